"""Tests for utils.tokenizer (byte-level BPE) and utils.data.book_prose, its corpus.

The proof that the tokenizer is GPT-2's: ours is trained on the book's prose, its files are
loaded into Hugging Face's ``tokenizers`` (BPE model, ByteLevel pre-tokenizer and decoder), and
both give the same ids and the same text on the book's held-out chapter and on hostile text; and
the other way round, a vocabulary trained by ``tokenizers``' own trainer loads into ours and gives
the same ids. Nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import random
from collections import Counter
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAYON_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

import utils.corpus as utils_corpus  # noqa: E402
from utils.data import book_prose, freeze_prose  # noqa: E402
from utils.tokenizer import (  # noqa: E402
    BYTE_TO_CHAR,
    CHAR_TO_BYTE,
    ByteBPETokenizer,
    _merge_word,
    _MergeLearner,
    bytes_to_unicode,
    pretokenize,
    train_bpe,
)

BOOK = Path(__file__).resolve().parent.parent / "book"
HELD_OUT = 13  # the chapter kept out of training, to encode as unseen text
HOSTILE = {
    "empty": "",
    "contractions": "don't I'LL we've she'd they're it's 'tis O'Neil's",
    "digits": "3.14159 2026-11-26 1,000,000 007 ١٢٣ ²³",
    "emoji": "👍 👍🏽 👨‍👩‍👧‍👦 🇫🇷🇯🇵 🏳️‍🌈 ❤️",
    "combining": "e\u0301 n\u0303 a\u030a\u0323 Z\u0351\u0352\u0353",
    "cjk": "日本語のテキストです。中文文本 한국어",
    "right_to_left": "שלום עולם مرحبا بالعالم \u200fabc\u200e",
    "controls": "\x00a\x1b[31mred\x1b[0m\tx\r\ny\x7f\x1c\x1f\x85",
    "spaces": "a     b\n\n\n\n   c \t \n  ",
    "trailing": "trailing spaces   ",
    "unicode_spaces": "a\u00a0b\u2028c\u3000d\u200bz",
    "latin1": bytes(range(256)).decode("latin-1"),
    "code": "def f(x):\n    return x**2  # $\\frac{a}{b}$ {glue:text}`x`",
}


def _hf(vocab_path, merges_path) -> Tokenizer:
    """Hugging Face's GPT-2 pipeline on our files: BPE, ByteLevel pre-tokenizer and decoder."""
    tok = Tokenizer(models.BPE.from_file(str(vocab_path), str(merges_path)))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


@pytest.fixture(scope="module")
def corpus() -> str:
    return book_prose([n for n in range(1, HELD_OUT)])


@pytest.fixture(scope="module")
def samples() -> dict[str, str]:
    return {"held_out_chapter": book_prose([HELD_OUT]), **HOSTILE}


@pytest.fixture(scope="module")
def ours(corpus) -> ByteBPETokenizer:
    return train_bpe(corpus, 800)


# The byte table and pre-tokenization


def test_byte_table_is_a_bijection_onto_printable_characters():
    table = bytes_to_unicode()
    assert sorted(table) == list(range(256)) and len(set(table.values())) == 256
    assert all(c.isprintable() and not c.isspace() and len(c) == 1 for c in table.values())
    assert table[ord("A")] == "A" and table[0xE9] == "é" and table[ord("~")] == "~"
    assert table[32] == "Ġ" and table[10] == "Ċ" and table[0] == "Ā"  # U+0120, U+010A, U+0100
    assert table[0xAD] == "Ń" and max(map(ord, table.values())) == 0x143  # 68 moved bytes
    assert BYTE_TO_CHAR == tuple(table[b] for b in range(256))
    assert all(CHAR_TO_BYTE[table[b]] == b for b in range(256))


def test_pretokenize_cuts_words_numbers_punctuation_and_spaces():
    assert pretokenize("Hello world's  end!!\n") == [
        "Hello",
        " world",
        "'s",
        " ",
        " end",
        "!!",
        "\n",
    ]
    assert pretokenize("I'LL  2024") == ["I", "'", "LL", " ", " 2024"]
    text = HOSTILE["emoji"] + HOSTILE["controls"]
    assert "".join(pretokenize(text)) == text
    with pytest.raises(ValueError, match="text must be a str"):
        pretokenize(b"bytes")


# Training


