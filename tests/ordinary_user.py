"""Run a command as an ordinary user, as an instructor without root would run the grader.

The tests run as root (CI does). `OrdinaryUser` sets up, as an administrator would, what an
ordinary user needs to run the grader, and `preexec` starts a command as that user (uid and
gid 65534, no capability, no supplementary group):

* control groups delegated to it: a group of its own in each version-1 hierarchy the grader
  uses (pids, memory), owned by the user, which the command starts in (what ``systemd-run
  --user --scope -p Delegate=yes`` gives on a machine with systemd);
* the interpreter reachable: where Python or its packages lie under a folder the user may not
  enter (``/root``, mode 700, here), the command gets a mount namespace of its own in which
  that folder is a world-readable tmpfs holding only those paths, bound read-only from the
  real ones. Nothing outside the command's namespace changes.

`reason` says why this cannot be done here ("" when it can).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import shutil
import stat
import sys
import tempfile
from pathlib import Path

UID = GID = 65534
CGROUP = Path("/sys/fs/cgroup")
_MS_RDONLY, _MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 1, 32, 4096, 0x4000, 0x40000
_CLONE_NEWNS = 0x00020000
_libc = ctypes.CDLL(None, use_errno=True)


def _own_groups() -> dict[str, str]:
    groups = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, names, path = line.split(":", 2)
        for name in names.split(","):
            groups[name] = path
    return groups


def reason() -> str:
    """Why the grader cannot be run as an ordinary user here; "" when it can."""
    if os.geteuid() != 0:
        return "needs root, to set up an ordinary user"
    own = _own_groups()
    if not all(c in own and (CGROUP / c).is_dir() for c in ("pids", "memory")):
        return "the test delegates version-1 control groups (pids, memory); none here"
    return ""


def _hidden(paths: list[str]) -> dict[str, set[str]]:
    """{a folder the user may not enter: the names in it that the paths go through}."""
    hidden: dict[str, set[str]] = {}
    for path in paths:
        parts = Path(path).resolve().parts
        for i in range(1, len(parts) - 1):
            folder = Path(*parts[:i + 1])
            if not os.stat(folder).st_mode & stat.S_IXOTH:
                hidden.setdefault(str(folder), set()).add(parts[i + 1])
                break
    return hidden


class OrdinaryUser:
    """Delegated groups and a view of the interpreter for user 65534 (see the module)."""

    def __init__(self) -> None:
        token = secrets.token_hex(4)
        own = _own_groups()
        self.groups = [CGROUP / c / own[c].lstrip("/") / f"ordinary-{token}"
                       for c in ("pids", "memory")]
        for group in self.groups:
            group.mkdir()
            for path in (group, group / "cgroup.procs", group / "tasks"):
                os.chown(path, UID, GID)
        needed = [sys.executable, sys.prefix, sys.base_prefix, *sys.path]
        self.hidden = _hidden([p for p in needed if p and os.path.exists(p)])
        self.stage = tempfile.mkdtemp(prefix="ordinary-stage-")
        for folder, names in self.hidden.items():
            for name in names:
                os.makedirs(os.path.join(self.stage, folder.strip("/"), name))

    def folder(self) -> Path:
        """A new folder the user owns, in a place it can reach."""
        path = Path(tempfile.mkdtemp(prefix="ordinary-"))
        path.chmod(0o755)
        os.chown(path, UID, GID)
        return path

    def preexec(self) -> None:
        """In the forked child, before exec: join the groups, see the interpreter, become the
        user."""
        for group in self.groups:
            (group / "cgroup.procs").write_text(str(os.getpid()))
        if self.hidden:
            _check(_libc.unshare(_CLONE_NEWNS))
            _check(_libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None))
            for folder, names in self.hidden.items():
                for name in names:  # hold each path before the folder is covered
                    staged = os.path.join(self.stage, folder.strip("/"), name)
                    _bind(os.path.join(folder, name), staged)
                _check(_libc.mount(b"tmpfs", folder.encode(), b"tmpfs", 0, b"mode=0755"))
                for name in names:
                    os.mkdir(os.path.join(folder, name))
                    _bind(os.path.join(self.stage, folder.strip("/"), name),
                          os.path.join(folder, name))
        os.setgroups([])
        os.setresgid(GID, GID, GID)
        os.setresuid(UID, UID, UID)

    def close(self) -> None:
        for group in self.groups:  # groups the grader left (none, if it cleaned up), then ours
            inner = [p for p in group.rglob("*") if p.is_dir()]
            for path in sorted(inner, key=lambda p: len(p.parts), reverse=True) + [group]:
                with contextlib.suppress(OSError):
                    path.rmdir()
        shutil.rmtree(self.stage, ignore_errors=True)


def _bind(source: str, target: str) -> None:
    _check(_libc.mount(source.encode(), target.encode(), None, _MS_BIND | _MS_REC, None))
    _check(_libc.mount(None, target.encode(), None,
                       _MS_REMOUNT | _MS_BIND | _MS_RDONLY, None))


def _check(result: int) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))
