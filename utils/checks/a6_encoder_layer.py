"""Assignment 6: an encoder layer, post-LN and pre-LN.

The student writes ``EncoderLayer(d_model, nhead, dim_feedforward, dropout=0.0,
activation="relu", norm_first=False)`` with attributes ``self_attn`` (``w_q``, ``w_k``, ``w_v``,
``w_o``), ``linear1``, ``linear2``, ``norm1`` and ``norm2``, named as in
``torch.nn.TransformerEncoderLayer``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from .a2_multi_head_attention import mha, mha_params
from .core import Case, Checker, CheckResult, Mistake, Spec, run_in_process
from .guard import Assignment, Rule

__all__ = ["check_encoder_layer", "CHECKER", "ASSIGNMENT", "encoder_layer"]

_ACTS = {"relu": F.relu, "gelu": F.gelu, "none": lambda t: t,
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
    d = x.shape[-1]
    n1, n2 = ("norm2", "norm1") if swap_norms else ("norm1", "norm2")
    if same_norm:
        n2 = n1
    activation_fn = _ACTS[act or activation]
    active = train or drop_in_eval
    p_drop = dropout if active else 0.0
    trace = {} if trace is None else trace

    record = trace_recorder(trace)
    dropped = exact_dropout(p_drop)

    def norm(y: torch.Tensor, name: str) -> torch.Tensor:
        return record(name, y, F.layer_norm(y, (d,), p[f"{name}.weight"], p[f"{name}.bias"],
                                            1e-5))

    def sa(y: torch.Tensor) -> torch.Tensor:
        out = record("self_attn", y, mha(p, nhead, y, y, y, mask, prefix="self_attn.",
                                         **attend_kw))
        return out if drop == "no_sa" else dropped(out)

    def ff(y: torch.Tensor) -> torch.Tensor:
        return feed_forward(p, y, activation_fn, dropped, record, drop, act_out)

    def add(y: torch.Tensor, f_y: torch.Tensor, which: str) -> torch.Tensor:
        if residual == "none" or residual == which:
            out = f_y
        else:
            out = y + f_y
        return dropped(out) if drop == "sum" else out

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
        Mistake("pre-LN and post-LN swapped: with norm_first=True normalize before each "
                "sublayer, x + f(norm(x)); with norm_first=False normalize after the residual "
                "sum, norm(x + f(x))", {"flip_norm_first": True}),
        Mistake("the layer computes LayerNorm(x + MHA(LayerNorm(x))), a misreading found in some "
                "tutorials: post-LN is norm(x + f(x)) and pre-LN is x + f(norm(x)), never both "
                "norms around one sublayer", {"tutorial": True}),
        Mistake("in pre-LN the residual is taken from norm(x): add the sublayer's output to x "
                "itself, x + f(norm(x))", {"pre_from_norm": True}),
        Mistake("the residual connections are missing: add each sublayer's input to its output",
                {"residual": "none"}),
        Mistake("the feed-forward block's residual is missing: x + FF(...), not FF(...) alone",
                {"residual": "ff"}),
        Mistake("the self-attention block's residual is missing: x + SA(...), not SA(...) alone",
                {"residual": "sa"}),
        Mistake("norm1 and norm2 swapped: norm1 goes with self-attention, norm2 with the "
                "feed-forward network", {"swap_norms": True}),
        Mistake("one layer norm used for both blocks: norm1 goes with self-attention, norm2 with "
                "the feed-forward network", {"same_norm": True}),
        Mistake("the activation argument is ignored (always ReLU)", {"act": "relu"}),
        Mistake("GELU with the tanh approximation: use the exact GELU (F.gelu), as torch's "
                "encoder layer does", {"act": "gelu_tanh"}),
        Mistake("no activation between linear1 and linear2", {"act": "none"}),
        Mistake("an activation after linear2 as well: the feed-forward network is "
                "linear2(act(linear1(x)))", {"act_out": True}),
        Mistake("the mask is ignored: pass it to the self-attention", {"mask_mode": "ignored"}),
        Mistake("mask polarity inverted: True means 'may attend'", {"invert": True}),
        Mistake("a 3-dimensional mask (B, L, L) lines up its batch axis with the heads: it needs "
                "a head axis, (B, 1, L, L)", {"head_axis": False}),
        Mistake("no dropout on the self-attention output: apply it to the sublayer's output "
                "before the residual sum", {"drop": "no_sa"}, combine=False),
        Mistake("no dropout on the feed-forward output: apply it to the sublayer's output "
                "before the residual sum", {"drop": "no_ff"}, combine=False),
        *SHARED_DROPOUT_MISTAKES,
    )

    def judge(self, spec: Spec, raw: dict[str, Any]) -> str | None:
        hint = super().judge(spec, raw)
        if hint and raw.get("status") == "build" and spec.ctor_args[3] == 1.0:
            hint += (" (the checker builds your layer with dropout=1.0, which nn.Dropout accepts, "
                     "to see where dropout acts: build self_attn without dropout, as the "
                     "assignment says)")
        return hint

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
        params = mha_params(gen, d, "self_attn.")
        params.update(ff_and_norm_params(gen, d, d_ff, ("norm1", "norm2")))
        tensors = {"x": torch.randn(b, length, d, generator=gen)}
        kwargs = {}
        if mask == "padding":
            lengths = [length] + [int(v) for v in torch.randint(1, length, (b - 1,),
                                                                 generator=gen)]
            real = torch.arange(length)[None, :] < torch.tensor(lengths)[:, None]
            tensors["mask"] = real[:, None, None, :]
        elif mask == "causal":
            tensors["mask"] = torch.ones(length, length, dtype=torch.bool).tril()
        elif mask == "batch":
            m = torch.rand(b, length, length, generator=gen) > 0.5
            m[..., 0] = True
            tensors["mask"] = m
        if mask:
            kwargs = {"mask": "mask"}
        return Spec("module", tensors, ["x"], kwargs, ctor_args=[d, nhead, d_ff, dropout],
                    ctor_kwargs={"activation": activation, "norm_first": norm_first},
                    params=params, train=train,
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
        Rule("module", "utils.transformer", "imports utils.transformer, the book's reference "
             "encoder layer that this assignment asks you to write"),
        Rule("module", "utils.models", "imports utils.models, which holds the reference "
             "encoder layer"),
        Rule("code", "torch.nn.modules.transformer", "uses torch's nn.TransformerEncoderLayer, "
             "the module this assignment asks you to write",
             qualname="TransformerEncoderLayer"),
        Rule("code", "torch.nn.modules.transformer", "uses torch's nn.TransformerEncoder",
             qualname="TransformerEncoder"),
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
