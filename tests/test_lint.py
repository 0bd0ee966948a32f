"""The library, the grader, the tests, the scripts and the notebooks' code pass ruff (settings in
pyproject)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from conftest import ROOT


def test_ruff_clean():
    ruff = Path(sys.executable).parent / "ruff"
    proc = subprocess.run(
        [str(ruff), "check", "--no-cache", "utils", "grader", "tests", "scripts", "book",
         "conftest.py"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def test_notebook_code_is_formatted_to_the_column():
    """The notebooks' code cells are formatted by `ruff format` at 88 characters
    (book/ruff.toml): a line longer than that scrolls sideways in the book's text column."""
    ruff = Path(sys.executable).parent / "ruff"
    proc = subprocess.run(
        [str(ruff), "format", "--check", "--no-cache", "book"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, (
        "run `.venv/bin/ruff format book`:\n" + proc.stdout[-4000:] + proc.stderr[-2000:]
    )


# A code block of the prose (a solution's code, the commands of a page) is drawn inside an
# exercise's or solution's box, narrower than a code cell: 79 characters fit at 1280 px there
# (the browser test measures every block), against 89 for a code cell; an admonition's box
# (a note, a tip) is narrower still, 75.
PROSE_CODE_COLUMNS = 79
ADMONITION_CODE_COLUMNS = 75
ADMONITIONS = ("{admonition}", "{note}", "{tip}", "{warning}", "{important}", "{seealso}")
FENCE = re.compile(r"^\s*(`{3,}|~{3,})\s*(.*)$")


def code_blocks(text: str, inside: str = "") -> list[tuple[str, list[str], str]]:
    """The fenced code blocks of MyST text, as (info string, lines, the directive around them
    or ""), looking inside directives (```{solution} ... ```) for the blocks they hold."""
    blocks, lines, i = [], text.split("\n"), 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, info = m.groups()
        close = re.compile(rf"^\s*{re.escape(fence[0])}{{{len(fence)},}}\s*$")
        j = i + 1
        while j < len(lines) and not close.match(lines[j]):
            j += 1
        body = lines[i + 1:j]
        if info.startswith("{") and not info.startswith(("{code", "{literal")):
            # A directive: its blocks (in the innermost directive's box).
            blocks += code_blocks("\n".join(body), info.split()[0])
        else:
            blocks.append((info, body, inside))
        i = j + 1
    return blocks


def _prose(path: Path) -> list[str]:
    if path.suffix == ".md":
        return [path.read_text(encoding="utf-8")]
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    return ["".join(c["source"]) for c in cells if c["cell_type"] == "markdown"]


def test_code_blocks_of_the_prose_fit_their_box():
    """Every fenced code block of the book's Markdown (pages and notebooks) keeps its lines to
    79 characters (75 in an admonition): a longer line scrolls sideways inside its box."""
    pages = sorted((ROOT / "book").rglob("*.md")) + sorted((ROOT / "book").rglob("*.ipynb"))
    pages = [p for p in pages if ".ipynb_checkpoints" not in p.parts]
    long = [f"{p.relative_to(ROOT)}: {len(line)} characters in {inside or 'the page'}: "
            f"{line.strip()[:50]!r}"
            for p in pages for text in _prose(p) for _, body, inside in code_blocks(text)
            for line in body
            if len(line) > (ADMONITION_CODE_COLUMNS if inside in ADMONITIONS
                            else PROSE_CODE_COLUMNS)]
    assert len(pages) > 20, pages
    assert not long, "code blocks wider than their box (reformat, e.g. ruff format " \
        f"--line-length {PROSE_CODE_COLUMNS}):\n" + "\n".join(long)


def test_code_blocks_are_found_inside_directives():
    text = "\n".join(["````{solution} ex-1", ":class: dropdown", "", "```python", "x = 1",
                      "```", "", "text", "````", "```bash", "make book", "```"])
    assert code_blocks(text) == [("python", ["x = 1"], "{solution}"),
                                 ("bash", ["make book"], "")]


# What the book's column shows of a code cell at 1280 px without scrolling (the browser test
# measures it); `ruff format` keeps code to 88 but cannot break a long string or comment.
CODE_CELL_COLUMNS = 89


def test_code_cells_fit_the_column():
    """No line of a notebook's code cell is longer than the column: a string or comment that
    `ruff format` could not break is split by hand."""
    notebooks = [p for p in sorted((ROOT / "book").rglob("*.ipynb"))
                 if ".ipynb_checkpoints" not in p.parts]
    long = [f"{p.relative_to(ROOT)}: {len(line)} characters: {line.strip()[:50]!r}"
            for p in notebooks
            for cell in json.loads(p.read_text(encoding="utf-8"))["cells"]
            if cell["cell_type"] == "code"
            for line in "".join(cell["source"]).splitlines() if len(line) > CODE_CELL_COLUMNS]
    assert len(notebooks) > 20, notebooks
    assert not long, "code lines wider than the column:\n" + "\n".join(long)
