"""Comparing a student's raw result with the reference, for every assignment's checker.

The trusted side of the checkers (`checker.Checker`) compares tensors that the student side sent
back (outputs, input and parameter gradients, the inputs after the call, what named submodules
saw) with the reference's, all keyed as `core.exercise` keys them (``out:NAME``, ``grad:NAME``,
``pgrad:PATH``, ``in:NAME``, ``trace_in:NAME``, ``trace_out:NAME``). This module holds the
tolerances, the differences and the hints that do not depend on an assignment: what a failed
stage means, an input changed in place, a wrong dtype, where a computation first leaves the
reference.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import torch

from .core import Spec

__all__ = ["ATOL", "RTOL", "GRAD_ATOL", "GRAD_RTOL", "allclose", "max_diff", "fmt",
           "shape_str", "status_hint", "changed_input_hint", "dtype_hint", "first_divergence",
           "grad_label", "pairs"]

ATOL = 1e-4
RTOL = 1e-4
GRAD_ATOL = 1e-4
GRAD_RTOL = 1e-3

DETACHED_HINT = ("the values are right but the output is detached from the autograd graph "
                 "(.detach(), .data, torch.no_grad() or a tensor rebuilt from numbers): no "
                 "gradient can flow back through it")


def shape_str(shape: Sequence[int]) -> str:
    """(2, 5, 8) as text."""
    return "(" + ", ".join(str(int(s)) for s in shape) + ")"


def allclose(a: torch.Tensor, b: torch.Tensor, atol: float, rtol: float,
             equal_nan: bool = False) -> bool:
    """Same shape and close values, compared in float64."""
    return tuple(a.shape) == tuple(b.shape) and bool(torch.allclose(
        a.detach().double(), b.detach().double(), atol=atol, rtol=rtol, equal_nan=equal_nan))


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest absolute difference (NaN counts as infinite)."""
    d = (a.detach().double() - b.detach().double()).abs()
    d = torch.nan_to_num(d, nan=math.inf, posinf=math.inf)  # inf stays inf, not the largest float
    return float(d.max()) if d.numel() else 0.0


def fmt(x: float) -> str:
    """A difference as printed in a hint."""
    return "inf" if not math.isfinite(x) else f"{x:.1e}"


def grad_label(key: str) -> str:
    """``grad:x`` as "the input `x`", ``pgrad:w`` as "the parameter `w`"."""
    kind, name = key.split(":", 1)
    return f"the input `{name}`" if kind == "grad" else f"the parameter `{name}`"


def pairs(pool: Sequence[Any], make: Any) -> list[Any]:
    """``make(a, b)`` for every pair of ``pool`` (in order) whose options are disjoint."""
    return [make(a, b) for a, b in itertools.combinations(pool, 2)
            if not set(a.options) & set(b.options)]


def status_hint(what: str, status: Any, message: str) -> str:
    """The hint for a case that stopped on the student side (``status`` is not "ok")."""
    if status == "timeout":
        return f"{what} {message}: an endless loop, or far too much work?"
    if status == "build":
        if message == "NotImplementedError":
            return "not implemented yet (building your module raises NotImplementedError)"
        return f"building your module failed: {message}"
    if status == "load":
        return (f"{message}: the checker copies known weights into it by that name, as the "
                "assignment specifies")
    if status == "call":
        if message == "NotImplementedError":
            return f"{what} is not implemented yet (it raises NotImplementedError)"
        return f"{what} raised {message}"
    if status == "type":
        return f"{what} {message}" if message.startswith("returned") else message
    if status == "backward":
        return f"the output is right or close, but the backward pass raised {message}"
    return f"this case could not run ({status}: {message})"


def changed_input_hint(what: str, spec: Spec, tensors: dict[str, torch.Tensor]) -> str | None:
    """The hint when an input came back modified (the student's code changed it in place)."""
    for name, original in spec.tensors.items():
        after = tensors.get(f"in:{name}")
        if after is not None and not (after.shape == original.shape
                                      and torch.equal(after, original)):
            return (f"{what} changes its input `{name}` in place (for example "
                    f"`{name}.sub_(...)`, `{name} -= ...` or `{name}[...] = ...`): compute on "
                    "new tensors and leave the caller's tensors as they were")
    return None


def dtype_hint(spec: Spec, tensors: dict[str, torch.Tensor]) -> str | None:
    """The hint when right values come back in another dtype than the reference's."""
    for name in spec.outputs:
        got = tensors[f"out:{name}"]
        if str(got.dtype) != spec.out_dtype:
            return (f"the values are right but the {name} has dtype {got.dtype}; the reference"
                    f" returns {spec.out_dtype} (the dtype of the input, or torch's default "
                    "dtype): convert back at the end if you compute in another precision")
    return None


def first_divergence(tensors: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> str:
    """Which traced submodule first sees or produces something else than the reference."""
    order = [k for k in ref if k.startswith(("trace_in:", "trace_out:"))]
    for key in order:
        stage, name = key.split(":", 1)
        got = tensors.get(key)
        if got is None and not ref[key].any():
            continue  # nothing flows there in the reference either (a dropped sublayer)
        if got is None:
            return f"`{name}` was never called (the checker watches it by that name)"
        want = ref[key]
        if tuple(got.shape) != tuple(want.shape):
            which = "input of" if stage == "trace_in" else "output of"
            return (f"the first difference is the {which} `{name}`: shape "
                    f"{shape_str(got.shape)} instead of {shape_str(want.shape)}")
        if not allclose(got, want, ATOL, RTOL):
            if stage == "trace_in":
                return (f"the first difference is in what goes into `{name}` (max |diff| = "
                        f"{fmt(max_diff(got, want))}): look at the steps before it")
            return (f"`{name}` gets the right input but its output differs (max |diff| = "
                    f"{fmt(max_diff(got, want))}): look at `{name}` itself")
    if order:
        return ("every watched submodule sees and returns the right values, so the "
                "difference comes after them (how their results are combined)")
    return ""
