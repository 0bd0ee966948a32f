"""The shared core of the checkers: cases, running student code on them, and judging the result.

A checker is a list of `Case` objects and a trusted reference. Running a case has two halves that
never need to live in the same process:

* `exercise` (the *student side*) builds the student's module or calls the student's function on
  the inputs of a `Spec`, runs a backward pass, and returns raw tensors only: the outputs, the
  gradients of the inputs and of the loaded parameters, the inputs as they are after the call,
  and what the named submodules saw (for localizing a mistake).
* `Checker.judge` (the *trusted side*) computes the expected values itself, with the checker's own
  reference written in float64, and compares. It names the mistake when the raw output matches a
  known wrong variant, and otherwise says where the student's computation first leaves the
  reference.

In a notebook both halves run in the student's process (`run_in_process`), for instant feedback.
The grader runs the student side in a sandboxed child process and the trusted side in its own
process (`utils.checks.sandbox`).
"""

from __future__ import annotations

import itertools
import math
import random
import signal
import textwrap
import threading
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

__all__ = [
    "Run",
    "CaseResult",
    "CheckResult",
    "Case",
    "Spec",
    "Checker",
    "Mistake",
    "build_module",
    "exercise",
    "register_runner",
    "run_in_process",
]

ATOL = 1e-4
RTOL = 1e-4
GRAD_ATOL = 1e-4
GRAD_RTOL = 1e-3
CASE_TIMEOUT_S = 10.0  # in a notebook: a case that runs longer is stopped and fails

Runner = Callable[[Any, "Spec", dict[str, torch.Tensor]], Any]
RUNNERS: dict[str, Runner] = {}
"""Student-side runners for kinds of case other than "function" and "module", by kind."""


def register_runner(kind: str, runner: Runner) -> Runner:
    """Make ``exercise`` run cases of ``kind`` with ``runner(obj, spec, inputs)``.

    The runner does what a case of that kind needs with the student's object (call a test the
    student wrote on planted implementations, train a model for a fixed budget, ...) and returns
    what ``spec.outputs`` names, as a tensor or a tuple of tensors. It runs on the student side,
    so it must not compute or hold an expected value. An exception it raises is reported as the
    student's error in the stage "call". An assignment module registers its runners when it is
    imported; ``utils.checks`` imports every assignment module, so both the notebook and the
    grader's child know them.
    """
    if kind in ("function", "module"):
        raise ValueError(f"the kind {kind!r} is built in")
    RUNNERS[kind] = runner
    return runner


@dataclass
class Run:
    """One run of a case in a fresh process of its own, for the grader (see `Checker.isolated`).

    ``oracle(family, k, args)``, when given, answers the calls the student's code makes of the
    implementations that the case hands it (assignment 3's behaviour tests), in the grader's
    own process.
    """

    spec: Spec
    oracle: Callable[[str, int, tuple[Any, ...]], Any] | None = None


# --------------------------------------------------------------------------------------------
# Results


@dataclass
class CaseResult:
    """The outcome of one case: its name, whether it passed, its points, and the hint."""

    name: str
    passed: bool
    hint: str = ""
    points: float = 0.0
    max_points: float = 1.0
    case_id: str = ""
    flag: str = ""  # "timeout", "crashed", "reference used" when one applies

    def line(self) -> str:
        """The one line that reports this case."""
        return f"[PASS] {self.name}" if self.passed else f"[FAIL] {self.name}: {self.hint}"

    def printed(self, width: int = 88) -> str:
        """``line()`` wrapped to ``width`` characters (the book's column holds 88), the lines
        after the first indented under the case's name."""
        return textwrap.fill(self.line(), width=width, subsequent_indent=" " * 7,
                             break_long_words=False, break_on_hyphens=False)


@dataclass
class CheckResult:
    """What a checker returns: the cases it ran, ``passed`` and ``score`` for a grader."""

    check: str
    cases: list[CaseResult] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        """True when every case passed."""
        return bool(self.cases) and all(c.passed for c in self.cases)

    @property
    def points(self) -> float:
        """The points earned."""
        return float(sum(c.points for c in self.cases))

    @property
    def max_points(self) -> float:
        """The points all cases are worth."""
        return float(sum(c.max_points for c in self.cases))

    @property
    def score(self) -> float:
        """The fraction of the points earned, from 0 to 1."""
        return self.points / self.max_points if self.max_points else 0.0

    @property
    def hints(self) -> list[str]:
        """The hints of the failed cases."""
        return [c.hint for c in self.cases if not c.passed]

    def summary(self) -> str:
        """The last printed line."""
        n_pass = sum(c.passed for c in self.cases)
        return f"{self.check}: {n_pass}/{len(self.cases)} cases passed (score {self.score:.2f})"

    def __repr__(self) -> str:
        return f"CheckResult({self.check!r}, passed={self.passed}, score={self.score:.2f})"


