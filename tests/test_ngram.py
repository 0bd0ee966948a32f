"""utils.ngram: the interpolated n-gram model, checked against counts and sums done by hand."""

from __future__ import annotations

import math

import pytest
import torch

from utils.ngram import InterpolatedNGram

# a b a b c a b, as ids 0 1 0 1 2 0 1 over a vocabulary of 4 (id 3 never occurs)
TINY = [0, 1, 0, 1, 2, 0, 1]


def test_counts_of_a_hand_made_corpus():
    m = InterpolatedNGram(4, order=3).fit(TINY)
    assert [m.count([i]) for i in range(4)] == [3, 3, 1, 0]
    assert m.count([0, 1]) == 3 and m.count([1, 0]) == 1 and m.count([1, 2]) == 1
    assert m.count([2, 0]) == 1 and m.count([0, 0]) == 0
    assert m.count([0, 1, 0]) == 1 and m.count([0, 1, 2]) == 1 and m.count([1, 2, 0]) == 1
    assert m.count([2, 0, 1]) == 1 and m.count([0, 1, 1]) == 0


def test_probabilities_by_hand():
    # lam = (0.5, 0.5, 0.5); after "a b" (0 1) the trigram counts are: a once, c once
    m = InterpolatedNGram(4, order=3, weights=[0.5, 0.5, 0.5]).fit(TINY)
    uni = [0.5 * c / 7 + 0.5 / 4 for c in (3, 3, 1, 0)]
    bi = [0.5 * c / 2 + 0.5 * u for c, u in zip((1, 0, 1, 0), uni, strict=True)]  # after b
    tri = [0.5 * c / 2 + 0.5 * b for c, b in zip((1, 0, 1, 0), bi, strict=True)]  # after a b
    torch.testing.assert_close(m.distribution([0, 1]), torch.tensor(tri, dtype=torch.float64))
    # an unseen context (d d) falls back to the bigram of d, also unseen, then the unigram
    torch.testing.assert_close(m.distribution([3, 3]), torch.tensor(uni, dtype=torch.float64))
    # nll of "a b c": token b after a (bigram), then c after a b (trigram)
    bi_after_a = [0.5 * c / 3 + 0.5 * u for c, u in zip((0, 3, 0, 0), uni, strict=True)]
    expected = [-math.log(bi_after_a[1]), -math.log(tri[2])]
    torch.testing.assert_close(m.nll([0, 1, 2]), torch.tensor(expected, dtype=torch.float64))


@pytest.mark.parametrize("order", [1, 2, 3, 4])
def test_every_context_sums_to_one_and_matches_nll(order):
    gen = torch.Generator().manual_seed(0)
    V = 7
    train_ids = torch.randint(0, V - 1, (300,), generator=gen)  # id 6 never seen
    m = InterpolatedNGram(V, order=order, weights=[0.9, 0.7, 0.6, 0.4][:order]).fit(train_ids)
    # every context of length order - 1, seen or not
    for flat in range(V ** (order - 1)):
        context = [flat // V ** j % V for j in range(order - 1)]
        p = m.distribution(context)
        assert p.shape == (V,) and bool((p > 0).all())
        assert abs(p.sum().item() - 1.0) < 1e-12
    test_ids = torch.randint(0, V, (50,), generator=gen)
    nll = m.nll(test_ids)
    assert nll.shape == (49,)
    for t in range(1, 50):
        expected = -m.distribution(test_ids[max(0, t - order + 1):t])[test_ids[t]].log()
        assert abs(nll[t - 1].item() - expected.item()) < 1e-12


def test_fit_weights_raises_the_likelihood_of_its_text():
    gen = torch.Generator().manual_seed(1)
    # a text with structure and noise: mostly the previous token plus one, sometimes plus
    # three, sometimes any token
    u = torch.rand(4000, generator=gen)
    steps = torch.where(u < 0.7, 1, 3).cumsum(0) % 11
    ids = torch.where(u > 0.9, torch.randint(0, 11, (4000,), generator=gen), steps)
    m = InterpolatedNGram(11, order=3).fit(ids[:3000])
    before = m.nll(ids[3000:]).mean().item()
    weights = m.fit_weights(ids[3000:], iterations=500)
    after = m.nll(ids[3000:]).mean().item()
    assert after < before
    assert weights.shape == (3,) and bool(((weights >= 0) & (weights <= 1)).all())
    # EM reaches a maximum: small moves of any weight do not lower the loss
    for k in range(3):
        for delta in (-0.02, 0.02):
            w = weights.clone()
            w[k] = (w[k] + delta).clamp(0, 1)
            other = InterpolatedNGram(11, order=3, weights=w).fit(ids[:3000])
            assert other.nll(ids[3000:]).mean().item() >= after - 1e-6


def test_errors_name_expected_and_actual():
    with pytest.raises(ValueError, match=r"weights must be 3 numbers .* got 2"):
        InterpolatedNGram(5, 3, weights=[0.5, 0.5])
    with pytest.raises(ValueError, match=r"\[0, 1\], got"):
        InterpolatedNGram(5, 2, weights=[0.5, 1.5])
    with pytest.raises(ValueError, match=r"2 \*\* 62"):
        InterpolatedNGram(50_000, 5)
    m = InterpolatedNGram(5, 2)
    with pytest.raises(ValueError, match="call fit"):
        m.nll([0, 1])
    with pytest.raises(ValueError, match=r"ids in \[0, 5\), got values from 0 to 7"):
        m.fit([0, 7])
    with pytest.raises(ValueError, match="1-D"):
        m.fit(torch.zeros(2, 2, dtype=torch.int64))
    with pytest.raises(TypeError, match="integer ids"):
        m.fit(torch.zeros(3))
    with pytest.raises(ValueError, match="at least 1 token"):
        m.fit([])
    m.fit([0, 1, 2])
    with pytest.raises(ValueError, match="1 to 2 ids, got 3"):
        m.count([0, 1, 2])
    assert m.nll([4]).shape == (0,)
