"""Reshaping the next-token distribution before a draw (chapter 18).

A language model gives, at each step, one score (logit) per token of the vocabulary; sampling
draws the next token from softmax(logits). The strategies here change the scores first, each
exactly as the logits processors of Hugging Face's ``transformers`` do (the chapter and
tests/test_sampling.py prove the equality to 1e-6):

* `apply_temperature`: logits / T (``TemperatureLogitsWarper``);
* `top_k_filter`: keep the k highest scores, every token tied with the k-th included
  (``TopKLogitsWarper``);
* `top_p_filter`: keep the smallest set of most likely tokens whose probabilities sum to at
  least p; the token that crosses p is kept (``TopPLogitsWarper``, nucleus sampling);
* `min_p_filter`: keep the tokens at least ``p_base`` times as likely as the most likely one
  (``MinPLogitsWarper``);
* `repetition_penalty`: divide the positive scores of tokens already in the sequence by the
  penalty, multiply their negative scores by it (``RepetitionPenaltyLogitsProcessor``).

A removed token's score becomes -inf: probability 0 after the softmax. Every filter keeps at
least ``min_tokens_to_keep`` tokens (1 by default), so a row never loses all its tokens.

`LogitsChooser` chains them in the order ``transformers`` applies them in ``generate``:
repetition penalty, then temperature, top-k, top-p, min-p. At temperature 0 (greedy) only the
repetition penalty applies: the others never remove the most likely token, so they cannot change
an argmax. `utils.decoding.generate` checks its arguments once and builds one; the filters' own
checks run when they are called by hand.

Shapes: logits (B, V) floating point; previous ids (B, L) integer. Inputs are never modified.
"""

from __future__ import annotations

import torch

from ._validation import (
    require_floating,
    require_int,
    require_integer_ids,
    require_rank,
    require_real,
    require_tensor,
    shape_str,
)

__all__ = [
    "apply_temperature",
    "top_k_filter",
    "top_p_filter",
    "min_p_filter",
    "repetition_penalty",
    "LogitsChooser",
    "logits_chooser",
]

_REMOVED = -float("inf")


# ------------------------------------------------------------------ the arithmetic, unchecked


def _temperature(logits: torch.Tensor, t: float) -> torch.Tensor:
    return logits / t


def _top_k(logits: torch.Tensor, k: int, keep: int = 1) -> torch.Tensor:
    k = min(max(k, keep), logits.shape[-1])
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]  # (B, 1): the k-th highest score
    return logits.masked_fill(logits < kth, _REMOVED)


def _top_p(logits: torch.Tensor, p: float, keep: int = 1) -> torch.Tensor:
    # Ascending order: a token is removed when the mass of it and every less likely token is
    # at most 1 - p, so the rest, the kept tokens, hold at least p (the crossing token kept).
    ascending, order = torch.sort(logits, dim=-1, descending=False)
    mass_below = ascending.softmax(dim=-1).cumsum(dim=-1)
    remove = mass_below <= 1 - p
    remove[..., -keep:] = False  # the `keep` most likely tokens always stay
    return logits.masked_fill(remove.scatter(-1, order, remove), _REMOVED)


def _min_p(logits: torch.Tensor, p_base: float, keep: int = 1) -> torch.Tensor:
    probs = logits.softmax(dim=-1)
    remove = probs < p_base * probs.amax(dim=-1, keepdim=True)
    top = torch.topk(probs, min(keep, probs.shape[-1]), dim=-1).indices
    remove.scatter_(-1, top, False)
    return logits.masked_fill(remove, _REMOVED)


def _repetition(logits: torch.Tensor, previous_ids: torch.Tensor, penalty: float) -> torch.Tensor:
    seen = logits.gather(-1, previous_ids)  # a token seen twice is penalised once
    seen = torch.where(seen < 0, seen * penalty, seen / penalty)
    return logits.scatter(-1, previous_ids, seen)


# ----------------------------------------------------------------- the checked, public filters


def _check_logits(logits: object) -> torch.Tensor:
    require_tensor("logits", logits)
    require_rank("logits", logits, "(B, V)", rank=2)
    require_floating("logits", logits)
    if logits.shape[1] == 0:
        raise ValueError(f"logits must score at least one token (V >= 1), got "
                         f"{shape_str(logits)}")
    return logits


def apply_temperature(logits: torch.Tensor, t: float) -> torch.Tensor:
    """(B, V) logits divided by the temperature ``t``, a finite number > 0: T < 1 sharpens
    softmax(logits / T) towards the argmax, T > 1 flattens it towards uniform."""
    t = require_real("t", t, low=0.0, low_open=True)
    return _temperature(_check_logits(logits), t)


def top_k_filter(logits: torch.Tensor, k: int, min_tokens_to_keep: int = 1) -> torch.Tensor:
    """(B, V) logits with every score below the row's k-th highest set to -inf.

    Tokens tied with the k-th score are all kept (so a row may keep more than k);
    ``k`` larger than V keeps everything; at least ``min_tokens_to_keep`` are kept."""
    k = require_int("k", k)
    keep = require_int("min_tokens_to_keep", min_tokens_to_keep)
    return _top_k(_check_logits(logits), k, keep)


