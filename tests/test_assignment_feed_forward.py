"""Assignment 5 (feed-forward variants): the SwiGLU and top-k mixture-of-experts checkers.

The references agree with the book's own layers, right code passes (written in several ways),
every named mistake is named, bad code never makes a checker raise, and the grader scores a
correct, a wrong and two hostile submissions as they deserve.
"""

from __future__ import annotations

import csv
import inspect

import nbformat
import pytest
import torch
import torch.nn.functional as F
from assignment_grading import grade, write_submission
from notebooks import ROOT
from torch import nn

from grader.scan import static_scan
from utils.checks import CheckResult, check_swiglu_feed_forward, check_top_k_moe
from utils.checks.a5_feed_forward import (
    ASSIGNMENT,
    FFN_CHECKER,
    MARGIN,
    MOE_CHECKER,
    swiglu_ffn,
    top_k_moe,
)
from utils.layers import MixtureOfExperts, PositionwiseFeedForward

# ---------------------------------------------------------------------------------------------
# Right implementations, written in several ways


class SwiGLU(nn.Module):
    def __init__(self, d_model, d_ff, bias=False):
        super().__init__()
        self.w_gate = nn.Linear(d_model, d_ff, bias=bias)
        self.w_up = nn.Linear(d_model, d_ff, bias=bias)
        self.w_down = nn.Linear(d_ff, d_model, bias=bias)

    def forward(self, x):
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class SwiGLUByHand(SwiGLU):
    """SiLU written out, the weights used as matrices, in float64."""

    def forward(self, x):
        def lin(m, y):
            out = y.double() @ m.weight.double().T
            return out if m.bias is None else out + m.bias.double()

        g = lin(self.w_gate, x)
        return lin(self.w_down, g * torch.sigmoid(g) * lin(self.w_up, x)).to(x.dtype)


class MoE(nn.Module):
    """The loop over experts with index_add (the notebook's solution)."""

    ffn = SwiGLU

    def __init__(self, d_model, d_ff, num_experts, k):
        super().__init__()
        self.num_experts, self.k = num_experts, k
        self.router = nn.Linear(d_model, num_experts, bias=False)
        self.experts = nn.ModuleList(self.ffn(d_model, d_ff) for _ in range(num_experts))
        self.last_routing = None

    def forward(self, x):
        tokens = x.reshape(-1, x.shape[-1])
        probs = torch.softmax(self.router(tokens), dim=-1)
        top_p, top_i = probs.topk(self.k, dim=-1)
        gates = top_p / top_p.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(tokens)
        for e, expert in enumerate(self.experts):
            token, slot = (top_i == e).nonzero(as_tuple=True)
            if token.numel():
                out = self.combine(out, token, gates[token, slot, None] * expert(tokens[token]))
        f = torch.bincount(top_i.flatten(), minlength=self.num_experts).float() / top_i.numel()
        aux = self.num_experts * (f * probs.mean(dim=0)).sum()
        self.last_routing = top_i.reshape(*x.shape[:-1], self.k)
        return out.reshape(x.shape), aux

    def combine(self, out, token, weighted):
        """Add each token's weighted expert output to what it has."""
        return out.index_add(0, token, weighted)


class MoESoftmaxAfterTopK(MoE):
    """Mixtral's order: top-k of the logits, then a softmax over those k; a dense gate matrix,
    every expert run on every token, and f from one-hot masks."""

    def forward(self, x):
        logits = self.router(x)                                        # (..., E)
        top_l, top_i = logits.topk(self.k, dim=-1)
        gates = torch.zeros_like(logits).scatter(-1, top_i, torch.softmax(top_l, dim=-1))
        out = sum(gates[..., e:e + 1] * expert(x) for e, expert in enumerate(self.experts))
        probs = torch.softmax(logits, dim=-1).reshape(-1, self.num_experts)
        mask = F.one_hot(top_i, self.num_experts).reshape(-1, self.k, self.num_experts)
        f = mask.float().sum(dim=(0, 1)) / (mask.shape[0] * self.k)
        aux = self.num_experts * torch.dot(f, probs.mean(0))
        self.last_routing = top_i
        return out, aux


class MoEByHand(MoE):
    """Experts on SwiGLUByHand, and the routing weights found token by token."""

    ffn = SwiGLUByHand


# ---------------------------------------------------------------------------------------------
# The references against the book's layers


