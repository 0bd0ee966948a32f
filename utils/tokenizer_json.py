"""Hugging Face's ``tokenizer.json`` read into the book's BPE, and chat templates applied by hand.

A ``tokenizer.json`` (the file of the ``tokenizers`` library, and of most checkpoints published
since 2020) holds the whole pipeline: a model (here BPE: its vocabulary and its ranked merges),
a pre-tokenizer that cuts the text before the merges, a decoder, added and special tokens and a
post-processor that may put a token such as ``<s>`` in front. Two styles cover the BPE models
one meets:

- byte level (GPT-2, Llama 3, Qwen): each byte of a pre-token becomes one printable character of
  GPT-2's table (`utils.tokenizer.BYTE_TO_CHAR`), so no text is unknown. GPT-2 cuts with its own
  regular expression inside ``ByteLevel``; Llama 3 cuts first with a ``Split`` of its own pattern
  and then calls ``ByteLevel(use_regex=False)``.
- Metaspace (SentencePiece's style, Llama 2, Mistral): spaces become "▁" (U+2581), one "▁" may be
  put in front of the text (``prepend_scheme``), and a character the vocabulary lacks becomes its
  UTF-8 bytes as the tokens ``<0x41>``... when the model has ``byte_fallback``. Llama 2's
  converted files do the same with a normalizer instead (``Prepend("▁")``, then ``Replace`` of
  " " by "▁") and no pre-tokenizer.

Added tokens are found first: those marked ``normalized: false`` (the special ones) in the raw
text, the others in the text once normalized, as ``tokenizers`` does. `load_tokenizer_json(path)`
reads the file into a `JsonTokenizer`, with ``encode``, ``decode``, ``token_to_id`` and
``vocab_size``, using the merge loop of `utils.tokenizer`. What the reader does not implement
(another model type, another normalizer, a dropout) is refused with a ValueError that names the
component and the file, never run approximately. `apply_chat_template` writes the
turns of a conversation in Llama 3's format, as a checkpoint's Jinja ``chat_template`` does.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

import regex

from ._validation import InputTypeError, type_name
from .tokenizer import (
    BYTE_TO_CHAR,
    CHAR_TO_BYTE,
    GPT2_PATTERN,
    _apply_merges,
    _check_ids,
    _check_merges,
    _utf8,
)

__all__ = ["JsonTokenizer", "load_tokenizer_json", "apply_chat_template", "LLAMA3_CHAT_TEMPLATE"]

_GPT2 = regex.compile(GPT2_PATTERN)
Step = Callable[[list[str], bool], list[str]]  # pre-tokens -> pre-tokens; True: text starts here
Normalizer = Callable[[str], str]
Splitter = tuple[regex.Pattern | None, list[int]]  # finds added tokens; the id of each group


def _refuse(path: Path, what: str, value: object) -> ValueError:
    return ValueError(f"{path}: {what} {value!r} is not supported by this reader")


def _kind(component: dict, path: Path, where: str) -> str:
    if not isinstance(component, dict) or "type" not in component:
        raise ValueError(f"{path}: {where} must be an object with a 'type', got {component!r}")
    return component["type"]


def _byte_level(add_prefix_space: bool, use_regex: bool) -> Step:
    """Each pre-token (with a space put in front if asked) cut by GPT-2's pattern, as byte chars."""

    def step(pieces: list[str], _start: bool) -> list[str]:
        out = []
        for piece in pieces:
            if add_prefix_space and not piece.startswith(" "):
                piece = " " + piece
            for part in _GPT2.findall(piece) if use_regex else [piece]:
                out.append("".join(BYTE_TO_CHAR[b] for b in _utf8(part)))
        return out

    return step


def _split(pattern: regex.Pattern) -> Step:
    """``Split(behavior="Isolated")``: the matches and the text between them, each a pre-token."""

    def step(pieces: list[str], _start: bool) -> list[str]:
        out = []
        for piece in pieces:
            at = 0
            for match in pattern.finditer(piece):
                out += [p for p in (piece[at : match.start()], match.group()) if p]
                at = match.end()
            if at < len(piece):
                out.append(piece[at:])
        return out

    return step