# --------------------------------------------------------------------------------------------
# What a case sends to the student side


@dataclass
class Spec:
    """Everything the student side needs to run one case, as plain data and tensors.

    ``kind`` is "function" (call the object) or "module" (build ``obj(*ctor_args,
    **ctor_kwargs)``, copy ``params`` into it by attribute path, set ``train``, call it). ``args``
    and ``kwargs`` name tensors of ``tensors``. ``outputs`` names what the call returns (a tuple
    when there are several). ``grad_out`` holds the upstream gradient of each output for the
    backward pass; ``grad_inputs`` the inputs whose gradients are compared. ``trace`` names the
    submodules whose first input and output are recorded.
    """

    kind: str
    tensors: dict[str, torch.Tensor]
    args: list[str]
    kwargs: dict[str, str] = field(default_factory=dict)
    literals: list[Any] = field(default_factory=list)  # plain positional arguments (a function)
    ctor_args: list[Any] = field(default_factory=list)
    ctor_kwargs: dict[str, Any] = field(default_factory=dict)
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    train: bool = False
    outputs: list[str] = field(default_factory=lambda: ["output"])
    out_dtype: str = "torch.float32"
    grad_out: dict[str, torch.Tensor] = field(default_factory=dict)
    grad_inputs: list[str] = field(default_factory=list)
    trace: list[str] = field(default_factory=list)
    seed: int = 0
    config: dict[str, Any] = field(default_factory=dict)  # for the trusted side only

    def to_payload(self) -> dict[str, Any]:
        """A dict of tensors and plain values (``torch.save``-able, ``weights_only`` loadable)."""
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    @classmethod
    def from_payload(cls, payload: dict[str, Any]) -> Spec:
        """The inverse of `to_payload`."""
        return cls(**{k: payload[k] for k in cls.__dataclass_fields__ if k in payload})


# --------------------------------------------------------------------------------------------
# The student side


class StudentError(Exception):
    """Stops a case on the student side; ``stage`` says where (build, load, call, type, ...)."""

    def __init__(self, stage: str, message: str):
        super().__init__(message)
        self.stage = stage
        self.message = message


class CaseTimeout(BaseException):
    """Raised inside a case that ran past its time limit (in-process runs only)."""


def _one_line(text: Any, limit: int = 200) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _exception_text(exc: BaseException) -> str:
    if isinstance(exc, NotImplementedError):
        return "NotImplementedError"
    return f"{type(exc).__name__}: {_one_line(exc) or '(no message)'}"


def _resolve(root: Any, path: str) -> tuple[Any, str]:
    """The object that owns the last name of ``path`` ("self_attn.w_q.weight") and that name."""
    *owners, last = path.split(".")
    obj = root
    for i, name in enumerate(owners):
        nxt = getattr(obj, name, None)
        if nxt is None:
            where = ".".join(owners[: i + 1])
            raise StudentError("load", f"your module has no attribute `{where}`")
        obj = nxt
    return obj, last