def test_swiglu_reference_matches_the_book_layer():
    torch.manual_seed(0)
    for bias in (False, True):
        layer = PositionwiseFeedForward(8, 12, activation="swiglu", bias=bias)
        p = {"w_gate.weight": layer.gate.weight, "w_up.weight": layer.linear1.weight,
             "w_down.weight": layer.linear2.weight}
        if bias:
            p.update({"w_gate.bias": layer.gate.bias, "w_up.bias": layer.linear1.bias,
                      "w_down.bias": layer.linear2.bias})
        x = torch.randn(2, 5, 8)
        assert torch.allclose(swiglu_ffn(p, x), layer(x), atol=1e-6)


def test_top1_reference_without_renormalization_is_the_book_switch_layer():
    """With weights="raw" and k = 1 the reference is chapter 6's MixtureOfExperts (p * expert)."""
    torch.manual_seed(1)
    moe = MixtureOfExperts(8, 12, num_experts=4, activation="swiglu")
    p = {"router.weight": moe.router.weight}
    for e, ex in enumerate(moe.experts):
        p.update({f"experts.{e}.w_gate.weight": ex.gate.weight,
                  f"experts.{e}.w_gate.bias": ex.gate.bias,
                  f"experts.{e}.w_up.weight": ex.linear1.weight,
                  f"experts.{e}.w_up.bias": ex.linear1.bias,
                  f"experts.{e}.w_down.weight": ex.linear2.weight,
                  f"experts.{e}.w_down.bias": ex.linear2.bias})
    x = torch.randn(3, 7, 8)
    out, aux, routing = top_k_moe(p, x, 4, 1, weights="raw")
    assert torch.allclose(out, moe(x), atol=1e-6)
    assert torch.equal(routing[..., 0].long(), moe.last_assignment)
    f = moe.last_counts.float() / 21
    probs = torch.softmax(moe.router(x.reshape(-1, 8)), -1).mean(0)
    assert torch.allclose(aux, 4 * (f * probs).sum(), atol=1e-6)


def test_uniform_routing_gives_an_aux_loss_of_one():
    """Equal router probabilities and equal counts: f_i = P_i = 1/E, so the loss is exactly 1."""
    e, d = 4, 4
    p = {"router.weight": torch.eye(d, dtype=torch.float64)}
    for i in range(e):
        for n in ("w_gate", "w_up", "w_down"):
            p[f"experts.{i}.{n}.weight"] = torch.ones(d, d, dtype=torch.float64)
    x = torch.eye(d, dtype=torch.float64) * 3 + torch.roll(torch.eye(d, dtype=torch.float64), 1,
                                                              0)
    for k in (1, 2):
        _, aux, routing = top_k_moe(p, x, e, k)
        assert torch.bincount(routing.long().flatten(), minlength=e).tolist() == [k] * e
        assert abs(float(aux) - 1.0) < 1e-12


def test_cases_have_no_ties():
    for spec in MOE_CHECKER.specs() + MOE_CHECKER.specs(seed=7):
        k = spec.ctor_args[3]
        x = spec.tensors["x"].reshape(-1, spec.tensors["x"].shape[-1]).double()
        top = (x @ spec.tensors["router.weight"].double().T).topk(k + 1, -1).values
        assert float((top[:, :-1] - top[:, 1:]).min()) >= MARGIN


# ---------------------------------------------------------------------------------------------
# Right code passes


@pytest.mark.parametrize("cls", [SwiGLU, SwiGLUByHand])
def test_right_swiglu_passes(cls):
    result = check_swiglu_feed_forward(cls, verbose=False)
    assert result.passed and result.points == result.max_points == 5, result.hints


@pytest.mark.parametrize("cls", [MoE, MoESoftmaxAfterTopK, MoEByHand])
def test_right_moe_passes(cls):
    result = check_top_k_moe(cls, verbose=False)
    assert result.passed and result.points == result.max_points == 9, result.hints


def test_fresh_inputs_pass_too():
    """The grader draws fresh inputs (a seed) for every run: the right code passes on them."""
    from utils.checks.core import exercise
    for checker, cls in ((FFN_CHECKER, SwiGLU), (MOE_CHECKER, MoE)):
        for seed in (3, 11, 2024):
            for spec in checker.specs(seed=seed):
                assert checker.judge(spec, exercise(cls, spec)) is None


