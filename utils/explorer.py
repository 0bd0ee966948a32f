"""The attention explorer: attention weights as an interactive, self-contained HTML view
(chapters 3, 9 and 10).

`attention_explorer` takes the (h, L_q, L_k) weights of one layer, or (layers, h, L_q, L_k) of a
stack, with the query and key tokens, and returns an `AttentionExplorer`, whose HTML (inline CSS,
JavaScript and the weights as JSON) a notebook stores and the book shows without a kernel or the
network. Hovering or clicking a query token colours the keys by its weights; without JavaScript a
static table of the first layer's first head is shown. The heatmaps are in `utils.plotting`."""

from __future__ import annotations

import hashlib
import html as html_lib
import json
import re
from collections.abc import Sequence

import torch

from ._validation import InputTypeError, require_int, shape_str
from .plotting import _as_weights, _check_text

__all__ = [
    "AttentionExplorer",
    "attention_explorer",
]


_ID_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{0,63}$")

# Scoped to the explorer's own element (the id is substituted), so two explorers on one page and
# the book's theme do not interfere. Text keeps the page's colour (`inherit`); highlights are a
# semi-transparent blue that reads on the light and on the dark theme alike.
_CSS = """
#ID { margin: 0.5em 0 1em; font-size: 0.9em; line-height: 1.4; color: inherit; }
#ID .tta-title { font-weight: 600; margin-bottom: 0.3em; }
#ID .tta-note, #ID .tta-readout { font-size: 0.9em; opacity: 0.85; margin: 0.3em 0; }
#ID .tta-controls { display: flex; flex-wrap: wrap; gap: 0.4em 1.2em; margin: 0.3em 0; }
#ID .tta-controls select { font: inherit; color: inherit; background: transparent;
  border: 1px solid rgba(128, 128, 128, 0.6); border-radius: 3px; padding: 0 0.2em; }
#ID .tta-controls option { color: #222; background: #fff; }
#ID .tta-label { font-size: 0.85em; opacity: 0.8; margin: 0.4em 0 0.15em; }
#ID .tta-row { display: flex; flex-wrap: wrap; gap: 3px; }
#ID .tta-q, #ID .tta-k { font: inherit; font-family: monospace; color: inherit;
  border: 1px solid rgba(128, 128, 128, 0.5); border-radius: 3px; padding: 1px 5px;
  background: transparent; text-align: center; min-width: 2.2em; }
#ID .tta-q { cursor: pointer; }
#ID .tta-q.tta-on { border-color: rgba(230, 120, 20, 1);
  box-shadow: 0 0 0 2px rgba(230, 120, 20, 0.6); }
#ID .tta-q:focus-visible { outline: 2px solid rgba(230, 120, 20, 1); outline-offset: 1px; }
#ID .tta-k { display: inline-flex; flex-direction: column; }
#ID .tta-w { font-size: 0.75em; opacity: 0.9; }
#ID table.tta-static { border-collapse: collapse; font-family: monospace; font-size: 0.8em; }
#ID table.tta-static th, #ID table.tta-static td { border: 1px solid rgba(128, 128, 128, 0.35);
  padding: 1px 4px; text-align: center; color: inherit; }
#ID table.tta-static caption { caption-side: top; text-align: left; font-size: 0.9em; }
#ID .tta-live { position: absolute; width: 1px; height: 1px; margin: -1px; padding: 0;
  overflow: hidden; clip: rect(0 0 0 0); white-space: nowrap; border: 0; }
"""

