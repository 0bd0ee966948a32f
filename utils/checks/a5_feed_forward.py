"""Assignment 5: feed-forward variants, a SwiGLU network and a top-k mixture of experts.

The student writes

* ``SwiGLUFeedForward(d_model, d_ff, bias=False)`` with the linears ``w_gate``, ``w_up`` and
  ``w_down``: ``out = w_down(SiLU(w_gate(x)) * w_up(x))``;
* ``TopKMoE(d_model, d_ff, num_experts, k)`` with a linear ``router`` (no bias) and a
  ``nn.ModuleList`` ``experts`` of ``SwiGLUFeedForward(d_model, d_ff)``. Its forward returns
  ``(output, aux_loss)`` and keeps the chosen experts in ``self.last_routing`` (..., k), from the
  most probable down. The weights are the softmax over all experts, restricted to the top k and
  renormalized to sum to 1 (Mixtral); ``aux_loss = E * sum_i f_i P_i`` with ``f_i`` the fraction
  of the k N routing assignments that go to expert i and ``P_i`` the mean router probability of
  expert i over the N tokens (the Switch Transformer's loss, extended to k assignments a token).

Both checkers run their cases through one student-side runner (`run_module`): it builds the
module, calls it with the case's weights in place of its parameters
(``torch.func.functional_call``), so that the weights are inputs of the call and their gradients
come back like the input's, and reads ``last_routing`` after the call.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from .checker import Case, Checker, Mistake, run_in_process
from .compare import allclose
from .core import Spec
from .guard import Assignment, Rule
from .results import CheckResult
from .runners import A5_KIND as KIND

__all__ = ["check_swiglu_feed_forward", "check_top_k_moe", "FFN_CHECKER", "MOE_CHECKER",
           "ASSIGNMENT", "swiglu_ffn", "top_k_moe", "KIND"]


_ACTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu, "gelu": F.gelu, "relu": F.relu, "sigmoid": torch.sigmoid,
    "none": lambda t: t,
}


# --------------------------------------------------------------------------------------------
# The references, in float64, with switches that reproduce mistakes


def swiglu_ffn(p: dict[str, torch.Tensor], x: torch.Tensor, prefix: str = "", *,
               act: str = "silu", swap: bool = False, form: str = "gated",
               act_out: bool = False) -> torch.Tensor:
    """W_down(SiLU(x W_gate) * (x W_up)) with the weights ``p[prefix + "w_gate.weight"]``, ...

    Biases are used when ``p`` holds them. ``act`` replaces SiLU, ``swap`` exchanges the two
    paths, ``form`` changes how they are combined ("gated", "no_up", "no_gate", "add", "both",
    "product"), ``act_out`` adds the activation after ``w_down``.
    """
    def lin(name: str, y: torch.Tensor) -> torch.Tensor:
        return F.linear(y, p[f"{prefix}{name}.weight"], p.get(f"{prefix}{name}.bias"))

    a = _ACTS[act]
    g, u = lin("w_gate", x), lin("w_up", x)
    if swap:
        g, u = u, g
    if form == "gated":
        h = a(g) * u
    elif form == "no_up":
        h = a(g)
    elif form == "no_gate":
        h = a(u)
    elif form == "add":
        h = a(g) + u
    elif form == "both":
        h = a(g) * a(u)
    elif form == "product":
        h = a(g * u)
    else:
        raise ValueError(f"unknown form {form!r}")
    out = lin("w_down", h)
    return a(out) if act_out else out


def top_k_moe(p: dict[str, torch.Tensor], x: torch.Tensor, num_experts: int, k: int, *,
              softmax_dim: str = "experts", weights: str = "renormalized",
              combine: str = "sum", aux_scale: bool = True, aux_p: str = "probs",
              aux_f: str = "assignments", aux_f_norm: str = "kN", aux_detached: bool = False,
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A top-k mixture of SwiGLU experts: (output (..., d), aux_loss (), routing (..., k)).

    Switches reproduce mistakes: ``softmax_dim`` ("experts", "positions": over the axis before
    the experts, "all_tokens": over every token), ``weights`` ("renormalized", "raw": the top-k
    probabilities as they are, "logits", "ones"), ``combine`` ("sum", "dense": every expert
    weighted by its full probability, "overwrite": only the highest-numbered of a token's
    experts counts, "capacity": at most ceil(k N / E) assignments an expert, in token order),
    and for the load-balancing loss ``aux_scale`` (the factor E), ``aux_p`` ("probs",
    "weights": the renormalized top-k weights), ``aux_f`` ("assignments", "top1", "soft":
    the probabilities), ``aux_f_norm`` ("kN", "N") and ``aux_detached``.
    """
    lead, d = x.shape[:-1], x.shape[-1]
    flat = x.reshape(-1, d)
    n = flat.shape[0]
    logits = flat @ p["router.weight"].T                                   # (N, E)
    if softmax_dim == "experts":
        probs = torch.softmax(logits, dim=-1)
    elif softmax_dim == "positions":
        probs = torch.softmax(logits.reshape(*lead, num_experts), dim=-2).reshape(n, -1)
    elif softmax_dim == "all_tokens":
        probs = torch.softmax(logits, dim=0)
    else:
        raise ValueError(f"unknown softmax_dim {softmax_dim!r}")
    top_p, top_i = probs.topk(k, dim=-1)                                   # (N, k)
    if weights == "renormalized":
        w = top_p / top_p.sum(dim=-1, keepdim=True)
    elif weights == "raw":
        w = top_p
    elif weights == "logits":
        w = logits.gather(-1, top_i)
    elif weights == "ones":
        w = torch.ones_like(top_p)
    else:
        raise ValueError(f"unknown weights {weights!r}")
    assigned = torch.zeros(n, num_experts, dtype=torch.bool).scatter(1, top_i, True)
    gates = torch.zeros_like(probs).scatter(1, top_i, w)                   # (N, E)
    if combine == "dense":
        gates = probs
    elif combine == "overwrite":
        last = F.one_hot(top_i.max(dim=-1).values, num_experts).bool()
        gates = gates * last
    elif combine == "capacity":
        cap = math.ceil(k * n / num_experts)
        gates = gates * (assigned & (assigned.long().cumsum(0) <= cap))
    elif combine != "sum":
        raise ValueError(f"unknown combine {combine!r}")
    out = torch.zeros_like(flat)
    for e in range(num_experts):
        out = out + gates[:, e:e + 1] * swiglu_ffn(p, flat, f"experts.{e}.")
    if aux_f == "assignments":
        counts, per = assigned.sum(0).to(probs.dtype), k
    elif aux_f == "top1":
        counts, per = F.one_hot(top_i[:, 0], num_experts).sum(0).to(probs.dtype), 1
    else:
        counts, per = None, 1
    if counts is None:  # "soft": the mean probabilities in place of the fraction of tokens
        f = probs.mean(0)
    else:
        f = counts / (per * n if aux_f_norm == "kN" else n)
    big_p = probs.mean(0) if aux_p == "probs" else gates.mean(0)
    aux = (num_experts if aux_scale else 1) * (f * big_p).sum()
    if aux_detached:
        aux = aux.detach()
    return out.reshape(x.shape), aux, top_i.reshape(*lead, k).to(x.dtype)


