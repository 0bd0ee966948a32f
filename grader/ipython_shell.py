"""What stands for IPython in the grader's child (`grader.child`).

A notebook's code may use what IPython gives it without an import: ``get_ipython()`` (`Shell`),
its magics, ``display`` (`display`), and cells whose source `inspect.getsource` can read
(`remember_source`). The child runs with no IPython; these stand-ins behave as a kernel whose
output nobody reads would.
"""

from __future__ import annotations

import builtins
import getopt
import linecache
import os
import runpy
import shlex
import sys
import traceback
import types
from typing import Any

__all__ = ["Shell", "display", "remember_source", "run_file"]


def remember_source(source: str, name: str) -> str:
    """Put ``source`` in `linecache` under ``name``, as IPython does for each cell, so that
    `inspect.getsource` (and so ``@torch.jit.script``) finds the code compiled from it; an
    entry without a modification time is never dropped by `linecache.checkcache`."""
    linecache.cache[name] = (len(source), None, source.splitlines(True), name)
    return name


class _DisplayHandle:
    """What ``display(..., display_id=...)`` returns: its methods show nothing here either."""

    def __init__(self, display_id: Any):
        self.display_id = display_id

    def display(self, *objs: Any, **kwargs: Any) -> None:
        return None

    def update(self, *objs: Any, **kwargs: Any) -> None:
        return None


def display(*objs: Any, display_id: Any = None, **kwargs: Any) -> _DisplayHandle | None:
    """IPython's ``display``, a builtin in every notebook, as a kernel whose output nobody reads
    has it: it shows nothing and returns None (a handle when given a ``display_id``)."""
    if display_id is None or display_id is False:
        return None
    return _DisplayHandle(display_id)


def run_file(ns: dict[str, Any], line: str) -> None:
    """``%run [-i] [-n] [-e] [-m MODULE] FILE [ARGS]`` as IPython runs it: the file as
    ``__main__`` in a fresh namespace whose names are then copied into the notebook's
    (``-i``: in the notebook's namespace ``ns`` itself), with ``sys.argv`` set; an exception in the
    file is printed (to the child's log), the names it made are kept and the cell goes on,
    as in IPython. Timing, profiling and debugging options run the file once. A file that is
    not there raises. Notebooks (``.ipynb``, ``.ipy``) cannot be run while grading."""
    opts, words = getopt.getopt(shlex.split(line), "nidtN:b:pD:l:rs:T:em:G")
    flags = dict(opts)
    if "-m" in flags:
        words = [flags["-m"], *words]
    if not words:
        raise ValueError("%run: you must provide at least a filename")
    path = os.path.expanduser(words[0])
    if "-m" not in flags:
        if not os.path.isfile(path) and not path.endswith(".py") and \
                os.path.isfile(path + ".py"):
            path += ".py"
        if not os.path.isfile(path):
            raise OSError(f"File {path!r} not found.")
        if path.lower().endswith((".ipy", ".ipynb")):
            raise OSError(f"%run {path}: running a notebook is not supported while grading")
    name = os.path.splitext(os.path.basename(path))[0] if "-n" in flags else "__main__"
    if "-i" in flags:
        prog_ns = ns
        saved = prog_ns.get("__name__")
        prog_ns["__name__"] = name
        prog_ns["__file__"] = path
        module = sys.modules["__main__"]
    else:
        module = types.ModuleType(name)
        prog_ns = module.__dict__
        prog_ns.update({"__file__": path, "__builtins__": builtins})
    saved_argv, saved_main = sys.argv, sys.modules.get(name)
    folder = os.path.dirname(os.path.abspath(path))
    added = folder not in sys.path
    if added:
        sys.path.insert(0, folder)
    sys.argv = [path, *words[1:]]
    sys.modules[name] = module
    try:
        if "-m" in flags:
            prog_ns.update(runpy.run_module(flags["-m"], run_name=name))
        else:
            with open(path, encoding="utf-8") as f:
                source = f.read()
            code = compile(source, path, "exec", dont_inherit=True)
            exec(code, prog_ns)  # noqa: S102 (the submission's code)
    except SystemExit as exc:
        if exc.code not in (None, 0) and "-e" not in flags:
            traceback.print_exc()
    except Exception:  # noqa: BLE001 (IPython prints it and goes on with the cell)
        traceback.print_exc()
    finally:
        sys.argv = saved_argv
        if added and folder in sys.path:
            sys.path.remove(folder)
        if saved_main is not None:
            sys.modules[name] = saved_main
        else:
            sys.modules.pop(name, None)
        if "-i" in flags:
            ns["__name__"] = saved
    if "-i" not in flags:
        prog_ns.pop("__name__", None)
        file_ = ns.get("__file__")
        ns.update(prog_ns)
        ns["__builtins__"] = builtins
        if file_ is None:
            ns.pop("__file__", None)
        else:
            ns["__file__"] = file_
    return None


