"""MultiHeadAttention and GroupedQueryAttention (chapter 3) against PyTorch.

`MultiHeadAttention.from_torch(m)` must give what `nn.MultiheadAttention` gives, for many shapes,
with and without biases and masks; the torch module gets the same masks in its own conventions,
converted by `utils.masks`.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from utils.attention import GroupedQueryAttention, MultiHeadAttention
from utils.masks import (
    causal_mask,
    combine_masks,
    padding_mask,
    padding_to_attention_mask,
    to_additive_mask,
    to_key_padding_mask,
    to_torch_attn_mask,
)

TOL = 1e-5

# (d_model, num_heads, L_q, L_k, bias, mask kind); "causal" needs L_q == L_k.
_SHAPES = [(8, 1), (8, 2), (12, 3), (16, 4), (32, 8), (24, 6)]
_LENGTHS = [(5, 5), (3, 7), (6, 2)]
CONFIGS = []
for (d, h), (lq, lk), bias in itertools.product(_SHAPES, _LENGTHS, (True, False)):
    CONFIGS.append((d, h, lq, lk, bias, "none"))
    CONFIGS.append((d, h, lq, lk, bias, "padding"))
    CONFIGS.append((d, h, lq, lk, bias, "causal" if lq == lk else "per_sequence"))
    if lq == lk:
        CONFIGS.append((d, h, lq, lk, bias, "causal+padding"))


def _ids(c):
    d, h, lq, lk, bias, kind = c
    return f"d{d}-h{h}-Lq{lq}-Lk{lk}-{'bias' if bias else 'nobias'}-{kind}"


def _torch_pair(d, h, bias, seed=0):
    torch.manual_seed(seed)
    ref = nn.MultiheadAttention(d, h, bias=bias, batch_first=True)
    ref.eval()
    ours = MultiHeadAttention.from_torch(ref)
    # The from-scratch path, whose weights are compared too; tests/test_fused_attention.py proves
    # the default fused path equal to it.
    ours.keep_weights = True
    return ref, ours


def _masks(kind, b, h, lq, lk, gen):
    """Our bool mask and the equivalent (attn_mask, key_padding_mask) for nn.MultiheadAttention.

    Every query keeps at least one key, because nn.MultiheadAttention gives NaN for a query with
    none (the book gives zeros; tested separately below).
    """
    if kind == "none":
        return None, None, None
    lengths = torch.randint(1, lk + 1, (b,), generator=gen)
    lengths[0] = lk  # one sequence without padding
    pad = padding_mask(lengths, lk)
    if kind == "padding":
        return padding_to_attention_mask(pad), None, to_key_padding_mask(pad)
    if kind == "causal":
        return causal_mask(lq), to_torch_attn_mask(causal_mask(lq)), None
    if kind == "causal+padding":
        ours = combine_masks(causal_mask(lq), padding_to_attention_mask(pad))
        return ours, to_torch_attn_mask(causal_mask(lq)), to_key_padding_mask(pad)
    if kind == "per_sequence":  # a random (B, L_q, L_k) mask, the same for every head
        ours = torch.rand(b, lq, lk, generator=gen) < 0.6
        ours[..., 0] = True
        return ours, to_torch_attn_mask(ours, num_heads=h), None
    raise AssertionError(kind)


@pytest.mark.parametrize("config", CONFIGS, ids=[_ids(c) for c in CONFIGS])
def test_from_torch_matches_nn_multihead_attention(config):
    d, h, lq, lk, bias, kind = config
    assert len(CONFIGS) >= 20
    ref, ours = _torch_pair(d, h, bias)
    gen = torch.Generator().manual_seed(1)
    b = 3
    query = torch.randn(b, lq, d, generator=gen)
    if lq == lk and kind != "padding":
        key = value = query  # self-attention
    else:
        key = torch.randn(b, lk, d, generator=gen)
        value = torch.randn(b, lk, d, generator=gen)
    mask, attn_mask, kpm = _masks(kind, b, h, lq, lk, gen)
    expected, expected_w = ref(query, key, value, attn_mask=attn_mask, key_padding_mask=kpm,
                               need_weights=True, average_attn_weights=False)
    got = ours(query, key, value, mask=mask)
    assert got.shape == (b, lq, d)
    assert ours.attn_weights.shape == (b, h, lq, lk)
    torch.testing.assert_close(got, expected, atol=TOL, rtol=0)
    torch.testing.assert_close(ours.attn_weights, expected_w, atol=TOL, rtol=0)


def test_from_torch_matches_with_additive_float_masks():
    ref, ours = _torch_pair(16, 4, True)
    x = torch.randn(2, 6, 16)
    pad = padding_mask([6, 4])
    mask = combine_masks(causal_mask(6), padding_to_attention_mask(pad))
    expected, _ = ref(x, x, x, attn_mask=to_additive_mask(causal_mask(6)),
                      key_padding_mask=to_additive_mask(~to_key_padding_mask(pad)))
    torch.testing.assert_close(ours(x, x, x, mask=mask), expected, atol=TOL, rtol=0)


def test_gradients_match_torch():
    ref, ours = _torch_pair(16, 4, True)
    ref.train()
    ours.train()
    x = torch.randn(2, 5, 16)
    ref(x, x, x, need_weights=False)[0].square().sum().backward()
    ours(x, x, x).square().sum().backward()
    w_q, _, _ = ref.in_proj_weight.grad.chunk(3)
    torch.testing.assert_close(ours.w_q.weight.grad, w_q, atol=1e-4, rtol=0)
    torch.testing.assert_close(ours.w_o.weight.grad, ref.out_proj.weight.grad, atol=1e-4, rtol=0)


def test_parameter_count_is_four_square_matrices():
    for d, h in [(16, 1), (16, 4), (64, 8)]:
        m = MultiHeadAttention(d, h)
        assert sum(p.numel() for p in m.parameters()) == 4 * d * d + 4 * d
        m = MultiHeadAttention(d, h, bias=False)
        assert sum(p.numel() for p in m.parameters()) == 4 * d * d


# ---------------------------------------------------------------------------- bad input


def test_d_model_not_divisible_by_heads():
    with pytest.raises(ValueError, match=r"d_model=10.*num_heads=4"):
        MultiHeadAttention(10, 4)
    with pytest.raises(ValueError, match=r"num_heads=6.*num_kv_heads=4"):
        GroupedQueryAttention(24, 6, 4)
    with pytest.raises(ValueError, match=r"dropout must be in \[0, 1\), got 1.0"):
        MultiHeadAttention(8, 2, dropout=1.0)
    with pytest.raises(ValueError, match="dropout"):
        GroupedQueryAttention(8, 2, 1, dropout=-0.1)


@pytest.mark.parametrize(
    "shape",
    [(5, 6), (3, 5), (3, 5, 5), (2, 3, 5, 5), (5,), (1, 1, 1, 1, 5)],
)
def test_wrong_mask_shape_raises_with_shapes(shape):
    # (2, 5) is not in the list: with B = 2 it is a (B, L_k) padding mask, read by the same rule
    # as the encoder's (tests/test_api_errors_core.py checks it).
    m = MultiHeadAttention(8, 2)
    x = torch.randn(2, 5, 8)
    mask = torch.ones(shape, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"mask") as info:
        m(x, x, x, mask=mask)
    message = str(info.value)
    assert "(" + ", ".join(map(str, shape)) + ")" in message  # the mask's own shape
    assert "(B, h, L_q, L_k)" in message


def test_non_bool_mask_raises():
    m = MultiHeadAttention(8, 2)
    x = torch.randn(2, 5, 8)
    with pytest.raises(ValueError, match="bool"):
        m(x, x, x, mask=to_additive_mask(causal_mask(5)))


def test_wrong_input_shapes_raise():
    m = MultiHeadAttention(8, 2)
    with pytest.raises(ValueError, match=r"d_model=8.*\(2, 5, 6\)"):
        m(torch.randn(2, 5, 6), torch.randn(2, 5, 8), torch.randn(2, 5, 8))
    with pytest.raises(ValueError, match="key and value"):
        m(torch.randn(2, 5, 8), torch.randn(2, 5, 8), torch.randn(2, 4, 8))
    with pytest.raises(ValueError, match="batch size B"):
        m(torch.randn(2, 5, 8), torch.randn(3, 5, 8), torch.randn(3, 5, 8))
    gqa = GroupedQueryAttention(8, 2, 1)
    with pytest.raises(ValueError, match=r"d_model=8.*\(2, 5, 6\)"):
        gqa(torch.randn(2, 5, 8), torch.randn(2, 5, 6), torch.randn(2, 5, 8))
    with pytest.raises(ValueError, match=r"key and value.*\(2, 5, 8\).*\(2, 4, 8\)"):
        gqa(torch.randn(2, 5, 8), torch.randn(2, 5, 8), torch.randn(2, 4, 8))


# ---------------------------------------------------------------------------- fully masked rows


@pytest.mark.parametrize("keep_weights", [True, False])
def test_fully_masked_rows_give_no_nan_forward_and_backward(keep_weights):
    torch.manual_seed(0)
    m = MultiHeadAttention(8, 2, keep_weights=keep_weights)
    x = torch.randn(2, 4, 8, requires_grad=True)
    mask = causal_mask(4).clone()
    mask[1] = False  # query 1 may attend to nothing
    pad = padding_to_attention_mask(padding_mask([4, 0], 4))  # sequence 1 is all padding
    out = m(x, x, x, mask=combine_masks(mask, pad))
    assert not torch.isnan(out).any()
    if keep_weights:
        w = m.attn_weights
        assert torch.all(w[:, :, 1] == 0) and torch.all(w[1] == 0)
    # A query with no key gets a zero attention output, so the layer returns W_O's bias there.
    torch.testing.assert_close(out[0, 1], m.w_o.bias.detach())
    out.sum().backward()
    for p in [x, *m.parameters()]:
        assert p.grad is not None and torch.isfinite(p.grad).all()


# ---------------------------------------------------------------------------- grouped-query


def test_gqa_equals_mha_when_groups_equal_heads():
    torch.manual_seed(0)
    for bias in (True, False):
        mha = MultiHeadAttention(24, 6, bias=bias)
        gqa = GroupedQueryAttention.from_multi_head(mha)
        assert gqa.num_kv_heads == 6
        q, kv = torch.randn(2, 3, 24), torch.randn(2, 7, 24)
        mask = padding_to_attention_mask(padding_mask([7, 2]))
        torch.testing.assert_close(gqa(q, kv, kv, mask=mask), mha(q, kv, kv, mask=mask),
                                   atol=TOL, rtol=0)
        torch.testing.assert_close(gqa.attn_weights, mha.attn_weights, atol=TOL, rtol=0)


@pytest.mark.parametrize("num_kv_heads", [1, 2, 4])
def test_gqa_matches_torch_sdpa_enable_gqa(num_kv_heads):
    torch.manual_seed(0)
    m = GroupedQueryAttention(32, 4, num_kv_heads)
    x = torch.randn(2, 6, 32)
    q = m.w_q(x).view(2, 6, 4, 8).transpose(1, 2)
    k = m.w_k(x).view(2, 6, num_kv_heads, 8).transpose(1, 2)
    v = m.w_v(x).view(2, 6, num_kv_heads, 8).transpose(1, 2)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_mask(6), enable_gqa=True)
    ref = m.w_o(ref.transpose(1, 2).reshape(2, 6, 32))
    torch.testing.assert_close(m(x, x, x, mask=causal_mask(6)), ref, atol=TOL, rtol=0)


def test_gqa_sizes_and_pooling():
    d, h = 64, 8
    for h_kv in (8, 4, 1):
        m = GroupedQueryAttention(d, h, h_kv)
        d_k = d // h
        expected = 2 * (d * d + d) + 2 * (d * h_kv * d_k + h_kv * d_k)
        assert sum(p.numel() for p in m.parameters()) == expected
        assert m.kv_cache_per_token() == 2 * h_kv * d_k
    mha = MultiHeadAttention(d, h)
    mqa = GroupedQueryAttention.from_multi_head(mha, num_kv_heads=1)
    torch.testing.assert_close(mqa.w_k.weight, mha.w_k.weight.view(h, d // h, d).mean(0))
    with pytest.raises(ValueError, match="num_kv_heads=3"):
        GroupedQueryAttention.from_multi_head(mha, num_kv_heads=3)


def test_heads_keep_the_parameters_but_multiply_the_attention_weights():
    """h heads: the parameters of one wide head, h times the (B, h, L, L) attention weights."""
    x = torch.randn(2, 7, 16)
    counts = set()
    for h in (1, 2, 4, 8):
        m = MultiHeadAttention(16, h, keep_weights=True)
        m(x, x, x)
        counts.add(sum(p.numel() for p in m.parameters()))
        assert m.attn_weights.shape == (2, h, 7, 7)
    assert counts == {4 * 16 * 16 + 4 * 16}


@pytest.mark.parametrize("h_kv, removed", [(32, 0.0), (8, 0.375), (4, 0.4375), (1, 0.484375)])
def test_gqa_removes_less_than_half_the_parameters(h_kv, removed):
    """Without biases, grouped-query attention removes (1 - h_kv / h) / 2 of the parameters:
    37.5% for 32 query heads and 8 key/value heads at d_model = 4096 (chapter 3's table)."""
    with torch.device("meta"):
        layer = GroupedQueryAttention(4096, 32, h_kv, bias=False)
    params = sum(p.numel() for p in layer.parameters())
    assert 1 - params / (4 * 4096**2) == removed == (1 - h_kv / 32) / 2


def test_one_head_blend_forgets_which_token_fills_which_role():
    """Chapter 3's argument: with equal weights on two tokens, one head returns the same output
    when the two tokens swap places, whatever its value projection; two heads of half the width,
    one per relation, tell the two orders apart."""
    torch.manual_seed(0)
    words, pos = torch.eye(3), torch.eye(3)

    def encode(order):  # (1, 3, 6): word code then position code
        return torch.cat([words[order], pos], dim=-1)[None]

    x_a, x_b = encode([0, 2, 1]), encode([1, 2, 0])       # "dog bites man", "man bites dog"
    # query of the middle token: equal weight on both neighbours (one head), or one neighbour
    # per head (two heads); keys read the position code.
    score = torch.zeros(6, 3)
    score[3 + 1, 0] = score[3 + 1, 2] = 50.0
    one = MultiHeadAttention(6, 1, bias=False)
    two = MultiHeadAttention(6, 2, bias=False)
    with torch.no_grad():
        one.w_q.weight.copy_(torch.cat([score, torch.zeros(6, 3)], 1).T)
        one.w_k.weight.copy_(torch.cat([torch.cat([torch.zeros(3, 3), torch.eye(3)]),
                                        torch.zeros(6, 3)], 1).T)
        one.w_v.weight.copy_(torch.randn(6, 6))
        back, ahead = torch.zeros(6, 3), torch.zeros(6, 3)
        back[3 + 1, 0] = ahead[3 + 1, 2] = 50.0
        read_pos = torch.cat([torch.zeros(3, 3), torch.eye(3)])
        read_word = torch.cat([torch.eye(3), torch.zeros(3, 3)])
        two.w_q.weight.copy_(torch.cat([back, ahead], 1).T)
        two.w_k.weight.copy_(torch.cat([read_pos, read_pos], 1).T)
        two.w_v.weight.copy_(torch.cat([read_word, read_word], 1).T)
        for m in (one, two):
            m.w_o.weight.copy_(torch.eye(6))
    torch.testing.assert_close(one(x_a, x_a, x_a)[0, 1], one(x_b, x_b, x_b)[0, 1], atol=1e-6,
                               rtol=0)
    assert (two(x_a, x_a, x_a)[0, 1] - two(x_b, x_b, x_b)[0, 1]).abs().max() > 0.9
