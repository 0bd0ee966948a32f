"""Low-rank adapters (LoRA) for the book's linear layers (chapter 20).

LoRA (Hu et al. 2021) freezes a pretrained ``nn.Linear`` with weight W (out, in) and learns a
change of low rank instead of W itself: two small matrices A (r, in) and B (out, r), and

    y = x W^T + b + (alpha / r) * dropout(x) A^T B^T,

so that the layer's weight is in effect W + (alpha / r) B A. B starts at zero, so the adapted
model starts exactly as the pretrained one; A starts random (``kaiming_uniform_(a=sqrt(5))``, as
``peft`` does), so that the first gradient of B is not zero. The names and the arithmetic are
those of ``peft``'s ``LoraConfig``/``get_peft_model``: the same base weights and adapter values
give the same outputs and gradients (tests/test_lora.py).

``add_lora`` wraps the layers of a model chosen by name (``target_modules``, matched as
``peft`` matches them) and freezes everything else; ``merge_lora`` folds every adapter back
into a plain ``nn.Linear``; ``trainable_parameters`` counts what an optimizer will update, and
``optimizer_state_bytes`` measures what it keeps for them.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from ._validation import InputTypeError, require_probability, require_real, type_name
from .costs import count_parameters

__all__ = ["LoRALinear", "add_lora", "merge_lora", "lora_layers", "trainable_parameters",
           "optimizer_state_bytes"]


class LoRALinear(nn.Module):
    """A frozen ``nn.Linear`` plus a trainable low-rank update.

    Args:
        base: the layer to adapt, weight W of shape (out, in); its parameters are frozen
            (``requires_grad=False``) in place.
        r: the rank of the update, an int >= 1.
        alpha: the scale numerator, a finite number > 0; the update is multiplied by
            ``scaling = alpha / r``.
        dropout: dropout probability on the adapter's input only, in [0, 1).

    Shapes:
        x (..., in) -> (..., out). ``lora_A`` is (r, in), ``lora_B`` is (out, r), created with
        W's dtype and device.

    Raises:
        InputTypeError: when ``base`` is not an ``nn.Linear`` or a number is of the wrong type.
        ValueError: when ``r`` < 1, ``alpha`` <= 0 or ``dropout`` is outside [0, 1).
    """

    def __init__(self, base: nn.Linear, r: int, alpha: float, dropout: float = 0.0):
        super().__init__()
        if not isinstance(base, nn.Linear):
            raise InputTypeError(f"base must be an nn.Linear, got {type_name(base)}")
        if isinstance(r, bool) or not isinstance(r, int):
            raise InputTypeError(f"r must be a positive int, got {r!r} ({type_name(r)})")
        if r < 1:
            raise ValueError(f"r must be a positive int, got {r}")
        self.r = r
        self.alpha = require_real("alpha", alpha, low=0.0, low_open=True)
        self.scaling = self.alpha / r
        self.base = base
        for p in base.parameters():
            p.requires_grad_(False)
        w = base.weight
        self.lora_A = nn.Parameter(torch.empty(r, base.in_features, dtype=w.dtype, device=w.device))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, r, dtype=w.dtype,
                                               device=w.device))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # B = 0: the update starts at 0
        self.dropout = nn.Dropout(require_probability("dropout", dropout))

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """base(x) + scaling * dropout(x) A^T B^T: (..., in) -> (..., out)."""
        return self.base(x) + (self.dropout(x) @ self.lora_A.T @ self.lora_B.T) * self.scaling

    def delta_weight(self) -> torch.Tensor:
        """The update of the weight, scaling * B A, (out, in), of rank at most r."""
        return self.scaling * (self.lora_B @ self.lora_A)

    def merge(self) -> nn.Linear:
        """A new ``nn.Linear`` with weight W + scaling * B A and the base's bias (copies, not
        views): the same outputs as this module in evaluation mode, one matrix product cheaper.
        Its parameters keep the base's ``requires_grad`` (False: frozen)."""
        base = self.base
        merged = nn.Linear(base.in_features, base.out_features, bias=base.bias is not None,
                           dtype=base.weight.dtype, device=base.weight.device)
        with torch.no_grad():
            merged.weight.copy_(base.weight + self.delta_weight())
            if base.bias is not None:
                merged.bias.copy_(base.bias)
        merged.requires_grad_(base.weight.requires_grad)
        return merged

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, r={self.r}, "
                f"alpha={self.alpha:g}, scaling={self.scaling:g}")


