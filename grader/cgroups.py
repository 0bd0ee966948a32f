"""Bounds that the kernel holds for each child: its number of tasks and its memory (cgroups).

A limit that the grader polls is only as good as its period: between two polls a child can start
hundreds of threads, and threads are counted per user, so one submission's bomb can take the
process table from the next student's child. A control group holds its limits at every
allocation instead. Each child gets a group of its own, made by the grader before the child runs
a line of the student's (the child waits for its start message, which comes after):

* ``pids.max``: at most `MAX_THREADS` tasks (threads included); the next ``clone`` fails with
  EAGAIN, inside the child, whatever it is doing;
* the memory limit (``memory.max``, or ``memory.limit_in_bytes`` with its swap twin in version 1
  of the interface): what the child touches, files it writes to memory-backed folders included;
  past it the kernel reclaims and then kills the child alone.

Both versions of the interface are served: version 2 (the unified tree, where the grader's own
group must be delegated to it, as systemd does with ``Delegate=yes``, and hold no other
process: the grader moves itself into a group below it and hands the controllers down,
`_v2_delegate`) and version 1 (one tree per controller). `available` says which controllers
the grader can use and, when one is missing, why; the grader refuses to run without them
unless ``--insecure``. Groups are named after the grader (its pid namespace, pid and a random
token) and a count of its children, under the grader's own group, and removed once the child
is reaped (`release`); `events` says whether a child reached a limit.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import secrets
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from .limits import MAX_THREADS

ROOT = Path("/sys/fs/cgroup")
CONTROLLERS = ("pids", "memory")


def _own_paths() -> dict[str, str]:
    """This process's group in each hierarchy: {controller or "": path}, "" for version 2."""
    paths: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, names, path = line.split(":", 2)
            for name in names.split(",") if names else [""]:
                paths[name] = path
    return paths


def _unified() -> Path | None:
    """The mount point of the version-2 tree, if there is one."""
    for candidate in (ROOT, ROOT / "unified"):
        if (candidate / "cgroup.controllers").exists():
            return candidate
    return None


@dataclass
class Group:
    """One child's groups: the folder per controller, and how its limits are written."""

    dirs: dict[str, Path] = field(default_factory=dict)
    v2: bool = False


def _base() -> tuple[dict[str, Path], bool, str]:
    """Where to make the groups of this grader's children: ({controller: parent}, v2, why not)."""
    own = _own_paths()
    tree = _unified()
    name = f"grader-{_namespace()}-{os.getpid()}-{secrets.token_hex(4)}"
    if tree is not None and "" in own:
        parent = tree / own[""].lstrip("/")
        if os.access(parent, os.W_OK) and _v2_delegate(parent, name):
            return {c: parent / name for c in CONTROLLERS}, True, ""
    dirs, missing = {}, []
    for c in CONTROLLERS:
        parent = ROOT / c / own.get(c, "/").lstrip("/")
        if c in own and parent.is_dir() and os.access(parent, os.W_OK):
            dirs[c] = parent / name
        else:
            missing.append(c)
    if missing:
        return {}, False, (f"no {' or '.join(missing)} control group the grader may write "
                           f"(version 1 under {ROOT}, or version 2: a group delegated to "
                           f"the grader, holding no other process)")
    return dirs, False, ""


def _v2_delegate(parent: Path, name: str) -> bool:
    """Whether the grader's own version-2 group ``parent`` hands the controllers down to the
    groups it will make; if it does not yet, make it so where the grader is the only process
    in it. A group that holds processes cannot also hand controllers down, so the grader first
    moves itself into a group of its own under ``parent`` (named like its children's parent,
    so that `_sweep` removes it after the grader is gone), then enables them."""
    def controllers(file: str) -> set[str]:
        with contextlib.suppress(OSError):
            return set((parent / file).read_text().split())
        return set()

    if set(CONTROLLERS) <= controllers("cgroup.subtree_control"):
        return True
    if not set(CONTROLLERS) <= controllers("cgroup.controllers"):
        return False
    try:
        if set((parent / "cgroup.procs").read_text().split()) != {str(os.getpid())}:
            return False  # other processes share the group: they could not all be moved
        own = parent / f"{name}-self"
        own.mkdir(exist_ok=True)
        _write(own / "cgroup.procs", "0")
        _write(parent / "cgroup.subtree_control", " ".join(f"+{c}" for c in CONTROLLERS))
    except OSError:
        return False
    return True


_state: dict[str, object] = {}
_made = itertools.count(1)


class GroupError(OSError):
    """The grader could not give a child its control groups: the grader's fault, not the
    student's (the child is killed and the case flagged ``sandbox``)."""