def _metaspace(replacement: str, scheme: str, split: bool) -> Step:
    """Spaces become ``replacement``; one is put in front (always, or where the text starts)."""
    cut = regex.compile(
        f"{regex.escape(replacement)}[^{regex.escape(replacement)}]*|[^"
        f"{regex.escape(replacement)}]+"
    )

    def step(pieces: list[str], start: bool) -> list[str]:
        out = []
        for number, piece in enumerate(pieces):
            piece = piece.replace(" ", replacement)
            first = scheme == "always" or (scheme == "first" and start and number == 0)
            if first and not piece.startswith(replacement):
                piece = replacement + piece
            out += cut.findall(piece) if split else [piece]
        return out

    return step


def _pre_tokenizer(spec: dict | None, path: Path) -> list[Step]:
    """The steps of the file's ``pre_tokenizer`` (none when it is null)."""
    if spec is None:
        return []
    kind = _kind(spec, path, "pre_tokenizer")
    if kind == "Sequence":
        return [s for inner in spec["pretokenizers"] for s in _pre_tokenizer(inner, path)]
    if kind == "ByteLevel":
        return [_byte_level(spec.get("add_prefix_space", False), spec.get("use_regex", True))]
    if kind == "Metaspace":
        scheme = spec.get("prepend_scheme", "always")
        if scheme not in ("always", "first", "never"):
            raise _refuse(path, "Metaspace prepend_scheme", scheme)
        return [_metaspace(spec.get("replacement", "▁"), scheme, spec.get("split", True))]
    if kind == "Split":
        if spec.get("behavior") != "Isolated" or spec.get("invert"):
            raise _refuse(path, "Split behavior", (spec.get("behavior"), spec.get("invert", False)))
        pattern = spec["pattern"]
        text = pattern.get("Regex") or regex.escape(pattern.get("String", ""))
        return [_split(regex.compile(text))]
    raise _refuse(path, "pre_tokenizer", kind)


def _byte_level_decode(tokens: list[str]) -> list[str]:
    """Each token's characters mapped back to bytes (a token outside the table: its UTF-8)."""
    data = b"".join(
        bytes(CHAR_TO_BYTE[c] for c in t) if all(c in CHAR_TO_BYTE for c in t) else t.encode()
        for t in tokens
    )
    return [data.decode("utf-8", errors="replace")]


def _byte_fallback_decode(tokens: list[str]) -> list[str]:
    """Runs of ``<0xAB>`` tokens joined into their bytes; invalid UTF-8: one U+FFFD a byte."""
    out, run = [], []
    for token in [*tokens, ""]:
        if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
            run.append(int(token[3:5], 16))
            continue
        if run:
            try:
                out.append(bytes(run).decode("utf-8"))
            except UnicodeDecodeError:
                out += ["\ufffd"] * len(run)
            run = []
        out.append(token)
    return out[:-1]


def _decoder(spec: dict | None, path: Path) -> Callable[[list[str]], list[str]]:
    """The file's ``decoder``: token strings -> strings (joined with "" by the tokenizer)."""
    if spec is None:
        return lambda tokens: [" ".join(tokens)]
    kind = _kind(spec, path, "decoder")
    if kind == "Sequence":
        parts = [_decoder(inner, path) for inner in spec["decoders"]]

        def chain(tokens: list[str]) -> list[str]:
            for part in parts:
                tokens = part(tokens)
            return tokens

        return chain
    if kind == "ByteLevel":
        return _byte_level_decode
    if kind == "ByteFallback":
        return _byte_fallback_decode
    if kind == "Fuse":
        return lambda tokens: ["".join(tokens)]
    if kind == "Replace" and "String" in spec["pattern"]:
        old, new = spec["pattern"]["String"], spec["content"]
        return lambda tokens: [t.replace(old, new) for t in tokens]
    if kind == "Strip":
        char, start, stop = spec["content"], spec["start"], spec["stop"]

        def strip(token: str) -> str:
            for _ in range(start):
                token = token[1:] if token.startswith(char) else token
            for _ in range(stop):
                token = token[:-1] if token.endswith(char) else token
            return token

        return lambda tokens: [strip(t) for t in tokens]
    if kind == "Metaspace":
        mark, keep = spec.get("replacement", "▁"), spec.get("prepend_scheme", "always") == "never"
        return lambda tokens: [  # the first token loses its marks (it received the prefix)
            t.replace(mark, " " if i or keep else "") for i, t in enumerate(tokens)
        ]
    raise _refuse(path, "decoder", kind)


