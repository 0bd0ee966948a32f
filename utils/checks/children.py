"""One child process of the grader, seen from the grader: its folder, its pipes, its CPU time.

For the grader (assignments' grading). `Child` makes a private scratch folder holding a copy of
the notebook, gets a process forked by the zygote (or starts a fresh one), sends it the start
message, and then reads its frames, writes to it without ever blocking, reads its CPU time from
the kernel, measures its scratch folder and kills it. `Stop` is a case lost by a child: a hint
for the student and a flag for the grades.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from . import kernel
from .limits import POLL_S, SCRATCH_BYTES, SCRATCH_FILES, SEND_S, child_env
from .protocol import Reader, encode
from .zygote_client import ZygoteError, children_started, shared_zygote, zygote_lock

_scratch_root: Path | None = None


def _scratch_parent() -> Path:
    """A private folder (mode 700) for this process's children's scratch folders."""
    global _scratch_root
    with zygote_lock:
        if _scratch_root is None or not _scratch_root.is_dir():
            _scratch_root = Path(tempfile.mkdtemp(prefix="grade-scratch-"))
            atexit.register(shutil.rmtree, _scratch_root, True)
        return _scratch_root


class Child:
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
        with zygote_lock:
            children_started["forked" if spawned is not None else "fresh"] += 1
        if spawned is not None:
            self.pid, self.write_fd, read_fd = spawned
        else:
            self.proc = subprocess.Popen(  # OSError (no process left to start) goes to the caller
                [sys.executable, "-I", "-B", "-m", "utils.checks.child"], cwd=self.dir,
                env=child_env(self.dir), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
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
        except Stop:
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
        stops reading its pipe (or fills it itself) loses its case (raises `Stop`)."""
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
                    raise Stop("the process running your code stopped reading what the grader "
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


class Stop(Exception):
    """A child lost its case: (hint, flag)."""

    def __init__(self, hint: str, flag: str):
        super().__init__(hint)
        self.hint, self.flag = hint, flag
