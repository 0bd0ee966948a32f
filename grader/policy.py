"""The confinement policy of a child: what it may read and list, and what it must poison.

For the grader (assignments' grading): `child_policy` turns an assignment's rules
(`utils.checks.guard.Rule`) into the Landlock paths a child may read (Python, its packages, the
parts of ``utils`` the rules allow: ``utils/checks`` and ``grader/`` never) and list, the sources
whose opening is reported (the book, the tests, the checkers' references), the torch operators to
poison (each rule's operators with their families, `poison.operator_family`) and the Python code
to poison, and the modules the child may not import. Policies are cached by the rules' ids.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import torch

from utils.checks.guard import Rule

from .poison import operator_family

ROOT = Path(__file__).resolve().parent.parent
UTILS = ROOT / "utils"


def _module_file(name: str) -> Path | None:
    """The source file of the module ``name`` (not imported), or None."""
    import importlib.util
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    origin = getattr(spec, "origin", None) if spec else None
    return Path(origin) if origin and origin.endswith(".py") else None


def _package_dirs(name: str) -> list[Path]:
    """The folders of the package ``name`` (not imported), each as found and resolved; [] for a
    plain module or one not found."""
    import importlib.util
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return []
    found: list[Path] = []
    for location in (getattr(spec, "submodule_search_locations", None) or []) if spec else []:
        for path in (Path(location), Path(location).resolve()):
            if path.is_dir() and path not in found:
                found.append(path)
    return found


def _with_pyc(path: Path) -> list[Path]:
    cache = path.parent / "__pycache__"
    found = [path]
    if cache.is_dir():
        found += [p for p in cache.iterdir() if p.name.startswith(path.stem + ".")]
    return found


def _allow_all_but(root: Path, excluded: set[Path], full: list[str], listing: list[str]) -> None:
    """Grant ``root`` whole (``full``) or, where something beneath it is excluded, its listing
    and each entry but the excluded ones, recursively."""
    if root in excluded:
        return
    if not any(root in p.parents for p in excluded):
        full.append(str(root))
        return
    listing.append(str(root))
    try:
        entries = sorted(root.iterdir())
    except OSError:
        return
    for entry in entries:
        if entry.is_dir() and not entry.is_symlink():
            _allow_all_but(entry, excluded, full, listing)
        elif entry not in excluded:
            full.append(str(entry))


_POLICIES: dict[tuple[str, ...], dict[str, list[str]]] = {}
_POLICY_LOCK = threading.Lock()


def child_policy(rules: list[Rule]) -> dict[str, list[str]]:
    """The Landlock policy and the poison of a child that runs under ``rules``."""
    key = tuple(sorted(r.id for r in rules))
    with _POLICY_LOCK:
        if key in _POLICIES:
            return _POLICIES[key]
    forbidden_modules = {r.target for r in rules if r.kind == "module"}
    excluded: set[Path] = set()
    sources = [str(ROOT / d) + "/" for d in ("book", "tests", "scripts", ".git", "_build")]
    # The checkers' references (never in a child's frames, so no traceback opens them).
    for path in sorted((UTILS / "checks").glob("a[0-9]_*.py")) + [UTILS / "checks" /
                                                                  "assignments.py"]:
        sources += [str(p) for p in _with_pyc(path)]
    for r in rules:
        target = r.target if r.kind in ("module", "code") else ""
        if target.startswith("utils.checks"):
            continue  # never in the child, never readable
        path = _module_file(target) if target else None
        if path is not None:
            excluded.update(_with_pyc(path))
            if r.kind == "module" or target.startswith("utils."):
                sources += [str(p) for p in _with_pyc(path)]
        if r.kind == "module":
            # A forbidden package: its whole folder unreadable, and reading in it reported.
            folders = _package_dirs(target)
            excluded.update(p.resolve() for p in folders)
            sources += [str(p) + "/" for p in folders]
    if any(r.kind == "builtin" for r in rules):
        torch_dir = Path(torch.__file__).resolve().parent
        excluded.update(torch_dir / d for d in ("_decomp", "_refs", "_prims"))
    full: list[str] = []
    listing: list[str] = []
    venv = Path(sys.prefix).resolve()
    _allow_all_but(venv, {p for p in excluded if venv in p.parents}, full, listing)
    base = Path(sys.base_prefix).resolve()
    if base != venv:
        full.append(str(base))
    # utils: the folder listed, then each allowed module of the book (utils/checks and grader/
    # never: the child imported what it needs of them before it confined itself).
    listing += [str(UTILS), str(UTILS / "__pycache__")]
    for path in sorted(UTILS.glob("*.py")):
        name = "utils" if path.stem == "__init__" else f"utils.{path.stem}"
        if name in forbidden_modules or any(name.startswith(m + ".") for m in forbidden_modules):
            continue
        if path in excluded:
            continue
        full += [str(p) for p in _with_pyc(path)]
    full += ["/usr", "/lib", "/lib64", "/etc/ld.so.cache", "/etc/localtime", "/etc/passwd",
             "/etc/group", "/etc/nsswitch.conf", "/dev/null", "/dev/zero", "/dev/urandom",
             "/dev/random", "/proc/cpuinfo", "/proc/meminfo", "/proc/stat",
             "/sys/devices/system/cpu"]
    # Each builtin rule's operators with their families: every overload, namespace, variant
    # and backward kernel of this torch's dispatcher (`poison.operator_family`).
    ops: dict[str, str] = {}
    for r in rules:
        if r.operators:
            for op in operator_family(r.operators):
                ops.setdefault(op, r.id)
    python = [(r.target, r.qualname, r.id, _what(r)) for r in rules
              if r.kind == "code" and not r.target.startswith("utils.checks")
              and r.target not in forbidden_modules]
    policy = {"readable": full, "listable": listing, "sources": sources,
              "poison_ops": list(ops.items()), "poison_python": python,
              "forbidden_modules": [(r.target, r.id) for r in rules if r.kind == "module"]}
    with _POLICY_LOCK:
        _POLICIES[key] = policy
    return policy


def _what(rule: Rule) -> str:
    name = rule.qualname or rule.target
    return f"{rule.target}.{rule.qualname}" if rule.qualname else name
