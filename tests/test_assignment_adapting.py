"""Assignment 9 (adapting a model): the top-p, LoRA and answer-only loss checkers.

The references agree with `transformers`, `peft` and a loop over tokens, right code passes
(written in several ways), every named mistake is named by a submission that makes it, bad code
never makes a checker raise, and the grader scores a correct, a wrong and two hostile
submissions as they deserve.
"""

from __future__ import annotations

import csv
import importlib.util
import itertools
import math
from pathlib import Path

import nbformat
import pytest
import torch
import torch.nn.functional as F
from assignment_grading import grade, write_submission
from notebooks import ROOT
from torch import nn

from grader.policy import child_policy
from grader.scan import static_scan
from utils.checks import (
    ASSIGNMENTS,
    CheckResult,
    check_answer_only_loss,
    check_lora_linear,
    check_top_p_filter,
)
from utils.checks.a9_adapting import (
    ASSIGNMENT,
    FILL_FINITE,
    LOSS_CHECKER,
    MARGIN,
    TOP_P_CHECKER,
    answer_only_reference,
    top_p_reference,
)
from utils.checks.a9_lora import (
    A_ZERO,
    B_NOT_ZERO,
    BASE_NOT_FROZEN,
    INIT_SWAPPED,
    LORA_CHECKER,
    MERGE_EXTRA_BIAS,
    lora_reference,
)
from utils.checks.compare import fmt, max_diff
from utils.checks.core import exercise

# ---------------------------------------------------------------------------------------------
# Right implementations, written in several ways


def top_p_sorted(logits, p, min_tokens_to_keep=1):
    """Vectorized: the mass before each token, in descending order (the notebook's solution)."""
    probs = torch.softmax(logits, dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    remove_sorted = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= p
    remove_sorted[..., :min_tokens_to_keep] = False
    return logits.masked_fill(remove_sorted.scatter(-1, order, remove_sorted), float("-inf"))


def top_p_shifted(logits, p, min_tokens_to_keep=1):
    """The older Hugging Face form: `cumulative > p` shifted one place right, then gathered."""
    sorted_logits, order = torch.sort(logits, descending=True)
    cumulative = sorted_logits.softmax(-1).cumsum(-1)
    remove = cumulative > p
    remove[..., 1:] = remove[..., :-1].clone()
    remove[..., 0] = False
    remove[..., :min_tokens_to_keep] = False
    mask = torch.zeros_like(remove).scatter(1, order, remove)
    out = logits.clone()
    out[mask] = -math.inf
    return out


def top_p_loop(logits, p, min_tokens_to_keep=1):
    """Row by row, token by token, in Python floats."""
    out = torch.full_like(logits, float("-inf"))
    for row in range(logits.shape[0]):
        probs = torch.softmax(logits[row].double(), dim=-1).tolist()
        total = 0.0
        for kept, index in enumerate(sorted(range(len(probs)), key=lambda i: -probs[i])):
            if total >= p and kept >= min_tokens_to_keep:
                break
            out[row, index] = logits[row, index]
            total += probs[index]
    return out


class LoRA(nn.Module):
    """nn.Parameters and matrix products (the notebook's solution)."""

    def __init__(self, base, r, alpha):
        super().__init__()
        self.base = base
        self.base.requires_grad_(False)
        self.lora_A = nn.Parameter(torch.empty(r, base.in_features))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, r))
        self.scaling = alpha / r

    def forward(self, x):
        return self.base(x) + x @ self.lora_A.T @ self.lora_B.T * self.scaling

    def merge(self):
        merged = nn.Linear(self.base.in_features, self.base.out_features,
                           bias=self.base.bias is not None)
        with torch.no_grad():
            merged.weight.copy_(self.base.weight + self.scaling * self.lora_B @ self.lora_A)
            if self.base.bias is not None:
                merged.bias.copy_(self.base.bias)
        return merged


class LoRAFunctional(nn.Module):
    """F.linear throughout, A drawn from a normal distribution, the merge by deepcopy."""

    def __init__(self, base, r, alpha):
        super().__init__()
        for param in base.parameters():
            param.requires_grad = False
        self.base = base
        self.r, self.alpha = r, alpha
        self.lora_A = nn.Parameter(torch.randn(r, base.in_features) * 0.01)
        self.lora_B = nn.Parameter(base.weight.new_zeros(base.out_features, r))

    def forward(self, x):
        update = F.linear(F.linear(x, self.lora_A), self.lora_B)
        return F.linear(x, self.base.weight, self.base.bias) + update * (self.alpha / self.r)

    def merge(self):
        import copy
        merged = copy.deepcopy(self.base)
        merged.weight.data += (self.alpha / self.r) * (self.lora_B @ self.lora_A).detach()
        return merged


