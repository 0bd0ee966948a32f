"""Causal attention through PyTorch's causal kernel: ``is_causal`` declared, or the library's
own causal mask recognized by its mark (`utils.masks.mark_causal`).

Every path is checked three ways: it gives the output and gradients of the explicit-mask path
(to float rounding; on a CPU to the bit), it really calls ``F.scaled_dot_product_attention``
with ``is_causal=True`` (a recording wrapper around it), and what must not take the fast path
(an edited mask, padding, a cache) does not.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import utils.fast_attention as fast_attention
from utils._validation import InputTypeError
from utils.attention import GroupedQueryAttention, MultiHeadAttention, scaled_dot_product_attention
from utils.checkpoint_models import (
    CheckpointLM,
    GELUFeedForward,
    PreNormBlock,
    RotarySelfAttention,
    TokenPositionEmbedding,
)
from utils.fast_attention import fused_attention
from utils.kv_cache import KVCache
from utils.layers import LayerNorm, RMSNorm
from utils.masks import causal_mask, expand_mask, is_marked_causal, mark_causal
from utils.models import DecoderOnlyLM, Seq2SeqTransformer
from utils.transformer_layers import DecoderLayer, EncoderLayer

# float32: a query row that sees one key has a gradient of exactly 0 in exact arithmetic (its
# softmax is 1 whatever the score); PyTorch's fused backward computes it as P (dP - D), two dot
# products summed in different orders, and leaves rounding noise of up to a few 1e-6 there on
# some CPUs (2.7e-6 measured), hence atol 1e-5. A wrong mask moves values by 1e-1 or more.
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float64: dict(atol=1e-12, rtol=1e-11)}


@pytest.fixture
def calls(monkeypatch):
    """Record how every ``F.scaled_dot_product_attention`` call is made: a list of
    ``(is_causal, has attn_mask)`` pairs, one per call, the calls themselves unchanged."""
    seen: list[tuple[bool, bool]] = []
    real = F.scaled_dot_product_attention

    def recording(*args, **kwargs):
        seen.append((bool(kwargs.get("is_causal", False)), kwargs.get("attn_mask") is not None))
        return real(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    return seen


def _close(name, got, want, dtype=torch.float32):
    diff = (got - want).abs().max().item() if got.numel() else 0.0
    assert torch.allclose(got, want, **TOL[dtype]), f"{name}: largest difference {diff:.3g}"


def _grads(out, *tensors):
    return torch.autograd.grad(out.square().sum(), tensors)


def _qkv(shape_q, shape_k, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(*shape_q, generator=g, dtype=dtype, requires_grad=True)
    k = torch.randn(*shape_k, generator=g, dtype=dtype, requires_grad=True)
    v = torch.randn(*shape_k, generator=g, dtype=dtype, requires_grad=True)
    return q, k, v


# --------------------------------------------------------------------------------------------
# fused_attention and scaled_dot_product_attention
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("l_q, l_k", [(1, 1), (7, 7), (64, 64), (3, 9), (1, 6)])
@pytest.mark.parametrize("padded", [False, True])
def test_is_causal_equals_the_explicit_mask(l_q, l_k, padded, dtype):
    q, k, v = _qkv((2, 3, l_q, 8), (2, 3, l_k, 8), dtype)
    pad = None
    if padded:  # the second sequence's last two keys are padding
        pad = torch.ones(2, 1, 1, l_k, dtype=torch.bool)
        pad[1, ..., -2:] = False
    explicit = torch.ones(l_q, l_k, dtype=torch.bool).tril(l_k - l_q)  # bottom-right aligned
    want_mask = explicit if pad is None else explicit & pad
    want = scaled_dot_product_attention(q, k, v, want_mask)[0]
    want_grads = _grads(want, q, k, v)
    for name, fn in (
        ("fused_attention", fused_attention),
        (
            "scaled_dot_product_attention",
            lambda *a, **kw: scaled_dot_product_attention(*a, **kw)[0],
        ),
    ):
        got = fn(q, k, v, pad, is_causal=True)
        _close(f"{name} output, L_q={l_q}, L_k={l_k}", got, want, dtype)
        for label, g_got, g_want in zip("qkv", _grads(got, q, k, v), want_grads, strict=True):
            _close(f"{name} grad of {label}, L_q={l_q}, L_k={l_k}", g_got, g_want, dtype)


def test_causal_kernel_is_bitwise_the_explicit_mask_on_cpu():
    q, k, v = _qkv((1, 4, 300, 16), (1, 4, 300, 16))
    mask = torch.ones(300, 300, dtype=torch.bool).tril()  # unmarked: the explicit path
    want = fused_attention(q, k, v, mask)
    got = fused_attention(q, k, v, is_causal=True)
    assert torch.equal(got, want), f"largest difference {(got - want).abs().max().item():.3g}"
    for label, a, b in zip("qkv", _grads(got, q, k, v), _grads(want, q, k, v), strict=True):
        assert torch.equal(a, b), f"grad of {label}: largest difference {(a - b).abs().max():.3g}"


def test_declared_and_marked_causal_call_the_causal_kernel(calls):
    q, k, v = _qkv((2, 2, 10, 4), (2, 2, 10, 4))
    fused_attention(q, k, v, is_causal=True)
    assert calls == [(True, False)], f"is_causal=True: kernel called as {calls}"
    calls.clear()
    fused_attention(q, k, v, causal_mask(10))
    assert calls == [(True, False)], f"causal_mask(10): kernel called as {calls}"
    calls.clear()
    fused_attention(q, k, v, torch.ones(10, 10, dtype=torch.bool).tril())
    assert calls == [(False, True)], f"an unmarked mask: kernel called as {calls}"


def _check_edited_masks(calls: list | None) -> None:
    """A marked mask written into afterwards (directly or through a view) is no longer causal:
    the explicit path runs (checked when ``calls`` records the kernel's calls) and gives the
    edited mask's output."""
    q, k, v = _qkv((1, 2, 6, 4), (1, 2, 6, 4))
    for edit in ("entry", "view", "row"):
        mask = causal_mask(6)
        assert is_marked_causal(mask), "causal_mask(6) carries no mark"
        if edit == "entry":
            mask[4, 1] = False  # still lower triangular: only the mark can tell
        elif edit == "view":
            mask[None, None][0, 0, 2, 4] = True
        else:
            mask[3].fill_(True)
        want = scaled_dot_product_attention(q, k, v, mask)[0]
        if calls is not None:
            calls.clear()
        got = fused_attention(q, k, v, mask)
        _close(f"output after an edit by {edit}", got, want)
        if calls is not None:
            assert calls == [(False, True)], f"edit by {edit}: kernel called as {calls}"
            assert not is_marked_causal(mask), f"mask edited by {edit} still counts as causal"
        plain = fused_attention(q, k, v, is_causal=True)
        assert not torch.allclose(got, plain), f"edit by {edit} changed nothing: a weak test"


def test_an_edited_causal_mask_is_read_as_it_is(calls):
    _check_edited_masks(calls)


def test_the_edit_test_catches_a_mark_that_ignores_edits(monkeypatch):
    """With a detector that trusts any mark, the check above fails, naming the edit."""
    monkeypatch.setattr(fast_attention, "is_marked_causal", lambda m: hasattr(m, "_causal_mark"))
    with pytest.raises(AssertionError, match="output after an edit by entry: largest difference"):
        _check_edited_masks(None)


def test_the_mark_follows_the_mask_rule_and_nothing_else():
    mask = causal_mask(5)
    assert is_marked_causal(expand_mask(mask, 2, 5, 5)), "expand_mask dropped the mark"
    shared = mark_causal(mask[None])  # (1, L, L), as the models make it
    assert is_marked_causal(expand_mask(shared, 2, 5, 5)), "expand_mask dropped the mark (3 dims)"
    for name, other in (
        ("clone", mask.clone()),
        ("expand", mask.expand(2, 5, 5)),
        ("logical and", mask & mask),
        ("transpose", mask.T),
    ):
        assert not is_marked_causal(other), f"{name} of a causal mask counts as marked"
    with torch.inference_mode():
        inference = torch.ones(3, 3, dtype=torch.bool).tril()
        assert not is_marked_causal(mark_causal(inference)), "an inference tensor counts as marked"
    q, k, v = _qkv((2, 1, 5, 4), (2, 1, 5, 4))
    batched = mark_causal(torch.ones(2, 5, 5, dtype=torch.bool).tril()[:, None])
    assert fast_attention._read_causal(q, k, batched, False)[1] is False, (
        "a mask with a batch dim above 1 was taken for the shared causal mask"
    )


def test_is_causal_errors():
    q, k, v = _qkv((1, 2, 5, 4), (1, 2, 3, 4))
    for fn in (fused_attention, scaled_dot_product_attention):
        with pytest.raises(
            ValueError,
            match=r"L_q <= L_k.*\(1, 2, 5, 4\) \(L_q=5\).*"
            r"\(1, 2, 3, 4\) \(L_k=3\)",
        ):
            fn(q, k, v, is_causal=True)
        with pytest.raises(InputTypeError, match="is_causal must be True or False, got 1"):
            fn(q, q, q, is_causal=1)
    mha = MultiHeadAttention(8, 2)
    x, memory = torch.randn(1, 5, 8), torch.randn(1, 3, 8)
    with pytest.raises(ValueError, match=r"L_q <= L_k.*L_q=5.*L_k=3"):
        mha(x, memory, memory, is_causal=True)
    with pytest.raises(InputTypeError, match="is_causal must be True or False, got 'yes'"):
        mha(x, x, x, is_causal="yes")
    with pytest.raises(InputTypeError, match="is_causal must be True or False, got None"):
        EncoderLayer(8, 2, 16)(x, is_causal=None)
    with pytest.raises(InputTypeError, match="mask must be a bool tensor"):
        mark_causal(torch.ones(3, 3).tril())
    with pytest.raises(InputTypeError, match="tgt_is_causal must be True or False, got 1"):
        DecoderLayer(8, 2, 16)(x, memory, tgt_is_causal=1)


# --------------------------------------------------------------------------------------------
# The attention modules
# --------------------------------------------------------------------------------------------


def _modules():
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 4)
    return {"MultiHeadAttention": mha, "GroupedQueryAttention": GroupedQueryAttention(16, 4, 2)}


