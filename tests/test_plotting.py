"""Tests of utils.plotting: the attention heatmaps that the chapters share."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from utils.plotting import plot_attention, plot_attention_heads  # noqa: E402


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def _weights(*shape):
    return torch.softmax(torch.randn(*shape, generator=torch.Generator().manual_seed(0)), dim=-1)


def _colorbars(fig):
    """Axes that are colorbars: matplotlib tags them with a `_colorbar` attribute."""
    return [ax for ax in fig.axes if getattr(ax, "_colorbar", None) is not None]


def test_plot_attention_titles_labels_colorbar():
    w = _weights(3, 4)
    ax = plot_attention(w, queries=list("abc"), keys=list("wxyz"), title="My title")
    assert ax.get_title() == "My title"
    assert ax.get_xlabel() == "key" and ax.get_ylabel() == "query"
    assert [t.get_text() for t in ax.get_xticklabels()] == list("wxyz")
    assert [t.get_text() for t in ax.get_yticklabels()] == list("abc")
    bars = _colorbars(ax.figure)
    assert len(bars) == 1 and bars[0].get_ylabel() == "weight"
    image = ax.get_images()[0]
    np.testing.assert_allclose(image.get_array(), w.numpy())
    assert image.get_clim() == (0.0, 1.0)


def test_plot_attention_defaults_and_options():
    ax = plot_attention(_weights(2, 5), colorbar=False, vmax=None)
    assert ax.get_title() == "Attention weights"
    assert ax.get_xlabel() == "key position" and ax.get_ylabel() == "query position"
    assert _colorbars(ax.figure) == []
    assert ax.get_images()[0].get_clim()[1] < 1.0 + 1e-6


def test_plot_attention_on_given_axes_and_annotations():
    fig, (a, b) = plt.subplots(1, 2)
    w = _weights(2, 3)
    out = plot_attention(w, ax=b, annotate=True)
    assert out is b and not a.get_images()
    texts = [t.get_text() for t in b.texts]
    assert len(texts) == 6 and texts[0] == f"{w[0, 0].item():.2f}"


def test_plot_attention_accepts_numpy_and_grad_tensors():
    w = _weights(3, 3).requires_grad_(True)
    plot_attention(w)
    plot_attention(w.detach().numpy())


@pytest.mark.parametrize("shape", [(4,), (2, 3, 4), (1, 1, 2, 2)])
def test_plot_attention_rejects_bad_shapes(shape):
    with pytest.raises(ValueError, match=r"\(L_q, L_k\)") as info:
        plot_attention(torch.zeros(shape))
    assert "(" + ", ".join(map(str, shape)) + ")" in str(info.value)


def test_plot_attention_rejects_wrong_number_of_labels():
    with pytest.raises(ValueError, match="L_k = 4"):
        plot_attention(_weights(3, 4), keys=list("abc"))
    with pytest.raises(ValueError, match="L_q = 3"):
        plot_attention(_weights(3, 4), queries=list("ab"))


def test_plot_attention_heads_grid():
    fig = plot_attention_heads(_weights(6, 3, 4), queries=list("abc"), keys=list("wxyz"),
                               title="Heads", ncols=4)
    assert fig._suptitle.get_text() == "Heads"
    heads = [ax for ax in fig.axes if ax.get_images()]
    assert [ax.get_title() for ax in heads] == [f"head {i}" for i in range(6)]
    assert all(ax.get_xlabel() == "key" and ax.get_ylabel() == "query" for ax in heads)
    assert [t.get_text() for t in heads[0].get_xticklabels()] == list("wxyz")
    assert len(_colorbars(fig)) == 1
    # 6 heads in rows of 4: two unused panels are switched off
    hidden = [ax for ax in fig.axes if not ax.axison]
    assert len(hidden) == 2


def test_plot_attention_heads_single_head():
    fig = plot_attention_heads(_weights(1, 2, 2))
    assert len([ax for ax in fig.axes if ax.get_images()]) == 1


@pytest.mark.parametrize("shape", [(3, 4), (2, 2, 3, 4), (0, 3, 4)])
def test_plot_attention_heads_rejects_bad_shapes(shape):
    with pytest.raises(ValueError, match=r"\(h, L_q, L_k\)") as info:
        plot_attention_heads(torch.zeros(shape))
    assert "(" + ", ".join(map(str, shape)) + ")" in str(info.value)


def test_plot_attention_heads_rejects_bad_options():
    with pytest.raises(ValueError, match="ncols"):
        plot_attention_heads(_weights(2, 3, 3), ncols=0)
    with pytest.raises(ValueError, match="L_k = 3"):
        plot_attention_heads(_weights(2, 3, 3), keys=list("ab"))
