"""Assignment 4: the sinusoidal positional encoding and layer normalization.

The student writes ``sinusoidal_encoding(max_len, d_model)`` and the module
``LayerNorm(d_model, eps=1e-5)`` with parameters ``weight`` and ``bias``.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .checker import Case, Checker, Mistake, run_in_process
from .core import Spec
from .guard import Assignment, Rule
from .results import CheckResult

__all__ = ["check_positional_encoding", "check_layer_norm", "PE_CHECKER", "LN_CHECKER",
           "ASSIGNMENT", "sinusoid", "layer_norm"]


# --------------------------------------------------------------------------------------------
# The sinusoidal positional encoding


def sinusoid(max_len: int, d_model: int, *, base: float = 10000.0, swap: bool = False,
             halves: bool = False, start: int = 0, w1: float | None = None,
             exponent: str = "2k", only: str = "", positions: str = "t") -> torch.Tensor:
    """PE[t, 2k] = sin(t w_k), PE[t, 2k+1] = cos(t w_k), w_k = base^(-2k/d), with mistakes."""
    t = torch.arange(start, start + max_len, dtype=torch.float64)[:, None]
    if positions == "normalized":
        t = t / max_len
    i = torch.arange(d_model // 2, dtype=torch.float64)
    if w1 is not None:
        w_s = w_c = w1**i
    elif exponent == "column":  # the column index j in the exponent: base^(-j/d)
        w_s, w_c = base ** (-2 * i / d_model), base ** (-(2 * i + 1) / d_model)
    elif exponent == "2column":  # 2j/d with the column index j
        w_s, w_c = base ** (-4 * i / d_model), base ** (-(4 * i + 2) / d_model)
    else:
        w_s = w_c = base ** (-2 * i / d_model)
    s, c = torch.sin(t * w_s), torch.cos(t * w_c)
    if only == "sin":
        c = torch.sin(t * w_c)
    elif only == "cos":
        s = torch.cos(t * w_s)
    if swap:
        s, c = c, s
    if halves:
        return torch.cat([s, c], dim=1)
    pe = torch.zeros(max_len, d_model, dtype=torch.float64)
    pe[:, 0::2] = s
    pe[:, 1::2] = c
    return pe


class PEChecker(Checker):
    """The checker of ``sinusoidal_encoding``."""

    name = "check_positional_encoding"
    target = "sinusoidal_encoding"
    what = "your function"
    shape_desc = {"encoding": "(max_len, d_model)"}
    combine_pairs = False
    mistakes = (
        Mistake("sin and cos swapped: even columns 2k take sin(t w_k), odd columns 2k+1 take "
                "cos(t w_k)", {"swap": True}),
        Mistake("sin and cos in two halves: interleave them, sin in the even columns and cos in "
                "the odd ones", {"halves": True}),
        Mistake("sin and cos swapped and in two halves: interleave them, sin in the even "
                "columns", {"halves": True, "swap": True}),
        Mistake("positions start at 1: the first position is t = 0", {"start": 1}),
        Mistake("the positions are divided by max_len: use t = 0, 1, 2, ... as they are",
                {"positions": "normalized"}),
        Mistake("the column index is in the exponent: a sine column 2k and the cosine column "
                "2k+1 after it share one frequency w_k = 10000^(-2k/d_model); use the pair "
                "index k, not the column index", {"exponent": "column"}),
        Mistake("the exponent uses 2 times the column index: the pair (2k, 2k+1) has "
                "w_k = 10000^(-2k/d_model)", {"exponent": "2column"}),
        Mistake("sines only: the odd columns take cos(t w_k)", {"only": "sin"}),
        Mistake("cosines only: the even columns take sin(t w_k)", {"only": "cos"}),
        Mistake("wrong frequency base: the exponent has the wrong sign, w_k = "
                "10000^(-2k/d_model) shrinks with k", {"base": 1e-4}),
        *(Mistake(f"wrong frequency base: {b:g} instead of 10000 (w_k = 10000^(-2k/d_model))",
                  {"base": b}) for b in (1000.0, 10.0, math.e, 1e5)),
        Mistake("wrong frequency base 100: did you use k/d_model instead of 2k/d_model in the "
                "exponent?", {"base": 100.0}),
    )

    def forward(self, spec: Spec, x: dict[str, torch.Tensor], p: dict[str, torch.Tensor],
                **options: Any) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        max_len, d_model = spec.literals
        return {"encoding": sinusoid(max_len, d_model, **options)}, {}

    def extra_variants(self, spec: Spec, tensors: dict[str, torch.Tensor]) -> list[Mistake]:
        out = tensors.get("out:encoding")
        max_len, d_model = spec.literals
        if out is None or out.dim() != 2 or tuple(out.shape) != (max_len, d_model) \
                or max_len < 2 or d_model < 4:
            return []
        s = float(out[1, 2])  # sin(w_1) with w_1 = base^(-2 / d_model)
        if not 0.0 < s < 1.0:
            return []
        w1 = math.asin(s)
        base = w1 ** (-d_model / 2)
        if not math.isfinite(base) or abs(base - 10000) < 1:
            return []
        shown = f"{base:.0f}" if base < 1e7 else f"{base:.2g}"
        return [Mistake(f"wrong frequency base: your frequencies match base ~ {shown}, expected "
                        "10000 (w_k = 10000^(-2k/d_model))", {"w1": w1})]

    def shape_note(self, spec: Spec, name: str, shape: tuple[int, ...]) -> str:
        max_len, d_model = spec.literals
        if shape == (d_model, max_len):
            return "transposed: rows are positions, columns are features"
        if shape == (1, max_len, d_model):
            return "with a leading batch axis: return (max_len, d_model)"
        return ""

    def localize(self, spec: Spec, tensors: dict[str, torch.Tensor],
                 ref: dict[str, torch.Tensor], name: str) -> str:
        got, want = tensors["out:encoding"].double(), ref["out:encoding"]
        bad = ((got - want).abs() > 1e-4).nonzero()
        if not len(bad):
            return "compare your code with the formula step by step"
        cols = sorted({int(j) for j in bad[:, 1]})
        t, j = (int(v) for v in bad[0])
        kind = "sine" if j % 2 == 0 else "cosine"
        return (f"the first wrong value is at position t={t}, column {j} (a {kind} column, "
                f"pair k={j // 2}); {len(cols)} of {want.shape[1]} columns differ")


def _pe_case(max_len: int, d_model: int) -> Any:
    def make(gen: torch.Generator) -> Spec:
        return Spec("function", {}, [], literals=[max_len, d_model], outputs=["encoding"])
    return make


# The encoding has no random input: its cases are the same in every run (which the grader's
# fresh inputs cannot change), and its sizes vary instead.
PE_CHECKER = PEChecker([
    Case("small", "max_len=10, d_model=8", _pe_case(10, 8), points=1),
    Case("large", "max_len=50, d_model=32", _pe_case(50, 32), points=1),
    Case("narrow", "max_len=3, d_model=2", _pe_case(3, 2), points=1),
    Case("wide", "max_len=7, d_model=64", _pe_case(7, 64), points=1),
])


# --------------------------------------------------------------------------------------------
# Layer normalization


def layer_norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float, *,
               unbiased: bool = False, eps_mode: str = "inside", affine: bool = True,
               dim: int | str = -1, swap_wb: bool = False, center_var: bool = True,
               center: bool = True, detach: str = "") -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) * w + b over the last axis, with switches for mistakes."""
    dims: Any = tuple(range(x.dim())) if dim == "all" else dim
    mean = x.mean(dim=dims, keepdim=True)
    if center_var:
        var = x.var(dim=dims, keepdim=True, unbiased=unbiased)
    else:
        var = (x**2).mean(dim=dims, keepdim=True)
    if detach == "mean":
        mean = mean.detach()
    elif detach == "var":
        var = var.detach()
    centered = x - mean if center else x
    if eps_mode == "outside":
        y = centered / (var.sqrt() + eps)
    elif eps_mode == "none":
        y = centered / var.sqrt()
    elif eps_mode == "default":
        y = centered / (var + 1e-5).sqrt()
    else:
        y = centered / (var + eps).sqrt()
    if swap_wb:
        w, b = b, w
    return y * w + b if affine else y


