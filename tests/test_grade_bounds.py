"""Bounds on what a child may do to the rest of the machine, and limits that are not polled away.

Six hostile notebooks of assignment a1 (a right attention function otherwise), graded once in
this process by a module-scoped fixture, so that this process is the grader:

* one whose cells try to pin, renice and idle the grader, the zygote, its own parent and a
  process of the same user without capabilities (CPU affinity, nice 19, ``SCHED_IDLE``; a
  priority for a process group or a user): each call is refused, its own scheduling stays its
  own to set, and the others' scheduling is unchanged after the run;
* one that writes native code of its own to its scratch folder (a shared object whose
  constructor makes System V shared memory, a message queue and a semaphore set) and imports
  it (the audit hook refuses ctypes, not this): the tmpfs is mounted noexec, so it never runs,
  and no IPC object is left;
* one that changes the mode, owner, times and extended attributes of a file outside its
  scratch folder (a child run as uid 0 without capabilities owns every root-owned file): each
  call is refused and the file is unchanged;
* one whose case floods its pipe to the grader with messages while it burns CPU far past its
  limit: scored as a timeout, stopped soon after its limit, not accepted when it answers;
* one that starts 300 threads: the kernel stops it at its control group's 64 tasks, and the
  group is gone after the run;
* one that compares its IPC, network, host-name, control-group, PID and mount namespaces with
  the grader's (all its own), then writes more bytes and more files than its scratch folder
  holds: the kernel refuses them, and the run is flagged ``limits``.

Then, without a notebook: the same shared object loaded by a process under the child's
system-call filter makes no IPC object (each call refused with EPERM); a control group holds
its limits and goes with its process; an ordinary user (a fork become user 65534) enters the
namespaces through a user namespace, takes every step of the zygote's PID namespaces and a
child's tmpfs, and is told why it has no control group; root without capabilities is refused
by the grader, which says why.
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import errno
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest
from hostile_submissions import LEASES, _a1_with
from notebooks import ROOT

from grader import cgroups, kernel, namespaces
from grader.limits import MAX_THREADS, SCRATCH_BYTES, SCRATCH_FILES, Limits
from grader.sandbox import Grading
from grader.zygote_client import shared_zygote
from utils.checks import ASSIGNMENTS

SOURCES = ROOT / "book" / "assignments"
IPC_KEY = 0x7E570042  # the key of every System V object the hostile notebook tries to make
CASE_S = 1.0

pytestmark = pytest.mark.skipif(not kernel.support()[0], reason="needs Landlock and seccomp")


def _notebook(cell: str, path: Path) -> Path:
    nb = nbformat.read(SOURCES / "a1_attention.ipynb", as_version=4)
    assert "### BEGIN SOLUTION" in nb.cells[3].source
    nb.cells[3].source = cell
    for c in nb.cells:
        if c.cell_type == "code":
            c.outputs, c.execution_count = [], None
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)
    return path


def _without_capabilities() -> None:
    if kernel.has_capabilities():
        kernel.drop_privileges()


def _scheduling(pid: int) -> tuple:
    return (sorted(os.sched_getaffinity(pid)), os.getpriority(os.PRIO_PROCESS, pid),
            os.sched_getscheduler(pid), os.sched_getparam(pid).sched_priority)


# Calls on other processes: each must be refused, or the function answers wrongly (ACTED).
_SCHEDULING = '''
import os

ONE_CPU = {min(os.sched_getaffinity(0))}
CALLS = (
    lambda p: os.sched_setaffinity(p, ONE_CPU),
    lambda p: os.setpriority(os.PRIO_PROCESS, p, 19),
    lambda p: os.sched_setscheduler(p, os.SCHED_IDLE, os.sched_param(0)),
    lambda p: os.sched_setparam(p, os.sched_param(0)),
)
# In a PID namespace of its own, its parent has no number it could name.
ACTED = [] if os.getppid() == 0 and os.getpid() == 1 else ["a parent it can name"]
for target in (GRADER, ZYGOTE, VICTIM):
    for number, call in enumerate(CALLS):
        try:
            call(target)
            ACTED.append((target, number))
        except OSError:
            pass
# A process group or a user that holds no process (harmless if let through): refused, not
# "no such process".
for which, who in ((os.PRIO_PGRP, 2**22 + 7), (os.PRIO_USER, 65533)):
    try:
        os.setpriority(which, who, 19)
        ACTED.append((which, who))
    except PermissionError:
        pass
    except OSError:
        ACTED.append((which, who))
# Its own scheduling stays its own to set (as threading libraries do): none of these raises.
os.sched_setaffinity(0, os.sched_getaffinity(0))
os.sched_setaffinity(os.getpid(), os.sched_getaffinity(0))
os.setpriority(os.PRIO_PROCESS, 0, 1)
os.setpriority(os.PRIO_PROCESS, os.getpid(), 2)
os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
'''

# A file outside the scratch folder, owned by the grader's user, which the child can neither
# read nor write (Landlock) but would own: its mode, owner, times and extended attributes must
# stay as they are. Each call must be refused, or the function answers wrongly (ACTED).
_ATTRIBUTES = '''
import os

ACTED = []
for name, call in (
    ("chmod", lambda: os.chmod(VICTIM_FILE, 0o4777)),
    ("chown", lambda: os.chown(VICTIM_FILE, os.getuid(), os.getgid())),
    ("utime", lambda: os.utime(VICTIM_FILE, (0, 0))),
    ("setxattr", lambda: os.setxattr(VICTIM_FILE, "user.graded", b"1")),
    ("chmod in scratch", lambda: (open("mine", "w").close(), os.chmod("mine", 0o4755))),
):
    try:
        call()
        ACTED.append(name)
    except OSError:
        pass
'''

# A shared object whose constructor makes System V IPC objects (run by importing it: the
# import then fails for want of an init function, after the constructor has run).
_PROBE_C = r'''
#include <stdio.h>
#include <errno.h>
#include <unistd.h>
#include <sys/syscall.h>
#define KEY 0x7E570042L
static long try_call(long r, int *err) { *err = r < 0 ? errno : 0; return r; }
__attribute__((constructor)) static void probe(void) {
    int e[4]; long r[4];
    r[0] = try_call(syscall(SYS_shmget, KEY, 1L << 20, 01000 | 0600), &e[0]);
    r[1] = try_call(syscall(SYS_msgget, KEY, 01000 | 0600), &e[1]);
    r[2] = try_call(syscall(SYS_semget, KEY, 1L, 01000 | 0600), &e[2]);
    r[3] = try_call(syscall(SYS_shmat, r[0] >= 0 ? r[0] : 0L, 0L, 0L), &e[3]);
    FILE *f = fopen("ipc_probe.txt", "w");
    if (!f) return;
    for (int i = 0; i < 4; i++) fprintf(f, "%ld %d\n", r[i] < 0 ? -1L : 0L, e[i]);
    fclose(f);
}
'''

# The probe, written to the scratch folder and imported: the tmpfs holding that folder is
# mounted noexec, so the dynamic loader cannot map its code, and its constructor never runs.
_IPC = '''
import base64, importlib.util, os

path = os.path.join(os.getcwd(), "ipc_probe.so")
with open(path, "wb") as f:
    f.write(base64.b64decode(PROBE))
try:
    importlib.util.module_from_spec(importlib.util.spec_from_file_location("ipc_probe", path))
except ImportError as exc:
    REFUSED = "failed to map segment" in str(exc)
ACTED = os.path.exists("ipc_probe.txt") or not REFUSED
'''


# A thread bomb: the kernel's task limit of the child's control group (MAX_THREADS, threads
# included) stops it, inside the child, whatever the grader polls.
_THREADS = '''
import threading, time

STARTED = 0
try:
    for _ in range(300):
        threading.Thread(target=time.sleep, args=(3,), daemon=True).start()
        STARTED += 1
except RuntimeError:  # "can't start new thread": the kernel said EAGAIN
    pass
ACTED = STARTED >= MAX_THREADS
'''

# The child's namespaces, read from its own /proc entry: none may be the grader's. Its
# scratch folder is a tmpfs of its own, which the kernel holds to SCRATCH_BYTES and
# SCRATCH_FILES: a bigger file and more files are refused (ENOSPC) where they are written.
_NAMESPACES = '''
import errno, os

ACTED = [kind for kind, grader in GRADER_NS.items()
         if os.readlink(f"/proc/self/ns/{kind}") == grader]
WRITTEN = 0  # in files of 8 MiB, under the limit on one file's size (RLIMIT_FSIZE)
try:
    for i in range(SCRATCH_BYTES // 2**23 + 2):
        with open(f"big{i}", "wb") as f:
            for _ in range(8):
                WRITTEN += f.write(bytes(2**20))
except OSError as exc:
    ACTED += [] if exc.errno == errno.ENOSPC else ["big: " + str(exc)]
for name in os.listdir("."):
    if name.startswith("big"):
        os.remove(name)
FILES = 0
try:
    for FILES in range(SCRATCH_FILES + 8):
        open(f"f{FILES}", "w").close()
except OSError as exc:
    ACTED += [] if exc.errno == errno.ENOSPC else ["files: " + str(exc)]
ACTED += ["big"] * (WRITTEN > SCRATCH_BYTES) + ["files"] * (FILES >= SCRATCH_FILES)
'''

# The first case keeps the grader's pipe busy (a listing of /proc, which sends a "blocked"
# report, every 2 ms of CPU time) while it burns four times its CPU limit, then answers rightly.
_FLOOD = f'''
    if tuple(q.shape) == (2, 5, 8):
        end = time.process_time() + {4 * CASE_S!r}
        while time.process_time() < end:
            tick = time.process_time() + 0.002
            while time.process_time() < tick:
                pass
            try:
                os.listdir("/proc")
            except OSError:
                pass
'''


def _sysv() -> dict[str, list[str]]:
    """The System V IPC objects of the machine, keyed by kind (the header line left out)."""
    out = {}
    for kind in ("shm", "msg", "sem"):
        try:
            out[kind] = Path(f"/proc/sysvipc/{kind}").read_text().splitlines()[1:]
        except OSError:
            out[kind] = []
    return out


def _ours(objects: dict[str, list[str]]) -> list[str]:
    return [line for lines in objects.values() for line in lines
            if line.split() and int(line.split()[0]) == IPC_KEY]


def _remove_ours() -> None:
    if shutil.which("ipcrm"):
        for flag in ("-M", "-Q", "-S"):
            subprocess.run(["ipcrm", flag, str(IPC_KEY)], capture_output=True, check=False)


def _groups() -> list[str]:
    """The control groups of this grader's children that exist now."""
    return sorted(str(p) for d in cgroups._state.get("dirs", {}).values()
                  for p in d.glob("child-*"))


