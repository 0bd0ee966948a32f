"""What an assignment forbids, and how the grader notices: rules, a static scan, a monitor.

A `Rule` names a piece of reference code the student must not use in an assignment: a module of
the book (``utils.attention``), a class or function by module and qualified name (torch's
``nn.LayerNorm``), or a built-in by name (``scaled_dot_product_attention``). Three layers look
for them:

* `static_scan` reads the notebook's code in the grader's own process: imports of a forbidden
  module or name.
* `Monitor`, installed in the sandboxed child before the student's first line runs, is an audit
  hook (which Python does not let code remove) and a profile function. The hook refuses the
  import of a forbidden module, the reading of a reference source file or of the book's sources,
  the opening of another process's files in ``/proc``, writes outside the sandbox folder, new
  processes, signals to other processes, sockets, and attempts to switch the profile function
  off. Threads are refused by replacing the functions that start them, and a thread found
  running anyway is reported as tampering. The profile function sees every call the
  student's code makes during a case, and reports calls into forbidden code.
* The grader, not the child, decides what a report means for the score.
"""

from __future__ import annotations

import _thread
import ast
import os
import re
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Rule", "Assignment", "Monitor", "static_scan"]


@dataclass
class Rule:
    """A piece of reference code an assignment forbids.

    ``kind`` is "module" (importing ``target`` or a submodule), "code" (calling code defined in
    module ``target`` whose qualified name is ``qualname`` or starts with ``qualname + "."``;
    every function of the module when ``qualname`` is empty) or "builtin" (calling a C function
    whose ``__name__`` is ``target``). ``checks`` limits it to some checkers of the assignment.
    """

    kind: str
    target: str
    reason: str
    qualname: str = ""
    checks: Sequence[str] = ()

    @property
    def id(self) -> str:
        """A short stable id, used in messages between the child and the grader."""
        return f"{self.kind}:{self.target}:{self.qualname}"

    def to_payload(self) -> dict[str, Any]:
        """Plain data for the child."""
        return {"id": self.id, "kind": self.kind, "target": self.target, "qualname": self.qualname}


@dataclass
class Assignment:
    """An assignment: its notebook's name, its checkers and the rules that apply to it."""

    name: str
    checkers: list[Any]
    rules: list[Rule] = field(default_factory=list)

    def rules_for(self, check: str) -> list[Rule]:
        """The rules that apply to the checker named ``check``."""
        return [r for r in self.rules if not r.checks or check in r.checks]


# --------------------------------------------------------------------------------------------
# The static scan, in the grader's process


