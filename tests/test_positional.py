"""Tests of utils.positional: the sinusoidal encoding, learned embeddings and RoPE."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from utils.positional import (
    LearnedPositionalEmbedding,
    RotaryEmbedding,
    SinusoidalPositionalEncoding,
    TokenEmbedding,
    apply_rope,
    permute_rope_weight,
    rope_angles,
    rope_permutation,
    sinusoidal_encoding,
    sinusoidal_shift_matrix,
)


def test_sinusoidal_matches_the_formula_entry_by_entry():
    max_len, d = 12, 10
    pe = sinusoidal_encoding(max_len, d)
    assert pe.shape == (max_len, d) and pe.dtype == torch.float32
    for t in range(max_len):
        for i in range(d):
            w = 1.0 / 10000 ** (2 * (i // 2) / d)
            expected = math.sin(t * w) if i % 2 == 0 else math.cos(t * w)
            assert abs(pe[t, i].item() - expected) < 1e-6


def test_sinusoidal_first_row_and_range():
    pe = sinusoidal_encoding(50, 16)
    assert torch.equal(pe[0, 0::2], torch.zeros(8))
    assert torch.equal(pe[0, 1::2], torch.ones(8))
    assert pe.abs().max() <= 1.0
    # every position's vector has squared norm d_model / 2 (sin^2 + cos^2 = 1 per pair)
    torch.testing.assert_close(pe.pow(2).sum(-1), torch.full((50,), 8.0))


@pytest.mark.parametrize("offset", [1, 3, 7, 20, -5])
def test_shift_matrix_maps_every_position(offset):
    d = 16
    pe = sinusoidal_encoding(64, d).double()
    m = sinusoidal_shift_matrix(offset, d)
    ts = torch.arange(max(0, -offset), 64 - max(0, offset))
    torch.testing.assert_close(pe[ts] @ m, pe[ts + offset], atol=1e-6, rtol=0)
    # a rotation per pair: orthogonal
    torch.testing.assert_close(m @ m.T, torch.eye(d, dtype=torch.float64))


@pytest.mark.parametrize("offset", [0, 1, 2, 5, 11, 30])
def test_sinusoidal_dot_product_depends_on_offset_only(offset):
    pe = sinusoidal_encoding(100, 32).double()
    t = torch.arange(0, 100 - offset)
    dots = (pe[t] * pe[t + offset]).sum(-1)
    torch.testing.assert_close(dots, torch.full_like(dots, dots[0].item()), atol=1e-5, rtol=0)
    # and it equals sum_k cos(offset * w_k)
    w = 1.0 / 10000 ** (torch.arange(0, 32, 2, dtype=torch.float64) / 32)
    assert abs(dots[0].item() - torch.cos(offset * w).sum().item()) < 1e-5


@pytest.mark.parametrize("args", [(0, 8), (5, 7), (5, 0), (-1, 4), (3.0, 4)])
def test_sinusoidal_bad_sizes(args):
    with pytest.raises(ValueError):
        sinusoidal_encoding(*args)


def test_sinusoidal_module_adds_the_encoding():
    mod = SinusoidalPositionalEncoding(8, max_len=20)
    x = torch.randn(2, 5, 8)
    torch.testing.assert_close(mod(x), x + sinusoidal_encoding(5, 8))
    with pytest.raises(ValueError, match=r"max_len=20"):
        mod(torch.randn(1, 21, 8))
    with pytest.raises(ValueError, match=r"\(2, 5, 6\)"):
        mod(torch.randn(2, 5, 6))


def test_learned_embedding_adds_its_rows_and_refuses_longer_inputs():
    torch.manual_seed(0)
    mod = LearnedPositionalEmbedding(10, 4)
    assert mod.weight.shape == (10, 4)
    x = torch.randn(3, 6, 4)
    torch.testing.assert_close(mod(x), x + mod.weight[:6])
    mod(x).sum().backward()
    assert torch.all(mod.weight.grad[6:] == 0) and torch.all(mod.weight.grad[:6] != 0)
    with pytest.raises(ValueError, match=r"L=11"):
        mod(torch.randn(1, 11, 4))
    with pytest.raises(ValueError, match=r"got \(6, 4\)"):
        mod(torch.randn(6, 4))
    with pytest.raises(ValueError, match=r"d_model=4\), got \(1, 6, 5\)"):
        mod(torch.randn(1, 6, 5))


def test_token_embedding_scale():
    torch.manual_seed(0)
    emb = TokenEmbedding(50, 16)
    ids = torch.tensor([[1, 2, 3]])
    torch.testing.assert_close(emb(ids), emb.embedding.weight[ids] * 4.0)
    unscaled = TokenEmbedding(50, 16, scale=False)
    torch.testing.assert_close(unscaled(ids), unscaled.embedding.weight[ids])
    with pytest.raises(ValueError, match="integer"):
        emb(torch.zeros(1, 3))


def _rope_by_loops(x, positions, base=10000.0):
    """RoPE written pair by pair with explicit 2x2 rotation matrices."""
    length, d = x.shape
    out = torch.empty_like(x)
    for t in range(length):
        for k in range(d // 2):
            angle = positions[t].item() * base ** (-2 * k / d)
            rot = torch.tensor([[math.cos(angle), -math.sin(angle)],
                                [math.sin(angle), math.cos(angle)]], dtype=x.dtype)
            out[t, 2 * k: 2 * k + 2] = rot @ x[t, 2 * k: 2 * k + 2]
    return out


def test_rope_matches_rotation_matrices_and_complex_numbers():
    torch.manual_seed(0)
    x = torch.randn(7, 8, dtype=torch.float64)
    pos = torch.arange(7)
    got = apply_rope(x, pos)
    torch.testing.assert_close(got, _rope_by_loops(x, pos))
    # the same as multiplying complex numbers x_{2k} + i x_{2k+1} by exp(i t w_k)
    z = torch.view_as_complex(x.reshape(7, 4, 2).contiguous())
    z = z * torch.polar(torch.ones(7, 4, dtype=torch.float64), rope_angles(pos, 8))
    torch.testing.assert_close(got, torch.view_as_real(z).reshape(7, 8))


def test_rope_keeps_norms_and_position_zero():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 9, 16)
    y = apply_rope(x)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))
    torch.testing.assert_close(y[..., 0, :], x[..., 0, :])
    assert y.shape == x.shape and y.dtype == x.dtype


@pytest.mark.parametrize("seed", range(5))
def test_rope_score_depends_only_on_offset(seed):
    g = torch.Generator().manual_seed(seed)
    d = 16
    q = torch.randn(d, dtype=torch.float64, generator=g)
    k = torch.randn(d, dtype=torch.float64, generator=g)
    m, n = torch.randint(0, 500, (2,), generator=g).tolist()
    shift = torch.randint(-200, 200, (1,), generator=g).item()

    def score(a, b):
        qa = apply_rope(q[None], torch.tensor([a]))[0]
        kb = apply_rope(k[None], torch.tensor([b]))[0]
        return (qa @ kb).item()

    assert abs(score(m, n) - score(m + shift, n + shift)) < 1e-9
    # with no offset the rotation cancels out
    assert abs(score(m, m) - (q @ k).item()) < 1e-9


def test_rope_batched_positions_and_module():
    torch.manual_seed(0)
    x = torch.randn(2, 5, 8)
    pos = torch.tensor([[0, 1, 2, 3, 4], [10, 11, 12, 13, 14]])
    y = apply_rope(x, pos)
    torch.testing.assert_close(y[1], apply_rope(x[1], pos[1]))
    rot = RotaryEmbedding(8)
    torch.testing.assert_close(rot(x), apply_rope(x))
    torch.testing.assert_close(rot(x, pos), y)


def test_rope_bad_inputs():
    with pytest.raises(ValueError, match=r"even"):
        apply_rope(torch.randn(4, 5))
    with pytest.raises(ValueError, match=r"\(\.\.\., L, d\)"):
        apply_rope(torch.randn(6))
    with pytest.raises(ValueError, match=r"L=4"):
        apply_rope(torch.randn(4, 6), torch.arange(5))
    with pytest.raises(ValueError, match=r"broadcast"):
        apply_rope(torch.randn(2, 4, 6), torch.zeros(3, 4))
    with pytest.raises(ValueError, match=r"\(3, 4\) do not broadcast to x's \(\.\.\., L\) = \(4\)"):
        apply_rope(torch.randn(4, 6), torch.zeros(3, 4))  # more batch dims than x has
    with pytest.raises(ValueError, match=r"dim=8"):
        RotaryEmbedding(8)(torch.randn(3, 6))
    with pytest.raises(ValueError):
        RotaryEmbedding(7)


# ----- the sign of the rotation and the two layouts ------------------------------------------

@pytest.mark.parametrize("t", [0, 1, 7, 123])
def test_rope_is_the_transposed_shift_matrix_in_row_form(t):
    """apply_rope(x, t) = x R_t^T = x R_{-t}, with R_t the shift matrix of the encoding."""
    torch.manual_seed(t)
    d = 12
    x = torch.randn(1, d, dtype=torch.float64)
    got = apply_rope(x, torch.tensor([t]))
    torch.testing.assert_close(got, x @ sinusoidal_shift_matrix(t, d).T)
    torch.testing.assert_close(got, x @ sinusoidal_shift_matrix(-t, d))


def test_rope_score_is_q_r_n_minus_m_k():
    torch.manual_seed(0)
    d, m, n = 16, 9, 4
    q = torch.randn(d, dtype=torch.float64)
    k = torch.randn(d, dtype=torch.float64)
    score = apply_rope(q[None], torch.tensor([m]))[0] @ apply_rope(k[None], torch.tensor([n]))[0]
    assert abs(score - q @ sinusoidal_shift_matrix(n - m, d) @ k) < 1e-12
    assert abs(score - q @ sinusoidal_shift_matrix(m - n, d) @ k) > 1e-3  # the other sign is wrong


def _rotate_half_reference(x, positions, base=10000.0):
    """The half layout as the Hugging Face Llama code writes it: x cos + rotate_half(x) sin."""
    d = x.shape[-1]
    inv_freq = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    freqs = positions.double()[:, None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    half1, half2 = x[..., : d // 2], x[..., d // 2:]
    rotated = torch.cat([-half2, half1], dim=-1)
    return x * emb.cos().to(x.dtype) + rotated * emb.sin().to(x.dtype)


def test_rope_half_layout_matches_rotate_half():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 11, 16, dtype=torch.float64)
    pos = torch.arange(11) + 5
    torch.testing.assert_close(apply_rope(x, pos, layout="half"), _rotate_half_reference(x, pos))
    torch.testing.assert_close(RotaryEmbedding(16, layout="half")(x, pos),
                               _rotate_half_reference(x, pos))


@pytest.mark.parametrize("d", [2, 8, 14])
def test_rope_permutation_maps_one_layout_to_the_other(d):
    torch.manual_seed(d)
    x = torch.randn(3, 9, d, dtype=torch.float64)
    pos = torch.arange(9) * 3
    p = rope_permutation(d)
    assert sorted(p.tolist()) == list(range(d))
    if d == 8:
        assert p.tolist() == [0, 2, 4, 6, 1, 3, 5, 7]
    torch.testing.assert_close(apply_rope(x[..., p], pos, layout="half"),
                               apply_rope(x, pos)[..., p])
    back = rope_permutation(d, to="interleaved")
    torch.testing.assert_close(x[..., p][..., back], x)
    torch.testing.assert_close(apply_rope(x[..., back], pos)[..., p][..., p],
                               apply_rope(x, pos, layout="half")[..., p])


@pytest.mark.parametrize("bias", [True, False])
def test_permuted_projections_give_the_same_scores_in_the_half_layout(bias):
    torch.manual_seed(0)
    d_model, h, L = 24, 3, 10
    d_k = d_model // h
    wq, wk = nn.Linear(d_model, d_model, bias=bias), nn.Linear(d_model, d_model, bias=bias)
    x = torch.randn(2, L, d_model)

    def scores(q_lin, k_lin, layout):
        q = q_lin(x).reshape(2, L, h, d_k).transpose(1, 2)
        k = k_lin(x).reshape(2, L, h, d_k).transpose(1, 2)
        return apply_rope(q, layout=layout) @ apply_rope(k, layout=layout).transpose(-2, -1)

    wq2, wk2 = nn.Linear(d_model, d_model, bias=bias), nn.Linear(d_model, d_model, bias=bias)
    with torch.no_grad():
        for new, old in ((wq2, wq), (wk2, wk)):
            new.weight.copy_(permute_rope_weight(old.weight, h))
            if bias:
                new.bias.copy_(permute_rope_weight(old.bias, h))
        ref = scores(wq, wk, "interleaved")
        torch.testing.assert_close(scores(wq2, wk2, "half"), ref, atol=1e-5, rtol=0)
        # without the permutation the half layout gives other scores
        assert (scores(wq, wk, "half") - ref).abs().max() > 1e-2
        # and the way back restores the original weights exactly
        assert torch.equal(permute_rope_weight(wq2.weight, h, to="interleaved"), wq.weight)


def test_rope_layout_bad_inputs():
    with pytest.raises(ValueError, match="layout"):
        apply_rope(torch.randn(3, 4), layout="halves")
    with pytest.raises(ValueError, match="layout"):
        RotaryEmbedding(4, layout="rotate_half")
    assert permute_rope_weight(torch.randn(12, 5), 3).shape == (12, 5)  # d_k = 4 is fine
    with pytest.raises(ValueError, match=r"num_heads=5 and d_k even, got \(12, 5\)"):
        permute_rope_weight(torch.randn(12, 5), 5)  # 12 does not split into 5 heads
    with pytest.raises(ValueError, match=r"d_k even"):
        permute_rope_weight(torch.randn(6, 5), 2)   # d_k = 3 is odd
    with pytest.raises(ValueError, match="even"):
        rope_permutation(5)
    with pytest.raises(ValueError, match="to must be"):
        rope_permutation(4, to="x")
