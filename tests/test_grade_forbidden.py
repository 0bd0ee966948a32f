"""Forbidden is forbidden: a forbidden torch operator is poisoned with its whole family (every
overload, every namespace, the variants that share its name's stem and the backward kernels),
Python helpers that only the family's decompositions use, and flex attention's higher-order
operator; a8's model cases require a model that reads its inputs.

Unit tests of the family rule, then hand-written notebooks that reach the forbidden computation
by another overload, another family member, another namespace, a backward kernel, a Python
helper or a higher-order operator, graded through the sandboxed grader in one run: each loses
exactly what a call of the forbidden operator itself loses, with the same flag."""

from __future__ import annotations

import csv

import pytest
import torch
from assignment_grading import grade, write_submission
from notebooks import ROOT

from grader.poison import family_words, operator_family
from grader.policy import child_policy
from utils.checks import ASSIGNMENTS
from utils.checks.a8_judges import judge_model
from utils.checks.a8_train import CHECKER as A8_CHECKER
from utils.checks.training_task import VOCAB

NOTEBOOKS = ROOT / "book" / "assignments"
A1 = NOTEBOOKS / "a1_attention.ipynb"
A4 = NOTEBOOKS / "a4_positional_encoding_layer_norm.ipynb"
A8 = NOTEBOOKS / "a8_train.ipynb"


def _policy_ops(name: str) -> set[str]:
    return {op for op, _ in child_policy(ASSIGNMENTS[name].rules)["poison_ops"]}


# ---------------------------------------------------------------------------------------------
# The family rule


def test_the_stem_of_a_name():
    assert family_words("aten::layer_norm") == ("layer", "norm")
    assert family_words("native_layer_norm") == ("layer", "norm")
    assert family_words("aten::_native_multi_head_attention.out") == ("multi", "head",
                                                                     "attention")
    assert family_words("_flash_attention_forward") == ("flash", "attention")
    assert family_words("_transformer_encoder_layer_fwd") == ("transformer", "encoder", "layer")
    assert family_words("quantized::batch_norm2d") == ("batch", "norm")


def test_a_family_holds_every_overload_namespace_variant_and_backward():
    names = ["aten::scaled_dot_product_attention", "aten::_scaled_dot_product_flash_attention",
             "aten::_scaled_dot_product_flash_attention.quantized",
             "aten::_scaled_dot_product_flash_attention_for_cpu_backward", "aten::softmax.int",
             "aten::_fused_sdp_choice", "aten::native_layer_norm.out", "quantized::layer_norm",
             "aten::native_layer_norm_backward", "aten::layer_norm", "aten::var_mean",
             "aten::_transformer_encoder_layer_fwd", "aten::native_group_norm"]
    got = operator_family(["scaled_dot_product_attention", "layer_norm"], names)
    assert got == ["aten::scaled_dot_product_attention",
                   "aten::_scaled_dot_product_flash_attention",
                   "aten::_scaled_dot_product_flash_attention.quantized",
                   "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
                   "aten::native_layer_norm.out", "quantized::layer_norm",
                   "aten::native_layer_norm_backward", "aten::layer_norm"]


def test_the_families_of_a1_and_a4_from_this_torch():
    a1 = _policy_ops("a1_attention")
    for op in ("aten::scaled_dot_product_attention", "aten::_scaled_dot_product_attention_math",
               "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
               "aten::_scaled_dot_product_flash_attention.quantized",
               "aten::_scaled_dot_product_efficient_attention_backward",
               "aten::_scaled_dot_product_cudnn_attention",
               "aten::_scaled_dot_product_fused_attention_overrideable",
               "aten::_flash_attention_forward", "aten::_flash_attention_backward",
               "aten::_efficient_attention_forward", "aten::_cudnn_attention_backward",
               "aten::_triton_scaled_dot_attention", "aten::_native_multi_head_attention.out",
               "aten::_triton_multi_head_attention", "aten::_transformer_encoder_layer_fwd.out"):
        assert op in a1, op
    a4 = _policy_ops("a4_positional_encoding_layer_norm")
    for op in ("aten::layer_norm", "aten::native_layer_norm.out",
               "aten::native_layer_norm_backward", "quantized::layer_norm",
               "aten::_native_batch_norm_legit.no_stats", "aten::_batch_norm_with_update",
               "aten::native_batch_norm.out", "aten::batch_norm_stats", "aten::rms_norm",
               "aten::_fused_rms_norm_backward", "aten::native_group_norm_backward",
               "quantized::group_norm", "quantized::instance_norm"):
        assert op in a4, op
    # What an honest solution calls stays out of every family.
    honest = {"aten::softmax.int", "aten::_softmax", "aten::_safe_softmax", "aten::matmul",
              "aten::bmm", "aten::masked_fill.Scalar", "aten::mean.dim", "aten::var.correction",
              "aten::var_mean.correction", "aten::sqrt", "aten::rsqrt", "aten::sub.Tensor",
              "aten::_fused_sdp_choice", "aten::linear", "aten::dropout", "aten::embedding"}
    for name in ASSIGNMENTS:
        assert not honest & _policy_ops(name), name


