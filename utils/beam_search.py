"""Beam search with a length penalty, scored as ``transformers`` scores it (chapter 18).

Greedy decoding keeps one sequence and takes the most likely token at each step; a token that
looks best now can lead to a poor sequence. Beam search keeps the ``num_beams`` best partial
sequences (beams), scored by the sum of their tokens' log-probabilities, and at each step
extends every beam by every token and keeps the best ``num_beams`` of all the extensions.

A beam that ends (its new token is ``eos``, or it reaches ``max_new_tokens``) leaves the search
and becomes a finished hypothesis, scored with the **length penalty**

    score = (sum of its log-probabilities) / (new tokens, eos included) ** length_penalty.

Log-probabilities are negative, so a longer sequence has a lower sum: ``length_penalty`` > 0
divides by a growing length and favours longer sequences, 0 compares plain sums, < 0 favours
shorter ones. The best ``num_beams`` finished hypotheses are kept.

This module follows ``transformers`` 5's ``GenerationMixin._beam_search`` step for step, so that
the sequences and scores are the same as its ``generate(num_beams=..., length_penalty=...,
early_stopping=...)`` with ``output_scores=True`` (its ``sequences_scores``):

* each step takes the best 2 x ``num_beams`` extensions, so that ``num_beams`` of them are still
  running even if the best ones all end; at the first step only the first beam is extended
  (the others start at -1e9: they are copies of the same prompt);
* an extension that ends becomes a finished candidate only if it is among the best
  ``num_beams`` extensions of its step; finished candidates and the kept hypotheses are merged,
  best ``num_beams`` first;
* the search stops when no running beam can beat the worst kept hypothesis, estimated with the
  current length (``early_stopping=False``; with ``"never"`` and a positive penalty, with the
  longest possible length), or, with ``early_stopping=True``, as soon as ``num_beams``
  hypotheses are finished, or when every extension ends.

Each step recomputes the model on every beam's whole prefix (no key/value cache: the beams are
reordered at every step), which is plenty for the small models of the book.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import nn

from ._validation import InputTypeError, eval_mode, require_int, require_real, type_name
from .data import EOS
from .decoding_steps import check_model, check_room, prompt_batch

__all__ = ["BeamSearchOutput", "beam_search"]

_NEG = -1.0e9  # the score that rules a beam out, as transformers writes it


class BeamSearchOutput(NamedTuple):
    """``sequences``: ``num_beams`` lists of new token ids, best first, each ending with ``eos``
    if the hypothesis ended with it; ``scores``: (num_beams,) float32, their length-penalised
    scores, descending."""

    sequences: list[list[int]]
    scores: torch.Tensor


def _check(num_beams: object, max_new_tokens: object, length_penalty: object, eos: object,
           early_stopping: object) -> tuple[int, int, float, int | None]:
    num_beams = require_int("num_beams", num_beams)
    max_new_tokens = require_int("max_new_tokens", max_new_tokens)
    length_penalty = require_real("length_penalty", length_penalty)
    if eos is not None:
        eos = require_int("eos", eos, minimum=0)
    if not (isinstance(early_stopping, bool) or early_stopping == "never"):
        raise InputTypeError(f"early_stopping must be True, False or 'never', got "
                             f"{early_stopping!r} ({type_name(early_stopping)})")
    return num_beams, max_new_tokens, length_penalty, eos


def beam_search(model: nn.Module, prompt: Sequence[int], num_beams: int, max_new_tokens: int,
                length_penalty: float = 1.0, eos: int | None = EOS,
                early_stopping: bool | str = False) -> BeamSearchOutput:
    """The ``num_beams`` best continuations of one prompt by beam search (module docstring).

    Args:
        model: an ``nn.Module``, ``model(tokens)`` (B, L) -> (B, L, V) logits, causal.
        prompt: a non-empty list (or 1-dim tensor) of token ids >= 0.
        num_beams: the beams kept at each step, and the hypotheses returned; an int >= 1.
        max_new_tokens: the most tokens a hypothesis adds, eos included; an int >= 1. With a
            model that has ``max_len``, the prompt plus ``max_new_tokens - 1`` must fit in it.
        length_penalty: the exponent of the length that divides a finished hypothesis's
            summed log-probability; a finite number (> 0 favours longer hypotheses).
        eos: the end token (an int >= 0), or None: hypotheses end only at ``max_new_tokens``.
        early_stopping: False (stop when no running beam can improve, judged at the current
            length), True (stop as soon as ``num_beams`` hypotheses are finished) or "never"
            (judged at the longest length when ``length_penalty`` > 0).

    Returns:
        `BeamSearchOutput`: the hypotheses, best first, and their scores.
    """
    check_model(model, "forward(tokens)")
    batch = prompt_batch([prompt])
    nb, max_new, lp, eos = _check(num_beams, max_new_tokens, length_penalty, eos,
                                  early_stopping)
    p = batch[0].shape[1]
    check_room(model, p + max_new - 1, f"a prompt of {p} tokens and max_new_tokens={max_new}")
    device = next(iter(model.parameters()), torch.empty(0)).device
    max_length, k2 = p + max_new, 2 * nb
    running = torch.full((nb, max_length), 0 if eos is None else eos, dtype=torch.long,
                         device=device)
    running[:, :p] = batch[0].to(device)
    running_scores = torch.zeros(nb, device=device)
    running_scores[1:] = _NEG  # copies of one prompt: extend the first only
    done, done_scores = running.clone(), torch.full((nb,), _NEG, device=device)
    done_flag = torch.zeros(nb, dtype=torch.bool, device=device)
    done_len = torch.zeros(nb, dtype=torch.long, device=device)
    top = torch.arange(k2, device=device) < nb  # the best num_beams extensions of a step
    improvable, cur = True, p
    with eval_mode(model), torch.inference_mode():
        while True:
            logits = model(running[:, :cur])[:, -1].float()  # (nb, V)
            vocab = logits.shape[-1]
            total = (torch.log_softmax(logits, dim=-1) + running_scores[:, None]).reshape(-1)
            ext_scores, index = torch.topk(total, k2)  # the best extensions of all beams
            ext = running[index // vocab]
            ext[:, cur] = index % vocab
            ends = torch.full_like(top, cur + 1 >= max_length)
            if eos is not None:
                ends |= ext[:, cur] == eos
            # the running beams: the best extensions that did not end
            alive = ext_scores + ends.float() * _NEG
            keep = torch.topk(alive, nb).indices
            running, running_scores = ext[keep], alive[keep]
            # the finished hypotheses: merge the ones that just ended, length-penalised
            new = ext_scores / ((cur + 1 - p) ** lp)
            new = new + float(bool(done_flag.all()) and early_stopping is True) * _NEG
            new = new + float(not improvable) * _NEG
            just = ends & top
            new = new + (~just) * _NEG
            merged = torch.topk(torch.cat([done_scores, new]), nb).indices
            done = torch.cat([done, ext])[merged]
            done_scores = torch.cat([done_scores, new])[merged]
            done_flag = torch.cat([done_flag, just])[merged]
            done_len = torch.cat([done_len, torch.full_like(top, cur + 1 - p, dtype=torch.long)
                                  ])[merged]
            cur += 1
            # can a running beam still beat the worst kept hypothesis?
            length = max_length - p if early_stopping == "never" and lp > 0 else cur - p
            best_running = running_scores[:1] / (length ** lp)
            worst = torch.where(done_flag, done_scores.min(), _NEG)
            improvable = improvable and bool((best_running > worst).any())
            full = bool(done_flag.all()) and early_stopping is True
            if not improvable or full or bool(ends.all()):
                break
    sequences = [done[i, p: p + int(done_len[i])].tolist() for i in range(nb)]
    return BeamSearchOutput(sequences, done_scores.clone())
