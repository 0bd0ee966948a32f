"""Assignment 8 (train a Transformer): the checker names every planted mistake, never raises on bad
code, gives partial credit by the stated scale, and grades the book's solution, a wrong and hostile
submissions through the sandboxed grader."""

from __future__ import annotations

import csv
import functools
import time

import nbformat
import pytest
import torch
from assignment_grading import grade, write_submission
from notebooks import ROOT

from utils.checks import a8_train
from utils.checks.a8_judges import M, partial_fraction, simulate_greedy
from utils.checks.a8_train import CHECKER
from utils.checks.checker import PartialHint
from utils.checks.core import guarded_exercise
from utils.checks.training_task import ScriptedModel, Submission

NOTEBOOK = ROOT / "book" / "assignments" / "a8_train.ipynb"


def _solution_cells() -> dict[int, str]:
    nb = nbformat.read(NOTEBOOK, as_version=4)
    return {i: c.source for i, c in enumerate(nb.cells)
            if c.cell_type == "code" and "### BEGIN SOLUTION" in c.source}


def _setup_source() -> str:
    nb = nbformat.read(NOTEBOOK, as_version=4)
    return nb.cells[1].source


SOLUTION = "\n\n".join(_solution_cells().values())


def _namespace(source: str = SOLUTION) -> dict:
    ns: dict = {"__name__": "__main__"}
    exec(compile(_setup_source().replace("print(", "(lambda *a, **k: None)("), "<setup>", "exec"),
         ns)
    exec(compile(source, "<submission>", "exec"), ns)
    return ns


def _planted(old: str, new: str) -> str:
    assert old in SOLUTION, old
    return SOLUTION.replace(old, new)


def _submission(ns: dict) -> Submission:
    return Submission(*(ns.get(n) for n in a8_train.FUNCTIONS))


@functools.cache
def _specs() -> dict:
    """The checker's specs by case id, made when a test first needs them: making them draws the
    training stream's sources (a second and a half), which every worker would otherwise pay
    while it collects the tests."""
    return dict(zip([c.id for c in CHECKER.cases], CHECKER.specs(), strict=True))


def _judge(submission, case_id: str):
    spec = _specs()[case_id]
    raw = guarded_exercise(submission, spec, 120)
    return CHECKER.judge(spec, raw)


QUICK = [c.id for c in CHECKER.cases if c.id != "training"]

