"""The grader is fair to honest notebooks that use what Jupyter gives them: ``display`` without an
import, ``get_ipython`` imported from IPython (autoreload), ``%%writefile`` then ``%run`` (and
``%run -i``), ``%%writefile`` with a quoted name, a helper under ``@torch.jit.script``
(which reads its source through ``linecache``), about 200 KB of code, and a comparison with the
book's own function in a cell of its own (noted, never voiding the notebook). All graded through
the command line in one run; each asserts the exact score."""

from __future__ import annotations

import builtins
import contextlib
import csv
import inspect
import json
import linecache
import os
import sys
import threading
import time
import types

import pytest
from assignment_grading import grade, write_submission
from grading_submissions import A1_RIGHT
from notebooks import ROOT

from grader import protocol
from utils.checks import ASSIGNMENTS

NOTEBOOK = ROOT / "book" / "assignments" / "a1_attention.ipynb"
SOLUTION = 3  # the solution cell of assignment 1
A1_POINTS = sum(case.points for checker in ASSIGNMENTS["a1_attention"].checkers
                for case in checker.cases)
NO_CELL_ERRORS = "## Errors while your notebook ran"

DISPLAY = '''
out, w = scaled_dot_product_attention(torch.ones(1, 2, 4), torch.ones(1, 3, 4),
                                      torch.ones(1, 3, 5))
display(out.shape)
display(w, out)
handle = display(w, display_id=True)
handle.update(w * 2)
assert display("silent") is None
print(In[-1][:10], len(Out))
'''

HELPER = "%%writefile attention_helper.py\nimport math\n\nimport torch\n" + A1_RIGHT

# Without an import of its own: math and torch come from the notebook, as `%run -i` allows.
SCORES_HELPER = '''%%writefile scores_helper.py

def scores_of(q, k):
    return q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
'''
USES_SCORES = '''%run -i scores_helper.py

def scaled_dot_product_attention(q, k, v, mask=None):
    scores = scores_of(q, k)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
        scores = scores.masked_fill(~mask.any(-1, keepdim=True), 0.0)
        weights = torch.softmax(scores, dim=-1) * mask
    else:
        weights = torch.softmax(scores, dim=-1)
    return weights @ v, weights
'''

JIT = '''
import inspect


@torch.jit.script
def masked_scores(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    scores = scores.masked_fill(~mask, float("-inf"))
    return scores.masked_fill(~mask.any(-1, keepdim=True), 0.0)


def scale(q: torch.Tensor) -> float:
    return 1 / math.sqrt(q.shape[-1])


assert "math.sqrt" in inspect.getsource(scale)  # the rest of the cell runs only if it works


def scaled_dot_product_attention(q, k, v, mask=None):
    scores = q @ k.transpose(-2, -1) * scale(q)
    if mask is not None:
        weights = torch.softmax(masked_scores(scores, mask), dim=-1) * mask
    else:
        weights = torch.softmax(scores, dim=-1)
    return weights @ v, weights
'''

# About 200 KB of honest code: a table of data, with accents (which JSON escapes six-fold).
ROWS = 4200
TABLE = "TABLE = [\n" + "".join(
    f'    ({i}, {i * 0.001:.6f}, "ligne n° {i} — café crème"),\n' for i in range(ROWS)) + \
    f"]\nassert len(TABLE) == {ROWS}\n"

COMPARE = '''
from utils.attention import scaled_dot_product_attention as book_attention

q, k, v = torch.randn(2, 3, 4), torch.randn(2, 5, 4), torch.randn(2, 5, 6)
assert torch.allclose(scaled_dot_product_attention(q, k, v)[0], book_attention(q, k, v)[0])
'''
USES_BOOK = '''
def scaled_dot_product_attention(q, k, v, mask=None):
    return book_attention(q, k, v, mask)
'''

# The usual first cell of a notebook developed with autoreload, through IPython's own import.
AUTORELOAD = '''from IPython import get_ipython

ipython = get_ipython()
ipython.run_line_magic("load_ext", "autoreload")
ipython.run_line_magic("autoreload", "2")
'''

# A quoted file name, as IPython's %%writefile accepts (the quotes are not part of the name).
QUOTED_HELPER = "%%writefile 'quoted_helper.py'\nimport math\n\nimport torch\n" + A1_RIGHT

# student: (source of the solution cell, [(index to insert at, source), ...])
STUDENTS = {
    "honest_display": ('display("my attention")\n' + A1_RIGHT, [(SOLUTION + 1, DISPLAY)]),
    "honest_run": ("%run attention_helper.py\n", [(SOLUTION, HELPER)]),
    "honest_run_i": (USES_SCORES, [(SOLUTION, SCORES_HELPER)]),
    "honest_jit": (JIT, []),
    "honest_autoreload": (AUTORELOAD + A1_RIGHT, []),
    "honest_quoted_writefile": ("from quoted_helper import scaled_dot_product_attention\n",
                                [(SOLUTION, QUOTED_HELPER)]),
    "honest_big": (A1_RIGHT, [(SOLUTION + 1, TABLE)]),
    "honest_compare": (A1_RIGHT, [(SOLUTION + 1, COMPARE)]),
    "uses_book_in_a_case": (USES_BOOK, [(SOLUTION + 1, COMPARE)]),
    "imports_book_as_solution": ("from utils.attention import scaled_dot_product_attention\n",
                                 []),
}


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """Every notebook above graded in one command-line run: (rows, feedback by student)."""
    base = tmp_path_factory.mktemp("honest")
    for student, (solution, extra) in STUDENTS.items():
        write_submission(NOTEBOOK, base / "in", student, {SOLUTION: solution},
                         inserted=extra)
    grade(base / "in", base / "out", "--case-timeout", "2", "--cells-timeout", "20")
    with open(base / "out" / "grades.csv", newline="") as f:
        rows = {r["student"]: r for r in csv.DictReader(f)}
    feedback = {s: (base / "out" / "feedback" / s / "a1_attention.md").read_text()
                for s in rows}
    return rows, feedback