def loss_vectorized(logits, tokens, prompt_lengths, lengths=None):
    """Targets with -100 outside the answers, one cross-entropy (the notebook's solution)."""
    batch, length, vocab = logits.shape
    if lengths is None:
        lengths = torch.full((batch,), length)
    targets = tokens[:, 1:].clone()
    position = torch.arange(length - 1)
    answer = (position >= prompt_lengths[:, None] - 1) & (position < lengths[:, None] - 1)
    targets[~answer] = -100
    return F.cross_entropy(logits[:, :-1].reshape(-1, vocab), targets.reshape(-1),
                           ignore_index=-100)


def loss_loop(logits, tokens, prompt_lengths, lengths=None):
    """A sum of log-softmax terms over the answer tokens, one at a time, then a division."""
    total, count = 0.0, 0
    for b in range(logits.shape[0]):
        end = logits.shape[1] if lengths is None else int(lengths[b])
        for t in range(int(prompt_lengths[b]), end):  # token t is predicted at t - 1
            total = total - torch.log_softmax(logits[b, t - 1], dim=-1)[tokens[b, t]]
            count += 1
    return total / count


def loss_masked_mean(logits, tokens, prompt_lengths, lengths=None):
    """Per-token losses times a float mask, summed and divided by the mask's sum."""
    losses = F.cross_entropy(logits[:, :-1].transpose(1, 2), tokens[:, 1:], reduction="none")
    target_pos = torch.arange(1, tokens.shape[1])[None, :]
    mask = target_pos >= prompt_lengths[:, None]
    if lengths is not None:
        mask = mask & (target_pos < lengths[:, None])
    mask = mask.to(losses.dtype)
    return (losses * mask).sum() / mask.sum()


@pytest.mark.parametrize("fn", [top_p_sorted, top_p_shifted, top_p_loop])
def test_right_top_p_passes(fn):
    result = check_top_p_filter(fn, verbose=False)
    assert result.passed and result.points == result.max_points == 8, result.hints


@pytest.mark.parametrize("cls", [LoRA, LoRAFunctional])
def test_right_lora_passes(cls):
    result = check_lora_linear(cls, verbose=False)
    assert result.passed and result.points == result.max_points == 6, result.hints


@pytest.mark.parametrize("fn", [loss_vectorized, loss_loop, loss_masked_mean])
def test_right_loss_passes(fn):
    result = check_answer_only_loss(fn, verbose=False)
    assert result.passed and result.points == result.max_points == 6, result.hints


def test_fresh_inputs_pass_too():
    """The grader draws fresh inputs (a seed) for every run: right code passes on them."""
    for checker, obj in ((TOP_P_CHECKER, top_p_shifted), (LORA_CHECKER, LoRAFunctional),
                         (LOSS_CHECKER, loss_loop)):
        for seed in (3, 11, 2024):
            for spec in checker.specs(seed=seed):
                hint = checker.judge(spec, exercise(obj, spec))
                assert hint is None, (checker.name, seed, hint)


# ---------------------------------------------------------------------------------------------
# The references against transformers, peft and a loop


def test_top_p_reference_is_transformers_warper():
    """The switchable reference (no switch) equals TopPLogitsWarper on every case, fixed and
    fresh, in float64 and float32; and the checker's cases keep MARGIN from p."""
    from transformers.generation.logits_process import TopPLogitsWarper
    for seed in (None, 5, 99):
        for spec in TOP_P_CHECKER.specs(seed=seed):
            p, keep = float(spec.literals[0]), spec.config["min_keep"]
            logits = spec.tensors["logits"]
            want = TopPLogitsWarper(p, min_tokens_to_keep=keep)(None, logits.double())
            assert torch.equal(top_p_reference(logits.double(), p, keep), want), (seed, p)
            assert torch.equal(top_p_sorted(logits, p, keep).double(), want.to(logits.dtype)
                               .double())
    assert MARGIN >= 1e-3