# name: (old text of the solution, new text, the case that must fail, the mistake it names)
MISTAKES = {
    "no_shift": ("tgt_in = torch.cat([torch.full_like(tgt[:, :1], BOS), tgt[:, :-1]], dim=1)",
                 "tgt_in = tgt", "step_input", "no_shift"),
    "no_bos": ("tgt_in = torch.cat([torch.full_like(tgt[:, :1], BOS), tgt[:, :-1]], dim=1)"
               "\n    logits = model(src, tgt_in, src != PAD, causal_mask(tgt.shape[1]))",
               "tgt_in = tgt[:, :-1]\n    tgt = tgt[:, 1:]\n"
               "    logits = model(src, tgt_in, src != PAD, causal_mask(tgt.shape[1]))",
               "step_input", "no_bos"),
    "too_wide": ("tgt_in = torch.cat([torch.full_like(tgt[:, :1], BOS), tgt[:, :-1]], dim=1)"
                 "\n    logits = model(src, tgt_in, src != PAD, "
                 "causal_mask(tgt.shape[1]))  # (B, L_t, V)",
                 "tgt_in = torch.cat([torch.full_like(tgt[:, :1], BOS), tgt], dim=1)\n"
                 "    logits = model(src, tgt_in, src != PAD, "
                 "causal_mask(tgt_in.shape[1]))[:, :-1]",
                 "step_input", "too_wide"),
    "no_causal": ("logits = model(src, tgt_in, src != PAD, causal_mask(tgt.shape[1]))",
                  "logits = model(src, tgt_in, src != PAD, None)", "step_causal", "no_causal"),
    "model_causal": ("tgt_mask=tgt_mask,\n", "tgt_mask=None,\n",
                     "model_causal", "model_causal"),
    "no_src_mask": ("logits = model(src, tgt_in, src != PAD,", "logits = model(src, tgt_in, None,",
                    "step_src_mask", "no_src_mask"),
    "src_mask_inverted": ("logits = model(src, tgt_in, src != PAD,",
                          "logits = model(src, tgt_in, src == PAD,", "step_src_mask",
                          "src_mask_inverted"),
    "model_src_mask": ("memory_mask=keys,\n", "memory_mask=None,\n", "model_padding",
                       "model_src_mask"),
    "pad_loss": ("tgt.reshape(-1), ignore_index=PAD\n", "tgt.reshape(-1)\n", "step_loss",
                 "pad_loss"),
    "sum_loss": ("ignore_index=PAD\n    )\n    optimizer.zero_grad()",
                 "ignore_index=PAD, reduction='sum'\n    )\n    optimizer.zero_grad()",
                 "step_loss", "sum_loss"),
    "input_loss": ("tgt.reshape(-1), ignore_index=PAD\n",
                   "tgt_in.reshape(-1), ignore_index=PAD\n",
                   "step_loss", "input_loss"),
    "no_step": ("    optimizer.step()\n    return loss.item()", "    return loss.item()",
                "step_optimizer", "no_step"),
    "no_backward": ("    loss.backward()\n", "", "step_optimizer", "no_backward"),
    "no_zero_grad": ("    optimizer.zero_grad()\n    loss.backward()\n", "    loss.backward()\n",
                     "step_optimizer", "no_zero_grad"),
    "zero_after_backward": ("    optimizer.zero_grad()\n    loss.backward()\n",
                            "    loss.backward()\n    optimizer.zero_grad()\n", "step_optimizer",
                            "zero_after_backward"),
    "train_mode": ("    model.eval()\n", "", "greedy_eval", "train_mode"),
    "decode_no_mask": ("logits = model(src, ys, src_mask,", "logits = model(src, ys, None,",
                       "greedy_batch", "decode_no_mask"),
    "no_feedback": ("logits = model(src, ys, src_mask,",
                    "logits = model(src, torch.full_like(ys, BOS), src_mask,", "greedy_batch",
                    "no_feedback"),
    "first_position": ("nxt = logits[:, -1].argmax(dim=-1)", "nxt = logits[:, 0].argmax(dim=-1)",
                       "greedy_batch", "first_position"),
    "keeps_bos": ("    return ys[:, 1:]", "    return ys", "greedy_batch", "keeps_bos"),
    "after_eos": ("            nxt = torch.where(done, torch.full_like(nxt, PAD), nxt)", "",
                  "greedy_batch", "after_eos"),
    "to_max_len": ("            if done.all():\n                break\n", "", "greedy_batch",
                   "to_max_len"),
    "first_eos_stops": ("if done.all():", "if done.any():", "greedy_batch", "first_eos_stops"),
    "off_by_one": ("for _ in range(max_len):", "for _ in range(max_len + 1):", "greedy_max_len",
                   "off_by_one"),
    "no_training": ("    for _ in range(steps):\n", "    for _ in range(0):\n",
                    "training", "no_training"),
}


def test_the_solution_passes_the_quick_cases():
    sub = _submission(_namespace())
    for case_id in QUICK:
        assert _judge(sub, case_id) is None, case_id


def test_every_mistake_is_tested():
    assert {key for *_, key in MISTAKES.values()} == set(M)


@pytest.mark.parametrize("name", list(MISTAKES))
def test_each_planted_mistake_is_named(name):
    old, new, case_id, key = MISTAKES[name]
    hint = _judge(_submission(_namespace(_planted(old, new))), case_id)
    assert hint is not None and hint.startswith(M[key]), (name, hint)


def test_a_decoder_that_ignores_the_model_earns_nothing_for_training():
    """Hostile: greedy_decode returns the reversed source without asking the model; the model is
    the student's, trained by their own loop. The retraining decodes with the checker's own
    greedy decoder, so the student's greedy_decode plays no part in it."""
    lazy = "\ndef train(model, steps, seed):\n    return []\n"
    ns = _namespace(SOLUTION + REVERSED + lazy)  # REVERSED: the cheat, as graded below
    assert _judge(_submission(ns), "training") == M["no_training"]
    ns = _namespace(SOLUTION + REVERSED + "\ndef train(model, steps, seed):\n"
                    "    opt = torch.optim.SGD(model.parameters(), lr=1e-3)\n"
                    "    for _, b in zip(range(2), TASK.batches(8, seed=seed)):\n"
                    "        train_step(model, opt, (b.src, b.tgt_out))\n")
    hint = _judge(_submission(ns), "training")
    assert hint.startswith("held-out exact match") and hint.fraction == 0, hint


