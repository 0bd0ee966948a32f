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

__all__ = ["scaled_dot_product_attention", "MultiHeadAttention", "GroupedQueryAttention"]


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
        ValueError: when the ranks, d_k, L_k, the batch dims or the mask's shape do not fit
            together, when q, k and v differ in dtype, or when the mask is not bool.
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
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(
            f"q, k and v must have the same dtype, got {q.dtype}, {k.dtype} and {v.dtype}"
        )
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if mask is not None:
        require_tensor("mask", mask)
        if mask.dtype != torch.bool:
            raise ValueError(
                f"mask must be a bool tensor (True = may attend), got dtype {mask.dtype}; "
                "utils.masks converts PyTorch's other conventions"
            )
        target = (*batch, q.shape[-2], k.shape[-2])
        require_broadcastable("mask", mask.shape, target, "(..., L_q, L_k)")

    d_k = q.shape[-1]
    scores = q @ k.transpose(-2, -1) / math.sqrt(d_k)  # (..., L_q, L_k)
    if mask is not None:
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


def _check_qkv(query: object, key: object, value: object, d_model: int) -> None:
    """Validate the (B, L_q, d_model) query and (B, L_k, d_model) key and value of a module."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        require_tensor(name, t)
        require_rank(name, t, "(B, L, d_model)", rank=3)
        if t.shape[-1] != d_model:
            raise ValueError(
                f"{name} must have shape (B, L, d_model={d_model}), got {shape_str(t)}"
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


def _check_mask(mask: torch.Tensor, b: int, h: int, l_q: int, l_k: int) -> torch.Tensor:
    """Validate a multi-head mask and return it ready to broadcast to (B, h, L_q, L_k)."""
    require_tensor("mask", mask)
    if mask.dtype != torch.bool:
        raise ValueError(
            f"mask must be a bool tensor (True = may attend), got dtype {mask.dtype} with shape "
            f"{shape_str(mask)}; utils.masks converts PyTorch's other conventions"
        )
    if mask.dim() not in (2, 3, 4):
        raise ValueError(
            f"mask must have shape (L_q, L_k), (B, L_q, L_k) or (B, h, L_q, L_k) = "
            f"{shape_str((b, h, l_q, l_k))}, got {shape_str(mask)}"
        )
    full = mask.unsqueeze(1) if mask.dim() == 3 else mask  # (B, L_q, L_k): same for every head
    try:
        ok = tuple(torch.broadcast_shapes(full.shape, (b, h, l_q, l_k))) == (b, h, l_q, l_k)
    except RuntimeError:
        ok = False
    if not ok:
        layout = {2: "(L_q, L_k)", 3: "(B, L_q, L_k)", 4: "(B, h, L_q, L_k)"}[mask.dim()]
        raise ValueError(
            f"mask of shape {shape_str(mask)}, read as {layout}, does not broadcast to "
            f"(B, h, L_q, L_k) = {shape_str((b, h, l_q, l_k))}; a (B, L_k) padding mask must "
            "first become (B, 1, 1, L_k) (utils.masks.padding_to_attention_mask)"
        )
    return full


def _check_heads(d_model: int, num_heads: int, dropout: float) -> None:
    """Raise `ValueError` unless num_heads divides d_model and 0 <= dropout < 1."""
    if d_model % num_heads != 0:
        raise ValueError(
            f"d_model must be divisible by num_heads: d_model={d_model}, num_heads={num_heads}"
            f" leaves a remainder of {d_model % num_heads}"
        )
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {dropout}")


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
        _check_heads(d_model, num_heads, dropout)
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
        _check_qkv(query, key, value, self.d_model)
        if mask is not None:
            mask = _check_mask(mask, query.shape[0], self.num_heads, query.shape[1], key.shape[1])
        q = self.split_heads(self.w_q(query))
        k = self.split_heads(self.w_k(key))
        v = self.split_heads(self.w_v(value))
        p = self.dropout if self.training else 0.0
        out, weights = scaled_dot_product_attention(q, k, v, mask, dropout_p=p)
        self.attn_weights = weights.detach()
        return self.w_o(self.merge_heads(out))

    @classmethod
    def from_torch(cls, module: nn.MultiheadAttention) -> MultiHeadAttention:
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


class GroupedQueryAttention(nn.Module):
    """Grouped-query attention: groups of query heads share one key/value head.

    ``num_heads`` query heads of width ``d_k = d_model / num_heads`` attend with only
    ``num_kv_heads`` key/value heads: query head i reads key/value head ``i // (num_heads /
    num_kv_heads)``. ``num_kv_heads == num_heads`` is ordinary multi-head attention,
    ``num_kv_heads == 1`` is multi-query attention. Fewer key/value heads mean smaller key and value
    projections and, above all, a smaller key/value cache when generating text.

    Args:
        d_model: width of the input and output vectors.
        num_heads: number of query heads h; must divide ``d_model``.
        num_kv_heads: number of key/value heads; must divide ``num_heads``.
        bias: whether the four projections have biases.
        dropout: dropout on the attention weights during training.

    Shapes:
        query (B, L_q, d_model), key and value (B, L_k, d_model) -> output (B, L_q, d_model).
        ``w_k`` and ``w_v`` map d_model -> num_kv_heads * d_k. After a forward pass,
        ``attn_weights`` holds the weights (B, h, L_q, L_k).
    """

    def __init__(self, d_model: int, num_heads: int, num_kv_heads: int, bias: bool = True,
                 dropout: float = 0.0):
        super().__init__()
        for name, value in (("d_model", d_model), ("num_heads", num_heads),
                            ("num_kv_heads", num_kv_heads)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        _check_heads(d_model, num_heads, dropout)
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_heads must be divisible by num_kv_heads: num_heads={num_heads}, "
                f"num_kv_heads={num_kv_heads} leaves a remainder of {num_heads % num_kv_heads}"
            )
        self.d_model = d_model
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.group_size = num_heads // num_kv_heads
        self.d_k = d_model // num_heads
        self.dropout = dropout
        kv_width = num_kv_heads * self.d_k
        self.w_q = nn.Linear(d_model, d_model, bias=bias)
        self.w_k = nn.Linear(d_model, kv_width, bias=bias)
        self.w_v = nn.Linear(d_model, kv_width, bias=bias)
        self.w_o = nn.Linear(d_model, d_model, bias=bias)
        self.attn_weights: torch.Tensor | None = None

    def kv_cache_per_token(self) -> int:
        """How many numbers one token adds to the key/value cache of this layer: 2 * h_kv * d_k."""
        return 2 * self.num_kv_heads * self.d_k

    def _split(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        b, length, _ = x.shape
        return x.view(b, length, heads, self.d_k).transpose(1, 2)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attend from ``query`` to ``key``/``value``; the arguments are as in
        `MultiHeadAttention.forward`. Returns (B, L_q, d_model)."""
        _check_qkv(query, key, value, self.d_model)
        if mask is not None:
            mask = _check_mask(mask, query.shape[0], self.num_heads, query.shape[1], key.shape[1])
        q = self._split(self.w_q(query), self.num_heads)  # (B, h, L_q, d_k)
        k = self._split(self.w_k(key), self.num_kv_heads)  # (B, h_kv, L_k, d_k)
        v = self._split(self.w_v(value), self.num_kv_heads)
        # Each key/value head serves group_size consecutive query heads.
        k = k.repeat_interleave(self.group_size, dim=1)  # (B, h, L_k, d_k)
        v = v.repeat_interleave(self.group_size, dim=1)
        p = self.dropout if self.training else 0.0
        out, weights = scaled_dot_product_attention(q, k, v, mask, dropout_p=p)
        self.attn_weights = weights.detach()
        b, _, l_q, _ = out.shape
        return self.w_o(out.transpose(1, 2).reshape(b, l_q, self.d_model))

    @classmethod
    def from_multi_head(
        cls, mha: MultiHeadAttention, num_kv_heads: int | None = None
    ) -> GroupedQueryAttention:
        """A `GroupedQueryAttention` made from a `MultiHeadAttention`'s parameters.

        The query and output projections are copied; the key and value projections of the heads in
        each group are averaged into one head. With ``num_kv_heads`` equal to the number of heads
        (the default) nothing is averaged and the result computes exactly what ``mha`` does.
        """
        if not isinstance(mha, MultiHeadAttention):
            raise ValueError(f"expected a MultiHeadAttention, got {type(mha).__name__}")
        h = mha.num_heads
        num_kv_heads = h if num_kv_heads is None else num_kv_heads
        bias = mha.w_q.bias is not None
        new = cls(mha.d_model, h, num_kv_heads, bias=bias, dropout=mha.dropout)
        new = new.to(dtype=mha.w_q.weight.dtype, device=mha.w_q.weight.device)
        g, d_k = new.group_size, mha.d_k

        def pool(t: torch.Tensor) -> torch.Tensor:
            # rows of a projection are (head, d_k) pairs; average the heads of each group
            return t.reshape(num_kv_heads, g, d_k, *t.shape[1:]).mean(dim=1).reshape(
                num_kv_heads * d_k, *t.shape[1:]
            )

        with torch.no_grad():
            new.w_q.load_state_dict(mha.w_q.state_dict())
            new.w_o.load_state_dict(mha.w_o.state_dict())
            new.w_k.weight.copy_(pool(mha.w_k.weight))
            new.w_v.weight.copy_(pool(mha.w_v.weight))
            if bias:
                new.w_k.bias.copy_(pool(mha.w_k.bias))
                new.w_v.bias.copy_(pool(mha.w_v.bias))
        new.train(mha.training)
        return new
