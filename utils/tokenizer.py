"""Byte-level byte-pair encoding (BPE), GPT-2's tokenizer, built from scratch.

Text becomes ids in three steps. The text is cut into pre-tokens by GPT-2's regular expression
(`pretokenize`: words with their leading space, numbers, runs of punctuation, whitespace). Each
pre-token is turned into its UTF-8 bytes, one starting token per byte, so that no text is ever
unknown. Then the learned merges are applied inside each pre-token, the merge of lowest rank
first, until none applies.

`train_bpe` learns the merges from a corpus; `ByteBPETokenizer` applies them, and reads and writes
GPT-2's two files: ``vocab.json`` (token string -> id) and ``merges.txt`` (``#version: 0.2``,
then one merge ``"a b"`` per line, by rank). A token is written as a string by mapping each of
its bytes to one printable character (`BYTE_TO_CHAR`, the table of GPT-2's files), so the same
files load into Hugging Face's ``tokenizers`` and give the same ids: the tests prove it.

Shapes: ``encode(text)`` gives a list of L ints in [0, vocab_size); ``decode(ids)`` takes any
sequence of such ints (a list, a tuple, a 1-D tensor or array). Bad input raises `ValueError`
(`utils._validation.InputTypeError`, also a `TypeError`, for an argument of the wrong type).
"""

from __future__ import annotations

import heapq
import json
import numbers
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path

import regex

from ._validation import InputTypeError, require_int, type_name

__all__ = [
    "GPT2_PATTERN",
    "BYTE_TO_CHAR",
    "CHAR_TO_BYTE",
    "bytes_to_unicode",
    "pretokenize",
    "train_bpe",
    "ByteBPETokenizer",
]

GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_PRETOKEN = regex.compile(GPT2_PATTERN)
MERGES_HEADER = "#version: 0.2"
VOCAB_FILE, MERGES_FILE = "vocab.json", "merges.txt"


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's table from each of the 256 byte values to one printable character.

    A byte that is a visible Latin-1 character stands for itself; the 68 others (controls, the
    space, the no-break space, the soft hyphen) take the characters from U+0100 on, in the order
    of their byte values, so that the space (byte 32, the 33rd of them) becomes 'Ġ' (U+0120).
    """
    table, spare = {}, 256
    for byte in range(256):  # visible in Latin-1: '!' to '~', '¡' to '¬', '®' to 'ÿ'
        if 0x21 <= byte <= 0x7E or 0xA1 <= byte <= 0xAC or 0xAE <= byte <= 0xFF:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(spare)
            spare += 1
    return table


BYTE_TO_CHAR: tuple[str, ...] = tuple(bytes_to_unicode()[b] for b in range(256))
CHAR_TO_BYTE: dict[str, int] = {c: b for b, c in enumerate(BYTE_TO_CHAR)}


def pretokenize(text: str) -> list[str]:
    """Cut ``text`` into GPT-2's pre-tokens; they join back to ``text`` exactly."""
    if not isinstance(text, str):
        raise InputTypeError(f"text must be a str, got {type_name(text)}")
    return _PRETOKEN.findall(text)


def _utf8(piece: str) -> bytes:
    """``piece`` in UTF-8; a lone surrogate (which has no UTF-8 form) raises a clear ValueError."""
    try:
        return piece.encode("utf-8")
    except UnicodeEncodeError as error:
        bad = piece[error.start : error.end]
        raise ValueError(f"text must be valid Unicode, got the lone surrogate {bad!r}") from None


def _merge_word(word: list[int], pair: tuple[int, int], new_id: int) -> list[int]:
    """Replace each occurrence of ``pair`` in ``word``, from left to right, by ``new_id``."""
    first, second = pair
    out, i, n = [], 0, len(word)
    while i < n:
        if i + 1 < n and word[i] == first and word[i + 1] == second:
            out.append(new_id)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return out


def _adjacent(word: Sequence[int]) -> Iterable[tuple[int, int]]:
    """The adjacent pairs of ``word``, left to right."""
    return zip(word, word[1:], strict=False)