def test_lora_reference_is_peft():
    """Same weights and adapters in peft's LoRA layer (LoraConfig(r, lora_alpha), no dropout):
    the same output, gradients of the input and of both adapters, and merged weight."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    for d_in, d_out, r, alpha, bias in ((8, 6, 2, 4.0, True), (12, 5, 4, 6.0, False)):
        model = nn.Sequential(nn.Linear(d_in, d_out, bias=bias)).double()
        wrapped = peft.get_peft_model(model, peft.LoraConfig(r=r, lora_alpha=alpha,
                                                             target_modules=["0"]))
        layer = wrapped.base_model.model[0]
        with torch.no_grad():
            layer.lora_B["default"].weight.normal_()
        a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
        weight, base_bias = layer.base_layer.weight, layer.base_layer.bias
        x = torch.randn(3, d_in, dtype=torch.float64, requires_grad=True)
        out = wrapped(x)
        g = torch.randn_like(out)
        got = torch.autograd.grad(out, (x, a, b), g)
        xr = x.detach().clone().requires_grad_(True)
        ar, br = a.detach().clone().requires_grad_(True), b.detach().clone().requires_grad_(True)
        ref = lora_reference(xr, weight.detach(), None if base_bias is None else
                             base_bias.detach(), ar, br, r, alpha)
        want = torch.autograd.grad(ref["output"], (xr, ar, br), g)
        assert (ref["output"] - out).abs().max() < 1e-12
        assert all((u - v).abs().max() < 1e-12 for u, v in zip(got, want, strict=True))
        merged = wrapped.merge_and_unload()[0]
        assert (merged.weight - ref["merged_weight"]).abs().max() < 1e-12


def test_loss_reference_is_a_loop_over_answer_tokens():
    for seed in (None, 8):
        for spec in LOSS_CHECKER.specs(seed=seed):
            t = spec.tensors
            args = (t["logits"].double(), t["tokens"], t["prompt_lengths"], t.get("lengths"))
            assert abs(float(answer_only_reference(*args)) - float(loss_loop(*args))) < 1e-12


# ---------------------------------------------------------------------------------------------
# Every named mistake is named, by a submission that makes it


def _planted_top_p(options):
    def top_p_filter(logits, p, min_tokens_to_keep=1):
        return top_p_reference(logits, p, min_tokens_to_keep, **options)
    return top_p_filter


def _planted_loss(options):
    def answer_only_loss(logits, tokens, prompt_lengths, lengths=None):
        return answer_only_reference(logits, tokens, prompt_lengths, lengths, **options)
    return answer_only_loss


@pytest.mark.parametrize("mistake", TOP_P_CHECKER.mistakes, ids=lambda m: str(m.options))
def test_every_top_p_mistake_is_named(mistake):
    result = check_top_p_filter(_planted_top_p(mistake.options), verbose=False)
    assert not result.passed and mistake.hint in result.hints, result.hints


@pytest.mark.parametrize("mistake", LOSS_CHECKER.mistakes, ids=lambda m: str(m.options))
def test_every_loss_mistake_is_named(mistake):
    result = check_answer_only_loss(_planted_loss(mistake.options), verbose=False)
    assert not result.passed and mistake.hint in result.hints, result.hints


def test_the_planted_references_themselves_pass():
    assert check_top_p_filter(_planted_top_p({}), verbose=False).passed
    assert check_answer_only_loss(_planted_loss({}), verbose=False).passed


def test_every_checker_names_at_least_eight_mistakes():
    assert [c.name for c in ASSIGNMENT.checkers] == ["check_top_p_filter", "check_lora_linear",
                                                      "check_answer_only_loss"]
    for checker in ASSIGNMENT.checkers:
        assert len({m.hint for m in checker.mistakes}) >= 8, checker.name


# Top-p mistakes as a student writes them


def top_p_unsorted(logits, p, min_tokens_to_keep=1):
    probs = torch.softmax(logits, -1)
    remove = probs.cumsum(-1) - probs >= p  # in the vocabulary's order
    remove[..., :min_tokens_to_keep] = False
    return logits.masked_fill(remove, float("-inf"))


def top_p_drops_crossing(logits, p, min_tokens_to_keep=1):
    sorted_logits, order = logits.sort(-1, descending=True)
    remove = sorted_logits.softmax(-1).cumsum(-1) > p  # not shifted
    remove[..., :min_tokens_to_keep] = False
    return logits.masked_fill(remove.scatter(1, order, remove), float("-inf"))


def top_p_no_min_keep(logits, p, min_tokens_to_keep=1):
    return top_p_sorted(logits, p)


def top_p_in_place(logits, p, min_tokens_to_keep=1):
    probs = torch.softmax(logits, dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    remove = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= p
    remove[..., :min_tokens_to_keep] = False
    return logits.masked_fill_(remove.scatter(-1, order, remove), float("-inf"))


def top_p_not_unsorted(logits, p, min_tokens_to_keep=1):
    probs = torch.softmax(logits, dim=-1)
    sorted_probs, _ = probs.sort(dim=-1, descending=True)
    remove = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= p
    remove[..., :min_tokens_to_keep] = False
    return logits.masked_fill(remove, float("-inf"))


def top_p_float32(logits, p, min_tokens_to_keep=1):
    return top_p_sorted(logits.float(), p, min_tokens_to_keep)


@pytest.mark.parametrize("fn, phrase", [
    (top_p_unsorted, "the cumulative mass is taken in the vocabulary's order, before sorting"),
    (top_p_drops_crossing, "the token that crosses p is dropped"),
    (top_p_no_min_keep, "min_tokens_to_keep is ignored"),
    (top_p_in_place, "changes its input `logits` in place"),
    (top_p_not_unsorted, "map it back with the sort's indices"),
    (top_p_float32, "has dtype torch.float32; the reference returns torch.float64"),
])
def test_handwritten_top_p_mistakes(fn, phrase):
    result = check_top_p_filter(fn, verbose=False)
    assert not result.passed and any(phrase in h for h in result.hints), result.hints


def _top_p_filled_with(fill):
    def top_p_filter(logits, p, min_tokens_to_keep=1):
        probs = torch.softmax(logits, dim=-1)
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        remove = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= p
        remove[..., :min_tokens_to_keep] = False
        return logits.masked_fill(remove.scatter(-1, order, remove), fill(logits))
    return top_p_filter


def top_p_gathered(logits, p, min_tokens_to_keep=1):
    probs = torch.softmax(logits, dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    remove = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= p
    remove[..., :min_tokens_to_keep] = False
    return logits.masked_fill(remove.gather(-1, order), float("-inf"))  # not the inverse


def top_p_ascending(logits, p, min_tokens_to_keep=1):
    probs = torch.softmax(logits, dim=-1)
    sorted_probs, order = probs.sort(dim=-1)  # the least likely first
    remove = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= p
    remove[..., :min_tokens_to_keep] = False
    return logits.masked_fill(remove.scatter(-1, order, remove), float("-inf"))


@pytest.mark.parametrize("fn, phrase", [
    (_top_p_filled_with(lambda x: -1e9), FILL_FINITE),
    (_top_p_filled_with(lambda x: torch.finfo(x.dtype).min), FILL_FINITE),
    (top_p_gathered, "you applied the permutation instead of its inverse: the mask made in "
                     "sorted order is mapped back with gather(-1, order); use scatter"),
    (top_p_ascending, "the probabilities are sorted in ascending order"),
], ids=["minus_1e9", "finfo_min", "gather", "ascending"])
def test_one_top_p_mistake_is_named_alike_in_every_case(fn, phrase):
    """Every case that fails names the one mistake made (not another mistake that gives the same
    output on that case, nor "matches none" with a difference of 1.8e+308)."""
    for seed in (None, 1, 2, 3):
        for case, spec in zip(TOP_P_CHECKER.cases, TOP_P_CHECKER.specs(seed), strict=True):
            hint = TOP_P_CHECKER.judge(spec, exercise(fn, spec))
            assert hint is None or hint.startswith(phrase), (seed, case.id, hint)
    assert not check_top_p_filter(fn, verbose=False).passed


def test_an_infinite_difference_prints_as_inf():
    assert max_diff(torch.tensor([-1e9]), torch.tensor([-math.inf])) == math.inf
    assert fmt(max_diff(torch.tensor([1.0]), torch.tensor([math.nan]))) == "inf"


def test_the_top_p_cases_tell_the_mistakes_apart():
    """On every case, fixed or drawn, two single mistakes that change the output change it each
    its own way (the fixed batch_one case once gave the same output for two of them)."""
    for seed in (None, *range(1, 30)):
        for case, spec in zip(TOP_P_CHECKER.cases, TOP_P_CHECKER.specs(seed), strict=True):
            x = spec.tensors["logits"].double()
            right = top_p_reference(x, spec.literals[0], spec.config["min_keep"])
            outs = {}
            for m in TOP_P_CHECKER.mistakes:
                out = top_p_reference(x, spec.literals[0], spec.config["min_keep"], **m.options)
                if not torch.equal(torch.isfinite(out), torch.isfinite(right)) or not \
                        torch.allclose(out, right, equal_nan=True):
                    outs[m.hint[:40]] = out
            for (a, out_a), (b, out_b) in itertools.combinations(outs.items(), 2):
                assert not torch.allclose(out_a, out_b, equal_nan=True), (seed, case.id, a, b)


# LoRA mistakes as a student writes them: one class each


def _lora(name, **methods):
    return type(name, (LoRA,), methods)


def _init_scaled(scaling):
    def __init__(self, base, r, alpha):
        LoRA.__init__(self, base, r, alpha)
        self.scaling = scaling(alpha, r)
    return __init__


def _init_then(change):
    def __init__(self, base, r, alpha):
        LoRA.__init__(self, base, r, alpha)
        change(self)
    return __init__


def _set_b_random(m):
    nn.init.normal_(m.lora_B)


def _set_a_zero(m):
    nn.init.zeros_(m.lora_A)


def _swap_inits(m):
    nn.init.zeros_(m.lora_A)
    nn.init.normal_(m.lora_B)


def _unfreeze(m):
    m.base.requires_grad_(True)


def _unfreeze_bias(m):
    if m.base.bias is not None:
        m.base.bias.requires_grad_(True)
    else:
        m.base.weight.requires_grad_(True)


def _freeze_adapters(m):
    m.lora_A.requires_grad_(False)
    m.lora_B.requires_grad_(False)


def _merge_with(delta, bias=True):
    def merge(self):
        merged = nn.Linear(self.base.in_features, self.base.out_features,
                           bias=bias and self.base.bias is not None)
        with torch.no_grad():
            merged.weight.copy_(self.base.weight + delta(self))
            if merged.bias is not None:
                merged.bias.copy_(self.base.bias)
        return merged
    return merge


def _merge_in_place(self):
    with torch.no_grad():
        self.base.weight += self.scaling * self.lora_B @ self.lora_A
    return self.base


LORA_MISTAKES = {
    "the LoRA update is not scaled": _lora("NoScale", __init__=_init_scaled(lambda a, r: 1.0)),
    "scaled by r / alpha": _lora("Inverse", __init__=_init_scaled(lambda a, r: r / a)),
    "an integer division": _lora("Floor", __init__=_init_scaled(lambda a, r: a // r)),
    "the update is scaled by alpha: divide it by r": _lora(
        "Alpha", __init__=_init_scaled(lambda a, r: a)),
    "the base layer's output is missing": _lora(
        "NoBase", forward=lambda self, x: x @ self.lora_A.T @ self.lora_B.T * self.scaling),
    "merge() adds (B A)^T": _lora("Transposed", merge=_merge_with(
        lambda m: m.scaling * (m.lora_B @ m.lora_A).T)),
    "merge() adds B @ A without the scaling": _lora("Unscaled", merge=_merge_with(
        lambda m: m.lora_B @ m.lora_A)),
    "merge() returns the base layer's weight unchanged": _lora(
        "NoUpdate", merge=_merge_with(lambda m: 0.0)),
    "merge() drops the base layer's bias": _lora("NoBias", merge=_merge_with(
        lambda m: m.scaling * m.lora_B @ m.lora_A, bias=False)),
    "merge() changes the base layer in place": _lora("InPlace", merge=_merge_in_place),
    BASE_NOT_FROZEN: _lora("NotFrozen", __init__=_init_then(_unfreeze)),
    "lora_A and lora_B do not require gradients": _lora(
        "AdaptersFrozen", __init__=_init_then(_freeze_adapters)),
    B_NOT_ZERO: _lora("BRandom", __init__=_init_then(_set_b_random)),
    A_ZERO: _lora("AZero", __init__=_init_then(_set_a_zero)),
    INIT_SWAPPED: _lora("Swapped", __init__=_init_then(_swap_inits)),
}


@pytest.mark.parametrize("phrase", list(LORA_MISTAKES))
def test_every_lora_mistake_is_named(phrase):
    result = check_lora_linear(LORA_MISTAKES[phrase], verbose=False)
    assert not result.passed and any(phrase in h for h in result.hints), result.hints


def test_every_lora_mistake_of_the_table_is_made_by_a_class():
    for mistake in LORA_CHECKER.mistakes:
        assert any(phrase in mistake.hint for phrase in LORA_MISTAKES), mistake.hint


class PeftStyleMerge(LoRA):
    """peft's way: merge() adds the update to the base layer's weight and returns the base layer,
    and the module, marked merged, then computes base(x) alone (so its output stays right)."""

    def forward(self, x):
        return self.base(x) if getattr(self, "merged", False) else LoRA.forward(self, x)

    def merge(self):
        with torch.no_grad():
            self.base.weight += self.scaling * self.lora_B @ self.lora_A
        self.merged = True
        return self.base


def test_a_merge_in_place_that_returns_the_base_layer_is_named():
    result = check_lora_linear(PeftStyleMerge, verbose=False)
    assert result.points == 0, result.hints
    assert all("merge() changes the base layer in place" in h for h in result.hints), result.hints


def test_a_base_frozen_but_its_bias_is_still_named():
    result = check_lora_linear(_lora("BiasTrains", __init__=_init_then(_unfreeze_bias)),
                               verbose=False)
    assert result.points == 0 and all(BASE_NOT_FROZEN in h for h in result.hints), result.hints


def _merge_default_linear(zero_bias):
    def merge(self):
        merged = nn.Linear(self.base.in_features, self.base.out_features)  # always a bias
        with torch.no_grad():
            merged.weight.copy_(self.base.weight + self.scaling * self.lora_B @ self.lora_A)
            if self.base.bias is not None:
                merged.bias.copy_(self.base.bias)
            elif zero_bias:
                merged.bias.zero_()
        return merged
    return merge


def test_a_merged_layer_may_hold_a_zero_bias_but_not_a_random_one():
    """Without a base bias, a merged nn.Linear whose bias is zero computes the same function
    (full marks); one that keeps nn.Linear's random bias does not, and is named."""
    fair = check_lora_linear(_lora("ZeroBias", merge=_merge_default_linear(True)), verbose=False)
    assert fair.passed, fair.hints
    wrong = check_lora_linear(_lora("RandomBias", merge=_merge_default_linear(False)),
                              verbose=False)
    assert len(wrong.hints) == 1 and wrong.hints[0].endswith(MERGE_EXTRA_BIAS), wrong.hints


