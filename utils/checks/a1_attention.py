"""Assignment 1: scaled dot-product attention with masks.

The student writes ``scaled_dot_product_attention(q, k, v, mask=None) -> (output, weights)``.
The reference below is written out in float64, with switches that reproduce the usual mistakes.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .checker import Case, Checker, Mistake, run_in_process
from .core import Spec
from .guard import Assignment, Rule
from .results import CheckResult

__all__ = ["check_scaled_dot_product_attention", "CHECKER", "ASSIGNMENT"]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
           *, scale: str = "sqrt_dk", axis: int = -1, mask_mode: str = "before",
           invert: bool = False, swap_kv: bool = False, log_softmax: bool = False,
           weights: str = "ok") -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T / sqrt(d_k)) v, with switches that reproduce common mistakes."""
    if swap_kv:
        k, v = v, k
    scores = q @ k.transpose(-2, -1)
    d_k = q.shape[-1]
    factor = {"sqrt_dk": 1 / math.sqrt(d_k), "none": 1.0, "dk": 1 / d_k,
              "sqrt_dv": 1 / math.sqrt(v.shape[-1]), "times_sqrt_dk": math.sqrt(d_k),
              "sqrt_lk": 1 / math.sqrt(k.shape[-2]), "after": 1.0}[scale]
    scores = scores * factor
    raw_scores = scores

    def softmax(s: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(s, dim=axis) if log_softmax else torch.softmax(s, dim=axis)

    if mask is None or mask_mode == "ignored":
        w = softmax(scores)
    else:
        if invert:
            mask = ~mask
        if mask_mode == "after":
            w = softmax(scores).masked_fill(~mask, 0.0)
        elif mask_mode == "zero_fill":
            w = softmax(scores.masked_fill(~mask, 0.0))
        elif mask_mode == "additive":
            w = softmax(scores + mask.to(scores.dtype))
        elif mask_mode == "big_negative":
            w = softmax(scores.masked_fill(~mask, -1e9))
        elif mask_mode == "nan_rows":
            w = softmax(scores.masked_fill(~mask, float("-inf")))
        else:
            s = scores.masked_fill(~mask, float("-inf"))
            has_key = mask.any(dim=-1, keepdim=True)
            s = s.masked_fill(~has_key, 0.0)
            w = softmax(s) * mask
    if scale == "after":
        w = w / math.sqrt(d_k)
    out = w @ v
    if weights == "scores":
        w = raw_scores
    return out, w


class SDPAChecker(Checker):
    """The checker of ``scaled_dot_product_attention``."""

    name = "check_scaled_dot_product_attention"
    target = "scaled_dot_product_attention"
    what = "your function"
    shape_desc = {"output": "(..., L_q, d_v)", "weights": "(..., L_q, L_k)"}
    mistakes = (
        Mistake("the scores are not scaled by 1/sqrt(d_k): divide q k^T by sqrt(d_k) before the "
                "softmax", {"scale": "none"}),
        Mistake("the scores are divided by d_k instead of sqrt(d_k)", {"scale": "dk"}),
        Mistake("the scores are scaled by 1/sqrt(d_v), the width of v: use d_k, the width of q "
                "and k", {"scale": "sqrt_dv"}),
        Mistake("the scores are multiplied by sqrt(d_k): divide by it instead",
                {"scale": "times_sqrt_dk"}),
        Mistake("the scores are scaled by 1/sqrt(L_k), the number of keys: use d_k, the width "
                "of q and k", {"scale": "sqrt_lk"}),
        Mistake("the scaling comes after the softmax (the weights are divided by sqrt(d_k)): "
                "scale the scores before the softmax, so that the weights still sum to 1",
                {"scale": "after"}),
        Mistake("softmax over the wrong axis: normalize over the keys (the last axis, dim=-1) so "
                "that each query's weights sum to 1", {"axis": -2}),
        Mistake("softmax over the batch axis (dim=0): normalize over the keys, the last axis",
                {"axis": 0}),
        Mistake("log_softmax instead of softmax: the weights must be probabilities",
                {"log_softmax": True}),
        Mistake("key and value swapped: the scores compare q with k, and the weights average v",
                {"swap_kv": True}),
        Mistake("mask applied after the softmax: fill the disallowed scores with -inf before the "
                "softmax, or the allowed weights no longer sum to 1", {"mask_mode": "after"}),
        Mistake("mask polarity inverted: True means 'may attend' (as in torch's "
                "F.scaled_dot_product_attention), so fill the scores where the mask is False",
                {"invert": True}),
        Mistake("the mask is ignored: fill the scores where the mask is False with -inf",
                {"mask_mode": "ignored"}),
        Mistake("masked scores are set to 0 instead of -inf, so masked keys still get weight",
                {"mask_mode": "zero_fill"}),
        Mistake("the bool mask is added to the scores as numbers: use it to fill the disallowed "
                "scores with -inf", {"mask_mode": "additive"}),
        Mistake("a query with no allowed key gives NaN: give such a row zero weights and a zero "
                "output", {"mask_mode": "nan_rows"}),
        Mistake("a query with no allowed key gets uniform weights (masked scores filled with a "
                "large negative number instead of -inf?): give such a row zero weights and a "
                "zero output", {"mask_mode": "big_negative"}),
        Mistake("the weights returned are the scores before the softmax: return the softmax of "
                "the scores", {"weights": "scores"}, combine=False),
    )
    nan_grad_hint = ("a fully masked row goes through the softmax as a row of -inf (NaN) and is "
                     "zeroed afterwards (nan_to_num, torch.where, masked_fill), which hides the "
                     "NaN in the forward pass only; replace such a row's scores before the "
                     "softmax, as the assignment explains")

    def forward(self, spec: Spec, x: dict[str, torch.Tensor], p: dict[str, torch.Tensor],
                **options: Any) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        out, w = attend(x["q"], x["k"], x["v"], x.get("mask"), **options)
        return {"output": out, "weights": w}, {}

    def shape_note(self, spec: Spec, name: str, shape: tuple[int, ...]) -> str:
        q, v = spec.tensors["q"], spec.tensors["v"]
        if name == "output" and shape == tuple(q.shape[:-2]) + (v.shape[-1], q.shape[-2]):
            return "transposed: the last two axes are (L_q, d_v)"
        if name == "output" and shape == tuple(q.shape[:-1]) + (spec.tensors["k"].shape[-2],):
            return "is that the weights? return (output, weights) in that order"
        return ""

    def localize(self, spec: Spec, tensors: dict[str, torch.Tensor],
                 ref: dict[str, torch.Tensor], name: str) -> str:
        w = tensors.get("out:weights")
        want = ref["out:weights"]
        if w is None or tuple(w.shape) != tuple(want.shape):
            return "compare your code with the formula step by step"
        w = w.double()
        if name == "output" and torch.allclose(w, want, atol=1e-4, rtol=1e-4):
            return "your weights are right, so the step after them is wrong: output = weights @ v"
        mask = spec.tensors.get("mask")
        if mask is not None:
            allowed = mask.expand(want.shape)
            if (w.masked_fill(allowed, 0.0).abs() > 1e-6).any():
                return "your weights are not 0 where the mask is False (a key a query may not see)"
        sums = w.sum(dim=-1)
        target = want.sum(dim=-1)
        if not torch.allclose(sums, target, atol=1e-4):
            return ("the weights of a query do not sum to 1 over the keys: the softmax must run "
                    "over the last axis, after the scaling and the mask")
        return ("your weights sum to 1 per query but differ from softmax(q k^T / sqrt(d_k)): "
                "check the scores (which tensors, which transpose, the scaling)")


def _case(shape_q: tuple[int, ...], shape_k: tuple[int, ...], d_v: int,
          mask: torch.Tensor | None) -> Any:
    def make(gen: torch.Generator) -> Spec:
        q = torch.randn(*shape_q, generator=gen)
        k = torch.randn(*shape_k, generator=gen)
        v = torch.randn(*shape_k[:-1], d_v, generator=gen)
        tensors = {"q": q, "k": k, "v": v}
        args = ["q", "k", "v"]
        if mask is not None:
            tensors["mask"] = mask.clone()
            args.append("mask")
        out_shape = torch.broadcast_shapes(q.shape[:-1], k.shape[:-2] + (1,)) + (d_v,)
        w_shape = out_shape[:-1] + (shape_k[-2],)
        grad_out = {"output": torch.randn(out_shape, generator=gen),
                    "weights": torch.randn(w_shape, generator=gen)}
        return Spec("function", tensors, args, outputs=["output", "weights"], grad_out=grad_out,
                    grad_inputs=["q", "k", "v"])
    return make


def _masks() -> dict[str, torch.Tensor]:
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    pad = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])[:, None, None, :]  # (2, 1, 1, 6)
    empty_row = torch.ones(2, 4, 6, dtype=torch.bool)
    empty_row[0, 1] = False
    empty_row[1, :, 3:] = False
    unbatched = torch.rand(4, 6, generator=torch.Generator().manual_seed(5)) > 0.4
    unbatched[:, 0] = True
    return {"causal": causal, "pad": pad, "empty": empty_row, "unbatched": unbatched}


