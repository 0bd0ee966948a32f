"""How long the grader takes on a class, and what the kernel's confinement costs.

    python scripts/grading_benchmark.py [--per-assignment 7] [--out _build/grading-bench]
    make bench-grade

Builds a class of handed-in notebooks over all nine assignments: for each, the book's solution
(several students), the version handed out (nothing done) and one with a known mistake. It grades
the class once with the command line as an instructor runs it (isolation on, two notebooks at
a time on two cores), checks that every solution got full marks and every blank one 0, and prints
the wall-clock time. Then it grades a smaller sample of one notebook per assignment twice, one
notebook at a time, with the confinement and without it (``--insecure`` on a kernel that has it
still confines; this benchmark switches the confinement off in its own process instead), and
prints the cost of isolation per submission: the difference of the two runs divided by the
number of child processes each made. The results go to OUT/grading-benchmark.md.
"""

from __future__ import annotations

import argparse
import csv
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from utils.checks import ASSIGNMENTS  # noqa: E402

SOURCES = ROOT / "book" / "assignments"
SCRIPT = ROOT / "scripts" / "grade_assignments.py"

# One known mistake per assignment: (cell index, text replaced, replacement).
MISTAKES = {
    "a1_attention": (3, "/ math.sqrt(d_k)", "* math.sqrt(d_k)"),
    "a2_multi_head_attention": (3, "self.w_k(key)", "self.w_q(key)"),
    "a3_masks": (3, "positions[None, :] <=", "positions[None, :] <"),
    "a4_positional_encoding_layer_norm": (6, "x - mean", "x"),
    "a5_feed_forward": (3, "F.silu", "torch.relu"),
    "a6_encoder_layer": (3, "self.norm_first", "not self.norm_first"),
    "a7_decoder_layer": (3, "self.norm_first", "not self.norm_first"),
    "a8_train": (5, "ignore_index=PAD", "ignore_index=-100"),
    "a9_adapting": (3, "descending=True", "descending=False"),
}


def _student_version(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    sys.path.insert(0, str(ROOT / "scripts"))
    from make_assignments import student_version
    return student_version(nb)[0]


def build_class(folder: Path, per_assignment: int) -> dict[str, str]:
    """Write the class; returns what each student must get: "full", "zero" or "some"."""
    expect = {}
    for name in ASSIGNMENTS:
        source = nbformat.read(SOURCES / f"{name}.ipynb", as_version=4)
        versions = [("right", source)] * max(1, per_assignment - 2)
        versions.append(("blank", _student_version(source)))
        wrong = nbformat.from_dict(source)
        index, old, new = MISTAKES[name]
        if old in wrong.cells[index].source:
            wrong.cells[index].source = wrong.cells[index].source.replace(old, new, 1)
            versions.append(("wrong", wrong))
        for k, (kind, nb) in enumerate(versions):
            student = f"{name[:2]}_{kind}_{k}"
            (folder / student).mkdir(parents=True)
            nbformat.write(nb, folder / student / f"{name}.ipynb")
            expect[student] = {"right": "full", "blank": "zero", "wrong": "some"}[kind]
    return expect


def grade(folder: Path, out: Path, *options: str) -> tuple[float, dict[str, dict[str, str]], str]:
    start = time.monotonic()
    run = subprocess.run([sys.executable, str(SCRIPT), str(folder), "--out", str(out), "--quiet",
                          *options], capture_output=True, text=True, cwd=ROOT)
    elapsed = time.monotonic() - start
    if run.returncode != 0:
        raise SystemExit(f"the grader failed:\n{run.stderr[-3000:]}")
    with open(out / "grades.csv", newline="") as f:
        rows = {r["student"]: r for r in csv.DictReader(f) if r["assignment"]}
    return elapsed, rows, run.stdout


def _children(stdout: str) -> int:
    for line in stdout.splitlines():
        if line.startswith("graded ") and "processes forked" in line:
            return int(line.split("(")[1].split()[0])
    return 0


def insecure_cost(work: Path) -> tuple[float, float, int]:
    """Grade one notebook per assignment, one at a time, confined and not; (confined s,
    unconfined s, children per run)."""
    sample = work / "sample"
    for name in ASSIGNMENTS:
        (sample / name[:2]).mkdir(parents=True)
        shutil.copy(SOURCES / f"{name}.ipynb", sample / name[:2] / f"{name}.ipynb")
    confined, rows_on, out_on = grade(sample, work / "out-on", "--jobs", "1")
    env_script = (
        "import sys, runpy; sys.argv = sys.argv[1:];"
        "import grader.kernel as k; k.support = lambda: (False, 'switched off');"
        "runpy.run_path(sys.argv[0], run_name='__main__')")
    start = time.monotonic()
    run = subprocess.run([sys.executable, "-c", env_script, str(SCRIPT), str(sample), "--out",
                          str(work / "out-off"), "--quiet", "--jobs", "1", "--insecure"],
                         capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    unconfined = time.monotonic() - start
    if run.returncode != 0:
        raise SystemExit(f"the unconfined run failed:\n{run.stderr[-3000:]}")
    return confined, unconfined, _children(out_on)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--per-assignment", type=int, default=7,
                        help="notebooks per assignment (default 7: 9 x 7 = 63 notebooks)")
    parser.add_argument("--out", type=Path, default=ROOT / "_build" / "grading-bench")
    parser.add_argument("--skip-cost", action="store_true",
                        help="only the class, not the cost of isolation")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="grading-bench-"))
    try:
        expect = build_class(work / "class", args.per_assignment)
        elapsed, rows, stdout = grade(work / "class", work / "out")
        wrong = []
        for student, want in expect.items():
            row = rows[student]
            score, top = float(row["score"]), float(row["max_score"])
            ok = {"full": score == top, "zero": score == 0, "some": score < top}[want]
            if not ok:
                wrong.append(f"{student}: {score:g} / {top:g}, expected {want}")
        lines = ["# Grading benchmark", "",
                 f"- machine: {os.cpu_count()} cores; the command line with its defaults "
                 "(isolation on, one notebook per core)",
                 f"- class: {len(expect)} notebooks over {len(ASSIGNMENTS)} assignments "
                 f"({sum(v == 'full' for v in expect.values())} solutions, "
                 f"{sum(v == 'zero' for v in expect.values())} blank, "
                 f"{sum(v == 'some' for v in expect.values())} with a mistake)",
                 f"- graded in {elapsed:.1f} s (goal: 120 s); child processes: "
                 f"{_children(stdout)}",
                 f"- every solution full marks, every blank one 0, every mistake below full: "
                 f"{'yes' if not wrong else 'NO: ' + '; '.join(wrong)}"]
        if not args.skip_cost:
            confined, unconfined, children = insecure_cost(work)
            per_child = (confined - unconfined) / max(1, children)
            lines += [f"- one notebook per assignment, one at a time: {confined:.1f} s confined, "
                      f"{unconfined:.1f} s without the kernel's confinement; {children} child "
                      f"processes: isolation costs {1000 * per_child:.1f} ms per child process, "
                      f"{(confined - unconfined) / len(ASSIGNMENTS):.2f} s per submission"]
        text = "\n".join(lines) + "\n"
        print(text)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "grading-benchmark.md").write_text(text)
        return 1 if wrong else 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
