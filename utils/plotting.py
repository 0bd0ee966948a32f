"""Matplotlib figures of attention weights that the chapters share (chapters 1 to 4 and 8 to 11).

`plot_attention` draws one (L_q, L_k) weight matrix as a heatmap, queries down and keys across;
`plot_attention_heads` draws the (h, L_q, L_k) weights of one layer, a panel per head, with one
shared colorbar. The interactive HTML view of the weights is `utils.explorer`, the diagram of a
whole encoder-decoder Transformer `utils.diagrams`."""

from __future__ import annotations

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

__all__ = [
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
