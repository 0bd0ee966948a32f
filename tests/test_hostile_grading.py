"""The hostile suite: a class of attacks on the grader, graded in one run of the command line,
twice: by root and by an ordinary user (user 65534, with control groups delegated to it, as
`ordinary_user` sets up), with the same expectations each time.

Every attack of `hostile_submissions.ATTACKS` gets exactly the score and the flag it must get,
next to an honest student whose notebook the attacks aim at. Afterwards every other file is
byte-identical (the other students' notebooks, the grader's own code, a file outside
everything, and grades.csv itself a few seconds after the grader exited), and no process that
a submission could have started is left. Then the limits: a case that uses 80% of its CPU time
passes on every one of ten runs, and one that needs twice its limit fails; and a kernel without
Landlock or seccomp makes the grader refuse to run unless told ``--insecure``.
"""

from __future__ import annotations

import csv
import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import ordinary_user
import pytest
from hostile_submissions import (
    ATTACKS,
    DEEP_LEVELS,
    FORMULA_NAME,
    HEADING_NAME,
    LATIN1_NAME,
    _a1_with,
)
from notebooks import ROOT

from grader import kernel, sanitize
from grader.limits import Limits
from grader.sandbox import grade_notebook
from utils.checks import ASSIGNMENTS

SCRIPT = ROOT / "scripts" / "grade_assignments.py"
SOURCES = ROOT / "book" / "assignments"
GUARDED = [*sorted((ROOT / "utils").rglob("*.py")), *sorted((ROOT / "grader").glob("*.py")),
           *sorted((ROOT / "scripts").glob("*.py")),
           *sorted(SOURCES.glob("*.ipynb"))]

# The grader's command line, reporting its own peak memory (in KiB) when it exits.
MEASURED = ("import atexit, resource, runpy, sys; atexit.register(lambda: sys.stderr.write("
            "f'MAXRSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}\\n')); "
            "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")

pytestmark = pytest.mark.skipif(not kernel.support()[0], reason="needs Landlock and seccomp")


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _digests(paths: list[Path]) -> dict[Path, str]:
    return {p: _digest(p) for p in paths if p.is_file() and not p.is_symlink()}


def _notebook(assignment: str, cells: dict[int, str], places: dict[str, str],
              replace: dict[int, tuple[str, str]] | None = None) -> nbformat.NotebookNode:
    nb = nbformat.read(SOURCES / f"{assignment}.ipynb", as_version=4)
    for index, (old, new) in (replace or {}).items():
        assert old in nb.cells[index].source, (assignment, index, old)
        nb.cells[index].source = nb.cells[index].source.replace(old, new)
    for index, source in cells.items():
        assert "### BEGIN SOLUTION" in nb.cells[index].source, (assignment, index)
        for name, value in places.items():
            source = source.replace(name, repr(value))
        nb.cells[index].source = source
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    return nb


