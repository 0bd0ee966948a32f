"""The book's search page, in Chromium, offline: a chapter found first by its key term.

For each term of ``KEY_TERMS`` (one or more for every numbered chapter of _toc.yml, the words a
reader would type for that chapter's topic) the test opens ``search.html?q=TERM`` in one browser
session, waits for the results and their snippets, and checks that:

- the chapter is among the first ``TOP`` results (the glossary's entry for the same term may
  come first);
- the snippets of the first ``SNIPPETS_CHECKED`` results are prose: no LaTeX (``\\(``,
  ``\\frac``, ``$$``), no file name from the page's download menu (``.ipynb``), no runs of blank
  lines left by the navigation, and the chapter's snippet shows one of the words searched for;
- the page logs no error or warning.

The ranking comes from the chapters' key terms in book/_ext/tested_transformer_search.py, the
snippets from book/_static/tested-transformer-search.js. A failure prints its cause first, then
the whole ranking of the term. ``test_checks_catch_a_bad_ranking`` feeds the checks a ranking
and snippets that break every rule, to prove that they can fail.
"""

from __future__ import annotations

import importlib.util
import re
import time
from urllib.parse import quote, urljoin, urlsplit

import pytest
import yaml
from test_browser import book_url, browser  # noqa: F401 - fixtures

from conftest import ROOT, SUMMARY_LINES

pytestmark = [pytest.mark.book, pytest.mark.browser]

# What a reader types, and the chapter that it must list first or second.
KEY_TERMS: list[tuple[str, str]] = [
    ("scaled dot-product attention", "book/01_attention"),
    ("softmax", "book/01_attention"),
    ("self-attention", "book/02_self_attention"),
    ("multi-head attention", "book/03_multi_head_attention"),
    ("masking", "book/04_masking"),
    ("positional encoding", "book/05_positional_encoding"),
    ("rotary", "book/05_positional_encoding"),
    ("feed-forward", "book/06_feed_forward"),
    ("layer norm", "book/07_layer_norm_and_residuals"),
    ("encoder", "book/08_encoder"),
    ("decoder", "book/09_transformer"),
    ("BERT", "book/10_model_families"),
    ("graph", "book/11_attention_beyond_text"),
    ("vision transformer", "book/12_images_and_convolution"),
    ("KV cache", "book/13_fast_attention"),
    ("Llama", "book/14_real_models"),
    ("tokenizer", "book/15_tokens_and_real_text"),
    ("ring attention", "book/16_beyond_one_machine"),
    ("bfloat16", "book/17_devices_and_precision"),
    ("top-p", "book/18_choosing_the_next_token"),
    ("instruction tuning", "book/19_fine_tuning"),
    ("LoRA", "book/20_lora_and_preferences"),
    ("sliding-window attention", "book/21_published_checkpoints"),
]
# Words that are no key term (book/_ext/tested_transformer_search.py): the chapter whose
# headings treat them must still come first or second, not be pushed down by the key terms of
# other chapters that merely contain them ("causal mask", "residual connection").
OTHER_WORDS: list[tuple[str, str]] = [
    ("causal", "book/04_masking"),
    ("padding", "book/04_masking"),
    ("residual", "book/07_layer_norm_and_residuals"),
    ("greedy", "book/09_transformer"),
    ("temperature", "book/10_model_families"),
]
TOP = 2
SNIPPETS_CHECKED = 5  # the first results' snippets, those a reader reads
WAIT_S = 20  # for one search's results and snippets

# Not prose: TeX delimiters and macros, the download menu's file names, blank lines of a menu.
NOT_PROSE = {
    "LaTeX": re.compile(
        r"\\[()\[\]]|\$\$|\\(?:frac|mathrm|text|sqrt|begin|end|top|times|cdot|sum|left|right"
        r"|operatorname|mathbf|infty|dots|alpha|sigma)\b"
    ),
    "a file name": re.compile(r"\.(?:ipynb|md|pdf)\b"),
    "navigation's blank lines": re.compile(r"\n\s*\n|\s{4,}"),
}

# The results as the page lists them, with each one's snippet (null until it has come).
READ_RESULTS = r"""
const status = document.querySelector('#search-results .search-summary');
const items = [...document.querySelectorAll('#search-results ul.search > li')].map((li) => {
  const a = li.querySelector('a');
  const p = li.querySelector('p.context');
  return {href: a.getAttribute('href'), title: a.textContent, snippet: p ? p.textContent : null};
});
return {done: !!(status && status.textContent.trim()), items};
"""


def numbered_chapters() -> list[str]:
    """The chapters of _toc.yml's numbered parts (1, 2, ...), as 'book/01_attention'."""
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text(encoding="utf-8"))
    return [
        re.sub(r"\.(md|ipynb)$", "", chapter["file"])
        for part in toc["parts"]
        if part.get("numbered")
        for chapter in part["chapters"]
    ]


