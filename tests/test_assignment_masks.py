"""Assignment 3 (masks): the checkers of the three mask functions and of the student's behaviour
tests. The references agree with utils.masks and torch, right code passes, every named mistake is
named, every planted bug is caught by a good test and reported when a test misses it, tests that
reject everything (or pass everything, or peek at names and sources) earn nothing for catching,
bad code never raises; then hand-written submissions graded through the sandboxed grader."""

from __future__ import annotations

import csv
import importlib.util
import inspect

import nbformat
import pytest
import torch
from assignment_grading import grade, write_submission
from notebooks import ROOT
from torch import nn

from utils.checks import (
    ASSIGNMENTS,
    CheckResult,
    check_batch_mask,
    check_batch_mask_test,
    check_causal_mask,
    check_causal_mask_test,
    check_padding_mask,
)
from utils.checks import a3_mask_tests as a3
from utils.checks.a3_mask_tests import planted
from utils.checks.a3_masks import BATCH, CAUSAL, PADDING, Reference
from utils.checks.core import exercise
from utils.masks import causal_mask, combine_masks, padding_mask, padding_to_attention_mask

NOTEBOOK = ROOT / "book" / "assignments" / "a3_masks.ipynb"
FUNCTION_CHECKS = {"causal": (check_causal_mask, CAUSAL), "padding": (check_padding_mask, PADDING),
                   "batch": (check_batch_mask, BATCH)}


def book_batch_mask(lengths, max_len):
    return combine_masks(causal_mask(max_len),
                         padding_to_attention_mask(padding_mask(lengths, max_len)))


def book_causal_mask(length):
    return causal_mask(length) if length else torch.ones(0, 0, dtype=torch.bool)


def _solutions() -> dict:
    """The notebook's own solution cells, run here: the functions and the two tests."""
    ns: dict = {}
    for cell in nbformat.read(NOTEBOOK, as_version=4).cells:
        if cell.cell_type == "code" and not cell.metadata["nbgrader"]["grade"]:
            exec(cell.source, ns)
    return ns


SOL = _solutions()


# ---------------------------------------------------------------------------------------------
# The references


@pytest.mark.parametrize("length", [0, 1, 2, 7])
def test_causal_reference_matches_the_book_and_torch(length):
    want = Reference.causal(length)
    assert want.dtype == torch.bool and torch.equal(want, book_causal_mask(length))
    if length:
        additive = nn.Transformer.generate_square_subsequent_mask(length)
        assert torch.equal(Reference.causal(length, form="additive"), additive)


@pytest.mark.parametrize("lengths, max_len", [([3, 0, 5], 5), ([1, 2], 6), ([4], 4), ([0], 3)])
def test_padding_and_batch_references_match_the_book(lengths, max_len):
    lens = torch.tensor(lengths)
    assert torch.equal(Reference.padding(lens, max_len), padding_mask(lens, max_len))
    assert torch.equal(Reference.batch(lens, max_len), book_batch_mask(lens, max_len))
    for code in range(len(a3.BATCH_BUGS) + 1):  # every planted mask runs on every input
        assert isinstance(planted("batch", code)(lens, max_len), torch.Tensor)
    assert torch.equal(planted("batch", 0)(lens, max_len), book_batch_mask(lens, max_len))


def test_planted_right_implementations_are_right():
    for n in (0, 1, 3, 9):
        assert torch.equal(planted("causal", 0)(n), book_causal_mask(n))


def test_planted_implementations_look_alike():
    """Name, code, source, docstring, defaults: nothing but the output tells them apart."""
    for family, bugs in (("causal", a3.CAUSAL_BUGS), ("batch", a3.BATCH_BUGS)):
        fns = [planted(family, code) for code in range(len(bugs) + 1)]
        first = fns[0]
        for fn in fns[1:]:
            assert fn.__name__ == first.__name__ and fn.__qualname__ == first.__qualname__
            assert fn.__code__ is first.__code__ and fn.__doc__ == first.__doc__
            assert fn.__defaults__ == first.__defaults__ and fn.__module__ == first.__module__
            assert inspect.getsource(fn) == inspect.getsource(first)


