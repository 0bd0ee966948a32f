"""Confinement by the Linux kernel for the grader's child processes: Landlock, seccomp, limits.

Python-level hooks run in the same process as the student's code, which can reach and undo them.
What this module sets up cannot be undone from inside, not even by code that runs as root:

* `drop_privileges`: no capability left (so a child started as root cannot raise its limits or
  override file permissions) and ``no_new_privs`` (nothing it could run would regain them);
* `landlock`: the file system as the child sees it: it may read only the folders and files it
  is given (Python, its packages, the parts of ``utils`` an assignment allows) and write only in
  its own scratch folder; it may execute nothing, bind or connect no TCP socket, and signal or
  reach through abstract Unix sockets no process outside its own Landlock domain;
* `seccomp`: a filter on system calls: no new process (fork, vfork, clone without
  ``CLONE_THREAD``; ``clone3`` answers ENOSYS so that the C library falls back to ``clone`` for
  threads), no exec, no socket, no ptrace or reading another process's memory, no signal to
  another process, no raising of a resource limit, no mounts, namespaces, io_uring, BPF, kernel
  keys or modules, and no leaving of its session;
* `set_limits`: address space, CPU time, file size, open files, no core dumps.

The grader's side: `set_child_subreaper` (orphans of the grader's descendants come back to the
grader, which can then kill them), `descendants` and `kill_descendants`.

`support` says whether this kernel has what the grader needs. Only Linux on x86-64 gets the
seccomp filter; elsewhere the grader refuses to run unless told ``--insecure``.

This module is the one door to the kernel for the grader and its child: it holds the steps
that are a few lines each, and re-exports the pieces that live in modules of their own:
`grader.landlock`, `grader.seccomp`, `grader.processes` (the grader's side)
and `grader.syscalls` (libc, system call numbers, `KernelError`).
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import resource
import signal
import struct
import sys

from . import cgroups, namespaces
from .landlock import landlock, landlock_abi
from .namespaces import has_capabilities, own_namespaces, scratch_on_tmpfs
from .processes import (
    cpu_seconds,
    descendants,
    kill_descendants,
    set_child_subreaper,
    thread_count,
)
from .seccomp import seccomp, seccomp_available
from .syscalls import (
    _PR_CAP_AMBIENT,
    _PR_CAP_AMBIENT_CLEAR_ALL,
    _PR_CAPBSET_DROP,
    _PR_SET_NO_NEW_PRIVS,
    _PR_SET_PDEATHSIG,
    _X86_64,
    KernelError,
    _libc,
    _prctl,
    _syscall,
)

__all__ = [
    "support",
    "landlock_abi",
    "own_namespaces",
    "scratch_on_tmpfs",
    "own_proc",
    "drop_privileges",
    "landlock",
    "seccomp",
    "set_limits",
    "set_child_subreaper",
    "set_parent_death_signal",
    "descendants",
    "kill_descendants",
    "cpu_seconds",
    "thread_count",
    "KernelError",
]


# --------------------------------------------------------------------------------------------
# What the kernel offers


def support() -> tuple[bool, str]:
    """(True, a description) when this kernel has Landlock and seccomp; else (False, why)."""
    missing = []
    if sys.platform != "linux":
        return False, f"the grader's isolation needs Linux, this is {sys.platform}"
    if not _X86_64:
        return False, (f"the grader's seccomp filter is written for x86-64, this machine is "
                       f"{platform.machine()}")
    abi = landlock_abi()
    if abi < 1:
        missing.append("Landlock (Linux 5.13 or later, enabled with lsm=landlock)")
    if not seccomp_available():
        missing.append("seccomp filters (CONFIG_SECCOMP_FILTER)")
    if not missing:
        failed = namespaces.trial()
        if failed:
            missing.append(f"namespaces a child of this grader may enter ({failed})")
    if missing:
        return False, "this kernel lacks " + " and ".join(missing)
    groups, why = cgroups.available()
    if not groups:
        return False, why
    return True, f"Landlock ABI {abi}, seccomp, namespaces and control groups"


# --------------------------------------------------------------------------------------------
# In the child, before the student's first line


def own_proc() -> str:
    """This process's folder in ``/proc`` (``/proc/self`` resolved: in a PID namespace of its
    own a child is process 1, but ``/proc`` names it by its number outside)."""
    return "/proc/" + os.readlink("/proc/self")


def set_parent_death_signal() -> None:
    """Be killed when the parent process dies (so no child outlives its grader)."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def drop_privileges() -> None:
    """Set ``no_new_privs`` and give up every capability, for good."""
    _prctl(_PR_SET_NO_NEW_PRIVS, 1)
    if not has_capabilities():  # an ordinary user, or root without capabilities (a container
        return  # run with all of them dropped): none to give up, and dropping one would fail
    cap = 0
    while cap < 64:
        if _libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) < 0:
            if ctypes.get_errno() == errno.EINVAL:  # past the last capability
                break
            raise KernelError(ctypes.get_errno(), "could not drop a capability")
        cap += 1
    _libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    header = struct.pack("Ii", 0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = bytes(24)  # two of {effective, permitted, inheritable}, all empty
    hbuf = ctypes.create_string_buffer(header, len(header))
    dbuf = ctypes.create_string_buffer(data, len(data))
    _syscall("capset", hbuf, dbuf)
    if has_capabilities():
        raise KernelError(errno.EPERM, "capabilities are still held after dropping them")


def set_limits(memory_mb: int, cpu_s: int, file_mb: int = 16, open_files: int = 64) -> None:
    """Hard limits: address space, CPU time, size of a written file, open files, no core."""
    mem = int(memory_mb) * 2**20
    for what, value in ((resource.RLIMIT_AS, mem), (resource.RLIMIT_CPU, int(cpu_s)),
                        (resource.RLIMIT_FSIZE, int(file_mb) * 2**20),
                        (resource.RLIMIT_NOFILE, int(open_files)), (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(what, (value, value))