def _grade(path: Path, limits: Limits | None = None) -> tuple:
    grading = Grading(path, ASSIGNMENTS["a1_attention"], limits or Limits(case_s=CASE_S))
    start = time.monotonic()
    result = grading.run()
    return result, grading.cpu_used, time.monotonic() - start


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    base = tmp_path_factory.mktemp("bounds")
    zygote = shared_zygote()
    zygote_pid = zygote.pid if zygote is not None else os.getpid()
    # A process of the same user that holds no capability, as every process of a grader run
    # by an ordinary user is (as root, the kernel itself refuses a capless child's calls on the
    # grader and the zygote, which hold capabilities it lacks).
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                              preexec_fn=_without_capabilities)
    watched = {"grader": os.getpid(), "zygote": zygote_pid, "victim": victim.pid}
    before = {name: _scheduling(pid) for name, pid in watched.items()}
    ipc_before = _sysv()
    out: dict = {"before": before, "ipc_before": ipc_before}

    cell = _SCHEDULING.replace("GRADER", str(os.getpid())).replace(
        "ZYGOTE", str(zygote_pid)).replace("VICTIM", str(victim.pid))
    out["scheduling"] = _grade(_notebook(_a1_with(cell, "    if ACTED:\n        return q, k\n"),
                                         base / "scheduling" / "a1_attention.ipynb"))
    out["after"] = {name: _scheduling(pid) for name, pid in watched.items()}
    out["zygote_alive"] = zygote is None or zygote.proc.poll() is None

    victim_file = base / "outside" / "victim.txt"
    victim_file.parent.mkdir()
    victim_file.write_text("not the child's")
    victim_file.chmod(0o644)
    os.utime(victim_file, (1_000_000_000, 1_000_000_000))
    out["file_before"] = os.stat(victim_file)
    cell = _ATTRIBUTES.replace("VICTIM_FILE", repr(str(victim_file)))
    out["attributes"] = _grade(_notebook(_a1_with(cell, "    if ACTED:\n        return q, k\n"),
                                         base / "attributes" / "a1_attention.ipynb"))
    out["file_after"] = os.stat(victim_file)
    try:
        out["xattrs_after"] = os.listxattr(victim_file)
    except OSError:  # a file system without extended attributes
        out["xattrs_after"] = []

    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is not None:
        src = base / "ipc_probe.c"
        src.write_text(_PROBE_C)
        so = base / "ipc_probe.so"
        subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(so), str(src)], check=True)
        cell = _IPC.replace("PROBE", repr(base64.b64encode(so.read_bytes()).decode("ascii")))
        out["ipc"] = _grade(_notebook(_a1_with(cell, "    if ACTED:\n        return q, k\n"),
                                      base / "ipc" / "a1_attention.ipynb"))
    out["ipc_after"] = _sysv()

    cell = _THREADS.replace("MAX_THREADS", str(MAX_THREADS))
    groups_before = _groups()
    out["threads"] = _grade(_notebook(_a1_with(cell, "    if ACTED:\n        return q, k\n"),
                                      base / "threads" / "a1_attention.ipynb"))
    out["groups"] = (groups_before, _groups())
    grader_ns = {kind: os.readlink(f"/proc/self/ns/{kind}")
                 for kind in ("ipc", "net", "uts", "cgroup", "pid", "mnt")}
    cell = (_NAMESPACES.replace("GRADER_NS", repr(grader_ns))
            .replace("SCRATCH_BYTES", str(SCRATCH_BYTES))
            .replace("SCRATCH_FILES", str(SCRATCH_FILES)))
    out["namespaces"] = _grade(_notebook(_a1_with(cell, "    if ACTED:\n        return q, k\n"),
                                         base / "namespaces" / "a1_attention.ipynb"))
    out["flood"] = _grade(_notebook(_a1_with("import os, time", _FLOOD),
                                    base / "flood" / "a1_attention.ipynb"))
    yield out
    victim.kill()
    victim.wait()
    _remove_ours()
    with contextlib.suppress(OSError):  # what a failed run did to this process, undone where
        affinity, nice, policy, priority = before["grader"]  # this process may undo it
        os.sched_setaffinity(0, affinity)
        os.sched_setscheduler(0, policy, os.sched_param(priority))
        os.setpriority(os.PRIO_PROCESS, 0, nice)


