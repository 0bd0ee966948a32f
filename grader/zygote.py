"""A process that has imported torch once and forks one sandboxed child per request.

Starting a fresh Python process and importing torch takes seconds, far longer than grading a
notebook. The grader (`grader.zygote_client`) therefore starts this process once, as
``python -I -B -m grader.zygote FD`` with the same stripped environment a fresh child gets,
and asks it over a Unix socket (the file descriptor FD) for children. The zygote imports what a
fresh child imports before its first instruction (torch and `grader.child`, with the student
side of the checkers: `utils.checks.core`, `results` and `runners`) and the parts of torch that
every notebook imports anyway (`preload`), never any student code, no checker's reference and
none of the book's modules that an assignment forbids. It never sees a case: the grader draws
the inputs in its own process and sends them straight to the child over the child's own pipes.
Once a run has asked for many children, the zygote's memory is mapped with huge pages where the
kernel can (`collapse_into_huge_pages`), which makes each further fork and child's exit about
three times cheaper.

What a forked child inherits, and what it does about it before the student's first line:

* threads: the zygote sets torch to one thread and checks that it is single-threaded, so the fork
  copies no thread pool in the middle of its work (the grader does not use a zygote that reports
  more than one thread);
* file descriptors: the child closes the zygote's socket and every descriptor that the zygote did
  not already hold after its imports, and keeps only the two pipe ends of its own request, as its
  standard input and output;
* the process group, the folder and the environment: it starts a session of its own (so that the
  grader can kill it with everything it started), moves into the folder the grader made for it,
  and sets ``HOME`` and ``TMPDIR`` there, as a fresh child has them;
* signal handlers: Ctrl-C, which the zygote ignores, raises KeyboardInterrupt again, as in a fresh
  interpreter.
* process ids: where the kernel allows it, the zygote goes on as process 1 of a PID namespace
  of its own (the process the grader started waits for it) and forks each child as process 1
  of a namespace of its own (`grader.namespaces`); the child tells the zygote its number as the
  grader sees it, which is what the zygote answers and what the grader's kills name.

`grader.child.serve` then sets the resource limits and installs the monitor, exactly as in
a fresh child. The zygote keeps every child it forked until the grader asks it to kill and reap
it, so that a process id can never be reused between the grader's decision and the kill.

Requests and answers are JSON, one per socket message: ``{"op": "spawn", "dir": PATH}`` with the
child's two pipe ends attached answers ``{"pid": PID}``; ``{"op": "kill", "pid": PID}`` answers
``{"ok": true}``. The zygote's first message is ``{"op": "hello", "threads": N, "pid": PID,
"pid_namespaces": BOOL}``, PID being the forking process's number as the grader sees it.
When the grader closes its end, the zygote kills its remaining children and exits.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import os
import signal
import socket
import sys
import tempfile
from typing import Any

import torch

from . import child, kernel, namespaces, poison
from .syscalls import _libc

MAX_MESSAGE = 65536
_MADV_COLLAPSE = 25  # Linux 6.1 and later
_HUGE_PAGE = 2 * 2**20
# Collapsing costs about 0.5 s and saves about 20 ms a fork: done before the 25th fork, when the
# children already forked say that this run has many to come (a class, an assignment whose
# cases each want a fresh process); a run of a few children never pays for it.
COLLAPSE_AFTER = 25


def open_fds() -> set[int]:
    """The file descriptors this process holds."""
    return {int(name) for name in os.listdir("/proc/self/fd")} if os.path.isdir(
        "/proc/self/fd") else set(range(3))


def thread_count() -> int:
    """The threads of this process (Linux), or 1 where that cannot be read."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


def collapse_into_huge_pages() -> int:
    """Map this process's private anonymous memory (the heap, malloc's arenas) with 2 MiB pages
    wherever the kernel can; return the bytes of the ranges it collapsed in full.

    A fork copies the parent's page tables, one entry for each 4 KiB page of anonymous memory,
    and a child's exit frees its copy. For a zygote that has imported torch (about 240 MiB)
    that was most of what a child cost: about 30 ms of system time for a child that does
    little, 12 ms with huge pages (200 forks, measured on a 2-core machine). A 2 MiB page needs
    one entry where 4 KiB pages need 512. Nothing else changes for a child: its first write to
    a huge page splits that page's mapping and copies only the 4 KiB written, as before. The
    pages are collapsed once (``MADV_COLLAPSE``, about 0.5 s), before the fork
    `COLLAPSE_AFTER`; where the kernel cannot (older than Linux 6.1, or transparent huge pages
    switched off) the call fails and the memory stays as it was.
    """
    madvise = _libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    done = 0
    try:
        with open("/proc/self/maps", encoding="ascii") as f:
            maps = f.read().splitlines()
    except OSError:
        return 0
    for line in maps:
        fields = line.split()
        path = fields[5] if len(fields) > 5 else ""
        if "w" not in fields[1] or fields[1][3] != "p" or path not in ("", "[heap]"):
            continue
        low, high = (int(x, 16) for x in fields[0].split("-"))
        start = -(-low // _HUGE_PAGE) * _HUGE_PAGE
        end = high // _HUGE_PAGE * _HUGE_PAGE
        if end > start and madvise(start, end - start, _MADV_COLLAPSE) == 0:
            done += end - start
    return done


def _send(sock: socket.socket, message: dict[str, Any]) -> None:
    sock.sendall(json.dumps(message).encode())


def _become_child(sock: socket.socket, fds: list[int], workdir: str, keep: set[int]) -> None:
    """In the forked child: shed what the zygote holds, then serve the grader."""
    os.setsid()
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a fresh interpreter
    sock.close()
    inp, out = fds
    os.dup2(inp, 0)
    os.dup2(out, 1)
    for fd in (open_fds() - keep - {0, 1, 2}) | ({inp, out} - {0, 1}):
        with contextlib.suppress(OSError):
            os.close(fd)
    os.chdir(workdir)
    os.environ["HOME"] = os.environ["TMPDIR"] = workdir
    tempfile.tempdir = workdir
    child.serve()


def _kill(pid: int) -> None:
    """Kill a child and its process group, then reap it."""
    for kill in (os.killpg, os.kill):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)


