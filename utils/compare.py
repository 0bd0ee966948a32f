"""Comparing what the book builds with PyTorch's own: the largest absolute difference, printed.

Every chapter proves a from-scratch piece equal to PyTorch's by printing the largest absolute
difference between the two outputs and checking it against a tolerance. The digits of a
difference of about 1e-7 are rounding noise that depends on the CPU and on how many threads
summed the numbers, so the book's nbval sanitizer masks them; the verdict ``<= tolerance`` next
to them is still compared, and `report_close` raises if it does not hold.
"""

from __future__ import annotations

import torch

from ._validation import InputTypeError, require_data, require_real, require_tensor, shape_str

__all__ = ["max_abs_diff", "report_close"]


def _require_comparable(name: str, t: object) -> torch.Tensor:
    require_tensor(name, t)
    if t.is_complex():
        raise InputTypeError(f"{name} must hold real numbers, got dtype {t.dtype}; compare the "
                             "real and imaginary parts (torch.view_as_real) instead")
    require_data(name, t)
    return t


def max_abs_diff(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest |actual - expected| over all elements, as a Python float.

    Any real dtypes (floating, integer) can be compared with each other, on any devices; a bool
    tensor only with a bool tensor (True counting as 1). Non-finite values are compared as a
    careful reader would:

    * equal infinities (inf and inf, -inf and -inf) differ by 0;
    * an infinity against anything else differs by inf;
    * a NaN against anything, NaN included, differs by inf: NaN means something went wrong,
      so it never counts as a match.

    The result is therefore never NaN. Two empty tensors differ by 0.0.

    Raises:
        InputTypeError: when an argument is not a tensor, is complex, lives on the meta device,
            or only one of the two is bool.
        ValueError: when the two tensors do not have the same shape.
    """
    _require_comparable("actual", actual)
    _require_comparable("expected", expected)
    if actual.shape != expected.shape:
        raise ValueError(
            f"actual and expected must have the same shape: actual {shape_str(actual)}, "
            f"expected {shape_str(expected)}"
        )
    if (actual.dtype == torch.bool) != (expected.dtype == torch.bool):
        raise InputTypeError(
            f"cannot compare a bool tensor with a number tensor: actual is {actual.dtype}, "
            f"expected is {expected.dtype}"
        )
    if actual.numel() == 0:
        return 0.0
    a = actual.detach().cpu().double()
    b = expected.detach().cpu().double()
    diff = (a - b).abs()
    diff = diff.masked_fill(a == b, 0.0)  # inf - inf would be NaN; equal infinities match
    diff = diff.masked_fill(torch.isnan(diff), float("inf"))  # NaN in either, or inf vs -inf
    return float(diff.max().item())


def report_close(label: str, actual: torch.Tensor, expected: torch.Tensor,
                 atol: float = 1e-5) -> float:
    """Print ``label: max |diff| = 2.4e-07 <= 1e-05`` and return the difference.

    Args:
        label: what is being compared, e.g. ``"ours vs nn.MultiheadAttention"``.
        actual: what the book built, any shape.
        expected: the reference (usually PyTorch's output), the same shape.
        atol: the tolerance the difference must not exceed, a finite number >= 0.

    Raises:
        AssertionError: when the difference exceeds ``atol`` (a NaN anywhere counts as an
            infinite difference, see `max_abs_diff`), so that a notebook that stops matching
            PyTorch fails its test instead of printing a wrong claim.
        InputTypeError, ValueError: for a label that is not a string, a bad ``atol``, or
            tensors `max_abs_diff` cannot compare.
    """
    if not isinstance(label, str):
        raise InputTypeError(f"label must be a string, got {label!r} ({type(label).__name__})")
    atol = require_real("atol", atol, low=0.0)
    diff = max_abs_diff(actual, expected)
    if not diff <= atol:
        raise AssertionError(f"{label}: max |diff| = {diff:.1e} exceeds the tolerance {atol:.0e}")
    print(f"{label}: max |diff| = {diff:.1e} <= {atol:.0e}")
    return diff
