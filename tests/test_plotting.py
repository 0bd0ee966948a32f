"""Tests of the figures: utils.plotting (the attention heatmaps that the chapters share),
utils.explorer (the attention explorer's HTML) and utils.diagrams (the architecture figure drawn
from a model's modules)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import json  # noqa: E402
import re  # noqa: E402

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from matplotlib.patches import FancyBboxPatch  # noqa: E402
from torch import nn  # noqa: E402

from utils._validation import InputTypeError  # noqa: E402
from utils.attention import keep_attention_weights  # noqa: E402
from utils.diagrams import architecture_figure  # noqa: E402
from utils.explorer import AttentionExplorer, attention_explorer  # noqa: E402
from utils.models import DecoderOnlyLM, EncoderOnlyMLM, Seq2SeqTransformer  # noqa: E402
from utils.plotting import plot_attention, plot_attention_heads  # noqa: E402
from utils.transformer import Encoder, EncoderLayer, Transformer  # noqa: E402


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


@pytest.mark.parametrize(("draw", "expected", "shape"), [
    *((plot_attention, r"\(L_q, L_k\)", s) for s in [(4,), (2, 3, 4), (1, 1, 2, 2)]),
    *((plot_attention_heads, r"\(h, L_q, L_k\)", s) for s in [(3, 4), (2, 2, 3, 4), (0, 3, 4)]),
])
def test_plots_reject_bad_shapes(draw, expected, shape):
    with pytest.raises(ValueError, match=expected) as info:
        draw(torch.zeros(shape))
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


def _script(explorer: AttentionExplorer) -> str:
    """The explorer's own script (the second script element)."""
    return re.findall(r"<script>(.*?)</script>", explorer.html, re.DOTALL)[-1]


def test_explorer_keyboard_and_screen_reader_markup():
    """What the script builds for the keyboard and for screen readers: the labels come with the
    data, the script makes the query tokens one toolbar with a roving tabindex (the selected
    token 0, the others -1), marks the shown query aria-pressed, answers the arrow keys, Home
    and End, and writes to a polite live region; the browser test drives it for real."""
    tokens = ["dog", "bites", "man"]
    ex = attention_explorer(_weights(2, 3, 3), tokens)
    labels = _data(ex)["labels"]
    assert labels["queries"] == ["query 1 of 3: dog", "query 2 of 3: bites",
                                 "query 3 of 3: man"]
    assert labels["group"].startswith("3 queries: ")
    assert all(k in labels["group"] for k in ("arrow keys", "Home", "End"))
    assert "Tab" in labels["hint"] and "arrow keys" in labels["hint"]
    assert _data(attention_explorer(_weights(1, 1, 2), ["a"], ["x", "y"]))["labels"][
        "group"].startswith("1 query: ")
    js = _script(ex)
    assert 'qrow.setAttribute("role", "toolbar")' in js
    assert 'qrow.setAttribute("aria-label", data.labels.group)' in js
    assert 'b.setAttribute("aria-label", data.labels.queries[i])' in js
    assert "b.tabIndex = i === state.pinned ? 0 : -1;" in js
    assert 'b.setAttribute("aria-pressed", i === state.query ? "true" : "false")' in js
    assert 'live.setAttribute("aria-live", "polite")' in js
    assert '" attends most to "' in js
    for key in ("ArrowRight", "ArrowLeft", "ArrowUp", "ArrowDown", "Home", "End"):
        assert f'"{key}"' in js, key
    # The selects stay ordinary controls, and answer the keyboard's change events too.
    assert 'el("select", "tta-" + key)' in js and 'sel.addEventListener("input", pick)' in js
    # Only the script makes buttons: without it, the static table is all there is.
    assert "<button" not in ex.html.replace(js, "")


def test_explorer_labels_escape_tokens():
    ex = attention_explorer(_weights(1, 2, 2), ["<eos>", "</script>"])
    assert _data(ex)["labels"]["queries"] == ["query 1 of 2: <eos>", "query 2 of 2: </script>"]
    assert ex.html.count("</script>") == 2


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


# ----------------------------------------------------------------------------- architecture_figure
def _texts(fig) -> list[str]:
    return [t.get_text() for t in fig.findobj(matplotlib.text.Text) if t.get_text()]


def _tf(**kw) -> Transformer:
    args = dict(d_model=16, nhead=4, num_encoder_layers=2, num_decoder_layers=2,
                dim_feedforward=32, dropout=0.0)
    return Transformer(**{**args, **kw})


