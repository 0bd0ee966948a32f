"""Guard: the prose takes its measured numbers from the outputs beside it.

A chapter's Markdown quotes a number that a cell measured through myst-nb's glue
(`glue("key", value, display=False)` in the cell, {glue:text}`key` in the text), so the
sentence and the output cannot disagree: nbval checks the glued value with the rest of the
cell's outputs. These tests check that

- every key that the prose pastes is glued by a cell of the same notebook, and every glued key
  is pasted somewhere (a glued value that no sentence uses is a number nobody reads);
- glued values are stored hidden (`display=False`): the cell's visible output is what it prints;
- the book pastes at least 40 measured numbers;
- no chapter types by hand a number that its own outputs printed: a decimal, a percentage or a
  number of three or more digits in the prose that appears among the notebook's printed outputs
  and nowhere in its code (where it would be a setting, such as `steps=300`, not a result);
- no pasted number reads wrongly once formatted: a glued value that is not zero never prints as
  zero ("a test error of 0.0", then "ten times that"), and the two ends of a pasted range never
  print the same ("lowest seed 78%, highest 78%" for 0.776 and 0.782): the format keeps too few
  digits for the sentence to say what the cell measured.
"""

from __future__ import annotations

import json
import re
from decimal import Decimal
from pathlib import Path

import pytest
from myst_nb.core.variables import format_plain_text
from notebooks import BOOK

CHAPTERS = sorted(BOOK.glob("[0-9][0-9]_*.ipynb"))
IDS = [p.stem for p in CHAPTERS]
GLUE_PREFIX = "application/papermill.record/"
MIN_GLUED = 40

# {glue}`key`, {glue:}`key`, {glue:any}`key`, {glue:text}`key:fmt`, {glue:md}`key:fmt`
ROLE = re.compile(r"\{glue(?::(?:any|text|md)?)?\}`([^`]+)`")
# ```{glue:figure} key  /  :::{glue} key  (directive forms)
DIRECTIVE = re.compile(r"^\s*(?:`{3,}|:{3,})\{glue(?::\w*)?\}\s+(\S+)", re.MULTILINE)
# One paste with where it sits: {glue:text}`key:fmt` (the format is optional)
PASTE = re.compile(r"\{glue(?P<kind>:(?:any|text|md)?)?\}`(?P<body>[^`]+)`")
# What joins the two ends of a range: "X to Y", "X-Y", "X–Y", "between X and Y", "from X through
# Y", "lowest X, highest Y" (markup and punctuation around them aside)
RANGE_GAP = re.compile(
    r"^[\s*_,;:()%]*(?:to|and|through|up to|-|–|—|\.\.|,?\s*(?:the\s+)?highest(?:\s+\w+)?)"
    r"[\s*_,;:()]*$"
)
NUMBER = re.compile(r"(?<![\w.])(\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+\.\d+|\d+)(%?)(?![\w])")


def _cells(path: Path) -> list[dict]:
    return json.loads(path.read_text(encoding="utf-8"))["cells"]


def _source(cell: dict) -> str:
    return "".join(cell["source"])


def _pasted_keys(text: str) -> list[str]:
    keys = []
    for match in ROLE.finditer(text):
        key = match.group(1)
        if "::" in key:  # pasted from another notebook: checked by the book build
            continue
        # a format spec follows the last colon and ends in a type character
        if re.search(r":[^:]*[bcdoxXeEfFgGn%s]$", key):
            key = key.rsplit(":", 1)[0]
        keys.append(key)
    keys += [m.group(1) for m in DIRECTIVE.finditer(text)]
    return keys


def _glued(path: Path) -> dict[str, dict]:
    """Every glue output of the notebook: key -> the output."""
    glued = {}
    for cell in _cells(path):
        for output in cell.get("outputs", []):
            meta = output.get("metadata", {}).get("scrapbook")
            if meta is not None:
                glued[meta["name"]] = output
    return glued


def _prose(path: Path) -> str:
    return "\n".join(_source(c) for c in _cells(path) if c["cell_type"] == "markdown")


@pytest.mark.parametrize("path", CHAPTERS, ids=IDS)
def test_every_pasted_key_is_glued_and_every_glued_key_pasted(path):
    glued = _glued(path)
    pasted = set(_pasted_keys(_prose(path)))
    missing = sorted(pasted - set(glued))
    unused = sorted(set(glued) - pasted)
    assert not missing, f"the prose pastes keys that no cell glues: {missing}"
    assert not unused, f"cells glue keys that no sentence pastes: {unused}"


