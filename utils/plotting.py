"""Figures that several chapters share: attention weights as heatmaps, an interactive attention
explorer that a notebook stores as self-contained HTML, and the diagram of a whole encoder-decoder
Transformer drawn from its own modules."""

from __future__ import annotations

import hashlib
import html as html_lib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass

import matplotlib.pyplot as plt
import torch
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Circle, FancyArrowPatch, FancyBboxPatch
from torch import nn

from ._validation import (
    InputTypeError,
    require_bool,
    require_data,
    require_int,
    require_real,
    shape_str,
)

__all__ = [
    "AttentionExplorer",
    "architecture_figure",
    "attention_explorer",
    "plot_attention",
    "plot_attention_heads",
]


def _as_weights(weights: object, expected: str, rank: int | None) -> torch.Tensor:
    """``weights`` (a tensor or an array-like of real numbers) as a float CPU tensor of ``rank``
    dims (3 or 4 when ``rank`` is None), or an error naming the expected shape ``expected`` and
    what was given."""
    if isinstance(weights, str):
        raise InputTypeError(f"weights must be a tensor of shape {expected}, got a str")
    try:
        w = torch.as_tensor(weights)
    except (TypeError, ValueError, RuntimeError):
        raise InputTypeError(
            f"weights must be a tensor of shape {expected}, got {type(weights).__name__}"
        ) from None
    if w.is_complex():
        raise InputTypeError(f"weights must hold real numbers, got dtype {w.dtype}")
    require_data("weights", w)
    if (w.dim() not in (3, 4)) if rank is None else (w.dim() != rank):
        raise ValueError(f"weights must have shape {expected}, got {shape_str(w)}")
    if w.numel() == 0:
        raise ValueError(f"weights must have shape {expected} with no size 0 (there would be "
                         f"nothing to draw), got {shape_str(w)}")
    return w.detach().cpu().float()


def _check_labels(queries: object, keys: object, l_q: int, l_k: int) -> None:
    """Raise when tick labels are not a sequence of one label per row / column."""
    for name, labels, n, symbol in (("queries", queries, l_q, "L_q"), ("keys", keys, l_k, "L_k")):
        if labels is None:
            continue
        if isinstance(labels, str) or not isinstance(labels, Sequence):
            raise InputTypeError(
                f"{name} must be a list of {symbol} = {n} labels, got {type(labels).__name__}"
            )
        if len(labels) != n:
            raise ValueError(f"{name} has {len(labels)} labels, expected {symbol} = {n}")


def _check_text(name: str, value: object) -> None:
    if not isinstance(value, str):
        raise InputTypeError(f"{name} must be a string, got {value!r} ({type(value).__name__})")


