"""Encoding and decoding speed of the book's byte-level BPE against the two a user would pick.

    python scripts/bench_tokenizer.py            # the book's prose, vocabulary 1,000, 7 rounds
    python scripts/bench_tokenizer.py --quick    # chapter 1, vocabulary 300, 2 rounds (seconds)

A vocabulary is trained with `utils.tokenizer.train_bpe` on the text. The same vocabulary is
loaded into the two peers, so that all three must give the same ids:

* Hugging Face's ``tokenizers``: our ``vocab.json`` and ``merges.txt`` in its BPE model, with
  the ByteLevel pre-tokenizer (no prefix space) and decoder; used in its batch mode
  (``encode_batch``, ``decode_batch``).
* ``tiktoken``: an ``Encoding`` built in memory, nothing downloaded, with our pre-tokenizer's
  regular expression (GPT-2's) and each token's bytes ranked by its id. tiktoken merges the
  adjacent pair whose joined bytes have the lowest rank, where GPT-2's BPE merges the pair of
  lowest merge rank; the two agree when each merged token's id follows its merge's rank, as
  `train_bpe` numbers them, and the equality check below would catch a vocabulary where they do
  not. Its ``*_batch`` functions only spread a loop over a pool of threads, so on one thread it
  is called once per paragraph, its fastest way.

The text is cut into the book's paragraphs (at blank lines), the documents of a batch; ours and
tiktoken take them one call each. Everything runs on one thread: ``RAYON_NUM_THREADS=1`` and
``TOKENIZERS_PARALLELISM=false`` are set before tokenizers is imported. Encoding starts cold:
ours and tokenizers both keep a cache of the pre-tokens they have merged, and both caches are
emptied before every timed call (``clear_cache()``, ``model._clear_cache()``); tiktoken keeps
none. The timing is `bench_harness.interleave`'s: rounds in alternating order, per-round CPU-time
ratios, the outputs checked equal first (the ids of all three; the text of all three, equal to
the paragraphs). A ratio above 1 means ours is slower.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

os.environ["RAYON_NUM_THREADS"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import tiktoken  # noqa: E402
from tokenizers import Encoding, Tokenizer, decoders, models, pre_tokenizers  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
for _path in (ROOT, ROOT / "scripts"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from bench_harness import interleave, make_row, ratio_summary  # noqa: E402

from utils.data import book_prose  # noqa: E402
from utils.tokenizer import GPT2_PATTERN, ByteBPETokenizer, train_bpe  # noqa: E402

GROUP = "(e) tokenizer"
FULL = {"chapters": None, "vocab": 1000, "rounds": 7}  # the whole book's prose
QUICK = {"chapters": [1], "vocab": 300, "rounds": 2}
DECODE_GOAL = "decoding at least as fast as tokenizers"
OURS = {"encode": "ByteBPETokenizer.encode, one call a paragraph",
        "decode": "ByteBPETokenizer.decode, one call a paragraph"}
SAME = {"encode": "ids identical (all three)",
        "decode": "text identical (all three, and to the paragraphs)"}
ROWS = (  # (what, peer, the peer's call, the mode)
    ("encode", "tokenizers", "tokenizers BPE + ByteLevel: encode_batch",
     "encoding cold: both caches emptied before each call; tokenizers in batch mode, timed up "
     "to its Encoding objects (their ids read after the clock)"),
    ("encode", "tiktoken", "tiktoken Encoding (the same ranks): encode_ordinary",
     "encoding cold: our cache emptied before each call (tiktoken keeps none); one call a "
     "paragraph"),
    ("decode", "tokenizers", "tokenizers BPE + ByteLevel: decode_batch",
     "decoding; tokenizers in batch mode"),
    ("decode", "tiktoken", "tiktoken Encoding (the same ranks): decode",
     "decoding; one call a paragraph"),
)


def paragraphs(text: str) -> list[str]:
    """The text's paragraphs (cut at blank lines, the empty ones dropped): a batch of documents."""
    return [p for p in text.split("\n\n") if p]


def hugging_face(ours: ByteBPETokenizer) -> Tokenizer:
    """GPT-2's pipeline in ``tokenizers``, on our two files."""
    with tempfile.TemporaryDirectory() as folder:
        vocab_path, merges_path = ours.save(folder)
        tok = Tokenizer(models.BPE.from_file(str(vocab_path), str(merges_path)))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def tiktoken_encoding(ours: ByteBPETokenizer) -> tiktoken.Encoding:
    """A tiktoken ``Encoding`` of our vocabulary: each token's bytes ranked by its id."""
    if ours.special_tokens:
        raise ValueError("only a vocabulary without special tokens is benchmarked")
    ranks = {ours.decode_bytes([i]): i for i in range(ours.vocab_size)}
    if len(ranks) != ours.vocab_size:
        raise ValueError("two tokens stand for the same bytes: tiktoken cannot rank them")
    return tiktoken.Encoding(name="book_bpe", pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                             special_tokens={})