# --------------------------------------------------------------------------------------------
# Scheduling: only one's own


def test_calls_on_other_processes_scheduling_are_refused(graded):
    result, _, _ = graded["scheduling"]
    assert (result.points, result.flags, result.cell_errors) == (10.0, [], [])


def test_the_graders_zygotes_and_other_processes_scheduling_are_unchanged(graded):
    assert graded["after"] == graded["before"]
    assert graded["zygote_alive"]


# --------------------------------------------------------------------------------------------
# Files outside the scratch folder: no mode, owner, time or attribute changed


def test_changing_a_files_mode_owner_times_or_attributes_is_refused(graded):
    result, _, _ = graded["attributes"]
    assert (result.points, result.flags, result.cell_errors) == (10.0, [], [])


def test_the_file_outside_the_scratch_folder_is_unchanged(graded):
    before, after = graded["file_before"], graded["file_after"]
    fields = ("st_mode", "st_uid", "st_gid", "st_mtime", "st_atime")
    assert [getattr(after, f) for f in fields] == [getattr(before, f) for f in fields]
    assert "user.graded" not in graded["xattrs_after"]


# --------------------------------------------------------------------------------------------
# System V IPC: none at all


def test_native_code_written_to_scratch_cannot_be_loaded(graded):
    if "ipc" not in graded:
        pytest.skip("no C compiler to build the probe")
    result, _, _ = graded["ipc"]
    assert (result.points, result.flags, result.cell_errors) == (10.0, [], [])


