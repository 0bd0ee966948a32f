"""Page-level checks of the PDF (tests/test_pdf.py): the text block's height, how full each page
is, the bibliography's contents line and the characters of the sources. Each check is a function
of what poppler's tools printed, so that test_checks_catch_a_broken_pdf can feed it broken input.
"""

from __future__ import annotations

import json
import re
import unicodedata
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

# How far a line may reach below the text block's last line, in points: a subscript of a
# formula on the last line reaches 5 pt below, a long table's "continues on next page" 7 pt; a
# code line run past the page's end lies a whole line (11 pt) below, in the 22 pt gap before the
# footer.
VERTICAL_TOLERANCE = 8.0
# Lines that lie within this distance of the running head's or the footer's line are them.
BAND = 0.5
# A page whose content ends above this fraction of the text block's height is near-empty; it
# is allowed only as the last page of a chapter (or of the contents, or of the introduction).
MIN_FILL = 0.5
INK = 200  # a pixel of a grey rendering darker than this is ink


@dataclass(frozen=True)
class Box:
    """A line of `pdftotext -bbox-layout`: its page, its vertical extent and its text."""

    page: int
    y_min: float
    y_max: float
    text: str


@dataclass(frozen=True)
class Geometry:
    head: float  # top of the running head's line
    top: float  # top of the text block's first line
    bottom: float  # bottom of the text block's last line
    foot: float  # top of the footer's line (page number, chapter or section)


def geometry(boxes: list[Box]) -> Geometry:
    """The running head, text block and footer, as most pages have them: the head is most pages'
    first line, the footer their last, the text block what lies between on full pages."""
    pages: dict[int, list[Box]] = {}
    for box in boxes:
        pages.setdefault(box.page, []).append(box)
    firsts = Counter(round(min(b.y_min for b in bs), 1) for bs in pages.values())
    lasts = Counter(round(max(b.y_min for b in bs), 1) for bs in pages.values())
    head, foot = firsts.most_common(1)[0][0], lasts.most_common(1)[0][0]
    tops, bottoms = Counter(), Counter()
    for bs in pages.values():
        body = [b for b in bs if abs(b.y_min - head) > BAND and abs(b.y_min - foot) > BAND]
        if body:
            tops[round(min(b.y_min for b in body), 1)] += 1
            bottoms[round(max(b.y_max for b in body), 1)] += 1
    return Geometry(head, tops.most_common(1)[0][0], bottoms.most_common(1)[0][0], foot)


def outside_text_block(
    boxes: list[Box], g: Geometry, tolerance: float = VERTICAL_TOLERANCE
) -> list[str]:
    """Lines above or below the text block that are not the running head or the footer: code
    run under the footer or off the page. (A block that runs past the page's end always has a
    line between the text block and the footer, which is wider than a line.)"""
    found = []
    for b in boxes:
        if abs(b.y_min - g.head) <= BAND or abs(b.y_min - g.foot) <= BAND:
            continue
        if b.y_max > g.bottom + tolerance or b.y_min < g.top - tolerance:
            where = "under the text block" if b.y_max > g.bottom + tolerance else "above it"
            found.append(
                f"page {b.page}: {b.text[:60]!r} at y = {b.y_min:.1f} to {b.y_max:.1f}, "
                f"{where} (text block {g.top:.1f} to {g.bottom:.1f}, footer at "
                f"{g.foot:.1f})"
            )
    return found


def pgm_pixels(data: bytes) -> tuple[int, int, bytes]:
    m = re.match(rb"P5\s+(\d+)\s+(\d+)\s+(\d+)\s", data)
    if not m:
        raise ValueError("not a binary PGM")
    width, height = int(m.group(1)), int(m.group(2))
    return width, height, data[m.end() : m.end() + width * height]


def fill(data: bytes, page_height: float, g: Geometry, text_bottom: float = 0.0) -> float:
    """How far down the text block a page has content: 0 for none, 1 for all of it. The lowest of
    its text lines (`text_bottom`, from pdftotext: a small font is too light to count as ink at
    a low resolution) and of its ink in a grey rendering (PGM: figures count, the running head
    and the footer do not)."""
    width, height, pixels = pgm_pixels(data)
    scale = height / page_height
    top, bottom = int(g.top * scale), min(height - 1, int(g.bottom * scale))
    inked = [
        y
        for y in range(top, bottom + 1)
        if any(p < INK for p in pixels[y * width : (y + 1) * width])
    ]
    ink = (inked[-1] - top + 1) / (bottom - top + 1) if inked else 0.0
    text = (text_bottom - g.top) / (g.bottom - g.top) if text_bottom > g.top else 0.0
    return max(ink, min(1.0, text))


