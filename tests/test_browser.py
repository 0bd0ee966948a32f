"""The built book, opened in a real Chromium, offline.

The book is served from ``_build/html`` on 127.0.0.1 (a free port, ``http.server`` in a thread) and
every page of the table of contents is opened in Debian's Chromium (its headless shell), driven by
Selenium through the installed ``chromedriver`` (nothing is downloaded: the driver's path is
given, so Selenium Manager never runs). Each page is visited once; the tests below then check
what was recorded:

- every formula is typeset by MathJax (no raw TeX left, no MathJax error);
- every image loaded and has alt text; every notebook figure has a caption; no text is lost as
  an unknown HTML tag (``<eos>`` written in Markdown);
- notebook figures are not shrunk below 80 % of their size (their labels stay readable), and no
  cell output is a wall of numbers;
- no request left 127.0.0.1 (Chrome's performance log: every requested URL);
- no console error or warning on any page;
- no stray output (``None``, an object's repr such as ``<Figure size ...>``) in any cell;
- every page links the book's repository and offers its source (.ipynb or .md) for download;
- the search page finds "softmax"; the next and previous links follow the table of contents;
  the sidebar lists exactly the pages of _toc.yml; index.html leads to the intro;
- the ☰ and "Contents" buttons work: tapped at 390 px, by keyboard at 900 and 1100 px, clicked
  at 1280 px.

Every page is visited twice, in a 1280x800 window and as a 390x844 phone, and its layout is
measured (``LAYOUT``). At 1280 px: no code cell, cell output or code block of the prose scrolls
sideways, every display equation fits its column, no table is clipped, no page scrolls
sideways. On the phone: no page scrolls sideways as a whole (long inline code wraps), a display
equation wider than the screen scrolls inside its own box with a shadow at its edge, no table is
clipped, every notebook figure fills the column and is a link to its full-size image. At both
sizes no equation's number is drawn over its equation. The measurements go to
``test-artifacts/layout.json`` and to the one-line summaries that pytest prints; a screenshot of
every page at both sizes goes to ``test-artifacts/screenshots/1280x800/`` and ``.../390x844/``
(git-ignored): the first screen of each page, or the whole page with ``BROWSER_SCREENSHOTS=full``
in the environment. (A full-page shot lays the page out again in a viewport up to 30,000 px tall
and rasterises it: about a second a page, as long as loading it, so the everyday run keeps to the
first screen; every check above measures the whole page either way.)
``test_checks_catch_a_broken_page`` feeds the same checks a page that breaks every rule, to prove
that they can fail.
"""

from __future__ import annotations

import base64
import functools
import http.server
import json
import os
import re
import shutil
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urljoin, urlsplit

import pytest
import yaml

from conftest import HTML, ROOT, SUMMARY_LINES

pytestmark = [pytest.mark.book, pytest.mark.browser]

# Debian's packages (`make browser-deps`); CHROMIUM / CHROMEDRIVER in the environment override.
# The headless shell is Chromium's own engine (Blink, V8) built without the browser's windows and
# services: the same pages, laid out the same, for about two thirds of the CPU time of the full
# browser run headless (84 s against 131 s for both passes over the book, measured here). The
# full `chromium` is taken when the shell is not installed.
CHROMIUM = Path(
    os.environ.get("CHROMIUM")
    or shutil.which("chromium-headless-shell")
    or shutil.which("chromium")
    or "/usr/bin/chromium-headless-shell"
)
CHROMEDRIVER = Path(
    os.environ.get("CHROMEDRIVER") or shutil.which("chromedriver") or "/usr/bin/chromedriver"
)
ARTIFACTS = ROOT / "test-artifacts"
WINDOW = (1280, 800)  # a laptop: the sidebar, the ~800 px text column and the page's contents
PHONE = (390, 844)  # a phone held upright, in CSS pixels
# "full": whole-page screenshots; anything else: the first screen of each page (the default).
FULL_SCREENSHOTS = os.environ.get("BROWSER_SCREENSHOTS", "") == "full"

# Chromium's flags. The background-networking ones keep the browser itself from calling home:
# in a closed network those connections are refused and show up as errors.
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--disable-extensions",
    "--hide-scrollbars",
    "--force-device-scale-factor=1",
    "--lang=en-US",
    f"--window-size={WINDOW[0]},{WINDOW[1]}",
    # Any host but 127.0.0.1 fails at once instead of waiting on a DNS timeout. The request is
    # still attempted (and recorded by the performance log), so the no-leak check still sees it.
    "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
]

SCHEMES_THAT_STAY = {"data", "blob", "about"}  # inline data, object URLs, the blank page

# Wait for MathJax 3 to finish its first typesetting pass (and its fonts), or say why it did not.
WAIT_MATHJAX = r"""
const done = arguments[arguments.length - 1];
const hasScript = [...document.scripts].some((s) => /mathjax/i.test(s.src));
if (!hasScript) { done("no MathJax script"); return; }
// Called once the document is complete, when every script of the page, deferred and async
// ones included, has run or failed to load; MathJax makes its startup object as its script runs.
// So no startup object two seconds later means that its script failed.
const t0 = Date.now();
(function poll() {
  const mj = window.MathJax;
  if (mj && mj.startup && mj.startup.promise) {
    mj.startup.promise
      .then(() => document.fonts.ready)
      .then(() => done("typeset"), (e) => done("MathJax failed: " + e));
  } else if (Date.now() - t0 > 2000) {
    done("MathJax never started (its script did not load or run)");
  } else {
    setTimeout(poll, 50);
  }
})();
"""

# Load every image now (lazy ones included) and wait until each has loaded or failed.
WAIT_IMAGES = r"""
const done = arguments[arguments.length - 1];
const imgs = [...document.images];
imgs.forEach((i) => { i.loading = "eager"; });
const settled = imgs.map((i) => (i.complete ? null : new Promise((r) => {
  i.addEventListener("load", r, { once: true });
  i.addEventListener("error", r, { once: true });
})));
Promise.race([Promise.all(settled), new Promise((r) => setTimeout(r, 15000))])
  .then(() => done(imgs.length));
"""

# What the checks need from a page, read after MathJax and the images are done.
COLLECT = r"""
const main = document.querySelector("main") || document.body;
const mathNodes = [...document.querySelectorAll(".math")];
const untypeset = mathNodes
  .filter((m) => !m.querySelector("mjx-container"))
  .map((m) => m.textContent.trim().slice(0, 120));
// TeX delimiters left in the text (outside code) mean math that was never handed to MathJax.
const walker = document.createTreeWalker(main, NodeFilter.SHOW_TEXT);
const rawTex = [];
for (let n = walker.nextNode(); n; n = walker.nextNode()) {
  const p = n.parentElement;
  // Search results quote pages as plain text, so their TeX is meant to stay raw.
  if (p.closest("pre, code, script, style, textarea, mjx-container, .math, #search-results")) {
    continue;
  }
  if (/\\\(|\\\[|\$\$|\\begin\{/.test(n.textContent)) {
    rawTex.push(n.textContent.trim().slice(0, 120));
  }
}
const mathErrors = [...document.querySelectorAll("mjx-merror")].map((e) =>
  (e.getAttribute("data-mjx-error") || "") + " :: " + e.textContent.slice(0, 80));
// MathJax's noundefined extension draws an unknown macro as red text instead of an error.
const mj = window.MathJax;
if (mj && mj.startup && mj.startup.document && mj.startup.document.math) {
  for (const item of mj.startup.document.math) {
    if (!item.root || !item.root.walkTree) continue;
    item.root.walkTree((node) => {
      if (node.isKind("mtext") && node.attributes.get("mathcolor") === "red") {
        mathErrors.push("undefined macro in: " + String(item.math).slice(0, 80));
      }
    });
  }
}
const images = [...document.images].map((i) => ({
  src: i.currentSrc || i.src,
  alt: i.getAttribute("alt"),
  complete: i.complete,
  naturalWidth: i.naturalWidth,
  // A notebook figure: its intended width (a width attribute, as high-DPI output sets) and
  // the width it is shown at, and whether it has a caption.
  fromCell: !!i.closest("div.cell_output"),
  intendedWidth: parseFloat(i.getAttribute("width")) || i.naturalWidth,
  shownWidth: i.getBoundingClientRect().width,
  caption: !!(i.closest("figure") && i.closest("figure").querySelector("figcaption")),
  figure: (i.closest("figure") && i.closest("figure").id) || "",
}));
// Text such as <eos> written in Markdown becomes an unknown HTML tag and vanishes from the page.
const unknownTags = [...main.querySelectorAll("*")]
  .filter((e) => e instanceof HTMLUnknownElement)
  .map((e) => `<${e.localName}> in: ${(e.parentElement.textContent || "").trim().slice(0, 100)}`);
// Text outputs of notebook cells, to find walls of numbers.
const outputs = [...document.querySelectorAll("div.cell_output pre")].map((p) => p.textContent);
const link = (sel) => { const a = document.querySelector(sel); return a ? a.href : null; };
// Outputs that say nothing to a reader: a bare None, an object's repr.
const stray = [...document.querySelectorAll("div.cell_output > .output")]
  .map((o) => o.textContent.trim())
  .filter((t) => t === "None" || /object at 0x[0-9a-fA-F]+>|^<Figure size|^<matplotlib\./.test(t))
  .map((t) => t.slice(0, 80));
const nav = [...document.querySelectorAll("nav.bd-docs-nav a.reference.internal")]
  .map((a) => a.href);
return {
  url: location.href,
  title: document.title,
  mathNodes: mathNodes.length,
  containers: document.querySelectorAll("mjx-container").length,
  untypeset, rawTex, mathErrors, images, outputs, unknownTags,
  stray,
  repository: link("a.btn-source-repository-button"),
  download: link("a.btn-download-source-button"),
  prev: link(".prev-next-area a.left-prev"),
  next: link(".prev-next-area a.right-next"),
  nav,
};
"""