def plot_attention(
    weights: torch.Tensor,
    queries: Sequence[str] | None = None,
    keys: Sequence[str] | None = None,
    title: str = "Attention weights",
    ax: Axes | None = None,
    colorbar: bool = True,
    annotate: bool = False,
    vmax: float | None = 1.0,
) -> Axes:
    """Draw one (L_q, L_k) weight matrix as a heatmap: queries down, keys across.

    Args:
        weights: (L_q, L_k) attention weights: a real tensor or array (a bool mask is drawn as
            0 and 1). NaN entries are left blank.
        queries, keys: optional tick labels (tokens) for the rows and columns: a list of L_q
            (L_k) labels.
        title: the axes title.
        ax: axes to draw on; a new figure is made when None.
        colorbar: add a colorbar.
        annotate: write each weight, rounded to 2 decimals, in its cell.
        vmax: top of the colour scale, a number > 0 (1.0 so that figures can be compared);
            None to fit.

    Returns:
        The axes drawn on.

    Raises:
        InputTypeError: for weights that are not real numbers, labels that are not a list,
            ``ax`` that is not matplotlib axes, or options of the wrong type.
        ValueError: for weights that are not 2-dim or are empty (L_q or L_k = 0: nothing to
            draw), labels of the wrong length, vmax <= 0.
    """
    w = _as_weights(weights, "(L_q, L_k)", 2).numpy()
    _check_labels(queries, keys, w.shape[0], w.shape[1])
    _check_text("title", title)
    if ax is not None and not isinstance(ax, Axes):
        raise InputTypeError(f"ax must be matplotlib Axes or None, got {type(ax).__name__}")
    require_bool("colorbar", colorbar)
    require_bool("annotate", annotate)
    if vmax is not None:
        vmax = require_real("vmax", vmax, low=0.0, low_open=True)
    if ax is None:
        # Big enough to read at page width for short sequences, never wider than 9 inches.
        width = min(9.0, max(4.5, 1.5 + 0.5 * w.shape[1]))
        height = min(7.0, max(3.5, 1.0 + 0.45 * w.shape[0]))
        _, ax = plt.subplots(figsize=(width, height), layout="constrained")
    im = ax.imshow(w, cmap="viridis", vmin=0.0, vmax=vmax, aspect="auto")
    ax.set_xlabel("key position" if keys is None else "key")
    ax.set_ylabel("query position" if queries is None else "query")
    ax.set_title(title)
    if keys is not None:
        ax.set_xticks(range(len(keys)), labels=list(keys), rotation=45, ha="right")
    if queries is not None:
        ax.set_yticks(range(len(queries)), labels=list(queries))
    if annotate:
        top = w.max() if vmax is None else vmax
        for i in range(w.shape[0]):
            for j in range(w.shape[1]):
                ax.text(j, i, f"{w[i, j]:.2f}", ha="center", va="center", fontsize=8,
                        color="black" if w[i, j] > 0.6 * top else "white")
    if colorbar:
        ax.figure.colorbar(im, ax=ax, fraction=0.046, pad=0.04, label="weight")
    return ax


