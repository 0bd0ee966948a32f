"""The handed-in notebooks: which files they are, how they are read and which assignment each is.

The grader's side, fair to the honest: a notebook is found whatever the browser or Jupyter called
its copy (``a1_attention (1).ipynb``, ``A1_Attention-Copy1.ipynb``, ``a1 attention.ipynb``), or
whatever the student renamed it to, as long as its metadata or its nbgrader cell ids say which
assignment it is; and every notebook that cannot be read or placed is reported, never dropped
silently. Nothing here runs a student's code, and nothing waits on a file: a FIFO, a device, a
socket or a symbolic link named like a notebook is refused before it is opened for reading.

* `assignment_of`: which assignment a notebook is, and how that was decided;
* `find_submissions`: every handed-in notebook, `Placed` (one per student and assignment) or
  `Unplaced` (with the reason).

Each notebook is read by `grader.notebook_reading` (`read_notebook`, or
`UnreadableNotebook` with a reason a person can read), which also gives the code cells to run.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import sanitize
from .notebook_reading import UnreadableNotebook, _dict, read_notebook

NOTEBOOK_SUFFIX = ".ipynb"

# The ways a file name is how it was decided: by `assignment_of` and `find_submissions`.
BY_METADATA = "metadata"
BY_CELL_IDS = "cell ids"
BY_FILE_NAME = "file name"
BY_FOLDER_NAME = "folder name"

_COPY_PREFIX = re.compile(r"^copy\s+of\s+")  # Google Drive, Colab
_COPY_SUFFIX = re.compile(r"(?:\s*\(\d+\)|[\s_-]*copy\d*)$")  # " (1)", "-Copy1", " copy", "_copy2"
_NUMBER = re.compile(r"a(\d+)(?:_|$)")  # "a1" in "a1_attention" or "a1"
_SAID_BY = {BY_METADATA: "the notebook's metadata says",
            BY_CELL_IDS: "the nbgrader ids of its cells say"}


@dataclass
class Placed:
    """A notebook to grade: its student, its assignment, its file and how it was placed.

    ``how`` is one of "metadata", "cell ids", "file name", "folder name". ``notes`` are for the
    feedback: the other notebooks handed in for the same assignment, which are not graded
    (``others``), and why a renamed notebook is graded as this assignment. ``unreadable`` is the
    reason when the notebook cannot be read though its file or folder name says which assignment
    it is: it is then scored 0 and never run.
    """

    student: str
    assignment: str
    path: Path
    how: str
    notes: list[str] = field(default_factory=list)
    unreadable: str | None = None
    others: list[Path] = field(default_factory=list)


@dataclass
class Unplaced:
    """A handed-in notebook (or folder) that is not graded, and why.

    ``relative`` is its path inside the student's folder ("" for the student's folder itself),
    or inside the handed-in folder when it lies outside every student's folder (``student``
    is then "").
    """

    student: str
    path: Path
    reason: str
    relative: str = ""

    def label(self) -> str:
        """``<student>/<relative path>``, as the grader's summary prints it (on one line)."""
        return shown("/".join(p for p in (self.student, self.relative) if p) or str(self.path))


def shown(name: str) -> str:
    """``name`` on one line (`grader.sanitize.line`): a newline, another control or
    invisible character, or a byte that is not UTF-8 (``\\xe9`` of a Latin-1 name) in a file
    name escaped."""
    return sanitize.line(name)


# ---------------------------------------------------------------------------------------------
# Which assignment


def _by_metadata(nb: dict[str, Any], names: Sequence[str]) -> str | None:
    said = _dict(_dict(nb, "metadata"), "tested_transformer").get("assignment")
    return said if isinstance(said, str) and said in names else None


