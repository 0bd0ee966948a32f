"""Assignment 7: a decoder layer, post-LN and pre-LN, with its causal mask.

The student writes ``DecoderLayer(d_model, nhead, dim_feedforward, dropout=0.0,
activation="relu", norm_first=False)`` with attributes ``self_attn`` and ``multihead_attn``
(each with ``w_q``, ``w_k``, ``w_v``, ``w_o``), ``linear1``, ``linear2``, ``norm1``, ``norm2``
and ``norm3``, named as in ``torch.nn.TransformerDecoderLayer``; ``forward(x, memory,
tgt_mask=None, memory_mask=None)``; and a static method ``causal_mask(length)``.

Besides the usual cases (output and gradients against a float64 reference that equals torch's
layer), two kinds of case of its own run through `core.register_runner`:

* ``decoder_mask`` calls ``DecoderLayer.causal_mask(L)`` and returns the mask;
* ``decoder_causality`` builds the layer, makes the causal mask with the student's
  ``causal_mask``, and runs the layer twice: on the target ``x`` and on ``x_changed``, the same
  target with every token from a position ``t`` on replaced. It returns both outputs, raw. The
  trusted side (`DecoderChecker.judge`) reads from them whether an output before ``t`` moved,
  and compares both with the reference.
"""

from __future__ import annotations

from typing import Any

import torch

from . import sublayers as parts
from .a3_masks import Reference, length_case
from .checker import Case, Checker, Mistake, combined, run_in_process
from .core import Spec
from .guard import Assignment, Rule
from .results import CheckResult
from .runners import CAUSALITY_KIND, MASK_KIND

__all__ = ["check_decoder_layer", "CHECKER", "ASSIGNMENT", "decoder_layer", "causal_variant"]



_CAUSAL_VARIANTS = {"strict": {"rule": "no_diagonal"}, "ahead": {"rule": "sees_next"},
                    "upper": {"rule": "upper"}, "inverted": {"invert": True},
                    "additive": {"form": "additive"}}


def causal_variant(length: int, variant: str = "ok") -> torch.Tensor:
    """The (L, L) causal mask (bool, True = may attend), or one of the usual wrong ones: "strict"
    (the diagonal hidden), "ahead" (off by one: position i sees 0..i+1), "upper" (transposed),
    "inverted" (polarity), "additive" (PyTorch's float convention)."""
    return Reference.causal(length, **_CAUSAL_VARIANTS.get(variant, {}))


def decoder_layer(p: dict[str, torch.Tensor], x: torch.Tensor, memory: torch.Tensor,
                  tgt_mask: torch.Tensor | None, memory_mask: torch.Tensor | None, *,
                  nhead: int, norm_first: bool, activation: str, dropout: float = 0.0,
                  train: bool = False, flip_norm_first: bool = False, swap_norms: str = "",
                  residual: str = "all", cross: str = "ok", sa_mask: str = "tgt",
                  ca_mask: str = "memory", ca_query: str = "ok", norm_memory: bool = False,
                  pre_from_norm: bool = False, final_norm: bool = False, act: str | None = None,
                  drop: str = "ok", drop_in_eval: bool = False,
                  trace: dict[str, torch.Tensor] | None = None,
                  **attend_kw: Any) -> torch.Tensor:
    """A decoder layer written out (float64 in the checker), with switches for common mistakes.

    Shapes: x (B, L_t, d_model), memory (B, L_s, d_model), tgt_mask broadcastable to
    (B, h, L_t, L_t) (a 3-dimensional one gets a head axis), memory_mask broadcastable to
    (B, h, L_t, L_s); returns (B, L_t, d_model). Post-LN::

        x = norm1(x + SA(x)); x = norm2(x + CA(x, memory)); x = norm3(x + FF(x))

    pre-LN: ``x = x + SA(norm1(x)); x = x + CA(norm2(x), memory); x = x + FF(norm3(x))``.
    Dropout is modelled for p = 0 and p = 1 only (the checker's cases), where it is exact.
    """
    names = {"sa": "norm1", "ca": "norm2", "ff": "norm3"}
    if swap_norms == "23":
        names["ca"], names["ff"] = "norm3", "norm2"
    elif swap_norms == "12":
        names["sa"], names["ca"] = "norm2", "norm1"
    masks = {"tgt": tgt_mask, "memory": memory_mask, "none": None}
    activation_fn = parts.ACTIVATIONS[act or activation]
    p_drop = dropout if (train or drop_in_eval) else 0.0
    record = parts.trace_recorder({} if trace is None else trace)
    dropped = parts.exact_dropout(p_drop)
    layer = parts.Sublayers(p, nhead, record, dropped, drop, residual, attend_kw)
    norm, add = layer.norm, layer.add

    def sa(y: torch.Tensor) -> torch.Tensor:
        return layer.attend("self_attn", y, y, masks[sa_mask], "no_sa")

    def ca(y: torch.Tensor) -> torch.Tensor:
        mem = norm(memory, names["ca"]) if norm_memory else memory
        q, kv = {"ok": (y, mem), "swap_qk": (mem, y), "kv_from_x": (y, y)}[cross]
        return layer.attend("multihead_attn", q, kv, masks[ca_mask], "no_ca")

    def ff(y: torch.Tensor) -> torch.Tensor:
        return parts.feed_forward(p, y, activation_fn, dropped, record, drop)

    if norm_first != flip_norm_first:
        h = norm(x, names["sa"])
        x = add(h if pre_from_norm else x, sa(h), "sa")
        h = norm(x, names["ca"])
        x = add(h if pre_from_norm else x, ca(x if ca_query == "raw" else h), "ca")
        h = norm(x, names["ff"])
        x = add(h if pre_from_norm else x, ff(h), "ff")
        return norm(x, "norm3") if final_norm else x
    x = norm(add(x, sa(x), "sa"), names["sa"])
    x = norm(add(x, ca(x), "ca"), names["ca"])
    return norm(add(x, ff(x), "ff"), names["ff"])