def _post_processor(spec: dict | None, path: Path) -> tuple[list[int], list[int]]:
    """The ids a post-processor puts before and after a single text (none, or a template's)."""
    if spec is None or _kind(spec, path, "post_processor") == "ByteLevel":
        return [], []
    if spec["type"] == "Sequence":  # Llama 3's: ByteLevel (offsets only), then a template
        parts = [_post_processor(inner, path) for inner in spec["processors"]]
        return [i for b, _ in parts for i in b], [i for _, a in reversed(parts) for i in a]
    if spec["type"] != "TemplateProcessing":
        raise _refuse(path, "post_processor", spec["type"])
    before, after, seen = [], [], False
    for item in spec["single"]:
        if "Sequence" in item:
            seen = True
            continue
        ids = spec["special_tokens"][item["SpecialToken"]["id"]]["ids"]
        (after if seen else before).extend(ids)
    return before, after


def _merges(raw: object, path: Path) -> list[tuple[str, str]]:
    """Merges in either format: ``"a b"`` strings (older files) or ``["a", "b"]`` pairs."""
    if not isinstance(raw, list):
        raise ValueError(f"{path}: model.merges must be a list, got {type_name(raw)}")
    merges = []
    for rank, merge in enumerate(raw):
        parts = merge.split(" ") if isinstance(merge, str) else merge
        if (
            not isinstance(parts, list)
            or len(parts) != 2
            or not all(isinstance(p, str) and p for p in parts)
        ):
            raise ValueError(f"{path}: model.merges[{rank}] must be 'a b' or [a, b], got {merge!r}")
        merges.append((parts[0], parts[1]))
    return merges


def _added_splitter(added: list[dict], normalize: Normalizer) -> Splitter:
    """A pattern finding the added tokens (the longest first), each in its own group, taking the
    whitespace before it (``lstrip``) and after it (``rstrip``) as the file asks; and the id of
    each group's token. ``normalize`` is applied to the tokens matched in normalized text."""
    if not added:
        return None, []
    alternatives, ids = [], []
    for token in sorted(added, key=lambda t: len(normalize(t["content"])), reverse=True):
        ids.append(token["id"])
        left = r"\s*" if token.get("lstrip") else ""
        right = r"\s*" if token.get("rstrip") else ""
        alternatives.append(f"({left}{regex.escape(normalize(token['content']))}{right})")
    return regex.compile("|".join(alternatives)), ids


def _cut(text: str, splitter: Splitter) -> Iterator[tuple[str | None, int, bool]]:
    """``text`` cut around the added tokens: (text, 0, whether it starts ``text``) for the text
    between them, (None, id, False) for each token."""
    pattern, ids = splitter
    at = 0
    for match in pattern.finditer(text) if pattern else ():
        yield text[at : match.start()], 0, at == 0
        yield None, ids[match.lastindex - 1], False
        at = match.end()
    yield text[at:], 0, at == 0


def _normalizer(spec: dict | None, path: Path) -> Normalizer:
    """The file's ``normalizer``: those Llama 2's converted files use (Prepend, Replace)."""
    if spec is None:
        return lambda text: text
    kind = _kind(spec, path, "normalizer")
    if kind == "Sequence":
        parts = [_normalizer(inner, path) for inner in spec["normalizers"]]

        def chain(text: str) -> str:
            for part in parts:
                text = part(text)
            return text

        return chain
    if kind == "Prepend":
        return lambda text: spec["prepend"] + text if text else text
    if kind == "Replace" and "String" in spec["pattern"]:
        return lambda text: text.replace(spec["pattern"]["String"], spec["content"])
    raise _refuse(path, "normalizer", kind)


