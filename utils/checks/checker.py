"""The trusted side of every assignment's checker: the reference, its known mistakes, the judge.

A checker (one per piece an assignment asks for) is a `Checker` subclass: its cases, a reference
``forward`` written in float64 with switches that reproduce the usual mistakes, and the
`Mistake` table that names them. `Checker.judge` takes the raw result that the student side
(`core.exercise`) sent back, computes the expected outputs and gradients itself, and returns None
or the hint a student reads: the named mistake when the output equals a known wrong variant, and
otherwise where the student's computation first leaves the reference (`compare`). The grader
runs it in its own process, never in the student's.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .compare import (
    ATOL,
    DETACHED_HINT,
    GRAD_ATOL,
    GRAD_RTOL,
    RTOL,
    allclose,
    changed_input_hint,
    dtype_hint,
    first_divergence,
    fmt,
    grad_label,
    max_diff,
    pairs,
    shape_str,
    status_hint,
)
from .core import Run, Spec, _exception_text, guarded_exercise
from .results import CaseResult, CheckResult

__all__ = ["Case", "Mistake", "PartialHint", "TrustedReference", "Checker", "combined",
           "run_in_process"]

CASE_TIMEOUT_S = 10.0  # in a notebook: a case that runs longer is stopped and fails


@dataclass
class Case:
    """One case of a checker: an id (a CSV column), a name (printed), points, and its input.

    ``make(gen)`` draws the case's random values from ``gen`` and returns its `Spec`. ``time_s``
    raises the case's time limit (wall-clock in a notebook, CPU seconds in the grader) above the
    default (for a case that trains a model); the grader's limit for the whole notebook still
    applies.
    """

    id: str
    name: str
    make: Callable[[torch.Generator], Spec]
    points: float = 1.0
    time_s: float | None = None  # a longer time limit than the default (a case that trains)

    def time_limit(self, default: float | None) -> float | None:
        """The time limit of this case: ``default``, or ``time_s`` when that is longer."""
        if default is None or self.time_s is None:
            return default
        return max(default, self.time_s)


@dataclass
class Mistake:
    """A known wrong variant: a hint and the options of the checker's forward that reproduce it.

    ``grad_only`` marks a mistake whose forward is right and whose gradient is not (a detached
    statistic, for instance): it is looked for only when the outputs match and a gradient does
    not.
    """

    hint: str
    options: dict[str, Any]
    grad_only: bool = False
    combine: bool = True  # may be paired with another mistake


def combined(pool: Sequence[Mistake]) -> list[Mistake]:
    """Every pair of ``pool`` with disjoint options, as one mistake with both hints."""
    return pairs(pool, lambda a, b: Mistake(f"{a.hint}; and {b.hint}",
                                            {**a.options, **b.options}))


_PARAM_INPUT = re.compile(r"the input `([^`]*\.[^`]*)`")


class PartialHint(str):
    """A hint that carries the share of the points a failed case still earns."""

    fraction: float = 0.0

    def __new__(cls, text: str, fraction: float) -> PartialHint:
        obj = super().__new__(cls, text)
        obj.fraction = fraction
        return obj


class TrustedReference:
    """What a checker expects: its cases, its float64 reference and its known mistakes.

    ``forward(spec, x, p, **options)`` is the reference with switches (``options``) that
    reproduce mistakes; `evaluate` runs it on a case's inputs and takes the gradients.
    """

    name: str = ""
    mistakes: Sequence[Mistake] = ()
    combine_pairs: bool = True

    def __init__(self, cases: Sequence[Case]):
        self.cases = list(cases)

    def forward(self, spec: Spec, x: dict[str, torch.Tensor], p: dict[str, torch.Tensor],
                **options: Any) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Outputs and named intermediates (``trace_in:NAME``/``trace_out:NAME``) in float64."""
        raise NotImplementedError

    def evaluate(self, spec: Spec, grads: bool = True, **options: Any) -> dict[str, torch.Tensor]:
        """Run `forward` with ``options`` on the spec's inputs; outputs, gradients and trace."""
        x = {k: (v.double() if v.is_floating_point() else v.clone())
             for k, v in spec.tensors.items()}
        for name in spec.grad_inputs:
            x[name].requires_grad_(grads)
        p = {k: v.double().requires_grad_(grads) for k, v in spec.params.items()}
        with torch.enable_grad() if grads else torch.no_grad():
            outs, trace = self.forward(spec, x, p, **options)
        res = {f"out:{k}": v.detach() for k, v in outs.items()}
        res.update({k: v.detach() for k, v in trace.items()})
        if grads and spec.grad_out:
            flows = [(outs[n], g.double()) for n, g in spec.grad_out.items()
                     if outs[n].requires_grad]
            leaves = [x[n] for n in spec.grad_inputs] + list(p.values())
            if flows and leaves:
                got = torch.autograd.grad([o for o, _ in flows], leaves,
                                          [g for _, g in flows], allow_unused=True)
                names = [f"grad:{n}" for n in spec.grad_inputs] + [f"pgrad:{k}" for k in p]
                for n, g in zip(names, got, strict=True):
                    res[n] = torch.zeros_like(leaves[names.index(n)]) if g is None else g
        return res

    def isolated(self, spec: Spec) -> Generator[Run, dict[str, Any], dict[str, Any]] | None:
        """How the grader runs this case: None (the default) in the same process as the other
        cases, after the notebook's cells; or a generator that yields `Run`s, each run in a
        fresh process of its own after the notebook's cells, is sent each run's raw result
        (status "ok") and returns the raw result to judge. A case whose answer could be told
        from what an earlier call saw (a behaviour test, a trained model) runs this way."""
        return None

    def all_mistakes(self) -> list[Mistake]:
        """The single mistakes, then every pair of combinable mistakes with disjoint options."""
        out = list(self.mistakes)
        if self.combine_pairs:
            out += combined([m for m in self.mistakes if m.combine and not m.grad_only])
        return out

    def extra_variants(self, spec: Spec, raw: dict[str, torch.Tensor]) -> list[Mistake]:
        """Mistakes that depend on the student's output (an estimated constant, ...)."""
        return []

    def specs(self, seed: int | None = None) -> list[Spec]:
        """The spec of every case; fixed values when ``seed`` is None, fresh ones otherwise."""
        out = []
        for i, case in enumerate(self.cases):
            gen = torch.Generator().manual_seed(1000 * (i + 1) if seed is None else seed + i)
            out.append(case.make(gen))
        return out

    def result(self, case: Case, hint: str | None, flag: str = "") -> CaseResult:
        """A `CaseResult` for ``case``: full points when ``hint`` is None; a `PartialHint`
        earns its share."""
        if isinstance(hint, PartialHint) and not flag:
            return CaseResult(case.name, False, str(hint),
                              round(case.points * hint.fraction, 2), case.points, case.id)
        ok = hint is None and not flag
        return CaseResult(case.name, ok, hint or "", case.points if ok else 0.0, case.points,
                          case.id, flag)


