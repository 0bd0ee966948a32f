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

from . import cgroups
from .landlock import landlock, landlock_abi
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
        failed = _namespaces_fail()
        if failed:
            missing.append(f"namespaces a child of this grader may enter ({failed})")
    if missing:
        return False, "this kernel lacks " + " and ".join(missing)
    groups, why = cgroups.available()
    if not groups:
        return False, why
    return True, f"Landlock ABI {abi}, seccomp, namespaces and control groups"


def _namespaces_fail() -> str:
    """Why a child cannot enter namespaces of its own (`own_namespaces`, tried in a fork), or
    "" when it can."""
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:  # nothing but system calls here, then out
        try:
            os.close(reader)
            own_namespaces()
            os.write(writer, b"ok")
        except BaseException as exc:  # noqa: BLE001 (reported to the parent)
            os.write(writer, str(exc).encode()[:500])
        finally:
            os._exit(0)
    os.close(writer)
    with os.fdopen(reader, "rb") as f:
        said = f.read().decode(errors="replace")
    os.waitpid(pid, 0)
    return "" if said == "ok" else (said or "the trial process died")


def own_namespaces() -> None:
    """Leave the grader's IPC, network, host-name and control-group namespaces for new ones.

    In its own IPC namespace a child can name no System V object and no POSIX message queue of
    another process, and nothing it makes outlives it; in its own network namespace it has only
    a loopback device, down; in its own control-group namespace its group (made by the grader
    before, `grader.cgroups`) is its root, and the grader's is not named. Root enters them
    directly; an ordinary user first enters a user namespace of its own, with its own user and
    group mapped to themselves, in which it holds the capability needed (and gives it up with
    every other in `drop_privileges`). The process must be single-threaded for the user
    namespace, as a forked child is. Root without capabilities can do neither: since Linux 5.12
    mapping user 0 needs ``CAP_SETFCAP``.
    """
    if not _has_capabilities():
        uid, gid = os.geteuid(), os.getegid()
        _unshare(_CLONE_NEWUSER)
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"),
                           ("gid_map", f"{gid} {gid} 1")):
            try:
                with open(f"/proc/self/{name}", "w") as f:
                    f.write(text)
            except OSError as exc:  # uid 0 without CAP_SETFCAP may not map itself (Linux 5.12)
                raise KernelError(exc.errno or errno.EPERM,
                                  f"a user namespace could not map user {uid} to itself "
                                  f"({exc.strerror}); as root, keep the capabilities") from None
    _unshare(_CLONE_NEWIPC | _CLONE_NEWNET | _CLONE_NEWUTS | _CLONE_NEWCGROUP)


_CLONE_NEWCGROUP, _CLONE_NEWUTS, _CLONE_NEWIPC = 0x02000000, 0x04000000, 0x08000000
_CLONE_NEWUSER, _CLONE_NEWNET = 0x10000000, 0x40000000


def _unshare(flags: int) -> None:
    if _libc.unshare(flags) != 0:
        raise KernelError(ctypes.get_errno(), "could not enter new namespaces")


# --------------------------------------------------------------------------------------------
# In the child, before the student's first line


def set_parent_death_signal() -> None:
    """Be killed when the parent process dies (so no child outlives its grader)."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def drop_privileges() -> None:
    """Set ``no_new_privs`` and give up every capability, for good."""
    _prctl(_PR_SET_NO_NEW_PRIVS, 1)
    if not _has_capabilities():  # an ordinary user, or root without capabilities (a container
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
    if _has_capabilities():
        raise KernelError(errno.EPERM, "capabilities are still held after dropping them")


def _has_capabilities() -> bool:
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(("CapEff:", "CapPrm:")) and int(line.split()[1], 16):
                    return True
    except OSError:
        return True
    return False


def set_limits(memory_mb: int, cpu_s: int, file_mb: int = 16, open_files: int = 64) -> None:
    """Hard limits: address space, CPU time, size of a written file, open files, no core."""
    mem = int(memory_mb) * 2**20
    for what, value in ((resource.RLIMIT_AS, mem), (resource.RLIMIT_CPU, int(cpu_s)),
                        (resource.RLIMIT_FSIZE, int(file_mb) * 2**20),
                        (resource.RLIMIT_NOFILE, int(open_files)), (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(what, (value, value))
