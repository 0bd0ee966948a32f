"""utils.masks (chapter 4): the masks, the converters checked against the torch functions they
mirror, and the behaviour tests that prove a mask does its job."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from utils.attention import MultiHeadAttention, scaled_dot_product_attention
from utils.masks import (
    causal_mask,
    combine_masks,
    from_additive_mask,
    from_key_padding_mask,
    from_torch_attn_mask,
    local_mask,
    padding_mask,
    padding_to_attention_mask,
    to_additive_mask,
    to_key_padding_mask,
    to_torch_attn_mask,
)

# ---------------------------------------------------------------------------- building masks


def test_causal_mask_is_lower_triangular():
    m = causal_mask(4)
    assert m.dtype == torch.bool and m.shape == (4, 4)
    for i in range(4):
        for j in range(4):
            assert bool(m[i, j]) == (j <= i)


def test_padding_mask():
    m = padding_mask([3, 1, 0], max_len=4)
    expected = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)
    assert torch.equal(m, expected)
    assert padding_mask(torch.tensor([2, 5])).shape == (2, 5)


def test_local_mask_is_banded():
    m = local_mask(6, 2)
    for i in range(6):
        for j in range(6):
            assert bool(m[i, j]) == (abs(i - j) <= 2)
    mc = local_mask(6, 2, causal=True)
    assert torch.equal(mc, m & causal_mask(6))
    assert torch.equal(local_mask(5, 0), torch.eye(5, dtype=torch.bool))
    assert torch.equal(local_mask(5, 4), torch.ones(5, 5, dtype=torch.bool))
    # At most 2w + 1 keys per query, whatever the length: cost grows as L * w, not L**2.
    assert int(local_mask(100, 3).sum(-1).max()) == 7


def test_padding_to_attention_mask_and_combine():
    pad = padding_mask([3, 2], 3)
    att = padding_to_attention_mask(pad)
    assert att.shape == (2, 1, 1, 3)
    both = combine_masks(causal_mask(3), att)
    assert both.shape == (2, 1, 3, 3)
    assert torch.equal(both[1, 0], torch.tensor([[1, 0, 0], [1, 1, 0], [1, 1, 0]]).bool())
    assert combine_masks(None, None) is None
    assert combine_masks(None, att) is att


@pytest.mark.parametrize(
    "call, pattern",
    [
        (lambda: causal_mask(0), "positive int"),
        (lambda: causal_mask(2.5), "positive int"),
        (lambda: local_mask(4, -1), "non-negative"),
        (lambda: padding_mask([3, 5], max_len=4), "max_len=4"),
        (lambda: padding_mask(torch.ones(2, 2, dtype=torch.long)), r"\(B,\).*\(2, 2\)"),
        (lambda: padding_to_attention_mask(torch.ones(2, 3)), "bool"),
        (lambda: padding_to_attention_mask(torch.ones(2, 3, 4, dtype=torch.bool)),
         r"\(B, L_k\).*\(2, 3, 4\)"),
        (lambda: combine_masks(causal_mask(3), causal_mask(4)), r"\(3, 3\), \(4, 4\)"),
        (lambda: to_torch_attn_mask(torch.ones(2, 3, 3, dtype=torch.bool)), "num_heads"),
        (lambda: from_additive_mask(torch.tensor([0.0, -1.0])), "0 and -inf"),
        (lambda: to_torch_attn_mask(causal_mask(3), dtype=torch.long), "dtype"),
    ],
)
def test_bad_input_raises(call, pattern):
    with pytest.raises(ValueError, match=pattern):
        call()


# ---------------------------------------------------------------------------- converters


def test_additive_causal_mask_equals_generate_square_subsequent_mask():
    for length in (1, 4, 9):
        ours = to_additive_mask(causal_mask(length))
        theirs = nn.Transformer.generate_square_subsequent_mask(length)
        assert ours.dtype == theirs.dtype
        assert torch.equal(ours, theirs)
        assert torch.equal(from_additive_mask(theirs), causal_mask(length))


def test_sdpa_bool_and_float_masks_agree_with_ours():
    """F.scaled_dot_product_attention takes our bool mask as is, or its additive float form."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 3, 5, 4), torch.randn(2, 3, 7, 4), torch.randn(2, 3, 7, 4)
    mask = combine_masks(local_mask(7, 2)[:5], padding_to_attention_mask(padding_mask([7, 5])))
    ours, _ = scaled_dot_product_attention(q, k, v, mask)
    with_bool = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    with_float = F.scaled_dot_product_attention(q, k, v, attn_mask=to_additive_mask(mask))
    torch.testing.assert_close(with_bool, ours, atol=1e-6, rtol=0)
    torch.testing.assert_close(with_float, ours, atol=1e-6, rtol=0)


