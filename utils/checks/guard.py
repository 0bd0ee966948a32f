"""What an assignment forbids: its rules.

A `Rule` names a piece of reference code the student must not use in an assignment: a module of
the book (``utils.attention``), a class or function by module and qualified name (torch's
``nn.LayerNorm``), or one of torch's built-in operators (``scaled_dot_product_attention``).
Each assignment module declares its rules here, in an `Assignment`; the grader (the top-level
package `grader`, which the book's library never imports) enforces them in three layers:

* `grader.scan` reads the notebook's code for imports of a forbidden module or name, for a
  clear message, in a process of its own under a memory, CPU and wall-clock bound. A scan
  skipped or cut short loses only the message: the next layer enforces the same rules whatever
  the scan found;
* in the sandboxed child (`grader.child`, `grader.poison`), before the student's first line:
  the forbidden operators and Python code are replaced by code that reports the call and
  raises, whatever the route to them, and forbidden modules are neither loaded nor readable
  (`grader.kernel`'s Landlock policy, built by `grader.policy`);
* the grader, not the child, decides what a report means for the score.

In a notebook the checkers do not apply the rules; only the grader does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Rule", "Assignment"]


@dataclass
class Rule:
    """A piece of reference code an assignment forbids.

    ``kind`` is "module" (importing ``target`` or a submodule), "code" (calling code defined in
    module ``target`` whose qualified name is ``qualname`` or starts with ``qualname + "."``;
    every function of the module when ``qualname`` is empty) or "builtin" (calling torch's
    operator ``target``, or any of ``ops``, the operators that compute the same thing).
    ``checks`` limits it to some checkers of the assignment.
    """

    kind: str
    target: str
    reason: str
    qualname: str = ""
    checks: Sequence[str] = ()
    ops: Sequence[str] = ()

    @property
    def operators(self) -> list[str]:
        """The torch operators a "builtin" rule poisons: ``target`` and ``ops``."""
        return list(dict.fromkeys([self.target, *self.ops])) if self.kind == "builtin" else []

    @property
    def id(self) -> str:
        """A short stable id, used in messages between the child and the grader."""
        return f"{self.kind}:{self.target}:{self.qualname}"

    def to_payload(self) -> dict[str, Any]:
        """Plain data for the child."""
        return {"id": self.id, "kind": self.kind, "target": self.target, "qualname": self.qualname}


@dataclass
class Assignment:
    """An assignment: its notebook's name, its checkers and the rules that apply to it."""

    name: str
    checkers: list[Any]
    rules: list[Rule] = field(default_factory=list)

    def rules_for(self, check: str) -> list[Rule]:
        """The rules that apply to the checker named ``check``."""
        return [r for r in self.rules if not r.checks or check in r.checks]