def _matches(name: str, target_modules: str | Sequence[str]) -> bool:
    """peft's rule: a str is a regular expression that must match the whole name; a list of
    names matches a module whose name is one of them or ends with ``"." + one of them``."""
    if isinstance(target_modules, str):
        return re.fullmatch(target_modules, name) is not None
    return any(name == t or name.endswith("." + t) for t in target_modules)


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def add_lora(model: nn.Module, target_modules: str | Sequence[str], r: int, alpha: float,
             dropout: float = 0.0) -> nn.Module:
    """Freeze ``model`` and wrap the ``nn.Linear`` layers named by ``target_modules`` in
    `LoRALinear` (in place). Returns ``model``.

    Args:
        model: any ``nn.Module``.
        target_modules: a list of module names, each matching a module whose full name
            (``model.named_modules()``) is that name or ends with ``"." + name`` (``["w_q",
            "w_v"]`` matches every attention's query and value projections), or one str, a
            regular expression that must match a whole name: the rule of ``peft``'s
            ``LoraConfig(target_modules=...)``.
        r, alpha, dropout: as in `LoRALinear`.

    Raises:
        InputTypeError: when ``model`` is not an ``nn.Module`` or ``target_modules`` is neither a
            str nor a list of str.
        ValueError: when no module matches, or a matching module is not an ``nn.Linear`` (or
            is already a `LoRALinear`'s base).
    """
    if not isinstance(model, nn.Module):
        raise InputTypeError(f"model must be an nn.Module, got {type_name(model)}")
    if not isinstance(target_modules, str) and not (
            isinstance(target_modules, Sequence) and target_modules
            and all(isinstance(t, str) for t in target_modules)):
        raise InputTypeError(f"target_modules must be a str or a non-empty list of str, got "
                             f"{target_modules!r}")
    inside = tuple(n + "." for n, _ in lora_layers(model))  # an adapter's own submodules
    names = [n for n, _ in model.named_modules()
             if n and _matches(n, target_modules) and not n.startswith(inside)]
    if not names:
        raise ValueError(f"target_modules {target_modules!r} match no module of "
                         f"{type(model).__name__}")
    for n in names:
        module = model.get_submodule(n)
        if isinstance(module, LoRALinear):
            raise ValueError(f"module {n!r} already has a LoRA adapter")
        if not isinstance(module, nn.Linear):
            raise ValueError(f"target module {n!r} must be an nn.Linear, got "
                             f"{type(module).__name__}")
    model.requires_grad_(False)
    for n in names:
        _replace(model, n, LoRALinear(model.get_submodule(n), r, alpha, dropout))
    return model


def lora_layers(model: nn.Module) -> Iterator[tuple[str, LoRALinear]]:
    """The ``(name, module)`` pairs of every `LoRALinear` in ``model``."""
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            yield name, module


def merge_lora(model: nn.Module) -> nn.Module:
    """Replace every `LoRALinear` in ``model`` with its merged ``nn.Linear`` (in place; the
    other parameters keep their ``requires_grad``). Returns ``model``; a model without adapters
    is returned unchanged. A `LoRALinear` that is ``model`` itself cannot be replaced in place:
    call its ``merge()``."""
    if not isinstance(model, nn.Module):
        raise InputTypeError(f"model must be an nn.Module, got {type_name(model)}")
    if isinstance(model, LoRALinear):
        raise ValueError("model is itself a LoRALinear: use model.merge()")
    for name, module in list(lora_layers(model)):
        _replace(model, name, module.merge())
    return model


def trainable_parameters(model: nn.Module) -> tuple[int, int]:
    """``(trainable, total)``: the number of scalars with ``requires_grad`` and of all of them
    (each shared tensor once), what ``peft``'s ``get_nb_trainable_parameters`` returns."""
    return (count_parameters(model, trainable_only=True), count_parameters(model))


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """The bytes of every tensor in ``optimizer.state`` (Adam's two moments per trainable
    parameter, and its step counters): what the optimizer keeps besides the model. Zero before
    the first step, when the state is still empty."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise InputTypeError(f"optimizer must be a torch.optim.Optimizer, got "
                             f"{type_name(optimizer)}")
    return sum(t.numel() * t.element_size() for state in optimizer.state.values()
               for t in state.values() if isinstance(t, torch.Tensor))
