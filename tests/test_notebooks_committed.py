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