# The student side of the two kinds of case of this assignment is in `runners`.



# --------------------------------------------------------------------------------------------
# The trusted side


# The mistakes of the layer and of its causal mask, in the order they are looked for.
MISTAKES = (
    # the causal mask
    Mistake("the causal mask is off by one: it lets position i see position i + 1 too; "
            "position i may attend to positions 0..i (tril with diagonal 0)",
            {"causal": "ahead"}),
    Mistake("the causal mask hides the diagonal: position i may attend to positions 0..i, "
            "itself included (tril with diagonal 0, not -1)", {"causal": "strict"}),
    Mistake("the causal mask is transposed (triu): row i is query i and must allow the keys "
            "0..i, a lower-triangular matrix", {"causal": "upper"}),
    Mistake("causal mask polarity inverted: True means 'may attend', so the keys j <= i are "
            "True", {"causal": "inverted"}),
    Mistake("an additive float mask (0 and -inf), PyTorch's convention for nn.Transformer: "
            "the book's masks are bool, True = may attend", {"causal": "additive"}),
    # the masks in the layer
    Mistake("the target mask is ignored, so the causal mask never reaches the "
            "self-attention: pass tgt_mask to self_attn", {"sa_mask": "none"}),
    Mistake("the memory mask is ignored: pass memory_mask to the cross-attention, so that "
            "source padding gets no weight", {"ca_mask": "none"}),
    Mistake("the memory mask is applied to the self-attention (and tgt_mask is ignored): "
            "tgt_mask goes to self_attn, memory_mask to multihead_attn",
            {"sa_mask": "memory"}),
    Mistake("the two masks are swapped: tgt_mask goes to self_attn, memory_mask to "
            "multihead_attn", {"sa_mask": "memory", "ca_mask": "tgt"}),
    Mistake("the target mask is applied to the cross-attention: the memory is known whole, "
            "only its padding is masked, with memory_mask", {"ca_mask": "tgt"}),
    parts.LAYER_MISTAKES["mask_3d"],
    parts.LAYER_MISTAKES["mask_inverted"],
    # cross-attention
    Mistake("cross-attention's queries and keys swapped: the queries come from the decoder "
            "(x), the keys and values from memory, multihead_attn(x, memory, memory)",
            {"cross": "swap_qk"}),
    Mistake("the cross-attention attends over x, not over memory: multihead_attn(x, memory, "
            "memory)", {"cross": "kv_from_x"}),
    Mistake("in pre-LN the cross-attention's queries are the un-normalized x: use "
            "x + CA(norm2(x), memory)", {"ca_query": "raw"}),
    Mistake("the memory is normalized (by norm2) before the cross-attention: norm2 "
            "normalizes only the decoder's x; the memory is used as it comes",
            {"norm_memory": True}),
    # norms and residuals
    parts.LAYER_MISTAKES["flip_norm_first"],
    *(Mistake(f"norm{a} and norm{b} swapped: norm1 goes with self-attention, norm2 with "
              "cross-attention, norm3 with the feed-forward network", {"swap_norms": f"{a}{b}"})
      for a, b in ((2, 3), (1, 2))),
    Mistake("in pre-LN the residual is taken from norm(x): add each sublayer's output to x "
            "itself, x + f(norm(x))", {"pre_from_norm": True}),
    Mistake("a pre-LN layer that normalizes its output at the end: the layer returns "
            "x + FF(norm3(x)) as it is; the final norm belongs to the stack "
            "(nn.TransformerDecoder's norm)", {"final_norm": True}),
    parts.LAYER_MISTAKES["no_residual"],
    parts.LAYER_MISTAKES["no_ca_residual"],
    parts.LAYER_MISTAKES["no_sa_residual"],
    parts.LAYER_MISTAKES["no_ff_residual"],
    # feed-forward
    *(parts.LAYER_MISTAKES[k] for k in ("act_ignored", "gelu_tanh_decoder", "no_act")),
    # dropout
    *(Mistake(f"no dropout on the {block} output: apply it to each sublayer's output before "
              "the residual sum", {"drop": key}, combine=False)
      for block, key in (("cross-attention", "no_ca"), ("self-attention", "no_sa"),
                         ("feed-forward", "no_ff"))),
    *parts.SHARED_DROPOUT_MISTAKES,
)