# The page's layout at the current window size: what scrolls sideways, and where.
LAYOUT = r"""
const vw = document.documentElement.clientWidth;
const main = document.querySelector("main") || document.body;
const px = Math.round;
const scrollsX = (e) => e.scrollWidth > e.clientWidth + 1;
const canScroll = (e) => ["auto", "scroll"].includes(getComputedStyle(e).overflowX);
const cells = [...document.querySelectorAll("div.cell")];
const where = (e) => {
  const s = e.closest("section[id]");
  const c = e.closest("div.cell");
  return (s ? "#" + s.id : "") + (c ? ` cell ${cells.indexOf(c)}` : "");
};
// A sidebar drawn off the screen (the phone's closed menus) is not part of the page's width.
const offCanvas = [...document.querySelectorAll(".bd-sidebar-primary, .bd-sidebar-secondary")]
  .filter((e) => {
    const r = e.getBoundingClientRect();
    return r.left >= vw - 1 || r.right <= 1 || getComputedStyle(e).visibility === "hidden";
  });
const code = [...document.querySelectorAll("div.cell_input pre")];
const wideCode = code.filter(scrollsX)
  .map((e) => `code ${where(e)}: ${px(e.scrollWidth - e.clientWidth)} px too wide`);
// Code blocks of the prose (Markdown pages, exercises, solutions, the landing page's commands).
const blocks = [...document.querySelectorAll("main pre")]
  .filter((e) => !e.closest("div.cell"));
const wideBlocks = blocks.filter(scrollsX)
  .map((e) => `code block ${where(e)} "${e.textContent.trim().slice(0, 40)}": `
              + `${px(e.scrollWidth - e.clientWidth)} px too wide`);
const outputs = [...document.querySelectorAll("div.cell_output > .output")]
  .map((o) => o.querySelector("pre") || o);
const wideOutputs = outputs
  .filter((e) => scrollsX(e) || e.getBoundingClientRect().right > vw + 1
                 || [...e.querySelectorAll("table, pre")].some(scrollsX))
  .map((e) => {
    const by = Math.max(e.scrollWidth - e.clientWidth, e.getBoundingClientRect().right - vw);
    return `output ${where(e)}: ${px(by)} px too wide`;
  });
// A table is clipped when part of it is out of sight and no box around it scrolls to it.
const tables = [...main.querySelectorAll("table")];
const clippedTables = tables.filter((t) => {
  if (offCanvas.some((o) => o.contains(t))) return false;
  for (let n = t.parentElement; n && n !== document.body; n = n.parentElement) {
    if (canScroll(n) && scrollsX(n)) return false;
  }
  const r = t.getBoundingClientRect();
  for (let n = t.parentElement; n && n !== document.body; n = n.parentElement) {
    const ox = getComputedStyle(n).overflowX;
    if ((ox === "hidden" || ox === "clip") && n.getBoundingClientRect().right < r.right - 1) {
      return true;  // cut off by a box that hides what overflows it
    }
  }
  return r.right > vw + 1 || r.left < -1 || scrollsX(t);
}).map((t) => `table ${where(t)}: ${px(t.getBoundingClientRect().width)} px wide`);
const equations = [...document.querySelectorAll('mjx-container[display="true"]')];
const wideEquations = equations.filter(
  (m) => scrollsX(m) || m.getBoundingClientRect().right > vw + 1);
const loose = wideEquations
  .filter((m) => !(canScroll(m) && m.getBoundingClientRect().right <= vw + 1))
  .map((m) => `equation ${where(m)}: neither fits nor scrolls in its own box`);
// A wide equation shows that it scrolls: shadows (gradients fixed to the box) at its edges,
// and covers of the background's colour that scroll with the content and hide a shadow once
// that end is reached.
const cued = (m) => {
  const cs = getComputedStyle(m);
  const attach = cs.backgroundAttachment.split(",").map((a) => a.trim());
  return (cs.backgroundImage.match(/gradient/g) || []).length >= 4
    && attach.includes("local") && attach.includes("scroll");
};
const uncued = wideEquations.filter((m) => !cued(m))
  .map((m) => `equation ${where(m)}: scrolls with nothing to show it`);
// An equation's number is never drawn over the visible part of its equation.
const overNumbers = [...document.querySelectorAll("div.math > span.eqno")].flatMap((n) => {
  const m = n.parentElement.querySelector('mjx-container[display="true"]');
  if (!m) return [];
  const a = n.getBoundingClientRect(), box = m.getBoundingClientRect();
  const ink = (m.querySelector("mjx-math") || m).getBoundingClientRect();
  const left = Math.max(box.left, ink.left), right = Math.min(box.right, ink.right);
  const top = Math.max(box.top, ink.top), bottom = Math.min(box.bottom, ink.bottom);
  const over = a.left < right - 1 && left < a.right - 1 && a.top < bottom - 1 && top < a.bottom - 1;
  return over ? [`equation ${n.textContent.replace("#", "").trim()} ${where(m)}: its number `
                 + `is drawn over it`] : [];
});
// Whatever reaches past the window's right edge outside a box that clips or scrolls it.
const sticking = [];
for (const e of main.querySelectorAll("*")) {
  const r = e.getBoundingClientRect();
  if (r.width === 0 || r.right <= vw + 1 || offCanvas.some((o) => o.contains(e))) continue;
  let boxed = false;
  for (let n = e.parentElement; n && n !== main; n = n.parentElement) {
    if (getComputedStyle(n).overflowX !== "visible" && n.getBoundingClientRect().right <= vw + 1) {
      boxed = true;
      break;
    }
  }
  if (!boxed) {
    const text = (e.textContent || "").trim().replace(/\s+/g, " ").slice(0, 60);
    sticking.push(`<${e.localName}> ${where(e)} ${px(r.right - vw)} px past the edge: ${text}`);
  }
}
const figures = [...document.querySelectorAll("div.cell_output img")].map((i) => {
  const box = i.closest("div.cell_output");
  const cs = getComputedStyle(box);
  const column = box.clientWidth - parseFloat(cs.paddingLeft) - parseFloat(cs.paddingRight);
  const a = i.closest("a[href]");
  return {
    src: (i.currentSrc || i.src).split("/").pop(),
    shown: i.getBoundingClientRect().width,
    column,
    fullSize: !!a && a.href === (i.currentSrc || i.src),
  };
});
return {
  width: vw,
  pageScroll: px(document.documentElement.scrollWidth - vw),
  codeCells: code.length, wideCode, codeBlocks: blocks.length, wideBlocks,
  outputs: outputs.length, wideOutputs,
  tables: tables.length, clippedTables,
  equations: equations.length, wideEquations: wideEquations.length, loose, uncued,
  overNumbers,
  sticking: sticking.slice(0, 5), stickingCount: sticking.length,
  figures,
};
"""