@pytest.mark.parametrize("path", CHAPTERS, ids=IDS)
def test_no_key_is_glued_twice(path):
    """myst-nb warns on a key glued twice in one notebook (the book's build allows no warning),
    and the prose would paste whichever value came last."""
    names = [output["metadata"]["scrapbook"]["name"] for cell in _cells(path)
             for output in cell.get("outputs", [])
             if output.get("metadata", {}).get("scrapbook") is not None]
    twice = sorted({n for n in names if names.count(n) > 1})
    assert not twice, f"keys glued more than once: {twice}"


@pytest.mark.parametrize("path", CHAPTERS, ids=IDS)
def test_glued_values_are_hidden(path):
    shown = [
        key
        for key, out in _glued(path).items()
        if out["metadata"]["scrapbook"].get("mime_prefix") != GLUE_PREFIX
    ]
    assert not shown, (
        f"glue these keys hidden (utils.glue.glue), so that the cell shows what it prints: {shown}"
    )


def test_the_book_pastes_enough_measured_numbers():
    counts = {p.stem: len(_pasted_keys(_prose(p))) for p in CHAPTERS}
    total = sum(counts.values())
    assert total >= MIN_GLUED, (
        f"the prose pastes {total} glued values (at least {MIN_GLUED} expected): {counts}"
    )


def _drop_code_blocks(text: str) -> str:
    """Drop fenced code and directives' option lines; keep directives' bodies (prose)."""
    kept: list[str] = []
    directives: list[str] = []  # the fences of the directives we are in
    code = None  # the fence of the code block we are in
    for line in text.splitlines():
        stripped = line.strip()
        fence = re.match(r"(`{3,}|~{3,}|:{3,})(.*)$", stripped)
        if code is not None:
            if fence and fence.group(1)[0] == code[0] and len(fence.group(1)) >= len(code):
                if not fence.group(2).strip():
                    code = None
            continue
        if fence:
            marks, info = fence.group(1), fence.group(2).strip()
            if info.startswith("{"):  # a directive opens: its body is prose
                directives.append(marks)
            elif not info and directives and marks == directives[-1]:
                directives.pop()  # the directive closes
            else:
                code = marks  # a code block opens
            continue
        if re.match(r":[\w-]+:", stripped):  # a directive's option (:label:, :class:)
            continue
        kept.append(line)
    return "\n".join(kept)


def _strip_non_prose(text: str) -> str:
    """The Markdown without what is not a sentence's own number."""
    text = _drop_code_blocks(text)
    text = re.sub(r"\$\$.*?\$\$", " ", text, flags=re.DOTALL)  # display math
    text = re.sub(r"\$[^$\n]+\$", " ", text)  # inline math
    text = re.sub(r"\{[\w:-]+\}`[^`]*`", " ", text)  # roles: glue, cite, numref, ...
    text = re.sub(r"`[^`]*`", " ", text)  # inline code
    text = re.sub(r"\]\([^)]*\)", "]", text)  # link targets
    text = re.sub(r"https?://\S+", " ", text)
    return text


def _numbers(text: str) -> set[str]:
    """Decimals, percentages and numbers of three or more digits, commas removed."""
    found = set()
    for match in NUMBER.finditer(text):
        digits, percent = match.group(1).replace(",", ""), match.group(2)
        if "." in digits or percent or len(digits) >= 3:
            value = Decimal(digits)
            found.add(_canonical(value))
            if percent:  # 90.6% is also the 0.906 that a cell may print
                found.add(_canonical(value / 100))
    return found


def _canonical(value: Decimal) -> str:
    return format(value.normalize(), "f")


def _output_text(cell: dict) -> str:
    parts = []
    for output in cell.get("outputs", []):
        if "text" in output:
            parts.append("".join(output["text"]))
        for mime, value in output.get("data", {}).items():
            if mime.endswith("text/plain"):
                parts.append("".join(value))
    return "\n".join(parts)


@pytest.mark.parametrize("path", CHAPTERS, ids=IDS)
def test_no_measured_number_is_typed_by_hand(path):
    cells = _cells(path)
    code = [c for c in cells if c["cell_type"] == "code"]
    printed = _numbers("\n".join(_output_text(c) for c in code))
    set_in_code = _numbers("\n".join(_source(c) for c in code))
    years = {str(y) for y in range(1900, 2100)}  # the years of citations
    typed = _numbers(_strip_non_prose(_prose(path))) & printed - set_in_code - years
    assert not typed, (
        f"the prose types numbers that the outputs printed; glue them instead: {sorted(typed)}"
    )


