"""A chapter opened in JupyterLab (`make lab`) reads as in the book: MyST is rendered.

`make lab` is started as a reader types it (through `tests/test_commands.py`'s helpers, on a free
port of 127.0.0.1), chapter 1 is opened in Debian's headless Chromium (`tests/test_browser.py`'s
driver) and every Markdown cell, once rendered, is read from the page. The checks
(`lab_problems`): every Markdown cell is rendered by the jupyterlab-myst extension, no raw
MyST is left in the rendered text (no `{numref}`, `{cite}`, `{eq}`, `{glue:text}`, no
`(label)=` line), every `{eq}` reference is a link showing the equation's number, and no
reference to a label defined in the chapter's own Markdown is left unresolved.

What jupyterlab-myst cannot resolve, and the book can, is counted and printed, not failed:
figure references (the figures are named in the code cells' metadata, which only the book's
build reads), citations (the bibliography is a file of the book, not of the notebook),
references to other chapters, and glued numbers (`{glue:text}`, myst-nb's, shown as their key).

`test_checks_catch_raw_markup` feeds the same checks the page that JupyterLab shows without
the extension (each cell's source as text), to prove that they can fail.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
from test_browser import chromium
from test_commands import TOKEN, fetch, free_port, running

from conftest import ROOT, SUMMARY_LINES

CHAPTER = ROOT / "book" / "01_attention.ipynb"
RENDER_TIMEOUT = 90  # seconds for JupyterLab to load and render the chapter, on a busy machine
SETTLED = 15  # seconds without a change to the shown cells after which the page is final

# Every Markdown cell's rendered text, the in-page links and the references the extension
# marks as unresolved (its yellow "... Not Found" spans). A cell rendered by JupyterLab's own
# Markdown renderer has a `.jp-RenderedMarkdown` and no `.myst` widget.
READ_CELLS = r"""
const cells = [...document.querySelectorAll('.jp-Notebook .jp-MarkdownCell')];
const shown = c => c.querySelector('div.myst') || c.querySelector('.jp-RenderedMarkdown');
return {
  cells: cells.length,
  myst: cells.filter(c => c.querySelector('div.myst')).length,
  text: cells.map(c => shown(c) ? shown(c).textContent : ''),
  links: [...document.querySelectorAll('.jp-MarkdownCell div.myst a[href^="#"]')]
    .map(a => [a.getAttribute('href').slice(1), a.textContent.trim()]),
  unresolved: [...document.querySelectorAll('.jp-MarkdownCell div.myst [title$="Not Found"]')]
    .map(e => [e.title, e.textContent.trim()]),
};
"""

RAW_MYST = re.compile(
    r"\{(?:numref|eq|cite|ref|doc|term|glue:text|glue|exercise|solution|admonition|figure)\}`?"
    r"|^\([\w:-]+\)=\s*$",
    re.MULTILINE,
)
NUMBER = re.compile(r"^\(\d+(?:\.\d+)?\)$")


def expected_from(notebook: Path) -> dict:
    """What the chapter's Markdown asks for: its cells, the equations it references with
    {eq}, the labels it defines itself, its figures' names, citations and glued numbers."""
    nb = json.loads(notebook.read_text(encoding="utf-8"))
    sources = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown"]
    markdown = "\n".join(sources)
    labels = set(re.findall(r"^\(([\w:-]+)\)=", markdown, re.MULTILINE))
    labels |= set(re.findall(r"\$\$\s*\(([\w:-]+)\)", markdown))
    labels |= set(re.findall(r"^:label:\s*(\S+)", markdown, re.MULTILINE))
    figures = {
        c["metadata"].get("mystnb", {}).get("figure", {}).get("name")
        for c in nb["cells"]
        if c["cell_type"] == "code"
    } - {None}
    return {
        "sources": sources,
        "eq_refs": sorted(set(re.findall(r"\{eq\}`([^`]+)`", markdown))),
        "labels": labels,
        "figures": figures,
        "citations": len(re.findall(r"\{cite\}`", markdown)),
        "glued": len(re.findall(r"\{glue:text\}`", markdown)),
    }


def lab_problems(page: dict, expected: dict) -> list[str]:
    """What keeps the chapter, as JupyterLab shows it, from reading as in the book."""
    problems = []
    wanted = len(expected["sources"])
    if page["cells"] != wanted:
        problems.append(
            f"JupyterLab shows {page['cells']} Markdown cells of the chapter's {wanted}"
        )
    if page["myst"] < page["cells"]:
        problems.append(
            f"only {page['myst']} of {page['cells']} Markdown cells are rendered by "
            "jupyterlab-myst: is it installed and enabled (`.venv/bin/jupyter labextension "
            "list`)?"
        )
    for i, text in enumerate(page["text"]):
        for m in list(RAW_MYST.finditer(text))[:2]:
            around = text[max(0, m.start() - 40) : m.end() + 40].replace("\n", " ")
            problems.append(f"Markdown cell {i + 1} shows raw MyST: ...{around}...")
    links = dict(page["links"])
    for label in expected["eq_refs"]:
        if not NUMBER.match(links.get(label, "")):
            problems.append(
                f"{{eq}}`{label}` is not a link showing the equation's number "
                f"(link text: {links.get(label)!r})"
            )
    for kind, label in page["unresolved"]:
        if label in expected["labels"]:
            problems.append(f"{kind}: {label}, a label of this chapter's own Markdown")
    return problems


