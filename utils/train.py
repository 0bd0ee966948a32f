"""A small, deterministic training loop and the accuracies the chapters report (chapters 9, 10).

The loop is deliberately plain: Adam, a learning rate that warms up linearly and then decays
linearly to zero, gradient clipping, and a report of the mean training loss at fixed steps. Given
the same seed, model initialisation and batches, it takes the same steps. It runs where the model
is, or on the ``device`` asked for, in float32 or under autocast (``precision``; see
`utils.devices`). The original paper's schedule, linear warm-up then inverse-square-root decay,
is `transformer_lr` (and, for an optimizer, `transformer_lr_scheduler`), kept in
`utils.schedules` and importable from here.
"""

from __future__ import annotations

import math
import numbers
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import islice

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ._validation import (
    InputTypeError,
    eval_mode,
    require_floating,
    require_int,
    require_integer_ids,
    require_rank,
    require_real,
    require_same_device,
    require_tensor,
    shape_str,
    type_name,
)
from .data import PAD, _is_sequence
from .devices import MixedPrecision, require_precision, resolve_device, to_device
from .schedules import transformer_lr, transformer_lr_scheduler, warmup_linear_decay

__all__ = [
    "History",
    "warmup_linear_decay",
    "transformer_lr",
    "transformer_lr_scheduler",
    "train",
    "train_side_by_side",
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
        skipped_steps: with ``precision="fp16"``, the steps (1-based) whose update the gradient
            scaler skipped because a gradient overflowed at the scale of that step (their loss
            is recorded all the same); empty in float32 and bfloat16.
    """

    steps: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    step_losses: list[float] = field(default_factory=list)
    seconds: float = 0.0
    skipped_steps: list[int] = field(default_factory=list)

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
    device: str | torch.device | None = None,
    precision: str = "fp32",
) -> History:
    """Train ``model`` for ``steps`` updates of Adam and report the loss at fixed steps.

    Args:
        model: the ``nn.Module`` to train (put in training mode here, in evaluation mode at the
            end); it needs at least one parameter with ``requires_grad``.
        batches: an iterable of batches (e.g. ``task.batches(64, seed=0)``); one per step.
        loss_fn: ``loss_fn(model, batch)`` -> scalar floating-point loss tensor that depends on
            the parameters.
        steps: the number of updates, a positive int.
        lr: the peak learning rate, a finite number > 0.
        warmup: warm-up steps, an int from 0 to ``steps`` (default: a tenth of ``steps``).
        report_every: report every this many steps, a positive int (default: a fifth of
            ``steps``); the report prints the mean loss since the last one, rounded to
            ``decimals``.
        seed: seeds torch's global generator (dropout, if any) before the first step; an int
            >= 0.
        clip: clip the gradient's global norm to this finite number > 0 (None: no clipping).
        decimals: rounding of the printed losses, an int >= 0. No rounding makes a printed
            loss trajectory the same on every machine: float sums differ in their last bits
            between processors, and training amplifies the difference. A notebook whose outputs
            are checked passes ``print_fn=None`` and prints comparisons with a wide margin
            instead (`History.mean_loss`).
        print_fn: where reports go (a callable); None to stay silent.
        device: where to train (a str such as ``"cuda"`` or a `torch.device`; see
            `utils.device`): the model is moved there (in place, by ``model.to``, and it stays
            there) and so is every batch (`utils.devices.to_device`: a tensor, a batch of
            `utils.data`, or tuples, lists and dicts of them). None (the default) moves
            nothing: the model trains where it is, on batches as they come.
        precision: ``"fp32"`` (the default: plain float32, no autocast at all), ``"bf16"`` or
            ``"fp16"``: the forward pass and the loss run under ``torch.autocast`` in that
            dtype, the parameters and the optimizer stay float32, and for float16 a gradient
            scaler multiplies the loss before the backward pass (the gradients are unscaled
            before clipping; `utils.devices.MixedPrecision`). A step the scaler skips does
            not advance the learning-rate schedule.

    Returns:
        A `History` (with ``precision="fp16"``, the steps the scaler skipped).

    Raises:
        ValueError or InputTypeError: for a bad argument, before the first step. Once training
            has started: a loss that is not a scalar floating-point tensor with a gradient
            (raised at the first step, before any update), ``batches`` running out before
            ``steps`` (raised after the updates made), and `FloatingPointError` for a loss
            that is NaN or infinite. After an error the train/eval mode of every submodule
            is put back as it was before the call (the updates already made stay). Autograd
            is on during the loop even when the caller is inside ``torch.no_grad()``.
    """
    if not isinstance(model, nn.Module):
        raise InputTypeError(f"model must be an nn.Module, got {type_name(model)}")
    try:
        batches = iter(batches)
    except TypeError:
        raise InputTypeError(f"batches must be an iterable of batches, got "
                             f"{type_name(batches)}") from None
    if not callable(loss_fn):
        raise InputTypeError(f"loss_fn must be callable, got {type_name(loss_fn)}")
    if print_fn is not None and not callable(print_fn):
        raise InputTypeError(f"print_fn must be callable or None, got {type_name(print_fn)}")
    steps = require_int("steps", steps)
    lr = require_real("lr", lr, low=0.0, low_open=True)
    warmup = max(1, steps // 10) if warmup is None else require_int("warmup", warmup, minimum=0)
    if warmup > steps:
        raise ValueError(f"warmup must be at most steps={steps}, got {warmup}")
    report_every = (max(1, steps // 5) if report_every is None
                    else require_int("report_every", report_every))
    seed = require_int("seed", seed, minimum=0)
    if clip is not None:
        clip = require_real("clip", clip, low=0.0, low_open=True)
    decimals = require_int("decimals", decimals, minimum=0)
    precision = require_precision(precision)
    device = None if device is None else resolve_device(device)
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError(f"model has no parameter with requires_grad=True to train "
                         f"({type(model).__name__})")
    if device is not None:
        model.to(device)
    amp = None if precision == "fp32" else MixedPrecision(precision, params[0].device.type)
    torch.manual_seed(seed)
    # foreach: each update is a few calls over all the parameters at once instead of a few
    # calls per parameter; the same arithmetic in the same order, so the same weights to the
    # last bit, a millisecond sooner per step for the book's small models.
    opt = torch.optim.Adam(params, lr=lr, betas=(0.9, 0.98), eps=1e-9, foreach=True)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: warmup_linear_decay(min(s, steps - 1), warmup, steps))
    history = History()
    start = time.perf_counter()
    window: list[float] = []
    count = 0
    # eval_mode(..., enabled=False) changes nothing on entry and puts every submodule's mode
    # back on exit: what an error leaves behind. Success ends in eval mode, below.
    with eval_mode(model, enabled=False), torch.enable_grad():
        model.train()
        for step, batch in enumerate(islice(batches, steps), start=1):
            if device is not None:
                batch = to_device(batch, device)
            if amp is None:
                loss = loss_fn(model, batch)
            else:
                with amp.autocast():
                    loss = loss_fn(model, batch)
            _check_loss(loss)
            value = float(loss.detach())
            if not math.isfinite(value):
                raise FloatingPointError(f"the loss became {value} at step {step}")
            opt.zero_grad(set_to_none=True)
            if amp is None:
                loss.backward()
                if clip is not None:
                    nn.utils.clip_grad_norm_(params, clip)
                opt.step()
                sched.step()
            elif amp.step(loss, opt, params, clip):
                sched.step()
            else:  # the scaler skipped the update; the schedule counts the updates made
                history.skipped_steps.append(step)
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


def _draws_random_numbers(model: nn.Module) -> str | None:
    """The name of a submodule that would draw random numbers in training mode, or None.

    Dropout is what the book's models draw with: an ``nn.Dropout`` (or one of its variants) with
    ``p > 0``, or a module with a float attribute ``dropout`` above 0 (the book's attention).
    """
    for name, sub in model.named_modules():
        p = getattr(sub, "p", None) if isinstance(sub, nn.modules.dropout._DropoutNd) else None
        rate = getattr(sub, "dropout", None)
        if (p is not None and p > 0) or (isinstance(rate, float) and rate > 0):
            return name or type(sub).__name__
    return None


def train_side_by_side(
    runs: Sequence[tuple[nn.Module, Iterable]],
    loss_fn: Callable[[nn.Module, object], torch.Tensor],
    steps: int,
    workers: int = 2,
    **kwargs,
) -> list[History]:
    """`train` each ``(model, batches)`` of ``runs``, ``workers`` of them at a time, in threads.

    A small model spends most of a step in many short operations, each of which keeps only one
    core busy; PyTorch releases Python's global lock while an operation runs (and for the whole
    backward pass), so two runs in two threads can keep up to two cores busy and, on a machine
    with a free core, finish sooner than one after the other. The overlap is partial: the Python
    between operations still runs one thread at a time. Each run is
    exactly ``train(model, batches, loss_fn, steps, **kwargs)``: the same operations in the same
    order, so the same weights and the same `History` losses as sequential calls
    (tests/test_train.py). Give each thread one core (``OMP_NUM_THREADS=1``) for the best use
    of a small machine.

    Args:
        runs: a sequence of ``(model, batches)`` pairs; no two models may share a parameter.
        loss_fn, steps, **kwargs: as in `train` (the same for every run), ``device`` and
            ``precision`` included.
        workers: how many runs train at once, a positive int (1: one after the other).

    Returns:
        One `History` per run, in the order of ``runs``; each ``seconds`` is that run's own wall
        time, which overlaps the others'.

    Raises:
        ValueError or InputTypeError: for a bad argument, before any training: ``runs`` empty or
            not pairs, a parameter shared between two models, or a model that would draw random
            numbers while training (dropout above 0), since all threads draw from one global
            generator and the order of their draws would change from run to run. An error in a
            run is raised once every run has stopped.
    """
    if isinstance(runs, (str, bytes)) or not isinstance(runs, Sequence) or not runs:
        raise InputTypeError(f"runs must be a non-empty sequence of (model, batches) pairs, "
                             f"got {type_name(runs)}")
    workers = require_int("workers", workers)
    seen: dict[int, int] = {}
    for i, run in enumerate(runs):
        if not isinstance(run, tuple) or len(run) != 2 or not isinstance(run[0], nn.Module):
            raise InputTypeError(f"runs[{i}] must be a (model, batches) pair with an nn.Module "
                                 f"first, got {type_name(run)}")
        drawer = _draws_random_numbers(run[0])
        if drawer is not None:
            raise ValueError(f"runs[{i}]: {drawer} has dropout above 0; runs that draw random "
                             f"numbers cannot train side by side reproducibly (use train)")
        for p in run[0].parameters():
            if seen.setdefault(id(p), i) != i:
                raise ValueError(f"runs[{seen[id(p)]}] and runs[{i}] share a parameter; each "
                                 f"run needs a model of its own")
    with ThreadPoolExecutor(max_workers=min(workers, len(runs))) as pool:
        futures = [pool.submit(train, model, batches, loss_fn, steps, **kwargs)
                   for model, batches in runs]
    return [f.result() for f in futures]


def _check_loss(loss: object) -> None:
    """What ``loss_fn`` returns must be a scalar floating-point tensor with a gradient."""
    if not isinstance(loss, torch.Tensor):
        raise InputTypeError(f"loss_fn must return a scalar torch.Tensor, got {type_name(loss)}")
    if loss.dim() != 0:
        raise ValueError(f"loss_fn must return a scalar, got shape {shape_str(loss)}")
    require_floating("the loss returned by loss_fn", loss)
    if not loss.requires_grad:
        raise ValueError("the loss returned by loss_fn does not require grad: it must be "
                         "computed from the model's parameters, with autograd on")


def _check_scored(logits: object, targets: object, ignore_index: object) -> torch.Tensor:
    """Check the arguments of the token metrics; return the (B, L) mask of scored positions.

    Raises unless ``logits`` is a floating (B, L, V) tensor, ``targets`` a (B, L) integer tensor
    on the same device whose scored entries (those != ``ignore_index``) lie in [0, V), and at
    least one position is scored.
    """
    require_tensor("logits", logits)
    require_tensor("targets", targets)
    require_rank("logits", logits, "(B, L, V)", rank=3)
    require_floating("logits", logits)
    if targets.shape != logits.shape[:2]:
        raise ValueError(f"targets must have shape (B, L) = {shape_str(logits.shape[:2])}, got "
                         f"{shape_str(targets)}")
    require_integer_ids("targets", targets)
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, numbers.Integral):
        raise InputTypeError(f"ignore_index must be an int, got {ignore_index!r} "
                             f"({type(ignore_index).__name__})")
    require_same_device(logits=logits, targets=targets)
    scored = targets != ignore_index
    if not scored.any():
        raise ValueError("no position is scored: every target equals ignore_index "
                         f"({ignore_index}), or the batch is empty ({shape_str(targets)})")
    require_integer_ids(f"targets (where != ignore_index={ignore_index})", targets[scored],
                        vocab_size=logits.shape[-1])
    return scored


def token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor,
                        ignore_index: int = PAD, label_smoothing: float = 0.0) -> torch.Tensor:
    """Mean cross-entropy over the positions whose target is not ``ignore_index``.

    With ``label_smoothing`` = eps > 0 the target of a position is no longer the one-hot vector
    of its token y but q = (1 - eps) onehot(y) + eps / V (Szegedy et al., 2016), and the loss
    of the position is the cross-entropy against q:

        -sum_k q_k log p_k = (1 - eps) (-log p_y) + eps * mean_k(-log p_k),

    the ordinary loss plus eps times the cross-entropy against the uniform distribution. It is
    minimal, at the entropy of q rather than at 0, when p = q. This is the definition of
    ``torch.nn.functional.cross_entropy(..., label_smoothing=eps)``; positions whose target is
    ``ignore_index`` are left out, as without smoothing.

    Args:
        logits: (B, L, V) floating-point unnormalised scores.
        targets: (B, L) integer ids in [0, V), on ``logits``' device; ``ignore_index``
            (``PAD``) marks positions without a loss.
        ignore_index: an int (it may lie outside [0, V), such as torch's -100).
        label_smoothing: eps, a real number in [0, 1]; 0 (the default) is the plain loss.

    Returns:
        A scalar tensor (with a gradient when ``logits`` has one). NaN or inf in ``logits``
        give a NaN or inf loss, as they would anywhere.

    Raises:
        ValueError: when no position is scored (every target is ``ignore_index``, or B = 0 or
            L = 0): a mean over nothing has no value, and torch would return NaN. Also for a
            scored target outside [0, V), for mismatched shapes and for a ``label_smoothing``
            outside [0, 1]; `InputTypeError` for logits that are not floating point, targets
            that are not integers, a ``label_smoothing`` that is not a real number, or tensors
            on different devices.
    """
    scored = _check_scored(logits, targets, ignore_index)
    eps = require_real("label_smoothing", label_smoothing, low=0.0, high=1.0)
    if eps == 0.0:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1).long(),
                               ignore_index=int(ignore_index))
    log_p = logits[scored].log_softmax(dim=-1)                       # (n, V), scored only
    nll = -log_p.gather(-1, targets[scored].long()[:, None])[:, 0]   # -log p_y, (n,)
    uniform = -log_p.mean(dim=-1)                                    # mean_k -log p_k, (n,)
    return ((1.0 - eps) * nll + eps * uniform).mean()


def token_accuracy(logits: torch.Tensor, targets: torch.Tensor,
                   ignore_index: int = PAD) -> float:
    """The fraction of scored positions (target != ``ignore_index``) whose argmax is right.

    Arguments, and the errors they raise, as in `token_cross_entropy`: in particular a batch
    with no scored position raises `ValueError` rather than dividing by zero.
    """
    scored = _check_scored(logits, targets, ignore_index)
    right = (logits.argmax(-1) == targets) & scored
    return right.sum().item() / scored.sum().item()


def exact_match(predicted: Sequence[Sequence[int]], expected: Sequence[Sequence[int]]) -> float:
    """The fraction of sequences predicted exactly (same tokens, same length).

    Args:
        predicted, expected: equally many sequences of token ids (lists, tuples or 1-dim
            tensors; a 2-dim tensor counts as its rows), at least one.

    Raises:
        ValueError: for different numbers of sequences, or none; `InputTypeError` when either
            is not a list of sequences (a flat list of ids, a string, a generator).
    """
    for name, seqs in (("predicted", predicted), ("expected", expected)):
        _require_sequences(name, seqs)
    if len(predicted) != len(expected):
        raise ValueError(f"got {len(predicted)} predictions for {len(expected)} expected sequences")
    if len(expected) == 0:
        raise ValueError("expected must hold at least one sequence")
    hits = sum(_ids(p) == _ids(e) for p, e in zip(predicted, expected, strict=True))
    return hits / len(expected)


def _require_sequences(name: str, seqs: object) -> None:
    """``seqs`` must be a sequence (or 2-dim tensor) of sequences (or 1-dim tensors)."""
    if isinstance(seqs, torch.Tensor):
        require_rank(name, seqs, "(N, L)", rank=2)
        return
    if not _is_sequence(seqs):
        raise InputTypeError(f"{name} must be a list of sequences of token ids, got "
                             f"{type_name(seqs)}")
    for i, s in enumerate(seqs):
        if not _is_sequence(s) or getattr(s, "ndim", 1) != 1:
            raise InputTypeError(f"{name} must be a list of sequences of token ids; {name}[{i}] "
                                 f"is {type_name(s)}")


def _ids(seq: Sequence[int] | torch.Tensor | np.ndarray) -> list:
    return seq.tolist() if isinstance(seq, (torch.Tensor, np.ndarray)) else list(seq)