def test_the_off_by_one_bug_is_planted_in_both_tests():
    assert "sees_next" in a3.CAUSAL_BUGS and "sees_next" in a3.BATCH_BUGS
    mask = planted("causal", a3._CAUSAL_CODES.index("sees_next"))(4)
    assert bool(mask[1, 2]) and not bool(mask[1, 3])  # t sees t + 1, not t + 2


# ---------------------------------------------------------------------------------------------
# The mask functions' checkers


def test_right_code_passes(capsys):
    for result in (check_causal_mask(book_causal_mask), check_padding_mask(padding_mask),
                   check_batch_mask(book_batch_mask), check_causal_mask(SOL["causal_mask"]),
                   check_padding_mask(SOL["padding_mask"]), check_batch_mask(SOL["batch_mask"]),
                   check_causal_mask(lambda n: torch.ones(n, n, dtype=torch.bool).tril()),
                   check_batch_mask_test(SOL["test_batch_mask"]),
                   check_causal_mask_test(SOL["test_causal_mask"])):
        assert result.passed and result.points == result.max_points
    assert "[FAIL]" not in capsys.readouterr().out


def _mistake_params():
    out = []
    for family, (_, checker) in FUNCTION_CHECKS.items():
        for m in checker.mistakes:
            out.append(pytest.param(family, m, id=f"{family}-{m.hint[:40]}"))
    return out


@pytest.mark.parametrize("family, mistake", _mistake_params())
def test_every_named_mistake_is_named(family, mistake):
    """Each mistake, as the reference reproduces it, fails and gets its own hint."""
    check, _ = FUNCTION_CHECKS[family]
    if family == "causal":
        def fn(length):
            return Reference.causal(length, **mistake.options)
    else:
        method = getattr(Reference, family)

        def fn(lengths, max_len):
            return method(lengths, max_len, **mistake.options)
    result = check(fn, verbose=False)
    assert not result.passed
    assert mistake.hint in result.hints, result.hints


HANDWRITTEN = {  # mistakes as a student writes them, and the phrase of the hint
    "causal": [
        (lambda n: torch.ones(n, n, dtype=torch.bool).tril(1), "query t may also see key t + 1"),
        (lambda n: torch.ones(n, n, dtype=torch.bool).tril(-1), "the diagonal is blocked"),
        (lambda n: torch.ones(n, n, dtype=torch.bool).triu(), "the upper triangle"),
        (lambda n: torch.ones(n, n).tril(), "a float mask"),
        (lambda n: torch.ones(n, n, dtype=torch.bool).triu(1), "polarity inverted"),
        (lambda n: nn.Transformer.generate_square_subsequent_mask(n) if n else torch.zeros(0, 0),
         "additive float mask"),
        (lambda n: torch.ones(1, n, n, dtype=torch.bool).tril(), "extra leading axis"),
        (lambda n: torch.ones(n, n, dtype=torch.long).tril(), "integer mask"),
        (lambda n: torch.rand(n, n) > 2, "every entry is False"),
    ],
    "padding": [
        (lambda lens, m: torch.arange(m)[None, :] >= lens[:, None], "polarity inverted"),
        (lambda lens, m: torch.arange(m)[None, :] >= m - lens[:, None], "wrong end"),
        (lambda lens, m: torch.arange(m)[None, :] <= lens[:, None], "first padding position"),
        (lambda lens, m: torch.arange(int(lens.max()))[None, :] < lens[:, None],
         "max_len is ignored"),
        (lambda lens, m: torch.arange(m)[:, None] < lens[None, :], "transposed"),
        (lambda lens, m: (torch.arange(m)[None, :] < lens[:, None]).float(), "float mask"),
    ],
    "batch": [
        (lambda lens, m: torch.ones(m, m, dtype=torch.bool).tril(1)
         & padding_mask(lens, m)[:, None, None, :], "query t may also see key t + 1"),
        (lambda lens, m: causal_mask(m) & padding_mask(lens, m)[:, None, :, None],
         "applied to the queries (rows)"),
        (lambda lens, m: causal_mask(m) | padding_mask(lens, m)[:, None, None, :],
         "combined with OR"),
        (lambda lens, m: causal_mask(m) & padding_mask(lens, m)[:, None, :],
         "no head axis"),
        (lambda lens, m: causal_mask(m).expand(len(lens), 1, m, m), "the padding is ignored"),
        (lambda lens, m: causal_mask(m) & padding_mask(lens, m)[:, None, None, :]
         & padding_mask(lens, m)[:, None, :, None], "applied to the queries (rows), alone or"),
    ],
}


