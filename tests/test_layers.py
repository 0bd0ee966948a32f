"""Tests of utils.layers: LayerNorm, RMSNorm, feed-forward networks, the mixture of experts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from utils.layers import (
    LayerNorm,
    MixtureOfExperts,
    PositionwiseFeedForward,
    RMSNorm,
    gated_ffn_width,
)


def _randomize(module):
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p))
    return module


# ----- LayerNorm -----------------------------------------------------------------------------

FUSED = pytest.mark.parametrize("fused", [True, False], ids=["fused", "from-scratch"])


@FUSED
def test_layernorm_matches_the_formula_and_torch(fused):
    torch.manual_seed(0)
    x = torch.randn(2, 5, 8) * 3 + 1
    ln = _randomize(LayerNorm(8, fused=fused))
    mean = x.mean(-1, keepdim=True)
    var = x.var(-1, unbiased=False, keepdim=True)
    expected = (x - mean) / torch.sqrt(var + 1e-5) * ln.weight + ln.bias
    torch.testing.assert_close(ln(x), expected)
    torch.testing.assert_close(
        ln(x), F.layer_norm(x, (8,), ln.weight, ln.bias, eps=1e-5), atol=1e-5, rtol=0
    )


@FUSED
def test_layernorm_at_init_gives_zero_mean_unit_variance(fused):
    x = torch.randn(4, 16, dtype=torch.float64) * 5 + 2
    y = LayerNorm(16, eps=0.0, fused=fused).double()(x)
    torch.testing.assert_close(y.mean(-1), torch.zeros(4, dtype=torch.float64))
    torch.testing.assert_close(y.var(-1, unbiased=False), torch.ones(4, dtype=torch.float64))


@FUSED
@pytest.mark.parametrize("eps", [1e-5, 1e-3])
def test_layernorm_from_torch(eps, fused):
    torch.manual_seed(0)
    ref = _randomize(nn.LayerNorm(12, eps=eps))
    ours = LayerNorm.from_torch(ref)
    assert ours.eps == eps and ours.fused
    ours.fused = fused
    x = torch.randn(3, 4, 12)
    torch.testing.assert_close(ours(x), ref(x), atol=1e-5, rtol=0)


@FUSED
def test_layernorm_from_torch_float64_and_no_affine(fused):
    ref = nn.LayerNorm(6, elementwise_affine=False)
    x = torch.randn(2, 6)
    copy = LayerNorm.from_torch(ref)
    copy.fused = fused
    torch.testing.assert_close(copy(x), ref(x), atol=1e-5, rtol=0)
    ref64 = _randomize(nn.LayerNorm(6).double())
    ours = LayerNorm.from_torch(ref64)
    ours.fused = fused
    assert ours.weight.dtype == torch.float64
    x64 = torch.randn(2, 6, dtype=torch.float64)
    torch.testing.assert_close(ours(x64), ref64(x64))


@FUSED
def test_layernorm_gradcheck(fused):
    """The module's own backward pass, with respect to the input, the gain and the bias."""
    torch.manual_seed(0)
    ln = _randomize(LayerNorm(5, fused=fused)).double()
    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    w = ln.weight.detach().clone().requires_grad_(True)
    b = ln.bias.detach().clone().requires_grad_(True)

    def run(x, w, b):
        return torch.func.functional_call(ln, {"weight": w, "bias": b}, (x,))

    assert torch.autograd.gradcheck(run, (x, w, b))


@FUSED
def test_layernorm_gradcheck_through_module(fused):
    ln = _randomize(LayerNorm(4, fused=fused)).double()
    x = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(ln, (x,))