def _processes_in(folder: Path) -> list[str]:
    """Processes whose working folder lies in ``folder``: every child works in one there."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            cwd = os.readlink(f"/proc/{name}/cwd")
        except OSError:
            continue
        if cwd.startswith(str(folder)):
            found.append(f"{name}: {cwd}")
    return found


@pytest.fixture(scope="module", params=["root", "ordinary user"])
def hostile(request, tmp_path_factory):
    """The class graded once by root, once by an ordinary user (`ordinary_user`), each with
    the same expectations."""
    user = None
    if request.param == "ordinary user":
        if ordinary_user.reason():
            pytest.skip(ordinary_user.reason())
        user = ordinary_user.OrdinaryUser()
        request.addfinalizer(user.close)
        base = user.folder()
        request.addfinalizer(lambda: shutil.rmtree(base, ignore_errors=True))
    else:
        base = tmp_path_factory.mktemp("hostile")
    submitted, out, scratch = base / "submitted", base / "out", base / "tmp"
    scratch.mkdir()
    if user is not None:
        os.chown(scratch, ordinary_user.UID, ordinary_user.GID)
    outside = base / "outside.txt"
    outside.write_text("untouched\n")
    victim = submitted / "victim" / "a1_attention.ipynb"
    victim.parent.mkdir(parents=True)
    victim.write_bytes((SOURCES / "a1_attention.ipynb").read_bytes())
    places = {"VICTIM": str(victim), "CHECKER": str(ROOT / "utils" / "checks" /
                                                      "a1_attention.py"),
              "GRADES": str(out / "grades.csv"), "OUTDIR": str(out), "OUTSIDE": str(outside),
              "UTILS": str(ROOT / "utils"), "BOOK": str(ROOT / "book")}
    for student, attack in ATTACKS.items():
        nb = _notebook(attack.assignment, attack.cells, places, attack.replace)
        folder = submitted / student
        folder.mkdir()
        path = folder / (attack.file_name or f"{attack.assignment}.ipynb")
        if attack.nbformat3:
            nbformat.write(nbformat.convert(nb, 3), path, version=3)
        else:
            nbformat.write(nb, path)
    # Two notebooks for one assignment: a wrong older one and a right newer one.
    dup = submitted / "z_duplicate"
    dup.mkdir()
    wrong = _notebook("a1_attention", {3: "def scaled_dot_product_attention(q, k, v, mask=None):"
                                          "\n    return q, k\n"}, {})
    nbformat.write(wrong, dup / "a1_attention.ipynb")
    os.utime(dup / "a1_attention.ipynb", (time.time() - 3600, time.time() - 3600))
    nbformat.write(_notebook("a1_attention", {}, {}), dup / "a1_attention (2).ipynb")
    # A FIFO and a symbolic link named like notebooks: refused before anything reads them.
    (submitted / "s_fifo").mkdir()
    os.mkfifo(submitted / "s_fifo" / "a1_attention.ipynb")
    (submitted / "e_symlinked").mkdir()
    os.symlink(victim, submitted / "e_symlinked" / "a1_attention.ipynb")
    watched = GUARDED + [victim, outside] + [p for p in submitted.rglob("*")
                                              if p.is_file() and not p.is_symlink()]
    before = _digests(watched)
    env = {**os.environ, "TMPDIR": str(scratch)}
    start = time.monotonic()
    run = subprocess.run([sys.executable, "-c", MEASURED, str(SCRIPT), str(submitted), "--out",
                          str(out), "--case-timeout", "2", "--cells-timeout", "10", "--quiet"],
                         capture_output=True, text=True, timeout=1200, cwd=ROOT, env=env,
                         preexec_fn=user.preexec if user is not None else None)
    elapsed = time.monotonic() - start
    assert run.returncode == 0, run.stderr[-3000:]
    grades = _digest(out / "grades.csv")
    left = _processes_in(scratch)
    time.sleep(4)  # anything that escaped would act now
    with open(out / "grades.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    shown = {sanitize.csv_cell(s): s for s in [*ATTACKS, "victim", "z_duplicate", "s_fifo",
                                               "e_symlinked"]}
    return {"rows": {shown.get(r["student"], r["student"]): r for r in rows if r["assignment"]},
            "all_rows": rows,
            "out": out, "run": run, "before": before, "after": _digests(list(before)),
            "grades": grades, "grades_later": _digest(out / "grades.csv"), "left": left,
            "left_later": _processes_in(scratch), "scratch": scratch, "elapsed": elapsed,
            "outside": outside, "victim": victim, "user": request.param,
            "owner": (out / "grades.csv").stat().st_uid}


def _feedback_path(hostile, student: str, assignment: str) -> Path:
    return hostile["out"] / "feedback" / sanitize.file_name(student) / f"{assignment}.md"


def _feedback(hostile, student: str, assignment: str) -> str:
    return _feedback_path(hostile, student, assignment).read_text(encoding="utf-8")


def test_there_are_enough_attacks_of_every_kind():
    kinds = [a.kind for a in ATTACKS.values()]
    assert len(kinds) >= 25
    assert min(kinds.count(k) for k in "ESFZ") >= 5


@pytest.mark.parametrize("student", sorted(ATTACKS))
def test_each_attack_gets_exactly_what_it_deserves(hostile, student):
    attack = ATTACKS[student]
    row = hostile["rows"][student]
    feedback = _feedback(hostile, student, attack.assignment)
    score, top = float(row["score"]), float(row["max_score"])
    assert row["assignment"] == attack.assignment
    if attack.score == "full":
        assert score == top, feedback
    elif attack.score == "zero":
        assert score == 0, feedback
    elif attack.score is not None:
        assert score == attack.score, feedback
    if attack.flag == "":
        assert row["flags"] == "", feedback
    elif attack.flag:
        assert attack.flag in row["flags"].split(";"), (row["flags"], feedback)
    if attack.phrase:
        assert attack.phrase in feedback, feedback
    for column, points in attack.columns.items():
        assert float(row[column]) == points, (column, feedback)
    if attack.kind == "Z":
        assert row["flags"] == "", feedback


def test_the_grader_ran_as_its_user(hostile):
    """The ordinary user's run is one: what the grader wrote belongs to that user."""
    assert hostile["owner"] == (ordinary_user.UID if hostile["user"] == "ordinary user"
                                else os.geteuid())


