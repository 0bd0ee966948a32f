"""The attention explorers of the built book, driven by the keyboard alone, in Chromium.

`utils.explorer.attention_explorer` makes the query tokens one Tab stop (a toolbar with a roving
tabindex) and its layer and head selects ordinary controls. For each explorer of the book this
test, with no click and no focus set by a script:

- reaches the explorer with Tab (the page is opened at the explorer's id, which makes the
  explorer's container the point that the next Tab starts from, as following a link to it
  does; a Shift+Tab then puts the focus on the element just before the explorer) and counts
  its Tab stops from there: the selects, then the query tokens once, then out;
- moves between the tokens with the arrow keys, Home and End, and checks that the weights
  shown under the keys are the stored ones of the selected query, that only the selected token
  is in the Tab order and pressed, and that its focus is visible;
- changes the head (and the layer) from the keyboard, in the selects, and checks the weights
  again, the mean of the heads included;
- reads the labels a screen reader gets (the toolbar's name, "query i of n: token" on each
  token) and what the live region announces ("bites attends most to dog, 0.62").

The pages are those of ``EXPLORER_PAGES``; the network and console checks are
`test_browser`'s.
"""

from __future__ import annotations

import time
from urllib.parse import urljoin

import pytest
from test_browser import (  # noqa: F401 - book_url and browser are fixtures
    READ_EXPLORERS,
    READ_SHOWN,
    Visit,
    book_url,
    browser,
    leave_cleanly,
)

pytestmark = [pytest.mark.book, pytest.mark.browser]

# The pages that show an attention explorer, and how many each one shows.
EXPLORER_PAGES = {
    "book/03_multi_head_attention": 1,
    "book/09_transformer": 1,
    "book/10_model_families": 2,
}

# Where the keyboard focus is, relative to explorer arguments[0]: inside it or not, and what
# the focused element is there (a select by its class, or the index of a query token).
FOCUS = r"""
const root = document.getElementById(arguments[0]);
const a = document.activeElement;
if (!a || !root.contains(a)) {
  return {inside: false, tag: a ? a.tagName.toLowerCase() : null};
}
const tokens = [...root.querySelectorAll("button.tta-q")];
return {
  inside: true,
  tag: a.tagName.toLowerCase(),
  kind: a.classList.contains("tta-q") ? "query" : a.className,
  index: tokens.indexOf(a),
  outline: getComputedStyle(a).outlineStyle,
};
"""

# What a screen reader gets from explorer arguments[0], and the state of its tokens.
READ_ACCESSIBLE = r"""
const root = document.getElementById(arguments[0]);
const group = root.querySelector(".tta-queries");
const live = root.querySelector("[aria-live]");
const tokens = [...root.querySelectorAll("button.tta-q")];
return {
  role: group.getAttribute("role"),
  groupLabel: group.getAttribute("aria-label"),
  labels: tokens.map((b) => b.getAttribute("aria-label")),
  tabindex: tokens.map((b) => b.getAttribute("tabindex")),
  pressed: tokens.map((b) => b.getAttribute("aria-pressed")),
  live: live ? {polite: live.getAttribute("aria-live"), text: live.textContent} : null,
  selects: [...root.querySelectorAll("select")].map((s) => s.className),
  headValue: (root.querySelector("select.tta-head") || {}).value,
  layerValue: (root.querySelector("select.tta-layer") || {}).value,
};
"""


def _fmt(values: list[float], decimals: int) -> list[str]:
    return [f"{v:.{decimals}f}" for v in values]


def _most(keys: list[str], weights: list[float], decimals: int) -> str:
    """What the explorer announces of the largest weight: every key whose shown weight ties
    with it ("dog and cat", or "4 at position 1 and 4 at position 3" where tied keys are the
    same token), then the weight ("0.500")."""
    top = f"{max(weights):.{decimals}f}"
    at = [j for j, v in enumerate(weights) if f"{v:.{decimals}f}" == top]
    tied = [keys[j] for j in at]
    if len(set(tied)) < len(tied):
        tied = [f"{keys[j]} at position {j}" for j in at]
    names = tied[0] if len(tied) == 1 else ", ".join(tied[:-1]) + " and " + tied[-1]
    return f"{names}, {top}"


