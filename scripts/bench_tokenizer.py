"""Encoding speed of the book's byte-level BPE (`utils.tokenizer`) against Hugging Face's.

    python scripts/bench_tokenizer.py                 # the book's prose, 1,000 tokens, 5 repeats
    python scripts/bench_tokenizer.py --quick         # chapter 1's prose, 500 tokens, 3 repeats
    python scripts/bench_tokenizer.py --vocab-size 2000 --repeats 9 --json OUT.json

A vocabulary is trained with `utils.tokenizer.train_bpe` on the text, written as GPT-2's
``vocab.json`` and ``merges.txt``, and the same two files are loaded into Hugging Face's
``tokenizers`` (BPE model, ByteLevel pre-tokenizer without a prefix space, ByteLevel decoder).
Both then encode the whole text, and their ids must be identical (the run stops otherwise).
Times are the median of ``--repeats`` runs after one warm-up run that is not counted:

* ours, cold: the cache of pre-tokens is emptied before each run, so every distinct pre-token
  is merged again, as for text never seen;
* ours, warm: the cache kept from the warm-up, so nearly every pre-token is a dictionary lookup;
* tokenizers: one thread (``RAYON_NUM_THREADS=1``, ``TOKENIZERS_PARALLELISM=false``, set before
  it is imported); its own cache of words is warm after the warm-up, as ours is in the warm row.

The ratio ``ours / tokenizers`` (above 1: ours is slower) is what to read: absolute times depend
on the machine and on what else runs on it. Python's own code is single-threaded too.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

os.environ["RAYON_NUM_THREADS"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from utils.data import book_prose  # noqa: E402
from utils.tokenizer import train_bpe  # noqa: E402


def _median_ms(run: Callable[[], object], repeats: int, before: Callable[[], None]) -> float:
    """The median time of ``run`` in ms over ``repeats`` runs, after one uncounted warm-up;
    ``before`` is called (untimed) before each run."""
    before()
    run()
    times = []
    for _ in range(repeats):
        before()
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def _hugging_face(vocab_path: Path, merges_path: Path) -> Tokenizer:
    """GPT-2's pipeline in ``tokenizers``, on our two files."""
    tok = Tokenizer(models.BPE.from_file(str(vocab_path), str(merges_path)))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def bench_tokenizer(text: str, vocab_size: int, repeats: int) -> dict:
    """Train on ``text``, then time encoding all of it with ours (cold and warm) and tokenizers.

    Returns:
        a dict: the sizes (``chars``, ``tokens``, ``vocab_size``, ``repeats``), ``train_s``,
        ``{ours_cold,ours_warm,tokenizers}_ms`` and ``..._tokens_per_s``, the ratios
        ``ratio_cold`` and ``ratio_warm`` (ours / tokenizers) and ``tokenizers_threads``.
        Raises AssertionError if the two tokenizers disagree on a single id.
    """
    if not isinstance(text, str) or not text:
        raise ValueError(f"text must be a non-empty str, got {type(text).__name__} {text!r:.40}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be a positive int, got {repeats!r}")
    start = time.perf_counter()
    ours = train_bpe(text, vocab_size)
    train_s = time.perf_counter() - start
    with tempfile.TemporaryDirectory() as folder:
        hf = _hugging_face(*ours.save(folder))
    ids = ours.encode(text)
    theirs = hf.encode(text).ids
    if ids != theirs:
        first = next((i for i, (a, b) in enumerate(zip(ids, theirs, strict=False)) if a != b), None)
        raise AssertionError(
            f"ids differ: {len(ids)} against {len(theirs)} tokens, first "
            f"difference at token {first}"
        )
    times = {
        "ours_cold": _median_ms(lambda: ours.encode(text), repeats, ours.clear_cache),
        "ours_warm": _median_ms(lambda: ours.encode(text), repeats, lambda: None),
        "tokenizers": _median_ms(lambda: hf.encode(text), repeats, lambda: None),
    }
    result = {
        "chars": len(text),
        "tokens": len(ids),
        "vocab_size": ours.vocab_size,
        "repeats": repeats,
        "train_s": round(train_s, 3),
        "tokenizers_threads": int(os.environ["RAYON_NUM_THREADS"]),
    }
    for name, ms in times.items():
        result[f"{name}_ms"] = round(ms, 3)
        result[f"{name}_tokens_per_s"] = round(len(ids) / (ms / 1000))
    result["ratio_cold"] = round(times["ours_cold"] / times["tokenizers"], 2)
    result["ratio_warm"] = round(times["ours_warm"] / times["tokenizers"], 2)
    return result


def format_table(result: dict) -> str:
    """A short Markdown table of ``bench_tokenizer``'s result."""
    lines = [
        f"Encoding {result['chars']:,} characters into {result['tokens']:,} tokens "
        f"(vocabulary {result['vocab_size']:,}, trained by ours in {result['train_s']:.2f} s; "
        f"median of {result['repeats']}, tokenizers on {result['tokenizers_threads']} thread)",
        "",
        "| encoder | ms | tokens/s | ours / tokenizers |",
        "| --- | ---: | ---: | ---: |",
    ]
    rows = [
        ("ours, cold cache", "ours_cold", result["ratio_cold"]),
        ("ours, warm cache", "ours_warm", result["ratio_warm"]),
        ("tokenizers (Rust)", "tokenizers", 1.0),
    ]
    for label, key, ratio in rows:
        lines.append(
            f"| {label} | {result[key + '_ms']:.1f} | "
            f"{result[key + '_tokens_per_s']:,} | {ratio:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="chapter 1, 500 tokens, 3 repeats")
    parser.add_argument("--vocab-size", type=int, default=None, help="default 1000 (quick: 500)")
    parser.add_argument("--repeats", type=int, default=None, help="default 5 (quick: 3)")
    parser.add_argument("--json", type=Path, default=None, help="also write the result here")
    args = parser.parse_args(argv)
    text = book_prose([1]) if args.quick else book_prose()
    vocab_size = args.vocab_size or (500 if args.quick else 1000)
    repeats = args.repeats or (3 if args.quick else 5)
    result = bench_tokenizer(text, vocab_size, repeats)
    print(format_table(result))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