class LNChecker(Checker):
    """The checker of the ``LayerNorm`` module."""

    name = "check_layer_norm"
    target = "LayerNorm"
    what = "your module"
    shape_desc = {"output": "the input's shape (..., d_model)"}
    mistakes = (
        Mistake("unbiased variance: layer norm divides by d_model, not d_model - 1 "
                "(use var(unbiased=False) or mean((x - mean)**2))", {"unbiased": True}),
        Mistake("eps is added to the standard deviation: add it to the variance, inside the "
                "square root", {"eps_mode": "outside"}),
        Mistake("eps is missing: add it to the variance inside the square root",
                {"eps_mode": "none"}),
        Mistake("the eps given to the constructor is not used", {"eps_mode": "default"}),
        Mistake("the gain `weight` and shift `bias` are not applied: return x_hat * weight + bias",
                {"affine": False}),
        Mistake("weight and bias swapped: the output is x_hat * weight + bias",
                {"swap_wb": True}),
        *(Mistake("normalized over the wrong axis: take the mean and variance over the last "
                  "axis (the features of each position)", {"dim": dim}) for dim in (0, -2)),
        Mistake("normalized over the whole tensor: take the mean and variance of each position "
                "separately, over the last axis only", {"dim": "all"}),
        Mistake("the variance is the mean of x**2: subtract the mean first, mean((x - mean)**2)",
                {"center_var": False}),
        Mistake("the mean is not subtracted: x_hat = (x - mean) / sqrt(var + eps)",
                {"center": False}),
        Mistake("the mean is detached (.detach() or .item()), so the gradient misses its part",
                {"detach": "mean"}, grad_only=True),
        Mistake("the variance is detached (.detach() or .item()), so the gradient misses its part",
                {"detach": "var"}, grad_only=True),
    )

    def forward(self, spec: Spec, x: dict[str, torch.Tensor], p: dict[str, torch.Tensor],
                **options: Any) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        eps = spec.ctor_kwargs.get("eps", 1e-5)
        return {"output": layer_norm(x["x"], p["weight"], p["bias"], eps, **options)}, {}

    def localize(self, spec: Spec, tensors: dict[str, torch.Tensor],
                 ref: dict[str, torch.Tensor], name: str) -> str:
        got = tensors["out:output"].double()
        w, b = spec.params["weight"].double(), spec.params["bias"].double()
        if (w.abs() < 1e-3).any():
            return "compare your code with the formula step by step"
        x_hat = (got - b) / w
        if not torch.allclose(x_hat.mean(-1), torch.zeros(()).double(), atol=1e-3):
            return ("with the gain and shift undone, your output's mean over the last axis is "
                    "not 0: the centering step is where it differs")
        var = x_hat.var(-1, unbiased=False)
        return (f"with the gain and shift undone, your output has mean 0 but variance "
                f"{float(var.mean()):.3g} instead of about 1: the scaling step differs")


