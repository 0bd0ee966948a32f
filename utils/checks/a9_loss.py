"""Assignment 9's answer-only loss: its reference, its named mistakes and its cases.

``answer_only_loss(logits, tokens, prompt_lengths, lengths=None)`` is the mean next-token
cross-entropy over the answer tokens only. The reference builds the targets itself
(``tokens[:, 1:]``, -100 wherever the predicted token is a prompt token or padding) and calls
``F.cross_entropy(..., ignore_index=-100)``. A mistake is named from the loss and the gradient
of the logits together.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from .checker import Case, Checker, Mistake, run_in_process
from .compare import ATOL, GRAD_ATOL, GRAD_RTOL, RTOL, allclose
from .core import Spec
from .results import CheckResult

__all__ = ["LOSS_CHECKER", "check_answer_only_loss", "answer_only_reference"]


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
    "sum", "all": divided by every position, "batch": divided by the batch size, "sequence": a
    mean per sequence, then over the batch); ``shift`` False (position t scored on token t);
    ``log_softmax`` False (the negative logit of the target, without the softmax).
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
    if reduce == "batch":
        return losses.sum() / b
    return (losses.sum(dim=1) / keep.sum(dim=1)).mean()


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
        Mistake("the summed loss is divided by the batch size: divide it by the number of "
                "answer tokens of the batch", {"reduce": "batch"}),
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

    def _judge_output(self, spec: Spec, raw: dict[str, Any], ref: dict[str, torch.Tensor],
                      name: str) -> str | None:
        """A mistake is named when the loss and the gradient of the logits both match it (the
        loss alone, one number, can match two mistakes, or even the reference, by chance);
        the loss alone names one only when no mistake matches both."""
        got, grad = raw["tensors"].get(f"out:{name}"), raw["tensors"].get("grad:logits")
        want, want_grad = ref[f"out:{name}"], ref.get("grad:logits")
        if got is None or grad is None or want_grad is None or got.shape != want.shape or \
                grad.shape != want_grad.shape or not torch.isfinite(grad).all() or (
                    allclose(got, want, ATOL, RTOL)
                    and allclose(grad, want_grad, GRAD_ATOL, GRAD_RTOL)):
            return super()._judge_output(spec, raw, ref, name)
        for m in self.all_mistakes():
            try:
                cand = self.evaluate(spec, **m.options)
            except Exception:  # a variant that cannot run on this case cannot match
                continue
            if allclose(got, cand[f"out:{name}"], ATOL, RTOL) and "grad:logits" in cand and \
                    allclose(grad, cand["grad:logits"], GRAD_ATOL, GRAD_RTOL):
                return m.hint
        return super()._judge_output(spec, raw, ref, name)

    def _judge(self, spec: Spec, raw: dict[str, Any]) -> str | None:
        hint = super()._judge(spec, raw)
        if hint and "input `tokens` in place" in hint:
            hint += " (`tokens[:, 1:]` is a view of tokens: clone it before writing -100)"
        return hint

    def localize(self, spec: Spec, tensors: dict[str, torch.Tensor],
                 ref: dict[str, torch.Tensor], name: str) -> str:
        return ("compare the positions you keep with the rule: position j predicts token "
                "j + 1 and counts when prompt_len - 1 <= j < length - 1")


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


# Points per case: the one place where this part's points are declared.
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


def check_answer_only_loss(fn: Any, verbose: bool = True) -> CheckResult:
    """Check ``fn(logits, tokens, prompt_lengths, lengths=None) -> ()`` loss and its gradient.

    Compared with ``F.cross_entropy(ignore_index=-100)`` on targets the checker builds itself.
    """
    return run_in_process(LOSS_CHECKER, fn, verbose)