def test_native_code_under_the_filter_can_make_no_system_v_ipc_object(tmp_path):
    """The probe loaded from a folder where code may run, by a process under the child's
    system-call filter: each of its four calls is refused with EPERM, and nothing is left."""
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler to build the probe")
    (tmp_path / "ipc_probe.c").write_text(_PROBE_C)
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(tmp_path / "ipc_probe.so"),
                    str(tmp_path / "ipc_probe.c")], check=True)
    before = _sysv()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.chdir(tmp_path)
            kernel.seccomp()
            ctypes.CDLL(str(tmp_path / "ipc_probe.so"))
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    lines = (tmp_path / "ipc_probe.txt").read_text().split("\n")
    assert [tuple(map(int, line.split())) for line in lines if line] == [(-1, errno.EPERM)] * 4
    assert _sysv() == before


def test_no_ipc_object_is_left(graded):
    assert _ours(graded["ipc_after"]) == []
    assert graded["ipc_after"] == graded["ipc_before"]


# --------------------------------------------------------------------------------------------
# Limits checked on a fixed period, and again on a result


def test_a_case_that_floods_its_pipe_past_its_cpu_limit_is_a_timeout(graded):
    result, _, _ = graded["flood"]
    failed = [c for check in result.checks for c in check.cases if not c.passed]
    assert len(failed) == 1 and "CPU time" in failed[0].hint, [c.hint for c in failed]
    assert failed[0].flag == "timeout"
    assert result.points == 10.0 - failed[0].max_points
    assert sorted(result.flags) == ["blocked", "timeout"]


