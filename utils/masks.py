"""Attention masks in the book's convention, and converters to PyTorch's (chapter 4).

A mask is a bool tensor, True = "this query may attend to this key", the polarity of the bool
``attn_mask`` of `torch.nn.functional.scaled_dot_product_attention`. It broadcasts to
(B, h, L_q, L_k). `expand_mask` holds the one rule by which every attention module of the book
reads a mask argument: a (B, L_k) padding mask, an (L_q, L_k) shared mask, or a 3- or 4-dim
mask, with the 2-dim case that fits both readings refused as ambiguous.

PyTorch uses other conventions, and this module converts to and from each of them:

- ``nn.MultiheadAttention(key_padding_mask=...)``: bool (B, L_k), True = *ignore* this key
  (`to_key_padding_mask`, `from_key_padding_mask`).
- ``nn.MultiheadAttention(attn_mask=...)`` in bool: (L_q, L_k) or (B*h, L_q, L_k), True = *not*
  allowed (`to_torch_attn_mask`, `from_torch_attn_mask`).
- additive float masks, 0.0 = allowed and -inf = not allowed, added to the scores before the
  softmax: the float ``attn_mask`` of ``nn.MultiheadAttention`` and of
  ``F.scaled_dot_product_attention``, and ``nn.Transformer.generate_square_subsequent_mask``
  (`to_additive_mask`, `from_additive_mask`).
"""

from __future__ import annotations

import numbers

import torch

from ._validation import (
    InputTypeError,
    broadcast_shape,
    require_bool,
    require_bool_mask,
    require_data,
    require_device,
    require_dtype,
    require_int,
    require_rank,
    require_same_device,
    require_tensor,
    shape_str,
)

__all__ = [
    "causal_mask",
    "padding_mask",
    "local_mask",
    "padding_to_attention_mask",
    "combine_masks",
    "to_key_padding_mask",
    "from_key_padding_mask",
    "to_torch_attn_mask",
    "from_torch_attn_mask",
    "to_additive_mask",
    "from_additive_mask",
    "expand_mask",
    "mark_causal",
    "is_marked_causal",
]


def _require_bool(name: str, mask: object) -> torch.Tensor:
    require_tensor(name, mask)
    require_bool_mask(name, mask)
    return mask


def _require_torch_mask(name: str, mask: object) -> torch.Tensor:
    """A mask in one of PyTorch's conventions: a bool or a floating-point tensor."""
    require_tensor(name, mask)
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise InputTypeError(
            f"{name} must be a bool or a floating-point (additive) tensor, got dtype "
            f"{mask.dtype} with shape {shape_str(mask)}"
        )
    return mask


# --------------------------------------------------------------------------------------------
# Building masks
# --------------------------------------------------------------------------------------------