# Runs once when the output is shown. It finds its container by id, reads the JSON next to it,
# hides the static table and builds the interactive view. Nothing is loaded from anywhere.
#
# The keyboard: the query tokens are one toolbar, a single Tab stop (roving tabindex: the
# selected token has tabindex 0, the others -1); Left/Up and Right/Down move to the previous and
# next token, Home and End to the first and last, and moving selects (as hovering shows). The
# layer and head selects are ordinary controls. Each token is labelled "query i of n: token" and
# marked aria-pressed when its weights are shown; a polite live region says in words what a
# deliberate change (a key, a click, a select) now shows. Hovering only redraws.
_JS = r"""
(function () {
  var root = document.getElementById("ID");
  if (!root || root.dataset.ttaReady) { return; }
  root.dataset.ttaReady = "1";
  var data = JSON.parse(root.querySelector("script.tta-data").textContent);
  var d = data.decimals, nL = data.w.length, nH = data.w[0].length;
  var state = { layer: 0, head: 0, query: 0, pinned: 0 };
  function el(tag, cls, text) {
    var e = document.createElement(tag);
    if (cls) { e.className = cls; }
    if (text !== undefined) { e.textContent = text; }
    return e;
  }
  function row(l, h, i) {
    if (h < nH) { return data.w[l][h][i]; }
    var out = [];
    for (var j = 0; j < data.k.length; j++) {
      var s = 0;
      for (var k = 0; k < nH; k++) { s += data.w[l][k][i][j]; }
      out.push(Number((s / nH).toFixed(d)));
    }
    return out;
  }
  var view = el("div", "tta-view");
  var controls = el("div", "tta-controls");
  function selector(label, names, key, extra) {
    if (names.length + (extra ? 1 : 0) < 2) { return null; }
    var lab = el("label", null, label + " ");
    var sel = el("select", "tta-" + key);
    names.forEach(function (n, i) {
      var o = el("option", null, n);
      o.value = i;
      sel.appendChild(o);
    });
    if (extra) { var o = el("option", null, extra); o.value = names.length; sel.appendChild(o); }
    function pick() {
      if (state[key] === Number(sel.value)) { return; }
      state[key] = Number(sel.value);
      draw("select");
    }
    sel.addEventListener("change", pick);
    sel.addEventListener("input", pick);
    lab.appendChild(sel);
    controls.appendChild(lab);
    return sel;
  }
  selector("layer", data.layers, "layer");
  selector("head", data.heads, "head", nH > 1 ? "mean of the heads" : null);
  if (controls.firstChild) { view.appendChild(controls); }
  view.appendChild(el("div", "tta-label", data.labels.hint));
  var qrow = el("div", "tta-row tta-queries");
  qrow.setAttribute("role", "toolbar");
  qrow.setAttribute("aria-label", data.labels.group);
  var qs = data.q.map(function (t, i) {
    var b = el("button", "tta-q", t);
    b.type = "button";
    b.dataset.i = i;
    b.setAttribute("aria-label", data.labels.queries[i]);
    b.addEventListener("mouseenter", function () { state.query = i; draw(null); });
    b.addEventListener("mouseleave", function () { state.query = state.pinned; draw(null); });
    b.addEventListener("focus", function () { select(i); });
    b.addEventListener("click", function () { select(i); });
    qrow.appendChild(b);
    return b;
  });
  function select(i) {
    state.query = state.pinned = i;
    draw("query");
  }
  qrow.addEventListener("keydown", function (e) {
    if (e.altKey || e.ctrlKey || e.metaKey) { return; }
    var i = state.pinned, last = qs.length - 1;
    var n = e.key === "ArrowRight" || e.key === "ArrowDown" ? Math.min(i + 1, last)
      : e.key === "ArrowLeft" || e.key === "ArrowUp" ? Math.max(i - 1, 0)
      : e.key === "Home" ? 0 : e.key === "End" ? last : -1;
    if (n < 0) { return; }
    e.preventDefault();
    if (n !== i || document.activeElement !== qs[n]) { qs[n].focus(); }
  });
  view.appendChild(qrow);
  view.appendChild(el("div", "tta-label", "its weights over the keys:"));
  var krow = el("div", "tta-row tta-keys");
  var ks = data.k.map(function (t, j) {
    var s = el("span", "tta-k");
    s.dataset.j = j;
    s.appendChild(el("span", "tta-tok", t));
    s.appendChild(el("span", "tta-w", ""));
    krow.appendChild(s);
    return s;
  });
  view.appendChild(krow);
  var readout = el("div", "tta-readout");
  view.appendChild(readout);
  var live = el("div", "tta-live");
  live.setAttribute("aria-live", "polite");
  live.setAttribute("aria-atomic", "true");
  view.appendChild(live);
  function draw(announce) {
    var w = row(state.layer, state.head, state.query), best = 0;
    qs.forEach(function (b, i) {
      b.classList.toggle("tta-on", i === state.query);
      b.setAttribute("aria-pressed", i === state.query ? "true" : "false");
      b.tabIndex = i === state.pinned ? 0 : -1;
    });
    ks.forEach(function (s, j) {
      var v = w[j];
      if (v > w[best]) { best = j; }
      var a = Math.max(0, Math.min(1, v));
      s.style.background = "rgba(40, 130, 255, " + (0.7 * a).toFixed(3) + ")";
      s.style.borderWidth = a > 0.5 ? "2px" : "1px";
      s.lastChild.textContent = v.toFixed(d);
      s.title = "weight " + v.toFixed(d) + " from query " + data.q[state.query]
        + " to key " + data.k[j];
    });
    var head = state.head < nH ? data.heads[state.head] : "mean of the heads";
    var where = (nL > 1 ? data.layers[state.layer] + ", " : "") + head;
    // Every key whose shown weight ties with the largest is named, not only the first; where
    // two of them are the same token, each is named with its position (from 0) as well.
    var top = w[best].toFixed(d);
    var at = data.k.map(function (t, j) { return j; })
      .filter(function (j) { return w[j].toFixed(d) === top; });
    var tied = at.map(function (j) { return data.k[j]; });
    if (tied.some(function (t, i) { return tied.indexOf(t) !== i; })) {
      tied = at.map(function (j) { return data.k[j] + " at position " + j; });
    }
    var names = tied.length === 1 ? tied[0]
      : tied.slice(0, -1).join(", ") + " and " + tied[tied.length - 1];
    var most = data.q[state.query] + " attends most to " + names + ", " + top;
    readout.textContent = where + ": query " + data.q[state.query] + " puts its largest weight, "
      + top + ", on key" + (tied.length > 1 ? "s " : " ") + names + ".";
    // A new query is announced alone; a new layer or head says which one it is.
    if (announce) { live.textContent = (announce === "select" ? where + ": " : "") + most; }
  }
  var stat = root.querySelector(".tta-static-block");
  if (stat) { stat.style.display = "none"; }
  root.appendChild(view);
  draw(null);
})();
"""


