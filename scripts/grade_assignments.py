"""Grade handed-in assignment notebooks, each in its own sandboxed process.

    python scripts/grade_assignments.py SUBMITTED --out DIR
    make grade SUBMITTED=... [OUT=DIR]

SUBMITTED is nbgrader's layout, SUBMITTED/<student>/<assignment>/<notebook>.ipynb, or a flat one,
SUBMITTED/<student>/<notebook>.ipynb. Which assignment a notebook is comes from its metadata (the
handed-out notebooks carry it), its nbgrader cell ids, its file name (forgiving: "A1_Attention
(1).ipynb" and "a1_attention-Copy1.ipynb" are a1_attention) or its folder
(`grader.submissions`). A student with several notebooks for one assignment is graded on
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
import signal
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from grader import kernel, sandbox, sanitize, submissions, zygote_client  # noqa: E402
from grader.limits import INTERRUPTED, Limits  # noqa: E402
from grader.notebook_reading import (  # noqa: E402
    MAX_NOTEBOOK_BYTES,
    UnreadableNotebook,
    read_notebook,
)
from grader.sandbox import SubmissionResult, grade_notebook  # noqa: E402
from grader.submissions import Placed, Unplaced  # noqa: E402
from utils.checks import ASSIGNMENTS  # noqa: E402
from utils.checks.results import CheckResult  # noqa: E402

SOURCES = ROOT / "book" / "assignments"
ANSWER_STUB = "YOUR ANSWER HERE"
FEEDBACK_BYTES = 64 * 2**10
FEEDBACK_CUT = "(feedback cut here: it was longer than 64 KiB)"
NOTE_CHARS = 300
MAX_NOTES = 20
GRADER_ERROR = "grader error"


def find_submissions(folder: Path,
                     names: Sequence[str] = tuple(ASSIGNMENTS)) -> tuple[list[Placed],
                                                                       list[Unplaced]]:
    """(placed, unplaced): every handed-in notebook in ``folder``, one `Placed` per student and
    assignment, and every notebook that cannot be graded with the reason
    (`grader.submissions.find_submissions`)."""
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
    nbformat 3 converted). An answer cell is found by its grade_id, so a student who moved cells
    around is still graded on the right answers. Where the ids are gone (cells copied into a
    fresh notebook keep no metadata), it is found by position: the first Markdown cell that
    starts with ``**Answer.**`` after the cell that starts like the question (its first line),
    before the next question.
    """
    try:
        cells = [c for c in read_notebook(notebook, MAX_NOTEBOOK_BYTES)["cells"]
                 if isinstance(c, dict) and c.get("cell_type") == "markdown"]
        by_id: dict[str, str] = {}
        texts = [_markdown_source(cell) for cell in cells]
        for cell, text in zip(cells, texts, strict=True):
            meta = cell.get("metadata", {}).get("nbgrader", {})
            if isinstance(meta, dict) and meta.get("grade_id") is not None:
                by_id.setdefault(str(meta.get("grade_id")), _answer_text(text))
    except (UnreadableNotebook, OSError, ValueError, KeyError, TypeError, AttributeError):
        return [None] * len(questions)
    answers: list[str | None] = []
    for q in questions:
        text = by_id.get(q["id"])
        if text is None:
            text = _answer_by_position(texts, q["question"])
        answers.append(None if not text or text == ANSWER_STUB else text)
    return answers


def _first_line(text: str) -> str:
    return " ".join(text.strip().split("\n", 1)[0].split()) if text.strip() else ""


def _answer_by_position(texts: list[str], question: str) -> str | None:
    """The answer after the Markdown cell that starts like ``question``, or None."""
    start = _first_line(question)
    if not start:
        return None
    for i, text in enumerate(texts):
        if _first_line(text) != start:
            continue
        for after in texts[i + 1:]:
            stripped = after.lstrip()
            if stripped.startswith("**Question"):
                return None
            if stripped.startswith("**Answer.**"):
                return _answer_text(after)
        return None
    return None


