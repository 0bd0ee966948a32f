"""The float64 pieces that the layer checkers share: assignments 6 (encoder) and 7 (decoder).

A layer's reference is built from these: the traced sublayers (`Sublayers`: layer norm,
attention, residual sum, each recorded under its attribute name as ``trace_in:NAME`` and
``trace_out:NAME``), the feed-forward block, dropout with p = 0 or 1 (the two where it is exact),
random weights for ``linear1``, ``linear2`` and the norms, and the mistakes that both layers
can make, each with the hint a student reads. Tensors are (B, L, d_model), batch first.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from .a2_multi_head_attention import mha, mha_params
from .checker import Mistake
from .core import Spec
from .guard import Rule

__all__ = ["ACTIVATIONS", "LAYER_MISTAKES", "SHARED_DROPOUT_MISTAKES", "Sublayers",
           "dropout_build_note", "exact_dropout", "feed_forward", "ff_and_norm_params",
           "layer_params", "layer_rules", "layer_spec", "padding_real", "trace_recorder"]

ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu, "none": lambda t: t,
         "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}


def trace_recorder(trace: dict[str, torch.Tensor]) -> Callable[[str, torch.Tensor, torch.Tensor],
                                                              torch.Tensor]:
    """``record(name, inp, out)``: keep the first input and output seen under ``name`` in
    ``trace`` (``trace_in:NAME``, ``trace_out:NAME``) and return ``out``."""
    def record(name: str, inp: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if f"trace_in:{name}" not in trace:
            trace[f"trace_in:{name}"], trace[f"trace_out:{name}"] = inp, out
        return out
    return record


def exact_dropout(p_drop: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """Dropout with probability 0 or 1, the two where it is exact whatever the random numbers."""
    def dropped(y: torch.Tensor) -> torch.Tensor:
        if p_drop == 0.0:
            return y
        if p_drop == 1.0:
            return torch.zeros_like(y)
        raise ValueError("only dropout 0 and 1 are modelled")
    return dropped


def feed_forward(p: dict[str, torch.Tensor], y: torch.Tensor,
                 activation_fn: Callable[[torch.Tensor], torch.Tensor],
                 dropped: Callable[[torch.Tensor], torch.Tensor],
                 record: Callable[[str, torch.Tensor, torch.Tensor], torch.Tensor],
                 drop: str = "ok", act_out: bool = False) -> torch.Tensor:
    """The feed-forward sublayer of an encoder or decoder layer, dropout included:
    dropped(linear2(dropped(act(linear1(y))))), with the dropout mistakes ``drop`` = "no_ff"
    (none on the output) and "no_ff_at_all" (none anywhere), and ``act_out`` (an activation
    after linear2). Shared by assignments 6 and 7."""
    h = record("linear1", y, F.linear(y, p["linear1.weight"], p["linear1.bias"]))
    h = activation_fn(h)
    if drop != "no_ff_at_all":
        h = dropped(h)
    out = record("linear2", h, F.linear(h, p["linear2.weight"], p["linear2.bias"]))
    if act_out:
        out = activation_fn(out)
    return out if drop in ("no_ff", "no_ff_at_all") else dropped(out)


def ff_and_norm_params(gen: torch.Generator, d: int, d_ff: int,
                       norms: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Random ``linear1``, ``linear2`` and LayerNorm parameters (gains near 1) for a layer."""
    params = {
        "linear1.weight": torch.randn(d_ff, d, generator=gen) / d**0.5,
        "linear1.bias": 0.1 * torch.randn(d_ff, generator=gen),
        "linear2.weight": torch.randn(d, d_ff, generator=gen) / d_ff**0.5,
        "linear2.bias": 0.1 * torch.randn(d, generator=gen),
    }
    for n in norms:
        params[f"{n}.weight"] = 1 + 0.3 * torch.randn(d, generator=gen)
        params[f"{n}.bias"] = 0.3 * torch.randn(d, generator=gen)
    return params


# The dropout mistakes that assignments 6 and 7 share, in the order their checkers list them.
SHARED_DROPOUT_MISTAKES = (
    Mistake("no dropout in the feed-forward block at all: apply it after the activation and "
            "on the block's output", {"drop": "no_ff_at_all"}, combine=False),
    Mistake("dropout applied to the residual sum: apply it to each sublayer's output, "
            "before the sum", {"drop": "sum"}, combine=False),
    Mistake("dropout is active in eval mode: use nn.Dropout modules (or pass "
            "training=self.training to F.dropout), which module.eval() switches off",
            {"drop_in_eval": True}, combine=False),
)


def _gelu_tanh(layer: str) -> Mistake:
    return Mistake("GELU with the tanh approximation: use the exact GELU (F.gelu), as torch's "
                   f"{layer} layer does", {"act": "gelu_tanh"})


