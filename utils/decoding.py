"""Turning a trained model's next-token scores into sequences (chapters 9 and 10).

Two ways to pick the next token from the logits at the last position:

* greedy (``temperature=0``): the most likely token;
* sampling at a temperature T > 0: draw from softmax(logits / T). T < 1 sharpens the
  distribution towards greedy, T > 1 flattens it towards uniform.

Both work on a whole batch at once; a sequence that has produced ``<eos>`` is finished and stops
growing while the others go on. Nothing is cached: each step runs the decoder over the whole prefix,
which is wasteful but simple and fast enough for the book's small models.

Models are used through these calls:

* encoder-decoder: ``model.encode(src, src_mask) -> memory`` and
  ``model.decode(tgt, memory, src_mask) -> logits`` (B, L_t, V);
* decoder-only: ``model(tokens) -> logits`` (B, L, V), causal.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from torch import nn

from ._validation import require_rank, require_tensor, shape_str
from .data import BOS, EOS, PAD, pad_sequences

__all__ = ["next_token", "greedy_decode", "sample_decode", "generate"]


def next_token(logits: torch.Tensor, temperature: float = 0.0,
               generator: torch.Generator | None = None) -> torch.Tensor:
    """Pick one token per row from (B, V) logits: argmax when ``temperature == 0``, else sample.

    Args:
        logits: (B, V) unnormalised scores for the next token.
        temperature: 0 for greedy, or T > 0 to sample from softmax(logits / T).
        generator: the random generator for sampling (seed it for reproducible samples).

    Returns:
        (B,) int64 token ids.
    """
    require_tensor("logits", logits)
    require_rank("logits", logits, "(B, V)", rank=2)
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def sample_decode(model: nn.Module, src: torch.Tensor, src_mask: torch.Tensor, max_len: int,
                  temperature: float = 1.0, generator: torch.Generator | None = None,
                  bos: int = BOS, eos: int = EOS) -> list[list[int]]:
    """Decode a batch with an encoder-decoder model, one token at a time.

    Args:
        model: has ``encode(src, src_mask)`` and ``decode(tgt, memory, src_mask)``.
        src: (B, L_s) source ids.
        src_mask: (B, L_s) bool, True at real source tokens.
        max_len: the most tokens to produce per sequence (``<eos>`` included).
        temperature: 0 for greedy, T > 0 to sample.
        generator: the random generator for sampling.
        bos, eos: the start and end tokens.

    Returns:
        B lists of ids: each output up to, not including, its ``<eos>`` (or ``max_len`` tokens
        if it never produced one).
    """
    require_tensor("src", src)
    require_rank("src", src, "(B, L_s)", rank=2)
    require_tensor("src_mask", src_mask)
    if src_mask.shape != src.shape or src_mask.dtype != torch.bool:
        raise ValueError(f"src_mask must be a bool tensor of shape {shape_str(src)}, got "
                         f"{src_mask.dtype} {shape_str(src_mask)}")
    if not isinstance(max_len, int) or max_len <= 0:
        raise ValueError(f"max_len must be a positive int, got {max_len!r}")
    was_training = model.training
    model.eval()
    b = src.shape[0]
    memory = model.encode(src, src_mask)
    tgt = torch.full((b, 1), bos, dtype=torch.long, device=src.device)
    done = torch.zeros(b, dtype=torch.bool, device=src.device)
    for _ in range(max_len):
        logits = model.decode(tgt, memory, src_mask)[:, -1]
        tok = next_token(logits, temperature, generator)
        tok = torch.where(done, torch.full_like(tok, PAD), tok)
        tgt = torch.cat([tgt, tok[:, None]], dim=1)
        done |= tok == eos
        if done.all():
            break
    model.train(was_training)
    return [_cut(row[1:].tolist(), eos) for row in tgt]


def greedy_decode(model: nn.Module, src: torch.Tensor, src_mask: torch.Tensor, max_len: int,
                  bos: int = BOS, eos: int = EOS) -> list[list[int]]:
    """`sample_decode` with temperature 0: the most likely token at every step."""
    return sample_decode(model, src, src_mask, max_len, temperature=0.0, bos=bos, eos=eos)


@torch.no_grad()
def generate(model: nn.Module, prompts: Sequence[Sequence[int]], max_new_tokens: int,
             temperature: float = 0.0, generator: torch.Generator | None = None,
             eos: int = EOS) -> list[list[int]]:
    """Continue each prompt with a decoder-only model until ``<eos>`` or ``max_new_tokens``.

    Prompts of different lengths share one right-padded batch. Row b's next token is read at its
    own last position, ``length_b - 1``, and written at ``length_b``. No padding mask is needed:
    the causal mask already hides every later position, padding included, from each position.

    Args:
        model: ``model(tokens)`` -> (B, L, V) logits, causal.
        prompts: B lists of ids (each non-empty, e.g. starting with ``<bos>``).
        max_new_tokens: the most tokens to add per prompt (``<eos>`` included).
        temperature: 0 for greedy, T > 0 to sample.
        generator: the random generator for sampling.
        eos: the end token.

    Returns:
        B lists of the new ids, up to, not including, ``<eos>``.
    """
    if not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    # The batch is built where the model lives (the CPU for a model without parameters).
    device = next(itertools.chain(model.parameters(), model.buffers()), torch.empty(0)).device
    tokens, real = pad_sequences(prompts)
    tokens, real = tokens.to(device), real.to(device)
    lengths = real.sum(dim=1)
    b = tokens.shape[0]
    tokens = torch.cat([tokens, torch.full((b, max_new_tokens), PAD, dtype=torch.long,
                                           device=device)], dim=1)
    rows = torch.arange(b, device=device)
    done = torch.zeros(b, dtype=torch.bool, device=device)
    was_training = model.training
    model.eval()
    for _ in range(max_new_tokens):
        width = int(lengths.max())
        logits = model(tokens[:, :width])[rows, lengths - 1]  # (B, V) at each row's last token
        tok = next_token(logits, temperature, generator)
        live = ~done
        tokens[rows[live], lengths[live]] = tok[live]
        lengths = lengths + live.long()
        done |= tok == eos
        if done.all():
            break
    model.train(was_training)
    start = real.sum(dim=1)
    return [_cut(tokens[i, start[i]: lengths[i]].tolist(), eos) for i in range(b)]


def _cut(ids: list[int], eos: int) -> list[int]:
    """The ids before the first ``eos`` (all of them if there is none)."""
    return ids[: ids.index(eos)] if eos in ids else ids