class LoRAWithLinears(LoRA):
    """peft's layout (lora_A and lora_B as nn.Linear): the names the assignment fixes differ."""

    def __init__(self, base, r, alpha):
        nn.Module.__init__(self)
        self.base = base.requires_grad_(False)
        self.lora_A = nn.Linear(base.in_features, r, bias=False)
        self.lora_B = nn.Linear(r, base.out_features, bias=False)


class LoRATransposedA(LoRA):
    def __init__(self, base, r, alpha):
        super().__init__(base, r, alpha)
        self.lora_A = nn.Parameter(torch.randn(base.in_features, r))


class LoRACopiesBase(LoRA):
    def __init__(self, base, r, alpha):
        super().__init__(nn.Linear(base.in_features, base.out_features), r, alpha)


@pytest.mark.parametrize("cls, phrase", [
    (LoRAWithLinears, "`lora_A` must be an nn.Parameter of shape"),
    (LoRATransposedA, "`lora_A` has shape (8, 2), expected (2, 8)"),
    (LoRACopiesBase, "must keep the layer it wraps as `self.base`"),
])
def test_handwritten_lora_layout_mistakes(cls, phrase):
    result = check_lora_linear(cls, verbose=False)
    assert not result.passed and any(phrase in h for h in result.hints), result.hints


