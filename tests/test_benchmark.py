"""Smoke test of scripts/benchmark.py (`make bench`): it runs with --quick and writes a table with
every row. Timings are never checked: they depend on the machine and on its load."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "benchmark.py"


def test_benchmark_quick_writes_every_row(tmp_path):
    out = tmp_path / "bench" / "table.md"
    # one thread: on a busy machine a second thread mostly waits for a free core
    args = ["--quick", "--repeats", "1", "--threads", "1", "--out", str(out)]
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    text = out.read_text()
    data = json.loads(out.with_suffix(".json").read_text())
    assert data["meta"]["threads"] == 1
    assert "torch threads: 1" in text and "device: cpu" in text
    groups = [r["group"] for r in data["rows"]]
    assert groups.count("(a) forward") == 3
    assert groups.count("(a) forward+backward") == 3
    assert groups.count("(b) attention") == 2
    assert groups.count("(c) local") >= 2
    assert groups.count("(d) generate") == 1
    assert groups.count("(e) tokenizer") == 2
    assert groups.count("(f) GPT-2 decoding") == 2
    for r in data["rows"]:
        if r["group"] in ("(e) tokenizer", "(f) GPT-2 decoding"):
            assert "the same" in r["note"], r  # ids and tokens checked equal, not only timed
    for r in data["rows"]:
        assert r["group"] in text
        if "skipped" in r:
            continue
        assert r["ours_ms"] > 0 and r["ref_ms"] > 0 and r["time_ratio"] > 0
        if r["group"] in ("(b) attention", "(c) local"):
            assert r["ours_mib"] is not None and r["ref_mib"] is not None
    assert {"memory_efficient_over_plain", "met"} <= set(data["memory_goal"])
    assert "Goals:" in text and "memory_efficient_attention's peak memory" in text
    assert "MultiHeadAttention at most 1.2x" in text and "KV cache at least 5x" in text
    assert text.count("at least as fast as transformers' generate") == 2
    # every row of the JSON is a row of the Markdown table
    assert text.count("\n| (") == len(data["rows"])


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="a CUDA device is present: the refusal without one cannot be tested")
def test_benchmark_refuses_cuda_without_a_gpu(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cuda", "--out",
                           str(tmp_path / "b.md")], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2
    assert "no CUDA device" in proc.stderr
    assert not (tmp_path / "b.md").exists()
