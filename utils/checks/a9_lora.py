"""Assignment 9, part 2: the checker of ``LoRALinear(base, r, alpha)``.

The student wraps a frozen ``nn.Linear`` ``base`` with two trainable matrices, ``lora_A``
(r, in_features) and ``lora_B`` (out_features, r), B zero at the start and A not, and computes
``base(x) + x A^T B^T * (alpha / r)``; ``merge()`` returns one ``nn.Linear`` whose weight is
``W + (alpha / r) B A``. These are the semantics of `peft`'s LoRA layer (``LoraConfig(r,
lora_alpha)`` without dropout); the book's tests prove `lora_reference` equal to it.

The student side (`runners.run_lora`) builds the base layer from the case's weights, builds the
student's module on it, sends back what it holds at the start (``lora_A``, ``lora_B``, which
parameters train), calls it with the case's adapters in place of its own (so that their
gradients come back like the input's), merges it, and calls it once more after the merge.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from .checker import Case, Checker, Mistake, run_in_process
from .compare import ATOL, RTOL, allclose, fmt, max_diff
from .core import Spec
from .results import CheckResult
from .runners import LORA_KIND

__all__ = ["LORA_CHECKER", "check_lora_linear", "lora_reference", "B_NOT_ZERO", "A_ZERO",
           "INIT_SWAPPED", "BASE_NOT_FROZEN", "MERGE_NO_BIAS", "MERGE_EXTRA_BIAS",
           "MERGE_IN_PLACE", "MERGE_RETURNS_BASE"]

B_NOT_ZERO = ("lora_B is not initialised to zero: at the start the adapted layer must compute "
              "exactly what the base layer computes (x A^T B^T = 0 when B = 0), so that "
              "fine-tuning starts from the pretrained model")
A_ZERO = ("lora_A is initialised to zero as well as lora_B: with A = B = 0 the gradient of B "
          "(which needs x A^T) and that of A (which needs B) are both 0, so neither ever moves; "
          "draw A at random (peft: nn.init.kaiming_uniform_(A, a=math.sqrt(5)))")
BASE_NOT_FROZEN = ("the base layer is not frozen: set requires_grad to False on its weight and "
                   "bias, so that only lora_A and lora_B train")
MERGE_NO_BIAS = "merge() drops the base layer's bias: the merged nn.Linear keeps it"
MERGE_EXTRA_BIAS = ("merge() gives the merged layer a bias that the base layer does not have "
                    "(nn.Linear draws one at random): build it with bias=False, or zero it")
MERGE_IN_PLACE = ("merge() changes the base layer in place, so that the LoRA module itself now "
                  "adds the update twice: build a new nn.Linear (or copy the weight) and leave "
                  "the module as it was")
MERGE_RETURNS_BASE = ("merge() changes the base layer in place (or returns the base layer "
                      "itself): build a new nn.Linear (or copy the weight) and leave the module "
                      "as it was")
INIT_SWAPPED = ("the initialisations of A and B are swapped: B (out_features, r) starts at zero "
                "and A (r, in_features) at random")


def _scaling(alpha: float, r: int, scale: str) -> float:
    return {"alpha_over_r": alpha / r, "one": 1.0, "r_over_alpha": r / alpha,
            "floor": float(alpha // r), "alpha": alpha}[scale]


def lora_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   lora_a: torch.Tensor, lora_b: torch.Tensor, r: int, alpha: float, *,
                   scale: str = "alpha_over_r", base: bool = True, merge: str = "right",
                   ) -> dict[str, torch.Tensor]:
    """The LoRA layer's output, its merged weight and bias, and its output after the merge.

    ``output = x W^T + b + (alpha / r) x A^T B^T``; merged weight ``W + (alpha / r) B A``.
    Switches reproduce mistakes: ``scale`` ("alpha_over_r", "one", "r_over_alpha", "floor":
    alpha // r, "alpha"), ``base`` (False: the base layer's output left out), ``merge``
    ("right", "transposed": (B A)^T added, "unscaled", "none": W returned as it is, "no_bias",
    "in_place": the base layer's weight overwritten by the merge and returned, so the module's
    output after it counts the update twice).
    """
    s = _scaling(alpha, r, scale)
    update = x @ lora_a.T @ lora_b.T * s
    out = F.linear(x, weight, bias) + update if base else update
    delta = lora_b @ lora_a
    if merge == "transposed":
        merged = weight + s * delta.T  # only where B A is square
    else:
        merged = {"unscaled": weight + delta, "none": weight}.get(merge, weight + s * delta)
    merged_bias = bias if bias is not None and merge != "no_bias" else weight.new_zeros(0)
    in_place = merge == "in_place"
    after = F.linear(x, merged, bias) + update if in_place else out
    return {"output": out, "merged_weight": merged, "merged_bias": merged_bias,
            "after_merge": after, "merged_is_base": weight.new_tensor([float(in_place)]),
            "base_after_merge": merged if in_place else weight}


class LoRAChecker(Checker):
    """The checker of ``LoRALinear``."""

    name = "check_lora_linear"
    target = "LoRALinear"
    what = "your module"
    weights_are_inputs = True
    shape_desc = {"output": "(..., out_features)", "merged_weight": "(out_features, in_features)",
                  "merged_bias": "(out_features,)", "trainable": "(4,)"}
    mistakes = (
        Mistake("the LoRA update is not scaled: multiply x A^T B^T by scaling = alpha / r",
                {"scale": "one"}),
        Mistake("the update is scaled by r / alpha: the scaling is alpha / r",
                {"scale": "r_over_alpha"}),
        Mistake("the scaling is alpha // r, an integer division: use alpha / r (with alpha = 10 "
                "and r = 4 it is 2.5, not 2)", {"scale": "floor"}),
        Mistake("the update is scaled by alpha: divide it by r as well, scaling = alpha / r",
                {"scale": "alpha"}),
        Mistake("the base layer's output is missing: the forward is base(x) + x A^T B^T * "
                "scaling", {"base": False}),
        Mistake("merge() adds (B A)^T: the update of the weight (out_features, in_features) is "
                "scaling * B @ A", {"merge": "transposed"}),
        Mistake("merge() adds B @ A without the scaling: W + (alpha / r) B A",
                {"merge": "unscaled"}),
        Mistake("merge() returns the base layer's weight unchanged: add scaling * B @ A to it",
                {"merge": "none"}),
        Mistake(MERGE_NO_BIAS, {"merge": "no_bias"}),
        Mistake(MERGE_IN_PLACE, {"merge": "in_place"}),
        Mistake(BASE_NOT_FROZEN, {"frozen": "none"}),
        Mistake("lora_A and lora_B do not require gradients: they are the trainable parameters",
                {"frozen": "all"}),
    )

    def forward(self, spec: Spec, x: dict[str, torch.Tensor], p: dict[str, torch.Tensor],
                **options: Any) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        _, _, has_bias, r, alpha = spec.literals
        frozen = options.pop("frozen", "base")
        outs = lora_reference(x["x"], x["base.weight"], x.get("base.bias"), x["lora_A"],
                              x["lora_B"], int(r), float(alpha), **options)
        flags = {"base": [0.0, 0.0, 1.0, 1.0], "none": [1.0, 1.0, 1.0, 1.0],
                 "all": [0.0, 0.0, 0.0, 0.0]}[frozen]
        if not has_bias:
            flags[1] = 0.0
        outs["trainable"] = torch.tensor(flags, dtype=torch.float64)
        outs["init_B"] = torch.zeros_like(x["lora_B"])
        outs["init_A"] = torch.zeros_like(x["lora_A"])  # judged apart: random, not zero
        return {k: outs[k] for k in spec.outputs}, {}

    def _judge_output(self, spec: Spec, raw: dict[str, Any], ref: dict[str, torch.Tensor],
                      name: str) -> str | None:
        tensors = raw["tensors"]
        if name == "init_B":
            got, a = tensors["out:init_B"], tensors["out:init_A"]
            if not torch.equal(got, torch.zeros_like(got)):
                return INIT_SWAPPED if not a.any() else B_NOT_ZERO
            return None
        if name == "init_A":
            got = tensors["out:init_A"]
            if not torch.isfinite(got).all():
                return "lora_A holds NaN or inf at the start: draw it from a finite distribution"
            return None if got.any() else A_ZERO
        if name == "trainable" and tuple(tensors["out:trainable"].shape) == (4,):
            got, want = tensors["out:trainable"], ref["out:trainable"]
            if not allclose(got, want, 0.0, 0.0) and allclose(got[2:], want[2:], 0.0, 0.0):
                return BASE_NOT_FROZEN  # the weight, the bias or both train
        if name in ("merged_is_base", "base_after_merge") and tuple(
                tensors[f"out:{name}"].shape) == tuple(ref[f"out:{name}"].shape):
            # Whatever the module computes after it (peft's merged flag), merge() leaves the
            # base layer as it was and returns a layer of its own.
            same = allclose(tensors[f"out:{name}"], ref[f"out:{name}"], ATOL, RTOL)
            return None if same else MERGE_RETURNS_BASE
        if name == "merged_bias":
            got, want = tensors["out:merged_bias"], ref["out:merged_bias"]
            if got.numel() == 0 and want.numel():
                return MERGE_NO_BIAS
            if want.numel() == 0 and got.numel():
                return None if got.dim() == 1 and not got.any() else MERGE_EXTRA_BIAS
        got, want = tensors[f"out:{name}"], ref[f"out:{name}"]
        if name == "output" or tuple(got.shape) != tuple(want.shape) or allclose(
                got, want, ATOL, RTOL):
            return super()._judge_output(spec, raw, ref, name)
        # The output is right: only the mistakes that leave it so can explain the rest.
        for m in self.all_mistakes():
            if m.grad_only or {"scale", "base"} & set(m.options):
                continue
            try:
                cand = self.evaluate(spec, grads=False, **m.options)[f"out:{name}"]
            except Exception:  # a variant that cannot run on this case cannot match
                continue
            if allclose(got, cand, ATOL, RTOL, equal_nan=True):
                return m.hint
        return (f"the {name} differs from the reference (max |diff| = "
                f"{fmt(max_diff(got, want))}) and matches none of the known mistakes; "
                f"{self.localize(spec, tensors, ref, name)}")

    def localize(self, spec: Spec, tensors: dict[str, torch.Tensor],
                 ref: dict[str, torch.Tensor], name: str) -> str:
        if name == "output":
            return "compare your forward with base(x) + x A^T B^T * alpha / r step by step"
        return "compare merge() with W + (alpha / r) B @ A step by step"


def _lora_case(d_in: int, d_out: int, bias: bool, r: int, alpha: float,
               lead: tuple[int, ...]) -> Callable[[torch.Generator], Spec]:
    def make(gen: torch.Generator) -> Spec:
        tensors = {"x": torch.randn(*lead, d_in, generator=gen),
                   "base.weight": torch.randn(d_out, d_in, generator=gen) / d_in**0.5,
                   "lora_A": torch.randn(r, d_in, generator=gen) / d_in**0.5,
                   "lora_B": torch.randn(d_out, r, generator=gen) / r**0.5}
        if bias:
            tensors["base.bias"] = 0.3 * torch.randn(d_out, generator=gen)
        return Spec(LORA_KIND, tensors, ["x"], literals=[d_in, d_out, bias, r, alpha],
                    outputs=["output", "trainable", "init_B", "init_A", "merged_weight",
                             "merged_bias", "after_merge", "merged_is_base", "base_after_merge"],
                    grad_out={"output": torch.randn(*lead, d_out, generator=gen)},
                    grad_inputs=["x", "lora_A", "lora_B"])
    return make


# Points per case: the one place where this part's points are declared.
LORA_CHECKER = LoRAChecker([
    Case("basic", "in 8, out 6, r = 2, alpha = 4, with a bias, x (2, 5, 8)",
         _lora_case(8, 6, True, 2, 4.0, (2, 5)), points=2),
    Case("no_bias", "in 12, out 5, r = 4, alpha = 10 (scaling 2.5), no bias, x (3, 12)",
         _lora_case(12, 5, False, 4, 10.0, (3,)), points=2),
    Case("square", "in = out = 8, r = 3, alpha = 12, with a bias, x (2, 4, 8)",
         _lora_case(8, 8, True, 3, 12.0, (2, 4))),
    Case("rank_one", "r = 1, alpha = 2, in 10, out 7, with a bias, x (7, 10)",
         _lora_case(10, 7, True, 1, 2.0, (7,))),
])


def check_lora_linear(cls: Any, verbose: bool = True) -> CheckResult:
    """Check a LoRA class ``cls(base, r, alpha)`` against the reference.

    The checker wraps an ``nn.Linear`` of known weights, checks that only ``lora_A`` and
    ``lora_B`` train and that the module starts as the base layer (B = 0, A random), then
    puts known adapters in and compares the output, the gradients of the input and of both
    adapters, ``merge()``'s weight and bias, and the module's output after the merge, with
    base(x) + x A^T B^T * alpha / r computed in float64.
    """
    return run_in_process(LORA_CHECKER, cls, verbose)