class _MergeLearner:
    """The state of BPE training: the distinct pre-tokens as token ids, and the pair counts.

    ``counts[pair]`` is how often ``pair`` occurs, adjacent, in the corpus (each pre-token
    weighted by its frequency); ``where[pair]`` holds the pre-tokens it may occur in. A merge
    updates only those pre-tokens and the counts of the pairs they gain and lose, so a merge
    costs time in proportion to the pre-tokens it touches, not to the corpus.
    """

    def __init__(self, word_counts: dict[bytes, int]) -> None:
        self.token_bytes = [bytes([b]) for b in range(256)]
        self.ids = {data: i for i, data in enumerate(self.token_bytes)}
        self.words = [list(word) for word in word_counts]
        self.freqs = list(word_counts.values())
        self.counts: Counter[tuple[int, int]] = Counter()
        self.where: defaultdict[tuple[int, int], set[int]] = defaultdict(set)
        for index, (word, freq) in enumerate(zip(self.words, self.freqs, strict=True)):
            for pair in _adjacent(word):
                self.counts[pair] += freq
                self.where[pair].add(index)
        self.heap = [self._entry(pair, count) for pair, count in self.counts.items()]
        heapq.heapify(self.heap)

    def _entry(self, pair: tuple[int, int], count: int) -> tuple:
        """Heap order: the highest count first, then the smallest (first, second) bytes."""
        return (-count, self.token_bytes[pair[0]], self.token_bytes[pair[1]], pair)

    def best(self) -> tuple[tuple[int, int], int] | None:
        """The pair to merge next and its count, or None when no pair is left.

        Heap entries go stale when counts change; each change pushes a fresh entry, and an
        entry is used only if its count is still the pair's count.
        """
        while self.heap:
            negative, _, _, pair = self.heap[0]
            if self.counts.get(pair, 0) == -negative:
                return pair, -negative
            heapq.heappop(self.heap)
        return None

    def merge(self, pair: tuple[int, int]) -> int:
        """Merge ``pair`` everywhere, update the counts, and return the merged token's id."""
        data = self.token_bytes[pair[0]] + self.token_bytes[pair[1]]
        new_id = self.ids.get(data)
        if new_id is None:  # the same bytes may already be a token, made by another merge
            new_id = len(self.token_bytes)
            self.token_bytes.append(data)
            self.ids[data] = new_id
        change: Counter[tuple[int, int]] = Counter()
        for index in self.where.pop(pair, ()):
            old = self.words[index]
            new = _merge_word(old, pair, new_id)
            if len(new) == len(old):
                continue
            freq = self.freqs[index]
            for gone in _adjacent(old):
                change[gone] -= freq
            for gained in _adjacent(new):
                change[gained] += freq
                self.where[gained].add(index)
            self.words[index] = new
        for changed, delta in change.items():
            if delta:
                count = self.counts[changed] + delta
                if count:
                    self.counts[changed] = count
                    heapq.heappush(self.heap, self._entry(changed, count))
                else:
                    del self.counts[changed]
        self.counts.pop(pair, None)  # no occurrence is left (already 0): never chosen again
        return new_id


def _check_specials(special_tokens: object) -> tuple[str, ...]:
    """Special tokens must be distinct, non-empty strings."""
    if isinstance(special_tokens, str) or not isinstance(special_tokens, Iterable):
        raise InputTypeError(f"special_tokens must be a list of str: {type_name(special_tokens)}")
    specials = tuple(special_tokens)
    for token in specials:
        if not isinstance(token, str) or not token:
            raise ValueError(f"each special token must be a non-empty str, got {token!r}")
    if len(set(specials)) != len(specials):
        raise ValueError(f"special tokens must be distinct, got {list(specials)}")
    return specials


def _special_splitter(specials: Sequence[str]) -> regex.Pattern | None:
    """A pattern that finds the special tokens, the longest first where they overlap."""
    if not specials:
        return None
    ordered = sorted(specials, key=len, reverse=True)
    return regex.compile("(" + "|".join(regex.escape(s) for s in ordered) + ")")


def _split_specials(text: str, splitter: regex.Pattern | None) -> list[str]:
    """``text`` cut around special tokens: the odd items (1, 3, ...) are the special tokens."""
    return [text] if splitter is None else splitter.split(text)


