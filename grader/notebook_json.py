"""A handed-in notebook's JSON, parsed in a process of its own with bounds on its memory and time.

A notebook of 20 MB of JSON made of millions of tiny objects costs gigabytes and minutes to parse
(4.5 GB and two minutes, measured), and the grader parses every handed-in notebook. So the
parsing runs in ``python -I`` with `PARSE_MEMORY` of address space, `PARSE_CPU_S` of CPU time
and `PARSE_WALL_S` of waiting: it reads the file's bytes on its standard input, checks and
converts them (nbformat 3 to 4, sources split in lines joined) and writes back only what the
grader reads of a notebook: each cell's type, id, source and nbgrader metadata, and the book's
own metadata. That answer is strings and small dicts, never more than the file's size. A
notebook that goes past a bound is `UnreadableNotebook`, with the bound named. The same bytes
are parsed once per grader process (`parse_bounded` keeps the last answers).
"""

from __future__ import annotations

import codecs
import copy
import hashlib
import json
import subprocess
import sys
from collections import OrderedDict
from typing import Any

PARSE_MEMORY = 2 * 2**30
PARSE_CPU_S = 20
PARSE_WALL_S = 60
_KEPT = 64  # answers remembered
_answers: OrderedDict[bytes, dict[str, Any]] = OrderedDict()


