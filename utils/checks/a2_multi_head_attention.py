"""Assignment 2: multi-head attention.

The student writes ``MultiHeadAttention(d_model, num_heads, bias=True, dropout=0.0)`` with
``nn.Linear`` attributes ``w_q``, ``w_k``, ``w_v``, ``w_o`` and ``forward(query, key, value,
mask=None)``. The checker copies known weights into those four attributes.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from .a1_attention import attend
from .checker import Case, Checker, Mistake, run_in_process
from .core import Spec
from .guard import Assignment, Rule
from .results import CheckResult

__all__ = ["check_multi_head_attention", "CHECKER", "ASSIGNMENT", "mha"]


def mha(p: dict[str, torch.Tensor], h: int, query: torch.Tensor, key: torch.Tensor,
        value: torch.Tensor, mask: torch.Tensor | None = None, *, prefix: str = "",
        split: str = "ok", merge: str = "ok", out_proj: bool = True, kv_from_query: bool = False,
        wq_for_keys: bool = False, swap_kv: bool = False, head_axis: bool = True,
        scale: str = "sqrt_dk", trace: dict[str, torch.Tensor] | None = None,
        **attend_kw: Any) -> torch.Tensor:
    """Multi-head attention with switches that reproduce common mistakes.

    ``p`` holds ``{prefix}w_q.weight``, ``{prefix}w_q.bias``, ... ; ``trace`` (when given)
    receives the first input and output of each projection, keyed as the student side keys them.
    """
    b, l_q, d = query.shape
    d_k = d // h
    if kv_from_query:
        key = value = query
    if swap_kv:
        key, value = value, key

    def lin(name: str, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, p[f"{prefix}{name}.weight"], p.get(f"{prefix}{name}.bias"))
        if trace is not None and f"trace_in:{name}" not in trace:
            trace[f"trace_in:{name}"], trace[f"trace_out:{name}"] = x, y
        return y

    def split_heads(x: torch.Tensor) -> torch.Tensor:
        length = x.shape[1]
        if split == "no_transpose":
            return x.reshape(b, h, length, d_k)
        if split == "interleaved":
            return x.reshape(b, length, d_k, h).permute(0, 3, 1, 2)
        return x.reshape(b, length, h, d_k).transpose(1, 2)

    q = split_heads(lin("w_q", query))
    k = split_heads(lin("w_q", key) if wq_for_keys else lin("w_k", key))
    v = split_heads(lin("w_v", value))
    if mask is not None and mask.dim() == 3 and head_axis:
        mask = mask.unsqueeze(1)
    if scale == "d_model":
        q = q * math.sqrt(d_k) / math.sqrt(d)  # so that attend's 1/sqrt(d_k) becomes 1/sqrt(d)
    out, _ = attend(q, k, v, mask, scale="sqrt_dk" if scale == "d_model" else scale, **attend_kw)
    if merge == "no_transpose":
        out = out.reshape(b, l_q, d)
    elif merge == "interleaved":
        out = out.permute(0, 2, 3, 1).reshape(b, l_q, d)
    else:
        out = out.transpose(1, 2).reshape(b, l_q, d)
    return lin("w_o", out) if out_proj else out


MHA_MISTAKES = (
    Mistake("heads split in the wrong order: view (B, L, d_model) as (B, L, h, d_k), then "
            "transpose to (B, h, L, d_k)", {"split": "no_transpose"}),
    Mistake("heads split in the wrong order: each head must take d_k consecutive features, view "
            "as (B, L, h, d_k), not (B, L, d_k, h)", {"split": "interleaved"}),
    Mistake("heads merged in the wrong order: transpose (B, h, L_q, d_k) to (B, L_q, h, d_k) "
            "before reshaping to (B, L_q, d_model)", {"merge": "no_transpose"}),
    Mistake("heads merged in the wrong order: concatenate the heads one after the other, "
            "(B, L_q, h, d_k) -> (B, L_q, d_model), not (B, L_q, d_k, h)",
            {"merge": "interleaved"}),
    Mistake("missing output projection: mix the concatenated heads with w_o", {"out_proj": False}),
    Mistake("the scores are not scaled by 1/sqrt(d_k): divide by sqrt(d_k) before the softmax",
            {"scale": "none"}),
    Mistake("the scores are scaled by 1/sqrt(d_model): use d_k = d_model / num_heads, the width "
            "of one head", {"scale": "d_model"}),
    Mistake("the scores are multiplied by sqrt(d_k): divide by it instead",
            {"scale": "times_sqrt_dk"}),
    Mistake("the scaling comes after the softmax: scale the scores before it",
            {"scale": "after"}),
    Mistake("softmax over the wrong axis: normalize over the keys (the last axis)",
            {"axis": -2}),
    Mistake("softmax over the batch axis (dim=0): normalize over the keys (the last axis)",
            {"axis": 0}),
    Mistake("mask applied after the softmax: fill the disallowed scores with -inf before the "
            "softmax", {"mask_mode": "after"}),
    Mistake("mask polarity inverted: True means 'may attend', so fill the scores where the mask "
            "is False", {"invert": True}),
    Mistake("the mask is ignored", {"mask_mode": "ignored"}),
    Mistake("masked scores are set to 0 instead of -inf", {"mask_mode": "zero_fill"}),
    Mistake("a 3-dimensional mask (B, L_q, L_k) lines up its batch axis with the heads: give it "
            "a head axis first, mask.unsqueeze(1) -> (B, 1, L_q, L_k)", {"head_axis": False}),
    Mistake("key and value are taken from the query: project the key and value arguments",
            {"kv_from_query": True}),
    Mistake("W_q is reused for the keys: project the keys with w_k", {"wq_for_keys": True}),
    Mistake("key and value swapped: w_k projects the key argument and w_v the value argument",
            {"swap_kv": True}),
)


class MHAChecker(Checker):
    """The checker of the ``MultiHeadAttention`` module."""

    name = "check_multi_head_attention"
    target = "MultiHeadAttention"
    what = "your module"
    shape_desc = {"output": "(B, L_q, d_model)"}
    mistakes = MHA_MISTAKES

    def forward(self, spec: Spec, x: dict[str, torch.Tensor], p: dict[str, torch.Tensor],
                **options: Any) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        names = spec.args
        trace: dict[str, torch.Tensor] = {}
        out = mha(p, spec.ctor_args[1], x[names[0]], x[names[1]], x[names[2]], x.get("mask"),
                  trace=trace, **options)
        return {"output": out}, trace

    def shape_note(self, spec: Spec, name: str, shape: tuple[int, ...]) -> str:
        q = spec.tensors[spec.args[0]]
        d, h = spec.ctor_args
        if shape == (q.shape[0], h, q.shape[1], d // h):
            return "the heads were not merged back"
        if shape == (q.shape[0], q.shape[1], d // h):
            return "only one head's width"
        return ""


def mha_params(gen: torch.Generator, d: int, prefix: str = "") -> dict[str, torch.Tensor]:
    """Known weights and biases for w_q, w_k, w_v, w_o."""
    out = {}
    for n in ("w_q", "w_k", "w_v", "w_o"):
        out[f"{prefix}{n}.weight"] = torch.randn(d, d, generator=gen) / math.sqrt(d)
        out[f"{prefix}{n}.bias"] = 0.1 * torch.randn(d, generator=gen)
    return out


def _case(b: int, l_q: int, l_k: int, d: int, h: int, mask: torch.Tensor | None,
          self_attn: bool = False) -> Any:
    def make(gen: torch.Generator) -> Spec:
        params = mha_params(gen, d)
        if self_attn:
            tensors = {"x": torch.randn(b, l_q, d, generator=gen)}
            args = ["x", "x", "x"]
        else:
            tensors = {"query": torch.randn(b, l_q, d, generator=gen),
                       "key": torch.randn(b, l_k, d, generator=gen),
                       "value": torch.randn(b, l_k, d, generator=gen)}
            args = ["query", "key", "value"]
        kwargs = {}
        if mask is not None:
            tensors["mask"] = mask.clone()
            kwargs = {"mask": "mask"}
        grad_out = {"output": torch.randn(b, l_q, d, generator=gen)}
        return Spec("module", tensors, args, kwargs, ctor_args=[d, h], params=params,
                    grad_out=grad_out, grad_inputs=sorted(set(args)),
                    trace=["w_q", "w_k", "w_v", "w_o"])
    return make


def _masks() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    batch = torch.rand(2, 4, 6, generator=g) > 0.5
    batch[..., 0] = True
    per_head = torch.rand(2, 3, 4, 6, generator=g) > 0.5
    per_head[..., 1] = True
    return {
        "causal": torch.ones(5, 5, dtype=torch.bool).tril(),
        "batch": batch,
        "pad": torch.tensor([[True] * 6, [True] * 3 + [False] * 3])[:, None, None, :],
        "per_head": per_head,
    }


_M = _masks()

# Points per case: the one place where this assignment's points are declared.
CHECKER = MHAChecker([
    Case("self", "self-attention, x (2, 5, 16), 4 heads", _case(2, 5, 5, 16, 4, None, True),
         points=2),
    Case("cross", "cross-attention, query (2, 3, 16), key/value (2, 6, 16), 4 heads",
         _case(2, 3, 6, 16, 4, None), points=2),
    Case("causal", "causal mask (5, 5), x (2, 5, 16), 4 heads",
         _case(2, 5, 5, 16, 4, _M["causal"], True), points=2),
    Case("batch_mask", "mask (B, L_q, L_k) = (2, 4, 6), query (2, 4, 12), 2 heads",
         _case(2, 4, 6, 12, 2, _M["batch"]), points=2),
    Case("padding", "padding mask (2, 1, 1, 6), query (2, 4, 12), 3 heads",
         _case(2, 4, 6, 12, 3, _M["pad"]), points=2),
    Case("head_mask", "a mask per head (2, 3, 4, 6), query (2, 4, 12), 3 heads",
         _case(2, 4, 6, 12, 3, _M["per_head"]), points=2),
    Case("one_head", "one head of width 8, x (1, 4, 8)", _case(1, 4, 4, 8, 1, None, True),
         points=1),
])

ASSIGNMENT = Assignment(
    name="a2_multi_head_attention",
    checkers=[CHECKER],
    rules=[
        Rule("code", "utils.attention", "uses utils.attention.MultiHeadAttention, the book's "
             "reference for the module this assignment asks you to write",
             qualname="MultiHeadAttention"),
        Rule("code", "utils.attention", "uses utils.attention.GroupedQueryAttention, a reference "
             "multi-head attention", qualname="GroupedQueryAttention"),
        Rule("code", "utils.attention", "uses utils.attention's reference multi-head attention "
             "(the base class of MultiHeadAttention)", qualname="_Attention"),
        Rule("module", "utils.transformer", "imports utils.transformer, which holds the "
             "reference multi-head attention"),
        Rule("module", "utils.transformer_layers", "imports utils.transformer_layers, which "
             "holds the reference multi-head attention"),
        Rule("module", "utils.models", "imports utils.models, which holds the reference "
             "multi-head attention"),
        Rule("code", "torch.nn.modules.activation", "uses torch's nn.MultiheadAttention, the "
             "module this assignment asks you to write", qualname="MultiheadAttention"),
        Rule("code", "torch.nn.functional", "uses torch's multi_head_attention_forward",
             qualname="multi_head_attention_forward"),
        Rule("builtin", "_native_multi_head_attention", "uses torch's built-in multi-head "
             "attention kernel"),
        Rule("code", "torch.ao.nn.quantizable.modules.activation", "uses torch's quantizable "
             "MultiheadAttention, another implementation of the module this assignment asks "
             "you to write", qualname="MultiheadAttention"),
    ],
)


def check_multi_head_attention(cls: Any, verbose: bool = True) -> CheckResult:
    """Check a multi-head attention class against the reference.

    The checker builds ``cls(d_model, num_heads)``, copies known weights into its ``nn.Linear``
    attributes ``w_q``, ``w_k``, ``w_v`` and ``w_o`` (weights and biases), calls ``module(query,
    key, value)`` or ``module(query, key, value, mask=mask)`` and compares the output (B, L_q,
    d_model) and the gradients of the inputs and of the weights. Masks: (L, L), (B, L_q, L_k),
    (B, 1, 1, L_k) and (B, h, L_q, L_k).
    """
    return run_in_process(CHECKER, cls, verbose)
