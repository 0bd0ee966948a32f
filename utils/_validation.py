"""Small helpers that turn bad input into an error naming what was expected and what was given.

Every public function and class of `utils` checks its arguments with these before doing any work,
so that a mistake surfaces as one clear sentence instead of a wrong answer or a message from deep
inside torch. Two kinds of error are raised:

* `InputTypeError` for an argument of the wrong kind (a list where a tensor belongs, a float or a
  bool where a count belongs, a float tensor where a bool mask belongs). It subclasses both
  `TypeError` and `ValueError`, so ``except ValueError`` written against earlier versions of the
  library still catches it.
* `ValueError` for an argument of the right kind with a wrong value (a shape, a negative count,
  a probability outside [0, 1)).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import numbers
import threading
from collections.abc import Iterator

import torch
from torch import nn


class InputTypeError(TypeError, ValueError):
    """An argument of the wrong type or dtype. Both a `TypeError` and a `ValueError`."""


def shape_str(t: torch.Tensor | torch.Size | tuple[int, ...]) -> str:
    """Format a tensor's shape (or a shape) as ``(2, 5, 8)``."""
    shape = t.shape if isinstance(t, torch.Tensor) else t
    return "(" + ", ".join(str(int(s)) for s in shape) + ")"


def type_name(value: object) -> str:
    """A short description of ``value`` for an error message: its type, and a tensor's dtype."""
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {shape_str(value)}"
    return type(value).__name__


def require_tensor(name: str, t: object) -> torch.Tensor:
    """Raise `InputTypeError` unless ``t`` is a tensor."""
    if not isinstance(t, torch.Tensor):
        raise InputTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def require_rank(name: str, t: torch.Tensor, expected: str, *, min_rank: int | None = None,
                 rank: int | None = None) -> None:
    """Raise `ValueError` if ``t`` has the wrong number of dimensions.

    Args:
        name: how the argument is called in the error message.
        t: the tensor to check.
        expected: the expected shape in words, such as ``"(..., L_q, d_k)"``.
        min_rank: the least number of dimensions allowed.
        rank: the exact number of dimensions required.
    """
    if rank is not None and t.dim() != rank:
        raise ValueError(f"{name} must have shape {expected} ({rank} dims), got {shape_str(t)}")
    if min_rank is not None and t.dim() < min_rank:
        raise ValueError(
            f"{name} must have shape {expected} (at least {min_rank} dims), got {shape_str(t)}"
        )


def broadcast_shape(*shapes: tuple[int, ...]) -> tuple[int, ...] | None:
    """The shape that ``shapes`` broadcast to, or None when they do not broadcast together.

    The rule of ``torch.broadcast_shapes`` in plain Python, without its exception (called on
    every forward pass, where the torch function's overhead shows at small sizes).
    """
    n = max((len(s) for s in shapes), default=0)
    out = []
    for dims in zip(*((1,) * (n - len(s)) + tuple(s) for s in shapes), strict=True):
        sizes = {d for d in dims if d != 1}
        if len(sizes) > 1:
            return None
        out.append(sizes.pop() if sizes else 1)
    return tuple(out)


def require_broadcastable(name: str, shape: torch.Size, target: tuple[int, ...],
                          target_desc: str) -> None:
    """Raise `ValueError` unless ``shape`` broadcasts to ``target``."""
    out = broadcast_shape(tuple(shape), tuple(target))
    if out is None or tuple(out) != tuple(target):
        raise ValueError(
            f"{name} of shape {shape_str(shape)} does not broadcast to {target_desc} = "
            f"{shape_str(target)}"
        )