def test_the_grader_stays_small(hostile):
    """Floods, huge frames and an oracle asked for a 1024 x 512 x 512 mask: under 1 GB."""
    peak = [int(line.split()[1]) for line in hostile["run"].stderr.splitlines()
            if line.startswith("MAXRSS ")]
    assert peak and peak[0] < 2**20, peak  # KiB


def test_the_victim_is_graded_and_untouched(hostile):
    row = hostile["rows"]["victim"]
    assert float(row["score"]) == float(row["max_score"]) == 10
    assert row["flags"] == ""
    assert hostile["outside"].read_text() == "untouched\n"


def test_every_other_file_is_byte_identical(hostile):
    changed = [str(p) for p, d in hostile["before"].items() if hostile["after"].get(p) != d]
    assert changed == []


def test_grades_are_not_changed_after_the_grader_exits(hostile):
    assert hostile["grades_later"] == hostile["grades"]


def test_no_process_of_any_submission_is_left(hostile):
    assert hostile["left"] == [] and hostile["left_later"] == []
    assert list(hostile["scratch"].iterdir()) == []  # every scratch folder removed too


def test_a_fifo_or_a_link_named_like_a_notebook_is_refused_and_reported(hostile):
    """Neither is opened for reading (a FIFO would block the grader); each gets its row."""
    rows = hostile["all_rows"]
    for student, reason in (("s_fifo", "a FIFO"), ("e_symlinked", "a symbolic link")):
        mine = [r for r in rows if r["student"] == student]
        assert len(mine) == 1 and mine[0]["score"] == "0" and mine[0]["flags"] == "unreadable"
        assert reason in _feedback(hostile, student, "a1_attention")


def test_one_row_per_student_and_assignment_the_newest_graded(hostile):
    rows = [r for r in hostile["all_rows"] if r["student"] == "z_duplicate"]
    assert len(rows) == 1
    assert float(rows[0]["score"]) == 10 and "duplicate" in rows[0]["flags"]
    assert "a1_attention.ipynb" in _feedback(hostile, "z_duplicate", "a1_attention")


def test_a_flood_leaves_small_feedback(hostile):
    for student in ATTACKS:
        path = _feedback_path(hostile, student, ATTACKS[student].assignment)
        assert path.stat().st_size <= 64 * 1024, student


# --------------------------------------------------------------------------------------------
# Outputs that no string can break: names, messages and answers shown, never acted on

_FORMULA = ("=", "+", "-", "@", "\t", "\r", "\uff1d", "\uff0b", "\uff0d", "\uff20")
_INVISIBLE = re.compile("[\u202a-\u202e\u2066-\u2069\u200e\u200f\u2028\u2029\x00-\x08"
                        "\x0b-\x1f\x7f]")


