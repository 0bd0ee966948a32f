"""Checkers for the programming assignments: run a student's code and say what is wrong.

Each checker takes the student's code with the signature of its ``utils`` counterpart, runs cases
of its own against a reference, prints one line per case and returns a `CheckResult` with
``.passed`` (bool) and ``.score`` (the fraction of cases passed, 0 to 1) that a grader can collect.

On a wrong answer a checker names the mistake: it computes the output of each known wrong variant
(no 1/sqrt(d_k) scaling, softmax over the wrong axis, mask applied after the softmax, ...) on the
same input and says which one the student's output matches. A checker never raises because of the
student's code: ``None``, a wrong type or shape, NaN, or an exception inside the student's code
(``NotImplementedError`` included) all become a failed case with a hint.

How modules get known weights: the checker builds the student's class itself, with the arguments
of its ``utils`` counterpart, and then copies reference weights into it by attribute name:

* ``check_multi_head_attention(cls)``: ``cls(d_model, num_heads)`` must have ``nn.Linear``
  attributes ``w_q``, ``w_k``, ``w_v``, ``w_o`` of shape (d_model, d_model), with biases.
* ``check_layer_norm(cls)``: ``cls(d_model, eps=eps)`` must have parameters ``weight`` and
  ``bias`` of shape (d_model,).
* ``check_encoder_layer(cls)``: ``cls(d_model, nhead, dim_feedforward, dropout, activation=...,
  norm_first=...)`` must have ``self_attn`` (with ``w_q``, ``w_k``, ``w_v``, ``w_o``),
  ``linear1``, ``linear2``, ``norm1`` and ``norm2``, named as in
  ``torch.nn.TransformerEncoderLayer``.
  A class without these attributes but with a ``from_torch`` classmethod is loaded through it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "CaseResult",
    "CheckResult",
    "check_scaled_dot_product_attention",
    "check_multi_head_attention",
    "check_positional_encoding",
    "check_layer_norm",
    "check_encoder_layer",
]

ATOL = 1e-4
RTOL = 1e-4


# --------------------------------------------------------------------------------------------
# Results


@dataclass
class CaseResult:
    """The outcome of one case: its name, whether it passed, and the hint when it did not."""

    name: str
    passed: bool
    hint: str = ""

    def line(self) -> str:
        """The one line printed for this case."""
        return f"[PASS] {self.name}" if self.passed else f"[FAIL] {self.name}: {self.hint}"


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
    def score(self) -> float:
        """The fraction of cases passed, from 0 to 1."""
        if not self.cases:
            return 0.0
        return sum(c.passed for c in self.cases) / len(self.cases)

    @property
    def hints(self) -> list[str]:
        """The hints of the failed cases."""
        return [c.hint for c in self.cases if not c.passed]

    def summary(self) -> str:
        n_pass = sum(c.passed for c in self.cases)
        return f"{self.check}: {n_pass}/{len(self.cases)} cases passed (score {self.score:.2f})"

    def __repr__(self) -> str:
        return f"CheckResult({self.check!r}, passed={self.passed}, score={self.score:.2f})"


# --------------------------------------------------------------------------------------------
# Helpers: calling the student's code, comparing, naming the mistake


def _shape(t: Any) -> str:
    return "(" + ", ".join(str(int(s)) for s in t) + ")"


def _one_line(text: str, limit: int = 160) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _exception_hint(exc: BaseException, what: str) -> str:
    if isinstance(exc, NotImplementedError):
        return f"{what} is not implemented yet (it raises NotImplementedError)"
    return f"{what} raised {type(exc).__name__}: {_one_line(exc) or '(no message)'}"


class _StudentError(Exception):
    """Raised inside a case to stop it with a hint (never leaves the checker)."""

    def __init__(self, hint: str):
        super().__init__(hint)
        self.hint = hint


def _call(what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    try:
        return fn(*args, **kwargs)
    except (Exception, SystemExit) as exc:  # the student's mistake: report it, never raise it
        raise _StudentError(_exception_hint(exc, what)) from None


def _require_tensor(value: Any, what: str) -> torch.Tensor:
    if value is None:
        raise _StudentError(f"{what} is None: did you forget a `return`?")
    if isinstance(value, (tuple, list)):
        raise _StudentError(f"{what} must be a torch.Tensor, got a {type(value).__name__} of "
                            f"{len(value)}: return the tensor alone")
    if not isinstance(value, torch.Tensor):
        raise _StudentError(f"{what} must be a torch.Tensor, got {type(value).__name__}")
    if value.is_complex():
        raise _StudentError(f"{what} must be a real tensor, got dtype {value.dtype}")
    return value


def _close(a: torch.Tensor, b: torch.Tensor, equal_nan: bool = False) -> bool:
    return a.shape == b.shape and torch.allclose(
        a.double(), b.double(), atol=ATOL, rtol=RTOL, equal_nan=equal_nan
    )


Variant = tuple[str, Callable[[], torch.Tensor]]


def _diagnose(
    out: Any,
    ref: torch.Tensor,
    variants: Sequence[Variant],
    what: str,
    shape_desc: str,
    shape_notes: dict[tuple[int, ...], str] | None = None,
) -> str | None:
    """None when ``out`` matches ``ref``; otherwise a hint naming the mistake."""
    out = _require_tensor(out, what)
    if tuple(out.shape) != tuple(ref.shape):
        hint = (
            f"wrong output shape: expected {what} of shape {shape_desc} = {_shape(ref.shape)}, "
            f"got {_shape(out.shape)}"
        )
        note = (shape_notes or {}).get(tuple(out.shape))
        return hint + (f" ({note})" if note else "")
    out = out.detach().to(device="cpu", dtype=torch.float64)
    if _close(out, ref):
        return None
    for hint, make in variants:
        try:
            candidate = make()
        except Exception:  # a variant that cannot run on this case cannot match
            continue
        if _close(out, candidate, equal_nan=True):
            return hint
    if not torch.isfinite(out).all():
        return f"{what} contains NaN or inf where the reference has none"
    diff = (out - ref.double()).abs().max().item()
    return (
        f"{what} differs from the reference (largest |difference| {diff:.2g}) and matches none "
        "of the known mistakes: compare your code with the formula step by step"
    )


def _combine(singles: Sequence[tuple[str, dict[str, Any]]]) -> list[tuple[str, dict[str, Any]]]:
    """The single mistakes, then every pair of mistakes that touch different options."""
    out = list(singles)
    for (h1, k1), (h2, k2) in itertools.combinations(singles, 2):
        if not set(k1) & set(k2):
            out.append((f"{h1}; and {h2}", {**k1, **k2}))
    return out


def _run(check: str, cases: Sequence[tuple[str, Callable[[], str | None]]],
         verbose: bool) -> CheckResult:
    result = CheckResult(check)
    for name, case in cases:
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)
                hint = case()
            res = CaseResult(name, hint is None, hint or "")
        except _StudentError as err:
            res = CaseResult(name, False, err.hint)
        except Exception as exc:  # anything else the student's objects did to us
            res = CaseResult(name, False, _exception_hint(exc, "checking your result"))
        result.cases.append(res)
    if verbose:  # printed at once, so that a notebook stores it as one output
        print("\n".join([c.line() for c in result.cases] + [result.summary()]))
    return result


def _randn(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen)


# --------------------------------------------------------------------------------------------
# Scaled dot-product attention: the reference and its known wrong variants

_SDPA_MISTAKES: list[tuple[str, dict[str, Any]]] = [
    ("the scores are not scaled by 1/sqrt(d_k): divide q k^T by sqrt(d_k) before the softmax",
     {"scale": "none"}),
    ("the scores are divided by d_k instead of sqrt(d_k)", {"scale": "dk"}),
    ("the scores are scaled by 1/sqrt(d_v), the width of v: use d_k, the width of q and k",
     {"scale": "sqrt_dv"}),
    ("softmax over the wrong axis: normalize over the keys (the last axis, dim=-1) so that each "
     "query's weights sum to 1", {"axis": -2}),
    ("mask applied after the softmax: fill the disallowed scores with -inf before the softmax, "
     "or the allowed weights no longer sum to 1", {"mask_mode": "after"}),
    ("mask polarity inverted: True means 'may attend' (as in torch's "
     "F.scaled_dot_product_attention), so fill the scores where the mask is False",
     {"invert": True}),
    ("the mask is ignored: fill the scores where the mask is False with -inf",
     {"mask_mode": "ignored"}),
    ("masked scores are set to 0 instead of -inf, so masked keys still get weight",
     {"mask_mode": "zero_fill"}),
    ("the bool mask is added to the scores as numbers: use it to fill the disallowed scores "
     "with -inf", {"mask_mode": "additive"}),
    ("a query with no allowed key gives NaN: give such a row zero weights and a zero output",
     {"mask_mode": "nan_rows"}),
    ("a query with no allowed key gets uniform weights (masked scores filled with a large "
     "negative number instead of -inf?): give such a row zero weights and a zero output",
     {"mask_mode": "big_negative"}),
]


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    scale: str | float = "sqrt_dk",
    axis: int = -1,
    mask_mode: str = "before",
    invert: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scaled dot-product attention with switches that reproduce common mistakes."""
    scores = q @ k.transpose(-2, -1)
    if scale == "sqrt_dk":
        scores = scores / math.sqrt(q.shape[-1])
    elif scale == "dk":
        scores = scores / q.shape[-1]
    elif scale == "sqrt_dv":
        scores = scores / math.sqrt(v.shape[-1])
    elif isinstance(scale, float):
        scores = scores * scale
    if mask is None or mask_mode == "ignored":
        return torch.softmax(scores, dim=axis) @ v, torch.softmax(scores, dim=axis)
    if invert:
        mask = ~mask
    if mask_mode == "after":
        weights = torch.softmax(scores, dim=axis).masked_fill(~mask, 0.0)
    elif mask_mode == "zero_fill":
        weights = torch.softmax(scores.masked_fill(~mask, 0.0), dim=axis)
    elif mask_mode == "additive":
        weights = torch.softmax(scores + mask.to(scores.dtype), dim=axis)
    elif mask_mode == "big_negative":
        weights = torch.softmax(scores.masked_fill(~mask, -1e9), dim=axis)
    elif mask_mode == "nan_rows":
        weights = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=axis)
    else:
        scores = scores.masked_fill(~mask, float("-inf"))
        has_key = mask.any(dim=-1, keepdim=True)
        scores = scores.masked_fill(~has_key, 0.0)
        weights = torch.softmax(scores, dim=axis) * mask
        weights = torch.nan_to_num(weights, nan=0.0)
    return weights @ v, weights


