"""`make check-devices` on the CPU: every check passes, the result files say so, and a broken
loader makes it fail and say which check.

On a machine with a GPU the same script checks CUDA or MPS too (`scripts/check_devices.py`); CI
has none, so it runs here on the CPU, with small models, and cannot rot.
"""

from __future__ import annotations

import json
import re
import sys

import pytest
import torch

from conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import check_devices  # noqa: E402

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def cpu_result(tmp_path_factory):
    out = tmp_path_factory.mktemp("devices")
    status = check_devices.main(["--quick", "--device", "cpu", "--out", str(out)])
    return status, json.loads((out / "check-devices.json").read_text()), \
        (out / "check-devices.md").read_text()


def test_every_check_passes_on_the_cpu(cpu_result):
    status, result, _ = cpu_result
    assert result["failed"] == [] and status == 0, result["failed"]
    (cpu,) = result["devices"]
    names = " | ".join(c["check"] for c in cpu["checks"])
    for part in ("MultiHeadAttention.from_torch", "Transformer.from_torch",
                 "gpt2: load onto cpu", "llama: load onto cpu", "gpt2: greedy tokens",
                 "llama: bfloat16 logits, error against float32", "training", "PyTorch SDPA math",
                 "the book's MultiHeadAttention, default (fused) path", "decoding, batch 1"):
        assert part in names, f"no check named like {part!r} in: {names}"
    training = next(c for c in cpu["checks"] if c["check"].startswith("training"))
    assert training["value"] == 0.0, "on the CPU, device='cpu' must train exactly as device=None"
    for row in cpu["decoding"]:
        assert row["same_tokens"] and row["tokens"] > 0 and row["ours_tokens_per_s"] > 0


def test_the_bfloat16_bound_is_the_references_own_error(cpu_result):
    _, result, _ = cpu_result
    checks = [c for c in result["devices"][0]["checks"] if "bfloat16 logits" in c["check"]]
    assert len(checks) == 2, checks
    for check in checks:
        # a real error of bfloat16, of a real size (the logits are of order 1)
        assert 1e-3 < check["bound"] < 1, check
        assert 0 < check["value"] <= check["bound"], check


def test_the_markdown_has_a_row_per_check(cpu_result):
    _, result, md = cpu_result
    rows = [ln for ln in md.splitlines() if ln.startswith("| ") and not ln.startswith("| ---")]
    checks = len(result["devices"][0]["checks"])
    decoding = len(result["devices"][0]["decoding"])
    assert len(rows) == 2 + checks + decoding, md  # two header rows
    assert re.search(r"PyTorch \S+, transformers \S+", md)


def test_a_broken_loader_fails_and_is_named(tmp_path, monkeypatch, capsys):
    real = check_devices.load_gpt2

    def broken(*args, **kwargs):
        model = real(*args, **kwargs)
        with torch.no_grad():
            next(model.parameters()).mul_(1.01)  # one weight tensor off by 1%
        return model

    monkeypatch.setattr(check_devices, "load_gpt2", broken)
    status = check_devices.main(["--quick", "--device", "cpu", "--out", str(tmp_path)])
    failed = json.loads((tmp_path / "check-devices.json").read_text())["failed"]
    assert status == 1
    assert any(f.startswith("cpu: gpt2: load onto cpu, logits") for f in failed), failed
    assert not any("llama" in f for f in failed), failed
    assert "FAILED" in capsys.readouterr().err


def test_a_device_that_is_not_there_is_refused(tmp_path):
    if "cuda" in check_devices.devices_present():
        pytest.skip("this machine has CUDA")
    with pytest.raises(SystemExit) as exc:
        check_devices.main(["--device", "cuda", "--out", str(tmp_path)])
    assert exc.value.code == 2
