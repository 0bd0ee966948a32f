"""Assignment 9: adapting a model, the top-p filter, a LoRA layer and the answer-only loss.

The student writes

* ``top_p_filter(logits, p, min_tokens_to_keep=1)``: (B, V) logits in, the same logits out with
  every token outside the nucleus set to -inf. The nucleus is the smallest set of most likely
  tokens whose probabilities add up to p or more (the token that crosses p is kept), and never
  fewer than ``min_tokens_to_keep`` tokens: the semantics of `transformers`' ``TopPLogitsWarper``,
  which is the reference when no mistake is reproduced;
* ``LoRALinear(base, r, alpha)`` (its checker is `a9_lora`);
* ``answer_only_loss(logits, tokens, prompt_lengths, lengths=None)`` (its checker is
  `a9_loss`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from .a9_lora import LORA_CHECKER, check_lora_linear, lora_reference
from .a9_loss import LOSS_CHECKER, answer_only_reference, check_answer_only_loss
from .checker import Case, Checker, Mistake, run_in_process
from .compare import allclose
from .core import Spec
from .guard import Assignment, Rule
from .results import CheckResult

__all__ = ["check_top_p_filter", "check_lora_linear", "check_answer_only_loss", "TOP_P_CHECKER",
           "LOSS_CHECKER", "LORA_CHECKER", "ASSIGNMENT", "top_p_reference", "answer_only_reference",
           "MARGIN"]


# --------------------------------------------------------------------------------------------
# The references, in float64, with switches that reproduce mistakes


def _warper(logits: torch.Tensor, p: float, min_keep: int) -> torch.Tensor:
    """`transformers`' own top-p filter (imported here only: about 1.5 s, once a process)."""
    from transformers.generation.logits_process import TopPLogitsWarper

    return TopPLogitsWarper(top_p=float(p), min_tokens_to_keep=int(min_keep))(None, logits)


def top_p_reference(logits: torch.Tensor, p: float, min_keep: int = 1, *, order: str = "desc",
                    crossing: str = "kept", use_min_keep: bool = True, mass: str = "probs",
                    unsort: bool | str = True, invert: bool = False, fill: str | float = "-inf",
                    output: str = "logits") -> torch.Tensor:
    """The nucleus filter of (B, V) ``logits``, written with the most likely token first.

    A token is removed when the probability of the tokens before it (in descending order)
    already reaches p; the first ``min_keep`` are always kept. Switches reproduce mistakes:
    ``order`` ("desc", "asc": the least likely first, "vocab": the cumulative mass taken in the
    vocabulary's order, before sorting), ``crossing`` ("kept", "dropped": the token whose
    probability crosses p removed), ``use_min_keep``, ``mass`` ("probs", "logits": no softmax),
    ``unsort`` (False: the mask made in sorted order applied to the vocabulary's order,
    "gather": mapped back with the sort's permutation instead of its inverse), ``invert`` (the
    kept and removed tokens swapped), ``fill`` ("-inf", "zero" or a number) and
    ``output`` ("logits", "probs": the renormalized probabilities returned).
    """
    probs = torch.softmax(logits, dim=-1) if mass == "probs" else logits
    if order == "vocab":
        values, index = probs, torch.arange(probs.shape[-1]).expand_as(probs)
    else:
        values, index = probs.sort(dim=-1, descending=order == "desc", stable=True)
    cumulative = values.cumsum(dim=-1)
    if crossing == "kept":
        remove = (cumulative - values) >= p  # the mass before the token already reaches p
    else:
        remove = cumulative > p
    if use_min_keep:
        remove[..., :min_keep] = False
    if unsort == "gather":  # with the order of torch's default (unstable) sort, as students sort
        if order != "vocab":
            index = probs.sort(dim=-1, descending=order == "desc").indices
        remove = remove.gather(-1, index)
    elif unsort:
        remove = remove.scatter(-1, index, remove)
    if invert:
        remove = ~remove
    if output == "probs":
        return torch.softmax(logits.masked_fill(remove, -torch.inf), dim=-1)
    value = {"-inf": -torch.inf, "zero": 0.0}.get(fill, fill) if isinstance(fill, str) else fill
    return logits.masked_fill(remove, float(value))


# --------------------------------------------------------------------------------------------
# The checkers


FILL_FINITE = "the right tokens are removed, but with a large finite value: set them to -inf"


