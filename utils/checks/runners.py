"""The student side of the kinds of case that need more than a call: what the grader's child holds.

The grader's sandboxed child imports this module (with `training_runner` and its
`training_task`), `core` and nothing else of the checkers: no checker's reference, no planted
implementation, no expected value.
Each runner does what its kind of case needs with the student's object and returns raw tensors,
which the trusted side judges:

* "a5_module" (assignment 5): the student's module with the case's weights, through
  `torch.func.functional_call`;
* "decoder_mask" and "decoder_causality" (assignment 7): the layer's own causal mask, and the
  layer run on a target and on the same target with a tail changed;
* "mask_test" (assignment 3): the student's behaviour test run on implementations whose answers
  come from an oracle (`set_oracle`): in a notebook, the planted implementations themselves; in
  the grader's child, the grader's process, so that the child holds no trace of which
  implementation is right;
* "a9_lora" (assignment 9): a LoRA module built on a base layer of known weights, what it holds
  at the start, its output with known adapters, its merge and its output after the merge;
* "a8_train" (assignment 8): the model, ``train_step``, ``greedy_decode`` and the retraining,
  in `utils.checks.training_runner`, which this module imports (so that importing this module
  registers every runner).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from . import training_runner  # noqa: F401 (registers the "a8_train" runner)
from .core import (
    CaseTimeout,
    Spec,
    StudentError,
    _exception_text,
    _load_params,
    _resolve,
    build_module,
    register_runner,
)

A5_KIND = "a5_module"
MASK_KIND = "decoder_mask"
CAUSALITY_KIND = "decoder_causality"
MASK_TEST_KIND = "mask_test"
LORA_KIND = "a9_lora"


# --------------------------------------------------------------------------------------------
# Assignment 5: one runner for both modules



def _param_names(spec: Spec) -> list[str]:
    """The weights of a case: the tensors whose name is an attribute path (it has a dot)."""
    return [n for n in spec.tensors if "." in n]


def run_module(obj: Any, spec: Spec, inputs: dict[str, torch.Tensor]) -> Any:
    """Build ``obj(*ctor_args, **ctor_kwargs)``, call it on ``x`` with the case's weights.

    The weights (``inputs`` named by attribute path, ``w_up.weight``, ``experts.0.w_gate.weight``,
    ...) replace the module's parameters for the call, so autograd takes their gradients as it
    takes the input's. The module must have exactly these parameters. For the mixture of
    experts (``spec.outputs`` ends with ``routing``) the call must return ``(output, aux_loss)``
    and leave the chosen experts in ``module.last_routing``; they come back as float32 indices.
    """
    module = build_module(obj, spec)
    names = _param_names(spec)
    for first in dict.fromkeys(n.split(".")[0] for n in names):
        held = getattr(module, first, None)
        if isinstance(held, (list, tuple)):
            raise StudentError("type", f"`{first}` is a Python {type(held).__name__}: make it "
                                       "an nn.ModuleList, so that the weights of its modules "
                                       "are parameters of your module")
    for path in names:
        owner, last = _resolve(module, path)
        target = getattr(owner, last, None)
        want = tuple(spec.tensors[path].shape)
        if not isinstance(target, torch.Tensor):
            raise StudentError("load", f"your module has no tensor `{path}` (expected shape "
                                       f"{want})")
        if tuple(target.shape) != want:
            raise StudentError("load", f"`{path}` has shape {tuple(target.shape)}, expected "
                                       f"{want}")
    try:
        own = [n for n, _ in module.named_parameters()]
    except CaseTimeout:
        raise
    except BaseException as exc:
        raise StudentError("build", _exception_text(exc)) from None
    extra = [n for n in own if n not in names]
    if extra:
        listed = ", ".join(f"`{n}`" for n in extra[:3]) + (", ..." if len(extra) > 3 else "")
        note = (" (with bias=False, build every nn.Linear with bias=False)"
                if any(n.endswith(".bias") for n in extra) else "")
        raise StudentError("type", f"your module has parameters the assignment does not ask "
                                   f"for: {listed}{note}")
    module.train(spec.train)
    params = {n: inputs[n] for n in names}
    # What the call raises becomes StudentError("call", ...) in `core.exercise`, which calls
    # every runner in that one guard.
    got = torch.func.functional_call(module, params, (inputs["x"],), strict=False)
    if spec.outputs[-1] != "routing":
        return got
    if not (isinstance(got, (tuple, list)) and len(got) == 2):
        what = type(got).__name__ if not isinstance(got, (tuple, list)) else \
            f"a {type(got).__name__} of {len(got)}"
        raise StudentError("type", f"returned {'None' if got is None else what}, expected a "
                                   "tuple (output, aux_loss)")
    routing = getattr(module, "last_routing", None)
    if not isinstance(routing, torch.Tensor):
        raise StudentError("type", "after a forward pass, `self.last_routing` must hold the "
                                   "chosen experts as a tensor of shape (..., k); it is "
                                   f"{type(routing).__name__}")
    if routing.is_floating_point() or routing.is_complex() or routing.dtype == torch.bool:
        raise StudentError("type", "`self.last_routing` must hold expert indices as integers "
                                   f"(torch.long, as torch.topk returns them), not {routing.dtype}")
    return got[0], got[1], routing.detach().to(torch.float32)


register_runner(A5_KIND, run_module)


# --------------------------------------------------------------------------------------------
# Assignment 7: the decoder layer's own mask, and causality



def _mask_method(obj: Any) -> Any:
    fn = getattr(obj, "causal_mask", None)
    if not callable(fn):
        raise StudentError("type", "your DecoderLayer has no static method `causal_mask(length)`: "
                                   "the checker makes the causal mask with it")
    return fn


def _run_mask(obj: Any, spec: Spec, inputs: dict[str, torch.Tensor]) -> Any:
    """``DecoderLayer.causal_mask(L)``, as the student wrote it."""
    return _mask_method(obj)(*spec.literals)


def _run_causality(obj: Any, spec: Spec, inputs: dict[str, torch.Tensor]) -> Any:
    """The student's layer, with the student's causal mask, on ``x`` and on ``x_changed``.

    Returns both outputs; what they mean is decided on the trusted side.
    """
    module = build_module(obj, spec)
    _load_params(module, spec.params)
    module.train(spec.train)
    mask = _mask_method(obj)(inputs["x"].shape[1])
    kwargs = {k: inputs[n] for k, n in spec.kwargs.items()}
    first = module(inputs["x"], inputs["memory"], tgt_mask=mask, **kwargs)
    second = module(inputs["x_changed"], inputs["memory"], tgt_mask=mask, **kwargs)
    return first, second


register_runner(MASK_KIND, _run_mask)
register_runner(CAUSALITY_KIND, _run_causality)


# --------------------------------------------------------------------------------------------
# Assignment 3: the student's behaviour tests, run on implementations answered by an oracle

ERROR_BYTES = 200
Oracle = Callable[[str, int, tuple[Any, ...]], Any]
_oracle: list[Oracle | None] = [None]


def set_oracle(oracle: Oracle | None) -> None:
    """Where the implementations of a "mask_test" case get their answers: ``oracle(family, k,
    args)`` returns what implementation ``k`` returns for ``args`` (or raises what it raises).
    None (the default) answers with the planted implementations of `utils.checks.a3_mask_tests`,
    whose codes the case's ``spec.config["codes"]`` lists (in a notebook only)."""
    _oracle[0] = oracle


