"""scripts/train_distributed.py: two ranks under torchrun train exactly what one process does.

The same 20 steps run twice, at the same time: under ``torchrun --nproc-per-node 2`` (gloo,
DistributedDataParallel, each rank on half of every batch) and as one plain ``python`` process
on the whole batches. Both save their final weights, which must agree to 1e-5, and print the
same losses. The three key biases are compared through the model's outputs instead: their true
gradient is exactly zero (adding one number to every score of a query leaves its softmax
unchanged), so what Adam feeds them is float rounding, normalised to full-size steps, and they
wander differently in any two runs whose sums are ordered differently; the outputs they cannot
change are what must agree.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import torch

from utils.models import Seq2SeqTransformer
from utils.tasks import ReversalTask

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "train_distributed.py"
ARGS = ["--steps", "20", "--batch", "8", "--test-size", "50", "--report-every", "5"]


def _start(command: list[str], save: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)  # the plain run must not think it is a rank
    return subprocess.Popen(
        [*command, str(SCRIPT), *ARGS, "--save", str(save)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _finish(proc: subprocess.Popen) -> str:
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    return out


def _losses(output: str) -> list[float]:
    return [float(x) for x in re.findall(r"loss (\d+\.\d+)", output)]


def _outputs(state: dict[str, torch.Tensor]) -> torch.Tensor:
    """The logits of the saved model on a fixed batch of the task."""
    task = ReversalTask(min_len=3, max_len=12, num_symbols=10)
    v = len(task.vocab)
    model = Seq2SeqTransformer(
        v, v, d_model=32, nhead=4, num_encoder_layers=1, num_decoder_layers=1,
        dim_feedforward=128, norm_first=True, share_embeddings=True,
    )  # fmt: skip
    model.load_state_dict(state)
    model.eval()
    b = task.collate(task.sample(16, seed=5))
    with torch.no_grad():
        return model(b.src, b.tgt_in, b.src_mask, b.tgt_mask)


def test_torchrun_with_two_ranks_trains_what_one_process_trains(tmp_path):
    torchrun = Path(sys.executable).with_name("torchrun")
    two = _start([str(torchrun), "--nproc-per-node", "2", "--standalone"], tmp_path / "two.pt")
    one = _start([sys.executable], tmp_path / "one.pt")
    out_two, out_one = _finish(two), _finish(one)
    assert "world size 2, backend gloo" in out_two, out_two
    assert "world size 1, backend none" in out_one, out_one
    assert "exact match on 50 held-out sequences" in out_two
    losses_two, losses_one = _losses(out_two), _losses(out_one)
    assert len(losses_one) == 5, out_one  # four reports and the final loss
    assert losses_one[0] > losses_one[-1]  # it trained
    assert max(abs(a - b) for a, b in zip(losses_two, losses_one, strict=True)) < 1e-5

    two_state, one_state = torch.load(tmp_path / "two.pt"), torch.load(tmp_path / "one.pt")
    assert two_state.keys() == one_state.keys()
    key_biases = [k for k in one_state if k.endswith("w_k.bias")]
    assert len(key_biases) == 3  # encoder self-, decoder self- and cross-attention
    for name, value in one_state.items():
        if name not in key_biases:
            torch.testing.assert_close(two_state[name], value, rtol=1e-5, atol=1e-5, msg=name)
    torch.testing.assert_close(_outputs(two_state), _outputs(one_state), rtol=1e-5, atol=1e-5)
