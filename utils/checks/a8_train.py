"""Assignment 8: train a Transformer on the reversal task, and decode greedily.

The student writes four functions (see the notebook for the exact contract):

* ``build_model(vocab_size)`` -> an ``nn.Module`` called as ``model(src, tgt, src_mask,
  tgt_mask)`` -> logits (B, L_t, V), with ``src_mask`` (B, L_s) bool (True = real token) and
  ``tgt_mask`` a causal (L_t, L_t) bool mask (or one that broadcasts to (B, L_t, L_t));
* ``train_step(model, optimizer, batch)`` -> the loss as a float, for ``batch = (src, tgt)``:
  padded ids, ``tgt`` the target followed by ``<eos>``;
* ``greedy_decode(model, src, src_mask, max_len)`` -> (B, T) int64 ids, ``<bos>`` left out, each
  row ending with ``<eos>`` and ``<pad>`` after it, T <= max_len;
* ``train(model, steps, seed)``: ``steps`` calls of ``train_step`` on ``TASK.batches(BATCH_SIZE,
  seed=seed)``.

The cases are of one new kind, ``"a8_train"`` (`core.register_runner`). The runner, on the
student side, builds the student's model, runs the student's functions, and returns raw tensors
only: the arguments the model was called with (recorded by a forward hook), the logits it gave,
the loss returned, what the optimizer saw, the decoded ids. The trusted side (`TrainingChecker.
judge`) computes everything expected: the shifted decoder input, the cross-entropy of the
recorded logits, the greedy tokens of a scripted model, the held-out exact match. The last case
retrains the student's code from a seed the checker gives and decodes sources that the trusted
side drew; their targets never leave the trusted side.

The runner finds the student's other functions next to the one the grader names (``train``) in
the namespace where it was defined (the notebook's); in a notebook `check_training` passes all
four.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..data import BOS, EOS, PAD, ReversalTask
from .core import (
    Case,
    CaseResult,
    CaseTimeout,
    Checker,
    CheckResult,
    Mistake,
    Spec,
    StudentError,
    register_runner,
    run_in_process,
)
from .guard import Assignment, Rule

__all__ = ["check_training", "CHECKER", "ASSIGNMENT", "TASK_ARGS", "STEPS", "PASS_ACCURACY",
           "partial_fraction"]

TASK_ARGS = {"min_len": 3, "max_len": 8, "num_symbols": 8}
"""The task of the assignment: ``ReversalTask(**TASK_ARGS)`` (the notebook's ``TASK``)."""
VOCAB = len(ReversalTask(**TASK_ARGS).vocab)  # 11: three specials and eight symbols
STEPS = 400  # the step budget of the retraining case
BATCH_SIZE = 64  # the notebook's BATCH_SIZE: train reads TASK.batches(BATCH_SIZE, seed=seed)
DECODE_LEN = TASK_ARGS["max_len"] + 2  # room for the answer, <eos> and one token to spare
NUM_TEST = 300
PASS_ACCURACY = 0.95
ZERO_ACCURACY = 0.50
TRAIN_TIME_S = 60.0  # the retraining case's wall-clock limit (the default per case is 5 s)
STALE = 1.0e4  # the stale gradient left in .grad before train_step runs
KIND = "a8_train"
FUNCTIONS = ("build_model", "train_step", "greedy_decode", "train")


def partial_fraction(accuracy: float) -> float:
    """The share of the retraining case's points for a held-out exact match ``accuracy``.

    1 at `PASS_ACCURACY` (95%) or more, 0 at `ZERO_ACCURACY` (50%) or less, linear in between,
    rounded down to a tenth.
    """
    if accuracy >= PASS_ACCURACY:
        return 1.0
    share = (accuracy - ZERO_ACCURACY) / (PASS_ACCURACY - ZERO_ACCURACY)
    return max(0.0, math.floor(10 * share) / 10)


class PartialHint(str):
    """A hint that carries the share of the points a failed case still earns."""

    fraction: float = 0.0

    def __new__(cls, text: str, fraction: float) -> PartialHint:
        obj = super().__new__(cls, text)
        obj.fraction = fraction
        return obj


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


def simulate_greedy(src: torch.Tensor, src_mask: torch.Tensor | None, max_len: int,
                    feed: str = "own", position: str = "last",
                    training: bool = False) -> torch.Tensor:
    """What a greedy decoder gets from `ScriptedModel` (trusted side): (B, T) ids, ``<pad>``
    after each ``<eos>``, stopping when every row has ended or after ``max_len`` tokens.

    ``feed="bos"`` feeds ``<bos>`` at every position instead of the predictions; ``position=
    "first"`` reads the logits of the first position instead of the last.
    """
    b = src.shape[0]
    ys = torch.full((b, 1), BOS, dtype=torch.long)
    done = torch.zeros(b, dtype=torch.bool)
    out = []
    for step in range(max_len):
        t = 0 if position == "first" else step
        prev = ys[:, t] if feed == "own" else torch.full((b,), BOS, dtype=torch.long)
        tok = scripted_next(src, src_mask, prev, t, training)
        tok = torch.where(done, torch.full_like(tok, PAD), tok)
        out.append(tok)
        ys = torch.cat([ys, tok[:, None]], dim=1)
        done |= tok == EOS
        if bool(done.all()):
            break
    return torch.stack(out, dim=1)


# --------------------------------------------------------------------------------------------
# The student side


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
    fns = _functions(obj, ("build_model", "train", "greedy_decode"))
    steps, seed = int(spec.literals[1]), int(spec.literals[2])
    torch.manual_seed(seed)
    model = _build(fns)
    before = [p.detach().clone() for p in model.parameters()]
    _call("train", fns["train"], model, steps, seed)
    after = list(model.parameters())
    change = sum(float((a.detach() - b).abs().sum()) for a, b in zip(after, before, strict=False))
    src, mask = x["src"], x["src_mask"]
    out = _ids("greedy_decode", _call("greedy_decode", fns["greedy_decode"], model, src.clone(),
                                      mask.clone(), DECODE_LEN))
    # Are these the model's own choices? Its argmax with its own output as the decoder input.
    model.eval()
    dec_in = torch.cat([torch.full((out.shape[0], 1), BOS, dtype=torch.long), out[:, :-1]], 1)
    dec_in = dec_in.clamp(0, VOCAB - 1) if out.shape[1] else dec_in
    with torch.no_grad():
        chosen = (_logits("your model", model, src, dec_in, mask, _causal(dec_in.shape[1]))
                  .argmax(-1) if out.shape[1] else out.clone())
    stats = torch.tensor([change, sum(p.numel() for p in before)], dtype=torch.float64)
    return out, chosen, stats


_MODES = {"model": _run_model, "train_step": _run_train_step, "greedy": _run_greedy,
          "training": _run_training}


def _runner(obj: Any, spec: Spec, x: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    # Tiny matrices gain nothing from a second thread, and on a busy machine threads that wait
    # for each other slow training down several times over; the grader's child has one already.
    # (`guarded_exercise` puts the caller's thread count back afterwards.)
    torch.set_num_threads(1)
    return _MODES[spec.literals[0]](obj, spec, x)


register_runner(KIND, _runner)


# --------------------------------------------------------------------------------------------
# The trusted side

M = {
    "no_shift": "no teacher-forcing shift: the decoder input is the target itself, so each "
                "position sees the token it must predict; feed <bos> + target[:-1]",
    "no_bos": "<bos> missing: the decoder input must start with <bos> (BOS = 1) and continue "
              "with target[:-1], as wide as the target",
    "too_wide": "the decoder input is <bos> + the whole target, one position too wide: drop the "
                "target's last column (target[:, :-1]) so that input and target line up",
    "no_causal": "the call in train_step lets a decoder position see later positions: pass a "
                 "causal tgt_mask (utils.masks.causal_mask(L_t)), or the model learns to copy "
                 "the answer it is given",
    "model_causal": "your model ignores tgt_mask: with a causal mask, changing a later decoder "
                    "token must not change the logits of an earlier position",
    "no_src_mask": "no source padding mask: pass src_mask = (src != PAD), (B, L_s) bool, so that "
                   "attention ignores the padding",
    "src_mask_inverted": "the source mask is inverted: True marks a real token (src != PAD), "
                         "False the padding",
    "model_src_mask": "your model does not apply src_mask everywhere: changing a padded source "
                      "token changed the logits (mask the encoder's self-attention and the "
                      "decoder's cross-attention)",
    "pad_loss": "the loss counts the padding: pass ignore_index=PAD to the cross-entropy",
    "sum_loss": "the loss is summed over tokens: take the mean over the real target tokens "
                "(F.cross_entropy's default reduction, with ignore_index=PAD)",
    "input_loss": "the loss compares the logits with the decoder input: the targets are the "
                  "next tokens, target (ending with <eos>)",
    "no_step": "optimizer.step() is never called (on the optimizer passed to train_step): the "
               "parameters never change",
    "no_backward": "loss.backward() is never called: the optimizer has no gradient to use",
    "no_zero_grad": "optimizer.zero_grad() missing: the gradients of earlier steps are still in "
                    ".grad and add up with this step's",
    "zero_after_backward": "zero_grad() between backward() and step() wipes the gradient: the "
                           "step does nothing; zero the gradients before backward()",
    "train_mode": "greedy_decode runs the model in training mode (dropout on): call "
                  "model.eval() first",
    "decode_no_mask": "greedy_decode does not pass src_mask to the model: padding in the source "
                      "changes the answer",
    "no_feedback": "greedy_decode does not feed its own predictions back: the decoder input of "
                   "each step is <bos> followed by the tokens chosen so far",
    "first_position": "greedy_decode reads the logits of the first position (or its decoder "
                      "input never grows): take logits[:, -1] of the whole prefix",
    "keeps_bos": "the output starts with <bos>: return the generated tokens only",
    "after_eos": "a row keeps generating after its <eos>: write <pad> after it",
    "to_max_len": "decoding never stops early: once every row has produced <eos>, stop (the "
                  "output is then as wide as the longest answer)",
    "first_eos_stops": "decoding stops when the first row ends: go on until every row has "
                       "produced <eos> (or max_len tokens)",
    "off_by_one": "max_len is off by one: generate at most max_len tokens (<eos> included)",
    "not_own_choice": "the tokens greedy_decode returns are not your model's greedy choices: "
                      "take the argmax of the model's logits at each step (see the decoding "
                      "cases)",
    "no_training": "training changed no parameter of the model: train must call train_step, "
                   "whose optimizer step updates the model it was given",
}


def _fn_hint(message: str) -> str:
    name, _, what = message.partition("|")
    if what == "NotImplementedError":
        return f"`{name}` is not implemented yet (it raises NotImplementedError)"
    return f"{name} raised {what}"


class TrainingChecker(Checker):
    """The checker of assignment 8: the model, train_step, greedy_decode and the training."""

    name = "check_training"
    target = "train"
    what = "your code"
    mistakes = tuple(Mistake(h, {"name": k}) for k, h in M.items())
    combine_pairs = False

    def result(self, case: Case, hint: str | None, flag: str = "") -> CaseResult:
        """Full points when ``hint`` is None; a `PartialHint` earns its share."""
        if isinstance(hint, PartialHint) and not flag:
            return CaseResult(case.name, False, str(hint),
                              round(case.points * hint.fraction, 2), case.points, case.id)
        return super().result(case, hint, flag)

    def judge(self, spec: Spec, raw: dict[str, Any]) -> str | None:
        status, message = raw.get("status"), str(raw.get("message", ""))
        if status == "timeout":
            return f"{self.what} {message}: an endless loop, or far too much work?"
        if status == "call" and "|" in message:
            return _fn_hint(message)
        if status == "call" and message == "NotImplementedError":
            return "not implemented yet (it raises NotImplementedError)"
        if status in ("type", "missing"):
            return message
        if status != "ok":
            return super().judge(spec, raw)
        t = raw["tensors"]
        mode = spec.literals[0]
        try:
            return getattr(self, f"_judge_{mode}")(spec, t)
        except KeyError as exc:
            return f"an output is missing ({exc})"

    # -- the model ------------------------------------------------------------------------------

    def _judge_model(self, spec: Spec, t: dict[str, torch.Tensor]) -> str | None:
        base, later, padded = t["out:base"], t["out:later"], t["out:padded"]
        b, length = spec.tensors["tgt"].shape
        if tuple(base.shape) != (b, length, VOCAB):
            return (f"your model returned logits of shape {tuple(base.shape)}, expected (B, L_t, "
                    f"V) = {(b, length, VOCAB)}")
        if not torch.isfinite(base).all():
            return "your model's logits contain NaN or inf"
        aspect = spec.config["aspect"]
        if aspect == "causal" and not torch.allclose(base[:, :-1], later[:, :-1], atol=1e-5):
            return M["model_causal"]
        if aspect == "padding" and not torch.allclose(base, padded, atol=1e-5):
            return M["model_src_mask"]
        return None

    # -- train_step -----------------------------------------------------------------------------

    def _judge_train_step(self, spec: Spec, t: dict[str, torch.Tensor]) -> str | None:
        src, tgt = spec.tensors["src"], spec.tensors["tgt"]
        b, length = tgt.shape
        aspect = spec.config["aspect"]
        dec_in, logits = t["out:dec_in"], t["out:logits"]
        events = t["out:events"].tolist()
        if aspect == "input":
            real = tgt != PAD
            want = torch.cat([torch.full((b, 1), BOS, dtype=torch.long), tgt[:, :-1]], 1)
            if tuple(dec_in.shape) == (b, length) and torch.equal(dec_in[real], want[real]):
                return None
            if tuple(dec_in.shape) == (b, length) and torch.equal(dec_in[real], tgt[real]):
                return M["no_shift"]
            if tuple(dec_in.shape) == (b, length + 1):
                return M["too_wide"]
            return M["no_bos"] + f" (got {tuple(dec_in.shape)} for a target {(b, length)})"
        if aspect == "causal":
            base, later = t["out:base"], t["out:later"]
            if base.shape != later.shape or base.dim() != 3:
                return f"the model's logits have shape {tuple(base.shape)}, expected (B, L_t, V)"
            if not torch.allclose(base[:, :-1], later[:, :-1], atol=1e-5):
                return M["no_causal"]
            return None
        if aspect == "src_mask":
            mask = _as_mask(t["out:src_mask"], tuple(src.shape)) if events[7] else None
            if mask is None:
                return M["no_src_mask"]
            if torch.equal(mask, src != PAD):
                return None
            if torch.equal(mask, src == PAD):
                return M["src_mask_inverted"]
            return "the source mask is not (src != PAD) of shape (B, L_s)"
        if aspect == "loss":
            return self._judge_loss(tgt, dec_in, logits, float(t["out:loss"]))
        if aspect == "optimizer":
            zero_grads, stale, backward, steps, zero_at_step, cleared, _, _ = events
            if backward == 0:
                return M["no_backward"]
            if steps == 0:
                return M["no_step"]
            if zero_at_step:
                return M["zero_after_backward"]
            if stale and not cleared:
                return M["no_zero_grad"]
            if steps > 1:
                return "optimizer.step() is called more than once for one batch"
            return None
        raise KeyError(aspect)

    def _judge_loss(self, tgt: torch.Tensor, dec_in: torch.Tensor, logits: torch.Tensor,
                    loss: float) -> str | None:
        if logits.dim() != 3 or tuple(logits.shape[:2]) != tuple(tgt.shape):
            return (f"the logits have shape {tuple(logits.shape)}, not (B, L_t, V) with the "
                    f"target's (B, L_t) = {tuple(tgt.shape)}: see the decoder input case")
        if not math.isfinite(loss):
            return "the loss is NaN or inf"
        z = logits.double().reshape(-1, logits.shape[-1])

        def close(value: float) -> bool:
            return abs(loss - value) <= 1e-4 * (1 + abs(value))

        want = float(F.cross_entropy(z, tgt.reshape(-1), ignore_index=PAD))
        if close(want):
            return None
        if close(float(F.cross_entropy(z, tgt.reshape(-1)))):
            return M["pad_loss"]
        if close(float(F.cross_entropy(z, tgt.reshape(-1), ignore_index=PAD,
                                       reduction="sum"))):
            return M["sum_loss"]
        if tuple(dec_in.shape) == tuple(tgt.shape):
            for ignore in (PAD, -100):
                if close(float(F.cross_entropy(z, dec_in.reshape(-1).long(),
                                               ignore_index=ignore))):
                    return M["input_loss"]
        return (f"the loss {loss:.4f} is not the mean cross-entropy of your model's logits over "
                f"the real target tokens ({want:.4f})")

    # -- greedy_decode --------------------------------------------------------------------------

    def _judge_greedy(self, spec: Spec, t: dict[str, torch.Tensor]) -> str | None:
        src, mask = spec.tensors["src"], spec.tensors["src_mask"]
        max_len = int(spec.literals[1])
        out, log = t["out:ids"], t["out:log"]
        if log.numel() and bool(log[:, 0].any()):
            return M["train_mode"]
        if log.numel() and not bool(log[:, 1].all()):
            return M["decode_no_mask"]
        want = simulate_greedy(src, mask, max_len)
        if torch.equal(out, want):
            return None
        b, w = want.shape
        if out.shape[0] != b:
            return f"the output has {out.shape[0]} rows for {b} sources"
        if out.shape[1] == w + 1 and bool((out[:, 0] == BOS).all()) and torch.equal(
                out[:, 1:], want):
            return M["keeps_bos"]
        finished = bool((want == EOS).any(dim=1).all())
        cut = _after_eos_to_pad(out)
        wide = out.shape[1] >= w and torch.equal(cut[:, :w], want) and bool(
            (cut[:, w:] == PAD).all())
        if wide and bool((out != cut).any()):
            return M["after_eos"]
        if wide:  # right tokens, then columns of <pad> only
            return M["to_max_len"] if finished else M["off_by_one"]
        if not finished and out.shape[1] == w + 1 and torch.equal(cut[:, :w], want):
            return M["off_by_one"]
        n = min(out.shape[1], w)
        if out.shape[1] < w and torch.equal(cut, want[:, :n]):
            return M["first_eos_stops"] if finished else M["off_by_one"]
        for feed, position, key in (("bos", "last", "no_feedback"),
                                    ("own", "first", "first_position")):
            other = simulate_greedy(src, mask, max_len, feed=feed, position=position)
            m = min(other.shape[1], out.shape[1])
            if m and torch.equal(out[:, :m], other[:, :m]):
                return M[key]
        bad = (out[:, :n] != want[:, :n]).nonzero()
        where = f" (first difference: row {int(bad[0, 0])}, token {int(bad[0, 1])})" \
            if len(bad) else ""
        return (f"the output {tuple(out.shape)} differs from the greedy tokens {tuple(want.shape)}"
                f" of the checker's model{where}")

    # -- the retraining -------------------------------------------------------------------------

    def _judge_training(self, spec: Spec, t: dict[str, torch.Tensor]) -> str | None:
        src = spec.tensors["src"]
        out, chosen, stats = t["out:ids"], t["out:chosen"], t["out:stats"]
        if out.shape[0] != src.shape[0]:
            return f"greedy_decode returned {out.shape[0]} rows for {src.shape[0]} sources"
        if float(stats[0]) == 0.0:
            return M["no_training"]
        lengths = (src != PAD).sum(dim=1)
        correct = 0
        own = 0
        for i in range(src.shape[0]):
            row = out[i].tolist()
            upto = row.index(EOS) + 1 if EOS in row else len(row)
            own += chosen.shape == out.shape and torch.equal(chosen[i, :upto], out[i, :upto])
            answer = src[i, : int(lengths[i])].flip(0).tolist() + [EOS]
            correct += row[:upto] == answer
        if own < 0.9 * src.shape[0]:
            return M["not_own_choice"]
        accuracy = correct / src.shape[0]
        if accuracy >= PASS_ACCURACY:
            return None
        share = partial_fraction(accuracy)
        return PartialHint(
            f"held-out exact match {100 * accuracy:.0f}%, below {PASS_ACCURACY:.0%}: "
            f"{share:.0%} of the points (none at {ZERO_ACCURACY:.0%} or less, all at "
            f"{PASS_ACCURACY:.0%}); look at the other cases for the mistake", share)


# --------------------------------------------------------------------------------------------
# The cases


def _pairs(gen: torch.Generator, b: int, lo: int, hi: int) -> tuple[torch.Tensor, ...]:
    """b sources of lengths lo..hi (one of the longest) and their targets: reversal + <eos>."""
    lengths = [hi] + [int(v) for v in torch.randint(lo, hi + 1, (b - 1,), generator=gen)]
    src = torch.full((b, hi), PAD, dtype=torch.long)
    tgt = torch.full((b, hi + 1), PAD, dtype=torch.long)
    for i, n in enumerate(lengths):
        row = torch.randint(3, VOCAB, (n,), generator=gen)
        src[i, :n] = row
        tgt[i, :n] = row.flip(0)
        tgt[i, n] = EOS
    return src, tgt


def _model_case(aspect: str) -> Any:
    def make(gen: torch.Generator) -> Spec:
        src, tgt = _pairs(gen, 3, 3, 7)
        dec_in = torch.cat([torch.full((3, 1), BOS, dtype=torch.long), tgt[:, :-1]], 1)
        return Spec(KIND, {"src": src, "tgt": dec_in, "src_mask": src != PAD}, [],
                    literals=["model"], outputs=["base", "later", "padded"],
                    seed=int(torch.randint(0, 2**31 - 1, (1,), generator=gen)),
                    config={"aspect": aspect})
    return make


def _step_case(aspect: str) -> Any:
    def make(gen: torch.Generator) -> Spec:
        src, tgt = _pairs(gen, 4, 3, 8)
        return Spec(KIND, {"src": src, "tgt": tgt}, [], literals=["train_step"],
                    outputs=["dec_in", "src_mask", "logits", "loss", "events", "base", "later"],
                    seed=int(torch.randint(0, 2**31 - 1, (1,), generator=gen)),
                    config={"aspect": aspect})
    return make


def _greedy_case(stops: list[int], max_len: int, train: bool = False) -> Any:
    def make(gen: torch.Generator) -> Spec:
        b = len(stops)
        width = 6
        src = torch.full((b, width), PAD, dtype=torch.long)
        for i, stop in enumerate(stops):
            n = width if i == 0 else int(torch.randint(2, width, (1,), generator=gen))
            src[i, :n] = torch.randint(3, VOCAB, (n,), generator=gen)
            src[i, 0] = 3 + stop
        return Spec(KIND, {"src": src, "src_mask": src != PAD}, [], literals=["greedy", max_len],
                    outputs=["ids", "log"], train=train)
    return make


def training_sources(seed: int) -> set[tuple[int, ...]]:
    """Every source of the stream that `train` reads with ``seed``: the first `STEPS` batches of
    ``TASK.batches(BATCH_SIZE, seed=seed)``."""
    seen: set[tuple[int, ...]] = set()
    stream = ReversalTask(**TASK_ARGS).batches(BATCH_SIZE, seed=seed)
    for _ in range(STEPS):
        b = next(stream)
        seen.update(tuple(row[m].tolist()) for row, m in zip(b.src, b.src_mask, strict=True))
    return seen


def _training_case(gen: torch.Generator) -> Spec:
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=gen))
    seen = [(s, s[::-1]) for s in training_sources(seed)]  # held out: none of these
    test = ReversalTask(**TASK_ARGS).sample(NUM_TEST, seed=int(torch.randint(
        0, 2**31 - 1, (1,), generator=gen)), exclude=seen)
    src = torch.full((NUM_TEST, TASK_ARGS["max_len"]), PAD, dtype=torch.long)
    for i, (s, _) in enumerate(test):
        src[i, : len(s)] = torch.tensor(s)
    return Spec(KIND, {"src": src, "src_mask": src != PAD}, [],
                literals=["training", STEPS, seed], outputs=["ids", "chosen", "stats"])


