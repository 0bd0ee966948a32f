"""Where the book's code runs and in what precision: devices, batches that move, mixed precision.

Everything in the book runs on the CPU, in float32, unless asked otherwise; nothing here changes
that. A reader with a GPU asks for it in one place:

- `device(prefer=None, verbose=True)` picks CUDA, then Apple's MPS, then the CPU (or checks the
  one asked for), and says in one line what it picked;
- `to_device(obj, device)` moves a batch: a tensor, a batch of `utils.data` (`MovableBatch`), or
  tuples, lists and dicts of them; anything else (ints, strings, None) is kept as it is;
- `MixedPrecision` is what ``utils.train.train(..., precision="bf16" | "fp16")`` runs: the
  forward pass and the loss under ``torch.autocast``, and for float16 a gradient scaler, so that
  small gradients do not underflow to zero (`PRECISIONS` names the choices).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterable
from typing import TypeVar

import torch
from torch import nn

from ._validation import InputTypeError, require_bool, type_name

__all__ = ["device", "available_devices", "to_device", "MovableBatch", "PRECISIONS",
           "MixedPrecision", "require_precision", "resolve_device"]

T = TypeVar("T")
PRECISIONS = ("fp32", "bf16", "fp16")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _mps_available() -> bool:
    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and mps.is_available())


def available_devices() -> list[str]:
    """The devices that can run the book's code here, fastest first: ``cuda:0``, ``cuda:1``...,
    then ``mps`` (Apple's GPU), then ``cpu`` (always there)."""
    found = [f"cuda:{i}" for i in range(torch.cuda.device_count())] if torch.cuda.is_available() \
        else []
    return found + (["mps"] if _mps_available() else []) + ["cpu"]


def _parse(value: object, name: str) -> torch.device:
    """``value`` (a str such as ``"cuda:1"`` or a `torch.device`) as a `torch.device`."""
    if isinstance(value, torch.device):
        return value
    if not isinstance(value, str):
        raise InputTypeError(f"{name} must be a str such as 'cuda' or 'cpu', or a torch.device, "
                             f"got {type_name(value)}; available here: "
                             f"{', '.join(available_devices())}")
    try:
        return torch.device(value)
    except RuntimeError:
        raise ValueError(f"{name}={value!r} is not a device name; available here: "
                         f"{', '.join(available_devices())}") from None


def resolve_device(value: str | torch.device, name: str = "device") -> torch.device:
    """Check that the device ``value`` names exists here and return it as a `torch.device`.

    ``"cuda"`` without an index becomes the current CUDA device (``cuda:0`` unless
    ``torch.cuda.set_device`` chose another), ``"mps"`` becomes ``mps:0``, as the tensors put
    there report. ``"meta"`` (tensors with a shape and no data) is accepted too.

    Raises:
        ValueError: for a name torch does not know, or a device not present here (the message
            lists those that are); `InputTypeError` for a value that is not a str or a device.
    """
    dev = _parse(value, name)
    if dev.type in ("cpu", "meta"):
        return dev
    if dev.type == "cuda" and torch.cuda.is_available():
        if dev.index is None:
            return torch.device("cuda", torch.cuda.current_device())
        if dev.index < torch.cuda.device_count():
            return dev
    if dev.type == "mps" and _mps_available() and dev.index in (None, 0):
        return torch.device("mps", 0)
    raise ValueError(f"{name}={value!r}: there is no {dev} here; available here: "
                     f"{', '.join(available_devices())}")


def device(prefer: str | torch.device | None = None, *, verbose: bool = True) -> torch.device:
    """The device to run on: ``prefer`` if given and present, else CUDA, then MPS, then the CPU.

    Args:
        prefer: None to pick the fastest device present; or a device to use, a str
            (``"cpu"``, ``"cuda"``, ``"cuda:1"``, ``"mps"``) or a `torch.device`, checked here.
        verbose: print one line saying what was picked (False: silent).

    Returns:
        A `torch.device` with an index for a GPU (``cuda:0``, ``mps:0``), so that it compares
        equal to the ``.device`` of the tensors put there.

    Raises:
        ValueError: when ``prefer`` names a device that is not present here, or no device at all
            (the message lists the devices available); `InputTypeError` for a ``prefer`` that is
            not a str or a device, or a ``verbose`` that is not a bool.
    """
    require_bool("verbose", verbose)
    if prefer is not None:
        dev, why = resolve_device(prefer, "prefer"), "as asked"
    elif torch.cuda.is_available():
        dev, why = resolve_device("cuda"), "the first CUDA GPU"
    elif _mps_available():
        dev, why = resolve_device("mps"), "Apple's GPU, through Metal"
    else:
        dev, why = torch.device("cpu"), "no CUDA or MPS device found"
    if verbose:
        name = f", {torch.cuda.get_device_name(dev)}" if dev.type == "cuda" else ""
        print(f"device: {dev} ({why}{name})")
    return dev


def _move(obj: T, dev: torch.device) -> T:
    if isinstance(obj, torch.Tensor):
        return obj.to(dev)
    if isinstance(obj, dict):
        moved = copy.copy(obj)
        moved.update({k: _move(v, dev) for k, v in obj.items()})
        return moved
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple
        return type(obj)(*(_move(v, dev) for v in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(_move(v, dev) for v in obj)
    if isinstance(obj, (MovableBatch, nn.Module)) or callable(getattr(obj, "to", None)):
        return obj.to(dev)
    return obj


def to_device(obj: T, device: str | torch.device) -> T:
    """``obj`` with every tensor in it on ``device``: what `utils.train.train` does to a batch.

    A tensor is moved with ``.to(device)``; a batch of `utils.data` (anything with a ``.to``
    method) by its own ``.to``; a tuple, list or dict (namedtuples and dict subclasses
    included) becomes a new one of the same type with its items moved, recursively. Anything
    else (an int, a string, None, a list of token ids) is returned as it is. Tensors already on
    ``device`` are returned unchanged, not copied, as ``Tensor.to`` does.

    Args:
        obj: the batch.
        device: a str (``"cuda"``, ``"cpu"``, ``"meta"``) or a `torch.device`.

    Raises:
        ValueError: for a device name torch does not know; `InputTypeError` for a ``device``
            that is not a str or a `torch.device`.
    """
    return _move(obj, _parse(device, "device"))


class MovableBatch:
    """What the batch dataclasses of `utils.data` share: ``batch.to(device)``."""

    def to(self: T, device: str | torch.device) -> T:
        """A new batch of the same type with every tensor field on ``device`` (see `to_device`);
        fields that are not tensors are kept. The batch itself is not changed.

        Raises:
            ValueError or `InputTypeError`: for a ``device`` that is not a device.
        """
        dev = _parse(device, "device")
        return dataclasses.replace(self, **{f.name: _move(getattr(self, f.name), dev)
                                            for f in dataclasses.fields(self) if f.init})


def require_precision(precision: object) -> str:
    """``precision`` if it is one of `PRECISIONS` (``"fp32"``, ``"bf16"``, ``"fp16"``)."""
    if not isinstance(precision, str) or precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(map(repr, PRECISIONS))}, got "
                         f"{precision!r}")
    return precision


class MixedPrecision:
    """A training step in bfloat16 or float16: autocast, and loss scaling for float16.

    Under ``torch.autocast`` the matrix products of the forward pass run in the low precision
    while the parameters, their gradients and the optimizer's state stay in float32. A float16
    gradient below about 6e-8 (2**-24, its smallest subnormal) becomes zero, so for float16 the
    loss is multiplied by a large scale before the backward pass and the gradients are divided
    by it before the update (``torch.amp.GradScaler``); a step whose gradients overflowed at
    that scale is skipped and the scale halved. bfloat16 has float32's range, so it needs no
    scaler.

    Args:
        precision: ``"bf16"`` or ``"fp16"`` (``"fp32"`` needs none of this: `utils.train.train`
            then runs its plain step, with no autocast at all).
        device_type: where the model is, ``"cpu"``, ``"cuda"`` or ``"mps"``.

    Attributes:
        dtype: ``torch.bfloat16`` or ``torch.float16``.
        scaler: the ``GradScaler`` for float16, None for bfloat16.
    """

    def __init__(self, precision: str, device_type: str):
        precision = require_precision(precision)
        if precision == "fp32":
            raise ValueError("precision='fp32' runs no autocast and no scaler: use the plain step")
        self.precision, self.device_type, self.dtype = precision, device_type, _DTYPES[precision]
        self.scaler = torch.amp.GradScaler(device_type) if precision == "fp16" else None

    def autocast(self) -> torch.autocast:
        """The context to run the forward pass and the loss in."""
        return torch.autocast(device_type=self.device_type, dtype=self.dtype)

    def step(self, loss: torch.Tensor, optimizer: torch.optim.Optimizer,
             params: Iterable[nn.Parameter], clip: float | None) -> bool:
        """Backward, clip the gradient's global norm to ``clip`` (None: no clipping), update.

        With a scaler the gradients are unscaled before they are clipped, so that ``clip``
        applies to the true gradients. Returns False when the scaler skipped the update
        (non-finite gradients at the current scale), True otherwise.
        """
        if self.scaler is None:
            loss.backward()
            if clip is not None:
                nn.utils.clip_grad_norm_(params, clip)
            optimizer.step()
            return True
        scale = self.scaler.get_scale()
        self.scaler.scale(loss).backward()
        if clip is not None:
            self.scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(params, clip)
        self.scaler.step(optimizer)
        self.scaler.update()
        return self.scaler.get_scale() >= scale  # the scale shrinks only after a skipped step