def _count_pretokens(texts: object, specials: Sequence[str]) -> dict[bytes, int]:
    """How often each pre-token occurs in ``texts`` (outside special tokens), as UTF-8 bytes."""
    if isinstance(texts, str):
        texts = [texts]
    elif not isinstance(texts, Iterable):
        raise InputTypeError(f"texts must be a str or an iterable of str, got {type_name(texts)}")
    splitter = _special_splitter(specials)
    counts: Counter[str] = Counter()
    for number, text in enumerate(texts):
        if not isinstance(text, str):
            raise InputTypeError(f"texts must hold str, got {type_name(text)} at item {number}")
        for part in _split_specials(text, splitter)[::2]:
            counts.update(_PRETOKEN.findall(part))
    return {_utf8(piece): count for piece, count in counts.items()}


def train_bpe(
    texts: str | Iterable[str],
    vocab_size: int,
    *,
    min_frequency: int = 2,
    special_tokens: Iterable[str] = (),
) -> ByteBPETokenizer:
    """Learn a byte-level BPE vocabulary of ``vocab_size`` tokens from ``texts``.

    The vocabulary starts with the 256 bytes (id = byte value). The pre-tokens of the corpus are
    counted once; then the most frequent adjacent pair of tokens (inside a pre-token, weighted by
    its count) is merged into a new token, again and again. Ties: among pairs of equal count,
    the pair whose (first, second) byte strings are smallest, compared as a tuple
    lexicographically (so (b"a", b"z") wins over (b"b", b"a"), and (b"a", b"b") over
    (b"a", b"c")). Special tokens, if any, take the last ids and are never merged or split;
    the text inside them is not counted.

    Args:
        texts: one str, or an iterable of str (documents counted separately, never joined).
        vocab_size: the number of tokens wanted, specials included: at least 256 + their number.
        min_frequency: training stops early, with a smaller vocabulary, when the best pair
            occurs fewer times than this (or when no pair is left).
        special_tokens: strings such as ``"<|endoftext|>"`` kept as single tokens.

    Returns:
        a `ByteBPETokenizer` whose merges are ranked in the order they were learned.
    """
    specials = _check_specials(special_tokens)
    vocab_size = require_int("vocab_size", vocab_size, minimum=256 + len(specials))
    min_frequency = require_int("min_frequency", min_frequency, minimum=1)
    learner = _MergeLearner(_count_pretokens(texts, specials))
    merges = []
    while len(learner.token_bytes) < vocab_size - len(specials):
        best = learner.best()
        if best is None or best[1] < min_frequency:
            break
        merges.append(best[0])
        learner.merge(best[0])
    names = ["".join(BYTE_TO_CHAR[b] for b in data) for data in learner.token_bytes]
    vocab = {name: i for i, name in enumerate(names)}
    vocab.update({token: len(names) + i for i, token in enumerate(specials)})
    return ByteBPETokenizer(vocab, [(names[a], names[b]) for a, b in merges], specials)


def _check_vocab(vocab: object) -> list[str]:
    """The token of each id; ids must be exactly 0 .. len(vocab) - 1, all 256 bytes present."""
    if not isinstance(vocab, dict):
        raise InputTypeError(f"vocab must be a dict from token str to id, got {type_name(vocab)}")
    by_id: dict[int, str] = {}
    for token, index in vocab.items():
        if not isinstance(token, str) or isinstance(index, bool) or not isinstance(index, int):
            raise ValueError(f"vocab must map str to int, got {token!r}: {index!r}")
        if index in by_id:
            raise ValueError(f"vocab gives id {index} to both {by_id[index]!r} and {token!r}")
        by_id[index] = token
    gaps = sorted(set(range(len(vocab))) - set(by_id))
    if gaps:
        raise ValueError(f"vocab ids must be 0 .. {len(vocab) - 1}, but id {gaps[0]} is missing")
    missing = [b for b in range(256) if BYTE_TO_CHAR[b] not in vocab]
    if missing:
        raise ValueError(
            f"vocab must hold all 256 byte tokens, but {len(missing)} are missing, the first "
            f"{BYTE_TO_CHAR[missing[0]]!r} (byte {missing[0]})"
        )
    return [by_id[i] for i in range(len(vocab))]


