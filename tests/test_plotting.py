"""Tests of utils.plotting: the attention heatmaps that the chapters share."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import json  # noqa: E402
import re  # noqa: E402

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from utils._validation import InputTypeError  # noqa: E402
from utils.plotting import (  # noqa: E402
    AttentionExplorer,
    attention_explorer,
    plot_attention,
    plot_attention_heads,
)


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


# ----------------------------------------------------------------------------- attention_explorer
def _data(explorer: AttentionExplorer) -> dict:
    """The JSON that the explorer embeds for its script."""
    m = re.search(r'<script type="application/json" class="tta-data">(.*?)</script>',
                  explorer.html, re.DOTALL)
    assert m, "no embedded data"
    return json.loads(m.group(1))


def test_explorer_3d_input_html_and_data():
    w = _weights(4, 3, 5)
    ex = attention_explorer(w, list("abc"), list("vwxyz"), title="T")
    assert isinstance(ex, AttentionExplorer)
    assert ex._repr_html_() == ex.html == str(ex)
    assert ex.html.startswith(f'<div class="tta" id="{ex.element_id}">')
    data = _data(ex)
    assert data["q"] == list("abc") and data["k"] == list("vwxyz")
    assert data["layers"] == ["layer 1"] and data["heads"] == [f"head {i}" for i in range(1, 5)]
    assert data["decimals"] == 3
    np.testing.assert_allclose(np.array(data["w"]), w.numpy()[None], atol=5e-4 + 1e-9)
    assert repr(ex) == "AttentionExplorer(1 layer(s), 4 head(s), 3 queries x 5 keys, " \
        f"{len(ex.html.encode())} bytes of HTML)"
    assert "0x" not in repr(ex)  # no memory address in the stored text/plain output


def test_explorer_4d_input_numpy_and_names():
    w = _weights(2, 3, 4, 4).numpy()
    ex = attention_explorer(w, list("abcd"), layer_names=["L1", "L2"],
                            head_names=["x", "y", "z"])
    data = _data(ex)
    assert np.array(data["w"]).shape == (2, 3, 4, 4)
    assert data["k"] == list("abcd")  # key tokens default to the query tokens
    assert data["layers"] == ["L1", "L2"] and data["heads"] == ["x", "y", "z"]
    assert "mean of the heads" in ex.html  # the selectors are built by the script


def test_explorer_static_fallback_table_is_the_first_head():
    w = _weights(2, 2, 3, 3)
    ex = attention_explorer(w, ["p", "q", "r"], decimals=2)
    table = re.search(r'<table class="tta-static">(.*?)</table>', ex.html, re.DOTALL).group(1)
    cells = re.findall(r"<td[^>]*>([^<]*)</td>", table)
    assert cells == [f"{round(v, 2):.2f}" for v in w[0, 0].flatten().tolist()]
    assert re.findall(r'<th scope="row">([^<]*)</th>', table) == ["p", "q", "r"]
    assert "layer 1, head 1" in table


def test_explorer_no_network_resources():
    html = attention_explorer(_weights(2, 3, 3), list("abc")).html
    assert not re.search(r"https?://|//[a-z0-9.-]+\.[a-z]{2,}/", html, re.IGNORECASE)
    assert not re.search(r"<(img|link|iframe)\b|\bsrc\s*=|@import|url\(", html,
                         re.IGNORECASE)
    assert "fetch(" not in html and "XMLHttpRequest" not in html


def test_explorer_is_deterministic():
    w = _weights(2, 3, 3)
    a = attention_explorer(w, list("abc")).html
    b = attention_explorer(w.clone(), list("abc")).html
    assert a == b
    other = attention_explorer(_weights(2, 3, 4)[:, :, :3], list("abc"))
    assert other.html != a and other.element_id != attention_explorer(w, list("abc")).element_id
    relabelled = attention_explorer(w, list("abd"))
    assert relabelled.element_id != attention_explorer(w, list("abc")).element_id
    assert re.fullmatch(r"tta-[0-9a-f]{12}", relabelled.element_id)
    fixed = attention_explorer(w, list("abc"), element_id="my-view")
    assert fixed.element_id == "my-view" and 'id="my-view"' in fixed.html
    assert '"my-view"' in fixed.html  # the script finds its own container


def test_explorer_escapes_tokens_and_title():
    tokens = ["<eos>", "a&b", '"q"', "</script><script>alert(1)"]
    ex = attention_explorer(_weights(1, 4, 4), tokens, title="<b>x</b>")
    assert "<eos>" not in ex.html and "\\u003ceos\\u003e" in ex.html
    assert "&lt;eos&gt;" in ex.html and "a&amp;b" in ex.html and "&lt;b&gt;x&lt;/b&gt;" in ex.html
    # The one closing tag of a script is the script's own: the token cannot end it early.
    assert ex.html.count("</script>") == 2
    assert _data(ex)["q"] == tokens


def test_explorer_rounding():
    w = torch.tensor([[[0.12345, 0.87655], [0.5, 0.5]]])
    data = _data(attention_explorer(w, ["a", "b"], decimals=2))
    assert data["w"] == [[[[0.12, 0.88], [0.5, 0.5]]]]
    assert data["decimals"] == 2
    data = _data(attention_explorer(w, ["a", "b"], decimals=0))
    assert data["w"] == [[[[0.0, 1.0], [0.0, 0.0]]]] or data["w"] == [[[[0.0, 1.0], [1.0, 1.0]]]]
    negative_zero = torch.tensor([[[-1e-9, 1.0]]])
    ex = attention_explorer(negative_zero, ["a"], ["x", "y"])
    assert "-0" not in ex.html.split('class="tta-data">')[1].split("</script>")[0]


@pytest.mark.parametrize("shape", [(4,), (3, 4), (1, 1, 1, 2, 2)])
def test_explorer_rejects_bad_ranks(shape):
    with pytest.raises(ValueError, match=r"\(h, L_q, L_k\) or \(layers, h, L_q, L_k\)") as info:
        attention_explorer(torch.zeros(shape), ["a"])
    assert "(" + ", ".join(map(str, shape)) + ")" in str(info.value)


def test_explorer_rejects_bad_labels_and_options():
    w = _weights(2, 3, 4)
    with pytest.raises(ValueError, match="query_tokens has 2 labels, expected L_q = 3"):
        attention_explorer(w, ["a", "b"], list("wxyz"))
    with pytest.raises(ValueError, match="key_tokens has 3 labels, expected L_k = 4"):
        attention_explorer(w, list("abc"), list("xyz"))
    with pytest.raises(ValueError, match=r"key_tokens is required when L_q != L_k.*\(1, 2, 3, 4\)"):
        attention_explorer(w, list("abc"))
    with pytest.raises(ValueError, match="head_names has 1 labels, expected h = 2"):
        attention_explorer(w, list("abc"), list("wxyz"), head_names=["x"])
    with pytest.raises(ValueError, match="layer_names has 2 labels, expected layers = 1"):
        attention_explorer(w, list("abc"), list("wxyz"), layer_names=["x", "y"])
    with pytest.raises(InputTypeError, match="query_tokens must be a list"):
        attention_explorer(w, "abc", list("wxyz"))
    with pytest.raises(InputTypeError, match="must hold strings"):
        attention_explorer(w, [1, 2, 3], list("wxyz"))
    with pytest.raises(ValueError, match="decimals must be between 0 and 6, got 9"):
        attention_explorer(w, list("abc"), list("wxyz"), decimals=9)
    with pytest.raises(ValueError, match="element_id"):
        attention_explorer(w, list("abc"), list("wxyz"), element_id="1 bad id")
    with pytest.raises(ValueError, match="finite"):
        attention_explorer(torch.full((1, 2, 2), float("nan")), ["a", "b"])
    with pytest.raises(ValueError, match="no size 0"):
        attention_explorer(torch.zeros(1, 0, 2), [], ["a", "b"])
