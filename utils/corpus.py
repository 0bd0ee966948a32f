"""The book's own prose as a corpus: `book_prose` and `freeze_prose` (chapters 15, 18 to 21).

Chapters 15 and 18 to 21 train tokenizers and small language models on the text of the book's
Markdown cells. They read it from a frozen copy, ``book/data/prose/NN.txt`` (one file per
chapter), so that editing a chapter, or a reader's own note in one, changes none of their
results; `freeze_prose` refreshes the copy on purpose. `utils.data` re-exports both.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path

from ._validation import InputTypeError, require_int, type_name

__all__ = ["book_prose", "freeze_prose", "BOOK", "PROSE"]

BOOK = Path(__file__).resolve().parent.parent / "book"  # the chapters' notebooks
PROSE = BOOK / "data" / "prose"  # the frozen corpus: NN.txt, one file per chapter
SUMS = "SHA256SUMS"  # beside them: the SHA-256 of each file, as freeze_prose wrote it


def _notebook_prose(folder: Path) -> dict[int, Path]:
    if not folder.is_dir():
        raise ValueError(f"no book folder at {folder}")
    return {int(p.name[:2]): p for p in folder.glob("[0-9][0-9]_*.ipynb")}


def _read_notebook(path: Path) -> str:
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    return "\n\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")


def _frozen(folder: Path) -> dict[int, Path]:
    found = {int(p.stem): p for p in folder.glob("[0-9][0-9].txt")} if folder.is_dir() else {}
    if not found:
        raise ValueError(f"no frozen prose at {folder} (no NN.txt): run `make freeze-prose`")
    return found


def _sums(folder: Path) -> dict[str, str]:
    path = folder / SUMS
    if not path.is_file():
        raise ValueError(f"no {SUMS} in {folder}: run `make freeze-prose`")
    return {name: digest for digest, name in
            (line.split("  ", 1) for line in path.read_text(encoding="ascii").splitlines())}


def _read_frozen(path: Path, sums: dict[str, str]) -> str:
    data = path.read_bytes()  # the text exactly, line ends included
    if hashlib.sha256(data).hexdigest() != sums.get(path.name):
        raise ValueError(
            f"{path} is not the text that was frozen (its SHA-256 differs from {SUMS}): "
            f"restore it (git checkout -- {path}) or refreeze on purpose (make freeze-prose)")
    return data.decode("utf-8")


def book_prose(chapters: Iterable[int] | None = None, book: str | Path | None = None) -> str:
    """The prose of the book: the text of the Markdown cells of its chapters, in chapter order.

    A small corpus of our own, on disk and free of licences, for training a tokenizer and small
    language models (chapters 15 and 18 to 21). Code cells and outputs are left out; cells are
    joined with a blank line, chapters too.

    By default the text is the **frozen** copy in ``book/data/prose/NN.txt``: each chapter's
    Markdown as it stood when `freeze_prose` last wrote it, checked against the SHA-256 it
    recorded. A corpus read from the live notebooks would change whenever anyone edits a chapter
    (a reworded sentence, a reader's own note in a cell), and with it every merge, loss and
    comparison of the chapters that train on it; the frozen copy keeps their results what the
    book prints. ``book=`` reads a folder of notebooks as they are now instead (``book=BOOK``:
    the book's own, from any working directory).

    Args:
        chapters: chapter numbers to read (``[3, 1]`` reads chapter 1 then chapter 3, always in
            chapter order); None reads every chapter there is.
        book: a folder of ``NN_*.ipynb`` notebooks to read live (default: the frozen copy).

    Returns:
        one str. A missing folder or chapter, or a frozen file changed since it was frozen,
        raises `ValueError`.
    """
    if book is None:
        found, sums = _frozen(PROSE), _sums(PROSE)
        where = f"the frozen prose ({PROSE})"

        def read(path: Path) -> str:
            return _read_frozen(path, sums)
    else:
        found, where, read = _notebook_prose(Path(book)), str(book), _read_notebook
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
    """Write each chapter's prose, read live from the notebooks in ``book`` (default: `BOOK`),
    to ``out/NN.txt`` (default: ``book/data/prose``), the copy `book_prose` reads, with the
    SHA-256 of each file in ``out/SHA256SUMS``; then remove the files of chapters no longer in
    ``book``. A folder without notebooks raises `ValueError` and changes nothing. Returns the
    paths written.

    Run it (``make freeze-prose``) only on purpose, then re-execute the chapters that train on
    the prose (CONTRIBUTING.md, "The frozen prose"): their stored outputs come from the old copy.
    """
    found = _notebook_prose(BOOK if book is None else Path(book))
    if not found:
        raise ValueError(f"no chapter notebooks (NN_*.ipynb) in {book}: nothing frozen")
    folder = PROSE if out is None else Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    written, sums = [], []
    for number, path in sorted(found.items()):
        target = folder / f"{number:02d}.txt"
        data = _read_notebook(path).encode("utf-8")
        target.write_bytes(data)
        written.append(target)
        sums.append(f"{hashlib.sha256(data).hexdigest()}  {target.name}\n")
    (folder / SUMS).write_text("".join(sums), encoding="ascii")
    for old in folder.glob("[0-9][0-9].txt"):
        if int(old.stem) not in found:
            old.unlink()
    return written
