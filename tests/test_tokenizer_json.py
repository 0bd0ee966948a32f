"""Tests for utils.tokenizer_json: ``tokenizer.json`` files and Llama 3's chat template.

The proof: Hugging Face's ``tokenizers`` trains small BPE vocabularies here, on chapter 1's prose
and on text made in code, in five styles (GPT-2's byte level; Llama 3's Split then byte level,
with ``ignore_merges`` and a template that puts a BOS in front; SentencePiece's Metaspace with
byte fallback and Llama 2's decoder chain; Metaspace with an unknown token and its own decoder;
Llama 2's converted files, where a normalizer puts the "▁" in and nothing pre-tokenizes),
saves each ``tokenizer.json``, and both readers give the same ids and the same decoded text on
hostile strings and on random ones (special tokens inside text, whitespace runs, digits, emoji).
The chat template written by hand gives the string and the ids of ``transformers``'
``apply_chat_template``. Each comparison is also shown to fail on a broken variant.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAYON_NUM_THREADS", "1")

import pytest  # noqa: E402
from tokenizers import (  # noqa: E402
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

from utils.data import book_prose  # noqa: E402
from utils.tokenizer_json import (  # noqa: E402
    LLAMA3_CHAT_TEMPLATE,
    apply_chat_template,
    load_tokenizer_json,
)

LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
UNICODE = "café naïve Zürich 日本語のテキスト 中文 한국어 שלום مرحبا 👍🏽 👨‍👩‍👧 ١٢٣ ²³ e\u0301"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<mask>", "<sep>"]
HOSTILE = [
    "", " ", "   ", "\n", "\n\n\n", "\t \n  ", "Attention is all you need.",
    " leading space", "trailing spaces   ", "a     b\n\n\n\n   c \t \n  ",
    "3.14159 2026-11-29 1,000,000 007 12345678", UNICODE,
    "don't I'LL we've she'd O'Neil's", "\x00a\x1b[31mred\x1b[0m\tx\r\ny\x7f\x85",
    "a\u00a0b\u2028c\u3000d\u200bz", bytes(range(32, 256)).decode("latin-1"),
    "def f(x):\n    return x**2  # $\\frac{a}{b}$",
    "<|endoftext|>", "text<|endoftext|>more", "a <|im_start|> b<|endoftext|><|im_start|>",
    "x <mask> y   <mask>\n z<mask>", "a<sep>  b <sep>\n\nc<sep>", "<|endoftext|> starts",
    "▁already ▁▁marked", "<unk><s></s>", "日本 added 日本語",
]  # fmt: skip


def _random_strings(count: int, seed: int = 0) -> list[str]:
    """Strings drawn from words, digits, whitespace runs, unicode and the special tokens."""
    rng = random.Random(seed)
    words = book_prose([1]).split()[:400] + UNICODE.split() + SPECIALS + ["日本"]
    gaps = [" ", " ", "  ", "\n", "\n\n", "\t", " \n ", "", "   "]
    return [
        "".join(rng.choice(words) + rng.choice(gaps) for _ in range(rng.randint(1, 12)))
        for _ in range(count)
    ]


def _corpus() -> list[str]:
    return [book_prose([1]), (UNICODE + " 0123456789 ") * 20]


def _train(style: str) -> Tokenizer:
    """A small BPE trained by ``tokenizers`` in one of the four styles."""
    byte_level = style in ("gpt2", "llama3")
    if style == "gpt2":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    elif style == "llama3":
        tok = Tokenizer(models.BPE(ignore_merges=True))
        split = pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated")
        byte = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.pre_tokenizer = pre_tokenizers.Sequence([split, byte])
    elif style in ("metaspace_first", "llama2"):  # SentencePiece's models converted
        fuse = style == "llama2"
        tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=fuse))
        if style == "llama2":  # no pre-tokenizer: a normalizer puts the "▁" in
            tok.normalizer = normalizers.Sequence(
                [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
            )
        else:
            tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
        tok.decoder = decoders.Sequence(
            [
                decoders.Replace("▁", " "),
                decoders.ByteFallback(),
                decoders.Fuse(),
                decoders.Strip(" ", 1, 0),
            ]
        )
    else:  # metaspace_always: no byte tokens, unknown characters fused into one <unk>
        tok = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always")
        tok.decoder = decoders.Metaspace(prepend_scheme="always")
    if byte_level:
        tok.decoder = decoders.ByteLevel()
    specials = [] if byte_level else ["<unk>", "<s>", "</s>"]
    if tok.model.byte_fallback:
        specials += [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(
        vocab_size=600 if tok.model.byte_fallback else 400,
        special_tokens=specials + SPECIALS[:2],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet() if byte_level else [],
        show_progress=False,
    )
    tok.train_from_iterator([line for text in _corpus() for line in text.split("\n")], trainer)
    tok.add_special_tokens([AddedToken("<mask>", lstrip=True, special=True)])
    tok.add_special_tokens([AddedToken("<sep>", rstrip=True, special=True)])
    tok.add_tokens([AddedToken("日本", special=False)])
    if style == "llama3":
        tok.add_special_tokens(["<|begin_of_text|>"])
        template = processors.TemplateProcessing(
            single="<|begin_of_text|> $A",
            special_tokens=[("<|begin_of_text|>", tok.token_to_id("<|begin_of_text|>"))],
        )
        tok.post_processor = processors.Sequence(
            [processors.ByteLevel(trim_offsets=False), template]
        )
    return tok


STYLES = ["gpt2", "llama3", "metaspace_first", "metaspace_always", "llama2"]


@pytest.fixture(scope="module", params=STYLES)
def saved(request, tmp_path_factory) -> tuple[Tokenizer, Path]:
    """(the ``tokenizers`` object read back from its file, the file) for each style."""
    path = tmp_path_factory.mktemp(request.param) / "tokenizer.json"
    _train(request.param).save(str(path))
    return Tokenizer.from_file(str(path)), path


def _mismatches(theirs: Tokenizer, ours, strings: list[str]) -> list[str]:
    """Every string whose ids or decoded text differ, the cause written out."""
    bad = []
    for text in strings:
        expected, got = theirs.encode(text).ids, ours.encode(text)
        if expected != got:
            bad.append(f"{text!r}: tokenizers {expected}, ours {got}")
            continue
        for skip in (True, False):
            want = theirs.decode(expected, skip_special_tokens=skip)
            have = ours.decode(expected, skip_special_tokens=skip)
            if want != have:
                bad.append(f"decode {text!r} (skip={skip}): tokenizers {want!r}, ours {have!r}")
    return bad


def test_ids_and_text_equal_tokenizers(saved):
    theirs, path = saved
    ours = load_tokenizer_json(path)
    bad = _mismatches(theirs, ours, HOSTILE + _random_strings(300))
    assert not bad, f"{len(bad)} strings differ, the first: {bad[0]}"
    assert ours.vocab_size == theirs.get_vocab_size()
    for token in ("<mask>", "<|endoftext|>", "日本"):
        assert ours.token_to_id(token) == theirs.token_to_id(token)
    assert set(ours.special_tokens) >= {"<mask>", "<|endoftext|>", "<|im_start|>"}
    assert "日本" not in ours.special_tokens


def test_decode_of_any_ids_equals_tokenizers(saved):
    """Ids in any order, cutting characters in the middle (invalid UTF-8 becomes U+FFFD)."""
    theirs, path = saved
    ours, rng = load_tokenizer_json(path), random.Random(1)
    size = theirs.get_vocab_size()
    for _ in range(200):
        ids = [rng.randrange(size) for _ in range(rng.randint(0, 12))]
        for skip in (True, False):
            want = theirs.decode(ids, skip_special_tokens=skip)
            assert ours.decode(ids, skip_special_tokens=skip) == want, f"ids {ids}, skip={skip}"


def test_merges_as_strings_read_the_same(saved, tmp_path):
    """Older files write each merge as one string "a b": both forms give the same ids."""
    theirs, path = saved
    spec = json.loads(path.read_text(encoding="utf-8"))
    spec["model"]["merges"] = [" ".join(pair) for pair in spec["model"]["merges"]]
    if any(" " in a or " " in b for a, b in json.loads(path.read_text())["model"]["merges"]):
        pytest.skip("a merge holds a space: the string form cannot write it")
    legacy = tmp_path / "tokenizer.json"
    legacy.write_text(json.dumps(spec, ensure_ascii=False), encoding="utf-8")
    bad = _mismatches(Tokenizer.from_file(str(legacy)), load_tokenizer_json(legacy), HOSTILE)
    assert not bad, bad[0]
    assert not _mismatches(theirs, load_tokenizer_json(legacy), HOSTILE)


def _broken(path: Path, tmp_path: Path, change) -> Path:
    spec = json.loads(path.read_text(encoding="utf-8"))
    change(spec)
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps(spec, ensure_ascii=False), encoding="utf-8")
    return broken


def test_the_comparison_catches_a_broken_reader(saved, tmp_path):
    """Merges ranked in another order, or another prepend scheme: the ids differ and are named."""
    theirs, path = saved

    def reorder(spec):
        merges = spec["model"]["merges"]
        merges[:60] = merges[:60][::-1]
        spec["model"]["ignore_merges"] = False

    ours = load_tokenizer_json(_broken(path, tmp_path, reorder))
    bad = _mismatches(theirs, ours, HOSTILE + _random_strings(50))
    assert bad and "tokenizers [" in bad[0], "reordered merges went unnoticed"
    if theirs.pre_tokenizer.__class__.__name__ == "Metaspace":

        def never(spec):
            spec["pre_tokenizer"]["prepend_scheme"] = "never"

        ours = load_tokenizer_json(_broken(path, tmp_path, never))
        assert _mismatches(theirs, ours, ["hello world"]), "a missing prefix went unnoticed"


REFUSALS = {
    "model type 'WordPiece'": lambda s: s["model"].update(type="WordPiece"),
    "model type 'Unigram'": lambda s: s["model"].update(type="Unigram"),
    "normalizer 'NFKC'": lambda s: s.update(normalizer={"type": "NFKC"}),
    "normalizer 'Lowercase'": lambda s: s.update(
        normalizer={"type": "Sequence", "normalizers": [{"type": "Lowercase"}]}
    ),
    "pre_tokenizer 'Whitespace'": lambda s: s.update(pre_tokenizer={"type": "Whitespace"}),
    "Split behavior ('Removed', False)": lambda s: s.update(
        pre_tokenizer={"type": "Split", "pattern": {"String": " "}, "behavior": "Removed"}
    ),
    "decoder 'WordPiece'": lambda s: s.update(decoder={"type": "WordPiece"}),
    "post_processor 'BertProcessing'": lambda s: s.update(
        post_processor={"type": "BertProcessing"}
    ),
    "model.dropout 0.1": lambda s: s["model"].update(dropout=0.1),
    "model.merges[2] must be 'a b' or [a, b]": lambda s: s["model"]["merges"].__setitem__(2, "ab"),
    "model.merges: merge 0": lambda s: s["model"]["merges"].__setitem__(0, ["zz", "qq"]),
    "added token with single_word": lambda s: s["added_tokens"][0].update(single_word=True),
}


@pytest.mark.parametrize("message", list(REFUSALS))
def test_what_the_reader_lacks_is_refused_naming_it_and_the_file(message, tmp_path):
    path = tmp_path / "tokenizer.json"
    _train("gpt2").save(str(path))
    broken = _broken(path, tmp_path, REFUSALS[message])
    with pytest.raises(ValueError) as error:
        load_tokenizer_json(broken)
    assert message in str(error.value) and str(broken) in str(error.value), str(error.value)


def test_bad_files_are_named(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        load_tokenizer_json(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{", encoding="utf-8")
    with pytest.raises(ValueError, match=r"bad\.json is not valid JSON"):
        load_tokenizer_json(tmp_path / "bad.json")
    (tmp_path / "vocab.json").write_text('{"a": 0}', encoding="utf-8")
    with pytest.raises(ValueError, match=r"vocab\.json: no 'model' key"):
        load_tokenizer_json(tmp_path / "vocab.json")


# --- chat templates ---------------------------------------------------------------------------

CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [
        {"role": "system", "content": "  Answer briefly.\n"},
        {"role": "user", "content": "What is 12 * 12?"},
        {"role": "assistant", "content": "144."},
        {"role": "user", "content": "日本語で？ <mask> 👍🏽\n\n"},
    ],
    [{"role": "system", "content": ""}, {"role": "user", "content": "a\n\n  b"}],
]
CHAT_TOKENS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


@pytest.fixture(scope="module")
def llama3_chat(tmp_path_factory):
    """A Llama-3-style folder: tokenizer.json (its special tokens added) and the template in
    tokenizer_config.json, read by transformers and by ours."""
    folder = tmp_path_factory.mktemp("chat")
    tok = _train("llama3")
    tok.add_special_tokens(CHAT_TOKENS)
    tok.save(str(folder / "tokenizer.json"))
    config = {"chat_template": LLAMA3_CHAT_TEMPLATE, "bos_token": CHAT_TOKENS[0],
              "eos_token": "<|eot_id|>"}  # fmt: skip
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(folder)), load_tokenizer_json(
        folder / "tokenizer.json"
    )


def _chat_mismatches(reference, ours, write=apply_chat_template) -> list[str]:
    bad = []
    for messages in CONVERSATIONS:
        for prompt in (False, True):
            want = reference.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=prompt
            )
            have = write(messages, add_generation_prompt=prompt)
            if want != have:
                bad.append(f"text of {messages} (prompt={prompt}): {want!r} vs ours {have!r}")
            ids = reference.apply_chat_template(
                messages, tokenize=True, add_generation_prompt=prompt
            )
            ids = ids["input_ids"] if hasattr(ids, "keys") else ids
            if ours.encode(have, add_special_tokens=False) != ids:
                bad.append(f"ids of {messages} (prompt={prompt}) differ")
    return bad


def test_chat_template_by_hand_equals_transformers(llama3_chat):
    reference, ours = llama3_chat
    bad = _chat_mismatches(reference, ours)
    assert not bad, f"{len(bad)} differ, the first: {bad[0]}"
    # The template writes the BOS itself: encoding its text with the post-processor's BOS as
    # well would give two, which is why chat text is encoded with add_special_tokens=False.
    text, bos = apply_chat_template(CONVERSATIONS[0]), ours.token_to_id(CHAT_TOKENS[0])
    assert ours.encode(text)[:2] == [bos, bos]
    assert ours.encode(text, add_special_tokens=False).count(bos) == 1


def test_the_chat_comparison_catches_a_broken_template(llama3_chat):
    reference, ours = llama3_chat

    def no_strip(messages, add_generation_prompt=False):
        padded = [{**m, "content": "\x00" + m["content"]} for m in messages]
        return apply_chat_template(padded, add_generation_prompt=add_generation_prompt)

    def no_bos(messages, add_generation_prompt=False):
        return apply_chat_template(messages, bos_token="", add_generation_prompt=False)

    for broken in (no_strip, no_bos):
        assert _chat_mismatches(reference, ours, broken), f"{broken.__name__} went unnoticed"
    with pytest.raises(ValueError, match="message 0 must be a dict with 'role' and 'content'"):
        apply_chat_template([{"role": "user"}])
