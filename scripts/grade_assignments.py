"""Grade handed-in assignment notebooks, each in its own sandboxed process.

    python scripts/grade_assignments.py SUBMITTED --out DIR
    make grade SUBMITTED=... [OUT=DIR]

SUBMITTED is nbgrader's layout, SUBMITTED/<student>/<assignment>/<notebook>.ipynb, or a flat one,
SUBMITTED/<student>/<notebook>.ipynb. Which assignment a notebook is comes from its metadata (the
handed-out notebooks carry it), its nbgrader cell ids, its file name (forgiving: "A1_Attention
(1).ipynb" and "a1_attention-Copy1.ipynb" are a1_attention) or its folder
(`utils.checks.submissions`). A student with several notebooks for one assignment is graded on
the newest; the others are named in the feedback. Writes DIR/grades.csv (one row per student and
assignment: score, max_score, the points of every case, written_max, flags; and one row per
handed-in notebook that could not be placed, with the reason in its flags),
DIR/feedback/<student>/<assignment>.md (every case with its points and hint) and
DIR/written/<assignment>.md (each written question, its model answer, then every student's
answer, for grading by hand; written_max is the number of points they are worth). Every file is
written whole or not at all (a temporary file renamed), grades.csv last. A notebook that cannot
be read (not a regular file, too large, not a notebook) is scored 0, flagged "unreadable" and
never run. Exits with 2 only when it cannot grade at all (no such folder, no notebook of the book
in it, or a kernel without Landlock or seccomp and no ``--insecure``); a student's code never
changes the exit status. Before writing anything it stops every process it started and any they
could have left (it is their child subreaper), so no submission's code runs after it.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import json
import os
import secrets
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from utils.checks import ASSIGNMENTS, kernel, sandbox, submissions, zygote_client  # noqa: E402
from utils.checks.limits import Limits  # noqa: E402
from utils.checks.notebook_reading import (  # noqa: E402
    MAX_NOTEBOOK_BYTES,
    UnreadableNotebook,
    read_notebook,
)
from utils.checks.results import CheckResult  # noqa: E402
from utils.checks.sandbox import SubmissionResult, grade_notebook  # noqa: E402
from utils.checks.submissions import Placed, Unplaced  # noqa: E402

SOURCES = ROOT / "book" / "assignments"
ANSWER_STUB = "YOUR ANSWER HERE"
FEEDBACK_BYTES = 64 * 2**10
FEEDBACK_CUT = "(feedback cut here: it was longer than 64 KiB)"
NOTE_CHARS = 300
MAX_NOTES = 20


def find_submissions(folder: Path,
                     names: Sequence[str] = tuple(ASSIGNMENTS)) -> tuple[list[Placed],
                                                                       list[Unplaced]]:
    """(placed, unplaced): every handed-in notebook in ``folder``, one `Placed` per student and
    assignment, and every notebook that cannot be graded with the reason
    (`utils.checks.submissions.find_submissions`)."""
    return submissions.find_submissions(folder, names)


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all: a new temporary file in the same folder,
    flushed to disk, then renamed over ``path``. A reader never sees half a file, and a grader
    stopped halfway leaves the previous file (or none), never a torn one, and no temporary one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{secrets.token_hex(8)}.tmp"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(tmp, flags, 0o666)  # the umask applies, as for open()
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(text.encode("utf-8"))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


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

    The notebook is read as JSON and never run (a regular file of at most MAX_NOTEBOOK_BYTES,
    nbformat 3 converted); an answer cell is found by its grade_id, so a student who moved cells
    around is still graded on the right answers.
    """
    try:
        cells = read_notebook(notebook, MAX_NOTEBOOK_BYTES)["cells"]
        by_id = {}
        for cell in cells:
            meta = cell.get("metadata", {}).get("nbgrader", {})
            if isinstance(meta, dict) and cell.get("cell_type") == "markdown":
                by_id.setdefault(str(meta.get("grade_id")), _answer_text(_markdown_source(cell)))
    except (UnreadableNotebook, OSError, ValueError, KeyError, TypeError, AttributeError):
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
            lines += [f"### {student}", "", quoted(given[k]) if given[k] else "*(no answer)*", ""]
    return "\n".join(lines)


MAX_ANSWER = 5000  # characters of one written answer shown; no honest answer comes near


def quoted(answer: str) -> str:
    """A student's answer as a Markdown block quote, cut at `MAX_ANSWER` characters, with raw
    HTML escaped: nothing in it can pass for a heading, another student's answer or markup of the
    report."""
    text = answer if len(answer) <= MAX_ANSWER else (
        answer[:MAX_ANSWER] + f"\n\n(cut here: the answer was {len(answer)} characters long)")
    text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return "\n".join("> " + line if line.strip() else ">" for line in text.splitlines())


