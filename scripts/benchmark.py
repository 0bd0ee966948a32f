"""Speed and memory of the book's attention code, each figure a ratio against PyTorch's.

    python scripts/benchmark.py                      # -> _build/bench/benchmark.md and .json
    python scripts/benchmark.py --quick              # tiny sizes, a few seconds (the smoke test)
    python scripts/benchmark.py --device cuda --repeats 10 --out DIR/bench.md
    python scripts/benchmark.py --threads 1          # torch.set_num_threads(1) first

Every row times one of the book's functions and its PyTorch counterpart in the same run, on the
same inputs, device and number of threads: the median of ``--repeats`` runs after one warm-up
run that is not counted, ours and the reference taking turns in rows (a) and (d), so that a
machine whose speed drifts during the run slows both alike. The ratio ``ours / PyTorch``
(above 1: ours is slower or bigger) is what to read; absolute times depend on the machine and on
what else runs on it. Rows:

(a) `utils.attention.MultiHeadAttention` against ``nn.MultiheadAttention(need_weights=False)``
    holding the same weights (``from_torch``), forward (``torch.no_grad()``, eval mode) and
    forward + backward.
(b) `scaled_dot_product_attention` and `memory_efficient_attention` against
    ``torch.nn.functional.scaled_dot_product_attention`` at L = 4096, 4 heads, d_k = 64: time,
    GFLOP/s (4 L^2 d_k h / time: two matrix products of 2 L^2 d_k flops per head) and peak memory.
(c) `local_attention` (window 64) against PyTorch's attention under the same banded mask, as L
    grows; the book's own masked `scaled_dot_product_attention` is shown in the notes.
(d) `utils.decoding.generate` with the KV cache against without it, when ``generate`` takes
    ``use_cache`` (skipped otherwise), 256 new tokens on a model of chapter 10's size, for one
    prompt and for a batch of 8. The reference here is the book's own uncached loop.
(e) `utils.tokenizer.ByteBPETokenizer.encode` on the book's prose (with an empty cache of
    pre-tokens and with a warm one) against Hugging Face's ``tokenizers`` loaded from the same
    ``vocab.json`` and ``merges.txt``, on one thread; the ids must be identical
    (`scripts/bench_tokenizer.py`). CPU only.
(f) `utils.decoding.generate` on a GPT-2 checkpoint of about 25M parameters, written by
    ``transformers`` and read by `utils.pretrained.load_gpt2`, against ``transformers``'
    ``generate`` on the same weights: greedy, both with their caches, 256 new tokens, batch 1
    and 8, the same tokens asserted; tokens per second (`scripts/bench_decoding.py`). CPU only.

The table ends with the goals: (a) at most 1.2 times PyTorch's time, (b) the memory-efficient
peak at most 1/8 of the plain one at L = 4096, (d) the cache at least 5 times faster, (f) the
book's generate at least as fast as ``transformers``' at both batch sizes.

Peak memory, how it is measured: each variant runs once, under ``torch.no_grad()``, in a process
of its own (so nothing allocated by another variant is counted or reused), forked from a server
process that has imported torch and the book's modules and run nothing else: as fresh as a new
Python process, without paying for the imports once per variant. On CPU the process
creates its inputs, runs a tiny warm-up (lazy initialisation), resets the kernel's high-water mark
of its resident memory (writing 5 to /proc/self/clear_refs, Linux) and reports VmHWM minus the
resident memory just before the call: the real peak growth, in pages actually touched. glibc
is told (``MALLOC_MMAP_THRESHOLD_``) to give every block of 64 KiB or more its own mapping, so
that a freed tensor is returned to the kernel instead of being kept and silently reused. Where
clear_refs is not available (not Linux), ``resource.getrusage``'s ``ru_maxrss`` is used, which
cannot be reset and so only counts growth beyond the peak of start-up. On CUDA it is
``torch.cuda.max_memory_allocated()`` after ``reset_peak_memory_stats()``, minus what was allocated
before the call. The notes also give, for the book's functions, the size of the largest
intermediate computed from the shapes.
"""