def _encode_error(text: str) -> torch.Tensor:
    data = text.encode("utf-8", "replace")[:ERROR_BYTES]
    out = torch.zeros(ERROR_BYTES, dtype=torch.uint8)
    if data:
        out[: len(data)] = torch.tensor(list(data), dtype=torch.uint8)
    return out


def _implementation(family: str, k: int, oracle: Oracle) -> Any:
    """Implementation ``k`` of ``family``: the same name and code for every k and every case."""
    if family == "causal":
        def causal_mask(length):  # noqa: ANN001, ANN202 (as a student would write it)
            return oracle("causal", k, (length,))
        return causal_mask

    def batch_mask(lengths, max_len):  # noqa: ANN001, ANN202
        return oracle("batch", k, (lengths, max_len))
    return batch_mask


def _local_oracle(spec: Spec) -> Oracle:
    codes = [int(c) for c in spec.config.get("codes", [])]

    def answer(family: str, k: int, args: tuple[Any, ...]) -> Any:
        from .a3_mask_tests import planted  # the notebook's process: the checker is here anyway
        return planted(family, codes[k])(*args)
    return answer


def run_mask_test(obj: Any, spec: Spec, inputs: dict[str, torch.Tensor]) -> Any:
    """Student side of a "mask_test" case: call the test on implementations 0..n-1 in turn.

    ``spec.literals`` is (family, n). Returns ``outcomes`` (0 = the test returned, 1 = it raised
    AssertionError, 2 = it raised something else) and ``errors``, each exception's text as
    bytes. Which implementation is right is known only where the oracle answers.
    """
    if not callable(obj):
        raise StudentError("type", f"expected a function, got {type(obj).__name__}")
    family, n = str(spec.literals[0]), int(spec.literals[1])
    oracle = _oracle[0] or _local_oracle(spec)
    outcomes = torch.zeros(n, dtype=torch.int64)
    errors = torch.zeros(n, ERROR_BYTES, dtype=torch.uint8)
    for k in range(n):
        try:
            obj(_implementation(family, k, oracle))
        except CaseTimeout:
            raise
        except NotImplementedError:
            raise StudentError("call", "NotImplementedError") from None
        except AssertionError as exc:
            outcomes[k] = 1
            errors[k] = _encode_error(f"AssertionError: {exc}" if str(exc) else "AssertionError")
        except BaseException as exc:  # noqa: BLE001 (a test that fails by crashing still fails)
            outcomes[k] = 2
            errors[k] = _encode_error(f"{type(exc).__name__}: {exc}")
    return outcomes, errors


