"""Tests for utils.tasks: the three toy tasks, their examples, batches and held-out sets."""

import pytest
import torch

from utils.data import BOS, EOS, PAD, LMBatch, MLMBatch, Seq2SeqBatch
from utils.masks import padding_mask
from utils.tasks import MissingDigitTask, ReversalTask, SortingTask


def test_reversal_examples():
    task = ReversalTask()
    assert len(task.vocab) == 13
    examples = task.sample(500, seed=3)
    assert len({src for src, _ in examples}) == 500  # distinct
    for src, tgt in examples:
        assert 3 <= len(src) <= 12
        assert list(tgt) == list(src)[::-1]
        assert all(3 <= i < 13 for i in src)
    assert task.sample(20, seed=3) == examples[:20]  # the seed fixes the draw


def test_reversal_batch_shapes_and_masks():
    task = ReversalTask()
    pairs = [((3, 4, 5), (5, 4, 3)), ((6, 7, 8, 9, 10), (10, 9, 8, 7, 6))]
    b = task.collate(pairs)
    assert isinstance(b, Seq2SeqBatch)
    assert b.src.shape == (2, 5) and b.tgt_in.shape == (2, 6) and b.tgt_out.shape == (2, 6)
    assert b.src[0].tolist() == [3, 4, 5, PAD, PAD]
    assert b.tgt_in[0].tolist() == [BOS, 5, 4, 3, PAD, PAD]
    assert b.tgt_out[0].tolist() == [5, 4, 3, EOS, PAD, PAD]
    assert torch.equal(b.src_mask, padding_mask([3, 5]))
    assert torch.equal(b.tgt_mask, padding_mask([4, 6]))
    # The decoder input is the output shifted right by one, behind <bos>.
    assert torch.equal(b.tgt_in[:, 1:][b.tgt_mask[:, 1:]], b.tgt_out[:, :-1][b.tgt_mask[:, 1:]])


def test_batches_avoid_the_held_out_set():
    task = ReversalTask(min_len=2, max_len=2, num_symbols=3)  # only 9 possible inputs
    held_out = task.sample(4, seed=0)
    keys = {src for src, _ in held_out}
    stream = task.batches(32, seed=1, exclude=held_out)
    for _ in range(5):
        b = next(stream)
        for row, m in zip(b.src, b.src_mask, strict=True):
            assert tuple(row[m].tolist()) not in keys


def test_batches_are_deterministic():
    task = ReversalTask()
    a = next(task.batches(8, seed=5))
    b = next(task.batches(8, seed=5))
    assert torch.equal(a.src, b.src) and torch.equal(a.tgt_out, b.tgt_out)


def test_task_arguments_are_checked():
    with pytest.raises(ValueError, match="max_len"):
        ReversalTask(min_len=5, max_len=4)
    with pytest.raises(ValueError, match="num_symbols"):
        ReversalTask(num_symbols=1)
    with pytest.raises(ValueError, match="batch_size"):
        next(ReversalTask().batches(0, seed=0))
    with pytest.raises(ValueError, match="seed"):
        ReversalTask().sample(3, seed=-1)
    with pytest.raises(ValueError, match="too small"):
        ReversalTask(min_len=1, max_len=1, num_symbols=2).sample(3, seed=0)
    with pytest.raises(ValueError, match="max_len"):
        MissingDigitTask(min_len=4, max_len=11)
    with pytest.raises(ValueError, match="min_len"):
        MissingDigitTask(min_len=1)
    with pytest.raises(ValueError, match="num_digits"):
        SortingTask(num_digits=11)


def test_sorting_examples_and_batch():
    task = SortingTask()
    sep = task.vocab.index[">"]
    for prompt, answer in task.sample(200, seed=0):
        assert prompt[0] == BOS and prompt[-1] == sep and answer[-1] == EOS
        assert list(answer[:-1]) == sorted(prompt[1:-1])
        assert 2 <= len(answer) - 1 <= 8
    examples = [((BOS, 5, 3, sep), (3, 5, EOS)), ((BOS, 4, 4, 3, sep), (3, 4, 4, EOS))]
    b = task.collate(examples)
    assert isinstance(b, LMBatch)
    assert b.inputs.shape == b.targets.shape == b.mask.shape == (2, 8)
    assert b.inputs[0].tolist() == [BOS, 5, 3, sep, 3, 5, EOS, PAD]
    # Only the answer (after the separator) is scored; the rest of the targets is PAD.
    assert b.targets[0].tolist() == [PAD, PAD, PAD, 3, 5, EOS, PAD, PAD]
    assert b.targets[1].tolist() == [PAD, PAD, PAD, PAD, 3, 4, 4, EOS]
    assert b.mask[0].tolist() == [True] * 7 + [False]
    assert task.vocab.decode(b.inputs[1], sep="") == "110>011"  # id 3 is the digit "0"