class Checker(TrustedReference):
    """A checker: the graded object, its cases, a trusted reference and its known mistakes.

    Subclasses (one per assignment piece) define `forward`, the reference with switches that
    reproduce mistakes, and may refine `localize`. ``target`` is the name the assignment asks
    the student to define; ``what`` says what it is in hints ("your function").
    """

    target: str = ""
    what: str = "your function"
    shape_desc: dict[str, str] = {}
    weights_are_inputs = False  # the case passes the weights as inputs: "parameter" in hints
    nan_grad_hint = ("a value that is NaN in the forward pass and hidden afterwards (by "
                     "nan_to_num, masked_fill or torch.where) still sends NaN backward; avoid "
                     "computing it at all")

    def judge(self, spec: Spec, raw: dict[str, Any]) -> str | None:
        """None when the raw result matches the reference, else the hint for the student."""
        hint = self._judge(spec, raw)
        return _PARAM_INPUT.sub(r"the parameter `\1`", hint) if hint and \
            self.weights_are_inputs else hint

    def _judge(self, spec: Spec, raw: dict[str, Any]) -> str | None:
        if raw.get("status") != "ok":
            return status_hint(self.what, raw.get("status"), raw.get("message", ""))
        hint = changed_input_hint(self.what, spec, raw["tensors"])
        if hint:
            return hint
        ref = self.evaluate(spec)
        for name in spec.outputs:
            hint = self._judge_output(spec, raw, ref, name)
            if hint:
                return hint if name == spec.outputs[0] else f"the {spec.outputs[0]} is right but " \
                    + hint
        return dtype_hint(spec, raw["tensors"]) or self._judge_grads(spec, raw, ref)

    def _judge_output(self, spec: Spec, raw: dict[str, Any], ref: dict[str, torch.Tensor],
                      name: str) -> str | None:
        got = raw["tensors"][f"out:{name}"]
        want = ref[f"out:{name}"]
        if got.is_complex():
            return f"the {name} must be a real tensor, got dtype {got.dtype}"
        if tuple(got.shape) != tuple(want.shape):
            hint = (f"wrong shape: expected the {name} of shape "
                    f"{self.shape_desc.get(name, '')} = {shape_str(want.shape)}, got "
                    f"{shape_str(got.shape)}").replace("shape  =", "shape")
            note = self.shape_note(spec, name, tuple(got.shape))
            return hint + (f" ({note})" if note else "")
        if allclose(got, want, ATOL, RTOL):
            return None
        for m in self.all_mistakes() + self.extra_variants(spec, raw["tensors"]):
            if m.grad_only:
                continue
            try:
                cand = self.evaluate(spec, grads=False, **m.options)[f"out:{name}"]
            except Exception:  # a variant that cannot run on this case cannot match
                continue
            if allclose(got, cand, ATOL, RTOL, equal_nan=True):
                return m.hint
        if not torch.isfinite(got.double()).all() and torch.isfinite(want).all():
            first = first_divergence(raw["tensors"], ref)
            return f"the {name} contains NaN or inf where the reference has none" + \
                (f"; {first}" if first else "")
        located = self.localize(spec, raw["tensors"], ref, name)
        return (f"the {name} differs from the reference (max |diff| = {fmt(max_diff(got, want))})"
                f" and matches none of the known mistakes; {located}")

    def _judge_grads(self, spec: Spec, raw: dict[str, Any],
                     ref: dict[str, torch.Tensor]) -> str | None:
        if not spec.grad_out:
            return None
        if "detached" in raw.get("notes", []):
            return DETACHED_HINT
        for key in [k for k in ref if k.startswith(("grad:", "pgrad:"))]:
            got, want, label = raw["tensors"].get(key), ref[key], grad_label(key)
            if got is None and not want.any():
                continue  # nothing flows there in the reference either (a dropped sublayer)
            if got is None:
                return (f"the values are right but no gradient reaches {label}: something in "
                        "between is detached or recomputed outside autograd")
            if allclose(got, want, GRAD_ATOL, GRAD_RTOL):
                continue
            if not torch.isfinite(got.double()).all() and torch.isfinite(want).all():
                return (f"the values are right but the gradient of {label} contains NaN or "
                        "inf: " + self.nan_grad_hint)
            for m in [m for m in self.mistakes if m.grad_only]:
                cand = self.evaluate(spec, **m.options).get(key)
                if cand is not None and allclose(got, cand, GRAD_ATOL, GRAD_RTOL):
                    return "the values are right but the gradient is not: " + m.hint
            return (f"the values are right but the gradient of {label} differs from the "
                    f"reference (max |diff| = {fmt(max_diff(got, want))}): part of your "
                    "computation is detached, done in place on a tensor autograd needs, or "
                    "not differentiable")
        return None

    def shape_note(self, spec: Spec, name: str, shape: tuple[int, ...]) -> str:
        """A note on a wrong shape that is a known slip ("transposed"), or ""."""
        return ""

    def localize(self, spec: Spec, tensors: dict[str, torch.Tensor],
                 ref: dict[str, torch.Tensor], name: str) -> str:
        """Where the student's computation first leaves the reference."""
        return first_divergence(tensors, ref) or "compare your code with the formula step by step"


def run_in_process(checker: Checker, obj: Any, verbose: bool = True,
                   timeout: float | None = CASE_TIMEOUT_S) -> CheckResult:
    """Run every case of ``checker`` on ``obj`` here, print one line per case, return the result.

    This is what the notebooks call: quick, and no protection against the code it checks (the
    grader runs the same cases in a sandbox).
    """
    result = CheckResult(checker.name)
    for case, spec in zip(checker.cases, checker.specs(), strict=True):
        raw = guarded_exercise(obj, spec, case.time_limit(timeout))
        try:
            hint = checker.judge(spec, raw)
        except Exception as exc:  # the judge must never take the notebook down
            hint = f"the result could not be compared ({_exception_text(exc)})"
        result.cases.append(checker.result(case, hint, "timeout" if raw["status"] == "timeout"
                                           else ""))
    if verbose:  # printed at once, so that a notebook stores it as one output
        print("\n".join([c.printed() for c in result.cases] + [result.summary()]))
    return result
