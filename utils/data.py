"""Tokens and padded batches: the vocabulary and the batches of the toy tasks (chapters 9 and 10).

`utils.tasks` draws its examples as ids of a `Vocab` and collates them with the helpers here;
`utils.decoding` and `utils.train` read prompts and sequences with them.

Every vocabulary's first three tokens are the shared specials ``<pad>``, ``<bos>`` and ``<eos>``
(ids 0, 1, 2: `PAD`, `BOS`, `EOS`). Batches are padded on the right with ``<pad>`` and carry
padding masks in the book's bool convention: True = a real token (see `utils.masks`). Shapes:
`pad_sequences` gives (B, L) int64 ids and a (B, L) bool mask; `Seq2SeqBatch` (encoder-decoder),
`LMBatch` (decoder-only) and `MLMBatch` (encoder-only) hold (B, L) tensors. A target of ``PAD``
means "no loss here": pass ``ignore_index=PAD`` to the cross-entropy. Batches are made on the CPU
unless a maker is given ``device=``; ``batch.to(device)`` returns a copy with every tensor moved.

`bert_mask_tokens` is BERT's masking rule (of the chosen positions, 80% become ``<mask>``, 10% a
random token, 10% stay), for chapter 10's comparison with the simpler rule of
`utils.tasks.MissingDigitTask`.

`book_prose`, the book's own prose as a corpus, lives in `utils.corpus`; it is re-exported here.

`random_windows` draws the training batches of a language model trained on one long text
(chapter 15 derives it; chapters 18 to 20 train with it): windows of ``context + 1`` consecutive
ids at random starts, the first ``context`` the input and the last ``context`` the targets.

Every count (sizes, ``pad_to``, ``vocab_size``) must be an int (not a bool, not a float such as
2.0) in its range, and token ids must be integers: anything else raises `ValueError`, or
`utils._validation.InputTypeError` (a `TypeError` and a `ValueError`) for a wrong type. Nothing
is rounded or truncated in silence.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ._validation import InputTypeError, require_bool, require_int, require_real, type_name
from .corpus import book_prose, freeze_prose
from .devices import MovableBatch, resolve_device

__all__ = [
    "PAD",
    "BOS",
    "EOS",
    "SPECIALS",
    "Vocab",
    "pad_sequences",
    "Seq2SeqBatch",
    "LMBatch",
    "MLMBatch",
    "bert_mask_tokens",
    "book_prose",
    "freeze_prose",
    "random_windows",
]

PAD, BOS, EOS = 0, 1, 2
SPECIALS = ("<pad>", "<bos>", "<eos>")


def _is_sequence(value: object) -> bool:
    """A list, tuple, tensor or NumPy array, not a string: something to read items from."""
    return (isinstance(value, (Sequence, torch.Tensor, np.ndarray))
            and not isinstance(value, (str, bytes)))


def _require_sequence(name: str, value: object, what: str) -> Sequence:
    """``value`` must be a list, tuple or other sequence (not a string): ``what`` says of what."""
    if not _is_sequence(value):
        raise InputTypeError(f"{name} must be a list of {what}, got {type_name(value)}")
    return value


def _as_ids(name: str, seq: object) -> torch.Tensor:
    """One sequence of token ids (a list, tuple, 1-dim tensor or array of ints) as int64."""
    if not _is_sequence(seq) or getattr(seq, "ndim", 1) != 1:
        raise InputTypeError(f"{name} must be a 1-dim sequence of integer token ids, got "
                             f"{type_name(seq)}")
    if len(seq) == 0:  # torch.as_tensor([]) would be float32; emptiness is checked later
        return torch.zeros(0, dtype=torch.long)
    if isinstance(seq, (list, tuple)) and any(isinstance(x, bool) for x in seq):
        # torch.as_tensor([3, True]) is int64, [3, 1]: a bool among ints would pass as an id.
        raise InputTypeError(f"{name} must be a 1-dim sequence of integer token ids, got a bool "
                             f"in {seq!r}")
    try:
        t = torch.as_tensor(seq)
    except (TypeError, ValueError, RuntimeError):
        raise InputTypeError(f"{name} must hold integer token ids, got {seq!r}") from None
    if t.dim() != 1 or t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
        raise InputTypeError(f"{name} must be a 1-dim sequence of integer token ids, got "
                             f"{type_name(t)}")
    return t.long()


@dataclass(frozen=True)
class Vocab:
    """A token <-> id table whose first ids are the specials ``<pad>``, ``<bos>``, ``<eos>``.

    Args:
        tokens: every token (a string), specials first, no repeats; a list is stored as a
            tuple.
    """

    tokens: tuple[str, ...]

    def __post_init__(self) -> None:
        _require_sequence("tokens", self.tokens, "token strings")
        object.__setattr__(self, "tokens", tuple(self.tokens))
        for i, t in enumerate(self.tokens):
            if not isinstance(t, str):
                raise InputTypeError(f"every token must be a str, got tokens[{i}] = {t!r}")
        if tuple(self.tokens[: len(SPECIALS)]) != SPECIALS:
            raise ValueError(f"a Vocab must start with {SPECIALS}, got {tuple(self.tokens[:3])}")
        if len(set(self.tokens)) != len(self.tokens):
            raise ValueError(f"tokens must be distinct, got {self.tokens}")

    @classmethod
    def from_symbols(cls, symbols: Iterable[str]) -> Vocab:
        """The specials followed by ``symbols``: strings, or one string whose characters are
        the symbols (``"abc"``)."""
        if not isinstance(symbols, Iterable):
            raise InputTypeError(f"symbols must be an iterable of token strings, got "
                                 f"{type_name(symbols)}")
        return cls(SPECIALS + tuple(symbols))

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def index(self) -> dict[str, int]:
        return {t: i for i, t in enumerate(self.tokens)}

    def encode(self, tokens: Iterable[str]) -> list[int]:
        """Token strings -> ids; raises `ValueError` on an unknown token.

        ``tokens`` is an iterable of strings, such as ``"3 9 1".split()``; a single string
        raises `InputTypeError` rather than being read character by character. No tokens give
        ``[]``.
        """
        if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Iterable):
            raise InputTypeError(f"tokens must be an iterable of token strings (e.g. "
                                 f"text.split()), got {type_name(tokens)}")
        index = self.index
        out = []
        for t in tokens:
            if not isinstance(t, str):
                raise InputTypeError(f"every token must be a str, got {t!r} "
                                     f"({type(t).__name__})")
            if t not in index:
                raise ValueError(f"unknown token {t!r}; the vocabulary is {self.tokens}")
            out.append(index[t])
        return out

    def decode(self, ids: Iterable[int] | torch.Tensor, sep: str = " ",
               skip_specials: bool = True) -> str:
        """Ids -> a readable string; stops at the first ``<eos>`` when ``skip_specials``.

        ``ids`` is an iterable of ints (NumPy integers included) or a 0- or 1-dim integer
        tensor; a float (even 3.0), a bool or an id outside [0, len(vocab)) raises. No ids give
        ``""``.
        """
        if not isinstance(sep, str):
            raise InputTypeError(f"sep must be a str, got {type_name(sep)}")
        require_bool("skip_specials", skip_specials)
        if isinstance(ids, torch.Tensor):
            ids = _as_ids("ids", ids.reshape(-1) if ids.dim() == 0 else ids).tolist()
        elif isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
            raise InputTypeError(f"ids must be an iterable of integer ids, got {type_name(ids)}")
        words = []
        for i in ids:
            if isinstance(i, bool) or not isinstance(i, numbers.Integral):
                raise InputTypeError(f"ids must be integers, got {i!r} ({type(i).__name__})")
            i = int(i)
            if not 0 <= i < len(self.tokens):
                raise ValueError(f"id {i} is outside the vocabulary of size {len(self.tokens)}")
            if skip_specials and i == EOS:
                break
            if skip_specials and i in (PAD, BOS):
                continue
            words.append(self.tokens[i])
        return sep.join(words)


def pad_sequences(seqs: Sequence[Sequence[int]], pad: int = PAD, max_len: int | None = None,
                  pad_to: int = 0, device: str | torch.device | None = None,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack sequences of different lengths into one tensor, padding on the right.

    Args:
        seqs: B >= 1 sequences of integer token ids (lists, tuples or 1-D integer tensors), each
            non-empty. Floats and bools raise rather than being truncated.
        pad: the int written after the end of each sequence (any int, e.g. -100).
        max_len: the padded length, a positive int; defaults to the longest sequence.
        pad_to: pad to at least this many positions (an int >= 0; when ``max_len`` is not
            given), e.g. to give every batch of a task the same width.
        device: where to put the result (a str or `torch.device`; None: the CPU). The batch is
            made on the CPU and then moved.

    Returns:
        ``(tokens, mask)``: tokens (B, max_len) int64, and mask (B, max_len) bool, True at real
        tokens and False at padding (the convention of `utils.masks.padding_mask`).
    """
    device = None if device is None else resolve_device(device)
    _require_sequence("seqs", seqs, "sequences of token ids")
    if len(seqs) == 0:
        raise ValueError("seqs must hold at least one sequence, got none")
    if isinstance(pad, bool) or not isinstance(pad, numbers.Integral):
        raise InputTypeError(f"pad must be an int, got {pad!r} ({type(pad).__name__})")
    pad_to = require_int("pad_to", pad_to, minimum=0)
    lists = _int_lists(seqs)
    rows = lists if lists is not None else [_as_ids(f"seqs[{i}]", s) for i, s in enumerate(seqs)]
    lengths = [len(r) for r in rows]
    if min(lengths) == 0:
        raise ValueError(f"every sequence must be non-empty, got lengths {lengths}")
    longest = max(lengths)
    if max_len is None:
        max_len = max(longest, pad_to)
    elif require_int("max_len", max_len) < longest:
        raise ValueError(f"max_len={max_len} is shorter than the longest sequence ({longest})")
    if lists is not None and _INT64_MIN <= int(pad) <= _INT64_MAX:
        # One call for the whole batch: a row at a time costs two tensor operations a sequence.
        tokens = torch.tensor([[*r, *(pad,) * (max_len - len(r))] for r in lists],
                              dtype=torch.long)
    else:
        tokens = torch.full((len(rows), max_len), int(pad), dtype=torch.long)
        for row, r in enumerate(rows):
            tokens[row, : len(r)] = r
    mask = torch.arange(max_len)[None, :] < torch.tensor(lengths)[:, None]
    if device is not None:
        return tokens.to(device), mask.to(device)
    return tokens, mask


