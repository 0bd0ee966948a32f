"""Scaled dot-product attention and multi-head attention (chapters 1 to 3).

Shapes follow the book's notation: row vectors, batch first. ``q`` is (..., L_q, d_k), ``k`` is
(..., L_k, d_k), ``v`` is (..., L_k, d_v); a mask is a bool tensor where True means "this query may
attend to this key", broadcastable to (..., L_q, L_k).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ._validation import require_broadcastable, require_rank, require_tensor, shape_str

__all__ = ["scaled_dot_product_attention", "MultiHeadAttention"]


def scaled_dot_product_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T / sqrt(d_k)) v, with an optional bool mask.

    Args:
        q: queries, shape (..., L_q, d_k).
        k: keys, shape (..., L_k, d_k).
        v: values, shape (..., L_k, d_v).
        mask: optional bool tensor broadcastable to (..., L_q, L_k); True = may attend.
            A query row with no allowed key gets all-zero weights and a zero output.
        dropout_p: probability of dropping an attention weight (applied after the softmax, with
            the survivors scaled by 1 / (1 - p)); 0 disables it.

    Returns:
        ``(output, weights)``: output of shape (..., L_q, d_v) and weights of shape
        (..., L_q, L_k), each weight row summing to 1 (or 0 for a fully masked row).

    Raises:
        ValueError: when the ranks, d_k, L_k or the mask's shape do not fit together.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        require_tensor(name, t)
    require_rank("q", q, "(..., L_q, d_k)", min_rank=2)
    require_rank("k", k, "(..., L_k, d_k)", min_rank=2)
    require_rank("v", v, "(..., L_k, d_v)", min_rank=2)
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"q and k must share the last dimension d_k: q is {shape_str(q)} (d_k={q.shape[-1]}),"
            f" k is {shape_str(k)} (d_k={k.shape[-1]})"
        )
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(
            f"k and v must have the same number of keys L_k: k is {shape_str(k)} "
            f"(L_k={k.shape[-2]}), v is {shape_str(v)} (L_k={v.shape[-2]})"
        )
    try:
        batch = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    except RuntimeError:
        raise ValueError(
            f"the leading (batch) dims of q {shape_str(q)}, k {shape_str(k)} and v {shape_str(v)}"
            " do not broadcast together"
        ) from None
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")

    d_k = q.shape[-1]
    scores = q @ k.transpose(-2, -1) / math.sqrt(d_k)  # (..., L_q, L_k)
    if mask is not None:
        require_tensor("mask", mask)
        if mask.dtype != torch.bool:
            raise ValueError(
                f"mask must be a bool tensor (True = may attend), got dtype {mask.dtype}; "
                "utils.masks converts PyTorch's other conventions"
            )
        target = (*batch, q.shape[-2], k.shape[-2])
        require_broadcastable("mask", mask.shape, target, "(..., L_q, L_k)")
        scores = scores.masked_fill(~mask, float("-inf"))
        # A row with no allowed key would be softmax of all -inf = NaN; give it zeros instead.
        has_key = mask.any(dim=-1, keepdim=True)
        scores = scores.masked_fill(~has_key, 0.0)
        weights = torch.softmax(scores, dim=-1) * mask
    else:
        weights = torch.softmax(scores, dim=-1)
    if dropout_p > 0.0:
        weights = F.dropout(weights, p=dropout_p, training=True)
    return weights @ v, weights


class MultiHeadAttention(nn.Module):
    """Multi-head attention, batch first, as in "Attention Is All You Need".

    ``h`` heads of width ``d_k = d_model / h`` attend in parallel; their outputs are concatenated
    and mixed by the output projection W_O.

    Args:
        d_model: width of the input and output vectors.
        num_heads: number of heads h; must divide ``d_model``.
        bias: whether the four projections have biases.
        dropout: dropout on the attention weights during training.

    Shapes:
        query (B, L_q, d_model), key and value (B, L_k, d_model) -> output (B, L_q, d_model).
        After a forward pass, ``attn_weights`` holds the weights (B, h, L_q, L_k).
    """

    def __init__(self, d_model: int, num_heads: int, bias: bool = True, dropout: float = 0.0):
        super().__init__()
        if d_model <= 0 or num_heads <= 0:
            raise ValueError(f"d_model and num_heads must be positive, got {d_model}, {num_heads}")
        if d_model % num_heads != 0:
            raise ValueError(
                f"d_model must be divisible by num_heads: d_model={d_model}, num_heads={num_heads}"
                f" leaves a remainder of {d_model % num_heads}"
            )
        self.d_model = d_model
        self.num_heads = num_heads
        self.d_k = d_model // num_heads
        self.dropout = dropout
        self.w_q = nn.Linear(d_model, d_model, bias=bias)
        self.w_k = nn.Linear(d_model, d_model, bias=bias)
        self.w_v = nn.Linear(d_model, d_model, bias=bias)
        self.w_o = nn.Linear(d_model, d_model, bias=bias)
        self.attn_weights: torch.Tensor | None = None

    def split_heads(self, x: torch.Tensor) -> torch.Tensor:
        """(B, L, d_model) -> (B, h, L, d_k)."""
        b, length, _ = x.shape
        return x.view(b, length, self.num_heads, self.d_k).transpose(1, 2)

    def merge_heads(self, x: torch.Tensor) -> torch.Tensor:
        """(B, h, L, d_k) -> (B, L, d_model)."""
        b, _, length, _ = x.shape
        return x.transpose(1, 2).reshape(b, length, self.d_model)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attend from ``query`` to ``key``/``value``.

        Args:
            query: (B, L_q, d_model).
            key: (B, L_k, d_model).
            value: (B, L_k, d_model).
            mask: optional bool mask, True = may attend, of shape (L_q, L_k), (B, L_q, L_k)
                (the same for every head) or anything that broadcasts to (B, h, L_q, L_k).

        Returns:
            (B, L_q, d_model).
        """
        for name, t in (("query", query), ("key", key), ("value", value)):
            require_tensor(name, t)
            require_rank(name, t, "(B, L, d_model)", rank=3)
            if t.shape[-1] != self.d_model:
                raise ValueError(
                    f"{name} must have shape (B, L, d_model={self.d_model}), got {shape_str(t)}"
                )
        if key.shape[:2] != value.shape[:2]:
            raise ValueError(
                f"key and value must have the same (B, L_k): key {shape_str(key)}, "
                f"value {shape_str(value)}"
            )
        if query.shape[0] != key.shape[0]:
            raise ValueError(
                f"query and key must have the same batch size B: query {shape_str(query)}, "
                f"key {shape_str(key)}"
            )
        if mask is not None:
            require_tensor("mask", mask)
            if mask.dim() == 3:  # (B, L_q, L_k): the same mask for every head
                mask = mask.unsqueeze(1)
            b, l_q, l_k = query.shape[0], query.shape[1], key.shape[1]
            require_broadcastable(
                "mask", mask.shape, (b, self.num_heads, l_q, l_k), "(B, h, L_q, L_k)"
            )
        q = self.split_heads(self.w_q(query))
        k = self.split_heads(self.w_k(key))
        v = self.split_heads(self.w_v(value))
        p = self.dropout if self.training else 0.0
        out, weights = scaled_dot_product_attention(q, k, v, mask, dropout_p=p)
        self.attn_weights = weights.detach()
        return self.w_o(self.merge_heads(out))

    @classmethod
    def from_torch(cls, module: nn.MultiheadAttention) -> "MultiHeadAttention":
        """A `MultiHeadAttention` holding a copy of ``module``'s parameters.

        The result gives the same output as ``module`` (with ``batch_first=True``, or with its
        inputs transposed) to about 1e-6 in float32.

        Raises:
            ValueError: for options this class does not have (separate key/value widths,
                ``add_bias_kv``, ``add_zero_attn``).
        """
        if not isinstance(module, nn.MultiheadAttention):
            raise ValueError(f"expected nn.MultiheadAttention, got {type(module).__name__}")
        if not module._qkv_same_embed_dim:
            raise ValueError("kdim/vdim different from embed_dim are not supported")
        if module.bias_k is not None or module.add_zero_attn:
            raise ValueError("add_bias_kv and add_zero_attn are not supported")
        d = module.embed_dim
        bias = module.in_proj_bias is not None
        new = cls(d, module.num_heads, bias=bias, dropout=module.dropout)
        new = new.to(dtype=module.in_proj_weight.dtype, device=module.in_proj_weight.device)
        with torch.no_grad():
            w_q, w_k, w_v = module.in_proj_weight.chunk(3, dim=0)
            new.w_q.weight.copy_(w_q)
            new.w_k.weight.copy_(w_k)
            new.w_v.weight.copy_(w_v)
            new.w_o.weight.copy_(module.out_proj.weight)
            if bias:
                b_q, b_k, b_v = module.in_proj_bias.chunk(3, dim=0)
                new.w_q.bias.copy_(b_q)
                new.w_k.bias.copy_(b_k)
                new.w_v.bias.copy_(b_v)
                new.w_o.bias.copy_(module.out_proj.bias)
        new.train(module.training)
        return new