from __future__ import annotations

import argparse
import atexit
import datetime
import gc
import importlib
import inspect
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from utils.attention import MultiHeadAttention, scaled_dot_product_attention  # noqa: E402
from utils.data import book_prose  # noqa: E402
from utils.fast_attention import local_attention, memory_efficient_attention  # noqa: E402
from utils.masks import local_mask  # noqa: E402

DEFAULT_OUT = ROOT / "_build" / "bench" / "benchmark.md"
MIB = 2**20
MEMORY_GOAL = 1 / 8  # memory_efficient_attention's peak over the plain version's, at most
MHA_GOAL = 1.2  # MultiHeadAttention's time over nn.MultiheadAttention's, at most
CACHE_GOAL = 5.0  # generate's speed-up from the KV cache, at least
PAGE = 4096  # a reference peak below one page is below what the measurement can see

FULL = {
    "mha": [(8, 128, 256, 8), (4, 512, 256, 8), (1, 2048, 128, 4)],  # (B, L, d_model, h)
    "sdpa": {"length": 4096, "heads": 4, "d_k": 64, "block": 256},
    "local": {"lengths": [1024, 2048, 4096], "window": 64, "heads": 4, "d_k": 64},
    # chapter 10's language model: d_model 32, 4 heads, 2 layers; 256 new tokens
    "generate": {"batches": [1, 8], "prompt": 16, "new_tokens": 256, "d_model": 32, "layers": 2},
    "tokenizer": {"chapters": None, "vocab": 1000},  # the whole book's prose
    "decoding": "FULL",  # scripts/bench_decoding.py's sizes
    "repeats": 5,
}
QUICK = {
    "mha": [(2, 16, 32, 4), (1, 32, 32, 4), (1, 64, 16, 2)],
    "sdpa": {"length": 256, "heads": 2, "d_k": 16, "block": 32},
    "local": {"lengths": [128, 256], "window": 8, "heads": 2, "d_k": 16},
    "generate": {"batches": [2], "prompt": 4, "new_tokens": 4, "d_model": 32, "layers": 1},
    "tokenizer": {"chapters": [1], "vocab": 300},
    "decoding": "QUICK",
    "repeats": 2,
}


# --- timing --------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_times(fns: list[Callable[[], object]], device: torch.device, repeats: int,
                 warmup: int = 1) -> list[float]:
    """Median wall time of each ``fn()`` in seconds over ``repeats`` runs, after ``warmup`` runs
    of each. The functions take turns (a, b, a, b, ...), so that a machine that slows down or
    speeds up during the measurement affects ours and the reference alike."""
    for fn in fns:
        for _ in range(warmup):
            fn()
    _sync(device)
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, seen in zip(fns, times, strict=True):
            _sync(device)
            start = time.perf_counter()
            fn()
            _sync(device)
            seen.append(time.perf_counter() - start)
    return [statistics.median(seen) for seen in times]


def median_time(fn: Callable[[], object], device: torch.device, repeats: int,
                warmup: int = 1) -> float:
    """Median wall time of ``fn()`` in seconds over ``repeats`` runs, after ``warmup`` runs."""
    return median_times([fn], device, repeats, warmup)[0]


# --- the attention variants whose memory is measured, one per process -------------------------


def _attention_inputs(length: int, heads: int, d_k: int, device: torch.device,
                      seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (1, heads, length, d_k)
    return tuple(torch.randn(shape, generator=g).to(device) for _ in range(3))


def _variant(name: str, length: int, window: int, block: int, device: torch.device,
             ) -> tuple[Callable, tuple]:
    """The function of variant ``name`` and any extra argument it needs (made before timing)."""
    if name == "utils_sdpa":
        return (lambda q, k, v: scaled_dot_product_attention(q, k, v)[0]), ()
    if name == "memory_efficient":
        return (lambda q, k, v: memory_efficient_attention(q, k, v, block_size=block)), ()
    if name == "torch_sdpa":
        return F.scaled_dot_product_attention, ()
    mask = local_mask(length, window, device=device)
    if name == "local":
        return (lambda q, k, v: local_attention(q, k, v, window)), ()
    if name == "torch_sdpa_banded":
        return (lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m)), (mask,)
    if name == "utils_sdpa_banded":
        return (lambda q, k, v, m: scaled_dot_product_attention(q, k, v, m)[0]), (mask,)
    raise ValueError(f"unknown variant {name!r}")


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(f"{field} not in /proc/self/status")