def test_ties_go_to_the_smallest_pair_of_byte_strings():
    # (a, b) and (b, a) both occur once: the smaller first byte string, b"a", wins...
    assert train_bpe(["ba", "ab"], 257, min_frequency=1).merges == [("a", "b")]
    assert train_bpe(["ab", "ba"], 257, min_frequency=1).merges == [("a", "b")]
    # ... the second byte string decides when the first ones are equal...
    assert train_bpe(["ac", "ab"], 257, min_frequency=1).merges == [("a", "b")]
    # ... and a higher count beats any tie rule.
    assert train_bpe(["ba", "ab", "ba"], 257, min_frequency=1).merges == [("b", "a")]


def test_first_merges_on_a_tiny_corpus_are_the_ones_computed_by_hand():
    # Pre-tokens: "hug", " hug" x2, " pug", " pun", " bun". By hand: (u, g) occurs 4 times;
    # then (h, ug) 3; then three pairs tie at 2, ordered by their byte strings: (" ", "hug"),
    # (" ", "p"), ("u", "n"); then every pair occurs once, under min_frequency=2: stop.
    tok = train_bpe("hug hug hug pug pun bun", 300)
    assert tok.merges == [("u", "g"), ("h", "ug"), ("Ġ", "hug"), ("Ġ", "p"), ("u", "n")]
    assert tok.vocab_size == 256 + 5
    assert tok.encode(" hug pun") == [258, 259, 260]
    assert tok.encode("bug") == [ord("b"), 256]


def test_vocabulary_has_the_size_asked_for(corpus):
    tok = train_bpe(corpus[:20_000], 400, special_tokens=["<|endoftext|>"])
    assert tok.vocab_size == 400 and len(tok.merges) == 400 - 256 - 1
    assert tok.token_to_id("<|endoftext|>") == 399


def _naive_counts(word_counts: dict[bytes, int], merges: list[tuple[int, int]]) -> Counter:
    """The slow reference: re-segment every pre-token with all merges so far, then count."""
    counts: Counter = Counter()
    for data, freq in word_counts.items():
        word = list(data)
        for new_id, pair in enumerate(merges, start=256):
            word = _merge_word(word, pair, new_id)
        for pair in zip(word, word[1:], strict=False):
            counts[pair] += freq
    return counts


def test_incremental_counts_equal_a_full_recount_after_every_merge(corpus):
    pieces = Counter(pretokenize(corpus[:6000] + " aaaa aaa abab"))  # repeats and overlaps
    word_counts = {p.encode(): n for p, n in pieces.items()}
    learner, merges = _MergeLearner(word_counts), []
    for _ in range(80):
        naive = _naive_counts(word_counts, merges)
        assert dict(learner.counts) == dict(naive)
        top = max(naive.values())
        tied = [p for p, n in naive.items() if n == top]
        expected = min(tied, key=lambda p: (learner.token_bytes[p[0]], learner.token_bytes[p[1]]))
        assert learner.best() == (expected, top)
        assert learner.merge(expected) == 256 + len(merges)  # distinct bytes: a new id each time
        merges.append(expected)
    assert dict(learner.counts) == dict(_naive_counts(word_counts, merges))


# Round trips


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_text_round_trips(ours, name):
    text = HOSTILE[name]
    ids = ours.encode(text)
    assert all(isinstance(i, int) and 0 <= i < ours.vocab_size for i in ids)
    assert ours.decode(ids) == text
    assert ours.decode_bytes(ids) == text.encode("utf-8")


def test_decode_bytes_is_exact_for_any_ids(ours):
    byte_ids = [ours.token_to_id(BYTE_TO_CHAR[b]) for b in range(256)]
    assert ours.decode_bytes(byte_ids) == bytes(range(256))
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(ours.vocab_size) for _ in range(rng.randrange(8))]
        expected = b"".join(bytes(CHAR_TO_BYTE[c] for c in ours.id_to_token(i)) for i in ids)
        assert ours.decode_bytes(ids) == expected
        assert ours.decode_bytes(torch.tensor(ids, dtype=torch.long)) == expected
    assert ours.decode([byte_ids[0xFF], byte_ids[ord("a")]]) == "\ufffda"  # not UTF-8


