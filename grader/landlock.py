"""Landlock: the file system and the network as the grader's child sees them, for good.

`landlock` lets the child read only the folders and files it is given (Python, its packages, the
parts of ``utils`` an assignment allows) and write only in its own scratch folder; it may
execute nothing, bind or connect no TCP socket, and signal or reach through abstract Unix
sockets no process outside its own Landlock domain. `landlock_abi` says which version of
Landlock this kernel has (0: none). Paths are strings; rights are the bit masks of
``linux/landlock.h``.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
import struct
from collections.abc import Iterable

from .syscalls import _NR, _PR_SET_NO_NEW_PRIVS, _X86_64, KernelError, _libc, _prctl, _syscall

# Landlock (linux/landlock.h): the rights on files, bit 0 first (REFER from ABI 2, TRUNCATE
# from ABI 3, IOCTL_DEV from ABI 5), then the rights on TCP (ABI 4) and the scopes (ABI 6).
(_LL_EXECUTE, _LL_WRITE_FILE, _LL_READ_FILE, _LL_READ_DIR, _LL_REMOVE_DIR, _LL_REMOVE_FILE,
 _LL_MAKE_CHAR, _LL_MAKE_DIR, _LL_MAKE_REG, _LL_MAKE_SOCK, _LL_MAKE_FIFO, _LL_MAKE_BLOCK,
 _LL_MAKE_SYM, _LL_REFER, _LL_TRUNCATE, _LL_IOCTL_DEV) = (1 << bit for bit in range(16))
_LL_NET_BIND_TCP, _LL_NET_CONNECT_TCP = 1 << 0, 1 << 1
_LL_SCOPE_ABSTRACT_UNIX_SOCKET, _LL_SCOPE_SIGNAL = 1 << 0, 1 << 1
_LL_RULE_PATH_BENEATH = 1
_LL_CREATE_RULESET_VERSION = 1 << 0


def landlock_abi() -> int:
    """The Landlock ABI version of this kernel; 0 when it has none (or it is disabled)."""
    if not _X86_64:
        return 0
    result = _libc.syscall(ctypes.c_long(_NR["landlock_create_ruleset"]), None,
                           ctypes.c_size_t(0), ctypes.c_uint32(_LL_CREATE_RULESET_VERSION))
    return int(result) if result > 0 else 0


def _fs_rights(abi: int) -> int:
    rights = (_LL_EXECUTE | _LL_WRITE_FILE | _LL_READ_FILE | _LL_READ_DIR | _LL_REMOVE_DIR
              | _LL_REMOVE_FILE | _LL_MAKE_CHAR | _LL_MAKE_DIR | _LL_MAKE_REG | _LL_MAKE_SOCK
              | _LL_MAKE_FIFO | _LL_MAKE_BLOCK | _LL_MAKE_SYM)
    if abi >= 2:
        rights |= _LL_REFER
    if abi >= 3:
        rights |= _LL_TRUNCATE
    if abi >= 5:
        rights |= _LL_IOCTL_DEV
    return rights


_FILE_ONLY = _LL_EXECUTE | _LL_WRITE_FILE | _LL_READ_FILE | _LL_TRUNCATE | _LL_IOCTL_DEV


def landlock(read: Iterable[str], write: Iterable[str], listable: Iterable[str] = ()) -> int:
    """Confine this process (and every thread, and anything it could start) for good.

    ``read``: folders (with everything beneath) and single files it may read; ``listable``:
    folders whose entries it may list (their files stay unreadable unless ``read`` names
    them); ``write``: folders it may also write in, create and remove files and folders in.
    Everything else on the file system is out of reach: no reading, writing or executing.
    From ABI 4 on no TCP bind or connect; from ABI 6 on no signal to a process outside this
    domain and no abstract Unix socket outside it. Paths that do not exist are skipped.
    Returns the ABI used.
    """
    abi = landlock_abi()
    if abi < 1:
        raise KernelError(errno.ENOSYS, "this kernel has no Landlock")
    handled = _fs_rights(abi)
    attr = struct.pack("Q", handled)
    if abi >= 4:
        attr += struct.pack("Q", _LL_NET_BIND_TCP | _LL_NET_CONNECT_TCP)
    if abi >= 6:
        attr += struct.pack("Q", _LL_SCOPE_ABSTRACT_UNIX_SOCKET | _LL_SCOPE_SIGNAL)
    abuf = ctypes.create_string_buffer(attr, len(attr))
    ruleset = _syscall("landlock_create_ruleset", abuf, ctypes.c_size_t(len(attr)),
                       ctypes.c_uint32(0))
    try:
        read_rights = _LL_READ_FILE | _LL_READ_DIR
        write_rights = handled & ~(_LL_EXECUTE | _LL_MAKE_CHAR | _LL_MAKE_BLOCK | _LL_MAKE_SOCK
                                   | _LL_MAKE_FIFO | _LL_MAKE_SYM | _LL_IOCTL_DEV)
        for paths, rights in ((read, read_rights), (listable, _LL_READ_DIR),
                              (write, write_rights)):
            for path in paths:
                _add_rule(ruleset, path, rights)
        _prctl(_PR_SET_NO_NEW_PRIVS, 1)
        _syscall("landlock_restrict_self", ctypes.c_int(ruleset), ctypes.c_uint32(0))
    finally:
        os.close(ruleset)
    return abi


def _add_rule(ruleset: int, path: str, rights: int) -> None:
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError:
        return  # nothing there: nothing to allow
    try:
        if not stat.S_ISDIR(os.fstat(fd).st_mode):  # fstat reads an O_PATH descriptor
            rights &= _FILE_ONLY
        rule = struct.pack("=Qi", rights, fd)
        rbuf = ctypes.create_string_buffer(rule, len(rule))
        _syscall("landlock_add_rule", ctypes.c_int(ruleset),
                 ctypes.c_int(_LL_RULE_PATH_BENEATH), rbuf, ctypes.c_uint32(0))
    finally:
        os.close(fd)
