"""Greedy decoding, timed against the peers a user would pick: rows (d) and (f) of ``make bench``.

(d) Chapter 10's model (`utils.models.DecoderOnlyLM`, d_model 32, 4 heads, 2 layers): the
    book's `utils.decoding.generate` against a bare cached loop on the same weights (plain
    PyTorch calls, no checks, the Q/K/V projection as one product: what the arithmetic costs
    without a library around it); against itself with every step through the checked modules
    (what checking once per call saves); and, through the checked modules, with the cache
    against without it (what the cache alone saves).
(f) GPT-2-shaped checkpoints written by `transformers` (``save_pretrained``) with random weights
    and read by `utils.pretrained.load_gpt2`: about 25M parameters, and GPT-2 small's shape
    (124M). Ours against ``GPT2LMHeadModel.generate`` with each attention implementation
    (``"eager"``, ``"sdpa"``) and against a bare cached loop on the checkpoint's tensors. At
    batch 1 decoding reads every weight once per token, so its speed has a ceiling: the
    memory bandwidth (the fastest of three ways of reading, `read_bandwidths`) over the bytes
    read per token, both printed; the row gives the fraction of that ceiling each contender
    reaches. Beside them, at batch 1, the weight products alone (`weight_products`): ours'
    products, on its own parameters, and nothing but those calls (no attention, norms or
    cache); the fraction they reach is what PyTorch's matrix-vector kernels allow on this
    processor in these layouts, a part of the gap no loop making these calls can close.

Every contender makes exactly ``new_tokens`` tokens per row (no end token can stop one), and
the tokens must be identical across all of them (`scripts/bench_harness.interleave` checks it
before timing). Times are CPU times per round, interleaved, on one thread.

    python scripts/bench_decoding.py --quick     # tiny models, a few tokens (the smoke test)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded: the checkpoint is made here
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
for path in (ROOT, Path(__file__).resolve().parent):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from bench_harness import interleave, make_row, one_thread, ratio_summary  # noqa: E402

import utils.decoding as decoding  # noqa: E402
from utils.decoding import generate  # noqa: E402
from utils.models import DecoderOnlyLM  # noqa: E402
from utils.pretrained import load_gpt2  # noqa: E402

NEVER = 10**9  # an end token no model makes: every contender runs its full length

CH10 = {"vocab": 50, "d_model": 32, "heads": 4, "layers": 2, "prompt": 16, "new_tokens": 256,
        "batches": [1, 8]}
CH10_QUICK = {**CH10, "layers": 1, "prompt": 4, "new_tokens": 6, "batches": [1, 2]}
GPT2 = [
    {"name": "25M", "d_model": 320, "heads": 5, "layers": 6, "vocab": 50257, "prompt": 16,
     "new_tokens": 64, "batches": [1, 8]},
    {"name": "GPT-2 small (124M)", "d_model": 768, "heads": 12, "layers": 12, "vocab": 50257,
     "prompt": 16, "new_tokens": 48, "batches": [1, 8]},
]
GPT2_QUICK = [{"name": "tiny", "d_model": 32, "heads": 2, "layers": 1, "vocab": 101, "prompt": 4,
               "new_tokens": 6, "batches": [1, 2]}]
DECODE_GOAL = 1.5  # chapter 10's model: generate at most this times a bare cached loop (batch 1)
BANDWIDTH_GOAL = 0.75  # GPT-2 small at batch 1: at least this fraction of the bandwidth ceiling


# --- chapter 10's model ----------------------------------------------------------------------


def bare_lm_loop(model: DecoderOnlyLM, prompts: torch.Tensor, new_tokens: int) -> list[list[int]]:
    """Greedy decoding of a pre-LN `DecoderOnlyLM` written as plain PyTorch calls on its
    weights: a preallocated cache, the causal prompt pass, then one token per step."""
    emb, scale, pe = model.embed.weight, model.embed.tokens.scale, model.embed.positions.pe
    layers = []
    for layer in model.blocks.layers:
        a, ff = layer.self_attn, layer.ff
        layers.append((layer.norm1, torch.cat([a.w_q.weight, a.w_k.weight, a.w_v.weight]),
                       torch.cat([a.w_q.bias, a.w_k.bias, a.w_v.bias]), a.w_o, layer.norm2,
                       ff.linear1, ff.linear2))
    final, bias = model.blocks.norm, model.head.bias
    b, length = prompts.shape
    h, d = model.blocks.layers[0].self_attn.num_heads, model.d_model
    total = length + new_tokens
    keys = [torch.empty(b, h, total, d // h) for _ in layers]
    values = [torch.empty(b, h, total, d // h) for _ in layers]

    def norm(n: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (d,), n.weight, n.bias, n.eps)

    def run(x: torch.Tensor, start: int) -> torch.Tensor:
        n = x.shape[1]
        for i, (n1, w_qkv, b_qkv, w_o, n2, l1, l2) in enumerate(layers):
            q, k, v = F.linear(norm(n1, x), w_qkv, b_qkv).view(b, n, 3, h, d // h).permute(
                2, 0, 3, 1, 4)
            keys[i][:, :, start:start + n] = k
            values[i][:, :, start:start + n] = v
            out = F.scaled_dot_product_attention(q, keys[i][:, :, :start + n],
                                                 values[i][:, :, :start + n], is_causal=n > 1)
            x = x + F.linear(out.transpose(1, 2).reshape(b, n, d), w_o.weight, w_o.bias)
            x = x + F.linear(F.gelu(F.linear(norm(n2, x), l1.weight, l1.bias)), l2.weight,
                             l2.bias)
        return norm(final, x[:, -1]) @ emb.T + bias

    out = []
    with torch.inference_mode():
        tok = run(F.embedding(prompts, emb) * scale + pe[:length], 0).argmax(-1)
        out.append(tok)
        for t in range(length, total - 1):
            tok = run(F.embedding(tok[:, None], emb) * scale + pe[t], t).argmax(-1)
            out.append(tok)
    return torch.stack(out, 1).tolist()


def checked_generate(*args: object, **kwargs: object) -> list[list[int]]:
    """`generate` with every step through the model's checked modules: its plan refused, as it
    is for a model the library does not know (`utils.decoding_plan`)."""
    real = decoding.plan_for
    decoding.plan_for = lambda *a: None
    try:
        return generate(*args, **kwargs)
    finally:
        decoding.plan_for = real


def ch10_rows(sizes: dict, rounds: int, quick: bool) -> list[dict]:
    """Rows (d): generate against the bare loop (the goal at batch 1), against itself through
    the checked modules (what checking once per call saves), and the cache alone: through the
    checked modules with the cache and without it."""
    torch.manual_seed(0)
    s = sizes
    n = s["new_tokens"]
    model = DecoderOnlyLM(s["vocab"], d_model=s["d_model"], nhead=s["heads"],
                          num_layers=s["layers"], max_len=s["prompt"] + n).eval()
    rows = []
    for batch in s["batches"]:
        g = torch.Generator().manual_seed(batch)
        prompts = torch.randint(3, s["vocab"], (batch, s["prompt"]), generator=g)
        timings = interleave({
            "generate": partial(generate, model, prompts, n, eos=NEVER),
            "bare loop": partial(bare_lm_loop, model, prompts, n),
            "checked": partial(checked_generate, model, prompts, n, eos=NEVER),
            "no cache": partial(checked_generate, model, prompts, n, eos=NEVER,
                                use_cache=False),
        }, rounds)
        case = (f"B={batch}, prompt {s['prompt']}, {n} new tokens, d={s['d_model']}, "
                f"{s['layers']} layers, V={s['vocab']}")
        row = partial(make_row, "(d) decoding, chapter 10's model", case,
                      setup="1 thread, greedy, inference mode", same="tokens identical")
        summary = ratio_summary(timings, "generate", "bare loop")
        goal = batch == 1
        rows.append(row(
            "generate", "bare cached loop", summary,
            goal=f"at most {DECODE_GOAL:g}x a bare cached loop at batch 1" if goal else None,
            goal_value=summary["ratio_median"] if goal else None,
            goal_met=None if quick or not goal else summary["ratio_median"] <= DECODE_GOAL,
            note="" if goal else "no goal at this batch size; reported"))
        rows.append(row("generate", "generate through the checked modules",
                        ratio_summary(timings, "generate", "checked"),
                        note="what checking once per call saves"))
        cache = ratio_summary(timings, "no cache", "checked")
        rows.append(row(
            "generate, checked modules, cache", "the same without the cache",
            ratio_summary(timings, "checked", "no cache"),
            note=f"the cache alone: {cache['ratio_median']:.1f}x faster (median per round)",
            speedup=cache["ratio_median"]))
    return rows


# --- GPT-2 ----------------------------------------------------------------------------------


def write_gpt2(folder: Path, s: dict) -> int:
    """A random-weight GPT-2 checkpoint in ``folder``, written by `transformers`; returns its
    number of parameters."""
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()
    config = GPT2Config(vocab_size=s["vocab"], n_embd=s["d_model"], n_head=s["heads"],
                        n_layer=s["layers"], n_positions=s["prompt"] + s["new_tokens"])
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    model.save_pretrained(folder, safe_serialization=True)
    return sum(p.numel() for p in model.parameters())


def bare_gpt2_loop(sd: dict, s: dict, prompts: torch.Tensor, new_tokens: int) -> list[list[int]]:
    """Greedy decoding of GPT-2 as plain PyTorch calls on the checkpoint's tensors (``sd``,
    `transformers`' names, Conv1D weights (in, out)): what a hand-written loop costs."""
    d, h, n_layer = s["d_model"], s["heads"], s["layers"]
    wte, wpe = sd["transformer.wte.weight"], sd["transformer.wpe.weight"]
    layers = [[sd[f"transformer.h.{i}.{k}"] for k in (
        "ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias",
        "attn.c_proj.weight", "attn.c_proj.bias", "ln_2.weight", "ln_2.bias",
        "mlp.c_fc.weight", "mlp.c_fc.bias", "mlp.c_proj.weight", "mlp.c_proj.bias")]
        for i in range(n_layer)]
    lnf_w, lnf_b = sd["transformer.ln_f.weight"], sd["transformer.ln_f.bias"]
    b, length = prompts.shape
    total = length + new_tokens
    keys = [torch.empty(b, h, total, d // h) for _ in range(n_layer)]
    values = [torch.empty(b, h, total, d // h) for _ in range(n_layer)]

    def run(x: torch.Tensor, start: int) -> torch.Tensor:
        n = x.shape[1]
        for i, (g1, c1, wa, ba, wp, bp, g2, c2, wf, bf, wm, bm) in enumerate(layers):
            y = F.layer_norm(x, (d,), g1, c1)
            q, k, v = torch.addmm(ba, y.view(-1, d), wa).view(b, n, 3, h, d // h).permute(
                2, 0, 3, 1, 4)
            keys[i][:, :, start:start + n] = k
            values[i][:, :, start:start + n] = v
            out = F.scaled_dot_product_attention(q, keys[i][:, :, :start + n],
                                                 values[i][:, :, :start + n], is_causal=n > 1)
            x = x + torch.addmm(bp, out.transpose(1, 2).reshape(b * n, d), wp).view(b, n, d)
            y = F.gelu(torch.addmm(bf, F.layer_norm(x, (d,), g2, c2).view(-1, d), wf),
                       approximate="tanh")
            x = x + torch.addmm(bm, y, wm).view(b, n, d)
        return F.linear(F.layer_norm(x[:, -1], (d,), lnf_w, lnf_b), wte)

    out = []
    with torch.inference_mode():
        tok = run(wte[prompts] + wpe[:length], 0).argmax(-1)
        out.append(tok)
        for t in range(length, total - 1):
            tok = run(wte[tok[:, None]] + wpe[t], t).argmax(-1)
            out.append(tok)
    return torch.stack(out, 1).tolist()


UNCHECKED = object()  # the output of a contender that makes no tokens (`weight_products`)
PRODUCTS = "weight products alone"  # its name among the contenders of row (f)


def weight_products(model: torch.nn.Module, batch: int, prompt: int, new_tokens: int) -> object:
    """Only the weight products of greedy decoding, made as `utils.decoding_plan.DecodePlan`
    makes them, with ``model``'s own parameters (the same memory ours reads): per block the
    Q/K/V product (one, on the joined weight), the output projection and the two feed-forward
    products, then the output head at each row's last position; for the prompt's rows at once,
    then one row per step, as many steps as every contender makes. Nothing else: the time these
    matrix-vector calls alone take for a decoding of ``new_tokens`` tokens. Returns `UNCHECKED`
    (it makes no tokens)."""
    from utils.decoding_plan import _fused_qkv

    d = model.embed.tokens.weight.shape[1]
    parts = [(*_fused_qkv(b.attn), b.attn.w_o.weight, b.attn.w_o.bias, b.ff.linear1.weight,
              b.ff.linear1.bias, b.ff.linear2.weight, b.ff.linear2.bias) for b in model.blocks]
    head_w = model.head.weight
    g = torch.Generator().manual_seed(0)
    rows = [torch.randn(batch, n, d, generator=g) for n in (prompt, 1)]
    wide = [torch.randn(batch, n, parts[0][4].shape[0], generator=g) for n in (prompt, 1)]
    with torch.inference_mode():
        for step in range(new_tokens):
            x, y = rows[step > 0], wide[step > 0]
            for wa, ba, wp, bp, wf, bf, wm, bm in parts:
                F.linear(x, wa, ba)
                F.linear(x, wp, bp)
                F.linear(x, wf, bf)
                F.linear(y, wm, bm)
            F.linear(x[:, -1], head_w)  # the head: each row's last position
    return UNCHECKED


def _same_tokens(a: object, b: object) -> bool:
    return b is UNCHECKED or a == b


def read_bandwidths(mib: int = 512, repeats: int = 5) -> dict[str, float]:
    """Bytes per second one thread reads from memory, by three ways of reading a float32 matrix
    of ``mib`` MiB (far larger than any cache), the best of ``repeats`` passes each: a vector
    times the matrix stored row by row (``x @ W``, each row scaled and added: GPT-2's layout),
    the matrix times a vector (``W @ x``, a dot product per row: ``nn.Linear``'s), and a sum.
    The ceiling of `gpt2_rows` uses the fastest: the one hardest to reach."""
    cols = 768
    w = torch.randn(mib * 2**20 // 4 // cols, cols)
    rows_first = w.T.contiguous()  # (cols, rows): x @ rows_first reads it row by row
    x = torch.randn(1, cols)
    ways = {"x @ W": lambda: x @ rows_first, "W @ x": lambda: F.linear(x, w),
            "sum": lambda: w.sum()}
    found = {}
    with torch.inference_mode():
        for name, fn in ways.items():
            fn()
            best = float("inf")
            for _ in range(repeats):  # CPU time, as every contender is timed
                start = time.process_time()
                fn()
                best = min(best, time.process_time() - start)
            found[name] = w.numel() * 4 / best
    return found


def bytes_per_token(sd: dict, s: dict, batch: int) -> float:
    """Bytes one greedy step reads at this size: every weight once (the token table once, as the
    output projection; one row of it and of the positions for the input, negligible), and the
    cached keys and values, averaged over the steps."""
    weights = sum(t.numel() * t.element_size() for k, t in sd.items()
                  if k != "transformer.wpe.weight" and not k.endswith("attn.bias"))
    mean_context = s["prompt"] + s["new_tokens"] / 2
    cache = 2 * s["layers"] * batch * mean_context * s["d_model"] * 4
    return weights + cache


def _hf_generate(model: torch.nn.Module, prompts: torch.Tensor, n: int) -> list[list[int]]:
    """``transformers``' greedy generate of exactly ``n`` new tokens per row."""
    with torch.inference_mode():
        out = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=n,
                             min_new_tokens=n, do_sample=False)
    return out[:, prompts.shape[1]:].tolist()


def gpt2_rows(configs: list[dict], rounds: int, quick: bool) -> list[dict]:
    """Rows (f): per configuration and batch size, ours against transformers (sdpa, eager) and
    a bare loop; at batch 1, the fraction of the bandwidth ceiling."""
    from safetensors.torch import load_file
    from transformers import GPT2LMHeadModel

    mib = 32 if quick else 256
    rows = []
    for s in configs:
        with tempfile.TemporaryDirectory() as folder:
            params = write_gpt2(Path(folder), s)
            sd = load_file(str(Path(folder) / "model.safetensors"))
            theirs = {impl: GPT2LMHeadModel.from_pretrained(folder, attn_implementation=impl)
                      .eval() for impl in ("sdpa", "eager")}
            ours = load_gpt2(folder).eval()
        for model in theirs.values():
            model.generation_config.eos_token_id = None
            model.generation_config.pad_token_id = 0
        n = s["new_tokens"]
        for batch in s["batches"]:
            g = torch.Generator().manual_seed(batch)
            prompts = torch.randint(0, s["vocab"], (batch, s["prompt"]), generator=g)

            # The bandwidth of this machine drifts (other programs read memory too): it is
            # measured in every round, untimed, just before ours runs, and each round's
            # fractions use that round's ceiling.
            reads: list[dict[str, float]] = []

            def read(name: str, reads: list = reads, batch: int = batch) -> None:
                if name == "ours" and batch == 1:
                    reads.append(read_bandwidths(mib, 2))

            contenders = {
                "ours": partial(generate, ours, prompts, n, eos=NEVER),
                "transformers (sdpa)": partial(_hf_generate, theirs["sdpa"], prompts, n),
                "transformers (eager)": partial(_hf_generate, theirs["eager"], prompts, n),
                "bare loop": partial(bare_gpt2_loop, sd, s, prompts, n),
            }
            if batch == 1:  # what the kernels alone allow, beside the ceiling
                contenders[PRODUCTS] = partial(
                    weight_products, ours, batch, s["prompt"], n)
            timings = interleave(contenders, rounds, before=read, same=_same_tokens)
            made = batch * n
            per_token = bytes_per_token(sd, s, batch)
            case = (f"{s['name']}: B={batch}, prompt {s['prompt']}, {n} new tokens, "
                    f"d={s['d_model']}, {s['layers']} layers, {params / 1e6:.1f}M parameters")
            extra = {"tokens_per_s": {k: made / t.cpu_median for k, t in timings.items()
                                      if k != PRODUCTS},
                     "bytes_per_token": per_token}
            fractions = {}
            if reads:
                per_round = [max(r.values()) for r in reads[1:]]  # the warm-up's dropped
                bandwidth = statistics.median(per_round)
                fractions = {name: statistics.median(  # steps per second over the ceiling
                    n / t / (bw / per_token) for t, bw in zip(timing.cpu, per_round,
                                                              strict=True))
                    for name, timing in timings.items()}
                extra |= {"bandwidth_gb_s": bandwidth / 1e9,
                          "bandwidth_range_gb_s": [min(per_round) / 1e9, max(per_round) / 1e9],
                          "bandwidths_gb_s": {k: statistics.median(r[k] for r in reads[1:])
                                              / 1e9 for k in reads[0]},
                          "ceiling_steps_per_s": bandwidth / per_token,
                          "fraction_of_ceiling": fractions}
                if PRODUCTS in timings:  # ours / the products, per round
                    extra["over_weight_products"] = ratio_summary(
                        timings, "ours", PRODUCTS)["ratio_median"]
            small = s["name"].startswith("GPT-2 small")
            for ref in ("transformers (sdpa)", "transformers (eager)", "bare loop"):
                summary = ratio_summary(timings, "ours", ref)
                goal = goal_value = goal_met = None
                if ref == "transformers (sdpa)":
                    goal, goal_value = "at most 1.0x transformers' time", summary["ratio_median"]
                    goal_met = None if quick else goal_value <= 1.0
                if ref == "bare loop" and small and batch == 1:
                    goal = (f"at least {BANDWIDTH_GOAL:.0%} of the bandwidth ceiling at batch 1")
                    goal_value = fractions["ours"]
                    goal_met = None if quick else goal_value >= BANDWIDTH_GOAL
                note = ""
                if fractions:
                    low, high = extra["bandwidth_range_gb_s"]
                    ways = ", ".join(f"{k} {v:.1f}" for k, v in extra["bandwidths_gb_s"].items())
                    note = (f"ceiling: {bandwidth / 1e9:.1f} GB/s (median over the rounds, "
                            f"{low:.1f} to {high:.1f}; the fastest of {ways} GB/s) over "
                            f"{per_token / 1e6:.0f} MB per token = "
                            f"{extra['ceiling_steps_per_s']:.1f} tokens/s; reached (median per "
                            f"round): " + ", ".join(f"{k} {v:.0%}" for k, v in fractions.items()))
                    if "over_weight_products" in extra:
                        note += (f"; ours takes {extra['over_weight_products']:.2f}x the time "
                                 "of its weight products alone (median per round)")
                rows.append(make_row(
                    "(f) decoding, GPT-2", case, "load_gpt2 + generate", ref, summary,
                    setup="1 thread, greedy, inference mode, float32", same="tokens identical",
                    goal=goal, goal_value=goal_value, goal_met=goal_met, note=note, **extra))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny models (a smoke test)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    with one_thread():
        rows = ch10_rows(CH10_QUICK if args.quick else CH10, args.rounds, args.quick)
        rows += gpt2_rows(GPT2_QUICK if args.quick else GPT2, args.rounds, args.quick)
    for r in rows:
        print(f"{r['group']} | {r['case']} | vs {r['reference']}: median {r['ratio_median']:.2f}"
              f" (min {r['ratio_min']:.2f}) {r['note']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
