"""The assignments: solution markers, the student versions `make assignments` writes (no line of
a solution left, every check failing without an exception), and the switch that builds the book
without the exercises' solutions."""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
import yaml
from nbclient import NotebookClient
from notebooks import ROOT

ASSIGNMENTS = sorted((ROOT / "book" / "assignments").glob("*.ipynb"))
SCRIPT = ROOT / "scripts" / "make_assignments.py"
CHECK_CALL = re.compile(r"\bcheck_\w+\(")

_spec = importlib.util.spec_from_file_location("make_assignments", SCRIPT)
make_assignments = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_assignments)


def solution_lines(path: Path) -> list[str]:
    """Every non-blank line between the markers of the notebook at ``path``, stripped."""
    lines, inside = [], False
    for cell in nbformat.read(path, as_version=4).cells:
        for ln in cell.source.splitlines():
            marker = make_assignments.marker_of(ln)
            if marker:
                inside = marker == make_assignments.BEGIN
            elif inside and ln.strip():
                lines.append(ln.strip())
    return lines


@pytest.fixture(scope="module")
def student_dir(tmp_path_factory):
    """Run the script as `make assignments` does, into a temporary folder."""
    out = tmp_path_factory.mktemp("assignments")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    return out


def test_the_table_of_contents_lists_the_assignments_in_order_with_chapters_and_time():
    """"For courses": every assignment, in the order of utils.checks.ASSIGNMENTS (the book's
    order), titled with the chapters it assumes and an estimate of the time it takes."""
    import yaml

    from utils.checks import ASSIGNMENTS as CHECKED

    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    part = next(p for p in toc["parts"] if p["caption"] == "For courses")
    entries = [s for s in part["chapters"][0]["sections"] if "title" in s]
    assert [Path(s["file"]).name for s in entries] == list(CHECKED) == [p.stem for p in ASSIGNMENTS]
    for number, entry in enumerate(entries, start=1):
        assert re.fullmatch(rf"{number}\. .+ · chapters? [\d, ]+ · [\d.]+ h", entry["title"]), entry


def test_there_are_nine_assignments_with_solutions_and_checks():
    assert len(ASSIGNMENTS) == 9
    for path in ASSIGNMENTS:
        sources = [c.source for c in nbformat.read(path, as_version=4).cells
                   if c.cell_type == "code"]
        assert any(make_assignments.BEGIN in s for s in sources), path.name
        assert any(CHECK_CALL.search(s) for s in sources), f"{path.name} calls no checker"


def test_makefile_target_writes_to_build_assignments():
    text = (ROOT / "Makefile").read_text()
    assert re.search(r"^assignments: venv\n\t.*make_assignments\.py --out _build/assignments$",
                     text, re.M)


# ---------------------------------------------------------------------------------------------
# Replacing the solutions


def test_stub_keeps_the_indentation():
    src = ("def f(x):\n    y = 1\n    ### BEGIN SOLUTION\n    if x:\n        return x + y\n"
           "    return y\n    ### END SOLUTION\n\n\nclass A:\n    def g(self):\n"
           "        ### BEGIN SOLUTION\n        return 2\n        ### END SOLUTION\n")
    new, removed = make_assignments.strip_solutions(src)
    assert new == ("def f(x):\n    y = 1\n    # YOUR CODE HERE\n    raise NotImplementedError()\n"
                   "\n\nclass A:\n    def g(self):\n        # YOUR CODE HERE\n"
                   "        raise NotImplementedError()")
    assert removed == ["    if x:", "        return x + y", "    return y", "        return 2"]
    ns: dict = {}
    exec(new, ns)
    with pytest.raises(NotImplementedError):
        ns["f"](1)


@pytest.mark.parametrize("src", [
    "### BEGIN SOLUTION\nx = 1\n",
    "x = 1\n### END SOLUTION\n",
    "### BEGIN SOLUTION\n### BEGIN SOLUTION\n### END SOLUTION\n",
])
def test_unpaired_markers_are_refused(src):
    with pytest.raises(make_assignments.SolutionMarkerError):
        make_assignments.strip_solutions(src)


def test_markdown_solutions_become_an_answer_prompt():
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell(
        "Why?\n\n### BEGIN SOLUTION\nBecause the softmax saturates.\n### END SOLUTION")])
    student, removed = make_assignments.student_version(nb)
    assert student.cells[0].source == "Why?\n\nYOUR ANSWER HERE"
    assert removed == ["Because the softmax saturates."]


def test_markdown_markers_may_be_html_comments():
    """The book's pages show the model answer without the markers; the student sees a prompt."""
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell(
        "**Answer.**\n\n<!-- ### BEGIN SOLUTION -->\nThe rows would no longer sum to 1.\n"
        "<!--### END SOLUTION-->")])
    student, removed = make_assignments.student_version(nb)
    assert student.cells[0].source == "**Answer.**\n\nYOUR ANSWER HERE"
    assert removed == ["The rows would no longer sum to 1."]
    assert make_assignments.marker_of("  <!-- ### BEGIN SOLUTION -->") == make_assignments.BEGIN
    assert make_assignments.marker_of("<!-- a comment -->") is None