def _child_memory(spec: dict) -> dict:
    """Run one variant once and return its peak memory growth in bytes (in a process of its own)."""
    torch.set_num_threads(spec["threads"])
    device = torch.device(spec["device"])
    fn, extra = _variant(spec["variant"], spec["length"], spec["window"], spec["block"], device)
    with torch.no_grad():
        # warm-up on tiny inputs: lazy initialisation (thread pools, kernels) is not counted
        small = _attention_inputs(32, 1, spec["d_k"], device)
        small_extra = _variant(spec["variant"], 32, spec["window"], spec["block"], device)[1]
        fn(*small, *small_extra)
        q, k, v = _attention_inputs(spec["length"], spec["heads"], spec["d_k"], device)
        del small, small_extra
        gc.collect()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
            out = fn(q, k, v, *extra)
            torch.cuda.synchronize(device)
            peak = torch.cuda.max_memory_allocated(device) - before
            method = "torch.cuda.max_memory_allocated"
        else:
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")  # reset the high-water mark to the current resident size
                before = _status_kib("VmRSS")
                out = fn(q, k, v, *extra)
                peak = (_status_kib("VmHWM") - before) * 1024
                method = "VmHWM after clear_refs"
            except OSError:
                scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB on Linux
                before_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
                out = fn(q, k, v, *extra)
                after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
                peak = after - before_rss
                method = "ru_maxrss growth"
    return {"peak_bytes": int(peak), "method": method, "out_shape": list(out.shape)}


class _MemoryServer:
    """A process started once, with glibc's allocator told to map every block of 64 KiB or more
    on its own and never to trim (``MALLOC_*`` must be set before a process starts), that forks
    one child per variant: the child measures and reports, then exits. The server only imports;
    it never runs a tensor operation, so no thread pool exists when it forks."""

    def __init__(self) -> None:
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--memory-server"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)

    def measure(self, spec: dict) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(spec) + "\n")
        self.proc.stdin.flush()
        reply = json.loads(self.proc.stdout.readline() or '{"error": "the server exited"}')
        if "error" in reply:
            raise RuntimeError(f"memory measurement of {spec['variant']} failed:\n"
                               f"{reply['error']}")
        return reply["result"]

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)


def _serve_memory() -> None:
    """The server's side: one JSON spec per line in, one JSON reply per line out."""
    for line in sys.stdin:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: measure, write the reply, exit without cleaning up
            os.close(read)
            try:
                reply = {"result": _child_memory(json.loads(line))}
            except BaseException:  # noqa: BLE001 - reported to the parent, which raises
                reply = {"error": traceback.format_exc()}
            with os.fdopen(write, "w") as f:
                f.write(json.dumps(reply))
            os._exit(0)
        os.close(write)
        with os.fdopen(read) as f:
            data = f.read()
        _, status = os.waitpid(pid, 0)
        if not data:
            data = json.dumps({"error": f"the child ended with status {status}, no reply"})
        sys.stdout.write(data + "\n")
        sys.stdout.flush()


_SERVER: _MemoryServer | None = None


def measure_memory(variant: str, length: int, heads: int, d_k: int, window: int, block: int,
                   device: torch.device) -> dict:
    """Peak memory growth of one call of ``variant``, measured in a process of its own."""
    global _SERVER
    if _SERVER is None:
        _SERVER = _MemoryServer()
        atexit.register(_SERVER.close)
    spec = {"variant": variant, "length": length, "heads": heads, "d_k": d_k, "window": window,
            "block": block, "device": str(device), "threads": torch.get_num_threads()}
    return _SERVER.measure(spec)