def _pastes(text: str) -> list[tuple[str, str, int, int]]:
    """Each paste of a glued value in ``text``: (key, format spec, start, end), in order."""
    found = []
    for match in PASTE.finditer(text):
        body = match.group("body")
        if "::" in body:  # pasted from another notebook
            continue
        key, fmt = body, ""
        if match.group("kind") in (":text", ":md") or re.search(r":[^:]*[bcdoxXeEfFgGn%s]$", body):
            key, _, fmt = body.rpartition(":") if ":" in body else ("", "", "")
            if not key:
                key, fmt = body, "s"
        found.append((key, fmt, match.start(), match.end()))
    return found


def _rendered(output: dict, fmt: str) -> str:
    """The text the book shows for a glued output pasted with the format ``fmt``."""
    return format_plain_text(output["data"][GLUE_PREFIX + "text/plain"], fmt)


def _as_number(text: str) -> Decimal | None:
    try:
        return Decimal(text.strip().rstrip("%").replace(",", ""))
    except ArithmeticError:
        return None


@pytest.mark.parametrize("path", CHAPTERS, ids=IDS)
def test_no_pasted_number_reads_as_zero_or_as_an_empty_range(path):
    glued = _glued(path)
    zeros, empty_ranges = [], []
    for cell in _cells(path):
        if cell["cell_type"] != "markdown":
            continue
        text = _source(cell)
        pastes = [p for p in _pastes(text) if p[0] in glued]
        for key, fmt, _, _ in pastes:
            shown = _rendered(glued[key], fmt)
            raw = glued[key]["data"][GLUE_PREFIX + "text/plain"]
            number = _as_number(shown)
            is_float = re.fullmatch(r"-?\d+(?:\.\d*)?(?:e-?\d+)?", raw) and not raw.isdigit()
            if is_float and number is not None and number == 0:
                zeros.append(f"{key} = {raw} shows as {shown!r}")
        for (k1, f1, _, end), (k2, f2, start, _) in zip(pastes, pastes[1:], strict=False):
            if not RANGE_GAP.match(text[end:start]):
                continue
            low, high = _rendered(glued[k1], f1), _rendered(glued[k2], f2)
            if _as_number(low) is not None and low == high:
                empty_ranges.append(f"{k1} and {k2} both show as {low!r}: {text[end:start]!r}")
    assert not zeros, (
        "glued floats that read as zero: paste them with more digits (or glue the int 0 where "
        f"a count is truly none): {zeros}"
    )
    assert not empty_ranges, (
        f"a pasted range whose ends read the same: paste them with more digits: {empty_ranges}"
    )


@pytest.mark.parametrize(
    ("markdown", "values", "problem"),
    [
        ("an error of {glue:text}`e:.1f`, ten times lower", {"e": 0.04}, "zero"),
        ("an error of {glue:text}`e:.2f`, ten times lower", {"e": 0.04}, None),
        ("an error of {glue:text}`e:.1f`", {"e": 0.0}, "zero"),
        ("{glue:text}`n` rows differ", {"n": 0}, None),
        ("from {glue:text}`lo:.0%` to {glue:text}`hi:.0%`", {"lo": 0.776, "hi": 0.782}, "range"),
        ("lowest seed {glue:text}`lo:.0%`, highest {glue:text}`hi:.0%`",
         {"lo": 0.776, "hi": 0.782}, "range"),
        ("**{glue:text}`lo:.0%`**–**{glue:text}`hi:.0%`**", {"lo": 0.776, "hi": 0.782}, "range"),
        ("from {glue:text}`lo:.1%` to {glue:text}`hi:.1%`", {"lo": 0.776, "hi": 0.782}, None),
        ("{glue:text}`lo:.0%` of heads and {glue:text}`hi:.0%` of layers, seen",
         {"lo": 0.5, "hi": 0.3}, None),
        ("{glue:text}`n` layers, then {glue:text}`m` heads", {"n": 2, "m": 2}, None),
    ],
)
def test_the_pasted_number_check_catches_what_reads_wrongly(tmp_path, markdown, values, problem):
    """The check above, on made-up chapters: it fails exactly where a sentence reads wrongly."""
    from utils.glue import glue_bundle

    outputs = []
    for key, value in values.items():
        data, metadata = glue_bundle(key, value)
        outputs.append({"output_type": "display_data", "data": data, "metadata": metadata})
    notebook = {
        "cells": [
            {"cell_type": "code", "source": "", "outputs": outputs, "metadata": {}},
            {"cell_type": "markdown", "source": markdown, "metadata": {}},
        ]
    }
    path = tmp_path / "99_made_up.ipynb"
    path.write_text(json.dumps(notebook), encoding="utf-8")
    if problem is None:
        test_no_pasted_number_reads_as_zero_or_as_an_empty_range(path)
    else:
        with pytest.raises(AssertionError, match=problem):
            test_no_pasted_number_reads_as_zero_or_as_an_empty_range(path)
