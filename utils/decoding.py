"""Turning a trained model's next-token scores into sequences (chapters 9 and 10).

Two ways to pick the next token from the logits at the last position:

* greedy (``temperature=0``): the most likely token;
* sampling at a temperature T > 0: draw from softmax(logits / T). T < 1 sharpens the
  distribution towards greedy, T > 1 flattens it towards uniform.

`generate` also takes the filters of `utils.sampling` (top-k, top-p, min-p, a repetition
penalty; chapter 18), which change the scores before the pick as ``transformers`` does.

Both work on a whole batch at once; a sequence that has produced ``<eos>`` is finished and stops
growing while the others go on.

Two ways to run the model, chosen by ``use_cache``, give the same tokens:

* ``use_cache=False``: each step runs the decoder over the whole prefix again. Simple, and the
  work per step grows with the prefix: O(L^2) token-positions for L tokens.
* ``use_cache=True`` (the default): a key/value cache (`utils.kv_cache.DecoderCache`) keeps,
  for every layer, the keys and values of the positions already processed; each step feeds only
  the new token, at its own absolute position, and its queries attend to the cached keys. An
  encoder-decoder's cross-attention projects the memory once. The logits agree with the
  recomputing path to rounding (about 1e-6 in float32), and the tokens are the same. The cache
  reserves room for every position the decoding will feed (`DecoderCache.reserve`), so that
  each step writes its keys and values in place instead of copying the whole cache.
  A model without ``new_cache()`` (a model not from `utils.models`) is run the recomputing way.

Models are used through these calls:

* encoder-decoder: ``model.encode(src, src_mask) -> memory`` and
  ``model.decode(tgt, memory, src_mask) -> logits`` (B, L_t, V); with a cache,
  ``model.new_cache()`` and ``model.decode(new_tgt, memory, src_mask, cache=cache)``;
* decoder-only: ``model(tokens) -> logits`` (B, L, V), causal; with a cache,
  ``model.new_cache()`` and ``model(new_tokens, mask, cache=cache, positions=positions)``.

A model that has a ``max_len`` attribute (the models of `utils.models` do) is asked for no more
positions than that: a request that would outgrow it raises before the first step.

On a GPU the host queues work and goes on; reading a value back (``int(t)``, ``bool(t)``,
``t.tolist()``) makes it wait until the device has done everything queued. So a loop that reads
"are all rows finished?" and "were the logits sound?" at every step keeps the GPU idle while
the next step is queued. ``check_every=k`` reads both only every k steps
(`utils.decoding_steps.Watch`): each step leaves its answers on the device, and the read of the
k-th step takes them in order, so that errors and the end of the loop come out as with k = 1;
the tokens and the random generator are the same for any k, at the price of up to k - 1 steps
computed and thrown away. The tokens and positions the loop makes itself are fed to the model
without its range checks (which would read them back); the prompts are checked as always. The
default reads every step on the CPU, where a read waits for nothing, and every
`utils.decoding_steps.CHECK_EVERY` steps elsewhere.

Checked once: `generate` checks its arguments and every prompt id once, and runs the prompts
through the model's own checked ``forward``. After that the loop feeds the model only what it
made itself, so for the library's own decoder-only models (`utils.models.DecoderOnlyLM`, and
GPT-2, Llama and the families of `utils.families` as they are loaded) each later step runs through
`utils.decoding_plan.DecodePlan`: the same operations on the same parameters without the
modules' per-call checks, which at a small model's size cost more than the arithmetic. A greedy
step checks the B scores it picked (the first maximum of each row: NaN, +inf or an all -inf row
is always what gets picked, so this finds every bad row) instead of a pass over all V scores.
Any other model, or one of these with a forward hook or a subclass, decodes through its checked
modules; the tokens are the same either way (tests/test_decoding_plan.py).

Every function checks its arguments before any work and raises `ValueError`, or
`utils._validation.InputTypeError` (a `TypeError` and a `ValueError`) for a wrong type. The model
is run in evaluation mode under ``torch.inference_mode()`` (no autograd, less bookkeeping per
operation: no tensor made inside is returned, and attention weights a module keeps for a plot
are for reading, not for autograd); the train/eval mode of each of its submodules and the grad
mode are restored on every exit, an exception included.
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Sequence

import torch
from torch import nn

from ._validation import (
    eval_mode,
    require_bool,
    require_bool_mask,
    require_floating,
    require_int,
    require_integer_ids,
    require_rank,
    require_same_device,
    require_tensor,
    shape_str,
)
from .data import BOS, EOS, PAD
from .decoding_plan import plan_for
from .decoding_steps import (
    Watch,
    check_every_for,
    check_model,
    check_room,
    check_sampling,
    checked_pick,
    prompt_batch,
)
from .kv_cache import DecoderCache
from .sampling import logits_chooser

__all__ = ["next_token", "greedy_decode", "sample_decode", "generate"]


def _cache_for(model: nn.Module, use_cache: object, length: int) -> DecoderCache | None:
    """A fresh cache when ``use_cache`` and the model offers one (``new_cache()``), else None;
    a library cache reserves room for the ``length`` positions decoding will feed it."""
    require_bool("use_cache", use_cache)
    make = getattr(model, "new_cache", None)
    cache = make() if use_cache and callable(make) else None
    if isinstance(cache, DecoderCache) and all(c.max_len is None or c.max_len >= length
                                               for c in cache.self_attn):
        cache.reserve(length)  # a cache too short for it fails at its first step, clearly
    return cache


def _takes_logits_at(model: nn.Module) -> bool:
    """Whether ``model.forward`` takes ``logits_at`` (the book's decoder-only models do)."""
    try:
        return "logits_at" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def _last_logits(logits: object, b: int, at: torch.Tensor | int) -> torch.Tensor:
    """The (B, V) logits at position ``at`` (per row, or one for all) of the model's output."""
    require_tensor("the model's output", logits)
    require_rank("the model's output", logits, "(B, L, V)", rank=3)
    if logits.shape[0] != b:
        raise ValueError(f"the model's output must have batch size B={b}, got "
                         f"{shape_str(logits)}")
    if isinstance(at, int):
        return logits[:, at]
    return logits[torch.arange(b, device=logits.device), at]


def next_token(logits: torch.Tensor, temperature: float = 0.0,
               generator: torch.Generator | None = None) -> torch.Tensor:
    """Pick one token per row from (B, V) logits: argmax when ``temperature == 0``, else sample.

    Args:
        logits: (B, V) floating-point unnormalised scores for the next token, V >= 1. A score
            of -inf rules a token out; NaN or +inf, or a row with no finite score, raises
            `ValueError` (argmax would pick an arbitrary token, sampling would fail inside
            torch).
        temperature: 0 for greedy, or a finite T > 0 to sample from softmax(logits / T).
        generator: the random generator for sampling (seed it for reproducible samples).

    Returns:
        (B,) int64 token ids; B = 0 gives an empty tensor.
    """
    require_tensor("logits", logits)
    require_rank("logits", logits, "(B, V)", rank=2)
    require_floating("logits", logits)
    temperature = check_sampling(temperature, generator)
    if logits.shape[1] == 0:
        raise ValueError(f"logits must score at least one token (V >= 1), got "
                         f"{shape_str(logits)}")
    return checked_pick(logits, temperature, generator)


def sample_decode(model: nn.Module, src: torch.Tensor, src_mask: torch.Tensor, max_len: int,
                  temperature: float = 1.0, generator: torch.Generator | None = None,
                  bos: int = BOS, eos: int = EOS, use_cache: bool = True,
                  check_every: int | None = None) -> list[list[int]]:
    """Decode a batch with an encoder-decoder model, one token at a time.

    Args:
        model: an ``nn.Module`` with ``encode(src, src_mask)`` and
            ``decode(tgt, memory, src_mask)``.
        src: (B, L_s) integer source ids.
        src_mask: (B, L_s) bool, True at real source tokens, on ``src``'s device.
        max_len: the most tokens to produce per sequence (``<eos>`` included), a positive int
            (at most the model's ``max_len``, if it has one).
        temperature: 0 for greedy, T > 0 to sample.
        generator: the random generator for sampling.
        bos, eos: the start and end tokens, ints >= 0.
        use_cache: keep the decoder's keys and values (and the memory's, for cross-attention)
            and feed only the newest token each step (see the module docstring); False
            recomputes the whole prefix each step. Both give the same tokens.
        check_every: read back from the device whether the logits were sound and which rows
            are finished only every this many steps (`Watch`); None: every step on the CPU,
            every `CHECK_EVERY` steps elsewhere. The same tokens for any value.

    Returns:
        B lists of ids: each output up to, not including, its ``<eos>`` (or ``max_len`` tokens
        if it never produced one). An empty batch (B = 0) gives ``[]``.
    """
    check_model(model, "encode() and decode()")
    require_tensor("src", src)
    require_rank("src", src, "(B, L_s)", rank=2)
    require_integer_ids("src", src)
    require_tensor("src_mask", src_mask)
    require_bool_mask("src_mask", src_mask)
    if src_mask.shape != src.shape:
        raise ValueError(f"src_mask must be a bool tensor of shape {shape_str(src)}, got "
                         f"{src_mask.dtype} {shape_str(src_mask)}")
    require_same_device(src=src, src_mask=src_mask)
    max_len = require_int("max_len", max_len)
    temperature = check_sampling(temperature, generator)
    bos = require_int("bos", bos, minimum=0)
    eos = require_int("eos", eos, minimum=0)
    check_room(model, max_len, f"max_len={max_len}")
    watch = Watch(check_every_for(check_every, src.device), src.device, temperature, generator)
    cache = _cache_for(model, use_cache, max_len)
    b = src.shape[0]
    with eval_mode(model), torch.inference_mode():
        memory = model.encode(src, src_mask)
        tgt = torch.full((b, 1), bos, dtype=torch.long, device=src.device)
        done = torch.zeros(b, dtype=torch.bool, device=src.device)
        for step in range(max_len):
            with watch.feeding():
                if cache is None:
                    out = model.decode(tgt, memory, src_mask)
                else:  # only the newest token; the cache holds the others' keys and values
                    out = model.decode(tgt[:, -1:], memory, src_mask, cache=cache)
            logits = _last_logits(out, b, -1)
            if step == 0:
                watch.trust(model, logits)
            tok = watch.pick(logits, temperature, generator)
            tok = torch.where(done, torch.full_like(tok, PAD), tok)
            tgt = torch.cat([tgt, tok[:, None]], dim=1)
            done |= tok == eos
            if watch.finished(done, step == max_len - 1):
                break
    return [_cut(row[1:].tolist(), eos) for row in tgt]


def greedy_decode(model: nn.Module, src: torch.Tensor, src_mask: torch.Tensor, max_len: int,
                  bos: int = BOS, eos: int = EOS, use_cache: bool = True,
                  check_every: int | None = None) -> list[list[int]]:
    """`sample_decode` with temperature 0: the most likely token at every step (with the
    key/value cache unless ``use_cache=False``; the tokens are the same)."""
    return sample_decode(model, src, src_mask, max_len, temperature=0.0, bos=bos, eos=eos,
                         use_cache=use_cache, check_every=check_every)


def generate(model: nn.Module, prompts: Sequence[Sequence[int]], max_new_tokens: int,
             temperature: float = 0.0, generator: torch.Generator | None = None,
             eos: int = EOS, use_cache: bool = True,
             check_every: int | None = None, *, top_k: int | None = None,
             top_p: float | None = None, min_p: float | None = None,
             repetition_penalty: float | None = None) -> list[list[int]]:
    """Continue each prompt with a decoder-only model until ``<eos>`` or ``max_new_tokens``.

    Prompts of different lengths share one right-padded batch. Row b's next token is read at its
    own last position, ``length_b - 1``, and written at ``length_b``. No padding mask is needed:
    the causal mask already hides every later position, padding included, from each position.

    With the cache (``use_cache=True``), the first step runs the padded prompts once and fills
    the cache; every later step feeds each row's newest token at its own position
    ``length_b - 1``, and its key and value take the next cache slot. A shorter prompt leaves
    cache slots of padding between its prompt and its new tokens: a key mask hides them. The
    rows finished by ``<eos>`` keep being fed (hidden by the key mask once the loop has read
    that they are finished: their own logits are never used), so that the batch keeps its
    shape, the random draws of sampling are those of the recomputing path, and the tokens the
    same.

    Args:
        model: an ``nn.Module``, ``model(tokens)`` -> (B, L, V) logits, causal.
        prompts: B prompts, each a non-empty list (or 1-dim tensor) of integer ids >= 0, e.g.
            starting with ``<bos>``; or a (B, L) integer tensor of B prompts of length L.
        max_new_tokens: the most tokens to add per prompt (``<eos>`` included), a positive int.
            With a model that has ``max_len``, the longest prompt plus ``max_new_tokens - 1``
            (the last token is never fed back) must fit in it.
        temperature: 0 for greedy, T > 0 to sample.
        generator: the random generator for sampling (seed it: the same seed, the same tokens).
        eos: the end token, an int >= 0.
        use_cache: keep every layer's keys and values and feed only the new tokens (see the
            module docstring); False recomputes the whole prefix each step. Both give the
            same tokens.
        check_every: read back from the device whether the logits were sound and which rows
            are finished only every this many steps (`Watch`): with the cache, a step then
            makes the host wait for nothing. None: every step on the CPU, every `CHECK_EVERY`
            steps elsewhere. The same tokens for any value. (Without the cache, each step also
            reads the longest row's length, the width of the prefix to recompute.)
        top_k, top_p, min_p, repetition_penalty: the filters of `utils.sampling`, applied as
            ``transformers`` applies them (`utils.sampling.LogitsChooser`): the penalty to the
            tokens of each row's prompt and of what it has generated, then the temperature,
            top-k, top-p and min-p. None (the default) leaves each out; at temperature 0 only
            the penalty changes anything.

    Returns:
        B lists of the new ids, up to, not including, ``<eos>``. An empty list of prompts
        gives ``[]``; an empty prompt raises (there is no last position to continue from).
    """
    check_model(model, "forward(tokens)")
    max_new_tokens = require_int("max_new_tokens", max_new_tokens)
    temperature = check_sampling(temperature, generator)
    chooser = logits_chooser(temperature, top_k, top_p, min_p, repetition_penalty)
    eos = require_int("eos", eos, minimum=0)
    require_bool("use_cache", use_cache)
    batch = prompt_batch(prompts)
    if batch is None:
        return []
    tokens, real = batch
    needed = tokens.shape[1] + max_new_tokens - 1  # positions fed (the last token never is)
    check_room(model, needed,
                f"a prompt of {tokens.shape[1]} tokens and max_new_tokens={max_new_tokens}")
    # The batch is built where the model lives (the CPU for a model without parameters).
    device = next(itertools.chain(model.parameters(), model.buffers()), torch.empty(0)).device
    tokens, real = tokens.to(device), real.to(device)
    lengths = real.sum(dim=1)
    b = tokens.shape[0]
    tokens = torch.cat([tokens, torch.full((b, max_new_tokens), PAD, dtype=torch.long,
                                           device=device)], dim=1)
    done = torch.zeros(b, dtype=torch.bool, device=device)
    ragged = not bool(real.all())
    watch = Watch(check_every_for(check_every, device), device, temperature, generator)
    cache = _cache_for(model, use_cache, needed)
    plan = None
    keys = real.clone()  # (B, L_cache): the cache slots each row may attend to
    tok = tokens[:, 0]  # each step's pick replaces it; the plan feeds it back
    with eval_mode(model), torch.inference_mode():
        for step in range(max_new_tokens):
            with watch.feeding():
                if plan is not None:  # the checked-once step (`utils.decoding_plan`)
                    slot = plan.slot
                    keys[:, slot] = ~done  # as the branch below: finished rows hidden
                    # each row's newest token (a finished row's is never read) at its position
                    logits = plan.step(tok[:, None], (lengths - 1)[:, None],
                                       keys[:, : slot + 1] if ragged or watch.any_done else None)
                elif cache is None:
                    width = int(lengths.max())
                    # (B, V) at each row's last token
                    logits = _last_logits(model(tokens[:, :width]), b, lengths - 1)
                elif step == 0:  # the padded prompts, once: slot t of the cache is position t
                    width = tokens.shape[1] - max_new_tokens
                    if _takes_logits_at(model):  # the output layer at the last tokens alone
                        logits = _last_logits(model(tokens[:, :width], keys, cache=cache,
                                                    logits_at=(lengths - 1)[:, None]), b, 0)
                    else:
                        logits = _last_logits(model(tokens[:, :width], keys, cache=cache), b,
                                              lengths - 1)
                else:  # each row's newest token, at its own position, into the next slot
                    pos = (lengths - 1)[:, None]  # (B, 1)
                    keys = torch.cat([keys, ~done[:, None]], dim=1)  # finished rows: hidden
                    # an all-True mask changes nothing: leave it out (less work per step); a
                    # row finished since the last read is not hidden yet, which changes only
                    # its own logits, never used
                    mask = keys if ragged or watch.any_done else None
                    logits = _last_logits(model(tokens.gather(1, pos), mask, cache=cache,
                                                positions=pos), b, 0)
            if step == 0:
                watch.trust(model, logits)
                if cache is not None and watch.trusted:
                    plan = plan_for(model, cache)
                    if plan is not None:  # (B, L_cache): the slots each row may attend to
                        keys = torch.cat([keys, keys.new_ones(b, max_new_tokens - 1)], dim=1)
            if chooser.plain:  # the draw divides by the temperature itself
                tok = watch.pick(logits, temperature, generator)
            else:  # the filtered scores, the temperature in them: a draw at T = 1
                so_far = _so_far(tokens, lengths) if chooser.needs_previous else None
                logits = chooser(logits, so_far)
                tok = watch.pick(logits, 1.0 if temperature > 0 else 0.0, generator)
            # Each live row's token goes to its own next slot; a finished row's next slot stays
            # padding (it is past the row's end, and never read).
            tokens.scatter_(1, lengths[:, None], torch.where(done, PAD, tok)[:, None])
            lengths = lengths + ~done
            done |= tok == eos
            if watch.finished(done, step == max_new_tokens - 1):
                break
        if plan is not None:
            plan.close()
    start = real.sum(dim=1)
    return [_cut(tokens[i, start[i]: lengths[i]].tolist(), eos) for i in range(b)]


def _so_far(tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """(B, L) ids of each row so far, prompt and new tokens; past a row's length, its first
    token again (a token present twice is penalised once: the repeat changes nothing)."""
    past = torch.arange(tokens.shape[1], device=tokens.device) >= lengths[:, None]
    return torch.where(past, tokens[:, :1], tokens)


def _cut(ids: list[int], eos: int) -> list[int]:
    """The ids before the first ``eos`` (all of them if there is none)."""
    return ids[: ids.index(eos)] if eos in ids else ids
