"""The grader is fair to the honest: a notebook is found whatever the browser or Jupyter named
its copy, or the student renamed it to; a notebook that cannot be read or placed is reported,
never dropped; nothing a file is (a FIFO, a link) makes the grader wait or follow it; a comment
never drops a student's cell; IPython syntax runs as in Jupyter; the outputs are written whole.

Fast: the sandbox is not started (the one run of the command line grades with a stand-in)."""

from __future__ import annotations

import contextlib
import csv
import importlib.util
import json
import os
import resource
import threading
import time
from pathlib import Path

import nbformat
import pytest
from notebooks import ROOT

from grader import notebook_json, notebook_reading
from grader.notebook_reading import (
    MAX_NOTEBOOK_BYTES,
    UnreadableNotebook,
    code_cells,
    ipython_source,
    read_notebook,
    read_notebook_bytes,
)
from grader.sandbox import SubmissionResult
from grader.submissions import Placed, assignment_of, find_submissions, name_match
from utils.checks import ASSIGNMENTS
from utils.checks.results import CheckResult

NAMES = list(ASSIGNMENTS)


def _load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


grade_assignments = _load("grade_assignments")
make_assignments = _load("make_assignments")


def _notebook(*sources: str, assignment: str | None = None, grade_ids: str | None = None):
    """A v4 notebook with a code cell per source; the metadata of ``assignment`` and nbgrader
    grade ids ``<grade_ids>-code-<i>`` when given."""
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in sources])
    if assignment:
        nb.metadata["tested_transformer"] = {"assignment": assignment}
    if grade_ids:
        for i, cell in enumerate(nb.cells):
            cell.metadata["nbgrader"] = {"grade": False, "solution": True, "locked": False,
                                         "grade_id": f"{grade_ids}-code-{i}",
                                         "schema_version": 3, "task": False}
    return nb


def _write(path: Path, nb=None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb if nb is not None else _notebook("x = 1"), path)
    return path


def _placed(found: list[Placed]) -> dict[tuple[str, str], Placed]:
    return {(p.student, p.assignment): p for p in found}


# ---------------------------------------------------------------------------------------------
# Which assignment


@pytest.mark.parametrize("filename", [
    "a1_attention.ipynb", "a1_attention (1).ipynb", "A1_ATTENTION.ipynb",
    "a1_attention-Copy1.ipynb", "a1 attention.ipynb", "A1_Attention (1).ipynb", "A1.ipynb",
    "a1_attention.IPYNB", "a1_attention - Copy (2).ipynb", "a1_attention_copy2.ipynb",
    "Copy of a1_attention.ipynb", "a1_attention_final.ipynb", "a1-attention copy.ipynb",
])
def test_copies_and_case_are_placed_by_file_name(tmp_path, filename):
    _write(tmp_path / "ada" / filename)
    placed, unplaced = find_submissions(tmp_path, NAMES)
    assert [(p.student, p.assignment, p.how, p.path.name) for p in placed] == [
        ("ada", "a1_attention", "file name", filename)]
    assert unplaced == [] and placed[0].notes == [] and placed[0].unreadable is None


@pytest.mark.parametrize("stem, expected", [
    ("a10", None), ("notes", None), ("homework", None), ("a1x", None), ("untitled", None),
    ("a2", "a2_multi_head_attention"), ("A8_train (3)", "a8_train"), ("a3-masks", "a3_masks"),
    ("a4", "a4_positional_encoding_layer_norm"), ("a01", "a1_attention"), ("", None),
])
def test_the_file_name_rule(stem, expected):
    assert name_match(stem, NAMES) == expected


