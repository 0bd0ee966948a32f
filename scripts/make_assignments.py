"""Write the student versions of the assignment notebooks, and optionally a course book.

    python scripts/make_assignments.py                  # -> _build/assignments/
    python scripts/make_assignments.py --out DIR A.ipynb ...
    python scripts/make_assignments.py --course-book    # also build _build/course/_build/html

Every block between ``### BEGIN SOLUTION`` and ``### END SOLUTION`` (nbgrader's markers) is
replaced by a stub that raises ``NotImplementedError``, indented like the markers; in a markdown
cell it becomes "YOUR ANSWER HERE". In a markdown cell the markers may be HTML comments
(``<!-- ### BEGIN SOLUTION -->``), so that the book's page shows the model answer without them;
nbgrader finds them there too. Outputs and execution counts are cleared. The script then checks
that no line of any solution is left and that every code cell still parses. Each student version
carries ``metadata.tested_transformer.assignment`` (its notebook's name), so that the grader knows
which assignment a handed-in notebook is whatever the student named the file.

``--course-book`` builds the book as a course would hand it out: the exercises' solutions hidden
(sphinx-exercise's ``hide_solutions: true``) and the assignments in their student versions. It
copies the book's sources to ``_build/course/src``, switches the option in the copy of
``_config.yml`` and runs ``jupyter-book build`` on the copy, so that the repository is untouched.
"""

from __future__ import annotations

import argparse
import ast
import html as html_lib
import re
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ROOT / "book" / "assignments"
BEGIN = "### BEGIN SOLUTION"
END = "### END SOLUTION"
CODE_STUB = ["# YOUR CODE HERE", "raise NotImplementedError()"]
TEXT_STUB = ["YOUR ANSWER HERE"]


class SolutionMarkerError(ValueError):
    """The solution markers of a cell do not pair up."""


def marker_of(line: str) -> str | None:
    """BEGIN or END when ``line`` is a solution marker (bare, or inside an HTML comment)."""
    text = line.strip()
    if text.startswith("<!--") and text.endswith("-->"):
        text = text[4:-3].strip()
    return text if text in (BEGIN, END) else None


def strip_solutions(source: str, stub: list[str] = CODE_STUB) -> tuple[str, list[str]]:
    """Replace each solution block of ``source`` by ``stub``, indented like its BEGIN marker.

    Returns the new source and the lines that were removed (the markers excluded).
    """
    out: list[str] = []
    removed: list[str] = []
    indent: str | None = None
    for number, line in enumerate(source.splitlines(), start=1):
        marker = marker_of(line)
        if marker == BEGIN:
            if indent is not None:
                raise SolutionMarkerError(f"line {number}: {BEGIN} inside another solution block")
            indent = line[: len(line) - len(line.lstrip())]
            out += [indent + s for s in stub]
        elif marker == END:
            if indent is None:
                raise SolutionMarkerError(f"line {number}: {END} without a {BEGIN}")
            indent = None
        elif indent is not None:
            removed.append(line)
        else:
            out.append(line)
    if indent is not None:
        raise SolutionMarkerError(f"a {BEGIN} block is never closed by {END}")
    return "\n".join(out), removed


def student_version(nb: nbformat.NotebookNode) -> tuple[nbformat.NotebookNode, list[str]]:
    """A copy of ``nb`` with every solution replaced by a stub and no outputs."""
    nb = nbformat.from_dict(nb)
    removed: list[str] = []
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.source, gone = strip_solutions(cell.source, CODE_STUB)
            cell.outputs = []
            cell.execution_count = None
        elif cell.cell_type == "markdown":
            cell.source, gone = strip_solutions(cell.source, TEXT_STUB)
        else:
            gone = []
        removed += gone
    return nb, removed


def leaked_lines(nb: nbformat.NotebookNode, removed: list[str]) -> list[str]:
    """The removed solution lines that still appear as a line of ``nb``. Lines of punctuation
    alone (a closing bracket that formatting put on its own line) give nothing away."""
    present = {ln.strip() for cell in nb.cells for ln in cell.source.splitlines()}
    return sorted(
        {ln.strip() for ln in removed if any(ch.isalnum() for ch in ln) and ln.strip() in present}
    )


