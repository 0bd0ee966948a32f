"""Assignment 7, the decoder layer (utils.checks.a7_decoder_layer): the float64 reference equals
torch's nn.TransformerDecoderLayer, the right code passes, every named mistake is named, the
causality case is judged from the two raw outputs, bad code never makes the checker raise, and
the grader (sandbox and command line) grades a right, a wrong and two hostile submissions."""

from __future__ import annotations

import csv
import inspect

import nbformat
import pytest
import torch
import torch.nn.functional as F
from assignment_grading import grade, write_submission
from grading_submissions import torch_layer
from notebooks import ROOT
from torch import nn

from grader.scan import static_scan
from utils.attention import MultiHeadAttention
from utils.checks import ASSIGNMENTS, CheckResult, check_decoder_layer
from utils.checks.a7_decoder_layer import (
    CAUSALITY_KIND,
    CHECKER,
    causal_variant,
    decoder_layer,
)
from utils.checks.core import guarded_exercise
from utils.layers import LayerNorm

NOTEBOOK = ROOT / "book" / "assignments" / "a7_decoder_layer.ipynb"


# ---------------------------------------------------------------------------------------------
# The reference


def _params_of(layer: nn.TransformerDecoderLayer) -> dict[str, torch.Tensor]:
    """torch's weights under the names the assignment asks for."""
    p = {}
    for ours, theirs in (("self_attn", layer.self_attn), ("multihead_attn", layer.multihead_attn)):
        w, b = theirs.in_proj_weight.detach().chunk(3), theirs.in_proj_bias.detach().chunk(3)
        for i, n in enumerate("qkv"):
            p[f"{ours}.w_{n}.weight"], p[f"{ours}.w_{n}.bias"] = w[i], b[i]
        p[f"{ours}.w_o.weight"] = theirs.out_proj.weight.detach()
        p[f"{ours}.w_o.bias"] = theirs.out_proj.bias.detach()
    for name in ("linear1", "linear2", "norm1", "norm2", "norm3"):
        sub = getattr(layer, name)
        p[f"{name}.weight"], p[f"{name}.bias"] = sub.weight.detach(), sub.bias.detach()
    return p


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("masks", ["none", "causal", "padding", "both", "causal_pad"])
def test_reference_equals_torch(norm_first, activation, masks):
    """In float64, to 1e-12: the reference is torch's layer, masks in the book's convention."""
    torch.manual_seed(3)
    layer = nn.TransformerDecoderLayer(8, 2, 16, dropout=0.0, activation=activation,
                                       batch_first=True, norm_first=norm_first).double().eval()
    b, l_t, l_s = 3, 5, 7
    x, memory = torch.randn(b, l_t, 8).double(), torch.randn(b, l_s, 8).double()
    causal = torch.ones(l_t, l_t, dtype=torch.bool).tril()
    src_real = torch.arange(l_s)[None] < torch.tensor([7, 4, 1])[:, None]
    tgt_real = torch.arange(l_t)[None] < torch.tensor([5, 2, 3])[:, None]
    ours_t = ours_m = None
    theirs: dict = {}
    if masks in ("causal", "both"):
        ours_t, theirs["tgt_mask"] = causal, ~causal
    if masks == "causal_pad":
        ours_t = causal[None] & tgt_real[:, None, :]
        theirs["tgt_mask"], theirs["tgt_key_padding_mask"] = ~causal, ~tgt_real
    if masks in ("padding", "both", "causal_pad"):
        ours_m, theirs["memory_key_padding_mask"] = src_real[:, None, None, :], ~src_real
    with torch.no_grad():
        want = layer(x, memory, **theirs)
        got = decoder_layer(_params_of(layer), x, memory, ours_t, ours_m, nhead=2,
                            norm_first=norm_first, activation=activation)
    assert torch.allclose(got, want, atol=1e-12, rtol=0)