def check_scaled_dot_product_attention(fn: Callable[..., Any], verbose: bool = True) -> CheckResult:
    """Check ``fn(q, k, v, mask=None) -> (output, weights)`` against the reference.

    Cases: no mask with L_q != L_k and d_v != d_k, a causal mask, a padding mask broadcast over
    two batch dims, and a mask with a query that may attend to no key (its row must be zeros).
    """
    name = "check_scaled_dot_product_attention"
    if not callable(fn):
        return _run(name, [("a function", lambda: f"expected a function, got {type(fn).__name__}")],
                    verbose)

    def case(shape_q, shape_k, d_v, mask_fn, seed):
        def run() -> str | None:
            gen = torch.Generator().manual_seed(seed)
            q = _randn(gen, *shape_q)
            k = _randn(gen, *shape_k)
            v = _randn(gen, *shape_k[:-1], d_v)
            mask = mask_fn() if mask_fn else None
            ref_out, ref_w = _attend(q, k, v, mask)
            args = (q.clone(), k.clone(), v.clone()) + ((mask.clone(),) if mask is not None else ())
            got = _call("your function", fn, *args)
            if not isinstance(got, (tuple, list)) or len(got) != 2:
                got_type = "None" if got is None else type(got).__name__
                raise _StudentError(f"expected a tuple (output, weights), got {got_type}")
            out, w = got
            variants = [(h, (lambda kw=kw: _attend(q, k, v, mask, **kw)[0]))
                        for h, kw in _combine(_SDPA_MISTAKES)]
            hint = _diagnose(out, ref_out, variants, "the output", "(..., L_q, d_v)")
            if hint:
                return hint
            scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
            w_variants = [(h, (lambda kw=kw: _attend(q, k, v, mask, **kw)[1]))
                          for h, kw in _combine(_SDPA_MISTAKES)]
            w_variants.append(("the weights returned are the scores before the softmax: "
                               "return the softmax of the scores", lambda: scores))
            hint = _diagnose(w, ref_w, w_variants, "the weights", "(..., L_q, L_k)")
            if hint:
                return "output right but " + hint
            return None
        return run

    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    pad = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])[:, None, None, :]  # (2, 1, 1, 6)
    empty_row = torch.ones(2, 4, 6, dtype=torch.bool)
    empty_row[0, 1] = False
    empty_row[1, :, 3:] = False
    cases = [
        ("no mask, q (2, 5, 8), k (2, 6, 8), v (2, 6, 4)",
         case((2, 5, 8), (2, 6, 8), 4, None, 1)),
        ("causal mask (5, 5), q k v (3, 5, 8)", case((3, 5, 8), (3, 5, 8), 8, lambda: causal, 2)),
        ("padding mask (2, 1, 1, 6), q (2, 3, 4, 8), k v (2, 3, 6, 8)",
         case((2, 3, 4, 8), (2, 3, 6, 8), 8, lambda: pad, 3)),
        ("a query with no allowed key gets zero weights, mask (2, 4, 6)",
         case((2, 4, 8), (2, 6, 8), 4, lambda: empty_row, 4)),
    ]
    return _run(name, cases, verbose)