class Keyboard:
    """Key presses sent to whatever has the focus, as a reader's keyboard does."""

    def __init__(self, driver, element_id: str):
        from selenium.webdriver.common.action_chains import ActionChains
        from selenium.webdriver.common.keys import Keys

        self.driver, self.id, self.keys, self.chains = driver, element_id, Keys, ActionChains

    def press(self, *keys: str) -> dict:
        chain = self.chains(self.driver)
        for key in keys:
            chain = chain.send_keys(key)
        chain.perform()
        return self.focus()

    def shift_tab(self) -> dict:
        k = self.keys
        self.chains(self.driver).key_down(k.SHIFT).send_keys(k.TAB).key_up(k.SHIFT).perform()
        return self.focus()

    def focus(self) -> dict:
        return self.driver.execute_script(FOCUS, self.id)

    def shown(self) -> dict:
        return self.driver.execute_script(READ_SHOWN, self.id)

    def accessible(self) -> dict:
        return self.driver.execute_script(READ_ACCESSIBLE, self.id)


def check_explorer_by_keyboard(driver, url: str, ex: dict, where: str) -> None:
    """Drive explorer ``ex`` (an entry of READ_EXPLORERS) of the page at ``url`` by keyboard."""
    data, d = ex["data"], ex["data"]["decimals"]
    q, k, w = data["q"], data["k"], data["w"]
    n_q, n_h, n_l = len(q), len(data["heads"]), len(data["layers"])
    kb = Keyboard(driver, ex["id"])
    keys = kb.keys

    # Open the page at the explorer: the next Tab starts from its container. One Tab in, one
    # Shift+Tab out: the focus is then on the element just before the explorer.
    driver.get(url + "#" + ex["id"])
    time.sleep(0.2)
    assert not kb.focus()["inside"], f"{where}: the focus is inside before any key"
    assert kb.press(keys.TAB)["inside"], f"{where}: Tab from the explorer's id did not enter it"
    before = kb.shift_tab()
    assert not before["inside"], f"{where}: Shift+Tab from the first stop stays inside"

    # From there, the Tab stops: each select once, then the query tokens once, then out.
    acc = kb.accessible()
    n_selects = len(acc["selects"])
    assert n_selects == (n_l > 1) + (n_h > 1), f"{where}: selects {acc['selects']}"
    stops = []
    for _ in range(n_selects + 3):
        f = kb.press(keys.TAB)
        if not f["inside"]:
            break
        stops.append(f["kind"] if f["kind"] != "query" else f"query {f['index']}")
    expected_stops = [*acc["selects"], "query 0"]
    assert stops == expected_stops, f"{where}: Tab stops {stops}, expected {expected_stops}"
    # Shift+Tab comes back to the tokens, one stop again, then to the selects and out.
    f = kb.shift_tab()
    assert (f["inside"], f.get("index")) == (True, 0), f"{where}: Shift+Tab back: {f}"
    assert f["outline"] not in ("none", ""), f"{where}: the focused token shows no outline"

    # The labels a screen reader reads.
    acc = kb.accessible()
    assert acc["role"] == "toolbar", where
    label = acc["groupLabel"] or ""
    assert label.startswith(f"{n_q} quer") and "arrow keys" in label, f"{where}: {label!r}"
    assert acc["labels"] == [f"query {i + 1} of {n_q}: {t}" for i, t in enumerate(q)], where
    assert acc["live"] and acc["live"]["polite"] == "polite", f"{where}: no polite live region"

    def expect(i: int, layer: int, head: int, key: str) -> None:
        """After ``key``: query i is focused, pressed, the only Tab stop, and shows the stored
        weights of (layer, head) (head == n_h: the mean of the heads)."""
        f = kb.focus()
        assert f["inside"] and f["index"] == i, f"{where}, {key}: focus on {f}, expected {i}"
        shown, acc = kb.shown(), kb.accessible()
        assert shown["active"] == i, f"{where}, {key}: query {shown['active']} shown"
        assert acc["tabindex"] == ["0" if j == i else "-1" for j in range(n_q)], (
            f"{where}, {key}: tabindex {acc['tabindex']}")
        assert acc["pressed"] == ["true" if j == i else "false" for j in range(n_q)], (
            f"{where}, {key}: aria-pressed {acc['pressed']}")
        if head < n_h:
            row = w[layer][head][i]
            assert shown["weights"] == _fmt(row, d), f"{where}, {key}: layer {layer}, head {head}"
        else:
            row = [sum(w[layer][h][i][j] for h in range(n_h)) / n_h for j in range(len(k))]
            got = [float(v) for v in shown["weights"]]
            assert max(abs(a - b) for a, b in zip(got, row, strict=True)) <= 10**-d + 1e-9, (
                f"{where}, {key}: the mean of the heads")
            row = got
        assert all(t.startswith(f"weight {v} from query {q[i]} ") for t, v in
                   zip(shown["titles"], shown["weights"], strict=True)), where
        announced = f"{q[i]} attends most to {_most(k, row, d)}"
        assert acc["live"]["text"].endswith(announced), (
            f"{where}, {key}: announced {acc['live']['text']!r}, expected {announced!r}")

    # The arrow keys, Home and End, with layer 1, head 1.
    moves = [(keys.ARROW_RIGHT, 1), (keys.ARROW_RIGHT, 2), (keys.ARROW_LEFT, 1),
             (keys.ARROW_DOWN, 2), (keys.ARROW_UP, 1), (keys.END, n_q - 1),
             (keys.ARROW_RIGHT, n_q - 1), (keys.HOME, 0), (keys.ARROW_LEFT, 0)]
    names = {keys.ARROW_RIGHT: "Right", keys.ARROW_LEFT: "Left", keys.ARROW_DOWN: "Down",
             keys.ARROW_UP: "Up", keys.HOME: "Home", keys.END: "End"}
    for key, i in moves:
        kb.press(key)
        expect(min(i, n_q - 1), 0, 0, names[key])
    i = min(2, n_q - 1)
    for _ in range(i):
        kb.press(keys.ARROW_RIGHT)
    expect(i, 0, 0, "Right")

    # The selects, from the keyboard: Shift+Tab to the head select, Down to the next head.
    f = kb.shift_tab()
    assert f["inside"] and f["kind"] == "tta-head", f"{where}: Shift+Tab to the head: {f}"
    kb.press(keys.ARROW_DOWN)
    assert kb.accessible()["headValue"] == "1", f"{where}: Down did not change the head"
    assert kb.press(keys.TAB)["index"] == i, f"{where}: Tab back to the selected token"
    expect(i, 0, 1, "head 2")
    layer = 0
    if n_l > 1:
        kb.shift_tab()
        f = kb.shift_tab()
        assert f["inside"] and f["kind"] == "tta-layer", f"{where}: to the layer select: {f}"
        kb.press(keys.ARROW_DOWN)
        assert kb.accessible()["layerValue"] == "1", f"{where}: Down did not change the layer"
        kb.press(keys.TAB, keys.TAB)
        layer = 1
        expect(i, layer, 1, "layer 2, head 2")
    # The last option of the head select: the mean of the heads; the announcement names it.
    kb.shift_tab()
    kb.press(keys.END)
    acc = kb.accessible()
    assert acc["headValue"] == str(n_h), f"{where}: End did not pick the mean of the heads"
    assert acc["live"]["text"].startswith(
        (f"{data['layers'][layer]}, " if n_l > 1 else "") + "mean of the heads: "), (
        f"{where}: the select's announcement {acc['live']['text']!r}")
    kb.press(keys.TAB)
    expect(i, layer, n_h, "the mean of the heads")

    # And out: one Tab past the tokens leaves the explorer.
    assert not kb.press(keys.TAB)["inside"], f"{where}: Tab after the tokens stays inside"


