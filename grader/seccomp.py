"""seccomp: the system calls the grader's child may make, filtered by the kernel, for good.

`seccomp` installs a classic-BPF filter (assembled by `_Program`, written by `_filter`): no new
process (fork, vfork, clone without ``CLONE_THREAD``; ``clone3`` answers ENOSYS so that the C
library falls back to ``clone`` for threads), no exec, no socket, no ptrace or reading another
process's memory, no signal to another process, no raising of a resource limit, no mounts,
namespaces, io_uring, BPF, kernel keys or modules, no System V IPC, no change to a file's mode,
owner, times or extended attributes, no inotify, and no leaving of its session (`DENIED`); no
descriptor's signal owner, lease or change notice (``fcntl``) and no inode flag (``ioctl``), by
their arguments. Scheduling and priority (CPU affinity, policy, nice, I/O priority) may be set
for the calling process only (`OWN_SCHEDULING`, ``setpriority`` and ``ioprio_set`` with
``PRIO_PROCESS`` and 0 or its own pid): pid and ``which`` are C ints, so the low 32 bits of an
argument, which classic BPF compares, are all the kernel reads of it. A thread named by its own
tid (other than the main thread's) is refused too, since no tid is known when the filter is
written; pid 0 (the calling thread) is what torch's start-up and OpenMP without
``OMP_PROC_BIND`` use.
x86-64 only; `seccomp_available` says whether this kernel filters system calls.
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct

from .syscalls import (
    _NR,
    _PR_GET_SECCOMP,
    _PR_SET_NO_NEW_PRIVS,
    _X86_64,
    KernelError,
    _libc,
    _prctl,
    _syscall,
)

DENIED = (
    # new processes and programs
    "fork", "vfork", "execve", "execveat",
    # the network and sockets of any kind
    "socket", "socketpair", "connect", "bind", "listen", "accept", "accept4",
    # other processes: their memory, their signals, their file descriptors
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_open", "pidfd_getfd",
    "pidfd_send_signal", "process_madvise", "process_mrelease", "tkill", "migrate_pages",
    "move_pages",
    # limits and privileges, the session (the grader kills a child by its session too)
    "setrlimit", "capset", "setsid", "setpgid", "personality",
    # the machine: mounts, namespaces, modules, keys, clocks, swap, BPF, io_uring
    "mount", "umount2", "pivot_root", "chroot", "open_tree", "move_mount", "fsopen",
    "fsconfig", "fsmount", "fspick", "mount_setattr", "unshare", "setns", "init_module",
    "finit_module", "delete_module", "kexec_load", "kexec_file_load", "reboot", "swapon",
    "swapoff", "acct", "quotactl", "syslog", "vhangup", "sethostname", "setdomainname",
    "iopl", "ioperm", "settimeofday", "clock_settime", "adjtimex", "clock_adjtime",
    "add_key", "request_key", "keyctl", "bpf", "perf_event_open", "userfaultfd",
    "io_uring_setup", "io_uring_enter", "io_uring_register", "fanotify_init",
    "name_to_handle_at", "open_by_handle_at",
    # memory outside the address-space limit
    "memfd_create", "memfd_secret",
    # System V IPC: its objects belong to no process and outlive the grader; shared between
    # the children of a notebook they would carry state from one "fresh" process to the next
    "shmget", "shmat", "shmdt", "shmctl", "msgget", "msgsnd", "msgrcv", "msgctl", "semget",
    "semop", "semtimedop", "semctl",
    # files the child owns outside its scratch folder (run as uid 0 without capabilities, it
    # owns every root-owned file; Landlock does not cover these): modes, owners, times, extended
    # attributes; and watching folders it cannot read
    "chmod", "fchmod", "fchmodat", "fchmodat2", "chown", "fchown", "lchown", "fchownat",
    "utime", "utimes", "futimesat", "utimensat", "setxattr", "lsetxattr", "fsetxattr",
    "setxattrat", "removexattr", "lremovexattr", "fremovexattr", "removexattrat",
    "inotify_init", "inotify_init1", "inotify_add_watch", "fanotify_mark",
)

# Scheduling and priority calls whose first argument names the process (or thread) they
# change: allowed on the calling process only (0, or its own pid), as `_filter` checks.
OWN_SCHEDULING = ("sched_setaffinity", "sched_setscheduler", "sched_setparam", "sched_setattr")
_PRIO_PROCESS = 0  # setpriority's "which": one process (not PRIO_PGRP, not PRIO_USER)
_IOPRIO_WHO_PROCESS = 1  # ioprio_set's "which": one process (not a group, not a user)

_AUDIT_ARCH_X86_64 = 0xC000003E
_X32_BIT = 0x40000000
# A descriptor's owner gets the signal the kernel sends when the descriptor is ready (O_ASYNC):
# F_SETOWN names any process the caller's uid may signal, F_SETSIG picks the signal (SIGKILL
# too). The kill calls are checked above; this path is closed here, whatever Landlock's ABI
# (its signal scope arrived with ABI 6, Linux 6.12).
# A lease (F_SETLEASE) on a file the child may read, which a child of a grader run as root
# owns, blocks every other process's open of it for up to the lease-break time (45 s), the
# child's own /proc files included (which `ps` and the grader read); a directory's change
# notices (F_NOTIFY) name files the child could not list. The inode-flag ioctls set flags
# (immutable, append-only, sync, noatime) and project ids on files the child owns, as Landlock
# does not see; verity would seal a file for good.
_SIGNAL_OWNER_FCNTL = (8, 10, 15, 1024, 1026)  # F_SETOWN, F_SETSIG, F_SETOWN_EX, F_SETLEASE,
# F_NOTIFY
_SIGNAL_OWNER_IOCTL = (
    0x8901, 0x8902,  # FIOSETOWN, SIOCSPGRP
    0x40086602, 0x40046602,  # FS_IOC_SETFLAGS, FS_IOC32_SETFLAGS
    0x40087602, 0x40047602,  # FS_IOC_SETVERSION, FS_IOC32_SETVERSION
    0x401C5820,  # FS_IOC_FSSETXATTR
    0x40806685,  # FS_IOC_ENABLE_VERITY
)
_CLONE_THREAD = 0x00010000
_CLONE_NAMESPACES = 0x7E020000  # NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET

_SECCOMP_RET_KILL_PROCESS = 0x80000000
_SECCOMP_RET_ERRNO = 0x00050000
_SECCOMP_RET_ALLOW = 0x7FFF0000
_SECCOMP_SET_MODE_FILTER = 1
_SECCOMP_FILTER_FLAG_TSYNC = 1


def seccomp_available() -> bool:
    """Whether this kernel filters system calls with seccomp (and this module has the filter)."""
    if not _X86_64:
        return False
    return _libc.prctl(_PR_GET_SECCOMP, 0, 0, 0, 0) >= 0


class _Program:
    """A tiny classic-BPF assembler with labels (jumps are forward and at most 255 apart)."""

    def __init__(self) -> None:
        self.code: list[tuple[int, object, object, int]] = []
        self.labels: dict[str, int] = {}

    def label(self, name: str) -> None:
        self.labels[name] = len(self.code)

    def load(self, offset: int) -> None:
        self.code.append((0x20, 0, 0, offset))  # BPF_LD | BPF_W | BPF_ABS

    def jump(self, op: str, k: int, jt: object = 0, jf: object = 0) -> None:
        code = {"eq": 0x15, "ge": 0x35, "set": 0x45}[op]  # BPF_JMP | BPF_JEQ/JGE/JSET | BPF_K
        self.code.append((code, jt, jf, k))

    def ret(self, value: int) -> None:
        self.code.append((0x06, 0, 0, value))  # BPF_RET | BPF_K

    def assemble(self) -> bytes:
        out = b""
        for i, (code, jt, jf, k) in enumerate(self.code):
            offsets = []
            for target in (jt, jf):
                if isinstance(target, str):
                    delta = self.labels[target] - (i + 1)
                    if not 0 <= delta <= 255:
                        raise ValueError(f"jump to {target} out of range ({delta})")
                    offsets.append(delta)
                else:
                    offsets.append(int(target))
            out += struct.pack("=HBBI", code, offsets[0], offsets[1], k & 0xFFFFFFFF)
        return out


def _filter(pid: int) -> bytes:
    """The seccomp program of a child whose process id is ``pid``."""
    nr, arch, arg = 0, 4, 16  # offsets in struct seccomp_data; the low half of args[i] at 16+8i
    deny = _SECCOMP_RET_ERRNO | errno.EPERM
    p = _Program()
    p.load(arch)
    p.jump("eq", _AUDIT_ARCH_X86_64, 0, "kill")
    p.load(nr)
    p.jump("ge", _X32_BIT, "deny", 0)  # the x32 ABI's numbers
    p.jump("eq", _NR["clone3"], "enosys", 0)
    p.jump("eq", _NR["clone"], "clone", 0)
    for name in ("kill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo"):
        p.jump("eq", _NR[name], "own_pid", 0)  # the first argument is the target's pid
    p.jump("eq", _NR["prlimit64"], "prlimit", 0)
    for name in OWN_SCHEDULING:
        p.jump("eq", _NR[name], "self", 0)  # the first argument is the target's pid
    p.jump("eq", _NR["setpriority"], "setpriority", 0)
    p.jump("eq", _NR["ioprio_set"], "ioprio_set", 0)
    p.jump("eq", _NR["fcntl"], "fcntl", 0)
    p.jump("eq", _NR["ioctl"], "ioctl", 0)
    for name in DENIED:
        p.jump("eq", _NR[name], "deny", 0)
    p.ret(_SECCOMP_RET_ALLOW)
    p.label("clone")  # a thread of this process, in no new namespace
    p.load(arg)
    p.jump("set", _CLONE_NAMESPACES, "deny", 0)
    p.jump("set", _CLONE_THREAD, "allow", "deny")
    p.label("own_pid")
    p.load(arg)
    p.jump("eq", pid, "allow", "deny")
    p.label("prlimit")  # reading a limit, never setting one: new_limit (args[2]) is NULL
    p.load(arg + 16)
    p.jump("eq", 0, 0, "deny")
    p.load(arg + 20)
    p.jump("eq", 0, "allow", "deny")
    p.label("setpriority")  # which = PRIO_PROCESS, who (args[1]) this process
    p.load(arg)
    p.jump("eq", _PRIO_PROCESS, "who", "deny")
    p.label("ioprio_set")  # which = IOPRIO_WHO_PROCESS, who (args[1]) this process
    p.load(arg)
    p.jump("eq", _IOPRIO_WHO_PROCESS, "who", "deny")
    p.label("who")
    p.load(arg + 8)
    p.jump("eq", 0, "allow", 0)
    p.jump("eq", pid, "allow", "deny")
    p.label("fcntl")  # no owner for a descriptor's signals, no signal chosen, no lease, no notice
    p.load(arg + 8)
    for cmd in _SIGNAL_OWNER_FCNTL:
        p.jump("eq", cmd, "deny", 0)
    p.ret(_SECCOMP_RET_ALLOW)
    p.label("ioctl")  # the same through ioctl, and no inode flags
    p.load(arg + 8)
    for request in _SIGNAL_OWNER_IOCTL:
        p.jump("eq", request, "deny", 0)
    p.ret(_SECCOMP_RET_ALLOW)
    p.label("self")  # 0 (the calling thread) or this process's pid (its main thread)
    p.load(arg)
    p.jump("eq", 0, "allow", 0)
    p.jump("eq", pid, "allow", "deny")
    p.label("allow")
    p.ret(_SECCOMP_RET_ALLOW)
    p.label("deny")
    p.ret(deny)
    p.label("enosys")
    p.ret(_SECCOMP_RET_ERRNO | errno.ENOSYS)
    p.label("kill")
    p.ret(_SECCOMP_RET_KILL_PROCESS)
    return p.assemble()


def seccomp() -> None:
    """Install the system-call filter on this process and all its threads, for good."""
    if not _X86_64:
        raise KernelError(errno.ENOSYS, "the seccomp filter is written for x86-64")
    program = _filter(os.getpid())
    buf = ctypes.create_string_buffer(program, len(program))

    class _Fprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    prog = _Fprog(len(program) // 8, ctypes.addressof(buf))
    _prctl(_PR_SET_NO_NEW_PRIVS, 1)
    _syscall("seccomp", ctypes.c_uint(_SECCOMP_SET_MODE_FILTER),
             ctypes.c_uint(_SECCOMP_FILTER_FLAG_TSYNC), ctypes.byref(prog))
