"""The sampling filters of `utils.sampling` equal `transformers`' logits processors, one by one
and chained along a whole run of `generate`; `generate` with them is seeded and reproducible.

The equalities compare the filtered distributions, softmax of the filtered scores: the same
tokens removed (probability 0 on both sides) and the rest within 1e-6. A filter that makes the
classic mistake (the token that crosses p dropped) is shown to fail the same comparison.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402
import test_pretrained  # noqa: E402
import torch  # noqa: E402
from test_pretrained import NEVER, VOCAB, checkpoints  # noqa: E402, F401

from utils._validation import InputTypeError  # noqa: E402
from utils.decoding import generate  # noqa: E402
from utils.pretrained import load_gpt2  # noqa: E402
from utils.sampling import (  # noqa: E402
    apply_temperature,
    logits_chooser,
    min_p_filter,
    repetition_penalty,
    top_k_filter,
    top_p_filter,
)

one_thread = test_pretrained.one_thread  # an autouse fixture: tiny models, one thread


def distribution_gap(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """The largest |difference| of the two filtered distributions (softmax of each row); a
    token removed by one side only (-inf there, not in the other) raises, naming it."""
    removed_ours, removed_theirs = ours == -float("inf"), theirs == -float("inf")
    differ = (removed_ours != removed_theirs).nonzero().tolist()
    assert not differ, f"tokens removed by one side only (row, token): {differ[:5]}"
    return (ours.softmax(-1) - theirs.softmax(-1)).abs().max().item()


def _logits():
    """Rows chosen to be hard: peaked, flat, ties at the k-th score, tokens already -inf."""
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(6, 50, generator=gen) * torch.tensor([0.5, 1.0, 2.0, 4.0, 8.0, 1.0])[:, None]
    rows[4, :10] = 3.0  # ties
    rows[5, 20:] = -float("inf")  # already removed
    return rows


def _processors():
    lib = test_pretrained._transformers()
    return lib.generation.logits_process


CASES = [
    ("temperature", 0.7), ("temperature", 1.6),
    ("top_k", 1), ("top_k", 5), ("top_k", 12), ("top_k", 80),
    ("top_p", 0.05), ("top_p", 0.5), ("top_p", 0.9), ("top_p", 1.0),
    ("min_p", 0.0), ("min_p", 0.05), ("min_p", 0.3), ("min_p", 1.0),
    ("penalty", 0.8), ("penalty", 1.3), ("penalty", 2.0),
]


def _pair(kind, value, keep=1):
    """(ours, the transformers processor) for one filter."""
    lp = _processors()
    previous = torch.tensor([[1, 2, 2, 30, 49]] * 6)
    if kind == "temperature":
        return (lambda x: apply_temperature(x, value)), lp.TemperatureLogitsWarper(value)
    if kind == "top_k":
        hf = lp.TopKLogitsWarper(value, min_tokens_to_keep=keep)
        return (lambda x: top_k_filter(x, value, keep)), hf
    if kind == "top_p":
        hf = lp.TopPLogitsWarper(value, min_tokens_to_keep=keep)
        return (lambda x: top_p_filter(x, value, keep)), hf
    if kind == "min_p":
        hf = lp.MinPLogitsWarper(value, min_tokens_to_keep=keep)
        return (lambda x: min_p_filter(x, value, keep)), hf
    hf = lp.RepetitionPenaltyLogitsProcessor(value)
    return (lambda x: repetition_penalty(x, previous, value)), (lambda ids, x: hf(previous, x))


@pytest.mark.parametrize("kind, value", CASES)
@pytest.mark.parametrize("keep", [1, 3])
def test_each_filter_equals_its_transformers_processor(kind, value, keep):
    if kind in ("temperature", "penalty") and keep > 1:
        pytest.skip("no min_tokens_to_keep")
    logits = _logits()
    before = logits.clone()
    ours, theirs = _pair(kind, value, keep)
    got, expected = ours(logits), theirs(None, logits.clone())
    assert torch.equal(logits, before), "the filter modified its input"
    gap = distribution_gap(got, expected)
    assert gap < 1e-6, f"{kind}={value}: distributions differ by {gap:.2e}"


def test_top_p_keeps_the_token_that_crosses_p():
    logits = torch.tensor([[0.5, 0.3, 0.2]]).log()
    kept = top_p_filter(logits, 0.6) > -float("inf")  # 0.5 < 0.6: the 0.3 token crosses it
    assert kept.tolist() == [[True, True, False]], f"kept {kept.tolist()}"
    assert (top_p_filter(logits, 0.5) > -float("inf")).sum() == 1  # 0.5 reaches 0.5 exactly


def _top_p_dropping_the_crossing_token(logits, p):
    """A classic mistake: remove every token at which the running sum (descending) is above p,
    which drops the token that crosses p."""
    probs, order = logits.softmax(-1).sort(dim=-1, descending=True)
    remove = probs.cumsum(-1) > p
    return logits.masked_fill(remove.scatter(-1, order, remove), -float("inf"))


def test_the_comparison_catches_a_top_p_that_drops_the_crossing_token():
    logits = _logits()[:4]  # rows without -inf
    theirs = _processors().TopPLogitsWarper(0.9)(None, logits.clone())
    with pytest.raises(AssertionError, match="removed by one side only"):
        distribution_gap(_top_p_dropping_the_crossing_token(logits, 0.9), theirs)


def test_top_k_with_ties_keeps_every_tied_token():
    logits = torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.0]])
    assert (top_k_filter(logits, 2) > -float("inf")).tolist() == [[False, True, True, True,
                                                                    False]]


@pytest.mark.parametrize("call, message", [
    (lambda: top_p_filter(torch.zeros(2, 3), 0.0), r"p must be a finite number in \(0.0, 1.0\]"),
    (lambda: top_p_filter(torch.zeros(3), 0.5), r"logits must have shape \(B, V\)"),
    (lambda: top_k_filter(torch.zeros(2, 3), 0), "k must be a positive int, got 0"),
    (lambda: min_p_filter(torch.zeros(2, 3), 1.5), r"p_base must be a finite number in \[0.0"),
    (lambda: apply_temperature(torch.zeros(2, 3), 0), r"t must be a finite number in \(0.0"),
    (lambda: repetition_penalty(torch.zeros(2, 3), torch.tensor([[0, 3]] * 2), 1.2),
     r"previous_ids must hold ids in \[0, 3\), got values from 0 to 3"),
    (lambda: repetition_penalty(torch.zeros(2, 3), torch.tensor([[0]]), 1.2),
     "previous_ids must have one row per row of logits, 2"),
    (lambda: top_p_filter(torch.zeros(2, 3, dtype=torch.long), 0.5), "floating"),
])
def test_bad_arguments_name_what_was_expected(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_generate_checks_the_filters_at_its_edge():
    model = test_pretrained._gpt2(n_embd=32, n_head=2)  # any module: the checks come first
    with pytest.raises(ValueError, match=r"top_p must be a finite number in \(0.0, 1.0\]"):
        generate(model, [[1, 2]], 3, temperature=1.0, top_p=1.5)
    with pytest.raises(InputTypeError, match="top_k must be a positive int"):
        generate(model, [[1, 2]], 3, temperature=1.0, top_k=2.5)
    with pytest.raises(ValueError, match="repetition_penalty must be a finite number"):
        generate(model, [[1, 2]], 3, repetition_penalty=-1.0)


SETTINGS = [
    dict(temperature=0.8, top_k=20),
    dict(temperature=1.2, top_p=0.8),
    dict(temperature=1.0, min_p=0.1),
    dict(temperature=0.9, top_k=30, top_p=0.9, min_p=0.05, repetition_penalty=1.3),
    dict(temperature=0.0, repetition_penalty=1.5),
]


def _hf_kwargs(setting):
    kw = dict(setting)
    temperature = kw.pop("temperature")
    if temperature == 0:
        return dict(do_sample=False, **kw)
    return dict(do_sample=True, temperature=temperature, top_k=kw.pop("top_k", 0), **kw)


@pytest.mark.parametrize("setting", SETTINGS, ids=str)
def test_filtered_distributions_equal_transformers_at_every_step_of_a_run(
        checkpoints, setting):  # noqa: F811
    directory, hf = checkpoints["gpt2/d32-h2-tied"]
    ours = load_gpt2(directory)
    prompt = torch.tensor([[5, 6, 7, 5, 6]])
    torch.manual_seed(0)
    out = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=20,
                      output_scores=True, return_dict_in_generate=True, eos_token_id=None,
                      pad_token_id=0, **_hf_kwargs(setting))
    chooser = logits_chooser(**setting)
    assert not chooser.plain
    gaps = []
    for step, theirs in enumerate(out.scores):  # each step's processed scores, (1, V)
        prefix = out.sequences[:, : prompt.shape[1] + step]
        with torch.no_grad():
            logits = ours(prefix)[:, -1]
        if setting["temperature"] == 0:  # greedy: compare the penalised scores themselves
            gaps.append((chooser(logits, prefix) - theirs).abs().max().item())
        else:
            gaps.append(distribution_gap(chooser(logits, prefix), theirs))
    assert len(gaps) == 20
    assert max(gaps) < 1e-5 if setting["temperature"] == 0 else max(gaps) < 1e-6, (
        f"largest difference {max(gaps):.2e} at step {gaps.index(max(gaps))}")


@pytest.mark.parametrize("setting", SETTINGS[:4], ids=str)
def test_generate_with_filters_is_seeded_and_cache_free(checkpoints, setting):  # noqa: F811
    directory, _ = checkpoints["gpt2/d32-h2-tied"]
    model = load_gpt2(directory)
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15, 16]]

    def run(seed, **kw):
        gen = torch.Generator().manual_seed(seed)
        return generate(model, prompts, 25, generator=gen, eos=NEVER, **setting, **kw)

    first = run(0)
    assert run(0) == first, "the same seed gave different tokens"
    assert run(0, use_cache=False) == first, "the KV cache changed the tokens"
    assert run(0, check_every=4) == first, "reading the device every 4 steps changed them"
    assert run(1) != first, "another seed gave the same tokens"
    assert all(0 <= t < VOCAB for row in first for t in row)


def test_filters_change_what_is_drawn(checkpoints):  # noqa: F811
    directory, _ = checkpoints["gpt2/d32-h2-tied"]
    model = load_gpt2(directory)
    rows = generate(model, [[5, 6, 7]] * 8, 20, temperature=1.0, top_k=1, eos=NEVER,
                    generator=torch.Generator().manual_seed(0))
    greedy = generate(model, [[5, 6, 7]], 20, eos=NEVER)[0]
    assert all(row == greedy for row in rows), "top_k=1 sampling is not greedy decoding"
    penalised = generate(model, [[5, 6, 7]], 20, eos=NEVER, repetition_penalty=5.0)[0]
    assert len(set(penalised)) > len(set(greedy)), (
        f"a strong penalty did not vary the tokens: {penalised} vs greedy {greedy}")