@pytest.mark.parametrize("path", ASSIGNMENTS, ids=[p.name for p in ASSIGNMENTS])
def test_every_question_has_an_answer_cell(path):
    """Each question under "Before you hand it in" is followed by its manually graded answer."""
    cells = nbformat.read(path, as_version=4).cells
    start = next(i for i, c in enumerate(cells) if "## Before you hand it in" in c.source)
    questions = [i for i, c in enumerate(cells) if i > start and c.cell_type == "markdown"
                 and c.source.lstrip().startswith("**Question")]
    assert questions, f"{path.name}: no question cells after 'Before you hand it in'"
    for i in questions:
        answer = cells[i + 1]
        meta = answer.metadata["nbgrader"]
        assert answer.cell_type == "markdown" and meta["solution"] and meta["grade"], i
        assert not meta["locked"] and meta["points"] > 0
        assert make_assignments.marker_of(answer.source.splitlines()[2]) == make_assignments.BEGIN
        assert cells[i].metadata["nbgrader"]["locked"]
    assert sum(1 for c in cells if c.cell_type == "markdown"
               and c.metadata["nbgrader"]["solution"]) == len(questions)


def test_course_config_switches_only_hide_solutions():
    text = (ROOT / "_config.yml").read_text()
    new = make_assignments.course_config(text)
    changed = [(a, b) for a, b in zip(text.splitlines(), new.splitlines(), strict=True) if a != b]
    assert len(changed) == 1 and re.fullmatch(r"\s*hide_solutions: true", changed[0][1])
    assert re.search(r"(?m)^\s*hide_solutions: false", text), "the book shows solutions by default"


# ---------------------------------------------------------------------------------------------
# The student versions


def test_one_student_version_per_assignment(student_dir):
    assert sorted(p.name for p in student_dir.glob("*.ipynb")) == [p.name for p in ASSIGNMENTS]


@pytest.mark.parametrize("path", ASSIGNMENTS, ids=[p.name for p in ASSIGNMENTS])
def test_no_line_of_a_solution_is_left(path, student_dir):
    student = nbformat.read(student_dir / path.name, as_version=4)
    text = json.dumps(student.cells)
    assert "BEGIN SOLUTION" not in text and "END SOLUTION" not in text
    present = {ln.strip() for c in student.cells for ln in c.source.splitlines()}
    solution = solution_lines(path)
    assert solution
    # A line of brackets alone (formatting puts a closing bracket on its own line) reveals nothing.
    assert not [ln for ln in solution if ln in present and any(ch.isalnum() for ch in ln)]
    code = [c for c in student.cells if c.cell_type == "code"]
    assert all(not c.outputs and c.execution_count is None for c in code)
    for c in code:
        ast.parse(c.source)
    stubs = sum(c.source.count("raise NotImplementedError()") for c in code)
    sources = nbformat.read(path, as_version=4).cells
    assert stubs == sum(c.source.count(make_assignments.BEGIN) for c in sources
                        if c.cell_type == "code")
    answers = [c for c in student.cells if c.cell_type == "markdown"
               and c.metadata["nbgrader"]["solution"]]
    assert answers and all(c.source.endswith("YOUR ANSWER HERE") for c in answers)


@pytest.mark.parametrize("path", ASSIGNMENTS, ids=[p.name for p in ASSIGNMENTS])
def test_student_version_runs_and_every_check_fails(path, student_dir, notebook_kernel_manager):
    nb = nbformat.read(student_dir / path.name, as_version=4)
    NotebookClient(nb, km=notebook_kernel_manager, timeout=120, kernel_name="python3",
                   resources={"metadata": {"path": str(student_dir)}}).execute()
    checks = 0
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        assert not [o for o in cell.outputs if o.output_type == "error"], cell.source
        if CHECK_CALL.search(cell.source):
            checks += 1
            out = "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")
            # One case a line; a long one wraps onto lines indented under the case's name.
            lines = re.sub(r"\n {7}(?=\S)", " ", out.strip()).splitlines()
            assert lines and re.search(r": 0/\d+ cases passed, 0 of \d+ points$", lines[-1]), out
            assert all(ln.startswith("[FAIL] ") and "not implemented yet" in ln
                       for ln in lines[:-1]), out
    assert checks >= 1


# ---------------------------------------------------------------------------------------------
# The book without solutions: sphinx-exercise's `hide_solutions`, on a tiny book built with the
# book's own configuration (only that option switched), so that it takes seconds.

TINY_PAGE = """# Tiny

```{exercise} A question
:label: ex-tiny

What is the largest attention weight?
```

```{solution} ex-tiny
:class: dropdown

SECRET-ANSWER-1729 is the answer.
```
"""