_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def _int_lists(seqs: Sequence) -> list | None:
    """``seqs`` as a list when every sequence is a list or tuple of Python ints (not bools) that
    fit int64: what the tasks' batches are made of, thousands of times a chapter. None
    otherwise (tensors, arrays, anything to check and convert one sequence at a time)."""
    for s in seqs:
        if type(s) not in (list, tuple) or not all(type(x) is int for x in s):
            return None
        if s and (min(s) < _INT64_MIN or max(s) > _INT64_MAX):
            return None
    return list(seqs)


@dataclass
class Seq2SeqBatch(MovableBatch):
    """A padded batch for an encoder-decoder model trained with teacher forcing.

    Attributes:
        src: (B, L_s) source ids, padded with ``PAD``.
        src_mask: (B, L_s) bool, True at real source tokens.
        tgt_in: (B, L_t) decoder input: ``<bos>`` followed by the target, padded.
        tgt_out: (B, L_t) what the decoder must predict at each position: the target followed
            by ``<eos>``, padded with ``PAD`` (ignored by the loss).
        tgt_mask: (B, L_t) bool, True at real decoder positions.
    """

    src: torch.Tensor
    src_mask: torch.Tensor
    tgt_in: torch.Tensor
    tgt_out: torch.Tensor
    tgt_mask: torch.Tensor

    @classmethod
    def from_pairs(cls, pairs: Sequence[tuple[Sequence[int], Sequence[int]]],
                   pad_to: int = 0, device: str | torch.device | None = None) -> Seq2SeqBatch:
        """Build the batch from (source, target) pairs of ids without specials; source and
        target are padded to at least ``pad_to`` positions (see `pad_sequences`) and put on
        ``device`` (None: the CPU). An empty list of pairs raises `ValueError`."""
        _require_pairs(pairs)
        device = None if device is None else resolve_device(device)
        src, src_mask = pad_sequences([s for s, _ in pairs], pad_to=pad_to)
        tgt_in, tgt_mask = pad_sequences([[BOS, *t] for _, t in pairs], pad_to=pad_to)
        tgt_out, _ = pad_sequences([[*t, EOS] for _, t in pairs], pad_to=pad_to)
        batch = cls(src, src_mask, tgt_in, tgt_out, tgt_mask)
        return batch if device is None else batch.to(device)