# --------------------------------------------------------------------------------------------
# The checkers


class FeedForwardChecker(Checker):
    """The checker of ``SwiGLUFeedForward``."""

    name = "check_swiglu_feed_forward"
    target = "SwiGLUFeedForward"
    what = "your module"
    shape_desc = {"output": "(..., d_model)"}
    weights_are_inputs = True
    mistakes = (
        Mistake("GELU instead of SiLU: SwiGLU gates with SiLU(z) = z sigmoid(z) (with GELU it "
                "would be GEGLU)", {"act": "gelu"}),
        Mistake("ReLU instead of SiLU: SwiGLU gates with SiLU(z) = z sigmoid(z) (with ReLU it "
                "would be ReGLU)", {"act": "relu"}),
        Mistake("the gate is sigmoid(x W_gate), the original GLU: SwiGLU uses SiLU(z) = "
                "z sigmoid(z)", {"act": "sigmoid"}),
        Mistake("no nonlinearity on the gate: (x W_gate) * (x W_up) is the bilinear variant; "
                "apply SiLU to x W_gate", {"act": "none"}),
        Mistake("w_gate and w_up swapped: SiLU goes on x W_gate, and x W_up is the linear path "
                "that the gate multiplies", {"swap": True}),
        Mistake("the linear path is missing: multiply SiLU(x W_gate), element by element, by "
                "x W_up before w_down", {"form": "no_up"}),
        Mistake("the gate is missing: W_down(SiLU(x W_up)) is an ungated feed-forward network; "
                "SwiGLU multiplies SiLU(x W_gate) by x W_up", {"form": "no_gate"}),
        Mistake("the two paths are added: the gate multiplies them, SiLU(x W_gate) * (x W_up)",
                {"form": "add"}),
        Mistake("SiLU on both paths: only x W_gate goes through SiLU, x W_up stays linear",
                {"form": "both"}),
        Mistake("SiLU applied to the product of the two paths: it applies to x W_gate alone, "
                "SiLU(x W_gate) * (x W_up)", {"form": "product"}),
        Mistake("an activation after w_down: the output is W_down(h), with nothing after it",
                {"act_out": True}),
    )

    def forward(self, spec: Spec, x: dict[str, torch.Tensor], p: dict[str, torch.Tensor],
                **options: Any) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        return {"output": swiglu_ffn(x, x["x"], **options)}, {}


