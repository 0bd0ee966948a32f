"""Speed and memory of the book's code, each figure a ratio against the code a user would pick.

    python scripts/benchmark.py                  # full sizes -> _build/bench/benchmark.md, .json
    python scripts/benchmark.py --quick          # tiny sizes, under a minute (the smoke test)
    python scripts/benchmark.py --rounds 7 --out DIR/bench.md
    python scripts/benchmark.py --only a,b       # some groups of rows only

How it measures (`scripts/bench_harness.py`): torch runs on one thread (``--threads`` to
change it: every row then states it), so that a figure is the work the code does and not how
busy the machine's other cores are. In each row every contender runs in this one process, in
rounds, the order reversed every round, after one untimed warm-up call whose outputs are
checked equal across contenders (to float32 rounding, or exactly for tokens and ids): a faster
wrong answer stops the run. The figure is the ratio ours / reference of CPU times, formed per
round; the table gives its median and minimum over the rounds, and the median wall-time ratio
beside them (above 1: ours is slower). On a GPU (``--device cuda``) the clock is the wall clock
after synchronising, since CPU time would miss the device's work. Each goal is judged on the
median CPU-time ratio, and only at full size (``--quick`` says "not judged").

Rows (the peers in `bench_attention`, `bench_tokenizer`, `bench_decoding`):

(a) `MultiHeadAttention` against the SDPA block and ``nn.MultiheadAttention``, evaluation and
    training, without a mask and causal;
(b) `scaled_dot_product_attention` and `memory_efficient_attention` against
    ``F.scaled_dot_product_attention``: time and peak memory, L = 4096 and 8192;
(c) `local_attention` against ``F.scaled_dot_product_attention`` under its banded mask;
(d) `generate` on chapter 10's model against a bare cached loop on the same weights, against
    itself through the checked modules, and the cache alone (with and without it);
(e) the tokenizer, encoding and decoding the book's prose, against Hugging Face ``tokenizers``
    (batch mode, its cache emptied) and ``tiktoken`` built from the same vocabulary (CPU only);
(f) `generate` on GPT-2-shaped checkpoints (25M parameters and GPT-2 small's 124M) against
    ``transformers``' ``generate`` with each attention implementation and a bare loop, and the
    fraction of the memory-bandwidth ceiling each reaches at batch 1 (CPU only).

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
before the call.
"""

from __future__ import annotations

import argparse
import atexit
import datetime
import gc
import json
import math
import os
import platform
import resource
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
for _path in (ROOT, Path(__file__).resolve().parent):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from utils.attention import scaled_dot_product_attention  # noqa: E402
from utils.fast_attention import local_attention, memory_efficient_attention  # noqa: E402
from utils.masks import local_mask  # noqa: E402

DEFAULT_OUT = ROOT / "_build" / "bench" / "benchmark.md"
MIB = 2**20
GROUPS = "abcdef"

FULL = {
    "mha": [(8, 128, 256, 8), (4, 512, 256, 8), (1, 2048, 128, 4)],  # (B, L, d_model, h)
    "causal_length": 2048,  # the causal goal's L
    "sdpa": {"lengths": [4096, 8192], "heads": 4, "d_k": 64, "block": 256, "plain_up_to": 4096},
    "local": {"lengths": [1024, 2048, 4096], "window": 64, "heads": 4, "d_k": 64},
    "rounds": 5,
}
QUICK = {
    "mha": [(2, 16, 32, 4), (1, 64, 16, 2)],
    "causal_length": 64,
    "sdpa": {"lengths": [256], "heads": 2, "d_k": 16, "block": 32, "plain_up_to": 256},
    "local": {"lengths": [128, 256], "window": 8, "heads": 2, "d_k": 16},
    "rounds": 2,
}


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


def verdict(row: dict) -> str:
    """A row's goal and whether it is met, in words ("" for a row without a goal)."""
    if row.get("goal") is None:
        return ""
    judged = ("not judged (--quick)" if row["goal_met"] is None
              else "met" if row["goal_met"] else "NOT met")
    return f"{row['goal']}: {judged}"


def table(rows: list[dict]) -> list[str]:
    """The rows as the lines of a Markdown table, its header included."""
    lines = ["| group | case | ours | reference | setup | ours ms | ref ms | CPU ratio, median "
             "(min) | wall ratio | ours MiB | ref MiB | memory ratio | same | goal | notes |",
             "| --- | --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | "
             "--- | --- | --- |"]
    for r in rows:
        lines.append(
            f"| {r['group']} | {r['case']} | {r['ours']} | {r['reference']} | {r['setup']} | "
            f"{_fmt(r['ours_ms'])} | {_fmt(r['ref_ms'])} | {_fmt(r['ratio_median'])} "
            f"({_fmt(r['ratio_min'])}) | {_fmt(r['wall_ratio_median'])} | "
            f"{_fmt(r.get('ours_mib'), 1)} | {_fmt(r.get('ref_mib'), 1)} | "
            f"{_fmt(r.get('memory_ratio'))} | {r['same']} | {verdict(r)} | {r['note']} |")
    return lines


