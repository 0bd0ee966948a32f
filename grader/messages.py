"""The child's messages, checked against a schema before the grader uses a field of them.

For the grader (assignments' grading), which trusts nothing a child sends: `clean_flag`,
`clean_ready` (the cells' errors and each target's MRO) and `clean_result` (a case's raw tensors
by name) accept only the fields, types and sizes they expect, and raise `ProtocolError`
otherwise; `_clean_arg` does the same for the arguments of an oracle call (ints, floats, bools,
lists, tensors of at most 65536 elements).
"""

from __future__ import annotations

from typing import Any

import torch

from .protocol import ProtocolError


def _str(value: Any, limit: int) -> str:
    if not isinstance(value, str):
        raise ProtocolError("a field that should be text")
    return value[:limit]


def _int(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ProtocolError("a field that should be an integer")
    return value


def _fields(msg: dict[str, Any], allowed: set[str]) -> None:
    if not set(msg) <= allowed:
        raise ProtocolError(f"unexpected fields {sorted(set(msg) - allowed)[:3]}")


def clean_flag(msg: dict[str, Any]) -> tuple[str, str]:
    """A ``flag`` message: (kind, detail)."""
    _fields(msg, {"op", "kind", "detail"})
    return _str(msg.get("kind"), 200), _str(msg.get("detail", ""), 300)


def clean_ready(msg: dict[str, Any]) -> tuple[list[str], dict[str, list[tuple[str, str]]]]:
    """A ``ready`` message: the cells' errors as text, and each target's MRO."""
    _fields(msg, {"op", "errors", "targets"})
    errors, targets = msg.get("errors"), msg.get("targets")
    if not isinstance(errors, list) or len(errors) > 20 or not isinstance(targets, dict) or \
            len(targets) > 20:
        raise ProtocolError("a malformed ready message")
    texts = []
    for err in errors:
        if not isinstance(err, dict):
            raise ProtocolError("a malformed cell error")
        _fields(err, {"cell", "error"})
        texts.append(f"cell {_int(err.get('cell'))}: {_str(err.get('error'), 200)}")
    mros: dict[str, list[tuple[str, str]]] = {}
    for name, info in targets.items():
        if not isinstance(info, dict):
            raise ProtocolError("a malformed target")
        _fields(info, {"exists", "type", "mro"})
        mro = info.get("mro", [])
        if not isinstance(mro, list) or len(mro) > 50:
            raise ProtocolError("a malformed target")
        entries = []
        for entry in mro:
            if not (isinstance(entry, list) and len(entry) == 2):
                raise ProtocolError("a malformed target")
            entries.append((_str(entry[0], 200), _str(entry[1], 200)))
        mros[_str(name, 100)] = entries
    return texts, mros


def clean_result(msg: dict[str, Any], position: int) -> dict[str, Any]:
    """A ``result`` message: the raw result of case ``position``, every value checked."""
    _fields(msg, {"op", "id", "raw"})
    if _int(msg.get("id")) != position:
        raise ProtocolError("a result for another case")
    raw = msg.get("raw")
    if not isinstance(raw, dict):
        raise ProtocolError("a result that is not a dict")
    _fields(raw, {"status", "message", "tensors", "notes"})
    tensors = raw.get("tensors", {})
    notes = raw.get("notes", [])
    if not isinstance(tensors, dict) or len(tensors) > 256 or not isinstance(notes, list) or \
            len(notes) > 10:
        raise ProtocolError("a malformed result")
    clean = {}
    for key, value in tensors.items():
        if not isinstance(value, torch.Tensor):
            raise ProtocolError("a result value that is not a tensor")
        clean[_str(key, 200)] = value
    return {"status": _str(raw.get("status"), 30), "message": _str(raw.get("message", ""), 300),
            "tensors": clean, "notes": [_str(n, 100) for n in notes]}


def _clean_arg(value: Any, depth: int = 0) -> Any:
    if depth > 4:
        raise ProtocolError("an argument nested too deeply")
    if isinstance(value, list):
        if len(value) > 4096:
            raise ProtocolError("an argument too long")
        return [_clean_arg(v, depth + 1) for v in value]
    if isinstance(value, torch.Tensor):
        if value.numel() > 65536:
            raise ProtocolError("an argument too large")
        return value
    if value is None or isinstance(value, (bool, int, float)):
        return value
    raise ProtocolError("an argument of an unexpected type")
