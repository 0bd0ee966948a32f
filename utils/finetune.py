"""Adapting a pretrained decoder to a task (chapter 19).

* `answer_only_targets` and `answer_only_loss`: instruction tuning's loss. A training example is a
  prompt followed by its answer in one sequence; the model is scored only on predicting the
  answer's tokens, never the prompt's (which it is given) or the padding.
* `pack_examples`: prompts and answers (lists of ids) -> one right-padded batch, with the prompt
  lengths and the total lengths that the loss needs.
* `SequenceClassifier`: a classification head on a pretrained `utils.models.DecoderOnlyLM` body,
  reading the hidden state at each row's last real token (or their mean).

The targets follow the usual convention of causal language models: position t's logits score
token t + 1, so the prediction of the first answer token, at index ``prompt_len``, is made at
position ``prompt_len - 1`` (the last prompt token), and that position is kept. Dropping it, or
keeping position ``prompt_len - 2`` (which predicts the last prompt token), is the classic
off-by-one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ._validation import (
    InputTypeError,
    require_choice,
    require_int,
    require_integer_ids,
    require_rank,
    require_tensor,
    shape_str,
    type_name,
)
from .masks import causal_mask
from .models import DecoderOnlyLM

__all__ = ["answer_only_targets", "answer_only_loss", "pack_examples", "SequenceClassifier",
           "IGNORE_INDEX"]

IGNORE_INDEX = -100  # the ignore_index of torch.nn.functional.cross_entropy


def _lengths(name: str, values: object, b: int, low: int, high: int, low_text: str,
             high_text: str) -> torch.Tensor:
    """``values``: an int (B,) tensor (or a list of ints) with every entry in [low, high]."""
    if isinstance(values, (list, tuple)):
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            raise InputTypeError(f"{name} must be a list of ints or an int (B,) tensor")
        values = torch.tensor(values, dtype=torch.long)
    require_tensor(name, values)
    require_integer_ids(name, values)
    if tuple(values.shape) != (b,):
        raise ValueError(f"{name} must have shape (B,) = ({b},), got {shape_str(values)}")
    if b and (int(values.min()) < low or int(values.max()) > high):
        raise ValueError(f"{name} must lie in [{low_text}, {high_text}], got values from "
                         f"{int(values.min())} to {int(values.max())}")
    return values.long()


def answer_only_targets(tokens: torch.Tensor, prompt_lengths: torch.Tensor | Sequence[int],
                        lengths: torch.Tensor | Sequence[int] | None = None,
                        ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """The next-token targets of prompt + answer sequences, with only the answer scored.

    Target t is ``tokens[:, t + 1]``, the token that position t predicts. It is set to
    ``ignore_index`` where that token belongs to the prompt (t + 1 < prompt_len) or is padding
    (t + 1 >= length). The first answer token, predicted at position prompt_len - 1, is kept.

    Args:
        tokens: (B, L) integer ids, each row a prompt, its answer, then padding; L >= 2.
        prompt_lengths: (B,) ints, each in [1, length - 1] (at least one prompt token, which
            the first answer token is predicted from, and at least one answer token).
        lengths: (B,) ints in [2, L], the real tokens of each row (default: L for every row).
        ignore_index: the value of an unscored target (torch's -100 by default).

    Returns:
        (B, L - 1) long targets, on ``tokens``' device.
    """
    require_tensor("tokens", tokens)
    require_rank("tokens", tokens, "(B, L)", rank=2)
    require_integer_ids("tokens", tokens)
    b, length = tokens.shape
    if length < 2:
        raise ValueError(f"tokens must have at least 2 positions (a prompt token and an answer "
                         f"token), got {shape_str(tokens)}")
    ignore_index = require_int("ignore_index", ignore_index, minimum=-(2**62))
    lengths = (torch.full((b,), length, dtype=torch.long) if lengths is None
               else _lengths("lengths", lengths, b, 2, length, "2", f"L={length}"))
    prompt_lengths = _lengths("prompt_lengths", prompt_lengths, b, 1, length - 1, "1",
                              f"L - 1={length - 1}")
    if bool((prompt_lengths >= lengths).any()):
        row = int((prompt_lengths >= lengths).nonzero()[0, 0])
        raise ValueError(f"every row needs an answer token: row {row} has prompt_length "
                         f"{int(prompt_lengths[row])} and length {int(lengths[row])}")
    device = tokens.device
    predicted = torch.arange(1, length, device=device)[None, :]  # index of the token predicted
    keep = ((predicted >= prompt_lengths.to(device)[:, None])
            & (predicted < lengths.to(device)[:, None]))
    targets = tokens[:, 1:].long()
    return targets.masked_fill(~keep, ignore_index)


def answer_only_loss(logits: torch.Tensor, tokens: torch.Tensor,
                     prompt_lengths: torch.Tensor | Sequence[int],
                     lengths: torch.Tensor | Sequence[int] | None = None) -> torch.Tensor:
    """Mean cross-entropy of the answer tokens only.

    Args:
        logits: (B, L, V) as the model returns them for ``tokens`` (the last position, which
            predicts nothing, is dropped), or (B, L - 1, V) already without it.
        tokens, prompt_lengths, lengths: as in `answer_only_targets`.

    Returns:
        A scalar: F.cross_entropy over the (B, L - 1) positions with ignore_index at every
        position that does not predict an answer token.
    """
    require_tensor("logits", logits)
    require_rank("logits", logits, "(B, L, V)", rank=3)
    if not logits.is_floating_point():
        raise InputTypeError(f"logits must be floating point, got dtype {logits.dtype}")
    targets = answer_only_targets(tokens, prompt_lengths, lengths)
    b, length = tokens.shape
    if logits.shape[:2] == (b, length):
        logits = logits[:, :-1]
    elif logits.shape[:2] != (b, length - 1):
        raise ValueError(f"logits must have shape (B, L, V) = ({b}, {length}, V) or "
                         f"(B, L - 1, V) for tokens {shape_str(tokens)}, got {shape_str(logits)}")
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1).to(
        logits.device), ignore_index=IGNORE_INDEX)


def pack_examples(prompts: Sequence[Sequence[int]], answers: Sequence[Sequence[int]],
                  pad: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prompts and answers -> (tokens (B, L), prompt_lengths (B,), lengths (B,)).

    Row b is ``prompts[b] + answers[b]``, right-padded with ``pad`` to the longest row.
    """
    for name, seqs in (("prompts", prompts), ("answers", answers)):
        if not isinstance(seqs, (list, tuple)) or not all(isinstance(s, (list, tuple))
                                                         for s in seqs):
            raise InputTypeError(f"{name} must be a list of lists of ids, got {type_name(seqs)}")
        if any(len(s) == 0 for s in seqs):
            raise ValueError(f"every one of the {name} needs at least one token")
    if len(prompts) != len(answers) or not prompts:
        raise ValueError(f"need as many answers as prompts, at least one; got {len(prompts)} "
                         f"prompts and {len(answers)} answers")
    rows = [list(p) + list(a) for p, a in zip(prompts, answers, strict=True)]
    lengths = torch.tensor([len(r) for r in rows])
    tokens = torch.full((len(rows), int(lengths.max())), pad, dtype=torch.long)
    for i, row in enumerate(rows):
        tokens[i, : len(row)] = torch.tensor(row)
    return tokens, torch.tensor([len(p) for p in prompts]), lengths


class SequenceClassifier(nn.Module):
    """A pretrained (or fresh) `DecoderOnlyLM` body with a new linear head on one vector per row.

    The body's embeddings and layers (final LayerNorm included) give hidden states (B, L, d);
    its language-model output layer is not used. ``pool="last"`` reads each row's last real
    token, position length - 1: under the causal mask it is the only position that has read the
    whole text, and it never sees the right padding, so no padding mask is needed.
    ``pool="mean"`` averages the real positions.

    Args:
        body: a `utils.models.DecoderOnlyLM` (its parameters are trained with the head).
        num_classes: C, an int >= 2.
        pool: ``"last"`` or ``"mean"``.

    Shapes:
        tokens (B, L), lengths (B,) (default: L) -> logits (B, C).
    """

    def __init__(self, body: DecoderOnlyLM, num_classes: int, pool: str = "last"):
        super().__init__()
        if not isinstance(body, DecoderOnlyLM):
            raise InputTypeError(f"body must be a DecoderOnlyLM, got {type_name(body)}")
        self.num_classes = require_int("num_classes", num_classes, minimum=2)
        self.pool = require_choice("pool", pool, ("last", "mean"))
        self.body = body
        self.head = nn.Linear(body.d_model, self.num_classes)

    def hidden(self, tokens: torch.Tensor) -> torch.Tensor:
        """The body's hidden states (B, L, d_model), after its final LayerNorm."""
        attn = causal_mask(tokens.shape[1], device=tokens.device)[None]
        return self.body.blocks(self.body.embed(tokens), attn)

    def pooled(self, tokens: torch.Tensor,
               lengths: torch.Tensor | Sequence[int] | None = None) -> torch.Tensor:
        """One vector per row (B, d_model): the hidden state at position length - 1, or the
        mean over the real positions."""
        require_tensor("tokens", tokens)
        require_rank("tokens", tokens, "(B, L)", rank=2)
        b, length = tokens.shape
        if length == 0:
            raise ValueError(f"tokens must have at least one position, got {shape_str(tokens)}")
        lengths = (torch.full((b,), length, dtype=torch.long) if lengths is None
                   else _lengths("lengths", lengths, b, 1, length, "1", f"L={length}"))
        lengths = lengths.to(tokens.device)
        h = self.hidden(tokens)
        if self.pool == "last":
            return h[torch.arange(b, device=tokens.device), lengths - 1]
        real = torch.arange(length, device=tokens.device)[None, :] < lengths[:, None]
        return (h * real[..., None]).sum(dim=1) / lengths[:, None].to(h.dtype)

    def forward(self, tokens: torch.Tensor,
                lengths: torch.Tensor | Sequence[int] | None = None) -> torch.Tensor:
        """Class logits (B, C)."""
        return self.head(self.pooled(tokens, lengths))
