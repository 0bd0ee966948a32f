"""Guard: every notebook is committed executed, top to bottom, with a title.

nbval compares only the cells that were run when the notebook was saved, so a notebook saved
without outputs would pass nbval while proving nothing. These tests make that impossible.
"""

from __future__ import annotations

import json
import re

import pytest
from notebooks import ROOT, book_notebooks

NOTEBOOKS = book_notebooks()
IDS = [str(p.relative_to(ROOT)) for p in NOTEBOOKS]


def _cells(path):
    return json.loads(path.read_text(encoding="utf-8"))["cells"]


def _code_cells(path):
    return [c for c in _cells(path) if c["cell_type"] == "code" and "".join(c["source"]).strip()]


def test_there_are_notebooks():
    assert NOTEBOOKS, "no notebook found under book/"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_title_first(path):
    first_md = next((c for c in _cells(path) if c["cell_type"] == "markdown"), None)
    assert first_md is not None, "the notebook has no markdown cell"
    assert "".join(first_md["source"]).lstrip().startswith("# "), (
        "the first markdown cell must start with a '# ' title"
    )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_executed_in_order(path):
    counts = [c.get("execution_count") for c in _code_cells(path)]
    assert counts, "the notebook has no code cell"
    expected = list(range(1, len(counts) + 1))
    assert counts == expected, (
        f"execution counts are {counts}, expected {expected}: re-run the notebook top to bottom "
        "in a fresh kernel (make execute NB=...) and commit it with its outputs"
    )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_no_errors_or_skips(path):
    for i, cell in enumerate(_code_cells(path), start=1):
        src = "".join(cell["source"])
        assert not re.search(r"^\s*#\s*NBVAL_SKIP", src, re.M), f"code cell {i} is skipped"
        if re.search(r"^\s*#\s*NBVAL_IGNORE_OUTPUT", src, re.M):
            comments = [ln for ln in src.splitlines() if ln.strip().startswith("#")]
            assert len(comments) >= 2, (
                f"code cell {i} ignores its output without a comment saying why"
            )
        for out in cell.get("outputs", []):
            assert out.get("output_type") != "error", f"code cell {i} has a stored error"
            text = "".join(out.get("data", {}).get("text/plain", ""))
            assert not re.match(r"<matplotlib\.\w+.* at 0x", text), (
                f"code cell {i} shows a matplotlib repr: end plotting cells with plt.show()"
            )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_no_cell_writes_to_stderr(path):
    """A warning or a log line in a stored output is something a reader's kernel prints too
    (nbval compares the streams): it is fixed at its cause, not stored."""
    for i, cell in enumerate(_code_cells(path), start=1):
        for out in cell.get("outputs", []):
            assert not (out.get("output_type") == "stream" and out.get("name") == "stderr"), (
                f"code cell {i} writes to stderr: {''.join(out.get('text', ''))[:200]!r}"
            )


# The characters of a line that the book's column shows at 1280 px without scrolling (the
# browser test measures the same column; code is held to it by the linter).
OUTPUT_COLUMNS = 89


def long_output_lines(cells: list[dict], columns: int = OUTPUT_COLUMNS) -> list[str]:
    """Lines of stored text outputs (printed text, or a result shown only as text) longer
    than ``columns`` characters, as "code cell N: 97 characters: <start of the line>"."""
    found = []
    for i, cell in enumerate((c for c in cells if c["cell_type"] == "code"), start=1):
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if "text" in out:
                text = "".join(out["text"])
            elif data.keys() <= {"text/plain"}:
                text = "".join(data.get("text/plain", ""))
            else:  # an HTML table, an image: the book shows that, not the text
                continue
            found += [f"code cell {i}: {len(line)} characters: {line[:60]!r}"
                      for line in text.splitlines() if len(line) > columns]
    return found


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_outputs_fit_the_column(path):
    """A printed line longer than the column scrolls sideways in the book at 1280 px, and its
    end is out of sight: print it in lines that fit."""
    long = long_output_lines(_cells(path))
    assert not long, f"{len(long)} output lines wider than {OUTPUT_COLUMNS} characters: {long}"


def test_long_output_lines_are_found():
    cells = [{"cell_type": "markdown", "source": ["x" * 200]},
             {"cell_type": "code", "outputs": [
                 {"output_type": "stream", "name": "stdout", "text": ["ok\n", "y" * 90]},
                 {"output_type": "execute_result", "data": {"text/plain": ["z" * 89]}},
                 {"output_type": "display_data",
                  "data": {"text/plain": ["w" * 99], "text/html": ["<table/>"]}}]}]
    assert long_output_lines(cells) == [f"code cell 1: 90 characters: {'y' * 60!r}"]


def test_the_readmes_chapter_map_has_the_books_titles():
    """Each row of the README's chapter map names its chapter as the chapter's title does."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    rows = dict(re.findall(r"^\| (\d+) \| ([^|]+?) \|", readme, re.M))
    chapters = sorted(ROOT.glob("book/[0-9][0-9]_*.ipynb"))
    assert sorted(int(n) for n in rows) == list(range(1, len(chapters) + 1))
    for path in chapters:
        nb = json.loads(path.read_text(encoding="utf-8"))
        first = "".join(nb["cells"][0]["source"]).splitlines()[0]
        assert rows[str(int(path.name[:2]))] == first.removeprefix("# ").strip(), path.name