def test_the_assignment_rules():
    assert ASSIGNMENT.name == "a5_feed_forward"
    assert [c.name for c in ASSIGNMENT.checkers] == ["check_swiglu_feed_forward",
                                                      "check_top_k_moe"]
    ids = {r.id for r in ASSIGNMENT.rules}
    assert static_scan(["from utils.layers import PositionwiseFeedForward"], ASSIGNMENT.rules)
    assert static_scan(["import utils.transformer"], ASSIGNMENT.rules)
    hit = static_scan(["from utils.checks.a5_feed_forward import top_k_moe"], ASSIGNMENT.rules)
    assert hit and set(hit) <= ids
    assert static_scan(["import torch\nfrom torch import nn"], ASSIGNMENT.rules) == []


# ---------------------------------------------------------------------------------------------
# Every named mistake is named: planted implementations that compute the reference with one
# mistake's options (in float32, on the module's own parameters)


def _planted_ffn(options):
    class Planted(SwiGLU):
        def forward(self, x):
            return swiglu_ffn(dict(self.named_parameters()), x, **options)
    return Planted


def _planted_moe(options):
    class Planted(MoE):
        def forward(self, x):
            out, aux, routing = top_k_moe(dict(self.named_parameters()), x, self.num_experts,
                                          self.k, **options)
            self.last_routing = routing.long()
            return out, aux
    return Planted


@pytest.mark.parametrize("mistake", FFN_CHECKER.mistakes, ids=lambda m: str(m.options))
def test_every_swiglu_mistake_is_named(mistake):
    result = check_swiglu_feed_forward(_planted_ffn(mistake.options), verbose=False)
    assert not result.passed and mistake.hint in result.hints, result.hints


@pytest.mark.parametrize("mistake", MOE_CHECKER.mistakes, ids=lambda m: str(m.options))
def test_every_moe_mistake_is_named(mistake):
    result = check_top_k_moe(_planted_moe(mistake.options), verbose=False)
    assert not result.passed and any(mistake.hint in h for h in result.hints), result.hints


def test_the_planted_reference_itself_passes():
    assert check_swiglu_feed_forward(_planted_ffn({}), verbose=False).passed
    assert check_top_k_moe(_planted_moe({}), verbose=False).passed


def test_both_checkers_name_at_least_eight_mistakes():
    for checker in (FFN_CHECKER, MOE_CHECKER):
        assert len({m.hint for m in checker.mistakes}) >= 8


# Mistakes as a student writes them, by hand


class SwiGLUSwapped(SwiGLU):
    def forward(self, x):
        return self.w_down(self.w_gate(x) * F.silu(self.w_up(x)))


class SwiGLUGelu(SwiGLU):
    def forward(self, x):
        return self.w_down(F.gelu(self.w_gate(x)) * self.w_up(x))


class SwiGLUWithBias(SwiGLU):
    def __init__(self, d_model, d_ff, bias=False):
        super().__init__(d_model, d_ff, bias=True)


class SwiGLUNoBias(SwiGLU):
    def __init__(self, d_model, d_ff, bias=False):
        super().__init__(d_model, d_ff, bias=False)


class MoEOverwrite(MoE):
    def combine(self, out, token, weighted):
        out[token] = weighted  # a token's second expert overwrites its first
        return out


class MoEHuggingFaceAux(MoE):
    """f divided by N, as the Hugging Face Mixtral code does."""

    def forward(self, x):
        out, aux = super().forward(x)
        return out, aux * self.k


class MoEAuxDetached(MoE):
    def forward(self, x):
        out, aux = super().forward(x)
        return out, aux.detach()


class MoERoutingUnsorted(MoE):
    def forward(self, x):
        out, aux = super().forward(x)
        self.last_routing = self.last_routing.flip(-1)
        return out, aux


class MoERoutingAsList(MoE):
    def forward(self, x):
        out, aux = super().forward(x)
        self.last_routing = self.last_routing.tolist()
        return out, aux


class MoERoutingFloat(MoE):
    def forward(self, x):
        out, aux = super().forward(x)
        self.last_routing = self.last_routing.float()
        return out, aux


class MoEOutputOnly(MoE):
    def forward(self, x):
        return super().forward(x)[0]


class MoEFloatAux(MoE):
    def forward(self, x):
        out, aux = super().forward(x)
        return out, aux.detach().item()


class MoERouterBias(MoE):
    def __init__(self, d_model, d_ff, num_experts, k):
        super().__init__(d_model, d_ff, num_experts, k)
        self.router = nn.Linear(d_model, num_experts)


class MoENamedGate(MoE):
    def __init__(self, d_model, d_ff, num_experts, k):
        super().__init__(d_model, d_ff, num_experts, k)
        self.gate = self.router
        del self.router

    def forward(self, x):
        self.router = self.gate
        return super().forward(x)