@pytest.mark.parametrize("family, index", [(f, i) for f, v in HANDWRITTEN.items()
                                           for i in range(len(v))])
def test_handwritten_mistakes_are_named(family, index):
    fn, phrase = HANDWRITTEN[family][index]
    result = FUNCTION_CHECKS[family][0](fn, verbose=False)
    assert not result.passed and any(phrase in h for h in result.hints), result.hints


def test_unknown_mistakes_are_located():
    def odd(length):
        mask = torch.ones(length, length, dtype=torch.bool).tril()
        if length > 3:
            mask[3, 1] = False
        return mask

    result = check_causal_mask(odd, verbose=False)
    assert any("mask[3, 1], which should be True" in h for h in result.hints), result.hints


def test_lengths_changed_in_place_are_caught():
    def in_place(lengths, max_len):
        lengths.clamp_(max=max_len - 1)  # changes the caller's tensor when a sequence is full
        return torch.arange(max_len)[None, :] < lengths[:, None]

    result = check_padding_mask(in_place, verbose=False)
    assert any("changes its input `lengths` in place" in h for h in result.hints), result.hints


# ---------------------------------------------------------------------------------------------
# The behaviour tests' checkers


def _test_that_misses(family: str, bug: str):
    """A good test except that it takes the planted ``bug`` for right."""
    codes = a3._CAUSAL_CODES if family == "causal" else a3._BATCH_CODES
    good, blind = planted(family, 0), planted(family, codes.index(bug))
    inputs = ([(n,) for n in (1, 2, 5, 12)] if family == "causal" else
              [(torch.tensor(lens), m) for lens, m in [([4, 2, 0], 4), ([1, 3], 6), ([5], 5)]])

    def same(a, b):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)

    def test(fn):
        for args in inputs:
            got = fn(*args)
            assert same(got, good(*args)) or same(got, blind(*args))
    return test


@pytest.mark.parametrize("family, bug", [("causal", b) for b in a3.CAUSAL_BUGS]
                         + [("batch", b) for b in a3.BATCH_BUGS])
def test_every_planted_bug_is_caught_and_reported_when_missed(family, bug):
    check = check_causal_mask_test if family == "causal" else check_batch_mask_test
    bugs = a3.CAUSAL_BUGS if family == "causal" else a3.BATCH_BUGS
    result = check(_test_that_misses(family, bug), verbose=False)
    failed = [c for c in result.cases if not c.passed]
    assert [c.case_id for c in failed] == [bug]
    assert failed[0].hint == f"your test lets through {bugs[bug]}"
    assert result.points == result.max_points - 1
    assert result.cases[-1].case_id == "accepts_right" and result.cases[-1].passed


def test_the_solution_test_needs_long_sequences_and_short_batches():
    """The bugs that show only on some inputs are missed by a test that tries too few."""
    def short_only(fn):
        for n in (1, 2, 3):
            assert torch.equal(fn(n), torch.ones(n, n, dtype=torch.bool).tril())

    def full_only(fn):
        lens = torch.tensor([4, 4])
        assert torch.equal(fn(lens, 4), torch.ones(2, 1, 4, 4, dtype=torch.bool).tril())

    causal = check_causal_mask_test(short_only, verbose=False)
    # torch.equal compares values across dtypes, so a float mask slips through it as well
    assert {c.case_id for c in causal.cases if not c.passed} == {"late_leak", "float"}
    batch = check_batch_mask_test(full_only, verbose=False)
    assert {"no_padding", "max_len", "queries", "one_more"} <= {
        c.case_id for c in batch.cases if not c.passed}