def test_attention_explorers_by_keyboard(book_url, browser):  # noqa: F811 - fixtures
    """Every explorer of the book, from the keyboard alone (see the module docstring)."""
    for page, count in EXPLORER_PAGES.items():
        visit = Visit(name=page, url=urljoin(book_url, f"{page}.html"))
        check_page(browser, visit.url, page, count)
        leave_cleanly(browser, visit)


def check_page(driver, url: str, page: str, count: int | None = None) -> None:
    """Each explorer of the page at ``url``, by keyboard (``count``: how many it must have)."""
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get(url)
    WebDriverWait(driver, 30).until(
        lambda d: d.execute_script("return document.readyState") == "complete")
    explorers = driver.execute_script(READ_EXPLORERS)
    if count is not None:
        assert len(explorers) == count, f"{page}: {len(explorers)} explorers, expected {count}"
    assert explorers, f"{page}: no explorer"
    for ex in explorers:
        check_explorer_by_keyboard(driver, url, ex, f"{page} #{ex['id']}")


def test_a_tie_for_the_largest_weight_names_every_tied_key(browser, tmp_path):  # noqa: F811
    """Two keys tied for the largest weight (0.400 each, and one of them only after rounding):
    the readout and the announcement name both, in order, not the first alone."""
    import torch
    from selenium.webdriver.common.by import By
    from test_browser import serve

    from utils.explorer import attention_explorer

    weights = torch.tensor([[[0.1, 0.4, 0.1, 0.4], [0.2, 0.4, 0.1, 0.39996]]])
    explorer = attention_explorer(weights, ["q1", "q2"], ["a", "b", "c", "d"],
                                  element_id="tie")
    (tmp_path / "tie.html").write_text(f"<!doctype html><html><body>{explorer.html}</body></html>",
                                       encoding="utf-8")
    read = ("const r = document.getElementById('tie');"
            "return [r.querySelector('.tta-readout').textContent,"
            " r.querySelector('.tta-live').textContent];")
    with serve(tmp_path) as url:
        browser.get(url + "tie.html")
        said = []
        for button in browser.find_element(By.ID, "tie").find_elements(
                By.CSS_SELECTOR, "button.tta-q"):
            button.click()
            said.append(browser.execute_script(read))
        browser.get("about:blank")
    for (readout, live), query in zip(said, ("q1", "q2"), strict=True):
        assert readout.endswith(f"query {query} puts its largest weight, 0.400, on keys b and d.")
        assert live.endswith(f"{query} attends most to b and d, 0.400"), live
    assert _most(["a", "b", "c"], [0.2, 0.5, 0.3], 3) == "b, 0.500"