def test_metadata_then_cell_ids_then_file_name_then_folder():
    both = _notebook("x = 1", assignment="a2_multi_head_attention", grade_ids="a3_masks")
    assert assignment_of(both, "a1_attention.ipynb", "a4", NAMES) == (
        "a2_multi_head_attention", "metadata")
    ids = _notebook("x = 1", "y = 2", grade_ids="a3_masks")
    assert assignment_of(ids, "a1_attention.ipynb", None, NAMES) == ("a3_masks", "cell ids")
    plain = _notebook("x = 1")
    assert assignment_of(plain, "a1_attention.ipynb", "a4", NAMES) == (
        "a1_attention", "file name")
    assert assignment_of(plain, "solution.ipynb", "A4 (1)", NAMES) == (
        "a4_positional_encoding_layer_norm", "folder name")
    name, reason = assignment_of(plain, "solution.ipynb", "week 3", NAMES)
    assert name is None and "says which assignment" in reason
    unknown = _notebook("x = 1", assignment="a9_nothing", grade_ids="z9")
    assert assignment_of(unknown, "a5.ipynb", None, NAMES) == ("a5_feed_forward", "file name")


def test_the_most_common_cell_id_prefix_wins_and_a_tie_decides_nothing():
    nb = _notebook("a", "b", "c", "d", grade_ids="a3_masks")
    nb.cells[3].metadata["nbgrader"]["grade_id"] = "a1_attention-code-9"
    assert assignment_of(nb, "x.ipynb", None, NAMES) == ("a3_masks", "cell ids")
    nb.cells[2].metadata["nbgrader"]["grade_id"] = "a1_attention-code-8"
    assert assignment_of(nb, "x.ipynb", None, NAMES)[0] is None  # two against two
    nb.cells[0].metadata["nbgrader"] = "not a dict"
    assert assignment_of(nb, "x.ipynb", None, NAMES) == ("a1_attention", "cell ids")
    weird = {"metadata": [], "cells": [5, {"metadata": {"nbgrader": {"grade_id": 3}}}]}
    assert assignment_of(weird, "a6.ipynb", None, NAMES) == ("a6_encoder_layer", "file name")


def test_a_renamed_notebook_is_placed_by_its_metadata(tmp_path):
    _write(tmp_path / "ada" / "homework.ipynb", _notebook("x = 1", assignment="a7_decoder_layer"))
    placed, unplaced = find_submissions(tmp_path, NAMES)
    assert not unplaced and len(placed) == 1
    p = placed[0]
    assert (p.assignment, p.how) == ("a7_decoder_layer", "metadata")
    assert p.notes == ["graded as a7_decoder_layer, as the notebook's metadata says (its file "
                       "is homework.ipynb)"]


def test_a_renamed_notebook_without_metadata_is_placed_by_its_cell_ids(tmp_path):
    nb = nbformat.read(ROOT / "book" / "assignments" / "a3_masks.ipynb", as_version=4)
    del nb.metadata["tested_transformer"]
    _write(tmp_path / "ada" / "homework.ipynb", nb)
    placed, unplaced = find_submissions(tmp_path, NAMES)
    assert not unplaced
    assert [(p.assignment, p.how) for p in placed] == [("a3_masks", "cell ids")]
    assert "nbgrader ids" in placed[0].notes[0]


def test_the_metadata_says_nothing_when_the_name_says_the_same(tmp_path):
    _write(tmp_path / "ada" / "a1_attention (2).ipynb", _notebook("x", assignment="a1_attention"))
    placed, _ = find_submissions(tmp_path, NAMES)
    assert placed[0].how == "metadata" and placed[0].notes == []


def test_nbgraders_layout_uses_the_folder_name(tmp_path):
    _write(tmp_path / "bo" / "a2_multi_head_attention" / "my work.ipynb")
    _write(tmp_path / "bo" / "a5" / "a5_feed_forward.ipynb")
    placed, unplaced = find_submissions(tmp_path, NAMES)
    assert not unplaced
    assert [(p.assignment, p.how) for p in placed] == [
        ("a2_multi_head_attention", "folder name"), ("a5_feed_forward", "file name")]


# ---------------------------------------------------------------------------------------------
# The handed-in folder