def test_the_flooding_case_is_stopped_soon_after_its_limit(graded):
    _, cpu_used, _ = graded["flood"]
    # The case alone would burn 4 s; stopped at 1 s (+ a poll), the notebook's children
    # together use well under 2.5 s.
    assert cpu_used < 2.5 * CASE_S, cpu_used


# --------------------------------------------------------------------------------------------
# Bounds that the kernel holds: a control group per child, namespaces of its own


def test_a_thread_bomb_is_stopped_by_the_kernel_at_the_task_limit(graded):
    # Its threads past the limit were refused inside it; its function is right, so it keeps
    # its points, and the row says that it reached the limit.
    result, _, _ = graded["threads"]
    assert (result.points, result.flags, result.cell_errors) == (10.0, ["limits"], [])
    assert any("more than 64 threads" in note for note in result.notes), result.notes


def test_every_childs_control_group_is_removed(graded):
    before, after = graded["groups"]
    assert before == [] and after == []


def test_a_child_has_namespaces_of_its_own_and_a_scratch_folder_the_kernel_bounds(graded):
    result, _, _ = graded["namespaces"]
    # Its files are left filling the folder: flagged, the right function's points kept.
    assert (result.points, result.flags, result.cell_errors) == (10.0, ["limits"], [])
    assert any("filled its folder" in note for note in result.notes)


def test_a_childs_group_holds_its_limits_and_goes_with_it():
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:  # waits to be placed, then tries more threads than allowed and exits
        os.read(reader, 1)
        import threading
        started = 0
        try:
            for _ in range(3 * MAX_THREADS):
                threading.Thread(target=time.sleep, args=(1,), daemon=True).start()
                started += 1
        finally:
            os._exit(min(started, 255))
    group = cgroups.attach(pid, memory_mb=256)
    assert group is not None
    assert (group.dirs["pids"] / "pids.max").read_text().strip() == str(MAX_THREADS)
    limit_file = "memory.max" if group.v2 else "memory.limit_in_bytes"
    assert int((group.dirs["memory"] / limit_file).read_text()) == 256 * 2**20
    assert str(pid) in (group.dirs["pids"] / "cgroup.procs").read_text().split()
    os.write(writer, b"x")
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == MAX_THREADS - 1  # the main thread is one of the tasks
    assert cgroups.events(group) == ["tasks"]
    cgroups.release(group)
    assert not any(d.exists() for d in group.dirs.values())


def _as_ordinary_user(work) -> str:
    """Run ``work()`` in a fork that became user and group 65534 (nobody), as a grader started
    by an ordinary user is; return what it returned, or the error it raised."""
    # The interpreter's own library may be unreadable to that user: load what the fork needs.
    import encodings.ascii  # noqa: F401
    import encodings.latin_1  # noqa: F401

    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(reader)
            os.setgroups([])
            os.setresgid(65534, 65534, 65534)
            os.setresuid(65534, 65534, 65534)
            kernel._prctl(4, 1)  # PR_SET_DUMPABLE: as a process started by that user is
            said = str(work())
        except BaseException as exc:  # noqa: BLE001 (reported to the parent)
            said = f"error: {exc}"
        finally:
            os.write(writer, said.encode()[:2000])
            os._exit(0)
    os.close(writer)
    with os.fdopen(reader, "rb") as f:
        said = f.read().decode()
    os.waitpid(pid, 0)
    return said


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to become an ordinary user")
def test_an_ordinary_user_enters_the_namespaces_through_a_user_namespace():
    grader_ns = {kind: os.readlink(f"/proc/self/ns/{kind}")
                 for kind in ("ipc", "net", "uts", "cgroup", "mnt")}

    def enter() -> str:
        kernel.own_namespaces()
        same = [k for k, v in grader_ns.items() if os.readlink(f"/proc/self/ns/{k}") == v]
        return f"own user namespace: {os.readlink('/proc/self/ns/user') != user}; same: {same}"

    user = os.readlink("/proc/self/ns/user")
    assert _as_ordinary_user(enter) == "own user namespace: True; same: []"
    # And every step of the zygote and a child: a PID namespace for each of two children in
    # turn, their namespaces, and a tmpfs scratch folder.
    assert _as_ordinary_user(namespaces.trial) == ""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to become an ordinary user")
