"""The grading benchmark's class: every assignment, solutions, blank and wrong notebooks (the
timing itself is `make bench-grade`, never a test)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import nbformat
from notebooks import ROOT

from utils.checks import ASSIGNMENTS

_spec = importlib.util.spec_from_file_location("grading_benchmark",
                                               ROOT / "scripts" / "grading_benchmark.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_every_mistake_changes_a_solution_cell():
    for name, (index, old, new) in bench.MISTAKES.items():
        nb = nbformat.read(ROOT / "book" / "assignments" / f"{name}.ipynb", as_version=4)
        assert "### BEGIN SOLUTION" in nb.cells[index].source, name
        assert old in nb.cells[index].source and old != new, name


def test_the_class_has_every_assignment_in_every_kind(tmp_path: Path):
    expect = bench.build_class(tmp_path, 7)
    assert len(expect) == 7 * len(ASSIGNMENTS)
    for name in ASSIGNMENTS:
        kinds = [v for s, v in expect.items() if s.startswith(name[:2] + "_")]
        assert sorted(kinds) == ["full"] * 5 + ["some", "zero"], name
    blank = nbformat.read(tmp_path / "a1_blank_5" / "a1_attention.ipynb", as_version=4)
    assert "raise NotImplementedError()" in blank.cells[3].source
