"""Assignment 8's trusted side: the hints and one judge per part of the assignment.

Each judge takes a case's `Spec` and the raw tensors the student side returned (``out:NAME``,
see `training_runner`) and returns None or the hint a student reads: the model (``judge_model``:
logits (B, L_t, V), causal, blind to padding), ``train_step`` (the shifted decoder input, the
masks, the loss, the optimizer's calls), ``greedy_decode`` (against the greedy tokens of the
scripted model, `simulate_greedy`) and the retraining (held-out exact match, a share of the
points between `ZERO_ACCURACY` and `PASS_ACCURACY`). `a8_train` holds the cases and the checker.
The model's invariances (causal, blind to padding) hold for a model that reads nothing, so the
model cases also require that its logits change with its input (`BLIND`, `DEAF`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..data import BOS, EOS, PAD
from .checker import PartialHint
from .core import Spec
from .training_runner import _after_eos_to_pad
from .training_task import VOCAB, _as_mask, scripted_next

__all__ = ["M", "BLIND", "DEAF", "JUDGES", "PASS_ACCURACY", "ZERO_ACCURACY", "exact_match",
           "partial_fraction", "simulate_greedy"]

PASS_ACCURACY = 0.95
ZERO_ACCURACY = 0.50


def partial_fraction(accuracy: float) -> float:
    """The share of the retraining case's points for a held-out exact match ``accuracy``.

    1 at `PASS_ACCURACY` (95%) or more, 0 at `ZERO_ACCURACY` (50%) or less, linear in between,
    rounded down to a tenth.
    """
    if accuracy >= PASS_ACCURACY:
        return 1.0
    share = (accuracy - ZERO_ACCURACY) / (PASS_ACCURACY - ZERO_ACCURACY)
    return max(0.0, math.floor(10 * share) / 10)


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
# The judges

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


BLIND = ("your model ignores its inputs: changing the last decoder token left the logits of "
         "the last position unchanged (each position must read the decoder tokens up to its "
         "own, and the source)")
DEAF = ("your model ignores its source: changing every real source token left all its logits "
        "unchanged (the decoder must read the encoder's output through cross-attention)")


def judge_model(spec: Spec, t: dict[str, torch.Tensor]) -> str | None:
    """The model cases: logits of the right shape, finite, that read the decoder input (the
    last position's logits change with its own token: a model that ignores its inputs would
    pass the invariances below without computing anything) and the source (`DEAF`), and, by
    aspect, causal (earlier positions unchanged) or blind to the source's padding."""
    base, later, padded = t["out:base"], t["out:later"], t["out:padded"]
    source = t["out:source"]
    b, length = spec.tensors["tgt"].shape
    if tuple(base.shape) != (b, length, VOCAB):
        return (f"your model returned logits of shape {tuple(base.shape)}, expected (B, L_t, "
                f"V) = {(b, length, VOCAB)}")
    if not torch.isfinite(base).all():
        return "your model's logits contain NaN or inf"
    if tuple(later.shape) != tuple(base.shape) or torch.allclose(
            base[:, -1], later[:, -1], atol=1e-5):
        return BLIND
    if tuple(source.shape) != tuple(base.shape) or torch.allclose(base, source, atol=1e-5):
        return DEAF
    aspect = spec.config["aspect"]
    if aspect == "causal" and not torch.allclose(base[:, :-1], later[:, :-1], atol=1e-5):
        return M["model_causal"]
    if aspect == "padding" and not torch.allclose(base, padded, atol=1e-5):
        return M["model_src_mask"]
    return None


def judge_train_step(spec: Spec, t: dict[str, torch.Tensor]) -> str | None:
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
        return _judge_loss(tgt, dec_in, logits, float(t["out:loss"]))
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


def _judge_loss(tgt: torch.Tensor, dec_in: torch.Tensor, logits: torch.Tensor,
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


def judge_greedy(spec: Spec, t: dict[str, torch.Tensor]) -> str | None:
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


def judge_training(spec: Spec, t: dict[str, torch.Tensor]) -> str | None:
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


JUDGES = {"model": judge_model, "train_step": judge_train_step, "greedy": judge_greedy,
          "training": judge_training}
