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
judge`, with `a8_judges`) computes everything expected: the shifted decoder input, the
cross-entropy of the recorded logits, the greedy tokens of a scripted model, the held-out exact
match. The last case retrains the student's code from a seed the checker gives and decodes
sources that the trusted side drew; their targets never leave the trusted side.

The runner finds the student's other functions next to the one the grader names (``train``) in
the namespace where it was defined (the notebook's); in a notebook `check_training` passes all
four.
"""

from __future__ import annotations

from typing import Any

import torch

from ..data import BOS, EOS, PAD
from ..tasks import ReversalTask
from .a8_judges import JUDGES, PASS_ACCURACY, M
from .checker import Case, Checker, Mistake, run_in_process
from .core import Run, Spec
from .guard import Assignment, Rule
from .results import CheckResult
from .training_runner import A8_KIND as KIND
from .training_task import TASK_ARGS, VOCAB, Submission

__all__ = ["check_training", "CHECKER", "ASSIGNMENT", "TASK_ARGS", "STEPS"]

STEPS = 400  # the step budget of the retraining case
BATCH_SIZE = 64  # the notebook's BATCH_SIZE: train reads TASK.batches(BATCH_SIZE, seed=seed)
NUM_TEST = 300
TRAIN_TIME_S = 60.0  # the retraining case's wall-clock limit (the default per case is 5 s)
FUNCTIONS = ("build_model", "train_step", "greedy_decode", "train")


# --------------------------------------------------------------------------------------------
# The trusted side (the judges of each part are in `a8_judges`)


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

    def judge(self, spec: Spec, raw: dict[str, Any]) -> str | None:
        status, message = raw.get("status"), str(raw.get("message", ""))
        if status == "call" and "|" in message:
            return _fn_hint(message)
        if status == "call" and message == "NotImplementedError":
            return "not implemented yet (it raises NotImplementedError)"
        if status in ("type", "missing"):
            return message
        if status != "ok":
            return super().judge(spec, raw)
        judge_part = JUDGES[spec.literals[0]]
        try:
            return judge_part(spec, raw["tensors"])
        except KeyError as exc:
            return f"an output is missing ({exc})"

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
                    literals=["model"], outputs=["base", "later", "padded", "source"],
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