# --------------------------------------------------------------------------------------------
# Multi-head attention

_MHA_MISTAKES: list[tuple[str, dict[str, Any]]] = [
    ("heads split in the wrong order: view (B, L, d_model) as (B, L, h, d_k), then transpose to "
     "(B, h, L, d_k)", {"split": "no_transpose"}),
    ("heads split in the wrong order: each head must take d_k consecutive features, view as "
     "(B, L, h, d_k), not (B, L, d_k, h)", {"split": "interleaved"}),
    ("heads merged in the wrong order: transpose (B, h, L_q, d_k) to (B, L_q, h, d_k) before "
     "reshaping to (B, L_q, d_model)", {"merge": "no_transpose"}),
    ("heads merged in the wrong order: concatenate the heads one after the other, "
     "(B, L_q, h, d_k) -> (B, L_q, d_model), not (B, L_q, d_k, h)", {"merge": "interleaved"}),
    ("missing output projection: mix the concatenated heads with w_o", {"out_proj": False}),
    ("the scores are not scaled by 1/sqrt(d_k): divide by sqrt(d_k) before the softmax",
     {"scale": "none"}),
    ("the scores are scaled by 1/sqrt(d_model): use d_k = d_model / num_heads, the width of one "
     "head", {"scale": "d_model"}),
    ("softmax over the wrong axis: normalize over the keys (the last axis)", {"axis": -2}),
    ("mask applied after the softmax: fill the disallowed scores with -inf before the softmax",
     {"mask_mode": "after"}),
    ("mask polarity inverted: True means 'may attend', so fill the scores where the mask is "
     "False", {"invert": True}),
    ("the mask is ignored", {"mask_mode": "ignored"}),
    ("key and value are taken from the query: project the key and value arguments",
     {"kv_from_query": True}),
]