# Points per case: the one place where this assignment's points are declared.
CHECKER = TrainingChecker([
    Case("model_shape", "build_model: logits (B, L_t, V) for model(src, tgt, src_mask, tgt_mask)",
         _model_case("shape"), points=1),
    Case("model_causal", "build_model: with a causal tgt_mask, a later decoder token leaves "
         "earlier logits alone", _model_case("causal"), points=1),
    Case("model_padding", "build_model: with src_mask, padded source tokens change nothing",
         _model_case("padding"), points=1),
    Case("step_input", "train_step: the decoder input is <bos> + target[:-1]",
         _step_case("input"), points=1),
    Case("step_causal", "train_step: the model is called with a causal mask",
         _step_case("causal"), points=1),
    Case("step_src_mask", "train_step: the source padding mask (src != PAD) is passed",
         _step_case("src_mask"), points=1),
    Case("step_loss", "train_step: the loss is the mean cross-entropy over real target tokens",
         _step_case("loss"), points=1),
    Case("step_optimizer", "train_step: zero_grad, backward and one optimizer step",
         _step_case("optimizer"), points=1),
    Case("greedy_batch", "greedy_decode: 4 rows ending at different steps, max_len 8",
         _greedy_case([2, 5, 0, 3], 8), points=1),
    Case("greedy_max_len", "greedy_decode: a row that never produces <eos> stops at max_len 5",
         _greedy_case([7, 1], 5), points=1),
    Case("greedy_eval", "greedy_decode: a model handed over in training mode is run in eval "
         "mode", _greedy_case([3, 1, 4], 8, train=True), points=1),
    Case("training", f"training: build_model, train(model, {STEPS}, seed), greedy_decode: exact "
         f"match >= {PASS_ACCURACY:.0%} on {NUM_TEST} held-out sources", _training_case, points=6,
         time_s=TRAIN_TIME_S),
])

ASSIGNMENT = Assignment(
    name="a8_train",
    checkers=[CHECKER],
    rules=[
        Rule("code", "utils.train", "uses utils.train.train, the book's training loop that this "
             "assignment asks you to write", qualname="train"),
        Rule("module", "utils.decoding", "imports utils.decoding, the book's decoders; this "
             "assignment asks you to write greedy decoding"),
        Rule("module", "utils.models", "imports utils.models, the book's complete models: build "
             "yours from utils.transformer's parts"),
        Rule("code", "torch.nn.modules.transformer", "uses torch's nn.Transformer: build the "
             "model from the book's parts (utils.transformer)", qualname="Transformer"),
    ],
)


def check_training(build_model: Any, train_step: Any, greedy_decode: Any, train: Any,
                   verbose: bool = True) -> CheckResult:
    """Check the four functions of assignment 8, retraining the model once.

    Prints one line per case and returns a `CheckResult`. The retraining case trains
    ``build_model(V)`` with ``train(model, STEPS, seed)`` and decodes 300 sources with
    ``greedy_decode``: all its points at 95% exact match or more, a share between 50% and 95%.
    """
    return run_in_process(CHECKER, Submission(build_model, train_step, greedy_decode, train),
                          verbose)
