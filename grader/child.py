"""The sandboxed child of the grader: runs one submission's code, then exercises it case by case.

`grader.zygote` forks it from a process that has imported torch and the student side of the
checkers (`utils.checks.core`, `results`, `runners`), never a checker's reference. `serve` reads
its instructions from the grader and, before the notebook's first line runs:

1. sends the student's prints to /dev/null (nothing is displayed while grading) and keeps
   private copies of its pipes;
2. imports the modules whose forbidden parts it must poison, and poisons them (`poison`):
   torch's forbidden operators through the dispatcher, forbidden Python code in place;
3. stands in for IPython (``get_ipython()``: the magics that run code run it once,
   ``%%writefile`` writes its file, ``%run`` runs one as IPython does, shell commands and the
   other magics do nothing; the names IPython gives a notebook without an import: ``display``,
   which shows nothing here, ``In``, ``Out``, ``_ih``, ``_oh``, ``_dh``, ``_i``, ``_iN``; each
   cell's source in `linecache`, so that `inspect.getsource` and ``@torch.jit.script`` find it)
   and for the checkers (``from utils.checks import check_...`` gives a function that does
   nothing);
4. sets its resource limits, enters IPC, network, host-name and control-group namespaces of its
   own (its control groups were made by the grader before it started), gives up every
   privilege (`kernel`), confines itself with
   Landlock (read only what it needs, write only in its own folder), installs the seccomp
   filter (no process, no exec, no socket, no signal to another process), and last an audit
   hook (no ctypes, no walk through every object of the process).

Only then does it run the notebook's code cells and answer each case with raw tensors. It never
says whether a case passed: the grader decides. A step of 4 that fails stops the child before
the notebook runs, unless the grader said ``insecure``.
"""

from __future__ import annotations

import builtins
import os
import sys
import types
from typing import Any

import numpy as np
import torch

from utils.checks import runners
from utils.checks.core import Spec, guarded_exercise
from utils.checks.results import CheckResult

from . import kernel
from .ipython_shell import Shell, install, remember_source
from .poison import Reporter, install_audit_hook, poison_operators, poison_python
from .protocol import read_trusted, write_frame

MAX_CALLS = 2000  # oracle calls in one case


def _one_thread(n: int) -> None:
    """Stands for torch.set_num_threads in the child: the grader runs everything on one thread."""


def _error_text(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    text = text if len(text) <= 200 else text[:197] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _describe_target(obj: Any) -> dict[str, Any]:
    if obj is None:
        return {"exists": False, "type": "", "mro": []}
    info: dict[str, Any] = {"exists": True, "type": type(obj).__name__[:100]}
    if isinstance(obj, type):
        info["mro"] = [[str(c.__module__)[:200], str(c.__qualname__)[:200]]
                       for c in obj.__mro__][:50]
    else:
        info["mro"] = [[str(getattr(obj, "__module__", ""))[:200],
                        str(getattr(obj, "__qualname__", ""))[:200]]]
    return info


def _stub_checkers() -> None:
    """``from utils.checks import check_...`` gives a checker that does nothing in the grader."""
    checks = sys.modules["utils.checks"]

    def stub(*args: Any, **kwargs: Any) -> CheckResult:
        return CheckResult("not run while grading")

    def getattr_(name: str) -> Any:
        if name.startswith("check_"):
            return stub
        raise AttributeError(f"module 'utils.checks' has no attribute {name!r}")

    checks.__getattr__ = getattr_  # type: ignore[attr-defined]


def _plain(value: Any, depth: int = 0) -> Any:
    """An argument of a planted implementation as data the grader accepts."""
    if depth > 4:
        raise TypeError("the checker's implementations take ints, lists and tensors")
    if isinstance(value, torch.Tensor):
        if value.numel() > 65536:
            raise ValueError("a tensor too large for the checker's implementations")
        return value.detach().cpu().clone()
    if isinstance(value, np.ndarray):
        return _plain(torch.from_numpy(np.ascontiguousarray(value)), depth)
    if isinstance(value, np.generic):
        return value.item()
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, (list, tuple)):
        if len(value) > 4096:
            raise ValueError("a list too long for the checker's implementations")
        return [_plain(v, depth + 1) for v in value]
    raise TypeError(f"the checker's implementations take ints, lists and tensors, not "
                    f"{type(value).__name__}")


_EXCEPTIONS = {"ValueError": ValueError, "TypeError": TypeError, "IndexError": IndexError,
               "RuntimeError": RuntimeError, "OverflowError": OverflowError}


def _remote_oracle(inp: int, out: int) -> Any:
    """The oracle of "mask_test" cases in the child: ask the grader, which alone knows the
    implementation behind each number."""
    calls = [0]

    def oracle(family: str, k: int, args: tuple[Any, ...]) -> Any:
        calls[0] += 1
        if calls[0] > MAX_CALLS:
            raise RuntimeError(f"more than {MAX_CALLS} calls of the implementation in one case")
        write_frame(out, {"op": "call", "family": family, "k": int(k),
                          "args": [_plain(a) for a in args]})
        answer = read_trusted(inp)
        if answer.get("op") == "reply":
            return answer["value"]
        raise _EXCEPTIONS.get(str(answer.get("type")), RuntimeError)(str(answer.get("message")))

    def reset() -> None:
        calls[0] = 0

    oracle.reset = reset  # type: ignore[attr-defined]
    return oracle


