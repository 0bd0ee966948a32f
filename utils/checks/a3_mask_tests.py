"""Assignment 3, second half: the behaviour tests that catch wrong masks.

The student writes ``test_causal_mask(causal_mask_fn)`` and ``test_batch_mask(batch_mask_fn)``,
which raise (an AssertionError) when the implementation they are given is wrong and return
quietly when it is right (the masks themselves are checked in `a3_masks`).

The tests are checked by a kind of case of their own, "mask_test": on the student side the runner
(`runners`) calls the student's test on a shuffled list of implementations, right ones and copies
of one planted bug, all made by the same wrapper (same name, same code, same source), and returns
only what each call did (returned, or raised, and the text of the exception). The trusted side
decides: a bug counts as caught only when every copy of the right implementation in the same case
passed, so a test that rejects everything earns nothing.
"""

from __future__ import annotations

import operator
from typing import Any

import torch

from .checker import Case, Checker, Mistake, run_in_process
from .core import Run, Spec
from .results import CheckResult
from .runners import ERROR_BYTES, MASK_TEST_KIND

__all__ = ["check_causal_mask_test", "check_batch_mask_test", "CAUSAL_TEST", "BATCH_TEST",
           "planted", "CAUSAL_BUGS", "BATCH_BUGS"]


# --------------------------------------------------------------------------------------------
# The planted implementations the student's tests are run on (student side)

CAUSAL_BUGS: dict[str, str] = {
    "sees_next": "a causal mask that is off by one: position t also sees t + 1 (True just above "
                 "the diagonal)",
    "no_diagonal": "a causal mask without the diagonal (j < i): a position cannot see itself",
    "inverted": "a causal mask with the polarity inverted (True above the diagonal)",
    "upper": "the transposed causal mask (the upper triangle)",
    "late_leak": "a causal mask that is right for short sequences only: from position 4 on, t "
                 "also sees t + 1 (try lengths of 6 and more)",
    "all_true": "a mask that blocks nothing (all True)",
    "float": "a causal mask of the right pattern as float 0.0 / 1.0 instead of bool",
    "additive": "an additive float mask (0 / -inf) instead of the bool mask",
    "lead_axis": "a causal mask of shape (1, L, L) instead of (L, L)",
}
BATCH_BUGS: dict[str, str] = {
    "sees_next": "a batch mask whose causal part is off by one: position t also sees t + 1",
    "inverted": "a batch mask with the polarity inverted",
    "left": "a batch mask that takes the padding from the wrong end (the first positions)",
    "queries": "a batch mask that applies the padding to the queries (rows) instead of the keys "
               "(columns): it blocks the rows of padded queries",
    "or": "a batch mask that combines causal and padding with OR instead of AND",
    "no_padding": "a batch mask that ignores the lengths (right only when every sequence fills "
                  "max_len: test a batch with short sequences)",
    "no_causal": "a batch mask without its causal part (padding only)",
    "one_more": "a batch mask whose padding is off by one (the first padding key allowed)",
    "max_len": "a batch mask that ignores max_len and uses the longest length (test a batch in "
               "which no sequence fills max_len)",
    "no_head_axis": "a batch mask of shape (B, L, L) instead of (B, 1, L, L)",
    "float": "a batch mask of the right pattern as float 0.0 / 1.0 instead of bool",
}
_CAUSAL_CODES = ["ok", *CAUSAL_BUGS]
_BATCH_CODES = ["ok", *BATCH_BUGS]


