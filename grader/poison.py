"""Forbidden code made unusable in the grader's child, whatever the route to it.

An assignment's rules (`utils.checks.guard.Rule`) name the reference code a student may not
use. Looking for those names in the notebook's text misses ``functools.partial(F.layer_norm,
...)``, ``getattr(torch, "layer" + "_norm")`` or code built with ``exec``; watching calls from
inside the student's process can be switched off by that process. So before the student's first
line the child makes the forbidden code itself fail, at the place every route leads to:

* torch's built-in operators (``aten::scaled_dot_product_attention``, ``aten::native_layer_norm``,
  ...) get a kernel of the child's own, registered with torch's dispatcher for every computing
  dispatch key where the operator has one, that reports the call to the grader and raises
  `PermissionError`. ``F.scaled_dot_product_attention``, ``torch.ops.aten...``,
  ``torch._C._nn...`` and any other binding all go through the dispatcher. A rule's operator
  stands for its family (`families.operator_family`: every overload, namespace, variant and
  backward kernel). The registration's handle is kept alive by a reference that no Python
  object holds, so no code in the process can take it back; torch's Python decompositions of
  the family are poisoned too, with the helpers only they use (``_refs._normalize``).
* Python functions and classes (``F.layer_norm``, ``nn.MultiheadAttention``, ...) have their
  code replaced in place, so every reference to them now holds code that reports and raises; the
  Landlock policy keeps their source files unreadable, so the original cannot be rebuilt.

Reports go straight to the grader's pipe with functions captured here, before any student code
ran; a report is lost if the student's code closes that pipe, but the call still fails.
"""

from __future__ import annotations

import ctypes
import importlib
import inspect
import json.encoder
import os
import struct
import sys
import types
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from . import families
from .families import (
    _DECOMP_MODULES,
    _base_name,
    _decomposition_table,
    _functions_in,
    _private_helpers,
    _references,
    family_words,
    index_decompositions,
    operator_family,
)

__all__ = ["Reporter", "family_words", "operator_family", "index_decompositions",
           "poison_operators", "poison_python", "install_audit_hook"]

# The dispatch keys whose kernels compute values (not Meta's shapes, not the autograd, tracing,
# batching or autocast layers, which end in one of these).
_DISPATCH_KEYS = (
    "CPU CUDA XPU MPS HPU MTIA PrivateUse1 QuantizedCPU QuantizedCUDA SparseCPU SparseCUDA "
    "SparseCsrCPU SparseCsrCUDA NestedTensorCPU NestedTensorCUDA MkldnnCPU "
    "CompositeImplicitAutograd CompositeImplicitAutogradNestedTensor CompositeExplicitAutograd "
    "CompositeExplicitAutogradNonFunctional").split()


class Reporter:
    """Sends ``flag`` frames to the grader through functions captured now, before the student's
    code could replace them: ``reporter(kind, detail)``."""

    def __init__(self, fd: int):
        esc = json.encoder.c_encode_basestring_ascii or json.encoder.py_encode_basestring_ascii
        pack = struct.Struct(">I").pack
        write = os.write

        def report(kind: str, detail: str) -> None:
            body = ('{"body":{"op":"flag","kind":' + esc(str(kind)[:200]) + ',"detail":'
                    + esc(str(detail)[:300]) + '},"tensors":[]}').encode("ascii")
            payload = pack(len(body)) + body
            frame = pack(len(payload)) + payload
            try:
                write(fd, frame)
            except OSError:
                pass

        self.report = report

    def __call__(self, kind: str, detail: str) -> None:
        self.report(kind, detail)


def _raiser(message: str, report: Callable[[], None]) -> Callable[..., Any]:
    def forbidden(*args: Any, **kwargs: Any) -> Any:
        report()
        raise PermissionError(message)
    return forbidden


def _computing_keys(table: str) -> list[str]:
    keys = [line.partition(":")[0].removesuffix("[alias]") for line in table.splitlines()]
    return list(dict.fromkeys(k for k in keys if k in _DISPATCH_KEYS))  # in order, once each