register_runner(MASK_TEST_KIND, run_mask_test)


# --------------------------------------------------------------------------------------------
# Assignment 9: a LoRA layer


def _adapter(module: Any, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    held = getattr(module, name, None)
    if not isinstance(held, torch.nn.Parameter):
        what = type(held).__name__ if held is not None else "missing"
        raise StudentError("type", f"`{name}` must be an nn.Parameter of shape {shape} (the "
                                   f"assignment fixes its name and shape); it is {what}")
    if tuple(held.shape) != shape:
        raise StudentError("load", f"`{name}` has shape {tuple(held.shape)}, expected {shape}")
    return held


def run_lora(obj: Any, spec: Spec, inputs: dict[str, torch.Tensor]) -> Any:
    """Build ``obj(base, r, alpha)`` on an ``nn.Linear`` holding the case's weights.

    ``spec.literals`` is (in_features, out_features, bias, r, alpha). Returns the output with
    the case's ``lora_A`` and ``lora_B`` in place of the module's (through
    `torch.func.functional_call`, so that their gradients come back), which of ``base.weight``,
    ``base.bias``, ``lora_A``, ``lora_B`` require a gradient (as 0 or 1), ``lora_B`` and
    ``lora_A`` as the module made them, ``merge()``'s weight and bias (an empty tensor when it
    has none) after the case's adapters are copied in, the module's output after the merge,
    whether ``merge()`` returned the base layer itself (as 0 or 1) and the base layer's weight
    after the merge.
    """
    d_in, d_out, has_bias, r, alpha = spec.literals
    base = torch.nn.Linear(int(d_in), int(d_out), bias=bool(has_bias))
    with torch.no_grad():
        base.weight.copy_(inputs["base.weight"])
        if has_bias:
            base.bias.copy_(inputs["base.bias"])
    module = build_module(obj, dataclasses.replace(spec, ctor_args=[base, int(r), alpha]))
    a = _adapter(module, "lora_A", (int(r), int(d_in)))
    b = _adapter(module, "lora_B", (int(d_out), int(r)))
    if getattr(module, "base", None) is not base:
        raise StudentError("type", "your module must keep the layer it wraps as `self.base`")
    names = ["base.weight", "base.bias", "lora_A", "lora_B"] if has_bias else \
        ["base.weight", "lora_A", "lora_B"]
    own = [n for n, _ in module.named_parameters()]
    extra = [n for n in own if n not in names]
    if extra:
        listed = ", ".join(f"`{n}`" for n in extra[:3]) + (", ..." if len(extra) > 3 else "")
        raise StudentError("type", f"your module has parameters the assignment does not ask "
                                   f"for: {listed}")
    trainable = torch.tensor([float(base.weight.requires_grad),
                              float(has_bias and base.bias.requires_grad),
                              float(a.requires_grad), float(b.requires_grad)])
    init_a, init_b = a.detach().clone().float(), b.detach().clone().float()
    module.train(False)
    params = {n: inputs[n] for n in names}
    out = torch.func.functional_call(module, params, (inputs["x"],), strict=False)
    with torch.no_grad():
        a.copy_(inputs["lora_A"])
        b.copy_(inputs["lora_B"])
    merged = module.merge()
    if not isinstance(merged, torch.nn.Linear):
        raise StudentError("type", f"merge() returned {type(merged).__name__}, expected an "
                                   "nn.Linear")
    merged_bias = merged.bias.detach().clone() if merged.bias is not None else torch.zeros(0)
    merged_weight, base_after = merged.weight.detach().clone(), base.weight.detach().clone()
    with torch.no_grad():
        after = module(inputs["x"].detach())
    return (out, trainable, init_b, init_a, merged_weight, merged_bias, after,
            torch.tensor([float(merged is base)]), base_after)


register_runner(LORA_KIND, run_lora)
