"""The grader's outputs against any string: `grader.sanitize`, and the output stage of
scripts/grade_assignments.py on made-up results (no notebook is run here).

Every string from a child, a notebook or the file system reaches grades.csv, the feedback, the
written-answers reports and the summary through the sanitiser: always encodable, controls shown,
Markdown and spreadsheet formulas inert. Each student's outputs are written inside a guard, and
grades.csv is written whatever failed before. Then the two bounds on the grader's own process:
the static scan's parsing, and the removal of a scratch folder however deep.
"""

from __future__ import annotations

import csv
import importlib.util
import io
import os
import re
import resource
import time
from pathlib import Path

import pytest
from notebooks import ROOT

from grader import kernel, sanitize, scan, zygote_client
from grader.children import remove_tree
from grader.sandbox import SubmissionResult
from grader.submissions import Placed, shown
from utils.checks import ASSIGNMENTS
from utils.checks.results import CheckResult

_spec = importlib.util.spec_from_file_location("grade_assignments",
                                               ROOT / "scripts" / "grade_assignments.py")
grade_assignments = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(grade_assignments)

BIDI = "\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069\u200e\u200f\u061c"
HOSTILE = ("a\nb\r\nc\rd\te \x1b[31m \x00 \x7f \u2028 \u2029 \ufeff \u200b \udcff \ud800 "
           + BIDI + " \U000e0041")
NAMES = ['=HYPERLINK("evil.example","x")', "ann\n# Forged heading", "caf\udce9", "\udcff",
         "+1-1", "@SUM(A1)", "-2+3", "\tx", "\rx", "\uff1d1+1", "..hidden", "CON", "a" * 300,
         "Zoë", "李雷", "Ann Lee", "a\\nb"]
LIVE = """# Forged heading
![pixel](http://evil.example/p.png) [click](http://evil.example/) <http://evil.example/>
<img src="http://evil.example/i.png"> <script>alert(1)</script> &#x202e; www.evil.example
https://evil.example/x [ref]: http://evil.example/
Title
=====
- [x] list | a | b |
1. one
> quote
---
***
```
fence"""


def _render(text: str) -> str:
    markdown_it = pytest.importorskip("markdown_it")
    try:
        md = markdown_it.MarkdownIt("gfm-like")  # tables, strikethrough, bare links, raw HTML
    except Exception:  # noqa: BLE001 (without linkify-it: CommonMark and its raw HTML)
        md = markdown_it.MarkdownIt("commonmark").enable("table")
    return md.render(text)


def _inert(html: str) -> None:
    """No image, link, raw HTML or heading of the student's text in rendered Markdown."""
    for live in ("<img", "<a ", "<script", "<h1", "<h2", "<h3", "<hr", "<blockquote", "<ul",
                 "<ol", "<pre", "<table"):
        assert live not in html, (live, html)


# ---------------------------------------------------------------------------------------------
# The sanitiser, context by context


def test_line_shows_every_control_and_is_always_encodable():
    out = sanitize.line(HOSTILE)
    out.encode("utf-8")  # strict
    assert "\n" not in out and "\r" not in out and "\t" not in out and "\x1b" not in out
    assert not set(BIDI + "\u2028\u2029\ufeff\u200b\x00\x7f") & set(out)
    for shown_as in ("\\n", "\\r", "\\t", "\\x1b", "\\x00", "\\x7f", "\\u2028", "\\u2029",
                     "\\ufeff", "\\u200b", "\\xff", "\\ud800", "\\u202e", "\\u2066",
                     "\\U000e0041"):
        assert shown_as in out, shown_as
    assert sanitize.line("caf\udce9") == "caf\\xe9"  # a Latin-1 byte of a folder's name
    assert sanitize.line(sanitize.line(HOSTILE)) == out  # shown twice, shown the same
    assert sanitize.line("Zoë 李雷 \u200d👩\u200d💻") == "Zoë 李雷 \u200d👩\u200d💻"
    assert sanitize.line("a\n\n\tb\r\nc\x1b", fold=True) == "a b c\\x1b"
    assert sanitize.line(42) == "42"


@pytest.mark.parametrize("text", [HOSTILE, LIVE, *NAMES])
def test_markdown_line_renders_as_one_inert_paragraph(text):
    out = sanitize.markdown_line(text)
    out.encode("utf-8")
    assert "\n" not in out and "\r" not in out
    for context in (out, f"- {out}", f"| a | {out} |\n| --- | --- |\n| {out} | b |"):
        html = _render(context)
        assert "<img" not in html and "<a " not in html and "<script" not in html
        assert "<h1" not in html and "<h2" not in html and "<blockquote" not in html
    html = _render(f"| case | hint |\n| --- | --- |\n| x | {out} |")
    assert html.count("<td>") == 2  # a "|" of the text makes no new cell


