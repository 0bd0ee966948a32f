"""The key/value caches of incremental decoding (chapters 10 and 13).

Generating text one token at a time, a decoder would otherwise recompute the keys and values of
the whole prefix at every step. A `KVCache` keeps one attention layer's keys and values, a
`DecoderCache` one `KVCache` per layer of a stack (and a static one per cross-attention).

Shapes: keys and values are (B, h_kv, L, d_k), batch first and split into heads; h_kv is the
number of key/value heads (``num_heads`` for `utils.attention.MultiHeadAttention`,
``num_kv_heads`` for `utils.attention.GroupedQueryAttention`). What a cache costs in bytes, by
formula, is `utils.costs.kv_cache_bytes`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ._validation import (
    InputTypeError,
    require_bool,
    require_int,
    require_rank,
    require_same_device,
    require_tensor,
    shape_str,
)

__all__ = ["KVCache", "DecoderCache"]


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
        positions: (B or 1, L_past) the position of every stored key, kept only by an attention
            that needs them (a sliding window, `utils.family_parts.FamilyAttention`); else None.

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
    positions: torch.Tensor | None = field(default=None, repr=False, compare=False)
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
        held = self._buffers if _in_room(self) else (self.k, self.v)
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
        _check_new(self, k, v)
        if self.k is None:
            if not (self._room and not self.static and _write(self, k, v, 0)):
                self.k, self.v = k, v
            return self.k, self.v
        if not _write(self, k, v, self.length):
            self.k = torch.cat([self.k, k], dim=2)
            self.v = torch.cat([self.v, v], dim=2)
            self._buffers = None
        return self.k, self.v


def _check_new(cache: KVCache, k: object, v: object) -> None:
    """Raise unless the new keys and values ``k``, ``v`` (B, h_kv, L_new, d_k) fit ``cache``."""
    require_tensor("k", k)
    require_tensor("v", v)
    require_rank("k", k, "(B, h_kv, L_new, d_k)", rank=4)
    if v.shape != k.shape:
        raise ValueError(f"k and v must have the same shape (B, h_kv, L_new, d_k), got "
                         f"k {shape_str(k)} and v {shape_str(v)}")
    if cache.k is None:
        if cache.max_len is not None and k.shape[2] > cache.max_len:
            raise ValueError(f"the cache holds at most max_len={cache.max_len} positions, "
                             f"got {k.shape[2]} at once")
        return
    if cache.static:
        raise ValueError("this cache is static (cross-attention keys and values, computed "
                         "once); it cannot grow")
    b, h, _, d = cache.k.shape
    if (k.shape[0], k.shape[1], k.shape[3]) != (b, h, d):
        raise ValueError(f"the cache holds keys of shape (B={b}, h_kv={h}, L_past, d_k={d}), "
                         f"got new keys {shape_str(k)}: the batch size, heads and d_k of "
                         f"every step must be those of the first")
    if k.dtype != cache.k.dtype:
        raise InputTypeError(f"the cache holds {cache.k.dtype} keys, got {k.dtype}")
    require_same_device(cache=cache.k, k=k, v=v)
    if cache.max_len is not None and cache.length + k.shape[2] > cache.max_len:
        raise ValueError(f"the cache holds {cache.length} positions; {k.shape[2]} more would "
                         f"exceed max_len={cache.max_len}")


def _in_room(cache: KVCache) -> bool:
    """Whether ``k`` and ``v`` are still the filled part of the reserved buffers."""
    if cache._buffers is None or cache.k is None:
        return False
    bk, bv = cache._buffers
    return (cache.k.data_ptr() == bk.data_ptr() and cache.v.data_ptr() == bv.data_ptr()
            and cache.k.shape[:2] == bk.shape[:2] and cache.k.stride() == bk.stride())


def _write(cache: KVCache, k: torch.Tensor, v: torch.Tensor, start: int) -> bool:
    """Write k, v at ``start`` in the reserved buffers, allocating them for an empty cache;
    False (nothing written) when there is no room or autograd would need the old tensors."""
    end = start + k.shape[2]
    if end > cache._room or k.requires_grad or v.requires_grad or (
            start and (cache.k.requires_grad or cache.v.requires_grad)):
        return False
    if start == 0:
        b, h, _, d = k.shape
        cache._buffers = (k.new_empty(b, h, cache._room, d), v.new_empty(b, h, cache._room, d))
    elif not _in_room(cache):
        return False
    bk, bv = cache._buffers
    bk[:, :, start:end] = k
    bv[:, :, start:end] = v
    cache.k, cache.v = bk[:, :, :end], bv[:, :, :end]
    return True


@dataclass
class DecoderCache:
    """The key/value caches of a whole stack, for generating one token at a time.

    One `KVCache` per layer for the self-attention (``self_attn``) and, for an
    encoder-decoder's decoder, one static cache per layer for the cross-attention
    (``cross_attn``: the memory's keys and values, computed once). Make one with
    `DecoderCache.for_stack` (or a model's ``new_cache()``), pass it to every call of the
    stack, and feed it only the new positions.

    Attributes:
        self_attn: N caches, each k, v of shape (B, h_kv, L_past, d_k).
        cross_attn: N static caches (B, h_kv, L_s, d_k), or an empty list.
    """

    self_attn: list[KVCache] = field(default_factory=list)
    cross_attn: list[KVCache] = field(default_factory=list)

    @classmethod
    def for_stack(cls, num_layers: int, cross_attention: bool = False,
                  max_len: int | None = None) -> DecoderCache:
        """Empty caches for ``num_layers`` layers; each self-attention cache holds at most
        ``max_len`` positions (None: no limit)."""
        num_layers = require_int("num_layers", num_layers)
        require_bool("cross_attention", cross_attention)
        if max_len is not None:
            max_len = require_int("max_len", max_len)
        return cls([KVCache(max_len=max_len) for _ in range(num_layers)],
                   [KVCache(static=True) for _ in range(num_layers)] if cross_attention else [])

    @property
    def length(self) -> int:
        """L_past, the number of positions already processed (0 for a fresh cache)."""
        return self.self_attn[0].length if self.self_attn else 0

    @property
    def nbytes(self) -> int:
        """Bytes held by every key and value, self- and cross-attention."""
        return sum(c.nbytes for c in (*self.self_attn, *self.cross_attn))

    @property
    def self_attn_nbytes(self) -> int:
        """Bytes of the self-attention caches only: 2 * N * B * h_kv * L_past * d_k * bytes."""
        return sum(c.nbytes for c in self.self_attn)

    def memory_bytes(self) -> int:
        """The same as `nbytes`."""
        return self.nbytes

    def reserve(self, length: int) -> DecoderCache:
        """Reserve room for ``length`` positions in every self-attention cache (see
        `KVCache.reserve`): later steps write in place instead of copying the
        cache. Returns the cache."""
        for c in self.self_attn:
            c.reserve(length)
        return self

    def check(self, num_layers: int, cross_attention: bool, batch: int) -> None:
        """Raise a `ValueError` unless the cache fits a stack of ``num_layers`` layers (with
        cross-attention caches when ``cross_attention``) fed a batch of ``batch`` rows."""
        if len(self.self_attn) != num_layers:
            raise ValueError(f"the cache has {len(self.self_attn)} self-attention caches but the "
                             f"stack has {num_layers} layers")
        if cross_attention and len(self.cross_attn) != num_layers:
            raise ValueError(f"the cache has {len(self.cross_attn)} cross-attention caches but "
                             f"the decoder has {num_layers} layers")
        held = self.self_attn[0].batch_size
        if held is not None and held != batch:
            raise ValueError(f"the cache holds a batch of B={held} sequences, got an input of "
                             f"B={batch}: a cache serves the batch it was started with")


def require_kv_cache(cache: object) -> KVCache:
    """``cache`` itself if it is a `KVCache`, else an `InputTypeError`."""
    if not isinstance(cache, KVCache):
        raise InputTypeError(f"cache must be a utils.kv_cache.KVCache or None, got "
                             f"{type(cache).__name__}")
    return cache


def require_decoder_cache(cache: object) -> DecoderCache:
    """``cache`` itself if it is a `DecoderCache`, else an `InputTypeError`."""
    if not isinstance(cache, DecoderCache):
        raise InputTypeError(f"cache must be a DecoderCache or None, got {type(cache).__name__}")
    return cache
