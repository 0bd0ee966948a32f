"""The book's own prose as a corpus: `book_prose` and `freeze_prose` (chapters 15, 18 to 21).

Chapters 15 and 18 to 21 train tokenizers and small language models on the text of the book's
Markdown cells. They read it from a frozen copy, ``book/data/prose/NN.txt`` (one file per
chapter), so that editing a chapter, or a reader's own note in one, changes none of their
results; `freeze_prose` refreshes the copy on purpose. `utils.data` re-exports both.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from ._validation import InputTypeError, require_int, type_name

__all__ = ["book_prose", "freeze_prose", "PROSE"]

_BOOK = Path(__file__).resolve().parent.parent / "book"
PROSE = _BOOK / "data" / "prose"  # the frozen corpus: NN.txt, one file per chapter


def _notebook_prose(folder: Path) -> dict[int, Path]:
    if not folder.is_dir():
        raise ValueError(f"no book folder at {folder}")
    return {int(p.name[:2]): p for p in folder.glob("[0-9][0-9]_*.ipynb")}


def _read_notebook(path: Path) -> str:
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    return "\n\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")


def _read_frozen(path: Path) -> str:
    with path.open(encoding="utf-8", newline="") as f:  # the text exactly, line ends included
        return f.read()


def book_prose(chapters: Iterable[int] | None = None, book: str | Path | None = None) -> str:
    """The prose of the book: the text of the Markdown cells of its chapters, in chapter order.

    A small corpus of our own, on disk and free of licences, for training a tokenizer and small
    language models (chapters 15 and 18 to 21). Code cells and outputs are left out; cells are
    joined with a blank line, chapters too.

    By default the text is the **frozen** copy in ``book/data/prose/NN.txt``: each chapter's
    Markdown as it stood when `freeze_prose` last wrote it. A corpus read from the live notebooks
    would change whenever anyone edits a chapter (a reworded sentence, a reader's own note in a
    cell), and with it every merge, loss and comparison of the chapters that train on it; the
    frozen copy keeps their results what the book prints. ``book=`` reads a folder of notebooks
    as they are now instead.

    Args:
        chapters: chapter numbers to read (``[3, 1]`` reads chapter 1 then chapter 3, always in
            chapter order); None reads every chapter there is.
        book: a folder of ``NN_*.ipynb`` notebooks to read live (default: the frozen copy).

    Returns:
        one str. A missing folder or chapter raises `ValueError`.
    """
    if book is None:
        found = {int(p.stem): p for p in PROSE.glob("[0-9][0-9].txt")}
        where, read = f"the frozen prose ({PROSE})", _read_frozen
    else:
        found = _notebook_prose(Path(book))
        where, read = str(book), _read_notebook
    if chapters is None:
        wanted = sorted(found)
    else:
        if isinstance(chapters, (str, bytes)) or not isinstance(chapters, Iterable):
            raise InputTypeError(f"chapters must be a list of int, got {type_name(chapters)}")
        wanted = sorted({require_int("chapter", c) for c in chapters})
        missing = [c for c in wanted if c not in found]
        if missing:
            raise ValueError(f"no chapter {missing[0]} in {where}: it has {sorted(found)}")
    return "\n\n".join(read(found[number]) for number in wanted)


def freeze_prose(book: str | Path | None = None, out: str | Path | None = None) -> list[Path]:
    """Write each chapter's prose, read live from the notebooks in ``book`` (default: the
    book's), to ``out/NN.txt`` (default: ``book/data/prose``), the copy `book_prose` reads;
    files of chapters no longer in ``book`` are removed. Returns the paths written.

    Run it (``make freeze-prose``) only on purpose, then re-execute the chapters that train on
    the prose (CONTRIBUTING.md, "The frozen prose"): their stored outputs come from the old copy.
    """
    found = _notebook_prose(_BOOK if book is None else Path(book))
    folder = PROSE if out is None else Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("[0-9][0-9].txt"):
        if int(old.stem) not in found:
            old.unlink()
    written = []
    for number, path in sorted(found.items()):
        target = folder / f"{number:02d}.txt"
        with target.open("w", encoding="utf-8", newline="") as f:
            f.write(_read_notebook(path))
        written.append(target)
    return written