@pytest.mark.parametrize("cls, phrase", [
    (SwiGLUSwapped, "w_gate and w_up swapped"),
    (SwiGLUGelu, "GELU instead of SiLU"),
    (SwiGLUWithBias, "parameters the assignment does not ask for: `w_gate.bias`"),
    (SwiGLUNoBias, "your module has no tensor `w_gate.bias`"),
])
def test_handwritten_swiglu_mistakes(cls, phrase):
    result = check_swiglu_feed_forward(cls, verbose=False)
    assert not result.passed and any(phrase in h for h in result.hints), result.hints


class MoEExpertsInAList(MoE):
    def __init__(self, d_model, d_ff, num_experts, k):
        super().__init__(d_model, d_ff, num_experts, k)
        experts = list(self.experts)
        del self.experts
        self.experts = experts


class MoEWrongExperts(MoE):
    ffn = SwiGLUSwapped


@pytest.mark.parametrize("cls, phrase", [
    (MoEExpertsInAList, "`experts` is a Python list: make it an nn.ModuleList"),
    (MoEWrongExperts, "at your SwiGLUFeedForward"),
    (MoEOverwrite, "overwrite each other"),
    (MoEHuggingFaceAux, "f_i is divided by N"),
    (MoEAuxDetached, "detached from the router"),
    (MoERoutingUnsorted, "holds the right experts but not in order"),
    (MoERoutingAsList, "`self.last_routing` must hold the chosen experts as a tensor"),
    (MoERoutingFloat, "must hold expert indices as integers"),
    (MoEOutputOnly, "expected a tuple (output, aux_loss)"),
    (MoEFloatAux, "the aux_loss is float, expected a torch.Tensor"),
    (MoERouterBias, "parameters the assignment does not ask for: `router.bias`"),
    (MoENamedGate, "your module has no attribute `router`"),
])
def test_handwritten_moe_mistakes(cls, phrase):
    result = check_top_k_moe(cls, verbose=False)
    assert not result.passed and any(phrase in h for h in result.hints), result.hints


def test_a_detached_aux_loss_fails_every_case():
    """With k = 1 the router's gradient comes from the loss alone (the output's weight is
    p / p = 1), so a detached loss fails that case too, and the hint names the weight a
    parameter."""
    result = check_top_k_moe(MoEAuxDetached, verbose=False)
    assert result.points == 0
    assert all("detached from the router" in c.hint for c in result.cases), result.hints


# ---------------------------------------------------------------------------------------------
# Bad code never raises


def _raise(exc):
    def f(*a, **k):
        raise exc
    return f


class Hangs(SwiGLU):
    def forward(self, x):
        while True:
            pass


BAD = {
    "None": lambda *a, **k: None,
    "a string": lambda *a, **k: "feed-forward",
    "NotImplementedError": _raise(NotImplementedError()),
    "sys.exit": _raise(SystemExit(1)),
    "KeyboardInterrupt": _raise(KeyboardInterrupt()),
    "not callable": 42,
    "a function": lambda x: x,
    "init raises": type("B", (nn.Module,), {"__init__": _raise(ValueError("no"))}),
    "forward raises": type("B", (SwiGLU,), {"forward": _raise(RuntimeError("boom"))}),
    "forward returns None": type("B", (MoE,), {"forward": lambda self, x: None}),
    "NaN": type("B", (MoE,), {"forward": lambda self, x: (x * float("nan"),) * 2}),
    "complex": type("B", (SwiGLU,), {"forward": lambda self, x: x.to(torch.complex64)}),
    "wrong shape": type("B", (SwiGLU,), {"forward": lambda self, x: x[..., :1]}),
    "module without weights": type("B", (nn.Module,), {"__init__": lambda self, *a, **k:
                                                       nn.Module.__init__(self)}),
}


@pytest.mark.parametrize("bad", list(BAD))
def test_bad_code_never_raises(bad, capsys):
    for check in (check_swiglu_feed_forward, check_top_k_moe):
        result = check(BAD[bad])
        assert isinstance(result, CheckResult)
        assert result.passed is False and result.score == 0.0
        assert all(c.hint for c in result.cases)
    lines = capsys.readouterr().out.strip().splitlines()
    assert all(ln.startswith(("[FAIL] ", "check_", " " * 7)) for ln in lines)


def test_a_module_that_hangs_fails_in_a_notebook_too():
    from utils.checks.checker import run_in_process
    result = run_in_process(FFN_CHECKER, Hangs, verbose=False, timeout=0.2)
    assert result.score == 0 and all("did not finish" in h for h in result.hints)


