"""A small, deterministic training loop and the accuracies the chapters report (chapters 9, 10).

The loop is deliberately plain: Adam, a learning rate that warms up linearly and then decays
linearly to zero, gradient clipping, and a report of the mean training loss at fixed steps. Given
the same seed, model initialisation and batches, it takes the same steps.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import islice

import torch
import torch.nn.functional as F
from torch import nn

from ._validation import require_rank, require_tensor, shape_str
from .data import PAD

__all__ = [
    "History",
    "warmup_linear_decay",
    "train",
    "token_cross_entropy",
    "token_accuracy",
    "exact_match",
]


@dataclass
class History:
    """What `train` records.

    Attributes:
        steps: the steps at which a report was made (1-based: after that many updates).
        losses: the mean training loss over the updates since the previous report.
        step_losses: the loss of every update, for a loss curve.
        seconds: wall-clock time of the whole loop (varies from run to run: never print it in a
            cell whose output must be stable).
    """

    steps: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    step_losses: list[float] = field(default_factory=list)
    seconds: float = 0.0

    def mean_loss(self, first: int, last: int) -> float:
        """The mean training loss of updates ``first`` to ``last`` (1-based, both included).

        A loss trajectory depends on the order in which the CPU sums floats, which differs between
        processors and thread counts, and small differences grow over hundreds of steps. What
        holds on any machine is a comparison with a wide margin, such as "the mean loss of the
        last 100 steps is below 0.05": print that, and draw the trajectory in a figure.
        """
        n = len(self.step_losses)
        for name, value in (("first", first), ("last", last)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int step, got {value!r}")
        if not 1 <= first <= last <= n:
            raise ValueError(f"need 1 <= first <= last <= {n} (the steps recorded), got "
                             f"first={first}, last={last}")
        window = self.step_losses[first - 1:last]
        return sum(window) / len(window)


def warmup_linear_decay(step: int, warmup: int, total: int) -> float:
    """The learning-rate multiplier at ``step`` (0-based).

    Rises linearly from 1 / warmup to 1 over the first ``warmup`` steps, then falls linearly to
    0 at ``total``. Warm-up keeps Adam's first, badly estimated updates small; the decay lets the
    last steps settle.
    """
    if warmup < 0 or total <= 0 or warmup > total:
        raise ValueError(f"need 0 <= warmup <= total and total > 0, got warmup={warmup}, "
                         f"total={total}")
    if step < warmup:
        return (step + 1) / warmup
    return max(0.0, (total - step) / max(1, total - warmup))


def train(
    model: nn.Module,
    batches: Iterable,
    loss_fn: Callable[[nn.Module, object], torch.Tensor],
    steps: int,
    lr: float = 1e-3,
    warmup: int | None = None,
    report_every: int | None = None,
    seed: int = 0,
    clip: float | None = 1.0,
    decimals: int = 2,
    print_fn: Callable[[str], None] | None = print,
) -> History:
    """Train ``model`` for ``steps`` updates of Adam and report the loss at fixed steps.

    Args:
        model: the module to train (put in training mode here, in evaluation mode at the end).
        batches: an iterable of batches (e.g. ``task.batches(64, seed=0)``); one per step.
        loss_fn: ``loss_fn(model, batch)`` -> scalar loss.
        steps: the number of updates.
        lr: the peak learning rate.
        warmup: warm-up steps (default: a tenth of ``steps``).
        report_every: report every this many steps (default: a fifth of ``steps``); the report
            prints the mean loss since the last one, rounded to ``decimals``.
        seed: seeds torch's global generator (dropout, if any) before the first step.
        clip: clip the gradient's global norm to this (None: no clipping).
        decimals: rounding of the printed losses (coarse, so that the printout is the same on
            other machines, whose float sums may differ in the last bits).
        print_fn: where reports go; None to stay silent.

    Returns:
        A `History`.
    """
    if not isinstance(steps, int) or steps <= 0:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    if lr <= 0:
        raise ValueError(f"lr must be positive, got {lr}")
    warmup = max(1, steps // 10) if warmup is None else warmup
    report_every = max(1, steps // 5) if report_every is None else report_every
    if report_every <= 0:
        raise ValueError(f"report_every must be positive, got {report_every}")
    torch.manual_seed(seed)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=lr, betas=(0.9, 0.98), eps=1e-9)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: warmup_linear_decay(min(s, steps - 1), warmup, steps))
    history = History()
    model.train()
    start = time.perf_counter()
    window: list[float] = []
    count = 0
    for step, batch in enumerate(islice(batches, steps), start=1):
        loss = loss_fn(model, batch)
        if loss.dim() != 0:
            raise ValueError(f"loss_fn must return a scalar, got shape {shape_str(loss)}")
        value = float(loss.detach())
        if not math.isfinite(value):
            raise FloatingPointError(f"the loss became {value} at step {step}")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if clip is not None:
            nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        sched.step()
        history.step_losses.append(value)
        window.append(value)
        count = step
        if step % report_every == 0 or step == steps:
            mean = sum(window) / len(window)
            history.steps.append(step)
            history.losses.append(mean)
            window = []
            if print_fn is not None:
                print_fn(f"step {step:5d}   loss {mean:.{decimals}f}")
    if count < steps:
        raise ValueError(f"batches ran out after {count} of {steps} steps")
    history.seconds = time.perf_counter() - start
    model.eval()
    return history


def token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor,
                        ignore_index: int = PAD) -> torch.Tensor:
    """Mean cross-entropy over the positions whose target is not ``ignore_index``.

    Args:
        logits: (B, L, V) unnormalised scores.
        targets: (B, L) ids; ``ignore_index`` (``PAD``) marks positions without a loss.
    """
    require_tensor("logits", logits)
    require_tensor("targets", targets)
    require_rank("logits", logits, "(B, L, V)", rank=3)
    if targets.shape != logits.shape[:2]:
        raise ValueError(f"targets must have shape (B, L) = {shape_str(logits.shape[:2])}, got "
                         f"{shape_str(targets)}")
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                           ignore_index=ignore_index)


def token_accuracy(logits: torch.Tensor, targets: torch.Tensor,
                   ignore_index: int = PAD) -> float:
    """The fraction of scored positions (target != ``ignore_index``) whose argmax is right."""
    require_tensor("logits", logits)
    require_rank("logits", logits, "(B, L, V)", rank=3)
    if targets.shape != logits.shape[:2]:
        raise ValueError(f"targets must have shape (B, L) = {shape_str(logits.shape[:2])}, got "
                         f"{shape_str(targets)}")
    scored = targets != ignore_index
    if not scored.any():
        raise ValueError("no position is scored: every target equals ignore_index")
    right = (logits.argmax(-1) == targets) & scored
    return right.sum().item() / scored.sum().item()


def exact_match(predicted: Sequence[Sequence[int]], expected: Sequence[Sequence[int]]) -> float:
    """The fraction of sequences predicted exactly (same tokens, same length)."""
    if len(predicted) != len(expected):
        raise ValueError(f"got {len(predicted)} predictions for {len(expected)} expected sequences")
    if not expected:
        raise ValueError("expected must hold at least one sequence")
    hits = sum(list(p) == list(e) for p, e in zip(predicted, expected, strict=True))
    return hits / len(expected)
