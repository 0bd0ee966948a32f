"""One child process of the grader, seen from the grader: its folder, its pipes, its CPU time.

For the grader (assignments' grading). `Child` makes a private scratch folder holding a copy of
the notebook, gets a process forked by the zygote (or starts a fresh one), puts it in a control
group of its own (`grader.cgroups`), sends it the start message, and then reads its frames
(`PolledReader`: the grader's checks of the child run on a fixed period however busy its pipe,
and once more before an answer is accepted), writes to it
without ever blocking, reads its CPU time from the kernel, measures its scratch folder and
kills it. `Stop` is a case lost by a child: a hint for the student and a flag for the grades.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import select
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from . import cgroups, kernel
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
            atexit.register(remove_tree, _scratch_root)
            atexit.register(cgroups.remove_base)
        return _scratch_root


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def _open_dir(name: str, dir_fd: int | None) -> int:
    """A folder's descriptor (never through a symbolic link); one its owner made unreadable
    is made readable first."""
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except PermissionError:
        os.chmod(name, 0o700, dir_fd=dir_fd)
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)


def _clear(fd: int, stuck: set[tuple[int, int]]) -> tuple[str, tuple[int, int]] | None:
    """Unlink every entry of the folder ``fd`` but its folders; the name and identity of one
    folder left to enter (not in ``stuck``), or None."""
    try:
        os.fchmod(fd, 0o700)
    except OSError:
        pass
    sub = None
    with os.scandir(fd) as entries:
        for entry in entries:
            try:
                if entry.is_dir(follow_symlinks=False):
                    st = entry.stat(follow_symlinks=False)
                    if sub is None and (st.st_dev, st.st_ino) not in stuck:
                        sub = entry.name, (st.st_dev, st.st_ino)
                else:
                    os.unlink(entry.name, dir_fd=fd)
            except OSError:
                continue
    return sub


def remove_tree(path: Path | str) -> None:
    """Remove the folder ``path`` and everything in it, however deep, and never raise.

    A child's scratch folder is whatever the student's code left there: thousands of nested
    folders (which make `shutil.rmtree` recurse past Python's limit and hold a descriptor per
    level), names so long that no path reaches the bottom, folders made unreadable. This walks
    down one folder at a time by descriptor (``openat``, never a link) and back up by ``..``,
    checked against the identity it recorded on the way down, holding two descriptors at most.
    """
    try:
        fd = _open_dir(str(path), None)
    except FileNotFoundError:
        return
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(path)
        return
    trail: list[tuple[str, tuple[int, int]]] = []  # (name, identity) of each folder entered
    stuck: set[tuple[int, int]] = set()  # folders that cannot be removed: never entered again
    try:
        st = os.fstat(fd)
        here = (st.st_dev, st.st_ino)
        while True:
            try:
                sub = _clear(fd, stuck)
            except OSError:
                sub = None
            if sub is not None:
                try:
                    down = _open_dir(sub[0], fd)
                except OSError:
                    stuck.add(sub[1])
                    continue
                st = os.fstat(down)
                trail.append((sub[0], here))
                os.close(fd)
                fd, here = down, (st.st_dev, st.st_ino)
                continue
            if not trail:
                break
            left = here
            name, parent = trail.pop()
            up = os.open("..", _DIR_FLAGS, dir_fd=fd)
            st = os.fstat(up)
            os.close(fd)
            fd = up
            if (st.st_dev, st.st_ino) != parent:
                return  # the tree changed under us: stop rather than remove elsewhere
            try:
                os.rmdir(name, dir_fd=fd)
            except OSError:
                stuck.add(left)
            here = parent
    except OSError:
        return
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)
    with contextlib.suppress(OSError):
        os.rmdir(path)


class PolledReader(Reader):
    """A child's frames, read so that the grader's checks of the child run on a fixed period
    whatever the child sends.

    The grader checks a child's CPU time, threads and scratch folder when a read raises
    `TimeoutError` (`grader.sessions.Conversation._wait`). A plain read raises it only
    when no frame arrives within a poll, so a child that keeps its pipe busy (a report every
    millisecond) would never be checked until the wall-clock backstop, and its answer would be
    accepted whatever it cost. This read raises `TimeoutError` (the cue to check) whenever
    ``period`` seconds have passed since the last check, frames waiting or not, and once more
    when a ``ready`` or ``result`` frame arrives, which it holds and hands over on the next
    read: no answer is accepted before the checks have run after it came. No frame is lost.
    """

    def __init__(self, fd: int, period: float = POLL_S):
        super().__init__(fd)
        self.period = period
        self.due = time.monotonic() + period
        self.held: dict[str, Any] | None = None

    def read(self, deadline: float) -> dict[str, Any]:
        if self.held is not None:
            msg, self.held = self.held, None
            return msg
        now = time.monotonic()
        if now >= self.due:
            self.due = now + self.period
            raise TimeoutError
        try:
            msg = super().read(min(deadline, self.due))
        except TimeoutError:
            self.due = time.monotonic() + self.period
            raise
        if isinstance(msg, dict) and msg.get("op") in ("ready", "result"):
            self.held = msg
            self.due = time.monotonic() + self.period
            raise TimeoutError
        return msg


def scratch_over(folder: Path) -> str:
    """"" while the scratch folder ``folder`` is within its limits, else what is over."""
    total = files = 0
    todo = [folder]
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


class Child:
    """One running child process and its pipes: forked by the zygote, or a fresh process."""

    def __init__(self, notebook: bytes, name: str, start: dict[str, Any]):
        self.dir = Path(tempfile.mkdtemp(prefix="grade-", dir=_scratch_parent()))
        start = {**start, "notebook": name}  # copied into the child's own scratch folder
        (self.dir / name).write_bytes(notebook)
        self.proc: subprocess.Popen[bytes] | None = None
        self.confined = False  # set on the child's "confined" message (`sessions`)
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
                [sys.executable, "-I", "-B", "-m", "grader.child"], cwd=self.dir,
                env=child_env(self.dir), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL, start_new_session=True)
            self.pid = self.proc.pid
            self.write_fd = os.dup(self.proc.stdin.fileno())
            read_fd = os.dup(self.proc.stdout.fileno())
            self.proc.stdin.close()
            self.proc.stdout.close()
        # The kernel's bounds go on before the child reads its start message, and so before
        # any of the student's code: none where the grader runs --insecure.
        self.group = None
        if not start.get("insecure"):
            try:
                self.group = cgroups.attach(self.pid, int(start["limits"]["memory_mb"]))
            except OSError:
                self._end(read_fd)
                raise
        os.set_blocking(self.write_fd, False)
        self.reader = PolledReader(read_fd)
        self.cpu_start = self.cpu_seen = self.cpu() or 0.0
        try:
            self.send(start)
        except Stop:
            pass  # the next read says what happened

    def cpu(self) -> float | None:
        """The CPU seconds this child has used; once it is gone, what was last seen (so that a
        child that answers and exits at once is still held to its limit), None if never seen."""
        used = kernel.cpu_seconds(self.pid)
        if used is not None:
            self.cpu_seen = max(getattr(self, "cpu_seen", 0.0), used)
            return used
        return getattr(self, "cpu_seen", None)

    def cpu_used(self) -> float:
        """The CPU seconds this child used, as last seen alive."""
        self.cpu()
        return max(0.0, self.cpu_seen - self.cpu_start)

    def scratch_over(self) -> str:
        """"" while the scratch folder is within its limits, else what is over. Polled only
        under ``--insecure``: otherwise the folder is a tmpfs of the child's own, bounded by
        the kernel (`grader.namespaces.scratch_on_tmpfs`), which the grader does not see."""
        return scratch_over(self.dir) if self.group is None else ""

    def scratch_full(self) -> bool:
        """Whether the child's tmpfs has no byte or no file left: the kernel refused a write
        (seen through the child's own root, ``/proc/PID/root``)."""
        try:
            st = os.statvfs(f"/proc/{self.pid}/root{self.dir}")
        except OSError:
            return False
        return st.f_bavail == 0 or st.f_favail == 0

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

    def limits_reached(self) -> list[str]:
        """The kernel-held limits this child reached ("tasks", "memory", "scratch")."""
        return cgroups.events(self.group) + (["scratch"] if self.scratch_full() else [])

    def kill(self) -> None:
        self._end(self.reader.fd)

    def _end(self, read_fd: int) -> None:
        if self.zygote is None or not self.zygote.kill(self.pid):
            for kill in (os.killpg, os.kill):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    kill(self.pid, signal.SIGKILL)
        for fd in (self.write_fd, read_fd):
            with contextlib.suppress(OSError):
                os.close(fd)
        if self.proc is not None:
            self.proc.wait()
        cgroups.release(getattr(self, "group", None))
        remove_tree(self.dir)


class Stop(Exception):
    """A child lost its case: (hint, flag)."""

    def __init__(self, hint: str, flag: str):
        super().__init__(hint)
        self.hint, self.flag = hint, flag
