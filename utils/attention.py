"""Scaled dot-product attention and multi-head attention (chapters 1 to 3).

Shapes follow the book's notation: row vectors, batch first. ``q`` is (..., L_q, d_k), ``k`` is
(..., L_k, d_k), ``v`` is (..., L_k, d_v); a mask is a bool tensor where True means "this query may
attend to this key", broadcastable to (..., L_q, L_k).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ._validation import (
    InputTypeError,
    broadcast_shape,
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

__all__ = ["scaled_dot_product_attention", "fused_attention", "MultiHeadAttention",
           "GroupedQueryAttention", "KVCache", "keep_attention_weights"]


def _check_qkv_tensors(q: object, k: object, v: object, mask: object,
                       ) -> tuple[torch.Size, torch.Tensor | None]:
    """Check q, k, v and an optional bool mask: the rules of `scaled_dot_product_attention`,
    shared with `memory_efficient_attention` and `local_attention`.

    Returns the broadcast batch shape of q, k and v, and the mask, with a 1-dim mask (L_k,)
    given a query axis so that it reads as (1, L_k).
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
    batch = broadcast_shape(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    if batch is None:
        raise ValueError(
            f"the leading (batch) dims of q {shape_str(q)}, k {shape_str(k)} and v {shape_str(v)}"
            " do not broadcast together"
        )
    batch = torch.Size(batch)
    if not (q.dtype == k.dtype == v.dtype):
        raise InputTypeError(
            f"q, k and v must have the same dtype, got {q.dtype}, {k.dtype} and {v.dtype}"
        )
    require_floating("q", q)
    if mask is not None:
        require_tensor("mask", mask)
        require_bool_mask("mask", mask)
        target = (*batch, q.shape[-2], k.shape[-2])
        require_broadcastable("mask", mask.shape, target, "(..., L_q, L_k)")
        if mask.dim() == 1:
            mask = mask[None, :]
    require_same_device(q=q, k=k, v=v, mask=mask)
    return batch, mask


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
    _, mask = _check_qkv_tensors(q, k, v, mask)
    dropout_p = require_probability("dropout_p", dropout_p)

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


def fused_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """`scaled_dot_product_attention`'s output, computed by PyTorch's fused kernel.

    The same function as `scaled_dot_product_attention` (same shapes, checks, mask convention
    and degenerate cases), but it returns the output only: ``F.scaled_dot_product_attention``
    picks the fastest kernel for the device and never builds the weights as a tensor of their
    own. A query row with no allowed key gets a zero output and zero gradients, whatever the
    kernel does with such a row: its mask row is opened before the call and its output
    multiplied by zero after.

    Args:
        q: (..., L_q, d_k); k: (..., L_k, d_k); v: (..., L_k, d_v), one dtype and device.
        mask: optional bool mask broadcastable to (..., L_q, L_k), True = may attend.
        dropout_p: dropout on the weights, in [0, 1) (the kernel's own random numbers).

    Returns:
        (..., L_q, d_v).

    Raises:
        InputTypeError, ValueError: as `scaled_dot_product_attention`.
    """
    batch, mask = _check_qkv_tensors(q, k, v, mask)
    dropout_p = require_probability("dropout_p", dropout_p)
    q, k, v = (t.expand(*batch, *t.shape[-2:]) for t in (q, k, v))
    if q.numel() == 0 or k.shape[-2] == 0:
        return scaled_dot_product_attention(q, k, v, mask, dropout_p)[0]
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)
    has_key = mask.any(dim=-1, keepdim=True)  # (..., L_q, 1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask | ~has_key, dropout_p=dropout_p)
    return out * has_key