def _check_model(spec: dict, path: Path) -> dict:
    """The file's BPE model, after refusing what this reader does not implement."""
    model = spec.get("model")
    if _kind(model, path, "model") != "BPE":
        raise _refuse(path, "model type", model["type"])
    for key in ("continuing_subword_prefix", "end_of_word_suffix", "dropout"):
        if model.get(key):
            raise _refuse(path, f"model.{key}", model[key])
    if not isinstance(model.get("vocab"), dict):
        raise ValueError(f"{path}: model.vocab must map token strings to ids")
    for token in spec.get("added_tokens") or []:
        if token.get("single_word"):
            raise _refuse(path, "added token with single_word", token["content"])
    return model


class JsonTokenizer:
    """A BPE ``tokenizer.json`` (byte-level or Metaspace style), read by `load_tokenizer_json`.

    ``encode(text)`` gives the ids `tokenizers` gives (``Tokenizer.encode(text).ids``: added
    tokens found first, the rest pre-tokenized and merged, then the post-processor's tokens);
    ``decode(ids)`` gives its ``decode(ids)``, special tokens skipped unless asked.
    """

    def __init__(self, spec: dict, path: Path) -> None:
        model = _check_model(spec, path)
        self._vocab = dict(model["vocab"])
        added = spec.get("added_tokens") or []
        self._added = {t["content"]: t["id"] for t in added}
        self._special_ids = {t["id"] for t in added if t.get("special")}
        self._normalize = _normalizer(spec.get("normalizer"), path)
        raw = [t for t in added if not t.get("normalized", not t.get("special"))]
        # An added token matched in normalized text is matched, and decoded, in its normalized
        # form (with Llama 2's normalizer, "▁" + its content), as tokenizers does.
        tokens = {i: t for t, i in self._vocab.items()}
        tokens.update({t["id"]: self._normalize(t["content"]) for t in added if t not in raw})
        tokens.update({t["id"]: t["content"] for t in raw})
        self._tokens = [tokens.get(i, "") for i in range(max(tokens) + 1)]
        try:
            self._ranks, _ = _check_merges(_merges(model.get("merges", []), path), self._vocab)
        except ValueError as error:
            raise ValueError(f"{path}: model.merges: {error}") from None
        self._raw = _added_splitter(raw, lambda text: text)
        self._normalized = _added_splitter([t for t in added if t not in raw], self._normalize)
        self._steps = _pre_tokenizer(spec.get("pre_tokenizer"), path)
        self._decoder = _decoder(spec.get("decoder"), path)
        self._before, self._after = _post_processor(spec.get("post_processor"), path)
        unk = model.get("unk_token")
        self._unk = None if unk is None else self._vocab.get(unk, self._added.get(unk))
        self._fuse_unk, self._byte_fallback = model.get("fuse_unk"), model.get("byte_fallback")
        self._ignore_merges = model.get("ignore_merges", False)
        self._cache: dict[str, tuple[int, ...]] = {}

    @property
    def vocab_size(self) -> int:
        """The number of ids, added tokens included: ids lie in [0, vocab_size)."""
        return len(self._tokens)

    @property
    def special_tokens(self) -> dict[str, int]:
        """The special added tokens and their ids."""
        return {t: i for t, i in self._added.items() if i in self._special_ids}

    def token_to_id(self, token: str) -> int:
        """The id of a token string (of the vocabulary or an added token)."""
        found = self._added.get(token, self._vocab.get(token))
        if found is None:
            raise ValueError(f"unknown token {token!r}")
        return found

    def id_to_token(self, index: int) -> str:
        """The token string of an id."""
        return self._tokens[_check_ids([index], len(self._tokens))[0]]

    def _symbols(self, piece: str) -> list[int]:
        """A pre-token's starting ids: its characters, bytes ``<0xAB>`` or unknown for others."""
        ids, unknown = [], False
        for char in piece:
            if char in self._vocab:
                ids.append(self._vocab[char])
                unknown = False
                continue
            if self._byte_fallback:
                found = [self._vocab.get(f"<0x{b:02X}>") for b in _utf8(char)]
                if None not in found:
                    ids += found
                    unknown = False
                    continue
            if self._unk is not None and not (self._fuse_unk and unknown):
                ids.append(self._unk)
            unknown = self._unk is not None
        return ids

    def _word(self, piece: str) -> tuple[int, ...]:
        found = self._cache.get(piece)
        if found is None:
            if self._ignore_merges and piece in self._vocab:
                found = (self._vocab[piece],)
            else:
                found = tuple(_apply_merges(self._symbols(piece), self._ranks))
            self._cache[piece] = found
        return found

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The ids of ``text``, with the post-processor's tokens unless ``add_special_tokens``
        is False (as ``apply_chat_template`` asks: the template writes them itself)."""
        if not isinstance(text, str):
            raise InputTypeError(f"text must be a str, got {type_name(text)}")
        ids: list[int] = []
        for raw, index, start in _cut(text, self._raw):  # tokens matched in the raw text,
            if raw is None:
                ids.append(index)
                continue
            for part, index, first in _cut(self._normalize(raw), self._normalized):  # then
                if part is None:  # those matched once it is normalized (tokenizers' order)
                    ids.append(index)
                elif part:
                    self._encode_text(part, start and first, ids)
        if add_special_tokens:
            ids = self._before + ids + self._after
        return ids

    def _encode_text(self, part: str, start: bool, ids: list[int]) -> None:
        """Append the ids of text between added tokens (``start``: it begins the whole text)."""
        pieces = [part]
        for step in self._steps:
            pieces = step(pieces, start)
        for piece in pieces:
            ids.extend(self._word(piece))

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """The text of ``ids``, through the file's decoder; special tokens skipped by default."""
        ids = _check_ids(ids, len(self._tokens))
        special = self._special_ids if skip_special_tokens else set()
        return "".join(self._decoder([self._tokens[i] for i in ids if i not in special]))


