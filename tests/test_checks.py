"""The assignment checkers in a notebook's process (utils.checks): the references agree with
torch, right code passes, known mistakes are named, gradients and inputs are checked, and
nothing a student hands in makes a checker raise."""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from grader.scan import static_scan
from utils.attention import MultiHeadAttention, scaled_dot_product_attention
from utils.checks import (
    CheckResult,
    check_layer_norm,
    check_multi_head_attention,
    check_positional_encoding,
    check_scaled_dot_product_attention,
)
from utils.checks.a1_attention import attend
from utils.checks.a2_multi_head_attention import mha
from utils.checks.a4_positional_layer_norm import layer_norm, sinusoid
from utils.checks.a6_encoder_layer import CHECKER as ENC
from utils.checks.a6_encoder_layer import encoder_layer
from utils.checks.guard import Rule
from utils.layers import LayerNorm
from utils.positional import sinusoidal_encoding


def test_attention_reference_matches_torch():
    q, k, v = torch.randn(2, 3, 5, 8), torch.randn(2, 3, 6, 8), torch.randn(2, 3, 6, 4)
    mask = torch.rand(2, 1, 5, 6) > 0.3
    mask[..., 0] = True
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert torch.allclose(attend(q, k, v, mask)[0], want, atol=1e-5)


def test_mha_reference_matches_torch():
    torch.manual_seed(0)
    m = nn.MultiheadAttention(16, 4, batch_first=True)
    w, b = m.in_proj_weight.detach().chunk(3), m.in_proj_bias.detach().chunk(3)
    p = {"w_q.weight": w[0], "w_k.weight": w[1], "w_v.weight": w[2], "w_q.bias": b[0],
         "w_k.bias": b[1], "w_v.bias": b[2], "w_o.weight": m.out_proj.weight.detach(),
         "w_o.bias": m.out_proj.bias.detach()}
    q, kv = torch.randn(2, 3, 16), torch.randn(2, 5, 16)
    assert torch.allclose(mha(p, 4, q, kv, kv), m(q, kv, kv)[0], atol=1e-5)


@pytest.mark.parametrize("norm_first", [False, True])
def test_encoder_reference_matches_torch(norm_first):
    torch.manual_seed(1)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True,
                                       norm_first=norm_first).train()
    a = layer.self_attn
    w, b = a.in_proj_weight.detach().chunk(3), a.in_proj_bias.detach().chunk(3)
    p = {f"self_attn.w_{n}.weight": w[i] for i, n in enumerate("qkv")}
    p.update({f"self_attn.w_{n}.bias": b[i] for i, n in enumerate("qkv")})
    p.update({"self_attn.w_o.weight": a.out_proj.weight, "self_attn.w_o.bias": a.out_proj.bias})
    for name in ("linear1", "linear2", "norm1", "norm2"):
        sub = getattr(layer, name)
        p[f"{name}.weight"], p[f"{name}.bias"] = sub.weight, sub.bias
    x = torch.randn(2, 5, 8)
    real = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])
    want = layer(x, src_key_padding_mask=~real)
    got = encoder_layer(p, x, real[:, None, None, :], nhead=2, norm_first=norm_first,
                        activation="relu")
    assert torch.allclose(got, want, atol=1e-5)


def test_pe_and_layer_norm_references():
    assert torch.allclose(sinusoid(20, 16).float(), sinusoidal_encoding(20, 16), atol=1e-6)
    x, w, b = torch.randn(3, 8), torch.randn(8), torch.randn(8)
    assert torch.allclose(layer_norm(x, w, b, 1e-5), F.layer_norm(x, (8,), w, b), atol=1e-5)


def test_right_code_passes(capsys):
    for result in (check_scaled_dot_product_attention(scaled_dot_product_attention),
                   check_multi_head_attention(MultiHeadAttention),
                   check_positional_encoding(sinusoidal_encoding),
                   check_layer_norm(LayerNorm)):
        assert result.passed and result.score == 1.0 and result.points == result.max_points
    out = capsys.readouterr().out
    assert "[FAIL]" not in out
    assert len(re.findall(r"cases passed, (\d+) of \1 points\n", out)) == 4, out


def _sdpa(**kw):
    return lambda q, k, v, mask=None: attend(q, k, v, mask, **kw)


@pytest.mark.parametrize("options, phrase", [
    ({"axis": 0}, "softmax over the batch axis"),
    ({"scale": "times_sqrt_dk"}, "multiplied by sqrt(d_k)"),
    ({"scale": "after"}, "scaling comes after the softmax"),
    ({"swap_kv": True}, "key and value swapped"),
    ({"invert": True, "scale": "none"}, "polarity inverted"),
    ({"mask_mode": "nan_rows"}, "gives NaN"),
])
def test_sdpa_mistakes_are_named(options, phrase):
    result = check_scaled_dot_product_attention(_sdpa(**options), verbose=False)
    assert not result.passed and any(phrase in h for h in result.hints), result.hints


def test_every_checker_names_at_least_eight_mistakes():
    from utils.checks import ASSIGNMENTS
    for assignment in ASSIGNMENTS.values():
        for checker in assignment.checkers:
            assert len({m.hint for m in checker.mistakes}) >= 8, checker.name
    assert any("LayerNorm(x + MHA(LayerNorm(x)))" in m.hint for m in ENC.mistakes)