def _full(graded, student):
    rows, feedback = graded
    row = rows[student]
    assert float(row["max_score"]) == A1_POINTS > 0
    assert float(row["score"]) == A1_POINTS, feedback[student]
    assert row["flags"] == "", row["flags"]
    return feedback[student]


@pytest.mark.parametrize("student", [
    "honest_display",  # display without an import
    "honest_run",  # %%writefile, then %run
    "honest_run_i",  # %%writefile, then %run -i in the notebook's namespace
    "honest_autoreload",  # get_ipython imported from IPython
    "honest_quoted_writefile",  # %%writefile with a quoted name
    "honest_jit",  # a helper under torch.jit.script
])
def test_an_honest_notebook_gets_full_marks_and_no_cell_error(graded, student):
    assert NO_CELL_ERRORS not in _full(graded, student)


def test_200_kb_of_code():
    """The start message of this notebook is over the bound on what a child may send."""
    code = TABLE + A1_RIGHT
    assert 180_000 < len(code.encode()) < 240_000
    assert len(json.dumps([code])) > protocol.MAX_HEADER


def test_200_kb_of_code_graded(graded):
    assert NO_CELL_ERRORS not in _full(graded, "honest_big")


def test_a_comparison_with_the_book_in_a_cell_of_its_own(graded):
    """The import fails in the grader and is noted; the rest of the notebook is graded."""
    feedback = _full(graded, "honest_compare")
    assert "imports utils.attention, which this assignment forbids" in feedback, feedback
    assert "ImportError" in feedback  # the comparison cell itself could not run


def test_a_case_that_needs_the_book_loses_its_points(graded):
    rows, feedback = graded
    row = rows["uses_book_in_a_case"]
    assert float(row["score"]) == 0, feedback["uses_book_in_a_case"]
    assert row["flags"] == "reference used"
    assert "imports utils.attention, which this assignment forbids" in feedback[
        "uses_book_in_a_case"]
    assert "NameError" in feedback["uses_book_in_a_case"]


def test_the_books_function_as_the_solution_is_flagged(graded):
    rows, feedback = graded
    row = rows["imports_book_as_solution"]
    assert float(row["score"]) == 0
    assert row["flags"] == "reference used"
    assert "imports utils.attention" in feedback["imports_book_as_solution"]


# ---------------------------------------------------------------------------------------------
# The pieces, in this process (fast)


def test_the_graders_frames_are_not_held_to_the_bound_on_the_childs():
    message = {"op": "start", "cells": ["x = 'é'\n" * 40_000]}  # about 640 KB of JSON
    data = protocol.encode(message)
    for read in (protocol.read_trusted, lambda fd: protocol.Reader(fd).read(time.monotonic() + 60)):
        r, w = os.pipe()
        writer = threading.Thread(target=_write_all, args=(w, data))
        writer.start()
        try:
            if read is protocol.read_trusted:
                assert read(r) == message
            else:  # what a child sends stays bounded
                with pytest.raises(protocol.ProtocolError, match="header larger"):
                    read(r)
        finally:
            os.close(r)
            writer.join()


def _write_all(fd, data):
    with contextlib.suppress(OSError):  # the reader may stop early
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    os.close(fd)


@pytest.fixture
def shell(tmp_path, monkeypatch):
    from grader import ipython_shell as child

    monkeypatch.chdir(tmp_path)
    module = types.ModuleType("__main__")
    monkeypatch.setitem(sys.modules, "__main__", module)
    ns = module.__dict__
    ns["__builtins__"] = builtins
    return child, child.Shell(ns), ns


def test_run_as_ipython_runs_it(shell, capsys):
    child, sh, ns = shell
    sh.run_cell_magic("writefile", "h.py", "import sys\nARGV = sys.argv[1:]\nNAME = __name__\n"
                      "X = 3\n\ndef k():\n    return X\n")
    sh.run_line_magic("run", "h.py a 'b c'")
    assert (ns["ARGV"], ns["NAME"], ns["k"](), "__file__" in ns) == (["a", "b c"], "__main__",
                                                                      3, False)
    sh.run_line_magic("run", "-n h")  # the name without .py; -n: not __main__
    assert ns["NAME"] == "h"
    sh.run_cell_magic("writefile", "i.py", "Y = X + 1\n")
    sh.run_line_magic("run", "-i i.py")  # in the notebook's namespace
    assert ns["Y"] == 4
    sh.run_cell_magic("writefile", "bad.py", "Z = 1\nraise ValueError('boom')\n")
    sh.run_line_magic("run", "bad.py")  # printed, the names kept, the cell goes on
    assert ns["Z"] == 1 and "ValueError: boom" in capsys.readouterr().err
    with pytest.raises(OSError, match="not found"):
        sh.run_line_magic("run", "missing.py")


def test_cells_are_in_linecache_and_display_is_silent(shell, capsys):
    child, _, ns = shell
    src = "def f(x):\n    return x + 1\n"
    exec(compile(src, child.remember_source(src, "<cell 1>"), "exec", dont_inherit=True), ns)
    linecache.checkcache()
    assert inspect.getsource(ns["f"]) == src
    assert child.display(1, 2) is None
    handle = child.display(1, display_id=True)
    assert handle.update(2) is None and handle.display(3) is None
    assert capsys.readouterr() == ("", "")
