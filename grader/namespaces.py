"""Namespaces of the grader's children, and the scratch folder the kernel bounds.

Each child sees a system of its own: its own process ids (it is process 1 of a PID namespace
made for it, and no other process has a number it could name), its own System V IPC and POSIX
message queues, a network with only a loopback device (down), its own host name, its control
group as the root of the tree, and its own mounts, among them its scratch folder: a tmpfs of
its own, whose size and number of files the kernel holds.

How the zygote (`grader.zygote`) gives each child its own PID namespace:

* `become_pid_namespace_init`, once, when the zygote starts: an ordinary user first enters a
  user namespace of its own (its user and group mapped to themselves); then the process forks
  into a new PID namespace and goes on there as its process 1, while the process the grader
  started only waits for it (and dies with the grader). A PID namespace can only be made by a
  process with ``CAP_SYS_ADMIN`` over the namespace it comes from: root has it over all, an
  ordinary user over the namespaces its own user namespace holds, which is why the zygote moves
  into one before forking children.
* `PidNamespaces.fork`, for each child: the next child is made process 1 of a namespace of its
  own (``setns`` back to the zygote's, then ``unshare``; a process may ask only once for the
  namespace of its next children, and ``setns`` resets that). The child says its number as the
  grader sees it (``/proc/self`` names it that way), which the grader needs for the control
  groups and to read its CPU time.

In the child, before any of the student's code: `own_namespaces` (IPC, network, host name,
control groups, mounts; directly as root, through a user namespace for an ordinary user that
is not in one already) and `scratch_on_tmpfs`. `trial` tries all of this in a throwaway process,
for `grader.kernel.support`.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil

from .syscalls import KernelError, _libc

_CLONE_NEWNS, _CLONE_NEWCGROUP, _CLONE_NEWUTS = 0x00020000, 0x02000000, 0x04000000
_CLONE_NEWIPC, _CLONE_NEWUSER, _CLONE_NEWPID = 0x08000000, 0x10000000, 0x20000000
_CLONE_NEWNET = 0x40000000
_MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REC, _MS_PRIVATE = 2, 4, 8, 0x4000, 0x40000


def has_capabilities() -> bool:
    """Whether this process holds any capability (in its own user namespace)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(("CapEff:", "CapPrm:")) and int(line.split()[1], 16):
                    return True
    except OSError:
        return True
    return False


def _unshare(flags: int, what: str = "new namespaces") -> None:
    if _libc.unshare(flags) != 0:
        raise KernelError(ctypes.get_errno(), f"could not enter {what}")


def _own_user_namespace() -> None:
    """Enter a user namespace of one's own, with one's user and group mapped to themselves,
    and so hold every capability over the namespaces made from it. Single-threaded only."""
    uid, gid = os.geteuid(), os.getegid()
    _unshare(_CLONE_NEWUSER, "a user namespace")
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"),
                       ("gid_map", f"{gid} {gid} 1")):
        try:
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
        except OSError as exc:  # uid 0 without CAP_SETFCAP may not map itself (Linux 5.12)
            raise KernelError(exc.errno or errno.EPERM,
                              f"a user namespace could not map user {uid} to itself "
                              f"({exc.strerror}); as root, keep the capabilities") from None


def own_namespaces() -> None:
    """Leave the grader's IPC, network, host-name, control-group and mount namespaces.

    In its own IPC namespace a child can name no System V object and no POSIX message queue of
    another process, and nothing it makes outlives it; in its own network namespace it has only
    a loopback device, down; in its own control-group namespace its group (made by the grader
    before, `grader.cgroups`) is its root; in its own mount namespace (every mount private, so
    that nothing it mounts is seen outside) it gets its scratch folder (`scratch_on_tmpfs`).
    Root, and a child of a zygote in a user namespace, enter them directly; an ordinary user
    first enters a user namespace of its own, in which it holds the capability needed (and
    gives it up with every other in `grader.kernel.drop_privileges`). Single-threaded only.
    Root without capabilities can do neither: since Linux 5.12 mapping user 0 needs
    ``CAP_SETFCAP``.
    """
    if not has_capabilities():
        _own_user_namespace()
    _unshare(_CLONE_NEWIPC | _CLONE_NEWNET | _CLONE_NEWUTS | _CLONE_NEWCGROUP | _CLONE_NEWNS)
    if _libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None) != 0:
        raise KernelError(ctypes.get_errno(), "could not make the child's mounts private")