# ----------------------------------------------------------------------------- serving the book
class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 - the signature is http.server's
        pass


@contextmanager
def serve(directory: Path) -> Iterator[str]:
    """Serve `directory` on 127.0.0.1 at a free port from a thread; yields the base URL."""
    handler = functools.partial(_QuietHandler, directory=str(directory))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_port}/"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)


# ----------------------------------------------------------------------------- the browser
def start_chromium():
    """Debian's Chromium through the installed chromedriver; Selenium Manager never runs.
    Chromedriver gives the browser a fresh temporary profile and deletes it on quit."""
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.exists()]
    if missing:
        pytest.fail(f"{', '.join(missing)} not found: install them with `make browser-deps`")
    os.environ["SE_OFFLINE"] = "true"  # belt and braces: Selenium Manager would not download
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = str(CHROMIUM)
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"performance": "ALL", "browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)), options=options)
    driver.set_page_load_timeout(60)
    driver.set_script_timeout(40)
    driver.execute_cdp_cmd("Network.enable", {})
    driver.get("about:blank")
    driver.get_log("performance")
    driver.get_log("browser")
    return driver


@contextmanager
def chromium() -> Iterator[object]:
    driver = start_chromium()
    try:
        yield driver
    finally:
        driver.quit()


# ----------------------------------------------------------------------------- one page visit
@dataclass
class Visit:
    """What one page load showed: the page's state and every request and console message."""

    name: str
    url: str
    page: dict = field(default_factory=dict)
    requests: list[str] = field(default_factory=list)
    http_errors: list[str] = field(default_factory=list)
    console: list[dict] = field(default_factory=list)
    mathjax: str = ""


def _drain_network(driver, visit: Visit) -> None:
    for entry in driver.get_log("performance"):
        msg = json.loads(entry["message"])["message"]
        method, params = msg.get("method", ""), msg.get("params", {})
        if method == "Network.requestWillBeSent":
            visit.requests.append(params["request"]["url"])
        elif method == "Network.webSocketCreated":
            visit.requests.append(params["url"])
        elif method == "Network.responseReceived":
            status = params["response"].get("status", 0)
            if status >= 400:
                visit.http_errors.append(f"{status} {params['response']['url']}")


def visit_page(
    driver,
    url: str,
    name: str,
    wait_for_js: str | None = None,
    extra_js: str | None = None,
    screenshot: Path | None = None,
    size: tuple[int, int] | None = None,
) -> Visit:
    """Open `url`, wait for MathJax and the images (and `wait_for_js`), record the page (and
    what `extra_js` returns, in ``page["extra"]``; its layout, in ``page["layout"]``), save a
    screenshot if asked, then leave for about:blank so that every request and message of this
    page is in this visit's record. `size` (width, height) shows the page as a phone of that
    size would (a mobile viewport); without it, in the browser's 1280x800 window."""

    visit = Visit(name=name, url=url)
    if size:
        driver.execute_cdp_cmd(
            "Emulation.setDeviceMetricsOverride",
            {"width": size[0], "height": size[1], "deviceScaleFactor": 1, "mobile": True},
        )
    try:
        _load_and_record(driver, visit, wait_for_js, extra_js, screenshot, size)
        # Leave before the phone's viewport is cleared: cleared first, it would have the page
        # laid out again at 1280 px on the way out (half a second a page).
        driver.get("about:blank")
    finally:
        if size:
            driver.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})
    _drain_network(driver, visit)
    visit.console = driver.get_log("browser")
    return visit


def _load_and_record(driver, visit, wait_for_js, extra_js, screenshot, size) -> None:
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get(visit.url)
    WebDriverWait(driver, 30).until(
        lambda d: d.execute_script("return document.readyState") == "complete"
    )
    if wait_for_js:
        WebDriverWait(driver, 30).until(lambda d: d.execute_script(wait_for_js))
    visit.mathjax = driver.execute_async_script(WAIT_MATHJAX)
    driver.execute_async_script(WAIT_IMAGES)
    visit.page = driver.execute_script(COLLECT)
    visit.page["layout"] = driver.execute_script(LAYOUT)
    if extra_js:
        visit.page["extra"] = driver.execute_script(extra_js)
    last_script = time.monotonic()
    if screenshot:
        _screenshot(driver, screenshot, size or WINDOW, mobile=bool(size))
    # Let a request started by the last script reach the log: 0.2 s after it (a full-page
    # screenshot usually takes longer than that already).
    time.sleep(max(0.0, last_script + 0.2 - time.monotonic()))


# ----------------------------------------------------------------------------- the checks
def leaving_requests(visit: Visit) -> list[str]:
    bad = []
    for url in visit.requests:
        parts = urlsplit(url)
        if parts.scheme in SCHEMES_THAT_STAY:
            continue
        if parts.scheme in ("http", "https", "ws", "wss") and parts.hostname == "127.0.0.1":
            continue
        bad.append(url if len(url) < 200 else url[:200] + "...")
    return bad


def leave_cleanly(driver, visit: Visit) -> None:
    """Leave the page of `visit` for about:blank, record its requests and console, and fail if
    it reached outside the book or wrote an error or warning."""
    time.sleep(0.2)  # let a request started by the last action reach the log
    driver.get("about:blank")
    _drain_network(driver, visit)
    visit.console = driver.get_log("browser")
    assert not leaving_requests(visit), f"{visit.name}: requests outside the book"
    assert not console_errors(visit), f"{visit.name}: console errors {console_errors(visit)}"


def console_errors(visit: Visit) -> list[str]:
    """Every error and warning the page wrote to the console (none is allowed)."""
    return [f"{e['level']}: {e['message']}" for e in visit.console
            if e["level"] in ("SEVERE", "WARNING")]


def math_problems(visit: Visit) -> list[str]:
    p = visit.page
    problems = [f"not typeset: {t}" for t in p["untypeset"]]
    problems += [f"raw TeX in the text: {t}" for t in p["rawTex"]]
    problems += [f"MathJax error: {t}" for t in p["mathErrors"]]
    if p["mathNodes"] and visit.mathjax != "typeset":
        problems.append(f"{p['mathNodes']} formulas but MathJax says: {visit.mathjax}")
    if p["mathNodes"] and not p["containers"]:
        problems.append("formulas on the page but no mjx-container")
    return problems


def image_problems(visit: Visit) -> list[str]:
    problems = []
    for img in visit.page["images"]:
        src = img["src"] if len(img["src"]) < 120 else img["src"][:120] + "..."
        if not (img["complete"] and img["naturalWidth"] > 0):
            problems.append(f"did not load: {src}")
        alt = (img["alt"] or "").strip()
        if not alt:
            problems.append(f"no alt text: {src}")
        elif re.match(r"^<Figure size|^\S+\.(png|svg|jpe?g|gif)$", alt, re.IGNORECASE):
            problems.append(f"placeholder alt text {alt!r}: {src}")
        if img.get("fromCell") and not img.get("caption"):
            problems.append(f"figure without a caption (mystnb.figure.caption): {src}")
    return problems


MIN_FIGURE_SCALE = 0.8  # a figure shrunk more than this has text too small to read
NUMBERS = re.compile(r"(?<![\w.])[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?")
MAX_NUMBERS, MAX_LINES = 120, 40  # in one output block: more is a wall to summarise