def page_of(href: str) -> str:
    """'book/04_masking.html#padding-masks' -> 'book/04_masking'."""
    return re.sub(r"\.html$", "", urlsplit(href).path.lstrip("/"))


def search(driver, base_url: str, term: str, complete: bool = False) -> list[dict]:
    """The results of searching `term`, as dicts of href, title and snippet, once the first
    `SNIPPETS_CHECKED` of them are listed with their snippets (or all of them, if `complete`),
    or what is there after `WAIT_S`. The page lists the results in their final order, one at a
    time while it fetches and reads each page for its snippet (a second for 30 results), so
    the first ones settle the checks."""
    driver.get(urljoin(base_url, "search.html?q=" + quote(term)))
    deadline = time.monotonic() + WAIT_S
    while True:
        seen = driver.execute_script(READ_RESULTS)
        items = seen["items"]
        enough = seen["done"] or (not complete and len(items) >= SNIPPETS_CHECKED)
        if enough and all(item["snippet"] is not None for item in items[:SNIPPETS_CHECKED]):
            return items
        if time.monotonic() > deadline:
            return items
        time.sleep(0.05)


def rank_of(chapter: str, results: list[dict]) -> int | None:
    """The chapter's place (1 = first) among the results, or None."""
    pages = [page_of(r["href"]) for r in results]
    return pages.index(chapter) + 1 if chapter in pages else None


def ranking_problems(term: str, chapter: str, results: list[dict]) -> list[str]:
    """What is wrong with the results of searching `term`, each a sentence; [] when nothing."""
    if not results:
        return [f"{term!r}: no results (or none listed in {WAIT_S} s)"]
    problems = []
    rank = rank_of(chapter, results)
    if rank is None or rank > TOP:
        where = f"#{rank}" if rank else f"not among the {len(results)} results listed"
        problems.append(f"{term!r}: {chapter} is {where}, not in the first {TOP}")
    words = [w for w in re.split(r"\W+", term.lower()) if len(w) > 1]
    chapter_seen = False
    for place, result in enumerate(results[:SNIPPETS_CHECKED], start=1):
        snippet = result["snippet"]
        if not snippet or not snippet.strip():
            problems.append(f"{term!r}: result #{place} ({result['href']}) has no snippet")
            continue
        for what, pattern in NOT_PROSE.items():
            if found := pattern.search(snippet):
                problems.append(
                    f"{term!r}: the snippet of #{place} ({result['href']}) shows {what} "
                    f"({found.group()!r}): {snippet[:160]!r}"
                )
        # The chapter's first result (its page, or the section that matched) shows the term.
        if page_of(result["href"]) != chapter or chapter_seen:
            continue
        chapter_seen = True
        # A word of the query where a word starts ("mask" in "masking", not "graph" in
        # "paragraph").
        if not any(re.search(rf"\b{re.escape(w)}", snippet.lower()) for w in words):
            problems.append(
                f"{term!r}: the snippet of {chapter} does not show the words searched for: "
                f"{snippet[:160]!r}"
            )
    return problems


