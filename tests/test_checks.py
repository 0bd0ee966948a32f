"""The assignment checkers (utils.checks): right code passes, each known mistake is named, and
nothing a student hands in makes a checker raise."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from utils.attention import MultiHeadAttention, scaled_dot_product_attention
from utils.checks import (
    CheckResult,
    _attend,
    _encoder,
    _encoder_params,
    _mha,
    _MHAParams,
    _torch_encoder_layer,
    check_encoder_layer,
    check_layer_norm,
    check_multi_head_attention,
    check_positional_encoding,
    check_scaled_dot_product_attention,
)
from utils.layers import LayerNorm
from utils.positional import sinusoidal_encoding
from utils.transformer import EncoderLayer

# ---------------------------------------------------------------------------------------------
# Student implementations, right and wrong


def sdpa(q, k, v, mask=None, *, scale=True, axis=-1, mask_after=False, invert=False,
         transpose_out=False):
    scores = q @ k.transpose(-2, -1)
    if scale:
        scores = scores / math.sqrt(q.shape[-1])
    if mask is not None and invert:
        mask = ~mask
    if mask is not None and not mask_after:
        scores = scores.masked_fill(~mask, float("-inf"))
        scores = scores.masked_fill(~mask.any(-1, keepdim=True), 0.0)
    w = torch.softmax(scores, dim=axis)
    if mask is not None:
        w = w.masked_fill(~mask, 0.0)
    out = w @ v
    return (out.transpose(-2, -1) if transpose_out else out), w


class StudentMHA(nn.Module):
    """Multi-head attention with switches for the mistakes the checker must name."""

    split = "ok"
    merge = "ok"
    out_proj = True
    unmerged = False

    def __init__(self, d_model, num_heads, bias=True, dropout=0.0):
        super().__init__()
        self.h, self.d_k = num_heads, d_model // num_heads
        self.w_q, self.w_k, self.w_v, self.w_o = (nn.Linear(d_model, d_model, bias=bias)
                                                  for _ in range(4))

    def forward(self, query, key, value, mask=None):
        b, l_q, d = query.shape

        def split(x):
            if self.split == "view":  # (B, L, d) straight into (B, h, L, d_k)
                return x.reshape(b, self.h, x.shape[1], self.d_k)
            return x.reshape(b, x.shape[1], self.h, self.d_k).transpose(1, 2)

        q, k, v = split(self.w_q(query)), split(self.w_k(key)), split(self.w_v(value))
        if mask is not None and mask.dim() == 3:
            mask = mask.unsqueeze(1)
        out, _ = scaled_dot_product_attention(q, k, v, mask)
        if self.unmerged:
            return out
        if self.merge == "view":
            out = out.reshape(b, l_q, d)
        else:
            out = out.transpose(1, 2).reshape(b, l_q, d)
        return self.w_o(out) if self.out_proj else out


def mha_with(**flags):
    return type("MHA", (StudentMHA,), flags)


def pe(max_len, d_model, *, swap=False, base=10000.0, transpose=False):
    t = torch.arange(max_len, dtype=torch.float64)[:, None]
    w = base ** (-torch.arange(0, d_model, 2, dtype=torch.float64) / d_model)
    out = torch.zeros(max_len, d_model, dtype=torch.float64)
    out[:, 0::2], out[:, 1::2] = (torch.cos(t * w), torch.sin(t * w)) if swap else (
        torch.sin(t * w), torch.cos(t * w))
    out = out.float()
    return out.T if transpose else out


class StudentLN(nn.Module):
    unbiased = False

    def __init__(self, d_model, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model))
        self.bias = nn.Parameter(torch.zeros(d_model))

    def forward(self, x):
        mean = x.mean(-1, keepdim=True)
        var = x.var(-1, keepdim=True, unbiased=self.unbiased)
        return (x - mean) / torch.sqrt(var + self.eps) * self.weight + self.bias


class StudentEncoder(nn.Module):
    """An encoder layer from the book's pieces; `swap_ln` puts the norms on the wrong side."""

    swap_ln = False
    flat = False

    def __init__(self, d_model, nhead, dim_feedforward, dropout=0.0, activation="relu",
                 norm_first=False):
        super().__init__()
        self.self_attn = MultiHeadAttention(d_model, nhead)
        self.linear1 = nn.Linear(d_model, dim_feedforward)
        self.linear2 = nn.Linear(dim_feedforward, d_model)
        self.norm1, self.norm2 = LayerNorm(d_model), LayerNorm(d_model)
        self.act = F.gelu if activation == "gelu" else F.relu
        self.norm_first = norm_first != self.swap_ln

    def forward(self, x, mask=None):
        def sa(y):
            return self.self_attn(y, y, y, mask)

        def ff(y):
            return self.linear2(self.act(self.linear1(y)))

        if self.norm_first:
            x = x + sa(self.norm1(x))
            x = x + ff(self.norm2(x))
        else:
            x = self.norm1(x + sa(x))
            x = self.norm2(x + ff(x))
        return x.flatten(1) if self.flat else x