def test_an_operator_this_torch_lacks_is_skipped():
    assert operator_family(["no_such_operator_anywhere"]) == []


# ---------------------------------------------------------------------------------------------
# a8: a model that ignores its inputs earns no model point


class _Blind(torch.nn.Module):
    def forward(self, src, tgt, src_mask=None, tgt_mask=None):
        return torch.zeros(tgt.shape[0], tgt.shape[1], VOCAB)


def _model_spec(aspect: str):
    case = next(c for c in A8_CHECKER.cases if c.id == f"model_{aspect}")
    return case.make(torch.Generator().manual_seed(0))


@pytest.mark.parametrize("aspect", ["shape", "causal", "padding"])
def test_a8_judges_a_blind_model_on_every_model_case(aspect):
    spec = _model_spec(aspect)
    b, length = spec.tensors["tgt"].shape
    blind = torch.zeros(b, length, VOCAB)
    hint = judge_model(spec, {"out:base": blind, "out:later": blind.clone(),
                              "out:padded": blind.clone(), "out:source": blind.clone()})
    assert hint is not None and "ignores its inputs" in hint
    seeing = blind.clone()
    seeing[:, -1] += 1.0  # the last position reads its own decoder token
    # ... but not the source: every logit the same whatever the source says
    hint = judge_model(spec, {"out:base": blind, "out:later": seeing,
                              "out:padded": blind.clone(), "out:source": blind.clone()})
    assert hint is not None and "ignores its source" in hint
    hearing = blind.clone()
    hearing[0, 0] += 1.0  # a logit that moves with the source
    assert judge_model(spec, {"out:base": blind, "out:later": seeing,
                              "out:padded": blind.clone(), "out:source": hearing}) is None


# ---------------------------------------------------------------------------------------------
# Notebooks graded through the sandbox

A1_FLEX_HOP = '''
def scaled_dot_product_attention(q, k, v, mask=None):
    # The output from flex attention's higher-order operator, called directly.
    from torch.nn.attention.flex_attention import _create_empty_block_mask

    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    lead = q.shape[:-2]
    n = int(torch.tensor(lead).prod()) if lead else 1
    q4 = q.reshape(n, 1, *q.shape[-2:])
    k4 = k.reshape(n, 1, *k.shape[-2:])
    v4 = v.reshape(n, 1, *v.shape[-2:])
    full = torch.ones(scores.shape, dtype=torch.bool) if mask is None else mask
    allowed = full.expand(scores.shape).reshape(n, 1, *scores.shape[-2:])

    def score_mod(s, b, h, i, j):
        return torch.where(allowed[b, h, i, j], s, -float("inf"))

    block = _create_empty_block_mask(q4, k4).as_tuple()
    out = torch.ops.higher_order.flex_attention(
        q4, k4, v4, score_mod, block, 1 / math.sqrt(q.shape[-1]), {})[0]
    return out.reshape(*lead, q.shape[-2], v.shape[-1]), weights
'''