def _ys(fig, prefix: str, left: bool) -> list[float]:
    """The heights of the texts starting with ``prefix`` in one column (encoder: left)."""
    width = fig.get_size_inches()[0]
    return sorted(t.get_position()[1] for t in fig.findobj(matplotlib.text.Text)
                  if t.get_text().startswith(prefix) and (t.get_position()[0] < width / 2) == left)


def test_architecture_figure_reads_counts_from_the_model():
    base = _texts(architecture_figure(_tf()))
    assert "Transformer: 2 + 2 layers, d_model = 16, post-LN" in base
    assert base.count("2×") == 2
    assert "Multi-head self-attention\nh = 4, d_k = 4" in base
    assert "Masked multi-head self-attention\nh = 4, d_k = 4" in base
    assert "Multi-head cross-attention\nh = 4; keys, values: encoder" in base
    assert base.count("Feed-forward, relu\n16 → 32 → 16") == 2
    assert base.count("Add & LayerNorm") == 5  # 2 in the encoder layer, 3 in the decoder layer
    assert base.count("LayerNorm (final)") == 2
    # Change one setting at a time: the figure follows.
    texts = _texts(architecture_figure(_tf(num_encoder_layers=3, num_decoder_layers=5)))
    assert "3×" in texts and "5×" in texts and "2×" not in texts
    texts = _texts(architecture_figure(_tf(nhead=2)))
    assert "Multi-head self-attention\nh = 2, d_k = 8" in texts
    assert not any("h = 4" in t for t in texts)
    texts = _texts(architecture_figure(_tf(dim_feedforward=48, activation="gelu")))
    assert texts.count("Feed-forward, gelu\n16 → 48 → 16") == 2
    assert "Transformer: 2 + 2 layers, d_model = 32, post-LN" in _texts(
        architecture_figure(_tf(d_model=32)))
    texts = _texts(architecture_figure(_tf(norm_first=True)))
    assert "Transformer: 2 + 2 layers, d_model = 16, pre-LN" in texts
    assert "Add & LayerNorm" not in texts
    assert texts.count("LayerNorm") == 5 and texts.count("+") == 5  # a norm and an addition each
    # A stack without its final norm is drawn without it.
    model = _tf()
    model.encoder.norm = None
    assert _texts(architecture_figure(model)).count("LayerNorm (final)") == 1


def test_architecture_figure_follows_the_forward_order():
    fig = architecture_figure(_tf())  # post-LN: sublayer, then add & norm
    attn, ff = _ys(fig, "Multi-head self", True)[0], _ys(fig, "Feed-forward", True)[0]
    adds = _ys(fig, "Add & LayerNorm", True)
    assert attn < adds[0] < ff < adds[1]
    masked, cross = _ys(fig, "Masked", False)[0], _ys(fig, "Multi-head cross", False)[0]
    assert masked < cross < _ys(fig, "Feed-forward", False)[0]
    fig = architecture_figure(_tf(norm_first=True))  # pre-LN: norm, sublayer, addition
    norms = _ys(fig, "LayerNorm", True)
    attn, ff = _ys(fig, "Multi-head self", True)[0], _ys(fig, "Feed-forward", True)[0]
    plus = _ys(fig, "+", True)
    assert norms[0] < attn < plus[0] < norms[1] < ff < plus[1] < norms[2]  # norms[2]: the final


def test_architecture_figure_of_a_copy_of_torchs_transformer():
    torch_tf = nn.Transformer(d_model=16, nhead=2, num_encoder_layers=1, num_decoder_layers=3,
                              dim_feedforward=24, activation="gelu", batch_first=True)
    fig = architecture_figure(Transformer.from_torch(torch_tf))
    texts = _texts(fig)
    assert "Transformer: 1 + 3 layers, d_model = 16, post-LN" in texts
    assert "1×" in texts and "3×" in texts
    assert "Masked multi-head self-attention\nh = 2, d_k = 8" in texts
    assert texts.count("Feed-forward, gelu\n16 → 24 → 16") == 2
    # A bare Transformer has no embeddings and no output projection: dashed boxes say so.
    assert "source vectors, width 16\nembedding + positions" in texts
    assert "output vectors, width 16\nlinear + softmax" in texts
    assert "dashed: a step that no module of Transformer computes" in texts
    with pytest.raises(ValueError, match="nn.Transformer.*Transformer.from_torch"):
        architecture_figure(torch_tf)


