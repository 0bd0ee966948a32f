"""Grade one submitted notebook in a sandboxed child process: the grader's side.

The grader (this module) never imports or runs the student's code. It runs `utils.checks.child`
in a fresh temporary folder with a copy of the notebook only, a stripped environment, limits on
memory, CPU time and file size, and wall-clock limits of its own: for the notebook's cells, for
each case, and for the whole submission. The child is forked by `utils.checks.zygote`, a process
started once that has imported torch and nothing of any student, which saves the seconds of a
fresh interpreter per child; where ``os.fork`` is missing (or `use_fork` is False) each child is
a fresh process instead. It draws every case's inputs afresh, sends them, reads
back raw tensors, checks their types and sizes, and judges them with the checker's reference in
its own process. A child that hangs is killed and a new one goes on with the next case; a child
that dies takes only its own case with it.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .core import Case, Checker, CheckResult, Spec
from .guard import TAMPER, Assignment, Rule, static_scan
from .protocol import ProtocolError, Reader, write_frame

CHECK_CALL = re.compile(r"\bcheck_\w+\(")
UTILS = Path(__file__).resolve().parent.parent
ROOT = UTILS.parent
MAX_ELEMENTS = 2_000_000  # per returned tensor; every case's tensors are far smaller


@dataclass
class Limits:
    """Wall-clock limits (seconds) and the memory limit (MiB) of one submission's child.

    ``case_s`` is the limit of a case; a case that trains a model asks for more with its own
    ``Case.time_s`` and gets the larger of the two. ``total_s`` bounds the whole notebook.
    """

    case_s: float = 5.0
    cells_s: float = 30.0
    total_s: float = 90.0
    memory_mb: int = 4096


@dataclass
class SubmissionResult:
    """The grade of one notebook: one `CheckResult` per checker, flags and the cells' errors."""

    assignment: str
    checks: list[CheckResult] = field(default_factory=list)
    flags: list[str] = field(default_factory=list)
    cell_errors: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def points(self) -> float:
        """The points earned over every checker."""
        return sum(c.points for c in self.checks)

    @property
    def max_points(self) -> float:
        """The points the assignment is worth."""
        return sum(c.max_points for c in self.checks)

    def flag(self, text: str) -> None:
        """Add ``text`` to the flags once."""
        if text not in self.flags:
            self.flags.append(text)


def code_cells(nb: dict[str, Any]) -> list[str]:
    """The sources of the code cells the student wrote: test cells (the checkers) left out."""
    out = []
    for cell in nb.get("cells", []):
        if not isinstance(cell, dict) or cell.get("cell_type") != "code":
            continue
        src = cell.get("source", "")
        src = "".join(src) if isinstance(src, list) else str(src)
        meta = (cell.get("metadata") or {}).get("nbgrader") or {}
        if (meta.get("grade") and not meta.get("solution")) or CHECK_CALL.search(src):
            continue
        out.append(src)
    return out


def _reference_files(rules: list[Rule]) -> list[str]:
    files = []
    for r in rules:
        if r.kind == "module" and r.target.startswith("utils."):
            path = UTILS / (r.target.split(".", 1)[1].replace(".", "/") + ".py")
            files.append(str(path))
    return files


def _readable() -> list[str]:
    roots = {sys.prefix, sys.base_prefix, sys.exec_prefix, str(UTILS), "/proc", "/sys", "/dev",
             "/etc", "/usr", "/lib", "/lib64", str(Path(torch.__file__).resolve().parent.parent)}
    return sorted(roots)


def _clean_raw(raw: Any, spec: Spec) -> dict[str, Any]:
    """The child's raw result with every value checked: plain strings and bounded tensors."""
    if not isinstance(raw, dict):
        raise ProtocolError("a result that is not a dict")
    status = raw.get("status")
    message = raw.get("message", "")
    if not isinstance(status, str) or not isinstance(message, str):
        raise ProtocolError("a result without a status")
    tensors = {}
    for key, value in (raw.get("tensors") or {}).items():
        if not (isinstance(key, str) and isinstance(value, torch.Tensor)):
            continue
        if value.layout != torch.strided or value.numel() > MAX_ELEMENTS or value.is_quantized:
            continue
        tensors[key] = value.detach().as_subclass(torch.Tensor).clone()
    notes = [n for n in (raw.get("notes") or []) if isinstance(n, str)][:10]
    return {"status": status[:30], "message": message[:300], "tensors": tensors, "notes": notes}


