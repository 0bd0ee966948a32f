"""The student side of the kinds of case that need more than a call: what the grader's child holds.

The grader's sandboxed child imports this module, `core` and nothing else of `utils.checks`: no
checker's reference, no planted implementation, no expected value. Each runner does what its kind
of case needs with the student's object and returns raw tensors, which the trusted side judges:

* "a5_module" (assignment 5): the student's module with the case's weights, through
  `torch.func.functional_call`;
* "decoder_mask" and "decoder_causality" (assignment 7): the layer's own causal mask, and the
  layer run on a target and on the same target with a tail changed;
* "mask_test" (assignment 3): the student's behaviour test run on implementations whose answers
  come from an oracle (`set_oracle`): in a notebook, the planted implementations themselves; in
  the grader's child, the grader's process, so that the child holds no trace of which
  implementation is right;
* "a8_train" (assignment 8): the model, ``train_step``, ``greedy_decode`` and the retraining.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..data import BOS, EOS, PAD, ReversalTask
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
A8_KIND = "a8_train"

TASK_ARGS = {"min_len": 3, "max_len": 8, "num_symbols": 8}
"""The task of assignment 8: ``ReversalTask(**TASK_ARGS)`` (the notebook's ``TASK``)."""
VOCAB = len(ReversalTask(**TASK_ARGS).vocab)  # 11: three specials and eight symbols
DECODE_LEN = TASK_ARGS["max_len"] + 2  # room for the answer, <eos> and one token to spare
STALE = 1.0e4  # the stale gradient left in .grad before train_step runs


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
    try:
        got = torch.func.functional_call(module, params, (inputs["x"],), strict=False)
    except CaseTimeout:
        raise
    except StudentError:
        raise
    except BaseException as exc:
        raise StudentError("call", _exception_text(exc)) from None
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
    None (the default) answers with the planted implementations of `utils.checks.a3_masks`,
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
        from .a3_masks import planted  # the notebook's process: the checker is here anyway
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
# Assignment 8


@dataclass
class Submission:
    """The four functions of a submission, as `check_training` receives them in a notebook."""

    build_model: Any
    train_step: Any
    greedy_decode: Any
    train: Any


# --------------------------------------------------------------------------------------------
# The scripted model of the decoding cases: its greedy tokens are known in advance


def scripted_next(src: torch.Tensor, src_mask: torch.Tensor | None, prev: torch.Tensor,
                  t: int, training: bool) -> torch.Tensor:
    """The scripted model's next token after ``prev`` (B,) at decoder position ``t``.

    A row's "key" sums its source tokens, weighted by position, over the positions its mask
    keeps (all of them without a mask, padding included, so a missing mask changes the key).
    Row b says ``<eos>`` at position ``src[b, 0] - 3``; training mode (dropout on) shifts every
    other token by one.
    """
    keep = torch.ones_like(src, dtype=torch.bool) if src_mask is None else src_mask
    pos = torch.arange(1, src.shape[1] + 1)
    key = ((src + 1) * pos * keep).sum(dim=1)
    tok = 3 + (key * 7 + prev * 5 + 3 * t + int(training)) % (VOCAB - 3)
    return torch.where(src[:, 0] - 3 == t, torch.full_like(tok, EOS), tok)


def _as_mask(mask: Any, shape: tuple[int, ...]) -> torch.Tensor | None:
    """A student's source mask as (B, L_s) bool, or None when it is not one."""
    if not isinstance(mask, torch.Tensor) or mask.numel() != math.prod(shape):
        return None
    return mask.reshape(shape).bool()


class ScriptedModel(nn.Module):
    """A stand-in for a trained model: ``model(src, tgt, src_mask, tgt_mask)`` -> logits whose
    argmax at position t is `scripted_next` of ``tgt[:, t]``. It records each call: training
    mode, whether a source mask came, grad mode and the decoder input's length."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))
        self.log: list[list[int]] = []

    def forward(self, src: torch.Tensor, tgt: torch.Tensor, src_mask: Any = None,
                tgt_mask: Any = None, memory_mask: Any = None) -> torch.Tensor:
        mask = _as_mask(src_mask, tuple(src.shape))
        self.log.append([int(self.training), int(mask is not None), int(torch.is_grad_enabled()),
                         int(tgt.shape[1])])
        b, length = tgt.shape
        logits = torch.zeros(b, length, VOCAB)
        for t in range(length):
            nxt = scripted_next(src, mask, tgt[:, t].long(), t, self.training)
            logits[torch.arange(b), t, nxt] = 4.0
            logits[torch.arange(b), t, (nxt + 1) % VOCAB] += 1.0
        return logits * self.scale


# --------------------------------------------------------------------------------------------
# Assignment 8: the student side


class _RecordingSGD(torch.optim.SGD):
    """Plain SGD that counts its calls and notes whether the gradients were all zero at a step."""

    def __init__(self, params: Any, lr: float):
        super().__init__(params, lr=lr)
        self.zero_grads = 0
        self.steps = 0
        self.zero_at_step = 0

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.zero_grads += 1
        super().zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        self.steps += 1
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        if not grads or all(not bool(gr.any()) for gr in grads):
            self.zero_at_step += 1
        return super().step(closure)


def _functions(obj: Any, names: tuple[str, ...]) -> dict[str, Any]:
    """The student's functions ``names``: from a `Submission`, or from the namespace in which
    the function ``obj`` was defined (the notebook's)."""
    if isinstance(obj, Submission):
        found = {n: getattr(obj, n) for n in names}
    else:
        space = getattr(obj, "__globals__", None)
        if not isinstance(space, dict):
            raise StudentError("type", "`train` must be a function defined with `def` in your "
                                       f"notebook, got {type(obj).__name__}")
        found = {n: space.get(n) for n in names}
    for name, fn in found.items():
        if fn is None:
            raise StudentError("type", f"your notebook defines no `{name}`")
        if not callable(fn):
            raise StudentError("type", f"`{name}` must be a function, got {type(fn).__name__}")
    return found


def _call(name: str, fn: Any, *args: Any) -> Any:
    """Call the student's ``fn``; any exception becomes a `StudentError` naming ``name``."""
    try:
        return fn(*args)
    except (CaseTimeout, StudentError):
        raise
    except BaseException as exc:
        text = " ".join(str(exc).split())[:160]
        what = "NotImplementedError" if isinstance(exc, NotImplementedError) else (
            f"{type(exc).__name__}: {text}" if text else type(exc).__name__)
        raise StudentError("call", f"{name}|{what}") from None


def _build(fns: dict[str, Any]) -> nn.Module:
    model = _call("build_model", fns["build_model"], VOCAB)
    if not isinstance(model, nn.Module):
        raise StudentError("type", f"build_model returned {type(model).__name__}, not an "
                                   "nn.Module")
    return model


def _logits(name: str, model: nn.Module, *args: Any, **kwargs: Any) -> torch.Tensor:
    try:
        out = model(*args, **kwargs)
    except (CaseTimeout, StudentError):
        raise
    except BaseException as exc:
        text = " ".join(str(exc).split())[:160]
        raise StudentError("call", f"{name}|{type(exc).__name__}: {text}") from None
    if not isinstance(out, torch.Tensor):
        raise StudentError("type", f"your model returned {type(out).__name__}, not a tensor "
                                   "of logits (B, L_t, V)")
    return out.detach().float()


def _ids(name: str, value: Any) -> torch.Tensor:
    """The student's decoded ids as a (B, T) int64 tensor (a list of lists is padded)."""
    if isinstance(value, (list, tuple)) and value and all(
            isinstance(r, (list, tuple, torch.Tensor)) for r in value):
        rows = [torch.as_tensor(r, dtype=torch.long).reshape(-1) for r in value]
        out = torch.full((len(rows), max(len(r) for r in rows)), PAD, dtype=torch.long)
        for i, r in enumerate(rows):
            out[i, : len(r)] = r
        return out
    if not isinstance(value, torch.Tensor) or value.dim() != 2 or value.is_floating_point():
        raise StudentError("type", f"{name} returned {type(value).__name__}"
                           f"{tuple(value.shape) if isinstance(value, torch.Tensor) else ''}, "
                           "expected a (B, T) tensor of int64 token ids")
    return value.long()


def _after_eos_to_pad(ids: torch.Tensor) -> torch.Tensor:
    """``ids`` with every token after a row's first ``<eos>`` replaced by ``<pad>``."""
    is_eos = (ids == EOS).long()
    after = (torch.cumsum(is_eos, dim=1) - is_eos) > 0
    return torch.where(after, torch.full_like(ids, PAD), ids)


def _causal(length: int) -> torch.Tensor:
    return torch.ones(length, length, dtype=torch.bool).tril()


def _perturb_last(tgt: torch.Tensor) -> torch.Tensor:
    """``tgt`` with every token of its last column replaced by another ordinary symbol."""
    out = tgt.clone()
    out[:, -1] = 3 + (out[:, -1].clamp(min=3) - 3 + 1) % (VOCAB - 3)
    return out


def _run_model(obj: Any, spec: Spec, x: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    fns = _functions(obj, ("build_model",))
    model = _build(fns)
    model.eval()
    src, tgt, mask = x["src"], x["tgt"], x["src_mask"]
    causal = _causal(tgt.shape[1])
    with torch.no_grad():
        base = _logits("your model", model, src, tgt, mask, causal)
        later = _logits("your model", model, src, _perturb_last(tgt), mask, causal)
        other = torch.where(mask, src, torch.full_like(src, 3 + (VOCAB - 4)))
        padded = _logits("your model", model, other, tgt, mask, causal)
    return base, later, padded


def _run_train_step(obj: Any, spec: Spec, x: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    fns = _functions(obj, ("build_model", "train_step"))
    model = _build(fns)
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise StudentError("type", "build_model's model has no trainable parameter")
    calls: list[tuple[tuple[Any, ...], dict[str, Any], Any]] = []
    seen = {"backward": 0, "stale": 0}

    def record(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
               output: Any) -> None:
        calls.append((args, dict(kwargs), output))

    def accumulated(p: torch.Tensor) -> None:
        seen["backward"] += 1
        if p.grad is not None and p.grad.numel() and float(p.grad.abs().min()) > STALE / 2:
            seen["stale"] += 1

    handles = [model.register_forward_hook(record, with_kwargs=True)]
    handles += [p.register_post_accumulate_grad_hook(accumulated) for p in params]
    opt = _RecordingSGD(params, lr=1e-3)
    for p in params:  # what an earlier step would have left behind
        p.grad = torch.full_like(p, STALE)
    try:
        loss = _call("train_step", fns["train_step"], model, opt, (x["src"].clone(),
                                                                    x["tgt"].clone()))
    finally:
        for h in handles:
            h.remove()
    try:
        loss_value = float(loss)
    except (TypeError, ValueError, RuntimeError):
        raise StudentError("type", f"train_step returned {type(loss).__name__}, expected the "
                                   "loss as a float (loss.item())") from None
    if not calls:
        raise StudentError("type", "train_step never called the model: call model(src, "
                                   "tgt_in, src_mask, tgt_mask)")
    args, kwargs, output = calls[0]
    names = ("src", "tgt", "src_mask", "tgt_mask")
    given = dict(zip(names, args, strict=False))
    given.update({k: v for k, v in kwargs.items() if k in names})
    dec_in = given.get("tgt")
    if not isinstance(dec_in, torch.Tensor) or not isinstance(output, torch.Tensor):
        raise StudentError("type", "train_step must call model(src, tgt_in, src_mask, "
                                   "tgt_mask), which returns the logits")
    src_mask = given.get("src_mask")
    cleared = all(p.grad is None or not bool(p.grad.any()) for p in params)
    events = torch.tensor([opt.zero_grads, seen["stale"], seen["backward"], opt.steps,
                           opt.zero_at_step, int(cleared), len(calls),
                           int(isinstance(src_mask, torch.Tensor))], dtype=torch.long)
    mask_out = (src_mask.detach().clone() if isinstance(src_mask, torch.Tensor)
                else torch.zeros(0, dtype=torch.bool))
    # The causality probe: the same call in eval mode, then with the last decoder token changed.
    model.eval()
    changed = _perturb_last(dec_in.detach())
    k_args = list(args)
    k_kwargs = dict(kwargs)
    with torch.no_grad():
        base = _logits("your model", model, *k_args, **k_kwargs)
        if len(k_args) >= 2:
            k_args[1] = changed
        else:
            k_kwargs["tgt"] = changed
        later = _logits("your model", model, *k_args, **k_kwargs)
    return (dec_in.detach().clone(), mask_out, output.detach().float(),
            torch.tensor(loss_value, dtype=torch.float64), events, base, later)


def _run_greedy(obj: Any, spec: Spec, x: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    fns = _functions(obj, ("greedy_decode",))
    model = ScriptedModel()
    model.train(spec.train)
    out = _call("greedy_decode", fns["greedy_decode"], model, x["src"].clone(),
                x["src_mask"].clone(), int(spec.literals[1]))
    ids = _ids("greedy_decode", out)
    log = torch.tensor(model.log, dtype=torch.long).reshape(-1, 4)
    return ids, log


def _run_training(obj: Any, spec: Spec, x: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The retraining, in a notebook: build, ``train(model, steps, seed)``, then decode with the
    grader's own greedy decoder; returns the ids, the parameter change and the parameter count.
    The grader runs the same steps in two fresh processes instead (`train_only`, `evaluate`)."""
    fns = _functions(obj, ("build_model", "train"))
    steps, seed = int(spec.literals[1]), int(spec.literals[2])
    torch.manual_seed(seed)
    model = _build(fns)
    before = [p.detach().clone() for p in model.parameters()]
    _call("train", fns["train"], model, steps, seed)
    change = sum(float((a.detach() - b).abs().sum())
                 for a, b in zip(model.parameters(), before, strict=False))
    ids = greedy_answers(model, x["src"], x["src_mask"], DECODE_LEN)
    stats = torch.tensor([change, sum(p.numel() for p in before)], dtype=torch.float64)
    return ids, stats


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    """A model's parameters and buffers, detached copies, by name."""
    try:
        return {k: v.detach().clone() for k, v in model.state_dict().items()
                if isinstance(v, torch.Tensor)}
    except (CaseTimeout, StudentError):
        raise
    except BaseException as exc:
        raise StudentError("call", f"state_dict|{type(exc).__name__}: {exc}") from None


def _run_train_only(obj: Any, spec: Spec, x: dict[str, torch.Tensor]) -> Any:
    """The grader's first process of the retraining: build the model (torch seeded with the
    grader's seed), keep its initial state, ``train(model, steps, seed)``, return both states.
    Nothing of the test set is in this process."""
    fns = _functions(obj, ("build_model", "train"))
    steps, seed = int(spec.literals[1]), int(spec.literals[2])
    torch.manual_seed(seed)
    model = _build(fns)
    initial = _state(model)
    _call("train", fns["train"], model, steps, seed)
    out = {f"initial.{k}": v for k, v in initial.items()}
    out.update({f"trained.{k}": v for k, v in _state(model).items()})
    return out


def _run_evaluate(obj: Any, spec: Spec, x: dict[str, torch.Tensor]) -> Any:
    """The grader's later processes of the retraining: a fresh model from ``build_model`` with
    the state the grader sends (trained, or the initial one, which this process cannot tell
    apart), decoded by the grader's greedy decoder on sources no process saw before."""
    fns = _functions(obj, ("build_model",))
    torch.manual_seed(int(spec.literals[1]))
    model = _build(fns)
    state = {k[len("state."):]: v for k, v in x.items() if k.startswith("state.")}
    try:
        model.load_state_dict(state, strict=True)
    except (CaseTimeout, StudentError):
        raise
    except BaseException as exc:
        text = " ".join(str(exc).split())[:160]
        raise StudentError("call", f"load_state_dict|{type(exc).__name__}: {text}") from None
    return greedy_answers(model, x["src"], x["src_mask"], DECODE_LEN)


def greedy_answers(model: nn.Module, src: torch.Tensor, src_mask: torch.Tensor,
                   max_len: int) -> torch.Tensor:
    """The grader's own greedy decoding of ``model``, as the assignment specifies it: eval mode,
    no autograd, ``<bos>`` first, the argmax of the last position fed back, ``<pad>`` after a
    row's ``<eos>``, stop when every row has ended or after ``max_len`` tokens."""
    model.eval()
    b = src.shape[0]
    ys = torch.full((b, 1), BOS, dtype=torch.long)
    done = torch.zeros(b, dtype=torch.bool)
    with torch.no_grad():
        for _ in range(max_len):
            logits = _logits("your model", model, src.clone(), ys.clone(), src_mask.clone(),
                             _causal(ys.shape[1]))
            if logits.dim() != 3 or tuple(logits.shape[:2]) != (b, ys.shape[1]):
                raise StudentError("type", f"your model returned logits of shape "
                                           f"{tuple(logits.shape)}, expected (B, L_t, V) = "
                                           f"{(b, ys.shape[1], VOCAB)}")
            nxt = logits[:, -1].argmax(dim=-1)
            nxt = torch.where(done, torch.full_like(nxt, PAD), nxt)
            ys = torch.cat([ys, nxt[:, None]], dim=1)
            done |= nxt == EOS
            if bool(done.all()):
                break
    return ys[:, 1:]


_MODES = {"model": _run_model, "train_step": _run_train_step, "greedy": _run_greedy,
          "training": _run_training, "train_only": _run_train_only, "evaluate": _run_evaluate}


def _runner(obj: Any, spec: Spec, x: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    # Tiny matrices gain nothing from a second thread, and on a busy machine threads that wait
    # for each other slow training down several times over; the grader's child has one already.
    # (`guarded_exercise` puts the caller's thread count back afterwards.)
    torch.set_num_threads(1)
    return _MODES[spec.literals[0]](obj, spec, x)


register_runner(A8_KIND, _runner)