def _by_cell_ids(nb: dict[str, Any], names: Sequence[str]) -> str | None:
    """The assignment most of the cells' nbgrader grade ids (``<assignment>-...``) name."""
    votes: Counter[str] = Counter()
    cells = nb.get("cells") if isinstance(nb, dict) else None
    for cell in cells if isinstance(cells, list) else []:
        grade_id = _dict(_dict(cell, "metadata"), "nbgrader").get("grade_id")
        if isinstance(grade_id, str):
            votes.update(n for n in names if grade_id.startswith(n + "-"))
    top = votes.most_common(2)
    if not top or (len(top) == 2 and top[0][1] == top[1][1]):
        return None  # no grade id, or two assignments as often: the file name decides
    return top[0][0]


def clean_name(text: str) -> str:
    """A file or folder name as the file-name rule compares it: lower case, without the copy
    marks browsers and Jupyter add (" (1)", "-Copy1", " copy", "Copy of "), spaces and hyphens
    as single underscores. ``"A1_Attention (1)"`` -> ``"a1_attention"``."""
    text = _COPY_PREFIX.sub("", text.lower().strip())
    while True:
        shorter = _COPY_SUFFIX.sub("", text).strip()
        if shorter == text:
            break
        text = shorter
    text = re.sub(r"[\s-]+", "_", text)
    return re.sub(r"_+", "_", text).strip("_")


def _number(text: str) -> int | None:
    """N of a leading "aN" token ("a1_attention", "a1"); None for "a1x" or "notes"."""
    match = _NUMBER.match(text)
    return int(match.group(1)) if match else None


def name_match(text: str, names: Sequence[str]) -> str | None:
    """The assignment a file's stem or a folder's name ``text`` names, or None.

    After `clean_name`: the name itself; else the one name the text starts with; else the one
    name whose "aN" matches the text's leading "aN" token ("a1" -> a1_attention, not "a10").
    """
    stem = clean_name(text)
    if not stem:
        return None
    if stem in names:
        return stem
    starts = [n for n in names if stem.startswith(n)]
    if len(starts) == 1:
        return starts[0]
    number = _number(stem)
    if number is None:
        return None
    same = [n for n in names if _number(n) == number]
    return same[0] if len(same) == 1 else None


def _stem(filename: str) -> str:
    return filename[: -len(NOTEBOOK_SUFFIX)] if is_notebook_name(filename) else Path(filename).stem


def assignment_of(nb: dict[str, Any], filename: str, folder_name: str | None,
                  names: Sequence[str]) -> tuple[str | None, str]:
    """Which of ``names`` the notebook ``nb`` (file ``filename`` in folder ``folder_name``) is.

    In order: the notebook's metadata (``metadata.tested_transformer.assignment``, which the
    handed-out notebooks carry); the nbgrader grade ids of its cells (``<assignment>-...``);
    its file name; its folder's name (nbgrader's ``<student>/<assignment>/`` layout). Returns
    (the assignment, how it was decided: "metadata", "cell ids", "file name" or "folder name"),
    or (None, the reason none was found).
    """
    found = _by_metadata(nb, names)
    if found:
        return found, BY_METADATA
    found = _by_cell_ids(nb, names)
    if found:
        return found, BY_CELL_IDS
    return by_name(filename, folder_name, names)


def by_name(filename: str, folder_name: str | None,
            names: Sequence[str]) -> tuple[str | None, str]:
    """The last two rules of `assignment_of`: the file name, then the folder's name."""
    found = name_match(_stem(filename), names)
    if found:
        return found, BY_FILE_NAME
    if folder_name:
        found = name_match(folder_name, names)
        if found:
            return found, BY_FOLDER_NAME
    where = "its file name nor its folder's name" if folder_name else "nor its file name"
    return None, (f"not one of the assignments: neither its metadata, its cells' ids {where} "
                  "says which assignment it is")


# ---------------------------------------------------------------------------------------------
# Finding the notebooks


def is_notebook_name(name: str) -> bool:
    """True for a notebook's file name (".ipynb" in any case, "A1.IPYNB")."""
    return name.lower().endswith(NOTEBOOK_SUFFIX) and len(name) > len(NOTEBOOK_SUFFIX)