def encoder_with(**flags):
    return type("Enc", (StudentEncoder,), flags)


def hints(result: CheckResult) -> str:
    return " | ".join(result.hints)


# ---------------------------------------------------------------------------------------------
# The references are right


def test_attention_reference_matches_torch():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 8, generator=g) for _ in range(3))
    mask = torch.rand(2, 1, 5, 5, generator=g) > 0.3
    mask[..., 0] = True
    out, _ = _attend(q, k, v, mask)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert torch.allclose(out, expected, atol=1e-6)


def test_mha_reference_matches_torch():
    torch.manual_seed(0)
    torch_mha = nn.MultiheadAttention(16, 4, batch_first=True)
    w = torch_mha.in_proj_weight.detach().chunk(3)
    b = torch_mha.in_proj_bias.detach().chunk(3)
    p = _MHAParams(4, {"q": w[0], "k": w[1], "v": w[2], "o": torch_mha.out_proj.weight.detach()},
                   {"q": b[0], "k": b[1], "v": b[2], "o": torch_mha.out_proj.bias.detach()})
    x, mem = torch.randn(2, 5, 16), torch.randn(2, 7, 16)
    expected, _ = torch_mha(x, mem, mem)
    assert torch.allclose(_mha(p, x, mem, mem), expected, atol=1e-5)