# Loss mistakes as a student writes them


def loss_tokens_in_place(logits, tokens, prompt_lengths, lengths=None):
    batch, length, vocab = logits.shape
    lengths = torch.full((batch,), length) if lengths is None else lengths
    targets = tokens[:, 1:]  # a view: writing -100 changes the caller's tokens
    position = torch.arange(length - 1)
    targets[(position < prompt_lengths[:, None] - 1) | (position >= lengths[:, None] - 1)] = -100
    return F.cross_entropy(logits[:, :-1].reshape(-1, vocab), targets.reshape(-1))


def loss_prompt_counted(logits, tokens, prompt_lengths, lengths=None):
    return loss_vectorized(logits, tokens, torch.ones_like(prompt_lengths), lengths)


def loss_padding_counted(logits, tokens, prompt_lengths, lengths=None):
    return loss_vectorized(logits, tokens, prompt_lengths)


def loss_first_answer_dropped(logits, tokens, prompt_lengths, lengths=None):
    return loss_vectorized(logits, tokens, prompt_lengths + 1, lengths)


def loss_summed(logits, tokens, prompt_lengths, lengths=None):
    return loss_loop(logits, tokens, prompt_lengths, lengths) * sum(
        int((lengths if lengths is not None else torch.full_like(prompt_lengths,
            tokens.shape[1]))[b]) - int(prompt_lengths[b]) for b in range(tokens.shape[0]))