def _load_params(module: nn.Module, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Copy each value of ``params`` into the student's tensor at that path; return them."""
    loaded = {}
    for path, value in params.items():
        owner, name = _resolve(module, path)
        target = getattr(owner, name, None)
        if not isinstance(target, torch.Tensor):
            raise StudentError("load", f"your module has no tensor `{path}` (expected shape "
                                       f"{tuple(value.shape)})")
        if tuple(target.shape) != tuple(value.shape):
            raise StudentError("load", f"`{path}` has shape {tuple(target.shape)}, expected "
                                       f"{tuple(value.shape)}")
        with torch.no_grad():
            target.copy_(value.to(target.dtype))
        loaded[path] = target
    return loaded


def _detached(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().cpu()


def build_module(obj: Any, spec: Spec) -> nn.Module:
    """The student's module, ``obj(*spec.ctor_args, **spec.ctor_kwargs)``; any error in the
    student's constructor, or something other than an ``nn.Module``, stops the case at the
    stage "build" (a `StudentError`). For runners of other kinds of case too."""
    try:
        module = obj(*spec.ctor_args, **spec.ctor_kwargs)
    except CaseTimeout:
        raise
    except BaseException as exc:  # the student's mistake: report it
        raise StudentError("build", _exception_text(exc)) from None
    if not isinstance(module, nn.Module):
        raise StudentError("build", f"building it returned {type(module).__name__}, "
                                    "not an nn.Module")
    return module


def exercise(obj: Any, spec: Spec) -> dict[str, Any]:
    """Run ``obj`` on one case; return raw tensors and notes, never raise for the student's code.

    The result has ``status`` ("ok" or the stage that failed: build, load, call, type,
    backward), ``message``, ``tensors`` (a flat dict: ``out:NAME``, ``in:NAME``, ``grad:NAME``,
    ``pgrad:PATH``, ``trace_in:NAME``, ``trace_out:NAME``) and ``notes`` (strings).
    """
    tensors: dict[str, torch.Tensor] = {}
    notes: list[str] = []
    result: dict[str, Any] = {"status": "ok", "message": "", "tensors": tensors, "notes": notes}
    inputs = {k: v.clone() for k, v in spec.tensors.items()}
    for name in spec.grad_inputs:
        inputs[name].requires_grad_(True)
    hooks: list[Any] = []
    try:
        loaded: dict[str, torch.Tensor] = {}
        if spec.kind == "module":
            module = build_module(obj, spec)
            loaded = _load_params(module, spec.params)
            module.train(spec.train)
            for name in spec.trace:
                sub = getattr(module, name, None)
                if isinstance(sub, nn.Module):
                    hooks.append(sub.register_forward_hook(_recorder(name, tensors)))
            fn: Any = module
        elif spec.kind in RUNNERS:
            fn = None
        else:
            if not callable(obj):
                raise StudentError("type", f"expected a function, got {type(obj).__name__}")
            fn = obj
        args = [inputs[n] for n in spec.args] + list(spec.literals)
        kwargs = {k: inputs[n] for k, n in spec.kwargs.items()}
        torch.manual_seed(spec.seed)
        try:
            got = RUNNERS[spec.kind](obj, spec, inputs) if fn is None else fn(*args, **kwargs)
        except CaseTimeout:
            raise
        except StudentError:
            raise
        except BaseException as exc:
            raise StudentError("call", _exception_text(exc)) from None
        outs = _outputs(got, spec.outputs)
        for name, out in outs.items():
            tensors[f"out:{name}"] = _detached(out)
        for name in spec.tensors:
            tensors[f"in:{name}"] = _detached(inputs[name])
        pairs = [(outs[n], g) for n, g in spec.grad_out.items()
                 if n in outs and outs[n].requires_grad and outs[n].shape == g.shape]
        if spec.grad_out and not any(o.requires_grad for o in outs.values()):
            notes.append("detached")
        if pairs:
            try:
                torch.autograd.backward([o for o, _ in pairs],
                                        [g.to(o.dtype) for o, g in pairs])
            except CaseTimeout:
                raise
            except BaseException as exc:
                raise StudentError("backward", _exception_text(exc)) from None
            for name in spec.grad_inputs:
                if inputs[name].grad is not None:
                    tensors[f"grad:{name}"] = _detached(inputs[name].grad)
            for path, t in loaded.items():
                if t.grad is not None:
                    tensors[f"pgrad:{path}"] = _detached(t.grad)
    except StudentError as err:
        result["status"], result["message"] = err.stage, err.message
    finally:
        for h in hooks:
            h.remove()
    return result


def _recorder(name: str, store: dict[str, torch.Tensor]) -> Callable[..., None]:
    def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if f"trace_out:{name}" in store:
            return  # only the first call
        if args and isinstance(args[0], torch.Tensor):
            store[f"trace_in:{name}"] = _detached(args[0])
        if isinstance(output, torch.Tensor):
            store[f"trace_out:{name}"] = _detached(output)
    return hook


def _describe(value: Any) -> str:
    if value is None:
        return "None (did you forget a `return`?)"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}"
    return type(value).__name__


def _outputs(got: Any, names: Sequence[str]) -> dict[str, torch.Tensor]:
    if list(names) == ["*"]:  # a runner that names its own outputs (a model's state, ...)
        if not isinstance(got, dict) or not all(
                isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in got.items()):
            raise StudentError("type", f"returned {_describe(got)}, expected tensors by name")
        return dict(got)
    if len(names) == 1:
        if not isinstance(got, torch.Tensor):
            extra = ": return the tensor alone" if isinstance(got, (tuple, list)) else ""
            raise StudentError("type", f"returned {_describe(got)}, expected a torch.Tensor{extra}")
        got = (got,)
    elif not isinstance(got, (tuple, list)) or len(got) != len(names):
        raise StudentError("type", f"returned {_describe(got)}, expected a tuple "
                                   f"({', '.join(names)})")
    out = {}
    for name, value in zip(names, got, strict=True):
        if not isinstance(value, torch.Tensor):
            raise StudentError("type", f"the {name} is {_describe(value)}, expected a "
                                       "torch.Tensor")
        out[name] = value
    return out


# --------------------------------------------------------------------------------------------
# Global state: every case starts from the same state and leaves it as it found it


class GlobalState:
    """Saves torch's, Python's and NumPy's global state; `restore` puts it back."""

    def __init__(self) -> None:
        self.dtype = torch.get_default_dtype()
        self.grad = torch.is_grad_enabled()
        self.torch_rng = torch.get_rng_state()
        self.py_rng = random.getstate()
        self.np_rng = np.random.get_state()  # noqa: NPY002 (the global generator is the state)
        self.deterministic = torch.are_deterministic_algorithms_enabled()
        self.threads = torch.get_num_threads()
        self.anomaly = torch.is_anomaly_enabled()

    def restore(self) -> None:
        """Put every saved value back."""
        torch.set_default_dtype(self.dtype)
        torch.set_grad_enabled(self.grad)
        torch.set_rng_state(self.torch_rng)
        random.setstate(self.py_rng)
        np.random.set_state(self.np_rng)  # noqa: NPY002
        torch.use_deterministic_algorithms(self.deterministic)
        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        torch.set_anomaly_enabled(self.anomaly)


def guarded_exercise(obj: Any, spec: Spec, timeout: float | None = None) -> dict[str, Any]:
    """`exercise` from a clean global state, restored afterwards, stopped after ``timeout`` s.

    The timeout uses SIGALRM, so it applies only in the main thread; elsewhere (and when
    ``timeout`` is None) the case runs without one.
    """
    saved = GlobalState()
    use_alarm = (timeout is not None and hasattr(signal, "setitimer")
                 and threading.current_thread() is threading.main_thread())
    previous = None
    try:
        torch.set_default_dtype(torch.float32)
        torch.set_grad_enabled(True)
        if use_alarm:
            previous = signal.signal(signal.SIGALRM, _raise_timeout)
            signal.setitimer(signal.ITIMER_REAL, float(timeout))
        try:
            return exercise(obj, spec)
        except CaseTimeout:
            return {"status": "timeout", "message": f"did not finish within {timeout:g} s",
                    "tensors": {}, "notes": []}
    finally:
        if use_alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        saved.restore()


def _raise_timeout(signum: int, frame: Any) -> None:
    raise CaseTimeout()


# --------------------------------------------------------------------------------------------
# The trusted side: references, mistakes, judging


def shape_str(shape: Sequence[int]) -> str:
    """(2, 5, 8) as text."""
    return "(" + ", ".join(str(int(s)) for s in shape) + ")"


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


Forward = Callable[..., tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]]


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