def figure_problems(visit: Visit) -> list[str]:
    """Notebook figures shown much smaller than drawn (their text becomes unreadable)."""
    problems = []
    for img in visit.page["images"]:
        if not img.get("fromCell") or not img["intendedWidth"]:
            continue
        scale = img["shownWidth"] / img["intendedWidth"]
        if scale < MIN_FIGURE_SCALE:
            problems.append(
                f"figure drawn {img['intendedWidth']:.0f} px wide is shown at "
                f"{img['shownWidth']:.0f} px ({scale:.0%}): make it narrower (figsize width "
                f"<= 6.7 in at 100 dpi) or give its cell the tag full-width: "
                f"{img.get('figure') or img['src'][-24:]}"
            )
    return problems


def output_problems(visit: Visit) -> list[str]:
    """Walls of numbers: cell outputs that print a tensor instead of a summary."""
    problems = []
    for text in visit.page.get("outputs", []):
        numbers, lines = len(NUMBERS.findall(text)), len(text.splitlines())
        if numbers > MAX_NUMBERS or lines > MAX_LINES:
            first = text.strip().splitlines()[0][:60] if text.strip() else ""
            problems.append(f"an output of {lines} lines and {numbers} numbers: {first!r}")
    return problems


def all_problems(visit: Visit) -> dict[str, list[str]]:
    return {
        "math": math_problems(visit),
        "images": image_problems(visit),
        "requests": leaving_requests(visit) + [f"HTTP {e}" for e in visit.http_errors],
        "console": console_errors(visit),
        "figures": figure_problems(visit),
        "outputs": output_problems(visit),
        "markup": [f"text lost as an HTML tag {t}" for t in visit.page.get("unknownTags", [])],
        "stray": [f"a stray output: {t!r}" for t in visit.page.get("stray", [])],
    }


def _report(visits: list[Visit], kind: str) -> str:
    lines = []
    for v in visits:
        for problem in all_problems(v)[kind]:
            lines.append(f"{v.name}: {problem}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- table of contents
def toc_pages() -> list[str]:
    """Page names (e.g. 'book/01_attention') in reading order, from _toc.yml."""
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text(encoding="utf-8"))
    names: list[str] = []

    def walk(entries):
        for entry in entries or []:
            if "file" in entry:
                names.append(re.sub(r"\.(md|ipynb|rst)$", "", entry["file"]))
            walk(entry.get("sections"))
            walk(entry.get("chapters"))

    names.append(re.sub(r"\.(md|ipynb|rst)$", "", toc["root"]))
    walk(toc.get("chapters"))
    walk(toc.get("parts"))
    walk(toc.get("sections"))
    return names


def _canonical(url: str | None) -> str | None:
    if url is None:
        return None
    parts = urlsplit(url)
    path = parts.path
    if path.endswith("/"):
        path += "index.html"
    return path


def _screenshot(driver, path: Path, size: tuple[int, int] = WINDOW, mobile: bool = False) -> None:
    """A PNG of the page at the given width: its first screen, as the reader first sees it, or
    with `FULL_SCREENSHOTS` the whole page (the viewport is made as tall as the page first, since
    capturing beyond a normal viewport misplaces the theme's sticky sidebars, then set back)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not FULL_SCREENSHOTS:
        shot = driver.execute_cdp_cmd("Page.captureScreenshot", {"format": "png"})
        path.write_bytes(base64.b64decode(shot["data"]))
        return
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.execute_cdp_cmd(
        "Emulation.setDeviceMetricsOverride",
        {"width": size[0], "height": min(int(height), 30000), "deviceScaleFactor": 1,
         "mobile": mobile},
    )
    try:
        # Two animation frames: the page has been laid out and painted at the new size.
        driver.execute_async_script(
            "const done = arguments[0];"
            "requestAnimationFrame(() => requestAnimationFrame(() => done(true)));")
        # optimizeForSpeed: a faster, less compressed PNG (half the time on a 30,000 px page).
        shot = driver.execute_cdp_cmd("Page.captureScreenshot",
                                      {"format": "png", "optimizeForSpeed": True})
    finally:
        if mobile:
            driver.execute_cdp_cmd(
                "Emulation.setDeviceMetricsOverride",
                {"width": size[0], "height": size[1], "deviceScaleFactor": 1, "mobile": True},
            )
        else:
            driver.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})
    path.write_bytes(base64.b64decode(shot["data"]))


# ----------------------------------------------------------------------------- fixtures
SCREENSHOTS: list[Path] = []  # written by this session's visits
SHOTS = ARTIFACTS / "screenshots"


def _shot_path(size: tuple[int, int], name: str) -> Path:
    return SHOTS / f"{size[0]}x{size[1]}" / (name.replace("/", "__") + ".png")


def _layout_summary(visits: list[Visit], size: tuple[int, int]) -> tuple[str, dict]:
    """One line and the figures of the layout measurements of `visits`, made at `size`."""
    lay = [v.page["layout"] for v in visits]
    n_code = sum(x["codeCells"] for x in lay)
    n_out = sum(x["outputs"] for x in lay)
    figures = [f for x in lay for f in x["figures"]]
    figs = {
        "pages": len(lay),
        "pages scrolling sideways": sum(x["pageScroll"] > 0 or x["stickingCount"] > 0
                                        for x in lay),
        "code cells": n_code,
        "code cells scrolling": sum(len(x["wideCode"]) for x in lay),
        "code blocks of the prose": sum(x["codeBlocks"] for x in lay),
        "code blocks scrolling": sum(len(x["wideBlocks"]) for x in lay),
        "outputs": n_out,
        "outputs scrolling": sum(len(x["wideOutputs"]) for x in lay),
        "tables": sum(x["tables"] for x in lay),
        "tables clipped": sum(len(x["clippedTables"]) for x in lay),
        "display equations": sum(x["equations"] for x in lay),
        "equations wider than the column (scroll in their box)":
            sum(x["wideEquations"] for x in lay),
        "equations that neither fit nor scroll": sum(len(x["loose"]) for x in lay),
        "figures": len(figures),
        "figures under 90% of the column": sum(f["shown"] < 0.9 * f["column"] for f in figures),
        "figures that open full size": sum(f["fullSize"] for f in figures),
    }
    line = (
        f"layout at {size[0]}x{size[1]}: {figs['pages scrolling sideways']}/{len(lay)} pages "
        f"scroll sideways; code cells scrolling {figs['code cells scrolling']}/{n_code}; "
        f"code blocks scrolling {figs['code blocks scrolling']}/"
        f"{figs['code blocks of the prose']}; "
        f"outputs scrolling {figs['outputs scrolling']}/{n_out}; tables clipped "
        f"{figs['tables clipped']}/{figs['tables']}; equations scrolling in their box "
        f"{figs['equations wider than the column (scroll in their box)']}/"
        f"{figs['display equations']}; figures under 90% of the column "
        f"{figs['figures under 90% of the column']}/{len(figures)}"
    )
    return line, figs


def _visit_all(browser, book_url, request, size: tuple[int, int] | None) -> list[Visit]:
    ARTIFACTS.mkdir(exist_ok=True)
    # A page missing from the build fails test_every_toc_page_is_built_and_in_the_navigation.
    names = [n for n in toc_pages() if (HTML / f"{n}.html").is_file()]
    assert names, "no page of _toc.yml was built"
    shown = size or WINDOW
    result = []
    for name in names:
        shot = _shot_path(shown, name)
        SCREENSHOTS.append(shot)
        result.append(visit_page(browser, urljoin(book_url, f"{name}.html"), name,
                                 screenshot=shot, size=size))
    line, figs = _layout_summary(result, shown)
    layout_file = ARTIFACTS / "layout.json"
    recorded = json.loads(layout_file.read_text()) if layout_file.is_file() else {}
    recorded[f"{shown[0]}x{shown[1]}"] = {
        "summary": figs,
        "pages": {v.name: v.page["layout"] for v in result},
    }
    layout_file.write_text(json.dumps(recorded, indent=1), encoding="utf-8")
    request.config.stash.setdefault(SUMMARY_LINES, []).append(line)
    return result


@pytest.fixture(scope="session")
def book_url(built_book) -> Iterator[str]:
    if not (HTML / "index.html").is_file():
        pytest.fail(f"the book was not built:\n{(built_book.stdout + built_book.stderr)[-4000:]}")
    with serve(HTML) as url:
        yield url


@pytest.fixture(scope="session")
def browser() -> Iterator[object]:
    with chromium() as driver:
        yield driver


@pytest.fixture(scope="session")
def visits(book_url, browser, request) -> list[Visit]:
    """Every page of the table of contents, visited once in a 1280x800 window, in reading
    order, each with a screenshot."""
    result = _visit_all(browser, book_url, request, None)
    formulas = sum(v.page["containers"] for v in result)
    images = sum(len(v.page["images"]) for v in result)
    summary = (
        f"browser test: {len(result)} pages visited, {formulas} formulas typeset, "
        f"{images} images checked (Chromium, offline, served on 127.0.0.1)"
    )
    (ARTIFACTS / "browser-summary.txt").write_text(summary + "\n", encoding="utf-8")
    request.config.stash.setdefault(SUMMARY_LINES, []).append(summary)
    return result


@pytest.fixture(scope="session")
def phone_visits(book_url, browser, request) -> list[Visit]:
    """Every page of the table of contents, visited once more as a 390x844 phone."""
    return _visit_all(browser, book_url, request, PHONE)


# ----------------------------------------------------------------------------- the tests
def test_every_toc_page_is_built_and_in_the_navigation(visits, book_url):
    """Every page of _toc.yml was built, and every page's sidebar lists exactly those pages."""
    missing = [n for n in toc_pages() if not (HTML / f"{n}.html").is_file()]
    assert not missing, f"pages in _toc.yml that were not built: {missing}"
    expected = {_canonical(urljoin(book_url, f"{v.name}.html")) for v in visits}
    for v in visits:
        nav = {_canonical(u) for u in v.page["nav"]}
        assert nav == expected, (
            f"{v.name}: the sidebar lacks {sorted(expected - nav)} and has {sorted(nav - expected)}"
        )