def test_grades_csv_has_one_row_per_student_and_no_live_formula(hostile):
    raw = (hostile["out"] / "grades.csv").read_bytes().decode("utf-8")  # strict: no surrogate
    assert not _INVISIBLE.search(raw.replace("\r\n", "\n"))
    rows = hostile["all_rows"]
    graded = [(r["student"], r["assignment"]) for r in rows if r["assignment"]]
    assert len(graded) == len(set(graded)) == len(ATTACKS) + 4  # the victim, the duplicate,
    assert set(hostile["rows"]) == {*ATTACKS, "victim", "z_duplicate", "s_fifo",  # the FIFO,
                                    "e_symlinked"}  # the link: one row each, none lost
    for row in rows:
        for key, cell in row.items():
            if key in ("student", "assignment", "flags"):
                assert not cell.startswith(_FORMULA), (key, cell)
            elif cell:
                float(cell)  # scores stay numbers
    assert hostile["rows"][FORMULA_NAME]["student"] == "'" + FORMULA_NAME
    assert hostile["rows"][HEADING_NAME]["student"] == "ann\\n# Forged heading"
    assert hostile["rows"][LATIN1_NAME]["student"] == "caf\\xe9"


def test_names_get_a_safe_feedback_folder_and_are_shown_escaped(hostile):
    for name in (FORMULA_NAME, HEADING_NAME, LATIN1_NAME):
        path = _feedback_path(hostile, name, "a1_attention")
        assert path.parent.name.isprintable() and "\"" not in path.parent.name
        first = path.read_bytes().decode("utf-8").splitlines()[0]
        assert first == f"# a1_attention: {sanitize.markdown_line(name)}"
        assert f"feedback of {sanitize.line(name)}: {path.parent}/" in hostile["run"].stdout
    assert "caf\\xe9" in hostile["run"].stdout and "\udce9" not in hostile["run"].stdout


def _rendered(text: str) -> str:
    markdown_it = pytest.importorskip("markdown_it")
    try:
        return markdown_it.MarkdownIt("gfm-like").render(text)
    except Exception:  # noqa: BLE001 (without linkify-it)
        return markdown_it.MarkdownIt("commonmark").enable("table").render(text)


def test_no_output_holds_a_live_image_link_heading_or_invisible_character(hostile):
    for path in sorted(hostile["out"].rglob("*.md")):
        text = path.read_bytes().decode("utf-8")  # strict: no lone surrogate was written
        assert not _INVISIBLE.search(text), path
        html = _rendered(text)
        for live in ("<img", "<a ", "<script", "<hr"):
            assert live not in html, (path, live)
        assert re.search(r"<h[1-6]>(Forged heading|Title)</h", html) is None, path
        assert html.count("<h1") == 1, path  # the grader's own title only
    written = (hostile["out"] / "written" / "a1_attention.md").read_text(encoding="utf-8")
    students = {s for s, a in ATTACKS.items() if a.assignment == "a1_attention"}
    heads = [ln for ln in written.splitlines() if ln.startswith("### ")]
    assert len(heads) == 2 * (len(students) + 4)  # two questions; the victim, the duplicate,
    assert "> \\# Forged heading" in written  # the FIFO and the link besides the attacks
    assert "\\!\\[pixel\\](http\\[:\\]//evil.example/pixel.png)" in written


def test_a_cell_error_with_a_surrogate_and_a_bidi_override_is_shown_escaped(hostile):
    text = _feedback(hostile, "s_surrogate_error", "a1_attention")
    assert "\u202e" not in text and "\\\\xff" in text and "\\\\u202e" in text


def test_a_deep_scratch_tree_is_removed_without_a_grader_error(hostile):
    """Hundreds of nested folders in a child's scratch folder: gone, no grader error (the
    folder's absence is checked with every scratch folder's, above)."""
    assert DEEP_LEVELS * 255 > 50 * 4096  # a path far past PATH_MAX
    assert all("grader error" not in r["flags"] for r in hostile["all_rows"])
    assert hostile["rows"]["s_deep_scratch"]["flags"] == ""


# --------------------------------------------------------------------------------------------
# CPU limits: a margin that an honest case never falls through


def _burner(fraction: float, limit: float) -> str:
    """A right attention function whose first case first burns ``fraction`` of ``limit`` CPU
    seconds (in whichever process runs it)."""
    return _a1_with("import time", f'''
    if tuple(q.shape) == (2, 5, 8):
        end = time.process_time() + {fraction * limit!r}
        while time.process_time() < end:
            pass
''')


