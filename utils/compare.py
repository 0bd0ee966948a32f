"""Comparing what the book builds with PyTorch's own: the largest absolute difference, printed.

Every chapter proves a from-scratch piece equal to PyTorch's by printing the largest absolute
difference between the two outputs and checking it against a tolerance. The digits of a
difference of about 1e-7 are rounding noise that depends on the CPU and on how many threads
summed the numbers, so the book's nbval sanitizer masks them; the verdict ``<= tolerance`` next
to them is still compared, and `report_close` raises if it does not hold.
"""

from __future__ import annotations

import torch

from ._validation import require_tensor, shape_str

__all__ = ["max_abs_diff", "report_close"]


def max_abs_diff(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest |actual - expected| over all elements, as a Python float.

    Raises:
        ValueError: when the two tensors do not have the same shape.
    """
    require_tensor("actual", actual)
    require_tensor("expected", expected)
    if actual.shape != expected.shape:
        raise ValueError(
            f"actual and expected must have the same shape: actual {shape_str(actual)}, "
            f"expected {shape_str(expected)}"
        )
    if actual.numel() == 0:
        return 0.0
    diff = (actual.detach().double() - expected.detach().double()).abs().max().item()
    return float(diff)


def report_close(label: str, actual: torch.Tensor, expected: torch.Tensor,
                 atol: float = 1e-5) -> float:
    """Print ``label: max |diff| = 2.4e-07 <= 1e-05`` and return the difference.

    Args:
        label: what is being compared, e.g. ``"ours vs nn.MultiheadAttention"``.
        actual: what the book built, any shape.
        expected: the reference (usually PyTorch's output), the same shape.
        atol: the tolerance the difference must not exceed.

    Raises:
        AssertionError: when the difference exceeds ``atol`` or is NaN, so that a notebook
            that stops matching PyTorch fails its test instead of printing a wrong claim.
    """
    diff = max_abs_diff(actual, expected)
    if not diff <= atol:  # also catches NaN
        raise AssertionError(f"{label}: max |diff| = {diff:.1e} exceeds the tolerance {atol:.0e}")
    print(f"{label}: max |diff| = {diff:.1e} <= {atol:.0e}")
    return diff