def test_index_leads_to_the_intro(book_url, browser, visits):
    redirected = "return !document.querySelector('meta[http-equiv=\"Refresh\" i]')"
    v = visit_page(browser, book_url, "index.html", wait_for_js=redirected)
    assert _canonical(v.page["url"]) == _canonical(urljoin(book_url, f"{visits[0].name}.html"))
    assert not leaving_requests(v) and not console_errors(v), all_problems(v)


def test_formulas_are_typeset(visits):
    assert any(v.page["containers"] for v in visits), "no formula was typeset on any page"
    assert not (r := _report(visits, "math")), "formulas not typeset:\n" + r


def test_images_load_and_have_alt_text(visits):
    assert not (r := _report(visits, "images")), "image problems:\n" + r


def test_figures_are_shown_at_a_readable_size(visits):
    """At a 1280 px window the text column is about 670 px; a figure squeezed into it loses
    the size of its labels and annotations."""
    assert not (r := _report(visits, "figures")), "figures shrunk on the page:\n" + r


def test_outputs_are_not_walls_of_numbers(visits):
    assert not (r := _report(visits, "outputs")), "long outputs (summarise them):\n" + r


def test_no_text_is_lost_as_an_html_tag(visits):
    """`<eos>` in Markdown (a caption, a sentence) is raw HTML to MyST: write `` `<eos>` ``."""
    assert not (r := _report(visits, "markup")), "unknown HTML tags hide text:\n" + r


def test_no_request_leaves_localhost(visits):
    assert all(v.requests for v in visits), "the performance log recorded no request"
    assert not (r := _report(visits, "requests")), "requests outside the book:\n" + r


def test_no_console_errors(visits):
    assert not (r := _report(visits, "console")), "console errors:\n" + r


def test_next_and_previous_follow_the_toc(visits, book_url):
    urls = [_canonical(urljoin(book_url, f"{v.name}.html")) for v in visits]
    problems = []
    for i, v in enumerate(visits):
        want_prev = urls[i - 1] if i > 0 else None
        want_next = urls[i + 1] if i + 1 < len(urls) else None
        got_prev, got_next = _canonical(v.page["prev"]), _canonical(v.page["next"])
        if got_prev != want_prev:
            problems.append(f"{v.name}: previous is {got_prev}, expected {want_prev}")
        if got_next != want_next:
            problems.append(f"{v.name}: next is {got_next}, expected {want_next}")
    assert not problems, "\n".join(problems)


def test_search_finds_softmax(book_url, browser, visits):
    done = (
        "const s = document.querySelector('#search-results .search-summary');"
        "return !!(s && s.textContent.trim());"
    )
    hits = (
        "return [document.querySelector('#search-results').textContent,"
        " [...document.querySelectorAll('#search-results ul.search li a')].map((a) => a.href)]"
    )
    v = visit_page(browser, urljoin(book_url, "search.html?q=softmax"), "search", done, hits)
    summary, links = v.page["extra"]
    pages = {_canonical(h) for h in links}
    assert pages, "searching for softmax found nothing: " + summary
    built = {_canonical(urljoin(book_url, f"{x.name}.html")) for x in visits}
    assert pages <= built | {_canonical(urljoin(book_url, "genindex.html"))}, pages - built
    chapter1 = _canonical(urljoin(book_url, "book/01_attention.html"))
    if chapter1 in built:
        assert chapter1 in pages, f"chapter 1 is not among the results {sorted(pages)}"
    problems = {k: p for k, p in all_problems(v).items() if p}
    assert not problems, f"the search page: {problems}"


# The sidebar (☰) and "Contents" buttons, pressed as a reader would: what each must show. A
# drawer is a <dialog> the theme fills with the sidebar's content and opens modally.
DRAWERS = r"""
const seen = (el) => !!el && el.getClientRects().length > 0
  && getComputedStyle(el).visibility !== "hidden";
const drawer = (id) => document.getElementById(id);
return {
  primaryOpen: !!(drawer("pst-primary-sidebar-modal") || {}).open
    && seen(drawer("pst-primary-sidebar-modal")),
  secondaryOpen: !!(drawer("pst-secondary-sidebar-modal") || {}).open
    && seen(drawer("pst-secondary-sidebar-modal")),
  sidebarShown: seen(document.getElementById("pst-primary-sidebar"))
    && !document.getElementById("pst-primary-sidebar").classList.contains("pst-sidebar-hidden"),
  chapterLinks: [...document.querySelectorAll("#pst-primary-sidebar-modal a.reference.internal")]
    .filter(seen).map((a) => a.href),
  tocLinks: [...document.querySelectorAll("#pst-secondary-sidebar-modal nav a")]
    .filter(seen).length,
};
"""


def _visible_button(driver, kind: str):
    """The one button of `kind` (primary-toggle, secondary-toggle) that the reader sees."""
    shown = [b for b in driver.find_elements("css selector", f"button.{kind}") if b.is_displayed()]
    assert len(shown) == 1, f"{len(shown)} visible {kind} buttons"
    return shown[0]


def _open_page(driver, url: str) -> None:
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get(url)
    WebDriverWait(driver, 30).until(
        lambda d: d.execute_script("return document.readyState") == "complete"
    )


def _tap(driver, element) -> None:
    """A finger's tap on the middle of `element`: touch events, which the page (with touch
    emulation on) turns into the click it gets from a phone."""
    x, y = driver.execute_script(
        "const r = arguments[0].getBoundingClientRect();"
        "return [r.left + r.width / 2, r.top + r.height / 2];", element)
    for kind, points in (("touchStart", [{"x": x, "y": y}]), ("touchEnd", [])):
        driver.execute_cdp_cmd("Input.dispatchTouchEvent", {"type": kind, "touchPoints": points})