def written_report(name: str, questions: list[dict],
                   answers: list[tuple[str, list[str | None]]]) -> str:
    """The Markdown file of one assignment's written answers, question by question."""
    total = sum(q["points"] for q in questions)
    lines = [f"# {name}: written answers, graded by hand ({_points(total)} points)", ""]
    for k, q in enumerate(questions):
        lines += [f"## {q['question']} ({_points(q['points'])} points)", "",
                  "**Model answer.** " + q["model"], ""]
        for student, given in answers:
            lines += [f"### {sanitize.markdown_line(student)}", "",
                      quoted(given[k]) if given[k] else "*(no answer)*", ""]
    return "\n".join(lines)


MAX_ANSWER = 5000  # characters of one written answer shown; no honest answer comes near


def quoted(answer: str) -> str:
    """A student's answer as a Markdown block quote, cut at `MAX_ANSWER` characters, every line
    through `sanitize.markdown_block`: raw HTML escaped, images and links shown as text, control
    characters shown, and nothing at a line's start that opens a block, so nothing in it can pass
    for a heading, another student's answer or markup of the report, or fetch anything."""
    text = answer if len(answer) <= MAX_ANSWER else (
        answer[:MAX_ANSWER] + f"\n\n(cut here: the answer was {len(answer)} characters long)")
    return "\n".join("> " + line if line.strip() else ">"
                     for line in sanitize.markdown_block(text).split("\n"))


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
        note = " ".join(sanitize.line(note, fold=True).split())
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
    md = sanitize.markdown_line
    lines = [f"# {md(result.assignment)}: {md(student)}", "",
             f"**Score: {_points(result.points)} / {_points(result.max_points)}**", ""]
    if result.flags:
        lines += [f"Flags: {md(', '.join(map(str, result.flags)), fold=True)}", ""]
    notes = capped_notes(result.notes)
    for note in notes:
        lines.append(f"- {md(note, fold=True)}")
    if notes:
        lines.append("")
    for check in result.checks:
        lines += [f"## {md(check.check)}", "", "| case | result | points | hint |",
                  "| --- | --- | --- | --- |"]
        for c in check.cases:
            lines.append(f"| {md(c.name, fold=True)} | {'pass' if c.passed else 'FAIL'} | "
                         f"{_points(c.points)} / {_points(c.max_points)} | "
                         f"{md(c.hint, fold=True)} |")
        lines.append("")
    if result.cell_errors:
        lines += ["## Errors while your notebook ran", ""]
        lines += [f"- {md(e, fold=True)}" for e in result.cell_errors] + [""]
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
    """The summary's line for a notebook that is not graded (one line, control characters
    shown)."""
    return sanitize.line(f"unplaced: {item.label()}: {item.reason}", fold=True)


def unplaced_row(item: Unplaced) -> dict[str, str]:
    """The CSV row of a notebook that is not graded: no assignment, no score, the reason."""
    where = item.relative or "(the folder itself)"
    return {"student": sanitize.csv_cell(item.student), "assignment": "", "score": "",
            "max_score": "", "written_max": "",
            "flags": sanitize.csv_cell(f"unplaced: {where}: {item.reason}", fold=True)}


def grades_csv(rows: list[dict[str, str]], cols: list[str]) -> str:
    """The text of grades.csv."""
    out = io.StringIO()
    writer = csv.DictWriter(out, ["student", "assignment", "score", "max_score", *cols,
                                  "written_max", "flags"], restval="", extrasaction="ignore")
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


def error_flag(exc: BaseException, doing: str) -> str:
    """The flag that says what failed: ``grader error: <exception type> while <doing>``."""
    return sanitize.line(f"{GRADER_ERROR}: {type(exc).__name__} while {doing}", fold=True)


def grader_error_result(name: str, exc: BaseException, doing: str) -> SubmissionResult:
    """The grade of a notebook the grader failed on: every case 0, flagged "grader error"."""
    result = SubmissionResult(name)
    hint = "not graded: the grader failed on this notebook"
    for checker in ASSIGNMENTS[name].checkers:
        result.checks.append(CheckResult(checker.name, [
            checker.result(case, hint, GRADER_ERROR) for case in checker.cases]))
    result.flags = [GRADER_ERROR, error_flag(exc, doing)]
    result.notes = ["the grader failed on this notebook; grade it by hand or ask for a regrade"]
    return result