def _hidden(name: str) -> bool:
    return name.startswith(".")


@dataclass
class _Candidate:
    path: Path
    relative: str
    how: str
    unreadable: str | None
    mtime_ns: int
    named: bool  # whether its file or folder name says the same assignment


def _entries(folder: Path) -> list[os.DirEntry[str]]:
    with os.scandir(folder) as it:
        return sorted((e for e in it if not _hidden(e.name)), key=lambda e: e.name)


def _points_to_folder(entry: os.DirEntry[str]) -> bool:
    with contextlib.suppress(OSError):
        return entry.is_dir(follow_symlinks=True)
    return False


def _student_notebooks(student: str, folder: Path,
                       unplaced: list[Unplaced]) -> list[tuple[Path, str, int]]:
    """(path, path inside the student's folder, depth) of every notebook file of a student.

    Hidden files and folders (``.ipynb_checkpoints``, ``.git``, macOS's ``._*``) are skipped;
    folders reached through a symbolic link are not entered but reported in ``unplaced``.
    """
    found: list[tuple[Path, str, int]] = []
    stack = [(folder, "", 0)]
    while stack:
        here, prefix, depth = stack.pop()
        try:
            entries = _entries(here)
        except OSError as exc:
            unplaced.append(Unplaced(student, here, f"a folder that cannot be listed "
                                     f"({exc.strerror or type(exc).__name__})", prefix))
            continue
        for entry in entries:
            relative = prefix + shown(entry.name)
            if entry.is_symlink() and _points_to_folder(entry):
                unplaced.append(Unplaced(student, Path(entry.path), "a symbolic link to a "
                                         "folder (the grader does not follow links)", relative))
            elif not entry.is_symlink() and entry.is_dir(follow_symlinks=False):
                stack.append((Path(entry.path), relative + "/", depth + 1))
            elif is_notebook_name(entry.name):
                found.append((Path(entry.path), relative, depth))
    return sorted(found, key=lambda f: f[1])


def _mtime_ns(path: Path) -> int:
    try:
        return os.lstat(path).st_mtime_ns
    except OSError:
        return 0


def _placed(student: str, assignment: str, group: list[_Candidate]) -> Placed:
    """One row for ``group``, a student's notebooks for one assignment: the newest readable one
    (the largest mtime; the larger path name on a tie), the others listed in its notes."""
    readable = [c for c in group if c.unreadable is None] or group
    chosen = max(readable, key=lambda c: (c.mtime_ns, str(c.path)))
    place = Placed(student, assignment, chosen.path, chosen.how, unreadable=chosen.unreadable)
    if chosen.how in _SAID_BY and not chosen.named:  # renamed: say why it is graded as what
        place.notes.append(f"graded as {assignment}, as {_SAID_BY[chosen.how]} (its file is "
                           f"{chosen.relative})")
    for other in sorted(group, key=lambda c: c.relative):
        if other is chosen:
            continue
        why = ("the newest one is graded" if other.unreadable is None
               else f"it cannot be read: {other.unreadable}")
        place.notes.append(f"also handed in: {other.relative}, not graded: {why}")
        place.others.append(other.path)
    return place


# What one student's folder may cost the grader before any grading: each notebook is parsed in
# a bounded process, but a folder of hundreds of large notebooks would still hold up the class.
# The newest are read, up to a count and a total size; the rest are reported.
EXTRA_NOTEBOOKS = 4  # beyond one per assignment
MAX_STUDENT_BYTES = 64 * 2**20


