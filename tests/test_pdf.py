"""The book as one PDF (`make pdf`), read back with poppler's tools.

`make pdf` builds ``_build/pdf/the-tested-transformer.pdf`` through LaTeX and then runs this file;
the test builds nothing itself, and fails with "run make pdf" when the PDF is missing. It reads
the PDF with ``pdftotext`` (the text, and with ``-bbox-layout`` every word's box), ``pdfimages``
and ``pdftoppm`` (Debian's poppler-utils, installed by ``make pdf-deps``) and checks:

- every page of _toc.yml is in the table of contents under its title (the notebook's or page's
  first ``#`` heading), in the toc's order, the chapters of numbered parts with the number the HTML
  book gives them ("3  Multi-head attention  45"), the others with none;
- no "??" (LaTeX's unresolved reference), no "[?]" (unresolved citation), no MyST role left as
  text; the bibliography lists every entry of references.bib; formulas are typeset;
- every figure is embedded: each PNG output of the notebooks' code cells is in the PDF at its own
  size in pixels (``pdfimages -list``), and every page with text or an image renders with ink
  (``pdftoppm``);
- no word runs past the margins of the text block (found from the body text's justified lines),
  and no line runs below it, under the footer or off the page (code that LaTeX could not break);
- no page is left near-empty (its content ending above half the text block) before its chapter
  ends, as a table that cannot break across pages leaves one;
- the contents list one bibliography;
- every character of the sources (Markdown pages, notebook cells and their text outputs) is in
  the PDF's text: the fonts have them all (chapter 15's Japanese, Korean and emoji come from
  Droid Sans Fallback and Symbola, in black and white), and only invisible characters (the
  joiner of emoji sequences, variation selectors) are exempt.

``test_checks_catch_a_broken_pdf`` feeds the same checks small inputs that break every rule, to
prove that they can fail.
"""

from __future__ import annotations

import base64
import json
import re
import shutil
import struct
import subprocess
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from pdf_pages import (
    Box,
    Geometry,
    bibliography_lines,
    characters_not_typeset,
    fill,
    geometry,
    line_boxes,
    near_empty_pages,
    outside_text_block,
    running_heads,
    source_texts,
    text_bottoms,
)

from conftest import ROOT

pytestmark = pytest.mark.pdf

PDF = ROOT / "_build" / "pdf" / "the-tested-transformer.pdf"
TOOLS = ("pdftotext", "pdfimages", "pdftoppm", "pdfinfo")
# How far a word may reach past the text block, in PDF points (1/72 in). Justified lines end on
# the edge to within 0.01 pt; a word that LaTeX could not break sticks out by several points.
MARGIN_TOLERANCE = 1.0
# Lines that count for finding the text block: justified body lines have many words.
BODY_LINE_WORDS = 8
# MyST roles that would be left as text if a role were not rendered.
ROLE_RE = re.compile(r"\{(cite|ref|numref|eq|term|doc|download|prf:ref)(:[a-z]+)?\}`")
# An entry of the bibliography starts a line with its author-year label: "[Vaswani et al., 2017]".
BIBLIOGRAPHY_ENTRY_RE = re.compile(
    r"^\s{0,2}\[([A-Z][^\[\]\n]*?, (?:\d{4}|n\.d\.)[a-z]?)\] \S", re.MULTILINE
)
# A line of the table of contents: an entry, dot leaders, a page number.
TOC_LINE = re.compile(r"(?:\. ){8,}\.?\s*[\dxvi]+\s*$", re.M)
MATH_ALPHANUMERICS = re.compile("[\U0001d400-\U0001d7ff]")


# ---------------------------------------------------------------------------------------------
# What the book should contain, from _toc.yml and the sources.


@dataclass(frozen=True)
class Entry:
    """A page of _toc.yml as the PDF's table of contents should list it."""

    file: str
    title: str
    number: int | None  # the chapter number, None for an unnumbered chapter or a section
    section: bool = False  # a section of a chapter (the assignments), not a chapter


def _source(file: str) -> Path:
    for suffix in (".ipynb", ".md"):
        path = ROOT / (file + suffix)
        if path.is_file():
            return path
    raise FileNotFoundError(f"{file} of _toc.yml has no .ipynb or .md source")


