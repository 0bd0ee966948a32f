"""Figures that several chapters share: attention weights as heatmaps."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
import torch
from matplotlib.axes import Axes

from ._validation import shape_str

__all__ = ["plot_attention", "plot_attention_heads"]


def _as_2d(weights: torch.Tensor, name: str = "weights"):
    w = torch.as_tensor(weights).detach().cpu().float()
    if w.dim() != 2:
        raise ValueError(f"{name} must have shape (L_q, L_k), got {shape_str(w)}")
    return w.numpy()


def _check_labels(queries, keys, l_q: int, l_k: int) -> None:
    """Raise `ValueError` when tick labels do not match the number of rows / columns."""
    if queries is not None and len(queries) != l_q:
        raise ValueError(f"queries has {len(queries)} labels, expected L_q = {l_q}")
    if keys is not None and len(keys) != l_k:
        raise ValueError(f"keys has {len(keys)} labels, expected L_k = {l_k}")


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
        weights: (L_q, L_k) attention weights.
        queries, keys: optional tick labels (tokens) for the rows and columns.
        title: the axes title.
        ax: axes to draw on; a new figure is made when None.
        colorbar: add a colorbar.
        annotate: write each weight, rounded to 2 decimals, in its cell.
        vmax: top of the colour scale (1.0 so that figures can be compared); None to fit.

    Returns:
        The axes drawn on.
    """
    w = _as_2d(weights)
    _check_labels(queries, keys, w.shape[0], w.shape[1])
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
        weights: (h, L_q, L_k) attention weights, one matrix per head.
        queries, keys: optional tick labels (tokens) for the rows and columns.
        title: the figure's title.
        ncols: the most panels in one row.

    Returns:
        The matplotlib figure.
    """
    w = torch.as_tensor(weights).detach().cpu().float()
    if w.dim() != 3 or w.shape[0] == 0:
        raise ValueError(f"weights must have shape (h, L_q, L_k) with h >= 1, got {shape_str(w)}")
    if ncols < 1:
        raise ValueError(f"ncols must be at least 1, got {ncols}")
    _check_labels(queries, keys, w.shape[1], w.shape[2])
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
