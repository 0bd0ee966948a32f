"""Grade one submitted notebook in confined child processes: the grader's side.

The grader (this module) never imports or runs the student's code. Each child runs in a fresh
scratch folder of its own that holds a private copy of the notebook, with a stripped environment;
before the notebook's first line it poisons the code the assignment forbids and confines itself
with the kernel (`grader.child`, `grader.kernel`): it can read only Python, its
packages and the parts of ``utils`` the assignment allows, write only in its folder, start no
process, run no program, open no socket, signal no other process, and raise none of its limits.

Children are forked by `grader.zygote`, a process started once that has imported torch and
the student side of the checkers and nothing of any student, which saves the seconds of a fresh
interpreter per child; where ``os.fork`` is missing (or `use_fork` is False) each child is a
fresh process instead.

The grader draws every case's inputs afresh, sends them, reads back raw tensors through a
protocol of bounded frames (`grader.protocol`), checks every message against a schema, and
judges with the checker's reference in its own process. Time is counted in CPU seconds of the
child, read from the kernel, with a wall-clock backstop: a slow or busy machine does not make an
honest case fail. A child that hangs, dies, writes too much or sends a malformed message loses
that case only (flag ``timeout``, ``crashed``, ``limits`` or ``protocol``), and a new child goes
on with the next one.

The pieces, each in a module of its own: `grader.limits` (`Limits`, the child's
environment), `grader.policy` (what a child may read, what it must poison),
`grader.messages` (the schema of the child's messages), `grader.zygote_client`
(the zygote), `grader.children` (one child process) and `grader.sessions` (the
conversation with the children). This module holds `Grading`, which puts them together, and
`SubmissionResult`, the grade of one notebook.
"""

from __future__ import annotations

import random
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from utils.checks.checker import Case, Checker
from utils.checks.core import Spec
from utils.checks.guard import Assignment, Rule
from utils.checks.results import CheckResult

from .limits import INTERRUPTED, SCRATCH_BYTES, SCRATCH_FILES, Limits
from .messages import clean_flag
from .notebook_reading import UnreadableNotebook, code_cells, parse_notebook, read_notebook_bytes
from .policy import child_policy
from .scan import static_scan
from .sessions import Sessions

# What a case's failure says when a name it needs was never defined (a failed import).
_UNDEFINED = ("NameError", "ImportError", "ModuleNotFoundError", "defines no `")
MAX_FLAGS = 200  # flag messages read from one notebook; more are ignored
MAX_NOTES = 20
MAX_NOTE = 300

insecure = False
"""True (``--insecure``) grades without the kernel's confinement: limits and poison only."""


@dataclass
class SubmissionResult:
    """The grade of one notebook: one `CheckResult` per checker, flags and the cells' errors."""

    assignment: str
    checks: list[CheckResult] = field(default_factory=list)
    flags: list[str] = field(default_factory=list)
    cell_errors: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def points(self) -> float:
        """The points earned over every checker."""
        return sum(c.points for c in self.checks)

    @property
    def max_points(self) -> float:
        """The points the assignment is worth."""
        return sum(c.max_points for c in self.checks)

    def flag(self, text: str) -> None:
        """Add ``text`` to the flags once."""
        if text not in self.flags:
            self.flags.append(text)

    def note(self, text: str) -> None:
        """Add a note once, cut to `MAX_NOTE` characters; at most `MAX_NOTES` notes."""
        text = " ".join(str(text).split())[:MAX_NOTE]
        if text not in self.notes and len(self.notes) < MAX_NOTES:
            self.notes.append(text)