class DecoderChecker(Checker):
    """The checker of the ``DecoderLayer`` module (and of its ``causal_mask``)."""

    name = "check_decoder_layer"
    target = "DecoderLayer"
    what = "your layer"
    shape_desc = {"output": "(B, L_t, d_model)", "output_changed": "(B, L_t, d_model)",
                  "mask": "(L, L)"}
    mistakes = MISTAKES

    def all_mistakes(self) -> list[Mistake]:
        """None here: `extra_variants` gives, case by case, the mistakes that can show in it."""
        return []

    def extra_variants(self, spec: Spec, raw: dict[str, torch.Tensor]) -> list[Mistake]:
        """The mistakes that change the output of this case, and their pairs.

        The mistakes of the mask alone show only in the two cases that use the student's mask,
        a mask mistake only in a case with that mask, dropout only where dropout is 1.0, ...:
        leaving out the others keeps the search (and a wrong notebook's wait) short.
        """
        if spec.kind == MASK_KIND:
            return [m for m in self.mistakes if "causal" in m.options]
        t = spec.tensors
        mask_3d = "tgt_mask" in t and t["tgt_mask"].dim() == 3
        masked = spec.kind == CAUSALITY_KIND or "tgt_mask" in t or "memory_mask" in t
        gelu = spec.ctor_kwargs.get("activation") == "gelu"
        pre = bool(spec.ctor_kwargs.get("norm_first"))
        dropout = len(spec.ctor_args) > 3 and spec.ctor_args[3] == 1.0

        def shows(m: Mistake) -> bool:
            o = m.options
            return not (("causal" in o and spec.kind != CAUSALITY_KIND)
                        or (("sa_mask" in o or "ca_mask" in o or "invert" in o) and not masked)
                        or ("head_axis" in o and not mask_3d)
                        or (("drop" in o or "drop_in_eval" in o) and not dropout)
                        or (o.get("act") in ("relu", "gelu_tanh") and not gelu)
                        or (("ca_query" in o or "final_norm" in o or "pre_from_norm" in o)
                            and not pre))

        singles = [m for m in self.mistakes if shows(m)]
        if dropout:  # where dropout is tested, a dropout mistake is the likelier explanation
            singles.sort(key=lambda m: not ("drop" in m.options or "drop_in_eval" in m.options))
        return singles + combined([m for m in singles if m.combine])

    def judge(self, spec: Spec, raw: dict[str, Any]) -> str | None:
        hint = parts.dropout_build_note(spec, raw, super().judge(spec, raw), "the attentions")
        status = raw.get("status")
        if (hint and status == "call" and spec.kind != MASK_KIND
                and ("must match" in hint or "broadcast" in hint)):
            l_t, l_s = spec.tensors["x"].shape[1], spec.tensors["memory"].shape[1]
            if l_t != l_s:
                hint += (f" (here the target has L_t = {l_t} positions and the memory L_s = "
                         f"{l_s}: the cross-attention takes its queries from x and its keys "
                         "and values from memory, so its output has x's length, and each mask "
                         "goes to its own attention: tgt_mask to self_attn, memory_mask to "
                         "multihead_attn)")
        causality = hint and status == "ok" and spec.kind == CAUSALITY_KIND
        return self._causality(spec, raw["tensors"]) + hint if causality else hint

    def _causality(self, spec: Spec, tensors: dict[str, torch.Tensor]) -> str:
        """What the two raw outputs say about looking ahead, as the start of the hint."""
        t = int(spec.config["changed_from"])
        a, b = tensors.get("out:output"), tensors.get("out:output_changed")
        want = tuple(spec.tensors["x"].shape)
        if a is None or b is None or tuple(a.shape) != want or tuple(b.shape) != want:
            return ""
        a, b = a.double(), b.double()
        moved = ((a[:, :t] - b[:, :t]).abs() > 1e-5 + 1e-5 * a[:, :t].abs()).any(dim=0).any(-1)
        early = [i for i in range(t) if bool(moved[i])]
        if early:
            return (f"your layer looks ahead: only the target tokens from position {t} on were "
                    f"changed, yet the output at position {early[0]} (of 0..{t - 1}) changed "
                    "too; ")
        return (f"your layer is causal (no output before position {t} changed when the tokens "
                f"from position {t} on did), but ")

    def forward(self, spec: Spec, x: dict[str, torch.Tensor], p: dict[str, torch.Tensor],
                **options: Any) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        causal = options.pop("causal", "ok")
        if spec.kind == MASK_KIND:
            return {"mask": causal_variant(int(spec.literals[0]), causal)}, {}
        _, nhead, _, dropout = spec.ctor_args
        kw = {"nhead": nhead, "dropout": dropout, "train": spec.train, **spec.ctor_kwargs,
              **options}
        if spec.kind == CAUSALITY_KIND:
            tgt_mask = causal_variant(x["x"].shape[1], causal)
            return {out: decoder_layer(p, x[name], x["memory"], tgt_mask, x.get("memory_mask"),
                                       **kw)
                    for out, name in (("output", "x"), ("output_changed", "x_changed"))}, {}
        trace: dict[str, torch.Tensor] = {}
        out = decoder_layer(p, x["x"], x["memory"], x.get("tgt_mask"), x.get("memory_mask"),
                            trace=trace, **kw)
        return {"output": out}, trace