def preload() -> None:
    """Import the parts of torch that notebooks pull in lazily, once for all children.

    A notebook may call ``torch.use_deterministic_algorithms`` itself, which imports
    ``torch._inductor.config`` and with it torch's compiler stack: close to two seconds, and parts
    of it (torch's decompositions) are unreadable to a child under a rule on torch's operators.
    It is torch's own code; the assignments' rules concern the book's modules, which stay out.
    matplotlib, which many notebooks import, is loaded here too (see below). Last, torch's
    Python decompositions are indexed by operator (`poison.index_decompositions`), so that a
    child that poisons an operator reads only that operator's entries.
    """
    with contextlib.suppress(ImportError):
        import torch._inductor.config  # noqa: F401
    # IPython, so that each child can answer ``from IPython import get_ipython`` with its own
    # stand-in (`ipython_shell.install`) without importing it again.
    with contextlib.suppress(ImportError):
        import IPython.core.getipython  # noqa: F401
    # matplotlib builds its font list on first import, with a subprocess (fc-list) that a
    # confined child may not start: build it here once, for every child.
    with contextlib.suppress(Exception):
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot  # noqa: F401
    # The grader's font-list folder (`zygote_client._matplotlib_cache`) served the import above;
    # the children get no variable of it.
    os.environ.pop("MPLCONFIGDIR", None)
    # Where torch's decompositions of each operator are, for the children that poison some.
    poison.index_decompositions()


def main(fd: int) -> None:
    """Serve spawn and kill requests on the socket ``fd`` until the grader closes it."""
    kernel.set_parent_death_signal()  # the grader gone, the zygote and its children go too
    # Process 1 of a PID namespace of its own (the process the grader started waits for it), so
    # that each child can be process 1 of one of its own (`namespaces.PidNamespaces`).
    pid_namespaces = None
    # A fork keeps only the forking thread: threads of this process, had its imports started
    # any, would vanish from the forking process unseen, so they are counted here, before.
    threads_before = thread_count()
    with contextlib.suppress(kernel.KernelError):  # then plain forks (the grader checked)
        namespaces.become_pid_namespace_init()
        kernel.set_parent_death_signal()  # its parent is now the waiting process
        pid_namespaces = namespaces.PidNamespaces()
    torch.set_num_threads(1)
    with contextlib.suppress(RuntimeError):
        torch.set_num_interop_threads(1)
    preload()
    # Everything imported so far is kept out of the cyclic garbage collector's scans, here and
    # in every child: a child's collection would otherwise walk (and so copy, page by page) the
    # whole heap it shares with the zygote.
    gc.freeze()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock = socket.socket(fileno=fd)
    keep = open_fds() - {fd} - ({pid_namespaces.own} if pid_namespaces else set())
    _send(sock, {"op": "hello", "threads": max(thread_count(), threads_before),
                 "pid": int(os.readlink("/proc/self")),
                 "pid_namespaces": pid_namespaces is not None})
    children: dict[int, int] = {}  # the grader's number of each child: the zygote's number
    spawned = 0
    try:
        while True:
            try:
                data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 2)
            except OSError:
                break
            if not data:
                break
            msg = json.loads(data.decode())
            if msg.get("op") == "spawn" and len(fds) == 2:
                spawned += 1
                if spawned == COLLAPSE_AFTER:
                    collapse_into_huge_pages()
                try:
                    if pid_namespaces is not None:
                        pid, seen = pid_namespaces.fork()
                    else:
                        pid = seen = os.fork()
                except OSError as exc:  # no process left on the machine: say so, go on
                    for f in fds:
                        os.close(f)
                    _send(sock, {"error": f"fork failed: {exc.strerror}"})
                    continue
                if pid == 0:
                    try:
                        _become_child(sock, fds, str(msg["dir"]), keep)
                    finally:
                        os._exit(70)
                children[seen] = pid
                for f in fds:
                    os.close(f)
                _send(sock, {"pid": seen})
            elif msg.get("op") == "kill":
                pid = children.pop(int(msg["pid"]), None)
                if pid is not None:
                    _kill(pid)
                _send(sock, {"ok": True})
            else:
                for f in fds:
                    os.close(f)
                _send(sock, {"error": "unknown request"})
    finally:
        for pid in children.values():
            _kill(pid)


if __name__ == "__main__":
    main(int(sys.argv[1]))
