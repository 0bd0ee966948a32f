"""Tests for utils.data: the specials, vocabularies, padding, BERT's masking rule and the random
windows of language-model training (the toy tasks that build on them are tested in
test_tasks.py)."""

import re

import numpy as np
import pytest
import torch

from utils._validation import InputTypeError
from utils.data import (
    BOS,
    EOS,
    PAD,
    SPECIALS,
    Vocab,
    bert_mask_tokens,
    pad_sequences,
    random_windows,
)
from utils.masks import padding_mask


def test_specials_have_fixed_ids():
    assert (PAD, BOS, EOS) == (0, 1, 2)
    v = Vocab.from_symbols("abc")
    assert v.tokens[:3] == SPECIALS and len(v) == 6


def test_vocab_round_trip_and_decode_stops_at_eos():
    v = Vocab.from_symbols("abc")
    ids = v.encode(["a", "c", "b"])
    assert ids == [3, 5, 4]
    assert v.decode([BOS, *ids, EOS, 3, PAD]) == "a c b"
    assert v.decode(torch.tensor(ids), sep="") == "acb"
    assert v.decode([BOS, 3, EOS], skip_specials=False) == "<bos> a <eos>"


def test_vocab_rejects_bad_input():
    with pytest.raises(ValueError, match="unknown token"):
        Vocab.from_symbols("ab").encode(["z"])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        Vocab.from_symbols("ab").decode([7])
    with pytest.raises(ValueError, match="must start with"):
        Vocab(("a", "b", "c"))
    with pytest.raises(ValueError, match="distinct"):
        Vocab.from_symbols("aa")


def test_pad_sequences_matches_padding_mask():
    seqs = [[5, 6, 7], [8], [9, 10]]
    tokens, mask = pad_sequences(seqs)
    assert tokens.shape == (3, 3) and tokens.dtype == torch.long
    assert tokens.tolist() == [[5, 6, 7], [8, PAD, PAD], [9, 10, PAD]]
    assert torch.equal(mask, padding_mask([3, 1, 2]))
    tokens, mask = pad_sequences(seqs, max_len=5)
    assert tokens.shape == (3, 5) and not mask[:, 3:].any()


