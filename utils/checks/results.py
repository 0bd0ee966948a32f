"""Results: what a checker returns and prints, for every assignment (the book's "For courses" part).

A `CaseResult` is one case's outcome (its points and the hint a student reads); a `CheckResult`
gathers the cases of one ``check_*`` call and gives ``passed``, ``score`` and the printed lines.
They hold plain values only, so that the grader's child can build them and the grader can read
them back.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field

__all__ = ["CaseResult", "CheckResult"]


@dataclass
class CaseResult:
    """The outcome of one case: its name, whether it passed, its points, and the hint."""

    name: str
    passed: bool
    hint: str = ""
    points: float = 0.0
    max_points: float = 1.0
    case_id: str = ""
    flag: str = ""  # "timeout", "crashed", "reference used" when one applies

    def line(self) -> str:
        """The one line that reports this case."""
        return f"[PASS] {self.name}" if self.passed else f"[FAIL] {self.name}: {self.hint}"

    def printed(self, width: int = 88) -> str:
        """``line()`` wrapped to ``width`` characters (the book's column holds 88), the lines
        after the first indented under the case's name."""
        return textwrap.fill(self.line(), width=width, subsequent_indent=" " * 7,
                             break_long_words=False, break_on_hyphens=False)


@dataclass
class CheckResult:
    """What a checker returns: the cases it ran, ``passed`` and ``score`` for a grader."""

    check: str
    cases: list[CaseResult] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        """True when every case passed."""
        return bool(self.cases) and all(c.passed for c in self.cases)

    @property
    def points(self) -> float:
        """The points earned."""
        return float(sum(c.points for c in self.cases))

    @property
    def max_points(self) -> float:
        """The points all cases are worth."""
        return float(sum(c.max_points for c in self.cases))

    @property
    def score(self) -> float:
        """The fraction of the points earned, from 0 to 1."""
        return self.points / self.max_points if self.max_points else 0.0

    @property
    def hints(self) -> list[str]:
        """The hints of the failed cases."""
        return [c.hint for c in self.cases if not c.passed]

    def summary(self) -> str:
        """The last printed line."""
        n_pass = sum(c.passed for c in self.cases)
        return (f"{self.check}: {n_pass}/{len(self.cases)} cases passed, "
                f"{self.points:g} of {self.max_points:g} points")

    def __repr__(self) -> str:
        return f"CheckResult({self.check!r}, passed={self.passed}, score={self.score:.2f})"
