"""Grade handed-in assignment notebooks, each in its own sandboxed process.

    python scripts/grade_assignments.py SUBMITTED --out DIR
    make grade SUBMITTED=... [OUT=DIR]

SUBMITTED is nbgrader's layout, SUBMITTED/<student>/<assignment>/<notebook>.ipynb, or a flat one,
SUBMITTED/<student>/<notebook>.ipynb. A notebook's file name (a1_attention.ipynb, ...) or its
assignment folder says which assignment it is. Writes DIR/grades.csv (one row per student and
assignment: score, max_score, the points of every case, written_max, flags),
DIR/feedback/<student>/<assignment>.md (every case with its points and hint) and
DIR/written/<assignment>.md (each written question, its model answer, then every student's
answer, for grading by hand; written_max is the number of points they are worth). Exits with 2
only when it cannot grade at all (no such folder, no notebook of the book in it); a student's
code never changes the exit status.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from utils.checks import ASSIGNMENTS, sandbox  # noqa: E402
from utils.checks.sandbox import Limits, SubmissionResult, grade_notebook  # noqa: E402


def find_submissions(folder: Path) -> list[tuple[str, str, Path]]:
    """(student, assignment, notebook) for every notebook of a known assignment in ``folder``."""
    found = []
    for student in sorted(p for p in folder.iterdir() if p.is_dir()):
        if student.name.startswith("."):
            continue
        candidates = sorted(student.glob("*.ipynb")) + sorted(student.glob("*/*.ipynb"))
        for nb in candidates:
            if ".ipynb_checkpoints" in nb.parts:
                continue
            name = nb.stem if nb.stem in ASSIGNMENTS else nb.parent.name
            if name in ASSIGNMENTS:
                found.append((student.name, name, nb))
    return found


SOURCES = ROOT / "book" / "assignments"
ANSWER_STUB = "YOUR ANSWER HERE"
MAX_NOTEBOOK_BYTES = 50 * 2**20


def _markdown_source(cell: dict) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else str(src)


def written_questions(name: str) -> list[dict]:
    """The questions of an assignment graded by hand, read from its source notebook.

    Each is ``{"id", "points", "question", "model"}``: the grade_id of nbgrader's manually graded
    answer cell, its points, the text of the cell before it, and the model answer.
    """
    nb = json.loads((SOURCES / f"{name}.ipynb").read_text(encoding="utf-8"))
    out, previous = [], ""
    for cell in nb["cells"]:
        meta = cell.get("metadata", {}).get("nbgrader", {})
        text = _markdown_source(cell)
        if cell["cell_type"] == "markdown" and meta.get("solution") and meta.get("grade"):
            out.append({"id": meta["grade_id"], "points": float(meta["points"]),
                        "question": previous.strip(), "model": _answer_text(text)})
        previous = text
    return out


def _answer_text(source: str) -> str:
    """An answer cell's text without its heading and solution markers."""
    lines = [ln for ln in source.splitlines()
             if "BEGIN SOLUTION" not in ln and "END SOLUTION" not in ln]
    text = "\n".join(lines).strip()
    return text.removeprefix("**Answer.**").strip()


def written_answers(notebook: Path, questions: list[dict]) -> list[str | None]:
    """The student's answer to each question (None: missing or left as handed out).

    The notebook is read as JSON and never run; an answer cell is found by its grade_id, so a
    student who moved cells around is still graded on the right answers.
    """
    try:
        if notebook.stat().st_size > MAX_NOTEBOOK_BYTES:
            return [None] * len(questions)
        cells = json.loads(notebook.read_text(encoding="utf-8", errors="replace"))["cells"]
        by_id = {}
        for cell in cells:
            meta = cell.get("metadata", {}).get("nbgrader", {})
            if isinstance(meta, dict) and cell.get("cell_type") == "markdown":
                by_id.setdefault(str(meta.get("grade_id")), _answer_text(_markdown_source(cell)))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return [None] * len(questions)
    answers: list[str | None] = []
    for q in questions:
        text = by_id.get(q["id"])
        answers.append(None if not text or text == ANSWER_STUB else text)
    return answers


def written_report(name: str, questions: list[dict],
                   answers: list[tuple[str, list[str | None]]]) -> str:
    """The Markdown file of one assignment's written answers, question by question."""
    total = sum(q["points"] for q in questions)
    lines = [f"# {name}: written answers, graded by hand ({_points(total)} points)", ""]
    for k, q in enumerate(questions):
        lines += [f"## {q['question']} ({_points(q['points'])} points)", "",
                  "**Model answer.** " + q["model"], ""]
        for student, given in answers:
            lines += [f"### {student}", "", given[k] if given[k] else "*(no answer)*", ""]
    return "\n".join(lines)


def columns(assignments: list[str]) -> list[str]:
    """The case columns of ``assignments``: ``<checker>.<case id>``."""
    cols = []
    for name in assignments:
        for checker in ASSIGNMENTS[name].checkers:
            cols += [f"{checker.name.removeprefix('check_')}.{c.id}" for c in checker.cases]
    return cols


def _points(x: float) -> str:
    return f"{x:g}"