def loss_divided_by_batch(logits, tokens, prompt_lengths, lengths=None):
    return loss_summed(logits, tokens, prompt_lengths, lengths) / tokens.shape[0]


def loss_not_shifted(logits, tokens, prompt_lengths, lengths=None):
    batch, length, vocab = logits.shape
    lengths = torch.full((batch,), length) if lengths is None else lengths
    position = torch.arange(length)  # position t scored on token t
    targets = tokens.masked_fill((position < prompt_lengths[:, None])
                                 | (position >= lengths[:, None]), -100)
    return F.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1))


@pytest.mark.parametrize("fn, phrase", [
    (loss_divided_by_batch, "the summed loss is divided by the batch size"),
    (loss_not_shifted, "the targets are not shifted"),
    (loss_tokens_in_place, "`tokens[:, 1:]` is a view of tokens: clone it"),
    (loss_prompt_counted, "the prompt tokens are left in the loss"),
    (loss_padding_counted, "the padding counts in the loss"),
    (loss_first_answer_dropped, "the first answer token is left out of the loss"),
    (loss_summed, "the loss is summed over the answer tokens"),
])
def test_handwritten_loss_mistakes(fn, phrase):
    result = check_answer_only_loss(fn, verbose=False)
    assert not result.passed and any(phrase in h for h in result.hints), result.hints