def _max_points(name: str) -> str:
    return _points(sum(c.points for checker in ASSIGNMENTS[name].checkers
                       for c in checker.cases))


def grade_row(student: str, name: str, result: SubmissionResult, cols: Sequence[str],
              written_max: float) -> dict[str, str]:
    """The CSV row of one student's assignment: every text cell through `sanitize.csv_cell`,
    every number a number."""
    row = {"student": sanitize.csv_cell(student), "assignment": name,
           "score": _points(float(result.points)), "max_score": _points(float(result.max_points)),
           "flags": sanitize.csv_cell(";".join(str(f) for f in result.flags), fold=True),
           "written_max": _points(written_max)}
    for check in result.checks:
        for c in check.cases:
            col = f"{check.check.removeprefix('check_')}.{c.case_id}"
            if col in cols:
                row[col] = _points(float(c.points))
    return row


def error_row(place: Placed, result: SubmissionResult | None, exc: BaseException,
              doing: str) -> dict[str, str]:
    """The row of a student whose outputs failed: the score when it is known, else 0, and the
    flags "grader error" and what failed."""
    try:
        score = _points(float(result.points)) if result is not None else "0"
        flags = [str(f) for f in result.flags] if result is not None else []
    except Exception:  # noqa: BLE001
        score, flags = "0", []
    flags += [GRADER_ERROR, error_flag(exc, doing)]
    return {"student": sanitize.csv_cell(place.student), "assignment": place.assignment,
            "score": score, "max_score": _max_points(place.assignment), "written_max": "",
            "flags": sanitize.csv_cell(";".join(dict.fromkeys(flags)), fold=True)}


def feedback_folders(students: Sequence[str]) -> dict[str, str]:
    """Each student's folder under ``feedback/``: `sanitize.file_name` of the student's folder
    name (the name itself when every file system takes it), unique even where case is
    ignored."""
    out: dict[str, str] = {}
    taken: set[str] = set()
    for student in sorted(set(students)):
        base = name = sanitize.file_name(student)
        n = 1
        while name.casefold() in taken:
            n += 1
            name = f"{base}-{n}"
        taken.add(name.casefold())
        out[student] = name
    return out


def write_outputs(out: Path, placed: Sequence[Placed], results: Sequence[SubmissionResult],
                  cols: Sequence[str]) -> tuple[list[dict[str, str]], list[str]]:
    """Write every feedback file and written-answers report; return the rows of grades.csv and
    the lines the summary adds (feedback moved to a safe folder name).

    Each student's feedback and row are made inside a guard: any exception makes that
    student's row "grader error" (with the exception's type) and the others go on; each
    assignment's written report likewise, its rows flagged when it could not be written.
    """
    names = sorted({p.assignment for p in placed}, key=list(ASSIGNMENTS).index)
    folders = feedback_folders([p.student for p in placed])
    questions: dict[str, list[dict]] = {}
    for name in names:
        try:
            questions[name] = written_questions(name)
        except Exception:  # noqa: BLE001 (the book's own notebook: reported with the report)
            questions[name] = []
    written: dict[str, list[tuple[str, list[str | None]]]] = {name: [] for name in names}
    rows: list[dict[str, str]] = []
    lines: list[str] = []
    for place, res in zip(placed, results, strict=True):
        student, name = place.student, place.assignment
        try:
            answers = ([None] * len(questions[name]) if place.unreadable
                       else written_answers(place.path, questions[name]))
            row = grade_row(student, name, res, cols,
                            sum(q["points"] for q in questions[name]))
            write_atomic(out / "feedback" / folders[student] / f"{name}.md",
                         feedback(student, res))
        except Exception as exc:  # noqa: BLE001 (one student must never stop the class)
            rows.append(error_row(place, res, exc, "writing the feedback"))
            continue
        written[name].append((student, answers))
        rows.append(row)
    for student, folder in folders.items():
        if folder != student:
            lines.append(sanitize.line(f"feedback of {student}: {out / 'feedback' / folder}/"))
    for name in names:
        if not questions[name]:
            continue
        try:
            write_atomic(out / "written" / f"{name}.md",
                         written_report(name, questions[name], written[name]))
        except Exception as exc:  # noqa: BLE001
            flag = error_flag(exc, f"writing written/{name}.md")
            for row in rows:
                if row["assignment"] == name:
                    row["flags"] = sanitize.csv_cell(";".join(
                        [f for f in row["flags"].split(";") if f] + [GRADER_ERROR, flag]))
            lines.append(sanitize.line(flag))
    return rows, lines