class _Marks:
    """What the grader makes of what it sees: flags, voided cases, judged results (a mixin of
    `Grading`, whose state it uses)."""

    def _void(self, rule: Rule, detail: str) -> None:
        """Score 0 every case the rule covers (the same code runs in all of them)."""
        self.result.flag("reference used")
        self.result.note(f"{rule.reason}" + (f" ({detail})" if detail else ""))
        for i, (checker, _, _) in enumerate(self.items):
            if rule.checks and checker.name not in rule.checks:
                continue
            if rule.reason not in self.case_flags[i]:
                self.case_flags[i].append(rule.reason)

    def _seen(self, rule: Rule, note: str) -> None:
        """A forbidden import or call made outside every case (by a cell of the notebook's own,
        or seen in its code): it failed, or never ran, and computed nothing for a case, whose
        inputs come later. Noted, and remembered for the cases that fail for want of a name it
        was to define (`_failed_imports`); the rest of the notebook is graded, as with a
        comparison with torch's."""
        if rule.id not in self.seen_rules:  # one note a rule: the scan's, or the cell's
            self.result.note(note)
            self.seen_rules.append(rule.id)

    def _on_flag(self, msg: dict[str, Any], during_cells: bool = False) -> None:
        self.flags_read += 1
        if self.flags_read > MAX_FLAGS:
            if self.flags_read == MAX_FLAGS + 1:  # first, so that no cap on notes hides it
                self.result.notes.insert(0, f"the notebook sent more than {MAX_FLAGS} reports; "
                                            "the rest were not read")
            return
        kind, detail = clean_flag(msg)
        if kind == "blocked":
            self.result.flag("blocked")
            self.result.note(f"the sandbox refused: {detail}")
        elif kind == "source":
            reason = "the notebook tried to read the book's sources or reference code"
            self.result.flag("reference used")
            self.result.note(f"{reason} ({detail[:120]})")
            for flags in self.case_flags:
                if reason not in flags:
                    flags.append(reason)
        elif kind in self.rules:
            rule = self.rules[kind]
            if during_cells:
                # A cell of the notebook's own (a comparison with torch's function or the
                # book's, say): the call or import failed and can compute nothing for a case,
                # whose inputs come later. Only a call made while a case runs voids it.
                if rule.kind == "module":
                    self._seen(rule, f"a cell of the notebook imported {detail[:80]}, which this "
                                     "assignment forbids; the import failed while grading, so "
                                     "a case whose code needs it loses its points; the rest is "
                                     "graded")
                else:
                    self._seen(rule, f"a cell of the notebook called {detail[:80]}, which this "
                                     "assignment forbids; it did not run while grading")
                return
            self._void(rule, detail[:120])

    def _check_targets(self, mros: dict[str, list[tuple[str, str]]]) -> None:
        for checker in self.assignment.checkers:
            for module, qualname in mros.get(checker.target, []):
                for rule in self.assignment.rules_for(checker.name):
                    if rule.kind == "code" and module == rule.target and (
                            not rule.qualname or qualname == rule.qualname or
                            qualname.startswith(rule.qualname + ".")):
                        self._void(rule, f"{checker.target} is {qualname}")
                    if rule.kind == "module" and (module == rule.target or
                                                  module.startswith(rule.target + ".")):
                        self._void(rule, f"{checker.target} is {qualname}")

    def _judge(self, position: int, raw: dict[str, Any]) -> None:
        checker, _, spec = self.items[position]
        if raw["status"] == "missing":
            hint: str | None = (f"the notebook defines no `{checker.target}` (after running all "
                                "its cells)")
        else:
            try:
                hint = checker.judge(spec, raw)
            except Exception as exc:  # a result the judge cannot handle is the student's loss
                hint = f"the result could not be compared ({type(exc).__name__})"
        reasons = self._failed_imports(checker.name, raw)
        if hint is not None and reasons:
            # A name the forbidden import was to define is what the case lacked (the book's
            # function as the solution, or called by it): the case is flagged, with its hint.
            self.result.flag("reference used")
            hint = f"{hint}; flagged: " + "; ".join(reasons) + " (not importable while grading)"
            self.outcome[position] = (hint, "reference used")
            return
        self.outcome[position] = (hint, "")

    def _failed_imports(self, check: str, raw: dict[str, Any]) -> list[str]:
        """The reasons of the forbidden imports seen outside every case (`_seen`) that apply to
        the checker ``check``, when ``raw`` failed for want of a name; else none."""
        if raw["status"] == "ok" or (raw["status"] != "missing" and not any(
                m in str(raw.get("message", "")) for m in _UNDEFINED)):
            return []
        return [r.reason for r in self.assignment.rules_for(check)
                if r.kind == "module" and r.id in self.seen_rules]

    def _finish(self, default: tuple[str, str]) -> SubmissionResult:
        by_checker: dict[str, CheckResult] = {}
        for i, (checker, case, _) in enumerate(self.items):
            hint, flag = self.outcome[i] or default
            if self.case_flags[i]:
                hint, flag = "flagged: " + "; ".join(self.case_flags[i]), "reference used"
            res = by_checker.setdefault(checker.name, CheckResult(checker.name))
            res.cases.append(checker.result(case, hint, flag))
            if flag and flag != "reference used":
                self.result.flag(flag)
        self.result.checks = list(by_checker.values())
        return self.result


