"""SentencePiece's ``.model`` file read without its library, and its BPE applied by hand.

A ``.model`` file (Llama 2's ``tokenizer.model``, and many others) is a protocol buffer: a list
of pieces, each a string with a score and a type (normal, unknown, control such as ``<s>``,
user-defined, byte ``<0x41>``), then the trainer's settings and the normalizer's. `read_model`
reads the few fields needed straight from the wire format (`_fields`), so neither
``sentencepiece`` nor ``protobuf`` is needed to use a model, only to prove it equal.

Encoding a BPE model differs from GPT-2's in three ways. The text is normalized first: runs of
spaces become one and the ends are stripped (``remove_extra_whitespaces``), one space is put in
front (``add_dummy_prefix``), and every space becomes "▁". It is not cut into words: the merges
run over the whole text, starting from its characters (a user-defined symbol stays whole). And
the pair merged next is the adjacent pair whose concatenation is the piece of highest score, the
leftmost on ties (a BPE model's scores are minus the merge ranks). A character no piece holds is
unknown, or, with ``byte_fallback``, its UTF-8 bytes as pieces ``<0x..>``.

Only what Llama-style models use is read: model_type BPE and the identity normalizer. A Unigram
model, a precompiled normalization map (the default ``nmt_nfkc``) or whitespace kept as a suffix
is refused with a ValueError naming the field and the file.
"""

from __future__ import annotations

import heapq
import struct
from collections.abc import Iterable, Iterator
from pathlib import Path

from ._validation import InputTypeError, type_name
from .tokenizer import _check_ids

__all__ = ["SentencePieceBPE", "read_model"]

SPACE = "\u2581"  # "▁", which stands for a space inside pieces
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
MODEL_TYPES = {1: "UNIGRAM", 2: "BPE", 3: "WORD", 4: "CHAR"}


def _varint(data: bytes, at: int) -> tuple[int, int]:
    """The base-128 integer starting at ``at`` and the offset after it."""
    value = shift = 0
    while True:
        if at >= len(data):
            raise ValueError("the data ends inside a varint")
        byte = data[at]
        value |= (byte & 0x7F) << shift
        at, shift = at + 1, shift + 7
        if byte < 0x80:
            return value, at


def _fields(data: bytes) -> Iterator[tuple[int, int | bytes]]:
    """Each (field number, value) of one protobuf message: an int for varints and fixed-size
    numbers (as raw little-endian bits), bytes for length-delimited fields (strings, messages)."""
    at = 0
    while at < len(data):
        key, at = _varint(data, at)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, at = _varint(data, at)
        elif wire in (1, 5):
            size = 8 if wire == 1 else 4
            value, at = int.from_bytes(data[at : at + size], "little"), at + size
        elif wire == 2:
            size, at = _varint(data, at)
            value, at = data[at : at + size], at + size
        else:
            raise ValueError(f"unknown wire type {wire} (field {number})")
        if at > len(data):
            raise ValueError(f"the data ends inside field {number}")
        yield number, value


