"""The grader end to end, through its command line: our own submissions (right, wrong, hostile)
graded in one run, in nbgrader's layout; then the CSV, the feedback and the flags."""

from __future__ import annotations

import csv
import importlib.util
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from grading_submissions import SUBMISSIONS, write_submissions
from notebooks import ROOT

from grader import zygote_client

SCRIPT = ROOT / "scripts" / "grade_assignments.py"
_spec = importlib.util.spec_from_file_location("grade_assignments", SCRIPT)
grade_assignments = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(grade_assignments)


def _grade(submitted, out, *options):
    """Run the command line on ``submitted``; returns the run and the CSV's rows by student."""
    start = time.monotonic()
    run = subprocess.run([sys.executable, str(SCRIPT), str(submitted), "--out", str(out),
                          "--case-timeout", "2", "--cells-timeout", "20", "--quiet", *options],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    run.elapsed = time.monotonic() - start
    assert (out / "grades.csv").exists(), run.stderr[-3000:]
    with open(out / "grades.csv", newline="") as f:
        return run, {r["student"]: r for r in csv.DictReader(f)}


@pytest.fixture(scope="session")
def graded(tmp_path_factory):
    """Grade every submission in one command-line run; returns (folder, out, rows, run)."""
    base = tmp_path_factory.mktemp("grading")
    submitted, out, outside = base / "submitted", base / "out", base / "outside.txt"
    write_submissions(submitted, outside)
    before = {p.relative_to(submitted) for p in submitted.rglob("*")}
    run, rows = _grade(submitted, out)
    after = {p.relative_to(submitted) for p in submitted.rglob("*")}
    return {"submitted": submitted, "out": out, "rows": rows, "run": run, "outside": outside,
            "new_files": after - before}


def test_the_run_succeeds_and_grades_everyone(graded):
    run = graded["run"]
    assert run.returncode == 0, run.stderr[-3000:]
    assert set(graded["rows"]) == set(SUBMISSIONS)
    assert "a1_attention:" in run.stdout and "mean" in run.stdout


def test_written_answers_are_collected_for_grading_by_hand(graded):
    """The CSV says how many points the written answers are worth; written/<assignment>.md has
    each question, its model answer and every student's answer (the submissions here keep the
    source notebooks' model answers)."""
    for row in graded["rows"].values():
        questions = grade_assignments.written_questions(row["assignment"])
        assert float(row["written_max"]) == sum(q["points"] for q in questions) > 0
    text = (graded["out"] / "written" / "a1_attention.md").read_text()
    students = [s for s, (a, _, _) in SUBMISSIONS.items() if a == "a1_attention"]
    questions = grade_assignments.written_questions("a1_attention")
    assert text.count("\n### ") == len(students) * len(questions)
    assert all(q["question"] in text for q in questions)


def test_every_child_is_forked_from_the_zygote(graded):
    """The fast path is the one taken: no child fell back to a fresh interpreter."""
    counts = re.search(r"\((\d+) processes forked, (\d+) started afresh\)", graded["run"].stdout)
    assert counts, graded["run"].stdout
    assert int(counts.group(1)) >= len(SUBMISSIONS) and int(counts.group(2)) == 0


def test_fresh_processes_grade_alike(tmp_path):
    """Without the zygote (--no-fork), every child is a fresh interpreter and the grades and the
    process a submission sees are the same."""
    students = ["evil_a1_probes_its_process", "bad_a1_times_sqrt"]
    write_submissions(tmp_path / "in", tmp_path / "outside.txt", students=students)
    run, rows = _grade(tmp_path / "in", tmp_path / "out", "--no-fork")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "(0 processes forked, 2 started afresh)" in run.stdout
    assert rows["evil_a1_probes_its_process"]["score"] == rows["evil_a1_probes_its_process"][
        "max_score"]
    feedback = (tmp_path / "out" / "feedback" / "bad_a1_times_sqrt" / "a1_attention.md")
    assert float(rows["bad_a1_times_sqrt"]["score"]) < float(rows["bad_a1_times_sqrt"]["max_score"])
    assert "multiplied by sqrt(d_k)" in feedback.read_text()


@pytest.mark.parametrize("student", list(SUBMISSIONS))
def test_each_submission_gets_what_it_deserves(graded, student):
    assignment, _, expect = SUBMISSIONS[student]
    row = graded["rows"][student]
    feedback = (graded["out"] / "feedback" / student / f"{assignment}.md").read_text()
    assert row["assignment"] == assignment
    score, top = float(row["score"]), float(row["max_score"])
    assert top > 0
    if expect == "full":
        assert score == top, feedback
        assert "FAIL" not in feedback
    elif expect == "zero":
        assert score == 0, feedback
    else:
        assert score < top, feedback
        assert expect in feedback, feedback
    cases = [k for k in row if "." in k and row[k] != ""]
    assert sum(float(row[k]) for k in cases) == score


def test_csv_has_one_column_per_case_and_flags(graded):
    with open(graded["out"] / "grades.csv", newline="") as f:
        header = next(csv.reader(f))
    assert header[:4] == ["student", "assignment", "score", "max_score"]
    assert header[-1] == "flags"
    assert "scaled_dot_product_attention.empty_row" in header
    assert "encoder_layer.post_train_dropout" in header
    assert "layer_norm.offset" in header and "positional_encoding.wide" in header


def test_flags_say_what_happened(graded):
    rows = graded["rows"]
    assert "reference used" in rows["evil_a1_reference"]["flags"]
    assert "reference used" in rows["evil_a1_hidden_import"]["flags"]
    assert "reference used" in rows["evil_a1_torch_sdpa"]["flags"]
    assert "reference used" in rows["evil_a6_torch_layer"]["flags"]
    assert "crashed" in rows["evil_a1_os_exit"]["flags"]
    assert "timeout" in rows["evil_a2_endless_init"]["flags"]
    assert "blocked" in rows["evil_a1_writes_files"]["flags"]
    assert "blocked" in rows["evil_a1_others_pipes"]["flags"]
    assert "blocked" in rows["evil_a1_escapes"]["flags"]
    assert rows["evil_a1_thread_restored"]["flags"] == ""  # threads are allowed
    for student in SUBMISSIONS:
        if student.startswith(("ok_", "bad_")):
            assert rows[student]["flags"] == "", student


def test_the_layer_norm_flag_leaves_the_encoding_its_points(graded):
    row = graded["rows"]["evil_a4_torch_layer_norm"]
    assert float(row["positional_encoding.small"]) > 0
    assert float(row["layer_norm.batch"]) == 0


def test_nothing_is_written_outside_the_sandbox(graded):
    assert not graded["outside"].exists()
    assert graded["new_files"] == set()


def test_feedback_lists_every_case_with_points(graded):
    text = (graded["out"] / "feedback" / "bad_a1_batch_axis" / "a1_attention.md").read_text()
    assert text.count("| FAIL |") + text.count("| pass |") == 5
    assert "/ 2 |" in text and "**Score:" in text


def test_the_flat_layout_is_found(tmp_path):
    write_submissions(tmp_path, tmp_path / "x", nested=False)
    found, unplaced = grade_assignments.find_submissions(tmp_path)
    assert len(found) == len(SUBMISSIONS) and not unplaced
    assert {p.assignment for p in found} == {a for a, _, _ in SUBMISSIONS.values()}


def test_a_bad_folder_is_the_only_failure(tmp_path):
    assert grade_assignments.main([str(tmp_path / "missing"), "--out", str(tmp_path)]) == 2
    (tmp_path / "empty" / "someone").mkdir(parents=True)
    assert grade_assignments.main([str(tmp_path / "empty"), "--out", str(tmp_path)]) == 2


def test_help():
    with pytest.raises(SystemExit) as exc:
        grade_assignments.main(["--help"])
    assert exc.value.code == 0


def test_makefile_has_a_grade_target():
    text = (ROOT / "Makefile").read_text()
    assert "grade_assignments.py $(SUBMITTED)" in text
    for target in ("test", "unit", "grade"):  # nbgrader is installed before its test runs
        assert re.search(rf"^{target}:.*\$\(GRADE_STAMP\)", text, re.M), target


THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _huge_pages_possible() -> bool:
    """Whether this kernel can collapse memory into transparent huge pages (Linux 6.1 or later,
    with them not switched off)."""
    release = tuple(int(x) for x in re.findall(r"\d+", os.uname().release)[:2])
    try:
        enabled = THP_ENABLED.read_text()
    except OSError:
        return False
    return sys.platform == "linux" and release >= (6, 1) and "[never]" not in enabled


def _anon_huge_kib(pid: int) -> int:
    text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    return int(re.search(r"^AnonHugePages:\s+(\d+) kB", text, re.M).group(1))


def test_the_zygote_kills_and_reaps_its_children(tmp_path):
    """A child the grader gives up on is gone at once, and so is every child when the zygote
    stops; the zygote is single-threaded (it refuses to start otherwise). Where the kernel can,
    it collapses its memory into huge pages before its `COLLAPSE_AFTER`-th fork (so that each
    later fork copies few page tables), and not before."""
    from grader.zygote import COLLAPSE_AFTER

    zygote = zygote_client.Zygote()
    fds = []
    try:
        first, *ends = zygote.spawn(tmp_path)
        fds += ends
        second, *ends = zygote.spawn(tmp_path)
        fds += ends
        assert Path(f"/proc/{first}").exists() and Path(f"/proc/{second}").exists()
        deadline = time.monotonic() + 10
        while os.getsid(first) != first and time.monotonic() < deadline:
            time.sleep(0.01)  # the child leaves the zygote's session right after the fork
        assert os.getsid(first) == first != os.getsid(0)
        assert zygote.kill(first)
        assert not Path(f"/proc/{first}").exists()
        if _huge_pages_possible():
            for _ in range(COLLAPSE_AFTER - 3):
                pid, *ends = zygote.spawn(tmp_path)
                fds += ends
                assert zygote.kill(pid)
            before = _anon_huge_kib(zygote.pid)
            pid, *ends = zygote.spawn(tmp_path)
            fds += ends
            assert _anon_huge_kib(zygote.pid) >= max(before, 64 * 1024)  # of its ~240 MiB
            if "[madvise]" in THP_ENABLED.read_text():  # no huge page but those asked for
                assert before == 0
    finally:
        zygote.close()
        for fd in fds:
            os.close(fd)
    assert zygote.proc.returncode == 0
    assert not Path(f"/proc/{second}").exists()


def test_the_zygote_keeps_matplotlib_s_font_list_in_a_lasting_folder(tmp_path, monkeypatch):
    """matplotlib builds its font list on first import, 2 to 3 s in a fresh folder: the zygote
    reads it from a folder of the grader's user, and its children get no trace of that."""
    from grader import zygote

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    env = zygote_client._matplotlib_cache()
    folder = tmp_path / "cache" / "tested-transformer" / "grader-matplotlib"
    assert env == {"MPLCONFIGDIR": str(folder)} and folder.is_dir()
    assert folder.stat().st_mode & 0o077 == 0  # the user's own
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "file"))  # cannot hold a folder
    assert zygote_client._matplotlib_cache() == {}  # then a fresh folder, as before
    monkeypatch.setenv("MPLCONFIGDIR", str(folder))
    zygote.preload()
    assert "MPLCONFIGDIR" not in os.environ  # gone before any child is forked