def _within_budget(student: str, found: list[tuple[Path, str, int]], names: Sequence[str],
                   unplaced: list[Unplaced]) -> list[tuple[Path, str, int]]:
    """The newest of a student's notebooks, up to `EXTRA_NOTEBOOKS` more than the assignments
    and `MAX_STUDENT_BYTES` in all; the others go to ``unplaced``."""
    kept, total = [], 0
    for path, relative, depth in sorted(found, key=lambda f: -_mtime_ns(f[0])):
        try:
            size = path.lstat().st_size
        except OSError:
            size = 0
        if len(kept) >= len(names) + EXTRA_NOTEBOOKS or total + size > MAX_STUDENT_BYTES:
            unplaced.append(Unplaced(student, path, f"not read: this student handed in more "
                                     f"than {len(names) + EXTRA_NOTEBOOKS} notebooks or "
                                     f"{MAX_STUDENT_BYTES // 2**20} MB of them, and only the "
                                     "newest within both are read", relative))
            continue
        kept.append((path, relative, depth))
        total += size
    return kept


def _place_student(student: str, folder: Path, names: Sequence[str],
                   unplaced: list[Unplaced]) -> list[Placed]:
    groups: dict[str, list[_Candidate]] = {}
    found = list(_student_notebooks(student, folder, unplaced))
    for path, relative, depth in _within_budget(student, found, names, unplaced):
        if depth > 1:
            unplaced.append(Unplaced(student, path, "too deep in folders: the grader reads "
                                     "<student>/*.ipynb and <student>/<folder>/*.ipynb", relative))
            continue
        folder_name = path.parent.name if depth == 1 else None
        try:
            nb, problem = read_notebook(path), None
        except UnreadableNotebook as exc:
            nb, problem = {}, exc.reason
        name, how = assignment_of(nb, path.name, folder_name, names)
        if name is None:
            reason = f"cannot be read: {problem}" if problem else how
            unplaced.append(Unplaced(student, path, reason, relative))
            continue
        named = by_name(path.name, folder_name, names)[0] == name
        groups.setdefault(name, []).append(
            _Candidate(path, relative, how, problem, _mtime_ns(path), named))
    return [_placed(student, name, groups[name]) for name in names if name in groups]


def find_submissions(folder: Path | str,
                     names: Sequence[str]) -> tuple[list[Placed], list[Unplaced]]:
    """Every handed-in notebook in ``folder``: (placed, unplaced).

    Layouts: ``folder/<student>/*.ipynb`` and ``folder/<student>/<assignment>/*.ipynb``
    (nbgrader's); the extension in any case. Hidden files and folders (``.ipynb_checkpoints``)
    are skipped silently, and so is every file that is not a notebook. A student's folder, or a
    folder in it, that is a symbolic link is not followed but reported; so is a notebook outside
    every student's folder, or deeper than ``<student>/<folder>/``. Each notebook is read once
    (`read_notebook`) and placed by `assignment_of`; one that cannot be read is still placed,
    with ``unreadable`` set, when its file or folder name says which assignment it is, and is
    reported otherwise. A student who handed in several notebooks for one assignment gets one
    `Placed`: the newest readable one, the others named in its notes. A student's notebooks are
    read newest first, within `EXTRA_NOTEBOOKS` more than ``names`` and `MAX_STUDENT_BYTES`;
    the rest are reported, not read.
    """
    folder = Path(folder)
    names = tuple(names)
    placed: list[Placed] = []
    unplaced: list[Unplaced] = []
    for entry in _entries(folder):
        path = Path(entry.path)
        if entry.is_symlink() and _points_to_folder(entry):
            unplaced.append(Unplaced(entry.name, path, "the student's folder is a symbolic link "
                                     "(the grader does not follow links)"))
        elif not entry.is_symlink() and entry.is_dir(follow_symlinks=False):
            placed += _place_student(entry.name, path, names, unplaced)
        elif is_notebook_name(entry.name):
            unplaced.append(Unplaced("", path, "a notebook outside every student's folder "
                                     "(the layout is <student>/<notebook>.ipynb)",
                                     shown(entry.name)))
    unplaced.sort(key=lambda u: (u.student, u.relative))
    return placed, unplaced