_ATTENTIONS, _NORMS = ("self_attn", "multihead_attn"), ("norm1", "norm2", "norm3")


def _case(b: int, l_t: int, l_s: int, d: int, nhead: int, d_ff: int, norm_first: bool,
          activation: str = "relu", tgt: str | None = None, memory_pad: bool = False,
          dropout: float = 0.0, train: bool = False) -> Any:
    """A module case; ``tgt`` is None, "causal" ((L_t, L_t)) or "causal_pad" ((B, L_t, L_t):
    causal and target padding)."""
    def make(gen: torch.Generator) -> Spec:
        params = parts.layer_params(gen, d, d_ff, _ATTENTIONS, _NORMS)
        tensors = {"x": torch.randn(b, l_t, d, generator=gen),
                   "memory": torch.randn(b, l_s, d, generator=gen)}
        if tgt:
            causal = torch.ones(l_t, l_t, dtype=torch.bool).tril()
            tensors["tgt_mask"] = (causal if tgt == "causal" else
                                   causal[None] & parts.padding_real(gen, b, l_t)[:, None, :])
        if memory_pad:
            tensors["memory_mask"] = parts.padding_real(gen, b, l_s)[:, None, None, :]
        kwargs = {k: k for k in ("tgt_mask", "memory_mask") if k in tensors}
        return parts.layer_spec("module", tensors, ["x", "memory"], kwargs,
                                (d, nhead, d_ff, dropout), activation, norm_first, params,
                                train=train,
                                grad_out={"output": torch.randn(b, l_t, d, generator=gen)},
                                grad_inputs=["x", "memory"],
                                trace=["norm1", "self_attn", "norm2", "multihead_attn", "norm3",
                                       "linear1", "linear2"])
    return make


def _causality_case(b: int, length: int, d: int, nhead: int, d_ff: int, norm_first: bool) -> Any:
    def make(gen: torch.Generator) -> Spec:
        params = parts.layer_params(gen, d, d_ff, _ATTENTIONS, _NORMS)
        x = torch.randn(b, length, d, generator=gen)
        t = int(torch.randint(1, length, (1,), generator=gen))
        changed = x.clone()
        changed[:, t:] = torch.randn(b, length - t, d, generator=gen)
        tensors = {"x": x, "x_changed": changed,
                   "memory": torch.randn(b, length, d, generator=gen),
                   "memory_mask": parts.padding_real(gen, b, length)[:, None, None, :]}
        return parts.layer_spec(CAUSALITY_KIND, tensors, ["x", "memory"],
                                {"memory_mask": "memory_mask"}, (d, nhead, d_ff, 0.0), "relu",
                                norm_first, params, outputs=["output", "output_changed"],
                                config={"changed_from": t})
    return make