def first_heading(path: Path) -> str:
    """The page's title: its first `# ` heading, as plain text, without a leading "3. "."""
    if path.suffix == ".ipynb":
        nb = json.loads(path.read_text(encoding="utf-8"))
        text = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
    else:
        text = path.read_text(encoding="utf-8")
    for line in text.splitlines():
        if line.startswith("# "):
            title = re.sub(r"^\d+\.\s+", "", line[2:].strip())
            return normalize(re.sub(r"[`*]", "", title))
    raise ValueError(f"{path} has no '# ' heading")


def toc_entries(toc: dict) -> list[Entry]:
    """Every page of _toc.yml but the root, in order; chapters of numbered parts numbered from 1
    across parts, as sphinx-multitoc-numbering numbers them in the HTML book."""
    entries, number = [], 0
    for part in toc["parts"]:
        for chapter in part["chapters"]:
            if part.get("numbered"):
                number += 1
            title = first_heading(_source(chapter["file"]))
            entries.append(Entry(chapter["file"], title, number if part.get("numbered") else None))
            for section in chapter.get("sections", []):
                title = first_heading(_source(section["file"]))
                entries.append(Entry(section["file"], title, None, section=True))
    return entries


def notebook_png_sizes(files: list[str]) -> Counter:
    """(width, height) in pixels of every PNG output of the code cells of these pages."""
    sizes: Counter = Counter()
    for file in files:
        path = _source(file)
        if path.suffix != ".ipynb":
            continue
        nb = json.loads(path.read_text(encoding="utf-8"))
        for cell in nb["cells"]:
            if cell["cell_type"] != "code":
                continue
            for output in cell.get("outputs", []):
                png = output.get("data", {}).get("image/png")
                if png:
                    data = base64.b64decode("".join(png) if isinstance(png, list) else png)
                    sizes[png_size(data)] += 1
    return sizes


def png_size(data: bytes) -> tuple[int, int]:
    """Width and height from a PNG's IHDR chunk."""
    if data[:8] != b"\x89PNG\r\n\x1a\n" or data[12:16] != b"IHDR":
        raise ValueError("not a PNG")
    return struct.unpack(">II", data[16:24])


def bibliography_size(bib: Path) -> int:
    entries = re.findall(r"^@(\w+)\s*\{", bib.read_text(encoding="utf-8"), re.MULTILINE)
    return sum(1 for kind in entries if kind.lower() not in ("comment", "string", "preamble"))


# ---------------------------------------------------------------------------------------------
# The checks, each a function of what poppler's tools printed, so that the last test can feed
# them broken input.


def normalize(text: str) -> str:
    """Typographic quotes and dashes as ASCII, white space collapsed."""
    table = str.maketrans({"’": "'", "‘": "'", "“": '"', "”": '"', "‐": "-", "‑": "-"})
    return re.sub(r"\s+", " ", text.translate(table)).strip()


def toc_problems(lines: list[str], entries: list[Entry]) -> list[str]:
    """Entries missing from the table of contents, numbered wrongly, or out of order.

    A contents line is the title, then the page number: "3 Multi-head attention .... 45"; a
    numbered chapter has its number first, an unnumbered one nothing."""
    lines = [normalize(line) for line in lines]
    problems, last = [], -1
    for entry in entries:
        title = re.escape(entry.title)
        if entry.section:
            pattern = rf"^(?:[\d.]+ )?{title}(?: ?\.)* \d+$"
        elif entry.number is None:
            pattern = rf"^{title} \d+$"
        else:
            pattern = rf"^{entry.number} {title} \d+$"
        found = [i for i, line in enumerate(lines) if re.match(pattern, line)]
        if not found:
            loose = [line for line in lines if re.search(rf"(^|\s){title} \d+$", line)]
            why = f" (listed as {loose[0]!r})" if loose else ""
            want = f"{entry.number} " if entry.number is not None else ""
            problems.append(f"{entry.file}: no contents line '{want}{entry.title} <page>'{why}")
            continue
        after = [i for i in found if i > last]
        if not after:
            problems.append(f"{entry.file}: '{entry.title}' is listed out of _toc.yml's order")
            continue
        last = after[0]
    return problems


def bibliography_labels(text: str) -> set[str]:
    """The distinct author-year labels that start a line, as the bibliography's entries do."""
    return {m.group(1) for m in BIBLIOGRAPHY_ENTRY_RE.finditer(text)}