def poison_operators(ops: Sequence[tuple[str, str]], reporter: Reporter) -> list[str]:
    """Make each torch operator ``(name, rule id)`` report and raise, through the dispatcher:
    ``name`` is ``ns::name.overload`` (a family's member, from `operator_family`) or a plain
    ``name`` (aten's, its default overload), and a kernel of its own replaces each of its
    computing kernels (`_DISPATCH_KEYS`).

    Returns the operators poisoned (those this torch has, with a kernel that computes)."""
    done: list[str] = []
    if not ops:
        return done
    libs: dict[str, Any] = {}
    bases: dict[str, str] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "overriding a previously registered kernel"
        for name, rule_id in ops:
            qualified = name if "::" in name else f"aten::{name}"
            namespace, _, op = qualified.partition("::")
            base = op.partition(".")[0]
            bases.setdefault(base, rule_id)
            try:
                table = torch._C._dispatch_dump(qualified)
            except RuntimeError:
                continue  # this torch has no such operator
            keys = _computing_keys(table)
            if not keys:
                continue
            shown = op if namespace == "aten" else qualified
            fn = _raiser(f"torch's {shown} may not be used in this assignment",
                         _reporting(reporter, rule_id, shown))
            if namespace not in libs:
                libs[namespace] = torch.library.Library(namespace, "IMPL")
            for key in keys:
                libs[namespace].impl(op, lambda *a, _fn=fn, **k: _fn(*a, **k), key)
            done.append(qualified)
    for lib in libs.values():
        _keep_forever(lib)
    _poison_decompositions(set(bases), bases, reporter)
    return done


def _reporting(reporter: Reporter, rule_id: str, detail: str) -> Callable[[], None]:
    def report() -> None:
        reporter(rule_id, detail)
    return report


def _keep_forever(lib: Any) -> None:
    """Keep the dispatcher registrations of ``lib`` for the life of the process: its finalizer
    (which torch would let any code run early) is detached, and its C++ handle gets a reference
    that no Python object holds."""
    import weakref
    # Newest first: the library's finalizer was made with it, after every other (reading every
    # finalizer of the process would copy, page by page, what a forked child shares).
    for fin in reversed(getattr(weakref.finalize, "_registry", {})):
        try:
            if fin.peek() is not None and fin.peek()[0] is lib:
                fin.detach()
                break
        except ReferenceError:
            continue
    for handle in [getattr(lib, "m", None), *getattr(lib, "_registration_handles", [])]:
        if handle is not None:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(handle))
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(lib))


def _poison_decompositions(names: set[str], rule_of: dict[str, str], reporter: Reporter) -> None:
    """torch's Python decompositions and references of the operators ``names``: through the
    zygote's index where it still describes this process, and whatever was imported or
    registered since, read in full."""
    if not names:
        return
    table = _decomposition_table()
    index = families._INDEX
    if index is not None and len(table) == index.table_size:
        table_ops = [(op, name) for name in names for op in index.ops.get(name, [])]
    else:
        table_ops = [(op, base) for op in list(table) if (base := _base_name(op)) in names]
    for op, base in table_ops:
        table[op] = _raiser(f"torch's {base} may not be used in this assignment",
                            _reporting(reporter, rule_of[base], base))
    indexed = index.modules if index is not None else frozenset()
    late: dict[str, list[types.FunctionType]] = {}  # in modules imported after the index
    for mod_name in [m for m in list(sys.modules) if m.startswith(_DECOMP_MODULES)]:
        if mod_name not in indexed:
            for f in _functions_in(sys.modules.get(mod_name)):
                late.setdefault(f.__name__, []).append(f)

    def lookup(name: str) -> list[types.FunctionType]:
        return (index.functions.get(name, []) if index is not None else []) + late.get(name, [])

    if index is not None and not late:
        refs, callers = index.refs, index.callers
    else:
        every = dict(index.functions) if index is not None else {}
        for name, fns in late.items():
            every[name] = every.get(name, []) + fns
        refs, callers = _references(every)
    rule_of = dict(rule_of)
    every = (index.functions if index is not None else {}) | late
    for name, user in families.named_variants(names, every).items():  # the family's too
        rule_of.setdefault(name, rule_of[user])
    for helper, user in _private_helpers(set(rule_of), refs, callers).items():
        rule_of[helper] = rule_of[user]
    functions = [f for name in rule_of for f in lookup(name)]
    for fn in functions:
        _replace_code(fn, f"torch's {fn.__name__} may not be used in this assignment",
                      _reporting(reporter, rule_of[fn.__name__], fn.__name__))