def test_save_and_load_round_trip(ours, tmp_path, samples):
    vocab_path, merges_path = ours.save(tmp_path / "tok")
    lines = merges_path.read_text(encoding="utf-8").splitlines()
    assert lines[0] == "#version: 0.2" and len(lines) == 1 + len(ours.merges)
    assert lines[1] == " ".join(ours.merges[0])
    vocab = json.loads(vocab_path.read_text(encoding="utf-8"))
    assert vocab["Ġ"] == 32 and len(vocab) == ours.vocab_size
    again = ByteBPETokenizer.load(tmp_path / "tok")
    assert again.merges == ours.merges and again.vocab_size == ours.vocab_size
    for text in samples.values():
        assert again.encode(text) == ours.encode(text)


def test_the_cache_changes_nothing(ours, samples):
    text = samples["held_out_chapter"]
    ours.clear_cache()
    cold = ours.encode(text)
    assert ours.encode(text) == cold


# Equal to Hugging Face tokenizers, both ways


@pytest.fixture(scope="module")
def ours_in_hf(ours, tmp_path_factory) -> Tokenizer:
    return _hf(*ours.save(tmp_path_factory.mktemp("ours")))


@pytest.mark.parametrize("name", ["held_out_chapter", *sorted(HOSTILE)])
def test_same_ids_and_text_as_hugging_face(ours, ours_in_hf, samples, name):
    text = samples[name]
    ids = ours.encode(text)
    assert ids == ours_in_hf.encode(text).ids
    assert ours.decode(ids) == ours_in_hf.decode(ids) == text


@pytest.mark.parametrize("name", ["held_out_chapter", *sorted(HOSTILE)])
def test_same_pre_tokens_as_hugging_face(samples, name):
    text = samples[name]
    theirs = pre_tokenizers.ByteLevel(add_prefix_space=False).pre_tokenize_str(text)
    mapped = ["".join(BYTE_TO_CHAR[b] for b in p.encode("utf-8")) for p in pretokenize(text)]
    assert mapped == [piece for piece, _ in theirs]


def test_same_decoding_of_arbitrary_ids_as_hugging_face(ours, ours_in_hf):
    rng = random.Random(1)
    for _ in range(300):
        ids = [rng.randrange(ours.vocab_size) for _ in range(rng.randrange(6))]
        assert ours.decode(ids) == ours_in_hf.decode(ids)  # invalid UTF-8 replaced alike


def test_special_tokens_match_hugging_face_added_tokens(corpus, tmp_path):
    specials = ["<|endoftext|>", "<|end"]  # overlapping: the longest must win
    tok = train_bpe(corpus[:20_000], 320, special_tokens=specials)
    hf = _hf(*tok.save(tmp_path))
    hf.add_special_tokens(specials)
    text = "a<|endoftext|>b <|end x<|endoftext|><|endoftext|> <|end|>"
    ids = tok.encode(text)
    assert ids == hf.encode(text).ids
    assert ids.count(tok.token_to_id("<|endoftext|>")) == 3
    assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=False) == text
    again = ByteBPETokenizer.load(tmp_path, special_tokens=specials)
    assert again.encode(text) == ids


def test_files_written_by_hugging_face_load_into_ours(corpus, samples, tmp_path):
    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=700, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    hf.train_from_iterator([corpus[:60_000]], trainer)
    hf.model.save(str(tmp_path))
    tok = ByteBPETokenizer.load(tmp_path)
    assert tok.vocab_size == hf.get_vocab_size() == 700
    for text in samples.values():
        ids = tok.encode(text)
        assert ids == hf.encode(text).ids
        assert tok.decode(ids) == hf.decode(ids)


# Clear errors


def _tiny_vocab(*extra: str) -> dict[str, int]:
    vocab = {c: i for i, c in enumerate(BYTE_TO_CHAR)}
    vocab.update({t: 256 + i for i, t in enumerate(extra)})
    return vocab


def test_bad_input_raises_clear_errors(ours):
    with pytest.raises(ValueError, match=r"unknown id 800 at position 1: not in \[0, 800\)"):
        ours.decode([5, 800])
    with pytest.raises(ValueError, match="unknown id -1"):
        ours.decode_bytes([-1])
    with pytest.raises(ValueError, match="ids must be ints, got 1.5 at position 0"):
        ours.decode([1.5])
    with pytest.raises(ValueError, match="ids must be ints, got True"):
        ours.decode([True])
    with pytest.raises(ValueError, match="ids must be a sequence of int, got str"):
        ours.decode("abc")
    with pytest.raises(ValueError, match="text must be a str, got bytes"):
        ours.encode(b"abc")
    with pytest.raises(ValueError, match="text must be a str, got NoneType"):
        ours.encode(None)
    with pytest.raises(ValueError, match="lone surrogate"):
        ours.encode("a\ud800b")
    with pytest.raises(ValueError, match="unknown token 'zzzz'"):
        ours.token_to_id("zzzz")


