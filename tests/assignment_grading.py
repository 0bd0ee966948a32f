"""Grading submissions of an assignment through the command line, for the assignment tests.

`write_submission` puts an assignment notebook, with some cells replaced and no outputs, where
nbgrader collects it (``SUBMITTED/STUDENT/NAME/NAME.ipynb``); `grade` runs
``scripts/grade_assignments.py`` on the folder and checks that it exits cleanly.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import nbformat
from notebooks import ROOT

SCRIPT = ROOT / "scripts" / "grade_assignments.py"


def write_submission(notebook: Path, submitted: Path, student: str, cells: dict[int, str],
                     solution_cells: bool = True,
                     inserted: Iterable[tuple[int, str]] = ()) -> None:
    """``notebook`` with ``cells`` (index -> source) replaced, unexecuted, as ``student``'s
    submission; ``solution_cells``: each replaced cell must be one the student fills in;
    ``inserted``: new code cells (index in the notebook as handed out, source) added after."""
    nb = nbformat.read(notebook, as_version=4)
    for index, source in cells.items():
        if solution_cells:
            assert "### BEGIN SOLUTION" in nb.cells[index].source, (student, index)
        nb.cells[index].source = source
    for index, source in sorted(inserted, reverse=True):
        nb.cells.insert(index, nbformat.v4.new_code_cell(source))
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    where = submitted / student / notebook.stem
    where.mkdir(parents=True)
    nbformat.write(nb, where / notebook.name)


def grade(submitted: Path, out: Path, *options: str) -> subprocess.CompletedProcess[str]:
    """Run the grader on ``submitted`` (writing to ``out``) with ``options``, quietly."""
    run = subprocess.run([sys.executable, str(SCRIPT), str(submitted), "--out", str(out),
                          *options, "--quiet"], capture_output=True, text=True, timeout=600,
                         cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    return run
