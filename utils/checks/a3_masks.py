"""Assignment 3: masks (the masks themselves; the behaviour tests are in `a3_mask_tests`).

The student writes three functions in the book's convention (bool, True = may attend):

* ``causal_mask(length)`` -> (L, L), True on and below the diagonal;
* ``padding_mask(lengths, max_len)`` -> (B, max_len), True at the real tokens (padding after
  them), ``lengths`` a 1-dim integer tensor;
* ``batch_mask(lengths, max_len)`` -> (B, 1, L, L) with L = max_len: query i of sequence b may
  attend to key j iff j <= i and j < lengths[b];

and two behaviour tests, ``test_causal_mask(causal_mask_fn)`` and
``test_batch_mask(batch_mask_fn)`` (`a3_mask_tests`).

The mask functions are checked like every other assignment: the trusted side builds the expected
mask with `Reference` and names the mistake when the student's mask equals a known wrong one.
"""

from __future__ import annotations

from typing import Any

import torch

from .a3_mask_tests import BATCH_TEST, CAUSAL_TEST
from .checker import Case, Checker, Mistake, run_in_process
from .compare import shape_str
from .core import Spec
from .guard import Assignment, Rule
from .results import CheckResult

__all__ = ["check_causal_mask", "check_padding_mask", "check_batch_mask", "CAUSAL", "PADDING",
           "BATCH", "ASSIGNMENT", "Reference"]


# --------------------------------------------------------------------------------------------
# The trusted reference, with switches that reproduce the usual mistakes


def _finish(mask: torch.Tensor, form: str) -> torch.Tensor:
    """The bool ``mask`` in the form a mistake returns it."""
    if form == "float":
        return mask.to(torch.float32)
    if form == "int":
        return mask.to(torch.int64)
    if form == "additive":
        return torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
    return mask


class Reference:
    """The checker's own masks (trusted side), written out with switches for mistakes."""

    @staticmethod
    def causal(length: int, *, rule: str = "ok", form: str = "bool", lead: bool = False,
               invert: bool = False) -> torch.Tensor:
        """(L, L) bool: key j allowed for query i iff j <= i (``rule`` changes the comparison)."""
        i = torch.arange(length)[:, None]
        j = torch.arange(length)[None, :]
        mask = {"ok": j <= i, "sees_next": j <= i + 1, "no_diagonal": j < i, "upper": j >= i,
                "all": (j >= 0) & (i >= 0), "none": (j < 0) & (i < 0)}[rule]
        if invert:
            mask = ~mask
        mask = _finish(mask, form)
        return mask[None] if lead else mask

    @staticmethod
    def padding(lengths: torch.Tensor, max_len: int, *, end: str = "right", shift: int = 0,
                ignore_lengths: bool = False, ignore_max_len: bool = False, invert: bool = False,
                form: str = "bool", layout: str = "ok") -> torch.Tensor:
        """(B, max_len) bool, True at positions j < lengths[b] (the real tokens)."""
        n = int(lengths.max()) if ignore_max_len and lengths.numel() else max_len
        pos = torch.arange(n)[None, :]
        lens = lengths[:, None]
        if ignore_lengths:
            mask = torch.ones(lengths.shape[0], n, dtype=torch.bool)
        elif end == "left":
            mask = pos >= n - lens
        else:
            mask = pos < lens + shift
        if invert:
            mask = ~mask
        mask = _finish(mask, form)
        if layout == "transposed":
            return mask.T
        if layout == "attention":
            return mask[:, None, None, :]
        return mask

    @staticmethod
    def batch(lengths: torch.Tensor, max_len: int, *, rule: str = "ok", keys: str = "ok",
              where: str = "keys", combine: str = "and", invert: bool = False,
              form: str = "bool", head_axis: bool = True,
              ignore_max_len: bool = False) -> torch.Tensor:
        """(B, 1, L, L) bool: causal AND the key padding of each sequence."""
        b = lengths.shape[0]
        n = int(lengths.max()) if ignore_max_len and lengths.numel() else max_len
        causal = Reference.causal(n, rule=rule)[None, None]  # (1, 1, L, L)
        pad = Reference.padding(lengths, n, end="left" if keys == "left" else "right",
                                shift=1 if keys == "one_more" else 0,
                                ignore_lengths=keys == "ignored")
        as_keys, as_queries = pad[:, None, None, :], pad[:, None, :, None]
        pad4 = as_queries if where == "queries" else as_keys
        if combine == "or":
            mask = causal | pad4
        elif combine == "causal_only":
            mask = causal.expand(b, 1, n, n)
        elif combine == "padding_only":
            mask = pad4.expand(b, 1, n, n)
        else:
            mask = causal & pad4
        mask = mask.expand(b, 1, n, n).contiguous()
        if invert:
            mask = ~mask
        mask = _finish(mask, form)
        return mask if head_axis else mask[:, 0]


