"""Greedy decoding of a GPT-2-shaped checkpoint: the book's parts against `transformers`.

Row (f) of ``make bench`` (`scripts/benchmark.py`). A GPT-2 configuration of about 25M
parameters (d_model 320, 5 heads, 6 layers, GPT-2's vocabulary of 50,257 tokens) is given random
weights and written by `transformers` itself (``save_pretrained``); `utils.pretrained.load_gpt2`
reads the same files into the book's modules. Both then continue the same prompts greedily, with
their key/value caches: the book's `utils.decoding.generate` and ``GPT2LMHeadModel.generate``
(``do_sample=False``). The tokens must be identical (the run stops with an error otherwise), and
the figure is new tokens per second, ours and theirs, at batch 1 and batch 8.

    python scripts/bench_decoding.py --quick     # a tiny model, a few tokens (the smoke test)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded: the checkpoint is made here
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from utils.decoding import generate  # noqa: E402
from utils.pretrained import load_gpt2  # noqa: E402

GROUP = "(f) GPT-2 decoding"
FULL = {"d_model": 320, "heads": 5, "layers": 6, "vocab": 50257, "prompt": 16,
        "new_tokens": 256, "batches": [1, 8]}
QUICK = {"d_model": 32, "heads": 2, "layers": 1, "vocab": 101, "prompt": 4, "new_tokens": 6,
         "batches": [1, 2]}


def write_checkpoint(folder: Path, sizes: dict) -> int:
    """A random-weight GPT-2 checkpoint in ``folder``, written by `transformers`; returns its
    number of parameters."""
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging

    logging.disable_progress_bar()
    config = GPT2Config(vocab_size=sizes["vocab"], n_embd=sizes["d_model"],
                        n_head=sizes["heads"], n_layer=sizes["layers"],
                        n_positions=sizes["prompt"] + sizes["new_tokens"],
                        eos_token_id=sizes["vocab"] - 1, bos_token_id=sizes["vocab"] - 1)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    model.save_pretrained(folder, safe_serialization=True)
    return sum(p.numel() for p in model.parameters())


def _reference_tokens(out: torch.Tensor, prompt: int, eos: int) -> list[list[int]]:
    """`transformers`' output rows (prompt + new tokens, padded after ``<eos>``) as the book's
    `generate` returns them: the new tokens up to, not including, ``<eos>``."""
    rows = []
    for row in out[:, prompt:].tolist():
        rows.append(row[: row.index(eos)] if eos in row else row)
    return rows


def bench_decoding(sizes: dict, repeats: int) -> list[dict]:
    """One row per batch size: median seconds of a whole greedy generation, ours and theirs,
    taking turns, after one warm-up run each. Raises if the tokens differ."""
    from transformers import GPT2LMHeadModel

    eos = sizes["vocab"] - 1
    with tempfile.TemporaryDirectory() as folder:
        params = write_checkpoint(Path(folder), sizes)
        theirs = GPT2LMHeadModel.from_pretrained(folder).eval()
        ours = load_gpt2(folder).eval()
    rows = []
    for batch in sizes["batches"]:
        g = torch.Generator().manual_seed(batch)
        prompts = torch.randint(0, eos, (batch, sizes["prompt"]), generator=g)
        results: dict[str, list[list[int]]] = {}

        def run_ours(prompts: torch.Tensor = prompts, results: dict = results) -> None:
            results["ours"] = generate(ours, prompts, sizes["new_tokens"], eos=eos)

        def run_theirs(prompts: torch.Tensor = prompts, results: dict = results) -> None:
            out = theirs.generate(prompts, attention_mask=torch.ones_like(prompts),
                                  max_new_tokens=sizes["new_tokens"], do_sample=False,
                                  pad_token_id=eos, eos_token_id=eos)
            results["theirs"] = _reference_tokens(out, sizes["prompt"], eos)

        times: dict[str, list[float]] = {"ours": [], "theirs": []}
        with torch.inference_mode():
            run_ours()
            run_theirs()
            for _ in range(repeats):
                for name, fn in (("ours", run_ours), ("theirs", run_theirs)):
                    start = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - start)
        if results["ours"] != results["theirs"]:
            raise RuntimeError(f"batch {batch}: the book's generate and transformers' differ")
        made = sum(len(r) for r in results["ours"])
        t_ours, t_ref = (statistics.median(times[k]) for k in ("ours", "theirs"))
        rows.append({
            "group": GROUP,
            "case": (f"B={batch}, prompt {sizes['prompt']}, up to {sizes['new_tokens']} new "
                     f"tokens, d={sizes['d_model']}, {sizes['layers']} layers, "
                     f"V={sizes['vocab']:,}, {params / 1e6:.1f}M parameters"),
            "ours": "load_gpt2 + generate", "reference": "GPT2LMHeadModel.generate",
            "ours_ms": t_ours * 1e3, "ref_ms": t_ref * 1e3, "time_ratio": t_ours / t_ref,
            "ours_mib": None, "ref_mib": None, "memory_ratio": None,
            "note": (f"greedy, both cached, median of {repeats}; {made} tokens made, the same "
                     f"in both; tokens/s ours {made / t_ours:,.0f}, transformers "
                     f"{made / t_ref:,.0f}"),
            "tokens": made, "ours_tokens_per_s": made / t_ours,
            "ref_tokens_per_s": made / t_ref,
        })
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model (a smoke test)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    for row in bench_decoding(QUICK if args.quick else FULL, args.repeats):
        print(f"{row['case']}: {row['note']} (threads {torch.get_num_threads()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
