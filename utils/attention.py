"""Scaled dot-product attention and multi-head attention (chapters 1 to 3).

Shapes follow the book's notation: row vectors, batch first. ``q`` is (..., L_q, d_k), ``k`` is
(..., L_k, d_k), ``v`` is (..., L_k, d_v); a mask is a bool tensor where True means "this query may
attend to this key", broadcastable to (..., L_q, L_k).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ._validation import (
    InputTypeError,
    require_bool,
    require_bool_mask,
    require_broadcastable,
    require_floating,
    require_int,
    require_like_module,
    require_probability,
    require_rank,
    require_real,
    require_same_device,
    require_tensor,
    shape_str,
)
from .masks import expand_mask

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
        q: queries, shape (..., L_q, d_k), floating point.
        k: keys, shape (..., L_k, d_k), the dtype and device of ``q``.
        v: values, shape (..., L_k, d_v), the dtype and device of ``q``.
        mask: optional bool tensor broadcastable to (..., L_q, L_k); True = may attend.
        dropout_p: probability of dropping an attention weight (applied after the softmax, with
            the survivors scaled by 1 / (1 - p)); a number in [0, 1), 0 disables it.

    Returns:
        ``(output, weights)``: output of shape (..., L_q, d_v) and weights of shape
        (..., L_q, L_k), each weight row summing to 1.

    Degenerate inputs:
        A query row with no allowed key (every key masked, or L_k = 0) gets all-zero weights and
        a zero output, never NaN, and its gradients are zero too. An empty batch or L_q = 0 gives
        empty outputs. NaN or infinite values in q, k or v are not checked and propagate.

    Raises:
        InputTypeError: (a TypeError and a ValueError) when an argument is not a tensor, q, k
            and v are not floating point or differ in dtype or device, the mask is not bool or
            not on their device, or ``dropout_p`` is not a number.
        ValueError: when the ranks, d_k (which must be at least 1), L_k, the batch dims or the
            mask's shape do not fit together, or ``dropout_p`` is outside [0, 1).
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
    if q.shape[-1] == 0:
        raise ValueError(f"d_k must be at least 1 (the scores are divided by sqrt(d_k)), got q "
                         f"{shape_str(q)} and k {shape_str(k)}")
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
        raise InputTypeError(
            f"q, k and v must have the same dtype, got {q.dtype}, {k.dtype} and {v.dtype}"
        )
    require_floating("q", q)
    dropout_p = require_probability("dropout_p", dropout_p)
    if mask is not None:
        require_tensor("mask", mask)
        require_bool_mask("mask", mask)
        target = (*batch, q.shape[-2], k.shape[-2])
        require_broadcastable("mask", mask.shape, target, "(..., L_q, L_k)")
    require_same_device(q=q, k=k, v=v, mask=mask)

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


def _check_qkv(module: nn.Module, query: object, key: object, value: object) -> None:
    """Validate the (B, L_q, d_model) query and (B, L_k, d_model) key and value of a module."""
    d_model = module.d_model
    for name, t in (("query", query), ("key", key), ("value", value)):
        require_tensor(name, t)
        require_rank(name, t, f"(B, L, d_model={d_model})", rank=3)
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
    for name, t in (("query", query), ("key", key), ("value", value)):
        require_like_module(name, t, module)


def _read_mask(mask: object, query: torch.Tensor, key: torch.Tensor,
               num_heads: int) -> torch.Tensor | None:
    """A multi-head mask read by `utils.masks.expand_mask`, checked, as (B, 1 or h, L_q, L_k)."""
    b, l_q, l_k = query.shape[0], query.shape[1], key.shape[1]
    full = expand_mask(mask, b, l_q, l_k)
    if full is None:
        return None
    if full.shape[1] not in (1, num_heads):
        raise ValueError(
            f"mask of shape {shape_str(mask)} has {full.shape[1]} heads but the attention has "
            f"h={num_heads}: a 4-dim mask must broadcast to (B, h, L_q, L_k) = "
            f"{shape_str((b, num_heads, l_q, l_k))}"
        )
    require_same_device(query=query, mask=full)
    return full


def _check_heads(d_model: object, num_heads: object, dropout: object, bias: object) -> None:
    """Raise unless d_model and num_heads are positive ints, num_heads divides d_model,
    0 <= dropout < 1 and bias is a bool."""
    require_int("d_model", d_model)
    require_int("num_heads", num_heads)
    if d_model % num_heads != 0:
        raise ValueError(
            f"d_model must be divisible by num_heads: d_model={d_model}, num_heads={num_heads}"
            f" leaves a remainder of {d_model % num_heads}"
        )
    dropout = require_real("dropout", dropout)
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {dropout}")
    require_bool("bias", bias)


@dataclass
class KVCache:
    """The keys and values one attention layer has computed for past positions.

    Generating text one token at a time, a decoder would otherwise recompute the keys and values of
    the whole prefix at every step. With a cache, each step projects only the new positions and
    appends them here; the queries of the new positions attend to everything stored.

    Attributes:
        k, v: (B, h_kv, L_past, d_k) tensors, or None while the cache is empty. ``h_kv`` is the
            number of key/value heads: ``num_heads`` for `MultiHeadAttention`, ``num_kv_heads``
            for `GroupedQueryAttention` (a smaller cache).
        max_len: the most positions the cache may hold (None: no limit); appending beyond it
            raises a `ValueError`.
        static: a cache of keys and values computed once and then only read: the encoder's
            memory seen by cross-attention. The first call fills it, later calls reuse it.

    The tensors live where the first appended keys live (the inputs' device and dtype).
    """

    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    max_len: int | None = None
    static: bool = False

    @property
    def length(self) -> int:
        """L_past, the number of positions stored (0 when empty)."""
        return 0 if self.k is None else self.k.shape[2]

    @property
    def batch_size(self) -> int | None:
        """B of the stored tensors, None while empty."""
        return None if self.k is None else self.k.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes held by the keys and values: 2 * B * h_kv * L_past * d_k * bytes per number."""
        return sum(t.numel() * t.element_size() for t in (self.k, self.v) if t is not None)

    def memory_bytes(self) -> int:
        """The same as `nbytes`."""
        return self.nbytes

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the keys and values of new positions; return all of them, past and new.

        Args:
            k, v: (B, h_kv, L_new, d_k), with the B, h_kv, d_k, dtype and device of what is
                stored already.

        Returns:
            ``(k, v)``, each (B, h_kv, L_past + L_new, d_k).

        Raises:
            ValueError: for shapes that do not fit the stored ones (another batch size, say),
                for growing past ``max_len``, or for appending to a filled ``static`` cache.
        """
        require_tensor("k", k)
        require_tensor("v", v)
        require_rank("k", k, "(B, h_kv, L_new, d_k)", rank=4)
        if v.shape != k.shape:
            raise ValueError(f"k and v must have the same shape (B, h_kv, L_new, d_k), got "
                             f"k {shape_str(k)} and v {shape_str(v)}")
        if self.k is None:
            if self.max_len is not None and k.shape[2] > self.max_len:
                raise ValueError(f"the cache holds at most max_len={self.max_len} positions, "
                                 f"got {k.shape[2]} at once")
            self.k, self.v = k, v
            return k, v
        if self.static:
            raise ValueError("this cache is static (cross-attention keys and values, computed "
                             "once); it cannot grow")
        b, h, _, d = self.k.shape
        if (k.shape[0], k.shape[1], k.shape[3]) != (b, h, d):
            raise ValueError(f"the cache holds keys of shape (B={b}, h_kv={h}, L_past, d_k={d}), "
                             f"got new keys {shape_str(k)}: the batch size, heads and d_k of "
                             f"every step must be those of the first")
        if k.dtype != self.k.dtype:
            raise InputTypeError(f"the cache holds {self.k.dtype} keys, got {k.dtype}")
        require_same_device(cache=self.k, k=k, v=v)
        if self.max_len is not None and self.length + k.shape[2] > self.max_len:
            raise ValueError(f"the cache holds {self.length} positions; {k.shape[2]} more would "
                             f"exceed max_len={self.max_len}")
        self.k = torch.cat([self.k, k], dim=2)
        self.v = torch.cat([self.v, v], dim=2)
        return self.k, self.v


def _cached_kv(module: nn.Module, key: torch.Tensor, value: torch.Tensor, heads: int,
               cache: KVCache | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Project ``key``/``value`` into (B, heads, L, d_k), through ``cache`` when there is one:
    a filled static cache is read without projecting anything; any other is appended to."""
    if cache is not None and not isinstance(cache, KVCache):
        raise InputTypeError(f"cache must be a KVCache or None, got {type(cache).__name__}")
    if cache is not None and cache.static and cache.k is not None:
        if cache.k.shape[0] != key.shape[0] or cache.k.shape[2] != key.shape[1]:
            raise ValueError(f"the static cache holds keys {shape_str(cache.k)} for a memory of "
                             f"(B={cache.k.shape[0]}, L_s={cache.k.shape[2]}), got key "
                             f"{shape_str(key)}")
        return cache.k, cache.v
    b, length, _ = key.shape
    k = module.w_k(key).view(b, length, heads, module.d_k).transpose(1, 2)
    v = module.w_v(value).view(b, length, heads, module.d_k).transpose(1, 2)
    return (k, v) if cache is None else cache.append(k, v)


def _read_cached_mask(mask: object, query: torch.Tensor, l_k: int,
                      num_heads: int) -> torch.Tensor | None:
    """`_read_mask` for keys of length ``l_k`` (the cached ones included)."""
    full = expand_mask(mask, query.shape[0], query.shape[1], l_k)
    if full is None:
        return None
    if full.shape[1] not in (1, num_heads):
        raise ValueError(f"mask of shape {shape_str(mask)} has {full.shape[1]} heads but the "
                         f"attention has h={num_heads}")
    require_same_device(query=query, mask=full)
    return full


class MultiHeadAttention(nn.Module):
    """Multi-head attention, batch first, as in "Attention Is All You Need".

    ``h`` heads of width ``d_k = d_model / h`` attend in parallel; their outputs are concatenated
    and mixed by the output projection W_O.

    Args:
        d_model: width of the input and output vectors, a positive int.
        num_heads: number of heads h, a positive int that divides ``d_model``.
        bias: whether the four projections have biases.
        dropout: dropout on the attention weights during training, in [0, 1).

    Shapes:
        query (B, L_q, d_model), key and value (B, L_k, d_model) -> output (B, L_q, d_model).
        After a forward pass, ``attn_weights`` holds the weights (B, h, L_q, L_k).

    Raises:
        InputTypeError: for a count that is not an int (``2.5``, ``True``), a dropout that is not
            a number or a bias that is not a bool.
        ValueError: for a count below 1, ``num_heads`` not dividing ``d_model``, or a dropout
            outside [0, 1).
    """

    def __init__(self, d_model: int, num_heads: int, bias: bool = True, dropout: float = 0.0):
        super().__init__()
        _check_heads(d_model, num_heads, dropout, bias)
        self.d_model = int(d_model)
        self.num_heads = int(num_heads)
        self.d_k = self.d_model // self.num_heads
        self.dropout = float(dropout)
        self.w_q = nn.Linear(self.d_model, self.d_model, bias=bias)
        self.w_k = nn.Linear(self.d_model, self.d_model, bias=bias)
        self.w_v = nn.Linear(self.d_model, self.d_model, bias=bias)
        self.w_o = nn.Linear(self.d_model, self.d_model, bias=bias)
        self.attn_weights: torch.Tensor | None = None

    def split_heads(self, x: torch.Tensor) -> torch.Tensor:
        """(B, L, d_model) -> (B, h, L, d_k)."""
        require_tensor("x", x)
        require_rank("x", x, f"(B, L, d_model={self.d_model})", rank=3)
        if x.shape[-1] != self.d_model:
            raise ValueError(
                f"x must have shape (B, L, d_model={self.d_model}), got {shape_str(x)}"
            )
        b, length, _ = x.shape
        return x.view(b, length, self.num_heads, self.d_k).transpose(1, 2)

    def merge_heads(self, x: torch.Tensor) -> torch.Tensor:
        """(B, h, L, d_k) -> (B, L, d_model)."""
        require_tensor("x", x)
        expected = f"(B, h={self.num_heads}, L, d_k={self.d_k})"
        require_rank("x", x, expected, rank=4)
        if x.shape[1] != self.num_heads or x.shape[3] != self.d_k:
            raise ValueError(f"x must have shape {expected}, got {shape_str(x)}")
        b, _, length, _ = x.shape
        return x.transpose(1, 2).reshape(b, length, self.d_model)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """Attend from ``query`` to ``key``/``value``.

        Args:
            query: (B, L_q, d_model), with the dtype and device of the module's parameters.
            key: (B, L_k, d_model), likewise.
            value: (B, L_k, d_model), likewise.
            mask: optional bool mask, True = may attend, read by the library's one rule
                (`utils.masks.expand_mask`):

                * 2 dims (B, L_k): a key padding mask, the same for every query and head;
                * 2 dims (L_q, L_k): one mask shared by the whole batch (a causal mask);
                * a 2-dim mask that fits both (B == L_q > 1) is ambiguous and raises: write
                  ``pad[:, None, :]`` for padding or ``mask[None]`` for a shared mask;
                * 3 dims: broadcastable to (B, L_q, L_k), the same for every head;
                * 4 dims: broadcastable to (B, h, L_q, L_k).

                With a cache, L_k counts the cached positions too (L_past + L_k).
            cache: optional `KVCache` for incremental decoding. The keys and values of ``key`` and
                ``value`` (the new positions only) are appended to it and the queries attend to
                all the stored ones; a filled ``static`` cache is used as it is (``key`` and
                ``value`` are then only checked).

        Returns:
            (B, L_q, d_model). A query with no allowed key (every key masked, or L_k = 0) gets
            zero attention weights, so its output is W_O's bias (zero without biases), never NaN.
            An empty batch or L_q = 0 gives an empty output.

        Raises:
            InputTypeError: for a non-tensor, a dtype or device other than the parameters', or a
                mask that is not bool or not on the inputs' device.
            ValueError: for shapes that do not fit, or a mask that is ambiguous or does not fit.
        """
        _check_qkv(self, query, key, value)
        if cache is None:
            mask = _read_mask(mask, query, key, self.num_heads)
            k = self.split_heads(self.w_k(key))
            v = self.split_heads(self.w_v(value))
        else:
            k, v = _cached_kv(self, key, value, self.num_heads, cache)
            mask = _read_cached_mask(mask, query, k.shape[2], self.num_heads)
        q = self.split_heads(self.w_q(query))
        p = self.dropout if self.training else 0.0
        out, weights = scaled_dot_product_attention(q, k, v, mask, dropout_p=p)
        self.attn_weights = weights.detach()
        return self.w_o(self.merge_heads(out))

    @classmethod
    def from_torch(cls, module: nn.MultiheadAttention) -> MultiHeadAttention:
        """A `MultiHeadAttention` holding an exact copy of ``module``'s parameters.

        The result gives the same output as ``module`` to about 1e-6 in float32, on the same
        inputs batch first: with ``batch_first=False`` only the parameters are copied, and the
        copy still expects (B, L, d_model). It has the module's dtype, device, dropout and
        train/eval mode. A module whose input projections have biases and whose output
        projection has none, or the reverse (possible by editing ``out_proj.bias``), is copied
        as it is: ``w_o`` then has a bias exactly when ``out_proj`` has one.

        Raises:
            InputTypeError: when ``module`` is not an ``nn.MultiheadAttention``.
            ValueError: for what this class cannot compute: key and value widths (``kdim``,
                ``vdim``) other than ``embed_dim``, ``add_bias_kv`` and ``add_zero_attn``.
        """
        if not isinstance(module, nn.MultiheadAttention):
            raise InputTypeError(
                f"module must be an nn.MultiheadAttention, got {type(module).__name__}"
            )
        if not module._qkv_same_embed_dim:
            raise ValueError(
                f"cannot copy an nn.MultiheadAttention with kdim={module.kdim} and "
                f"vdim={module.vdim} different from embed_dim={module.embed_dim}: "
                "MultiHeadAttention takes keys and values of width d_model"
            )
        if module.bias_k is not None or module.add_zero_attn:
            raise ValueError(
                "cannot copy an nn.MultiheadAttention with add_bias_kv=True or "
                "add_zero_attn=True: both append a key MultiHeadAttention does not have"
            )
        weight = module.in_proj_weight
        in_bias = module.in_proj_bias is not None
        new = cls(module.embed_dim, module.num_heads, bias=in_bias, dropout=module.dropout)
        _match_bias(new, module.out_proj)
        new = new.to(dtype=weight.dtype, device=weight.device)
        with torch.no_grad():
            for i, dst in enumerate((new.w_q, new.w_k, new.w_v)):
                dst.weight.copy_(weight.chunk(3, dim=0)[i])
                if in_bias:
                    dst.bias.copy_(module.in_proj_bias.chunk(3)[i])
            new.w_o.load_state_dict(module.out_proj.state_dict())
        new.train(module.training)
        return new


def _match_bias(new: nn.Module, out_proj: nn.Linear) -> None:
    """Give ``new.w_o`` a bias exactly when ``out_proj`` has one.

    Only a module whose output projection differs from its input projections needs a new
    ``w_o``; the usual case draws no extra random numbers, so seeded results stay the same.
    """
    has_bias = out_proj.bias is not None
    if (new.w_o.bias is not None) != has_bias:
        new.w_o = nn.Linear(out_proj.in_features, out_proj.out_features, bias=has_bias)


class GroupedQueryAttention(nn.Module):
    """Grouped-query attention: groups of query heads share one key/value head.

    ``num_heads`` query heads of width ``d_k = d_model / num_heads`` attend with only
    ``num_kv_heads`` key/value heads: query head i reads key/value head ``i // (num_heads /
    num_kv_heads)``. ``num_kv_heads == num_heads`` is ordinary multi-head attention,
    ``num_kv_heads == 1`` is multi-query attention. Fewer key/value heads mean smaller key and value
    projections and, above all, a smaller key/value cache when generating text.

    Args:
        d_model: width of the input and output vectors, a positive int.
        num_heads: number of query heads h, a positive int that divides ``d_model``.
        num_kv_heads: number of key/value heads, a positive int that divides ``num_heads``.
        bias: whether the four projections have biases.
        dropout: dropout on the attention weights during training, in [0, 1).

    Shapes:
        query (B, L_q, d_model), key and value (B, L_k, d_model) -> output (B, L_q, d_model).
        ``w_k`` and ``w_v`` map d_model -> num_kv_heads * d_k. After a forward pass,
        ``attn_weights`` holds the weights (B, h, L_q, L_k).

    Raises:
        InputTypeError, ValueError: as `MultiHeadAttention`, and when ``num_kv_heads`` is not a
            positive int dividing ``num_heads``.
    """

    def __init__(self, d_model: int, num_heads: int, num_kv_heads: int, bias: bool = True,
                 dropout: float = 0.0):
        super().__init__()
        _check_heads(d_model, num_heads, dropout, bias)
        require_int("num_kv_heads", num_kv_heads)
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_heads must be divisible by num_kv_heads: num_heads={num_heads}, "
                f"num_kv_heads={num_kv_heads} leaves a remainder of {num_heads % num_kv_heads}"
            )
        self.d_model = int(d_model)
        self.num_heads = int(num_heads)
        self.num_kv_heads = int(num_kv_heads)
        self.group_size = self.num_heads // self.num_kv_heads
        self.d_k = self.d_model // self.num_heads
        self.dropout = float(dropout)
        kv_width = self.num_kv_heads * self.d_k
        self.w_q = nn.Linear(self.d_model, self.d_model, bias=bias)
        self.w_k = nn.Linear(self.d_model, kv_width, bias=bias)
        self.w_v = nn.Linear(self.d_model, kv_width, bias=bias)
        self.w_o = nn.Linear(self.d_model, self.d_model, bias=bias)
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
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """Attend from ``query`` to ``key``/``value``.

        The arguments, the mask rule (a (B, L_k) padding mask, an (L_q, L_k) shared mask, the
        ambiguous B == L_q case raising, 3- and 4-dim masks), the cache (which here stores only
        the ``num_kv_heads`` key/value heads: a smaller cache), the degenerate cases and the errors
        are those of `MultiHeadAttention.forward`. Returns (B, L_q, d_model).
        """
        _check_qkv(self, query, key, value)
        if cache is None:
            mask = _read_mask(mask, query, key, self.num_heads)
            k = self._split(self.w_k(key), self.num_kv_heads)  # (B, h_kv, L_k, d_k)
            v = self._split(self.w_v(value), self.num_kv_heads)
        else:  # the cache stores the h_kv heads, before they are repeated
            k, v = _cached_kv(self, key, value, self.num_kv_heads, cache)
            mask = _read_cached_mask(mask, query, k.shape[2], self.num_heads)
        q = self._split(self.w_q(query), self.num_heads)  # (B, h, L_q, d_k)
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
        (the default) nothing is averaged and the result computes exactly what ``mha`` does. Each
        projection has a bias exactly when ``mha``'s has; dtype, device, dropout and train/eval
        mode are ``mha``'s.

        Raises:
            InputTypeError: when ``mha`` is not a `MultiHeadAttention` or ``num_kv_heads`` is
                not an int.
            ValueError: when ``num_kv_heads`` is below 1 or does not divide the number of heads.
        """
        if not isinstance(mha, MultiHeadAttention):
            raise InputTypeError(f"mha must be a MultiHeadAttention, got {type(mha).__name__}")
        h = mha.num_heads
        num_kv_heads = h if num_kv_heads is None else num_kv_heads
        bias = mha.w_q.bias is not None
        new = cls(mha.d_model, h, num_kv_heads, bias=bias, dropout=mha.dropout)
        _match_bias(new, mha.w_o)
        new = new.to(dtype=mha.w_q.weight.dtype, device=mha.w_q.weight.device)
        g, d_k = new.group_size, mha.d_k

        def pool(t: torch.Tensor) -> torch.Tensor:
            # rows of a projection are (head, d_k) pairs; average the heads of each group
            return t.reshape(new.num_kv_heads, g, d_k, *t.shape[1:]).mean(dim=1).reshape(
                new.num_kv_heads * d_k, *t.shape[1:]
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
