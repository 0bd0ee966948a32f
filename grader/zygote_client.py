"""The grader's end of `grader.zygote`: the process that forks the children, started once.

For the grader (assignments' grading). `Zygote` starts ``python -I -B -m grader.zygote FD``
with a child's environment, checks that it is single-threaded, and asks it over a Unix socket to
fork a child in a folder (`Zygote.spawn`) or to kill and reap one (`Zygote.kill`).
`shared_zygote` is the one zygote of this process, started on first use (None where ``os.fork``
is missing, or `use_fork` is False: each child then starts afresh); `stop_zygote` stops it.
`children_started` counts the children forked and started afresh.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from .limits import child_env


def _matplotlib_cache() -> dict[str, str]:
    """``MPLCONFIGDIR`` for the zygote: a folder of the grader's user where matplotlib keeps the
    font list that it builds on its first import (2 to 3 s, every time in a fresh folder).

    Only the zygote reads it, before it forks any child, and it then drops the variable, so the
    children's environment stays `child_env`'s. Empty (a fresh folder, as before) if the folder
    cannot be made.
    """
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    path = os.path.join(base, "tested-transformer", "grader-matplotlib")
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except OSError:
        return {}
    return {"MPLCONFIGDIR": path}


class ZygoteError(Exception):
    """The zygote could not start, or stopped answering."""


class Zygote:
    """The grader's end of `grader.zygote`: one pre-started process that forks children.

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
                [sys.executable, "-I", "-B", "-m", "grader.zygote", str(theirs.fileno())],
                cwd=self.dir, env={**child_env(self.dir), **_matplotlib_cache()},
                stdin=subprocess.DEVNULL,
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
        # The process that forks the children: process 1 of a PID namespace of its own, a child
        # of the process started above (`grader.namespaces`), or that process itself.
        self.pid = int(hello.get("pid") or self.proc.pid)
        self.pid_namespaces = bool(hello.get("pid_namespaces"))

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
zygote_lock = threading.Lock()
use_fork = hasattr(os, "fork") and hasattr(socket, "send_fds") and sys.platform == "linux"
"""Whether children are forked from a zygote; False starts each child as a fresh process."""
children_started = {"forked": 0, "fresh": 0}
"""How many children this process has had forked by its zygote and started afresh."""


def shared_zygote() -> Zygote | None:
    """The zygote of this process, started on first use; None when children start afresh."""
    global _zygote, _zygote_failed
    if not use_fork:
        return None
    with zygote_lock:
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
    with zygote_lock:
        if _zygote is not None:
            _zygote.close()
            _zygote = None
