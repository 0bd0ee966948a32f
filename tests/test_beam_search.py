"""`utils.beam_search.beam_search` returns the sequences and scores of `transformers`'
``generate(num_beams=..., length_penalty=..., early_stopping=...)`` on the same weights, for
every length penalty and stopping rule, with and without hypotheses that end at ``eos``."""

from __future__ import annotations

import pytest
import test_pretrained
import torch
from test_pretrained import checkpoints  # noqa: F401

from utils._validation import InputTypeError
from utils.beam_search import beam_search
from utils.decoding import generate
from utils.pretrained import load_gpt2

one_thread = test_pretrained.one_thread  # an autouse fixture: tiny models, one thread

PROMPT = [5, 6, 7]


def _reference(hf, num_beams, max_new, eos, **kw):
    """transformers' beam search: its (num_beams, new tokens) sequences, padded with ``eos``
    (or 0), and its sequences_scores."""
    prompt = torch.tensor([PROMPT])
    out = hf.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                      num_beams=num_beams, num_return_sequences=num_beams,
                      max_new_tokens=max_new, output_scores=True, return_dict_in_generate=True,
                      eos_token_id=eos, pad_token_id=0 if eos is None else eos, **kw)
    return out.sequences[:, len(PROMPT):], out.sequences_scores


def _padded(sequences, width, fill):
    return torch.tensor([s + [fill] * (width - len(s)) for s in sequences])


def _compare(ours, hf, num_beams, max_new, eos, **kw):
    got = beam_search(ours, PROMPT, num_beams, max_new, eos=eos, **kw)
    sequences, scores = _reference(hf, num_beams, max_new, eos, **kw)
    mine = _padded(got.sequences, sequences.shape[1], 0 if eos is None else eos)
    assert torch.equal(mine, sequences), f"sequences differ:\n{mine}\nvs\n{sequences}"
    gap = ((got.scores - scores).abs() / scores.abs()).max().item()
    assert gap < 1e-6, f"scores differ by {gap:.2e} (relative): {got.scores} vs {scores}"
    return got


@pytest.fixture(scope="module")
def models(checkpoints):  # noqa: F811
    directory, hf = checkpoints["gpt2/d32-h2-tied"]
    ours = load_gpt2(directory)
    # end tokens that the beams meet at different steps: hypotheses end early and late
    plain = beam_search(ours, PROMPT, 4, 10, eos=None)
    ends = sorted({t for s in plain.sequences for t in s[1:6]})[:3]
    return ours, hf, ends


@pytest.mark.parametrize("length_penalty", [1.0, 0.0, -1.0, 2.0])
@pytest.mark.parametrize("early_stopping", [False, True, "never"])
def test_sequences_and_scores_equal_transformers(models, length_penalty, early_stopping):
    ours, hf, ends = models
    lengths = set()
    for eos in [None, *ends]:
        got = _compare(ours, hf, 4, 10, eos, length_penalty=length_penalty,
                       early_stopping=early_stopping)
        lengths |= {len(s) for s in got.sequences}
    if length_penalty <= 1:  # (a penalty of 2 favours the longest hypotheses)
        assert len(lengths) > 1, "every hypothesis had the same length: eos never mattered"


@pytest.mark.parametrize("num_beams", [2, 5])
def test_other_beam_counts(models, num_beams):
    ours, hf, ends = models
    _compare(ours, hf, num_beams, 8, ends[0])


def test_one_beam_without_an_end_token_is_greedy_decoding(models):
    ours, _, _ = models
    got = beam_search(ours, PROMPT, 1, 12, eos=None)
    assert got.sequences == generate(ours, [PROMPT], 12, eos=10_000)


def test_scores_are_length_penalised_sums_of_log_probabilities(models):
    ours, _, ends = models
    for penalty in (0.0, 1.0, 2.0):
        got = beam_search(ours, PROMPT, 3, 8, length_penalty=penalty, eos=ends[0])
        for seq, score in zip(got.sequences, got.scores.tolist(), strict=True):
            tokens = torch.tensor([PROMPT + seq])
            with torch.no_grad():
                logp = ours(tokens[:, :-1]).log_softmax(-1)[0, len(PROMPT) - 1:]
            total = logp.gather(-1, tokens[0, len(PROMPT):, None]).sum().item()
            assert abs(total / len(seq) ** penalty - score) < 1e-4 * abs(score), (
                f"penalty {penalty}: score {score} is not {total} / {len(seq)}^{penalty}")
        assert got.scores.tolist() == sorted(got.scores.tolist(), reverse=True)


def test_a_wrong_length_penalty_fails_the_comparison(models):
    """The check can fail: scores divided by the length one step too long differ."""
    ours, hf, ends = models
    got = beam_search(ours, PROMPT, 4, 10, eos=ends[0], length_penalty=1.0)
    lengths = torch.tensor([len(s) for s in got.sequences], dtype=torch.float)
    wrong = got.scores * lengths / (lengths + 1)
    _, scores = _reference(hf, 4, 10, ends[0], length_penalty=1.0)
    assert ((wrong - scores).abs() / scores.abs()).max() > 1e-3


@pytest.mark.parametrize("kw, error, message", [
    (dict(num_beams=0), ValueError, "num_beams must be a positive int, got 0"),
    (dict(max_new_tokens=1.5), InputTypeError, "max_new_tokens must be a positive int"),
    (dict(length_penalty=float("nan")), ValueError, "length_penalty must be a finite number"),
    (dict(early_stopping="sometimes"), InputTypeError, "early_stopping must be True, False or"),
    (dict(eos=-1), ValueError, "eos must be an int >= 0"),
    (dict(prompt=[]), ValueError, "must be non-empty"),
    (dict(max_new_tokens=40), ValueError, "needs 42 positions but the model takes at most"),
])
def test_bad_arguments_name_what_was_expected(models, kw, error, message):
    ours, _, _ = models
    args = dict(prompt=PROMPT, num_beams=2, max_new_tokens=4) | kw
    with pytest.raises(error, match=message):
        beam_search(ours, **args)