@pytest.mark.parametrize("seed", range(30))
def test_layernorm_fused_equals_from_scratch(seed):
    """The default fused path and chapter 7's formula: same output and gradients (input, gain,
    bias) over random shapes, widths, eps, dtypes and affine settings, including constant rows
    (zeros there with eps > 0, NaN in both with eps = 0) and an empty batch."""
    g = torch.Generator().manual_seed(seed)
    dtype = (torch.float32, torch.float64)[seed % 2]
    d = int(torch.randint(1, 40, (1,), generator=g))
    rank = int(torch.randint(0, 3, (1,), generator=g))
    lead = tuple(int(n) for n in torch.randint(0, 5, (rank,), generator=g))
    eps = (1e-5, 1e-3, 0.0)[seed % 3]
    affine, bias = ((True, True), (True, False), (False, False))[seed // 3 % 3]
    x = (torch.randn(*lead, d, generator=g, dtype=dtype) * 4 + 3)
    if x.dim() > 1 and x.shape[0] > 0:
        x[0] = 2.5  # a constant row
    fused = LayerNorm(d, eps=eps, elementwise_affine=affine, bias=bias).to(dtype)
    _randomize(fused)
    scratch = LayerNorm(d, eps=eps, elementwise_affine=affine, bias=bias, fused=False).to(dtype)
    scratch.load_state_dict(fused.state_dict())
    tol = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-10, rtol=1e-9)
    upstream = torch.randn(x.shape, generator=g, dtype=dtype)
    outs, grads = [], []
    for m in (fused, scratch):
        xi = x.clone().requires_grad_(True)
        y = m(xi)
        outs.append(y)
        (y.nan_to_num() * upstream).sum().backward()
        grads.append([t.grad for t in (xi, *m.parameters())])
    torch.testing.assert_close(outs[0], outs[1], equal_nan=True, **tol)
    assert torch.equal(outs[0].isnan(), outs[1].isnan())
    if eps > 0 and x.numel():
        assert not outs[0].isnan().any()
    for a, b in zip(*grads, strict=True):
        if a is not None or b is not None:
            torch.testing.assert_close(a, b, equal_nan=True, **tol)


def test_layernorm_fused_switch_and_repr():
    ln = LayerNorm(4)
    assert ln.fused and "fused" not in repr(ln)
    assert "fused=False" in repr(LayerNorm(4, fused=False))
    with pytest.raises(Exception, match="fused"):
        LayerNorm(4, fused=1)


def test_layernorm_bad_inputs():
    with pytest.raises(ValueError, match=r"d_model=8\), got \(2, 7\)"):
        LayerNorm(8)(torch.randn(2, 7))
    with pytest.raises(ValueError):
        LayerNorm(0)
    with pytest.raises(ValueError, match="nn.LayerNorm"):
        LayerNorm.from_torch(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="single"):
        LayerNorm.from_torch(nn.LayerNorm([2, 3]))


# ----- RMSNorm -------------------------------------------------------------------------------

@pytest.mark.parametrize("eps", [None, 1e-6, 1e-2])
def test_rmsnorm_from_torch(eps):
    torch.manual_seed(0)
    ref = _randomize(nn.RMSNorm(10, eps=eps))
    ours = RMSNorm.from_torch(ref)
    x = torch.randn(2, 3, 10)
    torch.testing.assert_close(ours(x), ref(x), atol=1e-5, rtol=0)


def test_rmsnorm_formula_and_scale_invariance():
    torch.manual_seed(0)
    x = torch.randn(4, 8, dtype=torch.float64)
    rms = RMSNorm(8, eps=0.0).double()
    y = rms(x)
    torch.testing.assert_close(y, x / x.pow(2).mean(-1, keepdim=True).sqrt())
    torch.testing.assert_close(y.pow(2).mean(-1), torch.ones(4, dtype=torch.float64))
    torch.testing.assert_close(rms(7.5 * x), y)


def test_rmsnorm_gradcheck():
    torch.manual_seed(0)
    rms = _randomize(RMSNorm(5)).double()
    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(rms, (x,))


def test_rmsnorm_bad_inputs():
    with pytest.raises(ValueError, match=r"d_model=4\), got \(3,\s?\)|d_model=4\), got \(3\)"):
        RMSNorm(4)(torch.randn(3))
    with pytest.raises(ValueError, match="nn.RMSNorm"):
        RMSNorm.from_torch(nn.LayerNorm(4))


# ----- Feed-forward --------------------------------------------------------------------------