def test_one_row_per_assignment_the_newest_graded_the_others_noted(tmp_path):
    old = _write(tmp_path / "ada" / "a1_attention.ipynb")
    new = _write(tmp_path / "ada" / "a1_attention (1).ipynb")
    third = _write(tmp_path / "ada" / "a1_attention" / "A1.ipynb")
    os.utime(old, ns=(10**18, 3 * 10**18))
    os.utime(new, ns=(10**18, 2 * 10**18))
    os.utime(third, ns=(10**18, 1 * 10**18))
    placed, unplaced = find_submissions(tmp_path, NAMES)
    assert not unplaced and len(placed) == 1
    p = placed[0]
    assert p.path == old
    assert p.notes == [
        "also handed in: a1_attention (1).ipynb, not graded: the newest one is graded",
        "also handed in: a1_attention/A1.ipynb, not graded: the newest one is graded"]
    assert sorted(p.others) == sorted([new, third])
    os.utime(new, ns=(10**18, 3 * 10**18))  # a tie: the larger path name, every time
    assert find_submissions(tmp_path, NAMES)[0][0].path == max(old, new, key=str)


def test_a_readable_notebook_is_graded_before_a_newer_unreadable_one(tmp_path):
    good = _write(tmp_path / "ada" / "a1_attention.ipynb")
    bad = tmp_path / "ada" / "a1_attention (1).ipynb"
    bad.write_text("{oops")
    os.utime(good, ns=(10**18, 10**18))
    placed, _ = find_submissions(tmp_path, NAMES)
    assert placed[0].path == good and placed[0].unreadable is None
    assert placed[0].notes == ["also handed in: a1_attention (1).ipynb, not graded: it cannot be "
                               "read: not valid JSON (line 1: Expecting property name enclosed "
                               "in double quotes)"]


def test_every_notebook_is_placed_or_reported(tmp_path):
    _write(tmp_path / "ada" / "a1_attention.ipynb")
    _write(tmp_path / "ada" / "notes.ipynb")  # readable, no assignment
    (tmp_path / "ada" / "scratch.ipynb").write_bytes(b"\xff\xfe")  # unreadable, no assignment
    (tmp_path / "ada" / "README.md").write_text("hello")  # not a notebook: ignored
    (tmp_path / "ada" / "data.json").write_text("{}")
    _write(tmp_path / "ada" / ".ipynb_checkpoints" / "a2-checkpoint.ipynb")  # hidden: skipped
    _write(tmp_path / "ada" / ".hidden.ipynb")
    _write(tmp_path / ".trash" / "a3_masks.ipynb")
    _write(tmp_path / "ada" / "zip" / "a4" / "a4.ipynb")  # too deep
    _write(tmp_path / "loose.ipynb")  # outside every student's folder
    (tmp_path / "README.txt").write_text("x")
    placed, unplaced = find_submissions(tmp_path, NAMES)
    assert [(p.student, p.assignment) for p in placed] == [("ada", "a1_attention")]
    got = {(u.student, u.relative): u.reason for u in unplaced}
    assert set(got) == {("ada", "notes.ipynb"), ("ada", "scratch.ipynb"),
                        ("ada", "zip/a4/a4.ipynb"), ("", "loose.ipynb")}
    assert "says which assignment" in got[("ada", "notes.ipynb")]
    assert got[("ada", "scratch.ipynb")].startswith("cannot be read: not UTF-8")
    assert got[("ada", "zip/a4/a4.ipynb")].startswith("too deep")
    assert "outside every student's folder" in got[("", "loose.ipynb")]
    assert [u.label() for u in unplaced] == [
        "loose.ipynb", "ada/notes.ipynb", "ada/scratch.ipynb", "ada/zip/a4/a4.ipynb"]


def _in_thread(fn, timeout=10.0):
    """``fn()`` in a thread joined with a timeout: a call that blocks fails the test."""
    box: dict = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed to the test
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    start = time.monotonic()
    thread.start()
    thread.join(timeout)
    return thread, box, time.monotonic() - start


def _release(fifo: Path) -> None:
    """Unblock a reader stuck on ``fifo`` (only when the code under test failed)."""
    try:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass


