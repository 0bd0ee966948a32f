"""Decoding reads nothing back from the device inside a step, and gives the same tokens.

On a GPU, reading a tensor's value on the host (``int(t)``, ``bool(t)``, ``t.item()``,
``t.tolist()``) waits until the device has finished everything queued. The decoding loops read
the state of the batch (finished rows, sound logits) only every ``check_every`` steps; the
models skip the range checks of the ids and positions the loop made itself. Each read is
counted here on the CPU, by patching the Tensor methods that read a value, during whole
generations of different lengths: with ``check_every=k`` the count grows by one per k steps,
and with k at least the number of steps it does not grow at all. The control, k = 1 (the
loop as it was, still the CPU's default), grows with every step.

Every ``check_every`` gives the tokens of k = 1, bit for bit, and leaves the random generator
where k = 1 leaves it, through finished rows, ragged prompts, sampling, bad logits and both
kinds of model.
"""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from utils import seed_everything
from utils.data import BOS, EOS, PAD
from utils.decoding import generate, greedy_decode, sample_decode
from utils.decoding_steps import CHECK_EVERY, check_every_for
from utils.models import DecoderOnlyLM, Seq2SeqTransformer

V = 12
NEVER = V  # an end token no model here can produce
READS = ("item", "tolist", "__bool__", "__int__", "__index__", "__float__")


@pytest.fixture(scope="module")
def lm():
    """Weights three times their initial size: greedy tokens that change within a row, so that
    rows end at different steps (eos 9 or 10 with the prompts below)."""
    seed_everything(0)
    model = DecoderOnlyLM(V, d_model=16, nhead=2, num_layers=2, max_len=80).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3)
    return model


@pytest.fixture(scope="module")
def s2s():
    seed_everything(1)
    return Seq2SeqTransformer(V, V, d_model=16, nhead=2, max_len=40).eval()


def _reads(monkeypatch, run) -> int:
    """How many times ``run()`` reads a tensor's value on the host. Not counted: the read of
    `fused_attention`, which it makes only for a mask on the CPU (a shortcut for the CPU that
    it skips on any other device)."""
    count = [0]
    for name in READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, **kwargs):
            if sys._getframe(1).f_code.co_name != "fused_attention":
                count[0] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    try:
        run()
    finally:
        monkeypatch.undo()
    return count[0]


def _generate_reads(monkeypatch, lm, steps, every, use_cache=True):
    prompts = [[BOS, 3, 4, 5], [BOS, 6, 7, 8]]  # one length: no padding mask
    return _reads(
        monkeypatch,
        lambda: generate(lm, prompts, steps, eos=NEVER, use_cache=use_cache, check_every=every),
    )


def test_generate_reads_once_per_window_not_per_step(monkeypatch, lm):
    short, long = 8, 40
    for every in (4, 8):
        grown = _generate_reads(monkeypatch, lm, long, every) - _generate_reads(
            monkeypatch, lm, short, every
        )
        assert grown == (long - short) // every, (
            f"check_every={every}: {grown} more reads for {long - short} more steps"
        )
    # One window as long as the generation: the reads do not grow with its length.
    assert _generate_reads(monkeypatch, lm, long, long) == _generate_reads(
        monkeypatch, lm, short, short
    )
    # The control: the plain loop reads at every step, and the count sees it.
    grown = _generate_reads(monkeypatch, lm, long, 1) - _generate_reads(monkeypatch, lm, short, 1)
    assert grown >= long - short, f"check_every=1: only {grown} more reads"


def test_sampling_and_encoder_decoder_read_once_per_window(monkeypatch, lm, s2s):
    def sampled(steps, every):
        gen = torch.Generator().manual_seed(0)
        return _reads(
            monkeypatch,
            lambda: generate(
                lm, [[BOS, 3]], steps, temperature=1.0, generator=gen, eos=NEVER, check_every=every
            ),
        )

    assert sampled(40, 40) == sampled(8, 8)
    src = torch.tensor([[3, 4, 5, 6], [7, 8, 9, 3]])

    def decoded(steps, every):
        return _reads(
            monkeypatch,
            lambda: greedy_decode(s2s, src, src != PAD, steps, eos=NEVER, check_every=every),
        )

    assert decoded(30, 30) == decoded(6, 6)
    assert decoded(30, 1) - decoded(6, 1) >= 24  # the control


def test_the_default_reads_every_step_on_the_cpu_only():
    assert check_every_for(None, torch.device("cpu")) == 1
    assert check_every_for(None, torch.device("cuda", 0)) == CHECK_EVERY > 1
    assert check_every_for(3, torch.device("cpu")) == 3
    with pytest.raises(ValueError, match="check_every"):
        check_every_for(0, torch.device("cpu"))