class TopPChecker(Checker):
    """The checker of ``top_p_filter``."""

    name = "check_top_p_filter"
    target = "top_p_filter"
    shape_desc = {"output": "(B, V)"}
    mistakes = (
        Mistake("the cumulative mass is taken in the vocabulary's order, before sorting: sort "
                "the probabilities from the most likely down first, then add them up",
                {"order": "vocab"}),
        Mistake("the probabilities are sorted in ascending order, so the nucleus is made of the "
                "least likely tokens: sort with descending=True", {"order": "asc"}),
        Mistake("the token that crosses p is dropped (`cumulative > p` removes it): keep it, "
                "remove a token only when the mass of the tokens before it already reaches p "
                "(`cumulative - probs >= p`, or shift the mask one place to the right)",
                {"crossing": "dropped"}),
        Mistake("min_tokens_to_keep is ignored: the min_tokens_to_keep most likely tokens are "
                "kept even when fewer already reach p", {"use_min_keep": False}),
        Mistake("the cumulative sum runs over the raw logits: turn them into probabilities with "
                "a softmax first", {"mass": "logits"}),
        Mistake("the mask made in sorted order is applied to the tokens in the vocabulary's "
                "order: map it back with the sort's indices (scatter) before masking",
                {"unsort": False}),
        Mistake("you applied the permutation instead of its inverse: the mask made in sorted "
                "order is mapped back with gather(-1, order); use scatter(-1, order, mask)",
                {"unsort": "gather"}),
        Mistake("kept and removed are swapped: the tokens of the nucleus must keep their logits "
                "and the others get -inf", {"invert": True}),
        Mistake("removed tokens are set to 0: a logit of 0 is still a likely token; set them to "
                "-inf so that their probability is 0", {"fill": "zero"}),
        Mistake("the output holds the renormalized probabilities: return the logits, with "
                "-inf for the removed tokens (the softmax comes later, when sampling)",
                {"output": "probs"}),
    )

    def forward(self, spec: Spec, x: dict[str, torch.Tensor], p: dict[str, torch.Tensor],
                **options: Any) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        top_p, min_keep = float(spec.literals[0]), int(spec.config.get("min_keep", 1))
        if options:
            return {"output": top_p_reference(x["logits"], top_p, min_keep, **options)}, {}
        return {"output": _warper(x["logits"], top_p, min_keep)}, {}

    def extra_variants(self, spec: Spec, raw: dict[str, torch.Tensor]) -> list[Mistake]:
        """The right mask filled with the student's smallest value, when that is finite."""
        got = raw.get("out:output")
        if got is None or got.numel() == 0 or not got.is_floating_point():
            return []
        low = float(got.double().min())
        return [Mistake(FILL_FINITE, {"fill": low})] if math.isfinite(low) and low != 0 else []

    def _judge(self, spec: Spec, raw: dict[str, Any]) -> str | None:
        hint = super()._judge(spec, raw)
        if hint and "input `logits` in place" in hint:
            hint += " (`logits.masked_fill(...)` returns a new tensor; `masked_fill_` does not)"
        return hint

    def localize(self, spec: Spec, tensors: dict[str, torch.Tensor],
                 ref: dict[str, torch.Tensor], name: str) -> str:
        got, want = tensors["out:output"], ref["out:output"]
        kept, right = torch.isfinite(got), torch.isfinite(want)
        if torch.equal(kept, right):
            return ("the right tokens are removed, but the kept ones do not hold their logits "
                    "unchanged")
        counts = f"{int(kept.sum())} tokens kept in all where the reference keeps " \
                 f"{int(right.sum())}"
        return f"{counts}: compare your mask with the rule step by step"


# --------------------------------------------------------------------------------------------
# The cases

MARGIN = 2e-3
"""No cumulative mass of a top-p case lies closer than this to p, in any order a mistake sums."""


def _critical(logits: torch.Tensor) -> list[torch.Tensor]:
    """The cumulative masses (B, V) where a rule compares with p, in the orders that count."""
    probs = torch.softmax(logits.double(), dim=-1)
    out = []
    for values in (probs.sort(-1, descending=True).values, probs.sort(-1).values, probs):
        cumulative = values.cumsum(-1)
        out += [cumulative, cumulative - values]
    return out


def _fair(logits: torch.Tensor, p: float, min_keep: int) -> torch.Tensor:
    """(B,) True for the rows on which no rounding and no order among ties decides a token."""
    ok = torch.ones(logits.shape[0], dtype=torch.bool)
    for c in _critical(logits):  # the whole mass (1) is on the same side of p for every rule
        ok &= (((c - p).abs() >= MARGIN) | ((c - 1).abs() < 1e-9)).all(-1)
    probs = torch.softmax(logits.double(), dim=-1)
    values = probs.sort(-1, descending=True).values
    keep = (values.cumsum(-1) - values) < p
    keep[:, :min_keep] = True
    tied = (values[:, 1:] - values[:, :-1]).abs() < 1e-9
    ok &= ~(tied & (keep[:, 1:] != keep[:, :-1])).any(-1)  # a group of ties kept or dropped whole
    return ok