@contextlib.contextmanager
def _fifo_found(tmp_path: Path, name: str):
    """A FIFO ``ada/<name>`` handed in: yields (placed, unplaced, seconds) of `find_submissions`
    run in a thread, after checking that reading the FIFO did not block."""
    fifo = tmp_path / "ada" / name
    fifo.parent.mkdir()
    os.mkfifo(fifo)
    try:
        thread, box, took = _in_thread(lambda: find_submissions(tmp_path, NAMES))
        assert not thread.is_alive(), "reading the FIFO blocked"
        assert "error" not in box
        yield (*box["value"], took)
    finally:
        _release(fifo)


def test_a_fifo_named_like_a_notebook_is_refused_without_waiting(tmp_path):
    with _fifo_found(tmp_path, "a1_attention.ipynb") as (placed, unplaced, took):
        assert took < 5
        assert not unplaced and len(placed) == 1
        assert placed[0].assignment == "a1_attention"
        assert placed[0].unreadable == "a FIFO, not a regular file"
        with pytest.raises(UnreadableNotebook, match="a FIFO, not a regular file"):
            read_notebook_bytes(tmp_path / "ada" / "a1_attention.ipynb")


def test_a_fifo_with_another_name_is_reported(tmp_path):
    with _fifo_found(tmp_path, "untitled.ipynb") as (placed, unplaced, _):
        assert placed == [] and [u.reason for u in unplaced] == [
            "cannot be read: a FIFO, not a regular file"]


def test_symbolic_links_are_never_followed(tmp_path):
    elsewhere = _write(tmp_path / "elsewhere" / "a1_attention.ipynb")
    submitted = tmp_path / "submitted"
    (submitted / "ada").mkdir(parents=True)
    (submitted / "ada" / "a1_attention.ipynb").symlink_to(elsewhere)
    (submitted / "ada" / "a2").symlink_to(elsewhere.parent, target_is_directory=True)
    (submitted / "bo").symlink_to(elsewhere.parent, target_is_directory=True)
    with pytest.raises(UnreadableNotebook, match="a symbolic link"):
        read_notebook_bytes(submitted / "ada" / "a1_attention.ipynb")
    placed, unplaced = find_submissions(submitted, NAMES)
    assert [(p.student, p.assignment) for p in placed] == [("ada", "a1_attention")]
    assert placed[0].unreadable.startswith("a symbolic link")
    got = {(u.student, u.relative): u.reason for u in unplaced}
    assert set(got) == {("ada", "a2"), ("bo", "")}
    assert "symbolic link" in got[("ada", "a2")] and "symbolic link" in got[("bo", "")]


def test_a_file_name_with_a_newline_is_shown_on_one_line(tmp_path):
    _write(tmp_path / "ada" / "notes\nmore.ipynb")
    _, unplaced = find_submissions(tmp_path, NAMES)
    assert [u.label() for u in unplaced] == ["ada/notes\\nmore.ipynb"]


# ---------------------------------------------------------------------------------------------
# Reading


def test_an_nbformat_3_notebook_is_converted(tmp_path):
    v3 = nbformat.v3
    old = v3.new_notebook(worksheets=[v3.new_worksheet(cells=[
        v3.new_text_cell("markdown", source="# Assignment 1"),
        v3.new_code_cell(input="import torch\ny = 2")])])
    path = tmp_path / "ada" / "a1_attention.ipynb"
    path.parent.mkdir()
    path.write_text(v3.writes_json(old))
    assert json.loads(path.read_text())["nbformat"] == 3
    nb = read_notebook(path)
    assert nb["nbformat"] == 4 and type(nb) is dict and type(nb["cells"][0]) is dict
    assert [c["cell_type"] for c in nb["cells"]] == ["markdown", "code"]
    assert code_cells(nb) == ["import torch\ny = 2"]
    placed, unplaced = find_submissions(tmp_path, NAMES)
    assert not unplaced and placed[0].unreadable is None


