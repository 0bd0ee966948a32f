"""Tests for utils.decoding: greedy and sampled decoding, EOS, batches of different lengths."""

import pytest
import torch
from torch import nn

from utils import seed_everything
from utils.data import BOS, EOS, PAD
from utils.decoding import generate, greedy_decode, next_token, sample_decode
from utils.models import DecoderOnlyLM, Seq2SeqTransformer

V = 12


class CopyOracle(nn.Module):
    """A fake encoder-decoder that 'predicts' its source, then <eos>, whatever it is fed.

    It counts its decode calls, so that a test can see when decoding stopped.
    """

    def __init__(self):
        super().__init__()
        self.calls = 0

    def encode(self, src, src_mask):
        return torch.stack([src, src_mask.sum(1, keepdim=True).expand_as(src)], dim=-1)

    def decode(self, tgt, memory, src_mask):
        self.calls += 1
        src, lengths = memory[..., 0], memory[:, 0, 1]
        b, t = tgt.shape
        want = torch.full((b, t), EOS)
        for i in range(b):
            n = int(lengths[i])
            k = min(t, n)
            want[i, :k] = src[i, :k]
        return nn.functional.one_hot(want, V).float() * 10.0


class CountingLM(nn.Module):
    """A fake causal LM: after token x it predicts x + 1, and <eos> after token 9."""

    def forward(self, tokens):
        nxt = torch.where(tokens >= 9, torch.full_like(tokens, EOS), tokens + 1)
        return nn.functional.one_hot(nxt, V).float() * 10.0


def test_greedy_decode_stops_at_eos_and_handles_lengths():
    src = torch.tensor([[3, 4, 5, 6, 7], [8, 9, PAD, PAD, PAD], [5, 5, 5, 5, PAD]])
    mask = src != PAD
    model = CopyOracle()
    out = greedy_decode(model, src, mask, max_len=20)
    assert out == [[3, 4, 5, 6, 7], [8, 9], [5, 5, 5, 5]]
    # It stops as soon as every row has produced <eos> (after 6 steps), not after max_len.
    assert model.calls == 6


def test_greedy_decode_truncates_at_max_len():
    src = torch.tensor([[3, 4, 5, 6, 7]])
    assert greedy_decode(CopyOracle(), src, src != PAD, max_len=3) == [[3, 4, 5]]


def test_generate_handles_prompts_of_different_lengths():
    prompts = [[BOS, 3], [BOS, 5, 6, 7], [BOS, 8]]
    out = generate(CountingLM(), prompts, max_new_tokens=10)
    assert out == [[4, 5, 6, 7, 8, 9], [8, 9], [9]]
    assert generate(CountingLM(), prompts, max_new_tokens=2) == [[4, 5], [8, 9], [9]]


def test_greedy_decode_agrees_with_teacher_forcing():
    """Decoding one token at a time must give what the full forward pass scores highest."""
    seed_everything(0)
    model = Seq2SeqTransformer(V, V, d_model=16, nhead=2).eval()
    src = torch.tensor([[3, 4, 5, 6], [7, 8, PAD, PAD]])
    mask = src != PAD
    out = greedy_decode(model, src, mask, max_len=6)
    for i, seq in enumerate(out):
        tgt = torch.tensor([[BOS, *seq]])
        with torch.no_grad():
            logits = model(src[i : i + 1, : int(mask[i].sum())], tgt)
        expected = logits.argmax(-1)[0].tolist()
        assert expected[: len(seq)] == seq
        if len(seq) < 6:
            assert expected[len(seq)] == EOS


def test_generate_batch_equals_one_at_a_time():
    """Right padding must not change any row: a batch gives what each prompt gives alone."""
    seed_everything(0)
    model = DecoderOnlyLM(V, d_model=16, nhead=2, num_layers=1).eval()
    prompts = [[BOS, 3, 4, 5, 6, 7], [BOS, 8], [BOS, 9, 3, 3]]
    batch = generate(model, prompts, max_new_tokens=7)
    alone = [generate(model, [p], max_new_tokens=7)[0] for p in prompts]
    assert batch == alone
    gen = torch.Generator().manual_seed(1)
    sampled = generate(model, prompts, max_new_tokens=7, temperature=1.0, generator=gen)
    assert all(len(s) <= 7 and EOS not in s for s in sampled)


def test_sampling_is_reproducible_and_cold_sampling_is_greedy():
    seed_everything(0)
    model = DecoderOnlyLM(V, d_model=16, nhead=2, num_layers=1).eval()
    prompts = [[BOS, 3, 4], [BOS, 5]]

    def run(temp, seed):
        return generate(model, prompts, 8, temperature=temp,
                        generator=torch.Generator().manual_seed(seed))

    assert run(1.0, 7) == run(1.0, 7)
    assert run(1e-4, 7) == generate(model, prompts, 8)
    src = torch.tensor([[3, 4, 5]])
    s2s = Seq2SeqTransformer(V, V, d_model=16, nhead=2).eval()
    a = sample_decode(s2s, src, src != PAD, 6, 2.0, torch.Generator().manual_seed(3))
    b = sample_decode(s2s, src, src != PAD, 6, 2.0, torch.Generator().manual_seed(3))
    assert a == b


def test_next_token_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]])).expand(20000, 3)
    tok = next_token(logits, 1.0, torch.Generator().manual_seed(0))
    freq = torch.bincount(tok, minlength=3).float() / 20000
    assert torch.allclose(freq, torch.tensor([0.7, 0.2, 0.1]), atol=0.02)
    # A high temperature flattens the distribution towards uniform.
    hot = next_token(logits, 100.0, torch.Generator().manual_seed(0))
    assert torch.allclose(torch.bincount(hot).float() / 20000, torch.full((3,), 1 / 3),
                          atol=0.02)
    assert next_token(logits[:2], 0.0).tolist() == [0, 0]


def test_bad_input_raises():
    with pytest.raises(ValueError, match="temperature"):
        next_token(torch.zeros(1, 3), -1.0)
    with pytest.raises(ValueError, match=r"\(B, V\)"):
        next_token(torch.zeros(3), 0.0)
    src = torch.tensor([[3, 4]])
    with pytest.raises(ValueError, match="max_len"):
        greedy_decode(CopyOracle(), src, src != PAD, max_len=0)
    with pytest.raises(ValueError, match="src_mask"):
        greedy_decode(CopyOracle(), src, torch.ones(1, 3, dtype=torch.bool), max_len=3)
    with pytest.raises(ValueError, match="src_mask must be a torch.Tensor"):
        greedy_decode(CopyOracle(), src, None, max_len=3)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(CountingLM(), [[BOS]], max_new_tokens=0)
    with pytest.raises(ValueError, match="non-empty"):
        generate(CountingLM(), [[BOS], []], max_new_tokens=2)