@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_ffn_matches_the_formula(activation):
    torch.manual_seed(0)
    ffn = PositionwiseFeedForward(6, 24, activation=activation)
    x = torch.randn(2, 5, 6)
    act = F.relu if activation == "relu" else F.gelu
    w1, b1, w2, b2 = ffn.linear1.weight, ffn.linear1.bias, ffn.linear2.weight, ffn.linear2.bias
    torch.testing.assert_close(ffn(x), act(x @ w1.T + b1) @ w2.T + b2)


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_ffn_is_the_one_inside_torch_encoder_layer(activation):
    """Copy linear1/linear2 from a TransformerEncoderLayer: the same FFN output."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=32, dropout=0.0,
                                       activation=activation, batch_first=True)
    ffn = PositionwiseFeedForward(8, 32, activation=activation)
    ffn.linear1.load_state_dict(layer.linear1.state_dict())
    ffn.linear2.load_state_dict(layer.linear2.state_dict())
    x = torch.randn(2, 5, 8)
    torch.testing.assert_close(ffn(x), layer._ff_block(x), atol=1e-5, rtol=0)


def test_ffn_acts_on_each_position_alone():
    torch.manual_seed(0)
    ffn = PositionwiseFeedForward(4, 16)
    x = torch.randn(1, 6, 4)
    full = ffn(x)
    for t in range(6):
        torch.testing.assert_close(full[0, t], ffn(x[0, t]))
    perm = torch.randperm(6)
    torch.testing.assert_close(ffn(x[:, perm]), full[:, perm])


def test_ffn_equals_two_kernel_size_one_convolutions():
    torch.manual_seed(0)
    ffn = PositionwiseFeedForward(6, 12)
    conv1, conv2 = nn.Conv1d(6, 12, 1), nn.Conv1d(12, 6, 1)
    with torch.no_grad():
        conv1.weight.copy_(ffn.linear1.weight[:, :, None])
        conv1.bias.copy_(ffn.linear1.bias)
        conv2.weight.copy_(ffn.linear2.weight[:, :, None])
        conv2.bias.copy_(ffn.linear2.bias)
    x = torch.randn(2, 9, 6)
    conv_out = conv2(F.relu(conv1(x.transpose(1, 2)))).transpose(1, 2)
    torch.testing.assert_close(ffn(x), conv_out, atol=1e-5, rtol=0)


@pytest.mark.parametrize("activation,gate_act", [
    ("glu", torch.sigmoid), ("reglu", F.relu), ("geglu", F.gelu), ("swiglu", F.silu),
])
def test_gated_ffn_matches_the_formula(activation, gate_act):
    torch.manual_seed(0)
    ffn = PositionwiseFeedForward(6, 10, activation=activation)
    assert ffn.gate is not None and ffn.gated
    x = torch.randn(3, 6)
    hidden = gate_act(ffn.gate(x)) * ffn.linear1(x)
    torch.testing.assert_close(ffn(x), ffn.linear2(hidden))


def test_glu_variant_matches_torch_glu():
    """F.glu(a ++ b) = a * sigmoid(b): our "glu" with linear1 = a, gate = b."""
    torch.manual_seed(0)
    ffn = PositionwiseFeedForward(5, 7, activation="glu")
    x = torch.randn(4, 5)
    both = torch.cat([ffn.linear1(x), ffn.gate(x)], dim=-1)
    torch.testing.assert_close(ffn(x), ffn.linear2(F.glu(both, dim=-1)))


def test_gated_width_matches_parameters():
    assert gated_ffn_width(2048) == 1365
    assert gated_ffn_width(2048, multiple_of=8) == 1368
    d_model, d_ff = 64, 256
    plain = PositionwiseFeedForward(d_model, d_ff, bias=False)
    gated = PositionwiseFeedForward(d_model, gated_ffn_width(d_ff), activation="swiglu", bias=False)
    n_plain = sum(p.numel() for p in plain.parameters())
    n_gated = sum(p.numel() for p in gated.parameters())
    assert abs(n_gated - n_plain) / n_plain < 0.01


def test_ffn_dropout_only_in_training():
    torch.manual_seed(0)
    ffn = PositionwiseFeedForward(4, 8, dropout=0.5)
    x = torch.randn(10, 4)
    ffn.eval()
    torch.testing.assert_close(ffn(x), ffn.linear2(F.relu(ffn.linear1(x))))
    ffn.train()
    assert not torch.allclose(ffn(x), ffn.linear2(F.relu(ffn.linear1(x))))


@pytest.mark.parametrize("activation", ["relu", "swiglu"])
def test_ffn_dropout_sits_between_activation_and_w2(activation):
    """Train mode: linear2(dropout(hidden(x))), survivors scaled by 1 / (1 - p)."""
    p = 0.3
    ffn = PositionwiseFeedForward(6, 16, dropout=p, activation=activation).train()
    x = torch.randn(40, 6)
    with torch.no_grad():
        torch.manual_seed(3)
        out = ffn(x)
        torch.manual_seed(3)
        hidden = ffn.hidden(x)
        dropped = ffn.dropout(hidden)
        torch.testing.assert_close(out, ffn.linear2(dropped), atol=0, rtol=0)
        kept = dropped != 0
        assert 0 < kept.sum() < hidden.numel()
        torch.testing.assert_close(dropped[kept], hidden[kept] / (1 - p))


def test_ffn_dropout_matches_torch_ff_block_up_to_dropout2():
    """PyTorch's _ff_block is our FFN followed by dropout2, with the same random masks."""
    d_model, d_ff, p = 8, 32, 0.2
    layer = nn.TransformerEncoderLayer(d_model, 2, d_ff, dropout=p, batch_first=True).train()
    ffn = PositionwiseFeedForward(d_model, d_ff, dropout=p).train()
    ffn.linear1.load_state_dict(layer.linear1.state_dict())
    ffn.linear2.load_state_dict(layer.linear2.state_dict())
    x = torch.randn(2, 5, d_model)
    with torch.no_grad():
        torch.manual_seed(7)
        ours = layer.dropout2(ffn(x))
        torch.manual_seed(7)
        torch.testing.assert_close(ours, layer._ff_block(x), atol=1e-6, rtol=0)


