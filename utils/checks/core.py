"""The shared core of the checkers (every assignment): running student code on a case.

A checker is a list of cases (`checker.Case`) and a trusted reference. Running a case has two
halves that never need to live in the same process:

* `exercise` (the *student side*, this module) builds the student's module or calls the
  student's function on the inputs of a `Spec`, runs a backward pass, and returns raw tensors
  only: the outputs, the gradients of the inputs and of the loaded parameters, the inputs as they
  are after the call, and what the named submodules saw (for localizing a mistake).
* `checker.Checker.judge` (the *trusted side*) computes the expected values itself, with the
  checker's own reference written in float64, and compares (`compare`). It names the mistake
  when the raw output matches a known wrong variant, and otherwise says where the student's
  computation first leaves the reference.

In a notebook both halves run in the student's process (`checker.run_in_process`), for instant
feedback, and give `results.CheckResult`. The grader runs the student side in a sandboxed child
process and the trusted side in its own process (`grader.sandbox`): this module, `results`
and `runners` are all the child holds of the checkers.
"""

from __future__ import annotations

import random
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from .. import set_deterministic_algorithms

__all__ = [
    "Run",
    "Spec",
    "build_module",
    "exercise",
    "guarded_exercise",
    "register_runner",
    "student_code",
]

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


@contextmanager
def student_code(stage: str, passing: tuple[type[BaseException], ...] = (
        CaseTimeout, StudentError)) -> Iterator[None]:
    """Run the student's code inside: any exception it raises (but those of ``passing``, which go
    through) stops the case as a `StudentError` of ``stage``, with the exception in one line."""
    try:
        yield
    except passing:
        raise
    except BaseException as exc:  # the student's mistake: report it
        raise StudentError(stage, _exception_text(exc)) from None


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
    with student_code("build", passing=(CaseTimeout,)):
        module = obj(*spec.ctor_args, **spec.ctor_kwargs)
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
        with student_code("call"):
            got = RUNNERS[spec.kind](obj, spec, inputs) if fn is None else fn(*args, **kwargs)
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
            with student_code("backward", passing=(CaseTimeout,)):
                torch.autograd.backward([o for o, _ in pairs],
                                        [g.to(o.dtype) for o, g in pairs])
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
        self.deterministic_warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
        self.threads = torch.get_num_threads()
        self.anomaly = torch.is_anomaly_enabled()

    def restore(self) -> None:
        """Put every saved value back."""
        torch.set_default_dtype(self.dtype)
        torch.set_grad_enabled(self.grad)
        torch.set_rng_state(self.torch_rng)
        random.setstate(self.py_rng)
        np.random.set_state(self.np_rng)  # noqa: NPY002
        set_deterministic_algorithms(self.deterministic, warn_only=self.deterministic_warn_only)
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