def check_menus(driver, book_url: str) -> list[str]:
    """Press the menus as a reader does: by tap at 390 px (a phone), with Enter at 900 px and
    with Space at 1100 px (the keyboard), by click at 1280 px. Below 992 px ☰ opens the chapter
    list in a drawer, where a chapter is reached; above, it folds the sidebar away and back.
    Below 1200 px "Contents" opens the page's sections, and Escape closes them. Returns what
    went wrong."""
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    problems = []
    page = urljoin(book_url, "book/03_multi_head_attention.html")
    target = _canonical(urljoin(book_url, "book/04_masking.html"))
    for width, height, how in ((390, 844, "tap"), (900, 800, "Enter"), (1100, 800, "Space"),
                               (1280, 800, "click")):
        driver.execute_cdp_cmd(
            "Emulation.setDeviceMetricsOverride",
            {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": width < 500},
        )
        if how == "tap":
            driver.execute_cdp_cmd("Emulation.setTouchEmulationEnabled", {"enabled": True})
        try:
            _open_page(driver, page)

            def press(element, how: str = how) -> None:
                if how == "tap":
                    _tap(driver, element)
                elif how == "click":
                    element.click()
                else:
                    driver.execute_script("arguments[0].focus()", element)
                    element.send_keys(Keys.ENTER if how == "Enter" else Keys.SPACE)
                time.sleep(0.3)  # the drawer's opening transition

            state = driver.execute_script(DRAWERS)
            if width >= 992:  # the sidebar is on the page: ☰ folds it away and back
                press(_visible_button(driver, "primary-toggle"))
                folded = driver.execute_script(DRAWERS)["sidebarShown"]
                press(_visible_button(driver, "primary-toggle"))
                back = driver.execute_script(DRAWERS)["sidebarShown"]
                shown = state["sidebarShown"]
                if (shown, folded, back) != (True, False, True):
                    problems.append(f"{width} px: ☰ by {how}: sidebar shown {shown}, after a "
                                    f"press {folded}, after another {back}")
            else:
                press(_visible_button(driver, "primary-toggle"))
                state = driver.execute_script(DRAWERS)
                if not state["primaryOpen"] or target not in map(_canonical,
                                                                 state["chapterLinks"]):
                    problems.append(f"{width} px: ☰ by {how} showed no chapter list ({state})")
                    continue
                link = next(a for a in driver.find_elements(
                    "css selector", "#pst-primary-sidebar-modal a.reference.internal")
                    if a.is_displayed() and _canonical(a.get_attribute("href")) == target)
                if how == "tap":
                    _tap(driver, link)
                elif how == "click":
                    link.click()
                else:
                    link.send_keys(Keys.ENTER)
                WebDriverWait(driver, 30).until(lambda d: _canonical(d.current_url) == target)
            if width >= 1200:  # the page's sections are on the page, no button for them
                continue
            button = _visible_button(driver, "secondary-toggle")
            press(button)
            state = driver.execute_script(DRAWERS)
            if not state["secondaryOpen"] or state["tocLinks"] < 3:
                problems.append(f"{width} px: Contents by {how} showed no contents ({state})")
                continue
            driver.switch_to.active_element.send_keys(Keys.ESCAPE)
            time.sleep(0.3)
            if driver.execute_script(DRAWERS)["secondaryOpen"]:
                problems.append(f"{width} px: Escape left the contents open")
            elif how in ("Enter", "Space") and driver.execute_script(
                    "return document.activeElement === arguments[0]", button) is not True:
                problems.append(f"{width} px: the focus did not come back to Contents")
        finally:
            driver.execute_cdp_cmd("Emulation.setTouchEmulationEnabled", {"enabled": False})
            driver.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})
    driver.get("about:blank")
    return problems


def test_menus_open_by_tap_click_and_keyboard(book_url, browser, visits):
    """☰ opens the chapter list (a chapter in it is reached) and "Contents" the page's sections,
    on a phone by tap and at 900 px by keyboard; at 1100 and 1280 px ☰ folds the sidebar away
    and back, and at 1100 px "Contents" opens by keyboard too (`check_menus`)."""
    assert not (problems := check_menus(browser, book_url)), "\n".join(problems)


def test_screenshots_are_saved(visits, phone_visits):
    """Every page at both sizes, as PNG files of real content (artifacts, never committed): the
    first screen, or with `FULL_SCREENSHOTS` the whole page (at least a screen tall)."""
    for size, seen in ((WINDOW, visits), (PHONE, phone_visits)):
        for v in seen:
            shot = _shot_path(size, v.name)
            assert shot in SCREENSHOTS, shot
            data = shot.read_bytes()
            assert data[:8] == b"\x89PNG\r\n\x1a\n", shot
            assert len(data) > 20_000, f"{shot} is (nearly) empty"
            # the PNG header's width and height
            width, height = (int.from_bytes(data[i:i + 4], "big") for i in (16, 20))
            assert width == size[0], f"{shot} is {width} px wide, not {size[0]}"
            # At least the viewport: the phone's whole screen, the window's less its own bars;
            # the first screen is exactly that.
            assert height >= 0.75 * size[1], f"{shot} is {height} px tall, less than a screen"
            assert FULL_SCREENSHOTS or height <= size[1], f"{shot} is {height} px tall"


def layout_problems(visit: Visit, phone: bool) -> list[str]:
    """What in one page's layout breaks the rules of its size (see the module's docstring)."""
    lay = visit.page["layout"]
    problems = []
    if lay["pageScroll"] > 0:
        problems.append(f"the page scrolls sideways by {lay['pageScroll']} px")
    problems += lay["sticking"]
    problems += lay["clippedTables"]
    problems += lay["loose"] + lay["uncued"] + lay["overNumbers"]
    if phone:
        for f in lay["figures"]:
            if f["shown"] < 0.9 * f["column"]:
                problems.append(f"figure {f['src']} is {f['shown']:.0f} px wide in a column of "
                                f"{f['column']:.0f} px")
            if not f["fullSize"]:
                problems.append(f"figure {f['src']} does not open full size")
    return problems


def test_equations_fit_the_column_at_1280(visits):
    """At 1280x800 every display equation fits its column (the long ones are split over lines),
    beside its number; the number never covers an equation at either size (`layout_problems`)."""
    wide = {v.name: v.page["layout"]["wideEquations"] for v in visits
            if v.page["layout"]["wideEquations"]}
    assert not wide, f"display equations wider than the column at 1280 px: {wide}"


def test_code_and_outputs_fit_the_column_at_1280(visits):
    """At 1280x800 no code cell, no output and no code block of the prose scrolls sideways
    (the notebooks' code is formatted to the column's 89 characters, comments and strings
    included, and their printed lines are held to it by test_notebooks_committed.py), and
    nothing else does."""
    lay = [v.page["layout"] for v in visits]
    n_code, n_out = sum(x["codeCells"] for x in lay), sum(x["outputs"] for x in lay)
    n_blocks = sum(x["codeBlocks"] for x in lay)
    wide_code = [f"{v.name} {w}" for v in visits for w in v.page["layout"]["wideCode"]]
    wide_out = [f"{v.name} {w}" for v in visits for w in v.page["layout"]["wideOutputs"]]
    wide_blocks = [f"{v.name} {w}" for v in visits for w in v.page["layout"]["wideBlocks"]]
    assert n_code > 100 and n_out > 100 and n_blocks > 50, (n_code, n_out, n_blocks)
    assert not wide_code, (
        f"{len(wide_code)} of {n_code} code cells scroll sideways:\n" + "\n".join(wide_code))
    assert not wide_out, (
        f"{len(wide_out)} of {n_out} outputs scroll sideways:\n" + "\n".join(wide_out))
    assert not wide_blocks, (
        f"{len(wide_blocks)} of {n_blocks} code blocks of the prose scroll sideways:\n"
        + "\n".join(wide_blocks))
    problems = [f"{v.name}: {p}" for v in visits for p in layout_problems(v, phone=False)]
    assert not problems, "\n".join(problems)


def test_pages_fit_a_phone(phone_visits):
    """At 390x844 no page scrolls sideways, an equation too wide scrolls in its own box, no
    table is clipped, and every figure fills the column and opens full size."""
    assert any(v.page["layout"]["figures"] for v in phone_visits), "no figure was measured"
    problems = [f"{v.name}: {p}" for v in phone_visits for p in layout_problems(v, phone=True)]
    assert not problems, "\n".join(problems)


def test_phone_pages_load_cleanly(phone_visits):
    """The same checks as at 1280 px that can differ on a phone: console, requests, images."""
    for kind in ("console", "requests", "images", "math"):
        assert not (r := _report(phone_visits, kind)), f"{kind} on a phone:\n" + r