def _ids(output: list) -> list[list[int]]:
    """The ids of a batch, whether lists of ids or tokenizers' ``Encoding`` objects."""
    return [e.ids if isinstance(e, Encoding) else e for e in output]


def _same_ids(reference: list, other: list) -> bool:
    return _ids(reference) == _ids(other)


def bench_tokenizer_rows(text: str, vocab_size: int, rounds: int, quick: bool) -> list[dict]:
    """Train on ``text``, then time encoding and decoding its paragraphs with the three.

    Returns:
        four rows of `bench_harness.make_row` (group ``"(e) tokenizer"``): encoding against
        tokenizers and against tiktoken, then decoding against each. The row that decodes
        against tokenizers carries the goal (ours at most 1.0x), not judged when ``quick``.
        Raises AssertionError when the three disagree on one id, or a text differs from its
        paragraph.
    """
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"text must be a non-empty str, got {type(text).__name__} {text!r:.40}")
    docs = paragraphs(text)
    ours = train_bpe(text, vocab_size)
    hf, tt = hugging_face(ours), tiktoken_encoding(ours)
    caches = {"ours": ours.clear_cache, "tokenizers": hf.model._clear_cache}

    def cold(name: str) -> None:
        caches.get(name, lambda: None)()

    encode = {
        "ours": lambda: [ours.encode(doc) for doc in docs],
        "tokenizers": lambda: hf.encode_batch(docs),
        "tiktoken": lambda: [tt.encode_ordinary(doc) for doc in docs],
    }
    encoded = interleave(encode, rounds, same=_same_ids, before=cold)
    ids = encode["ours"]()
    decode = {
        "ours": lambda: [ours.decode(row) for row in ids],
        "tokenizers": lambda: hf.decode_batch(ids),
        "tiktoken": lambda: [tt.decode(row) for row in ids],
    }
    texts = decode["ours"]()
    if texts != docs:
        first = next(i for i, (a, b) in enumerate(zip(texts, docs, strict=True)) if a != b)
        raise AssertionError(f"ours decodes paragraph {first} to a different text")
    decoded = interleave(decode, rounds)
    tokens = sum(map(len, ids))
    case = (f"{len(text):,} characters of the book's prose in {len(docs):,} paragraphs, "
            f"{tokens:,} tokens, vocabulary {ours.vocab_size:,}")
    rows = []
    for what, peer, reference, mode in ROWS:
        summary = ratio_summary(encoded if what == "encode" else decoded, "ours", peer)
        goal = DECODE_GOAL if (what, peer) == ("decode", "tokenizers") else None
        value = summary["ratio_median"] if goal else None
        rows.append(make_row(
            GROUP, case, OURS[what], reference, summary, setup=f"1 thread; {mode}",
            same=SAME[what], goal=goal, goal_value=value,
            goal_met=None if goal is None or quick else value <= 1.0,
            note=f"tokens/s (CPU time): ours {tokens / summary['ours_ms'] * 1e3:,.0f}, "
                 f"the peer {tokens / summary['ref_ms'] * 1e3:,.0f}",
            tokens=tokens, paragraphs=len(docs)))
    return rows


def format_rows(rows: list[dict]) -> str:
    """The rows as a short Markdown table (the full benchmark has its own)."""
    lines = ["| case | ours | peer | setup | ours ms | peer ms | ratio median (min) | wall "
             "| goal |", "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        goal = "" if r["goal"] is None else (
            f"{r['goal']}: {'not judged' if r['goal_met'] is None else r['goal_met']}")
        lines.append(f"| {r['case']} | {r['ours']} | {r['reference']} | {r['setup']} | "
                     f"{r['ours_ms']:.1f} | {r['ref_ms']:.1f} | {r['ratio_median']:.2f} "
                     f"({r['ratio_min']:.2f}) | {r['wall_ratio_median']:.2f} | {goal} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="chapter 1, vocabulary 300")
    parser.add_argument("--rounds", type=int, default=None, help="default 7 (quick: 2)")
    args = parser.parse_args(argv)
    sizes = QUICK if args.quick else FULL
    rows = bench_tokenizer_rows(book_prose(sizes["chapters"]), sizes["vocab"],
                                args.rounds or sizes["rounds"], args.quick)
    print(format_rows(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