def _child_env(folder: Path) -> dict[str, str]:
    """The whole environment of a child (or of the zygote) whose folder is ``folder``."""
    return {"PATH": "/usr/bin:/bin", "HOME": str(folder), "TMPDIR": str(folder),
            "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1"}


class ZygoteError(Exception):
    """The zygote could not start, or stopped answering."""


class Zygote:
    """The grader's end of `utils.checks.zygote`: one pre-started process that forks children.

    Thread-safe: each request and its answer hold a lock, so the threads of the command line can
    share one zygote.
    """

    def __init__(self, start_timeout: float = 120.0):
        self.dir = Path(tempfile.mkdtemp(prefix="grade-zygote-"))
        self.lock = threading.Lock()
        self.broken = False
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-I", "-B", "-m", "utils.checks.zygote", str(theirs.fileno())],
                cwd=self.dir, env=_child_env(self.dir), stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                pass_fds=(theirs.fileno(),), start_new_session=True)
        finally:
            theirs.close()
        self.sock = ours
        try:
            hello = self._receive(start_timeout)
        except ZygoteError:
            self.close()
            raise
        if hello.get("op") != "hello" or hello.get("threads") != 1:
            self.close()
            raise ZygoteError(f"the zygote is not single-threaded ({hello.get('threads')})")

    def _receive(self, timeout: float) -> dict[str, Any]:
        self.sock.settimeout(timeout)
        try:
            data = self.sock.recv(65536)
        except OSError as exc:
            raise ZygoteError(f"no answer from the zygote ({type(exc).__name__})") from None
        if not data:
            raise ZygoteError("the zygote has gone")
        try:
            answer = json.loads(data.decode())
        except ValueError:
            raise ZygoteError("an unreadable answer from the zygote") from None
        if not isinstance(answer, dict):
            raise ZygoteError("an unreadable answer from the zygote")
        return answer

    def _call(self, message: dict[str, Any], fds: list[int] | None = None,
              timeout: float = 30.0) -> dict[str, Any]:
        with self.lock:
            if self.broken:
                raise ZygoteError("the zygote stopped answering earlier")
            try:
                data = json.dumps(message).encode()
                if fds:
                    socket.send_fds(self.sock, [data], fds)
                else:
                    self.sock.send(data)
                return self._receive(timeout)
            except (OSError, ZygoteError) as exc:
                self.broken = True  # a late answer would be read as the next one's: stop here
                raise ZygoteError(f"the zygote has gone ({type(exc).__name__})") from None

    def spawn(self, folder: Path) -> tuple[int, int, int]:
        """Fork a child in ``folder``; (its pid, the fd to write to it, the fd to read from it)."""
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        try:
            answer = self._call({"op": "spawn", "dir": str(folder)}, [to_child_r, from_child_w])
        except ZygoteError:
            for fd in (to_child_w, from_child_r):
                os.close(fd)
            raise
        finally:
            os.close(to_child_r)
            os.close(from_child_w)
        pid = answer.get("pid")
        if not isinstance(pid, int) or pid <= 0:
            for fd in (to_child_w, from_child_r):
                os.close(fd)
            raise ZygoteError("the zygote did not fork")
        return pid, to_child_w, from_child_r

    def kill(self, pid: int) -> bool:
        """Kill the child ``pid`` with its process group, and reap it; False if the zygote is
        gone (and the caller must kill the child itself)."""
        try:
            return self._call({"op": "kill", "pid": pid}).get("ok") is True
        except ZygoteError:
            return False

    def close(self) -> None:
        """Stop the zygote: it kills every child it still has, then exits."""
        with contextlib.suppress(OSError):
            self.sock.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