def causal_mask(length: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The (L, L) bool mask that lets position i attend to positions 0..i only.

    Example: ``causal_mask(3)`` is::

        [[True, False, False],
         [True, True,  False],
         [True, True,  True ]]

    The mask is marked (`mark_causal`): while it is not written into, `utils.fast_attention.
    fused_attention` and the attention modules recognize it and run PyTorch's causal kernel,
    ``is_causal=True``, instead of reading it; the output is the same.

    Args:
        length: L, a positive int (a float such as 2.5, a bool or 0 raises).
        device: where to make the mask (a `torch.device`, a string such as "cpu", or None).
    """
    length = require_int("length", length)
    device = require_device("device", device)
    with torch.inference_mode(False):  # a tensor with a version counter, to carry the mark
        return mark_causal(torch.ones(length, length, dtype=torch.bool, device=device).tril())


_MARK = "_causal_mark"  # the attribute that `mark_causal` sets on a tensor


def mark_causal(mask: torch.Tensor) -> torch.Tensor:
    """Mark ``mask``, a causal mask just built, so that the attention can recognize it; returns it.

    The mark records the tensor's version counter (``mask._version``, which every in-place write
    bumps, through any view of it) and where its data lie: `is_marked_causal` holds only while
    both are unchanged, so a mask edited after marking is read entry by entry again. Checking
    the L x L entries at each call instead would cost about a tenth of an attention at
    L = 2048. The caller vouches that ``mask``'s last two dims are a square causal mask (True
    on and below the diagonal) broadcast over any leading dims of size 1. A tensor made under
    ``torch.inference_mode()`` has no version counter and is left unmarked (`causal_mask` and
    the models make theirs outside it). A write that bypasses the counter (through ``.data``,
    or a NumPy view of the tensor) is not seen: do not edit a marked mask that way.

    Raises:
        InputTypeError: when ``mask`` is not a bool tensor.
    """
    _require_bool("mask", mask)
    if not mask.is_inference():
        setattr(mask, _MARK, (mask._version, mask.data_ptr()))
    return mask


def is_marked_causal(mask: object) -> bool:
    """Whether ``mask`` is a causal mask marked by `mark_causal` and not written into since.

    O(1): it reads the mark, never the entries. A write through ``mask.data`` (which has a
    version counter of its own, as autograd's checks also ignore) goes unseen.
    """
    mark = getattr(mask, _MARK, None)
    return mark is not None and mark == (mask._version, mask.data_ptr())


def padding_mask(lengths: torch.Tensor | list[int], max_len: int | None = None) -> torch.Tensor:
    """The (B, max_len) bool mask that is True at real tokens and False at padding.

    Args:
        lengths: (B,) the number of real tokens in each sequence, non-negative integers (a list
            or an integer tensor); padding comes after them.
        max_len: the padded length, an int >= 0; defaults to ``max(lengths)``.

    Returns:
        (B, max_len) bool. To use it as a key mask in attention, turn it into (B, 1, 1, L_k) with
        `padding_to_attention_mask`, which broadcasts to (B, h, L_q, L_k). An empty ``lengths``
        gives a (0, max_len) mask ((0, 0) without ``max_len``); a length of 0 gives a row of
        False, a sequence that attention treats as "every key masked".

    Raises:
        InputTypeError: when ``lengths`` is not integers (floats, bools, strings, None) or
            ``max_len`` is not an int.
        ValueError: for a negative length, a ``lengths`` that is not 1-dim, or a ``max_len``
            below the longest length.
    """
    if isinstance(lengths, torch.Tensor):
        require_data("lengths", lengths)
    else:
        try:
            lengths = torch.as_tensor(lengths, dtype=None if len(lengths) else torch.long)
        except (TypeError, ValueError, RuntimeError):
            raise InputTypeError(
                f"lengths must be a list or tensor of ints, got {lengths!r} "
                f"({type(lengths).__name__})"
            ) from None
    require_rank("lengths", lengths, "(B,)", rank=1)
    if lengths.dtype.is_floating_point or lengths.dtype.is_complex or lengths.dtype == torch.bool:
        raise InputTypeError(f"lengths must hold integers, got dtype {lengths.dtype}")
    if lengths.numel() and lengths.min() < 0:
        raise ValueError(f"lengths must be non-negative, got {lengths.tolist()}")
    if max_len is None:
        max_len = int(lengths.max()) if lengths.numel() else 0
    max_len = require_int("max_len", max_len, minimum=0)
    if lengths.numel() and int(lengths.max()) > max_len:
        raise ValueError(
            f"max_len={max_len} is shorter than the longest length {int(lengths.max())}"
        )
    positions = torch.arange(max_len, device=lengths.device)
    return positions[None, :] < lengths[:, None]


def local_mask(
    length: int, window: int, causal: bool = False, device: torch.device | str | None = None
) -> torch.Tensor:
    """The (L, L) banded bool mask of local (windowed) attention.

    Query i may attend to key j when ``|i - j| <= window``; with ``causal=True``, only when
    ``0 <= i - j <= window`` (the ``window`` previous positions and itself). Each row then allows at
    most ``2 * window + 1`` keys (``window + 1`` when causal), whatever L is, so the number of
    scores that matter grows as L * window instead of L**2.

    Example: ``local_mask(4, 1)`` is::

        [[True,  True,  False, False],
         [True,  True,  True,  False],
         [False, True,  True,  True ],
         [False, False, True,  True ]]

    Args:
        length: L, a positive int.
        window: how far a query may look, an int >= 0 (0: each position sees only itself).
        causal: only look back.
        device: where to make the mask.
    """
    length = require_int("length", length)
    if isinstance(window, numbers.Integral) and not isinstance(window, bool) and window < 0:
        raise ValueError(f"window must be a non-negative int, got {window}")
    window = require_int("window", window, minimum=0)
    require_bool("causal", causal)
    device = require_device("device", device)
    i = torch.arange(length, device=device)[:, None]
    j = torch.arange(length, device=device)[None, :]
    offset = i - j  # how far key j lies behind query i
    if causal:
        return (offset >= 0) & (offset <= window)
    return offset.abs() <= window


def padding_to_attention_mask(pad: torch.Tensor) -> torch.Tensor:
    """Turn a (B, L_k) padding mask (True = real token) into a (B, 1, 1, L_k) attention mask.

    The two new axes stand for the heads and the queries: every head and every query of sequence b
    may attend to the real keys of sequence b only. The result broadcasts to (B, h, L_q, L_k).
    """
    _require_bool("pad", pad)
    require_rank("pad", pad, "(B, L_k)", rank=2)
    return pad[:, None, None, :]


def combine_masks(*masks: torch.Tensor | None) -> torch.Tensor | None:
    """Combine masks by logical AND: a key is allowed only where every mask allows it.

    ``None`` entries (no mask) are skipped; the result is None when every entry is None. The masks
    are broadcast against each other, so ``combine_masks(causal_mask(L), padding_to_attention_mask
    (pad))`` gives a (B, 1, L, L) mask.

    Raises:
        InputTypeError: when a mask is not a bool tensor, or the masks are on different devices.
        ValueError: when the shapes do not broadcast together.
    """
    present = [m for m in masks if m is not None]
    if not present:
        return None
    for i, m in enumerate(present):
        _require_bool(f"mask {i}", m)
    require_same_device(**{f"mask {i}": m for i, m in enumerate(present)})
    try:
        torch.broadcast_shapes(*(m.shape for m in present))
    except RuntimeError:
        shapes = ", ".join(shape_str(m) for m in present)
        raise ValueError(f"the masks' shapes do not broadcast together: {shapes}") from None
    out = present[0]
    for m in present[1:]:
        out = out & m
    return out


# --------------------------------------------------------------------------------------------
# Converters to and from PyTorch's conventions
# --------------------------------------------------------------------------------------------


def to_key_padding_mask(pad: torch.Tensor) -> torch.Tensor:
    """Our (B, L_k) padding mask (True = real) -> ``key_padding_mask`` of ``nn.MultiheadAttention``.

    PyTorch's ``key_padding_mask`` has the opposite polarity: True = ignore this key.
    """
    _require_bool("pad", pad)
    require_rank("pad", pad, "(B, L_k)", rank=2)
    return ~pad


def from_key_padding_mask(key_padding_mask: torch.Tensor) -> torch.Tensor:
    """``nn.MultiheadAttention``'s ``key_padding_mask`` (B, L_k) -> our padding mask (True = real).

    Accepts PyTorch's bool form (True = ignore) and its float form (0 = keep, -inf = ignore).
    """
    _require_torch_mask("key_padding_mask", key_padding_mask)
    require_rank("key_padding_mask", key_padding_mask, "(B, L_k)", rank=2)
    if key_padding_mask.dtype == torch.bool:
        return ~key_padding_mask
    return from_additive_mask(key_padding_mask)


def to_torch_attn_mask(
    mask: torch.Tensor, num_heads: int | None = None, dtype: torch.dtype = torch.bool
) -> torch.Tensor:
    """Our mask -> the ``attn_mask`` of ``nn.MultiheadAttention``.

    PyTorch's bool ``attn_mask`` means True = NOT allowed; its float form is additive (0 / -inf).

    Args:
        mask: bool, True = may attend, of shape (L_q, L_k), or (B, L_q, L_k) / (B, 1, L_q, L_k) /
            (B, h, L_q, L_k) for a mask that differs between sequences.
        num_heads: needed for a mask with a batch axis: ``nn.MultiheadAttention`` wants such a
            mask as (B * h, L_q, L_k), sequence b's heads in rows b*h .. b*h + h - 1.
        dtype: ``torch.bool`` (default) for the bool form, a float dtype for the additive form.

    Returns:
        (L_q, L_k) for a 2-D mask, else (B * h, L_q, L_k): the inverse of ``mask`` in bool, or
        0 / -inf in a float dtype.
    """
    _require_bool("mask", mask)
    require_dtype("dtype", dtype)
    if dtype != torch.bool and not dtype.is_floating_point:
        raise ValueError(f"dtype must be torch.bool or a floating point dtype, got {dtype}")
    if num_heads is not None:
        num_heads = require_int("num_heads", num_heads)

    def convert(m: torch.Tensor) -> torch.Tensor:
        return ~m if dtype == torch.bool else to_additive_mask(m, dtype)

    if mask.dim() == 2:
        return convert(mask)
    if mask.dim() not in (3, 4):
        raise ValueError(
            f"mask must have shape (L_q, L_k), (B, L_q, L_k) or (B, h, L_q, L_k), got "
            f"{shape_str(mask)}"
        )
    if num_heads is None:
        raise ValueError(
            f"a mask of shape {shape_str(mask)} has a batch axis: give num_heads so that it can be "
            "laid out as (B * h, L_q, L_k)"
        )
    if mask.dim() == 3:
        mask = mask[:, None]
    b, h, l_q, l_k = mask.shape
    if h not in (1, num_heads):
        raise ValueError(
            f"mask of shape {shape_str(mask)} has {h} heads; expected 1 or num_heads={num_heads}"
        )
    return convert(mask.expand(b, num_heads, l_q, l_k).reshape(b * num_heads, l_q, l_k))


def from_torch_attn_mask(attn_mask: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
    """``nn.MultiheadAttention``'s ``attn_mask`` -> our bool mask (True = may attend).

    Accepts the bool form (True = not allowed) and the additive float form (0 / -inf), of shape
    (L_q, L_k) or (B * h, L_q, L_k). With ``num_heads`` given, a 3-D mask comes back as
    (B, h, L_q, L_k); without it, it keeps its shape.
    """
    _require_torch_mask("attn_mask", attn_mask)
    if num_heads is not None:
        num_heads = require_int("num_heads", num_heads)
    if attn_mask.dim() not in (2, 3):
        raise ValueError(
            f"attn_mask must have shape (L_q, L_k) or (B*h, L_q, L_k), got {shape_str(attn_mask)}"
        )
    mask = ~attn_mask if attn_mask.dtype == torch.bool else from_additive_mask(attn_mask)
    if mask.dim() == 3 and num_heads is not None:
        bh, l_q, l_k = mask.shape
        if bh % num_heads != 0:
            raise ValueError(
                f"attn_mask of shape {shape_str(attn_mask)}: the first dim {bh} is not a multiple"
                f" of num_heads={num_heads}"
            )
        mask = mask.reshape(bh // num_heads, num_heads, l_q, l_k)
    return mask


def to_additive_mask(mask: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Our bool mask -> an additive float mask: 0.0 where allowed, -inf where not.

    This is the form of ``nn.Transformer.generate_square_subsequent_mask(L)`` (which equals
    ``to_additive_mask(causal_mask(L))``) and of the float ``attn_mask`` accepted by
    ``F.scaled_dot_product_attention`` and ``nn.MultiheadAttention``: it is added to the scores,
    and exp(-inf) = 0 removes the key from the softmax. The shape is kept.
    """
    _require_bool("mask", mask)
    require_dtype("dtype", dtype, floating=True)
    out = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return out.masked_fill(~mask, float("-inf"))


def from_additive_mask(mask: torch.Tensor) -> torch.Tensor:
    """An additive float mask (0.0 = allowed, -inf = not allowed) -> our bool mask.

    Raises:
        InputTypeError: if ``mask`` is not a floating-point tensor, or has no values (meta).
        ValueError: if the tensor holds other values (NaN, +inf, or a finite non-zero entry,
            which is a bias on the scores, not a mask, and has no bool equivalent).
    """
    require_tensor("mask", mask)
    if not mask.dtype.is_floating_point:
        raise InputTypeError(f"an additive mask must be a float tensor, got dtype {mask.dtype}")
    require_data("mask", mask)
    blocked = torch.isneginf(mask)
    if not torch.all((mask == 0) | blocked):
        raise ValueError(
            f"additive mask of shape {shape_str(mask)} holds values other than 0 and -inf; "
            "such a bias has no bool equivalent"
        )
    return ~blocked


def _fits(shape: torch.Size, target: tuple[int, ...]) -> bool:
    """Whether ``shape`` broadcasts to exactly ``target``."""
    return broadcast_shape(tuple(shape), tuple(target)) == tuple(target)


def expand_mask(mask: torch.Tensor | None, batch: int, l_q: int, l_k: int,
                name: str = "mask") -> torch.Tensor | None:
    """Read a mask by the library's one rule and make it 4-dimensional.

    The rule, the same for every attention module and every mask argument:

    * 2 dims that fit (B, L_k): a key padding mask (True at real tokens), the same for every query
      and every head;
    * 2 dims that fit (L_q, L_k): one mask shared by the whole batch, such as `causal_mask`;
    * 2 dims that fit both, which happens when B == L_q: ambiguous, a `ValueError` (write a
      padding mask as ``mask[:, None, :]`` and a shared one as ``mask[None]``). When the first
      dim is 1 (B == L_q == 1, or a (1, L_k) mask) the two readings give the same mask, and it is
      accepted;
    * 3 dims: broadcastable to (B, L_q, L_k), the same for every head;
    * 4 dims: broadcastable to (B, h, L_q, L_k).

    "Fit" means "broadcasts to": a (1, L_k) mask applies to every sequence and every query.

    Args:
        mask: None, or a bool tensor, True = may attend, laid out as above.
        batch, l_q, l_k: B, L_q and L_k of the attention the mask is meant for, ints >= 0.
        name: how the argument is called in error messages.

    Returns:
        None, or a bool tensor with 4 dims that broadcasts to (B, h, L_q, L_k) for any h:
        (B, 1, 1, L_k) for a padding mask, (1, 1, L_q, L_k) for a shared one, (B, 1, L_q, L_k)
        for a 3-dim one (broadcast dims stay 1); a 4-dim mask is returned as it is (its h is
        checked by the attention, which knows how many heads it has).

    Raises:
        InputTypeError: for a mask that is not a bool tensor, or sizes that are not ints.
        ValueError: for a mask with the wrong number of dims, one that does not fit
            (B, L_q, L_k), or a 2-dim one that fits both readings differently.
    """
    batch = require_int("batch", batch, minimum=0)
    l_q = require_int("l_q", l_q, minimum=0)
    l_k = require_int("l_k", l_k, minimum=0)
    if mask is None:
        return None
    _require_bool(name, mask)
    accepted = (f"; {name} may be (B, L_k) padding, (L_q, L_k) shared, (B, L_q, L_k) or "
                f"(B, h, L_q, L_k), with B={batch}, L_q={l_q}, L_k={l_k}")
    if mask.dim() == 2:
        as_padding = _fits(mask.shape, (batch, l_k))
        as_shared = _fits(mask.shape, (l_q, l_k))
        if as_padding and as_shared and mask.shape[0] != 1:
            raise ValueError(
                f"{name} of shape {shape_str(mask)} is ambiguous because B = L_q = {batch}: it "
                f"could be a (B, L_k) padding mask or an (L_q, L_k) mask shared by the batch. "
                f"Write a padding mask as {name}[:, None, :] and a shared mask as {name}[None]"
            )
        if as_shared:
            shared = mask[None, None, :, :]  # (1, 1, L_q, L_k)
            return mark_causal(shared) if is_marked_causal(mask) else shared
        if as_padding:
            return padding_to_attention_mask(mask)  # (B, 1, 1, L_k)
        raise ValueError(
            f"a 2-dim {name} must be a (B, L_k) = {shape_str((batch, l_k))} padding mask or an "
            f"(L_q, L_k) = {shape_str((l_q, l_k))} mask shared by the batch, got "
            f"{shape_str(mask)}" + accepted
        )
    if mask.dim() == 3:
        target: tuple[int, ...] = (batch, l_q, l_k)
        desc = "(B, L_q, L_k)"
    elif mask.dim() == 4:
        target = (batch, mask.shape[1], l_q, l_k)  # h is checked by the attention itself
        desc = "(B, h, L_q, L_k)"
    else:
        raise ValueError(
            f"{name} must have 2, 3 or 4 dims, got {shape_str(mask)}" + accepted
        )
    if not _fits(mask.shape, target):
        raise ValueError(
            f"{name} of shape {shape_str(mask)} does not broadcast to {desc}" + accepted
        )
    if mask.dim() == 4:
        return mask
    out = mask.unsqueeze(1)
    return mark_causal(out) if is_marked_causal(mask) else out