def require_int(name: str, value: object, *, minimum: int = 1) -> int:
    """Return ``value`` as an `int` if it is an integer (not a bool) of at least ``minimum``.

    A float such as ``2.5`` or ``2.0``, a bool, a string or a tensor raises `InputTypeError`;
    an integer below ``minimum`` raises `ValueError`. NumPy integers are accepted.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        kind = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise InputTypeError(f"{name} must be {kind}, got {value!r} ({type(value).__name__})")
    value = int(value)
    if value < minimum:
        kind = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise ValueError(f"{name} must be {kind}, got {value}")
    return value


def require_real(name: str, value: object, *, low: float | None = None, high: float | None = None,
                 low_open: bool = False, high_open: bool = False) -> float:
    """Return ``value`` as a `float` if it is a finite real number in the given interval.

    Args:
        name: how the argument is called in the error message.
        value: the number (a bool or a non-number raises `InputTypeError`).
        low, high: the bounds (None: unbounded on that side).
        low_open, high_open: whether the bound itself is excluded.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InputTypeError(f"{name} must be a real number, got {value!r} "
                             f"({type(value).__name__})")
    value = float(value)
    left = "(" if low_open else "["
    right = ")" if high_open else "]"
    interval = (f"{left}{'-inf' if low is None else low}, "
                f"{'inf' if high is None else high}{right}")
    bad = not math.isfinite(value)
    if low is not None:
        bad = bad or value < low or (low_open and value == low)
    if high is not None:
        bad = bad or value > high or (high_open and value == high)
    if bad:
        raise ValueError(f"{name} must be a finite number in {interval}, got {value}")
    return value


def require_probability(name: str, value: object) -> float:
    """A dropout probability: a real number in [0, 1)."""
    return require_real(name, value, low=0.0, high=1.0, high_open=True)


def require_bool(name: str, value: object) -> bool:
    """Raise `InputTypeError` unless ``value`` is a bool."""
    if not isinstance(value, bool):
        raise InputTypeError(f"{name} must be True or False, got {value!r} "
                             f"({type(value).__name__})")
    return value


def require_choice(name: str, value: object, choices: tuple[str, ...]) -> str:
    """Raise unless ``value`` is one of the strings ``choices``."""
    if not isinstance(value, str):
        raise InputTypeError(f"{name} must be one of {choices}, got {value!r} "
                             f"({type(value).__name__})")
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value


def require_floating(name: str, t: torch.Tensor) -> None:
    """Raise `InputTypeError` unless ``t`` holds floating-point numbers."""
    if not t.is_floating_point():
        raise InputTypeError(
            f"{name} must be a floating-point tensor, got dtype {t.dtype} with shape "
            f"{shape_str(t)}"
        )


def require_bool_mask(name: str, mask: torch.Tensor) -> None:
    """Raise `InputTypeError` unless ``mask`` is a bool tensor (True = may attend / real)."""
    if mask.dtype != torch.bool:
        raise InputTypeError(
            f"{name} must be a bool tensor (True = may attend), got dtype {mask.dtype} with "
            f"shape {shape_str(mask)}; utils.masks converts PyTorch's other conventions"
        )


_TRUST = threading.local()


@contextlib.contextmanager
def values_trusted() -> Iterator[None]:
    """Inside this block the models skip the checks that read values back from the device (the
    range of token ids and positions), and check only shapes, dtypes and devices.

    For a caller that made the values itself and knows they are in range: a decoding loop feeds
    the tokens it picked and the positions it counted, and reading their range each step would
    make the host wait for the device (a GPU) at every step. Per thread; nests.
    """
    before = getattr(_TRUST, "on", False)
    _TRUST.on = True
    try:
        yield
    finally:
        _TRUST.on = before


def values_are_trusted() -> bool:
    """Whether the calling thread is inside `values_trusted`."""
    return getattr(_TRUST, "on", False)


def value_range(t: torch.Tensor) -> tuple[int, int]:
    """The smallest and the largest value of a non-empty integer tensor, in one pass."""
    low, high = torch.aminmax(t)
    return int(low), int(high)


def require_integer_ids(name: str, t: torch.Tensor, *, vocab_size: int | None = None) -> None:
    """Raise unless ``t`` holds integer token ids, each in [0, vocab_size) when that is given
    (the range is not read inside `values_trusted`)."""
    if t.dtype in (torch.bool,) or t.is_floating_point() or t.is_complex():
        raise InputTypeError(
            f"{name} must hold integer token ids (torch.long), got dtype {t.dtype} with shape "
            f"{shape_str(t)}"
        )
    if vocab_size is not None and t.numel() > 0 and not values_are_trusted():
        low, high = value_range(t)
        if low < 0 or high >= vocab_size:
            raise ValueError(
                f"{name} must hold ids in [0, {vocab_size}), got values from {low} to {high}"
            )