def available() -> tuple[bool, str]:
    """Whether children can be given groups here; if not, the reason."""
    if "ok" not in _state:
        dirs, v2, why = _base()
        for d in {*dirs.values()}:
            _sweep(d.parent)
        if dirs:
            try:
                for d in {*dirs.values()}:
                    d.mkdir(exist_ok=True)
                    if v2:
                        (d / "cgroup.subtree_control").write_text("+pids +memory")
            except OSError as exc:
                dirs, why = {}, f"cannot make a control group: {exc.strerror}"
        _state.update(ok=bool(dirs), dirs=dirs, v2=v2, why=why)
    return bool(_state["ok"]), str(_state["why"])


def _namespace() -> str:
    """This process's pid namespace, as a number: pids are only unique within one."""
    with contextlib.suppress(OSError):
        return os.readlink("/proc/self/ns/pid").strip("pid:[]")
    return "0"


def _sweep(parent: Path) -> None:
    """Remove the groups left by graders of this pid namespace that are gone (a run killed
    before its exit handlers). Another namespace's groups are not judged from here."""
    prefix = f"grader-{_namespace()}-"
    for d in parent.glob(prefix + "*"):
        pid = d.name.removeprefix(prefix).split("-")[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            for child in d.glob("child-*"):
                release(Group(dirs={"": child}))
            with contextlib.suppress(OSError):
                d.rmdir()


def _write(path: Path, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def attach(pid: int, memory_mb: int, tasks: int = MAX_THREADS) -> Group | None:
    """Put the process ``pid`` in a new group of its own, with its bounds. None where
    `available` says no (the grader then runs only with ``--insecure``)."""
    if not available()[0]:
        return None
    group = Group(v2=bool(_state["v2"]))
    parents: dict[str, Path] = _state["dirs"]  # type: ignore[assignment]
    memory = str(memory_mb * 2**20)
    # Named by a count of this grader's children, not by the pid, which the kernel reuses.
    name = f"child-{next(_made)}"
    try:
        for c in CONTROLLERS:  # version 2: one folder for both controllers
            d = parents[c] / name
            if d not in group.dirs.values():
                d.mkdir()
            group.dirs[c] = d
        pids, mem = group.dirs["pids"], group.dirs["memory"]
        _write(pids / "pids.max", str(tasks))
        if group.v2:
            _write(mem / "memory.max", memory)
            with contextlib.suppress(OSError):
                _write(mem / "memory.swap.max", "0")
        else:
            _write(mem / "memory.limit_in_bytes", memory)
            with contextlib.suppress(OSError):  # only where swap is accounted
                _write(mem / "memory.memsw.limit_in_bytes", memory)
        for d in {*group.dirs.values()}:
            _write(d / "cgroup.procs", str(pid))
    except OSError as exc:
        release(group)  # what was made so far; the caller kills the child
        raise GroupError(exc.errno, f"cannot give a child its control group: "
                                    f"{exc.strerror or exc}") from None
    return group


def events(group: Group | None) -> list[str]:
    """The limits that the group's processes reached: "tasks", "memory"."""
    if group is None:
        return []
    hit = []
    with contextlib.suppress(OSError):
        counts = dict(line.split() for line in
                      (group.dirs["pids"] / "pids.events").read_text().splitlines())
        if int(counts.get("max", 0)):
            hit.append("tasks")
    mem = group.dirs["memory"]
    with contextlib.suppress(OSError):
        if group.v2:
            counts = dict(line.split() for line in
                          (mem / "memory.events").read_text().splitlines())
            reached = int(counts.get("oom_kill", 0))
        else:  # the count of kills (failcnt also counts reclaims that succeeded)
            counts = dict(line.split() for line in
                          (mem / "memory.oom_control").read_text().splitlines())
            reached = int(counts.get("oom_kill", 0))
        if reached:
            hit.append("memory")
    return hit


def release(group: Group | None, wait_s: float = 2.0) -> None:
    """Kill whatever is left in the group, then remove its folders."""
    if group is None:
        return
    deadline = time.monotonic() + wait_s
    for d in {*group.dirs.values()}:
        while True:
            with contextlib.suppress(OSError):
                for pid in (d / "cgroup.procs").read_text().split():
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(int(pid), signal.SIGKILL)
            try:
                d.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:  # busy until its last task is gone
                if time.monotonic() > deadline:
                    break
                time.sleep(0.005)


def remove_base() -> None:
    """Remove this grader's parent groups (at exit; empty by then)."""
    for d in {*(_state.get("dirs") or {}).values()}:  # type: ignore[union-attr]
        with contextlib.suppress(OSError):
            d.rmdir()