@dataclass
class _MHAParams:
    h: int
    w: dict[str, torch.Tensor]  # "q", "k", "v", "o" -> (d_model, d_model)
    b: dict[str, torch.Tensor]  # "q", "k", "v", "o" -> (d_model,)


def _mha_params(gen: torch.Generator, d_model: int, h: int) -> _MHAParams:
    s = 1 / math.sqrt(d_model)
    return _MHAParams(
        h,
        {n: _randn(gen, d_model, d_model) * s for n in "qkvo"},
        {n: _randn(gen, d_model) * 0.1 for n in "qkvo"},
    )


def _mha(
    p: _MHAParams,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    split: str = "ok",
    merge: str = "ok",
    out_proj: bool = True,
    kv_from_query: bool = False,
    scale: str | float = "sqrt_dk",
    **attend_kw: Any,
) -> torch.Tensor:
    """Multi-head attention with switches that reproduce common mistakes."""
    b, l_q, d = query.shape
    h, d_k = p.h, d // p.h
    if kv_from_query:
        key = value = query

    def split_heads(x: torch.Tensor) -> torch.Tensor:
        length = x.shape[1]
        if split == "no_transpose":
            return x.reshape(b, h, length, d_k)
        if split == "interleaved":
            return x.reshape(b, length, d_k, h).permute(0, 3, 1, 2)
        return x.reshape(b, length, h, d_k).transpose(1, 2)

    q = split_heads(F.linear(query, p.w["q"], p.b["q"]))
    k = split_heads(F.linear(key, p.w["k"], p.b["k"]))
    v = split_heads(F.linear(value, p.w["v"], p.b["v"]))
    if mask is not None and mask.dim() == 3:
        mask = mask.unsqueeze(1)
    if scale == "d_model":
        scale = 1 / math.sqrt(d)
    out, _ = _attend(q, k, v, mask, scale=scale, **attend_kw)
    if merge == "no_transpose":
        out = out.reshape(b, l_q, d)
    elif merge == "interleaved":
        out = out.permute(0, 2, 3, 1).reshape(b, l_q, d)
    else:
        out = out.transpose(1, 2).reshape(b, l_q, d)
    return F.linear(out, p.w["o"], p.b["o"]) if out_proj else out