@pytest.mark.parametrize("keep_weights", [False, True])
@pytest.mark.parametrize("name", ["MultiHeadAttention", "GroupedQueryAttention"])
def test_modules_is_causal_equals_the_explicit_mask(name, keep_weights):
    attn = _modules()[name]
    attn.keep_weights = keep_weights
    x = torch.randn(3, 11, 16, requires_grad=True)
    params = list(attn.parameters())
    explicit = torch.ones(11, 11, dtype=torch.bool).tril()
    want = attn(x, x, x, explicit)
    want_grads = _grads(want, x, *params)
    pad = torch.ones(3, 11, dtype=torch.bool)
    pad[0, 8:] = False
    for label, run in (
        ("is_causal", lambda: attn(x, x, x, is_causal=True)),
        ("causal_mask", lambda: attn(x, x, x, causal_mask(11))),
        ("is_causal with causal_mask", lambda: attn(x, x, x, causal_mask(11), is_causal=True)),
    ):
        got = run()
        _close(f"{name} {label}", got, want)
        for i, (a, b) in enumerate(zip(_grads(got, x, *params), want_grads, strict=True)):
            _close(f"{name} {label}: gradient {i}", a, b)
    got = attn(x, x, x, pad[:, None, :], is_causal=True)
    _close(f"{name} is_causal with padding", got, attn(x, x, x, explicit & pad[:, None, :]))