def test_markdown_line_neutralises_each_construct():
    md = sanitize.markdown_line
    assert md("# Forged") == "\\# Forged"
    assert md("![i](http://e/p.png)") == "\\!\\[i\\](http\\[:\\]//e/p.png)"
    assert md("<img src=x>") == "&lt;img src=x&gt;"
    assert md("&#x202e;") == "&amp;#x202e;"
    assert md("a | b") == "a \\| b"
    assert md("see www.e.com") == "see www\\[.\\]e.com"
    assert md("1. one") == "1\\. one" and md("- x") == "\\- x" and md("=1") == "\\=1"
    assert md("plain words, (2, 5, 8) and x_1 * y") == "plain words, (2, 5, 8) and x_1 * y"


def test_markdown_block_keeps_lines_and_makes_each_inert():
    out = sanitize.markdown_block(LIVE + "\r\n# after crlf\r# after cr\n\tcode")
    out.encode("utf-8")
    assert "\r" not in out
    lines = out.split("\n")
    assert len(lines) == LIVE.count("\n") + 4
    assert "\\# after crlf" in lines and "\\# after cr" in lines and "\tcode" in lines
    quoted = "\n".join("> " + ln if ln.strip() else ">" for ln in lines)
    html = _render(quoted)
    for live in ("<img", "<a ", "<script", "<h1", "<h2", "<hr", "<ul", "<ol", "<pre"):
        assert live not in html, (live, html)
    assert html.count("<blockquote") == 1  # one quote: nothing in it ended or nested it


@pytest.mark.parametrize("cell", ["=1+1", "+1+1", "-1+1", "@SUM(A1)", "\t=1", "\r=1", " =1",
                                  "\uff1d1", '=HYPERLINK("evil.example","x")',
                                  "=cmd|' /C calc'!A0"])
def test_csv_cell_neutralises_formulas(cell):
    out = sanitize.csv_cell(cell)
    assert out.startswith(("'", "\\")), out  # an apostrophe, or a tab or CR shown as "\t"
    assert "\t" not in out and "\r" not in out


@pytest.mark.parametrize("number", ["0", "10", "2.5", "-1.5", "+3", "1e-3", "-2E+4", ".5"])
def test_csv_cell_keeps_numbers_numbers(number):
    assert sanitize.csv_cell(number) == number
    float(sanitize.csv_cell(number))


def test_file_name_is_a_safe_unique_folder_for_any_name(tmp_path):
    made = {}
    for name in NAMES + ["a\nb", "a_b", "a\rb", "/etc", "a/b", "", " ", "-rf", "x.", "con.txt"]:
        folder = sanitize.file_name(name)
        folder.encode("utf-8")
        assert folder and "/" not in folder and folder not in (".", "..")
        assert not folder.startswith((".", "-", " ")) and len(folder.encode()) <= 120
        assert all(c.isprintable() for c in folder)
        made.setdefault(folder, []).append(name)
        (tmp_path / folder).mkdir(exist_ok=True)
    assert all(len(names) == 1 for names in made.values()), made
    for kept in ("Zoë", "李雷", "Ann Lee", "s_fifo", "victim"):
        assert sanitize.file_name(kept) == kept


def test_a_folder_name_in_latin1_is_shown_escaped_by_the_submissions():
    assert shown("caf\udce9") == "caf\\xe9"
    assert shown("a\nb") == "a\\nb"


# ---------------------------------------------------------------------------------------------
# The grader's outputs, on made-up results


def _result(name: str = "a1_attention", hint: str = "", note: str = "",
            error: str = "", flag: str = "") -> SubmissionResult:
    res = SubmissionResult(name)
    for checker in ASSIGNMENTS[name].checkers:
        cases = [checker.result(c, None) for c in checker.cases]
        if hint:
            cases[0] = checker.result(checker.cases[0], hint, "crashed")
        res.checks.append(CheckResult(checker.name, cases))
    if note:
        res.notes.append(note)
    if error:
        res.cell_errors.append(error)
    if flag:
        res.flag(flag)
    return res


def test_feedback_of_any_name_and_text_is_encodable_and_inert():
    res = _result(hint="ValueError: " + HOSTILE + LIVE, note=LIVE + HOSTILE,
                  error="cell 3: " + HOSTILE + LIVE, flag="crashed\n# x")
    for name in NAMES:
        text = grade_assignments.feedback(name, res)
        text.encode("utf-8")
        assert not set(BIDI) & set(text)
        html = _render(text)
        assert html.count("<h1") == 1 and html.count("<h2") == 2, html  # the grader's own
        assert "<img" not in html and "<a " not in html and "<script" not in html
        assert html.count("<table") == 1 and html.count("<tr>") == 1 + len(res.checks[0].cases)


