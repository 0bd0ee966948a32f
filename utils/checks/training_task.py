"""Assignment 8's task and the scripted model of its decoding cases, for both of its sides.

The student side (`training_runner`, in the grader's child) and the trusted side (`a8_train`,
`a8_judges`, in the grader) share these: the reversal task `TASK_ARGS` and its vocabulary size
`VOCAB`, the `Submission` a notebook hands to `check_training`, and `ScriptedModel`, a stand-in
for a trained model whose greedy tokens (`scripted_next`) the judge knows in advance. Tokens are
(B, L) int64 ids; logits are (B, L_t, VOCAB). Nothing here computes an expected value of the
student's own code, so the child may hold it. (It is not named ``aN_*``: the policy takes those
for references, and reports a child that opens one.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..data import EOS
from ..tasks import ReversalTask

TASK_ARGS = {"min_len": 3, "max_len": 8, "num_symbols": 8}
"""The task of assignment 8: ``ReversalTask(**TASK_ARGS)`` (the notebook's ``TASK``)."""
VOCAB = len(ReversalTask(**TASK_ARGS).vocab)  # 11: three specials and eight symbols


@dataclass
class Submission:
    """The four functions of a submission, as `check_training` receives them in a notebook."""

    build_model: Any
    train_step: Any
    greedy_decode: Any
    train: Any


# --------------------------------------------------------------------------------------------
# The scripted model of the decoding cases: its greedy tokens are known in advance


def scripted_next(src: torch.Tensor, src_mask: torch.Tensor | None, prev: torch.Tensor,
                  t: int, training: bool) -> torch.Tensor:
    """The scripted model's next token after ``prev`` (B,) at decoder position ``t``.

    A row's "key" sums its source tokens, weighted by position, over the positions its mask
    keeps (all of them without a mask, padding included, so a missing mask changes the key).
    Row b says ``<eos>`` at position ``src[b, 0] - 3``; training mode (dropout on) shifts every
    other token by one.
    """
    keep = torch.ones_like(src, dtype=torch.bool) if src_mask is None else src_mask
    pos = torch.arange(1, src.shape[1] + 1)
    key = ((src + 1) * pos * keep).sum(dim=1)
    tok = 3 + (key * 7 + prev * 5 + 3 * t + int(training)) % (VOCAB - 3)
    return torch.where(src[:, 0] - 3 == t, torch.full_like(tok, EOS), tok)


def _as_mask(mask: Any, shape: tuple[int, ...]) -> torch.Tensor | None:
    """A student's source mask as (B, L_s) bool, or None when it is not one."""
    if not isinstance(mask, torch.Tensor) or mask.numel() != math.prod(shape):
        return None
    return mask.reshape(shape).bool()


class ScriptedModel(nn.Module):
    """A stand-in for a trained model: ``model(src, tgt, src_mask, tgt_mask)`` -> logits whose
    argmax at position t is `scripted_next` of ``tgt[:, t]``. It records each call: training
    mode, whether a source mask came, grad mode and the decoder input's length."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))
        self.log: list[list[int]] = []

    def forward(self, src: torch.Tensor, tgt: torch.Tensor, src_mask: Any = None,
                tgt_mask: Any = None, memory_mask: Any = None) -> torch.Tensor:
        mask = _as_mask(src_mask, tuple(src.shape))
        self.log.append([int(self.training), int(mask is not None), int(torch.is_grad_enabled()),
                         int(tgt.shape[1])])
        b, length = tgt.shape
        logits = torch.zeros(b, length, VOCAB)
        for t in range(length):
            nxt = scripted_next(src, mask, tgt[:, t].long(), t, self.training)
            logits[torch.arange(b), t, nxt] = 4.0
            logits[torch.arange(b), t, (nxt + 1) % VOCAB] += 1.0
        return logits * self.scale