def _load_linear(module: Any, attr: str, weight: torch.Tensor, bias: torch.Tensor | None,
                 owner: str) -> None:
    lin = getattr(module, attr, None)
    if lin is None:
        raise _StudentError(f"{owner} has no attribute `{attr}` (an nn.Linear); the checker loads "
                            "known weights into it by that name")
    w = getattr(lin, "weight", None)
    if not isinstance(w, torch.Tensor) or tuple(w.shape) != tuple(weight.shape):
        got = _shape(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__
        raise _StudentError(f"{owner}.{attr}.weight must have shape {_shape(weight.shape)} "
                            f"(an nn.Linear({weight.shape[1]}, {weight.shape[0]})), got {got}")
    w.copy_(weight)
    if bias is not None:
        bb = getattr(lin, "bias", None)
        if not isinstance(bb, torch.Tensor) or tuple(bb.shape) != tuple(bias.shape):
            raise _StudentError(f"{owner}.{attr} has no bias of shape {_shape(bias.shape)}: "
                                "build it with bias=True")
        bb.copy_(bias)


def _load_mha(module: Any, p: _MHAParams, owner: str) -> None:
    for n in "qkvo":
        _load_linear(module, f"w_{n}", p.w[n], p.b[n], owner)


def _build(what: str, cls: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    module = _call(f"building {what}", cls, *args, **kwargs)
    if module is None:
        raise _StudentError(f"building {what} returned None")
    if isinstance(module, nn.Module):
        module.eval()
    return module


def check_multi_head_attention(cls: Callable[..., Any], verbose: bool = True) -> CheckResult:
    """Check a multi-head attention class against the reference.

    The checker builds ``cls(d_model, num_heads)``, copies known weights into its ``nn.Linear``
    attributes ``w_q``, ``w_k``, ``w_v`` and ``w_o`` (weights and biases), and calls
    ``module(query, key, value)`` or ``module(query, key, value, mask=mask)``, expecting an output
    of shape (B, L_q, d_model). Cases: self-attention, cross-attention with L_q != L_k, a causal
    mask (L, L), a padding mask (B, 1, 1, L_k), and another d_model / num_heads.
    """
    name = "check_multi_head_attention"
    if not callable(cls):
        return _run(name, [("a class", lambda: f"expected a class, got {type(cls).__name__}")],
                    verbose)

    def case(b, l_q, l_k, d_model, h, mask_fn, seed, self_attn=False):
        def run() -> str | None:
            gen = torch.Generator().manual_seed(seed)
            p = _mha_params(gen, d_model, h)
            query = _randn(gen, b, l_q, d_model)
            key = query if self_attn else _randn(gen, b, l_k, d_model)
            value = query if self_attn else _randn(gen, b, l_k, d_model)
            mask = mask_fn() if mask_fn else None
            module = _build("your module", cls, d_model, h)
            _load_mha(module, p, "your module")
            ref = _mha(p, query, key, value, mask)
            kwargs = {"mask": mask.clone()} if mask is not None else {}
            out = _call("your forward", module, query.clone(), key.clone(), value.clone(), **kwargs)
            variants = [(hint, (lambda kw=kw: _mha(p, query, key, value, mask, **kw)))
                        for hint, kw in _combine(_MHA_MISTAKES)]
            notes = {(b, h, l_q, d_model // h): "the heads were not merged back",
                     (b, l_q, d_model // h): "only one head's width"}
            return _diagnose(out, ref, variants, "the output", "(B, L_q, d_model)", notes)
        return run

    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    pad = torch.tensor([[True] * 6, [True] * 3 + [False] * 3])[:, None, None, :]
    cases = [
        ("self-attention, x (2, 5, 16), 4 heads", case(2, 5, 5, 16, 4, None, 11, self_attn=True)),
        ("cross-attention, query (2, 3, 16), key/value (2, 6, 16), 4 heads",
         case(2, 3, 6, 16, 4, None, 12)),
        ("causal mask (5, 5), x (2, 5, 16), 4 heads",
         case(2, 5, 5, 16, 4, lambda: causal, 13, self_attn=True)),
        ("padding mask (2, 1, 1, 6), query (2, 4, 12), 3 heads",
         case(2, 4, 6, 12, 3, lambda: pad, 14)),
        ("one head of width 8, x (1, 4, 8)", case(1, 4, 4, 8, 1, None, 15, self_attn=True)),
    ]
    return _run(name, cases, verbose)


# --------------------------------------------------------------------------------------------
# Sinusoidal positional encoding


def _sinusoid(max_len: int, d_model: int, *, base: float = 10000.0, swap: bool = False,
              halves: bool = False, start: int = 0, w1: float | None = None) -> torch.Tensor:
    t = torch.arange(start, start + max_len, dtype=torch.float64)[:, None]
    i = torch.arange(d_model // 2, dtype=torch.float64)
    w = w1**i if w1 is not None else base ** (-2 * i / d_model)
    s, c = torch.sin(t * w), torch.cos(t * w)
    if swap:
        s, c = c, s
    if halves:
        return torch.cat([s, c], dim=1)
    pe = torch.zeros(max_len, d_model, dtype=torch.float64)
    pe[:, 0::2] = s
    pe[:, 1::2] = c
    return pe


def _estimated_base_variant(out: torch.Tensor, d_model: int) -> Variant | None:
    """If ``out`` looks like sin/cos with some other base, the variant with that base."""
    if out.dim() != 2 or out.shape[0] < 2 or d_model < 4 or out.shape[1] != d_model:
        return None
    s = float(out[1, 2])  # sin(w_1) with w_1 = base^(-2 / d_model)
    if not 0.0 < s < 1.0:
        return None
    w1 = math.asin(s)
    base = w1 ** (-d_model / 2)
    if not math.isfinite(base) or abs(base - 10000) < 1:
        return None
    shown = f"{base:.0f}" if base < 1e7 else f"{base:.2g}"
    hint = (f"wrong frequency base: your frequencies match base ~ {shown}, expected 10000 "
            "(w_k = 10000^(-2k/d_model))")
    if abs(base - 100) < 1:
        hint += "; did you use k/d_model instead of 2k/d_model in the exponent?"
    return hint, (lambda: _sinusoid(out.shape[0], d_model, w1=w1))


def check_positional_encoding(fn: Callable[..., Any], verbose: bool = True) -> CheckResult:
    """Check ``fn(max_len, d_model) -> (max_len, d_model)`` against the sinusoidal encoding.

    PE[t, 2k] = sin(t w_k), PE[t, 2k+1] = cos(t w_k), w_k = 10000^(-2k/d_model).
    """
    name = "check_positional_encoding"
    if not callable(fn):
        return _run(name, [("a function", lambda: f"expected a function, got {type(fn).__name__}")],
                    verbose)

    def case(max_len, d_model):
        def run() -> str | None:
            ref = _sinusoid(max_len, d_model)
            out = _call("your function", fn, max_len, d_model)
            variants: list[Variant] = [
                ("sin and cos swapped: even columns 2k take sin(t w_k), odd columns 2k+1 take "
                 "cos(t w_k)", lambda: _sinusoid(max_len, d_model, swap=True)),
                ("sin and cos in two halves: interleave them, sin in the even columns and cos in "
                 "the odd ones", lambda: _sinusoid(max_len, d_model, halves=True)),
                ("sin and cos swapped and in two halves: interleave them, sin in the even columns",
                 lambda: _sinusoid(max_len, d_model, halves=True, swap=True)),
                ("positions start at 1: the first position is t = 0",
                 lambda: _sinusoid(max_len, d_model, start=1)),
            ]
            for base in (1000.0, 100.0, 10.0, math.e, 1e5):
                variants.append((
                    f"wrong frequency base: {base:g} instead of 10000 (w_k = 10000^(-2k/d_model))",
                    lambda base=base: _sinusoid(max_len, d_model, base=base)))
            variants.append(("wrong frequency base: the exponent has the wrong sign, "
                             "w_k = 10000^(-2k/d_model) shrinks with k",
                             lambda: _sinusoid(max_len, d_model, base=1e-4)))
            if isinstance(out, torch.Tensor) and not out.is_complex():
                guess = _estimated_base_variant(out.detach().double().cpu(), d_model)
                if guess is not None:
                    variants.append(guess)
            notes = {(d_model, max_len): "transposed: rows are positions, columns are features",
                     (1, max_len, d_model): "without a leading batch axis"}
            return _diagnose(out, ref, variants, "the encoding", "(max_len, d_model)", notes)
        return run

    cases = [
        ("max_len=10, d_model=8", case(10, 8)),
        ("max_len=50, d_model=32", case(50, 32)),
        ("max_len=3, d_model=2", case(3, 2)),
    ]
    return _run(name, cases, verbose)


# --------------------------------------------------------------------------------------------
# Layer normalization


def _layer_norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float, *,
                unbiased: bool = False, eps_mode: str = "inside", affine: bool = True,
                dim: int = -1) -> torch.Tensor:
    mean = x.mean(dim=dim, keepdim=True)
    var = x.var(dim=dim, keepdim=True, unbiased=unbiased)
    if eps_mode == "outside":
        y = (x - mean) / (var.sqrt() + eps)
    elif eps_mode == "none":
        y = (x - mean) / var.sqrt()
    elif eps_mode == "default":
        y = (x - mean) / (var + 1e-5).sqrt()
    else:
        y = (x - mean) / (var + eps).sqrt()
    return y * w + b if affine else y


_LN_MISTAKES: list[tuple[str, dict[str, Any]]] = [
    ("unbiased variance: layer norm divides by d_model, not d_model - 1 "
     "(use var(unbiased=False) or mean((x - mean)**2))", {"unbiased": True}),
    ("eps is added to the standard deviation: add it to the variance, inside the square root",
     {"eps_mode": "outside"}),
    ("eps is missing: add it to the variance inside the square root", {"eps_mode": "none"}),
    ("the eps given to the constructor is not used", {"eps_mode": "default"}),
    ("the gain `weight` and shift `bias` are not applied: return x_hat * weight + bias",
     {"affine": False}),
    ("normalized over the wrong axis: take the mean and variance over the last axis "
     "(the features of each position)", {"dim": 0}),
    ("normalized over the wrong axis: take the mean and variance over the last axis "
     "(the features of each position)", {"dim": -2}),
]


def check_layer_norm(cls: Callable[..., Any], verbose: bool = True) -> CheckResult:
    """Check a layer-norm class against ``torch.nn.functional.layer_norm``.

    The checker builds ``cls(d_model)`` (or ``cls(d_model, eps=eps)``), copies a known gain and
    shift into its parameters ``weight`` and ``bias`` (shape (d_model,)) and calls ``module(x)``.
    """
    name = "check_layer_norm"
    if not callable(cls):
        return _run(name, [("a class", lambda: f"expected a class, got {type(cls).__name__}")],
                    verbose)

    def case(shape, eps, seed, scale=1.0, offset=0.0):
        def run() -> str | None:
            gen = torch.Generator().manual_seed(seed)
            d = shape[-1]
            x = _randn(gen, *shape) * scale + offset
            w = 1 + 0.5 * _randn(gen, d)
            b = 0.5 * _randn(gen, d)
            module = (_build("your module", cls, d) if eps is None
                      else _build("your module", cls, d, eps=eps))
            for attr, val in (("weight", w), ("bias", b)):
                param = getattr(module, attr, None)
                if not isinstance(param, torch.Tensor) or tuple(param.shape) != (d,):
                    got = _shape(param.shape) if isinstance(param, torch.Tensor) else "missing"
                    raise _StudentError(f"your module needs a parameter `{attr}` of shape ({d},)"
                                        f" (got {got}): the checker loads known values into it")
                param.copy_(val)
            e = 1e-5 if eps is None else eps
            ref = F.layer_norm(x, (d,), w, b, e)
            out = _call("your forward", module, x.clone())
            variants = [(h, (lambda kw=kw: _layer_norm(x, w, b, e, **kw)))
                        for h, kw in _combine(_LN_MISTAKES)]
            return _diagnose(out, ref, variants, "the output", "the input's shape (..., d_model)")
        return run

    cases = [
        ("x (2, 5, 8)", case((2, 5, 8), None, 21)),
        ("x (4, 16) with mean 100 and std 10", case((4, 16), None, 22, scale=10.0, offset=100.0)),
        ("eps=0.1 on x (3, 6) with a small variance", case((3, 6), 0.1, 23, scale=0.2)),
        ("a single vector x (8,)", case((8,), None, 24)),
    ]
    return _run(name, cases, verbose)


# --------------------------------------------------------------------------------------------
# Encoder layer

_ENC_MISTAKES: list[tuple[str, dict[str, Any]]] = [
    ("pre-LN and post-LN swapped: with norm_first=True normalize before each sublayer, "
     "x + f(norm(x)); with norm_first=False normalize after the residual sum, norm(x + f(x))",
     {"flip_norm_first": True}),
    ("the residual connections are missing: add each sublayer's input to its output",
     {"residual": False}),
    ("norm1 and norm2 swapped: norm1 goes with self-attention, norm2 with the feed-forward "
     "network", {"swap_norms": True}),
    ("the activation argument is ignored (always ReLU)", {"act": "relu"}),
    ("no activation between linear1 and linear2", {"act": "none"}),
    ("the mask is ignored: pass it to the self-attention", {"mask_mode": "ignored"}),
    ("mask polarity inverted: True means 'may attend'", {"invert": True}),
]

_ACTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": F.relu, "gelu": F.gelu, "none": lambda t: t,
}


def _torch_encoder_layer(d_model: int, nhead: int, d_ff: int, activation: str, norm_first: bool,
                         seed: int) -> nn.TransformerEncoderLayer:
    torch.manual_seed(seed)
    layer = nn.TransformerEncoderLayer(d_model, nhead, d_ff, dropout=0.0, activation=activation,
                                       batch_first=True, norm_first=norm_first)
    with torch.no_grad():  # non-trivial gains and biases, so that every parameter matters
        for ln in (layer.norm1, layer.norm2):
            ln.weight.copy_(1 + 0.3 * torch.randn(d_model))
            ln.bias.copy_(0.3 * torch.randn(d_model))
        layer.self_attn.in_proj_bias.copy_(0.1 * torch.randn(3 * d_model))
    layer.train()  # with dropout 0 this is exact, and it keeps PyTorch's fused fast path off
    return layer


def _encoder_params(layer: nn.TransformerEncoderLayer) -> dict[str, Any]:
    d = layer.self_attn.embed_dim
    w = layer.self_attn.in_proj_weight.detach().chunk(3)
    bias = layer.self_attn.in_proj_bias.detach().chunk(3)
    attn = _MHAParams(
        layer.self_attn.num_heads,
        {"q": w[0], "k": w[1], "v": w[2], "o": layer.self_attn.out_proj.weight.detach()},
        {"q": bias[0], "k": bias[1], "v": bias[2], "o": layer.self_attn.out_proj.bias.detach()},
    )
    return {
        "d": d, "attn": attn,
        "l1": (layer.linear1.weight.detach(), layer.linear1.bias.detach()),
        "l2": (layer.linear2.weight.detach(), layer.linear2.bias.detach()),
        "n1": (layer.norm1.weight.detach(), layer.norm1.bias.detach(), layer.norm1.eps),
        "n2": (layer.norm2.weight.detach(), layer.norm2.bias.detach(), layer.norm2.eps),
    }


def _encoder(p: dict[str, Any], x: torch.Tensor, mask: torch.Tensor | None, *, norm_first: bool,
             activation: str, flip_norm_first: bool = False, residual: bool = True,
             swap_norms: bool = False, act: str | None = None, **attend_kw: Any) -> torch.Tensor:
    """An encoder layer written out, with switches that reproduce common mistakes."""
    d = p["d"]
    n1, n2 = (p["n2"], p["n1"]) if swap_norms else (p["n1"], p["n2"])
    activation_fn = _ACTS[act or activation]

    def norm(y: torch.Tensor, n: tuple[torch.Tensor, torch.Tensor, float]) -> torch.Tensor:
        return F.layer_norm(y, (d,), n[0], n[1], n[2])

    def sa(y: torch.Tensor) -> torch.Tensor:
        return _mha(p["attn"], y, y, y, mask, **attend_kw)

    def ff(y: torch.Tensor) -> torch.Tensor:
        return F.linear(activation_fn(F.linear(y, *p["l1"])), *p["l2"])

    def add(y: torch.Tensor, f_y: torch.Tensor) -> torch.Tensor:
        return y + f_y if residual else f_y

    if norm_first != flip_norm_first:
        x = add(x, sa(norm(x, n1)))
        return add(x, ff(norm(x, n2)))
    x = norm(add(x, sa(x)), n1)
    return norm(add(x, ff(x)), n2)


def _load_encoder(module: Any, p: dict[str, Any]) -> None:
    attn = getattr(module, "self_attn", None)
    if attn is None:
        raise _StudentError("your layer has no attribute `self_attn` (your multi-head attention "
                            "with w_q, w_k, w_v, w_o); the checker loads known weights by name")
    _load_mha(attn, p["attn"], "your layer.self_attn")
    _load_linear(module, "linear1", *p["l1"], "your layer")
    _load_linear(module, "linear2", *p["l2"], "your layer")
    for attr, (w, b, _) in (("norm1", p["n1"]), ("norm2", p["n2"])):
        norm = getattr(module, attr, None)
        ok = all(isinstance(getattr(norm, n, None), torch.Tensor)
                 and tuple(getattr(norm, n).shape) == tuple(w.shape) for n in ("weight", "bias"))
        if not ok:
            raise _StudentError(f"your layer has no layer norm `{attr}` with `weight` and `bias` "
                                f"of shape {_shape(w.shape)}")
        norm.weight.copy_(w)
        norm.bias.copy_(b)


def check_encoder_layer(cls: Callable[..., Any], verbose: bool = True) -> CheckResult:
    """Check an encoder layer class against ``torch.nn.TransformerEncoderLayer(batch_first=True)``.

    The checker builds ``cls(d_model, nhead, dim_feedforward, 0.0, activation=...,
    norm_first=...)`` and copies the weights of a ``torch.nn.TransformerEncoderLayer`` into its
    attributes ``self_attn`` (``w_q``, ``w_k``, ``w_v``, ``w_o``), ``linear1``, ``linear2``,
    ``norm1`` and ``norm2``; a class without them but with a ``from_torch`` classmethod is built
    by ``cls.from_torch(torch_layer)`` instead. It calls ``layer(x)`` or ``layer(x, mask=mask)``
    with a bool padding mask (B, 1, 1, L), True = may attend.
    """
    name = "check_encoder_layer"
    if not callable(cls):
        return _run(name, [("a class", lambda: f"expected a class, got {type(cls).__name__}")],
                    verbose)

    def case(b, length, d_model, nhead, d_ff, norm_first, activation, lengths, seed):
        def run() -> str | None:
            layer = _torch_encoder_layer(d_model, nhead, d_ff, activation, norm_first, seed)
            p = _encoder_params(layer)
            gen = torch.Generator().manual_seed(seed)
            x = _randn(gen, b, length, d_model)
            mask = None
            if lengths is not None:
                real = torch.arange(length)[None, :] < torch.tensor(lengths)[:, None]  # (B, L)
                mask = real[:, None, None, :]
                ref = layer(x, src_key_padding_mask=~real)
            else:
                ref = layer(x)
            try:
                module = _build("your layer", cls, d_model, nhead, d_ff, 0.0,
                                activation=activation, norm_first=norm_first)
                _load_encoder(module, p)
            except _StudentError:
                if not callable(getattr(cls, "from_torch", None)):
                    raise
                module = _call("your from_torch", cls.from_torch, layer)
                if isinstance(module, nn.Module):
                    module.eval()
            kwargs = {"mask": mask.clone()} if mask is not None else {}
            out = _call("your forward", module, x.clone(), **kwargs)
            variants = [(h, (lambda kw=kw: _encoder(p, x, mask, norm_first=norm_first,
                                                    activation=activation, **kw)))
                        for h, kw in _combine(_ENC_MISTAKES)]
            return _diagnose(out, ref.detach(), variants, "the output", "(B, L, d_model)")
        return run

    cases = [
        ("post-LN (norm_first=False), x (2, 5, 16), 4 heads, ReLU",
         case(2, 5, 16, 4, 32, False, "relu", None, 31)),
        ("pre-LN (norm_first=True), x (2, 5, 16), 4 heads, ReLU",
         case(2, 5, 16, 4, 32, True, "relu", None, 32)),
        ("post-LN with a padding mask (2, 1, 1, 6), 2 heads",
         case(2, 6, 8, 2, 16, False, "relu", [6, 4], 33)),
        ("pre-LN, GELU, padding mask (2, 1, 1, 6), 2 heads",
         case(2, 6, 8, 2, 16, True, "gelu", [3, 6], 34)),
    ]
    return _run(name, cases, verbose)
