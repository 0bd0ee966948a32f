"""Assignment 9: adapting a model, the top-p filter, a LoRA layer and the answer-only loss.

The student writes

* ``top_p_filter(logits, p, min_tokens_to_keep=1)``: (B, V) logits in, the same logits out with
  every token outside the nucleus set to -inf. The nucleus is the smallest set of most likely
  tokens whose probabilities add up to p or more (the token that crosses p is kept), and never
  fewer than ``min_tokens_to_keep`` tokens: the semantics of `transformers`' ``TopPLogitsWarper``,
  which is the reference when no mistake is reproduced;
* ``LoRALinear(base, r, alpha)`` (its checker is `a9_lora`);
* ``answer_only_loss(logits, tokens, prompt_lengths, lengths=None)``: the mean next-token
  cross-entropy over the answer tokens only. The reference builds the targets itself
  (``tokens[:, 1:]``, -100 wherever the predicted token is a prompt token or padding) and calls
  ``F.cross_entropy(..., ignore_index=-100)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from .a9_lora import LORA_CHECKER, check_lora_linear, lora_reference
from .checker import Case, Checker, Mistake, run_in_process
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
                    unsort: bool = True, invert: bool = False, fill: str = "-inf",
                    output: str = "logits") -> torch.Tensor:
    """The nucleus filter of (B, V) ``logits``, written with the most likely token first.

    A token is removed when the probability of the tokens before it (in descending order)
    already reaches p; the first ``min_keep`` are always kept. Switches reproduce mistakes:
    ``order`` ("desc", "asc": the least likely first, "vocab": the cumulative mass taken in the
    vocabulary's order, before sorting), ``crossing`` ("kept", "dropped": the token whose
    probability crosses p removed), ``use_min_keep``, ``mass`` ("probs", "logits": no softmax),
    ``unsort`` (False: the mask made in sorted order applied to the vocabulary's order),
    ``invert`` (the kept and removed tokens swapped), ``fill`` ("-inf", "zero") and
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
    if unsort:
        remove = remove.scatter(-1, index, remove)
    if invert:
        remove = ~remove
    if output == "probs":
        return torch.softmax(logits.masked_fill(remove, -torch.inf), dim=-1)
    return logits.masked_fill(remove, -torch.inf if fill == "-inf" else 0.0)


def answer_only_reference(logits: torch.Tensor, tokens: torch.Tensor,
                          prompt_lengths: torch.Tensor, lengths: torch.Tensor | None = None, *,
                          start: int = -1, end: int = -1, reduce: str = "mean",
                          shift: bool = True, log_softmax: bool = True) -> torch.Tensor:
    """The mean cross-entropy of the answer tokens, from targets built here.

    Position j predicts token j + 1; it counts when ``prompt_len + start <= j < length + end``
    (``start`` = -1: the last prompt token predicts the first answer token; ``end`` = -1: the
    last real token predicts nothing). Switches reproduce mistakes: ``start`` 0 (the first
    answer token dropped), -2 (the last prompt token kept), None (the prompt counted); ``end``
    0 (the first padding token predicted), None (the padding counted); ``reduce`` ("mean",
    "sum", "all": divided by every position, "sequence": a mean per sequence, then over the
    batch); ``shift`` False (position t scored on token t); ``log_softmax`` False (the
    negative logit of the target, without the softmax).
    """
    b, length, vocab = logits.shape
    full = torch.full((b,), length, dtype=torch.long)
    lengths = full if lengths is None else lengths.long()
    if shift:
        scores, targets, pos = logits[:, :-1], tokens[:, 1:].clone(), torch.arange(length - 1)
    else:
        scores, targets, pos = logits, tokens.clone(), torch.arange(length) - 1
    first = torch.zeros_like(full) if start is None else prompt_lengths.long() + start
    last = full if end is None else lengths + end
    keep = (pos[None, :] >= first[:, None]) & (pos[None, :] < last[:, None])
    targets = targets.masked_fill(~keep, -100)
    flat = scores.reshape(-1, vocab)
    if log_softmax:
        losses = F.cross_entropy(flat, targets.reshape(-1), ignore_index=-100, reduction="none")
    else:
        losses = F.nll_loss(flat, targets.reshape(-1), ignore_index=-100, reduction="none")
    losses = losses.reshape(targets.shape)
    if reduce == "mean":
        return losses.sum() / keep.sum()
    if reduce == "sum":
        return losses.sum()
    if reduce == "all":
        return losses.sum() / keep.numel()
    return (losses.sum(dim=1) / keep.sum(dim=1)).mean()


# --------------------------------------------------------------------------------------------
# The checkers


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


class LossChecker(Checker):
    """The checker of ``answer_only_loss``."""

    name = "check_answer_only_loss"
    target = "answer_only_loss"
    shape_desc = {"loss": "()"}
    mistakes = (
        Mistake("the first answer token is left out of the loss: it is predicted at position "
                "prompt_len - 1 (the last prompt token), whose target is kept", {"start": 0}),
        Mistake("the prediction made at position prompt_len - 2 (of the last prompt token) "
                "counts: only the predictions of answer tokens count, from position "
                "prompt_len - 1 on", {"start": -2}),
        Mistake("the prompt tokens are left in the loss: set the targets of every position "
                "before prompt_len - 1 to -100", {"start": None}),
        Mistake("the padding counts in the loss: positions from length - 1 on predict padding; "
                "set their targets to -100", {"end": None}),
        Mistake("the prediction made at the last real token (of the first padding token) "
                "counts: the last real token predicts nothing, keep positions below length - 1",
                {"end": 0}),
        Mistake("the loss is summed over the answer tokens: take the mean over them (over every "
                "answer token of the batch)", {"reduce": "sum"}),
        Mistake("the masked sum is divided by every position, prompt and padding included: "
                "divide by the number of answer tokens", {"reduce": "all"}),
        Mistake("the loss is a mean per sequence, then a mean over the batch: take one mean "
                "over every answer token of the batch, so that a longer answer weighs more",
                {"reduce": "sequence"}),
        Mistake("the targets are not shifted: position t predicts token t + 1, so compare "
                "logits[:, :-1] with tokens[:, 1:]", {"shift": False}),
        Mistake("the log-softmax is missing (nll_loss on raw logits): use F.cross_entropy, "
                "which applies it", {"log_softmax": False}),
    )

    def forward(self, spec: Spec, x: dict[str, torch.Tensor], p: dict[str, torch.Tensor],
                **options: Any) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        loss = answer_only_reference(x["logits"], x["tokens"], x["prompt_lengths"],
                                     x.get("lengths"), **options)
        return {"loss": loss}, {}

    def _judge(self, spec: Spec, raw: dict[str, Any]) -> str | None:
        hint = super()._judge(spec, raw)
        if hint and "input `tokens` in place" in hint:
            hint += " (`tokens[:, 1:]` is a view of tokens: clone it before writing -100)"
        return hint

    def localize(self, spec: Spec, tensors: dict[str, torch.Tensor],
                 ref: dict[str, torch.Tensor], name: str) -> str:
        return ("compare the positions you keep with the rule: position j predicts token "
                "j + 1 and counts when prompt_len - 1 <= j < length - 1")


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
        logits = draw(gen, batch)
        for _ in range(1000):  # redraw the rows where a rounding or a tie could decide
            bad = ~_fair(logits, p, keep)
            if not bad.any():
                break
            logits[bad] = draw(gen, int(bad.sum()))
        literals: list[Any] = [p] if min_keep is None else [p, min_keep]
        return Spec("function", {"logits": logits.to(dtype)}, ["logits"], literals=literals,
                    out_dtype=str(dtype), config={"min_keep": keep})
    return make


def _loss_case(prompts: list[int], lengths: list[int] | None, length: int, vocab: int = 11,
               dtype: torch.dtype = torch.float32) -> Callable[[torch.Generator], Spec]:
    def make(gen: torch.Generator) -> Spec:
        b = len(prompts)
        tensors = {"logits": 2.0 * torch.randn(b, length, vocab, generator=gen).to(dtype),
                   "tokens": torch.randint(0, vocab, (b, length), generator=gen),
                   "prompt_lengths": torch.tensor(prompts)}
        kwargs = {}
        if lengths is not None:
            tensors["lengths"] = torch.tensor(lengths)
            kwargs = {"lengths": "lengths"}
        return Spec("function", tensors, ["logits", "tokens", "prompt_lengths"], kwargs=kwargs,
                    outputs=["loss"], out_dtype=str(dtype),
                    grad_out={"loss": torch.randn((), generator=gen).to(dtype)},
                    grad_inputs=["logits"])
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

LOSS_CHECKER = LossChecker([
    Case("padded", "3 sequences of length 10 with padding, prompts of 2 to 4 tokens",
         _loss_case([3, 2, 4], [9, 6, 10], 10), points=2),
    Case("no_lengths", "lengths=None: no padding, 2 sequences of length 8",
         _loss_case([2, 5], None, 8)),
    Case("prompt_one", "a prompt of 1 token (the first prediction counts) and padding",
         _loss_case([1, 3], [7, 5], 8)),
    Case("one_answer", "answers of 1 and 2 tokens, float64 logits",
         _loss_case([4, 3, 2], [5, 5, 9], 9, dtype=torch.float64)),
    Case("batch_one", "a batch of 1 without padding", _loss_case([3], [8], 8)),
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
        Rule("code", __name__, "uses the checker's own reference loss",
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


def check_answer_only_loss(fn: Any, verbose: bool = True) -> CheckResult:
    """Check ``fn(logits, tokens, prompt_lengths, lengths=None) -> ()`` loss and its gradient.

    Compared with ``F.cross_entropy(ignore_index=-100)`` on targets the checker builds itself.
    """
    return run_in_process(LOSS_CHECKER, fn, verbose)