class UnreadableNotebook(Exception):
    """A handed-in file that cannot be read as a notebook; ``reason`` says why, for a person."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def _json(data: bytes) -> Any:
    """The JSON value in ``data``, or `UnreadableNotebook`."""
    if not data.strip():
        raise UnreadableNotebook("an empty file")
    bom = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0  # some editors add it
    try:
        text = data[bom:].decode("utf-8")
    except UnicodeDecodeError as exc:
        at = bom + exc.start
        raise UnreadableNotebook(f"not UTF-8 text (byte {data[at]:#04x} at offset {at})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise UnreadableNotebook(f"not valid JSON (line {exc.lineno}: {exc.msg})") from None
    except RecursionError:
        raise UnreadableNotebook("not a notebook: its JSON is nested too deeply") from None


def _to_v4(raw: dict[str, Any]) -> dict[str, Any]:
    """``raw`` (a notebook's JSON) as an nbformat 4 notebook of plain dicts."""
    import nbformat  # here: the grader's process imports it only when it reads notebooks

    if "nbformat" not in raw and isinstance(raw.get("cells"), list):
        raw.update(nbformat=4, nbformat_minor=raw.get("nbformat_minor", 0))  # cells: enough
    major = raw.get("nbformat")
    if not isinstance(major, int) or isinstance(major, bool):
        raise UnreadableNotebook("not a notebook: it has no nbformat version")
    if major not in nbformat.versions:
        raise UnreadableNotebook(f"nbformat {major} cannot be converted")
    minor = raw.get("nbformat_minor", 0)
    if major == 4 and not isinstance(raw.get("cells"), list):
        raise UnreadableNotebook("not a notebook: it has no list of cells")
    if major == 4 and not isinstance(raw.get("metadata"), dict):
        raw["metadata"] = {}  # all nbformat needs; a notebook without it is still a notebook
    try:
        nb = nbformat.versions[major].to_notebook_json(raw, minor=minor)
        nb = nbformat.convert(nb, 4)
        plain = json.loads(json.dumps(nb))
    except UnreadableNotebook:
        raise
    except Exception as exc:  # whatever nbformat makes of a malformed notebook
        detail = _detail(exc)
        if major != 4:
            raise UnreadableNotebook(f"nbformat {major} cannot be converted ({detail})") from None
        raise UnreadableNotebook(f"not a notebook nbformat can read ({detail})") from None
    return plain


def _detail(exc: Exception) -> str:
    """A short account of what nbformat raised."""
    if isinstance(exc, AttributeError | KeyError) and exc.args:
        return f"it has no {str(exc.args[0])[:60]!r}"
    text = str(exc).splitlines()[0][:120] if str(exc) else ""
    return text or type(exc).__name__


def parse_here(data: bytes) -> dict[str, Any]:
    """The notebook in ``data`` (a file's bytes) as an nbformat 4 dict; `UnreadableNotebook`
    when it is not one, with the reason."""
    try:
        raw = _json(data)
        if not isinstance(raw, dict):
            raise UnreadableNotebook(f"not a notebook: its JSON is {_json_kind(raw)}, not an "
                                     "object")
        nb = _to_v4(raw)
        if not isinstance(nb.get("cells"), list):
            raise UnreadableNotebook("not a notebook: it has no list of cells")
        return nb
    except UnreadableNotebook:
        raise
    except Exception as exc:  # RecursionError, MemoryError, anything nbformat raises
        raise UnreadableNotebook(f"not a notebook that can be read ({type(exc).__name__})"
                                 ) from None


def _json_kind(value: Any) -> str:
    kinds = {list: "a list", str: "a string", bool: "a boolean", int: "a number",
             float: "a number", type(None): "null"}
    return kinds.get(type(value), type(value).__name__)


def _reduced(nb: dict[str, Any]) -> dict[str, Any]:
    """What the grader reads of a notebook: no outputs, attachments or other metadata."""
    def meta(value: Any, key: str) -> dict[str, Any]:
        found = value.get(key) if isinstance(value, dict) else None
        return found if isinstance(found, dict) else {}

    cells = []
    for cell in nb["cells"]:
        if not isinstance(cell, dict):
            cells.append(None)
            continue
        src = cell.get("source", "")
        kept = {"cell_type": cell.get("cell_type"),
                "source": "".join(str(s) for s in src) if isinstance(src, list) else str(src),
                "metadata": {"nbgrader": meta(meta(cell, "metadata"), "nbgrader")}}
        if isinstance(cell.get("id"), str):
            kept["id"] = cell["id"]
        cells.append(kept)
    book = meta(meta(nb, "metadata"), "tested_transformer")
    return {"nbformat": 4, "nbformat_minor": nb.get("nbformat_minor", 0),
            "metadata": {"tested_transformer": book} if book else {}, "cells": cells}


def _parsing_process() -> None:
    """The parsing process: its bounds, then the bytes on stdin, then the answer on stdout:
    ``{"nb": ...}`` or ``{"error": reason}``."""
    import resource

    memory, cpu_s = int(sys.argv[1]), int(sys.argv[2])
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    data = sys.stdin.buffer.read()
    try:
        answer: dict[str, Any] = {"nb": _reduced(parse_here(data))}
    except UnreadableNotebook as exc:
        answer = {"error": exc.reason}
    sys.stdout.write(json.dumps(answer))


def parse_bounded(data: bytes) -> dict[str, Any]:
    """The notebook in ``data`` as the grader reads it (see the module's docstring), parsed in
    a bounded process; `UnreadableNotebook` when it is not a notebook or breaks a bound."""
    key = hashlib.sha256(data).digest()
    answer = _answers.get(key)  # one lookup: another thread may evict between two
    if answer is None:
        try:
            run = subprocess.run(
                [sys.executable, "-I", "-c", "from grader.notebook_json import _parsing_process;"
                 " _parsing_process()", str(PARSE_MEMORY), str(PARSE_CPU_S)],
                input=data, capture_output=True, timeout=PARSE_WALL_S, check=False)
            answer = json.loads(run.stdout) if run.returncode == 0 else None
        except (OSError, subprocess.SubprocessError, ValueError):
            answer = None
        if not isinstance(answer, dict) or not ("nb" in answer or "error" in answer):
            raise UnreadableNotebook(
                f"not a notebook the grader could read within its bounds "
                f"({PARSE_MEMORY // 2**30} GiB of memory, {PARSE_CPU_S} s of CPU time)")
        _answers[key] = answer
        while len(_answers) > _KEPT:
            _answers.popitem(last=False)
    if "error" in answer:
        raise UnreadableNotebook(str(answer["error"]))
    return copy.deepcopy(answer["nb"])