def write_student_versions(sources: list[Path], out: Path) -> list[Path]:
    """Write the student version of each notebook in ``sources`` to ``out``; return the paths."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for src in sources:
        nb = nbformat.read(src, as_version=4)
        student, removed = student_version(nb)
        if not removed:
            raise SolutionMarkerError(f"{src}: no solution block ({BEGIN} ... {END}) found")
        leaks = leaked_lines(student, removed)
        if leaks:
            raise SolutionMarkerError(f"{src}: solution lines left in the student version: {leaks}")
        for i, cell in enumerate(student.cells):
            if cell.cell_type == "code":
                try:
                    ast.parse(cell.source)
                except SyntaxError as exc:
                    raise SolutionMarkerError(
                        f"{src}: code cell {i} no longer parses: {exc}") from None
        student.metadata["tested_transformer"] = {"assignment": src.stem}  # the grader reads it
        nbformat.validate(student)
        dest = out / src.name
        nbformat.write(student, dest)
        written.append(dest)
    return written


def course_config(text: str) -> str:
    """``_config.yml`` with sphinx-exercise's ``hide_solutions`` switched on."""
    new, n = re.subn(r"(?m)^(\s*hide_solutions:\s*)\S+", r"\1true", text)
    if n != 1:
        raise ValueError("_config.yml must hold exactly one `hide_solutions:` line")
    return new


def build_course_book(out: Path) -> Path:
    """Build the book without any solution into ``out/_build/html``; return that folder."""
    src = out / "src"
    for stale in (src, out / "_build"):  # always a fresh build of fresh sources
        if stale.exists():
            shutil.rmtree(stale)
    src.mkdir(parents=True)
    shutil.copytree(ROOT / "book", src / "book",
                    ignore=shutil.ignore_patterns(".ipynb_checkpoints", "_build"))
    shutil.copytree(ROOT / "scripts", src / "scripts",  # the instructor page includes one
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(ROOT / "_toc.yml", src / "_toc.yml")
    (src / "_config.yml").write_text(course_config((ROOT / "_config.yml").read_text()))
    sources = sorted(SOURCES.glob("*.ipynb"))
    write_student_versions(sources, src / "book" / "assignments")
    jb = Path(sys.executable).parent / "jupyter-book"
    proc = subprocess.run([str(jb), "build", str(src), "--path-output", str(out), "-W", "-n",
                           "--keep-going"])
    if proc.returncode != 0:
        raise SystemExit(f"error: the course book did not build cleanly (exit {proc.returncode})")
    html = out / "_build" / "html"
    removed = [ln.strip() for s in sources
               for ln in student_version(nbformat.read(s, as_version=4))[1] if len(ln.strip()) > 20]
    # No exercise solution on any page, no assignment solution on the assignment pages (the
    # chapters themselves teach the same code, and rightly keep it).
    for page in html.rglob("*.html"):
        text = page.read_text(encoding="utf-8")
        leak = "assignments" in page.relative_to(html).parts and any(
            ln in visible_text(text) for ln in removed)
        if 'class="solution' in text or leak:
            raise SystemExit(f"{page}: a solution is still in the course book")
    return html


def visible_text(page: str) -> str:
    """The text of an HTML page without its tags (code is split into highlighting spans)."""
    return html_lib.unescape(re.sub(r"<[^>]+>", "", page))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", type=Path,
                        help="source notebooks (default: book/assignments/*.ipynb)")
    parser.add_argument("--out", type=Path, default=ROOT / "_build" / "assignments",
                        help="where to write the student versions (default: _build/assignments)")
    parser.add_argument("--course-book", action="store_true",
                        help="also build the book without solutions into _build/course")
    args = parser.parse_args(argv)
    sources = args.notebooks or sorted(SOURCES.glob("*.ipynb"))
    if not sources:
        parser.error(f"no notebook found in {SOURCES}")
    try:
        written = write_student_versions(sources, args.out)
    except SolutionMarkerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for path in written:
        print(f"wrote {path}")
    if args.course_book:
        html = build_course_book(ROOT / "_build" / "course")
        print(f"the course book (no solutions) is in {html / 'index.html'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