def _mha_pair(d=16, h=4):
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(d, h, batch_first=True).eval()
    return ref, MultiHeadAttention.from_torch(ref)


def test_key_padding_mask_converter_mirrors_nn_multihead_attention():
    ref, ours = _mha_pair()
    q, kv = torch.randn(3, 4, 16), torch.randn(3, 6, 16)
    pad = padding_mask([6, 3, 1])
    kpm = to_key_padding_mask(pad)
    assert torch.equal(kpm, torch.tensor([[0] * 6, [0, 0, 0, 1, 1, 1], [0] + [1] * 5]).bool())
    expected, _ = ref(q, kv, kv, key_padding_mask=kpm)
    got = ours(q, kv, kv, mask=padding_to_attention_mask(pad))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    assert torch.equal(from_key_padding_mask(kpm), pad)
    assert torch.equal(from_key_padding_mask(to_additive_mask(~kpm)), pad)


def test_attn_mask_converter_mirrors_nn_multihead_attention():
    ref, ours = _mha_pair()
    x = torch.randn(2, 5, 16)
    # A 2-D mask shared by the batch.
    mask = local_mask(5, 1, causal=True)
    expected, _ = ref(x, x, x, attn_mask=to_torch_attn_mask(mask))
    torch.testing.assert_close(ours(x, x, x, mask=mask), expected, atol=1e-5, rtol=0)
    expected_f, _ = ref(x, x, x, attn_mask=to_additive_mask(mask))
    torch.testing.assert_close(expected_f, expected, atol=1e-6, rtol=0)
    assert torch.equal(from_torch_attn_mask(to_torch_attn_mask(mask)), mask)
    # A mask per sequence and per head, laid out as (B * h, L_q, L_k) for torch.
    per = torch.rand(2, 4, 5, 5, generator=torch.Generator().manual_seed(3)) < 0.5
    per[..., 0] = True
    torch_mask = to_torch_attn_mask(per, num_heads=4)
    assert torch_mask.shape == (8, 5, 5)
    expected, _ = ref(x, x, x, attn_mask=torch_mask)
    torch.testing.assert_close(ours(x, x, x, mask=per), expected, atol=1e-5, rtol=0)
    assert torch.equal(from_torch_attn_mask(torch_mask, num_heads=4), per)
    assert torch.equal(from_torch_attn_mask(to_additive_mask(~torch_mask), num_heads=4), per)
    float_mask = to_torch_attn_mask(per, num_heads=4, dtype=torch.float32)
    assert torch.equal(float_mask, to_additive_mask(~torch_mask))
    expected_f, _ = ref(x, x, x, attn_mask=float_mask)
    torch.testing.assert_close(ours(x, x, x, mask=per), expected_f, atol=1e-5, rtol=0)


def test_nn_multihead_attention_gives_nan_where_the_book_gives_zeros():
    """The reason for the book's rule: torch leaves a query with no allowed key as NaN."""
    ref, ours = _mha_pair()
    x = torch.randn(1, 3, 16)
    mask = causal_mask(3).clone()
    mask[0] = False
    theirs, _ = ref(x, x, x, attn_mask=to_torch_attn_mask(mask))
    assert torch.isnan(theirs[0, 0]).all()
    got = ours(x, x, x, mask=mask)
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got[0, 1:], theirs[0, 1:], atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------- behaviour tests


def _two_layers(d=16, h=4):
    torch.manual_seed(0)
    return MultiHeadAttention(d, h), MultiHeadAttention(d, h)


def _run(layers, x, mask):
    for layer in layers:
        x = x + layer(x, x, x, mask=mask)
    return x


@pytest.mark.parametrize("t", [0, 3, 6])
def test_causal_mask_hides_the_future(t):
    """Changing the tokens after position t leaves every output up to t unchanged."""
    layers = _two_layers()
    x = torch.randn(2, 8, 16)
    changed = x.clone()
    changed[:, t + 1:] = torch.randn(2, 8 - t - 1, 16) * 10
    mask = causal_mask(8)
    before, after = _run(layers, x, mask), _run(layers, changed, mask)
    torch.testing.assert_close(after[:, : t + 1], before[:, : t + 1], atol=1e-6, rtol=0)
    assert (after[:, t + 1:] - before[:, t + 1:]).abs().max() > 1e-2  # the rest does change
    # Without the mask the earlier outputs do change: the test can fail.
    free_before, free_after = _run(layers, x, None), _run(layers, changed, None)
    assert (free_after[:, : t + 1] - free_before[:, : t + 1]).abs().max() > 1e-2