def _positions(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.arange(n)[:, None], torch.arange(n)[None, :]


def _planted_causal(length: Any, code: int) -> torch.Tensor:
    n = operator.index(length)
    if n < 0:
        raise ValueError(f"length must be >= 0, got {n}")
    name = _CAUSAL_CODES[code]
    i, j = _positions(n)
    if name == "sees_next":
        mask = j <= i + 1
    elif name == "no_diagonal":
        mask = j < i
    elif name == "inverted":
        mask = j > i
    elif name == "upper":
        mask = j >= i
    elif name == "late_leak":
        mask = j <= i + (i >= 4).long()
    elif name == "all_true":
        mask = torch.ones(n, n, dtype=torch.bool)
    else:
        mask = j <= i
    if name == "float":
        return mask.float()
    if name == "additive":
        return torch.zeros(n, n).masked_fill(~mask, float("-inf"))
    return mask[None] if name == "lead_axis" else mask


def _planted_batch(lengths: Any, max_len: Any, code: int) -> torch.Tensor:
    lens = torch.as_tensor(lengths)
    if lens.dim() != 1 or lens.dtype.is_floating_point or lens.dtype == torch.bool:
        raise ValueError(f"lengths must be a 1-dim integer tensor, got {lengths!r}")
    n = operator.index(max_len)
    name = _BATCH_CODES[code]
    if name == "max_len" and lens.numel():
        n = int(lens.max())
    if lens.numel() and (int(lens.min()) < 0 or int(lens.max()) > n):
        raise ValueError(f"lengths must lie in [0, max_len={n}], got {lens.tolist()}")
    b = lens.shape[0]
    i, j = _positions(n)
    causal = (j <= i + 1) if name == "sees_next" else (j <= i)
    pos = torch.arange(n)[None, :]
    if name == "left":
        real = pos >= n - lens[:, None]
    elif name == "one_more":
        real = pos <= lens[:, None]
    else:
        real = pos < lens[:, None]
    keys, queries = real[:, None, None, :], real[:, None, :, None]
    if name == "queries":
        mask = causal & queries
    elif name == "or":
        mask = causal | keys
    elif name == "no_padding":
        mask = causal[None, None].expand(b, 1, n, n)
    elif name == "no_causal":
        mask = keys.expand(b, 1, n, n)
    else:
        mask = causal & keys
    mask = mask.expand(b, 1, n, n).contiguous()
    if name == "inverted":
        return ~mask
    if name == "float":
        return mask.float()
    return mask[:, 0] if name == "no_head_axis" else mask


def planted(family: str, code: int) -> Any:
    """An implementation to run a student's test on; every one has the same name and code."""
    if family == "causal":
        def causal_mask(length):  # noqa: ANN001, ANN202 (as a student would write it)
            return _planted_causal(length, code)
        return causal_mask

    def batch_mask(lengths, max_len):  # noqa: ANN001, ANN202
        return _planted_batch(lengths, max_len, code)
    return batch_mask


def _decode(row: torch.Tensor) -> str:
    data = bytes(int(v) for v in row.tolist() if 0 < int(v) < 256)
    text = " ".join(data.decode("utf-8", "replace").split())
    return "".join(c for c in text if c.isprintable())[:ERROR_BYTES]


MAX_LENGTH = 2048  # the largest length the planted implementations answer for in the grader
MAX_ELEMENTS = 2**22  # the largest batch mask they build there


def grader_oracle(codes: list[int]) -> Any:
    """The oracle of the grader's process (`runners.set_oracle` in the child asks it): answers
    for implementation ``k`` with the planted code ``codes[k]``, on arguments of bounded size."""
    def answer(family: str, k: int, args: tuple[Any, ...]) -> Any:
        if family not in ("causal", "batch") or not 0 <= k < len(codes):
            raise RuntimeError("no such implementation")
        sizes, rows = [], 1
        for a in args:
            t = a if isinstance(a, torch.Tensor) else None
            if isinstance(a, list):
                try:
                    t = torch.as_tensor(a)
                except (TypeError, ValueError, RuntimeError):
                    t = None
            if isinstance(a, int) and not isinstance(a, bool):
                sizes.append(a)
            elif t is not None and t.numel() and not t.dtype.is_floating_point and \
                    t.dtype != torch.bool:
                sizes.append(int(t.max()))
                rows = max(rows, t.numel())
        if any(n > MAX_LENGTH for n in sizes):
            raise ValueError(f"lengths above {MAX_LENGTH} are not supported by the checker")
        if family == "batch" and rows * max(sizes, default=0) ** 2 > MAX_ELEMENTS:
            raise ValueError("a batch larger than the checker's implementations accept")
        return planted(family, codes[k])(*args)
    return answer


class MaskTestChecker(Checker):
    """The checker of a behaviour test the student wrote: run on right and planted wrong code.

    ``family`` ("causal" or "batch") names the test, ``test_{family}_mask``, and its checker,
    ``check_{family}_mask_test``; ``bugs`` the planted mistakes, one case each.
    """

    what = "your test"
    combine_pairs = False

    def __init__(self, family: str, bugs: dict[str, str]):
        super().__init__(_test_cases(family, bugs))
        self.name, self.target = f"check_{family}_mask_test", f"test_{family}_mask"
        self.family, self.bugs = family, bugs
        self.mistakes = tuple(Mistake(f"your test lets through {hint}", {"bug": name})
                              for name, hint in bugs.items())

    def forward(self, spec: Spec, x: dict[str, torch.Tensor], p: dict[str, torch.Tensor],
                **options: Any) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        return {}, {}

    def isolated(self, spec: Spec) -> Any:
        """In the grader, each implementation runs in a fresh process of its own, whose test sees
        one implementation with no trace of which it is (its answers come from the grader), and
        nothing of what an earlier call saw: a test can only tell right from wrong by testing."""
        return self._one_per_process(spec)

    def _one_per_process(self, spec: Spec) -> Any:
        codes = [int(c) for c in spec.config["codes"]]
        outcomes, errors = [], []
        for code in codes:
            run = Spec(MASK_TEST_KIND, {}, [], literals=[self.family, 1],
                       outputs=["outcomes", "errors"], out_dtype="torch.int64")
            raw = yield Run(run, grader_oracle([code]))
            t = raw["tensors"]
            got_o, got_e = t.get("out:outcomes"), t.get("out:errors")
            if not (isinstance(got_o, torch.Tensor) and tuple(got_o.shape) == (1,)
                    and isinstance(got_e, torch.Tensor) and tuple(got_e.shape) == (1, ERROR_BYTES)):
                return {"status": "ok", "message": "", "notes": [], "tensors": {}}
            outcomes.append(got_o.to(torch.int64))
            errors.append(got_e.to(torch.uint8))
        return {"status": "ok", "message": "", "notes": [],
                "tensors": {"out:outcomes": torch.cat(outcomes), "out:errors": torch.cat(errors)}}

    def judge(self, spec: Spec, raw: dict[str, Any]) -> str | None:
        if raw.get("status") != "ok":
            return super().judge(spec, raw)
        codes = [int(c) for c in spec.config["codes"]]
        outcomes = raw["tensors"].get("out:outcomes")
        errors = raw["tensors"].get("out:errors")
        if (not isinstance(outcomes, torch.Tensor) or tuple(outcomes.shape) != (len(codes),)
                or outcomes.dtype != torch.int64 or not isinstance(errors, torch.Tensor)
                or tuple(errors.shape) != (len(codes), ERROR_BYTES)
                or errors.dtype != torch.uint8):
            return "the result of running your test could not be read"
        result = [int(v) for v in outcomes]
        if any(v not in (0, 1, 2) for v in result):
            return "the result of running your test could not be read"
        right = [k for k, c in enumerate(codes) if c == 0]
        failed = [k for k in right if result[k] != 0]
        if failed:
            text = _decode(errors[failed[0]]) or "an exception"
            return (f"your test fails the correct implementation ({text}), so it cannot tell "
                    "right from wrong: a bug it 'catches' earns nothing while the right mask "
                    "fails too")
        codes_list = _CAUSAL_CODES if self.family == "causal" else _BATCH_CODES
        missed = [codes_list[c] for k, c in enumerate(codes) if c != 0 and result[k] == 0]
        if missed:
            return f"your test lets through {self.bugs[missed[0]]}"
        return None


def _test_case(family: str, bug: str, copies: int = 2) -> Any:
    codes_list = _CAUSAL_CODES if family == "causal" else _BATCH_CODES

    def make(gen: torch.Generator) -> Spec:
        codes = [0] * copies + ([codes_list.index(bug)] * copies if bug != "ok" else [0])
        order = torch.randperm(len(codes), generator=gen).tolist()
        return Spec(MASK_TEST_KIND, {}, [], literals=[family, len(codes)],
                    outputs=["outcomes", "errors"], out_dtype="torch.int64",
                    config={"codes": [codes[k] for k in order]})
    return make


def _test_cases(family: str, bugs: dict[str, str]) -> list[Case]:
    cases = [Case(name, f"your test catches {hint}", _test_case(family, name))
             for name, hint in bugs.items()]
    # Worth no points by itself (every case above holds the right implementation too, and
    # counts only if it passes), so that a test that passes everything earns nothing; last, so
    # that a test that remembers what it saw in an earlier call learns nothing from it.
    cases.append(Case("accepts_right", "your test passes the correct implementation",
                      _test_case(family, "ok", copies=3), points=0))
    return cases


CAUSAL_TEST = MaskTestChecker("causal", CAUSAL_BUGS)
BATCH_TEST = MaskTestChecker("batch", BATCH_BUGS)


def check_causal_mask_test(test: Any, verbose: bool = True) -> CheckResult:
    """Run the student's ``test(causal_mask_fn)`` on right and planted wrong causal masks.

    A case passes when the test returns quietly on every copy of the right implementation and
    raises on every copy of that case's planted bug.
    """
    return run_in_process(CAUSAL_TEST, test, verbose)


def check_batch_mask_test(test: Any, verbose: bool = True) -> CheckResult:
    """Run the student's ``test(batch_mask_fn)`` on right and planted wrong batch masks."""
    return run_in_process(BATCH_TEST, test, verbose)