@pytest.mark.parametrize("norm_first", [False, True])
def test_reference_dropout_one_equals_torch_in_training(norm_first):
    """dropout=1.0 in training mode: torch's layer and the reference drop the same things."""
    torch.manual_seed(4)
    layer = nn.TransformerDecoderLayer(8, 2, 16, dropout=1.0, batch_first=True,
                                       norm_first=norm_first).double().train()
    x, memory = torch.randn(2, 4, 8).double(), torch.randn(2, 6, 8).double()
    with torch.no_grad():
        want = layer(x, memory)
        got = decoder_layer(_params_of(layer), x, memory, None, None, nhead=2,
                            norm_first=norm_first, activation="relu", dropout=1.0, train=True)
    assert torch.allclose(got, want, atol=1e-12, rtol=0)


def test_causal_variants():
    assert torch.equal(causal_variant(3), torch.tensor([[1, 0, 0], [1, 1, 0], [1, 1, 1]]).bool())
    assert torch.equal(causal_variant(3, "ahead"), torch.ones(3, 3, dtype=torch.bool).tril(1))
    assert causal_variant(3, "additive").dtype == torch.float32


# ---------------------------------------------------------------------------------------------
# Student code, right and wrong


class Dec(nn.Module):
    """A decoder layer with switches: ``mode`` names one mistake, ``mask_mode`` one in the mask."""

    mode = "ok"
    mask_mode = "ok"

    def __init__(self, d_model, nhead, dim_feedforward, dropout=0.0, activation="relu",
                 norm_first=False):
        super().__init__()
        self.self_attn = MultiHeadAttention(d_model, nhead)
        self.multihead_attn = MultiHeadAttention(d_model, nhead)
        self.linear1 = nn.Linear(d_model, dim_feedforward)
        self.linear2 = nn.Linear(dim_feedforward, d_model)
        self.norm1, self.norm2, self.norm3 = (LayerNorm(d_model) for _ in range(3))
        self.dropout = nn.Dropout(dropout)
        self.p = dropout
        self.activation = {"relu": F.relu, "gelu": F.gelu}[activation]
        self.norm_first = norm_first

    @classmethod
    def causal_mask(cls, length):
        ones = torch.ones(length, length, dtype=torch.bool)
        return {"ok": ones.tril(), "ahead": ones.tril(1), "strict": ones.tril(-1),
                "upper": ones.triu(), "inverted": ~ones.tril(),
                "additive": torch.zeros(length, length).masked_fill(~ones.tril(), float("-inf")),
                }[cls.mask_mode]

    def forward(self, x, memory, tgt_mask=None, memory_mask=None):
        m = self.mode
        drop = ((lambda t: F.dropout(t, self.p, training=True)) if m == "drop_in_eval"
                else self.dropout)
        act = {"always_relu": F.relu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
               "no_act": lambda t: t}.get(m, self.activation)
        if m == "invert":
            tgt_mask, memory_mask = (None if k is None else ~k for k in (tgt_mask, memory_mask))
        if m == "no_head_axis" and tgt_mask is not None and tgt_mask.dim() == 3:
            tgt_mask = tgt_mask[None]  # (1, B, L, L): the batch axis meets the heads
        sa_mask = {"no_tgt_mask": None, "memory_mask_in_self": memory_mask,
                   "masks_swapped": memory_mask}.get(m, tgt_mask)
        ca_mask = {"no_memory_mask": None, "masks_swapped": tgt_mask,
                   "tgt_to_cross": tgt_mask}.get(m, memory_mask)
        n_sa, n_ca, n_ff = {"norm23": (self.norm1, self.norm3, self.norm2),
                            "norm12": (self.norm2, self.norm1, self.norm3)}.get(
                                m, (self.norm1, self.norm2, self.norm3))

        def sa(y):
            out = self.self_attn(y, y, y, sa_mask)
            return out if m == "no_sa_dropout" else drop(out)

        def ca(y, mem):
            if m == "cross_swap":
                out = self.multihead_attn(mem, y, y, ca_mask)
            elif m == "cross_self":
                out = self.multihead_attn(y, y, y, ca_mask)
            else:
                out = self.multihead_attn(y, mem, mem, ca_mask)
            return out if m == "no_ca_dropout" else drop(out)

        def ff(y):
            h = act(self.linear1(y))
            out = self.linear2(h if m == "no_ff_dropout_at_all" else drop(h))
            return out if m in ("no_ff_dropout", "no_ff_dropout_at_all") else drop(out)

        def add(y, f_y, which):
            out = f_y if m in ("no_residual", f"no_{which}_residual") else y + f_y
            return drop(out) if m == "drop_sum" else out

        mem = n_ca(memory) if m == "norm_memory" else memory
        if self.norm_first != (m == "flip"):
            h = n_sa(x)
            x = add(h if m == "pre_from_norm" else x, sa(h), "sa")
            h = n_ca(x)
            x = add(h if m == "pre_from_norm" else x, ca(x if m == "pre_raw_query" else h, mem),
                    "ca")
            h = n_ff(x)
            x = add(h if m == "pre_from_norm" else x, ff(h), "ff")
            return self.norm3(x) if m == "final_norm" else x
        x = n_sa(add(x, sa(x), "sa"))
        x = n_ca(add(x, ca(x, mem), "ca"))
        return n_ff(add(x, ff(x), "ff"))