def _always_fails(fn):
    raise AssertionError("everything is wrong")


def _always_passes(fn):
    return None


def _peeks_at_the_name(fn):
    assert fn.__name__ in ("causal_mask", "batch_mask")
    assert "tril" in inspect.getsource(fn)  # a right mask in the student's own style


def _peeks_at_the_source(fn):
    assert "sees_next" not in inspect.getsource(fn) and "t + 1" not in (fn.__doc__ or "")


def _stateful(fn, calls=[]):  # noqa: B006 (the state is the point)
    calls.append(1)
    assert len(calls) == 1


def _crashes(fn):
    fn("five")  # a TypeError on every implementation


@pytest.mark.parametrize("test", [_always_fails, _peeks_at_the_name, _stateful, _crashes])
def test_a_test_that_rejects_the_right_mask_earns_nothing(test):
    for check in (check_causal_mask_test, check_batch_mask_test):
        result = check(test, verbose=False)
        assert result.points == 0, [c.line() for c in result.cases]
        assert all("fails the correct implementation" in h for h in result.hints)


@pytest.mark.parametrize("test", [_always_passes, _peeks_at_the_source])
def test_a_test_that_passes_everything_catches_nothing(test):
    for check in (check_causal_mask_test, check_batch_mask_test):
        result = check(test, verbose=False)
        assert [c.case_id for c in result.cases if c.passed] == ["accepts_right"]
        assert result.points == 0


def test_every_case_mixes_right_and_wrong_in_random_order():
    orders = set()
    for checker in (a3.CAUSAL_TEST, a3.BATCH_TEST):
        for seed in (1, 2, 3):
            for case, spec in zip(checker.cases, checker.specs(seed), strict=True):
                family, n = spec.literals
                codes = spec.config["codes"]  # the trusted side's: never sent to the child
                assert n == len(codes) and codes.count(0) >= 2
                if case.id != "accepts_right":
                    assert len(set(codes)) == 2 and codes.count(0) == 2
                orders.add(codes.index(0))
    assert len(orders) > 1  # the right copies are not always first


def test_the_judge_survives_a_forged_result():
    checker, spec = a3.CAUSAL_TEST, a3.CAUSAL_TEST.specs()[0]
    n = spec.literals[1]
    forged = [{"outcomes": torch.zeros(n + 1, dtype=torch.int64)},
              {"outcomes": torch.full((n,), 7, dtype=torch.int64)},
              {"outcomes": torch.zeros(n)},
              {}]
    for tensors in forged:
        raw = {"status": "ok", "message": "", "notes": [],
               "tensors": {f"out:{k}": v for k, v in tensors.items()}
               | {"out:errors": torch.zeros(n, a3.ERROR_BYTES, dtype=torch.uint8)}}
        assert checker.judge(spec, raw) == "the result of running your test could not be read"


def test_the_runner_returns_outcomes_only():
    spec = a3.CAUSAL_TEST.specs()[0]
    raw = exercise(SOL["test_causal_mask"], spec)
    assert raw["status"] == "ok"
    assert set(raw["tensors"]) == {"out:outcomes", "out:errors"}
    assert raw["tensors"]["out:outcomes"].dtype == torch.int64


BAD = {
    "None": lambda *a, **k: None,
    "a string": lambda *a, **k: "mask",
    "NotImplementedError": lambda *a, **k: (_ for _ in ()).throw(NotImplementedError()),
    "sys.exit": lambda *a, **k: (_ for _ in ()).throw(SystemExit(1)),
    "KeyboardInterrupt": lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt()),
    "NaN": lambda *a, **k: torch.full((2, 5, 4), float("nan")),
    "complex": lambda *a, **k: torch.zeros(2, 2, dtype=torch.complex64),
    "a tuple": lambda *a, **k: (torch.ones(3, 3, dtype=torch.bool),) * 2,
    "not callable": 42,
}