def _build_tiny_book(folder: Path, hide: bool) -> str:
    (folder / "book").mkdir(parents=True)
    (folder / "book" / "intro.md").write_text(TINY_PAGE)
    (folder / "book" / "references.bib").write_text((ROOT / "book" / "references.bib").read_text())
    # the configuration's static files, icons and Sphinx additions
    for extra in ("_static", "_extra", "_ext"):
        if (ROOT / "book" / extra).is_dir():
            shutil.copytree(ROOT / "book" / extra, folder / "book" / extra)
    (folder / "_toc.yml").write_text("format: jb-book\nroot: book/intro\n")
    config = (ROOT / "_config.yml").read_text()
    config = make_assignments.course_config(config) if hide else config
    # The tiny book has none of the chapters that the search's key terms name.
    settings = yaml.safe_load(config)
    settings["sphinx"].setdefault("config", {})["search_key_terms"] = {}
    (folder / "_config.yml").write_text(yaml.safe_dump(settings, sort_keys=False))
    jb = Path(sys.executable).parent / "jupyter-book"
    proc = subprocess.run([str(jb), "build", str(folder), "-W", "-n", "--keep-going"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return (folder / "_build" / "html" / "book" / "intro.html").read_text(encoding="utf-8")


@pytest.mark.book
def test_hide_solutions_removes_every_solution(tmp_path):
    shown = _build_tiny_book(tmp_path / "shown", hide=False)
    hidden = _build_tiny_book(tmp_path / "hidden", hide=True)
    assert "SECRET-ANSWER-1729" in shown and "What is the largest attention weight?" in shown
    assert "What is the largest attention weight?" in hidden
    assert "SECRET-ANSWER-1729" not in hidden and 'class="solution' not in hidden


@pytest.mark.book
def test_course_book_has_no_solution(tmp_path):
    """The whole book as a course hands it out: no exercise solution, no assignment solution."""
    html = make_assignments.build_course_book(tmp_path / "course")  # raises if a solution is left
    pages = {p.relative_to(html).as_posix(): p.read_text(encoding="utf-8")
             for p in html.rglob("*.html")}
    assert "book/assignments/a1_attention.html" in pages
    assert "raise NotImplementedError()" in make_assignments.visible_text(
        pages["book/assignments/a1_attention.html"])
    solution = [ln for p in ASSIGNMENTS for ln in solution_lines(p) if len(ln) > 20]
    for name, text in pages.items():
        assert 'class="solution' not in text, name
        if name.startswith("book/assignments/"):  # chapters teach the same code, rightly
            visible = make_assignments.visible_text(text)
            assert not [ln for ln in solution if ln in visible], name


def test_visible_text_finds_solutions_in_the_book_pages():
    """The course book's check reads code through its highlighting spans."""
    page = ('<div class="highlight"><pre><span class="n">scores</span> <span class="o">=</span> '
            '<span class="n">q</span> <span class="o">@</span> <span class="n">k</span>'
            '<span class="o">.</span><span class="n">transpose</span><span class="p">(</span>'
            '<span class="o">-</span><span class="mi">2</span><span class="p">,</span> '
            '<span class="o">-</span><span class="mi">1</span><span class="p">)</span> '
            '<span class="o">&gt;</span> <span class="mi">0</span></pre></div>')
    assert "scores = q @ k.transpose(-2, -1) > 0" in make_assignments.visible_text(page)


@pytest.mark.parametrize("path", ASSIGNMENTS, ids=[p.name for p in ASSIGNMENTS])
def test_nbgrader_metadata(path):
    """Solution cells, read-only instructions, autograded test cells worth the checker's points."""
    from utils.checks import ASSIGNMENTS as CHECKED

    checkers = {c.name: c for c in CHECKED[path.stem].checkers}
    ids = []
    for cell in nbformat.read(path, as_version=4).cells:
        meta = cell.metadata["nbgrader"]
        ids.append(meta["grade_id"])
        assert meta["schema_version"] == 3
        call = CHECK_CALL.search(cell.source)
        if make_assignments.BEGIN in cell.source and cell.cell_type == "markdown":
            # a written answer: nbgrader's manually graded answer cell
            assert meta["solution"] and meta["grade"] and not meta["locked"]
            assert meta["points"] > 0
        elif make_assignments.BEGIN in cell.source:
            assert meta["solution"] and not meta["grade"] and not meta["locked"]
        elif call and cell.cell_type == "code":
            checker = checkers[call.group(0)[:-1]]
            assert meta["grade"] and meta["locked"] and not meta["solution"]
            assert meta["points"] == sum(c.points for c in checker.cases)
            assert cell.source.rstrip().splitlines()[-1].startswith("result")
        else:
            assert meta["locked"] and not meta["solution"] and not meta["grade"]
    assert len(ids) == len(set(ids))