def load_tokenizer_json(path: str | Path) -> JsonTokenizer:
    """Read a ``tokenizer.json`` with a BPE model; anything this reader lacks is refused."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"no such file: {path}")
    try:
        spec = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from None
    if not isinstance(spec, dict) or "model" not in spec:
        raise ValueError(f"{path}: no 'model' key: not a tokenizers file")
    return JsonTokenizer(spec, path)


# Llama 3's template (its Instruct checkpoints' tokenizer_config.json), which the test compares
# against `apply_chat_template` in transformers; the function below writes the same by hand.
LLAMA3_CHAT_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)


def apply_chat_template(
    messages: Sequence[dict],
    *,
    bos_token: str = "<|begin_of_text|>",
    add_generation_prompt: bool = False,
) -> str:
    """A conversation in Llama 3's chat format: the beginning-of-text token once, then each turn
    as ``<|start_header_id|>role<|end_header_id|>`` + two newlines + its text with the
    whitespace around it removed + ``<|eot_id|>``; with ``add_generation_prompt``, the header of
    the assistant's next turn, which the model then completes."""
    if isinstance(messages, (str, dict)) or not isinstance(messages, Sequence):
        raise InputTypeError(f"messages must be a list of dicts, got {type_name(messages)}")
    text = []
    for number, message in enumerate(messages):
        if not isinstance(message, dict) or not {"role", "content"} <= message.keys():
            raise ValueError(f"message {number} must be a dict with 'role' and 'content'")
        head = bos_token if number == 0 else ""
        role, content = message["role"], message["content"].strip()
        text.append(f"{head}<|start_header_id|>{role}<|end_header_id|>\n\n{content}<|eot_id|>")
    if add_generation_prompt:
        text.append("<|start_header_id|>assistant<|end_header_id|>\n\n")
    return "".join(text)
