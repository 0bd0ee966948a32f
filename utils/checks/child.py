"""The sandboxed child of the grader: runs one submission's code, then exercises it case by case.

It starts in a folder of its own that holds a copy of the notebook only, with the grader's pipes
on its standard input and output. Usually `utils.checks.zygote` forks it from a process that has
already imported torch; without ``os.fork`` `utils.checks.sandbox` starts it afresh as ``python
-I -m utils.checks.child``. Either way, `serve` then does the same: it reads its instructions from
the grader, sets its own resource limits, keeps private copies of its pipes (the student's prints
go to a log file), installs the `Monitor`, runs the notebook's code cells, and answers each case
with raw tensors. It never says whether a case passed: the grader decides.
"""

from __future__ import annotations

import builtins
import os
import re
import resource
import sys
from typing import Any

import torch

from .core import Spec, guarded_exercise
from .guard import Monitor
from .protocol import read_trusted, write_frame

_MAGIC = re.compile(r"^\s*[%!]")


def _limit(limits: dict[str, Any]) -> None:
    mem = int(limits["memory_mb"]) * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    cpu = int(limits["cpu_s"])
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
    size = 64 * 2**20
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _one_thread(n: int) -> None:
    """Stands for torch.set_num_threads in the child: the grader runs everything on one thread."""


def _error_text(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    text = text if len(text) <= 200 else text[:197] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _describe_target(obj: Any) -> dict[str, Any]:
    if obj is None:
        return {"exists": False}
    info: dict[str, Any] = {"exists": True, "type": type(obj).__name__}
    if isinstance(obj, type):
        info["mro"] = [[str(c.__module__), str(c.__qualname__)] for c in obj.__mro__]
    else:
        info["mro"] = [[str(getattr(obj, "__module__", "")), str(getattr(obj, "__qualname__", ""))]]
    return info


def serve() -> None:
    """Run the protocol until the grader says "end" (or the student's code ends the process).

    Nothing of the student's runs before the limits and the monitor are in place.
    """
    inp, out = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    log = os.open("output.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(null)
    os.close(log)
    start = read_trusted(inp)
    _limit(start["limits"])
    torch.set_num_threads(1)
    # One thread for good: a notebook's torch.set_num_threads(n) is ignored, so that the only
    # thread is the main one and any other is the notebook's own (see Monitor.check_threads).
    torch.set_num_threads = _one_thread

    def report(kind: str, detail: str) -> None:
        write_frame(out, {"op": "flag", "kind": kind, "detail": detail[:300]})

    monitor = Monitor(start["rules"], os.getcwd(), start["readable"], start["forbidden_files"],
                      report)
    ns: dict[str, Any] = {"__name__": "__main__", "__builtins__": builtins}
    errors = []
    monitor.install()
    for i, src in enumerate(start["cells"]):
        src = "\n".join(ln for ln in src.splitlines() if not _MAGIC.match(ln))
        try:
            exec(compile(src, f"<cell {i + 1}>", "exec"), ns)
        except BaseException as exc:  # the student's error: note it, run the next cell
            errors.append({"cell": i + 1, "error": _error_text(exc)})
    targets = {name: _describe_target(ns.get(name)) for name in start["targets"]}
    monitor.check_threads()
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
            monitor.watch_calls()
            try:
                raw = guarded_exercise(obj, Spec.from_payload(msg["spec"]), None)
            finally:
                monitor.stop_watching_calls()
        monitor.check_threads()
        write_frame(out, {"op": "result", "id": msg["id"], "raw": raw}, tensors=True)
    sys.stdout.flush()
    os._exit(0)


def main() -> None:
    """The entry point of a child started as a fresh process."""
    try:
        serve()
    finally:
        os._exit(70)  # only reached when the grader went away before "end"


if __name__ == "__main__":
    main()