def top_p_filter(logits: torch.Tensor, p: float, min_tokens_to_keep: int = 1) -> torch.Tensor:
    """(B, V) logits with all but the nucleus set to -inf: the smallest set of most likely
    tokens whose probabilities (softmax of the row) sum to at least ``p``, in (0, 1].

    Sorted from most to least likely, the token whose probability makes the running sum reach
    ``p`` is kept, and every token after it removed; ``p = 1`` keeps everything. At least
    ``min_tokens_to_keep`` tokens are kept. Ties in the sort are broken as ``torch.sort`` does."""
    p = require_real("p", p, low=0.0, high=1.0, low_open=True)
    keep = require_int("min_tokens_to_keep", min_tokens_to_keep)
    return _top_p(_check_logits(logits), p, keep)


def min_p_filter(logits: torch.Tensor, p_base: float, min_tokens_to_keep: int = 1
                 ) -> torch.Tensor:
    """(B, V) logits with every token whose probability is below ``p_base`` times the row's
    highest probability set to -inf; ``p_base`` in [0, 1]. The threshold follows the model's
    confidence: strict when one token dominates, loose when many are close."""
    p_base = require_real("p_base", p_base, low=0.0, high=1.0)
    keep = require_int("min_tokens_to_keep", min_tokens_to_keep)
    return _min_p(_check_logits(logits), p_base, keep)


def repetition_penalty(logits: torch.Tensor, previous_ids: torch.Tensor, penalty: float
                       ) -> torch.Tensor:
    """(B, V) logits with the score s of every token in row b of ``previous_ids`` (B, L)
    replaced by s / penalty if s > 0, s * penalty if s < 0 (CTRL's penalty): a penalty > 1
    makes every token already present less likely, whatever the sign of its score. A token
    present several times is penalised once. ``penalty`` a finite number > 0."""
    logits = _check_logits(logits)
    require_tensor("previous_ids", previous_ids)
    require_rank("previous_ids", previous_ids, "(B, L)", rank=2)
    require_integer_ids("previous_ids", previous_ids, vocab_size=logits.shape[1])
    if previous_ids.shape[0] != logits.shape[0]:
        raise ValueError(f"previous_ids must have one row per row of logits, "
                         f"{logits.shape[0]}, got {shape_str(previous_ids)}")
    penalty = require_real("penalty", penalty, low=0.0, low_open=True)
    return _repetition(logits, previous_ids, penalty)


# ------------------------------------------------------------------------- the chain of them


class LogitsChooser:
    """The filters of one decoding run, checked once, applied in ``transformers``' order.

    ``chooser(logits, previous_ids)`` -> the (B, V) scores to draw from: softmax of them is
    the filtered distribution (temperature included), or their argmax when
    ``temperature == 0``. ``previous_ids`` (B, L) is only read with a repetition penalty.
    """

    def __init__(self, temperature: float, top_k: int | None, top_p: float | None,
                 min_p: float | None, penalty: float | None, min_tokens_to_keep: int = 1):
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.min_p, self.penalty, self.keep = min_p, penalty, min_tokens_to_keep

    @property
    def plain(self) -> bool:
        """Whether nothing but the temperature changes the logits: then a plain draw from
        softmax(logits / T) (or the argmax) is the same distribution."""
        return self.penalty is None and (self.temperature == 0 or
                                         (self.top_k, self.top_p, self.min_p) == (None,) * 3)

    @property
    def needs_previous(self) -> bool:
        """Whether the chain reads the previous ids (a repetition penalty)."""
        return self.penalty is not None

    def __call__(self, logits: torch.Tensor, previous_ids: torch.Tensor | None = None
                 ) -> torch.Tensor:
        if self.penalty is not None:
            logits = _repetition(logits, previous_ids, self.penalty)
        if self.temperature == 0:  # greedy: the warpers below never remove the argmax
            return logits
        if self.temperature != 1:
            logits = _temperature(logits, self.temperature)
        if self.top_k is not None:
            logits = _top_k(logits, self.top_k, self.keep)
        if self.top_p is not None:
            logits = _top_p(logits, self.top_p, self.keep)
        if self.min_p is not None:
            logits = _min_p(logits, self.min_p, self.keep)
        return logits


def logits_chooser(temperature: float = 1.0, top_k: int | None = None,
                   top_p: float | None = None, min_p: float | None = None,
                   repetition_penalty: float | None = None,
                   min_tokens_to_keep: int = 1) -> LogitsChooser:
    """A `LogitsChooser` of these settings, each checked (``.plain`` when nothing but the
    temperature changes the logits).

    Args:
        temperature: 0 (greedy) or a finite T > 0.
        top_k: None (off) or an int >= 1.
        top_p: None or 1.0 (off), or a number in (0, 1].
        min_p: None (off) or a number in [0, 1].
        repetition_penalty: None or 1.0 (off), or a finite number > 0.
        min_tokens_to_keep: the fewest tokens each filter keeps, an int >= 1.
    """
    temperature = require_real("temperature", temperature, low=0.0)
    if top_k is not None:
        top_k = require_int("top_k", top_k)
    if top_p is not None:
        top_p = require_real("top_p", top_p, low=0.0, high=1.0, low_open=True)
        top_p = None if top_p == 1 else top_p
    if min_p is not None:
        min_p = require_real("min_p", min_p, low=0.0, high=1.0)
    if repetition_penalty is not None:
        repetition_penalty = require_real("repetition_penalty", repetition_penalty, low=0.0,
                                          low_open=True)
        repetition_penalty = None if repetition_penalty == 1 else repetition_penalty
    keep = require_int("min_tokens_to_keep", min_tokens_to_keep)
    return LogitsChooser(temperature, top_k, top_p, min_p, repetition_penalty, keep)