def _variant(mode="ok", mask_mode="ok"):
    return type("DecoderLayer", (Dec,), {"mode": mode, "mask_mode": mask_mode})


def test_right_code_passes(capsys):
    result = check_decoder_layer(_variant())
    assert result.passed and result.points == result.max_points == 18
    out = capsys.readouterr().out
    assert "[FAIL]" not in out and "11/11 cases passed, 18 of 18 points" in out


def test_the_book_solution_passes():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    ns: dict = {}
    for cell in nb.cells:
        if cell.cell_type == "code" and "check_decoder_layer(" not in cell.source:
            exec(cell.source, ns)
    assert check_decoder_layer(ns["DecoderLayer"], verbose=False).passed


MISTAKES = [
    ("cross_swap", "ok", "queries and keys swapped"),
    ("cross_self", "ok", "attends over x, not over memory"),
    ("memory_mask_in_self", "ok", "memory mask is applied to the self-attention"),
    ("masks_swapped", "ok", "two masks are swapped"),
    ("no_tgt_mask", "ok", "target mask is ignored"),
    ("no_memory_mask", "ok", "memory mask is ignored"),
    ("tgt_to_cross", "ok", "target mask is applied to the cross-attention"),
    ("flip", "ok", "pre-LN and post-LN swapped"),
    ("norm23", "ok", "norm2 and norm3 swapped"),
    ("no_ca_residual", "ok", "cross-attention block's residual is missing"),
    ("pre_raw_query", "ok", "un-normalized x"),
    ("norm_memory", "ok", "memory is normalized"),
    ("final_norm", "ok", "normalizes its output at the end"),
    ("drop_in_eval", "ok", "dropout is active in eval mode"),
    ("no_ca_dropout", "ok", "no dropout on the cross-attention output"),
    ("ok", "ahead", "off by one"),
    ("ok", "strict", "hides the diagonal"),
    ("ok", "upper", "transposed (triu)"),
    ("ok", "inverted", "causal mask polarity inverted"),
    ("ok", "additive", "additive float mask"),
    ("no_head_axis", "ok", "lines up its batch axis with the heads"),
    ("invert", "ok", "mask polarity inverted: True means 'may attend'"),
    ("norm12", "ok", "norm1 and norm2 swapped"),
    ("pre_from_norm", "ok", "residual is taken from norm(x)"),
    ("no_residual", "ok", "residual connections are missing"),
    ("no_sa_residual", "ok", "self-attention block's residual is missing"),
    ("no_ff_residual", "ok", "feed-forward block's residual is missing"),
    ("always_relu", "ok", "activation argument is ignored"),
    ("gelu_tanh", "ok", "tanh approximation"),
    ("no_act", "ok", "no activation between linear1 and linear2"),
    ("no_sa_dropout", "ok", "no dropout on the self-attention output"),
    ("no_ff_dropout", "ok", "no dropout on the feed-forward output"),
    ("no_ff_dropout_at_all", "ok", "no dropout in the feed-forward block at all"),
    ("drop_sum", "ok", "dropout applied to the residual sum"),
]