_zygote: Zygote | None = None
_zygote_failed = False
_zygote_lock = threading.Lock()
use_fork = hasattr(os, "fork") and hasattr(socket, "send_fds") and sys.platform == "linux"
"""Whether children are forked from a zygote; False starts each child as a fresh process."""
children_started = {"forked": 0, "fresh": 0}
"""How many children this process has had forked by its zygote and started afresh."""


def shared_zygote() -> Zygote | None:
    """The zygote of this process, started on first use; None when children start afresh."""
    global _zygote, _zygote_failed
    if not use_fork:
        return None
    with _zygote_lock:
        if _zygote is None and not _zygote_failed:
            try:
                _zygote = Zygote()
                atexit.register(stop_zygote)
            except (ZygoteError, OSError):
                _zygote_failed = True
        return _zygote


def stop_zygote() -> None:
    """Stop the zygote of this process, if it has one (the next grading starts a new one)."""
    global _zygote
    with _zygote_lock:
        if _zygote is not None:
            _zygote.close()
            _zygote = None


class _Child:
    """One running child process and its pipes: forked by the zygote, or a fresh process."""

    def __init__(self, notebook: Path, start: dict[str, Any]):
        self.dir = Path(tempfile.mkdtemp(prefix="grade-"))
        shutil.copy2(notebook, self.dir / notebook.name)
        self.proc: subprocess.Popen[bytes] | None = None
        self.zygote = shared_zygote()
        spawned = None
        if self.zygote is not None:
            try:
                spawned = self.zygote.spawn(self.dir)
            except ZygoteError:
                self.zygote = None
        with _zygote_lock:
            children_started["forked" if spawned is not None else "fresh"] += 1
        if spawned is not None:
            self.pid, self.write_fd, read_fd = spawned
        else:
            self.proc = subprocess.Popen(
                [sys.executable, "-I", "-B", "-m", "utils.checks.child"], cwd=self.dir,
                env=_child_env(self.dir), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL, start_new_session=True)
            self.pid = self.proc.pid
            self.write_fd = os.dup(self.proc.stdin.fileno())
            read_fd = os.dup(self.proc.stdout.fileno())
            self.proc.stdin.close()
            self.proc.stdout.close()
        self.reader = Reader(read_fd)
        self.send(start)

    def send(self, message: dict[str, Any], tensors: bool = False) -> None:
        try:
            write_frame(self.write_fd, message, tensors)
        except OSError:
            pass  # the child is gone: the next read says so

    def kill(self) -> None:
        if self.zygote is None or not self.zygote.kill(self.pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)
        for fd in (self.write_fd, self.reader.fd):
            with contextlib.suppress(OSError):
                os.close(fd)
        if self.proc is not None:
            self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