def keep_attention_weights(module: nn.Module, keep: bool = True) -> nn.Module:
    """Set ``keep_weights`` on every attention module inside ``module`` (itself included).

    With ``keep=True`` each `MultiHeadAttention` runs the from-scratch path and stores its
    weights in ``attn_weights`` at the next forward pass, for a plot; ``keep=False`` returns them
    to the fused kernel. Returns ``module``, so that ``keep_attention_weights(model)(x)`` works.

    Raises:
        InputTypeError: when ``module`` is not an ``nn.Module`` or ``keep`` is not a bool.
    """
    if not isinstance(module, nn.Module):
        raise InputTypeError(f"module must be an nn.Module, got {type(module).__name__}")
    require_bool("keep", keep)
    for sub in module.modules():
        if isinstance(sub, (MultiHeadAttention, GroupedQueryAttention)):
            sub.keep_weights = keep
    return module


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
    checked: list[torch.Tensor] = []
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not any(t is seen for seen in checked):  # self-attention passes one tensor thrice
            require_like_module(name, t, module)
            checked.append(t)


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

    By default each `append` concatenates: it copies everything stored into a new tensor, a
    copy that grows with the cache. A cache told its final length in advance (`reserve`)
    allocates that room once and writes each new position in place; ``k`` and ``v`` are then
    views of the filled part of that room.
    """

    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    max_len: int | None = None
    static: bool = False
    _room: int = field(default=0, init=False, repr=False, compare=False)
    _buffers: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, init=False,
                                                               repr=False, compare=False)

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
        """Bytes held by the keys and values: 2 * B * h_kv * L_past * d_k * bytes per number,
        with L_past replaced by the reserved length once a `reserve`d room is allocated."""
        held = self._buffers if self._in_room() else (self.k, self.v)
        return sum(t.numel() * t.element_size() for t in held if t is not None)

    def reserve(self, length: int) -> KVCache:
        """Allocate room for ``length`` positions at the next `append` to an empty cache.

        Appends then write into that room instead of concatenating, which saves a copy of the
        whole cache at every step. Only appends without autograd use the room (in-place writes
        would break the backward pass of earlier steps); growing past it falls back to
        concatenation. Returns the cache.

        Raises:
            InputTypeError, ValueError: for a ``length`` that is not a positive int.
            ValueError: for a ``length`` above ``max_len``.
        """
        length = require_int("length", length)
        if self.max_len is not None and length > self.max_len:
            raise ValueError(f"cannot reserve {length} positions in a cache of "
                             f"max_len={self.max_len}")
        self._room = length
        return self

    def _in_room(self) -> bool:
        """Whether ``k`` and ``v`` are still the filled part of the reserved buffers."""
        if self._buffers is None or self.k is None:
            return False
        bk, bv = self._buffers
        return (self.k.data_ptr() == bk.data_ptr() and self.v.data_ptr() == bv.data_ptr()
                and self.k.shape[:2] == bk.shape[:2] and self.k.stride() == bk.stride())

    def _write(self, k: torch.Tensor, v: torch.Tensor, start: int) -> bool:
        """Write k, v at ``start`` in the reserved buffers, allocating them for an empty cache;
        False (nothing written) when there is no room or autograd would need the old tensors."""
        end = start + k.shape[2]
        if end > self._room or k.requires_grad or v.requires_grad or (
                start and (self.k.requires_grad or self.v.requires_grad)):
            return False
        if start == 0:
            b, h, _, d = k.shape
            self._buffers = (k.new_empty(b, h, self._room, d), v.new_empty(b, h, self._room, d))
        elif not self._in_room():
            return False
        bk, bv = self._buffers
        bk[:, :, start:end] = k
        bv[:, :, start:end] = v
        self.k, self.v = bk[:, :, :end], bv[:, :, :end]
        return True

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
            if not (self._room and not self.static and self._write(k, v, 0)):
                self.k, self.v = k, v
            return self.k, self.v
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
        if not self._write(k, v, self.length):
            self.k = torch.cat([self.k, k], dim=2)
            self.v = torch.cat([self.v, v], dim=2)
            self._buffers = None
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
        keep_weights: whether to keep the attention weights of each forward pass (for plots).
            False (the default): the attention itself runs in PyTorch's fused kernel
            (``F.scaled_dot_product_attention``), which never returns the weights, and
            ``attn_weights`` is None. True: it runs in this book's `scaled_dot_product_attention`
            (the from-scratch path of chapter 3) and ``attn_weights`` holds the weights. Both give
            the same output and gradients to float rounding; dropout draws different random
            numbers in each. The attribute can be switched at any time (see
            `keep_attention_weights`).

    Shapes:
        query (B, L_q, d_model), key and value (B, L_k, d_model) -> output (B, L_q, d_model).
        After a forward pass with ``keep_weights``, ``attn_weights`` holds the weights
        (B, h, L_q, L_k); without, it is None.

    Raises:
        InputTypeError: for a count that is not an int (``2.5``, ``True``), a dropout that is not
            a number or a bias that is not a bool.
        ValueError: for a count below 1, ``num_heads`` not dividing ``d_model``, or a dropout
            outside [0, 1).
    """

    def __init__(self, d_model: int, num_heads: int, bias: bool = True, dropout: float = 0.0,
                 keep_weights: bool = False):
        super().__init__()
        _check_heads(d_model, num_heads, dropout, bias)
        require_bool("keep_weights", keep_weights)
        self.d_model = int(d_model)
        self.num_heads = int(num_heads)
        self.d_k = self.d_model // self.num_heads
        self.dropout = float(dropout)
        self.keep_weights = keep_weights
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
        if self.keep_weights:
            out, weights = scaled_dot_product_attention(q, k, v, mask, dropout_p=p)
            self.attn_weights = weights.detach()
        else:
            out = fused_attention(q, k, v, mask, dropout_p=p)
            self.attn_weights = None
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
        keep_weights: as in `MultiHeadAttention`: False runs PyTorch's fused kernel and keeps no
            weights, True runs the from-scratch path and keeps them in ``attn_weights``.

    Shapes:
        query (B, L_q, d_model), key and value (B, L_k, d_model) -> output (B, L_q, d_model).
        ``w_k`` and ``w_v`` map d_model -> num_kv_heads * d_k. After a forward pass with
        ``keep_weights``, ``attn_weights`` holds the weights (B, h, L_q, L_k); without, None.

    Raises:
        InputTypeError, ValueError: as `MultiHeadAttention`, and when ``num_kv_heads`` is not a
            positive int dividing ``num_heads``.
    """

    def __init__(self, d_model: int, num_heads: int, num_kv_heads: int, bias: bool = True,
                 dropout: float = 0.0, keep_weights: bool = False):
        super().__init__()
        _check_heads(d_model, num_heads, dropout, bias)
        require_bool("keep_weights", keep_weights)
        self.keep_weights = keep_weights
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
        if self.keep_weights:
            out, weights = scaled_dot_product_attention(q, k, v, mask, dropout_p=p)
            self.attn_weights = weights.detach()
        else:
            out = fused_attention(q, k, v, mask, dropout_p=p)
            self.attn_weights = None
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


# --- Making attention fast: blocks and the online softmax, and banded local attention ---------


def _block_sizes(block_size: object) -> tuple[int, int]:
    """Read ``block_size``: one positive int for both, or a pair (block_q, block_k)."""
    if isinstance(block_size, tuple | list):
        if len(block_size) != 2:
            raise ValueError(
                f"block_size must be an int or a pair (block_q, block_k), got {block_size!r}"
            )
        return (require_int("block_size[0]", block_size[0]),
                require_int("block_size[1]", block_size[1]))
    size = require_int("block_size", block_size)
    return size, size


def _tile(mask: torch.Tensor, rows: slice, cols: slice) -> torch.Tensor:
    """The (rows, cols) tile of a mask broadcastable to (..., L_q, L_k), a view.

    An axis of size 1 (broadcast over the queries or the keys) is kept whole.
    """
    r = rows if mask.shape[-2] != 1 else slice(None)
    c = cols if mask.shape[-1] != 1 else slice(None)
    return mask[..., r, c]


def memory_efficient_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    block_size: int | tuple[int, int] = 256,
) -> torch.Tensor:
    """softmax(q k^T / sqrt(d_k)) v computed block by block, never holding an L_q x L_k matrix.

    The queries are cut into blocks of ``block_q`` rows and the keys into blocks of ``block_k``
    rows. For each query block, the key blocks arrive one at a time and an *online softmax*
    keeps, for each query row, three running quantities: the largest score seen so far ``m``,
    the sum ``l`` of exp(score - m) over the keys seen so far, and the output accumulator
    ``acc`` = sum of exp(score - m) v. When a key block raises the maximum from ``m_old`` to
    ``m_new``, the old ``l`` and ``acc`` are rescaled by exp(m_old - m_new) so that every term is
    again relative to the same maximum. After the last block, ``acc / l`` is exactly the softmax
    average. Only ``block_q x block_k`` score tiles and (..., block_q, d_v) accumulators exist
    at any time, so the extra memory is O(block_q * block_k + L_q * d_v) instead of O(L_q L_k).

    Args:
        q: queries, shape (..., L_q, d_k), floating point.
        k: keys, shape (..., L_k, d_k), the dtype and device of ``q``.
        v: values, shape (..., L_k, d_v), the dtype and device of ``q``.
        mask: optional bool tensor broadcastable to (..., L_q, L_k), True = may attend. It is
            sliced tile by tile, never expanded to its full size.
        block_size: the tile size, one positive int for queries and keys, or a pair
            ``(block_q, block_k)``. It need not divide L_q or L_k (the last block is shorter).
            Larger tiles mean fewer Python steps and larger matrix products, smaller ones less
            memory; 256 was the fastest of 128, 256 and 512 on a CPU at L = 4096, d_k = 64.

    Returns:
        The output (..., L_q, d_v), equal to ``scaled_dot_product_attention(q, k, v, mask)[0]``
        up to rounding (about 1e-6 in float32). The weights are never formed, so none are
        returned.

    Degenerate inputs:
        A query row with no allowed key gets a zero output, never NaN, also when its first key
        blocks are all masked and an allowed key only comes later. L_k = 0 gives zeros; an empty
        batch or L_q = 0 gives an empty output.

    Gradients:
        Autograd differentiates through the loop; the running maximum is detached (the result
        does not depend on it, it only keeps exp from overflowing). Autograd keeps each tile for
        the backward pass, so training through this function stores O(L_q L_k) numbers in
        total; the memory saving is for inference (``torch.no_grad()``). FlashAttention saves
        the memory in training too by recomputing the tiles in a hand-written backward pass.

    Raises:
        InputTypeError, ValueError: as `scaled_dot_product_attention`, and for a ``block_size``
            that is not a positive int or a pair of them.
    """
    batch, mask = _check_qkv_tensors(q, k, v, mask)
    block_q, block_k = _block_sizes(block_size)
    l_q, l_k, d_v = q.shape[-2], k.shape[-2], v.shape[-1]
    scale = 1.0 / math.sqrt(q.shape[-1])
    q = q.expand(*batch, *q.shape[-2:])
    k = k.expand(*batch, *k.shape[-2:])
    v = v.expand(*batch, *v.shape[-2:])
    outputs = []
    for qs in range(0, l_q, block_q):
        rows = slice(qs, min(qs + block_q, l_q))
        q_blk = q[..., rows, :] * scale  # (..., bq, d_k)
        n = q_blk.shape[-2]
        m = torch.full((*batch, n, 1), float("-inf"), dtype=q.dtype, device=q.device)
        l_sum = torch.zeros((*batch, n, 1), dtype=q.dtype, device=q.device)
        acc = torch.zeros((*batch, n, d_v), dtype=q.dtype, device=q.device)
        for ks in range(0, l_k, block_k):
            cols = slice(ks, min(ks + block_k, l_k))
            s = q_blk @ k[..., cols, :].transpose(-2, -1)  # (..., bq, bk): one tile
            if mask is not None:
                s = s.masked_fill(~_tile(mask, rows, cols), float("-inf"))
            m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True).detach())
            # A row with no allowed key so far has m_new = -inf; subtract 0 instead, so that its
            # exp(-inf) terms are 0 rather than exp(-inf - (-inf)) = NaN.
            m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
            p = torch.exp(s - m_safe)  # (..., bq, bk), masked entries exactly 0
            alpha = torch.exp(m - m_safe)  # rescales what was summed against the old maximum
            l_sum = alpha * l_sum + p.sum(dim=-1, keepdim=True)
            acc = alpha * acc + p @ v[..., cols, :]
            m = m_new
        # l = 0 only for a row without any allowed key; its acc is 0 too, so its output is 0.
        outputs.append(acc / torch.where(l_sum > 0, l_sum, torch.ones_like(l_sum)))
    if not outputs:
        return torch.zeros((*batch, 0, d_v), dtype=q.dtype, device=q.device)
    return torch.cat(outputs, dim=-2)


def local_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: int,
    causal: bool = False,
) -> torch.Tensor:
    """Banded (local) self-attention in O(L * window) time and memory.

    Computes the same as ``scaled_dot_product_attention(q, k, v, local_mask(L, window,
    causal))[0]``: query i attends to key j when ``|i - j| <= window`` (``0 <= i - j <= window``
    with ``causal=True``), without forming the L x L scores.

    How: the queries are cut into blocks of ``b = max(window, 16)`` positions (fewer when L is
    smaller). Every query of a block needs keys only from ``window`` positions before the block
    to ``window`` positions after it (to the block's end when causal), so K and V are padded by
    ``window`` at the start (and the end) and `torch.Tensor.unfold` cuts them into overlapping
    slabs of ``b + 2 * window`` (causal: ``b + window``) keys, one slab per block, without
    copying. The scores are then (..., L / b, b, b + 2 * window): O(L * window) numbers, with
    no factor d_k (a slab of keys per *query*, (..., L, 2 * window + 1, d_k), would cost
    O(L * window * d_k)). Inside a slab, the keys outside the band and the padding are masked
    before a softmax that cannot give NaN.

    Args:
        q: queries, shape (..., L, d_k), floating point.
        k: keys, shape (..., L, d_k), the same L: this is self-attention over one sequence.
        v: values, shape (..., L, d_v).
        window: how far a query may look, an int >= 0 (0: each position sees only itself).
        causal: only look back (the query itself and ``window`` earlier positions).

    Returns:
        The output (..., L, d_v). Every query sees at least itself, so no row is empty.

    Raises:
        InputTypeError, ValueError: as `scaled_dot_product_attention`; also when q and k differ
            in length, or for a ``window`` that is not an int >= 0 or a ``causal`` that is not a
            bool.
    """
    batch, _ = _check_qkv_tensors(q, k, v, None)
    if q.shape[-2] != k.shape[-2]:
        raise ValueError(
            f"local attention needs as many queries as keys (one sequence): q is {shape_str(q)}"
            f" (L_q={q.shape[-2]}), k is {shape_str(k)} (L_k={k.shape[-2]})"
        )
    if isinstance(window, int) and not isinstance(window, bool) and window < 0:
        raise ValueError(f"window must be a non-negative int, got {window}")
    window = require_int("window", window, minimum=0)
    require_bool("causal", causal)
    length, d_v = q.shape[-2], v.shape[-1]
    if length == 0 or math.prod(batch) == 0:
        return torch.zeros((*batch, length, d_v), dtype=q.dtype, device=q.device)
    b = min(max(window, 16), length)
    n_blocks = -(-length // b)
    padded = n_blocks * b
    left, right = window, (0 if causal else window)
    span = b + left + right  # keys in one slab
    q = q.expand(*batch, *q.shape[-2:])
    k = k.expand(*batch, *k.shape[-2:])
    v = v.expand(*batch, *v.shape[-2:])
    # queries: pad to a whole number of blocks, then (..., n_blocks, b, d_k)
    q_blocks = F.pad(q, (0, 0, 0, padded - length)).unflatten(-2, (n_blocks, b))
    # keys and values: `left` positions before, `right` after, and the block padding.
    pad_kv = (0, 0, left, right + padded - length)
    k_slabs = F.pad(k, pad_kv).unfold(-2, span, b)  # (..., n_blocks, d_k, span): K^T per slab
    v_slabs = F.pad(v, pad_kv).unfold(-2, span, b).transpose(-2, -1)  # (..., n_blocks, span, d_v)
    scores = (q_blocks / math.sqrt(q.shape[-1])) @ k_slabs  # (..., n_blocks, b, span)

    # Query r of block n sits at n * b + r; key c of its slab at n * b + c - left.
    r = torch.arange(b, device=q.device)[:, None]
    c = torch.arange(span, device=q.device)[None, :]
    offset = r - c + left  # i - j, the same for every block
    band = (offset >= 0) & (offset <= window) if causal else offset.abs() <= window
    key_pos = torch.arange(n_blocks, device=q.device)[:, None] * b + c - left  # (n_blocks, span)
    in_range = (key_pos >= 0) & (key_pos < length)
    allowed = band[None, :, :] & in_range[:, None, :]  # (n_blocks, b, span)

    # In place: the matrix product's backward needs its inputs, not its output.
    scores.masked_fill_(~allowed, float("-inf"))
    # A padding query past L may have no key in range; fill its row with zeros instead of -inf
    # so that the softmax gives no NaN. Its output is cut off below. Every real query has at
    # least itself, so its weights outside the band are exactly exp(-inf) = 0.
    has_key = allowed.any(dim=-1, keepdim=True)
    scores.masked_fill_(~has_key, 0.0)
    weights = torch.softmax(scores, dim=-1)
    out = weights @ v_slabs  # (..., n_blocks, b, d_v)
    return out.flatten(-3, -2)[..., :length, :]


__all__ += ["memory_efficient_attention", "local_attention"]


def split_k_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    num_splits: int = 4,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention with the keys split into chunks, each chunk's softmax computed on its own and the
    partial results combined by their log-sum-exp: the idea of Flash-Decoding (split-K).

    The L_k keys and values are cut into ``num_splits`` chunks of ``ceil(L_k / num_splits)``
    positions (the last one shorter, padded and masked). For every chunk c and query row, on its
    own: the largest score ``m_c``, ``l_c = sum exp(s - m_c)``, the chunk's softmax average
    ``o_c = sum exp(s - m_c) v / l_c`` and its log-sum-exp ``lse_c = m_c + log l_c``. The chunks
    do not depend on each other (on a GPU they run in parallel, which is the point when there is
    a single query per sequence); the combination is

        lse = log sum_c exp(lse_c),    output = sum_c exp(lse_c - lse) o_c,

    the rescaling of the online softmax applied once, to whole chunks. All chunks are computed at
    once here, as one batched matrix product of shape (..., num_splits, L_q, chunk): the memory
    is that of plain attention; what the function shows is that the split changes nothing.

    Args:
        q: queries, shape (..., L_q, d_k), floating point; in decoding L_q = 1.
        k: keys, shape (..., L_k, d_k), the dtype and device of ``q`` (the cache).
        v: values, shape (..., L_k, d_v).
        num_splits: how many chunks to cut the keys into, an int >= 1; more chunks than keys
            leaves some chunks empty, which is allowed (they weigh 0).
        mask: optional bool tensor broadcastable to (..., L_q, L_k), True = may attend.

    Returns:
        The output (..., L_q, d_v), equal to ``scaled_dot_product_attention(q, k, v, mask)[0]``
        up to rounding. A query row with no allowed key gets zeros, never NaN.

    Raises:
        InputTypeError, ValueError: as `scaled_dot_product_attention`, and for a ``num_splits``
            that is not an int >= 1.
    """
    batch, mask = _check_qkv_tensors(q, k, v, mask)
    num_splits = require_int("num_splits", num_splits, minimum=1)
    l_q, l_k, d_v = q.shape[-2], k.shape[-2], v.shape[-1]
    if l_k == 0 or l_q == 0 or math.prod(batch) == 0:
        return torch.zeros((*batch, l_q, d_v), dtype=q.dtype, device=q.device)
    chunk = -(-l_k // num_splits)
    padded = chunk * num_splits
    allowed = torch.ones(l_q, l_k, dtype=torch.bool, device=q.device) if mask is None else mask
    allowed = F.pad(allowed, (0, padded - l_k), value=False)  # padding keys: never allowed
    # (..., num_splits, chunk, d) for keys and values; the mask (..., num_splits, L_q, chunk)
    k_chunks = F.pad(k, (0, 0, 0, padded - l_k)).unflatten(-2, (num_splits, chunk))
    v_chunks = F.pad(v, (0, 0, 0, padded - l_k)).unflatten(-2, (num_splits, chunk))
    m_chunks = allowed.unflatten(-1, (num_splits, chunk)).movedim(-2, -3)
    scores = (q.unsqueeze(-3) / math.sqrt(q.shape[-1])) @ k_chunks.transpose(-2, -1)
    scores = scores.masked_fill(~m_chunks, float("-inf"))  # (..., num_splits, L_q, chunk)

    # Each chunk on its own: its maximum, sum of exponentials and softmax average.
    m = scores.amax(dim=-1, keepdim=True).detach()
    m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # an all-masked chunk: 0
    p = torch.exp(scores - m_safe)  # masked entries exactly 0
    l_sum = p.sum(dim=-1, keepdim=True)
    o = (p @ v_chunks) / torch.where(l_sum > 0, l_sum, torch.ones_like(l_sum))
    lse = m_safe + torch.log(l_sum)  # -inf for a chunk with no allowed key

    # Combine: weights exp(lse_c - lse) over the chunks, summing to 1 (0 if no chunk has a key).
    lse_all = torch.logsumexp(lse, dim=-3, keepdim=True)
    lse_all = torch.where(torch.isinf(lse_all), torch.zeros_like(lse_all), lse_all)
    weights = torch.exp(lse - lse_all)  # (..., num_splits, L_q, 1)
    return (weights * o).sum(dim=-3)


__all__ += ["split_k_attention"]