def known_gaps(page: dict, expected: dict) -> str:
    """What the extension leaves unresolved where the book resolves it: counted, not failed."""
    kinds = [kind for kind, _ in page["unresolved"]]
    figures = sum(label in expected["figures"] for _, label in page["unresolved"])
    return (
        f"{figures} figure references and {kinds.count('Citation Not Found')} citations "
        f"unresolved, {expected['glued']} glued numbers shown as their keys"
    )


def open_chapter(driver, url: str, expected: dict) -> dict:
    """Open the chapter and read it until the checks pass, the page has not changed for
    SETTLED seconds, or RENDER_TIMEOUT runs out; the extension renders each cell, then resolves
    references across cells, in several passes."""
    driver.get(url)
    deadline = time.monotonic() + RENDER_TIMEOUT
    page = {"cells": 0, "myst": 0, "text": [], "links": [], "unresolved": []}
    changed = time.monotonic()
    while time.monotonic() < deadline:
        seen, page = page, driver.execute_script(READ_CELLS)
        if page != seen:
            changed = time.monotonic()
        elif page["cells"] and time.monotonic() - changed > SETTLED:
            break  # every cell shown and nothing changed since: what the reader gets
        if page["cells"] and not lab_problems(page, expected):
            break
        time.sleep(0.5)
    return page


@pytest.mark.book
@pytest.mark.browser
def test_a_chapter_reads_in_jupyterlab_as_in_the_book(tmp_path, request):
    expected = expected_from(CHAPTER)
    # The reader's own JupyterLab settings and saved layouts are left alone, and so is book/
    # (the checkpoint JupyterLab saves on opening a notebook goes to tmp_path); every cell is
    # attached to the page (no windowing), so that all of them can be read without scrolling.
    settings = tmp_path / "settings" / "@jupyterlab" / "notebook-extension"
    settings.mkdir(parents=True)
    (settings / "tracker.jupyterlab-settings").write_text('{"windowingMode": "none"}')
    port, log = free_port(), tmp_path / "lab.log"
    args = [
        "lab",
        f"LAB_PORT={port}",
        f"LAB_ARGS=--no-browser --ServerApp.port_retries=0 --IdentityProvider.token={TOKEN}"
        f" --LabApp.user_settings_dir={tmp_path / 'settings'}"
        f" --LabApp.workspaces_dir={tmp_path / 'workspaces'}"
        f" --FileCheckpoints.checkpoint_dir={tmp_path / 'checkpoints'}",
    ]
    start = time.monotonic()
    with running(args, log) as proc:
        fetch(f"http://127.0.0.1:{port}/api/status?token={TOKEN}", proc, log, timeout=120)
        with chromium() as driver:
            page = open_chapter(
                driver, f"http://127.0.0.1:{port}/lab/tree/{CHAPTER.name}?token={TOKEN}", expected
            )
    problems = lab_problems(page, expected)
    if problems:
        pytest.fail(
            f"{CHAPTER.name} in JupyterLab ({RENDER_TIMEOUT} s allowed): "
            f"{len(problems)} problems, the first: {problems[0]}\n"
            + "\n".join(problems[1:20])
            + f"\n--- make lab's log, last lines:\n{log.read_text()[-2000:]}"
        )
    summary = (
        f"JupyterLab: {CHAPTER.name}'s {page['cells']} Markdown cells rendered by "
        f"MyST, {len(expected['eq_refs'])} equation references numbered, in "
        f"{time.monotonic() - start:.0f} s; as expected, {known_gaps(page, expected)}"
    )
    request.config.stash.setdefault(SUMMARY_LINES, []).append(summary)


def test_checks_catch_raw_markup():
    """Without jupyterlab-myst, JupyterLab renders the cells as plain Markdown: the roles and
    labels stay as text and nothing is a numbered link. The checks must say so."""
    expected = expected_from(CHAPTER)
    raw = {
        "cells": len(expected["sources"]),
        "myst": 0,
        "text": expected["sources"],
        "links": [],
        "unresolved": [],
    }
    problems = lab_problems(raw, expected)
    assert problems and "rendered by jupyterlab-myst" in problems[0], problems[:3]
    assert any("{numref}" in p for p in problems), problems
    assert any("{cite}" in p for p in problems), problems
    assert any("(eq-01-attention)" in p or "is not a link" in p for p in problems), problems
    # and an unresolved reference to the chapter's own label (a typo, a lost label) fails too
    broken = {
        "cells": raw["cells"],
        "myst": raw["cells"],
        "text": [""] * raw["cells"],
        "links": [],
        "unresolved": [("Cross Reference Not Found", "eq-01-softmax")],
    }
    assert any(
        "a label of this chapter's own Markdown" in p for p in lab_problems(broken, expected)
    )
