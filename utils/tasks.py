"""Toy tasks made in code (chapters 9, 10 and 13, and assignment 8).

Three small tasks, each cheap to generate and each needing a particular part of the Transformer:

* `ReversalTask` (encoder-decoder): read 3 to 12 symbols, write them backwards. The output at step
  i depends on the input at position n - 1 - i, so the model must know positions and lengths.
* `SortingTask` (decoder-only): the text ``"3 9 1 > 1 3 9"`` written token by token; a causal
  language model learns to continue the prompt up to ``>`` with the sorted digits.
* `MissingDigitTask` (encoder-only): the digits 0 to n - 1 shuffled, one replaced by ``<mask>``;
  the hidden digit is the one no other token shows, so the model must read both sides of the mask.

Every task has its own `utils.data.Vocab` (the specials ``<pad>``, ``<bos>``, ``<eos>`` first) and
collates its examples into the padded batches of `utils.data`: a `Seq2SeqBatch`, an `LMBatch` or an
`MLMBatch`, (B, L) tensors with a bool padding mask (True = a real token). A target of ``PAD``
means "no loss here": pass ``ignore_index=PAD`` to the cross-entropy.

Held-out data: ``task.sample(n, seed)`` draws ``n`` distinct examples, and ``task.batches(...,
exclude=held_out)`` never yields an example whose input is in ``held_out``, so that a test set
measures generalisation, not memory. Short lengths have few distinct problems (4 digits can be
shuffled in only 24 ways), so a plain draw of many test examples can take nearly all of them and
leave training none of that length: ``sample(..., max_share=0.2)`` takes at most a fifth of the
problems of each length (`_Task.num_problems`), so that every length stays in both sets, and
`_Task.length_of` gives the length of an example, to count or score the lengths separately.

Every count (lengths, sizes, ``n``, ``batch_size``, ``seed``, ``pad_to``) must be an int (not a
bool, not a float such as 2.0) in its range, and token ids must be integers: anything else
raises `ValueError`, or `utils._validation.InputTypeError` (a `TypeError` and a `ValueError`) for
a wrong type, when the function is called (``batches`` included, although it returns a lazy
stream). Nothing is rounded or truncated in silence.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence

import torch

from ._validation import InputTypeError, require_bool, require_int, require_real, type_name
from .data import (
    BOS,
    EOS,
    PAD,
    SPECIALS,
    LMBatch,
    MLMBatch,
    Seq2SeqBatch,
    Vocab,
    _require_pairs,
    pad_sequences,
)
from .devices import resolve_device

__all__ = ["ReversalTask", "SortingTask", "MissingDigitTask"]


def _require_lengths(min_len: object, max_len: object, least: int) -> tuple[int, int]:
    """``least <= min_len <= max_len``, both ints."""
    min_len = require_int("min_len", min_len, minimum=least)
    max_len = require_int("max_len", max_len, minimum=least)
    if max_len < min_len:
        raise ValueError(f"max_len must be >= min_len={min_len}, got {max_len}")
    return min_len, max_len


def _share_caps(task: _Task, max_share: object, n: int) -> dict[int, int]:
    """The most problems of each length that ``task.sample(n, ..., max_share)`` may take, or a
    ValueError when they are fewer than ``n`` in all."""
    max_share = require_real("max_share", max_share, low=0.0, high=1.0, low_open=True)
    cap = {k: math.floor(max_share * task.num_problems(k))
           for k in range(task.min_len, task.max_len + 1)}
    if sum(cap.values()) < n:
        raise ValueError(f"max_share={max_share} allows only {sum(cap.values())} "
                         f"problems in all, fewer than n={n}")
    return cap


class _Task:
    """Shared sampling machinery: distinct examples, and endless batches that avoid a held-out set.

    A subclass defines ``vocab``, ``_draw(generator) -> (key, example)``, where ``key`` is the
    hashable input that identifies the example (two examples with the same key are the same
    problem), ``_key_length(key)`` (the length of the problem) and ``num_problems(length)``.
    """

    vocab: Vocab
    min_len: int
    max_len: int

    def _draw(self, g: torch.Generator) -> tuple[tuple[int, ...], object]:
        raise NotImplementedError

    def num_problems(self, length: int) -> int:  # pragma: no cover - per task
        """How many distinct problems (keys) of ``length`` the task has."""
        raise NotImplementedError

    @staticmethod
    def _key_length(key: tuple[int, ...]) -> int:
        return len(key)

    def length_of(self, example: Sequence) -> int:
        """The length of an example as returned by `sample` (digits or symbols, no specials)."""
        _require_pairs([example])
        (key,) = self._keys([example])
        return self._key_length(key)

    def _require_length(self, length: object) -> int:
        length = require_int("length", length, minimum=0)
        if not self.min_len <= length <= self.max_len:
            raise ValueError(f"length must lie in [min_len, max_len] = [{self.min_len}, "
                             f"{self.max_len}], got {length}")
        return length

    def _draw_many(self, n: int, g: torch.Generator, exclude: set, distinct: bool,
                   cap: dict[int, int] | None = None) -> list:
        out, seen, tries = [], set(), 0
        taken = dict.fromkeys(cap, 0) if cap else {}
        while len(out) < n:
            tries += 1
            if tries > 100 * n + 1000:
                raise ValueError(f"could not draw {n} distinct examples; the task is too small")
            key, example = self._draw(g)
            if key in exclude or (distinct and key in seen):
                continue
            if cap:
                length = self._key_length(key)
                if taken[length] >= cap[length]:
                    continue
                taken[length] += 1
            seen.add(key)
            out.append(example)
        return out

    @staticmethod
    def _keys(examples: Iterable) -> set:
        return {tuple(e[0]) for e in examples}

    def _exclude_keys(self, exclude: object) -> set:
        """The keys of the examples in ``exclude``, or an error saying what was expected."""
        if isinstance(exclude, (str, bytes)) or not isinstance(exclude, Iterable):
            raise InputTypeError(f"exclude must be a list of examples (as returned by sample()),"
                                 f" got {type_name(exclude)}")
        exclude = list(exclude)
        if exclude:
            _require_pairs(exclude)
        return self._keys(exclude)

    def sample(self, n: int, seed: int, exclude: Iterable = (),
               max_share: float | None = None) -> list:
        """``n`` distinct examples drawn with ``seed`` (for a held-out test set).

        Args:
            n: how many, a positive int.
            seed: seed of the generator, an int >= 0, so that the same call gives the same
                examples.
            exclude: examples (as returned by `sample`) whose inputs must not appear.
            max_share: None (no limit), or a number in (0, 1]: take at most
                ``floor(max_share * num_problems(length))`` problems of each length, so that a
                test set never takes (nearly) all the problems of a short length and leaves
                training without them. Draws of a length already full are skipped, so the
                lengths are no longer equally frequent.

        Raises:
            ValueError: also when the task has fewer than ``n`` distinct examples left (within
                the share).
        """
        n = require_int("n", n)
        seed = require_int("seed", seed, minimum=0)
        cap = None if max_share is None else _share_caps(self, max_share, n)
        g = torch.Generator().manual_seed(seed)
        return self._draw_many(n, g, self._exclude_keys(exclude), distinct=True, cap=cap)

    def batches(self, batch_size: int, seed: int, exclude: Iterable = (),
                pad_to: int = 0, device: str | torch.device | None = None) -> Iterator:
        """An endless stream of fresh random batches, none containing an input in ``exclude``,
        each padded to at least ``pad_to`` positions (see `pad_sequences`) and put on
        ``device`` (a str or `torch.device`; None: the CPU). The examples are drawn on the
        CPU, so a seed gives the same batches on every device. The arguments (``batch_size`` a
        positive int, ``seed`` and ``pad_to`` ints >= 0, a device present here) are checked
        here, when the stream is made, not when the first batch is drawn.
        """
        batch_size = require_int("batch_size", batch_size)
        seed = require_int("seed", seed, minimum=0)
        pad_to = require_int("pad_to", pad_to, minimum=0)
        device = None if device is None else resolve_device(device)
        return self._stream(batch_size, seed, self._exclude_keys(exclude), pad_to, device)

    def _stream(self, batch_size: int, seed: int, keys: set, pad_to: int,
                device: torch.device | None) -> Iterator:
        g = torch.Generator().manual_seed(seed)
        while True:
            examples = self._draw_many(batch_size, g, keys, distinct=False)
            yield self.collate(examples, pad_to, device)

    def collate(self, examples: Sequence, pad_to: int = 0,
                device: str | torch.device | None = None):  # pragma: no cover - per task
        raise NotImplementedError


def _randint(low: int, high: int, g: torch.Generator, size: int | None = None):
    """Integers in [low, high] (both included)."""
    if size is None:
        return int(torch.randint(low, high + 1, (1,), generator=g))
    return torch.randint(low, high + 1, (size,), generator=g).tolist()


class ReversalTask(_Task):
    """Reverse a sequence of ``min_len`` to ``max_len`` symbols drawn from ``num_symbols``.

    An example is a pair ``(source, target)`` of id lists without specials, e.g. with the default
    symbols ``"0"`` to ``"9"``: source ``3 7 7 1`` -> target ``1 7 7 3``.

    Args:
        min_len, max_len: the range of lengths, both included.
        num_symbols: the alphabet size, from 2 to 26; the symbols are ``"0"``... or ``"a"``...
    """

    def __init__(self, min_len: int = 3, max_len: int = 12, num_symbols: int = 10):
        min_len, max_len = _require_lengths(min_len, max_len, 1)
        num_symbols = require_int("num_symbols", num_symbols, minimum=2)
        if num_symbols > 26:
            raise ValueError(f"num_symbols must be at most 26, got {num_symbols}")
        self.min_len, self.max_len, self.num_symbols = min_len, max_len, num_symbols
        symbols = [str(i) for i in range(10)] if num_symbols <= 10 else [
            chr(ord("a") + i) for i in range(26)]
        self.vocab = Vocab.from_symbols(symbols[:num_symbols])

    def _draw(self, g):
        n = _randint(self.min_len, self.max_len, g)
        src = tuple(_randint(len(SPECIALS), len(self.vocab) - 1, g, size=n))
        return src, (src, src[::-1])

    def num_problems(self, length: int) -> int:
        """``num_symbols ** length`` sources of that length."""
        return self.num_symbols ** self._require_length(length)

    def collate(self, examples: Sequence[tuple[Sequence[int], Sequence[int]]],
                pad_to: int = 0, device: str | torch.device | None = None) -> Seq2SeqBatch:
        """(source, target) pairs -> a padded `Seq2SeqBatch` on ``device`` (None: the CPU); an
        empty list raises."""
        return Seq2SeqBatch.from_pairs(examples, pad_to, device)


class SortingTask(_Task):
    """Sort digits, written as text for a decoder-only language model.

    An example is the id list of ``<bos> 3 9 1 > 1 3 9 <eos>``: the prompt runs up to and
    including ``>``, the answer is the rest. Only the answer is scored.

    Args:
        min_len, max_len: how many digits to sort, both included.
        num_digits: the digits are ``"0"`` to ``str(num_digits - 1)`` (at most 10).
        distinct: draw the digits of a problem without repetition (then ``max_len`` can be at
            most ``num_digits``); with repetition, the model must also count repeated digits.
    """

    SEP = ">"

    def __init__(self, min_len: int = 2, max_len: int = 8, num_digits: int = 10,
                 distinct: bool = False):
        min_len, max_len = _require_lengths(min_len, max_len, 1)
        num_digits = require_int("num_digits", num_digits, minimum=2)
        require_bool("distinct", distinct)
        if num_digits > 10:
            raise ValueError(f"num_digits must be at most 10, got {num_digits}")
        if distinct and max_len > num_digits:
            raise ValueError(f"with distinct digits, max_len must be at most num_digits="
                             f"{num_digits}, got {max_len}")
        self.min_len, self.max_len, self.num_digits = min_len, max_len, num_digits
        self.distinct = distinct
        self.vocab = Vocab.from_symbols([str(i) for i in range(num_digits)] + [self.SEP])
        self.sep_id = self.vocab.index[self.SEP]

    def _draw(self, g):
        n = _randint(self.min_len, self.max_len, g)
        if self.distinct:
            chosen = torch.randperm(self.num_digits, generator=g)[:n]
            digits = [len(SPECIALS) + int(d) for d in chosen]
        else:
            digits = _randint(len(SPECIALS), len(SPECIALS) + self.num_digits - 1, g, size=n)
        prompt = (BOS, *digits, self.sep_id)
        return prompt, (prompt, tuple(sorted(digits)) + (EOS,))

    @staticmethod
    def _keys(examples):
        return {tuple(p) for p, _ in examples}

    @staticmethod
    def _key_length(key):
        return len(key) - 2  # without <bos> and >

    def num_problems(self, length: int) -> int:
        """Prompts of ``length`` digits: ``num_digits ** length``, or with distinct digits
        ``num_digits! / (num_digits - length)!`` (the order of the prompt counts)."""
        length = self._require_length(length)
        if self.distinct:
            return math.perm(self.num_digits, length)
        return self.num_digits ** length

    def collate(self, examples: Sequence[tuple[Sequence[int], Sequence[int]]],
                pad_to: int = 0, device: str | torch.device | None = None) -> LMBatch:
        """(prompt, answer) pairs -> an `LMBatch` whose targets score only the answers, on
        ``device`` (None: the CPU); an empty list raises."""
        _require_pairs(examples)
        pad_to = require_int("pad_to", pad_to, minimum=0)
        device = None if device is None else resolve_device(device)
        full = [[*p, *a] for p, a in examples]
        tokens, real = pad_sequences(full, pad_to=pad_to + 1 if pad_to else 0)
        inputs, targets = tokens[:, :-1], tokens[:, 1:].clone()
        for row, (p, _) in enumerate(examples):
            targets[row, : len(p) - 1] = PAD  # predicting the prompt is not the task
        batch = LMBatch(inputs, targets, real[:, :-1])
        return batch if device is None else batch.to(device)


class MissingDigitTask(_Task):
    """Masked-token prediction for an encoder-only model: which digit is missing?

    Each example is a shuffled arrangement of the digits ``0`` to ``n - 1``, each exactly once,
    for n from ``min_len`` to ``max_len``, with one of them replaced by ``<mask>``, e.g.
    ``3 0 <mask> 1 4`` (the hidden digit is ``2``). The answer is the one digit of ``0..n-1`` that
    no visible token shows, so the model must take in the whole sequence, on both sides of the
    mask, and must not mistake padding for tokens: it needs bidirectional attention and the
    padding mask.

    An example is ``(inputs, targets)``: ids of equal length, targets ``PAD`` everywhere but at the
    hidden position. Held-out examples are held out by their unmasked sequence.
    """

    MASK = "<mask>"

    def __init__(self, min_len: int = 4, max_len: int = 10):
        min_len, max_len = _require_lengths(min_len, max_len, 2)
        if max_len > 10:
            raise ValueError(f"max_len must be at most 10 (the digits 0-9), got {max_len}")
        self.min_len, self.max_len = min_len, max_len
        self.vocab = Vocab.from_symbols([str(i) for i in range(10)] + [self.MASK])
        self.mask_id = self.vocab.index[self.MASK]

    def _draw(self, g):
        n = _randint(self.min_len, self.max_len, g)
        seq = [len(SPECIALS) + int(d) for d in torch.randperm(n, generator=g)]
        hidden = _randint(0, n - 1, g)
        inputs, targets = list(seq), [PAD] * n
        inputs[hidden], targets[hidden] = self.mask_id, seq[hidden]
        return tuple(seq), (tuple(inputs), tuple(targets))

    @staticmethod
    def _keys(examples):
        # The problem is the unmasked sequence, whichever of its tokens is hidden.
        return {tuple(y if y != PAD else x for x, y in zip(xs, ys, strict=True))
                for xs, ys in examples}

    def num_problems(self, length: int) -> int:
        """``length!`` orders of the digits 0 to length - 1 (whichever one is hidden)."""
        return math.factorial(self._require_length(length))

    def collate(self, examples: Sequence[tuple[Sequence[int], Sequence[int]]],
                pad_to: int = 0, device: str | torch.device | None = None) -> MLMBatch:
        """(inputs, targets) pairs of equal lengths -> a padded `MLMBatch` on ``device``
        (None: the CPU); an empty list raises."""
        _require_pairs(examples)
        device = None if device is None else resolve_device(device)
        for i, (x, y) in enumerate(examples):
            if len(x) != len(y):
                raise ValueError(f"examples[{i}] has {len(x)} inputs but {len(y)} targets; "
                                 "they must be equally long")
        inputs, mask = pad_sequences([x for x, _ in examples], pad_to=pad_to)
        targets, _ = pad_sequences([y for _, y in examples], max_len=inputs.shape[1])
        batch = MLMBatch(inputs, targets, mask)
        return batch if device is None else batch.to(device)