# Drawn inputs on which the loss alone of "not shifted" equals that of "the prompt is left in the
# loss" (the padded case) or the reference's own loss (the prompt_one case), within tolerance.
LOSS_LOOK_ALIKES = [(450652119, "padded"), (242573670, "prompt_one")]


@pytest.mark.parametrize("seed, case_id", LOSS_LOOK_ALIKES)
def test_a_loss_mistake_is_named_from_the_gradient_too(seed, case_id):
    specs = dict(zip([c.id for c in LOSS_CHECKER.cases], LOSS_CHECKER.specs(seed), strict=True))
    spec = specs[case_id]
    looks = [LOSS_CHECKER.evaluate(spec, grads=False, **o)["out:loss"]
             for o in ({"shift": False}, {"start": None}, {})]
    assert any(torch.allclose(looks[0], other, 1e-4, 1e-4) for other in looks[1:]), looks
    hint = LOSS_CHECKER.judge(spec, exercise(loss_not_shifted, spec))
    assert hint and "the targets are not shifted" in hint, hint


# ---------------------------------------------------------------------------------------------
# Bad code never raises


def _raise(exc):
    def f(*a, **k):
        raise exc
    return f


BAD = {
    "None": lambda *a, **k: None,
    "a string": lambda *a, **k: "adapted",
    "NotImplementedError": _raise(NotImplementedError()),
    "sys.exit": _raise(SystemExit(1)),
    "KeyboardInterrupt": _raise(KeyboardInterrupt()),
    "not callable": 42,
    "NaN": lambda x, *a, **k: x * float("nan"),
    "a module without merge": type("B", (nn.Module,), {
        "__init__": lambda self, base, r, alpha: nn.Module.__init__(self)}),
    "merge raises": _lora("MergeRaises", merge=_raise(RuntimeError("boom"))),
    "merge returns a tensor": _lora("MergeTensor", merge=lambda self: self.base.weight),
}


@pytest.mark.parametrize("bad", list(BAD))
def test_bad_code_never_raises(bad, capsys):
    for check in (check_top_p_filter, check_lora_linear, check_answer_only_loss):
        result = check(BAD[bad])
        assert isinstance(result, CheckResult)
        assert result.passed is False and result.score == 0.0, (check, result.hints)
        assert all(c.hint for c in result.cases)
    lines = capsys.readouterr().out.strip().splitlines()
    assert all(ln.startswith(("[FAIL] ", "check_", " " * 7)) for ln in lines)


# ---------------------------------------------------------------------------------------------
# The assignment's place in the grader

NOTEBOOK = ROOT / "book" / "assignments" / "a9_adapting.ipynb"


def test_the_assignment_rules():
    assert list(ASSIGNMENTS)[-1] == ASSIGNMENT.name == "a9_adapting"
    ids = {r.id for r in ASSIGNMENT.rules}
    for line in ("from transformers import TopPLogitsWarper", "import peft",
                 "from utils.sampling import top_p_filter", "import utils.lora",
                 "from utils.finetune import answer_only_loss"):
        hit = static_scan([line], ASSIGNMENT.rules)
        assert hit and set(hit) <= ids, line
    assert static_scan(["import torch\nimport torch.nn.functional as F\nimport math"],
                       ASSIGNMENT.rules) == []


def test_the_forbidden_packages_are_unreadable_whole():
    """transformers and peft: every file of the package, not only its __init__.py, is outside
    what the child may read, and opening one is reported."""
    policy = child_policy(ASSIGNMENT.rules)
    for name in ("transformers", "peft"):
        folder = Path(importlib.util.find_spec(name).origin).parent
        assert str(folder) + "/" in policy["sources"], (name, policy["sources"])
        inside = [p for p in policy["readable"] + policy["listable"]
                  if Path(p) == folder.resolve() or folder.resolve() in Path(p).parents]
        assert inside == [], (name, inside[:5])


SOLUTION_CELLS = (3, 7, 11)

TOP_P_DROPS_CROSSING_CELL = '''
def top_p_filter(logits, p, min_tokens_to_keep=1):
    sorted_logits, order = logits.sort(-1, descending=True)
    remove = sorted_logits.softmax(-1).cumsum(-1) > p
    remove[..., :min_tokens_to_keep] = False
    return logits.masked_fill(remove.scatter(1, order, remove), float("-inf"))
'''

