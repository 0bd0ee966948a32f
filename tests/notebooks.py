"""Finding the book's notebooks, shared by the guard test and the execution script."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BOOK = ROOT / "book"


def book_notebooks() -> list[Path]:
    """Every notebook under book/, checkpoints excluded, sorted."""
    return sorted(
        p for p in BOOK.rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts
    )