# ---------------------------------------------------------------------------------------------
# Grading through the sandbox: a correct, a wrong and two hostile submissions in one run

SOLUTION_CELLS = (3, 7)

# The notebook's TopKMoE (the test's MoE) whose experts' outputs overwrite each other.
MOE_OVERWRITE_CELL = ("\nclass TopKMoE(nn.Module):\n    ffn = SwiGLUFeedForward\n\n"
                      + inspect.getsource(MoE.__init__) + "\n" + inspect.getsource(MoE.forward)
                      + "\n" + inspect.getsource(MoEOverwrite.combine))

FFN_FROM_BOOK_CELL = '''
from utils.layers import PositionwiseFeedForward


class SwiGLUFeedForward(nn.Module):
    def __init__(self, d_model, d_ff, bias=False):
        super().__init__()
        inner = PositionwiseFeedForward(d_model, d_ff, activation="swiglu", bias=bias)
        self.w_gate, self.w_up, self.w_down = inner.gate, inner.linear1, inner.linear2
        self.inner = [inner]

    def forward(self, x):
        return self.inner[0](x)
'''

FFN_CHECKER_REFERENCE_CELL = '''
import importlib

_ref = importlib.import_module("utils.checks." + "a5_feed_forward")


class SwiGLUFeedForward(nn.Module):
''' + inspect.getsource(SwiGLU.__init__) + '''
    def forward(self, x):
        return _ref.swiglu_ffn(dict(self.named_parameters()), x)
'''

# student: ({solution cell index: source}, expectation)
SUBMISSIONS = {
    "ok_a5_book": ({}, "full"),
    "bad_a5_overwrite": ({7: MOE_OVERWRITE_CELL}, "overwrite each other"),
    "evil_a5_utils_layers": ({3: FFN_FROM_BOOK_CELL}, "imports utils.layers"),
    # The checkers' files are out of the sandbox's reach: reading one is flagged.
    "evil_a5_checker_reference": ({3: FFN_CHECKER_REFERENCE_CELL},
                                  "tried to read the book's sources or reference code"),
}


def _write(folder):
    for student, (cells, _) in SUBMISSIONS.items():
        write_submission(ROOT / "book" / "assignments" / "a5_feed_forward.ipynb", folder, student,
                         cells)


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    base = tmp_path_factory.mktemp("a5_grading")
    _write(base / "submitted")
    grade(base / "submitted", base / "out", "--case-timeout", "5", "--cells-timeout", "30")
    with open(base / "out" / "grades.csv", newline="") as f:
        rows = {r["student"]: r for r in csv.DictReader(f)}
    return rows, base / "out"


def test_the_solution_cells_are_where_the_submissions_put_code():
    nb = nbformat.read(ROOT / "book" / "assignments" / "a5_feed_forward.ipynb", as_version=4)
    assert [i for i, c in enumerate(nb.cells)
            if c.cell_type == "code" and "### BEGIN SOLUTION" in c.source] == list(
        SOLUTION_CELLS)


@pytest.mark.parametrize("student", list(SUBMISSIONS))
def test_each_a5_submission_gets_what_it_deserves(graded, student):
    rows, out = graded
    row = rows[student]
    expect = SUBMISSIONS[student][1]
    feedback = (out / "feedback" / student / "a5_feed_forward.md").read_text()
    assert row["assignment"] == "a5_feed_forward"
    score, top = float(row["score"]), float(row["max_score"])
    assert top == 14
    if expect == "full":
        assert score == top and "FAIL" not in feedback, feedback
        assert row["flags"] == ""
    else:
        assert score < top and expect in feedback, feedback
    cases = [k for k in row if "." in k and row[k] != ""]
    assert sum(float(row[k]) for k in cases) == score


def test_the_wrong_submission_keeps_its_right_parts(graded):
    row = graded[0]["bad_a5_overwrite"]
    assert float(row["swiglu_feed_forward.small"]) == 2  # part 1 is right
    assert float(row["top_k_moe.top1"]) == 2           # with k = 1 nothing is overwritten
    assert float(row["top_k_moe.top2"]) == 0
    assert row["flags"] == ""


def test_the_hostile_submissions_are_flagged(graded):
    rows = graded[0]
    for student in ("evil_a5_utils_layers", "evil_a5_checker_reference"):
        assert "reference used" in rows[student]["flags"], rows[student]
        assert float(rows[student]["swiglu_feed_forward.small"]) == 0
