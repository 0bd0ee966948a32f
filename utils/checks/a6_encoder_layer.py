"""Assignment 6: an encoder layer, post-LN and pre-LN.

The student writes ``EncoderLayer(d_model, nhead, dim_feedforward, dropout=0.0,
activation="relu", norm_first=False)`` with attributes ``self_attn`` (``w_q``, ``w_k``, ``w_v``,
``w_o``), ``linear1``, ``linear2``, ``norm1`` and ``norm2``, named as in
``torch.nn.TransformerEncoderLayer``.
"""

from __future__ import annotations

from typing import Any

import torch

from .checker import Case, Checker, Mistake, run_in_process
from .core import Spec
from .guard import Assignment, Rule
from .results import CheckResult
from .sublayers import (
    ACTIVATIONS,
    LAYER_MISTAKES,
    SHARED_DROPOUT_MISTAKES,
    Sublayers,
    dropout_build_note,
    exact_dropout,
    feed_forward,
    layer_params,
    layer_rules,
    layer_spec,
    padding_real,
    trace_recorder,
)

__all__ = ["check_encoder_layer", "CHECKER", "ASSIGNMENT", "encoder_layer"]

def encoder_layer(p: dict[str, torch.Tensor], x: torch.Tensor, mask: torch.Tensor | None, *,
                  nhead: int, norm_first: bool, activation: str, dropout: float = 0.0,
                  train: bool = False, flip_norm_first: bool = False, residual: str = "both",
                  swap_norms: bool = False, same_norm: bool = False, act: str | None = None,
                  act_out: bool = False, tutorial: bool = False, pre_from_norm: bool = False,
                  drop: str = "ok", drop_in_eval: bool = False,
                  trace: dict[str, torch.Tensor] | None = None,
                  **attend_kw: Any) -> torch.Tensor:
    """An encoder layer written out in float64, with switches that reproduce common mistakes.

    Dropout is modelled for p = 0 and p = 1 only (the checker's cases), where it is exact:
    with p = 1 every dropped tensor is zero, whatever the random numbers.
    """
    n1, n2 = ("norm2", "norm1") if swap_norms else ("norm1", "norm2")
    if same_norm:
        n2 = n1
    activation_fn = ACTIVATIONS[act or activation]
    active = train or drop_in_eval
    p_drop = dropout if active else 0.0
    record = trace_recorder({} if trace is None else trace)
    dropped = exact_dropout(p_drop)
    layer = Sublayers(p, nhead, record, dropped, drop, residual, attend_kw)
    norm, add = layer.norm, layer.add

    def sa(y: torch.Tensor) -> torch.Tensor:
        return layer.attend("self_attn", y, y, mask, "no_sa")

    def ff(y: torch.Tensor) -> torch.Tensor:
        return feed_forward(p, y, activation_fn, dropped, record, drop, act_out)

    if tutorial:  # LayerNorm(x + MHA(LayerNorm(x))), a misreading found in some tutorials
        x = norm(add(x, sa(norm(x, n1)), "sa"), n1)
        return norm(add(x, ff(norm(x, n2)), "ff"), n2)
    if norm_first != flip_norm_first:
        h = norm(x, n1)
        x = add(h if pre_from_norm else x, sa(h), "sa")
        h = norm(x, n2)
        return add(h if pre_from_norm else x, ff(h), "ff")
    x = norm(add(x, sa(x), "sa"), n1)
    return norm(add(x, ff(x), "ff"), n2)


class EncoderChecker(Checker):
    """The checker of the ``EncoderLayer`` module."""

    name = "check_encoder_layer"
    target = "EncoderLayer"
    what = "your layer"
    shape_desc = {"output": "(B, L, d_model)"}
    mistakes = (
        LAYER_MISTAKES["flip_norm_first"],
        Mistake("the layer computes LayerNorm(x + MHA(LayerNorm(x))), a misreading found in some "
                "tutorials: post-LN is norm(x + f(x)) and pre-LN is x + f(norm(x)), never both "
                "norms around one sublayer", {"tutorial": True}),
        Mistake("in pre-LN the residual is taken from norm(x): add the sublayer's output to x "
                "itself, x + f(norm(x))", {"pre_from_norm": True}),
        *(LAYER_MISTAKES[k] for k in ("no_residual", "no_ff_residual", "no_sa_residual")),
        Mistake("norm1 and norm2 swapped: norm1 goes with self-attention, norm2 with the "
                "feed-forward network", {"swap_norms": True}),
        Mistake("one layer norm used for both blocks: norm1 goes with self-attention, norm2 with "
                "the feed-forward network", {"same_norm": True}),
        *(LAYER_MISTAKES[k] for k in ("act_ignored", "gelu_tanh_encoder", "no_act")),
        Mistake("an activation after linear2 as well: the feed-forward network is "
                "linear2(act(linear1(x)))", {"act_out": True}),
        Mistake("the mask is ignored: pass it to the self-attention", {"mask_mode": "ignored"}),
        LAYER_MISTAKES["mask_inverted"],
        LAYER_MISTAKES["mask_3d"],
        Mistake("no dropout on the self-attention output: apply it to the sublayer's output "
                "before the residual sum", {"drop": "no_sa"}, combine=False),
        Mistake("no dropout on the feed-forward output: apply it to the sublayer's output "
                "before the residual sum", {"drop": "no_ff"}, combine=False),
        *SHARED_DROPOUT_MISTAKES,
    )

    def judge(self, spec: Spec, raw: dict[str, Any]) -> str | None:
        return dropout_build_note(spec, raw, super().judge(spec, raw), "self_attn")

    def forward(self, spec: Spec, x: dict[str, torch.Tensor], p: dict[str, torch.Tensor],
                **options: Any) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        d, nhead, _, dropout = spec.ctor_args
        trace: dict[str, torch.Tensor] = {}
        out = encoder_layer(p, x["x"], x.get("mask"), nhead=nhead, dropout=dropout,
                            train=spec.train, trace=trace, **spec.ctor_kwargs, **options)
        return {"output": out}, trace