def scratch_on_tmpfs(folder: str, size: int, files: int, keep: tuple[str, ...] = ()) -> None:
    """Mount a tmpfs of ``size`` bytes and at most ``files`` files and folders over ``folder``
    (the current folder), with the files named in ``keep`` copied into it, and go into it.

    Only in a mount namespace of one's own (`own_namespaces`): nobody else sees the tmpfs, and
    it goes, with all that was written in it, when the child does. Its pages count towards the
    child's memory limit (`grader.cgroups`). Nothing on it can be executed.
    """
    below = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        options = f"size={int(size)},nr_inodes={int(files)},mode=0700,uid={os.geteuid()}," \
                  f"gid={os.getegid()}"
        if _libc.mount(b"tmpfs", os.fsencode(folder), b"tmpfs",
                       _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, options.encode()) != 0:
            raise KernelError(ctypes.get_errno(), "could not mount the child's scratch folder")
        os.chdir(folder)
        for name in keep:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=below)
            with os.fdopen(fd, "rb") as src, open(name, "wb") as dst:
                shutil.copyfileobj(src, dst)
    finally:
        os.close(below)


def become_pid_namespace_init() -> None:
    """Go on as process 1 of a new PID namespace (in a user namespace of one's own first, for
    an ordinary user), so that `PidNamespaces` can make one for each child. The calling
    process forks; the parent waits for the child and exits with its status; the child
    returns. Raises `KernelError`, having forked nothing, where the kernel refuses.
    Single-threaded only.
    """
    if not has_capabilities():
        _own_user_namespace()
    _unshare(_CLONE_NEWPID, "a PID namespace")
    pid = os.fork()
    if pid == 0:
        return
    _, status = os.waitpid(pid, 0)
    os._exit(os.waitstatus_to_exitcode(status) & 0xFF if os.WIFEXITED(status) else 1)


class PidNamespaces:
    """Forks each child into a PID namespace of its own (see the module's docstring)."""

    def __init__(self) -> None:
        self.own = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)

    def fork(self) -> tuple[int, int]:
        """Fork; in the child (process 1 of a new namespace) returns (0, 0); in the parent
        (pid in the parent's namespace, pid as the grader sees it)."""
        if _libc.setns(self.own, _CLONE_NEWPID) != 0:
            raise KernelError(ctypes.get_errno(), "could not go back to the zygote's namespace")
        _unshare(_CLONE_NEWPID, "a PID namespace")
        reader, writer = os.pipe()
        try:
            pid = os.fork()
        except OSError:
            os.close(reader)
            os.close(writer)
            _libc.setns(self.own, _CLONE_NEWPID)
            raise
        if pid != 0:  # any other fork of the zygote's (none planned) stays in its namespace
            _libc.setns(self.own, _CLONE_NEWPID)
        if pid == 0:
            os.close(reader)
            os.write(writer, os.readlink("/proc/self").encode())
            os.close(writer)
            return 0, 0
        os.close(writer)
        with os.fdopen(reader, "rb") as f:
            said = f.read(32)
        if not said.isdigit():  # it died before saying it (no memory left, say): never guess
            os.waitpid(pid, 0)  # a number, which outside this namespace is another process's
            raise OSError(errno.ESRCH, "the child ended before it started")
        return pid, int(said)


def trial() -> str:
    """Why a child cannot have the namespaces and scratch folder above (tried in a throwaway
    process that takes each step the zygote and a child take), or "" when it can."""
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:  # nothing but system calls here, then out
        os.close(reader)
        try:
            become_pid_namespace_init()
            own = PidNamespaces()
            for _ in range(2):  # a second namespace, after the first child is gone
                child, _host = own.fork()
                if child == 0:
                    code = 2
                    try:
                        own_namespaces()
                        scratch_on_tmpfs("/tmp", 2**20, 16)
                        code = 0 if os.getpid() == 1 else 3
                    except BaseException as exc:  # noqa: BLE001 (reported to the parent)
                        os.write(writer, f"{exc}; ".encode()[:500])
                    finally:
                        os._exit(code)
                _, status = os.waitpid(child, 0)
                if os.waitstatus_to_exitcode(status) != 0:
                    raise KernelError(errno.EPERM, "a child could not enter its namespaces "
                                                   "or mount its scratch folder")
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
