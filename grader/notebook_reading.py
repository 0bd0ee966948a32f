"""A handed-in notebook read and checked: its bytes, its JSON, and the code it runs.

The grader's side (assignments' grading), which never runs a student's code and never waits on
a file: a FIFO, a device, a socket or a symbolic link named like a notebook is refused before it
is opened for reading.

* `read_notebook_bytes`, `parse_notebook` and `read_notebook`: a regular file of at most
  `MAX_NOTEBOOK_BYTES`, as an nbformat 4 notebook of plain dicts (nbformat 3 converted), or
  `UnreadableNotebook` with a reason a person can read;
* `code_cells`: the sources of the code cells to run, as Jupyter would run them (IPython's
  transformation of ``%magic`` and ``!command`` lines, bounded by `TRANSFORM_BUDGET`).
"""

from __future__ import annotations

import errno
import os
import re
import stat
from pathlib import Path
from typing import Any

from IPython.core.inputtransformer2 import TransformerManager

from .notebook_json import UnreadableNotebook, parse_bounded

MAX_NOTEBOOK_BYTES = 20 * 2**20
CHUNK = 2**20
# Lines IPython's input transformer may change (escapes, prompts, help, `x = !cmd`).
_IPYTHON_SYNTAX = re.compile(
    r"(?m)^[ \t]*(?:[%!?,;/]|>>>|\.\.\.|In \[)|\?[ \t]*$|=[ \t]*[%!]")
TRANSFORM_BUDGET = 500_000  # characters tokenized per notebook: a few seconds at most


# ---------------------------------------------------------------------------------------------
# Reading


def _size(n: int) -> str:
    if n >= 2**20 and n % 2**20 == 0:
        return f"{n // 2**20} MB"
    if n >= 2**10 and n % 2**10 == 0:
        return f"{n // 2**10} KB"
    return f"{n} bytes"