# --- the rows -------------------------------------------------------------------------------


def _row(group: str, case: str, ours: str, reference: str, ours_s: float, ref_s: float,
         ours_mem: int | None = None, ref_mem: int | None = None, note: str = "") -> dict:
    return {
        "group": group, "case": case, "ours": ours, "reference": reference,
        "ours_ms": ours_s * 1e3, "ref_ms": ref_s * 1e3, "time_ratio": ours_s / ref_s,
        "ours_mib": None if ours_mem is None else ours_mem / MIB,
        "ref_mib": None if ref_mem is None else ref_mem / MIB,
        "memory_ratio": (None if ours_mem is None or ref_mem is None or ref_mem < PAGE
                         else ours_mem / ref_mem),
        "note": note,
    }


def _train_step(module: nn.Module, x: torch.Tensor, **kwargs: object) -> None:
    """One forward and backward pass of self-attention on ``x``, gradients cleared first."""
    module.zero_grad(set_to_none=True)
    out = module(x, x, x, **kwargs)
    out = out[0] if isinstance(out, tuple) else out  # nn.MultiheadAttention: (output, None)
    out.sum().backward()


def bench_mha(sizes: dict, device: torch.device, repeats: int) -> list[dict]:
    rows = []
    for b, length, d_model, h in sizes["mha"]:
        torch.manual_seed(0)
        ref = nn.MultiheadAttention(d_model, h, batch_first=True).to(device)
        ours = MultiHeadAttention.from_torch(ref)
        x = torch.randn(b, length, d_model, device=device)
        case = f"B={b}, L={length}, d={d_model}, h={h}"
        names = ("MultiHeadAttention", "nn.MultiheadAttention(need_weights=False)")

        ref.eval()
        ours.eval()
        with torch.no_grad():
            t_ours, t_ref = median_times([partial(ours, x, x, x),
                                          partial(ref, x, x, x, need_weights=False)],
                                         device, repeats)
        rows.append(_row("(a) forward", case, *names, t_ours, t_ref,
                         note="eval mode, torch.no_grad()"))

        ref.train()
        ours.train()

        t_ours, t_ref = median_times([partial(_train_step, ours, x),
                                      partial(_train_step, ref, x, need_weights=False)],
                                     device, repeats)
        rows.append(_row("(a) forward+backward", case, *names, t_ours, t_ref))
    return rows


def bench_sdpa(sizes: dict, device: torch.device, repeats: int,
               memory: bool = True) -> tuple[list[dict], dict | None]:
    """Rows (b), and the memory goal (None without ``memory``: the peaks are then not measured,
    which saves the fresh processes, as a notebook wants)."""
    s = sizes["sdpa"]
    length, heads, d_k, block = s["length"], s["heads"], s["d_k"], s["block"]
    q, k, v = _attention_inputs(length, heads, d_k, device)
    flops = 4 * length * length * d_k * heads
    times, mems = {}, {}
    for name in ("torch_sdpa", "utils_sdpa", "memory_efficient"):
        fn, extra = _variant(name, length, 0, block, device)
        with torch.no_grad():
            times[name] = median_time(partial(fn, q, k, v, *extra), device, repeats)
        mems[name] = (measure_memory(name, length, heads, d_k, 0, block, device)["peak_bytes"]
                      if memory else None)
    case = f"L={length}, h={heads}, d_k={d_k}"
    elt = q.element_size()
    gflops = {n: flops / t / 1e9 for n, t in times.items()}
    rows = [
        _row("(b) attention", case, "scaled_dot_product_attention",
             "F.scaled_dot_product_attention", times["utils_sdpa"], times["torch_sdpa"],
             mems["utils_sdpa"], mems["torch_sdpa"],
             note=f"{gflops['utils_sdpa']:.1f} vs {gflops['torch_sdpa']:.1f} GFLOP/s; largest "
                  f"intermediate h L^2 = {heads * length**2 * elt / MIB:.1f} MiB"),
        _row("(b) attention", case, f"memory_efficient_attention (block {block})",
             "F.scaled_dot_product_attention", times["memory_efficient"], times["torch_sdpa"],
             mems["memory_efficient"], mems["torch_sdpa"],
             note=f"{gflops['memory_efficient']:.1f} vs {gflops['torch_sdpa']:.1f} GFLOP/s; "
                  f"largest intermediate h block^2 = {heads * block**2 * elt / MIB:.2f} MiB"),
    ]
    if not memory:
        return rows, None
    ratio = mems["memory_efficient"] / max(mems["utils_sdpa"], 1)
    goal = {"memory_efficient_over_plain": ratio, "goal": MEMORY_GOAL, "met": ratio <= MEMORY_GOAL,
            "length": length}
    return rows, goal