def plot_attention_heads(
    weights: torch.Tensor,
    queries: Sequence[str] | None = None,
    keys: Sequence[str] | None = None,
    title: str = "Attention weights per head",
    ncols: int = 4,
):
    """Draw the weights of every head, (h, L_q, L_k), in a grid with one shared colorbar.

    Args:
        weights: (h, L_q, L_k) attention weights, one matrix per head, h >= 1 (for one layer's
            ``attn_weights`` of shape (B, h, L_q, L_k), pass ``attn_weights[b]``).
        queries, keys: optional tick labels (tokens) for the rows and columns, lists of L_q
            (L_k) labels.
        title: the figure's title.
        ncols: the most panels in one row, a positive int.

    Returns:
        The matplotlib figure.

    Raises:
        InputTypeError: for weights that are not real numbers, labels that are not a list, or
            an ``ncols`` that is not an int.
        ValueError: for weights that are not 3-dim or are empty (no head, L_q or L_k = 0),
            labels of the wrong length, or ``ncols`` < 1.
    """
    w = _as_weights(weights, "(h, L_q, L_k)", 3)
    ncols = require_int("ncols", ncols)
    _check_labels(queries, keys, w.shape[1], w.shape[2])
    _check_text("title", title)
    h = w.shape[0]
    ncols = min(ncols, h)
    nrows = (h + ncols - 1) // ncols
    fig, axes = plt.subplots(nrows, ncols, figsize=(3.0 * ncols + 1.0, 2.8 * nrows),
                             squeeze=False, layout="constrained")
    im = None
    for i, ax in enumerate(axes.flat):
        if i >= h:
            ax.axis("off")
            continue
        im = ax.imshow(w[i].numpy(), cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto")
        ax.set_title(f"head {i}")
        ax.set_xlabel("key")
        ax.set_ylabel("query")
        if keys is not None:
            ax.set_xticks(range(len(keys)), labels=list(keys), rotation=45, ha="right", fontsize=8)
        if queries is not None:
            ax.set_yticks(range(len(queries)), labels=list(queries), fontsize=8)
    fig.colorbar(im, ax=axes, fraction=0.03, label="weight")
    fig.suptitle(title)
    return fig


# ----------------------------------------------------------------------------- attention explorer
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
    var most = data.q[state.query] + " attends most to " + data.k[best] + ", "
      + w[best].toFixed(d);
    readout.textContent = where + ": query " + data.q[state.query] + " puts its largest weight, "
      + w[best].toFixed(d) + ", on key " + data.k[best] + ".";
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


# ----------------------------------------------------------------------------- architecture figure
# Colours of the boxes by what they hold, after the figure of Vaswani et al. (2017).
_FILL = {"attention": "#fce3c0", "ff": "#cde8f6", "norm": "#f3f0b8", "embedding": "#f7d3dc",
         "positions": "#ffffff", "output": "#ddd6ee", "outside": "#ffffff"}
_FONT = 8.0  # points: the smallest text of the figure
_LINE = _FONT * 1.25 / 72  # inches per line of text
_GAP = 0.15  # inches between two boxes of a column (the arrow between them)


@dataclass
class _Box:
    """One box of a column: its lines of text, its kind (the fill), dashed when the step is not
    a module of the model drawn. ``add`` marks the residual addition (a circle)."""

    lines: list[str]
    kind: str
    dashed: bool = False
    add: bool = False
    reads_memory: bool = False  # cross-attention: the encoder's output comes in from the side
    residual_from: int | None = None  # the index of the box whose input the addition adds
    y: float = 0.0  # bottom, set when the column is laid out
    height: float = 0.0

    @property
    def top(self) -> float:
        return self.y + self.height


def _traced_sublayers(layer: nn.Module, memory: bool) -> list[tuple[str, nn.Module, bool]]:
    """Run ``layer`` once on zeros and record, in the order its forward calls them, its children
    that are not dropouts: ``(name, module, reads_memory)``. ``reads_memory`` is True for an
    attention whose keys are the memory (cross-attention).

    The run changes nothing: the layer is in eval mode for it (no dropout, no random numbers
    drawn), gradients are off, and the weights an attention keeps (``attn_weights``) are put
    back afterwards.
    """
    p = next(layer.parameters(), None)
    dtype, device = (p.dtype, p.device) if p is not None else (torch.float32, None)
    d_model = int(layer.d_model)
    x = torch.zeros(1, 2, d_model, dtype=dtype, device=device)
    mem = torch.zeros(1, 3, d_model, dtype=dtype, device=device)
    calls: list[tuple[str, nn.Module, bool]] = []
    handles = []
    for name, child in layer.named_children():
        if isinstance(child, nn.Dropout):
            continue

        def hook(module, args, output, name=name):
            reads = memory and len(args) > 1 and args[1] is mem
            calls.append((name, module, reads))

        handles.append(child.register_forward_hook(hook))
    modes = {m: m.training for m in layer.modules()}
    kept = {m: m.attn_weights for m in layer.modules() if hasattr(m, "attn_weights")}
    try:
        layer.eval()
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            if memory:
                layer(x, mem)
            else:
                layer(x)
    finally:
        for h in handles:
            h.remove()
        for m, training in modes.items():
            m.training = training
        for m, w in kept.items():
            m.attn_weights = w
    return calls


def _layer_boxes(layer: nn.Module, decoder: bool) -> list[_Box]:
    """The boxes of one encoder or decoder layer, bottom to top, in the order its forward
    applies its sublayers: post-LN (sublayer, then add & norm) or pre-LN (norm, sublayer, add),
    read from the order of the calls."""
    from .attention import GroupedQueryAttention, MultiHeadAttention
    from .layers import LayerNorm, PositionwiseFeedForward, RMSNorm

    norms = (LayerNorm, RMSNorm, nn.LayerNorm, nn.RMSNorm)
    calls = _traced_sublayers(layer, decoder)
    kinds = ["norm" if isinstance(m, norms) else "sub" for _, m, _ in calls]
    pre = len(kinds) > 0 and kinds[0] == "norm"
    pattern = ["norm", "sub"] if pre else ["sub", "norm"]
    if len(kinds) % 2 or any(k != pattern[i % 2] for i, k in enumerate(kinds)):
        order = ", ".join(name for name, _, _ in calls)
        raise ValueError(f"expected each sublayer of a {type(layer).__name__} to come with one "
                         f"norm, before it (pre-LN) or after it (post-LN); its forward calls "
                         f"{order}")

    def sub_box(module: nn.Module, reads_memory: bool) -> _Box:
        if isinstance(module, (MultiHeadAttention, GroupedQueryAttention)):
            heads = f"h = {module.num_heads}"
            if getattr(module, "num_kv_heads", module.num_heads) != module.num_heads:
                heads += f", {module.num_kv_heads} key/value heads"
            if reads_memory:
                return _Box(["Multi-head cross-attention",
                             f"{heads}; keys, values: encoder"], "attention", reads_memory=True)
            what = "Masked multi-head self-attention" if decoder else "Multi-head self-attention"
            return _Box([what, f"{heads}, d_k = {module.d_k}"], "attention")
        if isinstance(module, PositionwiseFeedForward):
            return _Box([f"Feed-forward, {module.activation}",
                         f"{module.d_model} → {module.d_ff} → {module.d_model}"], "ff")
        raise ValueError(f"expected the sublayers of a {type(layer).__name__} to be attention "
                         f"or a PositionwiseFeedForward, got {type(module).__name__}")

    boxes: list[_Box] = []
    for i in range(0, len(calls), 2):
        if pre:
            (_, norm, _), (_, sub, reads) = calls[i], calls[i + 1]
            first = len(boxes)
            boxes.append(_Box([type(norm).__name__], "norm"))
            boxes.append(sub_box(sub, reads))
            boxes.append(_Box(["+"], "norm", add=True, residual_from=first))
        else:
            (_, sub, reads), (_, norm, _) = calls[i], calls[i + 1]
            first = len(boxes)
            boxes.append(sub_box(sub, reads))
            boxes.append(_Box([f"Add & {type(norm).__name__}"], "norm", residual_from=first))
    return boxes


def _stack_layers(stack: nn.Module, name: str, decoder: bool) -> tuple[int, list[_Box]]:
    """N and the boxes of the stack's layer; every layer must draw the same."""
    layers = list(getattr(stack, "layers", []))
    if not layers:
        raise ValueError(f"expected the {name} to have layers, got none")
    drawn = [_layer_boxes(layer, decoder) for layer in layers]
    for i, boxes in enumerate(drawn[1:], start=1):
        if [b.lines for b in boxes] != [b.lines for b in drawn[0]]:
            raise ValueError(f"expected every layer of the {name} to be alike (the figure draws "
                             f"one layer N times), but layer {i} differs from layer 0")
    return len(layers), drawn[0]


def _embedding_boxes(embed: nn.Module | None, side: str, d_model: int,
                     shared: bool) -> list[_Box]:
    """Token embedding and positions of one side, or a dashed box for a bare Transformer."""
    from .positional import LearnedPositionalEmbedding, SinusoidalPositionalEncoding

    if embed is None:
        return [_Box([f"{side} vectors, width {d_model}", "embedding + positions"], "outside",
                     dashed=True)]
    tokens = embed.tokens
    scaled = " × √d_model" if tokens.scale != 1.0 else ""
    boxes = [_Box([f"Token embedding{scaled}",
                   "shared with the source" if shared
                   else f"V = {tokens.vocab_size}, d_model = {tokens.d_model}"], "embedding")]
    positions = embed.positions
    if isinstance(positions, SinusoidalPositionalEncoding):
        boxes.append(_Box(["+ sinusoidal positional encoding"], "positions"))
    elif isinstance(positions, LearnedPositionalEmbedding):
        boxes.append(_Box(["+ learned positional embedding"], "positions"))
    elif positions is not None:
        boxes.append(_Box([f"+ {type(positions).__name__}"], "positions"))
    return boxes


def _output_boxes(head: nn.Module | None, d_model: int) -> list[_Box]:
    if head is None:
        return [_Box([f"output vectors, width {d_model}", "linear + softmax"], "outside",
                     dashed=True)]
    if getattr(head, "tied", False):
        table = head.embedding[0].weight
        box = _Box([f"Linear {table.shape[1]} → {table.shape[0]}",
                    "tied: the embedding, transposed"], "output")
    else:
        proj = head.proj
        box = _Box([f"Linear {proj.in_features} → {proj.out_features}"], "output")
    return [box, _Box(["Softmax (in the loss and in decoding)"], "outside", dashed=True)]


def _parts(model: object) -> tuple[nn.Module, nn.Module | None, nn.Module | None,
                                   nn.Module | None]:
    """(transformer, source embedding, target embedding, output head) of ``model``, or a
    ValueError saying what the figure expects."""
    from .transformer import Decoder, Encoder, Transformer

    expected = ("a utils.transformer.Transformer, or a model that holds one as .transformer "
                "(utils.models.Seq2SeqTransformer)")
    if isinstance(model, nn.Transformer):
        raise ValueError(f"architecture_figure expects {expected}, got torch's nn.Transformer; "
                         "copy it first with utils.transformer.Transformer.from_torch")
    if isinstance(model, Transformer):
        core, src, tgt, head = model, None, None, None
    elif isinstance(getattr(model, "transformer", None), Transformer):
        core = model.transformer
        src, tgt = getattr(model, "src_embed", None), getattr(model, "tgt_embed", None)
        head = getattr(model, "head", None)
    else:
        missing = ""
        if isinstance(model, nn.Module) and not any(
                isinstance(m, Decoder) for m in model.modules()):
            missing = ", which has no decoder"
        raise ValueError(f"architecture_figure draws an encoder-decoder Transformer: it "
                         f"expects {expected}, got {type(model).__name__}{missing}")
    for part, cls in (("encoder", Encoder), ("decoder", Decoder)):
        if not isinstance(getattr(core, part, None), cls):
            raise ValueError(f"architecture_figure expects the Transformer's {part} to be a "
                             f"utils.transformer.{cls.__name__}, got "
                             f"{type(getattr(core, part, None)).__name__}")
    return core, src, tgt, head


def architecture_figure(model: nn.Module, title: str | None = None,
                        width: float = 6.6) -> Figure:
    """Draw an encoder-decoder Transformer as the classic diagram, read from its own modules.

    Encoder on the left, decoder on the right, inputs at the bottom: the source and target
    token embeddings and positional encodings; the encoder layer with its sublayers in the
    order its ``forward`` applies them (found by running the layer once on zeros and recording
    the calls): self-attention with its number of heads, feed-forward d_model → d_ff → d_model
    with its activation, each with its residual connection and norm, drawn as "Add & Norm"
    after the sublayer (post-LN) or as a norm before it and an addition after it (pre-LN); the
    same for the decoder layer, with masked self-attention and cross-attention, whose keys and
    values come from the encoder's output (an arrow from the encoder); N× beside each stack;
    the final norms if the stacks have them; the output projection and the softmax. Every
    count and name is read from the modules, so the figure cannot drift from the code. Dashed
    boxes are steps that no module of ``model`` computes (a bare `Transformer` has no
    embeddings and no output projection; the softmax lives in the loss and in decoding).

    Drawing runs each layer once on zeros, in eval mode and without gradients; it draws no
    random numbers and leaves the model as it was (train/eval mode, kept attention weights).
    A model on PyTorch's meta device (shapes, no numbers) can be drawn too.

    Args:
        model: a `utils.transformer.Transformer`, or a model holding one as ``.transformer``
            with ``src_embed``, ``tgt_embed`` and ``head`` (`utils.models.Seq2SeqTransformer`).
        title: the figure's title; by default the model's class, depths and d_model.
        width: the figure's width in inches, 5.5 to 6.7 (the book's column is 6.7 inches at
            100 dpi); the height follows from the number of boxes.

    Returns:
        The matplotlib figure.

    Raises:
        ValueError: for a model this cannot draw, naming what it expected: torch's own
            ``nn.Transformer`` (copy it with ``Transformer.from_torch``), a model without a
            decoder (`utils.models.DecoderOnlyLM`, an `Encoder`), layers that differ from one
            another, or a layer whose sublayers do not each come with one norm.
        InputTypeError: for a title that is not a string or a width that is not a number.
    """
    core, src_embed, tgt_embed, head = _parts(model)
    if title is not None:
        _check_text("title", title)
    width = require_real("width", width)
    if not 5.5 <= width <= 6.7:
        raise ValueError(f"width must be between 5.5 and 6.7 inches, got {width}")
    d_model = int(core.d_model)
    n_enc, enc_boxes = _stack_layers(core.encoder, "encoder", decoder=False)
    n_dec, dec_boxes = _stack_layers(core.decoder, "decoder", decoder=True)
    pre = any(b.add for b in enc_boxes)
    shared = src_embed is not None and src_embed is tgt_embed
    if title is None:
        title = (f"{type(model).__name__}: {n_enc} + {n_dec} layers, d_model = {d_model}, "
                 f"{'pre' if pre else 'post'}-LN")

    def final(stack: nn.Module) -> list[_Box]:
        norm = getattr(stack, "norm", None)
        return [] if norm is None else [_Box([f"{type(norm).__name__} (final)"], "norm")]

    enc_in = _embedding_boxes(src_embed, "source", d_model, False)
    dec_in = _embedding_boxes(tgt_embed, "target", d_model, shared)
    enc_top, dec_top = final(core.encoder), final(core.decoder) + _output_boxes(head, d_model)

    # Columns, in inches: the encoder's residual lines run on its left, the decoder's on its
    # right, and the memory's arrow between the two stacks.
    box_w = (width - 2.0) / 2
    enc_x = 0.8
    dec_x = width - 0.8 - box_w
    lane = (enc_x + box_w + dec_x) / 2

    def height(b: _Box) -> float:
        return 0.2 if b.add else _LINE * len(b.lines) + 0.14

    def stack_up(boxes: list[_Box], y: float) -> float:
        for b in boxes:
            b.height = height(b)
            b.y = y
            y = b.top + _GAP
        return y - _GAP

    pad = 0.12  # inside the frame of a stack
    bottom = 0.75  # room for the input captions and the key to the dashed boxes
    columns = {}
    for side, inputs, layer, outputs in (("enc", enc_in, enc_boxes, enc_top),
                                         ("dec", dec_in, dec_boxes, dec_top)):
        y = stack_up(inputs, bottom)
        frame_bottom = y + _GAP
        y = stack_up(layer, frame_bottom + pad)
        frame_top = y + pad
        y = stack_up(outputs, frame_top + _GAP) if outputs else frame_top
        columns[side] = (inputs, layer, outputs, frame_bottom, frame_top, y)
    top = max(c[5] for c in columns.values())
    total_h = top + 0.45 + 0.3  # the output caption and the title

    fig = plt.figure(figsize=(width, total_h))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, width)
    ax.set_ylim(0, total_h)
    ax.axis("off")
    text_kw = dict(ha="center", va="center", fontsize=_FONT, color="black")
    arrow_kw = dict(arrowstyle="-|>", mutation_scale=8, color="0.25", lw=0.9,
                    shrinkA=0, shrinkB=0)

    def arrow(points: list[tuple[float, float]]) -> None:
        for a, b in zip(points[:-2], points[1:-1], strict=True):
            ax.plot([a[0], b[0]], [a[1], b[1]], color="0.25", lw=0.9, solid_capstyle="butt")
        ax.add_patch(FancyArrowPatch(points[-2], points[-1], **arrow_kw))

    def draw_box(b: _Box, x: float) -> None:
        cx = x + box_w / 2
        if b.add:
            ax.add_patch(Circle((cx, b.y + 0.1), 0.1, facecolor=_FILL["norm"],
                                edgecolor="0.2", lw=0.9))
            ax.text(cx, b.y + 0.1, "+", **{**text_kw, "fontsize": 9})
            return
        ax.add_patch(FancyBboxPatch((x, b.y), box_w, b.height,
                                    boxstyle="round,pad=0,rounding_size=0.05",
                                    facecolor=_FILL[b.kind], edgecolor="0.2", lw=0.9,
                                    linestyle="--" if b.dashed else "-"))
        ax.text(cx, b.y + b.height / 2, "\n".join(b.lines), linespacing=1.25, **text_kw)

    for side, x in (("enc", enc_x), ("dec", dec_x)):
        inputs, layer, outputs, f_bottom, f_top, _ = columns[side]
        cx = x + box_w / 2
        everything = inputs + layer + outputs
        for b in everything:
            draw_box(b, x)
        # The main flow: an arrow into the first box, then from each box to the next.
        arrow([(cx, bottom - 0.22), (cx, everything[0].y)])
        for a, b in zip(everything, everything[1:], strict=False):
            arrow([(cx, a.top), (cx, b.y)])
        if side == "dec":
            arrow([(cx, everything[-1].top), (cx, everything[-1].top + 0.22)])
        # The stack: a frame around the layer and N× beside it.
        fx = x - 0.3 if side == "enc" else x - 0.1
        ax.add_patch(FancyBboxPatch((fx, f_bottom), box_w + 0.4, f_top - f_bottom,
                                    boxstyle="round,pad=0,rounding_size=0.1",
                                    facecolor="#f4f4f4", edgecolor="0.45", lw=0.9, zorder=0))
        n = n_enc if side == "enc" else n_dec
        nx = fx - 0.2 if side == "enc" else fx + box_w + 0.4 + 0.2
        ax.text(nx, (f_bottom + f_top) / 2, f"{n}×", **{**text_kw, "fontsize": 10})
        # Residual connections: from just below the sublayer's input to the addition.
        rx = x - 0.15 if side == "enc" else x + box_w + 0.15
        for b in layer:
            if b.residual_from is None:
                continue
            start = layer[b.residual_from].y - _GAP / 2
            end_x = x if side == "enc" else x + box_w
            if b.add:
                end_x = cx - 0.1 if side == "enc" else cx + 0.1
            y_end = b.y + b.height / 2
            ax.plot([cx, rx, rx], [start, start, y_end], color="0.25", lw=0.9)
            ax.add_patch(FancyArrowPatch((rx, y_end), (end_x, y_end), **arrow_kw))
    # The memory: from the encoder's output to every cross-attention of the decoder.
    enc_cx = enc_x + box_w / 2
    enc_out = columns["enc"][2][-1].top if columns["enc"][2] else columns["enc"][4]
    for b in dec_boxes:
        if b.reads_memory:
            y = b.y + b.height / 2
            up = enc_out + 0.2
            ax.plot([enc_cx, enc_cx, lane, lane], [enc_out, up, up, y], color="0.25", lw=0.9)
            ax.add_patch(FancyArrowPatch((lane, y), (dec_x, y), **arrow_kw))
            ax.text(enc_cx - 0.06, up, "encoder output (memory)", **{**text_kw, "ha": "right"})
    ax.text(enc_x + box_w / 2, bottom - 0.32, "source tokens" if src_embed else "source",
            **text_kw)
    ax.text(dec_x + box_w / 2, bottom - 0.32,
            "target tokens, shifted right" if tgt_embed else "target, shifted right", **text_kw)
    ax.text(dec_x + box_w / 2, top + 0.32,
            "next-token probabilities" if head is not None else "output", **text_kw)
    ax.text(width / 2, total_h - 0.2, title, **{**text_kw, "fontsize": 10})
    ax.text(width / 2, 0.14, f"dashed: a step that no module of {type(model).__name__} computes",
            **{**text_kw, "color": "0.3"})
    return fig