def test_pad_sequences_gives_the_same_batch_for_lists_tensors_and_arrays():
    """Lists and tuples of ints take a path of their own (one tensor call for the batch); every
    other kind of sequence is converted one at a time. Both must give the same batch."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 9, (40,), generator=g).tolist()
    seqs = [torch.randint(-5, 2**40, (n,), generator=g).tolist() for n in lengths]
    seqs[3] = [2**63 - 1, -(2**63)]  # int64's ends
    for kwargs in ({}, {"pad": -100}, {"pad_to": 12}, {"max_len": 9}, {"pad": 2**63 - 1}):
        tokens, mask = pad_sequences(seqs, **kwargs)
        for other in ([tuple(s) for s in seqs], [torch.tensor(s) for s in seqs],
                      [np.array(s) for s in seqs], [*seqs[:-1], torch.tensor(seqs[-1])]):
            t2, m2 = pad_sequences(other, **kwargs)
            assert torch.equal(tokens, t2) and torch.equal(mask, m2), kwargs
        assert tokens.dtype == torch.long
        assert tokens[mask].tolist() == [x for s in seqs for x in s]
    with pytest.raises(InputTypeError, match="integer token ids"):
        pad_sequences([[1, 2], [2**63]])  # too large for int64
    with pytest.raises(InputTypeError, match="integer token ids, got a bool"):
        pad_sequences([[1, 2], [3, True]])  # a bool among ints, not the id 1
    with pytest.raises(InputTypeError, match="integer token ids"):
        pad_sequences([(1, 2), (3, 4.0)])


def test_pad_sequences_rejects_bad_input():
    with pytest.raises(ValueError, match="at least one"):
        pad_sequences([])
    with pytest.raises(ValueError, match="non-empty"):
        pad_sequences([[1], []])
    with pytest.raises(ValueError, match="shorter than the longest"):
        pad_sequences([[1, 2, 3]], max_len=2)


def test_bert_mask_tokens_rule():
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, 13, (400, 100), generator=g)
    mask_id, vocab_size = 13, 14
    inputs, targets, kind = bert_mask_tokens(tokens, mask_id, vocab_size, generator=g)
    assert inputs.shape == targets.shape == kind.shape == tokens.shape
    chosen = kind > 0
    assert abs(chosen.float().mean().item() - 0.15) < 0.01
    shares = torch.bincount(kind[chosen], minlength=4)[1:].float() / chosen.sum()
    assert torch.allclose(shares, torch.tensor([0.8, 0.1, 0.1]), atol=0.02)
    assert (inputs[kind == 1] == mask_id).all()
    assert ((inputs[kind == 2] >= 3) & (inputs[kind == 2] < 13)).all()  # an ordinary token
    assert torch.equal(inputs[kind == 3], tokens[kind == 3])
    assert torch.equal(inputs[kind == 0], tokens[kind == 0])
    assert torch.equal(targets[chosen], tokens[chosen]) and (targets[~chosen] == PAD).all()
    # Specials are never chosen; a 1-dim sequence works too; the generator fixes the draw.
    row = torch.tensor([BOS, 5, 6, 7, EOS, PAD])
    _, _, k = bert_mask_tokens(row, mask_id, vocab_size, select_prob=1.0)
    assert k[[0, 4, 5]].tolist() == [0, 0, 0] and (k[1:4] > 0).all()
    a = bert_mask_tokens(tokens, mask_id, vocab_size, generator=torch.Generator().manual_seed(3))
    b = bert_mask_tokens(tokens, mask_id, vocab_size, generator=torch.Generator().manual_seed(3))
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_bert_mask_tokens_errors():
    with pytest.raises(TypeError, match="tokens"):
        bert_mask_tokens([3, 4], 13, 14)
    with pytest.raises(TypeError, match="integer"):
        bert_mask_tokens(torch.ones(3), 13, 14)
    with pytest.raises(ValueError, match="mask_id"):
        bert_mask_tokens(torch.tensor([3, 4]), 14, 14)
    with pytest.raises(ValueError, match="select_prob"):
        bert_mask_tokens(torch.tensor([3, 4]), 13, 14, select_prob=1.5)


def test_random_windows_are_consecutive_ids_at_seeded_uniform_starts():
    # id = 1000 + position: a window shows where it starts; int32, which the windows keep
    ids = torch.arange(1000, 1050, dtype=torch.int32)
    batches = random_windows(ids, context=8, batch_size=4, seed=3)
    drawn = torch.cat([next(batches) for _ in range(500)])  # (2000, 9)
    assert drawn.shape == (2000, 9) and drawn.dtype == ids.dtype
    starts = drawn[:, 0] - 1000
    assert torch.equal(drawn, ids[starts[:, None] + torch.arange(9)])  # consecutive
    # every start that fits (0 .. 41) occurs, none past it, and no start is favoured
    counts = torch.bincount(starts, minlength=42)
    assert len(counts) == 42 and counts.min() > 20 and counts.max() < 80
    # the same seed gives the same batches, another seed others, and the global state is
    # neither read nor changed
    torch.manual_seed(0)
    before = torch.get_rng_state()
    again = random_windows(ids, 8, 4, seed=3)
    assert torch.equal(torch.cat([next(again) for _ in range(500)]), drawn)
    assert torch.equal(torch.get_rng_state(), before)
    other = random_windows(ids, 8, 4, seed=4)
    assert not torch.equal(torch.cat([next(other) for _ in range(5)]), drawn[:20])
    # the last start that fits is drawn: the window then ends at the last id
    tight = next(random_windows(ids[:10], context=9, batch_size=3))
    assert torch.equal(tight, ids[:10].expand(3, 10))


def test_random_windows_equal_the_chapters_loop():
    """The sampler chapter 15 writes out: the same generator calls, the same windows."""
    ids, context, batch_size = torch.randint(0, 320, (5000,)), 32, 16
    gen = torch.Generator().manual_seed(7)
    offsets = torch.arange(context + 1)
    ours = random_windows(ids, context, batch_size, seed=7)
    for _ in range(20):
        starts = torch.randint(0, len(ids) - context, (batch_size,), generator=gen)
        assert torch.equal(next(ours), ids[starts[:, None] + offsets])


@pytest.mark.parametrize(
    "args, message",
    [
        (([1, 2, 3], 1, 1), "ids must be a 1-dim integer tensor, got list"),
        ((torch.zeros(5), 1, 1), "ids must be a 1-dim integer tensor, got torch.float32"),
        ((torch.zeros(2, 5, dtype=torch.long), 1, 1), "got shape (2, 5)"),
        ((torch.arange(5), 5, 1), "more than context=5 ids (a window is context + 1), got 5"),
        ((torch.arange(5), 0, 1), "context"),
        ((torch.arange(5), 2, 0), "batch_size"),
        ((torch.arange(5), 2, 1, -1), "seed"),
        ((torch.arange(5), 2.0, 1), "context"),
    ],
)
def test_random_windows_refuses_bad_arguments_naming_them(args, message):
    with pytest.raises(ValueError, match=re.escape(message)) as caught:
        random_windows(*args)
    ids, context = args[:2]
    wrong_type = isinstance(ids, list) or ids.is_floating_point() or isinstance(context, float)
    assert isinstance(caught.value, InputTypeError) == wrong_type