def columns(assignments: list[str]) -> list[str]:
    """The case columns of ``assignments``: ``<checker>.<case id>``."""
    cols = []
    for name in assignments:
        for checker in ASSIGNMENTS[name].checkers:
            cols += [f"{checker.name.removeprefix('check_')}.{c.id}" for c in checker.cases]
    return cols


def _points(x: float) -> str:
    return f"{x:g}"


def capped_notes(notes: list[str]) -> list[str]:
    """At most MAX_NOTES notes of at most NOTE_CHARS characters each, on one line each."""
    out = []
    for note in notes[:MAX_NOTES]:
        note = " ".join(str(note).split())
        out.append(note if len(note) <= NOTE_CHARS else note[:NOTE_CHARS - 1] + "…")
    if len(notes) > MAX_NOTES:
        out[-1] = f"... and {len(notes) - MAX_NOTES + 1} more notes"
    return out


def capped_feedback(text: str, limit: int = FEEDBACK_BYTES) -> str:
    """``text`` if it is at most ``limit`` bytes; else its first lines, cut at a line boundary,
    and a last line saying so (the whole at most ``limit`` bytes)."""
    if len(text.encode("utf-8")) <= limit:
        return text
    budget = limit - len(FEEDBACK_CUT.encode("utf-8")) - 2
    kept, used = [], 0
    for line in text.splitlines(keepends=True):
        size = len(line.encode("utf-8"))
        if used + size > budget:
            break
        kept.append(line)
        used += size
    head = "".join(kept)
    if head and not head.endswith("\n"):
        head += "\n"
    return head + FEEDBACK_CUT + "\n"


def feedback(student: str, result: SubmissionResult) -> str:
    """The Markdown feedback for one student's assignment, at most 64 KiB."""
    lines = [f"# {result.assignment}: {student}", "",
             f"**Score: {_points(result.points)} / {_points(result.max_points)}**", ""]
    if result.flags:
        lines += [f"Flags: {', '.join(result.flags)}", ""]
    notes = capped_notes(result.notes)
    for note in notes:
        lines.append(f"- {note}")
    if notes:
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
    return capped_feedback("\n".join(lines))


def unreadable_result(name: str, reason: str) -> SubmissionResult:
    """The grade of a notebook that cannot be read: every case 0, the flag "unreadable"."""
    result = SubmissionResult(name)
    hint = f"your notebook could not be read: {reason}"
    for checker in ASSIGNMENTS[name].checkers:
        result.checks.append(CheckResult(checker.name, [
            checker.result(case, hint, "unreadable") for case in checker.cases]))
    result.flag("unreadable")
    result.notes.append(f"the notebook could not be read, so it was not run: {reason}")
    return result


def with_placement(result: SubmissionResult, place: Placed) -> SubmissionResult:
    """``result`` with the notes of how ``place`` was found (the other notebooks handed in for
    the same assignment, a renamed notebook) first, and the flag "duplicate" when there were
    other notebooks."""
    result.notes[:0] = place.notes
    if place.others:
        result.flag("duplicate")
    return result


def unplaced_line(item: Unplaced) -> str:
    """The summary's line for a notebook that is not graded."""
    return f"unplaced: {item.label()}: {item.reason}"


def unplaced_row(item: Unplaced) -> dict[str, str]:
    """The CSV row of a notebook that is not graded: no assignment, no score, the reason."""
    where = item.relative or "(the folder itself)"
    return {"student": item.student, "assignment": "", "score": "", "max_score": "",
            "written_max": "", "flags": f"unplaced: {where}: {item.reason}"}


def grades_csv(rows: list[dict[str, str]], cols: list[str]) -> str:
    """The text of grades.csv."""
    out = io.StringIO()
    writer = csv.DictWriter(out, ["student", "assignment", "score", "max_score", *cols,
                                  "written_max", "flags"], restval="")
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


def _progress(done: int, total: int, start: float) -> None:
    width = 30
    filled = int(width * done / total) if total else width
    bar = "#" * filled + "." * (width - filled)
    sys.stderr.write(f"\r[{bar}] {done}/{total} notebooks, {time.monotonic() - start:.0f} s")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def summary(rows: list[dict[str, str]], unplaced: Sequence[Unplaced] = ()) -> str:
    """Per assignment: the number graded, the mean score and how the scores spread; then one
    line per handed-in notebook that could not be graded, with the reason."""
    out = []
    for name in sorted({r["assignment"] for r in rows if r["assignment"]}):
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
    out += [unplaced_line(item) for item in unplaced]
    return "\n".join(out)