_POISON_CODES: dict[int, types.CodeType] = {}


def _poison_code(nfree: int) -> types.CodeType:
    """A code object that calls its ``_report`` keyword default and raises `PermissionError`
    with its ``_message``, with ``nfree`` free variables (so that it can replace the code of a
    function that has a closure); one per ``nfree``, compiled once."""
    if nfree in _POISON_CODES:
        return _POISON_CODES[nfree]
    names = [f"_cell{i}" for i in range(nfree)]
    inner = ["    def forbidden(*args, _report=None, _message='forbidden', **kwargs):"]
    if names:
        inner.append("        (" + ", ".join(names) + ",)")
    inner += ["        if _report is not None:", "            _report()",
              "        raise PermissionError(_message)"]
    src = "def outer():\n" + "".join(f"    {n} = None\n" for n in names) + "\n".join(inner) + \
        "\n    return forbidden\n"
    scope: dict[str, Any] = {}
    exec(compile(src, "<forbidden>", "exec"), scope)  # noqa: S102 (our own text)
    _POISON_CODES[nfree] = scope["outer"]().__code__
    return _POISON_CODES[nfree]


def _replace_code(fn: types.FunctionType, message: str, report: Callable[[], None]) -> None:
    fn.__code__ = _poison_code(len(fn.__code__.co_freevars))
    fn.__defaults__ = None
    fn.__kwdefaults__ = {"_report": report, "_message": message}


def _functions_of(obj: Any) -> Iterable[types.FunctionType]:
    """Every Python function that makes up ``obj``: itself and what it wraps, or a class's
    methods (static, class, properties included)."""
    seen: set[int] = set()
    todo = [obj]
    while todo:
        item = todo.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, (staticmethod, classmethod)):
            todo.append(item.__func__)
        elif isinstance(item, property):
            todo += [f for f in (item.fget, item.fset, item.fdel) if f is not None]
        elif inspect.isfunction(item):
            yield item
            wrapped = getattr(item, "__wrapped__", None)
            if wrapped is not None:
                todo.append(wrapped)
        elif isinstance(item, type):
            todo += list(vars(item).values())


def poison_python(targets: Sequence[tuple[str, str, str, str]], reporter: Reporter) -> list[str]:
    """Replace the code of Python functions and classes: ``(module, qualname, rule id, what)``
    for each; an empty qualname means every function and class defined in the module. Modules
    not imported yet are imported first (their files are unreadable afterwards). Returns what
    was poisoned."""
    done = []
    for module_name, qualname, rule_id, what in targets:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        if qualname:
            obj: Any = module
            try:
                for part in qualname.split("."):
                    obj = getattr(obj, part)
            except AttributeError:
                continue
            objs = [obj]
        else:
            objs = [v for v in vars(module).values()
                    if (inspect.isfunction(v) or isinstance(v, type))
                    and getattr(v, "__module__", None) == module_name]
        for obj in objs:
            for fn in _functions_of(obj):
                _replace_code(fn, f"{what} may not be used in this assignment",
                              _reporting(reporter, rule_id, what))
        done.append(f"{module_name}.{qualname}" if qualname else module_name)
    return done


_DENIED_EVENTS = {
    "gc.get_objects": "inspecting every object of the process",
    "gc.get_referrers": "inspecting every object of the process",
    "gc.get_referents": "inspecting every object of the process",
    "ctypes.dlopen": "loading native code", "ctypes.dlsym": "loading native code",
    "ctypes.call_function": "calling native code", "ctypes.cdata": "raw memory access",
    "ctypes.cdata/buffer": "raw memory access", "ctypes.addressof": "raw memory access",
    "ctypes.string_at": "raw memory access", "ctypes.wstring_at": "raw memory access",
    "ctypes.PyObj_FromPtr": "raw memory access", "ctypes.set_exception": "raw memory access",
    "builtins.input": "reading the keyboard",
}