@pytest.mark.parametrize("mode, mask_mode, phrase", MISTAKES,
                         ids=[f"{a}-{b}" for a, b, _ in MISTAKES])
def test_each_mistake_is_named(mode, mask_mode, phrase):
    result = check_decoder_layer(_variant(mode, mask_mode), verbose=False)
    assert not result.passed and any(phrase in h for h in result.hints), result.hints


def test_every_named_mistake_is_tested():
    """At least eight mistakes, and each one made by real code in `test_each_mistake_is_named`."""
    assert len({m.hint for m in CHECKER.mistakes}) >= 8
    for mistake in CHECKER.mistakes:
        assert any(mistake.hint.startswith(phrase) or phrase in mistake.hint
                   for _, _, phrase in MISTAKES), mistake.hint


def test_a_mismatch_of_lengths_gets_a_note():
    """Swapped queries and keys cannot even run when L_t != L_s; the hint says why."""
    result = check_decoder_layer(_variant("cross_swap"), verbose=False)
    first = result.cases[0]
    assert not first.passed and "L_t = 5" in first.hint and "L_s = 7" in first.hint


# ---------------------------------------------------------------------------------------------
# The causality case


def _causality_spec():
    index = [c.id for c in CHECKER.cases].index("causality")
    return CHECKER.cases[index], CHECKER.specs()[index]


def test_causality_names_a_layer_that_looks_ahead():
    result = check_decoder_layer(_variant("no_tgt_mask"), verbose=False)
    case = next(c for c in result.cases if c.case_id == "causality")
    assert not case.passed and case.hint.startswith("your layer looks ahead")
    assert "target mask is ignored" in case.hint
    result = check_decoder_layer(_variant(mask_mode="ahead"), verbose=False)
    case = next(c for c in result.cases if c.case_id == "causality")
    assert case.hint.startswith("your layer looks ahead") and "off by one" in case.hint


def test_causality_credits_a_causal_layer_that_is_wrong_elsewhere():
    result = check_decoder_layer(_variant("norm23"), verbose=False)
    case = next(c for c in result.cases if c.case_id == "causality")
    assert not case.passed and case.hint.startswith("your layer is causal")


def test_causality_is_judged_from_the_raw_outputs():
    """The trusted side decides from the two raw outputs alone: the same raw result with an
    earlier position moved is found out, whatever the student side might have claimed."""
    _, spec = _causality_spec()
    assert spec.kind == CAUSALITY_KIND
    raw = guarded_exercise(_variant(), spec)
    assert raw["status"] == "ok" and CHECKER.judge(spec, raw) is None
    t = spec.config["changed_from"]
    forged = {**raw, "tensors": dict(raw["tensors"])}
    forged["tensors"]["out:output_changed"] = raw["tensors"]["out:output_changed"].clone()
    forged["tensors"]["out:output_changed"][:, t - 1] += 0.5
    assert CHECKER.judge(spec, forged).startswith(
        f"your layer looks ahead: only the target tokens from position {t} on")


def test_causality_inputs_are_drawn_by_the_grader():
    a = CHECKER.specs(seed=11)
    b = CHECKER.specs(seed=12)
    i = [c.id for c in CHECKER.cases].index("causality")
    assert not torch.equal(a[i].tensors["x"], b[i].tensors["x"])
    x, changed, t = a[i].tensors["x"], a[i].tensors["x_changed"], a[i].config["changed_from"]
    assert torch.equal(x[:, :t], changed[:, :t]) and not torch.equal(x[:, t:], changed[:, t:])


# ---------------------------------------------------------------------------------------------
# Bad code


class _NoMask(Dec):
    causal_mask = None


class _WrongShapes(Dec):
    def __init__(self, d_model, *args, **kwargs):
        super().__init__(d_model, *args, **kwargs)
        self.norm3 = LayerNorm(d_model + 1)


class _Raises(Dec):
    def forward(self, x, memory, tgt_mask=None, memory_mask=None):
        raise RuntimeError("boom")