def test_scripted_model_and_simulation_agree():
    """The scripted model's greedy tokens, decoded by the book's solution, are the simulation's."""
    ns = _namespace()
    spec = _specs()["greedy_batch"]
    src, mask = spec.tensors["src"], spec.tensors["src_mask"]
    got = ns["greedy_decode"](ScriptedModel(), src, mask, 8)
    assert torch.equal(got, simulate_greedy(src, mask, 8))
    assert (got == a8_train.EOS).any(dim=1).all()


def test_partial_credit_scale():
    assert partial_fraction(0.95) == partial_fraction(1.0) == 1.0
    assert partial_fraction(0.5) == partial_fraction(0.1) == 0.0
    assert partial_fraction(0.725) == 0.5
    assert partial_fraction(0.94) == 0.9
    hint = PartialHint("below", 0.5)
    case = next(c for c in CHECKER.cases if c.id == "training")
    res = CHECKER.result(case, hint)
    assert not res.passed and res.points == 3.0 and res.max_points == 6.0


BAD = {
    "not implemented": "def build_model(vocab_size):\n    raise NotImplementedError()\n",
    "model is a string": "def build_model(vocab_size):\n    return 'model'\n",
    "model returns a tuple": "def build_model(vocab_size):\n    m = Seq2Seq(vocab_size)\n"
                             "    return nn.Sequential()\n",
    "step returns None": "def train_step(model, optimizer, batch):\n    return None\n",
    "step returns a vector": "def train_step(model, optimizer, batch):\n"
                             "    return torch.ones(3)\n",
    "decoder returns floats": "def greedy_decode(model, src, src_mask, max_len):\n"
                              "    return torch.zeros(src.shape[0], 3)\n",
    "decoder returns a list": "def greedy_decode(model, src, src_mask, max_len):\n"
                              "    return [[EOS] for _ in range(src.shape[0])]\n",
    "decoder returns nothing": "def greedy_decode(model, src, src_mask, max_len):\n    pass\n",
    "train raises": "def train(model, steps, seed):\n    raise RuntimeError('boom')\n",
    "model is None": "build_model = None\n",
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_code_never_raises(name):
    sub = _submission(_namespace(SOLUTION + "\n" + BAD[name]))
    if name == "not implemented":
        assert "not implemented yet" in _judge(sub, "model_shape")
    for case_id in QUICK:
        hint = _judge(sub, case_id)
        assert hint is None or isinstance(hint, str)


def test_missing_functions_are_named():
    ns = _namespace()
    del ns["greedy_decode"]
    sub = ns["train"]  # as the grader finds it: the other functions come from its namespace
    assert _judge(sub, "greedy_batch") == "your notebook defines no `greedy_decode`"
    assert _judge(len, "greedy_batch").startswith("`train` must be a function")


def test_rules_forbid_the_book_loop_decoders_models_and_torch_transformer():
    targets = {(r.target, r.qualname) for r in a8_train.ASSIGNMENT.rules}
    assert targets == {("utils.train", "train"), ("utils.decoding", ""), ("utils.models", ""),
                       ("torch.nn.modules.transformer", "Transformer")}


# ---------------------------------------------------------------------------------------------
# Through the grader: the book's solution, a wrong one and hostile ones, in one run

REVERSED = '''
def greedy_decode(model, src, src_mask, max_len):
    ### BEGIN SOLUTION
    rows = [torch.cat([s[m].flip(0), torch.tensor([EOS])]) for s, m in zip(src, src_mask)]
    out = torch.full((len(rows), max(len(r) for r in rows)), PAD, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out
    ### END SOLUTION
'''
HARD_CODED_TRAIN = '''
def train(model, steps, seed):
    ### BEGIN SOLUTION
    return [0.0] * steps
    ### END SOLUTION
'''
BOOK_DECODER = '''
from utils.decoding import greedy_decode as _book_greedy


def greedy_decode(model, src, src_mask, max_len):
    ### BEGIN SOLUTION
    return _book_greedy(model, src, src_mask, max_len)
    ### END SOLUTION
'''
BOOK_LOOP = '''
import utils.train


def train(model, steps, seed):
    ### BEGIN SOLUTION
    return utils.train.train(model, TASK.batches(BATCH_SIZE, seed=seed), lambda m, b: m(b.src,
        b.tgt_in, b.src_mask, causal_mask(b.tgt_in.shape[1])).sum() * 0, 2, print_fn=None)
    ### END SOLUTION
'''


def _cell_index(name: str) -> int:
    return next(i for i, s in _solution_cells().items() if f"def {name}(" in s)


# The book's own notebook, the honest submission, is graded on its own below (timed, as an
# instructor would grade it), not a second time here.
SUBMITTED = {
    "bad_no_causal": {_cell_index("train_step"): _solution_cells()[_cell_index("train_step")]
                      .replace("causal_mask(tgt.shape[1])", "None")},
    "evil_reversed": {_cell_index("greedy_decode"): REVERSED,
                      _cell_index("train"): HARD_CODED_TRAIN},
    "evil_book_decoder": {_cell_index("greedy_decode"): BOOK_DECODER,
                          _cell_index("train"): HARD_CODED_TRAIN},
    "evil_book_loop": {_cell_index("train"): BOOK_LOOP},
}


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    base = tmp_path_factory.mktemp("a8")
    for student, cells in SUBMITTED.items():
        write_submission(NOTEBOOK, base / "in", student, cells, solution_cells=False)
    start = time.monotonic()
    grade(base / "in", base / "out")
    elapsed = time.monotonic() - start
    with open(base / "out" / "grades.csv", newline="") as f:
        rows = {r["student"]: r for r in csv.DictReader(f)}
    feedback = {s: (base / "out" / "feedback" / s / "a8_train.md").read_text() for s in rows}
    return rows, feedback, elapsed


def test_the_solution_notebook_gets_full_marks_in_under_60_s(tmp_path):
    """The book's notebook alone, through the command line, as an instructor grades it."""
    folder = tmp_path / "in" / "student"
    folder.mkdir(parents=True)
    (folder / "a8_train.ipynb").write_bytes(NOTEBOOK.read_bytes())
    start = time.monotonic()
    grade(tmp_path / "in", tmp_path / "out")
    elapsed = time.monotonic() - start
    with open(tmp_path / "out" / "grades.csv", newline="") as f:
        (row,) = list(csv.DictReader(f))
    assert row["score"] == row["max_score"] == "17", row
    assert row["flags"] == ""
    assert elapsed < 60, elapsed


def test_grades_of_right_wrong_and_hostile_submissions(graded):
    rows, feedback, _ = graded
    bad = rows["bad_no_causal"]
    assert bad["training.step_causal"] == "0" and float(bad["training.training"]) < 6
    assert M["no_causal"].replace("|", "\\|") in feedback["bad_no_causal"]
    evil = rows["evil_reversed"]
    assert evil["training.training"] == "0"
    assert "training changed no parameter" in feedback["evil_reversed"]
    for student, phrase in (("evil_book_decoder", "imports utils.decoding"),
                            ("evil_book_loop", "uses utils.train.train")):
        assert "reference used" in rows[student]["flags"], rows[student]
        assert phrase in feedback[student]
        assert rows[student]["training.training"] == "0"


def test_the_notebook_uses_the_checker_task_and_the_test_set_is_held_out():
    ns = _namespace()
    task = ns["TASK"]
    assert (task.min_len, task.max_len, task.num_symbols) == tuple(a8_train.TASK_ARGS.values())
    assert ns["BATCH_SIZE"] == a8_train.BATCH_SIZE and ns["V"] == a8_train.VOCAB
    spec = _specs()["training"]
    seen = a8_train.training_sources(spec.literals[2])
    rows = {tuple(r[r != a8_train.PAD].tolist()) for r in spec.tensors["src"]}
    assert len(rows) == a8_train.NUM_TEST and not rows & seen
