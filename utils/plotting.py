"""Figures that several chapters share: attention weights as heatmaps, and an interactive
attention explorer that a notebook stores as self-contained HTML."""

from __future__ import annotations

import hashlib
import html as html_lib
import json
import re
from collections.abc import Sequence

import matplotlib.pyplot as plt
import torch
from matplotlib.axes import Axes

from ._validation import (
    InputTypeError,
    require_bool,
    require_data,
    require_int,
    require_real,
    shape_str,
)

__all__ = ["AttentionExplorer", "attention_explorer", "plot_attention", "plot_attention_heads"]


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
#ID .tta-q:focus-visible { outline: 2px solid rgba(230, 120, 20, 1); }
#ID .tta-k { display: inline-flex; flex-direction: column; }
#ID .tta-w { font-size: 0.75em; opacity: 0.9; }
#ID table.tta-static { border-collapse: collapse; font-family: monospace; font-size: 0.8em; }
#ID table.tta-static th, #ID table.tta-static td { border: 1px solid rgba(128, 128, 128, 0.35);
  padding: 1px 4px; text-align: center; color: inherit; }
#ID table.tta-static caption { caption-side: top; text-align: left; font-size: 0.9em; }
"""

# Runs once when the output is shown. It finds its container by id, reads the JSON next to it,
# hides the static table and builds the interactive view. Nothing is loaded from anywhere.
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
    sel.addEventListener("change", function () { state[key] = Number(sel.value); draw(); });
    lab.appendChild(sel);
    controls.appendChild(lab);
    return sel;
  }
  selector("layer", data.layers, "layer");
  selector("head", data.heads, "head", nH > 1 ? "mean of the heads" : null);
  view.appendChild(controls);
  view.appendChild(el("div", "tta-label", "queries (hover, click or focus one; arrow keys move):"));
  var qrow = el("div", "tta-row tta-queries");
  var qs = data.q.map(function (t, i) {
    var b = el("button", "tta-q", t);
    b.type = "button";
    b.dataset.i = i;
    b.addEventListener("mouseenter", function () { state.query = i; draw(); });
    b.addEventListener("mouseleave", function () { state.query = state.pinned; draw(); });
    b.addEventListener("focus", function () { state.query = state.pinned = i; draw(); });
    b.addEventListener("click", function () { state.query = state.pinned = i; draw(); });
    b.addEventListener("keydown", function (e) {
      var n = e.key === "ArrowRight" || e.key === "ArrowDown" ? i + 1
        : e.key === "ArrowLeft" || e.key === "ArrowUp" ? i - 1 : -1;
      if (n >= 0 && n < qs.length) { e.preventDefault(); qs[n].focus(); }
    });
    qrow.appendChild(b);
    return b;
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
  readout.setAttribute("aria-live", "polite");
  view.appendChild(readout);
  function draw() {
    var w = row(state.layer, state.head, state.query), best = 0;
    qs.forEach(function (b, i) {
      b.classList.toggle("tta-on", i === state.query);
      b.setAttribute("aria-pressed", i === state.query ? "true" : "false");
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
    readout.textContent = (nL > 1 ? data.layers[state.layer] + ", " : "") + head + ": query "
      + data.q[state.query] + " puts its largest weight, " + w[best].toFixed(d) + ", on key "
      + data.k[best] + ".";
  }
  var stat = root.querySelector(".tta-static-block");
  if (stat) { stat.style.display = "none"; }
  root.appendChild(view);
  draw();
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

    Hovering, clicking or focusing (keyboard) a query token colours the key tokens by the weight
    that query gives them and writes each weight under its key; selectors choose the layer and
    the head (or the mean of the heads). Without JavaScript (an untrusted notebook, a page with
    scripts off) a static HTML table of the first layer's first head is shown instead. Nothing
    is loaded from the network and no kernel is needed once the output is stored.

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
            "w": values}
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