# --------------------------------------------------------------------------------------------
# Judging a mask: exact comparison, by dtype family


def _family(t: torch.Tensor) -> str:
    if t.dtype == torch.bool:
        return "bool"
    if t.is_complex():
        return "complex"
    return "float" if t.is_floating_point() else "int"


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Same shape, same kind of dtype (bool, float, int) and the same values."""
    if tuple(got.shape) != tuple(want.shape) or _family(got) != _family(want):
        return False
    if _family(got) in ("bool", "complex"):
        return bool(torch.equal(got, want))
    return bool(torch.equal(got.double(), want.double()))


class MaskChecker(Checker):
    """A mask function's checker: exact comparison, mistakes matched by shape, dtype and value."""

    what = "your function"
    combine_pairs = False
    axes = "(L, L)"

    def build(self, spec: Spec, **options: Any) -> torch.Tensor:
        """The expected mask of ``spec`` with ``options`` (the mistakes' switches)."""
        raise NotImplementedError

    def forward(self, spec: Spec, x: dict[str, torch.Tensor], p: dict[str, torch.Tensor],
                **options: Any) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        return {"mask": self.build(spec, **options)}, {}

    def _judge_output(self, spec: Spec, raw: dict[str, Any], ref: dict[str, torch.Tensor],
                      name: str) -> str | None:
        got = raw["tensors"][f"out:{name}"]
        want = ref[f"out:{name}"]
        if _same(got, want):
            return None
        for m in self.mistakes:
            try:
                cand = self.build(spec, **m.options)
            except Exception:  # a variant that cannot run on this case cannot match
                continue
            if _same(got, cand):
                return m.hint
        if _family(got) != "bool":
            return (f"the mask has dtype {got.dtype}: return a bool tensor, True where the query "
                    "may attend (the book's convention, that of F.scaled_dot_product_attention)")
        if tuple(got.shape) != tuple(want.shape):
            return (f"wrong shape: expected {self.axes} = {shape_str(want.shape)}, got "
                    f"{shape_str(got.shape)}")
        return self.where_wrong(got, want)

    def where_wrong(self, got: torch.Tensor, want: torch.Tensor) -> str:
        """The number of wrong entries and the first of them, in words."""
        wrong = (got != want).nonzero()
        first = tuple(int(v) for v in wrong[0])
        should = "True (allowed)" if bool(want[first]) else "False (blocked)"
        return (f"{len(wrong)} of {want.numel()} entries are wrong and match none of the known "
                f"mistakes; the first is mask{list(first)}, which should be {should}")


class CausalChecker(MaskChecker):
    """The checker of ``causal_mask(length)``."""

    name = "check_causal_mask"
    target = "causal_mask"
    axes = "(L, L)"
    mistakes = (
        Mistake("off by one: query t may also see key t + 1 (True just above the diagonal); "
                "the rule is j <= i, as in torch.ones(L, L).tril()", {"rule": "sees_next"}),
        Mistake("the diagonal is blocked: a position may attend to itself (j <= i, not j < i), "
                "and the first query would have no key at all", {"rule": "no_diagonal"}),
        Mistake("mask polarity inverted: True means 'may attend', so True on and below the "
                "diagonal and False above it", {"invert": True}),
        Mistake("the upper triangle (the transpose): query i may attend to keys j <= i, the "
                "lower triangle, tril not triu", {"rule": "upper"}),
        Mistake("a float mask of 0.0 and 1.0: return a bool tensor (for example "
                "torch.ones(L, L, dtype=torch.bool).tril())", {"form": "float"}),
        Mistake("an integer mask of 0 and 1: return a bool tensor (dtype=torch.bool)",
                {"form": "int"}),
        Mistake("an additive float mask (0 and -inf), PyTorch's other convention: this "
                "assignment asks for the bool mask, True = may attend", {"form": "additive"}),
        Mistake("the mask has an extra leading axis, (1, L, L): return (L, L), which "
                "broadcasts over the batch by itself", {"lead": True}),
        Mistake("every entry is True: that is no mask at all, every query sees the future",
                {"rule": "all"}),
        Mistake("every entry is False: no query may attend to anything", {"rule": "none"}),
    )

    def build(self, spec: Spec, **options: Any) -> torch.Tensor:
        return Reference.causal(int(spec.literals[0]), **options)