def test_bad_training_arguments_raise(corpus):
    with pytest.raises(ValueError, match="vocab_size must be an int >= 256, got 255"):
        train_bpe("abc", 255)
    with pytest.raises(ValueError, match="vocab_size must be an int >= 257, got 256"):
        train_bpe("abc", 256, special_tokens=["<s>"])
    with pytest.raises(ValueError, match="vocab_size must be an int >= 256, got 300.0"):
        train_bpe("abc", 300.0)
    with pytest.raises(ValueError, match="texts must hold str, got int at item 1"):
        train_bpe(["abc", 3], 300)
    with pytest.raises(ValueError, match="texts must be a str or an iterable of str"):
        train_bpe(None, 300)
    with pytest.raises(ValueError, match="special_tokens must be a list of str: str"):
        train_bpe("abc", 300, special_tokens="<s>")
    with pytest.raises(ValueError, match="special tokens must be distinct"):
        train_bpe("abc", 300, special_tokens=["<s>", "<s>"])
    with pytest.raises(ValueError, match="min_frequency must be a positive int, got 0"):
        train_bpe("abc", 300, min_frequency=0)


def test_bad_vocabularies_and_merges_raise(tmp_path):
    with pytest.raises(ValueError, match=r"merge 0 \('a', 'b'\) needs the token 'ab'"):
        ByteBPETokenizer(_tiny_vocab(), [("a", "b")])
    with pytest.raises(ValueError, match=r"merge 1 \('ab', 'xy'\) needs the token 'xy'"):
        ByteBPETokenizer(_tiny_vocab("ab", "abxy"), [("a", "b"), ("ab", "xy")])
    with pytest.raises(ValueError, match=r"merge 1 \('a', 'b'\) is listed twice"):
        ByteBPETokenizer(_tiny_vocab("ab"), [("a", "b"), ("a", "b")])
    with pytest.raises(ValueError, match="merge 0 must be a pair of str"):
        ByteBPETokenizer(_tiny_vocab("ab"), [("a", "b", "c")])
    vocab = {c: i for i, c in enumerate(c for c in BYTE_TO_CHAR if c != "Ġ")}
    with pytest.raises(ValueError, match="all 256 byte tokens, but 1 are missing, the first 'Ġ'"):
        ByteBPETokenizer(vocab, [])
    with pytest.raises(ValueError, match="vocab ids must be 0 .. 256, but id 256 is missing"):
        ByteBPETokenizer({**_tiny_vocab(), "ab": 300}, [])
    with pytest.raises(ValueError, match="vocab gives id 0 to both"):
        ByteBPETokenizer({**_tiny_vocab(), "ab": 0}, [])
    with pytest.raises(ValueError, match="special token '<s>' is not in the vocabulary"):
        ByteBPETokenizer(_tiny_vocab(), [], special_tokens=["<s>"])
    with pytest.raises(ValueError, match="holds ' ', which is not one of the 256 byte"):
        ByteBPETokenizer(_tiny_vocab("a b"), [])
    (tmp_path / "vocab.json").write_text(json.dumps(_tiny_vocab("ab")), encoding="utf-8")
    (tmp_path / "merges.txt").write_text("#version: 0.2\na b\nab\n", encoding="utf-8")
    with pytest.raises(ValueError, match="merges.txt, line 3: expected 'first second', got 'ab'"):
        ByteBPETokenizer.load(tmp_path)
    with pytest.raises(ValueError, match="no such file"):
        ByteBPETokenizer.load(tmp_path / "missing")


# The corpus: the book's prose


def test_book_prose_holds_the_markdown_and_no_code():
    chapter_1 = book_prose([1])
    assert chapter_1.startswith("# Attention from scratch")
    assert "the Transformer is built around" in chapter_1
    notebook = next(BOOK.glob("01_*.ipynb"))
    cells = json.loads(notebook.read_text(encoding="utf-8"))["cells"]
    code = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
    assert code and "seed_everything(0)" in code[0]
    assert not any(source.strip() in chapter_1 for source in code if len(source) > 30)
    whole = book_prose()
    assert chapter_1 in whole and book_prose([2]) in whole and len(whole) > 200_000
    assert whole.index(chapter_1) < whole.index(book_prose([2]))