@dataclass
class LMBatch(MovableBatch):
    """A padded batch for a causal language model.

    Attributes:
        inputs: (B, L) ids fed to the model (each sequence without its last token).
        targets: (B, L) the next token at each position, ``PAD`` where no loss is wanted
            (the prompt, and the padding).
        mask: (B, L) bool, True at real input tokens.
    """

    inputs: torch.Tensor
    targets: torch.Tensor
    mask: torch.Tensor


@dataclass
class MLMBatch(MovableBatch):
    """A padded batch for masked-token prediction.

    Attributes:
        inputs: (B, L) ids with some tokens replaced by ``<mask>``.
        targets: (B, L) the hidden token at masked positions, ``PAD`` everywhere else.
        mask: (B, L) bool, True at real tokens (masked ones included), False at padding.
    """

    inputs: torch.Tensor
    targets: torch.Tensor
    mask: torch.Tensor


def _require_pairs(examples: object) -> None:
    """``examples`` must be a non-empty list of pairs (two sequences each)."""
    _require_sequence("examples", examples, "examples, each a pair of id sequences")
    if len(examples) == 0:
        raise ValueError("examples must hold at least one example, got none")
    for i, ex in enumerate(examples):
        if not _is_sequence(ex) or len(ex) != 2:
            raise InputTypeError(f"every example must be a pair (inputs, outputs) of id "
                                 f"sequences; examples[{i}] is {type_name(ex)}")