def test_sources_split_in_lines_are_joined(tmp_path):
    path = _write(tmp_path / "a.ipynb", _notebook("x = 1\ny = 2\n"))
    assert isinstance(json.loads(path.read_text())["cells"][0]["source"], list)
    assert read_notebook(path)["cells"][0]["source"] == "x = 1\ny = 2\n"


def test_a_byte_order_mark_is_allowed(tmp_path):
    path = _write(tmp_path / "a.ipynb")
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    assert read_notebook(path)["cells"][0]["source"] == "x = 1"


@pytest.mark.parametrize("data, reason", [
    (b'{\n "cells": [],\n oops\n}', "not valid JSON (line 3"),
    (b"[" * 20000 + b"]" * 20000, "nested too deeply"),
    (b'{"cells": [], "x": "caf\xe9"}', "not UTF-8 text (byte 0xe9 at offset 23)"),
    (b"", "an empty file"),
    (b"[1, 2]", "its JSON is a list"),
    (b'{"nbformat": 4, "nbformat_minor": 5, "metadata": {}}', "no list of cells"),
    (b'{"nbformat": 4, "nbformat_minor": 5, "metadata": {}, "cells": "x"}', "no list of cells"),
    (b'{"metadata": {}}', "no nbformat version"),
    (b'{"nbformat": 5, "cells": []}', "nbformat 5 cannot be converted"),
    (b'{"nbformat": 2, "nbformat_minor": 0}', "nbformat 2 cannot be converted"),
    (b'{"nbformat": 4, "nbformat_minor": 5, "metadata": {}, "cells": [7]}', "nbformat can read"),
])
def test_what_cannot_be_read_says_why(tmp_path, data, reason):
    path = tmp_path / "a1_attention.ipynb"
    path.write_bytes(data)
    with pytest.raises(UnreadableNotebook) as exc:
        read_notebook(path)
    assert reason in exc.value.reason


def test_an_unreadable_notebook_named_for_an_assignment_gets_a_row(tmp_path):
    (tmp_path / "ada").mkdir()
    (tmp_path / "ada" / "a2.ipynb").write_bytes(b"[" * 20000 + b"]" * 20000)
    placed, unplaced = find_submissions(tmp_path, NAMES)
    assert not unplaced
    assert [(p.assignment, p.how) for p in placed] == [("a2_multi_head_attention", "file name")]
    assert "nested too deeply" in placed[0].unreadable


def test_the_size_limit(tmp_path):
    assert MAX_NOTEBOOK_BYTES == 20 * 2**20
    path = tmp_path / "a.ipynb"
    path.write_bytes(b"x" * 1000)
    assert read_notebook_bytes(path, limit=1000) == b"x" * 1000
    with pytest.raises(UnreadableNotebook, match="larger than 999 bytes"):
        read_notebook_bytes(path, limit=999)
    with open(path, "r+b") as f:  # sparse: nothing is written, nothing is read
        f.truncate(MAX_NOTEBOOK_BYTES + 1)
    with pytest.raises(UnreadableNotebook, match="larger than 20 MB"):
        read_notebook(path)
    with pytest.raises(UnreadableNotebook, match="a folder, not a regular file"):
        read_notebook(tmp_path)
    with pytest.raises(UnreadableNotebook, match="gone"):
        read_notebook(tmp_path / "missing.ipynb")


def test_nothing_but_unreadable_notebook_escapes(tmp_path, monkeypatch):
    # What the parsing process runs (parse_here), made to fail inside nbformat's conversion.
    path = _write(tmp_path / "a.ipynb")

    def broken(*args, **kwargs):
        raise MemoryError("no")

    monkeypatch.setattr(json, "dumps", broken)
    with pytest.raises(UnreadableNotebook):
        notebook_json.parse_here(path.read_bytes())