class PaddingChecker(MaskChecker):
    """The checker of ``padding_mask(lengths, max_len)``."""

    name = "check_padding_mask"
    target = "padding_mask"
    axes = "(B, max_len)"
    mistakes = (
        Mistake("mask polarity inverted: True marks a real token (a key that may be attended "
                "to), False the padding", {"invert": True}),
        Mistake("the padding is taken from the wrong end: padding comes after the real tokens, "
                "so position j is real when j < lengths[b]", {"end": "left"}),
        Mistake("off by one: the first padding position is marked real (j <= lengths[b]); use "
                "j < lengths[b]", {"shift": 1}),
        Mistake("off by one: the last real token is marked as padding (j < lengths[b] - 1); use "
                "j < lengths[b]", {"shift": -1}),
        Mistake("max_len is ignored: the mask is as wide as the longest sequence, but the batch "
                "is padded to max_len, which may be longer", {"ignore_max_len": True}),
        Mistake("the lengths are ignored: every position is marked real", {"ignore_lengths": True}),
        Mistake("transposed: the mask is (max_len, B); it must be (B, max_len), one row per "
                "sequence", {"layout": "transposed"}),
        Mistake("the mask is already in attention form (B, 1, 1, max_len): this function "
                "returns (B, max_len); batch_mask adds the axes", {"layout": "attention"}),
        Mistake("a float mask of 0.0 and 1.0: return a bool tensor", {"form": "float"}),
        Mistake("an integer mask of 0 and 1: return a bool tensor (a comparison such as "
                "positions < lengths gives one)", {"form": "int"}),
    )

    def build(self, spec: Spec, **options: Any) -> torch.Tensor:
        return Reference.padding(spec.tensors["lengths"], int(spec.literals[0]), **options)


class BatchChecker(MaskChecker):
    """The checker of ``batch_mask(lengths, max_len)``."""

    name = "check_batch_mask"
    target = "batch_mask"
    axes = "(B, 1, L, L)"
    mistakes = (
        Mistake("off by one in the causal part: query t may also see key t + 1; the rule is "
                "j <= i", {"rule": "sees_next"}),
        Mistake("the diagonal is blocked: a real token may attend to itself (j <= i)",
                {"rule": "no_diagonal"}),
        Mistake("the causal part is transposed (upper triangle): query i may see keys j <= i",
                {"rule": "upper"}),
        Mistake("mask polarity inverted: True means 'may attend'", {"invert": True}),
        Mistake("the padding is taken from the wrong end: padding comes after the real tokens",
                {"keys": "left"}),
        Mistake("the padding mask is applied to the queries (rows), alone or with the keys "
                "(the two give the same mask here): the rows of padded queries must still allow "
                "the real keys j <= i; it is the padded keys (columns) that are blocked, "
                "pad[:, None, None, :]", {"where": "queries"}),
        Mistake("the masks are combined with OR: a key is allowed only where both allow it, "
                "causal & padding", {"combine": "or"}),
        Mistake("the padding is ignored: only the causal mask is applied (right only when every "
                "sequence fills max_len)", {"combine": "causal_only"}),
        Mistake("the causal mask is missing: only the padding mask is applied",
                {"combine": "padding_only"}),
        Mistake("off by one in the padding: the first padding key is allowed (j <= lengths[b]); "
                "use j < lengths[b]", {"keys": "one_more"}),
        Mistake("max_len is ignored: L is taken as the longest length, but the batch is padded "
                "to max_len", {"ignore_max_len": True}),
        Mistake("no head axis: the mask is (B, L, L); return (B, 1, L, L) so that it broadcasts "
                "over the heads", {"head_axis": False}),
        Mistake("a float mask of 0.0 and 1.0: return a bool tensor", {"form": "float"}),
        Mistake("an additive float mask (0 and -inf): return the bool mask, True = may attend",
                {"form": "additive"}),
    )

    def build(self, spec: Spec, **options: Any) -> torch.Tensor:
        return Reference.batch(spec.tensors["lengths"], int(spec.literals[0]), **options)


