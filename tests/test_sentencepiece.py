"""Tests for utils.sentencepiece_model: SentencePiece ``.model`` files read without the library.

The proof: the ``sentencepiece`` package trains small BPE models here (on chapter 1's prose and
text made in code; with and without byte fallback; Llama 2's settings, which keep extra spaces;
no dummy prefix), and the book's reader gives the same pieces, scores and types, the same ids as
``SentencePieceProcessor.encode`` and the same text as its ``decode``, on hostile strings, on
random ones and on random ids. A Unigram model and the default normalizer (``nmt_nfkc``, a
precompiled character map) are refused, naming the field and the file; each comparison is also
shown to fail on a broken variant.
"""

from __future__ import annotations

import io
import random
import warnings
from pathlib import Path

import pytest

with warnings.catch_warnings():  # its SWIG types warn on import that they have no __module__
    warnings.simplefilter("ignore", DeprecationWarning)
    import sentencepiece as spm

from utils.data import book_prose
from utils.sentencepiece_model import BYTE, CONTROL, UNKNOWN, SentencePieceBPE, read_model

UNICODE = "café naïve Zürich 日本語のテキスト 中文 한국어 שלום مرحبا 👍🏽 👨‍👩‍👧 ١٢٣ ²³ e\u0301"
HOSTILE = [
    "", " ", "   ", "\n", "\t \n  ", "Attention is all you need.", " leading space",
    "trailing spaces   ", "a     b\n\n\n\n   c \t \n  ", "3.14159 2026-11-29 1,000,000 007",
    UNICODE, "don't I'LL we've", "\x00a\x1b[31mred\x1b[0m\tx\r\ny\x7f", "a\u00a0b\u3000d\u200bz",
    bytes(range(32, 256)).decode("latin-1"), "def f(x):\n    return x**2  # $\\frac{a}{b}$",
    "<|im_start|>user hi<|im_end|>", "x<|im_start|><|im_start|> y", "▁already ▁▁marked",
    "<unk> <s> </s> <0x41>", "QQQ ZZZ qqq", "日本語日本語",
]  # fmt: skip
STYLES = {
    "plain": {"byte_fallback": False},
    "byte_fallback": {"byte_fallback": True},
    "llama2": {"byte_fallback": True, "remove_extra_whitespaces": False, "split_digits": True},
    "no_dummy_prefix": {"byte_fallback": True, "add_dummy_prefix": False},
}


def _lines() -> list[str]:
    prose = [line for line in book_prose([1]).split("\n") if line.strip()]
    return prose + [UNICODE + " 0123456789"] * 20


def _train(path: Path, **options) -> Path:
    """A model trained by ``sentencepiece`` into ``path``; BPE, identity normalizer by default."""
    settings = {"model_type": "bpe", "vocab_size": 400, "normalization_rule_name": "identity",
                "user_defined_symbols": ["<|im_start|>", "<|im_end|>"], "minloglevel": 2,
                "num_threads": 1} | options  # fmt: skip
    if settings.get("byte_fallback"):
        settings["vocab_size"] += 256
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(_lines()), model_writer=model, **settings)
    path.write_bytes(model.getvalue())
    return path


@pytest.fixture(scope="module", params=list(STYLES))
def trained(request, tmp_path_factory) -> tuple[spm.SentencePieceProcessor, Path]:
    path = _train(tmp_path_factory.mktemp(request.param) / "m.model", **STYLES[request.param])
    return spm.SentencePieceProcessor(model_file=str(path)), path


