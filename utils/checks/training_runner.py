"""The student side of assignment 8 (training): what the grader's child runs of a submission.

The kind of case "a8_train", registered with `core.register_runner` when this module is imported
(`utils.checks.runners` imports it, so the grader's child holds it as it holds every runner).
One runner for six modes (``spec.literals[0]``): the student's model on a batch ("model"),
``train_step`` watched by a recording optimizer and hooks ("train_step"), ``greedy_decode`` on
`ScriptedModel`, whose greedy tokens are known in advance ("greedy"), and the retraining: in a
notebook at once ("training"), in the grader in two fresh processes ("train_only", then
"evaluate", decoded by the grader's own `greedy_answers`). Tokens are (B, L) int64 ids of the
reversal task `TASK_ARGS` (vocabulary `VOCAB`); logits are (B, L_t, VOCAB). It returns raw
tensors only: the trusted side (`utils.checks.a8_train`) judges them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..data import BOS, EOS, PAD
from .core import CaseTimeout, Spec, StudentError, register_runner
from .training_task import TASK_ARGS, VOCAB, ScriptedModel, Submission

A8_KIND = "a8_train"

DECODE_LEN = TASK_ARGS["max_len"] + 2  # room for the answer, <eos> and one token to spare
STALE = 1.0e4  # the stale gradient left in .grad before train_step runs


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
        # every real source token replaced by the next symbol: a model must read its source
        moved = torch.where(mask, 3 + (src - 3 + 1) % (VOCAB - 3), src)
        source = _logits("your model", model, moved, tgt, mask, causal)
    return base, later, padded, source


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