@pytest.mark.parametrize("name", ["MultiHeadAttention", "GroupedQueryAttention"])
def test_modules_is_causal_with_a_cache_puts_the_queries_last(name):
    """With a cache, is_causal means: the new queries follow the cached positions."""
    attn = _modules()[name].eval()
    x = torch.randn(2, 9, 16)
    with torch.no_grad():
        full = attn(x, x, x, is_causal=True)
        cache = KVCache()
        first = attn(x[:, :4], x[:, :4], x[:, :4], cache=cache, is_causal=True)
        rest = attn(x[:, 4:], x[:, 4:], x[:, 4:], cache=cache, is_causal=True)
    _close(f"{name} cached is_causal", torch.cat([first, rest], dim=1), full)


@pytest.mark.parametrize("name", ["MultiHeadAttention", "GroupedQueryAttention"])
def test_modules_call_the_causal_kernel(name, calls):
    attn = _modules()[name]
    x = torch.randn(2, 6, 16)
    attn(x, x, x, is_causal=True)
    attn(x, x, x, causal_mask(6))
    assert calls == [(True, False)] * 2, f"{name}: kernel called as {calls}"


# --------------------------------------------------------------------------------------------
# The layers and models: the fast path exactly when the self-attention mask is purely causal
# --------------------------------------------------------------------------------------------


def _checkpoint_lm(family: str) -> CheckpointLM:
    torch.manual_seed(0)
    d = 16
    if family == "llama":
        blocks = [
            PreNormBlock(
                RMSNorm(d), RotarySelfAttention(d, 4, 2), RMSNorm(d), GELUFeedForward(d, 32)
            )
            for _ in range(2)
        ]
        return CheckpointLM(
            TokenPositionEmbedding(40, d, 32, False),
            blocks,
            RMSNorm(d),
            tie_output=True,
            family="llama",
        )
    blocks = [
        PreNormBlock(LayerNorm(d), MultiHeadAttention(d, 4), LayerNorm(d), GELUFeedForward(d, 32))
        for _ in range(2)
    ]
    return CheckpointLM(
        TokenPositionEmbedding(40, d, 32, True),
        blocks,
        LayerNorm(d),
        tie_output=True,
        family="gpt2",
    )