def length_case(low: int, high: int | None = None, kind: str = "function") -> Any:
    """A case of a causal mask made from a length alone: ``low``, or drawn in [low, high]; the
    student's function, or a case of ``kind`` (assignment 7's ``DecoderLayer.causal_mask``)."""
    def make(gen: torch.Generator) -> Spec:
        n = low if high is None else int(torch.randint(low, high + 1, (1,), generator=gen))
        return Spec(kind, {}, [], literals=[n], outputs=["mask"], out_dtype="torch.bool")
    return make


def _lengths_case(batch: int, max_len: int, kind: str) -> Any:
    """Random lengths: "full" has one sequence of max_len, "short" none, "zero" a 0 and a full."""
    def make(gen: torch.Generator) -> Spec:
        if kind == "all_full":
            lens = torch.full((batch,), max_len)
        else:
            lens = torch.randint(1, max_len, (batch,), generator=gen)
        if kind == "full":
            lens[int(torch.randint(0, batch, (1,), generator=gen))] = max_len
        elif kind == "zero":
            order = torch.randperm(batch, generator=gen)
            lens[order[0]], lens[order[1]] = 0, max_len
        return Spec("function", {"lengths": lens}, ["lengths"], literals=[max_len],
                    outputs=["mask"], out_dtype="torch.bool")
    return make


# Points per case: the one place where this assignment's points are declared.
CAUSAL = CausalChecker([
    Case("length_5", "causal_mask(5)", length_case(5), points=2),
    Case("length_1", "causal_mask(1): a single position sees itself", length_case(1)),
    Case("long", "a longer sequence, L from 9 to 16", length_case(9, 16)),
    Case("length_0", "causal_mask(0): an empty (0, 0) mask", length_case(0)),
])


def _lengths_cases(*last: Case) -> list[Case]:
    """The cases that padding_mask and batch_mask share, then ``last``."""
    return [
        Case("one_full", "lengths (3,), one of them max_len = 6", _lengths_case(3, 6, "full"),
             points=2),
        Case("none_full", "lengths (2,), none of them max_len = 7", _lengths_case(2, 7, "short")),
        Case("zero_length", "lengths (4,) with a 0 and a max_len = 5",
             _lengths_case(4, 5, "zero")),
        *last,
    ]


PADDING = PaddingChecker(_lengths_cases(
    Case("all_full", "one sequence that fills max_len = 4", _lengths_case(1, 4, "all_full"))))
BATCH = BatchChecker(_lengths_cases(
    Case("all_full", "two sequences that fill max_len = 5", _lengths_case(2, 5, "all_full")),
    Case("single", "one sequence of length 1, max_len = 1", _lengths_case(1, 1, "all_full"))))

_FUNCTIONS = ("check_causal_mask", "check_padding_mask", "check_batch_mask")
ASSIGNMENT = Assignment(
    name="a3_masks",
    checkers=[CAUSAL, PADDING, BATCH, CAUSAL_TEST, BATCH_TEST],
    rules=[
        Rule("module", "utils.masks", "imports utils.masks, the book's reference masks that this "
             "assignment asks you to write"),
        Rule("code", "utils.checks.a3_masks", "uses the checker's own reference masks",
             qualname="Reference"),
        Rule("code", "torch.nn.modules.transformer", "uses torch's "
             "nn.Transformer.generate_square_subsequent_mask for the mask this assignment asks "
             "you to write", qualname="Transformer.generate_square_subsequent_mask",
             checks=_FUNCTIONS),
        Rule("code", "torch.nn.modules.transformer", "uses torch's _generate_square_subsequent_"
             "mask for the mask this assignment asks you to write",
             qualname="_generate_square_subsequent_mask", checks=_FUNCTIONS),
    ],
)


def check_causal_mask(fn: Any, verbose: bool = True) -> CheckResult:
    """Check ``fn(length) -> (L, L)`` bool, True on and below the diagonal."""
    return run_in_process(CAUSAL, fn, verbose)


def check_padding_mask(fn: Any, verbose: bool = True) -> CheckResult:
    """Check ``fn(lengths, max_len) -> (B, max_len)`` bool, True at the real tokens."""
    return run_in_process(PADDING, fn, verbose)


def check_batch_mask(fn: Any, verbose: bool = True) -> CheckResult:
    """Check ``fn(lengths, max_len) -> (B, 1, L, L)`` bool: causal AND key padding."""
    return run_in_process(BATCH, fn, verbose)