def unresolved_markers(text: str) -> list[str]:
    """ "??", "[?]" and MyST roles left as text, each with a little context."""
    found = []
    for pattern in (re.escape("??"), re.escape("[?]"), ROLE_RE.pattern):
        for m in re.finditer(pattern, text):
            context = text[max(0, m.start() - 50) : m.end() + 30].replace("\n", " ")
            found.append(f"{m.group(0)!r} in ...{context}...")
    return found


@dataclass(frozen=True)
class Word:
    page: int
    x_min: float
    x_max: float
    text: str


@dataclass(frozen=True)
class Line:
    page: int
    x_min: float
    x_max: float
    words: tuple[Word, ...]


def bbox_lines(xhtml: str) -> list[Line]:
    """The lines of `pdftotext -bbox-layout`, each with its words and their x extent."""
    ns = {"h": "http://www.w3.org/1999/xhtml"}
    root = ET.fromstring(xhtml)
    lines = []
    for number, page in enumerate(root.iter(f"{{{ns['h']}}}page"), start=1):
        for line in page.iter(f"{{{ns['h']}}}line"):
            words = tuple(
                Word(number, float(w.get("xMin")), float(w.get("xMax")), w.text or "")
                for w in line.iter(f"{{{ns['h']}}}word")
            )
            lines.append(Line(number, float(line.get("xMin")), float(line.get("xMax")), words))
    return lines


def text_block(lines: list[Line]) -> tuple[float, float]:
    """Left and right edge of the text block: where most long (justified) lines start and end."""
    body = [line for line in lines if len(line.words) >= BODY_LINE_WORDS]
    if not body:
        raise ValueError("no body text to find the margins from")
    left = Counter(round(line.x_min, 1) for line in body).most_common(1)[0][0]
    right = Counter(round(line.x_max, 1) for line in body).most_common(1)[0][0]
    return left, right


def words_past_margin(lines: list[Line], left: float, right: float,
                      tolerance: float = MARGIN_TOLERANCE) -> list[str]:
    return [
        f"page {w.page}: {w.text!r} spans x = {w.x_min:.1f} to {w.x_max:.1f} "
        f"(text block {left:.1f} to {right:.1f})"
        for line in lines
        for w in line.words
        if w.x_max > right + tolerance or w.x_min < left - tolerance
    ]


def pdf_image_sizes(listing: str) -> Counter:
    """(width, height) of every image (not its soft mask) in `pdfimages -list`'s table."""
    sizes: Counter = Counter()
    for row in listing.splitlines()[2:]:
        cols = row.split()
        if len(cols) > 4 and cols[2] == "image":
            sizes[(int(cols[3]), int(cols[4]))] += 1
    return sizes


def missing_images(expected: Counter, found: Counter) -> list[str]:
    return [
        f"{n} figure(s) of {w} x {h} px missing (the notebooks have {expected[(w, h)]}, "
        f"the PDF {found[(w, h)]})"
        for (w, h), n in (expected - found).items()
    ]


def pgm_ink(data: bytes) -> int:
    """How many pixels of a binary greyscale PGM (pdftoppm -gray) are not near white."""
    m = re.match(rb"P5\s+(\d+)\s+(\d+)\s+(\d+)\s", data)
    if not m:
        raise ValueError("not a binary PGM")
    width, height = int(m.group(1)), int(m.group(2))
    pixels = data[m.end() : m.end() + width * height]
    return sum(1 for p in pixels if p < 200)


def blank_pages(ink: dict[int, int], pages_with_content: set[int]) -> list[int]:
    return sorted(p for p in pages_with_content if ink.get(p, 0) == 0)


# ---------------------------------------------------------------------------------------------
# Reading the PDF once.


def _run(*args: str) -> str:
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(args)} failed:\n{proc.stderr[-2000:]}"
    return proc.stdout


@pytest.fixture(scope="module")
def pdf() -> Path:
    if not PDF.is_file():
        pytest.fail(f"{PDF.relative_to(ROOT)} is missing: run make pdf", pytrace=False)
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        pytest.fail(f"{', '.join(missing)} not found: run make pdf (it installs Debian's "
                    "poppler-utils)", pytrace=False)
    return PDF


