"""The families of forbidden code, for `grader.poison`: which torch operators and which
Python functions of torch's decompositions stand with a forbidden operator.

* `operator_family`: the operators of torch's dispatcher whose name holds the words of the
  forbidden operator's stem in order (`family_words`): every overload in every namespace, the
  variants and the backward kernels.
* `index_decompositions`: where torch's Python decompositions and references of each operator
  are, and which helper functions each of them uses (`_private_helpers`: a helper that only a
  family's functions use belongs to the family, whether its name is private or public).
"""

from __future__ import annotations

import inspect
import sys
import types
from collections.abc import Iterable, Sequence
from typing import Any

import torch


def family_words(name: str) -> tuple[str, ...]:
    """The stem of an operator's name: its words (split at ``_``; namespace, overload and a
    ``1d``/``2d``/``3d`` ending left out) without a leading ``native`` and a trailing
    ``forward`` or ``fwd``: ``native_layer_norm`` -> (layer, norm)."""
    words = [w for w in _words(name) if w]
    if words and words[0] == "native":
        words = words[1:]
    if len(words) > 1 and words[-1] in ("forward", "fwd"):
        words = words[:-1]
    return tuple(words)


def _words(name: str) -> list[str]:
    base = name.rpartition("::")[2].partition(".")[0]
    words = []
    for w in base.split("_"):
        if len(w) > 2 and w[-1] == "d" and w[-2] in "123":
            w = w[:-2]
        words.append(w)
    return words


def _holds(words: list[str], stem: tuple[str, ...]) -> bool:
    """Whether ``stem`` is a subsequence of ``words``."""
    it = iter(words)
    return all(any(w == s for w in it) for s in stem)


def operator_family(names: Sequence[str], all_ops: Iterable[str] | None = None) -> list[str]:
    """Every operator of the dispatcher (``all_ops``: ``torch._C._dispatch_get_all_op_names()``
    by default) in the family of one of ``names``: those whose name's words hold the stem of
    the name (`family_words`) in order. That is every overload of the operator in every
    namespace (``aten::native_layer_norm.out``, ``quantized::layer_norm``), its variants
    (``aten::_scaled_dot_product_flash_attention_for_cpu``) and its backward kernels
    (``aten::native_layer_norm_backward``). Qualified names, ``ns::name`` or ``ns::name.overload``,
    in the dispatcher's order."""
    stems = {family_words(n) for n in names}
    stems.discard(())
    ops = torch._C._dispatch_get_all_op_names() if all_ops is None else all_ops
    return [op for op in ops if any(_holds(_words(op), stem) for stem in stems)]


_DECOMP_MODULES = ("torch._decomp", "torch._refs", "torch._prims")


class _DecompositionIndex:
    """Where torch's Python decompositions and references of each operator are: the keys of the
    decomposition table and the functions of torch._decomp, torch._refs and torch._prims, by
    operator name. Made once in the zygote (`index_decompositions`), so that a child reads only
    the entries of the operators it poisons: walking every one of them in each child costs about
    15 ms, most of it copying the pages it touches of what the child shares with the zygote."""

    def __init__(self, table: dict[Any, Any]) -> None:
        self.table_size = len(table)
        self.ops: dict[str, list[Any]] = {}
        for op in list(table):
            self.ops.setdefault(_base_name(op), []).append(op)
        self.modules = frozenset(m for m in list(sys.modules) if m.startswith(_DECOMP_MODULES))
        self.functions: dict[str, list[types.FunctionType]] = {}
        for name in self.modules:
            for value in _functions_in(sys.modules.get(name)):
                self.functions.setdefault(value.__name__, []).append(value)
        self.refs, self.callers = _references(self.functions)


def _names_in(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names_in(const)
    return names


def _names_of(fn: types.FunctionType) -> set[str]:
    """The names that ``fn``'s code uses, with those of the functions it wraps (decorators keep
    them in ``__wrapped__`` or in their closure)."""
    names: set[str] = set()
    todo, seen = [fn], set()
    while todo and len(seen) < 8:
        f = todo.pop()
        if id(f) in seen or not inspect.isfunction(f):
            continue
        seen.add(id(f))
        names |= _names_in(f.__code__)
        todo += [getattr(f, "__wrapped__", None)] + [
            c.cell_contents for c in (f.__closure__ or ()) if _cell_has_function(c)]
    return names


def _cell_has_function(cell: Any) -> bool:
    try:
        return inspect.isfunction(cell.cell_contents)
    except ValueError:  # an empty cell
        return False


def _references(functions: dict[str, list[types.FunctionType]]
                ) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """For each function name, the functions of ``functions`` its code names (refs), and for
    each of those, the names of the functions whose code names it (callers)."""
    refs: dict[str, set[str]] = {}
    callers: dict[str, set[str]] = {}
    for name, fns in functions.items():
        for fn in fns:
            for used in _names_of(fn):  # public helpers too (native_batch_norm_helper)
                if used in functions and used != name:
                    refs.setdefault(name, set()).add(used)
                    callers.setdefault(used, set()).add(name)
    return refs, callers


def _private_helpers(names: set[str], refs: dict[str, set[str]],
                     callers: dict[str, set[str]]) -> dict[str, str]:
    """The functions that only the functions ``names`` (and such helpers) use, private or public
    (``native_batch_norm_helper``), each with the name of one function that uses it."""
    poisoned = set(names)
    found: dict[str, str] = {}
    todo = list(names)
    while todo:
        name = todo.pop()
        for helper in sorted(refs.get(name, ())):
            if helper not in poisoned and callers.get(helper, set()) <= poisoned:
                poisoned.add(helper)
                found[helper] = name
                todo.append(helper)
    return found


def named_variants(names: Iterable[str], functions: Iterable[str]) -> dict[str, str]:
    """The functions named after one of the operators ``names`` with a suffix
    (``_native_batch_norm_legit_no_stats`` decomposes the ``no_stats`` overload), each with the
    operator's name (the longest that fits)."""
    names = list(names)
    prefixes = tuple(n + "_" for n in names)
    return {f: max((n for n in names if f.startswith(n + "_")), key=len)
            for f in functions if f.startswith(prefixes)}


_INDEX: _DecompositionIndex | None = None


def _decomposition_table() -> dict[Any, Any]:
    try:
        from torch._decomp import decomposition_table
    except ImportError:
        return {}
    return decomposition_table


def index_decompositions() -> None:
    """Index torch's decompositions once, before forking the children (the zygote calls it)."""
    global _INDEX
    _INDEX = _DecompositionIndex(_decomposition_table())


def _base_name(op: Any) -> str:
    return str(getattr(getattr(op, "overloadpacket", op), "__name__", ""))


def _functions_in(module: Any) -> list[types.FunctionType]:
    if module is None:
        return []
    return [v for v in list(vars(module).values()) if inspect.isfunction(v)]