def bench_local(sizes: dict, device: torch.device, repeats: int,
                memory: bool = True) -> list[dict]:
    """Rows (c); ``memory=False`` leaves the peaks unmeasured."""
    s = sizes["local"]
    window, heads, d_k = s["window"], s["heads"], s["d_k"]
    rows = []
    for length in s["lengths"]:
        q, k, v = _attention_inputs(length, heads, d_k, device)
        times, mems = {}, {}
        for name in ("torch_sdpa_banded", "utils_sdpa_banded", "local"):
            fn, extra = _variant(name, length, window, 0, device)
            with torch.no_grad():
                times[name] = median_time(partial(fn, q, k, v, *extra), device, repeats)
            mems[name] = (measure_memory(name, length, heads, d_k, window, 0,
                                         device)["peak_bytes"] if memory else None)
        rows.append(_row(
            "(c) local", f"L={length}, window={window}, h={heads}, d_k={d_k}",
            "local_attention", "F.scaled_dot_product_attention(local_mask)",
            times["local"], times["torch_sdpa_banded"], mems["local"], mems["torch_sdpa_banded"],
            note="book's masked scaled_dot_product_attention: "
                 f"{times['utils_sdpa_banded'] * 1e3:.1f} ms"
                 + (f", {mems['utils_sdpa_banded'] / MIB:.1f} MiB" if memory else "")))
    return rows


def bench_generate(sizes: dict, device: torch.device, repeats: int) -> list[dict]:
    from utils import decoding
    from utils.models import DecoderOnlyLM

    s = sizes["generate"]
    if "use_cache" not in inspect.signature(decoding.generate).parameters:
        return [{"group": "(d) generate", "case": "skipped", "ours": "generate(use_cache=True)",
                 "reference": "generate(use_cache=False)", "skipped":
                 "utils.decoding.generate has no use_cache argument in this version"}]
    torch.manual_seed(0)
    vocab = 50
    model = DecoderOnlyLM(vocab, d_model=s["d_model"], nhead=4, num_layers=s["layers"],
                          max_len=s["prompt"] + s["new_tokens"]).to(device).eval()
    rows = []
    for batch in s["batches"]:
        g = torch.Generator().manual_seed(0)
        prompts = torch.randint(3, vocab, (batch, s["prompt"]), generator=g).tolist()
        # Greedy with an untrained model: a row may stop early at <eos>; both runs stop alike.
        tokens = {}

        def run(use_cache: bool, prompts: list = prompts, tokens: dict = tokens) -> None:
            tokens[use_cache] = decoding.generate(model, prompts, s["new_tokens"],
                                                  use_cache=use_cache)

        with torch.no_grad():
            t_ours, t_ref = median_times([partial(run, True), partial(run, False)], device,
                                         repeats)
        same = tokens[True] == tokens[False]
        made = sum(len(t) for t in tokens[True])
        case = (f"B={batch}, prompt {s['prompt']}, up to {s['new_tokens']} new tokens, "
                f"d={s['d_model']}, {s['layers']} layers")
        rows.append(_row("(d) generate", case, "generate(use_cache=True)",
                         "generate(use_cache=False)", t_ours, t_ref,
                         note=f"greedy, median of {repeats}; {made} tokens made; same tokens: "
                              f"{same}; speed-up {t_ref / t_ours:.1f}x"))
    return rows


