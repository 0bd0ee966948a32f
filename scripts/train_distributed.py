"""Train chapter 9's reversal model data-parallel, with PyTorch's DistributedDataParallel.

Every process (rank) builds the same model from the same seed and draws the same stream of
global batches; rank r trains on its own slice of each batch, and DistributedDataParallel
averages the gradients over the ranks after every backward pass. Each rank's loss is weighted
by its share of the batch's real (non-padding) target tokens, times the number of ranks, so
that the average is exactly the gradient of the whole batch's mean loss: P processes compute
the updates that one process computes on the whole batch, up to float rounding.

Up to rounding only: the ranks add their numbers in another order than one process does, so
the last bits differ, and training amplifies such differences step after step. Measured at the
default schedule (500 steps of 48 sequences) with ``--report-every 1``, which prints every
step's loss to four decimals, one process and two ranks print the same losses up to step 52,
52 and 47 for seeds 0, 1 and 2, and part from the next step on; at the end their weights differ
by up to 0.30, 0.30 and 0.35, and both have learned the task (exact match on the held-out
sequences, one process then two ranks: 100.0% and 99.8%, 99.9% and 99.6%, 99.5% and 99.8%).
With the default ``--report-every`` (means over 100 steps) the first mean printed already
differs in its fourth decimal (seed 0: 1.9549 against 1.9558), since the runs part inside that
window. To repeat it, for S in 0, 1 and 2::

    python scripts/train_distributed.py --report-every 1 --seed S --save one.pt
    torchrun --nproc-per-node 2 --standalone scripts/train_distributed.py \
        --report-every 1 --seed S --save two.pt

and compare the printed losses and the two files of weights. tests/test_train_distributed.py
runs a shorter schedule both ways, ``--steps 20 --batch 8`` (its own warm-up and decay, and
smaller batches: not the first 20 steps of the default run), and checks that the printed losses
and every saved weight agree to 1e-5, the key biases included. The three key biases are
not trained (``requires_grad`` off, left at their initial values): adding b_K to every key
adds the same number to all the scores of a query, which its softmax cancels, so their true
gradient is exactly zero, and what backward gives them is rounding noise (about 1e-9) that
Adam (eps 1e-9) would turn into steps of most of the learning rate, a random walk that
differs between any two runs.

One machine, two processes on the CPU (gloo)::

    torchrun --nproc-per-node 2 scripts/train_distributed.py [--steps N] [--batch B] [--seed S]

One process, no torchrun (world size 1, no process group)::

    python scripts/train_distributed.py

Two machines, two processes each: run on both, with HOST the address of the first machine
(``--node-rank 0`` there, ``--node-rank 1`` on the other)::

    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 2 \\
        --rdzv-backend c10d --rdzv-endpoint HOST:29400 scripts/train_distributed.py

or, without the rendezvous backend, ``--master-addr HOST --master-port 29500`` in place of the
two ``--rdzv`` flags. On machines with GPUs the same commands run unchanged: when the machine
has a GPU for each of its processes, each process takes the GPU ``LOCAL_RANK`` and the NCCL
backend (``--backend`` overrides the choice); with fewer GPUs than processes (two processes,
one GPU), every process computes on the CPU with gloo and rank 0 says so (`choose_device`).
torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT,
which ``init_process_group`` and `setup` read.

Rank 0 prints the world size, backend and device (and a note when it falls back to the CPU),
the mean loss every ``--report-every`` steps (of whole batches, whatever the number of ranks),
the exact-match accuracy of greedy decoding on ``--test-size`` (1,000) held-out sequences
(``task.sample(n, seed=1)``, excluded from training as in chapter 9) and, with ``--save
PATH``, writes the final weights.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
import warnings
from itertools import islice
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere

from utils import seed_everything  # noqa: E402
from utils.data import PAD  # noqa: E402
from utils.decoding import greedy_decode  # noqa: E402
from utils.models import Seq2SeqTransformer  # noqa: E402
from utils.tasks import ReversalTask  # noqa: E402
from utils.train import exact_match, token_cross_entropy, train  # noqa: E402

# Nested tensors (PyTorch's fast path for padded batches) warn that their API is a prototype.
warnings.filterwarnings("ignore", message="The PyTorch API of nested tensors")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=500, help="optimizer steps (default 500)")
    p.add_argument("--batch", type=int, default=48, help="global batch size (default 48)")
    p.add_argument("--lr", type=float, default=1e-2, help="peak learning rate (default 1e-2)")
    p.add_argument("--seed", type=int, default=0, help="seed of weights and batches")
    p.add_argument("--report-every", type=int, default=None, help="default: steps / 5")
    p.add_argument("--test-size", type=int, default=1000, help="held-out sequences (1000)")
    p.add_argument("--backend", default=None, help="default: nccl with CUDA, else gloo")
    p.add_argument("--save", type=Path, default=None, help="rank 0 saves the weights here")
    args = p.parse_args(argv)
    for name in ("steps", "batch", "test_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be a positive int, got {getattr(args, name)}")
    return args


def choose_device(
    local_rank: int, local_world_size: int, cuda_count: int, backend: str | None
) -> tuple[str, str, str | None]:
    """Where this rank computes and which backend it uses: (device, backend, note or None).

    One GPU per process: rank ``local_rank`` of the ``local_world_size`` processes on this
    machine takes GPU ``local_rank`` when every process has its own (``cuda_count`` GPUs at
    least) and the backend is NCCL by default. With fewer GPUs than processes, two processes
    would share a GPU (which NCCL refuses) or ask for one that does not exist ("invalid device
    ordinal"): every process then computes on the CPU with gloo, and the note says why. With
    no GPU at all, the CPU and gloo, without a note. NCCL asked for where it cannot run (no
    GPU, or too few) raises a ValueError that says so.
    """
    if cuda_count >= local_world_size and cuda_count > 0:
        return f"cuda:{local_rank}", backend or "nccl", None
    if backend == "nccl":
        raise ValueError(
            f"--backend nccl needs one GPU per process: {local_world_size} processes on this "
            f"machine, {cuda_count} GPU(s); start at most {cuda_count} (torchrun "
            "--nproc-per-node) or use --backend gloo"
        )
    note = None
    if cuda_count > 0:
        note = (
            f"{local_world_size} processes but {cuda_count} GPU(s) on this machine: every "
            f"process computes on the CPU with gloo (start --nproc-per-node {cuda_count} "
            "or fewer to use the GPUs)"
        )
    return "cpu", backend or "gloo", note


def setup(backend: str | None) -> tuple[int, int, torch.device, str, str | None]:
    """Join the process group that torchrun describes, or none when started by plain python.

    Returns (rank, world size, device, backend, note) as `choose_device` decides them from
    torchrun's LOCAL_RANK and LOCAL_WORLD_SIZE and the GPUs that this machine has.
    """
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    try:
        name, backend, note = choose_device(local_rank, local_world_size, cuda_count, backend)
    except ValueError as error:
        raise SystemExit(str(error)) from None
    device = torch.device(name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if "WORLD_SIZE" not in os.environ:  # plain python: one process, no group
        return 0, 1, device, backend, note
    dist.init_process_group(backend)
    return dist.get_rank(), dist.get_world_size(), device, backend, note


def shard(batch: object, rank: int, world_size: int, device: torch.device) -> object:
    """Rank ``rank``'s rows of ``batch`` (every field sliced alike), moved to ``device``: the
    first ``B % world_size`` ranks take one row more."""
    size = len(batch.src)
    base, extra = divmod(size, world_size)
    start = rank * base + min(rank, extra)
    rows = slice(start, start + base + (1 if rank < extra else 0))
    fields = {f.name: getattr(batch, f.name)[rows].to(device) for f in dataclasses.fields(batch)}
    return dataclasses.replace(batch, **fields)


def make_loss(world_size: int):
    """The loss of one rank's slice, weighted so that DDP's average of the gradients over the
    ranks is the gradient of the whole batch's mean loss over its real target tokens."""

    def loss_fn(model: torch.nn.Module, pair: tuple) -> torch.Tensor:
        mine, total_tokens = pair
        logits = model(mine.src, mine.tgt_in, mine.src_mask, mine.tgt_mask)
        share = (mine.tgt_out != PAD).sum() / total_tokens  # of the global batch's tokens
        loss = token_cross_entropy(logits, mine.tgt_out) * share * world_size
        if world_size == 1:
            return loss
        # The value reported is the whole batch's loss (the ranks' shares summed); the
        # gradient stays this rank's own, which DDP averages.
        whole = (loss / world_size).detach().clone()
        dist.all_reduce(whole)
        return loss + (whole - loss).detach()

    return loss_fn


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rank, world_size, device, backend, note = setup(args.backend)
    if args.batch < world_size:
        raise SystemExit(f"--batch {args.batch} leaves a rank with no rows ({world_size} ranks)")
    say = print if rank == 0 else (lambda *a, **k: None)
    say(
        f"world size {world_size}, backend {backend if dist.is_initialized() else 'none'}, "
        f"device {device}, threads per rank {torch.get_num_threads()}",
        flush=True,
    )
    if note is not None:
        say(f"note: {note}", flush=True)

    task = ReversalTask(min_len=3, max_len=12, num_symbols=10)
    test_set = task.sample(args.test_size, seed=1)  # held out: excluded from training
    seed_everything(args.seed)  # the same initial weights on every rank
    vocab = len(task.vocab)
    model = Seq2SeqTransformer(
        vocab,
        vocab,
        d_model=32,
        nhead=4,
        num_encoder_layers=1,
        num_decoder_layers=1,
        dim_feedforward=128,
        norm_first=True,
        share_embeddings=True,
    ).to(device)
    # The key biases stay as initialised: adding b_K to every key adds q . b_K to every score
    # of query q, which its softmax cancels, so their true gradient is exactly zero. What
    # backward gives them is float rounding (about 1e-9), in a different order on every
    # number of ranks, and Adam would turn that noise into steps of a large part of the
    # learning rate, a different random walk in every run.
    for name, p in model.named_parameters():
        if name.endswith("w_k.bias"):
            p.requires_grad_(False)
    wrapped = model if world_size == 1 else DistributedDataParallel(model)
    stream = task.batches(args.batch, seed=args.seed, exclude=test_set, pad_to=16)
    batches = (
        (shard(b, rank, world_size, device), int((b.tgt_out != PAD).sum()))
        for b in islice(stream, args.steps)
    )
    start = time.perf_counter()
    history = train(
        wrapped,
        batches,
        make_loss(world_size),
        steps=args.steps,
        lr=args.lr,
        report_every=args.report_every,
        seed=args.seed,
        decimals=4,
        print_fn=say,
    )
    seconds = time.perf_counter() - start
    if rank == 0:
        test = task.collate(test_set, pad_to=16)
        predicted = greedy_decode(model, test.src.to(device), test.src_mask.to(device), 13)
        accuracy = exact_match(predicted, [list(t) for _, t in test_set])
        say(
            f"trained {args.steps} steps of {args.batch} sequences in {seconds:.1f} s; "
            f"final loss {history.step_losses[-1]:.6f}"
        )
        say(f"exact match on {len(test_set)} held-out sequences: {accuracy:.1%}")
        if args.save is not None:
            torch.save({k: v.cpu() for k, v in model.state_dict().items()}, args.save)
            say(f"weights saved to {args.save}")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