class _ReturnsTuple(Dec):
    def forward(self, x, memory, tgt_mask=None, memory_mask=None):
        return super().forward(x, memory, tgt_mask, memory_mask), None


class _Exits(Dec):
    def __init__(self, *args, **kwargs):
        raise SystemExit(1)


class _NaN(Dec):
    def forward(self, x, memory, tgt_mask=None, memory_mask=None):
        return torch.full_like(x, float("nan"))


class _InPlace(Dec):
    def forward(self, x, memory, tgt_mask=None, memory_mask=None):
        memory.mul_(2)
        return super().forward(x, memory, tgt_mask, memory_mask)


BAD = {
    "None": lambda *a, **k: None,
    "a string": "DecoderLayer",
    "not callable": 42,
    "NotImplementedError": lambda *a, **k: (_ for _ in ()).throw(NotImplementedError()),
    "no causal_mask": _NoMask,
    "wrong shapes": _WrongShapes,
    "forward raises": _Raises,
    "a tuple": _ReturnsTuple,
    "sys.exit": _Exits,
    "NaN": _NaN,
    "in place": _InPlace,
}


@pytest.mark.parametrize("bad", list(BAD))
def test_bad_code_never_raises(bad, capsys):
    result = check_decoder_layer(BAD[bad])
    assert isinstance(result, CheckResult)
    assert result.passed is False and result.score < 1.0
    lines = capsys.readouterr().out.strip().splitlines()
    assert all(ln.startswith(("[FAIL] ", "[PASS] ", "check_", " " * 7)) for ln in lines)


def test_in_place_and_missing_mask_are_explained():
    hints = " ".join(check_decoder_layer(_InPlace, verbose=False).hints)
    assert "changes its input `memory` in place" in hints
    hints = check_decoder_layer(_NoMask, verbose=False).hints
    assert any("no static method `causal_mask(length)`" in h for h in hints)


# ---------------------------------------------------------------------------------------------
# Grading, in the sandbox and through the command line

WRONG = '''
class DecoderLayer(nn.Module):
''' + inspect.getsource(Dec.__init__) + '''
    @staticmethod
    def causal_mask(length):
        return torch.ones(length, length, dtype=torch.bool).tril()

    def forward(self, x, memory, tgt_mask=None, memory_mask=None):
        def ff(y):
            return self.dropout(self.linear2(self.dropout(self.activation(self.linear1(y)))))

        if self.norm_first:
            x = x + self.dropout(self.self_attn(*(self.norm1(x),) * 3, tgt_mask))
            x = x + self.dropout(self.multihead_attn(self.norm2(x), memory, memory, memory_mask))
            return x + ff(self.norm3(x))
        x = self.norm1(x + self.dropout(self.self_attn(x, x, x, tgt_mask)))
        x = self.norm3(x + self.dropout(self.multihead_attn(x, memory, memory, memory_mask)))
        return self.norm2(x + ff(x))
'''
EVIL_IMPORT = "from utils.transformer import DecoderLayer\n"
EVIL_TORCH = torch_layer("Decoder") + '''
    @staticmethod
    def causal_mask(length):
        return nn.Transformer.generate_square_subsequent_mask(length) == 0
'''
EVIL_WRAPPER = WRONG.split("    def forward")[0].replace(
    "        self.norm_first = norm_first\n",
    "        self.norm_first = norm_first\n"
    "        self.inner = nn.TransformerDecoderLayer(d_model, nhead, dim_feedforward, dropout,\n"
    "                                                activation, batch_first=True,\n"
    "                                                norm_first=norm_first)\n") + '''
    def forward(self, x, memory, tgt_mask=None, memory_mask=None):
        inner = self.inner
        with torch.no_grad():  # the checker's weights, copied into torch's layer
            for ours, theirs in ((self.self_attn, inner.self_attn),
                                 (self.multihead_attn, inner.multihead_attn)):
                theirs.in_proj_weight.copy_(torch.cat([ours.w_q.weight, ours.w_k.weight,
                                                       ours.w_v.weight]))
                theirs.in_proj_bias.copy_(torch.cat([ours.w_q.bias, ours.w_k.bias,
                                                     ours.w_v.bias]))
                theirs.out_proj.weight.copy_(ours.w_o.weight)
                theirs.out_proj.bias.copy_(ours.w_o.bias)
            for name in ("linear1", "linear2", "norm1", "norm2", "norm3"):
                getattr(inner, name).weight.copy_(getattr(self, name).weight)
                getattr(inner, name).bias.copy_(getattr(self, name).bias)
        pad = None if memory_mask is None else ~memory_mask[:, 0, 0]
        causal = None if tgt_mask is None or tgt_mask.dim() != 2 else ~tgt_mask
        return inner(x, memory, tgt_mask=causal, memory_key_padding_mask=pad)
'''
STUDENTS = {"ok_a7_book": None, "bad_a7_norms": WRONG, "evil_a7_import": EVIL_IMPORT,
            "evil_a7_torch_layer": EVIL_TORCH, "evil_a7_wrapper": EVIL_WRAPPER}