# The mistakes that assignments 6 and 7 share, by name (each checker lists them in its order).
LAYER_MISTAKES = {
    "flip_norm_first": Mistake(
        "pre-LN and post-LN swapped: with norm_first=True normalize before each sublayer, "
        "x + f(norm(x)); with norm_first=False normalize after the residual sum, "
        "norm(x + f(x))", {"flip_norm_first": True}),
    "no_residual": Mistake("the residual connections are missing: add each sublayer's input to "
                           "its output", {"residual": "none"}),
    **{f"no_{key}_residual": Mistake(f"the {block} block's residual is missing: x + "
                                     f"{key.upper()}(...), not {key.upper()}(...) alone",
                                     {"residual": key})
       for block, key in (("feed-forward", "ff"), ("self-attention", "sa"),
                          ("cross-attention", "ca"))},
    "act_ignored": Mistake("the activation argument is ignored (always ReLU)", {"act": "relu"}),
    "gelu_tanh_encoder": _gelu_tanh("encoder"),
    "gelu_tanh_decoder": _gelu_tanh("decoder"),
    "no_act": Mistake("no activation between linear1 and linear2", {"act": "none"}),
    "mask_inverted": Mistake("mask polarity inverted: True means 'may attend'", {"invert": True}),
    "mask_3d": Mistake("a 3-dimensional mask (B, L, L) lines up its batch axis with the heads: "
                       "it needs a head axis, (B, 1, L, L)", {"head_axis": False}),
}


def dropout_build_note(spec: Spec, raw: dict[str, Any], hint: str | None, what: str) -> str | None:
    """``hint``, with a note when building the layer failed in a case with dropout=1.0: the
    attentions (``what``) must be built without dropout."""
    if hint and raw.get("status") == "build" and len(spec.ctor_args) > 3 and \
            spec.ctor_args[3] == 1.0:
        hint += (" (the checker builds your layer with dropout=1.0, which nn.Dropout accepts, "
                 f"to see where dropout acts: build {what} without dropout, as the "
                 "assignment says)")
    return hint


@dataclass
class Sublayers:
    """The traced sublayers of one layer's forward, with the switches for mistakes that they
    share: ``drop`` (where dropout is missing) and ``residual`` (which residual is missing)."""

    p: dict[str, torch.Tensor]
    nhead: int
    record: Callable[[str, torch.Tensor, torch.Tensor], torch.Tensor]
    dropped: Callable[[torch.Tensor], torch.Tensor]
    drop: str
    residual: str
    attend_kw: dict[str, Any]

    def norm(self, y: torch.Tensor, name: str) -> torch.Tensor:
        """LayerNorm ``name`` (eps 1e-5) over the last axis."""
        return self.record(name, y, F.layer_norm(y, (y.shape[-1],), self.p[f"{name}.weight"],
                                                 self.p[f"{name}.bias"], 1e-5))

    def attend(self, name: str, q: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor | None,
               undropped: str) -> torch.Tensor:
        """The attention ``name`` of q over kv, dropped unless ``drop`` is ``undropped``."""
        out = self.record(name, q, mha(self.p, self.nhead, q, kv, kv, mask, prefix=f"{name}.",
                                       **self.attend_kw))
        return out if self.drop == undropped else self.dropped(out)

    def add(self, y: torch.Tensor, f_y: torch.Tensor, which: str) -> torch.Tensor:
        """The residual sum of sublayer ``which`` ("sa", "ca", "ff")."""
        out = f_y if self.residual in ("none", which) else y + f_y
        return self.dropped(out) if self.drop == "sum" else out


def layer_params(gen: torch.Generator, d: int, d_ff: int, attentions: tuple[str, ...],
                 norms: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Random weights for a layer's ``attentions`` (``w_q``, ...), linears and ``norms``."""
    params: dict[str, torch.Tensor] = {}
    for name in attentions:
        params.update(mha_params(gen, d, f"{name}."))
    params.update(ff_and_norm_params(gen, d, d_ff, norms))
    return params


def padding_real(gen: torch.Generator, b: int, length: int) -> torch.Tensor:
    """(B, length) bool, True = real token; the first sequence is full, the others random."""
    lengths = [length] + [int(v) for v in torch.randint(1, length, (b - 1,), generator=gen)]
    return torch.arange(length)[None, :] < torch.tensor(lengths)[:, None]


def layer_spec(kind: str, tensors: dict[str, torch.Tensor], args: list[str],
               kwargs: dict[str, str], layer: tuple[int, int, int, float], activation: str,
               norm_first: bool, params: dict[str, torch.Tensor], **more: Any) -> Spec:
    """The spec of a layer case: ``cls(d_model, nhead, d_ff, dropout, activation=...,
    norm_first=...)`` (``layer`` holds the four) with ``params`` copied in."""
    return Spec(kind, tensors, args, kwargs, ctor_args=list(layer),
                ctor_kwargs={"activation": activation, "norm_first": norm_first}, params=params,
                **more)


def layer_rules(layer: str) -> list[Rule]:
    """What an assignment that asks for a ``layer`` ("encoder" or "decoder") layer forbids:
    the book's layers and torch's."""
    cls = f"Transformer{layer.capitalize()}"
    return [
        Rule("module", "utils.transformer", "imports utils.transformer, the book's reference "
             f"{layer} layer that this assignment asks you to write"),
        Rule("module", "utils.transformer_layers", "imports utils.transformer_layers, the "
             f"book's reference {layer} layer that this assignment asks you to write"),
        Rule("module", "utils.models", "imports utils.models, which holds the reference "
             f"{layer} layer"),
        Rule("code", "torch.nn.modules.transformer", f"uses torch's nn.{cls}Layer, "
             "the module this assignment asks you to write", qualname=f"{cls}Layer"),
        Rule("code", "torch.nn.modules.transformer", f"uses torch's nn.{cls}", qualname=cls),
    ]