def test_ffn_bad_inputs():
    with pytest.raises(ValueError, match="activation"):
        PositionwiseFeedForward(4, 8, activation="tanh")
    with pytest.raises(ValueError):
        PositionwiseFeedForward(4, 0)
    with pytest.raises(ValueError):
        PositionwiseFeedForward(4, 8, dropout=1.5)
    with pytest.raises(ValueError, match=r"d_model=4\), got \(2, 3, 5\)"):
        PositionwiseFeedForward(4, 8)(torch.randn(2, 3, 5))
    with pytest.raises(ValueError, match=r"d_model=4\), got \(2, 5\)"):
        PositionwiseFeedForward(4, 8, activation="swiglu")(torch.randn(2, 5))


# ----- Mixture of experts --------------------------------------------------------------------

def test_moe_routes_each_token_to_its_top_expert():
    torch.manual_seed(0)
    moe = MixtureOfExperts(6, 12, num_experts=4)
    x = torch.randn(2, 10, 6)
    out = moe(x)
    assert out.shape == x.shape
    probs = torch.softmax(x @ moe.router.weight.T, dim=-1)
    p, idx = probs.max(-1)
    assert torch.equal(moe.last_assignment, idx)
    assert moe.last_counts.tolist() == torch.bincount(idx.flatten(), minlength=4).tolist()
    assert int(moe.last_counts.sum()) == 20
    for b in range(2):
        for t in range(10):
            e = int(idx[b, t])
            torch.testing.assert_close(out[b, t], p[b, t] * moe.experts[e](x[b, t]))


def test_moe_gradients_reach_router_and_used_experts():
    torch.manual_seed(0)
    moe = MixtureOfExperts(4, 8, num_experts=3)
    x = torch.randn(16, 4)
    moe(x).sum().backward()
    assert moe.router.weight.grad is not None and moe.router.weight.grad.abs().sum() > 0
    for e, expert in enumerate(moe.experts):
        used = int(moe.last_counts[e]) > 0
        grad = expert.linear1.weight.grad
        assert (grad is not None and grad.abs().sum() > 0) == used


def test_moe_bad_inputs():
    with pytest.raises(ValueError):
        MixtureOfExperts(4, 8, num_experts=0)
    with pytest.raises(ValueError, match=r"d_model=4\), got \(3, 5\)"):
        MixtureOfExperts(4, 8, 2)(torch.randn(3, 5))