def grade_all(placed: list[Placed], limits: Limits, jobs: int, quiet: bool,
              start: float) -> list[SubmissionResult]:
    """The result of every placed notebook, in order: each run in its sandbox, ``jobs`` at once;
    one that cannot be read scored 0 without running it."""
    results: dict[int, SubmissionResult] = {}
    for i, place in enumerate(placed):
        if place.unreadable:
            results[i] = with_placement(unreadable_result(place.assignment, place.unreadable),
                                        place)
    todo = [i for i in range(len(placed)) if i not in results]
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = {pool.submit(grade_notebook, placed[i].path, ASSIGNMENTS[placed[i].assignment],
                               limits): i for i in todo}
        for n, fut in enumerate(as_completed(futures), start=1):
            i = futures[fut]
            results[i] = with_placement(fut.result(), placed[i])
            if not quiet:
                _progress(n, len(todo), start)
    return [results[i] for i in range(len(placed))]


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
                        help=f"CPU seconds allowed per case (default {Limits.case_s:g}; a case "
                             "that trains asks for more)")
    parser.add_argument("--cells-timeout", type=float, default=Limits.cells_s,
                        help=f"CPU seconds allowed to run a notebook's cells (default "
                             f"{Limits.cells_s:g})")
    parser.add_argument("--timeout", type=float, default=Limits.total_s,
                        help=f"CPU seconds allowed per notebook in all (default "
                             f"{Limits.total_s:g})")
    parser.add_argument("--memory-mb", type=int, default=Limits.memory_mb,
                        help=f"address-space limit of a notebook's process in MiB (default "
                             f"{Limits.memory_mb})")
    parser.add_argument("--no-fork", action="store_true",
                        help="start every notebook's process afresh instead of forking it from a "
                             "process that has imported torch once (slower; the same isolation)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--insecure", action="store_true",
                        help="grade even where the kernel lacks Landlock or seccomp, without "
                             "its confinement (every row is flagged 'insecure'); never for "
                             "notebooks you do not trust")
    args = parser.parse_args(argv)
    supported, why = kernel.support()
    if not supported and not args.insecure:
        print(f"error: the grader cannot confine the notebooks: {why}. Run with --insecure to "
              "grade without the kernel's confinement (only notebooks you trust).",
              file=sys.stderr)
        return 2
    sandbox.insecure = not supported
    if not args.submitted.is_dir():
        print(f"error: {args.submitted} is not a folder", file=sys.stderr)
        return 2
    placed, unplaced = find_submissions(args.submitted)
    if not placed:
        print(f"error: no notebook of the book's assignments ({', '.join(ASSIGNMENTS)}) in "
              f"{args.submitted}/<student>/[<assignment>/]", file=sys.stderr)
        for item in unplaced:
            print(unplaced_line(item), file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    if args.no_fork:
        zygote_client.use_fork = False
    limits = Limits(args.case_timeout, args.cells_timeout, args.timeout, args.memory_mb)
    start = time.monotonic()
    # Orphans of any process below this one come back to it, so that none outlives the run.
    kernel.set_child_subreaper()
    zygote_client.shared_zygote()  # from this thread, which outlives the grading threads
    try:
        results = grade_all(placed, limits, args.jobs, args.quiet, start)
    finally:
        zygote_client.stop_zygote()
        # Every process below the grader is gone before anything is written.
        leftover = kernel.kill_descendants()
    names = sorted({p.assignment for p in placed}, key=list(ASSIGNMENTS).index)
    cols = columns(names)
    questions = {name: written_questions(name) for name in names}
    written: dict[str, list[tuple[str, list[str | None]]]] = {name: [] for name in names}
    rows = []
    for place, res in zip(placed, results, strict=True):
        student, name = place.student, place.assignment
        answers = ([None] * len(questions[name]) if place.unreadable
                   else written_answers(place.path, questions[name]))
        written[name].append((student, answers))
        row = {"student": student, "assignment": name, "score": _points(res.points),
               "max_score": _points(res.max_points), "flags": ";".join(res.flags),
               "written_max": _points(sum(q["points"] for q in questions[name]))}
        for check in res.checks:
            for c in check.cases:
                row[f"{check.check.removeprefix('check_')}.{c.case_id}"] = _points(c.points)
        rows.append(row)
        write_atomic(args.out / "feedback" / student / f"{name}.md", feedback(student, res))
    for name in names:
        if questions[name]:
            write_atomic(args.out / "written" / f"{name}.md",
                         written_report(name, questions[name], written[name]))
    write_atomic(args.out / "grades.csv",  # last: a grades.csv is never older than its feedback
                 grades_csv(rows + [unplaced_row(item) for item in unplaced], cols))
    print(summary(rows, unplaced))
    if sandbox.insecure:
        print(f"INSECURE: graded without the kernel's confinement ({why}); every row is "
              "flagged 'insecure'")
    if leftover:
        print(f"killed {len(leftover)} leftover processes before writing the grades")
    started = zygote_client.children_started
    print(f"graded {len(rows)} notebooks in {time.monotonic() - start:.1f} s "
          f"({started['forked']} processes forked, {started['fresh']} started afresh); "
          f"{len(unplaced)} not placed; wrote {args.out / 'grades.csv'}, "
          f"{args.out / 'feedback'}/ and {args.out / 'written'}/")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