def _ln_case(shape: tuple[int, ...], eps: float | None, scale: float = 1.0,
             offset: float = 0.0) -> Any:
    def make(gen: torch.Generator) -> Spec:
        d = shape[-1]
        x = torch.randn(*shape, generator=gen) * scale + offset
        params = {"weight": 1 + 0.5 * torch.randn(d, generator=gen),
                  "bias": 0.5 * torch.randn(d, generator=gen)}
        kwargs = {} if eps is None else {"eps": eps}
        return Spec("module", {"x": x}, ["x"], ctor_args=[d], ctor_kwargs=kwargs, params=params,
                    grad_out={"output": torch.randn(*shape, generator=gen)}, grad_inputs=["x"])
    return make


LN_CHECKER = LNChecker([
    Case("batch", "x (2, 5, 8)", _ln_case((2, 5, 8), None), points=1),
    Case("offset", "x (4, 16) with mean 100 and std 10", _ln_case((4, 16), None, 10.0, 100.0),
         points=1),
    Case("eps", "eps=0.1 on x (3, 6) with a small variance", _ln_case((3, 6), 0.1, 0.2),
         points=1),
    Case("vector", "a single vector x (8,)", _ln_case((8,), None), points=1),
])

ASSIGNMENT = Assignment(
    name="a4_positional_encoding_layer_norm",
    checkers=[PE_CHECKER, LN_CHECKER],
    rules=[
        Rule("module", "utils.positional", "imports utils.positional, the book's reference "
             "positional encoding", checks=["check_positional_encoding"]),
        Rule("module", "utils.models", "imports utils.models, which holds the reference "
             "positional encoding and layer norm"),
        Rule("module", "utils.layers", "imports utils.layers, the book's reference layer norm",
             checks=["check_layer_norm"]),
        Rule("module", "utils.transformer", "imports utils.transformer, which holds the "
             "reference layer norm", checks=["check_layer_norm"]),
        Rule("module", "utils.transformer_layers", "imports utils.transformer_layers, which "
             "holds the reference layer norm", checks=["check_layer_norm"]),
        Rule("code", "torch.nn.modules.normalization", "uses torch's nn.LayerNorm, the module "
             "this assignment asks you to write", qualname="LayerNorm",
             checks=["check_layer_norm"]),
        Rule("code", "torch.nn.functional", "calls torch's F.layer_norm",
             qualname="layer_norm", checks=["check_layer_norm"]),
        Rule("builtin", "layer_norm", "calls torch's built-in layer_norm",
             checks=["check_layer_norm"]),
        Rule("builtin", "group_norm", "calls one of torch's other normalizations (group, "
             "batch, instance or RMS norm), which compute a layer norm when reshaped",
             ops=("native_group_norm", "batch_norm", "native_batch_norm",
                  "_batch_norm_impl_index", "_native_batch_norm_legit",
                  "_native_batch_norm_legit_no_training", "_native_batch_norm_legit_functional",
                  "instance_norm", "rms_norm", "_fused_rms_norm"),
             checks=("check_layer_norm",)),
        Rule("builtin", "native_layer_norm", "calls torch's built-in native_layer_norm",
             checks=["check_layer_norm"]),
    ],
)


def check_positional_encoding(fn: Any, verbose: bool = True) -> CheckResult:
    """Check ``fn(max_len, d_model) -> (max_len, d_model)`` against the sinusoidal encoding.

    PE[t, 2k] = sin(t w_k), PE[t, 2k+1] = cos(t w_k), w_k = 10000^(-2k/d_model), in torch's
    default dtype.
    """
    return run_in_process(PE_CHECKER, fn, verbose)


def check_layer_norm(cls: Any, verbose: bool = True) -> CheckResult:
    """Check a layer-norm class against layer normalization over the last axis.

    The checker builds ``cls(d_model)`` (or ``cls(d_model, eps=eps)``), copies a known gain and
    shift into its parameters ``weight`` and ``bias`` (shape (d_model,)), calls ``module(x)`` and
    compares the output and the gradients of x, weight and bias.
    """
    return run_in_process(LN_CHECKER, cls, verbose)