def test_written_report_shows_answers_and_names_inert():
    questions = [{"id": "q", "points": 2.0, "question": "**Question 1.** Why?", "model": "So."}]
    answers = [(name, [LIVE + "\n" + HOSTILE]) for name in NAMES]
    text = grade_assignments.written_report("a1_attention", questions, answers)
    text.encode("utf-8")
    html = _render(text)
    assert html.count("<h1") == 1 and html.count("<h2") == 1
    assert html.count("<h3") == len(NAMES)  # one per student: no name or answer adds one
    for live in ("<img", "<a ", "<script", "<hr", "<pre"):
        assert live not in html, live
    assert re.search(r"<h[1-6]>(Forged heading|Title)</h", html) is None


def test_grades_csv_cells_are_inert_and_scores_numbers():
    cols = grade_assignments.columns(["a1_attention"])
    rows = [grade_assignments.grade_row(name, "a1_attention", _result(flag=name), cols, 4.0)
            for name in NAMES]
    text = grade_assignments.grades_csv(rows, cols)
    text.encode("utf-8")
    parsed = list(csv.DictReader(io.StringIO(text)))
    assert [r["student"] for r in parsed] == [sanitize.csv_cell(n) for n in NAMES]
    for row in parsed:
        for key, cell in row.items():
            if key in ("student", "flags", "assignment"):
                assert not cell.startswith(("=", "+", "-", "@", "\t", "\r", "\uff1d")), cell
            else:
                float(cell)  # numbers stay numbers
    assert parsed[0]["student"] == "'" + NAMES[0] and parsed[1]["student"] == NAMES[1].replace(
        "\n", "\\n")


def _placed(tmp_path: Path, students: list[str]) -> list[Placed]:
    out = []
    for student in students:
        path = tmp_path / "in" / student / "a1_attention.ipynb"
        path.parent.mkdir(parents=True)
        path.write_bytes((ROOT / "book" / "assignments" / "a1_attention.ipynb").read_bytes())
        out.append(Placed(student, "a1_attention", path, "file name"))
    return out


def test_one_students_failure_flags_that_row_only_and_grades_are_written(tmp_path,
                                                                          monkeypatch):
    placed = _placed(tmp_path, ["ada", "bo", "caf\udce9"])
    cols = grade_assignments.columns(["a1_attention"])
    feedback = grade_assignments.feedback

    def failing(student, result):
        if student == "bo":
            raise UnicodeEncodeError("utf-8", "\udcff", 0, 1, "surrogates not allowed")
        return feedback(student, result)

    monkeypatch.setattr(grade_assignments, "feedback", failing)
    rows, lines = grade_assignments.write_outputs(tmp_path / "out", placed,
                                                  [_result() for _ in placed], cols)
    grade_assignments.write_grades(tmp_path / "out", placed, rows, [], cols)
    with open(tmp_path / "out" / "grades.csv", newline="", encoding="utf-8") as f:
        got = {r["student"]: r for r in csv.DictReader(f)}
    assert set(got) == {"ada", "bo", "caf\\xe9"}
    assert got["bo"]["flags"] == ("grader error;grader error: UnicodeEncodeError while writing "
                                  "the feedback") and got["bo"]["score"] == "10"
    for ok in ("ada", "caf\\xe9"):
        assert got[ok]["flags"] == "" and got[ok]["score"] == "10"
    assert (tmp_path / "out" / "feedback" / "ada" / "a1_attention.md").is_file()
    assert not (tmp_path / "out" / "feedback" / "bo").exists()
    latin = tmp_path / "out" / "feedback" / sanitize.file_name("caf\udce9") / "a1_attention.md"
    assert latin.read_text(encoding="utf-8").startswith("# a1_attention: caf\\\\xe9\n")
    assert lines == [f"feedback of caf\\xe9: {latin.parent}/"]
    written = (tmp_path / "out" / "written" / "a1_attention.md").read_text(encoding="utf-8")
    assert "### ada" in written and "### bo" not in written


def _quiet_grader(monkeypatch):
    monkeypatch.setattr(zygote_client, "shared_zygote", lambda: None)
    monkeypatch.setattr(zygote_client, "stop_zygote", lambda: None)
    monkeypatch.setattr(kernel, "kill_descendants", lambda: [])
    monkeypatch.setattr(kernel, "support", lambda: (True, ""))