class MoEChecker(Checker):
    """The checker of ``TopKMoE``."""

    name = "check_top_k_moe"
    target = "TopKMoE"
    what = "your module"
    shape_desc = {"output": "(..., d_model)", "aux_loss": "()", "routing": "(..., k)"}
    weights_are_inputs = True
    mistakes = (
        Mistake("the top-k probabilities are not renormalized: divide them by their sum so that "
                "each token's k weights add up to 1, as Mixtral does (with k = 1 the weight is "
                "then exactly 1; the Switch Transformer and chapter 6 keep p instead, this "
                "assignment does not)", {"weights": "raw"}),
        *(Mistake("the softmax runs over the tokens, not over the experts: take it over the "
                  "last axis of the router's logits, (..., num_experts)", {"softmax_dim": dim})
          for dim in ("positions", "all_tokens")),
        Mistake("the router's raw logits are used as weights: turn them into probabilities with "
                "a softmax over the experts, then keep the top k and renormalize",
                {"weights": "logits"}),
        Mistake("the router weights are not applied: multiply each expert's output by the "
                "token's renormalized router probability for that expert before adding the "
                "outputs up", {"weights": "ones"}),
        Mistake("every expert runs on every token, weighted by the full softmax (a dense "
                "mixture): send each token to its top-k experts only", {"combine": "dense"}),
        Mistake("a token's expert outputs overwrite each other instead of adding up (out[rows] "
                "= ... where out[rows] += ... or index_add is needed): with k = 2 each token "
                "sums the weighted outputs of two experts", {"combine": "overwrite"}),
        Mistake("some tokens lose an expert's output, as under a capacity limit (each expert "
                "taking at most ceil(k N / E) assignments): this layer has no capacity limit "
                "and drops no token", {"combine": "capacity"}),
        Mistake("the load-balancing loss lacks its factor num_experts: E * sum_i f_i P_i, which "
                "is 1 for a uniform routing", {"aux_scale": False}),
        Mistake("P_i is computed from the renormalized top-k weights: it is the mean, over all "
                "tokens, of the full softmax probability of expert i", {"aux_p": "weights"}),
        Mistake("f_i counts only each token's first choice: count all k assignments of every "
                "token, f_i = (assignments to expert i) / (k N)", {"aux_f": "top1"}),
        Mistake("f_i is divided by N, so the f_i add up to k: divide the count by k N so that "
                "they add up to 1 (the Hugging Face Mixtral code divides by N, which scales the "
                "loss by k; this assignment does not)", {"aux_f_norm": "N"}),
        Mistake("f_i is computed from the router probabilities (the loss became E * sum_i "
                "P_i^2): f_i is the fraction of the routing assignments that go to expert i, a "
                "count", {"aux_f": "soft"}),
        Mistake("the load-balancing loss is detached from the router: its gradient must reach "
                "router.weight through P_i (only f_i, a count, carries none)",
                {"aux_detached": True}, grad_only=True),
    )

    def forward(self, spec: Spec, x: dict[str, torch.Tensor], p: dict[str, torch.Tensor],
                **options: Any) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        _, _, num_experts, k = spec.ctor_args
        out, aux, routing = top_k_moe(x, x["x"], num_experts, k, **options)
        return {"output": out, "aux_loss": aux, "routing": routing}, {}

    def _judge_output(self, spec: Spec, raw: dict[str, Any], ref: dict[str, torch.Tensor],
                      name: str) -> str | None:
        if name == "routing":
            got, want = raw["tensors"]["out:routing"], ref["out:routing"]
            if tuple(got.shape) == tuple(want.shape) and not allclose(got, want, 0.0, 0.0) \
                    and torch.equal(got.sort(-1).values, want.sort(-1).values):
                return ("`last_routing` holds the right experts but not in order: list each "
                        "token's experts from the most probable down, as torch.topk does")
        return super()._judge_output(spec, raw, ref, name)

    def localize(self, spec: Spec, tensors: dict[str, torch.Tensor],
                 ref: dict[str, torch.Tensor], name: str) -> str:
        if name == "output" and "out:routing" in tensors and allclose(
                tensors["out:routing"], ref["out:routing"], 0.0, 0.0):
            return ("`last_routing` is right, so look at how the experts' outputs are weighted "
                    "and added up, and at your SwiGLUFeedForward, which the experts are (does it "
                    "pass its own check?)")
        if name == "aux_loss":
            return "compare your loss with E * sum_i f_i P_i step by step"
        return "compare your code with the routing rule step by step"