def test_missing_digit_examples():
    task = MissingDigitTask(min_len=4, max_len=10)
    mask_id = task.vocab.index["<mask>"]
    for inputs, targets in task.sample(300, seed=0):
        n = len(inputs)
        assert 4 <= n <= 10 and len(targets) == n
        hidden = [i for i in range(n) if inputs[i] == mask_id]
        assert len(hidden) == 1
        full = [t if t != PAD else x for x, t in zip(inputs, targets, strict=True)]
        assert sorted(full) == list(range(3, 3 + n))  # the digits 0..n-1, each once
        assert all(targets[i] == PAD for i in range(n) if i != hidden[0])
        visible = {x for x in inputs if x != mask_id}
        assert set(range(3, 3 + n)) - visible == {targets[hidden[0]]}  # the missing one
    b = task.collate(task.sample(5, seed=1), pad_to=16)
    assert isinstance(b, MLMBatch)
    assert b.inputs.shape == b.targets.shape == b.mask.shape and b.inputs.shape[1] == 16
    assert not (b.targets[~b.mask] != PAD).any()
    assert (b.inputs == mask_id).sum() == 5


def test_missing_digit_held_out_is_by_unmasked_sequence():
    task = MissingDigitTask(min_len=2, max_len=2)  # only 2 possible sequences: 0 1 and 1 0
    held_out = task.sample(1, seed=0)
    x, t = held_out[0]
    word = [b if b != PAD else a for a, b in zip(x, t, strict=True)]
    b = next(task.batches(40, seed=0, exclude=held_out))
    full = torch.where(b.targets != PAD, b.targets, b.inputs)
    assert not any(row.tolist() == word for row in full)


def test_num_problems_and_length_of():
    assert [MissingDigitTask(4, 6).num_problems(n) for n in (4, 5, 6)] == [24, 120, 720]
    assert SortingTask(3, 8, distinct=True).num_problems(3) == 720  # 10 * 9 * 8 ordered prompts
    assert SortingTask(2, 4).num_problems(2) == 100
    assert ReversalTask(1, 3, num_symbols=3).num_problems(3) == 27
    for task in (MissingDigitTask(4, 10), SortingTask(3, 8, distinct=True), ReversalTask()):
        for ex in task.sample(50, seed=0):
            n = task.length_of(ex)
            assert task.min_len <= n <= task.max_len
        with pytest.raises(ValueError, match="length"):
            task.num_problems(task.max_len + 1)
    assert SortingTask().length_of(((BOS, 5, 3, 4, 13), (3, 4, 5, EOS))) == 3


def test_sample_max_share_caps_every_length():
    task = MissingDigitTask(min_len=4, max_len=10)
    plain = task.sample(1000, seed=1)
    lengths = [task.length_of(ex) for ex in plain]
    assert lengths.count(4) > 20  # without a cap, nearly all 24 sequences of length 4 are taken
    capped = task.sample(1000, seed=1, max_share=0.2)
    assert len(capped) == 1000
    lengths = [task.length_of(ex) for ex in capped]
    for n in range(4, 11):
        assert 0 < lengths.count(n) <= int(0.2 * task.num_problems(n))
    assert lengths.count(4) == 4 and lengths.count(5) == 24
    # Training can still draw every length.
    b = next(task.batches(256, seed=0, exclude=capped))
    assert set(b.mask.sum(1).tolist()) == set(range(4, 11))
    with pytest.raises(ValueError, match="max_share"):
        task.sample(10, seed=0, max_share=0.0)
    with pytest.raises(ValueError, match="allows only"):
        MissingDigitTask(min_len=4, max_len=5).sample(100, seed=0, max_share=0.5)