class AttentionExplorer:
    """Attention weights as self-contained HTML with inline JavaScript (see
    :func:`attention_explorer`). A notebook displays it through ``_repr_html_``; ``html`` (and
    ``str()``) is the markup itself."""

    def __init__(self, html: str, element_id: str, shape: tuple[int, int, int, int]) -> None:
        self.html = html
        self.element_id = element_id
        self.shape = shape

    def _repr_html_(self) -> str:
        return self.html

    def __str__(self) -> str:
        return self.html

    def __repr__(self) -> str:
        layers, heads, l_q, l_k = self.shape
        return (f"AttentionExplorer({layers} layer(s), {heads} head(s), {l_q} queries x {l_k} "
                f"keys, {len(self.html.encode('utf-8'))} bytes of HTML)")


def _check_tokens(name: str, tokens: object, n: int, symbol: str) -> list[str]:
    if isinstance(tokens, str) or not isinstance(tokens, Sequence):
        raise InputTypeError(f"{name} must be a list of {symbol} = {n} strings, "
                             f"got {type(tokens).__name__}")
    if len(tokens) != n:
        raise ValueError(f"{name} has {len(tokens)} labels, expected {symbol} = {n}")
    out = []
    for t in tokens:
        if not isinstance(t, str):
            raise InputTypeError(f"{name} must hold strings, got {t!r} ({type(t).__name__})")
        out.append(t)
    return out


def _explorer_labels(queries: list[str]) -> dict[str, object]:
    """The words of the interactive view that say how to use it: the visible hint above the
    query tokens, the accessible name of the tokens' toolbar, and each token's label."""
    n = len(queries)
    return {
        "hint": "queries (hover or click one; from the keyboard, Tab to them, then use the "
                "arrow keys, Home and End):",
        "group": f"{n} quer{'y' if n == 1 else 'ies'}: the arrow keys, Home and End choose "
                 "the one whose weights are shown",
        "queries": [f"query {i + 1} of {n}: {t}" for i, t in enumerate(queries)],
    }


def _number(v: float, decimals: int) -> float:
    # round() then + 0.0 turns -0.0 into 0.0, so the JSON never says "-0.0".
    return round(v, decimals) + 0.0