def text_bottoms(boxes: list[Box], g: Geometry) -> dict[int, float]:
    """The bottom of each page's lowest line of the text block (not the footer)."""
    bottoms: dict[int, float] = {}
    for b in boxes:
        if abs(b.y_min - g.head) > BAND and abs(b.y_min - g.foot) > BAND:
            bottoms[b.page] = max(bottoms.get(b.page, 0.0), b.y_max)
    return bottoms


def near_empty_pages(
    fills: dict[int, float], has_head: dict[int, bool], minimum: float = MIN_FILL
) -> list[str]:
    """Pages filled less than `minimum` whose chapter goes on: the next page has content and a
    running head. A chapter's (or a part's) first page has no running head, and LaTeX leaves a
    page blank only before a chapter or part, so the last page of a chapter is never counted."""
    found = []
    for page, f in sorted(fills.items()):
        after = page + 1
        if 0 < f < minimum and fills.get(after, 0) > 0 and has_head.get(after):
            found.append(
                f"page {page}: its content ends {100 * f:.0f}% down the text block, "
                f"and page {after} goes on with the same chapter"
            )
    return found


def bibliography_lines(contents: list[str]) -> list[str]:
    """Lines of the table of contents that list a bibliography: "Bibliography 489"."""
    return [
        line.strip()
        for line in contents
        if re.match(r"^\s*(?:[\d.]+\s+)?(?:Bibliography|References)(?: ?\.)*\s+\d+\s*$", line)
    ]


def source_texts(path: Path) -> list[str]:
    """What a page prints: a Markdown page's text; a notebook's cells and text outputs (the
    plain text of a rich output only when it has no image or HTML to show instead)."""
    if path.suffix != ".ipynb":
        return [path.read_text(encoding="utf-8")]
    texts = []
    for cell in json.loads(path.read_text(encoding="utf-8"))["cells"]:
        texts.append("".join(cell["source"]))
        for output in cell.get("outputs", []):
            if "text" in output:
                texts.append("".join(output["text"]))
            data = output.get("data", {})
            if "text/plain" in data and not any(
                k.startswith("image/") or k == "text/html" for k in data
            ):
                texts.append("".join(data["text/plain"]))
    return texts


def invisible(ch: str) -> bool:
    """White space, control and format characters (the joiner of emoji sequences, U+200D) and
    variation selectors (U+FE0F): nothing to print, so nothing for pdftotext to read back."""
    return (
        ch.isspace()
        or unicodedata.category(ch) in ("Cc", "Cf")
        or 0xFE00 <= ord(ch) <= 0xFE0F
        or 0xE0100 <= ord(ch) <= 0xE01EF
    )


def characters_not_typeset(sources: dict[str, list[str]], pdf_text: str) -> list[str]:
    """Every visible character of the sources that the PDF's text does not contain, with the
    pages it comes from."""
    where: dict[str, set[str]] = {}
    for name, texts in sources.items():
        for text in texts:
            for ch in set(text):
                where.setdefault(ch, set()).add(name)
    typeset = set(pdf_text)
    return [
        f"U+{ord(ch):04X} {ch!r} ({unicodedata.name(ch, '?')}), from "
        f"{', '.join(sorted(where[ch])[:3])}"
        for ch in sorted(where)
        if ch not in typeset and not invisible(ch)
    ]


def line_boxes(xhtml: str) -> tuple[list[Box], dict[int, float]]:
    """The lines of `pdftotext -bbox-layout` with their vertical extent, and each page's
    height."""
    ns = "{http://www.w3.org/1999/xhtml}"
    boxes, heights = [], {}
    for number, page in enumerate(ET.fromstring(xhtml).iter(f"{ns}page"), start=1):
        heights[number] = float(page.get("height"))
        for line in page.iter(f"{ns}line"):
            text = " ".join(w.text or "" for w in line.iter(f"{ns}word"))
            boxes.append(Box(number, float(line.get("yMin")), float(line.get("yMax")), text))
    return boxes, heights


def running_heads(boxes: list[Box], g: Geometry) -> set[int]:
    """The pages that carry a running head (a chapter's or part's first page does not)."""
    return {b.page for b in boxes if abs(b.y_min - g.head) <= BAND}