def write_grades(out: Path, placed: Sequence[Placed], rows: list[dict[str, str]],
                 unplaced: Sequence[Unplaced], cols: Sequence[str],
                 failure: BaseException | None = None) -> list[dict[str, str]]:
    """Write grades.csv: ``rows`` (one per placed notebook, in order; when the grading itself
    failed before they were made, ``failure``, a "grader error" row for each), then a row per
    unplaced notebook. Returns the graded rows."""
    if len(rows) != len(placed):
        rows = [error_row(place, None, failure or RuntimeError(), "grading") for place in placed]
    write_atomic(out / "grades.csv", grades_csv(rows + [unplaced_row(u) for u in unplaced],
                                                list(cols)))
    return rows


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
        try:
            for n, fut in enumerate(as_completed(futures), start=1):
                i = futures[fut]
                try:
                    results[i] = with_placement(fut.result(), placed[i])
                except Exception as exc:  # noqa: BLE001 (one notebook must never stop the class)
                    results[i] = grader_error_result(placed[i].assignment, exc, "grading")
                if not quiet:
                    _progress(n, len(todo), start)
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM: every grading stops now, not when done
            INTERRUPTED.set()
            pool.shutdown(wait=False, cancel_futures=True)
            zygote_client.stop_zygote()  # its children die: the waits on them end at once
            raise
    return [results[i] for i in range(len(placed))]


def _terminated(signum: int, frame: object) -> None:
    """SIGTERM and SIGINT end the run: children killed, folders removed, grades written."""
    raise KeyboardInterrupt


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
                             "process that has imported torch once (slower; the same isolation but "
                             "for a PID namespace of each child's own)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--insecure", action="store_true",
                        help="grade even where the kernel lacks Landlock or seccomp, without "
                             "its confinement (every row is flagged 'insecure'); never for "
                             "notebooks you do not trust")
    args = parser.parse_args(argv)
    for stream in (sys.stdout, sys.stderr):  # a terminal that cannot show a character escapes it
        with contextlib.suppress(AttributeError, ValueError):
            stream.reconfigure(errors="backslashreplace")
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
    # Ctrl-C too, even where the grader was started with SIGINT ignored (a background job, a
    # test runner's worker), in which case Python installs no handler of its own.
    signal.signal(signal.SIGTERM, _terminated)
    signal.signal(signal.SIGINT, _terminated)
    if args.no_fork:
        zygote_client.use_fork = False
    limits = Limits(args.case_timeout, args.cells_timeout, args.timeout, args.memory_mb)
    start = time.monotonic()
    names = sorted({p.assignment for p in placed}, key=list(ASSIGNMENTS).index)
    cols = columns(names)
    rows: list[dict[str, str]] = []
    extra: list[str] = []
    failure: BaseException | None = None
    try:
        try:
            # Orphans of any process below this one come back to it, so that none outlives
            # the run.
            kernel.set_child_subreaper()
            zygote_client.shared_zygote()  # from this thread, which outlives the grading threads
            results = grade_all(placed, limits, args.jobs, args.quiet, start)
        finally:
            zygote_client.stop_zygote()
            # Every process below the grader is gone before anything is written.
            leftover = kernel.kill_descendants()
        rows, extra = write_outputs(args.out, placed, results, cols)
    except BaseException as exc:
        failure = exc
        raise
    finally:
        # Always, and last: a grades.csv is never older than its feedback.
        rows = write_grades(args.out, placed, rows, unplaced, cols, failure)
    try:
        text = summary(rows, unplaced)
    except Exception as exc:  # noqa: BLE001 (the grades are written: say what failed)
        text = error_flag(exc, "summing up the grades")
    print("\n".join([text, *extra]))
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