class Shell:
    """What ``get_ipython()`` returns in the grader. The magics that run Python code run it once
    (``%time``, ``%timeit``, ``%%time``, ``%%capture``, ...), ``%%writefile`` writes its file in
    the scratch folder, ``%run`` runs a file as IPython does (`run_file`); the others, and shell
    commands, do nothing (a ``!pip install`` left in a notebook must not stop the rest of its
    cell)."""

    RUNS_CODE = frozenset(("time", "timeit", "capture", "prun", "debug"))

    def __init__(self, ns: dict[str, Any]):
        self.ns = ns
        self.user_ns = ns
        self.magics = 0

    def _run(self, code: str) -> Any:
        """Run ``code`` in the notebook's namespace; the value of an expression, as ``x = %time
        f()`` expects it."""
        self.magics += 1
        name = remember_source(code, f"<magic {self.magics}>")
        try:
            expression = compile(code, name, "eval", dont_inherit=True)
        except SyntaxError:
            exec(compile(code, name, "exec", dont_inherit=True), self.ns)  # noqa: S102 (the submission's code)
            return None
        return eval(expression, self.ns)  # noqa: S307 (the submission's code)

    def run_file(self, line: str) -> None:
        """``%run``: `run_file` in the notebook's namespace."""
        run_file(self.ns, line)

    def run_line_magic(self, name: str, line: str, *args: Any, **kwargs: Any) -> Any:
        if name == "run":
            return self.run_file(line)
        if name in self.RUNS_CODE:
            words = line.split()
            while words and words[0].startswith("-"):  # %timeit -n 10 -r 3 expr
                words = words[2:] if words[0] in ("-n", "-r") else words[1:]
            return self._run(" ".join(words))
        return None

    def run_cell_magic(self, name: str, line: str, cell: str, *args: Any, **kwargs: Any) -> None:
        if name in self.RUNS_CODE:
            if name == "capture" and line.split():
                target = line.split()[-1]
                if target.isidentifier():
                    self.ns[target] = None
            self._run(cell)
        elif name == "writefile":  # IPython's rules: quotes, "~", UTF-8, -a or --append
            try:
                words = shlex.split(line)
            except ValueError:
                words = line.split()
            if words:
                mode = "a" if {"-a", "--append"} & set(words[:-1]) else "w"
                with open(os.path.expanduser(words[-1]), mode, encoding="utf-8") as f:
                    f.write(cell)
        return None

    def system(self, cmd: str, *args: Any, **kwargs: Any) -> None:
        return None

    def getoutput(self, cmd: str, *args: Any, **kwargs: Any) -> list[str]:
        return []

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None


def install(shell: Shell) -> None:
    """Make ``get_ipython()`` return ``shell`` however it is reached: the builtin, and
    ``from IPython import get_ipython`` (the zygote has imported IPython already; a fresh child
    imports it here, from packages it may read)."""
    builtins.get_ipython = lambda: shell  # type: ignore[attr-defined]
    builtins.display = display  # type: ignore[attr-defined]
    try:
        import IPython
        import IPython.core.getipython
    except ImportError:
        return
    IPython.get_ipython = IPython.core.getipython.get_ipython = lambda: shell
