"""Tests of utils.attention.scaled_dot_product_attention (chapter 1).

Compared with torch.nn.functional.scaled_dot_product_attention, whose bool ``attn_mask`` has the
same polarity as the book's masks (True = may attend).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from utils.attention import scaled_dot_product_attention

ATOL = 1e-5


def _qkv(batch, l_q, l_k, d_k, d_v, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(*batch, l_q, d_k, generator=g, dtype=dtype)
    k = torch.randn(*batch, l_k, d_k, generator=g, dtype=dtype)
    v = torch.randn(*batch, l_k, d_v, generator=g, dtype=dtype)
    return q, k, v


def _random_mask(shape, seed=1):
    """A random bool mask in which every query row keeps at least one key."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(*shape, generator=g) > 0.5
    mask[..., 0] = True
    return mask


@pytest.mark.parametrize("batch", [(), (3,), (2, 4)], ids=["0 batch dims", "1", "2"])
@pytest.mark.parametrize(
    "l_q, l_k, d_k, d_v", [(1, 1, 1, 1), (5, 5, 8, 8), (4, 7, 16, 3), (6, 2, 5, 11)]
)
def test_matches_torch(batch, l_q, l_k, d_k, d_v):
    q, k, v = _qkv(batch, l_q, l_k, d_k, d_v)
    out, weights = scaled_dot_product_attention(q, k, v)
    expected = F.scaled_dot_product_attention(q, k, v)
    assert out.shape == (*batch, l_q, d_v)
    assert weights.shape == (*batch, l_q, l_k)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)


def test_matches_the_formula():
    q, k, v = _qkv((2,), 3, 4, 6, 5, dtype=torch.float64)
    out, weights = scaled_dot_product_attention(q, k, v)
    scores = torch.einsum("bqd,bkd->bqk", q, k) / math.sqrt(6)
    expected_w = scores.exp() / scores.exp().sum(-1, keepdim=True)
    torch.testing.assert_close(weights, expected_w)
    torch.testing.assert_close(out, torch.einsum("bqk,bkd->bqd", expected_w, v))


def test_weights_are_a_distribution():
    q, k, v = _qkv((2, 3), 5, 7, 4, 4)
    _, weights = scaled_dot_product_attention(q, k, v)
    assert (weights >= 0).all()
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 3, 5))


def test_one_key_gets_all_the_weight():
    q, k, v = _qkv((), 4, 1, 3, 2)
    out, weights = scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(weights, torch.ones(4, 1))
    torch.testing.assert_close(out, v.expand(4, 2))


def test_broadcast_batch_dims():
    """A single k, v shared by every batch element, as in torch's broadcasting."""
    q, _, _ = _qkv((2, 3), 4, 5, 6, 2)
    _, k, v = _qkv((), 4, 5, 6, 2, seed=3)
    out, weights = scaled_dot_product_attention(q, k, v)
    assert out.shape == (2, 3, 4, 2) and weights.shape == (2, 3, 4, 5)
    expected = F.scaled_dot_product_attention(q, k.expand(2, 3, 5, 6), v.expand(2, 3, 5, 2))
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    "mask_shape",
    [(4, 6), (1, 4, 6), (2, 3, 4, 6), (2, 1, 4, 6), (1, 3, 1, 6), (6,)],
    ids=["(L_q,L_k)", "(1,L_q,L_k)", "full", "(B,1,L_q,L_k)", "(1,h,1,L_k)", "(L_k,)"],
)
def test_bool_mask_matches_torch(mask_shape):
    q, k, v = _qkv((2, 3), 4, 6, 8, 5)
    mask = _random_mask(mask_shape)
    out, weights = scaled_dot_product_attention(q, k, v, mask)
    # torch's mask needs at least 2 dims; give it the broadcast mask in full
    full = mask.expand(2, 3, 4, 6)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=full)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)
    # masked keys get exactly zero weight; the rest still sum to one
    assert (weights.masked_select(~mask.expand_as(weights)) == 0).all()
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 3, 4))


def test_all_true_mask_changes_nothing():
    q, k, v = _qkv((2,), 3, 4, 5, 5)
    out, _ = scaled_dot_product_attention(q, k, v)
    out_m, _ = scaled_dot_product_attention(q, k, v, torch.ones(3, 4, dtype=torch.bool))
    torch.testing.assert_close(out, out_m, atol=0, rtol=0)


def test_causal_mask_matches_is_causal():
    q, k, v = _qkv((2,), 5, 5, 4, 4)
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    out, weights = scaled_dot_product_attention(q, k, v, causal)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)
    assert (weights.triu(1) == 0).all()


def test_fully_masked_row_gives_zeros_and_no_nan():
    q, k, v = _qkv((2,), 3, 4, 5, 6, dtype=torch.float64)
    q.requires_grad_(True)
    k.requires_grad_(True)
    v.requires_grad_(True)
    mask = torch.ones(2, 3, 4, dtype=torch.bool)
    mask[0, 1] = False  # query 1 of batch element 0 may attend to nothing
    out, weights = scaled_dot_product_attention(q, k, v, mask)
    assert not out.isnan().any() and not weights.isnan().any()
    assert (weights[0, 1] == 0).all()
    assert (out[0, 1] == 0).all()
    # the other rows are untouched
    ref, _ = scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(out[1], ref[1])
    torch.testing.assert_close(out[0, [0, 2]], ref[0, [0, 2]])
    # the backward pass is NaN-free too, and the empty row sends no gradient to its query
    (out.sum() + weights.pow(2).sum()).backward()
    for t in (q, k, v):
        assert t.grad is not None and torch.isfinite(t.grad).all()
    assert (q.grad[0, 1] == 0).all()