def bert_mask_tokens(tokens: torch.Tensor, mask_id: int, vocab_size: int,
                     generator: torch.Generator | None = None, select_prob: float = 0.15,
                     num_specials: int = len(SPECIALS),
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """BERT's masking rule: choose positions, then hide 80% of them, randomize 10%, keep 10%.

    Each position of ``tokens`` is chosen with probability ``select_prob``. A chosen position
    becomes ``mask_id`` with probability 0.8, a token drawn uniformly from the ordinary tokens
    (ids ``num_specials`` to ``vocab_size - 1``, ``mask_id`` excluded; it may happen to be the
    original token) with probability 0.1, and keeps its token with probability 0.1. Special
    tokens (ids below ``num_specials``) are never chosen. The model is scored at every chosen
    position, so it cannot learn that only ``<mask>`` needs predicting, and it sees ``<mask>``,
    which never occurs in real text, less often.

    Args:
        tokens: (B, L) or (L,) integer ids.
        mask_id: the id of ``<mask>``, an int in [0, vocab_size).
        vocab_size: V, an int.
        generator: a `torch.Generator` for reproducible draws.
        select_prob: the share of positions chosen, a number in [0, 1].
        num_specials: ids below this (``<pad>``, ``<bos>``, ``<eos>``) are never chosen nor drawn.

    Returns:
        ``(inputs, targets, kind)``, each shaped like ``tokens``: the corrupted ids; the original
        id at chosen positions and ``PAD`` elsewhere; and ``kind`` (int64): 0 not chosen,
        1 replaced by ``<mask>``, 2 replaced by a random token, 3 chosen but unchanged. They
        are on ``tokens``' device; the draws are made on the CPU (``generator`` is a CPU
        generator), so a seed gives the same draws on every device.
    """
    if not isinstance(tokens, torch.Tensor) or tokens.dim() not in (1, 2):
        raise InputTypeError(f"tokens must be a (B, L) or (L,) tensor of ids, got "
                             f"{type_name(tokens)}")
    if tokens.dtype == torch.bool or tokens.is_floating_point() or tokens.is_complex():
        raise InputTypeError(f"tokens must hold integer ids, got dtype {tokens.dtype}")
    vocab_size = require_int("vocab_size", vocab_size)
    mask_id = require_int("mask_id", mask_id, minimum=0)
    num_specials = require_int("num_specials", num_specials, minimum=0)
    if mask_id >= vocab_size:
        raise ValueError(f"mask_id must lie in [0, vocab_size={vocab_size}), got {mask_id}")
    ordinary = [i for i in range(num_specials, vocab_size) if i != mask_id]
    if not ordinary:
        raise ValueError(f"no ordinary token to draw: vocab_size={vocab_size}, "
                         f"num_specials={num_specials}")
    select_prob = require_real("select_prob", select_prob, low=0.0, high=1.0)
    where, tokens = tokens.device, tokens.cpu()  # drawn on the CPU, the generator's device
    u = torch.rand(tokens.shape, generator=generator)
    chosen = (torch.rand(tokens.shape, generator=generator) < select_prob) & (
        tokens >= num_specials)
    kind = torch.zeros(tokens.shape, dtype=torch.long)
    kind[chosen & (u < 0.8)] = 1
    kind[chosen & (u >= 0.8) & (u < 0.9)] = 2
    kind[chosen & (u >= 0.9)] = 3
    pick = torch.randint(len(ordinary), tokens.shape, generator=generator)
    random_ids = torch.tensor(ordinary, dtype=torch.long)[pick]
    inputs = tokens.long().clone()
    inputs[kind == 1] = mask_id
    inputs[kind == 2] = random_ids[kind == 2]
    targets = torch.where(chosen, tokens.long(), torch.full_like(inputs, PAD))
    return inputs.to(where), targets.to(where), kind.to(where)


def random_windows(
    ids: torch.Tensor, context: int, batch_size: int, seed: int = 0
) -> Iterator[torch.Tensor]:
    """Batches of windows of ``context + 1`` consecutive ids at uniformly random starts, forever.

    Each batch draws ``batch_size`` starts from ``torch.randint(0, len(ids) - context)`` with a
    generator of its own seeded by ``seed`` (so the batches do not depend on, or change, the
    global random state), and gathers ``ids[start : start + context + 1]`` for each: the input
    is ``window[:, :-1]`` and the next-token targets ``window[:, 1:]``. Every window fits in
    ``ids``; one start is as likely as any other.

    Args:
        ids: the text as token ids, a 1-dim integer tensor of N > ``context`` ids.
        context: the positions the model reads, a positive int.
        batch_size: windows per batch B, a positive int.
        seed: the seed of the batches' generator, an int >= 0.

    Returns:
        An endless iterator of (B, context + 1) tensors of ``ids``' dtype.

    Raises:
        ValueError or InputTypeError: for a bad argument, naming it, when called.
    """
    if not isinstance(ids, torch.Tensor):
        raise InputTypeError(f"ids must be a 1-dim integer tensor, got {type_name(ids)}")
    integer = not (ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool)
    if not integer:
        raise InputTypeError(f"ids must be a 1-dim integer tensor, got {ids.dtype}")
    if ids.dim() != 1:
        raise ValueError(
            f"ids must be a 1-dim integer tensor, got shape {tuple(ids.shape)} of {ids.dtype}"
        )
    context = require_int("context", context, minimum=1)
    batch_size = require_int("batch_size", batch_size, minimum=1)
    seed = require_int("seed", seed, minimum=0)
    if len(ids) <= context:
        raise ValueError(
            f"ids must hold more than context={context} ids (a window is context + 1), "
            f"got {len(ids)}"
        )
    return _windows(ids, context, batch_size, seed)


def _windows(
    ids: torch.Tensor, context: int, batch_size: int, seed: int
) -> Iterator[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    offsets = torch.arange(context + 1, device=ids.device)
    while True:
        starts = torch.randint(0, len(ids) - context, (batch_size,), generator=gen)
        yield ids[starts.to(ids.device)[:, None] + offsets]  # (B, context + 1)