def format_ranking(term: str, results: list[dict]) -> str:
    lines = [f"search {term!r}: {len(results)} results"]
    for place, r in enumerate(results, start=1):
        snippet = (r["snippet"] or "(no snippet)").replace("\n", "\\n")[:110]
        lines.append(f"  {place:2}. {r['href']}  [{r['title'][:40]}]  {snippet}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- the tests
def test_every_chapter_has_a_key_term():
    missing = sorted(set(numbered_chapters()) - {chapter for _, chapter in KEY_TERMS})
    assert not missing, f"chapters without a key term in KEY_TERMS: {missing}"


def search_all(driver, base_url: str, pairs: list[tuple[str, str]]):
    """Search each (term, chapter) of `pairs`: the problems found, the whole ranking of each
    term that has one, and each term's "term place"."""
    problems, failed, ranks = [], [], []
    for term, chapter in pairs:
        results = search(driver, base_url, term)
        found = ranking_problems(term, chapter, results)
        problems += found
        if found:
            failed.append(format_ranking(term, search(driver, base_url, term, complete=True)))
        ranks.append(f"{term} {rank_of(chapter, results) or '-'}")
    driver.get("about:blank")
    return problems, failed, ranks


def test_each_chapter_is_found_first_by_its_key_term(book_url, browser, request):  # noqa: F811
    browser.get("about:blank")
    browser.get_log("browser")  # what earlier pages logged
    started = time.monotonic()
    problems, failed, ranks = search_all(browser, book_url, KEY_TERMS)
    console = [
        f"{m['level']}: {m['message'][:200]}"
        for m in browser.get_log("browser")
        if m["level"] in ("SEVERE", "WARNING")
    ]
    line = (
        f"search: {len(KEY_TERMS)} key terms in {time.monotonic() - started:.1f} s, "
        f"the chapter's place: {', '.join(ranks)}"
    )
    request.config.stash.setdefault(SUMMARY_LINES, []).append(line)
    assert not problems, "\n".join(problems) + "\n\n" + "\n\n".join(failed)
    assert not console, "the search page logged:\n" + "\n".join(console)


def _key_terms() -> set[str]:
    spec = importlib.util.spec_from_file_location(
        "search_terms", ROOT / "book" / "_ext" / "tested_transformer_search.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return {t for terms in module.KEY_TERMS.values() for t in terms.split(", ")}


def test_words_that_are_no_key_term_find_their_chapter(book_url, browser):  # noqa: F811
    keys = _key_terms()
    assert not [w for w, _ in OTHER_WORDS if w in keys], "OTHER_WORDS must not be key terms"
    problems, failed, _ = search_all(browser, book_url, OTHER_WORDS)
    assert not problems, "\n".join(problems) + "\n\n" + "\n\n".join(failed)


def test_search_works_on_a_phone(book_url, browser):  # noqa: F811
    """The same search as a 390x844 phone shows it: the chapter first or second, prose
    snippets, and a results page that does not scroll sideways."""
    from test_browser import PHONE

    browser.execute_cdp_cmd(
        "Emulation.setDeviceMetricsOverride",
        {"width": PHONE[0], "height": PHONE[1], "deviceScaleFactor": 1, "mobile": True},
    )
    problems = []
    try:
        for term, chapter in KEY_TERMS[::6]:
            results = search(browser, book_url, term)
            problems += ranking_problems(term, chapter, results)
            overflow = browser.execute_script(
                "return document.documentElement.scrollWidth - window.innerWidth;")
            if overflow > 1:
                problems.append(f"{term!r}: the results page scrolls sideways by {overflow} px")
        browser.get("about:blank")
    finally:
        browser.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})
    assert not problems, "at 390x844:\n" + "\n".join(problems)


def test_snippets_write_formulas_as_text(book_url, browser):  # noqa: F811
    """Inline formulas of a snippet, as the search page writes them."""
    browser.get(urljoin(book_url, "search.html"))
    cases = {
        r"\(L \times L\)": "L × L",
        r"\(\mathrm{softmax}(Q K^\top / \sqrt{d_k})\,V\)": "softmax(Q Kᵀ / √d_k) V",
        r"\(d_\text{model}\)": "d_model",
        r"\(\frac{1}{\sqrt{d_k}}\)": "1/√d_k",
        r"\(0, \dots, t\)": "0, …, t",
        r"\(\begin{pmatrix} 1 \end{pmatrix}\)": "…",  # too complex: left out
    }
    got = browser.execute_script(
        "return arguments[0].map((t) => Search.texToText(t));", list(cases)
    )
    assert got == list(cases.values())


def test_checks_catch_a_bad_ranking():
    """The checks above, fed results that break each rule, report each one."""
    good = {"href": "book/04_masking.html", "title": "4. Masking", "snippet": "Masking a query."}
    other = {"href": "book/10_model_families.html", "title": "10.", "snippet": "Masking tokens."}
    assert ranking_problems("masking", "book/04_masking", [good, other]) == []
    bad = [
        other,
        {**other, "href": "book/glossary.html", "snippet": "....ipynb\n\n\n      .pdf"},
        {**good, "snippet": r"Rows of zeros: \(\frac{QK^\top}{\sqrt{d_k}}\) and $$x$$"},
        {**good, "href": "book/04_masking.html#the-causal-mask", "snippet": "masking"},
        {**other, "snippet": None},
    ]
    problems = "\n".join(ranking_problems("masking", "book/04_masking", bad))
    for expected in (
        "book/04_masking is #3, not in the first 2",
        "shows a file name ('.ipynb')",
        "shows navigation's blank lines",
        "shows LaTeX ('\\\\(')",
        "does not show the words searched for: 'Rows of zeros",
        "result #5 (book/10_model_families.html) has no snippet",
    ):
        assert expected in problems, f"{expected!r} not reported in:\n{problems}"
    assert ranking_problems("graph", "book/11_attention_beyond_text", [
        {"href": "book/11_attention_beyond_text.html", "title": "11.", "snippet": "A paragraph."}
    ]), "'graph' found inside 'paragraph'"
    assert "not among the 1 results listed" in "\n".join(
        ranking_problems("masking", "book/04_masking", [other])
    )
    assert ranking_problems("masking", "book/04_masking", []) != []