def test_architecture_figure_of_a_token_model():
    model = Seq2SeqTransformer(13, 13, d_model=32, nhead=4, dim_feedforward=128,
                               norm_first=True, share_embeddings=True)
    texts = _texts(architecture_figure(model))
    assert "Seq2SeqTransformer: 1 + 1 layers, d_model = 32, pre-LN" in texts
    assert "Token embedding × √d_model\nV = 13, d_model = 32" in texts
    assert "Token embedding × √d_model\nshared with the source" in texts
    assert texts.count("+ sinusoidal positional encoding") == 2
    assert "Linear 32 → 13\ntied: the embedding, transposed" in texts
    assert "Softmax (in the loss and in decoding)" in texts
    model = Seq2SeqTransformer(11, 7, d_model=16, nhead=2, positional=False, tie_output=False)
    texts = _texts(architecture_figure(model))
    assert "Token embedding × √d_model\nV = 11, d_model = 16" in texts
    assert "Token embedding × √d_model\nV = 7, d_model = 16" in texts
    assert not any("positional" in t for t in texts)
    assert "Linear 16 → 7" in texts


def test_architecture_figure_is_readable():
    """At most 6.7 inches wide (the book's column), no text below 8 points, no two texts on top
    of each other, and every box's text inside its box, for the paper's base model."""
    with torch.device("meta"):  # shapes only: 63 million parameters cost nothing
        model = Seq2SeqTransformer(37000, 37000, d_model=512, nhead=8, num_encoder_layers=6,
                                   num_decoder_layers=6, dim_feedforward=2048,
                                   share_embeddings=True)
    for m in (model, _tf(norm_first=True)):
        fig = architecture_figure(m)
        assert fig.get_size_inches()[0] <= 6.7
        renderer = fig.canvas.get_renderer()
        texts = [t for t in fig.findobj(matplotlib.text.Text) if t.get_text()]
        assert min(t.get_fontsize() for t in texts) >= 8
        boxes = [t.get_window_extent(renderer) for t in texts]
        for t, b in zip(texts, boxes, strict=True):
            assert fig.bbox.contains(b.x0, b.y0) and fig.bbox.contains(b.x1, b.y1), t.get_text()
        for i, a in enumerate(boxes):
            for j in range(i):
                assert not a.overlaps(boxes[j]), (texts[i].get_text(), texts[j].get_text())
        patches = [p.get_window_extent(renderer) for p in fig.axes[0].patches
                   if isinstance(p, FancyBboxPatch)]
        for t, b in zip(texts, boxes, strict=True):
            around = [p for p in patches if p.contains(*b.get_points().mean(axis=0))]
            if around:
                p = min(around, key=lambda p: p.width * p.height)  # the box, not the stack
                assert p.x0 <= b.x0 and b.x1 <= p.x1 and p.y0 <= b.y0 and b.y1 <= p.y1, (
                    t.get_text())


def test_architecture_figure_leaves_the_model_as_it_was():
    model = Seq2SeqTransformer(13, 13, d_model=16, nhead=2, dropout=0.1)
    model.train()
    keep_attention_weights(model)
    src = torch.randint(3, 13, (2, 5))
    tgt = torch.randint(3, 13, (2, 4))
    model.eval()
    with torch.no_grad():
        model(src, tgt)
    model.train()
    layer = model.transformer.decoder.layers[0]
    kept = layer.cross_attn.attn_weights
    params = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    architecture_figure(model)
    assert torch.equal(torch.get_rng_state(), rng)  # no random number drawn
    assert all(m.training for m in model.modules())
    assert layer.cross_attn.attn_weights is kept
    assert all(torch.equal(v, params[k]) for k, v in model.state_dict().items())


def test_architecture_figure_refuses_what_it_cannot_draw():
    for model in (DecoderOnlyLM(13, d_model=16, nhead=2), EncoderOnlyMLM(13, d_model=16, nhead=2),
                  Encoder(2, 16, 2)):
        with pytest.raises(ValueError, match="expects a utils.transformer.Transformer.*"
                                             "no decoder"):
            architecture_figure(model)
    with pytest.raises(ValueError, match="expects a utils.transformer.Transformer"):
        architecture_figure("a model")
    model = _tf()
    model.decoder = None
    with pytest.raises(ValueError, match="decoder to be a utils.transformer.Decoder, got NoneType"):
        architecture_figure(model)
    model = _tf()
    model.encoder.layers[1] = EncoderLayer(16, 2, 32)
    with pytest.raises(ValueError, match="every layer of the encoder to be alike.*layer 1"):
        architecture_figure(model)
    with pytest.raises(ValueError, match="width must be between 5.5 and 6.7"):
        architecture_figure(_tf(), width=8)
    with pytest.raises(InputTypeError, match="title"):
        architecture_figure(_tf(), title=3)