def _check_merges(merges: object, vocab: dict[str, int]) -> dict[tuple[int, int], tuple[int, int]]:
    """``{(first id, second id): (rank, merged id)}``; each part and result must be in vocab."""
    if isinstance(merges, str) or not isinstance(merges, Iterable):
        raise InputTypeError(f"merges must be a list of (str, str) pairs, got {type_name(merges)}")
    ranks: dict[tuple[int, int], tuple[int, int]] = {}
    merges = list(merges)
    for rank, merge in enumerate(merges):
        if not (
            isinstance(merge, Sequence)
            and len(merge) == 2
            and all(isinstance(part, str) for part in merge)
        ):
            raise ValueError(f"merge {rank} must be a pair of str, got {merge!r}")
        first, second = merge
        for token in (first, second, first + second):
            if token not in vocab:
                raise ValueError(
                    f"merge {rank} ({first!r}, {second!r}) needs the token {token!r}, which is "
                    "not in the vocabulary"
                )
        pair = (vocab[first], vocab[second])
        if pair in ranks:
            raise ValueError(f"merge {rank} ({first!r}, {second!r}) is listed twice")
        ranks[pair] = (rank, vocab[first + second])
    return ranks, [(first, second) for first, second in merges]


def _token_bytes(token: str, special: bool) -> bytes:
    """The bytes a token stands for: a special token's UTF-8, else its characters mapped back."""
    if special:
        return token.encode("utf-8")
    try:
        return bytes(CHAR_TO_BYTE[c] for c in token)
    except KeyError as error:
        raise ValueError(
            f"the token {token!r} holds {error.args[0]!r}, which is not one of the 256 byte "
            "characters of GPT-2's table (declare it as a special token if it is one)"
        ) from None


def _read_files(vocab_path: str | Path, merges_path: str | Path) -> tuple[dict, list]:
    """The vocabulary and the merges stored in GPT-2's ``vocab.json`` and ``merges.txt``."""
    vocab_path, merges_path = Path(vocab_path), Path(merges_path)
    for path in (vocab_path, merges_path):
        if not path.is_file():
            raise ValueError(f"no such file: {path}")
    try:
        vocab = json.loads(vocab_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"{vocab_path} is not valid JSON: {error}") from None
    merges = []
    for number, line in enumerate(merges_path.read_text(encoding="utf-8").split("\n"), 1):
        line = line.rstrip("\r")
        if not line or (number == 1 and line.startswith("#version")):
            continue
        parts = line.split(" ")
        if len(parts) != 2 or not all(parts):
            raise ValueError(f"{merges_path}, line {number}: expected 'first second', got {line!r}")
        merges.append((parts[0], parts[1]))
    return vocab, merges


def _apply_merges(word: list[int], ranks: dict[tuple[int, int], tuple[int, int]]) -> list[int]:
    """Merge inside one pre-token's ids, the pair of lowest rank first, until none applies."""
    while len(word) > 1:
        found = [(ranks[p][0], p) for p in _adjacent(word) if p in ranks]
        if not found:
            break
        pair = min(found)[1]
        word = _merge_word(word, pair, ranks[pair][1])
    return word


def _check_ids(ids: object, size: int) -> list[int]:
    """``ids`` (a sequence, a 1-D tensor or array) as a list of ints, each in [0, size).

    The usual input, plain ints all in range, is checked in bulk: the set of their types, then
    their min and max (three passes in C). Anything else goes through the loop, which accepts
    other integers (NumPy's) and names the first bad id: a bool, a non-integer, or out of range.
    """
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
        raise InputTypeError(f"ids must be a sequence of int, got {type_name(ids)}")
    ids = ids if type(ids) is list else list(ids)
    if not ids or (set(map(type, ids)) == {int} and min(ids) >= 0 and max(ids) < size):
        return ids
    for position, index in enumerate(ids):
        if isinstance(index, bool) or not isinstance(index, numbers.Integral):
            raise InputTypeError(f"ids must be ints, got {index!r} at position {position}")
        if not 0 <= index < size:
            raise ValueError(f"unknown id {index} at position {position}: not in [0, {size})")
    return [int(i) for i in ids]


def _write_files(
    directory: Path, tokens: list[str], merges: list[tuple[str, str]]
) -> tuple[Path, Path]:
    """Write GPT-2's ``vocab.json`` and ``merges.txt`` into ``directory``; return their paths."""
    directory.mkdir(parents=True, exist_ok=True)
    vocab_path, merges_path = directory / VOCAB_FILE, directory / MERGES_FILE
    vocab = {token: i for i, token in enumerate(tokens)}
    vocab_path.write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    lines = [MERGES_HEADER] + [f"{a} {b}" for a, b in merges]
    merges_path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return vocab_path, merges_path