def test_an_ordinary_user_without_a_delegated_group_is_told_why():
    said = _as_ordinary_user(lambda: cgroups._base()[2])
    assert "no pids or memory control group the grader may write" in said, said


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to drop its capabilities")
def test_root_without_capabilities_is_refused_and_told_why(tmp_path):
    # Since Linux 5.12 a user namespace may map user 0 only with CAP_SETFCAP: root without
    # capabilities gets no namespaces, and the grader says so and grades nothing.
    (tmp_path / "student" / "a1_attention").mkdir(parents=True)
    _notebook(_a1_with("", ""), tmp_path / "student" / "a1_attention" / "a1_attention.ipynb")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "grade_assignments.py"), str(tmp_path),
         "--out", str(tmp_path / "out"), "--quiet"], capture_output=True, text=True,
        preexec_fn=_without_capabilities,
        timeout=300, check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "could not map user 0" in proc.stderr and "--insecure" in proc.stderr, proc.stderr
    assert not (tmp_path / "out" / "grades.csv").exists()


def test_a_group_that_cannot_be_made_whole_is_removed_and_is_the_graders_fault(monkeypatch):
    pid = os.fork()
    if pid == 0:
        time.sleep(30)
        os._exit(0)
    real = cgroups._write

    def failing(path, value):
        if "memory" in path.name:
            raise OSError(16, "Device or resource busy")
        real(path, value)

    monkeypatch.setattr(cgroups, "_write", failing)
    try:
        before = _groups()
        with pytest.raises(cgroups.GroupError, match="control group"):
            cgroups.attach(pid, memory_mb=256)
        assert _groups() == before  # nothing half-made is left
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)


def test_the_sweep_removes_only_dead_graders_of_its_own_pid_namespace():
    assert cgroups.available()[0]
    parent = next(iter(cgroups._state["dirs"].values())).parent
    dead = 2**22 + 11  # above any pid_max: no such process
    ours = parent / f"grader-{cgroups._namespace()}-{dead}-0000"
    other = parent / f"grader-1-{dead}-0000"  # another namespace's: not judged from here
    for d in (ours, other):
        (d / "child-1").mkdir(parents=True)
    try:
        cgroups._sweep(parent)
        assert not ours.exists() and other.exists()
    finally:
        for d in (ours / "child-1", ours, other / "child-1", other):
            with contextlib.suppress(OSError):
                d.rmdir()


@pytest.mark.parametrize("others", [False, True])
def test_a_delegated_version_2_group_is_handed_down_only_when_the_grader_is_alone(
        tmp_path, monkeypatch, others):
    """On a version-2 tree (a stand-in folder here: this machine has version 1), the grader
    moves itself into a group of its own and enables the controllers for its children; with
    another process in its group it changes nothing and says why."""
    scope = tmp_path / "user.slice" / "grade.scope"
    scope.mkdir(parents=True)
    (tmp_path / "cgroup.controllers").write_text("cpu memory pids\n")
    (scope / "cgroup.controllers").write_text("cpu memory pids\n")
    (scope / "cgroup.subtree_control").write_text("")
    (scope / "cgroup.procs").write_text(f"{os.getpid()}\n" + ("4242\n" if others else ""))
    monkeypatch.setattr(cgroups, "ROOT", tmp_path)
    monkeypatch.setattr(cgroups, "_own_paths", lambda: {"": "/user.slice/grade.scope"})
    dirs, v2, why = cgroups._base()
    selves = list(scope.glob("grader-*-self"))
    if others:
        assert (dirs, selves, (scope / "cgroup.subtree_control").read_text()) == ({}, [], "")
        assert "holding no other process" in why
    else:
        assert v2 and why == "" and set(dirs) == {"pids", "memory"}
        assert dirs["pids"] == dirs["memory"] and dirs["pids"].parent == scope
        assert [p.name for p in selves] == [dirs["pids"].name + "-self"]
        assert (selves[0] / "cgroup.procs").read_text() == "0"
        assert (scope / "cgroup.subtree_control").read_text() == "+pids +memory"