def _case(b: int, length: int, d: int, nhead: int, d_ff: int, norm_first: bool, activation: str,
          mask: str | None = None, dropout: float = 0.0, train: bool = False) -> Any:
    def make(gen: torch.Generator) -> Spec:
        params = layer_params(gen, d, d_ff, ("self_attn",), ("norm1", "norm2"))
        tensors = {"x": torch.randn(b, length, d, generator=gen)}
        if mask == "padding":
            tensors["mask"] = padding_real(gen, b, length)[:, None, None, :]
        elif mask == "causal":
            tensors["mask"] = torch.ones(length, length, dtype=torch.bool).tril()
        elif mask == "batch":
            m = torch.rand(b, length, length, generator=gen) > 0.5
            m[..., 0] = True
            tensors["mask"] = m
        return layer_spec("module", tensors, ["x"], {"mask": "mask"} if mask else {},
                          (d, nhead, d_ff, dropout), activation, norm_first, params, train=train,
                          grad_out={"output": torch.randn(b, length, d, generator=gen)},
                          grad_inputs=["x"], trace=["self_attn", "norm1", "norm2", "linear1",
                                                     "linear2"])
    return make


# Points per case: the one place where this assignment's points are declared.
CHECKER = EncoderChecker([
    Case("post_ln", "post-LN (norm_first=False), x (2, 5, 16), 4 heads, ReLU",
         _case(2, 5, 16, 4, 32, False, "relu"), points=2),
    Case("pre_ln", "pre-LN (norm_first=True), x (2, 5, 16), 4 heads, ReLU",
         _case(2, 5, 16, 4, 32, True, "relu"), points=2),
    Case("post_padding", "post-LN with a padding mask (2, 1, 1, 6), 2 heads",
         _case(2, 6, 8, 2, 16, False, "relu", "padding"), points=2),
    Case("pre_gelu_padding", "pre-LN, GELU, padding mask (3, 1, 1, 6), 2 heads",
         _case(3, 6, 8, 2, 16, True, "gelu", "padding"), points=2),
    Case("post_causal", "post-LN with a causal mask (6, 6), 2 heads",
         _case(2, 6, 8, 2, 16, False, "relu", "causal"), points=1),
    Case("pre_batch_mask", "pre-LN with a mask (B, L, L) = (2, 6, 6), 2 heads",
         _case(2, 6, 8, 2, 16, True, "relu", "batch"), points=1),
    Case("post_train_dropout", "training mode, dropout=1.0, post-LN: each sublayer's output is "
         "dropped", _case(2, 5, 8, 2, 16, False, "relu", None, 1.0, True), points=1),
    Case("pre_train_dropout", "training mode, dropout=1.0, pre-LN: each sublayer's output is "
         "dropped", _case(2, 5, 8, 2, 16, True, "relu", None, 1.0, True), points=1),
    Case("eval_dropout", "eval mode turns dropout off (dropout=1.0), post-LN",
         _case(2, 5, 8, 2, 16, False, "relu", None, 1.0, False), points=1),
])

ASSIGNMENT = Assignment(
    name="a6_encoder_layer",
    checkers=[CHECKER],
    rules=[
        *layer_rules("encoder"),
        Rule("builtin", "_transformer_encoder_layer_fwd", "uses torch's built-in encoder layer "
             "kernel"),
    ],
)


def check_encoder_layer(cls: Any, verbose: bool = True) -> CheckResult:
    """Check an encoder layer class against the reference.

    The checker builds ``cls(d_model, nhead, dim_feedforward, dropout, activation=...,
    norm_first=...)``, copies known weights into ``self_attn`` (``w_q``, ``w_k``, ``w_v``,
    ``w_o``), ``linear1``, ``linear2``, ``norm1`` and ``norm2``, calls ``layer(x)`` or
    ``layer(x, mask=mask)`` (bool, True = may attend: (B, 1, 1, L), (L, L) or (B, L, L)), and
    compares the output and the gradients of x and of every weight. Three cases check dropout:
    in training mode with dropout=1.0 each sublayer's output must vanish before the residual sum,
    and in eval mode dropout must be off.
    """
    return run_in_process(CHECKER, cls, verbose)
