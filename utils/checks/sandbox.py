"""Grade one submitted notebook in confined child processes: the grader's side.

The grader (this module) never imports or runs the student's code. Each child runs in a fresh
scratch folder of its own that holds a private copy of the notebook, with a stripped environment;
before the notebook's first line it poisons the code the assignment forbids and confines itself
with the kernel (`utils.checks.child`, `utils.checks.kernel`): it can read only Python, its
packages and the parts of ``utils`` the assignment allows, write only in its folder, start no
process, run no program, open no socket, signal no other process, and raise none of its limits.

Children are forked by `utils.checks.zygote`, a process started once that has imported torch and
the student side of the checkers and nothing of any student, which saves the seconds of a fresh
interpreter per child; where ``os.fork`` is missing (or `use_fork` is False) each child is a
fresh process instead.

The grader draws every case's inputs afresh, sends them, reads back raw tensors through a
protocol of bounded frames (`utils.checks.protocol`), checks every message against a schema, and
judges with the checker's reference in its own process. Time is counted in CPU seconds of the
child, read from the kernel, with a wall-clock backstop: a slow or busy machine does not make an
honest case fail. A child that hangs, dies, writes too much or sends a malformed message loses
that case only (flag ``timeout``, ``crashed``, ``limits`` or ``protocol``), and a new child goes
on with the next one.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import random
import secrets
import select
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Generator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from . import kernel
from .core import Case, Checker, CheckResult, Run, Spec
from .guard import Assignment, Rule, static_scan
from .protocol import ProtocolError, Reader, encode
from .submissions import UnreadableNotebook, code_cells, parse_notebook, read_notebook_bytes

UTILS = Path(__file__).resolve().parent.parent
ROOT = UTILS.parent
MAX_FLAGS = 200  # flag messages read from one notebook; more are ignored
MAX_NOTES = 20
MAX_NOTE = 300
SCRATCH_BYTES = 64 * 2**20  # what a child may leave in its folder
SCRATCH_FILES = 1000
POLL_S = 0.1
MAX_CALLS = 5000  # oracle calls answered in one run of a case
MAX_THREADS = 64  # threads of one child: more is a bomb aimed at the machine's process table
SEND_S = 5.0  # how long the grader waits for a child to take a message
_ORACLE_TYPES = ("ValueError", "TypeError", "IndexError", "RuntimeError", "OverflowError")

insecure = False
"""True (``--insecure``) grades without the kernel's confinement: limits and poison only."""


@dataclass
class Limits:
    """Limits of one submission's children, in CPU seconds of the child (and MiB of memory).

    ``case_s`` is the limit of a case; a case that trains a model asks for more with its own
    ``Case.time_s`` and gets the larger of the two. ``cells_s`` bounds running the notebook's
    cells in each child, ``total_s`` the CPU time of all the notebook's children together. A
    limit is counted in CPU time, which a busy machine does not inflate; a child that waits
    instead of computing is stopped by a wall-clock backstop of ``wall_factor`` times the limit
    plus ``wall_extra_s``.
    """

    case_s: float = 5.0
    cells_s: float = 30.0
    total_s: float = 240.0
    memory_mb: int = 4096
    wall_factor: float = 3.0
    wall_extra_s: float = 10.0

    def wall(self, cpu_s: float) -> float:
        """The wall-clock backstop of a limit of ``cpu_s`` CPU seconds."""
        return self.wall_factor * cpu_s + self.wall_extra_s


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

    def note(self, text: str) -> None:
        """Add a note once, cut to `MAX_NOTE` characters; at most `MAX_NOTES` notes."""
        text = " ".join(str(text).split())[:MAX_NOTE]
        if text not in self.notes and len(self.notes) < MAX_NOTES:
            self.notes.append(text)


# --------------------------------------------------------------------------------------------
# What a child may read, and what it must poison


def _module_file(name: str) -> Path | None:
    """The source file of the module ``name`` (not imported), or None."""
    import importlib.util
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    origin = getattr(spec, "origin", None) if spec else None
    return Path(origin) if origin and origin.endswith(".py") else None


def _with_pyc(path: Path) -> list[Path]:
    cache = path.parent / "__pycache__"
    found = [path]
    if cache.is_dir():
        found += [p for p in cache.iterdir() if p.name.startswith(path.stem + ".")]
    return found