def test_padding_mask_hides_the_padding():
    """Changing padding tokens leaves the real tokens' outputs unchanged."""
    layers = _two_layers()
    lengths = torch.tensor([8, 5, 2])
    pad = padding_mask(lengths, 8)
    x = torch.randn(3, 8, 16)
    changed = torch.where(pad[..., None], x, torch.randn(3, 8, 16) * 10)
    mask = combine_masks(causal_mask(8), padding_to_attention_mask(pad))
    for m in (padding_to_attention_mask(pad), mask):
        before, after = _run(layers, x, m), _run(layers, changed, m)
        for b, n in enumerate(lengths.tolist()):
            torch.testing.assert_close(after[b, :n], before[b, :n], atol=1e-6, rtol=0)
    free_before, free_after = _run(layers, x, None), _run(layers, changed, None)
    assert (free_after[1, :5] - free_before[1, :5]).abs().max() > 1e-2


def test_cross_attention_padding_of_memory_is_ignored():
    """Decoder queries over encoder keys with padding: the padded keys never matter."""
    torch.manual_seed(0)
    m = MultiHeadAttention(16, 4, keep_weights=True)
    tgt, memory = torch.randn(2, 3, 16), torch.randn(2, 6, 16)
    pad = padding_mask([6, 4])
    changed = torch.where(pad[..., None], memory, torch.randn(2, 6, 16) * 10)
    mask = padding_to_attention_mask(pad)
    expected = m(tgt, memory, memory, mask=mask)
    torch.testing.assert_close(m(tgt, changed, changed, mask=mask), expected, atol=1e-6, rtol=0)
    assert torch.all(m.attn_weights[1, :, :, 4:] == 0)


# ------------------------------------------------ the chapter's derivations, loops first


@pytest.mark.parametrize("length", [1, 2, 5, 9])
def test_masks_equal_their_loop_definitions(length):
    """Each mask of the chapter, written as loops over (query i, key j), equals the library's."""
    for i in range(length):
        for j in range(length):
            assert bool(causal_mask(length)[i, j]) == (j <= i)
    for w in range(length + 1):
        two_sided, causal = local_mask(length, w), local_mask(length, w, causal=True)
        for i in range(length):
            for j in range(length):
                assert bool(two_sided[i, j]) == (abs(i - j) <= w)
                assert bool(causal[i, j]) == (0 <= i - j <= w)
        # the same bands cut out between two diagonals of a matrix of ones
        ones = torch.ones(length, length, dtype=torch.bool)
        assert torch.equal(two_sided, ones.triu(-w).tril(w))
        assert torch.equal(causal, ones.tril().triu(-w))
    lengths = [length, 0, max(length - 2, 0)]
    pad = padding_mask(lengths, length)
    both = combine_masks(causal_mask(length), padding_to_attention_mask(pad))
    assert both.shape == (3, 1, length, length)
    for b, n in enumerate(lengths):
        for j in range(length):
            assert bool(pad[b, j]) == (j < n)
            for i in range(length):
                assert bool(both[b, 0, i, j]) == (j <= i and j < n)


def test_masked_softmax_is_softmax_on_allowed_keys_and_zero_on_empty_rows():
    """The book's rule in formulas: rows with a key match softmax(scores + additive mask), rows
    without one are all zero, and no NaN appears forward or backward."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 5, 4, requires_grad=True) for _ in range(3))
    mask = combine_masks(causal_mask(5), padding_to_attention_mask(
        padding_mask([5, 3], 5).flip(-1)))[:, 0]          # left padding: empty rows in sequence 1
    out, weights = scaled_dot_product_attention(q, k, v, mask)
    has_key = mask.any(-1)
    assert not bool(has_key.all())
    expected = torch.softmax(q @ k.transpose(-2, -1) / 2.0 + to_additive_mask(mask), dim=-1)
    torch.testing.assert_close(weights[has_key], expected[has_key], atol=1e-6, rtol=0)
    assert torch.all(weights[~has_key] == 0) and torch.all(out[~has_key] == 0)
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