def module_dtype_device(module: nn.Module) -> tuple[torch.dtype, torch.device] | None:
    """The dtype and device of ``module``'s first floating-point parameter (None if it has none).

    The parameters are visited in the order of ``module.parameters()``, but by walking the
    submodules directly: this runs at every forward call, and ``parameters()`` costs several
    microseconds of bookkeeping per call, a visible share of one step of cached decoding.
    """
    stack = [module]
    while stack:
        m = stack.pop()
        for p in m._parameters.values():
            if p is not None and p.is_floating_point():
                return p.dtype, p.device
        stack.extend(reversed([c for c in m._modules.values() if c is not None]))
    return None


def apply_dropout(dropout: nn.Dropout, x: torch.Tensor) -> torch.Tensor:
    """``dropout(x)`` in training mode; ``x`` itself in evaluation mode, where dropout is the
    identity anyway, without the cost of a module call (a share of each decoding step)."""
    return dropout(x) if dropout.training else x


def require_like_module(name: str, t: torch.Tensor, module: nn.Module) -> None:
    """Raise `InputTypeError` unless ``t`` is floating point, with ``module``'s dtype and device.

    A float64 input to a float32 module would otherwise fail inside ``F.linear`` with
    "mat1 and mat2 must have the same dtype"; say instead what to do.
    """
    require_floating(name, t)
    ref = module_dtype_device(module)
    if ref is None:
        return
    dtype, device = ref
    if t.dtype != dtype:
        raise InputTypeError(
            f"{name} has dtype {t.dtype} but {type(module).__name__}'s parameters are {dtype}; "
            f"convert one of them ({name}.to({dtype}) or module.to({t.dtype}))"
        )
    if t.device != device:
        raise InputTypeError(
            f"{name} is on {t.device} but {type(module).__name__}'s parameters are on {device}; "
            f"move one of them ({name}.to('{device}') or module.to('{t.device}'))"
        )


def require_same_device(**tensors: torch.Tensor | None) -> None:
    """Raise `InputTypeError` unless every given tensor (None ones skipped) is on one device."""
    seen = [(n, t.device) for n, t in tensors.items() if isinstance(t, torch.Tensor)]
    for n, d in seen[1:]:
        if d != seen[0][1]:
            raise InputTypeError(
                f"{n} is on {d} but {seen[0][0]} is on {seen[0][1]}; put them on one device"
            )


@contextlib.contextmanager
def eval_mode(module: nn.Module, enabled: bool = True) -> Iterator[nn.Module]:
    """Put ``module`` (and every submodule) in evaluation mode, and restore each one's mode on exit.

    The mode of every submodule is restored as it was, even where a submodule's mode differed from
    its parent's, and on every exit path (an exception included).
    """
    modes = [(m, m.training) for m in module.modules()]
    try:
        if enabled:
            module.eval()
        yield module
    finally:
        for m, was_training in modes:
            m.training = was_training


def require_dtype(name: str, value: object, *, floating: bool = False) -> torch.dtype:
    """Return ``value`` if it is a `torch.dtype` (a floating-point one when ``floating``).

    A string such as ``"float32"`` or a Python type raises `InputTypeError`; an integer dtype
    where a floating one belongs raises `ValueError`.
    """
    if not isinstance(value, torch.dtype):
        raise InputTypeError(f"{name} must be a torch.dtype such as torch.float32, got {value!r} "
                             f"({type(value).__name__})")
    if floating and not value.is_floating_point:
        raise ValueError(f"{name} must be a floating-point dtype, got {value}")
    return value


