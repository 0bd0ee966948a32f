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
from typing import Any

import torch
import torch.nn.functional as F

from ..data import BOS, EOS, PAD, ReversalTask
from .core import (
    Case,
    CaseResult,
    Checker,
    CheckResult,
    Mistake,
    Run,
    Spec,
    run_in_process,
)
from .guard import Assignment, Rule
from .runners import A8_KIND as KIND
from .runners import (
    TASK_ARGS,
    VOCAB,
    ScriptedModel,  # noqa: F401 (re-exported: the tests use it from here)
    Submission,
    _after_eos_to_pad,
    _as_mask,
    scripted_next,
)

__all__ = ["check_training", "CHECKER", "ASSIGNMENT", "TASK_ARGS", "STEPS", "PASS_ACCURACY",
           "partial_fraction"]

STEPS = 400  # the step budget of the retraining case
BATCH_SIZE = 64  # the notebook's BATCH_SIZE: train reads TASK.batches(BATCH_SIZE, seed=seed)
NUM_TEST = 300
PASS_ACCURACY = 0.95
ZERO_ACCURACY = 0.50
TRAIN_TIME_S = 60.0  # the retraining case's wall-clock limit (the default per case is 5 s)
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



# --------------------------------------------------------------------------------------------
# The scripted model of the decoding cases: its greedy tokens are known in advance


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

    def isolated(self, spec: Spec) -> Any:
        """The retraining, in the grader: three fresh processes. The first builds the model and
        trains it with the student's ``train`` (on the stream of the grader's seed) and sends
        back its initial and its trained state; nothing of the test set is in it. Then, in a
        random order, one process decodes the held-out sources with the trained state and one
        with the initial state, each with the grader's own greedy decoder, and neither can tell
        which state it holds. Answers that do not come from training (a model that reverses by
        hand, a runner replaced by a stub) show up as a model that answers as well untrained."""
        if spec.literals[0] != "training":
            return None
        return self._retrain(spec)

    def _retrain(self, spec: Spec) -> Any:
        steps, seed = int(spec.literals[1]), int(spec.literals[2])
        raw = yield Run(Spec(KIND, {}, [], literals=["train_only", steps, seed], outputs=["*"]))
        t = raw["tensors"]
        initial = {k[len("out:initial."):]: v for k, v in t.items()
                   if k.startswith("out:initial.")}
        trained = {k[len("out:trained."):]: v for k, v in t.items()
                   if k.startswith("out:trained.")}
        change = sum(float((trained[k].double() - v.double()).abs().sum())
                     for k, v in initial.items() if k in trained and trained[k].shape == v.shape
                     and v.is_floating_point())
        count = sum(v.numel() for v in initial.values() if v.is_floating_point())
        answers = {}
        order = ["trained", "initial"]
        if seed % 2:
            order.reverse()
        for which in order:
            state = trained if which == "trained" else initial
            tensors = dict(spec.tensors)
            tensors.update({f"state.{k}": v for k, v in state.items()})
            run = Spec(KIND, tensors, [], literals=["evaluate", seed], outputs=["ids"])
            got = yield Run(run)
            ids = got["tensors"].get("out:ids")
            if not isinstance(ids, torch.Tensor):
                return {"status": "type", "message": "the evaluation returned no answers",
                        "tensors": {}, "notes": []}
            answers[which] = ids
        return {"status": "ok", "message": "", "notes": [],
                "tensors": {"out:ids": answers["trained"], "out:control": answers["initial"],
                            "out:stats": torch.tensor([change, count], dtype=torch.float64)}}

    def _judge_training(self, spec: Spec, t: dict[str, torch.Tensor]) -> str | None:
        src = spec.tensors["src"]
        out, stats = t["out:ids"], t["out:stats"]
        if out.dim() != 2 or out.shape[0] != src.shape[0]:
            return f"decoding returned {tuple(out.shape)} ids for {src.shape[0]} sources"
        if float(stats[0]) == 0.0:
            return M["no_training"]
        accuracy = exact_match(src, out)
        control = t.get("out:control")
        if control is not None:
            before = exact_match(src, control) if control.dim() == 2 and \
                control.shape[0] == src.shape[0] else 0.0
            if before >= ZERO_ACCURACY:
                return (f"the model answers without training: with its initial weights it "
                        f"already reverses {100 * before:.0f}% of the held-out sources (trained: "
                        f"{100 * accuracy:.0f}%). The answers must come from the weights that "
                        "train learns, not from code that computes the reversal")
        if accuracy >= PASS_ACCURACY:
            return None
        share = partial_fraction(accuracy)
        return PartialHint(
            f"held-out exact match {100 * accuracy:.0f}%, below {PASS_ACCURACY:.0%}: "
            f"{share:.0%} of the points (none at {ZERO_ACCURACY:.0%} or less, all at "
            f"{PASS_ACCURACY:.0%}); look at the other cases for the mistake", share)


def exact_match(src: torch.Tensor, ids: torch.Tensor) -> float:
    """The share of rows of ``ids`` that are exactly the reversal of their source and ``<eos>``."""
    lengths = (src != PAD).sum(dim=1)
    correct = 0
    for i in range(src.shape[0]):
        row = ids[i].tolist()
        upto = row.index(EOS) + 1 if EOS in row else len(row)
        correct += row[:upto] == src[i, : int(lengths[i])].flip(0).tolist() + [EOS]
    return correct / max(1, src.shape[0])


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
                literals=["training", STEPS, seed], outputs=["ids", "stats"])


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