LN_INIT = '''
class LayerNorm(nn.Module):
    def __init__(self, d_model, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model))
        self.bias = nn.Parameter(torch.zeros(d_model))

    def forward(self, x):
'''
LN_HEAD = LN_INIT + '''        shape = x.shape
        rows = x.reshape(1, -1, shape[-1])  # batch norm's channels: the rows
'''
# Another overload of an operator the rules list (_native_batch_norm_legit).
A4_OVERLOAD = LN_HEAD + '''
        y = torch.ops.aten._native_batch_norm_legit.no_stats(
            rows, None, None, True, 0.0, self.eps)[0]
        return y.reshape(shape) * self.weight + self.bias
'''
# A member of the batch-norm family that no rule names.
A4_FAMILY = LN_HEAD + '''
        n = rows.shape[1]
        y = torch.ops.aten._batch_norm_with_update(
            rows, rows.new_ones(n), rows.new_zeros(n), rows.new_zeros(n), rows.new_ones(n), 0.0,
            self.eps)[0]
        return y.reshape(shape) * self.weight + self.bias
'''
# An overload with a kernel of its own (native_batch_norm.out) for the forward, the forbidden
# operator's backward kernel for the gradients.
A4_BACKWARD = '''
class _Norm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, eps):
        rows = x.detach().reshape(1, -1, x.shape[-1])
        out = torch.empty_like(rows)
        mean, invstd = rows.new_empty(rows.shape[1]), rows.new_empty(rows.shape[1])
        torch.ops.aten.native_batch_norm.out(rows, None, None, None, None, True, 0.0, eps,
                                             out=out, save_mean=mean, save_invstd=invstd)
        ctx.save_for_backward(x, mean.reshape(*x.shape[:-1], 1),
                              invstd.reshape(*x.shape[:-1], 1))
        return out.reshape(x.shape)

    @staticmethod
    def backward(ctx, grad):
        x, mean, rstd = ctx.saved_tensors
        gx = torch.ops.aten.native_layer_norm_backward(
            grad, x, [x.shape[-1]], mean, rstd, None, None, [True, False, False])[0]
        return gx, None

''' + LN_INIT + '''        return _Norm.apply(x, self.eps) * self.weight + self.bias
'''
# A Python helper that only the forbidden operator's reference uses.
A4_HELPER = LN_INIT + '''        import torch._refs as refs

        return refs._normalize(x, [x.dim() - 1], self.eps)[0] * self.weight + self.bias
'''
# A public helper that only the forbidden operators' decompositions use.
A4_PUBLIC_HELPER = LN_INIT + '''        from torch._decomp import decompositions

        s = x.shape
        y = decompositions.native_batch_norm_helper(x.reshape(1, -1, s[-1]), None, None, None,
                                                    None, True, 0.0, self.eps, False)[0]
        return y.reshape(s) * self.weight + self.bias
'''
A8_BLIND = '''
class Seq2Seq(nn.Module):
    """Logits that read nothing of src, tgt or the masks."""

    def __init__(self, vocab_size, d_model=32, nhead=4, dim_feedforward=128, max_len=32):
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(vocab_size))

    def forward(self, src, tgt, src_mask=None, tgt_mask=None):
        return self.bias.expand(tgt.shape[0], tgt.shape[1], -1)


def build_model(vocab_size):
    return Seq2Seq(vocab_size)
'''

A8_DEAF = '''
class Seq2Seq(nn.Module):
    """A causal decoder of its own tokens that never reads src: a language model of the target."""

    def __init__(self, vocab_size, d_model=32, nhead=4, dim_feedforward=128, max_len=32):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, d_model)
        self.out = nn.Linear(d_model, vocab_size)

    def forward(self, src, tgt, src_mask=None, tgt_mask=None):
        return self.out(self.embed(tgt))


def build_model(vocab_size):
    return Seq2Seq(vocab_size)
'''

LN_CASES = ("layer_norm.batch", "layer_norm.offset", "layer_norm.eps", "layer_norm.vector")
A4_VOID = {c: 0 for c in LN_CASES}
# student: (notebook, cells, score, flags, exact points of some cases)
SUBMISSIONS = {
    "ok_a1": (A1, {}, 10, "", {}),
    "ok_a4": (A4, {}, 8, "", {}),
    "hop_a1_flex_attention": (A1, {3: A1_FLEX_HOP}, 0, "reference used", {}),
    "overload_a4_batch_norm_no_stats": (A4, {6: A4_OVERLOAD}, 4, "reference used", A4_VOID),
    "family_a4_batch_norm_with_update": (A4, {6: A4_FAMILY}, 4, "reference used", A4_VOID),
    "backward_a4_layer_norm_backward": (A4, {6: A4_BACKWARD}, 4, "reference used",
                                        A4_VOID),
    "helper_a4_refs_normalize": (A4, {6: A4_HELPER}, 4, "reference used", A4_VOID),
    "public_helper_a4_batch_norm": (A4, {6: A4_PUBLIC_HELPER}, 4, "reference used", A4_VOID),
    "blind_a8_model": (A8, {3: A8_BLIND}, 8, "",
                       {"training.model_shape": 0, "training.model_causal": 0,
                        "training.model_padding": 0}),
    "deaf_a8_model": (A8, {3: A8_DEAF}, 8, "",
                      {"training.model_shape": 0, "training.model_causal": 0,
                       "training.model_padding": 0}),
}


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    base = tmp_path_factory.mktemp("grading_forbidden")
    submitted, out = base / "submitted", base / "out"
    for student, (notebook, cells, _, _, _) in SUBMISSIONS.items():
        write_submission(notebook, submitted, student,
                         cells)
    grade(submitted, out, "--case-timeout", "5", "--cells-timeout", "20")
    with open(out / "grades.csv", newline="") as f:
        rows = {(r["student"], r["assignment"]): r for r in csv.DictReader(f)}
    return out, rows


@pytest.mark.parametrize("student", list(SUBMISSIONS))
def test_each_route_loses_what_a_forbidden_call_loses(graded, student):
    out, rows = graded
    notebook, _, score, flags, columns = SUBMISSIONS[student]
    (row,) = [r for (s, _), r in rows.items() if s == student]
    feedback = (out / "feedback" / student / f"{row['assignment']}.md").read_text()
    if score is not None:
        assert float(row["score"]) == score, feedback
    assert row["flags"] == flags, feedback
    for column, points in columns.items():
        assert float(row[column]) == points, (column, feedback)