def _allow_all_but(root: Path, excluded: set[Path], full: list[str], listing: list[str]) -> None:
    """Grant ``root`` whole (``full``) or, where something beneath it is excluded, its listing
    and each entry but the excluded ones, recursively."""
    if root in excluded:
        return
    if not any(root in p.parents for p in excluded):
        full.append(str(root))
        return
    listing.append(str(root))
    try:
        entries = sorted(root.iterdir())
    except OSError:
        return
    for entry in entries:
        if entry.is_dir() and not entry.is_symlink():
            _allow_all_but(entry, excluded, full, listing)
        elif entry not in excluded:
            full.append(str(entry))


_POLICIES: dict[tuple[str, ...], dict[str, list[str]]] = {}
_POLICY_LOCK = threading.Lock()


def _policy(rules: list[Rule]) -> dict[str, list[str]]:
    """The Landlock policy and the poison of a child that runs under ``rules``."""
    key = tuple(sorted(r.id for r in rules))
    with _POLICY_LOCK:
        if key in _POLICIES:
            return _POLICIES[key]
    forbidden_modules = {r.target for r in rules if r.kind == "module"}
    excluded: set[Path] = set()
    sources = [str(ROOT / d) + "/" for d in ("book", "tests", "scripts", ".git", "_build")]
    # The checkers' references (never in a child's frames, so no traceback opens them).
    for path in sorted((UTILS / "checks").glob("a[0-9]_*.py")) + [UTILS / "checks" /
                                                                  "assignments.py"]:
        sources += [str(p) for p in _with_pyc(path)]
    for r in rules:
        target = r.target if r.kind in ("module", "code") else ""
        if target.startswith("utils.checks"):
            continue  # never in the child, never readable
        path = _module_file(target) if target else None
        if path is not None:
            excluded.update(_with_pyc(path))
            if r.kind == "module" or target.startswith("utils."):
                sources += [str(p) for p in _with_pyc(path)]
    if any(r.kind == "builtin" for r in rules):
        torch_dir = Path(torch.__file__).resolve().parent
        excluded.update(torch_dir / d for d in ("_decomp", "_refs", "_prims"))
    full: list[str] = []
    listing: list[str] = []
    venv = Path(sys.prefix).resolve()
    _allow_all_but(venv, {p for p in excluded if venv in p.parents}, full, listing)
    base = Path(sys.base_prefix).resolve()
    if base != venv:
        full.append(str(base))
    # utils: the folder listed, then each allowed module of the book (utils/checks never).
    listing += [str(UTILS), str(UTILS / "__pycache__")]
    for path in sorted(UTILS.glob("*.py")):
        name = "utils" if path.stem == "__init__" else f"utils.{path.stem}"
        if name in forbidden_modules or any(name.startswith(m + ".") for m in forbidden_modules):
            continue
        if path in excluded:
            continue
        full += [str(p) for p in _with_pyc(path)]
    full += ["/usr", "/lib", "/lib64", "/etc/ld.so.cache", "/etc/localtime", "/etc/passwd",
             "/etc/group", "/etc/nsswitch.conf", "/dev/null", "/dev/zero", "/dev/urandom",
             "/dev/random", "/proc/cpuinfo", "/proc/meminfo", "/proc/stat",
             "/sys/devices/system/cpu"]
    ops = [(op, r.id) for r in rules for op in r.operators]
    python = [(r.target, r.qualname, r.id, _what(r)) for r in rules
              if r.kind == "code" and not r.target.startswith("utils.checks")
              and r.target not in forbidden_modules]
    policy = {"readable": full, "listable": listing, "sources": sources,
              "poison_ops": ops, "poison_python": python,
              "forbidden_modules": [(r.target, r.id) for r in rules if r.kind == "module"]}
    with _POLICY_LOCK:
        _POLICIES[key] = policy
    return policy


def _what(rule: Rule) -> str:
    name = rule.qualname or rule.target
    return f"{rule.target}.{rule.qualname}" if rule.qualname else name


# --------------------------------------------------------------------------------------------
# The child's messages, checked against a schema


def _str(value: Any, limit: int) -> str:
    if not isinstance(value, str):
        raise ProtocolError("a field that should be text")
    return value[:limit]


