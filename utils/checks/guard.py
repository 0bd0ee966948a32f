"""What an assignment forbids: rules, and a static scan of the notebook's text.

A `Rule` names a piece of reference code the student must not use in an assignment: a module of
the book (``utils.attention``), a class or function by module and qualified name (torch's
``nn.LayerNorm``), or one of torch's built-in operators (``scaled_dot_product_attention``).
Three layers enforce them:

* `static_scan` reads the notebook's code in the grader's own process: imports of a forbidden
  module or name, for a clear message;
* in the sandboxed child (`utils.checks.child`, `utils.checks.poison`), before the student's
  first line: the forbidden operators and Python code are replaced by code that reports the
  call and raises, whatever the route to them, and forbidden modules are neither loaded nor
  readable (`utils.checks.kernel`'s Landlock policy, built by `utils.checks.policy`);
* the grader, not the child, decides what a report means for the score.
"""

from __future__ import annotations

import ast
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Rule", "Assignment", "static_scan"]


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


# --------------------------------------------------------------------------------------------
# The static scan, in the grader's process


def _imports(tree: ast.AST) -> list[tuple[str, list[str]]]:
    """(module, [names]) for every import in ``tree``; ``from a import b`` also yields a.b."""
    out: list[tuple[str, list[str]]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [a.name for a in node.names]
            out.append((node.module, names))
            out += [(f"{node.module}.{n}", []) for n in names]
        elif (isinstance(node, ast.Call) and isinstance(node.func, (ast.Name, ast.Attribute))
              and getattr(node.func, "id", getattr(node.func, "attr", "")) in
              ("__import__", "import_module") and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            out.append((node.args[0].value, []))
    return out


def static_scan(sources: Sequence[str], rules: Sequence[Rule]) -> list[str]:
    """The ids of the rules that the code ``sources`` visibly breaks by an import."""
    found: list[str] = []
    for src in sources:
        try:
            tree = ast.parse(src)
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            continue  # text that Python cannot parse (without exhausting itself) imports nothing
        for module, names in _imports(tree):
            for rule in rules:
                hit = False
                if rule.kind == "module":
                    hit = module == rule.target or module.startswith(rule.target + ".")
                elif rule.kind == "code" and rule.target.startswith("utils."):
                    hit = module == rule.target and rule.qualname.split(".")[0] in names
                if hit and rule.id not in found:
                    found.append(rule.id)
    return found