class _LN(nn.Module):
    mode = "ok"

    def __init__(self, d, eps=1e-5):
        super().__init__()
        self.eps, self.weight, self.bias = eps, nn.Parameter(torch.ones(d)), nn.Parameter(
            torch.zeros(d))

    def forward(self, x):
        if self.mode == "in_place":
            x = x.detach()
            x.sub_(x.mean(-1, keepdim=True))
        mean = x.mean(-1, keepdim=True)
        var = x.var(-1, keepdim=True, unbiased=False)
        if self.mode == "var_detached":
            var = var.detach()
        out = (x - mean) / torch.sqrt(var + self.eps) * self.weight + self.bias
        return out.detach() if self.mode == "detached" else out


@pytest.mark.parametrize("mode, phrase", [
    ("detached", "detached from the autograd graph"),
    ("in_place", "changes its input `x` in place"),
    ("var_detached", "the variance is detached"),
])
def test_gradients_and_inputs_are_checked(mode, phrase):
    result = check_layer_norm(type("LN", (_LN,), {"mode": mode}), verbose=False)
    assert not result.passed and any(phrase in h for h in result.hints), result.hints


def test_unknown_mistakes_are_localized():
    class Odd(MultiHeadAttention):
        def forward(self, query, key, value, mask=None):
            return super().forward(query, key, value * 1.5, mask)

    result = check_multi_head_attention(Odd, verbose=False)
    assert any("`w_v`" in h for h in result.hints), result.hints


BAD = {
    "None": lambda *a, **k: None,
    "a string": lambda *a, **k: "attention",
    "NotImplementedError": lambda *a, **k: (_ for _ in ()).throw(NotImplementedError()),
    "sys.exit": lambda *a, **k: (_ for _ in ()).throw(SystemExit(1)),
    "NaN": lambda *a, **k: (torch.full((2, 5, 4), float("nan")),) * 2,
    "complex": lambda *a, **k: torch.zeros(2, 2, dtype=torch.complex64),
    "not callable": 42,
}


@pytest.mark.parametrize("bad", list(BAD))
def test_bad_code_never_raises(bad, capsys):
    for check in (check_scaled_dot_product_attention, check_multi_head_attention,
                  check_positional_encoding, check_layer_norm):
        result = check(BAD[bad])
        assert isinstance(result, CheckResult)
        assert result.passed is False and result.score == 0.0
    lines = capsys.readouterr().out.strip().splitlines()
    # A long line is wrapped to the book's 88 columns, its rest indented under the case's name.
    assert all(ln.startswith(("[FAIL] ", "check_", " " * 7)) for ln in lines)
    assert all(len(ln) <= 88 for ln in lines if " " in ln.strip()), lines


def test_a_case_that_hangs_fails_in_a_notebook_too():
    from utils.checks.checker import run_in_process

    def slow(q, k, v, mask=None):
        while True:
            pass

    result = run_in_process(check_scaled_dot_product_attention.__globals__["CHECKER"], slow,
                            verbose=False, timeout=0.2)
    assert result.score == 0 and "did not finish" in result.hints[0]


def test_global_state_is_restored():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)

    def meddle(q, k, v, mask=None):
        torch.set_default_dtype(torch.float64)
        torch.set_grad_enabled(False)
        return scaled_dot_product_attention(q, k, v, mask)

    check_scaled_dot_product_attention(meddle, verbose=False)
    assert torch.get_default_dtype() == torch.float32 and torch.is_grad_enabled()
    assert torch.equal(torch.rand(3), expected)


def test_static_scan_sees_imports():
    rules = [Rule("module", "utils.attention", "r"),
             Rule("code", "utils.attention", "c", qualname="MultiHeadAttention")]
    assert static_scan(["from utils.attention import scaled_dot_product_attention"],
                       rules[1:]) == []
    assert static_scan(["from utils.attention import MultiHeadAttention"], rules[1:]) == [
        rules[1].id]
    assert static_scan(["import utils.attention as a"], rules) == [rules[0].id]
    assert static_scan(["__import__('utils.attention')"], rules) == [rules[0].id]
    assert math.isfinite(1.0)


def test_the_decomposition_index_finds_what_a_full_walk_finds():
    """The grader's zygote indexes torch's Python decompositions and references once, by
    operator; a child poisons through the index what a walk of every one would find."""
    import sys

    import torch._decomp  # noqa: F401
    import torch._refs  # noqa: F401

    from grader import families

    table = families._decomposition_table()
    index = families._DecompositionIndex(table)
    assert index.table_size == len(table) > 100
    found = 0
    for name in ("native_batch_norm", "native_group_norm", "batch_norm", "rms_norm",
                 "native_layer_norm", "_softmax", "softmax", "instance_norm"):
        walked_ops = {op for op in list(table) if families._base_name(op) == name}
        assert set(index.ops.get(name, [])) == walked_ops, name
        walked = {id(f) for m in list(sys.modules) if m.startswith(families._DECOMP_MODULES)
                  for f in families._functions_in(sys.modules[m]) if f.__name__ == name}
        assert {id(f) for f in index.functions.get(name, [])} == walked, name
        found += len(walked_ops) + len(walked)
    assert found > 10  # the names above do have decompositions and references to poison