def test_a_case_using_80_percent_of_its_cpu_time_passes_every_time(tmp_path):
    limit = 1.0
    path = tmp_path / "a1_attention.ipynb"
    nbformat.write(_notebook("a1_attention", {3: _burner(0.8, limit)}, {}), path)
    scores = []
    for _ in range(10):
        res = grade_notebook(path, ASSIGNMENTS["a1_attention"], Limits(case_s=limit))
        scores.append((res.points, tuple(res.flags)))
    assert scores == [(10.0, ())] * 10


def test_a_case_using_twice_its_cpu_time_fails_with_a_timeout(tmp_path):
    limit = 1.0
    path = tmp_path / "a1_attention.ipynb"
    nbformat.write(_notebook("a1_attention", {3: _burner(2.0, limit)}, {}), path)
    res = grade_notebook(path, ASSIGNMENTS["a1_attention"], Limits(case_s=limit))
    assert "timeout" in res.flags
    failed = [c for check in res.checks for c in check.cases if not c.passed]
    assert len(failed) == 1 and "CPU time" in failed[0].hint
    assert res.points == 10 - failed[0].max_points  # the next child goes on with the others


# --------------------------------------------------------------------------------------------
# A kernel without the confinement


def test_without_landlock_or_seccomp_the_grader_refuses_unless_insecure(tmp_path, monkeypatch,
                                                                        capsys):
    import importlib.util
    spec = importlib.util.spec_from_file_location("grade_script", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.setattr(kernel, "support", lambda: (False, "this kernel lacks Landlock"))
    (tmp_path / "in" / "ann").mkdir(parents=True)
    (tmp_path / "in" / "ann" / "a1_attention.ipynb").write_bytes(
        (SOURCES / "a1_attention.ipynb").read_bytes())
    assert script.main([str(tmp_path / "in"), "--out", str(tmp_path / "out"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--insecure" in err and "lacks Landlock" in err
    assert not (tmp_path / "out").exists()
    from grader import sandbox
    monkeypatch.setattr(sandbox, "insecure", False)
    assert script.main([str(tmp_path / "in"), "--out", str(tmp_path / "out"), "--quiet",
                        "--insecure"]) == 0
    with open(tmp_path / "out" / "grades.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert rows[0]["score"] == "10" and rows[0]["flags"] == "insecure"
    assert "INSECURE" in capsys.readouterr().out


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_an_interrupted_run_stops_at_once_and_leaves_nothing(tmp_path, sig):
    """A notebook that sleeps a minute in its cells, and the run interrupted once its child
    runs: it ends within 15 s, still writes grades.csv (every row a grader error: an
    interrupted run is no grading), and leaves no process and no folder of its own."""
    submitted, out, scratch = tmp_path / "submitted", tmp_path / "out", tmp_path / "tmp"
    (submitted / "ann").mkdir(parents=True)
    scratch.mkdir()
    nb = _notebook("a1_attention", {3: _a1_with("import time\ntime.sleep(60)")}, {})
    nbformat.write(nb, submitted / "ann" / "a1_attention.ipynb")
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), str(submitted), "--out", str(out), "--quiet"],
        cwd=ROOT, env={**os.environ, "TMPDIR": str(scratch)}, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not [p for p in _processes_in(scratch) if "/grade-scratch-" in p]:
        assert proc.poll() is None and time.monotonic() < deadline, "no child started"
        time.sleep(0.2)
    proc.send_signal(sig)
    sent = time.monotonic()
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail("the grader did not stop within 60 s of the signal")
    assert time.monotonic() - sent < 15, time.monotonic() - sent
    assert proc.returncode != 0
    with open(out / "grades.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["assignment"]]
    assert len(rows) == 1 and "grader error" in rows[0]["flags"], rows
    assert "KeyboardInterrupt" in rows[0]["flags"] and rows[0]["score"] == "0", rows
    assert _processes_in(scratch) == [] and list(scratch.iterdir()) == [], err[-2000:]