# --------------------------------------------------------------------------------------------
# The cases


def _linear(gen: torch.Generator, d_out: int, d_in: int) -> torch.Tensor:
    return torch.randn(d_out, d_in, generator=gen) / d_in**0.5


def _ffn_params(gen: torch.Generator, d: int, d_ff: int, bias: bool,
                prefix: str = "") -> dict[str, torch.Tensor]:
    out = {}
    for name, (d_out, d_in) in (("w_gate", (d_ff, d)), ("w_up", (d_ff, d)),
                                ("w_down", (d, d_ff))):
        out[f"{prefix}{name}.weight"] = _linear(gen, d_out, d_in)
        if bias:
            out[f"{prefix}{name}.bias"] = 0.3 * torch.randn(d_out, generator=gen)
    return out


def _ffn_case(lead: tuple[int, ...], d: int, d_ff: int, bias: bool) -> Any:
    def make(gen: torch.Generator) -> Spec:
        tensors = {"x": torch.randn(*lead, d, generator=gen)}
        tensors.update(_ffn_params(gen, d, d_ff, bias))
        return Spec(KIND, tensors, ["x"], ctor_args=[d, d_ff], ctor_kwargs={"bias": bias},
                    grad_out={"output": torch.randn(*lead, d, generator=gen)},
                    grad_inputs=list(tensors))
    return make


MARGIN = 0.1
"""The smallest gap between a token's k + 1 largest router logits in the MoE cases."""


def _separated(x: torch.Tensor, w: torch.Tensor, k: int) -> torch.Tensor:
    """(N,) True where the k + 1 largest logits of a row of x are MARGIN apart or more."""
    top = (x.double() @ w.double().T).topk(k + 1, dim=-1).values
    return (top[:, :-1] - top[:, 1:]).min(dim=-1).values >= MARGIN


def _moe_case(lead: tuple[int, ...], d: int, d_ff: int, num_experts: int, k: int) -> Any:
    def make(gen: torch.Generator) -> Spec:
        router = 2.0 * _linear(gen, num_experts, d)
        flat = torch.randn(math.prod(lead), d, generator=gen)
        for _ in range(1000):  # redraw the tokens whose top k + 1 logits are close: no ties
            bad = ~_separated(flat, router, min(k, num_experts - 1))
            if not bad.any():
                break
            flat[bad] = torch.randn(int(bad.sum()), d, generator=gen)
        tensors = {"x": flat.reshape(*lead, d), "router.weight": router}
        for e in range(num_experts):
            tensors.update(_ffn_params(gen, d, d_ff, False, f"experts.{e}."))
        return Spec(KIND, tensors, ["x"], ctor_args=[d, d_ff, num_experts, k],
                    outputs=["output", "aux_loss", "routing"],
                    grad_out={"output": torch.randn(*lead, d, generator=gen),
                              "aux_loss": torch.randn((), generator=gen)},
                    grad_inputs=list(tensors))
    return make