def test_every_row_masked():
    q, k, v = _qkv((), 3, 4, 5, 6)
    out, weights = scaled_dot_product_attention(q, k, v, torch.zeros(3, 4, dtype=torch.bool))
    assert (out == 0).all() and (weights == 0).all()


def test_gradcheck_float64():
    q, k, v = _qkv((2,), 3, 4, 5, 2, dtype=torch.float64)
    mask = _random_mask((3, 4))
    mask[2] = False  # include a fully masked row
    inputs = tuple(t.requires_grad_(True) for t in (q, k, v))
    assert torch.autograd.gradcheck(
        lambda q, k, v: scaled_dot_product_attention(q, k, v)[0], inputs
    )
    assert torch.autograd.gradcheck(
        lambda q, k, v: scaled_dot_product_attention(q, k, v, mask), inputs
    )


def test_gradients_match_torch():
    q, k, v = _qkv((2,), 3, 4, 5, 6)
    mask = _random_mask((3, 4))
    a = [t.clone().requires_grad_(True) for t in (q, k, v)]
    b = [t.clone().requires_grad_(True) for t in (q, k, v)]
    g = torch.randn(2, 3, 6, generator=torch.Generator().manual_seed(5))
    (scaled_dot_product_attention(*a, mask)[0] * g).sum().backward()
    (F.scaled_dot_product_attention(*b, attn_mask=mask) * g).sum().backward()
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x.grad, y.grad, atol=ATOL, rtol=0)


def test_dropout():
    q, k, v = _qkv((2,), 4, 6, 8, 8)
    torch.manual_seed(0)
    _, weights = scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    _, clean = scaled_dot_product_attention(q, k, v)
    kept = weights != 0
    assert 0 < kept.sum() < kept.numel()
    torch.testing.assert_close(weights[kept], 2 * clean[kept])
    with pytest.raises(ValueError, match="dropout_p"):
        scaled_dot_product_attention(q, k, v, dropout_p=1.0)


def _raises(*args, match, **kwargs):
    with pytest.raises(ValueError, match=match) as info:
        scaled_dot_product_attention(*args, **kwargs)
    return str(info.value)


def test_mismatched_d_k_names_both_shapes():
    q, k, v = _qkv((2,), 3, 4, 5, 6)
    msg = _raises(q, k[..., :4], v, match="d_k")
    assert "(2, 3, 5)" in msg and "(2, 4, 4)" in msg


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_wrong_rank_names_expected_and_actual(which):
    q, k, v = _qkv((), 3, 4, 5, 6)
    args = {"q": q, "k": k, "v": v}
    args[which] = args[which][0]  # drop a dimension: rank 1
    msg = _raises(args["q"], args["k"], args["v"], match=f"^{which} must have shape")
    assert "at least 2 dims" in msg
    assert f"got {tuple(args[which].shape)}".replace(",)", ")") in msg


def test_l_k_mismatch_names_both_shapes():
    q, k, v = _qkv((2,), 3, 4, 5, 6)
    msg = _raises(q, k, v[:, :3], match="L_k")
    assert "(2, 4, 5)" in msg and "(2, 3, 6)" in msg


def test_batch_dims_that_do_not_broadcast():
    q, _, _ = _qkv((2,), 3, 4, 5, 6)
    _, k, v = _qkv((3,), 3, 4, 5, 6)
    msg = _raises(q, k, v, match="do not broadcast")
    assert "(2, 3, 5)" in msg and "(3, 4, 5)" in msg


@pytest.mark.parametrize("mask_shape", [(3, 5), (4, 3), (3, 4, 4), (2, 2, 3, 4)])
def test_mask_that_does_not_broadcast(mask_shape):
    q, k, v = _qkv((2,), 3, 4, 5, 6)
    mask = torch.ones(mask_shape, dtype=torch.bool)
    msg = _raises(q, k, v, mask, match="does not broadcast")
    expected = "(" + ", ".join(map(str, mask_shape)) + ")"
    assert expected in msg and "(2, 3, 4)" in msg


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.uint8])
def test_non_bool_mask(dtype):
    q, k, v = _qkv((), 3, 4, 5, 6)
    msg = _raises(q, k, v, torch.ones(3, 4, dtype=dtype), match="bool")
    assert str(dtype) in msg


def test_not_a_tensor():
    q, k, v = _qkv((), 3, 4, 5, 6)
    _raises(q.tolist(), k, v, match="q must be a torch.Tensor")
    _raises(q, k, v, [[True] * 4] * 3, match="mask must be a torch.Tensor")


def test_mixed_dtypes():
    q, k, v = _qkv((), 3, 4, 5, 6)
    _raises(q.double(), k, v, match="same dtype")