def _imports(tree: ast.AST) -> list[tuple[str, list[str]]]:
    """(module, [names]) for every import in ``tree``; ``from a import b`` also yields a.b."""
    out: list[tuple[str, list[str]]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [a.name for a in node.names]
            out.append((node.module, names))
            out += [(f"{node.module}.{n}", []) for n in names]
        elif (isinstance(node, ast.Call) and isinstance(node.func, (ast.Name, ast.Attribute))
              and getattr(node.func, "id", getattr(node.func, "attr", "")) in
              ("__import__", "import_module") and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            out.append((node.args[0].value, []))
    return out


def static_scan(sources: Sequence[str], rules: Sequence[Rule]) -> list[str]:
    """The ids of the rules that the code ``sources`` visibly breaks by an import."""
    found: list[str] = []
    for src in sources:
        try:
            tree = ast.parse(src)
        except SyntaxError:
            continue
        for module, names in _imports(tree):
            for rule in rules:
                hit = False
                if rule.kind == "module":
                    hit = module == rule.target or module.startswith(rule.target + ".")
                elif rule.kind == "code" and rule.target.startswith("utils."):
                    hit = module == rule.target and rule.qualname.split(".")[0] in names
                if hit and rule.id not in found:
                    found.append(rule.id)
    return found


# --------------------------------------------------------------------------------------------
# The monitor, in the sandboxed child

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_BLOCKED_EVENTS = {
    "subprocess.Popen": "starting a process", "os.system": "starting a process",
    "os.exec": "starting a process", "os.posix_spawn": "starting a process",
    "os.spawn": "starting a process", "os.fork": "starting a process",
    "os.forkpty": "starting a process", "pty.spawn": "starting a process",
    "_thread.start_new_thread": "starting a thread",
    "sys.setprofile": "switching off the grader's instrumentation",
    "sys.settrace": "switching off the grader's instrumentation",
    "gc.get_referrers": "inspecting the grader's objects",
    "gc.get_objects": "inspecting the grader's objects",
    "gc.get_referents": "inspecting the grader's objects",
    "ctypes.dlopen": "loading native code", "ctypes.dlsym": "loading native code",
    "ctypes.addressof": "raw memory access", "ctypes.string_at": "raw memory access",
    "ctypes.cdata": "raw memory access", "ctypes.PyObj_FromPtr": "raw memory access",
    "ctypes.call_function": "calling native code",
    "builtins.input": "reading the keyboard",
}
_PATH_EVENTS = ("os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown",
                "os.truncate", "os.symlink", "os.link", "os.utime", "shutil.rmtree",
                "shutil.move", "shutil.copyfile", "shutil.copytree", "os.chdir")
TAMPER = "tamper"
_current_frames = sys._current_frames  # kept before any student code can replace them
_listdir = os.listdir
_OTHER_PROCESS = re.compile(r"^/proc/(\d+)(?:/|$)")


class Monitor:
    """The audit hook and profile function of the sandboxed child.

    ``report(kind, detail)`` sends a finding to the grader at once (kind is a rule id, "blocked"
    or "tamper"); ``sandbox`` is the only folder it may write in; ``readable`` the folders it may
    read from; ``forbidden_files`` the reference sources it may not read even there.
    """

    def __init__(self, rules: Sequence[dict[str, Any]], sandbox: str, readable: Sequence[str],
                 forbidden_files: Sequence[str], report: Callable[[str, str], None]):
        self.report = report
        self.sandbox = os.path.realpath(sandbox)
        self.readable = [os.path.realpath(p) for p in readable]
        self.forbidden_files = {os.path.realpath(p) for p in forbidden_files}
        self.modules = [r for r in rules if r["kind"] == "module"]
        self.code: dict[str, list[dict[str, Any]]] = {}
        for r in rules:
            if r["kind"] in ("code", "module"):
                self.code.setdefault(r["target"], []).append(r)
        self.builtins = {r["target"]: r for r in rules if r["kind"] == "builtin"}
        self.armed = False
        self.seen: set[tuple[str, str]] = set()

    # -- reporting ----------------------------------------------------------------------------

    def _report(self, kind: str, detail: str) -> None:
        if (kind, detail) not in self.seen:
            self.seen.add((kind, detail))
            self.report(kind, detail)

    # -- the audit hook -------------------------------------------------------------------------

    def _inside(self, path: str, roots: Sequence[str]) -> bool:
        return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)

    def _path(self, value: Any) -> str | None:
        if isinstance(value, bytes):
            value = os.fsdecode(value)
        if not isinstance(value, str):
            return None
        return os.path.realpath(value)

    def audit(self, event: str, args: tuple[Any, ...]) -> None:
        """The audit hook: refuse what a submission may not do once it is armed."""
        if not self.armed:
            return
        if event == "import":
            name = args[0] if args else ""
            for r in self.modules:
                if name == r["target"] or str(name).startswith(r["target"] + "."):
                    self._report(r["id"], str(name))
                    raise ImportError(f"{name} may not be used in this assignment")
            return
        if event == "open":
            self._open(args)
            return
        if event in ("sys.setprofile", "sys.settrace") and self._own_switch():
            return
        if event in _BLOCKED_EVENTS or event.startswith("socket."):
            why = _BLOCKED_EVENTS.get(event, "network access")
            self._report(TAMPER if "instrumentation" in why or "grader" in why else "blocked",
                         why)
            raise PermissionError(f"{why} is not allowed while grading")
        if event in ("os.kill", "os.killpg", "signal.pthread_kill"):
            if event == "os.kill" and args and args[0] == os.getpid():
                return
            self._report("blocked", "sending a signal to another process")
            raise PermissionError("sending a signal to another process is not allowed")
        if event in _PATH_EVENTS:
            for value in args[:2]:
                path = self._path(value)
                if path is not None and not self._inside(path, [self.sandbox]):
                    self._report("blocked", f"{event} outside its folder")
                    raise PermissionError(f"{event} outside the sandbox folder is not allowed")

    def _open(self, args: tuple[Any, ...]) -> None:
        path = self._path(args[0] if args else None)
        if path is None:
            return
        mode = args[1] if len(args) > 1 else None
        flags = args[2] if len(args) > 2 else 0
        writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
            isinstance(flags, int) and bool(flags & _WRITE_FLAGS))
        if self._inside(path, [self.sandbox]):
            return
        given = args[0]
        given = os.path.abspath(os.fsdecode(given)) if isinstance(given, (str, bytes)) else ""
        if self._other_process(given) or self._other_process(path):
            # /proc/PID/fd/N of the grader or of the process that forked this one would open
            # their pipes to other notebooks' processes: no file of another process is readable.
            self._report("blocked", "opening another process's files in /proc")
            raise PermissionError("opening another process's files is not allowed")
        if writes and not path.startswith("/dev/"):
            self._report("blocked", f"writing {path}")
            raise PermissionError("writing outside the sandbox folder is not allowed")
        if self._forbidden(path):
            self._report("source", path)
            raise PermissionError("reading the reference code is not allowed in this assignment")
        if not self._inside(path, self.readable):
            self._report("source" if path.endswith(".ipynb") else "blocked",
                         f"reading {path}" if path.endswith(".ipynb") else "reading a file "
                         "outside the sandbox")
            raise PermissionError("reading files outside the sandbox is not allowed")

    @staticmethod
    def _other_process(path: str) -> bool:
        """Whether ``path`` lies in the /proc folder of another process than this one."""
        match = _OTHER_PROCESS.match(path)
        return bool(match) and int(match.group(1)) != os.getpid()

    def _forbidden(self, path: str) -> bool:
        """A reference source file, or its compiled form in __pycache__."""
        if path in self.forbidden_files:
            return True
        p = Path(path)
        if p.parent.name != "__pycache__":
            return False
        return any(str(p.parent.parent) == str(Path(f).parent)
                   and p.name.startswith(Path(f).stem + ".") for f in self.forbidden_files)

    # -- the profile function -------------------------------------------------------------------

    def profile(self, frame: Any, event: str, arg: Any) -> None:
        """The profile function: report calls into forbidden code."""
        if event == "call":
            rules = self.code.get(frame.f_globals.get("__name__", ""))
            if rules:
                qn = frame.f_code.co_qualname
                for r in rules:
                    q = r["qualname"]
                    if not q or qn == q or qn.startswith(q + "."):
                        self._report(r["id"], qn)
        elif event == "c_call":
            r = self.builtins.get(getattr(arg, "__name__", ""))
            if r is not None:
                self._report(r["id"], r["target"])

    def _own_switch(self) -> bool:
        """Whether sys.setprofile was called by `watch_calls` or `stop_watching_calls`."""
        caller = sys._getframe(2)
        return caller.f_code in (Monitor.watch_calls.__code__,
                                 Monitor.stop_watching_calls.__code__)

    def watch_calls(self) -> None:
        """Start the profile function (during a case)."""
        sys.setprofile(self.profile)

    def stop_watching_calls(self) -> None:
        """Stop the profile function (between cases)."""
        sys.setprofile(None)

    def _refuse_thread(self, *args: Any, **kwargs: Any) -> None:
        self._report("blocked", "starting a thread")
        raise PermissionError("starting a thread is not allowed while grading")

    def check_threads(self) -> None:
        """Report a thread that runs beside the main one as tampering.

        Python 3.11 raises no audit event for a new thread, so `install` replaces the functions
        that start one; code that gets hold of the originals again is caught here, after the
        cells and after every case (a second thread would run unseen by the profile function).
        The child keeps torch to one thread, so torch starts no pool of its own.
        """
        try:
            count = len(_listdir("/proc/self/task"))
        except OSError:
            count = len(_current_frames())
        if count > 1:
            self._report(TAMPER, "running a thread of its own")

    def install(self) -> None:
        """Start watching for good: the audit hook, which no code can remove, and no threads."""
        for owner, name in ((_thread, "start_new_thread"), (_thread, "start_new"),
                            (_thread, "start_joinable_thread"), (threading, "_start_new_thread"),
                            (threading, "_start_joinable_thread")):
            if hasattr(owner, name):
                setattr(owner, name, self._refuse_thread)
        sys.addaudithook(self.audit)
        self.armed = True