def _allclose(a: torch.Tensor, b: torch.Tensor, atol: float, rtol: float,
              equal_nan: bool = False) -> bool:
    return tuple(a.shape) == tuple(b.shape) and bool(torch.allclose(
        a.detach().double(), b.detach().double(), atol=atol, rtol=rtol, equal_nan=equal_nan))


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest absolute difference (NaN counts as infinite)."""
    d = (a.detach().double() - b.detach().double()).abs()
    d = torch.nan_to_num(d, nan=math.inf)
    return float(d.max()) if d.numel() else 0.0


def _fmt(x: float) -> str:
    return "inf" if not math.isfinite(x) else f"{x:.1e}"


class Checker:
    """A checker: the graded object, its cases, a trusted reference and its known mistakes.

    Subclasses (one per assignment piece) define `forward`, the reference with switches that
    reproduce mistakes, and may refine `localize`. ``target`` is the name the assignment asks
    the student to define; ``what`` says what it is in hints ("your function").
    """

    name: str = ""
    target: str = ""
    what: str = "your function"
    mistakes: Sequence[Mistake] = ()
    shape_desc: dict[str, str] = {}
    combine_pairs: bool = True

    def __init__(self, cases: Sequence[Case]):
        self.cases = list(cases)

    # -- the reference ------------------------------------------------------------------------

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
            pairs = [(outs[n], g.double()) for n, g in spec.grad_out.items()
                     if outs[n].requires_grad]
            leaves = [x[n] for n in spec.grad_inputs] + list(p.values())
            if pairs and leaves:
                got = torch.autograd.grad([o for o, _ in pairs], leaves,
                                          [g for _, g in pairs], allow_unused=True)
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
            pool = [m for m in self.mistakes if m.combine and not m.grad_only]
            for m1, m2 in itertools.combinations(pool, 2):
                if not set(m1.options) & set(m2.options):
                    out.append(Mistake(f"{m1.hint}; and {m2.hint}", {**m1.options, **m2.options}))
        return out

    def extra_variants(self, spec: Spec, raw: dict[str, torch.Tensor]) -> list[Mistake]:
        """Mistakes that depend on the student's output (an estimated constant, ...)."""
        return []

    # -- judging ------------------------------------------------------------------------------

    def judge(self, spec: Spec, raw: dict[str, Any]) -> str | None:
        """None when the raw result matches the reference, else the hint for the student."""
        status = raw.get("status")
        message = raw.get("message", "")
        if status == "timeout":
            return f"{self.what} {message}: an endless loop, or far too much work?"
        if status == "build":
            if message == "NotImplementedError":
                return "not implemented yet (building your module raises NotImplementedError)"
            return f"building your module failed: {message}"
        if status == "load":
            return (f"{message}: the checker copies known weights into it by that name, as the "
                    "assignment specifies")
        if status == "call":
            if message == "NotImplementedError":
                return f"{self.what} is not implemented yet (it raises NotImplementedError)"
            return f"{self.what} raised {message}"
        if status == "type":
            return f"{self.what} {message}" if message.startswith("returned") else message
        if status == "backward":
            return f"the output is right or close, but the backward pass raised {message}"
        if status != "ok":
            return f"this case could not run ({status}: {message})"
        tensors: dict[str, torch.Tensor] = raw["tensors"]
        for name, original in spec.tensors.items():  # inputs must come back unmodified
            after = tensors.get(f"in:{name}")
            if after is not None and not (after.shape == original.shape
                                          and torch.equal(after, original)):
                return (f"{self.what} changes its input `{name}` in place (for example "
                        f"`{name}.sub_(...)`, `{name} -= ...` or `{name}[...] = ...`): compute on "
                        "new tensors and leave the caller's tensors as they were")
        ref = self.evaluate(spec)
        for name in spec.outputs:
            hint = self._judge_output(spec, raw, ref, name)
            if hint:
                return hint if name == spec.outputs[0] else f"the {spec.outputs[0]} is right but " \
                    + hint
        for name in spec.outputs:
            got = tensors[f"out:{name}"]
            if str(got.dtype) != spec.out_dtype:
                return (f"the values are right but the {name} has dtype {got.dtype}; the reference"
                        f" returns {spec.out_dtype} (the dtype of the input, or torch's default "
                        "dtype): convert back at the end if you compute in another precision")
        return self._judge_grads(spec, raw, ref)

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
        if _allclose(got, want, ATOL, RTOL):
            return None
        for m in self.all_mistakes() + self.extra_variants(spec, raw["tensors"]):
            if m.grad_only:
                continue
            try:
                cand = self.evaluate(spec, grads=False, **m.options)[f"out:{name}"]
            except Exception:  # a variant that cannot run on this case cannot match
                continue
            if _allclose(got, cand, ATOL, RTOL, equal_nan=True):
                return m.hint
        if not torch.isfinite(got.double()).all() and torch.isfinite(want).all():
            return f"the {name} contains NaN or inf where the reference has none" + \
                self._where(spec, raw, ref)
        located = self.localize(spec, raw["tensors"], ref, name)
        diff = max_diff(got, want)
        return (f"the {name} differs from the reference (max |diff| = {_fmt(diff)}) and matches "
                f"none of the known mistakes; {located}")

    def _where(self, spec: Spec, raw: dict[str, Any], ref: dict[str, torch.Tensor]) -> str:
        first = self.first_divergence(spec, raw["tensors"], ref)
        return f"; {first}" if first else ""

    def _judge_grads(self, spec: Spec, raw: dict[str, Any],
                     ref: dict[str, torch.Tensor]) -> str | None:
        if not spec.grad_out:
            return None
        tensors = raw["tensors"]
        if "detached" in raw.get("notes", []):
            return ("the values are right but the output is detached from the autograd graph "
                    "(.detach(), .data, torch.no_grad() or a tensor rebuilt from numbers): no "
                    "gradient can flow back through it")
        wanted = [k for k in ref if k.startswith(("grad:", "pgrad:"))]
        for key in wanted:
            got = tensors.get(key)
            label = _grad_label(key)
            if got is None and not ref[key].any():
                continue  # nothing flows there in the reference either (a dropped sublayer)
            if got is None:
                return (f"the values are right but no gradient reaches {label}: something in "
                        "between is detached or recomputed outside autograd")
            want = ref[key]
            if _allclose(got, want, GRAD_ATOL, GRAD_RTOL):
                continue
            if not torch.isfinite(got.double()).all() and torch.isfinite(want).all():
                return (f"the values are right but the gradient of {label} contains NaN or "
                        "inf: " + self.nan_grad_hint)
            for m in self.mistakes:
                if not m.grad_only:
                    continue
                cand = self.evaluate(spec, **m.options).get(key)
                if cand is not None and _allclose(got, cand, GRAD_ATOL, GRAD_RTOL):
                    return "the values are right but the gradient is not: " + m.hint
            return (f"the values are right but the gradient of {label} differs from the "
                    f"reference (max |diff| = {_fmt(max_diff(got, want))}): part of your "
                    "computation is detached, done in place on a tensor autograd needs, or "
                    "not differentiable")
        return None

    nan_grad_hint = ("a value that is NaN in the forward pass and hidden afterwards (by "
                     "nan_to_num, masked_fill or torch.where) still sends NaN backward; avoid "
                     "computing it at all")

    # -- localizing ---------------------------------------------------------------------------

    def shape_note(self, spec: Spec, name: str, shape: tuple[int, ...]) -> str:
        """A note on a wrong shape that is a known slip ("transposed"), or ""."""
        return ""

    def first_divergence(self, spec: Spec, tensors: dict[str, torch.Tensor],
                         ref: dict[str, torch.Tensor]) -> str:
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
            if not _allclose(got, want, ATOL, RTOL):
                if stage == "trace_in":
                    return (f"the first difference is in what goes into `{name}` (max |diff| = "
                            f"{_fmt(max_diff(got, want))}): look at the steps before it")
                return (f"`{name}` gets the right input but its output differs (max |diff| = "
                        f"{_fmt(max_diff(got, want))}): look at `{name}` itself")
        if order:
            return ("every watched submodule sees and returns the right values, so the "
                    "difference comes after them (how their results are combined)")
        return ""

    def localize(self, spec: Spec, tensors: dict[str, torch.Tensor],
                 ref: dict[str, torch.Tensor], name: str) -> str:
        """Where the student's computation first leaves the reference."""
        return self.first_divergence(spec, tensors, ref) or \
            "compare your code with the formula step by step"

    # -- running in the student's own process ---------------------------------------------------

    def specs(self, seed: int | None = None) -> list[Spec]:
        """The spec of every case; fixed values when ``seed`` is None, fresh ones otherwise."""
        out = []
        for i, case in enumerate(self.cases):
            gen = torch.Generator().manual_seed(1000 * (i + 1) if seed is None else seed + i)
            out.append(case.make(gen))
        return out

    def result(self, case: Case, hint: str | None, flag: str = "") -> CaseResult:
        """A `CaseResult` for ``case``: full points when ``hint`` is None."""
        ok = hint is None and not flag
        return CaseResult(case.name, ok, hint or "", case.points if ok else 0.0, case.points,
                          case.id, flag)


def _grad_label(key: str) -> str:
    kind, name = key.split(":", 1)
    return f"the input `{name}`" if kind == "grad" else f"the parameter `{name}`"


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
