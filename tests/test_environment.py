"""The notebooks are tested in the environment a reader gets.

`make book` and `make lab` install requirements.txt into .venv, with constraints.txt pinning
everything it pulls in; `make test` runs every notebook with nbval in that same .venv
(`--nbval-current-env`). What only the grading needs, nbgrader and what it adds, goes into
.venv-grade, layered on top (the Makefile). So nothing may be installed in the tests' environment
that requirements.txt does not bring: a package there that a reader lacks could change what a
notebook prints (nbgrader once brought ipywidgets, and tqdm's warning on stderr went away in the
tests but not on a reader's machine).
"""

from __future__ import annotations

import importlib.metadata as metadata
import re
import sys

from packaging.markers import default_environment
from packaging.requirements import Requirement

from conftest import ROOT

# Installed in every venv by Python itself, and the book's own package (pip install -e .).
NOT_FROM_REQUIREMENTS = {"pip", "tested-transformer"}


def _name(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _pins(path) -> dict[str, str]:
    """``name == version`` lines of a requirements or constraints file, by normalized name."""
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", f"{path.name}: {line!r} is not an exact pin"
            pins[_name(req.name)] = spec.version
    return pins


def _installed() -> dict[str, metadata.Distribution]:
    return {_name(d.metadata["Name"]): d for d in metadata.distributions()}


def _closure(roots: list[str], installed: dict[str, metadata.Distribution]) -> set[str]:
    """The distributions that ``roots`` pull in, following each one's requirements with the
    extras asked for and the markers of this interpreter."""
    seen: set[tuple[str, frozenset[str]]] = set()
    todo = [(_name(r), frozenset()) for r in roots]
    while todo:
        name, extras = todo.pop()
        if (name, extras) in seen or name not in installed:
            continue
        seen.add((name, extras))
        for line in installed[name].requires or []:
            req = Requirement(line)
            if req.marker is None or any(
                    req.marker.evaluate({**default_environment(), "extra": extra})
                    for extra in ("", *extras)):
                todo.append((_name(req.name), frozenset(req.extras)))
    return {name for name, _ in seen}


def test_the_tests_run_in_the_books_venv():
    assert sys.prefix == str(ROOT / ".venv"), (
        f"the tests run in {sys.prefix}, not in {ROOT / '.venv'}, the environment `make book` "
        "gives a reader: run them with `make test`")


def test_the_environment_holds_exactly_what_requirements_txt_brings():
    installed = _installed()
    wanted = _closure(list(_pins(ROOT / "requirements.txt")), installed)
    missing = sorted(set(_pins(ROOT / "requirements.txt")) - set(installed))
    extra = sorted(set(installed) - wanted - NOT_FROM_REQUIREMENTS)
    assert not missing, f"requirements.txt names packages that are not installed: {missing}"
    assert not extra, (
        f"installed in the tests' environment but not brought by requirements.txt: {extra}; a "
        "reader's `make book` does not have them (nbgrader and its packages belong in "
        ".venv-grade, requirements-grade.txt; a .venv made before that split still has them: "
        "remove .venv and .venv-grade, and `make test` makes both again)")


def test_every_installed_version_is_the_pinned_one():
    """constraints.txt is `pip freeze` (which leaves setuptools out: requirements.txt pins it)."""
    pins = _pins(ROOT / "constraints.txt")
    for path in ("requirements.txt", "requirements-grade.txt"):
        for name, version in _pins(ROOT / path).items():
            assert pins.setdefault(name, version) == version, (
                f"{path} pins {name}=={version}, constraints.txt {pins[name]}")
    wrong = {name: (d.version, pins.get(name)) for name, d in _installed().items()
             if name not in NOT_FROM_REQUIREMENTS
             and d.version.split("+")[0] != pins.get(name)}  # 2.13.0+cpu is torch==2.13.0
    assert not wrong, f"installed version, pinned version: {wrong}"


def test_nbgrader_is_in_the_grading_environment_only():
    assert "nbgrader" not in _installed()
    grade = ROOT / ".venv-grade" / "lib"
    assert list(grade.glob("python3*/site-packages/nbgrader/__init__.py")), (
        f"nbgrader is not installed in {grade.parent}: `make test` installs it there")