@pytest.mark.parametrize("bad", list(BAD))
def test_bad_code_never_raises(bad, capsys):
    for check in (check_causal_mask, check_padding_mask, check_batch_mask,
                  check_causal_mask_test, check_batch_mask_test):
        result = check(BAD[bad])
        assert isinstance(result, CheckResult)
        assert result.passed is False and result.points == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert all(ln.startswith(("[FAIL] ", "check_", "[PASS] your test passes the correct", " " * 7))
               for ln in lines)


def test_a_stub_is_not_implemented_yet():
    def stub(*args):
        raise NotImplementedError()

    for check in (check_causal_mask, check_padding_mask, check_batch_mask,
                  check_causal_mask_test, check_batch_mask_test):
        result = check(stub, verbose=False)
        assert result.points == 0 and all("not implemented yet" in h for h in result.hints)


def test_the_notebook_check_cells_are_worth_the_checkers_points():
    points = {c.name: sum(case.points for case in c.cases)
              for c in ASSIGNMENTS["a3_masks"].checkers}
    assert points == {"check_causal_mask": 5, "check_padding_mask": 5, "check_batch_mask": 6,
                      "check_causal_mask_test": 9, "check_batch_mask_test": 11}
    assert all(len({m.hint for m in c.mistakes}) >= 8 for c in ASSIGNMENTS["a3_masks"].checkers)


# ---------------------------------------------------------------------------------------------
# Grading through the sandbox: right, wrong and hostile submissions

SCRIPT = ROOT / "scripts" / "grade_assignments.py"
_spec = importlib.util.spec_from_file_location("grade_assignments", SCRIPT)
grade_assignments = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(grade_assignments)

CELLS = {"causal": 3, "padding": 6, "batch": 9, "test_causal": 13, "test_batch": 16}

VECTORIZED = {
    "causal": '''
def causal_mask(length):
    return torch.ones(length, length, dtype=torch.bool).tril()
''',
    "batch": '''
def batch_mask(lengths, max_len):
    i = torch.arange(max_len).view(1, 1, -1, 1)
    j = torch.arange(max_len).view(1, 1, 1, -1)
    return (j <= i) & (j < lengths.view(-1, 1, 1, 1))
''',
    "test_causal": '''
def test_causal_mask(causal_mask_fn):
    for n in range(0, 11):
        want = torch.tensor([[j <= i for j in range(n)] for i in range(n)], dtype=torch.bool)
        got = causal_mask_fn(n)
        assert got.dtype == torch.bool and got.shape == (n, n) and torch.equal(got, want.view(n, n))
''',
}
OFF_BY_ONE = '''
def causal_mask(length):
    return torch.ones(length, length, dtype=torch.bool).tril(1)
'''
WEAK_TEST = '''
def test_batch_mask(batch_mask_fn):
    mask = batch_mask_fn(torch.tensor([3, 3]), 3)
    assert mask.dtype == torch.bool and mask.shape == (2, 1, 3, 3)
    assert torch.equal(mask[0, 0], torch.ones(3, 3, dtype=torch.bool).tril())
'''
PEEKS = '''
import inspect

def test_causal_mask(causal_mask_fn):
    assert causal_mask_fn.__name__ == "causal_mask"
    assert "tril" in inspect.getsource(causal_mask_fn)
'''
RAISES = '''
def test_batch_mask(batch_mask_fn):
    raise AssertionError("wrong")
'''
REFERENCE = '''
from utils.masks import causal_mask
'''
CHECKER_REFERENCE = '''
from utils.checks.a3_masks import Reference

def padding_mask(lengths, max_len):
    return Reference.padding(lengths, max_len)
'''
TORCH_CAUSAL = '''
from torch import nn

def causal_mask(length):
    return nn.Transformer.generate_square_subsequent_mask(length) == 0
'''

