"""The kernel's system calls as the grader's confinement makes them: libc, numbers, errors.

The ground under `grader.landlock`, `grader.seccomp` and `grader.kernel`
(assignments' grading, chapter-free): the C library loaded once through ctypes, the x86-64
numbers of the system calls the confinement makes or refuses, the ``prctl`` options it uses,
and `KernelError`, raised by a call that fails (with the errno).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import sys


class KernelError(OSError):
    """A confinement step failed (the child must then not run the student's code)."""


_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_libc.prctl.restype = ctypes.c_int
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong,
                        ctypes.c_ulong]

_X86_64 = platform.machine() in ("x86_64", "AMD64") and sys.platform == "linux"

# System call numbers (x86-64).
_NR = {
    "socket": 41, "connect": 42, "accept": 43, "bind": 49, "listen": 50, "socketpair": 53,
    "ioctl": 16, "fcntl": 72, "clone": 56, "fork": 57, "vfork": 58, "execve": 59, "kill": 62,
    "ptrace": 101,
    "shmget": 29, "shmat": 30, "shmctl": 31, "semget": 64, "semop": 65, "semctl": 66,
    "shmdt": 67, "msgget": 68, "msgsnd": 69, "msgrcv": 70, "msgctl": 71, "setpriority": 141,
    "sched_setparam": 142, "sched_setscheduler": 144, "sched_setaffinity": 203,
    "semtimedop": 220, "ioprio_set": 251, "sched_setattr": 314,
    "syslog": 103, "setpgid": 109, "setsid": 112, "capset": 126, "rt_sigqueueinfo": 129,
    "personality": 135, "vhangup": 153, "pivot_root": 155, "adjtimex": 159, "setrlimit": 160,
    "chroot": 161, "acct": 163, "settimeofday": 164, "mount": 165, "umount2": 166,
    "swapon": 167, "swapoff": 168, "reboot": 169, "sethostname": 170, "setdomainname": 171,
    "iopl": 172, "ioperm": 173, "init_module": 175, "delete_module": 176, "quotactl": 179,
    "tkill": 200, "clock_settime": 227, "tgkill": 234, "kexec_load": 246, "add_key": 248,
    "request_key": 249, "keyctl": 250, "migrate_pages": 256, "unshare": 272,
    "move_pages": 279, "accept4": 288, "rt_tgsigqueueinfo": 297, "perf_event_open": 298,
    "fanotify_init": 300, "prlimit64": 302, "name_to_handle_at": 303,
    "open_by_handle_at": 304, "clock_adjtime": 305, "setns": 308, "process_vm_readv": 310,
    "process_vm_writev": 311, "kcmp": 312, "finit_module": 313, "seccomp": 317,
    "memfd_create": 319, "kexec_file_load": 320, "bpf": 321, "execveat": 322,
    "userfaultfd": 323, "pidfd_send_signal": 424, "io_uring_setup": 425,
    "io_uring_enter": 426, "io_uring_register": 427, "open_tree": 428, "move_mount": 429,
    "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433, "pidfd_open": 434,
    "clone3": 435, "pidfd_getfd": 438, "process_madvise": 440, "mount_setattr": 442,
    "landlock_create_ruleset": 444, "landlock_add_rule": 445, "landlock_restrict_self": 446,
    "memfd_secret": 447, "process_mrelease": 448,
    "chmod": 90, "fchmod": 91, "chown": 92, "fchown": 93, "lchown": 94, "utime": 132,
    "setxattr": 188, "lsetxattr": 189, "fsetxattr": 190, "removexattr": 197,
    "lremovexattr": 198, "fremovexattr": 199, "utimes": 235, "inotify_init": 253,
    "inotify_add_watch": 254, "fchownat": 260, "futimesat": 261, "fchmodat": 268,
    "utimensat": 280, "inotify_init1": 294, "fanotify_mark": 301, "fchmodat2": 452,
    "setxattrat": 463, "removexattrat": 466,
}

_PR_SET_PDEATHSIG = 1
_PR_CAPBSET_DROP = 24
_PR_SET_SECCOMP = 22
_PR_GET_SECCOMP = 21
_PR_SET_CHILD_SUBREAPER = 36
_PR_SET_NO_NEW_PRIVS = 38
_PR_CAP_AMBIENT = 47
_PR_CAP_AMBIENT_CLEAR_ALL = 4


def _syscall(name: str, *args: object) -> int:
    result = _libc.syscall(ctypes.c_long(_NR[name]), *args)
    if result < 0:
        err = ctypes.get_errno()
        raise KernelError(err, f"{name}: {os.strerror(err)}")
    return int(result)


def _prctl(option: int, a: int = 0, b: int = 0, c: int = 0, d: int = 0) -> int:
    result = _libc.prctl(option, a, b, c, d)
    if result < 0:
        err = ctypes.get_errno()
        raise KernelError(err, f"prctl({option}): {os.strerror(err)}")
    return result