def _int(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ProtocolError("a field that should be an integer")
    return value


def _fields(msg: dict[str, Any], allowed: set[str]) -> None:
    if not set(msg) <= allowed:
        raise ProtocolError(f"unexpected fields {sorted(set(msg) - allowed)[:3]}")


def clean_flag(msg: dict[str, Any]) -> tuple[str, str]:
    """A ``flag`` message: (kind, detail)."""
    _fields(msg, {"op", "kind", "detail"})
    return _str(msg.get("kind"), 200), _str(msg.get("detail", ""), 300)


def clean_ready(msg: dict[str, Any]) -> tuple[list[str], dict[str, list[tuple[str, str]]]]:
    """A ``ready`` message: the cells' errors as text, and each target's MRO."""
    _fields(msg, {"op", "errors", "targets"})
    errors, targets = msg.get("errors"), msg.get("targets")
    if not isinstance(errors, list) or len(errors) > 20 or not isinstance(targets, dict) or \
            len(targets) > 20:
        raise ProtocolError("a malformed ready message")
    texts = []
    for err in errors:
        if not isinstance(err, dict):
            raise ProtocolError("a malformed cell error")
        _fields(err, {"cell", "error"})
        texts.append(f"cell {_int(err.get('cell'))}: {_str(err.get('error'), 200)}")
    mros: dict[str, list[tuple[str, str]]] = {}
    for name, info in targets.items():
        if not isinstance(info, dict):
            raise ProtocolError("a malformed target")
        _fields(info, {"exists", "type", "mro"})
        mro = info.get("mro", [])
        if not isinstance(mro, list) or len(mro) > 50:
            raise ProtocolError("a malformed target")
        entries = []
        for entry in mro:
            if not (isinstance(entry, list) and len(entry) == 2):
                raise ProtocolError("a malformed target")
            entries.append((_str(entry[0], 200), _str(entry[1], 200)))
        mros[_str(name, 100)] = entries
    return texts, mros


def clean_result(msg: dict[str, Any], position: int) -> dict[str, Any]:
    """A ``result`` message: the raw result of case ``position``, every value checked."""
    _fields(msg, {"op", "id", "raw"})
    if _int(msg.get("id")) != position:
        raise ProtocolError("a result for another case")
    raw = msg.get("raw")
    if not isinstance(raw, dict):
        raise ProtocolError("a result that is not a dict")
    _fields(raw, {"status", "message", "tensors", "notes"})
    tensors = raw.get("tensors", {})
    notes = raw.get("notes", [])
    if not isinstance(tensors, dict) or len(tensors) > 256 or not isinstance(notes, list) or \
            len(notes) > 10:
        raise ProtocolError("a malformed result")
    clean = {}
    for key, value in tensors.items():
        if not isinstance(value, torch.Tensor):
            raise ProtocolError("a result value that is not a tensor")
        clean[_str(key, 200)] = value
    return {"status": _str(raw.get("status"), 30), "message": _str(raw.get("message", ""), 300),
            "tensors": clean, "notes": [_str(n, 100) for n in notes]}


def _clean_arg(value: Any, depth: int = 0) -> Any:
    if depth > 4:
        raise ProtocolError("an argument nested too deeply")
    if isinstance(value, list):
        if len(value) > 4096:
            raise ProtocolError("an argument too long")
        return [_clean_arg(v, depth + 1) for v in value]
    if isinstance(value, torch.Tensor):
        if value.numel() > 65536:
            raise ProtocolError("an argument too large")
        return value
    if value is None or isinstance(value, (bool, int, float)):
        return value
    raise ProtocolError("an argument of an unexpected type")


# --------------------------------------------------------------------------------------------
# The zygote and the children


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


_scratch_root: Path | None = None


def _scratch_parent() -> Path:
    """A private folder (mode 700) for this process's children's scratch folders."""
    global _scratch_root
    with _zygote_lock:
        if _scratch_root is None or not _scratch_root.is_dir():
            _scratch_root = Path(tempfile.mkdtemp(prefix="grade-scratch-"))
            atexit.register(shutil.rmtree, _scratch_root, True)
        return _scratch_root


class _Child:
    """One running child process and its pipes: forked by the zygote, or a fresh process."""

    def __init__(self, notebook: bytes, name: str, start: dict[str, Any]):
        self.dir = Path(tempfile.mkdtemp(prefix="grade-", dir=_scratch_parent()))
        (self.dir / name).write_bytes(notebook)
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
            self.proc = subprocess.Popen(  # OSError (no process left to start) goes to the caller
                [sys.executable, "-I", "-B", "-m", "utils.checks.child"], cwd=self.dir,
                env=_child_env(self.dir), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL, start_new_session=True)
            self.pid = self.proc.pid
            self.write_fd = os.dup(self.proc.stdin.fileno())
            read_fd = os.dup(self.proc.stdout.fileno())
            self.proc.stdin.close()
            self.proc.stdout.close()
        os.set_blocking(self.write_fd, False)
        self.reader = Reader(read_fd)
        self.cpu_start = self.cpu_seen = self.cpu() or 0.0
        try:
            self.send(start)
        except _Stop:
            pass  # the next read says what happened

    def cpu(self) -> float | None:
        """The CPU seconds this child has used (None once it is gone)."""
        used = kernel.cpu_seconds(self.pid)
        if used is not None:
            self.cpu_seen = max(getattr(self, "cpu_seen", 0.0), used)
        return used

    def cpu_used(self) -> float:
        """The CPU seconds this child used, as last seen alive."""
        self.cpu()
        return max(0.0, self.cpu_seen - self.cpu_start)

    def scratch_over(self) -> str:
        """"" while the scratch folder is within its limits, else what is over."""
        total = files = 0
        todo = [self.dir]
        while todo:
            folder = todo.pop()
            try:
                entries = list(os.scandir(folder))
            except OSError:
                continue
            for e in entries:
                files += 1
                if files > SCRATCH_FILES:
                    return f"more than {SCRATCH_FILES} files"
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    continue
                if stat.S_ISDIR(st.st_mode):
                    todo.append(Path(e.path))
                else:
                    total += st.st_blocks * 512
                if total > SCRATCH_BYTES:
                    return f"more than {SCRATCH_BYTES // 2**20} MB"
        return ""

    def send(self, message: dict[str, Any], timeout: float = SEND_S) -> None:
        """Write one frame to the child, never blocking past ``timeout`` seconds: a child that
        stops reading its pipe (or fills it itself) loses its case (raises `_Stop`)."""
        data = memoryview(encode(message))
        deadline = time.monotonic() + timeout
        while data:
            try:
                n = os.write(self.write_fd, data)
            except BlockingIOError:
                n = 0
            except OSError:
                return  # the child is gone: the next read says so
            data = data[n:]
            if data:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise _Stop("the process running your code stopped reading what the grader "
                                "sent it", "protocol")
                select.select([], [self.write_fd], [], min(left, POLL_S))

    def kill(self) -> None:
        if self.zygote is None or not self.zygote.kill(self.pid):
            for kill in (os.killpg, os.kill):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    kill(self.pid, signal.SIGKILL)
        for fd in (self.write_fd, self.reader.fd):
            with contextlib.suppress(OSError):
                os.close(fd)
        if self.proc is not None:
            self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


class _Stop(Exception):
    """A child lost its case: (hint, flag)."""

    def __init__(self, hint: str, flag: str):
        super().__init__(hint)
        self.hint, self.flag = hint, flag


# --------------------------------------------------------------------------------------------
# Grading one notebook


class Grading:
    """The grading of one notebook for one assignment."""

    def __init__(self, notebook: Path, assignment: Assignment, limits: Limits | None = None,
                 seed: int | None = None):
        self.notebook = notebook
        self.assignment = assignment
        self.limits = limits or Limits()
        self.seed = secrets.randbits(31) if seed is None else seed
        self.rng = random.Random(self.seed)
        self.result = SubmissionResult(assignment.name)
        self.items: list[tuple[Checker, Case, Spec]] = []
        for j, checker in enumerate(assignment.checkers):
            for case, spec in zip(checker.cases, checker.specs(self.seed + 100 * j), strict=True):
                self.items.append((checker, case, spec))
        self.case_flags: list[list[str]] = [[] for _ in self.items]
        self.outcome: list[tuple[str | None, str] | None] = [None] * len(self.items)
        self.rules = {r.id: r for r in assignment.rules}
        self.flags_read = 0
        self.cpu_used = 0.0
        self.stalled = False  # a child waited past its wall-clock backstop
        self.data = b""
        self.sources: list[str] = []

    # -- flags ------------------------------------------------------------------------------------

    def _void(self, rule: Rule, detail: str) -> None:
        """Score 0 every case the rule covers (the same code runs in all of them)."""
        self.result.flag("reference used")
        self.result.note(f"{rule.reason}" + (f" ({detail})" if detail else ""))
        for i, (checker, _, _) in enumerate(self.items):
            if rule.checks and checker.name not in rule.checks:
                continue
            if rule.reason not in self.case_flags[i]:
                self.case_flags[i].append(rule.reason)

    def _on_flag(self, msg: dict[str, Any], during_cells: bool = False) -> None:
        self.flags_read += 1
        if self.flags_read > MAX_FLAGS:
            if self.flags_read == MAX_FLAGS + 1:  # first, so that no cap on notes hides it
                self.result.notes.insert(0, f"the notebook sent more than {MAX_FLAGS} reports; "
                                            "the rest were not read")
            return
        kind, detail = clean_flag(msg)
        if kind == "blocked":
            self.result.flag("blocked")
            self.result.note(f"the sandbox refused: {detail}")
        elif kind == "source":
            reason = "the notebook tried to read the book's sources or reference code"
            self.result.flag("reference used")
            self.result.note(f"{reason} ({detail[:120]})")
            for flags in self.case_flags:
                if reason not in flags:
                    flags.append(reason)
        elif kind in self.rules:
            rule = self.rules[kind]
            if during_cells and rule.kind != "module":
                # A cell of the notebook's own (a comparison with torch, say): the call failed
                # and can compute nothing for a case, whose inputs come later. Only a call made
                # while a case runs voids it.
                self.result.note(f"a cell of the notebook called {detail[:80]}, which this "
                                 "assignment forbids; it did not run while grading")
                return
            self._void(rule, detail[:120])

    # -- running ------------------------------------------------------------------------------

    def _start_message(self, rules: list[Rule], targets: list[str]) -> dict[str, Any]:
        policy = _policy(rules)
        return {
            "op": "start", "cells": self.sources, "insecure": insecure,
            "poison_ops": policy["poison_ops"], "poison_python": policy["poison_python"],
            "forbidden_modules": policy["forbidden_modules"], "source_roots": policy["sources"],
            "readable": policy["readable"], "listable": policy["listable"],
            "targets": targets,
            "limits": {"memory_mb": self.limits.memory_mb,
                       "cpu_s": int(self.limits.cells_s + self.limits.total_s) + 5},
        }

    def run(self) -> SubmissionResult:
        """Grade the notebook; never raises because of what the notebook holds or does."""
        try:
            return self._run()
        except Exception as exc:  # noqa: BLE001 (one notebook must never stop the class)
            self.result.flag("grader error")
            self.result.note(f"the grader failed on this notebook ({type(exc).__name__}: "
                             f"{str(exc)[:150]}); grade it by hand or ask for a regrade")
            return self._finish(default=("not graded: the grader failed on this notebook",
                                         "grader error"))

    def _run(self) -> SubmissionResult:
        if insecure:
            self.result.flag("insecure")
        try:
            # Read once, refusing links, FIFOs and devices before opening them; the children
            # get a private copy of these very bytes.
            self.data = read_notebook_bytes(self.notebook)
            self.sources = code_cells(parse_notebook(self.data))
        except UnreadableNotebook as exc:
            self.result.flag("unreadable")
            self.result.note(f"the notebook could not be read: {exc.reason}")
            return self._finish(default=(f"the notebook could not be read ({exc.reason})",
                                         "unreadable"))
        for rule_id in static_scan(self.sources, self.assignment.rules):
            self._void(self.rules[rule_id], "seen in the notebook's code")
        shared = [i for i, (c, _, s) in enumerate(self.items) if c.isolated(s) is None]
        isolated = [i for i in range(len(self.items)) if i not in shared]
        position = 0
        while position < len(shared) and not self._out_of_time():
            position = self._session(shared, position)
        for i in isolated:
            if self._out_of_time():
                break
            self._isolated(i)
        if self.stalled:
            return self._finish(default=("not run: an earlier case of this notebook waited past "
                                         "its wall-clock limit without computing", "timeout"))
        return self._finish(default=("the CPU time allowed for the whole notebook ran out before "
                                     "this case", "timeout"))

    def _out_of_time(self) -> bool:
        return self.cpu_used >= self.limits.total_s or self.stalled

    def _rules_for(self, positions: list[int]) -> list[Rule]:
        names = {self.items[i][0].name for i in positions}
        return [r for r in self.assignment.rules if not r.checks or set(r.checks) & names]

    def _spawn(self, positions: list[int]) -> _Child:
        targets = sorted({self.items[i][0].target for i in positions})
        start = self._start_message(self._rules_for(positions), targets)
        try:
            return _Child(self.data, self.notebook.name if self.notebook.name.isprintable()
                          else "notebook.ipynb", start)
        except OSError as exc:
            why = exc.strerror or str(exc)
            raise _Stop(f"the grader could not start a process for your code ({why}); the "
                        "machine was out of processes or memory: ask for a regrade",
                        "crashed") from None

    def _wait(self, child: _Child, cpu_limit: float, what: str, position: int | None,
              oracle: Any = None) -> dict[str, Any]:
        """The next ``ready`` or ``result`` message of ``child``, handling flags and oracle
        calls on the way; raises `_Stop` when the child runs out of CPU time, waits too long,
        writes too much, dies, or sends something malformed."""
        start_cpu = child.cpu() or 0.0
        wall_by = time.monotonic() + self.limits.wall(cpu_limit)
        calls = 0
        while True:
            try:
                msg = child.reader.read(min(wall_by, time.monotonic() + POLL_S))
            except TimeoutError:
                used = (child.cpu() or start_cpu) - start_cpu
                if used > cpu_limit:
                    raise _Stop(f"{what} did not finish within {cpu_limit:g} s of CPU time: an "
                                "endless loop, or far too much work?", "timeout") from None
                if time.monotonic() >= wall_by:
                    self.stalled = True  # a process that waits instead of computing: no more
                    raise _Stop(f"{what} did not finish within {self.limits.wall(cpu_limit):g} s "
                                "(waiting or sleeping, not computing)", "timeout") from None
                if (kernel.thread_count(child.pid) or 0) > MAX_THREADS:
                    raise _Stop(f"{what} started more than {MAX_THREADS} threads, past the "
                                "grader's limit", "limits") from None
                over = child.scratch_over()
                if over:
                    raise _Stop(f"{what} wrote {over} in its folder, past the grader's limit",
                                "limits") from None
                continue
            except EOFError:
                if position is None:
                    raise _Stop("the notebook ended its own process while its cells ran "
                                "(os._exit, a signal, or memory use past the limit)",
                                "crashed") from None
                raise _Stop("the process running your code ended during this case (os._exit, a "
                            "signal, or memory use past the limit)", "crashed") from None
            except ProtocolError as exc:
                raise _Stop(f"the process running your code sent a message the grader could not "
                            f"read during {what} ({exc})", "protocol") from None
            child.cpu()
            op = msg.get("op")
            try:
                if op == "flag":
                    self._on_flag(msg, during_cells=position is None)
                elif op == "fatal":
                    raise _Stop("the grader could not confine the process that runs your code "
                                f"({str(msg.get('error'))[:200]}); tell your instructor",
                                "sandbox")
                elif op == "ready" and position is None:
                    return msg
                elif op == "result" and position is not None:
                    return clean_result(msg, position)
                elif op == "call" and oracle is not None:
                    calls += 1
                    if calls > MAX_CALLS:
                        raise ProtocolError(f"more than {MAX_CALLS} calls of an implementation")
                    self._answer(child, msg, oracle)
                else:
                    raise ProtocolError(f"an unexpected message ({str(op)[:20]})")
            except ProtocolError as exc:
                raise _Stop(f"the process running your code sent a message the grader could not "
                            f"read during {what} ({exc})", "protocol") from None

    def _answer(self, child: _Child, msg: dict[str, Any], oracle: Any) -> None:
        _fields(msg, {"op", "family", "k", "args"})
        family = _str(msg.get("family"), 20)
        k = _int(msg.get("k"))
        args = msg.get("args")
        if not isinstance(args, list) or len(args) > 4:
            raise ProtocolError("malformed arguments")
        args = [_clean_arg(a) for a in args]
        try:
            value = oracle(family, k, tuple(args))
            if not isinstance(value, torch.Tensor):
                raise RuntimeError("the implementation returned no tensor")
            reply: dict[str, Any] = {"op": "reply", "value": value}
        except Exception as exc:  # noqa: BLE001 (what the planted implementation raises)
            name = type(exc).__name__
            reply = {"op": "raise", "type": name if name in _ORACLE_TYPES else "RuntimeError",
                     "message": " ".join(str(exc).split())[:200]}
        child.send(reply)

    def _begin(self, child: _Child) -> None:
        """Wait for the notebook's cells to run in ``child``."""
        msg = self._wait(child, self.limits.cells_s, "your notebook's cells", None)
        errors, mros = clean_ready(msg)
        for err in errors:
            if err not in self.result.cell_errors:
                self.result.cell_errors.append(err)
        self._check_targets(mros)

    def _session(self, positions: list[int], start: int) -> int:
        """One child: run the cells, then the cases ``positions[start:]``; return where the next
        child starts."""
        try:
            child = self._spawn(positions)
        except _Stop as stop:
            for i in positions[start:]:
                if self.outcome[i] is None:
                    self.outcome[i] = (stop.hint, stop.flag)
            return len(positions)
        try:
            try:
                self._begin(child)
            except _Stop as stop:
                for i in positions[start:]:
                    if self.outcome[i] is None:
                        self.outcome[i] = (stop.hint, stop.flag)
                return len(positions)
            k = start
            while k < len(positions) and not self.stalled:
                i = positions[k]
                checker, case, spec = self.items[i]
                limit = case.time_limit(self.limits.case_s) or self.limits.case_s
                try:
                    child.send({"op": "case", "id": i, "target": checker.target,
                                "spec": _payload(spec)})
                    raw = self._wait(child, limit, checker.what, i)
                except _Stop as stop:
                    self.outcome[i] = (stop.hint, stop.flag)
                    return k + 1
                self._judge(i, raw)
                k += 1
            with contextlib.suppress(_Stop):
                child.send({"op": "end"}, timeout=1.0)
            return k
        finally:
            self.cpu_used += child.cpu_used()
            child.kill()

    def _run_alone(self, i: int, run: Run) -> dict[str, Any]:
        """One `Run` of case ``i`` in a fresh child; its raw result (raises `_Stop`)."""
        checker, case, _ = self.items[i]
        child = self._spawn([i])
        try:
            self._begin(child)
            child.send({"op": "case", "id": i, "target": checker.target,
                        "spec": _payload(run.spec)})
            limit = case.time_limit(self.limits.case_s) or self.limits.case_s
            return self._wait(child, limit, checker.what, i, run.oracle)
        finally:
            self.cpu_used += child.cpu_used()
            child.kill()

    def _isolated(self, i: int) -> None:
        """Case ``i``, run by its checker's plan of fresh processes."""
        checker, _, spec = self.items[i]
        plan: Generator[Run, dict[str, Any], dict[str, Any]] | None = checker.isolated(spec)
        if plan is None:
            return
        try:
            run = next(plan)
            while True:
                if self._out_of_time():
                    raise _Stop("the CPU time allowed for the whole notebook ran out before "
                                "this case", "timeout")
                raw = self._run_alone(i, run)
                if raw["status"] != "ok":
                    plan.close()
                    self._judge(i, raw)
                    return
                run = plan.send(raw)
        except StopIteration as done:
            self._judge(i, done.value)
        except _Stop as stop:
            plan.close()
            self.outcome[i] = (stop.hint, stop.flag)
        except Exception as exc:  # noqa: BLE001 (results the plan cannot use lose this case)
            self.outcome[i] = (f"the results could not be compared ({type(exc).__name__})", "")

    def _check_targets(self, mros: dict[str, list[tuple[str, str]]]) -> None:
        for checker in self.assignment.checkers:
            for module, qualname in mros.get(checker.target, []):
                for rule in self.assignment.rules_for(checker.name):
                    if rule.kind == "code" and module == rule.target and (
                            not rule.qualname or qualname == rule.qualname or
                            qualname.startswith(rule.qualname + ".")):
                        self._void(rule, f"{checker.target} is {qualname}")
                    if rule.kind == "module" and (module == rule.target or
                                                  module.startswith(rule.target + ".")):
                        self._void(rule, f"{checker.target} is {qualname}")

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


def _payload(spec: Spec) -> dict[str, Any]:
    """What the child gets of a spec: everything but the trusted side's ``config``."""
    payload = spec.to_payload()
    payload.pop("config", None)
    return payload


def grade_notebook(notebook: Path, assignment: Assignment, limits: Limits | None = None,
                   seed: int | None = None) -> SubmissionResult:
    """Grade ``notebook`` for ``assignment`` in confined child processes."""
    return Grading(Path(notebook), assignment, limits, seed).run()