def _confine(start: dict[str, Any], out: int) -> Reporter:
    """Steps 2 to 4 of the module's docstring. Raises on a failed kernel step."""
    reporter = Reporter(out)
    secure = not start.get("insecure")
    limits = start["limits"]
    kernel.set_parent_death_signal()
    poison_python([tuple(t) for t in start["poison_python"]], reporter)
    poison_operators([tuple(t) for t in start["poison_ops"]], reporter)
    _stub_checkers()
    torch.set_num_threads(1)
    # One thread for good: a notebook's torch.set_num_threads(n) is ignored.
    torch.set_num_threads = _one_thread
    if secure:  # the notebook is copied into the tmpfs before the limit on a file's size
        kernel.own_namespaces()
        kernel.scratch_on_tmpfs(os.getcwd(), limits["scratch_bytes"], limits["scratch_files"],
                                (start["notebook"],))
    kernel.set_limits(limits["memory_mb"], limits["cpu_s"], limits.get("file_mb", 16),
                      limits.get("open_files", 64))
    if secure:
        kernel.drop_privileges()
        kernel.landlock(start["readable"] + [kernel.own_proc()], [os.getcwd()],
                        start["listable"])
        kernel.seccomp()
    # Last: the hook refuses ctypes, which the steps above use.
    install_audit_hook([tuple(m) for m in start["forbidden_modules"]], start["source_roots"],
                       reporter, os.getcwd())
    return reporter


def serve() -> None:
    """Run the protocol until the grader says "end" (or the student's code ends the process).

    Nothing of the student's runs before the limits, the poison and the confinement are in
    place.
    """
    inp, out = os.dup(0), os.dup(1)
    # What the cells print goes nowhere, as nothing is displayed while grading: not into a file,
    # whose size limit would fail a print (and the cell) past 16 MB of output.
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)
    start = read_trusted(inp)
    try:
        _confine(start, out)
    except Exception as exc:  # noqa: BLE001 (a kernel step failed: nothing of the student's runs)
        write_frame(out, {"op": "fatal", "error": _error_text(exc)})
        os._exit(71)
    # The grader takes a "fatal" message (its own fault) only before this one: after it, the
    # student's code runs, and could write one.
    write_frame(out, {"op": "confined"})
    oracle = _remote_oracle(inp, out)
    runners.set_oracle(oracle)
    sys.modules["__main__"] = types.ModuleType("__main__")
    ns: dict[str, Any] = sys.modules["__main__"].__dict__
    ns["__builtins__"] = builtins
    shell = Shell(ns)
    install(shell)
    inputs: list[str] = [""]
    outputs: dict[int, Any] = {}  # nothing is displayed while grading
    ns.update({"In": inputs, "_ih": inputs, "Out": outputs, "_oh": outputs,
               "_dh": [os.getcwd()], "_i": "", "_ii": "", "_iii": ""})
    sys.path.insert(0, os.getcwd())  # as in Jupyter: a module the notebook wrote is importable
    errors = []
    for i, src in enumerate(start["cells"]):
        inputs.append(src)  # IPython's input history, with its shortcuts
        ns["_iii"], ns["_ii"], ns["_i"] = ns.get("_ii", ""), ns.get("_i", ""), inputs[-2]
        ns[f"_i{i + 1}"] = src
        try:
            name = remember_source(src, f"<cell {i + 1}>")
            # dont_inherit: this module's `from __future__ import annotations` is not the cell's
            exec(compile(src, name, "exec", dont_inherit=True), ns)  # noqa: S102 (the submission)
        except BaseException as exc:  # the student's error: note it, run the next cell
            if len(errors) < 20:
                errors.append({"cell": i + 1, "error": _error_text(exc)})
    targets = {name: _describe_target(ns.get(name)) for name in start["targets"]}
    write_frame(out, {"op": "ready", "errors": errors, "targets": targets})
    while True:
        msg = read_trusted(inp)
        if msg["op"] != "case":
            break
        obj = ns.get(msg["target"])
        if obj is None:
            raw: dict[str, Any] = {"status": "missing", "message": msg["target"],
                                   "tensors": {}, "notes": []}
        else:
            oracle.reset()
            raw = guarded_exercise(obj, Spec.from_payload(msg["spec"]), None)
        write_frame(out, {"op": "result", "id": msg["id"], "raw": raw})
    os._exit(0)


def main() -> None:
    """The entry point of a child started as a fresh process."""
    try:
        serve()
    finally:
        os._exit(70)  # only reached when the grader went away before "end"


if __name__ == "__main__":
    main()