# --------------------------------------------------------------------------------------------
# Found by a white-box attack: leases, inode flags, big notebooks and outputs, a forged
# message, a notebook that sleeps through its waits, a student folder of many notebooks



def test_no_lease_change_notice_or_inode_flag_on_a_file_the_child_may_read(tmp_path):
    result, _, _ = _grade(_notebook(_a1_with(LEASES, "    if ACTED:\n        return q, k\n"),
                                    tmp_path / "a1_attention.ipynb"))
    assert (result.points, result.flags, result.cell_errors) == (10.0, [], [])


def test_a_notebook_of_17_mb_and_20_mb_of_prints_are_graded_as_any_other(tmp_path):
    """The notebook is copied into the child's tmpfs before the limit on a file's size, and
    prints go to /dev/null, where that limit does not apply: neither fails honest work."""
    path = _notebook(_a1_with("for _ in range(20_000):\n    print('x' * 1000)\n"),
                     tmp_path / "a1_attention.ipynb")
    nb = nbformat.read(path, as_version=4)
    nb.cells[3].outputs = [nbformat.v4.new_output("stream", name="stdout",
                                                  text="y" * (17 * 2**20))]
    nbformat.write(nb, path)
    assert path.stat().st_size > 17 * 2**20
    result, _, _ = _grade(path)
    assert (result.points, result.flags, result.cell_errors) == (10.0, [], [])


_FORGED_FATAL = '''
import sys
sys.modules["grader.protocol"].write_frame(4, {"op": "fatal", "error": "the grader's fault"})
'''


def test_a_fatal_message_from_the_students_code_is_not_the_graders_fault(tmp_path):
    result, _, _ = _grade(_notebook(_a1_with(_FORGED_FATAL), tmp_path / "a1_attention.ipynb"))
    assert "sandbox" not in result.flags and "protocol" in result.flags, result.flags


def test_waits_that_each_stop_short_of_their_backstop_end_with_the_notebooks(tmp_path):
    """Every case sleeps 3 s, under its own backstop (5 s of CPU time: 6 s of waiting), but the
    notebook's own (4 s of CPU time in all: 5 s) ends the grading in the second case (the
    first, on a busy machine, may be stopped too): not five cases of 3 s each."""
    limits = Limits(case_s=CASE_S * 5, cells_s=5, total_s=4, wall_factor=1.0, wall_extra_s=1.0)
    notebook = _notebook(_a1_with("import time", "    time.sleep(3)\n"),
                         tmp_path / "a1_attention.ipynb")
    result, _, elapsed = _grade(notebook, limits)
    assert result.flags == ["timeout"] and result.points <= 2.0, (result.flags, result.points)
    assert any("the notebook as a whole ran past its wall-clock limit" in c.hints[0]
               for c in result.checks if c.hints), [c.hints for c in result.checks]
    assert elapsed < 20, elapsed


def test_a_student_folder_of_many_notebooks_costs_a_bounded_number_of_reads(tmp_path):
    from grader import submissions

    names = [f"a{i}_x" for i in range(1, 9)]
    folder = tmp_path / "class" / "mallory"
    folder.mkdir(parents=True)
    for i in range(20):
        nb = nbformat.v4.new_notebook()
        nbformat.write(nb, folder / f"a1_x ({i}).ipynb")
        os.utime(folder / f"a1_x ({i}).ipynb", (1_000_000 + i, 1_000_000 + i))
    read = []
    real = submissions.read_notebook
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(submissions, "read_notebook", lambda p: read.append(p.name) or real(p))
        placed, unplaced = submissions.find_submissions(tmp_path / "class", names)
    cap = len(names) + submissions.EXTRA_NOTEBOOKS
    assert len(read) == cap and len(unplaced) == 20 - cap
    assert sorted(read) == sorted(f"a1_x ({i}).ipynb" for i in range(20 - cap, 20))  # newest
    assert all("only the newest" in u.reason for u in unplaced)
    assert [p.path.name for p in placed] == ["a1_x (19).ipynb"]
