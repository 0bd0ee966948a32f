"""nbgrader itself on the book's smallest assignment: the source notebook goes into a course folder
unchanged, `nbgrader generate_assignment` makes the student version, and `nbgrader autograde`
scores a right and a wrong submission; `nbgrader export` writes the scores we check.

nbgrader comes from requirements-grade.txt, which `make test` and `make grade` install into
.venv-grade, an environment layered on .venv (the Makefile): the notebooks' own environment, .venv,
stays the reader's (tests/test_environment.py)."""

from __future__ import annotations

import csv
import os
import shutil
import subprocess
from pathlib import Path

import nbformat
import pytest
from grading_submissions import A1_RIGHT
from notebooks import ROOT

from utils.checks.a1_attention import CHECKER

ASSIGNMENT = "a1_attention"
SOURCE = ROOT / "book" / "assignments" / f"{ASSIGNMENT}.ipynb"
# Right without a mask, wrong with one: every masked case fails and the unmasked one passes.
MASK_IGNORED = A1_RIGHT.replace("    if mask is not None:", "    if False:")
BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
GRADE_PYTHON = ROOT / ".venv-grade" / "bin" / "python"


def _nbgrader(course: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(course / ".jupyter"),
           "PATH": f"{GRADE_PYTHON.parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("JUPYTER_PATH", None)
    proc = subprocess.run([str(GRADE_PYTHON), "-m", "nbgrader", *args], cwd=course, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"nbgrader {args[0]} failed:\n{proc.stdout[-3000:]}" \
                                 f"\n{proc.stderr[-5000:]}"
    return proc


def _solution_cells(nb: nbformat.NotebookNode, kind: str = "code") -> list[int]:
    """The solution cells of ``kind``: "code", or "markdown" (the written answers)."""
    return [i for i, c in enumerate(nb.cells)
            if c.metadata.get("nbgrader", {}).get("solution") and c.cell_type == kind]


@pytest.fixture(scope="module")
def course(tmp_path_factory):
    """A course folder after generate_assignment, autograde and export; returns what they made."""
    if not GRADE_PYTHON.exists():
        pytest.fail(f"{GRADE_PYTHON} is missing: `make test` installs requirements-grade.txt there")
    course = tmp_path_factory.mktemp("course")
    (course / "nbgrader_config.py").write_text(
        "c = get_config()\n"
        "c.CourseDirectory.root = " + repr(str(course)) + "\n"
        "c.CourseDirectory.course_id = 'tested_transformer'\n"
        "c.Execute.timeout = 120\n")
    (course / "source" / ASSIGNMENT).mkdir(parents=True)
    shutil.copy2(SOURCE, course / "source" / ASSIGNMENT / SOURCE.name)
    _nbgrader(course, "generate_assignment", ASSIGNMENT)
    release = nbformat.read(course / "release" / ASSIGNMENT / SOURCE.name, as_version=4)
    source = nbformat.read(SOURCE, as_version=4)
    cells = _solution_cells(source)
    for student, code in (("right", None), ("wrong", MASK_IGNORED)):
        nb = nbformat.read(course / "release" / ASSIGNMENT / SOURCE.name, as_version=4)
        for i in cells:
            nb.cells[i].source = code if code is not None else source.cells[i].source
        folder = course / "submitted" / student / ASSIGNMENT
        folder.mkdir(parents=True)
        nbformat.write(nb, folder / SOURCE.name)
    _nbgrader(course, "autograde", ASSIGNMENT)
    _nbgrader(course, "export")
    with open(course / "grades.csv", newline="") as f:
        scores = {r["student_id"]: r for r in csv.DictReader(f)}
    return {"release": release, "source": source, "cells": cells, "scores": scores,
            "answers": _solution_cells(source, "markdown")}


def test_generate_assignment_removes_every_solution(course):
    release, source = course["release"], course["source"]
    assert course["cells"], "the source notebook has no solution cell"
    assert len(release.cells) == len(source.cells)
    for i in course["cells"]:
        assert BEGIN not in release.cells[i].source
        assert "raise NotImplementedError()" in release.cells[i].source
        solution = source.cells[i].source.split(BEGIN)[1].split(END)[0]
        for line in solution.splitlines():
            if line.strip() and not line.strip().startswith("#"):
                assert line not in release.cells[i].source.splitlines(), line
    for cell in release.cells:
        if cell.cell_type == "code":
            assert not cell.outputs
    # the written answers: the model answer (between markers in HTML comments) is gone
    assert course["answers"], "the source notebook has no answer cell"
    for i in course["answers"]:
        assert release.cells[i].source == "**Answer.**\n\nYOUR ANSWER HERE"


def _written_points(course) -> float:
    return sum(course["source"].cells[i].metadata["nbgrader"]["points"] for i in course["answers"])


def test_autograde_gives_the_right_submission_full_points(course):
    """All the autograded points; the written answers count in the maximum but wait for a
    person to grade them."""
    top = sum(c.points for c in CHECKER.cases)
    row = course["scores"]["right"]
    assert float(row["max_score"]) == top + _written_points(course)
    assert float(row["score"]) == top


def test_autograde_gives_the_wrong_submission_the_points_of_the_cases_it_passes(course):
    unmasked = sum(c.points for c in CHECKER.cases if c.id == "no_mask")
    row = course["scores"]["wrong"]
    assert 0 < float(row["score"]) == unmasked < float(row["max_score"])