def test_no_stray_outputs(visits):
    """No cell shows a bare None or an object's repr (end a plotting cell with plt.show(), end
    a cell with a statement rather than a call that returns None)."""
    assert not (r := _report(visits, "stray")), "stray outputs:\n" + r


def test_every_page_links_the_repository_and_its_source(visits):
    """The repository button and the download button (the page's .ipynb or .md) on every
    page; the download is served by the book itself."""
    problems = []
    for v in visits:
        repo, download = v.page["repository"], v.page["download"]
        if not (repo and urlsplit(repo).scheme == "https"):
            problems.append(f"{v.name}: no repository link ({repo})")
        kind = ".ipynb" if (ROOT / f"{v.name}.ipynb").is_file() else ".md"
        if not (download and download.endswith(Path(v.name).name + kind)):
            problems.append(f"{v.name}: the download button offers {download}, expected the "
                            f"page's {kind}")
        elif not (HTML / urlsplit(download).path.lstrip("/")).is_file():
            problems.append(f"{v.name}: {download} is not in the built book")
    assert not problems, "\n".join(problems)


# ----------------------------------------------------------------------------- attention explorers
# The pages that show utils.explorer.attention_explorer, and how many explorers each one has.
EXPLORER_PAGES = {
    "book/03_multi_head_attention": 1,
    "book/09_transformer": 1,
    "book/10_model_families": 2,
}

# Each explorer of the page: its id, its embedded data, and whether its static table is hidden
# (the script ran) and its interactive view is there.
READ_EXPLORERS = r"""
return [...document.querySelectorAll("div.tta")].map((root) => ({
  id: root.id,
  data: JSON.parse(root.querySelector("script.tta-data").textContent),
  staticRows: root.querySelectorAll(".tta-static-block table.tta-static tr").length,
  staticShown: getComputedStyle(root.querySelector(".tta-static-block")).display !== "none",
  queries: root.querySelectorAll(".tta-view button.tta-q").length,
  keys: root.querySelectorAll(".tta-view .tta-k").length,
}));
"""

# The weights written under the keys of explorer arguments[0], and the active query's index.
READ_SHOWN = r"""
const root = document.getElementById(arguments[0]);
const active = [...root.querySelectorAll("button.tta-q")].findIndex(
  (b) => b.classList.contains("tta-on"));
return {
  active,
  weights: [...root.querySelectorAll(".tta-k .tta-w")].map((e) => e.textContent),
  alphas: [...root.querySelectorAll(".tta-k")].map((e) => {
    const m = getComputedStyle(e).backgroundColor.match(/rgba?\(([^)]*)\)/);
    const parts = m ? m[1].split(",").map(Number) : [0, 0, 0, 0];
    return parts.length > 3 ? parts[3] : 1;
  }),
  titles: [...root.querySelectorAll(".tta-k")].map((e) => e.title),
};
"""

# Contrast ratios (WCAG) in explorer arguments[0]: a query token's text against the page
# background behind it, and the most highlighted key's text against its blended background.
CONTRAST = r"""
const root = document.getElementById(arguments[0]);
function rgba(c) {
  const m = c.match(/rgba?\(([^)]*)\)/);
  const p = m[1].split(",").map(Number);
  return p.length > 3 ? p : [...p, 1];
}
function behind(e) {   // the first opaque background from e up, else white
  for (let n = e; n; n = n.parentElement) {
    const c = rgba(getComputedStyle(n).backgroundColor);
    if (c[3] > 0.99) return c;
  }
  return [255, 255, 255, 1];
}
function over(top, base) {
  const a = top[3];
  return [0, 1, 2].map((i) => top[i] * a + base[i] * (1 - a)).concat([1]);
}
function lum(c) {
  const f = (v) => { v /= 255; return v <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4; };
  return 0.2126 * f(c[0]) + 0.7152 * f(c[1]) + 0.0722 * f(c[2]);
}
function ratio(a, b) {
  const [x, y] = [lum(a), lum(b)].sort((p, q) => q - p);
  return (x + 0.05) / (y + 0.05);
}
const q = root.querySelector("button.tta-q");
const page = behind(root);
const keys = [...root.querySelectorAll(".tta-k")];
const top = keys.reduce((a, b) =>
  rgba(getComputedStyle(b).backgroundColor)[3] > rgba(getComputedStyle(a).backgroundColor)[3]
    ? b : a);
const keyBg = over(rgba(getComputedStyle(top).backgroundColor), page);
return {
  theme: document.documentElement.dataset.theme,
  page: page,
  query: ratio(rgba(getComputedStyle(q).color), over(rgba(getComputedStyle(q).backgroundColor),
                                                   page)),
  key: ratio(rgba(getComputedStyle(top).color), keyBg),
};
"""


def _fmt(values: list[float], decimals: int) -> list[str]:
    return [f"{v:.{decimals}f}" for v in values]


def _hover(driver, element) -> None:
    from selenium.webdriver.common.action_chains import ActionChains

    driver.execute_script("arguments[0].scrollIntoView({block: 'center'});", element)
    ActionChains(driver).move_to_element(element).perform()


def _static_tables(page: str) -> list[list[str]]:
    """The numbers of each explorer's static table in the built HTML file (what a reader sees
    when scripts do not run)."""
    html = (HTML / f"{page}.html").read_text(encoding="utf-8")
    tables = re.findall(r'<table class="tta-static">(.*?)</table>', html, re.DOTALL)
    return [re.findall(r"<td[^>]*>([^<]*)</td>", t) for t in tables]


def test_attention_explorers_work_offline(book_url, browser):
    """Each attention explorer of the book, in Chromium with the network out of reach: hovering
    a query token shows the stored weights of that query and head under the keys, switching
    the head (or taking the mean) changes them, the keyboard moves between queries, the static
    table is in the HTML for readers without scripts, and the text stays readable in dark mode.
    """
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import Select, WebDriverWait

    for page, count in EXPLORER_PAGES.items():
        assert (HTML / f"{page}.html").is_file(), f"{page} was not built"
        # The static fallback: the first head's weights as a table, in the HTML itself.
        tables = _static_tables(page)
        assert len(tables) == count, f"{page}: {len(tables)} static tables, expected {count}"

        visit = Visit(name=page, url=urljoin(book_url, f"{page}.html"))
        browser.get(visit.url)
        WebDriverWait(browser, 30).until(
            lambda d: d.execute_script("return document.readyState") == "complete")
        explorers = browser.execute_script(READ_EXPLORERS)
        assert len(explorers) == count, f"{page}: {len(explorers)} explorers, expected {count}"
        for ex, table in zip(explorers, tables, strict=True):
            data, d = ex["data"], ex["data"]["decimals"]
            where = f"{page} #{ex['id']}"
            n_q, n_k, n_h = len(data["q"]), len(data["k"]), len(data["heads"])
            first = [v for r in data["w"][0][0] for v in r]
            assert table == _fmt(first, d), f"{where}: the static table is not head 1"
            assert ex["staticRows"] == n_q + 1, where
            assert not ex["staticShown"], f"{where}: the script did not replace the table"
            assert (ex["queries"], ex["keys"]) == (n_q, n_k), where

            root = browser.find_element(By.ID, ex["id"])
            buttons = root.find_elements(By.CSS_SELECTOR, "button.tta-q")
            i = n_q // 2
            _hover(browser, buttons[i])
            shown = browser.execute_script(READ_SHOWN, ex["id"])
            assert shown["active"] == i, f"{where}: hovering query {i} did not select it"
            expected = _fmt(data["w"][0][0][i], d)
            assert shown["weights"] == expected, f"{where}: query {i}, head 1"
            assert all(t.startswith(f"weight {w} ") for t, w in
                       zip(shown["titles"], expected, strict=True)), where
            best = max(range(n_k), key=lambda j: data["w"][0][0][i][j])
            assert shown["alphas"][best] == max(shown["alphas"]) > 0, (
                f"{where}: the largest weight is not the most highlighted key")

            heads = Select(root.find_element(By.CSS_SELECTOR, "select.tta-head"))
            assert len(heads.options) == n_h + 1, f"{where}: a head selector with the mean"
            heads.select_by_index(1)
            _hover(browser, buttons[i])
            shown = browser.execute_script(READ_SHOWN, ex["id"])
            assert shown["weights"] == _fmt(data["w"][0][1][i], d), f"{where}: head 2"
            assert shown["weights"] != expected, f"{where}: switching the head changed nothing"

            if len(data["layers"]) > 1:
                Select(root.find_element(By.CSS_SELECTOR, "select.tta-layer")).select_by_index(1)
                _hover(browser, buttons[i])
                shown = browser.execute_script(READ_SHOWN, ex["id"])
                assert shown["weights"] == _fmt(data["w"][1][1][i], d), f"{where}: layer 2"
                Select(root.find_element(By.CSS_SELECTOR, "select.tta-layer")).select_by_index(0)

            heads.select_by_index(n_h)                      # the mean of the heads
            _hover(browser, buttons[i])
            shown = browser.execute_script(READ_SHOWN, ex["id"])
            mean = [sum(data["w"][0][h][i][j] for h in range(n_h)) / n_h for j in range(n_k)]
            got = [float(v) for v in shown["weights"]]
            assert max(abs(a - b) for a, b in zip(got, mean, strict=True)) <= 10 ** -d + 1e-9, (
                f"{where}: the mean of the heads")
            heads.select_by_index(0)

            # The keyboard: focus a query, then the right arrow moves to the next one.
            browser.execute_script("arguments[0].focus();", buttons[0])
            buttons[0].send_keys(Keys.ARROW_RIGHT)
            shown = browser.execute_script(READ_SHOWN, ex["id"])
            assert browser.switch_to.active_element == buttons[1], f"{where}: arrow key"
            assert shown["active"] == 1 and shown["weights"] == _fmt(data["w"][0][0][1], d), where

            for theme in ("light", "dark"):
                browser.execute_script(
                    "document.documentElement.dataset.theme = arguments[0];", theme)
                time.sleep(0.2)  # the theme's colour transitions
                c = browser.execute_script(CONTRAST, ex["id"])
                assert c["theme"] == theme, c
                assert c["query"] >= 4.5, f"{where}, {theme}: query text contrast {c}"
                assert c["key"] >= 3.0, f"{where}, {theme}: highlighted key contrast {c}"
            browser.execute_script("document.documentElement.dataset.theme = 'light';")

        leave_cleanly(browser, visit)


