"""Learning-rate schedules (chapters 7 and 9), re-exported by `utils.train`.

- `warmup_linear_decay`: the multiplier `utils.train.train` uses, a linear warm-up and then a
  linear decay to zero;
- `transformer_lr` and `transformer_lr_scheduler`: the original Transformer's rate, a linear
  warm-up and then an inverse-square-root decay (Vaswani et al., 2017, 5.3).
"""

from __future__ import annotations

import torch

from ._validation import InputTypeError, require_int, require_real, type_name

__all__ = ["warmup_linear_decay", "transformer_lr", "transformer_lr_scheduler"]


def warmup_linear_decay(step: int, warmup: int, total: int) -> float:
    """The learning-rate multiplier at ``step`` (0-based).

    Rises linearly from 1 / warmup to 1 over the first ``warmup`` steps, then falls linearly to
    0 at ``total``. Warm-up keeps Adam's first, badly estimated updates small; the decay lets the
    last steps settle.

    Args:
        step: an int >= 0; from ``total`` on the multiplier is 0.
        warmup: an int from 0 (no warm-up) to ``total``.
        total: a positive int.
    """
    step = require_int("step", step, minimum=0)
    warmup = require_int("warmup", warmup, minimum=0)
    total = require_int("total", total)
    if warmup > total:
        raise ValueError(f"need 0 <= warmup <= total and total > 0, got warmup={warmup}, "
                         f"total={total}")
    if step < warmup:
        return (step + 1) / warmup
    return max(0.0, (total - step) / max(1, total - warmup))


def transformer_lr(step: int, d_model: int, warmup_steps: int = 4000) -> float:
    """The learning rate of the original Transformer at ``step`` (Vaswani et al., 2017, 5.3).

        lrate = d_model ** -0.5 * min(step ** -0.5, step * warmup_steps ** -1.5)

    It grows linearly for the first ``warmup_steps`` steps, then decays as the inverse square
    root of the step. The two branches meet at ``step == warmup_steps``, the peak, where the
    rate is ``(d_model * warmup_steps) ** -0.5``. The paper uses ``warmup_steps = 4000`` with
    Adam (beta1 = 0.9, beta2 = 0.98, eps = 1e-9); for its base model, d_model = 512, the peak
    is about 7.0e-4.

    Args:
        step: the 1-based number of the update, an int >= 1 (the formula divides by its
            square root, so step 0 has no rate).
        d_model: the model width, a positive int.
        warmup_steps: the length of the warm-up, a positive int.

    Returns:
        The learning rate, a float > 0.

    Raises:
        ValueError: for a ``step``, ``d_model`` or ``warmup_steps`` below 1;
            `InputTypeError` for one that is not an int.
    """
    step = require_int("step", step)
    d_model = require_int("d_model", d_model)
    warmup_steps = require_int("warmup_steps", warmup_steps)
    return d_model ** -0.5 * min(step ** -0.5, step * warmup_steps ** -1.5)


def transformer_lr_scheduler(optimizer: torch.optim.Optimizer, d_model: int,
                             warmup_steps: int = 4000, factor: float = 1.0,
                             ) -> torch.optim.lr_scheduler.LambdaLR:
    """A `LambdaLR` that gives ``optimizer`` the rate of `transformer_lr`, times ``factor``.

    `LambdaLR` multiplies each parameter group's initial ``lr`` by the function's value, so
    create the optimizer with ``lr=1.0`` to get the paper's rates exactly (with another ``lr``
    every rate is scaled by it). `LambdaLR` counts from 0 and the paper from 1: the k-th call of
    ``scheduler.step()`` (k = 0 before any) sets the rate of update k + 1,
    ``factor * transformer_lr(k + 1, d_model, warmup_steps)``.

    Args:
        optimizer: a `torch.optim.Optimizer`.
        d_model, warmup_steps: as in `transformer_lr`.
        factor: a finite number > 0 that scales every rate.

    Raises:
        ValueError: for a ``d_model`` or ``warmup_steps`` below 1 or a ``factor`` <= 0;
            `InputTypeError` for an ``optimizer`` that is not one.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise InputTypeError(f"optimizer must be a torch.optim.Optimizer, got "
                             f"{type_name(optimizer)}")
    d_model = require_int("d_model", d_model)
    warmup_steps = require_int("warmup_steps", warmup_steps)
    factor = require_real("factor", factor, low=0.0, low_open=True)
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: factor * transformer_lr(s + 1, d_model, warmup_steps))