@pytest.mark.parametrize("norm_first", [False, True])
def test_encoder_reference_matches_torch(norm_first):
    layer = _torch_encoder_layer(8, 2, 16, "gelu", norm_first, seed=0)
    x = torch.randn(2, 6, 8)
    real = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    with torch.no_grad():
        expected = layer(x, src_key_padding_mask=~real)
        got = _encoder(_encoder_params(layer), x, real[:, None, None, :], norm_first=norm_first,
                       activation="gelu")
    assert torch.allclose(got, expected, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Right code passes with score 1


@pytest.mark.parametrize("check, code", [
    (check_scaled_dot_product_attention, scaled_dot_product_attention),
    (check_scaled_dot_product_attention, sdpa),
    (check_multi_head_attention, MultiHeadAttention),
    (check_multi_head_attention, StudentMHA),
    (check_positional_encoding, sinusoidal_encoding),
    (check_positional_encoding, pe),
    (check_layer_norm, LayerNorm),
    (check_layer_norm, StudentLN),
    (check_encoder_layer, StudentEncoder),
], ids=lambda x: getattr(x, "__name__", str(x)))
def test_right_code_passes(check, code, capsys):
    result = check(code)
    assert result.passed and result.score == 1.0, hints(result)
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == len(result.cases) + 1  # one line per case, then the summary
    assert all(ln.startswith("[PASS] ") for ln in lines[:-1])


def test_utils_encoder_layer_passes():
    result = check_encoder_layer(EncoderLayer, verbose=False)
    assert result.passed, hints(result)


# ---------------------------------------------------------------------------------------------
# Each known mistake is named


MISTAKES = [
    ("no scaling", check_scaled_dot_product_attention,
     lambda q, k, v, mask=None: sdpa(q, k, v, mask, scale=False), "not scaled by 1/sqrt(d_k)"),
    ("softmax axis", check_scaled_dot_product_attention,
     lambda q, k, v, mask=None: sdpa(q, k, v, mask, axis=-2), "softmax over the wrong axis"),
    ("mask after softmax", check_scaled_dot_product_attention,
     lambda q, k, v, mask=None: sdpa(q, k, v, mask, mask_after=True),
     "mask applied after the softmax"),
    ("mask polarity", check_scaled_dot_product_attention,
     lambda q, k, v, mask=None: sdpa(q, k, v, mask, invert=True), "mask polarity inverted"),
    ("sdpa shape", check_scaled_dot_product_attention,
     lambda q, k, v, mask=None: sdpa(q, k, v, mask, transpose_out=True),
     "wrong output shape: expected the output of shape (..., L_q, d_v) = (2, 5, 4), "
     "got (2, 4, 5)"),
    ("split order", check_multi_head_attention, mha_with(split="view"),
     "heads split in the wrong order"),
    ("merge order", check_multi_head_attention, mha_with(merge="view"),
     "heads merged in the wrong order"),
    ("no output projection", check_multi_head_attention, mha_with(out_proj=False),
     "missing output projection"),
    ("mha shape", check_multi_head_attention, mha_with(unmerged=True),
     "wrong output shape: expected the output of shape (B, L_q, d_model) = (2, 5, 16), "
     "got (2, 4, 5, 4)"),
    ("sin cos swapped", check_positional_encoding, lambda n, d: pe(n, d, swap=True),
     "sin and cos swapped"),
    ("base 1000", check_positional_encoding, lambda n, d: pe(n, d, base=1000.0),
     "wrong frequency base"),
    ("base 500", check_positional_encoding, lambda n, d: pe(n, d, base=500.0),
     "wrong frequency base: your frequencies match base ~ 500"),
    ("pe shape", check_positional_encoding, lambda n, d: pe(n, d, transpose=True),
     "wrong output shape: expected the encoding of shape (max_len, d_model) = (10, 8), "
     "got (8, 10)"),
    ("unbiased variance", check_layer_norm, type("LN", (StudentLN,), {"unbiased": True}),
     "unbiased variance"),
    ("pre/post LN swapped", check_encoder_layer, encoder_with(swap_ln=True),
     "pre-LN and post-LN swapped"),
    ("encoder shape", check_encoder_layer, encoder_with(flat=True),
     "wrong output shape: expected the output of shape (B, L, d_model) = (2, 5, 16), got (2, 80)"),
]


@pytest.mark.parametrize("check, code, phrase", [m[1:] for m in MISTAKES],
                         ids=[m[0] for m in MISTAKES])
def test_mistake_is_named(check, code, phrase, capsys):
    result = check(code)
    assert not result.passed and result.score < 1
    assert any(phrase in h for h in result.hints), hints(result)
    out = capsys.readouterr().out
    assert phrase in out  # the hint is printed, on the line of its case
    assert all(ln.startswith(("[PASS] ", "[FAIL] ")) for ln in out.splitlines()[:-1])


def test_combined_mistakes_are_both_named():
    result = check_scaled_dot_product_attention(
        lambda q, k, v, mask=None: sdpa(q, k, v, mask, scale=False, invert=True), verbose=False)
    assert any("not scaled" in h and "polarity inverted" in h for h in result.hints), hints(result)


# ---------------------------------------------------------------------------------------------
# Nothing a student hands in makes a checker raise


def _raises(exc):
    def fn(*args, **kwargs):
        raise exc
    return fn


def _module_returning(value):
    class M(nn.Module):
        def __init__(self, *args, **kwargs):
            super().__init__()
            self.w_q, self.w_k, self.w_v, self.w_o = (nn.Linear(16, 16) for _ in range(4))
            self.weight = nn.Parameter(torch.ones(8))
            self.bias = nn.Parameter(torch.zeros(8))

        def forward(self, *args, **kwargs):
            return value(args[0]) if callable(value) else value
    return M


BAD = {
    "None": lambda *a, **k: None,
    "a string": lambda *a, **k: "attention",
    "NotImplementedError": _raises(NotImplementedError),
    "an exception": _raises(ZeroDivisionError("division by zero")),
    "sys.exit": _raises(SystemExit(1)),
    "NaN": lambda *a, **k: (torch.full((2, 5, 4), float("nan")),) * 2,
    "a wrong shape": lambda *a, **k: (torch.zeros(3), torch.zeros(3)),
    "a 1-tuple": lambda *a, **k: (torch.zeros(3),),
    "complex": lambda *a, **k: torch.zeros(2, 2, dtype=torch.complex64),
    "not callable": 42,
}
ALL_CHECKS = [check_scaled_dot_product_attention, check_multi_head_attention,
              check_positional_encoding, check_layer_norm, check_encoder_layer]


@pytest.mark.parametrize("check", ALL_CHECKS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("bad", list(BAD), ids=list(BAD))
def test_bad_code_never_raises(check, bad, capsys):
    result = check(BAD[bad])
    assert isinstance(result, CheckResult)
    assert result.passed is False and result.score == 0.0
    assert len(result.hints) == len(result.cases) > 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert all(ln.startswith("[FAIL] ") for ln in lines[:-1]) and "0/" in lines[-1]


@pytest.mark.parametrize("check", ALL_CHECKS[1:], ids=lambda c: c.__name__)
@pytest.mark.parametrize("value", [None, "x", lambda x: x * float("nan"), lambda x: x[..., :1]],
                         ids=["None", "str", "NaN", "shape"])
def test_bad_modules_never_raise(check, value):
    result = check(_module_returning(value), verbose=False)
    assert result.passed is False and result.score < 1


def test_messages_are_specific():
    r = check_scaled_dot_product_attention(BAD["NotImplementedError"], verbose=False)
    assert "not implemented yet" in r.hints[0]
    r = check_scaled_dot_product_attention(BAD["an exception"], verbose=False)
    assert "ZeroDivisionError: division by zero" in r.hints[0]
    r = check_positional_encoding(BAD["None"], verbose=False)
    assert "None" in r.hints[0] and "return" in r.hints[0]
    r = check_positional_encoding(lambda n, d: torch.full((n, d), float("nan")), verbose=False)
    assert "NaN" in r.hints[0]
    r = check_scaled_dot_product_attention(
        lambda q, k, v, mask=None: sdpa(q, k, v, None if mask is None else mask) if mask is None
        else _nan_rows(q, k, v, mask), verbose=False)
    assert r.cases[0].passed and "zero weights" in r.hints[-1]


def _nan_rows(q, k, v, mask):
    s = (q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])).masked_fill(~mask, float("-inf"))
    w = torch.softmax(s, -1)
    return w @ v, w


def test_checker_leaves_the_global_random_state_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    check_multi_head_attention(MultiHeadAttention, verbose=False)
    assert torch.equal(torch.rand(3), expected)


def test_more_hints():
    def big_negative(q, k, v, mask=None):
        s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        if mask is not None:
            s = s.masked_fill(~mask, -1e9)
        w = torch.softmax(s, -1)
        return w @ v, w

    r = check_scaled_dot_product_attention(big_negative, verbose=False)
    assert r.score == 0.75 and "uniform weights" in r.hints[0]
    r = check_positional_encoding(lambda n, d: pe(n, d)[None], verbose=False)
    assert "without a leading batch axis" in r.hints[0]
    r = check_multi_head_attention(
        type("M", (StudentMHA,), {"forward": lambda self, *a, **k: (StudentMHA.forward(
            self, *a, **k), None)}), verbose=False)
    assert "got a tuple of 2: return the tensor alone" in r.hints[0]