def test_tied_keys_that_are_the_same_token_are_named_by_position(browser, tmp_path):  # noqa: F811
    """A sequence can repeat a token ("4 4" in the reversal task): when the tied keys are the
    same token, the readout says where each one is, not "keys 4 and 4"."""
    import torch
    from selenium.webdriver.common.by import By
    from test_browser import serve

    from utils.explorer import attention_explorer

    weights = torch.tensor([[[0.1, 0.4, 0.1, 0.4]]])
    explorer = attention_explorer(weights, ["q"], ["7", "4", "5", "4"], element_id="same")
    (tmp_path / "same.html").write_text(
        f"<!doctype html><html><body>{explorer.html}</body></html>", encoding="utf-8")
    with serve(tmp_path) as url:
        browser.get(url + "same.html")
        browser.find_element(By.ID, "same").find_element(By.CSS_SELECTOR, "button.tta-q").click()
        readout = browser.execute_script(
            "return document.querySelector('#same .tta-readout').textContent;")
        browser.get("about:blank")
    expected = "4 at position 1 and 4 at position 3"
    assert readout.endswith(f"puts its largest weight, 0.400, on keys {expected}."), readout
    assert _most(["7", "4", "5", "4"], [0.1, 0.4, 0.1, 0.4], 3) == f"{expected}, 0.400"