def _distinct(logits: torch.Tensor, p: float, min_keep: int) -> bool:
    """Whether the single mistakes that change the output of ``logits`` change it each its own
    way, so that the one a submission makes is the one named."""
    x = logits.double()
    right = top_p_reference(x, p, min_keep)
    seen: list[torch.Tensor] = []
    for mistake in TopPChecker.mistakes:
        out = top_p_reference(x, p, min_keep, **mistake.options)
        if allclose(out, right, 1e-4, 1e-4, equal_nan=True):
            continue
        if any(allclose(out, other, 1e-4, 1e-4, equal_nan=True) for other in seen):
            return False
        seen.append(out)
    return True


def _top_p_case(batch: int, vocab: int, p: float, min_keep: int | None = None, *,
                scale: float = 2.0, ties: bool = False, dtype: torch.dtype = torch.float32,
                masked: int = 0) -> Callable[[torch.Generator], Spec]:
    def draw(gen: torch.Generator, n: int) -> torch.Tensor:
        if ties:
            return torch.randint(0, 4, (n, vocab), generator=gen).double()
        rows = scale * torch.randn(n, vocab, generator=gen, dtype=torch.float64)
        for row in rows if masked else ():
            row[torch.randperm(vocab, generator=gen)[:masked]] = -torch.inf
        return rows

    def make(gen: torch.Generator) -> Spec:
        keep = 1 if min_keep is None else min_keep
        for _ in range(100):  # redraw when two mistakes would give the same output
            logits = draw(gen, batch)
            for _ in range(1000):  # redraw the rows where a rounding or a tie could decide
                bad = ~_fair(logits, p, keep)
                if not bad.any():
                    break
                logits[bad] = draw(gen, int(bad.sum()))
            if _distinct(logits.to(dtype), p, keep):
                break
        literals: list[Any] = [p] if min_keep is None else [p, min_keep]
        return Spec("function", {"logits": logits.to(dtype)}, ["logits"], literals=literals,
                    out_dtype=str(dtype), config={"min_keep": keep})
    return make


# Points per case: the one place where this assignment's points are declared.
TOP_P_CHECKER = TopPChecker([
    Case("basic", "logits (4, 20), p = 0.9", _top_p_case(4, 20, 0.9), points=2),
    Case("small_p", "p = 0.3: some rows keep only the most likely token",
         _top_p_case(4, 16, 0.3)),
    Case("min_keep", "p = 0.2, min_tokens_to_keep = 3", _top_p_case(3, 12, 0.2, 3)),
    Case("p_one", "p = 1.0: every token stays", _top_p_case(2, 10, 1.0, scale=1.0)),
    Case("ties", "logits with ties (whole numbers from 0 to 3), p = 0.7",
         _top_p_case(4, 12, 0.7, ties=True)),
    Case("float64", "float64 logits (2, 30), p = 0.8, min_tokens_to_keep = 2",
         _top_p_case(2, 30, 0.8, 2, dtype=torch.float64)),
    Case("batch_one", "a batch of 1 whose logits already hold -inf, p = 0.95",
         _top_p_case(1, 24, 0.95, masked=6)),
])

_FORBIDDEN = (
    ("utils.sampling", "imports utils.sampling, the book's top-p filter"),
    ("utils.lora", "imports utils.lora, the book's LoRA layer"),
    ("utils.finetune", "imports utils.finetune, the book's answer-only loss"),
    ("utils.preference", "imports utils.preference, which holds the book's answer masks"),
    ("transformers", "imports transformers, whose TopPLogitsWarper is the reference top-p "
                     "filter"),
    ("peft", "imports peft, whose LoRA layer is the reference LoRALinear"),
)

ASSIGNMENT = Assignment(
    name="a9_adapting",
    checkers=[TOP_P_CHECKER, LORA_CHECKER, LOSS_CHECKER],
    rules=[
        *(Rule("module", target, reason) for target, reason in _FORBIDDEN),
        Rule("code", __name__, "uses the checker's own reference top-p filter",
             qualname="top_p_reference"),
        Rule("code", answer_only_reference.__module__, "uses the checker's own reference loss",
             qualname="answer_only_reference"),
        Rule("code", lora_reference.__module__, "uses the checker's own reference LoRA layer",
             qualname="lora_reference"),
    ],
)


def check_top_p_filter(fn: Any, verbose: bool = True) -> CheckResult:
    """Check ``fn(logits, p[, min_tokens_to_keep]) -> logits`` with -inf outside the nucleus.

    The checker calls it on (B, V) logits whose cumulative probabilities lie at least 2e-3
    from p in every order and whose ties are never split by the nucleus, and compares with
    `transformers`' ``TopPLogitsWarper``; it also checks that the input is left unchanged.
    """
    return run_in_process(TOP_P_CHECKER, fn, verbose)