class Grading:
    """The grading of one notebook for one assignment."""

    def __init__(self, notebook: Path, assignment: Assignment, limits: Limits | None = None,
                 seed: int | None = None):
        self.notebook = notebook
        self.assignment = assignment
        self.limits = limits or Limits()
        self.seed = secrets.randbits(31) if seed is None else seed
        self.result = SubmissionResult(assignment.name)
        # (checker, case, spec) in order; flags per position; hints per position
        self.items: list[tuple[Checker, Case, Spec]] = []
        for j, checker in enumerate(assignment.checkers):
            for case, spec in zip(checker.cases, checker.specs(self.seed + 100 * j), strict=True):
                self.items.append((checker, case, spec))
        self.case_flags: list[list[str]] = [[] for _ in self.items]
        self.outcome: list[tuple[str | None, str] | None] = [None] * len(self.items)
        self.rules = {r.id: r for r in assignment.rules}

    # -- flags ------------------------------------------------------------------------------------

    def _apply_rule(self, rule_id: str, position: int | None, detail: str = "") -> None:
        """Score 0 the cases that ``rule`` voids: every case it applies to for a module (or a use
        seen outside a case), every case of the checker whose case at ``position`` called the
        forbidden code otherwise. The child reports each forbidden call site once, so the first
        case that reaches it is the only one known to; the code that made it runs in the other
        cases of that checker as well."""
        rule = self.rules.get(rule_id)
        if rule is None:
            return
        self.result.flag("reference used")
        self.result.notes.append(f"{rule.reason}" + (f" ({detail})" if detail else ""))
        seen_in = None if position is None else self.items[position][0]
        for i, (checker, _, _) in enumerate(self.items):
            if rule.checks and checker.name not in rule.checks:
                continue
            if rule.kind == "module" or seen_in is None or checker is seen_in:
                if rule.reason not in self.case_flags[i]:
                    self.case_flags[i].append(rule.reason)

    def _on_flag(self, msg: dict[str, Any], position: int | None, ready: bool) -> None:
        kind, detail = str(msg.get("kind", "")), str(msg.get("detail", ""))[:200]
        if kind == "blocked":
            self.result.flag("blocked")
            note = f"the sandbox refused: {detail}"
            if note not in self.result.notes:
                self.result.notes.append(note)
        elif kind == TAMPER:
            self.result.flag("tampering")
            reason = f"the notebook tried {detail}, which the grader does not allow"
            for flags in self.case_flags:
                if reason not in flags:
                    flags.append(reason)
        elif kind == "source":
            self.result.flag("reference used")
            reason = "the notebook tried to read the book's sources or reference code"
            for flags in self.case_flags:
                if reason not in flags:
                    flags.append(reason)
        elif kind in self.rules:
            rule = self.rules[kind]
            if rule.kind == "module":
                self._apply_rule(kind, None, detail)
            elif ready and position is not None:
                self._apply_rule(kind, position, detail)

    # -- running ------------------------------------------------------------------------------

    def _start_message(self, sources: list[str]) -> dict[str, Any]:
        lim = self.limits
        return {
            "op": "start", "cells": sources,
            "rules": [r.to_payload() for r in self.assignment.rules],
            "readable": _readable(), "forbidden_files": _reference_files(self.assignment.rules),
            "targets": sorted({c.target for c, _, _ in self.items}),
            "limits": {"memory_mb": lim.memory_mb, "cpu_s": int(lim.total_s) + 5},
        }

    def run(self) -> SubmissionResult:
        """Grade the notebook; never raises because of what the notebook holds or does."""
        try:
            nb = json.loads(self.notebook.read_text(encoding="utf-8"))
            sources = code_cells(nb)
        except (OSError, ValueError, TypeError, AttributeError) as exc:
            self.result.flag("unreadable")
            hint = f"the notebook could not be read ({type(exc).__name__})"
            return self._finish(default=(hint, "unreadable"))
        for rule_id in static_scan(sources, self.assignment.rules):
            self._apply_rule(rule_id, None, "seen in the notebook's code")
        deadline = time.monotonic() + self.limits.total_s
        position = 0
        while position < len(self.items):
            if time.monotonic() >= deadline:
                break
            position = self._session(sources, position, deadline)
        return self._finish(default=("the time allowed for the whole notebook ran out before "
                                     "this case", "timeout"))

    def _session(self, sources: list[str], position: int, deadline: float) -> int:
        """One child: run the cells, then cases from ``position``; return the next position."""
        child = _Child(self.notebook, self._start_message(sources))
        try:
            ready_by = min(deadline, time.monotonic() + self.limits.cells_s)
            while True:
                try:
                    msg = child.reader.read(ready_by)
                except TimeoutError:
                    self._fail_rest(position, "your notebook's cells did not finish within "
                                    f"{self.limits.cells_s:g} s (an endless loop?)", "timeout")
                    return len(self.items)
                except (EOFError, ProtocolError):
                    self._fail_rest(position, "the notebook ended its own process while its cells "
                                    "ran (os._exit, a signal, or memory use past the limit)",
                                    "crashed")
                    return len(self.items)
                if msg["op"] == "flag":
                    self._on_flag(msg, None, False)
                elif msg["op"] == "ready":
                    self._on_ready(msg)
                    break
            while position < len(self.items):
                checker, case, spec = self.items[position]
                child.send({"op": "case", "id": position, "target": checker.target,
                            "spec": spec.to_payload()}, tensors=True)
                case_s = case.time_limit(self.limits.case_s)
                case_by = min(deadline, time.monotonic() + case_s)
                try:
                    raw = self._await_result(child, position, case_by)
                except TimeoutError:
                    self.outcome[position] = (f"{checker.what} did not finish within "
                                              f"{case_s:g} s: an endless loop, or far "
                                              "too much work?", "timeout")
                    return position + 1
                except (EOFError, ProtocolError):
                    self.outcome[position] = ("the process running your code ended during this "
                                              "case (os._exit, a signal, or memory use past the "
                                              "limit)", "crashed")
                    return position + 1
                self._judge(position, raw)
                position += 1
            child.send({"op": "end"})
            return position
        finally:
            child.kill()

    def _await_result(self, child: _Child, position: int, deadline: float) -> dict[str, Any]:
        while True:
            msg = child.reader.read(deadline)
            if msg["op"] == "flag":
                self._on_flag(msg, position, True)
            elif msg["op"] == "result" and msg.get("id") == position:
                return _clean_raw(msg.get("raw"), self.items[position][2])
            else:
                raise ProtocolError("an unexpected frame")

    def _on_ready(self, msg: dict[str, Any]) -> None:
        for err in (msg.get("errors") or [])[:20]:
            if isinstance(err, dict):
                self.result.cell_errors.append(
                    f"cell {str(err.get('cell'))[:5]}: {str(err.get('error'))[:200]}")
        targets = msg.get("targets") or {}
        for checker in self.assignment.checkers:
            info = targets.get(checker.target) if isinstance(targets, dict) else None
            mro = info.get("mro", []) if isinstance(info, dict) else []
            for entry in mro if isinstance(mro, list) else []:
                if not (isinstance(entry, list) and len(entry) == 2):
                    continue
                module, qualname = (str(e) for e in entry)
                for rule in self.assignment.rules_for(checker.name):
                    if rule.kind == "code" and module == rule.target and (
                            qualname == rule.qualname or
                            qualname.startswith(rule.qualname + ".")):
                        self._apply_rule(rule.id, None, f"{checker.target} is {qualname}")
                    if rule.kind == "module" and (module == rule.target or
                                                  module.startswith(rule.target + ".")):
                        self._apply_rule(rule.id, None, f"{checker.target} is {qualname}")

    def _judge(self, position: int, raw: dict[str, Any]) -> None:
        checker, _, spec = self.items[position]
        if raw["status"] == "missing":
            self.outcome[position] = (f"the notebook defines no `{checker.target}` (after running "
                                      "all its cells)", "")
            return
        try:
            hint = checker.judge(spec, raw)
        except Exception as exc:  # a result the judge cannot handle is the student's loss
            hint = f"the result could not be compared ({type(exc).__name__})"
        self.outcome[position] = (hint, "")

    def _fail_rest(self, position: int, hint: str, flag: str) -> None:
        for i in range(position, len(self.items)):
            if self.outcome[i] is None:
                self.outcome[i] = (hint, flag)

    def _finish(self, default: tuple[str, str]) -> SubmissionResult:
        by_checker: dict[str, CheckResult] = {}
        for i, (checker, case, _) in enumerate(self.items):
            hint, flag = self.outcome[i] or default
            if self.case_flags[i]:
                hint, flag = "flagged: " + "; ".join(self.case_flags[i]), "reference used"
            res = by_checker.setdefault(checker.name, CheckResult(checker.name))
            res.cases.append(checker.result(case, hint, flag))
            if flag and flag != "reference used":
                self.result.flag(flag)
        self.result.checks = list(by_checker.values())
        return self.result


def grade_notebook(notebook: Path, assignment: Assignment, limits: Limits | None = None,
                   seed: int | None = None) -> SubmissionResult:
    """Grade ``notebook`` for ``assignment`` in a sandboxed child process."""
    return Grading(Path(notebook), assignment, limits, seed).run()