def require_device(name: str, value: object) -> torch.device | None:
    """Return ``value`` as a `torch.device` (None stays None), or raise naming what was given.

    Accepts a `torch.device`, a string such as ``"cpu"`` or ``"cuda:0"``, or None.
    """
    if value is None:
        return None
    if not isinstance(value, (str, torch.device)):
        raise InputTypeError(f"{name} must be a torch.device, a string such as 'cpu', or None; "
                             f"got {value!r} ({type(value).__name__})")
    try:
        return torch.device(value)
    except RuntimeError:
        raise ValueError(f"{name} must name a device such as 'cpu' or 'cuda:0', "
                         f"got {value!r}") from None


def require_data(name: str, t: torch.Tensor) -> None:
    """Raise `InputTypeError` if ``t`` lives on the ``meta`` device, where it has no values.

    Functions that must look at the values of a tensor (its largest entry, whether it holds NaN)
    call this first, so that a meta tensor gets a sentence instead of torch's "Tensor.item()
    cannot be called on meta tensors".
    """
    if t.device.type == "meta":
        raise InputTypeError(
            f"{name} must hold values, got a tensor of shape {shape_str(t)} on the meta device; "
            "move it to a real device first"
        )


def require_module_device(name: str, t: torch.Tensor, module: nn.Module) -> None:
    """Raise `InputTypeError` unless ``t`` is on the device of ``module`` (of its first parameter
    or buffer; a module with neither accepts any device).

    For inputs whose dtype is not the module's (integer token ids), where `require_like_module`
    does not apply.
    """
    ref = next(itertools.chain(module.parameters(), module.buffers()), None)
    if ref is not None and t.device != ref.device:
        raise InputTypeError(
            f"{name} is on {t.device} but {type(module).__name__} is on {ref.device}; move "
            f"one of them ({name}.to('{ref.device}') or module.to('{t.device}'))"
        )


def require_qkv(q: object, k: object, v: object,
                mask: object) -> tuple[torch.Size, torch.Tensor | None]:
    """Check q, k, v and an optional bool mask: the rules of
    `utils.attention.scaled_dot_product_attention`, shared with the functions of
    `utils.fast_attention`. q is (..., L_q, d_k), k (..., L_k, d_k), v (..., L_k, d_v), the mask
    broadcastable to (..., L_q, L_k).

    Returns the broadcast batch shape of q, k and v, and the mask, with a 1-dim mask (L_k,)
    given a query axis so that it reads as (1, L_k).
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        require_tensor(name, t)
    require_rank("q", q, "(..., L_q, d_k)", min_rank=2)
    require_rank("k", k, "(..., L_k, d_k)", min_rank=2)
    require_rank("v", v, "(..., L_k, d_v)", min_rank=2)
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"q and k must share the last dimension d_k: q is {shape_str(q)} (d_k={q.shape[-1]}),"
            f" k is {shape_str(k)} (d_k={k.shape[-1]})"
        )
    if q.shape[-1] == 0:
        raise ValueError(f"d_k must be at least 1 (the scores are divided by sqrt(d_k)), got q "
                         f"{shape_str(q)} and k {shape_str(k)}")
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(
            f"k and v must have the same number of keys L_k: k is {shape_str(k)} "
            f"(L_k={k.shape[-2]}), v is {shape_str(v)} (L_k={v.shape[-2]})"
        )
    batch = broadcast_shape(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    if batch is None:
        raise ValueError(
            f"the leading (batch) dims of q {shape_str(q)}, k {shape_str(k)} and v {shape_str(v)}"
            " do not broadcast together"
        )
    batch = torch.Size(batch)
    if not (q.dtype == k.dtype == v.dtype):
        raise InputTypeError(
            f"q, k and v must have the same dtype, got {q.dtype}, {k.dtype} and {v.dtype}"
        )
    require_floating("q", q)
    if mask is not None:
        require_tensor("mask", mask)
        require_bool_mask("mask", mask)
        target = (*batch, q.shape[-2], k.shape[-2])
        require_broadcastable("mask", mask.shape, target, "(..., L_q, L_k)")
        if mask.dim() == 1:
            mask = mask[None, :]
    require_same_device(q=q, k=k, v=v, mask=mask)
    return batch, mask
