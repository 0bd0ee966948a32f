"""Attention masks in the book's convention (chapter 4).

A mask is a bool tensor, True = "this query may attend to this key", the polarity of the bool
``attn_mask`` of `torch.nn.functional.scaled_dot_product_attention`. It broadcasts to
(B, h, L_q, L_k).
"""

from __future__ import annotations

import torch

from ._validation import require_rank, require_tensor, shape_str

__all__ = ["causal_mask", "padding_mask"]


def causal_mask(length: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The (L, L) bool mask that lets position i attend to positions 0..i only.

    Example: ``causal_mask(3)`` is::

        [[True, False, False],
         [True, True,  False],
         [True, True,  True ]]
    """
    if not isinstance(length, int) or length <= 0:
        raise ValueError(f"length must be a positive int, got {length!r}")
    return torch.ones(length, length, dtype=torch.bool, device=device).tril()


def padding_mask(lengths: torch.Tensor | list[int], max_len: int | None = None) -> torch.Tensor:
    """The (B, max_len) bool mask that is True at real tokens and False at padding.

    Args:
        lengths: (B,) the number of real tokens in each sequence; padding comes after them.
        max_len: the padded length; defaults to ``max(lengths)``.

    Returns:
        (B, max_len) bool. To use it as a key mask in attention, index it as
        ``mask[:, None, None, :]``, which broadcasts to (B, h, L_q, L_k).
    """
    lengths = torch.as_tensor(lengths)
    require_rank("lengths", lengths, "(B,)", rank=1)
    if lengths.numel() and lengths.min() < 0:
        raise ValueError(f"lengths must be non-negative, got {lengths.tolist()}")
    if max_len is None:
        max_len = int(lengths.max()) if lengths.numel() else 0
    if lengths.numel() and int(lengths.max()) > max_len:
        raise ValueError(f"max_len={max_len} is shorter than the longest length {int(lengths.max())}")
    positions = torch.arange(max_len, device=lengths.device)
    return positions[None, :] < lengths[:, None]


def _require_bool(name: str, mask: torch.Tensor) -> None:
    require_tensor(name, mask)
    if mask.dtype != torch.bool:
        raise ValueError(f"{name} must be a bool tensor, got dtype {mask.dtype} {shape_str(mask)}")