# ----------------------------------------------------------------------------- the checks can fail
BROKEN_PAGE = r"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>broken</title>
<style>img { max-width: 100%%; }</style>
<script>window.MathJax = {options: {processHtmlClass: "math"}};</script>
<script defer src="%(mathjax)s"></script>
</head><body class="tex2jax_ignore mathjax_ignore"><main>
<p>An unclosed brace <span class="math">\(\frac{1}{2\)</span> is never typeset.</p>
<p>One too many <span class="math">\(\frac{1}{2}}\)</span>.</p>
<p>An unknown macro <span class="math">\(\nosuch{x}\)</span>.</p>
<p>Forgotten delimiters: \(x^2\)</p>
<p>The last row predicts <eos>.</p>
<img src="missing.png" alt="a figure that is not there">
<img src="pixel.png">
<img src="http://example.com/tracker.png" alt="an image from elsewhere">
<div class="cell_output" style="width: 600px">
<img src="wide.svg" alt="wide.svg">
<div class="output text_plain"><pre>%(wall)s</pre></div>
</div>
<div class="cell_output"><div class="output text_plain"><pre>None</pre></div></div>
<div class="cell_output"><div class="output text_plain">
<pre>&lt;Figure size 640x480 with 1 Axes&gt;</pre></div></div>
<p>Inline code that cannot wrap: <code style="white-space: nowrap">%(long_code)s</code></p>
<pre style="width: 200px; overflow-x: auto">make book; make test; make serve PORT=80</pre>
<div style="overflow: hidden; width: 300px"><table style="width: 900px"><tr><td>a table cut
off by its box</td></tr></table></div>
<p><span class="math">\[%(long_sum)s\]</span></p>
<div class="math" style="position: relative"><span class="eqno"
 style="position: absolute; left: 50%%; top: 0">(9.9)</span>\[a + b = c\]</div>
<script>console.error("something broke");</script>
</main></body></html>
"""
WIDE_SVG = (
    '<svg xmlns="http://www.w3.org/2000/svg" width="1200" height="100">'
    '<rect width="1200" height="100" fill="teal"/></svg>'
)

PIXEL_PNG = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg=="
)


def test_checks_catch_a_broken_page(browser, built_book, tmp_path):
    """A page that breaks every rule: each check must report it (the checks can fail)."""
    (tmp_path / "_static").symlink_to(HTML / "_static", target_is_directory=True)
    (tmp_path / "pixel.png").write_bytes(PIXEL_PNG)
    (tmp_path / "wide.svg").write_text(WIDE_SVG, encoding="utf-8")
    wall = "tensor(" + repr([[round(0.01 * (i * 13 + j), 2) for j in range(10)] for i in range(20)])
    for name, mathjax in [
        ("local.html", "_static/mathjax/tex-chtml.js"),
        ("cdn.html", "https://cdn.jsdelivr.net/npm/mathjax@3/es5/tex-chtml.js"),
    ]:
        page = BROKEN_PAGE % {
            "mathjax": mathjax, "wall": wall,
            "long_code": ".".join(["utils.attention.scaled_dot_product_attention"] * 4),
            "long_sum": " + ".join(f"x_{{{i}}}" for i in range(150)),
        }
        (tmp_path / name).write_text(page, encoding="utf-8")
    with serve(tmp_path) as url:
        local_visit = visit_page(browser, urljoin(url, "local.html"), "local")
        local = all_problems(local_visit)
        phone = layout_problems(
            visit_page(browser, urljoin(url, "local.html"), "local", size=PHONE), phone=True)
        cdn = all_problems(visit_page(browser, urljoin(url, "cdn.html"), "cdn"))
    text = {k: "\n".join(v) for k, v in local.items()}
    assert "not typeset: " in text["math"] and "{2\\)" in text["math"], local
    assert "MathJax error: Extra close brace" in text["math"], local
    assert "undefined macro in: \\nosuch{x}" in text["math"], local
    assert "raw TeX in the text" in text["math"], local
    assert "did not load: " in text["images"] and "missing.png" in text["images"], local
    assert "no alt text: " in text["images"] and "pixel.png" in text["images"], local
    assert "placeholder alt text 'wide.svg'" in text["images"], local
    assert "figure without a caption" in text["images"], local
    assert "figure drawn 1200 px wide is shown at 600 px (50%)" in text["figures"], local
    assert "an output of 1 lines and 200 numbers" in text["outputs"], local
    assert "text lost as an HTML tag <eos> in: The last row predicts" in text["markup"], local
    assert "example.com" in text["requests"], local
    assert "SEVERE: " in text["console"] and "something broke" in text["console"], local
    assert "a stray output: 'None'" in text["stray"], local
    assert "a stray output: '<Figure size 640x480 with 1 Axes>'" in text["stray"], local
    desktop = "\n".join(layout_problems(local_visit, phone=False))
    assert "the page scrolls sideways by" in desktop, desktop
    assert "table " in desktop and "px wide" in desktop, desktop  # the clipped table
    assert "neither fits nor scrolls in its own box" in desktop, desktop
    assert "scrolls with nothing to show it" in desktop, desktop
    assert "equation (9.9)" in desktop and "its number is drawn over it" in desktop, desktop
    assert "px past the edge: utils.attention" in desktop, desktop
    assert local_visit.page["layout"]["wideOutputs"], local_visit.page["layout"]  # the wall
    assert [w for w in local_visit.page["layout"]["wideBlocks"] if '"make book' in w], (
        local_visit.page["layout"])
    phone_text = "\n".join(phone)
    assert "the page scrolls sideways by" in phone_text, phone_text
    assert "wide.svg does not open full size" in phone_text, phone_text
    cdn_text = "\n".join(cdn["math"] + cdn["requests"])
    assert "cdn.jsdelivr.net" in cdn_text, cdn  # MathJax from a CDN is a request that leaves
    assert "not typeset" in cdn_text, cdn