_M = _masks()

# Points per case: the one place where this assignment's points are declared.
CHECKER = SDPAChecker([
    Case("no_mask", "no mask, q (2, 5, 8), k (2, 6, 8), v (2, 6, 4)",
         _case((2, 5, 8), (2, 6, 8), 4, None), points=2),
    Case("causal", "causal mask (5, 5), q k v (3, 5, 8)",
         _case((3, 5, 8), (3, 5, 8), 8, _M["causal"]), points=2),
    Case("padding", "padding mask (2, 1, 1, 6), q (2, 3, 4, 8), k v (2, 3, 6, 8)",
         _case((2, 3, 4, 8), (2, 3, 6, 8), 8, _M["pad"]), points=2),
    Case("empty_row", "a query with no allowed key gets zero weights, mask (2, 4, 6)",
         _case((2, 4, 8), (2, 6, 8), 4, _M["empty"]), points=2),
    Case("unbatched", "no batch axis, q (4, 8), k v (6, 8), mask (4, 6)",
         _case((4, 8), (6, 8), 8, _M["unbatched"]), points=2),
])

ASSIGNMENT = Assignment(
    name="a1_attention",
    checkers=[CHECKER],
    rules=[
        Rule("module", "utils.attention", "imports utils.attention, the book's reference "
             "attention that this assignment asks you to write"),
        Rule("module", "utils.fast_attention", "imports utils.fast_attention, whose functions "
             "compute the attention that this assignment asks you to write"),
        Rule("module", "utils.transformer", "imports utils.transformer, which holds the "
             "reference attention"),
        Rule("module", "utils.transformer_layers", "imports utils.transformer_layers, which "
             "holds the reference attention"),
        Rule("module", "utils.models", "imports utils.models, which holds the reference "
             "attention"),
        Rule("builtin", "scaled_dot_product_attention", "calls torch's built-in "
             "F.scaled_dot_product_attention, the function this assignment asks you to write",
             ops=("_scaled_dot_product_attention_math",
                  "_scaled_dot_product_flash_attention_for_cpu",
                  "_scaled_dot_product_efficient_attention",
                  "_scaled_dot_product_flash_attention", "_scaled_dot_product_cudnn_attention",
                  # the kernels beneath them, under names of their own
                  "_flash_attention_forward", "_efficient_attention_forward",
                  "_cudnn_attention_forward", "_triton_scaled_dot_attention",
                  # the fused multi-head kernels compute it too, with identity projections
                  "_native_multi_head_attention", "_transformer_encoder_layer_fwd")),
        # (each with its family: every overload, variant and backward kernel, see
        # grader.poison.operator_family)
        Rule("code", "torch.ao.nn.quantizable.modules.activation", "uses torch's quantizable "
             "MultiheadAttention, which computes this attention", qualname="MultiheadAttention"),
        Rule("code", "torch.nn.attention.flex_attention", "uses torch's flex_attention, which "
             "computes the attention this assignment asks you to write",
             qualname="flex_attention"),
        Rule("code", "torch._higher_order_ops.flex_attention", "uses torch's flex_attention "
             "operator, which computes the attention this assignment asks you to write"),
        Rule("code", "torch.nn.modules.activation", "uses torch's nn.MultiheadAttention",
             qualname="MultiheadAttention"),
        Rule("code", "torch.nn.functional", "uses torch's multi_head_attention_forward",
             qualname="multi_head_attention_forward"),
    ],
)


def check_scaled_dot_product_attention(fn: Any, verbose: bool = True) -> CheckResult:
    """Check ``fn(q, k, v, mask=None) -> (output, weights)`` against the reference.

    Cases: no mask with L_q != L_k and d_v != d_k, a causal mask, a padding mask broadcast over
    two batch dims, a mask with a query that may attend to no key (its row must be zeros), and
    inputs without a batch axis. Each case also compares the gradients of q, k and v.
    """
    return run_in_process(CHECKER, fn, verbose)