# Points per case: the one place where this assignment's points are declared.
FFN_CHECKER = FeedForwardChecker([
    Case("small", "x (2, 5, 8), d_ff = 12, no biases", _ffn_case((2, 5), 8, 12, False),
         points=2),
    Case("wide", "x (3, 4, 16), d_ff = 40, no biases", _ffn_case((3, 4), 16, 40, False),
         points=1),
    Case("tokens", "x (7, 8), a matrix of tokens, d_ff = 20", _ffn_case((7,), 8, 20, False),
         points=1),
    Case("bias", "bias=True: every linear has a bias, x (2, 3, 8), d_ff = 16",
         _ffn_case((2, 3), 8, 16, True), points=1),
])

MOE_CHECKER = MoEChecker([
    Case("top1", "k = 1, 4 experts, x (2, 6, 8)", _moe_case((2, 6), 8, 12, 4, 1), points=2),
    Case("top2", "k = 2, 4 experts, x (2, 6, 8)", _moe_case((2, 6), 8, 12, 4, 2), points=3),
    Case("top2_six", "k = 2, 6 experts, x (3, 8, 8)", _moe_case((3, 8), 8, 12, 6, 2),
         points=2),
    Case("tokens", "k = 2, 3 experts, x (10, 8), a matrix of tokens",
         _moe_case((10,), 8, 12, 3, 2), points=1),
    Case("idle_experts", "k = 2, 8 experts and 3 tokens: some experts get no token",
         _moe_case((1, 3), 8, 12, 8, 2), points=1),
])

_FORBIDDEN_UTILS = (
    ("utils.layers", "imports utils.layers, the book's reference feed-forward networks "
                     "(PositionwiseFeedForward with SwiGLU, MixtureOfExperts)"),
    ("utils.transformer", "imports utils.transformer, which holds the reference feed-forward "
                          "network"),
    ("utils.transformer_layers", "imports utils.transformer_layers, which holds the reference "
                                 "feed-forward network"),
    ("utils.models", "imports utils.models, which holds the reference feed-forward network"),
)

ASSIGNMENT = Assignment(
    name="a5_feed_forward",
    checkers=[FFN_CHECKER, MOE_CHECKER],
    rules=[
        *(Rule("module", target, reason) for target, reason in _FORBIDDEN_UTILS),
        Rule("code", __name__, "uses the checker's own reference SwiGLU network",
             qualname="swiglu_ffn"),
        Rule("code", __name__, "uses the checker's own reference mixture of experts",
             qualname="top_k_moe"),
    ],
)


def check_swiglu_feed_forward(cls: Any, verbose: bool = True) -> CheckResult:
    """Check a SwiGLU feed-forward class against the reference.

    The checker builds ``cls(d_model, d_ff, bias=...)``, calls it with known weights in
    ``w_gate``, ``w_up`` and ``w_down`` (``weight``, and ``bias`` when bias=True) on inputs of
    shape (..., d_model), and compares the output and the gradients of the input and of every
    weight with W_down(SiLU(x W_gate) * (x W_up)) computed in float64.
    """
    return run_in_process(FFN_CHECKER, cls, verbose)


def check_top_k_moe(cls: Any, verbose: bool = True) -> CheckResult:
    """Check a top-k mixture-of-experts class against the reference.

    The checker builds ``cls(d_model, d_ff, num_experts, k)``, calls it with known weights in
    ``router`` and ``experts[e].w_gate``, ``w_up``, ``w_down`` on inputs of shape (..., d_model)
    whose top k + 1 router logits are at least 0.1 apart (no ties), and compares the output,
    the load-balancing loss, ``last_routing`` and the gradients of the input and of every
    weight, through both the output and the loss.
    """
    return run_in_process(MOE_CHECKER, cls, verbose)