def _random_strings(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = book_prose([1]).split()[:400] + UNICODE.split() + ["<|im_start|>", "Q", "ZZ"]
    gaps = [" ", " ", "  ", "\n", "\n\n", "\t", " \n ", "", "   "]
    return [
        "".join(rng.choice(words) + rng.choice(gaps) for _ in range(rng.randint(1, 12)))
        for _ in range(count)
    ]


def _mismatches(reference: spm.SentencePieceProcessor, ours, strings: list[str]) -> list[str]:
    bad = []
    for text in strings:
        expected, got = reference.encode(text), ours.encode(text)
        if expected != got:
            bad.append(f"{text!r}: sentencepiece {expected}, ours {got}")
        elif reference.decode(expected) != ours.decode(expected):
            bad.append(
                f"decode {text!r}: {reference.decode(expected)!r} vs {ours.decode(expected)!r}"
            )
    return bad


def test_the_file_reads_as_sentencepiece_reads_it(trained):
    reference, path = trained
    model = read_model(path)
    assert len(model["pieces"]) == reference.get_piece_size()
    for index, (piece, score, kind) in enumerate(model["pieces"]):
        assert piece == reference.id_to_piece(index), index
        assert score == pytest.approx(reference.get_score(index), abs=0), index
        assert (kind == CONTROL) == reference.is_control(index), index
        assert (kind == UNKNOWN) == reference.is_unknown(index), index
        assert (kind == BYTE) == reference.is_byte(index), index
    assert model["name"] == "identity" and model["model_type"] == 2


def test_ids_and_text_equal_sentencepiece(trained):
    reference, path = trained
    ours = SentencePieceBPE(path)
    bad = _mismatches(reference, ours, HOSTILE + _random_strings(300))
    assert not bad, f"{len(bad)} strings differ, the first: {bad[0]}"
    assert ours.vocab_size == reference.get_piece_size()
    for piece in ("<|im_start|>", "<s>", "▁the", "not a piece"):
        assert ours.piece_to_id(piece) == reference.piece_to_id(piece), piece


def test_decode_of_any_ids_equals_sentencepiece(trained):
    """Ids in any order: control pieces, the unknown piece, bytes cutting a character."""
    reference, path = trained
    ours, rng = SentencePieceBPE(path), random.Random(1)
    for _ in range(300):
        ids = [rng.randrange(ours.vocab_size) for _ in range(rng.randint(0, 10))]
        assert ours.decode(ids) == reference.decode(ids), f"ids {ids}"


def test_the_comparison_catches_a_broken_reader(trained):
    reference, path = trained
    strings = HOSTILE + _random_strings(50)
    reversed_scores = SentencePieceBPE(path)
    reversed_scores._scores = {p: (-s, i) for p, (s, i) in reversed_scores._scores.items()}
    no_fallback = SentencePieceBPE(path)  # unknown characters as <unk>, not as their bytes
    no_fallback._byte_fallback = False
    no_prefix = SentencePieceBPE(path)
    no_prefix._dummy = not no_prefix._dummy
    brokens = [("scores", reversed_scores), ("dummy prefix", no_prefix)]
    if reference.piece_to_id("<0x41>") != reference.unk_id():
        brokens.append(("byte fallback", no_fallback))
    for name, broken in brokens:
        bad = _mismatches(reference, broken, strings)
        assert bad and "sentencepiece [" in bad[0], f"a broken {name} went unnoticed"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"model_type": "unigram"}, "trainer_spec.model_type 'UNIGRAM'"),
        ({"normalization_rule_name": "nmt_nfkc"}, "normalizer_spec.name 'nmt_nfkc'"),
        ({"treat_whitespace_as_suffix": True}, "trainer_spec.treat_whitespace_as_suffix"),
    ],
)
def test_what_the_reader_lacks_is_refused_naming_it_and_the_file(options, message, tmp_path):
    path = _train(tmp_path / "other.model", **({"vocab_size": 200} | options))
    with pytest.raises(ValueError) as error:
        SentencePieceBPE(path)
    assert message in str(error.value) and str(path) in str(error.value), str(error.value)


def test_bad_files_are_named(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        SentencePieceBPE(tmp_path / "missing.model")
    good = _train(tmp_path / "good.model", vocab_size=200)
    cut = tmp_path / "cut.model"
    cut.write_bytes(good.read_bytes()[:1001])
    with pytest.raises(ValueError, match=r"cut\.model is not a SentencePiece model"):
        read_model(cut)
    (tmp_path / "text.model").write_text("not a model at all\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"text\.model is not a SentencePiece model"):
        read_model(tmp_path / "text.model")