TOP_P_FROM_TRANSFORMERS_CELL = '''
from transformers.generation.logits_process import TopPLogitsWarper


def top_p_filter(logits, p, min_tokens_to_keep=1):
    return TopPLogitsWarper(p, min_tokens_to_keep=min_tokens_to_keep)(None, logits)
'''

LOSS_FROM_CHECKER_CELL = '''
import importlib

_ref = importlib.import_module("utils.checks." + "a9_adapting")


def answer_only_loss(logits, tokens, prompt_lengths, lengths=None):
    return _ref.answer_only_reference(logits, tokens, prompt_lengths, lengths)
'''

TOP_P_READS_TRANSFORMERS_CELL = '''
import glob
import sys

_found = {}
for _folder in sys.path:
    for _path in glob.glob(_folder + "/transformers/generation/logits_process.py"):
        try:
            _src = open(_path).read()
            _start = _src.index("class TopPLogitsWarper")
            _code = _src[_start:_src.index("\\nclass ", _start + 10)]
            _code = _code.replace("@add_start_docstrings(LOGITS_PROCESSOR_INPUTS_DOCSTRING)", "")
            exec(_code, _found.setdefault("ns", {"torch": torch, "LogitsProcessor": object}))
        except Exception:
            pass


def top_p_filter(logits, p, min_tokens_to_keep=1):
    warper = _found["ns"]["TopPLogitsWarper"](top_p=p, min_tokens_to_keep=min_tokens_to_keep)
    return warper(None, logits.clone())
'''

# student: ({solution cell index: source}, expectation)
SUBMISSIONS = {
    "ok_a9_book": ({}, "full"),
    "bad_a9_crossing": ({3: TOP_P_DROPS_CROSSING_CELL}, "the token that crosses p is dropped"),
    "evil_a9_transformers": ({3: TOP_P_FROM_TRANSFORMERS_CELL}, "imports transformers"),
    "evil_a9_checker_reference": ({11: LOSS_FROM_CHECKER_CELL},
                                  "tried to read the book's sources or reference code"),
    "evil_a9_reads_transformers": ({3: TOP_P_READS_TRANSFORMERS_CELL},
                                   "tried to read the book's sources or reference code"),
}


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    base = tmp_path_factory.mktemp("a9_grading")
    for student, (cells, _) in SUBMISSIONS.items():
        write_submission(NOTEBOOK, base / "submitted", student, cells)
    grade(base / "submitted", base / "out", "--case-timeout", "5", "--cells-timeout", "30")
    with open(base / "out" / "grades.csv", newline="") as f:
        rows = {r["student"]: r for r in csv.DictReader(f)}
    return rows, base / "out"


def test_the_solution_cells_are_where_the_submissions_put_code():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert [i for i, c in enumerate(nb.cells)
            if c.cell_type == "code" and "### BEGIN SOLUTION" in c.source] == list(
        SOLUTION_CELLS)


@pytest.mark.parametrize("student", list(SUBMISSIONS))
def test_each_a9_submission_gets_what_it_deserves(graded, student):
    rows, out = graded
    row = rows[student]
    expect = SUBMISSIONS[student][1]
    feedback = (out / "feedback" / student / "a9_adapting.md").read_text()
    assert row["assignment"] == "a9_adapting"
    score, top = float(row["score"]), float(row["max_score"])
    assert top == 20
    if expect == "full":
        assert score == top and "FAIL" not in feedback, feedback
        assert row["flags"] == ""
    else:
        assert score < top and expect in feedback, feedback
    cases = [k for k in row if "." in k and row[k] != ""]
    assert sum(float(row[k]) for k in cases) == score


def test_the_wrong_submission_keeps_its_right_parts(graded):
    row = graded[0]["bad_a9_crossing"]
    assert float(row["lora_linear.basic"]) == 2
    assert float(row["answer_only_loss.padded"]) == 2
    assert float(row["top_p_filter.basic"]) == 0
    assert row["flags"] == ""


def test_the_hostile_submissions_are_flagged(graded):
    rows = graded[0]
    assert "reference used" in rows["evil_a9_transformers"]["flags"], rows["evil_a9_transformers"]
    assert float(rows["evil_a9_transformers"]["top_p_filter.basic"]) == 0
    reader = rows["evil_a9_reads_transformers"]  # the package's files, not only __init__.py
    assert "reference used" in reader["flags"], reader
    assert float(reader["top_p_filter.basic"]) == 0
    evil = rows["evil_a9_checker_reference"]
    assert "reference used" in evil["flags"], evil
    assert float(evil["answer_only_loss.padded"]) == 0
