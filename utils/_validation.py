"""Small helpers that turn bad input into a `ValueError` naming expected and actual shapes."""

from __future__ import annotations

import torch


def shape_str(t: torch.Tensor | torch.Size | tuple[int, ...]) -> str:
    """Format a tensor's shape (or a shape) as ``(2, 5, 8)``."""
    shape = t.shape if isinstance(t, torch.Tensor) else t
    return "(" + ", ".join(str(int(s)) for s in shape) + ")"


def require_tensor(name: str, t: object) -> torch.Tensor:
    """Raise `ValueError` unless ``t`` is a tensor."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def require_rank(name: str, t: torch.Tensor, expected: str, *, min_rank: int | None = None,
                 rank: int | None = None) -> None:
    """Raise `ValueError` if ``t`` has the wrong number of dimensions.

    Args:
        name: how the argument is called in the error message.
        t: the tensor to check.
        expected: the expected shape in words, such as ``"(..., L_q, d_k)"``.
        min_rank: the least number of dimensions allowed.
        rank: the exact number of dimensions required.
    """
    if rank is not None and t.dim() != rank:
        raise ValueError(f"{name} must have shape {expected} ({rank} dims), got {shape_str(t)}")
    if min_rank is not None and t.dim() < min_rank:
        raise ValueError(
            f"{name} must have shape {expected} (at least {min_rank} dims), got {shape_str(t)}"
        )


def require_broadcastable(name: str, shape: torch.Size, target: tuple[int, ...],
                          target_desc: str) -> None:
    """Raise `ValueError` unless ``shape`` broadcasts to ``target``."""
    try:
        out = torch.broadcast_shapes(shape, target)
    except RuntimeError:
        out = None
    if out is None or tuple(out) != tuple(target):
        raise ValueError(
            f"{name} of shape {shape_str(shape)} does not broadcast to {target_desc} = "
            f"{shape_str(target)}"
        )
