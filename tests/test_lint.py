"""The library, the grader, the tests, the scripts and the notebooks' code pass ruff (settings in
pyproject)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import ROOT


def test_ruff_clean():
    ruff = Path(sys.executable).parent / "ruff"
    proc = subprocess.run(
        [str(ruff), "check", "--no-cache", "utils", "grader", "tests", "scripts", "book",
         "conftest.py"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def test_notebook_code_is_formatted_to_the_column():
    """The notebooks' code cells are formatted by `ruff format` at 88 characters
    (book/ruff.toml): a line longer than that scrolls sideways in the book's text column."""
    ruff = Path(sys.executable).parent / "ruff"
    proc = subprocess.run(
        [str(ruff), "format", "--check", "--no-cache", "book"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, (
        "run `.venv/bin/ruff format book`:\n" + proc.stdout[-4000:] + proc.stderr[-2000:]
    )