def _models():
    torch.manual_seed(0)
    tokens = torch.randint(0, 40, (2, 12))
    src = torch.randint(0, 40, (2, 7))
    seq2seq = Seq2SeqTransformer(
        40, 40, d_model=16, nhead=4, num_encoder_layers=1, num_decoder_layers=2
    )
    return {
        # name: (model, run, self-attention calls per forward that must be causal, others)
        "DecoderOnlyLM": (
            DecoderOnlyLM(40, d_model=16, nhead=4, num_layers=2),
            lambda m: m(tokens),
            2,
            0,
        ),
        "Seq2SeqTransformer": (seq2seq, lambda m: m(src, tokens), 2, 3),
        "CheckpointLM gpt2": (_checkpoint_lm("gpt2"), lambda m: m(tokens), 2, 0),
        "CheckpointLM llama": (_checkpoint_lm("llama"), lambda m: m(tokens), 2, 0),
    }


@pytest.mark.parametrize("name", list(_models()))
def test_models_take_the_causal_kernel(name, calls, monkeypatch):
    model, run, n_causal, n_other = _models()[name]
    params = [p for p in model.parameters() if p.requires_grad]
    got = run(model)
    expected = sorted([(True, False)] * n_causal + [(False, False)] * n_other)
    assert sorted(calls) == expected, f"{name}: kernel called as {calls}, expected {expected}"
    got_grads = _grads(got, *params)
    monkeypatch.setattr(fast_attention, "is_marked_causal", lambda m: False)
    calls.clear()
    want = run(model)  # the explicit-mask path
    assert all(not c for c, _ in calls), f"{name} without detection: kernel called as {calls}"
    _close(f"{name} logits", got, want)
    for i, (a, b) in enumerate(zip(got_grads, _grads(want, *params), strict=True)):
        _close(f"{name} gradient of parameter {i}", a, b)


@pytest.mark.parametrize("name", list(_models()))
def test_models_take_the_causal_kernel_under_inference_mode(name, calls):
    """Inference mode makes tensors without a version counter, which cannot carry the mark: the
    models (and causal_mask) make their causal masks outside it, so evaluation under
    torch.inference_mode() (generate, the benchmark) takes the causal kernel too."""
    model, run, n_causal, n_other = _models()[name]
    with torch.inference_mode():
        run(model.eval())
        mask = causal_mask(6)
    expected = sorted([(True, False)] * n_causal + [(False, False)] * n_other)
    assert sorted(calls) == expected, f"{name}: kernel called as {calls}, expected {expected}"
    assert is_marked_causal(mask), "causal_mask made under inference mode is not marked"


def test_models_keep_the_explicit_mask_with_padding_or_a_cache(calls):
    model = DecoderOnlyLM(40, d_model=16, nhead=4, num_layers=2).eval()
    tokens = torch.randint(0, 40, (2, 8))
    pad = torch.ones(2, 8, dtype=torch.bool)
    pad[1, 6:] = False
    model(tokens, pad)
    assert calls and all(not c for c, _ in calls), f"with padding: kernel called as {calls}"
    calls.clear()
    with torch.no_grad():
        cache = model.new_cache()
        model(tokens[:, :5], cache=cache)
        model(tokens[:, 5:], cache=cache)
    assert calls and all(not c for c, _ in calls), f"with a cache: kernel called as {calls}"


@pytest.mark.parametrize("norm_first", [False, True])
def test_layers_is_causal_equals_the_explicit_mask(norm_first, calls):
    torch.manual_seed(0)
    enc = EncoderLayer(16, 4, 32, dropout=0.0, norm_first=norm_first)
    dec = DecoderLayer(16, 4, 32, dropout=0.0, norm_first=norm_first)
    x, memory = torch.randn(2, 9, 16), torch.randn(2, 5, 16)
    explicit = torch.ones(9, 9, dtype=torch.bool).tril()
    for name, want, runs in (
        (
            "EncoderLayer",
            enc(x, explicit),
            (lambda: enc(x, is_causal=True), lambda: enc(x, causal_mask(9))),
        ),
        (
            "DecoderLayer",
            dec(x, memory, explicit),
            (lambda: dec(x, memory, tgt_is_causal=True), lambda: dec(x, memory, causal_mask(9))),
        ),
    ):
        for i, run in enumerate(runs):
            calls.clear()
            _close(f"{name} run {i}", run(), want)
            assert calls[0] == (True, False), f"{name} run {i}: kernel called as {calls}"
