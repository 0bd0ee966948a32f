"""The book builds with zero warnings, and no built page loads anything from outside the book."""

from __future__ import annotations

import re
from html.parser import HTMLParser

import pytest

from conftest import HTML

pytestmark = pytest.mark.book


def test_book_builds_without_warnings(built_book):
    log = built_book.stdout + built_book.stderr
    warnings = [ln for ln in log.splitlines() if re.search(r"WARNING|ERROR", ln)]
    assert built_book.returncode == 0, f"the build failed:\n{log[-6000:]}"
    assert not warnings, "the build printed warnings:\n" + "\n".join(warnings[:40])
    assert (HTML / "index.html").is_file()


class _Resources(HTMLParser):
    """Collects the URLs a page loads by itself: scripts, stylesheets, images, fonts, frames."""

    def __init__(self):
        super().__init__()
        self.urls: list[str] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag in ("script", "img", "iframe", "source", "audio", "video", "embed") and a.get("src"):
            self.urls.append(a["src"])
        if tag == "link" and a.get("href"):
            rel = (a.get("rel") or "").lower()
            loads = ("stylesheet", "preload", "modulepreload", "icon", "prefetch")
            if any(r in rel for r in loads):
                self.urls.append(a["href"])


def _external(url: str) -> bool:
    return bool(re.match(r"^(https?:)?//", url))


def test_no_page_loads_from_outside_the_book(built_book):
    assert built_book.returncode == 0
    pages = sorted(HTML.rglob("*.html"))
    assert pages, "no HTML page was built"
    offenders = []
    for page in pages:
        parser = _Resources()
        parser.feed(page.read_text(encoding="utf-8"))
        offenders += [f"{page.relative_to(HTML)}: {u}" for u in parser.urls if _external(u)]
    assert not offenders, "pages load resources from outside the book:\n" + "\n".join(offenders)


def test_mathjax_is_served_from_the_book(built_book):
    assert built_book.returncode == 0
    assert (HTML / "_static" / "mathjax" / "tex-chtml.js").is_file()
    notation = (HTML / "book" / "notation.html").read_text(encoding="utf-8")
    assert "_static/mathjax/tex-chtml.js" in notation