class Grading(_Marks, Sessions):
    """The grading of one notebook for one assignment."""

    def __init__(self, notebook: Path, assignment: Assignment, limits: Limits | None = None,
                 seed: int | None = None):
        self.notebook = notebook
        self.assignment = assignment
        self.limits = limits or Limits()
        self.seed = secrets.randbits(31) if seed is None else seed
        self.rng = random.Random(self.seed)
        self.result = SubmissionResult(assignment.name)
        self.items: list[tuple[Checker, Case, Spec]] = []
        for j, checker in enumerate(assignment.checkers):
            for case, spec in zip(checker.cases, checker.specs(self.seed + 100 * j), strict=True):
                self.items.append((checker, case, spec))
        self.case_flags: list[list[str]] = [[] for _ in self.items]
        self.outcome: list[tuple[str | None, str] | None] = [None] * len(self.items)
        self.rules = {r.id: r for r in assignment.rules}
        self.flags_read = 0
        self.seen_rules: list[str] = []  # forbidden imports or calls seen outside every case
        self.cpu_used = 0.0
        self.stalled = False  # a child waited past its wall-clock backstop
        # The whole notebook's wall-clock backstop, that of its total CPU time (set again when
        # the grading starts).
        self.notebook_wall_by = time.monotonic() + self.limits.wall(self.limits.total_s)
        self.data = b""
        self.sources: list[str] = []

    # -- running ------------------------------------------------------------------------------

    def _start_message(self, rules: list[Rule], targets: list[str]) -> dict[str, Any]:
        policy = child_policy(rules)
        return {
            "op": "start", "cells": self.sources, "insecure": insecure,
            "poison_ops": policy["poison_ops"], "poison_python": policy["poison_python"],
            "forbidden_modules": policy["forbidden_modules"], "source_roots": policy["sources"],
            "readable": policy["readable"], "listable": policy["listable"],
            "targets": targets,
            "limits": {"memory_mb": self.limits.memory_mb,
                       "cpu_s": int(self.limits.cells_s + self.limits.total_s) + 5,
                       "scratch_bytes": SCRATCH_BYTES, "scratch_files": SCRATCH_FILES},
        }

    def run(self) -> SubmissionResult:
        """Grade the notebook; never raises because of what the notebook holds or does."""
        try:
            return self._run()
        except Exception as exc:  # noqa: BLE001 (one notebook must never stop the class)
            self.result.flag("grader error")
            self.result.note(f"the grader failed on this notebook ({type(exc).__name__}: "
                             f"{str(exc)[:150]}); grade it by hand or ask for a regrade")
            return self._finish(default=("not graded: the grader failed on this notebook",
                                         "grader error"))

    def _run(self) -> SubmissionResult:
        if insecure:
            self.result.flag("insecure")
        try:
            # Read once, refusing links, FIFOs and devices before opening them; the children
            # get a private copy of these very bytes.
            self.data = read_notebook_bytes(self.notebook)
            self.sources = code_cells(parse_notebook(self.data))
        except UnreadableNotebook as exc:
            self.result.flag("unreadable")
            self.result.note(f"the notebook could not be read: {exc.reason}")
            return self._finish(default=(f"the notebook could not be read ({exc.reason})",
                                         "unreadable"))
        for rule_id in static_scan(self.sources, self.assignment.rules):
            rule = self.rules[rule_id]
            what = f"{rule.target}.{rule.qualname}" if rule.qualname else rule.target
            fails = "cannot be imported" if rule.kind == "module" else "does not run"
            self._seen(rule, f"the notebook's code imports {what}, which this assignment "
                             f"forbids ({rule.reason}); it {fails} while grading, so a case "
                             "whose code needs it loses its points; the rest is graded")
        self.notebook_wall_by = time.monotonic() + self.limits.wall(self.limits.total_s)
        shared = [i for i, (c, _, s) in enumerate(self.items) if c.isolated(s) is None]
        isolated = [i for i in range(len(self.items)) if i not in shared]
        position = 0
        while position < len(shared) and not self._out_of_time():
            position = self._session(shared, position)
        for i in isolated:
            if self._out_of_time():
                break
            self._isolated(i)
        if INTERRUPTED.is_set():
            return self._finish(default=("not run: the grading was interrupted", "interrupted"))
        if self.stalled:
            return self._finish(default=("not run: an earlier case of this notebook waited past "
                                         "its wall-clock limit without computing", "timeout"))
        return self._finish(default=("the CPU time allowed for the whole notebook ran out before "
                                     "this case", "timeout"))

    def _out_of_time(self) -> bool:
        return (self.cpu_used >= self.limits.total_s or self.stalled
                or time.monotonic() >= self.notebook_wall_by or INTERRUPTED.is_set())

    def _rules_for(self, positions: list[int]) -> list[Rule]:
        names = {self.items[i][0].name for i in positions}
        return [r for r in self.assignment.rules if not r.checks or set(r.checks) & names]


def grade_notebook(notebook: Path, assignment: Assignment, limits: Limits | None = None,
                   seed: int | None = None) -> SubmissionResult:
    """Grade ``notebook`` for ``assignment`` in confined child processes."""
    return Grading(Path(notebook), assignment, limits, seed).run()