def _not_regular(mode: int) -> str | None:
    """Why a file of ``mode`` is refused, or None for a regular file."""
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISLNK(mode):
        return "a symbolic link (the grader does not follow links)"
    kinds = [(stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a folder"),
             (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device")]
    kind = next((name for test, name in kinds if test(mode)), "a special file")
    return f"{kind}, not a regular file"


def _os_reason(exc: OSError) -> str:
    if exc.errno == errno.ENOENT:
        return "gone: the file was removed while the grader read the folder"
    if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a link made after the lstat
        return "a symbolic link (the grader does not follow links)"
    return f"not readable ({exc.strerror or type(exc).__name__})"


def read_notebook_bytes(path: Path | str, limit: int = MAX_NOTEBOOK_BYTES) -> bytes:
    """The bytes of the regular file ``path``, at most ``limit`` of them.

    Anything else is refused before it is opened for reading: a symbolic link, a FIFO, a socket,
    a device or a folder (``os.lstat``). The file is then opened without following a link and
    without blocking, and checked again on the open descriptor, so that a file swapped in between
    is refused as well. Raises `UnreadableNotebook`.
    """
    try:
        info = os.lstat(path)
    except OSError as exc:
        raise UnreadableNotebook(_os_reason(exc)) from None
    reason = _not_regular(info.st_mode)
    if reason:
        raise UnreadableNotebook(reason)
    if info.st_size > limit:
        raise UnreadableNotebook(f"larger than {_size(limit)}")
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        raise UnreadableNotebook(_os_reason(exc)) from None
    try:
        reason = _not_regular(os.fstat(fd).st_mode)
        if reason:
            raise UnreadableNotebook(reason)
        chunks, total = [], 0
        while total <= limit:
            chunk = os.read(fd, min(CHUNK, limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
    except OSError as exc:
        raise UnreadableNotebook(_os_reason(exc)) from None
    finally:
        os.close(fd)
    if total > limit:
        raise UnreadableNotebook(f"larger than {_size(limit)}")
    return b"".join(chunks)


def parse_notebook(data: bytes) -> dict[str, Any]:
    """The notebook in ``data`` (a file's bytes) as an nbformat 4 dict of what the grader reads
    (`grader.notebook_json`: parsed in a bounded process of its own); `UnreadableNotebook`
    when it is not one, with the reason."""
    return parse_bounded(data)


def read_notebook(path: Path | str, limit: int = MAX_NOTEBOOK_BYTES) -> dict[str, Any]:
    """The notebook at ``path`` as an nbformat 4 dict of plain values (sources as strings).

    nbformat 3 notebooks are converted. Raises `UnreadableNotebook` (and nothing else) when the
    file is not a regular file, is too large, is not UTF-8 JSON, or is not a notebook.
    """
    return parse_notebook(read_notebook_bytes(path, limit))


def _dict(value: Any, key: str) -> dict[str, Any]:
    found = value.get(key) if isinstance(value, dict) else None
    return found if isinstance(found, dict) else {}


# ---------------------------------------------------------------------------------------------
# The code to run


def _source(cell: dict[str, Any]) -> str:
    src = cell.get("source", "")
    return "".join(str(s) for s in src) if isinstance(src, list) else str(src)


def is_test_cell(cell: dict[str, Any]) -> bool:
    """True for nbgrader's autograded test cell (grade true, solution false): the checker calls
    the grader replaces. Only the metadata decides, never the cell's text."""
    meta = _dict(_dict(cell, "metadata"), "nbgrader")
    return bool(meta.get("grade")) and not meta.get("solution")


class _OverBudget(RuntimeError):
    """IPython's transformation of a notebook's cells took more work than `TRANSFORM_BUDGET`."""


class _BoundedTransformer(TransformerManager):
    """IPython's own transformer, with a bound on its work. It tokenizes the whole cell again
    after each piece of IPython syntax it replaces, so that a cell of many ``!`` lines costs
    the square of its length; every pass is charged to ``budget`` (characters tokenized)."""

    def __init__(self, budget: int):
        super().__init__()
        self.budget = budget

    def do_one_token_transform(self, lines: list[str]) -> tuple[bool, list[str]]:
        self.budget -= sum(len(line) for line in lines)
        if self.budget < 0:
            raise _OverBudget("the transformation of the cells took too long")
        return super().do_one_token_transform(lines)


def has_ipython_syntax(source: str) -> bool:
    """True when IPython might change ``source``: a line that starts with an escape (``%``,
    ``!``, ``?``, ``,``, ``;``, ``/``) or a prompt (``>>>``, ``...``, ``In [1]:``), ends with
    ``?``, assigns ``= %magic`` or ``= !command``, a leading blank line or a first line that is
    indented. False only when IPython's transformation would leave the cell as it is."""
    lines = source.splitlines()
    first = next((ln for ln in lines if ln.strip()), "")
    return (bool(lines) and not lines[0].strip()) or first[:1] in (" ", "\t") or (
        _IPYTHON_SYNTAX.search(source) is not None)


def ipython_source(source: str, transformer: TransformerManager | None = None) -> str:
    """``source`` as IPython runs it: ``%magic`` and ``!command`` lines become calls of
    ``get_ipython()``, exactly as in Jupyter (a line inside a string is left alone). Kept as it
    is when IPython cannot transform it (the cell's own syntax error then shows when it runs),
    or when ``transformer`` has spent its budget."""
    if not has_ipython_syntax(source):
        return source
    try:
        out = (transformer or TransformerManager()).transform_cell(source)
    except Exception:  # IPython's transformers on text they do not expect; _OverBudget
        return source
    if not isinstance(out, str) or out in (source, source + "\n"):
        return source
    return out


def code_cells(nb: dict[str, Any]) -> list[str]:
    """The sources of the code cells to run, in order, as IPython would run them.

    A cell is left out only when its nbgrader metadata marks it as an autograded test cell; what
    a cell says (a comment that mentions ``check_causal_mask(``) never drops it. IPython's
    transformation of one notebook is bounded by `TRANSFORM_BUDGET`: past it, a cell with
    IPython syntax is kept as it is (no honest notebook comes near).
    """
    cells = nb.get("cells") if isinstance(nb, dict) else None
    transformer = _BoundedTransformer(TRANSFORM_BUDGET)
    out = []
    for cell in cells if isinstance(cells, list) else []:
        if not isinstance(cell, dict) or cell.get("cell_type") != "code" or is_test_cell(cell):
            continue
        out.append(ipython_source(_source(cell), transformer))
    return out