def test_grades_csv_is_written_when_the_grading_itself_fails(tmp_path, monkeypatch, capsys):
    """A notebook whose grading raises is that student's "grader error"; a failure of the whole
    output stage still leaves grades.csv, every row flagged, and the exception raised."""
    _quiet_grader(monkeypatch)
    for student in ("ada", "bo"):
        path = tmp_path / "in" / student / "a1_attention.ipynb"
        path.parent.mkdir(parents=True)
        path.write_bytes((ROOT / "book" / "assignments" / "a1_attention.ipynb").read_bytes())

    def grade(notebook, assignment, limits=None, seed=None):
        if "bo" in str(notebook):
            raise MemoryError("the grader ran out")
        return _result()

    monkeypatch.setattr(grade_assignments, "grade_notebook", grade)
    out = tmp_path / "out"
    assert grade_assignments.main([str(tmp_path / "in"), "--out", str(out), "--quiet"]) == 0
    with open(out / "grades.csv", newline="") as f:
        got = {r["student"]: r for r in csv.DictReader(f)}
    assert got["ada"]["score"] == "10" and got["ada"]["flags"] == ""
    assert got["bo"]["score"] == "0" and got["bo"]["flags"] == (
        "grader error;grader error: MemoryError while grading")
    assert "1 flagged" in capsys.readouterr().out

    def broken(*args, **kwargs):
        raise RuntimeError("the output stage broke")

    monkeypatch.setattr(grade_assignments, "write_outputs", broken)
    out2 = tmp_path / "out2"
    with pytest.raises(RuntimeError):
        grade_assignments.main([str(tmp_path / "in"), "--out", str(out2), "--quiet"])
    with open(out2 / "grades.csv", newline="") as f:
        got = list(csv.DictReader(f))
    assert [r["student"] for r in got] == ["ada", "bo"]
    assert all(r["flags"] == "grader error;grader error: RuntimeError while grading"
               for r in got)


# ---------------------------------------------------------------------------------------------
# The grader's own process: the static scan's parsing, the scratch folder's removal


def test_the_static_scan_still_sees_imports_in_an_honest_200_kb_notebook():
    rules = ASSIGNMENTS["a1_attention"].rules
    filler = "def f{0}(x):\n    return x * {0} + 1  # honest work\n\n"
    cells = ["".join(filler.format(i) for i in range(j * 1000, (j + 1) * 1000))
             for j in range(5)]
    cells.append("from utils.attention import scaled_dot_product_attention as ref\n")
    assert 150_000 < sum(len(c) for c in cells) < scan.SCAN_BYTES
    assert scan.static_scan(cells, rules) == ["module:utils.attention:"]


def test_the_static_scan_never_grows_the_grader(monkeypatch):
    """Code over the bound is not parsed; code under it that would take more memory than the
    scanning process has is cut short there; the grader's own memory does not move."""
    rules = ASSIGNMENTS["a1_attention"].rules
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.monotonic()
    huge = ["f(a)\n" * (scan.SCAN_BYTES // 5 + 1) + "import utils.attention\n"]
    assert scan.scan_imports(huge) is None and scan.static_scan(huge, rules) == []
    assert time.monotonic() - start < 1
    monkeypatch.setattr(scan, "SCAN_MEMORY", 96 * 2**20)  # the same cut, sooner
    dense = ["import utils.attention\n", "f(a)\n" * 150_000]
    assert scan.scan_imports(dense) == [("utils.attention", [])]  # the cell it could parse
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown < 64 * 1024, grown  # KiB


def test_a_deep_scratch_tree_is_removed_without_recursion(tmp_path):
    """1,100 nested folders (past Python's recursion limit) named so long that no path reaches
    the bottom, an unreadable folder and links out: all removed, nothing outside touched."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("keep")
    top = tmp_path / "scratch"
    top.mkdir()
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for i in range(1100):
            name = f"{i:05d}" * 51
            os.mkdir(name, dir_fd=fd)
            down = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = down
            if i % 500 == 0:
                os.symlink(outside, "link", dir_fd=fd)
                os.symlink(outside / "keep.txt", "file_link", dir_fd=fd)
                with open(os.open("f", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=fd), "w") as f:
                    f.write("x")
        os.mkdir("locked", dir_fd=fd)
        os.chmod("locked", 0, dir_fd=fd)
    finally:
        os.close(fd)
    remove_tree(top)
    assert not top.exists()
    assert (outside / "keep.txt").read_text() == "keep"
    remove_tree(top)  # gone already: nothing to do, no error