def goals(rows: list[dict]) -> list[str]:
    """One line per row that has a goal: the figure and the verdict."""
    lines = []
    for r in rows:
        if r.get("goal") is None:
            continue
        figure = r["goal_value"]
        shown = f"{figure:.0%} of the ceiling" if "ceiling" in r["goal"] else f"{figure:.2f}x"
        lines.append(f"- {r['group']}, {r['case']}, {r['ours']} against {r['reference']}: "
                     f"{shown}; {verdict(r)}.")
    return lines


def render(meta: dict, rows: list[dict]) -> str:
    lines = [
        "# Benchmark",
        "",
        f"- date: {meta['date']}",
        f"- device: {meta['device']}",
        f"- torch threads: {meta['threads']}; torch {meta['torch']}",
        f"- load average at start: {meta['load']}",
        f"- timing: {meta['rounds']} interleaved rounds after a warm-up, order reversed every "
        f"round; ratio = ours / reference of {meta['clock']}, per round (median and minimum)",
        f"- peak memory: {meta['memory_method']}, one process per variant",
        f"- sizes: {'--quick (goals not judged)' if meta['quick'] else 'full'}; "
        f"{meta['seconds']} s",
        "",
        *table(rows),
        "",
        "Goals:",
        "",
        *goals(rows),
        "",
    ]
    return "\n".join(lines)


def _memory_method(device: torch.device) -> str:
    if device.type == "cuda":
        return "torch.cuda.max_memory_allocated() growth"
    if os.path.exists("/proc/self/clear_refs"):
        return ("resident-set high-water mark (VmHWM, reset through /proc/self/clear_refs) "
                "minus the resident size before the call")
    return "resource.getrusage ru_maxrss growth"


def run(groups: str, quick: bool, rounds: int | None, device: torch.device) -> list[dict]:
    """The rows of ``groups`` (letters of `GROUPS`), at quick or full size."""
    import bench_attention

    sizes = QUICK if quick else FULL
    rounds = sizes["rounds"] if rounds is None else rounds
    rows: list[dict] = []
    if "a" in groups:
        rows += bench_attention.mha_rows(sizes["mha"], sizes["causal_length"], rounds, device,
                                         quick)

    def memory_of(s: dict) -> Callable[[str, int], int]:
        return lambda variant, length: measure_memory(
            variant, length, s["heads"], s["d_k"], s.get("window", 0), s.get("block", 0),
            device)["peak_bytes"]

    if "b" in groups:
        rows += bench_attention.sdpa_rows(sizes["sdpa"], rounds, device, quick,
                                          memory_of(sizes["sdpa"]))
    if "c" in groups:
        rows += bench_attention.local_rows(sizes["local"], rounds, device,
                                           memory_of(sizes["local"]))
    cpu = device.type == "cpu"
    if "d" in groups or ("f" in groups and cpu):
        import bench_decoding as dec
    if "d" in groups:
        rows += dec.ch10_rows(dec.CH10_QUICK if quick else dec.CH10, rounds, quick)
    if "e" in groups and cpu:
        import bench_tokenizer

        from utils.data import book_prose

        t = bench_tokenizer.QUICK if quick else bench_tokenizer.FULL
        rows += bench_tokenizer.bench_tokenizer_rows(book_prose(t["chapters"]), t["vocab"],
                                                     max(rounds, t["rounds"]), quick)
    if "f" in groups and cpu:
        rows += dec.gpt2_rows(dec.GPT2_QUICK if quick else dec.GPT2, rounds, quick)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke test)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--rounds", type=int, default=None,
                        help="timed rounds per row (default 5, 2 with --quick)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: every figure is then the work done)")
    parser.add_argument("--only", default=GROUPS, help="the groups to run, e.g. 'a,d'")
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
    if args.rounds is not None and args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.threads < 1:
        parser.error(f"--threads must be at least 1, got {args.threads}")
    groups = "".join(c for c in args.only if c in GROUPS)
    if not groups or any(c not in GROUPS + ", " for c in args.only):
        parser.error(f"--only takes letters among {GROUPS!r}, got {args.only!r}")
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    sizes = QUICK if args.quick else FULL
    meta = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "device": device_name(device),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "load": " ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg")
        else "unknown",
        "rounds": args.rounds or sizes["rounds"],
        "clock": "CPU time" if device.type == "cpu" else "wall time after synchronising",
        "memory_method": _memory_method(device),
        "quick": args.quick,
        "groups": groups,
    }
    start = time.perf_counter()
    rows = run(groups, args.quick, args.rounds, device)
    meta["seconds"] = round(time.perf_counter() - start, 1)

    text = render(meta, rows)
    print(text)
    out = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    out.with_suffix(".json").write_text(
        json.dumps({"meta": meta, "rows": rows}, indent=1,
                   default=lambda x: None if isinstance(x, float) and math.isnan(x) else x) + "\n")
    print(f"written: {out} and {out.with_suffix('.json')} ({meta['seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