def _solution_index(nb) -> int:
    return next(i for i, c in enumerate(nb.cells)
                if c.cell_type == "code" and "class DecoderLayer" in c.source)


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """The four submissions in nbgrader's layout, graded by scripts/grade_assignments.py."""
    base = tmp_path_factory.mktemp("a7_grading")
    index = _solution_index(nbformat.read(NOTEBOOK, as_version=4))
    for student, source in STUDENTS.items():
        write_submission(NOTEBOOK, base / "submitted", student,
                         {} if source is None else {index: source}, solution_cells=False)
    out = base / "out"
    grade(base / "submitted", out, "--case-timeout", "3", "--cells-timeout", "30")
    with open(out / "grades.csv", newline="") as f:
        rows = {r["student"]: r for r in csv.DictReader(f)}
    feedback = {s: (out / "feedback" / s / "a7_decoder_layer.md").read_text() for s in STUDENTS}
    return rows, feedback


def test_grading_the_right_submission(graded):
    rows, feedback = graded
    row = rows["ok_a7_book"]
    assert float(row["score"]) == float(row["max_score"]) == 18, feedback["ok_a7_book"]
    assert row["flags"] == "" and "FAIL" not in feedback["ok_a7_book"]
    assert "decoder_layer.causality" in row


def test_grading_a_wrong_submission(graded):
    rows, feedback = graded
    row = rows["bad_a7_norms"]
    assert 0 < float(row["score"]) < float(row["max_score"]) and row["flags"] == ""
    assert "norm2 and norm3 swapped" in feedback["bad_a7_norms"]
    assert float(row["decoder_layer.causal_mask"]) == 1  # the mask itself is right


def test_grading_hostile_submissions(graded):
    rows, feedback = graded
    row = rows["evil_a7_import"]
    assert float(row["score"]) == 0 and "reference used" in row["flags"]
    assert "imports utils.transformer" in feedback["evil_a7_import"]
    row = rows["evil_a7_torch_layer"]
    assert float(row["score"]) == 0 and "reference used" in row["flags"]
    assert "nn.TransformerDecoderLayer" in feedback["evil_a7_torch_layer"]
    # torch's layer held inside and called with the checker's weights: seen while it runs.
    # The monitor reports each call site once per process, in the first case that reaches it;
    # the grader voids every case of that checker, since the same code ran in all of them.
    row = rows["evil_a7_wrapper"]
    assert float(row["score"]) == 0 and "reference used" in row["flags"]
    assert float(row["decoder_layer.post_ln"]) == 0
    assert "nn.TransformerDecoderLayer" in feedback["evil_a7_wrapper"]


def test_the_static_scan_and_the_registry():
    assert "a7_decoder_layer" in ASSIGNMENTS
    rules = ASSIGNMENTS["a7_decoder_layer"].rules
    assert static_scan(["from utils.transformer import DecoderLayer"], rules)
    assert static_scan(["from utils.masks import causal_mask"], rules)
    assert not static_scan(["from utils.attention import MultiHeadAttention\n"
                            "from utils.layers import LayerNorm"], rules)