@pytest.fixture(scope="module")
def pages(pdf) -> list[str]:
    """The text of every page, laid out as printed."""
    return _run("pdftotext", "-layout", "-enc", "UTF-8", str(pdf), "-").split("\f")[:-1]


@pytest.fixture(scope="module")
def bbox(pdf) -> str:
    return _run("pdftotext", "-bbox-layout", "-enc", "UTF-8", str(pdf), "-")


@pytest.fixture(scope="module")
def lines(bbox) -> list[Line]:
    return bbox_lines(bbox)


@pytest.fixture(scope="module")
def boxes(bbox) -> tuple[list[Box], dict[int, float]]:
    return line_boxes(bbox)


@pytest.fixture(scope="module")
def rendered(pdf, tmp_path_factory) -> dict[int, bytes]:
    """Every page rendered in grey at 12 dpi (PGM), by page number."""
    out = tmp_path_factory.mktemp("pages")
    proc = subprocess.run(["pdftoppm", "-gray", "-r", "12", str(pdf), str(out / "p")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and not proc.stderr.strip(), f"pdftoppm: {proc.stderr[-2000:]}"
    return {int(path.stem.split("-")[-1]): path.read_bytes() for path in out.glob("p-*.pgm")}


@pytest.fixture(scope="module")
def toc() -> dict:
    return yaml.safe_load((ROOT / "_toc.yml").read_text(encoding="utf-8"))


# ---------------------------------------------------------------------------------------------
# The tests.


def test_every_page_of_the_toc_is_in_the_contents(pages, toc):
    entries = toc_entries(toc)
    problems = toc_problems("\n".join(pages).splitlines(), entries)
    assert not problems, "the table of contents does not match _toc.yml:\n" + "\n".join(problems)
    root_title = first_heading(_source(toc["root"]))
    assert root_title in normalize(pages[0]), f"the title page does not say {root_title!r}"


def test_chapters_are_numbered_as_in_the_html_book(pages, toc):
    numbered = [e for e in toc_entries(toc) if e.number is not None]
    assert numbered, "no part of _toc.yml is numbered"
    # Running heads of a numbered chapter's pages: "Chapter 3. Multi-head attention".
    text = normalize("\n".join(pages))
    missing = [f"Chapter {e.number}. {e.title}" for e in numbered
               if f"Chapter {e.number}. {e.title}" not in text]
    assert not missing, "no page carries the running head " + ", ".join(map(repr, missing))


def test_no_unresolved_reference_or_citation(pages):
    found = unresolved_markers("\n".join(pages))
    assert not found, "unresolved references or raw roles in the PDF:\n" + "\n".join(found[:20])


def test_bibliography_lists_every_entry(pages):
    labels = bibliography_labels("\n".join(pages))
    expected = bibliography_size(ROOT / "book" / "references.bib")
    assert len(labels) >= expected, (
        f"the PDF's bibliography has {len(labels)} entries, references.bib {expected} (the "
        "bibliography page lists them all)")


def test_formulas_are_typeset(pages):
    text = "\n".join(pages)
    assert len(MATH_ALPHANUMERICS.findall(text)) > 500, "hardly any math italic: no formulas?"
    leaked = re.findall(r"\$\$|\\begin\{(?:equation|align)", text)
    assert not leaked, f"formulas left as LaTeX source: {leaked[:5]}"


def test_every_figure_is_embedded(pdf, toc):
    files = [e.file for e in toc_entries(toc)]
    expected = notebook_png_sizes(files)
    assert sum(expected.values()) > 0, "the notebooks have no figure: wrong files?"
    found = pdf_image_sizes(_run("pdfimages", "-list", str(pdf)))
    missing = missing_images(expected, found)
    assert not missing, "figures of the notebooks are not in the PDF:\n" + "\n".join(missing)
    assert sum(found.values()) >= sum(expected.values())


def test_every_page_renders(pdf, pages, rendered):
    count = int(re.search(r"^Pages:\s+(\d+)", _run("pdfinfo", str(pdf)), re.M).group(1))
    assert count == len(pages)
    assert len(rendered) == count, f"{len(rendered)} of {count} pages rendered"
    ink = {page: pgm_ink(data) for page, data in rendered.items()}
    listing = _run("pdfimages", "-list", str(pdf)).splitlines()[2:]
    with_images = {int(row.split()[0]) for row in listing if row.strip()}
    with_text = {i for i, page in enumerate(pages, start=1) if page.strip()}
    blank = blank_pages(ink, with_text | with_images)
    assert not blank, f"pages with text or images render blank: {blank}"


def test_no_line_runs_past_the_margin(lines):
    left, right = text_block(lines)
    # The text block of Sphinx's geometry (1 in margins) on a letter or A4 page.
    assert 60 < left < 90 and 500 < right < 540.5, f"odd text block {left} to {right}"
    past = words_past_margin(lines, left, right)
    assert not past, f"{len(past)} words run past the margin:\n" + "\n".join(past[:30])


def test_nothing_runs_under_the_footer_or_off_the_page(boxes):
    found_boxes, _ = boxes
    g = geometry(found_boxes)
    assert g.head < g.top < g.bottom < g.foot and 10 < g.foot - g.bottom < 40, f"odd pages: {g}"
    found = outside_text_block(found_boxes, g)
    assert not found, (f"{len(found)} lines lie outside the text block (code that ran past the "
                       "page's end?):\n" + "\n".join(found[:30]))


def test_no_near_empty_page_before_a_chapter_ends(boxes, rendered, pages):
    found_boxes, heights = boxes
    g = geometry(found_boxes)
    bottoms = text_bottoms(found_boxes, g)
    fills = {p: fill(data, heights[p], g, bottoms.get(p, 0.0)) for p, data in rendered.items()}
    # The table of contents ends where its last entry does, and the book's first page (the
    # introduction, which carries a running head) starts on a fresh page after it: its last
    # page is not a chapter cut short. Its pages are those of dot-leader lines.
    contents = {i for i, page in enumerate(pages, start=1) if TOC_LINE.search(page)}
    fills = {p: f for p, f in fills.items() if p not in contents}
    found = near_empty_pages(fills, {p: p in running_heads(found_boxes, g) for p in fills})
    assert not found, ("near-empty pages in the middle of a chapter (a table or figure that "
                       "did not fit?):\n" + "\n".join(found))


def test_the_contents_list_one_bibliography(pages):
    # Every line but each page's last, its footer ("Bibliography  491" on the bibliography's
    # own pages).
    lines = [line for page in pages for line in [ln for ln in page.splitlines() if ln.strip()][:-1]]
    found = bibliography_lines(lines)
    assert len(found) == 1, f"the contents list {len(found)} bibliographies: {found}"


def test_every_character_of_the_sources_is_typeset(pages, toc):
    files = [toc["root"]] + [e.file for e in toc_entries(toc)]
    sources = {file: source_texts(_source(file)) for file in files}
    missing = characters_not_typeset(sources, "".join(pages))
    assert not missing, ("characters of the sources missing from the PDF (a font without them? "
                         "see CONTRIBUTING, 'make pdf'):\n" + "\n".join(missing))


def test_checks_catch_a_broken_pdf(tmp_path):
    entries = [Entry("a", "Attention from scratch", 1), Entry("b", "Masking", 2),
               Entry("n", "Notation", None), Entry("s", "Assignment 1: Masks", None, True)]
    contents = ["2 Attention from scratch 13", "Masking 63", "Notation 7",
                "Assignment 1: Masks . . . . . 280"]
    problems = toc_problems(contents, entries)
    assert len(problems) == 2 and "listed as" in problems[0] and "Masking" in problems[1]
    assert toc_problems(["Notation 7", "1 Attention from scratch 13"],
                        [entries[0], entries[2]]) == ["n: 'Notation' is listed out of "
                                                      "_toc.yml's order"]
    assert not toc_problems(["1 Attention from scratch 13", "2 Masking 63", "Notation 70",
                             "Assignment 1: Masks . . . 80"], entries)

    assert len(unresolved_markers("see Fig. ?? and [?], or {cite}`vaswani`")) == 3
    text = "as [Ba, 2016] showed\n[Ba, 2016a] Jimmy Ba.\n[Ba, 2016b] J. Ba.\n[16, 2048] and\n"
    assert bibliography_labels(text) == {"Ba, 2016a", "Ba, 2016b"}
    assert not unresolved_markers("Fig. 3.1 and [Vaswani et al., 2017]")

    xhtml = ('<html xmlns="http://www.w3.org/1999/xhtml"><body><doc>'
             '<page width="612" height="792"><flow><block>'
             + "".join('<line xMin="72" xMax="540">'
                       + "".join(f'<word xMin="{72 + 58.5 * i}" xMax="{120 + 58.5 * i}">w</word>'
                                 for i in range(8))
                       + "</line>" for _ in range(3))
             + '<line xMin="72" xMax="573"><word xMin="72" xMax="573">torch.nn.Trans</word></line>'
             '<line xMin="60" xMax="90"><word xMin="60" xMax="90">left</word></line>'
             "</block></flow></page></doc></body></html>")
    lines = bbox_lines(xhtml)
    assert text_block(lines) == (72.0, 540.0)
    past = words_past_margin(lines, 72.0, 540.0)
    assert len(past) == 2 and "torch.nn.Trans" in past[0] and "'left'" in past[1]

    expected = Counter({(640, 480): 2, (300, 200): 1})
    listing = ("page num type width height\n---\n"
               "  3  0 image 640 480 rgb 3 8\n  3  1 smask 640 480 gray 1 8\n")
    assert len(missing_images(expected, pdf_image_sizes(listing))) == 2

    white, inked = b"P5 4 2 255\n" + bytes([255] * 8), b"P5 4 2 255\n" + bytes([255] * 7 + [0])
    assert pgm_ink(white) == 0 and pgm_ink(inked) == 1
    assert blank_pages({1: 0, 2: 5, 3: 0}, {1, 2}) == [1]

    # A code block run under the footer: its lines go on below the text block (y 731 and 742,
    # beside the footer's page number) and off the page.
    boxes = [Box(p, 35.5, 45.5, "The Tested Transformer") for p in (1, 2, 3)]
    boxes += [Box(p, 75.1, 83.0, "text") for p in (1, 2, 3)]
    boxes += [Box(p, 712.0, 719.9, "text") for p in (1, 2, 3)]
    boxes += [Box(p, 741.9, 751.9, str(p)) for p in (1, 2, 3)]
    g = geometry(boxes)
    assert g == Geometry(35.5, 75.1, 719.9, 741.9)
    fine = [Box(2, 718.0, 725.1, "k"), Box(2, 716.7, 726.6, "continues on next page")]
    assert not outside_text_block(boxes + fine, g)  # a subscript, a long table's foot
    over = [Box(2, 723.0, 731.0, "x = 1"), Box(2, 741.9, 749.0, "y = 2"),
            Box(2, 800.0, 808.0, "z = 3")]
    found = outside_text_block(boxes + over, g)
    assert len(found) == 2 and "'x = 1'" in found[0] and "'z = 3'" in found[1], found

    # Fill: a page inked down to its middle, and the near-empty page it makes mid-chapter.
    half = b"P5 4 132 255\n" + bytes([0] * 4 * 66 + [255] * 4 * 66)
    assert 0.45 < fill(half, 792.0, g) < 0.55
    white = b"P5 4 132 255\n" + bytes([255] * 4 * 132)
    assert fill(white, 792.0, g) == 0.0 and 0.74 < fill(white, 792.0, g, 560.0) < 0.76
    assert text_bottoms(boxes + [Box(2, 500.0, 560.0, "x")], g)[1] == 719.9
    fills = {1: 0.36, 2: 0.9, 3: 0.2, 4: 0.0, 5: 0.3, 6: 0.9, 7: 0.1}
    heads = {1: True, 2: True, 3: True, 4: True, 5: True, 6: False, 7: True}
    found = near_empty_pages(fills, heads)
    assert len(found) == 1 and found[0].startswith("page 1:"), found  # 3, 5 end chapters

    contents = ["Glossary  477", "Bibliography  481", "Bibliography  483", "Index  490"]
    assert bibliography_lines(contents) == ["Bibliography  481", "Bibliography  483"]
    assert bibliography_lines(["9.1 The decoder . . . 201", "Bibliography 491"]) == [
        "Bibliography 491"]

    sources = {"book/15": ["print('🙂 日本語')", "👨\u200d👩\ufe0f"], "book/intro": ["x\ty"]}
    missing = characters_not_typeset(sources, "print('🙂 日語') 👨👩 x y")
    assert len(missing) == 1 and "U+672C" in missing[0] and "book/15" in missing[0], missing
