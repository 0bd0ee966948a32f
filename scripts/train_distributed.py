"""Train chapter 9's reversal model data-parallel, with PyTorch's DistributedDataParallel.

Every process (rank) builds the same model from the same seed and draws the same stream of
global batches; rank r trains on its own slice of each batch, and DistributedDataParallel
averages the gradients over the ranks after every backward pass. Each rank's loss is weighted
by its share of the batch's real (non-padding) target tokens, times the number of ranks, so
that the average is exactly the gradient of the whole batch's mean loss: P processes compute
the updates that one process computes on the whole batch, and the two runs end with the same
weights (up to float rounding).

One machine, two processes on the CPU (gloo)::

    torchrun --nproc-per-node 2 scripts/train_distributed.py [--steps N] [--batch B] [--seed S]

One process, no torchrun (world size 1, no process group)::

    python scripts/train_distributed.py

Two machines, two processes each: run on both, with HOST the address of the first machine
(``--node-rank 0`` there, ``--node-rank 1`` on the other)::

    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 2 \\
        --rdzv-backend c10d --rdzv-endpoint HOST:29400 scripts/train_distributed.py

or, without the rendezvous backend, ``--master-addr HOST --master-port 29500`` in place of the
two ``--rdzv`` flags. On machines with GPUs the same commands run unchanged: with CUDA present
each process takes the GPU ``LOCAL_RANK`` and the NCCL backend (``--backend`` overrides the
choice). torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT, which
``init_process_group`` reads.

Rank 0 prints the world size, backend and device, the mean loss every ``--report-every`` steps
(the loss of whole batches, the same whatever the number of ranks), the exact-match accuracy
of greedy decoding on ``--test-size`` (1,000) held-out sequences (``task.sample(n, seed=1)``,
excluded from training as in chapter 9) and, with ``--save PATH``, writes the final weights.
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


def setup(backend: str | None) -> tuple[int, int, torch.device, str]:
    """Join the process group that torchrun describes, or none when started by plain python.

    Returns (rank, world size, device, backend): NCCL and GPU ``LOCAL_RANK`` when CUDA is
    available, else gloo and the CPU.
    """
    cuda = torch.cuda.is_available()
    backend = backend or ("nccl" if cuda else "gloo")
    device = torch.device("cpu")
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    if "WORLD_SIZE" not in os.environ:  # plain python: one process, no group
        return 0, 1, device, backend
    dist.init_process_group(backend)
    return dist.get_rank(), dist.get_world_size(), device, backend


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
    rank, world_size, device, backend = setup(args.backend)
    if args.batch < world_size:
        raise SystemExit(f"--batch {args.batch} leaves a rank with no rows ({world_size} ranks)")
    say = print if rank == 0 else (lambda *a, **k: None)
    say(
        f"world size {world_size}, backend {backend if dist.is_initialized() else 'none'}, "
        f"device {device}, threads per rank {torch.get_num_threads()}",
        flush=True,
    )

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