def _sibling(name: str) -> object:
    """A script beside this one, imported only when its rows are measured: chapter 13 loads this
    file for its own rows, and should not pay for importing tokenizers and transformers."""
    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:
        sys.path.insert(0, here)
    return importlib.import_module(name)


def bench_tokenizer_rows(sizes: dict, repeats: int) -> list[dict]:
    """(e): encoding the book's prose with `utils.tokenizer` against Hugging Face's tokenizers
    loaded from the same files (`scripts/bench_tokenizer.py`), the same ids asserted."""
    s = sizes["tokenizer"]
    r = _sibling("bench_tokenizer").bench_tokenizer(book_prose(s["chapters"]), s["vocab"], repeats)
    case = (f"{r['chars']:,} characters of the book's prose, {r['tokens']:,} tokens, "
            f"vocabulary {r['vocab_size']:,}")
    rows = []
    for name, label in (("ours_cold", "empty cache"), ("ours_warm", "warm cache")):
        row = _row("(e) tokenizer", case, f"ByteBPETokenizer.encode ({label})",
                   "tokenizers BPE + ByteLevel (1 thread)", r[f"{name}_ms"] / 1e3,
                   r["tokenizers_ms"] / 1e3,
                   note=f"the same ids; tokens/s ours {r[f'{name}_tokens_per_s']:,}, "
                        f"tokenizers {r['tokenizers_tokens_per_s']:,}; the whole text is one "
                        f"string")
        rows.append(row)
    return rows


def goals(rows: list[dict], memory: dict, quick: bool) -> list[str]:
    """One line per goal of the benchmark: the figure measured and whether it is met."""
    def verdict(ok: bool) -> str:
        return "not judged: --quick sizes" if quick else ("met" if ok else "NOT met")

    lines = []
    mha = [r for r in rows if r["group"].startswith("(a)") and "skipped" not in r]
    if mha:
        worst = max(mha, key=lambda r: r["time_ratio"])
        lines.append(f"- MultiHeadAttention at most {MHA_GOAL:g}x nn.MultiheadAttention's time "
                     f"(need_weights=False), forward and forward+backward, at every shape: "
                     f"worst ratio {worst['time_ratio']:.2f} ({worst['group'][4:]}, "
                     f"{worst['case']}) ({verdict(worst['time_ratio'] <= MHA_GOAL)}).")
    lines.append(f"- memory_efficient_attention's peak memory at most 1/8 of scaled_dot_product_"
                 f"attention's at L={memory['length']}: measured ratio "
                 f"{memory['memory_efficient_over_plain']:.4f} ({verdict(memory['met'])}).")
    for r in rows:
        if r["group"] == "(d) generate" and "skipped" not in r:
            speed = 1 / r["time_ratio"]
            lines.append(f"- generate with the KV cache at least {CACHE_GOAL:g}x faster than "
                         f"without, {r['case']}: {speed:.1f}x ({verdict(speed >= CACHE_GOAL)}).")
        if r["group"].startswith("(f)"):
            lines.append(f"- the book's generate on a loaded GPT-2 at least as fast as "
                         f"transformers' generate, {r['case']}: {r['ours_tokens_per_s']:,.0f} "
                         f"against {r['ref_tokens_per_s']:,.0f} tokens/s "
                         f"({verdict(r['time_ratio'] <= 1.0)}).")
    return lines


# --- report ---------------------------------------------------------------------------------


def _fmt(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(device)})"
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"cpu ({name}, {os.cpu_count()} logical cores)"