class ByteBPETokenizer:
    """A byte-level BPE tokenizer: GPT-2's algorithm and file format.

    Args:
        vocab: token string -> id, the ids exactly 0 .. len(vocab) - 1; all 256 byte tokens
            (the characters of `BYTE_TO_CHAR`) must be there, so that any text can be encoded.
        merges: (first, second) token strings, by rank (rank 0 is applied first); both and their
            concatenation must be tokens of ``vocab``.
        special_tokens: tokens of ``vocab`` matched whole in the text before pre-tokenization
            (the longest first where two overlap) and never split.
    """

    def __init__(
        self,
        vocab: dict[str, int],
        merges: Iterable[tuple[str, str]],
        special_tokens: Iterable[str] = (),
    ) -> None:
        self._tokens = _check_vocab(vocab)
        self._vocab = dict(vocab)
        self._ranks, self._merges = _check_merges(merges, self._vocab)
        self._specials = _check_specials(special_tokens)
        for token in self._specials:
            if token not in self._vocab:
                raise ValueError(f"special token {token!r} is not in the vocabulary")
        self._splitter = _special_splitter(self._specials)
        specials = set(self._specials)
        self._bytes = [_token_bytes(t, t in specials) for t in self._tokens]
        self._byte_ids = [self._vocab[c] for c in BYTE_TO_CHAR]
        self._cache: dict[str, tuple[int, ...]] = {}

    @property
    def vocab_size(self) -> int:
        """The number of tokens (specials included); ids lie in [0, vocab_size)."""
        return len(self._tokens)

    @property
    def merges(self) -> list[tuple[str, str]]:
        """The merges, by rank, as (first, second) token strings."""
        return list(self._merges)

    @property
    def special_tokens(self) -> tuple[str, ...]:
        """The special tokens, never split."""
        return self._specials

    def token_to_id(self, token: str) -> int:
        """The id of a token string (as written in vocab.json)."""
        if token not in self._vocab:
            raise ValueError(f"unknown token {token!r}")
        return self._vocab[token]

    def id_to_token(self, index: int) -> str:
        """The token string of an id."""
        return self._tokens[_check_ids([index], len(self._tokens))[0]]

    def clear_cache(self) -> None:
        """Forget the ids remembered for each pre-token already encoded."""
        self._cache.clear()

    def encode(self, text: str) -> list[int]:
        """The ids of ``text``: a list of L ints in [0, vocab_size)."""
        if not isinstance(text, str):
            raise InputTypeError(f"text must be a str, got {type_name(text)}")
        ids: list[int] = []
        cache = self._cache
        for number, part in enumerate(_split_specials(text, self._splitter)):
            if number % 2:
                ids.append(self._vocab[part])
                continue
            for piece in _PRETOKEN.findall(part):
                found = cache.get(piece)
                if found is None:
                    word = [self._byte_ids[b] for b in _utf8(piece)]
                    found = cache[piece] = tuple(_apply_merges(word, self._ranks))
                ids.extend(found)
        return ids

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """The bytes the ids stand for, joined: exact for every byte sequence."""
        return b"".join(map(self._bytes.__getitem__, _check_ids(ids, len(self._tokens))))

    def decode(self, ids: Iterable[int]) -> str:
        """The text of ``ids`` (special tokens written out); invalid UTF-8 becomes U+FFFD."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def save(self, directory: str | Path) -> tuple[Path, Path]:
        """Write ``vocab.json`` and ``merges.txt`` into ``directory``; return their paths."""
        return _write_files(Path(directory), self._tokens, self._merges)

    @classmethod
    def from_files(
        cls, vocab_path: str | Path, merges_path: str | Path, special_tokens: Iterable[str] = ()
    ) -> ByteBPETokenizer:
        """Read GPT-2's ``vocab.json`` and ``merges.txt`` (ours, GPT-2's or `tokenizers`')."""
        vocab, merges = _read_files(vocab_path, merges_path)
        return cls(vocab, merges, special_tokens)

    @classmethod
    def load(cls, directory: str | Path, special_tokens: Iterable[str] = ()) -> ByteBPETokenizer:
        """Read ``vocab.json`` and ``merges.txt`` from ``directory`` (as `save` wrote them)."""
        directory = Path(directory)
        return cls.from_files(directory / VOCAB_FILE, directory / MERGES_FILE, special_tokens)