def feedback(student: str, result: SubmissionResult) -> str:
    """The Markdown feedback for one student's assignment."""
    lines = [f"# {result.assignment}: {student}", "",
             f"**Score: {_points(result.points)} / {_points(result.max_points)}**", ""]
    if result.flags:
        lines += [f"Flags: {', '.join(result.flags)}", ""]
    for note in result.notes:
        lines.append(f"- {note}")
    if result.notes:
        lines.append("")
    for check in result.checks:
        lines += [f"## {check.check}", "", "| case | result | points | hint |",
                  "| --- | --- | --- | --- |"]
        for c in check.cases:
            hint = c.hint.replace("|", "\\|").replace("\n", " ")
            lines.append(f"| {c.name} | {'pass' if c.passed else 'FAIL'} | "
                         f"{_points(c.points)} / {_points(c.max_points)} | {hint} |")
        lines.append("")
    if result.cell_errors:
        lines += ["## Errors while your notebook ran", ""]
        lines += [f"- {e}" for e in result.cell_errors] + [""]
    return "\n".join(lines)


def _progress(done: int, total: int, start: float) -> None:
    width = 30
    filled = int(width * done / total) if total else width
    bar = "#" * filled + "." * (width - filled)
    sys.stderr.write(f"\r[{bar}] {done}/{total} notebooks, {time.monotonic() - start:.0f} s")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def summary(rows: list[dict[str, str]]) -> str:
    """Per assignment: the number graded, the mean score and how the scores spread."""
    out = []
    for name in sorted({r["assignment"] for r in rows}):
        scores = [float(r["score"]) for r in rows if r["assignment"] == name]
        top = float(next(r["max_score"] for r in rows if r["assignment"] == name))
        bins = [0] * 5
        for s in scores:
            bins[min(4, int(5 * s / top))] += 1 if top else 0
        spread = ", ".join(f"{20 * i}-{20 * (i + 1)}%: {n}" for i, n in enumerate(bins))
        flagged = sum(1 for r in rows if r["assignment"] == name and r["flags"])
        out.append(f"{name}: {len(scores)} graded, mean {sum(scores) / len(scores):.2f} / "
                   f"{top:g}, min {min(scores):g}, max {max(scores):g}; {spread}; "
                   f"{flagged} flagged")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Grade handed-in assignment notebooks, each in its own sandboxed process.",
        epilog="Layouts: SUBMITTED/<student>/<assignment>/<notebook>.ipynb (nbgrader's) or "
               "SUBMITTED/<student>/<notebook>.ipynb. Exit status 2: nothing could be graded.")
    parser.add_argument("submitted", type=Path, help="the folder of handed-in notebooks")
    parser.add_argument("--out", type=Path, required=True,
                        help="where to write grades.csv and feedback/")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="notebooks graded at once (default: the number of cores)")
    parser.add_argument("--case-timeout", type=float, default=Limits.case_s,
                        help=f"seconds allowed per case (default {Limits.case_s:g})")
    parser.add_argument("--cells-timeout", type=float, default=Limits.cells_s,
                        help=f"seconds allowed to run a notebook's cells (default "
                             f"{Limits.cells_s:g})")
    parser.add_argument("--timeout", type=float, default=Limits.total_s,
                        help=f"seconds allowed per notebook in all (default {Limits.total_s:g})")
    parser.add_argument("--memory-mb", type=int, default=Limits.memory_mb,
                        help=f"address-space limit of a notebook's process in MiB (default "
                             f"{Limits.memory_mb})")
    parser.add_argument("--no-fork", action="store_true",
                        help="start every notebook's process afresh instead of forking it from a "
                             "process that has imported torch once (slower; the same isolation)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if not args.submitted.is_dir():
        print(f"error: {args.submitted} is not a folder", file=sys.stderr)
        return 2
    found = find_submissions(args.submitted)
    if not found:
        print(f"error: no notebook of the book's assignments ({', '.join(ASSIGNMENTS)}) in "
              f"{args.submitted}/<student>/[<assignment>/]", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    if args.no_fork:
        sandbox.use_fork = False
    limits = Limits(args.case_timeout, args.cells_timeout, args.timeout, args.memory_mb)
    start = time.monotonic()
    results: dict[int, SubmissionResult] = {}
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = {pool.submit(grade_notebook, nb, ASSIGNMENTS[a], limits): i
                   for i, (_, a, nb) in enumerate(found)}
        for n, fut in enumerate(as_completed(futures), start=1):
            results[futures[fut]] = fut.result()
            if not args.quiet:
                _progress(n, len(found), start)
    names = sorted({a for _, a, _ in found}, key=list(ASSIGNMENTS).index)
    cols = columns(names)
    questions = {name: written_questions(name) for name in names}
    written: dict[str, list[tuple[str, list[str | None]]]] = {name: [] for name in names}
    rows = []
    for i, (student, name, nb) in enumerate(found):
        res = results[i]
        written[name].append((student, written_answers(nb, questions[name])))
        row = {"student": student, "assignment": name, "score": _points(res.points),
               "max_score": _points(res.max_points), "flags": ";".join(res.flags),
               "written_max": _points(sum(q["points"] for q in questions[name]))}
        for check in res.checks:
            for c in check.cases:
                row[f"{check.check.removeprefix('check_')}.{c.case_id}"] = _points(c.points)
        rows.append(row)
        path = args.out / "feedback" / student / f"{name}.md"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(feedback(student, res), encoding="utf-8")
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "grades.csv", "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, ["student", "assignment", "score", "max_score", *cols,
                                    "written_max", "flags"], restval="")
        writer.writeheader()
        writer.writerows(rows)
    for name in names:
        if questions[name]:
            path = args.out / "written" / f"{name}.md"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(written_report(name, questions[name], written[name]),
                            encoding="utf-8")
    print(summary(rows))
    started = sandbox.children_started
    print(f"graded {len(rows)} notebooks in {time.monotonic() - start:.1f} s "
          f"({started['forked']} processes forked, {started['fresh']} started afresh); wrote "
          f"{args.out / 'grades.csv'}, {args.out / 'feedback'}/ and {args.out / 'written'}/")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
