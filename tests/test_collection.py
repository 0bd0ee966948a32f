"""Running nbval from the repository root collects the book's notebooks and nothing in _build/."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

from conftest import ROOT


def test_nbval_from_root_skips_build_outputs():
    # A notebook inside _build/ (Jupyter Book copies notebooks there) must not be collected.
    probe_dir = ROOT / "_build" / "collection-probe"
    probe_dir.mkdir(parents=True, exist_ok=True)
    probe = probe_dir / "probe.ipynb"
    probe.write_text(json.dumps({
        "cells": [], "metadata": {}, "nbformat": 4, "nbformat_minor": 5,
    }))
    try:
        proc = subprocess.run(
            # tests/ is left out: what is checked is where notebooks are looked for, and
            # collecting the unit tests would only import torch and every test module again.
            [sys.executable, "-m", "pytest", "--collect-only", "-q", "--nbval",
             "-p", "no:cacheprovider", "-p", "no:xdist", "--ignore=tests", "."],
            cwd=ROOT, capture_output=True, text=True, timeout=300,
        )
    finally:
        shutil.rmtree(probe_dir)
    ids = [ln for ln in proc.stdout.splitlines() if "::" in ln]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert any(i.startswith("book/01_attention.ipynb::") for i in ids), "notebooks not collected"
    assert not [i for i in ids if i.startswith(("_build", ".venv"))], "collected build outputs"
