"""scripts/train_distributed.py: two ranks under torchrun train exactly what one process does.

The same 20 steps run twice, at the same time: under ``torchrun --nproc-per-node 2`` (gloo,
DistributedDataParallel, each rank on half of every batch) and as one plain ``python`` process
on the whole batches. Both save their final weights, which must agree to 1e-5, every one of
them, and print the same losses. The three key biases are part of the comparison: the script
does not train them (their true gradient is exactly zero, since adding one number to every
score of a query leaves its softmax unchanged, so Adam would only turn float rounding into
steps), and both runs must hold them at their initial values. ``--steps 20 --batch 8`` is a
schedule of its own (warm-up and decay over 20 steps, batches of 8), not the first 20 steps of
the script's default run; at the default schedule the two runs part after about 50 steps, as
the script's docstring records with the commands that show it.

`choose_device` is tested alone with GPU counts made up, on the CPU: two processes and one GPU
(or none) fall back to the CPU and gloo, and say so.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from utils import seed_everything
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


def _model() -> Seq2SeqTransformer:
    """The script's model, as it starts at seed 0."""
    v = len(ReversalTask(min_len=3, max_len=12, num_symbols=10).vocab)
    seed_everything(0)
    return Seq2SeqTransformer(
        v, v, d_model=32, nhead=4, num_encoder_layers=1, num_decoder_layers=1,
        dim_feedforward=128, norm_first=True, share_embeddings=True,
    )  # fmt: skip


def _outputs(state: dict[str, torch.Tensor]) -> torch.Tensor:
    """The logits of the saved model on a fixed batch of the task."""
    task = ReversalTask(min_len=3, max_len=12, num_symbols=10)
    model = _model()
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
    initial = _model().state_dict()
    for name, value in one_state.items():  # every weight, the key biases included
        torch.testing.assert_close(two_state[name], value, rtol=1e-5, atol=1e-5, msg=name)
        if name in key_biases:  # not trained: still the initial values, in both runs
            assert torch.equal(value, initial[name]) and torch.equal(two_state[name], value)
        elif name in initial and initial[name].dtype.is_floating_point:
            assert not torch.equal(value, initial[name]), name  # trained
    torch.testing.assert_close(_outputs(two_state), _outputs(one_state), rtol=1e-5, atol=1e-5)


def _script():
    spec = importlib.util.spec_from_file_location("train_distributed", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("local_rank", "local_world_size", "cuda_count", "backend", "device", "chosen", "note"),
    [
        (1, 2, 0, None, "cpu", "gloo", None),  # no GPU: the CPU, as on this machine
        (1, 2, 1, None, "cpu", "gloo", "2 processes but 1 GPU"),  # was cuda:1, a crash
        (1, 2, 1, "gloo", "cpu", "gloo", "2 processes but 1 GPU"),  # and with gloo too
        (0, 1, 1, None, "cuda:0", "nccl", None),  # plain python on a GPU machine
        (1, 2, 2, None, "cuda:1", "nccl", None),  # one GPU per process
        (3, 4, 8, "gloo", "cuda:3", "gloo", None),
    ],
)
def test_choose_device_gives_each_process_a_gpu_or_falls_back_to_the_cpu(
    local_rank, local_world_size, cuda_count, backend, device, chosen, note
):
    got = _script().choose_device(local_rank, local_world_size, cuda_count, backend)
    assert got[:2] == (device, chosen)
    assert (got[2] is None) if note is None else (note in got[2] and "CPU" in got[2])


@pytest.mark.parametrize("cuda_count", [0, 1, 2, 4])
@pytest.mark.parametrize("processes", [1, 2, 4])
def test_choose_device_on_every_machine_size(processes, cuda_count):
    """Every rank of ``processes`` on a machine with ``cuda_count`` GPUs: its own GPU and NCCL
    when there is one for each, else all on the CPU with gloo, said in one line (with GPUs)."""
    choose = _script().choose_device
    got = [choose(rank, processes, cuda_count, None) for rank in range(processes)]
    if cuda_count >= processes:
        assert got == [(f"cuda:{rank}", "nccl", None) for rank in range(processes)]
        return
    assert all(device == "cpu" and backend == "gloo" for device, backend, _ in got), got
    notes = {note for _, _, note in got}
    if cuda_count == 0:
        assert notes == {None}
    else:
        (note,) = notes
        assert (
            note.startswith(f"{processes} processes but {cuda_count} GPU(s)") and "\n" not in note
        )
        assert "on the CPU with gloo" in note
        with pytest.raises(ValueError, match="needs one GPU per process"):
            choose(0, processes, cuda_count, "nccl")


@pytest.mark.parametrize(("local_world_size", "cuda_count"), [(2, 1), (1, 0)])
def test_choose_device_refuses_nccl_without_a_gpu_per_process(local_world_size, cuda_count):
    with pytest.raises(ValueError, match="--backend nccl needs one GPU per process"):
        _script().choose_device(0, local_world_size, cuda_count, "nccl")


def test_setup_reads_torchruns_variables_and_falls_back_on_one_gpu(monkeypatch):
    script = _script()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.delenv("WORLD_SIZE", raising=False)  # no process group is started
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    rank, world_size, device, backend, note = script.setup(None)
    assert (rank, world_size, device.type, backend) == (0, 1, "cpu", "gloo")
    assert "every process computes on the CPU with gloo" in note
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert script.setup(None)[2:] == (torch.device("cpu"), "gloo", None)
    with pytest.raises(SystemExit, match="needs one GPU per process"):
        script.setup("nccl")