def install_audit_hook(forbidden_modules: Sequence[tuple[str, str]], source_roots: Sequence[str],
                       reporter: Reporter, scratch: str = "") -> None:
    """An audit hook that no code can remove (only C functions and captured data inside):

    * importing a forbidden module ``(name, rule id)`` reports it and raises ImportError (the
      module's file is unreadable anyway);
    * opening a path under ``source_roots`` (the book's sources, tests, the reference) reports
      it as "source" (the kernel refuses the read anyway);
    * opening an absolute path outside ``scratch`` for writing reports it as "blocked" (the
      kernel refuses the write anyway);
    * starting a process, opening a socket and looking at other processes in /proc are
      reported as "blocked" (the kernel refuses them anyway);
    * the garbage collector's object lists, ctypes and ``input`` are refused.
    """
    modules = tuple((str(n), str(r)) for n, r in forbidden_modules)
    roots = tuple(str(r) for r in source_roots)  # folders end with "/"
    denied = dict(_DENIED_EVENTS)
    report = reporter.report
    fsdecode = os.fsdecode
    str_type, bytes_type, int_type = str, bytes, int
    inside = scratch.rstrip("/") + "/"
    # Sub-interpreters run without this hook; the test modules reach into the interpreter.
    interpreters = frozenset(("_xxsubinterpreters", "_xxinterpchannels", "_interpreters",
                              "_interpchannels", "_interpqueues", "_testcapi",
                              "_testinternalcapi", "_testmultiphase", "_testsinglephase"))
    own = "/proc/" + os.readlink("/proc/self")  # process 1 of its PID namespace
    digits = "0123456789"
    reported = {"subprocess.Popen": "starting a process", "os.system": "starting a process",
                "os.exec": "starting a process", "os.posix_spawn": "starting a process",
                "os.spawn": "starting a process", "os.fork": "starting a process",
                "os.forkpty": "starting a process", "pty.spawn": "starting a process",
                "socket.__new__": "opening a socket", "socket.connect": "opening a socket",
                "socket.bind": "opening a socket"}

    def other_process(path: Any) -> bool:
        if type(path) is bytes_type:
            path = fsdecode(path)
        if type(path) is not str_type:
            return False
        if path == "/proc" or path == "/proc/":
            return True
        return path.startswith("/proc/") and path[6:7] in digits and not (
            path == own or path.startswith(own + "/"))
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if event == "import":
            name = args[0] if args else ""
            if type(name) is not str_type:
                return
            if name in interpreters:
                report("blocked", "starting another interpreter")
                raise ImportError(f"{name} may not be used while grading")
            for target, rule_id in modules:
                if name == target or name.startswith(target + "."):
                    report(rule_id, name)
                    raise ImportError(f"{name} may not be used in this assignment")
        elif event in reported:
            report("blocked", reported[event])
        elif event in ("os.listdir", "os.scandir"):
            if args and other_process(args[0]):
                report("blocked", "looking at the other processes in /proc")
        elif event == "open":
            path = args[0] if args else None
            if other_process(path):
                report("blocked", "opening another process's files in /proc")
            if type(path) is bytes_type:
                path = fsdecode(path)
            if type(path) is str_type:
                mode = args[1] if len(args) > 1 else None
                flags = args[2] if len(args) > 2 else 0
                writes = (type(mode) is str_type and ("w" in mode or "a" in mode or "x" in mode
                                                      or "+" in mode)) or (
                    type(flags) is int_type and flags & write_flags != 0)
                if writes:
                    if scratch and path.startswith("/") and not path.startswith(inside) \
                            and path != scratch and not path.startswith("/dev/"):
                        report("blocked", "writing " + path[:200])
                    return
                for root in roots:
                    if path.startswith(root):
                        report("source", path)
                        raise PermissionError("reading the book's sources is not allowed")
        elif event in denied:
            report("blocked", denied[event])
            raise PermissionError(f"{denied[event]} is not allowed while grading")

    sys.addaudithook(hook)