# student: ({cell: source}, {column: expected points or None for "below full"}, phrase)
A3_SUBMISSIONS = {
    "ok_a3_book": ({}, {}, ""),
    "ok_a3_vectorized": ({CELLS[k]: v for k, v in VECTORIZED.items()}, {}, ""),
    "bad_a3_off_by_one": ({CELLS["causal"]: OFF_BY_ONE}, {"causal_mask.length_5": 0},
                          "query t may also see key t + 1"),
    "bad_a3_weak_test": ({CELLS["test_batch"]: WEAK_TEST},
                         {"batch_mask_test.no_padding": 0, "batch_mask_test.sees_next": 1},
                         "your test lets through a batch mask that ignores the lengths"),
    "evil_a3_peeks_at_name_and_source": (
        {CELLS["test_causal"]: PEEKS},
        {"causal_mask_test.sees_next": 0, "causal_mask_test.accepts_right": 0},
        "your test fails the correct implementation"),
    "evil_a3_always_raises": ({CELLS["test_batch"]: RAISES},
                              {"batch_mask_test.sees_next": 0, "batch_mask_test.or": 0,
                               "batch_mask_test.accepts_right": 0},
                              "your test fails the correct implementation"),
    "evil_a3_reference": ({CELLS["causal"]: REFERENCE}, {"causal_mask.length_5": 0},
                          "imports utils.masks"),
    "evil_a3_checker_reference": ({CELLS["padding"]: CHECKER_REFERENCE},
                                  {"padding_mask.one_full": 0},
                                  "uses the checker's own reference masks"),
    "evil_a3_torch_causal": ({CELLS["causal"]: TORCH_CAUSAL}, {"causal_mask.length_5": 0},
                             "generate_square_subsequent_mask"),
}


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    base = tmp_path_factory.mktemp("grading_a3")
    submitted, out = base / "submitted", base / "out"
    for student, (cells, _, _) in A3_SUBMISSIONS.items():
        write_submission(NOTEBOOK, submitted, student, cells)
    grade(submitted, out, "--case-timeout", "2", "--cells-timeout", "20")
    with open(out / "grades.csv", newline="") as f:
        rows = {r["student"]: r for r in csv.DictReader(f)}
    return out, rows


@pytest.mark.parametrize("student", list(A3_SUBMISSIONS))
def test_each_a3_submission_gets_what_it_deserves(graded, student):
    out, rows = graded
    _, columns, phrase = A3_SUBMISSIONS[student]
    row = rows[student]
    feedback = (out / "feedback" / student / "a3_masks.md").read_text()
    score, top = float(row["score"]), float(row["max_score"])
    assert top == 36
    if not phrase:
        assert score == top and "FAIL" not in feedback and row["flags"] == "", feedback
    else:
        assert score < top and phrase in feedback, feedback
    for column, points in columns.items():
        assert float(row[column]) == points, (column, feedback)


def test_hostile_tests_earn_nothing_for_catching(graded):
    _, rows = graded
    for student, prefix, worth in (("evil_a3_peeks_at_name_and_source", "causal_mask_test.", 9),
                                   ("evil_a3_always_raises", "batch_mask_test.", 11)):
        row = rows[student]
        assert sum(float(v) for k, v in row.items() if k.startswith(prefix)) == 0
        assert float(row["score"]) == 36 - worth, row  # the rest of the notebook is fine


def test_references_are_flagged(graded):
    _, rows = graded
    assert "reference used" in rows["evil_a3_reference"]["flags"]
    assert "reference used" in rows["evil_a3_checker_reference"]["flags"]
    assert "reference used" in rows["evil_a3_torch_causal"]["flags"]
    assert float(rows["evil_a3_torch_causal"]["causal_mask_test.sees_next"]) == 1  # not the tests
    for student in A3_SUBMISSIONS:
        if student.startswith(("ok_", "bad_")):
            assert rows[student]["flags"] == "", student
