"""The static scan: a notebook's code read for imports that an assignment's rules forbid.

For the grader (assignments' grading), for a clear message only. It parses untrusted text, so it
does so in a process of its own under a memory, CPU and wall-clock bound (`SCAN_MEMORY`,
`SCAN_CPU_S`, `SCAN_WALL_S`), and not at all for code over `SCAN_BYTES`: parsing costs the
parser a few hundred bytes of memory per byte of code, which in the grader's process would let
one notebook take gigabytes from the grading of the class. A scan skipped or cut short loses
only the message: the sandboxed child enforces the same rules (`utils.checks.guard`) whatever
the scan found.
"""

from __future__ import annotations

import ast
import functools
import inspect
import json
import subprocess
import sys
from collections.abc import Sequence

from utils.checks.guard import Rule

__all__ = ["static_scan", "scan_imports"]

SCAN_BYTES = 2**20
"""Code (UTF-8 bytes, all cells) above which the static scan is skipped: 23 times the largest
chapter's code and 5 times the largest honest notebook the grader has met (about 200 KB)."""
SCAN_MEMORY = 512 * 2**20  # the scanning process's address space
SCAN_CPU_S = 5
SCAN_WALL_S = 20


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


def _scan_here(sources: Sequence[str]) -> list[tuple[str, list[str]]]:
    """Every import of ``sources``, each distinct one once (run in the scanning process)."""
    seen: dict[str, tuple[str, list[str]]] = {}
    for src in sources:
        try:
            tree = ast.parse(src)
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            continue  # text that Python cannot parse (without exhausting itself) imports nothing
        try:
            for module, names in _imports(tree):
                seen.setdefault(json.dumps([module, names]), (module, names))
        except (RecursionError, MemoryError):
            continue
        del tree
    return list(seen.values())


def scan_imports(sources: Sequence[str]) -> list[tuple[str, list[str]]] | None:
    """Every import of ``sources``, read in a process of its own (``python -I -S`` running
    `_scanning_process`, `_scan_here` and `_imports`, nothing else) limited to `SCAN_MEMORY`
    of address space, `SCAN_CPU_S` of CPU time and `SCAN_WALL_S` of waiting; None when the
    code is over `SCAN_BYTES` or the process did not finish within its bounds (the scan is
    then skipped)."""
    sources = [str(s) for s in sources]
    if sum(len(s) for s in sources) > SCAN_BYTES or sum(  # characters first: no copy made
            len(s.encode("utf-8", "surrogatepass")) for s in sources) > SCAN_BYTES:
        return None
    payload = json.dumps(sources).encode("ascii")
    try:
        run = subprocess.run([sys.executable, "-I", "-S", "-c", _scanner_code(),
                              str(SCAN_MEMORY), str(SCAN_CPU_S)], input=payload,
                             capture_output=True, timeout=SCAN_WALL_S, check=False)
        if run.returncode != 0:
            return None
        found = json.loads(run.stdout)
        return [(str(module), [str(n) for n in names]) for module, names in found]
    except (OSError, subprocess.SubprocessError, ValueError, TypeError):
        return None


def static_scan(sources: Sequence[str], rules: Sequence[Rule]) -> list[str]:
    """The ids of the rules that the code ``sources`` visibly breaks by an import (none when
    the scan is skipped: see `scan_imports`)."""
    found: list[str] = []
    for module, names in scan_imports(sources) or []:
        for rule in rules:
            hit = False
            if rule.kind == "module":
                hit = module == rule.target or module.startswith(rule.target + ".")
            elif rule.kind == "code" and rule.target.startswith("utils."):
                hit = module == rule.target and rule.qualname.split(".")[0] in names
            if hit and rule.id not in found:
                found.append(rule.id)
    return found


def _scanning_process() -> None:
    """The scanning process: its limits first, then the sources (a JSON list on stdin), then
    their imports (a JSON list on stdout)."""
    import resource

    memory, cpu_s = int(sys.argv[1]), int(sys.argv[2])
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    sources = json.loads(sys.stdin.buffer.read())
    sys.stdout.write(json.dumps(_scan_here([str(s) for s in sources])))



@functools.cache
def _scanner_code() -> str:
    """The scanning process's program: these three functions and a call, without importing
    this module (its dataclasses would double the process's start-up time)."""
    parts = [inspect.getsource(f) for f in (_imports, _scan_here, _scanning_process)]
    return "\n".join(["from __future__ import annotations", "import ast, json, sys",
                      "from collections.abc import Sequence", *parts, "_scanning_process()"])
