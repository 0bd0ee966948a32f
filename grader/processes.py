"""The grader's side of its children's processes: orphans, descendants, CPU time, threads.

`set_child_subreaper` (orphans of the grader's descendants come back to the grader, which can
then kill them), `descendants` and `kill_descendants`, and what the grader reads of a child
while it runs, from ``/proc/PID/stat``: `cpu_seconds` and `thread_count`. Linux only; elsewhere
they find nothing.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import time
from collections.abc import Sequence

from .syscalls import _PR_SET_CHILD_SUBREAPER, KernelError, _libc


def set_child_subreaper() -> bool:
    """Make this process the reaper of its orphaned descendants; False where that is missing."""
    if sys.platform != "linux":
        return False
    return _libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


def _parents() -> dict[int, int]:
    """Every process's parent, read from /proc."""
    out = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return out
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                data = f.read()
        except OSError:
            continue
        rest = data[data.rfind(b")") + 2:].split()
        if len(rest) > 1:
            out[int(name)] = int(rest[1])
    return out


def descendants(pid: int | None = None) -> list[int]:
    """The processes below ``pid`` (this process by default), children first."""
    root = os.getpid() if pid is None else pid
    parents = _parents()
    children: dict[int, list[int]] = {}
    for child, parent in parents.items():
        children.setdefault(parent, []).append(child)
    out, todo = [], list(children.get(root, []))
    while todo:
        p = todo.pop(0)
        out.append(p)
        todo += children.get(p, [])
    return out


def kill_descendants(keep: Sequence[int] = (), timeout: float = 10.0) -> list[int]:
    """SIGKILL every descendant of this process except ``keep`` and those below them, reap the
    ones that are this process's own children, and wait until they are gone. Returns the
    processes it killed; raises `KernelError` if some are still there after ``timeout``."""
    kept = set(keep)
    for k in keep:
        kept.update(descendants(k))
    me = os.getpid()
    killed: list[int] = []
    deadline = time.monotonic() + timeout
    while True:
        left = [p for p in descendants() if p not in kept]
        alive = [p for p in left if not _zombie(p) or _parent(p) == me]
        if not alive:
            return killed
        for p in alive:
            try:
                os.kill(p, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                continue
            if p not in killed:
                killed.append(p)
        for p in alive:
            if _parent(p) == me:
                try:
                    os.waitpid(p, os.WNOHANG)
                except ChildProcessError:
                    pass
        if time.monotonic() > deadline:
            raise KernelError(errno.ETIMEDOUT, f"processes {alive} would not die")
        time.sleep(0.01)


def _stat_fields(pid: int) -> list[bytes]:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return []
    return data[data.rfind(b")") + 2:].split()


def _zombie(pid: int) -> bool:
    fields = _stat_fields(pid)
    return not fields or fields[0] in (b"Z", b"X")


def _parent(pid: int) -> int:
    fields = _stat_fields(pid)
    return int(fields[1]) if len(fields) > 1 else 0


def thread_count(pid: int) -> int | None:
    """The threads of the process ``pid``; None when it is gone."""
    fields = _stat_fields(pid)
    return int(fields[17]) if len(fields) > 17 else None


_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_seconds(pid: int) -> float | None:
    """The CPU time (user + system, all threads) the process ``pid`` has used; None if gone."""
    fields = _stat_fields(pid)
    if len(fields) < 13:
        return None
    return (int(fields[11]) + int(fields[12])) / _TICKS