def test_a_notebook_of_millions_of_tiny_objects_is_parsed_within_bounds(tmp_path):
    # Under the 20 MB limit, but gigabytes once parsed: the bounded process refuses it, and
    # the grader's own process neither grows nor waits long.
    tiny = b"[0]," * (19 * 2**20 // 4 - 100)
    path = tmp_path / "a.ipynb"
    path.write_bytes(b'{"nbformat": 4, "nbformat_minor": 5, "cells": [], "metadata": {"x": ['
                     + tiny.rstrip(b",") + b"]}}")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.monotonic()
    try:
        nb = read_notebook(path)
    except UnreadableNotebook as exc:
        assert "bounds" in exc.reason or "MemoryError" in exc.reason, exc.reason
    else:  # parsed within the bounds: then only what the grader reads came back
        assert nb["cells"] == [] and nb["metadata"] == {}
    assert time.monotonic() - start < notebook_json.PARSE_WALL_S
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before  # KiB
    assert grown < 200 * 2**10, f"the grader's process grew by {grown} KiB"


def test_only_what_the_grader_reads_comes_back(tmp_path):
    nb = _notebook("x = 1")
    nb.cells[0].outputs = [nbformat.v4.new_output("stream", name="stdout", text="big")]
    nb.cells[0].metadata = nbformat.from_dict(
        {"nbgrader": {"grade_id": "g", "solution": True}, "x": 1})
    nb.metadata["tested_transformer"] = {"assignment": "a1_attention"}
    cell = read_notebook(_write(tmp_path / "a.ipynb", nb))["cells"][0]
    assert set(cell) <= {"cell_type", "source", "metadata", "id"}
    assert cell["metadata"] == {"nbgrader": {"grade_id": "g", "solution": True}}


# ---------------------------------------------------------------------------------------------
# The code that runs


def _cell(source: str, **nbgrader) -> dict:
    cell = {"cell_type": "code", "source": source, "metadata": {}, "outputs": []}
    if nbgrader:
        cell["metadata"]["nbgrader"] = nbgrader
    return cell


def test_only_the_metadata_drops_a_test_cell():
    nb = {"cells": [
        _cell("def causal_mask(n):\n    # check_causal_mask(fn) would test it\n    return n\n",
              grade=False, solution=True),
        _cell('note = "see check_causal_mask(causal_mask)"'),
        _cell("result = check_causal_mask(causal_mask)", grade=True, solution=False),
        _cell("check_causal_mask(causal_mask)  # my own run", grade=False, solution=False),
        {"cell_type": "markdown", "source": "x = 1", "metadata": {}},
        _cell(["y = ", "2"]),
        "not a cell",
    ]}
    assert code_cells(nb) == [
        "def causal_mask(n):\n    # check_causal_mask(fn) would test it\n    return n\n",
        'note = "see check_causal_mask(causal_mask)"',
        "check_causal_mask(causal_mask)  # my own run",
        "y = 2"]
    assert code_cells({"cells": "x"}) == [] and code_cells([]) == []


def test_ipython_syntax_becomes_what_jupyter_runs():
    src = 'help_text = """\n!ls\n%time nothing\n"""\n!ls\n%time x = 1\ny = 3 % 2\n'
    assert ipython_source(src) == ('help_text = """\n!ls\n%time nothing\n"""\n'
                                   "get_ipython().system('ls')\n"
                                   "get_ipython().run_line_magic('time', 'x = 1')\n"
                                   "y = 3 % 2\n")
    assert ipython_source("files = !ls") == "files = get_ipython().getoutput('ls')\n"
    assert ipython_source("%%time\nx = 1") == (
        "get_ipython().run_cell_magic('time', '', 'x = 1\\n')\n")
    plain = "x = 1\nif x != 2:\n    y = x % 3"
    assert ipython_source(plain) == plain
    assert ipython_source("def f(:\n    !ls") == "def f(:\n    !ls"  # left to fail as it is
    nb = {"cells": [_cell("!pip install nothing"), _cell('s = """\n!ls\n"""')]}
    assert code_cells(nb) == ["get_ipython().system('pip install nothing')\n",
                              's = """\n!ls\n"""']


def test_the_transformation_of_a_notebook_is_bounded(monkeypatch):
    """IPython tokenizes a cell again after each escape it replaces: many ``!`` lines would
    cost the square of their length. Past the budget a cell is kept as it is."""
    monkeypatch.setattr(notebook_reading, "TRANSFORM_BUDGET", 20_000)
    hostile = "!ls\n" * 400
    nb = {"cells": [_cell(hostile) for _ in range(20)] + [_cell("!ls")]}
    start = time.monotonic()
    out = code_cells(nb)
    assert time.monotonic() - start < 10
    assert out[-1] == "!ls" and out[0] == hostile


# ---------------------------------------------------------------------------------------------
# The assignments carry their name


@pytest.mark.parametrize("name", NAMES)
def test_the_source_and_student_notebooks_say_which_assignment_they_are(name, tmp_path):
    source = ROOT / "book" / "assignments" / f"{name}.ipynb"
    assert json.loads(source.read_text())["metadata"]["tested_transformer"] == {
        "assignment": name}
    [student] = make_assignments.write_student_versions([source], tmp_path)
    nb = read_notebook(student)
    assert nb["metadata"]["tested_transformer"] == {"assignment": name}
    assert assignment_of(nb, "Untitled1.ipynb", None, NAMES) == (name, "metadata")


# ---------------------------------------------------------------------------------------------
# The grader's outputs


def test_feedback_is_capped_at_a_line_boundary():
    text = "".join(f"line {i}: " + "é" * 50 + "\n" for i in range(2000))
    cut = grade_assignments.capped_feedback(text)
    assert len(cut.encode("utf-8")) <= 64 * 1024
    assert cut.endswith("\n(feedback cut here: it was longer than 64 KiB)\n")
    kept = cut.splitlines()[:-1]
    assert kept and all(ln in text.splitlines() for ln in kept)
    assert grade_assignments.capped_feedback("short\n") == "short\n"
    result = SubmissionResult("a1_attention", notes=[f"note {i} " + "x" * 500 for i in range(50)])
    notes = [ln for ln in grade_assignments.feedback("ada", result).splitlines()
             if ln.startswith("- ")]
    assert len(notes) == 20 and all(len(n) <= 302 for n in notes)
    assert notes[-1] == "- ... and 31 more notes"


def test_an_unreadable_notebook_scores_zero_of_the_assignments_points():
    res = grade_assignments.unreadable_result("a1_attention", "a FIFO, not a regular file")
    top = sum(c.points for checker in ASSIGNMENTS["a1_attention"].checkers
              for c in checker.cases)
    assert res.points == 0 and res.max_points == top > 0
    assert res.flags == ["unreadable"]
    assert "a FIFO, not a regular file" in grade_assignments.feedback("ada", res)


def test_write_atomic_leaves_no_temporary_file(tmp_path):
    path = tmp_path / "out" / "grades.csv"
    grade_assignments.write_atomic(path, "a,b\n")
    grade_assignments.write_atomic(path, "c,d\n")
    assert path.read_text() == "c,d\n"
    with pytest.raises(UnicodeEncodeError):
        grade_assignments.write_atomic(path, "\udc80")  # cannot be written: the old file stays
    assert path.read_text() == "c,d\n"
    assert [p.name for p in path.parent.iterdir()] == ["grades.csv"]


def _fake_grade(notebook, assignment, limits=None, seed=None):
    """Full points for every case, without running anything."""
    res = SubmissionResult(assignment.name)
    for checker in assignment.checkers:
        res.checks.append(CheckResult(checker.name, [checker.result(c, None)
                                                     for c in checker.cases]))
    return res


def test_the_command_line_reports_every_notebook(tmp_path, monkeypatch, capsys):
    submitted, out = tmp_path / "submitted", tmp_path / "out"
    _write(submitted / "ada" / "A1_Attention (1).ipynb")
    old = _write(submitted / "ada" / "a1_attention.ipynb")
    os.utime(old, ns=(10**18, 10**18))
    _write(submitted / "ada" / "homework.ipynb", _notebook("x = 1", assignment="a3_masks"))
    _write(submitted / "ada" / "notes.ipynb")
    (submitted / "bo").mkdir()
    os.mkfifo(submitted / "bo" / "a2_multi_head_attention.ipynb")
    graded = []

    def fake(notebook, assignment, limits=None, seed=None):
        graded.append(Path(notebook).name)
        return _fake_grade(notebook, assignment, limits, seed)

    monkeypatch.setattr(grade_assignments, "grade_notebook", fake)
    assert grade_assignments.main([str(submitted), "--out", str(out), "--quiet"]) == 0
    assert sorted(graded) == ["A1_Attention (1).ipynb", "homework.ipynb"]  # never the FIFO
    with open(out / "grades.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    by = {(r["student"], r["assignment"]): r for r in rows}
    assert set(by) == {("ada", "a1_attention"), ("ada", "a3_masks"), ("ada", ""),
                       ("bo", "a2_multi_head_attention")}
    assert by[("ada", "a1_attention")]["flags"] == "duplicate"
    assert by[("ada", "a3_masks")]["flags"] == ""
    assert by[("ada", "")]["flags"].startswith("unplaced: notes.ipynb: not one of the")
    assert by[("ada", "")]["score"] == by[("ada", "")]["max_score"] == ""
    bo = by[("bo", "a2_multi_head_attention")]
    assert bo["flags"] == "unreadable" and float(bo["score"]) == 0 < float(bo["max_score"])
    assert "a FIFO" in (out / "feedback" / "bo" / "a2_multi_head_attention.md").read_text()
    text = (out / "feedback" / "ada" / "a1_attention.md").read_text()
    assert "also handed in: a1_attention.ipynb, not graded: the newest one is graded" in text
    assert "graded as a3_masks" in (out / "feedback" / "ada" / "a3_masks.md").read_text()
    printed = capsys.readouterr().out
    assert "unplaced: ada/notes.ipynb: not one of the assignments" in printed
    assert "a1_attention: 1 graded" in printed
    leftovers = [p for p in out.rglob("*") if p.name.startswith(".") or p.suffix == ".tmp"]
    assert leftovers == []


def test_nothing_placed_is_an_error_that_lists_what_was_found(tmp_path, capsys):
    _write(tmp_path / "ada" / "notes.ipynb")
    assert grade_assignments.main([str(tmp_path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "no notebook of the book's assignments" in err
    assert "unplaced: ada/notes.ipynb" in err
    assert not (tmp_path / "out").exists()


def test_the_grader_end_to_end_on_a_copy_a_fifo_and_a_stray_notebook(tmp_path):
    """One real run of the command line (the sandbox included): the book's own solution saved
    as a browser's copy gets every point, a FIFO gets a row of 0 without being opened, a stray
    notebook is listed; and no temporary file is left."""
    import subprocess
    import sys

    submitted, out = tmp_path / "submitted", tmp_path / "out"
    source = nbformat.read(ROOT / "book" / "assignments" / "a1_attention.ipynb", as_version=4)
    _write(submitted / "ada" / "A1_Attention (1).ipynb", source)
    (submitted / "bo").mkdir()
    os.mkfifo(submitted / "bo" / "a1_attention.ipynb")
    _write(submitted / "cy" / "notes.ipynb")
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "grade_assignments.py"),
                          str(submitted), "--out", str(out), "--quiet", "--jobs", "2"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    with open(out / "grades.csv", newline="") as f:
        rows = {r["student"]: r for r in csv.DictReader(f)}
    assert rows["ada"]["score"] == rows["ada"]["max_score"] != "" and rows["ada"]["flags"] == ""
    assert rows["bo"]["score"] == "0" and rows["bo"]["flags"] == "unreadable"
    assert rows["cy"]["assignment"] == "" and rows["cy"]["flags"].startswith(
        "unplaced: notes.ipynb: ")
    assert "unplaced: cy/notes.ipynb: " in run.stdout
    assert not [p for p in out.rglob("*") if p.name.startswith(".") or p.suffix == ".tmp"]