# Points per case: the one place where this assignment's points are declared.
CHECKER = DecoderChecker([
    Case("post_ln", "post-LN (norm_first=False), x (2, 5, 16), memory (2, 7, 16), 4 heads",
         _case(2, 5, 7, 16, 4, 32, False), points=2),
    Case("pre_ln", "pre-LN (norm_first=True), x (2, 5, 16), memory (2, 7, 16), 4 heads",
         _case(2, 5, 7, 16, 4, 32, True), points=2),
    Case("post_causal", "post-LN with a causal target mask (6, 6), 2 heads",
         _case(2, 6, 6, 8, 2, 16, False, tgt="causal"), points=2),
    Case("post_memory_padding", "post-LN with a source padding mask (2, 1, 1, 6), 2 heads",
         _case(2, 6, 6, 8, 2, 16, False, memory_pad=True), points=2),
    Case("post_both", "post-LN, causal mask (6, 6) and source padding (3, 1, 1, 6)",
         _case(3, 6, 6, 8, 2, 16, False, tgt="causal", memory_pad=True), points=2),
    Case("pre_both_gelu", "pre-LN, GELU, target mask (B, L_t, L_t) = (2, 5, 5) (causal and "
         "target padding), source padding (2, 1, 1, 7)",
         _case(2, 5, 7, 8, 2, 16, True, "gelu", tgt="causal_pad", memory_pad=True), points=2),
    Case("causal_mask", "DecoderLayer.causal_mask(7): (7, 7) bool, True = may attend",
         length_case(7, kind=MASK_KIND), points=1),
    Case("causality", "causality: changing the target from a position t on changes no output "
         "before t (pre-LN, your causal_mask, source padding)",
         _causality_case(2, 6, 8, 2, 16, True), points=2),
    Case("post_train_dropout", "training mode, dropout=1.0, post-LN: each sublayer's output is "
         "dropped", _case(2, 5, 6, 8, 2, 16, False, dropout=1.0, train=True), points=1),
    Case("pre_train_dropout", "training mode, dropout=1.0, pre-LN: each sublayer's output is "
         "dropped", _case(2, 5, 6, 8, 2, 16, True, dropout=1.0, train=True), points=1),
    Case("eval_dropout", "eval mode turns dropout off (dropout=1.0), pre-LN",
         _case(2, 5, 6, 8, 2, 16, True, tgt="causal", memory_pad=True, dropout=1.0), points=1),
])

ASSIGNMENT = Assignment(
    name="a7_decoder_layer",
    checkers=[CHECKER],
    rules=[
        *parts.layer_rules("decoder"),
        Rule("code", "torch.nn.modules.transformer", "uses torch's nn.Transformer (its "
             "generate_square_subsequent_mask is the causal mask this assignment asks for)",
             qualname="Transformer"),
        Rule("code", "torch.nn.modules.transformer", "uses torch's causal mask helper",
             qualname="_generate_square_subsequent_mask"),
        Rule("code", "utils.masks", "uses utils.masks.causal_mask, the book's version of the "
             "causal mask this assignment asks for", qualname="causal_mask"),
        Rule("code", "utils.masks", "uses utils.masks.local_mask, which makes the causal mask "
             "this assignment asks for", qualname="local_mask"),
    ],
)


def check_decoder_layer(cls: Any, verbose: bool = True) -> CheckResult:
    """Check a decoder layer class against the reference.

    The checker builds ``cls(d_model, nhead, dim_feedforward, dropout, activation=...,
    norm_first=...)``, copies known weights into ``self_attn`` and ``multihead_attn`` (``w_q``,
    ``w_k``, ``w_v``, ``w_o``), ``linear1``, ``linear2``, ``norm1``, ``norm2`` and ``norm3``,
    calls ``layer(x, memory)`` with ``tgt_mask`` ((L_t, L_t) or (B, L_t, L_t)) and
    ``memory_mask`` ((B, 1, 1, L_s)) as keyword arguments when the case has them (bool, True =
    may attend), and compares the output (B, L_t, d_model) and the gradients of x, memory and
    every weight. One case checks ``cls.causal_mask(L)``; one checks causality itself: with the
    mask from ``cls.causal_mask``, changing the target from a position t on must leave every
    output before t as it was. Three cases check dropout, as in assignment 6.
    """
    return run_in_process(CHECKER, cls, verbose)
