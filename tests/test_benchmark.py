"""`make bench` (scripts/benchmark.py and its harness): the harness interleaves, reverses, checks
outputs and forms per-round ratios; the quick run writes every row with its setup, ratios,
equality and goal. Timings are never judged here: they depend on the machine and its load."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "benchmark.py"
sys.path.insert(0, str(ROOT / "scripts"))

from bench_harness import Timing, interleave, ratio_summary  # noqa: E402


def test_interleave_reverses_the_order_every_round_and_warms_up_once():
    calls = []
    contenders = {name: (lambda n=name: calls.append(n) or 1) for name in "abc"}
    timings = interleave(contenders, rounds=3)
    assert calls == list("abc") + list("abc") + list("cba") + list("abc")
    assert all(len(t.cpu) == 3 and len(t.wall) == 3 for t in timings.values())


def test_interleave_refuses_a_contender_whose_output_differs():
    with pytest.raises(AssertionError, match="slow's output differs from ref's"):
        interleave({"ref": lambda: torch.ones(3), "slow": lambda: torch.zeros(3)}, rounds=1)
    with pytest.raises(AssertionError, match="b's output differs"):
        interleave({"a": lambda: [1, 2], "b": lambda: [1, 3]}, rounds=1)
    interleave({"a": lambda: [1, 2], "b": lambda: [1, 2]}, rounds=1)  # equal: no error


def test_ratios_are_formed_per_round():
    """The median of per-round ratios, not the ratio of medians: a round slowed for both
    contenders alike leaves its ratio unchanged."""
    t = {"ours": Timing(cpu=[1.0, 10.0, 2.0], wall=[1.0, 10.0, 2.0]),
         "ref": Timing(cpu=[1.0, 5.0, 4.0], wall=[2.0, 5.0, 4.0])}
    s = ratio_summary(t, "ours", "ref")
    assert s["ratio_median"] == 1.0 and s["ratio_min"] == 0.5
    assert s["wall_ratio_median"] == 0.5
    assert s["ours_ms"] == 2000.0 and s["ref_ms"] == 4000.0 and s["rounds"] == 3


def test_benchmark_quick_writes_every_row(tmp_path):
    out = tmp_path / "bench" / "table.md"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = out.read_text()
    data = json.loads(out.with_suffix(".json").read_text())
    assert data["meta"]["threads"] == 1 and data["meta"]["quick"] is True
    assert "torch threads: 1" in text and "device: cpu" in text and "CPU time" in text
    groups = [r["group"] for r in data["rows"]]
    # (a): 2 shapes x (no mask, causal) x (evaluation, training) x 2 peers
    assert groups.count("(a) attention module") == 16
    assert groups.count("(b) attention function") == 2
    assert groups.count("(c) local attention") == 2
    assert groups.count("(d) decoding, chapter 10's model") == 6
    assert groups.count("(e) tokenizer") == 4
    assert groups.count("(f) decoding, GPT-2") == 6
    for r in data["rows"]:
        assert r["setup"] and r["same"], r  # every row says how it ran and what was equal
        assert r["ratio_median"] > 0 and r["ratio_min"] <= r["ratio_median"], r
        assert r["wall_ratio_median"] > 0 and r["ours_ms"] > 0 and r["ref_ms"] > 0, r
        if r["goal"] is not None:
            assert r["goal_met"] is None, r  # quick sizes: goals are not judged
    refs = {r["reference"] for r in data["rows"]}
    assert {"the SDPA block", "nn.MultiheadAttention", "bare cached loop", "bare loop",
            "transformers (sdpa)", "transformers (eager)"} <= refs
    assert any("tiktoken" in r for r in refs) and any("tokenizers" in r for r in refs)
    for r in data["rows"]:
        if r["group"] in ("(b) attention function", "(c) local attention"):
            assert r["ours_mib"] is not None and r["ref_mib"] is not None, r
    goals = text.split("Goals:")[1]
    assert goals.count("not judged (--quick)") == sum(r["goal"] is not None
                                                      for r in data["rows"])
    assert "ceiling: " in text and "GB/s" in text  # the bandwidth ceiling at batch 1
    for r in data["rows"]:  # beside it, at batch 1, what the weight products alone reach
        if r["group"].startswith("(f)") and "B=1," in r["case"]:
            assert set(r["fraction_of_ceiling"]) == {
                "ours", "transformers (sdpa)", "transformers (eager)", "bare loop",
                "weight products alone"}, r
            assert 0 < r["fraction_of_ceiling"]["weight products alone"], r
            assert r["over_weight_products"] > 0, r
            assert "the time of its weight products alone" in r["note"], r
    assert text.count("\n| (") == len(data["rows"])  # every JSON row is a Markdown row


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="a CUDA device is present: the refusal without one cannot be tested")
def test_benchmark_refuses_cuda_without_a_gpu(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cuda", "--out",
                           str(tmp_path / "b.md")], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2
    assert "no CUDA device" in proc.stderr
    assert not (tmp_path / "b.md").exists()


class _WeightReads:
    """The right-hand operands (address, shape, strides) of every matrix product run while
    active."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        seen = self.seen = []
        aten = torch.ops.aten
        products = {aten.addmm.default: 2, aten.mm.default: 1, aten.bmm.default: 1,
                    aten.matmul.default: 1, aten.linear.default: 1}

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func in products:
                    w = args[products[func]]
                    if func is aten.linear.default:  # x W^T: the matrix it reads is W^T
                        w = w.t()
                    seen.append((w.data_ptr(), tuple(w.shape), tuple(w.stride())))
                return func(*args, **(kwargs or {}))

        self.mode = Mode()

    def __enter__(self):
        self.mode.__enter__()
        return self.seen

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)


def test_weight_products_reads_what_a_decoding_step_of_ours_reads(tmp_path):
    """Row (f)'s "weight products alone" must be the products ours makes per decoding step: the
    same weight tensors (the same memory) in the same layouts, each once, and nothing more (the
    steps after the prompt's pass, counted as the difference between 4 tokens and 1)."""
    from collections import Counter

    from bench_decoding import GPT2_QUICK, NEVER, weight_products, write_gpt2

    from utils.decoding import generate
    from utils.pretrained import load_gpt2

    s = GPT2_QUICK[0]
    write_gpt2(tmp_path, s)
    ours = load_gpt2(tmp_path).eval()
    prompts = torch.randint(0, s["vocab"], (2, 4), generator=torch.Generator().manual_seed(0))
    reads = {}
    for n in (1, 4):
        with _WeightReads() as seen:
            generate(ours, prompts, n, eos=NEVER)
        reads["ours", n] = Counter(seen)
        with _WeightReads() as seen:
            weight_products(ours, 2, 4, n)
        reads["products", n] = Counter(seen)
    steps = {who: reads[who, 4] - reads[who, 1] for who in ("ours", "products")}
    d, v = s["d_model"], s["vocab"]
    assert steps["ours"] == steps["products"]
    shapes = Counter({(shape, stride): k for (_, shape, stride), k in steps["ours"].items()})
    assert shapes[(d, v), (v, 1)] == 3  # the head, (d, V) rows first, once a step
    assert shapes[(d, 3 * d), (3 * d, 1)] == 3 * s["layers"]  # Q/K/V as one product
    assert sum(steps["ours"].values()) == 3 * (4 * s["layers"] + 1)
    assert len(steps["ours"]) == 4 * s["layers"] + 1  # each a tensor of its own