def read_model(path: str | Path) -> dict:
    """The fields of a ``.model`` file that encoding needs: ``pieces`` [(piece, score, type)],
    ``model_type``, ``byte_fallback``, ``unk_surface`` and the normalizer's ``name``,
    ``charsmap`` (bytes), ``add_dummy_prefix``, ``remove_extra_whitespaces``,
    ``escape_whitespaces``, ``treat_whitespace_as_suffix`` (protobuf's defaults where absent)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"no such file: {path}")
    model = dict(pieces=[], model_type=1, byte_fallback=False, unk_surface=" \u2047 ")
    model |= dict(treat_whitespace_as_suffix=False, name="", charsmap=b"", escape_whitespaces=True)
    model |= dict(add_dummy_prefix=True, remove_extra_whitespaces=True)
    # The field numbers of sentencepiece_model.proto: TrainerSpec (field 2), NormalizerSpec (3).
    trainer = {3: "model_type", 24: "treat_whitespace_as_suffix", 35: "byte_fallback"}
    trainer[44] = "unk_surface"
    normalizer = {1: "name", 2: "charsmap", 3: "add_dummy_prefix", 4: "remove_extra_whitespaces"}
    normalizer[5] = "escape_whitespaces"
    try:
        for number, value in _fields(path.read_bytes()):
            if number == 1:  # one piece: 1 the string, 2 the score (float32), 3 the type
                piece = {1: b"", 2: 0, 3: NORMAL} | dict(_fields(value))
                score = struct.unpack("<f", piece[2].to_bytes(4, "little"))[0]
                model["pieces"].append((piece[1].decode("utf-8"), score, piece[3]))
            for wanted, names in ((2, trainer), (3, normalizer)):
                if number == wanted:
                    for field, inner in _fields(value):
                        if field in names:
                            model[names[field]] = inner
    except (ValueError, AttributeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path} is not a SentencePiece model: {error}") from None
    for key in ("unk_surface", "name"):
        if isinstance(model[key], bytes):
            model[key] = model[key].decode("utf-8")
    return model


def _decode_each_byte(data: bytes) -> str:
    """UTF-8 to text, one U+FFFD for each byte that does not start a valid character."""
    out, at = [], 0
    while at < len(data):
        lead = data[at]
        size = 1 if lead < 0x80 else 2 if lead >> 5 == 6 else 3 if lead >> 4 == 14 else 4
        try:
            out.append(data[at : at + size].decode("utf-8"))
            at += size
        except UnicodeDecodeError:
            out.append("\ufffd")
            at += 1
    return "".join(out)


def _check_model(model: dict, path: Path) -> dict:
    """``model``, after refusing what this reader does not implement, naming the field."""
    kind = MODEL_TYPES.get(model["model_type"], model["model_type"])
    types = [t for _, _, t in model["pieces"]]
    checks = [
        ("trainer_spec.model_type", kind, kind != "BPE"),
        ("normalizer_spec.name", model["name"], bool(model["charsmap"])),
        ("trainer_spec.treat_whitespace_as_suffix", True, model["treat_whitespace_as_suffix"]),
        ("a piece of type", "UNUSED", UNUSED in types),
        ("a model without a piece of type", "UNKNOWN", UNKNOWN not in types),
    ]
    for field, value, bad in checks:
        if bad:
            raise ValueError(
                f"{path}: {field} {value!r} is not supported by this reader (only BPE models "
                "with the identity normalizer)"
            )
    return model


class SentencePieceBPE:
    """A SentencePiece BPE model (read by `read_model`): ``encode`` and ``decode`` as
    ``sentencepiece.SentencePieceProcessor`` does them, with no BOS or EOS added."""

    def __init__(self, path: str | Path) -> None:
        model = _check_model(read_model(path), Path(path))
        pieces = model["pieces"]
        self._pieces, self._types = [p for p, _, _ in pieces], [t for _, _, t in pieces]
        merged = (NORMAL, USER_DEFINED)  # the pieces a merge may make; the others are reserved
        self._scores = {p: (s, i) for i, (p, s, t) in enumerate(pieces) if t in merged}
        self._reserved = {p: i for i, (p, _, t) in enumerate(pieces) if t not in merged}
        user = (p for p, _, t in pieces if t == USER_DEFINED)
        self._user = sorted(user, key=len, reverse=True)  # matched whole, the longest first
        self._unk = self._types.index(UNKNOWN)
        self._byte_fallback = bool(model["byte_fallback"])
        self._unk_surface = model["unk_surface"]
        self._dummy, self._squeeze = model["add_dummy_prefix"], model["remove_extra_whitespaces"]
        self._escape = model["escape_whitespaces"]

    @property
    def vocab_size(self) -> int:
        """The number of pieces; ids lie in [0, vocab_size)."""
        return len(self._pieces)

    def piece_to_id(self, piece: str) -> int:
        """The id of a piece (the unknown piece's id for a string that is none)."""
        return self._reserved.get(piece, self._scores.get(piece, (0, self._unk))[1])

    def id_to_piece(self, index: int) -> str:
        """The piece of an id."""
        return self._pieces[_check_ids([index], len(self._pieces))[0]]

    def normalize(self, text: str) -> str:
        """The text as the merges see it: spaces squeezed, one in front, each as "▁"."""
        if self._squeeze:
            text = " ".join(part for part in text.split(" ") if part)
        if text and self._dummy:
            text = " " + text
        return text.replace(" ", SPACE) if self._escape else text

    def _symbols(self, text: str) -> tuple[list[str], list[bool]]:
        """The starting symbols (characters, and user-defined pieces kept whole, which no
        merge may touch) and whether each is such a frozen piece."""
        out, frozen, at = [], [], 0
        while at < len(text):
            user = next((u for u in self._user if text.startswith(u, at)), None)
            out.append(user or text[at])
            frozen.append(user is not None)
            at += len(out[-1])
        return out, frozen

    def encode(self, text: str) -> list[int]:
        """The ids of ``text``: BPE over its normalized characters, the best-scored pair first."""
        if not isinstance(text, str):
            raise InputTypeError(f"text must be a str, got {type_name(text)}")
        symbols, frozen = self._symbols(self.normalize(text))
        after = list(range(1, len(symbols))) + [-1]
        before = list(range(-1, len(symbols) - 1))
        heap: list[tuple[float, int, str, str]] = []

        def push(left: int, right: int) -> None:
            if left < 0 or right < 0 or frozen[left] or frozen[right]:
                return
            found = self._scores.get(symbols[left] + symbols[right])
            if found is not None:
                heapq.heappush(heap, (-found[0], left, symbols[left], symbols[right]))

        for left in range(len(symbols) - 1):
            push(left, left + 1)
        while heap:
            _, left, first, second = heapq.heappop(heap)
            right = after[left]
            if symbols[left] != first or right < 0 or symbols[right] != second:
                continue  # stale: one side has changed since this pair was pushed
            symbols[left], symbols[right] = first + second, ""
            after[left] = after[right]
            if after[right] >= 0:
                before[after[right]] = left
            push(before[left], left)
            push(left, after[left])
        ids, unknown = [], False
        for piece in filter(None, symbols):
            index = self.piece_to_id(piece)
            if index == self._unk and self._byte_fallback:
                ids += [self._reserved[f"<0x{b:02X}>"] for b in piece.encode("utf-8")]
            elif not (index == self._unk and unknown):  # a run of unknowns: one unknown id
                ids.append(index)
            unknown = index == self._unk
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        """The text of ``ids``: control pieces dropped, byte pieces joined into UTF-8, "▁" as a
        space. At the start, the "▁" that ``add_dummy_prefix`` put in front is removed: from
        each piece until one leaves text, or, where extra spaces were kept, from one piece."""
        out, run, seen = [], bytearray(), False
        for index in [*_check_ids(ids, len(self._pieces)), None]:
            kind = None if index is None else self._types[index]
            if kind == BYTE:
                run.append(int(self._pieces[index][3:5], 16))
                continue
            if run:
                out.append(_decode_each_byte(bytes(run)))
                run = bytearray()
            at_start, seen = not (seen or any(out)), False
            if kind in (None, CONTROL):
                continue
            if kind == UNKNOWN:
                out.append(self._unk_surface)
                continue
            piece = self._pieces[index]
            if at_start and (self._dummy or self._squeeze) and piece.startswith(SPACE):
                piece, seen = piece[1:], not self._squeeze
            out.append(piece.replace(SPACE, " "))
        return "".join(out)