def _notebook(folder: Path, name: str, *markdown: str) -> Path:
    cells = [{"cell_type": "markdown", "metadata": {}, "source": m} for m in markdown]
    cells.insert(1, {"cell_type": "code", "metadata": {}, "source": "x = 1", "outputs": [],
                     "execution_count": 1})
    path = folder / name
    path.write_text(json.dumps({"cells": cells, "metadata": {}, "nbformat": 4,
                                "nbformat_minor": 5}), encoding="utf-8")
    return path


def test_book_prose_reads_the_frozen_copy_so_editing_a_chapter_changes_no_corpus(
        tmp_path, monkeypatch):
    book, frozen = tmp_path / "book", tmp_path / "prose"
    book.mkdir()
    first = _notebook(book, "01_a.ipynb", "# One\r\nwindows line end", "caf\u00e9 \u2211")
    _notebook(book, "02_b.ipynb", "# Two")
    (frozen / "07.txt").parent.mkdir()
    (frozen / "07.txt").write_text("a chapter no longer in the book", encoding="utf-8")
    written = freeze_prose(book, frozen)
    assert [p.name for p in written] == ["01.txt", "02.txt"]
    assert sorted(p.name for p in frozen.iterdir()) == ["01.txt", "02.txt", "SHA256SUMS"]
    monkeypatch.setattr(utils_corpus, "PROSE", frozen)
    live = "# One\r\nwindows line end\n\ncaf\u00e9 \u2211\n\n# Two"
    assert book_prose() == book_prose(book=book) == live  # exactly, \r\n included
    _notebook(book, first.name, "# One, reworded", "a reader's own note")
    assert book_prose(book=book).startswith("# One, reworded")
    assert book_prose() == live  # the frozen copy: unchanged until frozen again
    with pytest.raises(ValueError, match=r"no chapter 3 in the frozen prose .*: it has \[1, 2\]"):
        book_prose([3])
    # a frozen file changed by hand (an editor that strips or adds a line end) is refused
    (frozen / "02.txt").write_bytes(b"# Two\n")
    assert book_prose([1]) == live.split("\n\n# Two")[0]
    with pytest.raises(ValueError, match="02.txt is not the text that was frozen"):
        book_prose()
    # a folder without notebooks freezes nothing and deletes nothing
    with pytest.raises(ValueError, match="no chapter notebooks"):
        freeze_prose(tmp_path / "prose", frozen)
    assert sorted(p.name for p in frozen.iterdir()) == ["01.txt", "02.txt", "SHA256SUMS"]
    monkeypatch.setattr(utils_corpus, "PROSE", tmp_path / "nowhere")
    with pytest.raises(ValueError, match="no frozen prose at"):
        book_prose()


def test_the_shipped_frozen_prose_is_every_chapter_as_frozen_byte_for_byte():
    chapters = sorted(int(p.stem) for p in utils_corpus.PROSE.glob("[0-9][0-9].txt"))
    assert chapters == list(range(1, len(chapters) + 1)) and len(chapters) >= 17
    whole = book_prose()  # checks every file against its SHA-256 in SHA256SUMS
    for number in chapters:  # each file is one chapter's Markdown, from its title on
        assert book_prose([number]).startswith("# ") and book_prose([number]) in whole
    attributes = (BOOK.parent / ".gitattributes").read_text(encoding="utf-8").splitlines()
    assert "book/data/prose/* -text" in attributes  # git never converts its line ends
    live_1 = book_prose([1], book=utils_corpus.BOOK)  # the live chapter, from anywhere
    assert live_1.startswith("# Attention from scratch")


def test_book_prose_selects_chapters_in_order_and_rejects_bad_ones(tmp_path):
    assert book_prose([3, 1]) == book_prose([1]) + "\n\n" + book_prose([3])
    with pytest.raises(ValueError, match="no chapter 99 in"):
        book_prose([1, 99])
    with pytest.raises(ValueError, match="chapter must be a positive int, got 0"):
        book_prose([0])
    with pytest.raises(ValueError, match="chapters must be a list of int, got str"):
        book_prose("1")
    with pytest.raises(ValueError, match="no book folder at"):
        book_prose(book=tmp_path / "nowhere")