def render(meta: dict, rows: list[dict], goal: dict) -> str:
    lines = [
        "# Attention benchmark",
        "",
        f"- date: {meta['date']}",
        f"- device: {meta['device']}",
        f"- torch threads: {meta['threads']} (torch.get_num_threads()); torch {meta['torch']}",
        f"- load average at start: {meta['load']}",
        f"- timing: median of {meta['repeats']} runs after 1 warm-up run (in (a) and (d) ours "
        "and the reference take turns); ratio = ours / "
        "reference (above 1: ours is slower or uses more memory)",
        f"- peak memory: {meta['memory_method']}, one process per variant (forked from one "
        "that only imported)",
        "",
        *table(rows),
    ]
    lines += ["", "Goals:", "", *goals(rows, goal, meta["quick"]), ""]
    return "\n".join(lines)


def table(rows: list[dict]) -> list[str]:
    """The rows as the lines of a Markdown table, its header included."""
    lines = ["| group | case | ours | reference | ours ms | ref ms | time ratio | ours MiB | "
             "ref MiB | memory ratio | notes |",
             "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['group']} | skipped | {r['ours']} | {r['reference']} | - | - | "
                         f"- | - | - | - | {r['skipped']} |")
            continue
        lines.append(
            f"| {r['group']} | {r['case']} | {r['ours']} | {r['reference']} | "
            f"{_fmt(r['ours_ms'])} | {_fmt(r['ref_ms'])} | {_fmt(r['time_ratio'])} | "
            f"{_fmt(r['ours_mib'], 1)} | {_fmt(r['ref_mib'], 1)} | "
            f"{_fmt(r['memory_ratio'])} | {r['note']} |")
    return lines


def _memory_method(device: torch.device) -> str:
    if device.type == "cuda":
        return "torch.cuda.max_memory_allocated() growth"
    if os.path.exists("/proc/self/clear_refs"):
        return ("resident-set high-water mark (VmHWM, reset through /proc/self/clear_refs) "
                "minus the resident size before the call")
    return "resource.getrusage ru_maxrss growth"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke test)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed runs per figure (default 5, 2 with --quick)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: torch's own choice); on a busy machine "
                             "fewer threads than cores give steadier times")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help="the Markdown table; the JSON goes beside it (default "
                             "_build/bench/benchmark.md)")
    parser.add_argument("--memory-server", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.memory_server:
        _serve_memory()
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        print("benchmark.py: --device cuda asked for, but torch finds no CUDA device here; "
              "run with --device cpu", file=sys.stderr)
        return 2
    sizes = QUICK if args.quick else FULL
    repeats = args.repeats if args.repeats is not None else sizes["repeats"]
    if repeats < 1:
        parser.error(f"--repeats must be at least 1, got {repeats}")
    if args.threads is not None:
        if args.threads < 1:
            parser.error(f"--threads must be at least 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)

    meta = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "device": device_name(device),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "load": " ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg")
        else "unknown",
        "repeats": repeats,
        "memory_method": _memory_method(device),
        "quick": args.quick,
    }
    start = time.perf_counter()
    rows = bench_mha(sizes, device, repeats)
    sdpa_rows, goal = bench_sdpa(sizes, device, repeats)
    rows += sdpa_rows
    rows += bench_local(sizes, device, repeats)
    rows += bench_generate(sizes, device, repeats)
    if device.type == "cpu":  # the tokenizer and transformers' generate: CPU only here
        rows += bench_tokenizer_rows(sizes, repeats)
        decoding = _sibling("bench_decoding")
        rows += decoding.bench_decoding(getattr(decoding, sizes["decoding"]), repeats)
    meta["seconds"] = round(time.perf_counter() - start, 1)

    text = render(meta, rows, goal)
    print(text)
    out = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    out.with_suffix(".json").write_text(
        json.dumps({"meta": meta, "rows": rows, "memory_goal": goal}, indent=1,
                   default=lambda x: None if isinstance(x, float) and math.isnan(x) else x) + "\n")
    print(f"written: {out} and {out.with_suffix('.json')} ({meta['seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