class Ender(nn.Module):
    """A fake causal LM: row r's next token is <eos> once its sequence is ``stops[r]`` long,
    else the token after its last one (mod V, never <eos>); optionally NaN logits from some
    length on. Records every call's input length."""

    vocab_size, max_len = V, 64

    def __init__(self, stops, nan_from=None, all_minus_inf=False):
        super().__init__()
        self.stops, self.nan_from, self.all_minus_inf = stops, nan_from, all_minus_inf

    def forward(self, tokens):
        b, length = tokens.shape
        nxt = (tokens % (V - 3)) + 3  # 3 .. V - 1: never PAD, BOS or EOS
        logits = nn.functional.one_hot(nxt, V).float() * 10.0
        for r in range(b):
            for t in range(length):
                if t + 1 >= self.stops[r]:
                    logits[r, t] = 0.0
                    logits[r, t, EOS] = 10.0
                if self.nan_from is not None and t + 1 >= self.nan_from:
                    logits[r, t] = float("-inf") if self.all_minus_inf else float("nan")
        return logits


def _same_everywhere(run):
    """run(every) for every check_every, each with a fresh generator and global seed: the
    tokens, the generator's state and the global RNG's state must be those of every=1."""
    results = []
    for every in (1, 3, 50):
        torch.manual_seed(123)
        gen = torch.Generator().manual_seed(5)
        out = run(every, gen)
        results.append((every, out, gen.get_state(), torch.get_rng_state()))
    _, expected, gen_state, rng_state = results[0]
    for every, out, g, r in results[1:]:
        assert out == expected, f"check_every={every}: {out} != {expected}"
        assert torch.equal(g, gen_state), f"check_every={every}: the generator moved on"
        assert torch.equal(r, rng_state), f"check_every={every}: the global generator moved on"
    return expected


@pytest.mark.parametrize("use_cache", [True, False])
@pytest.mark.parametrize("temperature", [0.0, 1.5])
def test_every_check_every_gives_the_same_tokens(lm, use_cache, temperature):
    lengths = set()
    for prompts in ([[BOS, 3, 4, 5, 6], [BOS, 8], [BOS, 9, 3]], [[BOS, 3], [BOS, 8], [BOS, 6]]):
        for eos in (EOS, 5, 9, 10, NEVER):  # rows end at different steps, or never
            for generator in (True, False) if temperature else (True,):  # its own or global
                out = _same_everywhere(
                    lambda every, gen, p=prompts, eos=eos, g=generator: generate(
                        lm,
                        p,
                        20,
                        temperature=temperature,
                        generator=gen if g else None,
                        eos=eos,
                        use_cache=use_cache,
                        check_every=every,
                    )
                )
                lengths |= {len(row) for row in out}
    assert len(lengths) > 2, lengths  # rows that end at different steps, and rows that do not
    ended = _same_everywhere(
        lambda every, gen: generate(
            Ender([4, 9, 6]),
            [[BOS, 3], [BOS, 4, 5], [BOS]],
            20,
            temperature=temperature,
            generator=gen,
            use_cache=use_cache,
            check_every=every,
        )
    )
    assert [len(row) for row in ended] == [2, 6, 5]


@pytest.mark.parametrize("temperature", [0.0, 1.5])
def test_encoder_decoder_gives_the_same_tokens(s2s, temperature):
    src = torch.tensor([[3, 4, 5, 6, 7], [8, 9, PAD, PAD, PAD], [5, 5, 5, 5, PAD]])
    for eos in (EOS, 4, 9):
        for use_cache in (True, False):
            _same_everywhere(
                lambda every, gen, eos=eos, use_cache=use_cache: sample_decode(
                    s2s,
                    src,
                    src != PAD,
                    15,
                    temperature,
                    gen,
                    eos=eos,
                    use_cache=use_cache,
                    check_every=every,
                )
            )


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("every", [1, 4, 30])
def test_bad_logits_raise_the_same_error_at_the_read(temperature, every):
    prompts = [[BOS, 3], [BOS, 4]]
    with pytest.raises(ValueError, match="logits must not contain NaN or \\+inf"):
        generate(
            Ender([30, 30], nan_from=6),
            prompts,
            20,
            temperature=temperature,
            use_cache=False,
            check_every=every,
        )
    with pytest.raises(ValueError, match="a row that is all -inf"):
        generate(
            Ender([30, 30], nan_from=6, all_minus_inf=True),
            prompts,
            20,
            temperature=temperature,
            use_cache=False,
            check_every=every,
        )
    # Every row finished before the logits went bad: no error, whatever the window.
    out = generate(
        Ender([4, 5], nan_from=7),
        prompts,
        20,
        temperature=temperature,
        use_cache=False,
        check_every=every,
    )
    assert out == [[6, 9], [7, 10, 4]] or (temperature and len(out) == 2), out


def test_prompts_are_still_checked_by_the_model(lm):
    with pytest.raises(ValueError, match=r"ids must lie in \[0, 12\)"):
        generate(lm, [[BOS, 12]], 5, check_every=4)