def attention_explorer(
    weights: torch.Tensor,
    query_tokens: Sequence[str],
    key_tokens: Sequence[str] | None = None,
    *,
    layer_names: Sequence[str] | None = None,
    head_names: Sequence[str] | None = None,
    title: str | None = None,
    decimals: int = 3,
    element_id: str | None = None,
) -> AttentionExplorer:
    """Attention weights as an interactive, self-contained HTML view for a notebook or the book.

    Hovering or clicking a query token colours the key tokens by the weight that query gives
    them and writes each weight under its key; selectors choose the layer and the head (or the
    mean of the heads). Without JavaScript (an untrusted notebook, a page with scripts off) a
    static HTML table of the first layer's first head is shown instead. Nothing is loaded from
    the network and no kernel is needed once the output is stored.

    The keyboard: the query tokens are one Tab stop, a toolbar whose selected token alone has
    ``tabindex="0"`` (the others ``-1``); Left/Up and Right/Down select the previous and next
    query, Home and End the first and last. The layer and head selects are ordinary controls,
    so an explorer has 1 + (number of selects) Tab stops. Each token is labelled "query i of n:
    token" and is ``aria-pressed`` while its weights are shown, and a polite live region says
    what a key press, a click or a select shows ("bites attends most to dog, 0.620").

    Args:
        weights: (h, L_q, L_k) or (layers, h, L_q, L_k) attention weights, a tensor or array
            of finite real numbers (usually in [0, 1]; colours are clipped to that range).
        query_tokens: L_q strings, the queries (rows).
        key_tokens: L_k strings, the keys; None for self-attention (the query tokens, L_q =
            L_k required).
        layer_names, head_names: labels of the selectors; default "layer 1", ... and
            "head 1", ...
        title: an optional title above the view.
        decimals: the weights are rounded to this many decimals (0 to 6) in the embedded data
            and on screen, which keeps the HTML small and identical across runs.
        element_id: the id of the container; by default ``"tta-"`` and a hash of the content,
            so the same input always gives the same HTML (never random).

    Returns:
        An :class:`AttentionExplorer`; a notebook shows it when it is the cell's last
        expression.

    Raises:
        InputTypeError: for weights that are not real numbers, tokens that are not lists of
            strings, or options of the wrong type.
        ValueError: for weights of another rank, empty or not finite; token or name lists of
            the wrong length; ``decimals`` out of range; an ``element_id`` that is not a
            simple HTML id (a letter, then letters, digits, ``-`` or ``_``).
    """
    w = _as_weights(weights, "(h, L_q, L_k) or (layers, h, L_q, L_k)", None)
    if w.dim() == 3:
        w = w[None]
    layers, heads, l_q, l_k = w.shape
    if not bool(torch.isfinite(w).all()):
        raise ValueError("weights must be finite, got NaN or infinite entries")
    q = _check_tokens("query_tokens", query_tokens, l_q, "L_q")
    if key_tokens is None:
        if l_q != l_k:
            raise ValueError(f"key_tokens is required when L_q != L_k: weights of shape "
                             f"{shape_str(w)} have L_q = {l_q}, L_k = {l_k}")
        k = list(q)
    else:
        k = _check_tokens("key_tokens", key_tokens, l_k, "L_k")
    lnames = (_check_tokens("layer_names", layer_names, layers, "layers")
              if layer_names is not None else [f"layer {i + 1}" for i in range(layers)])
    hnames = (_check_tokens("head_names", head_names, heads, "h")
              if head_names is not None else [f"head {i + 1}" for i in range(heads)])
    if title is not None:
        _check_text("title", title)
    decimals = require_int("decimals", decimals, minimum=0)
    if not 0 <= decimals <= 6:
        raise ValueError(f"decimals must be between 0 and 6, got {decimals}")
    if element_id is not None:
        _check_text("element_id", element_id)
        if not _ID_RE.match(element_id):
            raise ValueError(f"element_id must be a letter followed by letters, digits, - or _ "
                             f"(at most 64 characters), got {element_id!r}")

    values = [[[[_number(v, decimals) for v in r] for r in m] for m in hd]
              for hd in w.double().tolist()]
    data = {"q": q, "k": k, "layers": lnames, "heads": hnames, "decimals": decimals,
            "w": values, "labels": _explorer_labels(q)}
    payload = json.dumps(data, ensure_ascii=True, separators=(",", ":"))
    # No "<", ">" or "&" inside the script element: a token such as "</script>" cannot end it
    # early, and "<eos>" reads the same to every parser. JSON.parse turns them back.
    payload = payload.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    if element_id is None:
        digest = hashlib.sha256((payload + "\0" + (title or "")).encode("utf-8")).hexdigest()
        element_id = "tta-" + digest[:12]

    esc = html_lib.escape
    parts = [f'<div class="tta" id="{element_id}">',
             "<style>" + _CSS.replace("#ID", "#" + element_id).strip() + "</style>"]
    if title:
        parts.append(f'<div class="tta-title">{esc(title)}</div>')
    # The static view: the first layer's first head as a table, shaded by weight.
    first = values[0][0]
    caption = (f"{esc(lnames[0]) + ', ' if layers > 1 else ''}{esc(hnames[0])}: "
               f"rows are queries, columns keys"
               + (" (the interactive view, with every head, needs JavaScript)"
                  if layers * heads > 1 else ""))
    rows = ["<tr><th></th>" + "".join(f'<th scope="col">{esc(t)}</th>' for t in k) + "</tr>"]
    for i, r in enumerate(first):
        cells = "".join(
            f'<td style="background:rgba(40,130,255,{0.7 * min(max(v, 0.0), 1.0):.2f})">'
            f"{v:.{decimals}f}</td>" for v in r)
        rows.append(f'<tr><th scope="row">{esc(q[i])}</th>{cells}</tr>')
    parts.append('<div class="tta-static-block"><table class="tta-static">'
                 f"<caption>{caption}</caption>" + "".join(rows) + "</table></div>")
    parts.append(f'<script type="application/json" class="tta-data">{payload}</script>')
    parts.append("<script>" + _JS.replace('"ID"', json.dumps(element_id)).strip() + "</script>")
    parts.append("</div>")
    return AttentionExplorer("\n".join(parts), element_id, (layers, heads, l_q, l_k))
