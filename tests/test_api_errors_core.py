"""Bad and degenerate input to the core modules, through their public API, table by table.

utils.attention, utils.masks, utils.positional, utils.layers, utils.compare, utils.plotting and
utils.seed_everything. Every row of an error table is a call, the exception it must raise before
doing any work, and a phrase its message must hold (what was expected, what was given). Every
row of a degenerate table is a valid but unusual input and the value it must give. The
``from_torch`` tables list each configuration that is refused and each one that is copied, the
latter checked output for output.
"""

from __future__ import annotations

import math
import random

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from utils import masks, seed_everything  # noqa: E402
from utils._validation import InputTypeError  # noqa: E402
from utils.attention import (  # noqa: E402
    GroupedQueryAttention,
    MultiHeadAttention,
    scaled_dot_product_attention,
)
from utils.compare import max_abs_diff, report_close  # noqa: E402
from utils.layers import (  # noqa: E402
    LayerNorm,
    MixtureOfExperts,
    PositionwiseFeedForward,
    RMSNorm,
    gated_ffn_width,
)
from utils.plotting import plot_attention, plot_attention_heads  # noqa: E402
from utils.positional import (  # noqa: E402
    LearnedPositionalEmbedding,
    RotaryEmbedding,
    SinusoidalPositionalEncoding,
    TokenEmbedding,
    apply_rope,
    rope_angles,
    sinusoidal_encoding,
    sinusoidal_shift_matrix,
)

INF, NAN = math.inf, math.nan
T = InputTypeError  # wrong type, dtype or device (a TypeError and a ValueError)
V = ValueError  # right type, wrong value


def r(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape) + len(shape)))


def ones(*shape: int) -> torch.Tensor:
    return torch.ones(*shape, dtype=torch.bool)


def meta(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A tensor on the meta device: the one "other device" a CPU-only machine has."""
    return torch.empty(*shape, dtype=dtype, device="meta")


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


MHA = MultiHeadAttention(8, 2)
GQA = GroupedQueryAttention(8, 2, 1)
X = r(2, 5, 8)
Q, K, V_ = r(2, 3, 4), r(2, 5, 4), r(2, 5, 6)
SPE = SinusoidalPositionalEncoding(8, max_len=10)
LPE = LearnedPositionalEmbedding(10, 8)
TOK = TokenEmbedding(10, 8)
ROPE = RotaryEmbedding(8)
FF = PositionwiseFeedForward(8, 16)
MOE = MixtureOfExperts(8, 16, 3)
W = torch.softmax(r(3, 4), dim=-1)


def _case(name, call, exc, phrase):
    return pytest.param(call, exc, phrase, id=name)


# ---------------------------------------------------------------------------- error tables

ATTENTION_ERRORS = [
    _case("sdpa q not a tensor", lambda: scaled_dot_product_attention(Q.tolist(), K, V_), T,
          "q must be a torch.Tensor, got list"),
    _case("sdpa q rank 1", lambda: scaled_dot_product_attention(r(4), K, V_), V,
          "q must have shape (..., L_q, d_k) (at least 2 dims), got (4)"),
    _case("sdpa d_k differs", lambda: scaled_dot_product_attention(Q, r(2, 5, 3), V_), V,
          "q is (2, 3, 4) (d_k=4), k is (2, 5, 3) (d_k=3)"),
    _case("sdpa d_k = 0", lambda: scaled_dot_product_attention(r(2, 3, 0), r(2, 5, 0), V_), V,
          "d_k must be at least 1"),
    _case("sdpa L_k differs", lambda: scaled_dot_product_attention(Q, K, r(2, 4, 6)), V,
          "k is (2, 5, 4) (L_k=5), v is (2, 4, 6) (L_k=4)"),
    _case("sdpa batch dims", lambda: scaled_dot_product_attention(Q, r(3, 5, 4), r(3, 5, 6)), V,
          "do not broadcast"),
    _case("sdpa dtypes differ", lambda: scaled_dot_product_attention(Q.double(), K, V_), T,
          "same dtype, got torch.float64, torch.float32 and torch.float32"),
    _case("sdpa integer q, k, v",
          lambda: scaled_dot_product_attention(Q.long(), K.long(), V_.long()), T,
          "q must be a floating-point tensor, got dtype torch.int64"),
    _case("sdpa q on another device", lambda: scaled_dot_product_attention(meta(2, 3, 4), K, V_),
          T, "k is on cpu but q is on meta"),
    _case("sdpa mask not bool",
          lambda: scaled_dot_product_attention(Q, K, V_, torch.ones(3, 5)), T,
          "mask must be a bool tensor (True = may attend), got dtype torch.float32"),
    _case("sdpa mask shape", lambda: scaled_dot_product_attention(Q, K, V_, ones(3, 4)), V,
          "mask of shape (3, 4) does not broadcast to (..., L_q, L_k) = (2, 3, 5)"),
    _case("sdpa mask on another device",
          lambda: scaled_dot_product_attention(Q, K, V_, meta(3, 5, dtype=torch.bool)), T,
          "mask is on meta but q is on cpu"),
    _case("sdpa dropout_p = 1", lambda: scaled_dot_product_attention(Q, K, V_, dropout_p=1.0),
          V, "dropout_p must be a finite number in [0.0, 1.0), got 1.0"),
    _case("sdpa dropout_p < 0", lambda: scaled_dot_product_attention(Q, K, V_, dropout_p=-0.1),
          V, "got -0.1"),
    _case("sdpa dropout_p NaN", lambda: scaled_dot_product_attention(Q, K, V_, dropout_p=NAN),
          V, "got nan"),
    _case("sdpa dropout_p str", lambda: scaled_dot_product_attention(Q, K, V_, dropout_p="0.1"),
          T, "dropout_p must be a real number, got '0.1' (str)"),
    _case("sdpa dropout_p bool", lambda: scaled_dot_product_attention(Q, K, V_, dropout_p=True),
          T, "got True (bool)"),
    _case("MHA d_model float", lambda: MultiHeadAttention(16.7, 2), T,
          "d_model must be a positive int, got 16.7 (float)"),
    _case("MHA num_heads float", lambda: MultiHeadAttention(16, 2.5), T,
          "num_heads must be a positive int, got 2.5 (float)"),
    _case("MHA num_heads bool", lambda: MultiHeadAttention(16, True), T,
          "num_heads must be a positive int, got True (bool)"),
    _case("MHA d_model 0", lambda: MultiHeadAttention(0, 1), V,
          "d_model must be a positive int, got 0"),
    _case("MHA heads do not divide", lambda: MultiHeadAttention(10, 4), V,
          "d_model=10, num_heads=4 leaves a remainder of 2"),
    _case("MHA bias str", lambda: MultiHeadAttention(8, 2, bias="yes"), T,
          "bias must be True or False, got 'yes' (str)"),
    _case("MHA dropout str", lambda: MultiHeadAttention(8, 2, dropout="0.1"), T,
          "dropout must be a real number, got '0.1'"),
    _case("MHA dropout 1", lambda: MultiHeadAttention(8, 2, dropout=1.0), V,
          "dropout must be in [0, 1), got 1.0"),
    _case("MHA float64 input", lambda: MHA(X.double(), X.double(), X.double()), T,
          "query has dtype torch.float64 but MultiHeadAttention's parameters are torch.float32"),
    _case("MHA integer input", lambda: MHA(X.long(), X.long(), X.long()), T,
          "query must be a floating-point tensor, got dtype torch.int64"),
    _case("MHA input on another device", lambda: MHA(meta(2, 5, 8), meta(2, 5, 8), meta(2, 5, 8)),
          T, "query is on meta but MultiHeadAttention's parameters are on cpu"),
    _case("MHA rank 2 input", lambda: MHA(r(5, 8), r(5, 8), r(5, 8)), V,
          "query must have shape (B, L, d_model=8) (3 dims), got (5, 8)"),
    _case("MHA wrong width", lambda: MHA(r(2, 5, 7), X, X), V,
          "query must have shape (B, L, d_model=8), got (2, 5, 7)"),
    _case("MHA key/value lengths", lambda: MHA(X, X, r(2, 4, 8)), V,
          "key and value must have the same (B, L_k): key (2, 5, 8), value (2, 4, 8)"),
    _case("MHA batch sizes", lambda: MHA(X, r(3, 5, 8), r(3, 5, 8)), V,
          "same batch size B: query (2, 5, 8), key (3, 5, 8)"),
    _case("MHA mask not bool", lambda: MHA(X, X, X, torch.ones(5, 5)), T,
          "mask must be a bool tensor"),
    _case("MHA mask 2-dim wrong", lambda: MHA(X, X, X, ones(5, 6)), V,
          "(B, L_k) = (2, 5) padding mask or an (L_q, L_k) = (5, 5) mask shared by the batch, "
          "got (5, 6)"),
    _case("MHA mask 1-dim", lambda: MHA(X, X, X, ones(5)), V,
          "mask must have 2, 3 or 4 dims, got (5)"),
    _case("MHA mask 3-dim wrong", lambda: MHA(X, X, X, ones(3, 5, 5)), V,
          "mask of shape (3, 5, 5) does not broadcast to (B, L_q, L_k)"),
    _case("MHA mask 4-dim wrong heads", lambda: MHA(X, X, X, ones(2, 3, 5, 5)), V,
          "mask of shape (2, 3, 5, 5) has 3 heads but the attention has h=2"),
    _case("MHA mask ambiguous (B == L_q)", lambda: MHA(r(3, 3, 8), r(3, 7, 8), r(3, 7, 8),
                                                        ones(3, 7)), V,
          "ambiguous because B = L_q = 3"),
    _case("MHA mask on another device",
          lambda: MHA(X, X, X, meta(5, 5, dtype=torch.bool)), T, "mask is on meta but query"),
    _case("MHA split_heads wrong width", lambda: MHA.split_heads(r(2, 5, 7)), V,
          "x must have shape (B, L, d_model=8), got (2, 5, 7)"),
    _case("MHA merge_heads wrong heads", lambda: MHA.merge_heads(r(2, 3, 5, 4)), V,
          "x must have shape (B, h=2, L, d_k=4), got (2, 3, 5, 4)"),
    _case("GQA num_kv_heads float", lambda: GroupedQueryAttention(16, 2, 1.0), T,
          "num_kv_heads must be a positive int, got 1.0 (float)"),
    _case("GQA num_kv_heads bool", lambda: GroupedQueryAttention(16, 2, True), T,
          "num_kv_heads must be a positive int, got True"),
    _case("GQA num_kv_heads 0", lambda: GroupedQueryAttention(16, 2, 0), V,
          "num_kv_heads must be a positive int, got 0"),
    _case("GQA groups do not divide", lambda: GroupedQueryAttention(24, 6, 4), V,
          "num_heads=6, num_kv_heads=4 leaves a remainder of 2"),
    _case("GQA float64 input", lambda: GQA(X.double(), X.double(), X.double()), T,
          "query has dtype torch.float64 but GroupedQueryAttention's parameters are "
          "torch.float32"),
    _case("GQA mask ambiguous", lambda: GQA(r(3, 3, 8), r(3, 3, 8), r(3, 3, 8), ones(3, 3)), V,
          "ambiguous"),
    _case("GQA mask 4-dim wrong heads", lambda: GQA(X, X, X, ones(2, 3, 5, 5)), V,
          "has 3 heads but the attention has h=2"),
    _case("GQA.from_multi_head of a Linear",
          lambda: GroupedQueryAttention.from_multi_head(nn.Linear(2, 2)), T,
          "mha must be a MultiHeadAttention, got Linear"),
    _case("GQA.from_multi_head num_kv_heads float",
          lambda: GroupedQueryAttention.from_multi_head(MHA, 2.0), T,
          "num_kv_heads must be a positive int, got 2.0"),
]

MASK_ERRORS = [
    _case("causal_mask float", lambda: masks.causal_mask(2.5), T,
          "length must be a positive int, got 2.5 (float)"),
    _case("causal_mask bool", lambda: masks.causal_mask(True), T, "got True (bool)"),
    _case("causal_mask 0", lambda: masks.causal_mask(0), V, "length must be a positive int, got 0"),
    _case("causal_mask bad device", lambda: masks.causal_mask(3, device="nope"), V,
          "device must name a device such as 'cpu' or 'cuda:0', got 'nope'"),
    _case("causal_mask device int list", lambda: masks.causal_mask(3, device=[0]), T,
          "device must be a torch.device"),
    _case("padding_mask float lengths", lambda: masks.padding_mask([2.5, 3]), T,
          "lengths must hold integers, got dtype torch.float32"),
    _case("padding_mask bool lengths", lambda: masks.padding_mask([True, False]), T,
          "lengths must hold integers, got dtype torch.bool"),
    _case("padding_mask None", lambda: masks.padding_mask(None), T,
          "lengths must be a list or tensor of ints, got None"),
    _case("padding_mask negative", lambda: masks.padding_mask([2, -1]), V,
          "lengths must be non-negative, got [2, -1]"),
    _case("padding_mask 2-dim", lambda: masks.padding_mask([[1, 2]]), V,
          "lengths must have shape (B,) (1 dims), got (1, 2)"),
    _case("padding_mask max_len float", lambda: masks.padding_mask([2, 3], 16.7), T,
          "max_len must be an int >= 0, got 16.7 (float)"),
    _case("padding_mask max_len bool", lambda: masks.padding_mask([1, 1], True), T,
          "max_len must be an int >= 0, got True"),
    _case("padding_mask max_len short", lambda: masks.padding_mask([2, 5], 3), V,
          "max_len=3 is shorter than the longest length 5"),
    _case("padding_mask meta", lambda: masks.padding_mask(meta(2, dtype=torch.long)), T,
          "lengths must hold values, got a tensor of shape (2) on the meta device"),
    _case("local_mask window float", lambda: masks.local_mask(4, 1.5), T,
          "window must be an int >= 0, got 1.5 (float)"),
    _case("local_mask window bool", lambda: masks.local_mask(4, True), T, "got True (bool)"),
    _case("local_mask window negative", lambda: masks.local_mask(4, -1), V,
          "window must be a non-negative int, got -1"),
    _case("local_mask causal str", lambda: masks.local_mask(4, 1, causal="yes"), T,
          "causal must be True or False, got 'yes'"),
    _case("padding_to_attention_mask float",
          lambda: masks.padding_to_attention_mask(torch.ones(2, 3)), T,
          "pad must be a bool tensor"),
    _case("padding_to_attention_mask 3-dim",
          lambda: masks.padding_to_attention_mask(ones(2, 3, 4)), V,
          "pad must have shape (B, L_k) (2 dims), got (2, 3, 4)"),
    _case("combine_masks float", lambda: masks.combine_masks(ones(3, 3), torch.ones(3, 3)), T,
          "mask 1 must be a bool tensor"),
    _case("combine_masks shapes",
          lambda: masks.combine_masks(masks.causal_mask(3), masks.causal_mask(4)), V,
          "do not broadcast together: (3, 3), (4, 4)"),
    _case("combine_masks devices",
          lambda: masks.combine_masks(ones(3, 3), meta(3, 3, dtype=torch.bool)), T,
          "mask 1 is on meta but mask 0 is on cpu"),
    _case("to_key_padding_mask float", lambda: masks.to_key_padding_mask(torch.ones(2, 3)), T,
          "pad must be a bool tensor"),
    _case("from_key_padding_mask integer",
          lambda: masks.from_key_padding_mask(torch.ones(2, 3, dtype=torch.long)), T,
          "must be a bool or a floating-point (additive) tensor, got dtype torch.int64"),
    _case("from_key_padding_mask 1-dim", lambda: masks.from_key_padding_mask(ones(3)), V,
          "(B, L_k) (2 dims), got (3)"),
    _case("to_torch_attn_mask num_heads float",
          lambda: masks.to_torch_attn_mask(ones(2, 3, 3), 2.5), T,
          "num_heads must be a positive int, got 2.5"),
    _case("to_torch_attn_mask num_heads 0", lambda: masks.to_torch_attn_mask(ones(2, 3, 3), 0), V,
          "num_heads must be a positive int, got 0"),
    _case("to_torch_attn_mask dtype str",
          lambda: masks.to_torch_attn_mask(ones(3, 3), dtype="float"), T,
          "dtype must be a torch.dtype such as torch.float32, got 'float'"),
    _case("to_torch_attn_mask dtype long",
          lambda: masks.to_torch_attn_mask(ones(3, 3), dtype=torch.long), V,
          "dtype must be torch.bool or a floating point dtype, got torch.int64"),
    _case("to_torch_attn_mask no num_heads", lambda: masks.to_torch_attn_mask(ones(2, 3, 3)), V,
          "give num_heads"),
    _case("from_torch_attn_mask num_heads not dividing",
          lambda: masks.from_torch_attn_mask(ones(4, 3, 3), 3), V,
          "the first dim 4 is not a multiple of num_heads=3"),
    _case("from_torch_attn_mask integer",
          lambda: masks.from_torch_attn_mask(torch.ones(3, 3, dtype=torch.long)), T,
          "attn_mask must be a bool or a floating-point (additive) tensor"),
    _case("to_additive_mask dtype long", lambda: masks.to_additive_mask(ones(3, 3), torch.long), V,
          "dtype must be a floating-point dtype, got torch.int64"),
    _case("from_additive_mask integer",
          lambda: masks.from_additive_mask(torch.zeros(3, dtype=torch.long)), T,
          "an additive mask must be a float tensor, got dtype torch.int64"),
    _case("from_additive_mask NaN", lambda: masks.from_additive_mask(torch.tensor([0.0, NAN])), V,
          "values other than 0 and -inf"),
    _case("from_additive_mask +inf", lambda: masks.from_additive_mask(torch.tensor([0.0, INF])), V,
          "values other than 0 and -inf"),
    _case("from_additive_mask meta", lambda: masks.from_additive_mask(meta(3, 3)), T,
          "mask must hold values"),
    _case("expand_mask batch float", lambda: masks.expand_mask(ones(3, 3), 2.5, 3, 3), T,
          "batch must be an int >= 0, got 2.5"),
    _case("expand_mask ambiguous", lambda: masks.expand_mask(ones(3, 3), 3, 3, 3), V,
          "ambiguous because B = L_q = 3"),
    _case("expand_mask 5 dims", lambda: masks.expand_mask(ones(1, 1, 1, 3, 3), 2, 3, 3), V,
          "mask must have 2, 3 or 4 dims, got (1, 1, 1, 3, 3)"),
]

POSITIONAL_ERRORS = [
    _case("sinusoidal_encoding max_len float", lambda: sinusoidal_encoding(16.7, 8), T,
          "max_len must be a positive int, got 16.7"),
    _case("sinusoidal_encoding d_model bool", lambda: sinusoidal_encoding(16, True), T,
          "d_model must be a positive int, got True"),
    _case("sinusoidal_encoding odd d_model", lambda: sinusoidal_encoding(16, 7), V,
          "d_model must be even (sines and cosines come in pairs), got 7"),
    _case("sinusoidal_encoding base 0", lambda: sinusoidal_encoding(4, 8, base=0), V,
          "base must be a finite number in (0.0, inf], got 0.0"),
    _case("sinusoidal_encoding base inf", lambda: sinusoidal_encoding(4, 8, base=INF), V,
          "got inf"),
    _case("sinusoidal_encoding base str", lambda: sinusoidal_encoding(4, 8, base="1e4"), T,
          "base must be a real number, got '1e4'"),
    _case("sinusoidal_shift_matrix offset str", lambda: sinusoidal_shift_matrix("1", 8), T,
          "offset must be a real number, got '1'"),
    _case("sinusoidal_shift_matrix offset NaN", lambda: sinusoidal_shift_matrix(NAN, 8), V,
          "offset must be a finite number"),
    _case("SinusoidalPositionalEncoding odd", lambda: SinusoidalPositionalEncoding(7), V,
          "d_model must be even"),
    _case("SinusoidalPositionalEncoding max_len float",
          lambda: SinusoidalPositionalEncoding(8, 2.5), T, "max_len must be a positive int"),
    _case("SinusoidalPositionalEncoding dropout 1",
          lambda: SinusoidalPositionalEncoding(8, 10, 1.0), V,
          "dropout must be a finite number in [0.0, 1.0), got 1.0"),
    _case("SinusoidalPositionalEncoding beyond max_len", lambda: SPE(r(1, 11, 8)), V,
          "x has L=11 positions but the encoding was built for max_len=10"),
    _case("SinusoidalPositionalEncoding integer x",
          lambda: SPE(torch.ones(1, 3, 8, dtype=torch.long)), T,
          "x must be a floating-point tensor"),
    _case("SinusoidalPositionalEncoding x on another device", lambda: SPE(meta(1, 3, 8)), T,
          "x is on meta but SinusoidalPositionalEncoding is on cpu"),
    _case("LearnedPositionalEmbedding max_len float",
          lambda: LearnedPositionalEmbedding(2.5, 8), T, "max_len must be a positive int"),
    _case("LearnedPositionalEmbedding init_std < 0",
          lambda: LearnedPositionalEmbedding(10, 8, init_std=-1.0), V,
          "init_std must be a finite number in [0.0, inf], got -1.0"),
    _case("LearnedPositionalEmbedding beyond max_len", lambda: LPE(r(1, 11, 8)), V,
          "x has L=11 positions but there are only max_len=10 learned position vectors"),
    _case("LearnedPositionalEmbedding float64 x", lambda: LPE(r(1, 3, 8).double()), T,
          "x has dtype torch.float64 but LearnedPositionalEmbedding's parameters are "
          "torch.float32"),
    _case("LearnedPositionalEmbedding x on another device", lambda: LPE(meta(1, 3, 8)), T,
          "x is on meta"),
    _case("TokenEmbedding vocab float", lambda: TokenEmbedding(2.5, 8), T,
          "vocab_size must be a positive int"),
    _case("TokenEmbedding scale str", lambda: TokenEmbedding(10, 8, scale="yes"), T,
          "scale must be True or False"),
    _case("TokenEmbedding float ids", lambda: TOK(torch.ones(2, 3)), T,
          "ids must hold integer token ids (torch.long), got dtype torch.float32"),
    _case("TokenEmbedding id too large", lambda: TOK(torch.tensor([[3, 10]])), V,
          "ids must hold ids in [0, 10), got values from 3 to 10"),
    _case("TokenEmbedding negative id", lambda: TOK(torch.tensor([[-1]])), V,
          "got values from -1 to -1"),
    _case("TokenEmbedding ids on another device",
          lambda: TOK(meta(2, 3, dtype=torch.long)), T, "ids is on meta but TokenEmbedding"),
    _case("rope_angles odd dim", lambda: rope_angles(torch.arange(3), 7), V,
          "dim must be even"),
    _case("rope_angles bool positions", lambda: rope_angles(ones(3), 8), T,
          "positions must be an integer or real tensor, got dtype torch.bool"),
    _case("rope_angles NaN positions", lambda: rope_angles(torch.tensor([0.0, NAN]), 8), V,
          "positions must be finite"),
    _case("apply_rope odd width", lambda: apply_rope(r(2, 3, 7)), V,
          "d even (features rotate in pairs), got (2, 3, 7)"),
    _case("apply_rope integer x", lambda: apply_rope(torch.ones(2, 3, 8, dtype=torch.long)), T,
          "x must be a floating-point tensor"),
    _case("apply_rope positions length", lambda: apply_rope(r(2, 3, 8), torch.arange(4)), V,
          "positions must have shape (L=3,) or (..., L=3)"),
    _case("apply_rope positions on another device",
          lambda: apply_rope(r(2, 3, 8), meta(3, dtype=torch.long)), T,
          "positions is on meta but x is on cpu"),
    _case("apply_rope base NaN", lambda: apply_rope(r(2, 3, 8), base=NAN), V,
          "base must be a finite number"),
    _case("RotaryEmbedding dim float", lambda: RotaryEmbedding(8.0), T,
          "dim must be a positive int, got 8.0"),
    _case("RotaryEmbedding base str", lambda: RotaryEmbedding(8, base="x"), T,
          "base must be a real number"),
    _case("RotaryEmbedding wrong width", lambda: ROPE(r(2, 3, 6)), V,
          "x must have shape (..., L, dim=8), got (2, 3, 6)"),
]


def _norm_errors(cls):
    n = cls.__name__
    mod = cls(8)
    return [
        _case(f"{n} d_model float", lambda: cls(8.0), T, "d_model must be a positive int, got 8.0"),
        _case(f"{n} d_model bool", lambda: cls(True), T, "got True (bool)"),
        _case(f"{n} d_model 0", lambda: cls(0), V, "d_model must be a positive int, got 0"),
        _case(f"{n} eps negative", lambda: cls(8, eps=-1.0), V,
              "eps must be a finite number in [0.0, inf], got -1.0"),
        _case(f"{n} eps inf", lambda: cls(8, eps=INF), V, "got inf"),
        _case(f"{n} eps str", lambda: cls(8, eps="1e-5"), T, "eps must be a real number"),
        _case(f"{n} float64 input", lambda: mod(r(2, 8).double()), T,
              f"x has dtype torch.float64 but {n}'s parameters are torch.float32"),
        _case(f"{n} integer input", lambda: mod(torch.ones(2, 8, dtype=torch.long)), T,
              "x must be a floating-point tensor, got dtype torch.int64"),
        _case(f"{n} input on another device", lambda: mod(meta(2, 8)), T,
              f"x is on meta but {n}'s parameters are on cpu"),
        _case(f"{n} wrong width", lambda: mod(r(2, 7)), V,
              "x must have shape (..., d_model=8), got (2, 7)"),
        _case(f"{n} scalar input", lambda: mod(torch.tensor(1.0)), V, "got ()"),
    ]


LAYER_ERRORS = [
    *_norm_errors(LayerNorm),
    *_norm_errors(RMSNorm),
    _case("FFN d_ff float", lambda: PositionwiseFeedForward(8, 16.7), T,
          "d_ff must be a positive int, got 16.7"),
    _case("FFN d_model bool", lambda: PositionwiseFeedForward(True, 16), T,
          "d_model must be a positive int, got True"),
    _case("FFN activation unknown", lambda: PositionwiseFeedForward(8, 16, activation="tanh"), V,
          "activation must be one of ('gelu', 'relu', 'geglu', 'glu', 'reglu', 'swiglu'), "
          "got 'tanh'"),
    _case("FFN activation None", lambda: PositionwiseFeedForward(8, 16, activation=None), T,
          "activation must be one of"),
    _case("FFN dropout str", lambda: PositionwiseFeedForward(8, 16, dropout="x"), T,
          "dropout must be a real number"),
    _case("FFN bias str", lambda: PositionwiseFeedForward(8, 16, bias="no"), T,
          "bias must be True or False"),
    _case("FFN float64 input", lambda: FF(r(2, 8).double()), T,
          "x has dtype torch.float64 but PositionwiseFeedForward's parameters are torch.float32"),
    _case("FFN input on another device", lambda: FF(meta(2, 8)), T, "x is on meta"),
    _case("FFN hidden wrong width", lambda: FF.hidden(r(2, 7)), V,
          "x must have shape (..., d_model=8), got (2, 7)"),
    _case("gated_ffn_width float", lambda: gated_ffn_width(2.5), T,
          "d_ff must be a positive int, got 2.5"),
    _case("gated_ffn_width multiple_of 0", lambda: gated_ffn_width(16, 0), V,
          "multiple_of must be a positive int, got 0"),
    _case("MoE num_experts float", lambda: MixtureOfExperts(8, 16, 2.5), T,
          "num_experts must be a positive int, got 2.5"),
    _case("MoE num_experts bool", lambda: MixtureOfExperts(8, 16, True), T, "got True"),
    _case("MoE d_model float", lambda: MixtureOfExperts(8.0, 16, 2), T,
          "d_model must be a positive int, got 8.0"),
    _case("MoE float64 input", lambda: MOE(r(2, 8).double()), T,
          "x has dtype torch.float64 but MixtureOfExperts's parameters are torch.float32"),
    _case("MoE input on another device", lambda: MOE(meta(2, 8)), T, "x is on meta"),
    _case("MoE route wrong width", lambda: MOE.route(r(2, 7)), V, "d_model=8), got (2, 7)"),
]

OTHER_ERRORS = [
    _case("max_abs_diff shapes", lambda: max_abs_diff(r(2), r(3)), V,
          "actual (2), expected (3)"),
    _case("max_abs_diff list", lambda: max_abs_diff([1.0], r(1)), T,
          "actual must be a torch.Tensor, got list"),
    _case("max_abs_diff complex", lambda: max_abs_diff(torch.ones(2, dtype=torch.complex64),
                                                       r(2)), T,
          "actual must hold real numbers, got dtype torch.complex64"),
    _case("max_abs_diff bool vs float", lambda: max_abs_diff(ones(2), r(2)), T,
          "cannot compare a bool tensor with a number tensor"),
    _case("max_abs_diff meta", lambda: max_abs_diff(meta(2), r(2)), T,
          "actual must hold values"),
    _case("report_close label int", lambda: report_close(3, r(2), r(2)), T,
          "label must be a string, got 3 (int)"),
    _case("report_close atol negative", lambda: report_close("x", r(2), r(2), atol=-1.0), V,
          "atol must be a finite number in [0.0, inf], got -1.0"),
    _case("report_close atol NaN", lambda: report_close("x", r(2), r(2), atol=NAN), V,
          "got nan"),
    _case("plot_attention 3-dim", lambda: plot_attention(r(2, 3, 4)), V,
          "weights must have shape (L_q, L_k), got (2, 3, 4)"),
    _case("plot_attention string", lambda: plot_attention("weights"), T,
          "weights must be a tensor of shape (L_q, L_k), got a str"),
    _case("plot_attention complex", lambda: plot_attention(torch.ones(3, 4, dtype=torch.cfloat)),
          T, "weights must hold real numbers"),
    _case("plot_attention meta", lambda: plot_attention(meta(3, 4)), T, "weights must hold values"),
    _case("plot_attention query labels", lambda: plot_attention(W, queries=["a"]), V,
          "queries has 1 labels, expected L_q = 3"),
    _case("plot_attention key labels", lambda: plot_attention(W, keys=list("abc")), V,
          "keys has 3 labels, expected L_k = 4"),
    _case("plot_attention labels not a list", lambda: plot_attention(W, queries=3), T,
          "queries must be a list of L_q = 3 labels, got int"),
    _case("plot_attention labels a str", lambda: plot_attention(W, keys="abcd"), T,
          "keys must be a list of L_k = 4 labels, got str"),
    _case("plot_attention ax str", lambda: plot_attention(W, ax="ax"), T,
          "ax must be matplotlib Axes or None, got str"),
    _case("plot_attention vmax 0", lambda: plot_attention(W, vmax=0.0), V,
          "vmax must be a finite number in (0.0, inf], got 0.0"),
    _case("plot_attention annotate str", lambda: plot_attention(W, annotate="yes"), T,
          "annotate must be True or False"),
    _case("plot_attention_heads 2-dim", lambda: plot_attention_heads(W), V,
          "weights must have shape (h, L_q, L_k), got (3, 4)"),
    _case("plot_attention_heads no head", lambda: plot_attention_heads(r(0, 3, 4)), V,
          "weights must have shape (h, L_q, L_k) with no size 0 (there would be nothing to "
          "draw), got (0, 3, 4)"),
    _case("plot_attention empty", lambda: plot_attention(r(0, 4)), V,
          "with no size 0 (there would be nothing to draw), got (0, 4)"),
    _case("plot_attention_heads ncols float", lambda: plot_attention_heads(r(2, 3, 4), ncols=2.5),
          T, "ncols must be a positive int, got 2.5"),
    _case("plot_attention_heads ncols 0", lambda: plot_attention_heads(r(2, 3, 4), ncols=0), V,
          "ncols must be a positive int, got 0"),
    _case("plot_attention_heads key labels",
          lambda: plot_attention_heads(r(2, 3, 4), keys=["a"]), V,
          "keys has 1 labels, expected L_k = 4"),
    _case("seed_everything float", lambda: seed_everything(1.5), T,
          "seed must be an int from 0 to 2**32 - 1, got 1.5 (float)"),
    _case("seed_everything bool", lambda: seed_everything(True), T, "got True (bool)"),
    _case("seed_everything negative", lambda: seed_everything(-1), V,
          "seed must be an int from 0 to 2**32 - 1, got -1"),
    _case("seed_everything too large", lambda: seed_everything(2**32), V, "got 4294967296"),
]


@pytest.mark.parametrize("call, exc, phrase",
                         ATTENTION_ERRORS + MASK_ERRORS + POSITIONAL_ERRORS + LAYER_ERRORS
                         + OTHER_ERRORS)
def test_bad_input_raises_a_clear_error(call, exc, phrase):
    with pytest.raises(exc) as info:
        call()
    assert phrase in str(info.value), f"{phrase!r} not in {str(info.value)!r}"
    if exc is T:  # old `except ValueError` code still catches a wrong type
        assert isinstance(info.value, TypeError) and isinstance(info.value, ValueError)


def test_a_failed_call_changes_nothing():
    """An error is raised before any work: no stored weights, no mode or grad-mode change."""
    m = MultiHeadAttention(8, 2).train()
    before = [p.detach().clone() for p in m.parameters()]
    with pytest.raises(InputTypeError):
        m(X.double(), X.double(), X.double())
    assert m.attn_weights is None and m.training and torch.is_grad_enabled()
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters(), strict=True))


# ---------------------------------------------------------------------------- degenerate input


def _zeros_like_sdpa(q_shape, k_shape, v_shape, mask=None):
    out, w = scaled_dot_product_attention(r(*q_shape), r(*k_shape), r(*v_shape), mask)
    return out, w


def _mha_bias(m, out):
    return m.w_o.bias.detach().expand_as(out)


def _rows_of(value, shape):
    return torch.full(shape, value)


DEGENERATE = [
    # (name, call, expected): expected is a tensor (compared exactly, shape included), a number,
    # or a callable(result) -> expected tensor
    ("sdpa every key masked: zero output",
     lambda: scaled_dot_product_attention(Q, K, V_, torch.zeros(3, 5, dtype=torch.bool))[0],
     torch.zeros(2, 3, 6)),
    ("sdpa every key masked: zero weights",
     lambda: scaled_dot_product_attention(Q, K, V_, torch.zeros(3, 5, dtype=torch.bool))[1],
     torch.zeros(2, 3, 5)),
    ("sdpa L_k = 0: zero output", lambda: _zeros_like_sdpa((2, 3, 4), (2, 0, 4), (2, 0, 6))[0],
     torch.zeros(2, 3, 6)),
    ("sdpa L_k = 0: empty weights",
     lambda: _zeros_like_sdpa((2, 3, 4), (2, 0, 4), (2, 0, 6))[1], torch.zeros(2, 3, 0)),
    ("sdpa L_q = 0", lambda: _zeros_like_sdpa((2, 0, 4), (2, 5, 4), (2, 5, 6))[0],
     torch.zeros(2, 0, 6)),
    ("sdpa B = 0", lambda: _zeros_like_sdpa((0, 3, 4), (0, 5, 4), (0, 5, 6))[0],
     torch.zeros(0, 3, 6)),
    ("MHA every key masked: W_O's bias",
     lambda: MHA(X, X, X, torch.zeros(5, 5, dtype=torch.bool)), lambda out: _mha_bias(MHA, out)),
    ("MHA L_k = 0: W_O's bias", lambda: MHA(X, r(2, 0, 8), r(2, 0, 8)),
     lambda out: _mha_bias(MHA, out)),
    ("MHA all-padding sequence: W_O's bias",
     lambda: MHA(X, X, X, masks.padding_mask([5, 0]))[1], lambda out: _mha_bias(MHA, out)),
    ("MHA B = 0", lambda: MHA(r(0, 5, 8), r(0, 5, 8), r(0, 5, 8)), torch.zeros(0, 5, 8)),
    ("MHA L_q = 0", lambda: MHA(r(2, 0, 8), X, X), torch.zeros(2, 0, 8)),
    ("GQA every key masked: W_O's bias",
     lambda: GQA(X, X, X, torch.zeros(5, 5, dtype=torch.bool)), lambda out: _mha_bias(GQA, out)),
    ("GQA B = 0", lambda: GQA(r(0, 5, 8), r(0, 5, 8), r(0, 5, 8)), torch.zeros(0, 5, 8)),
    ("padding_mask of no sequence", lambda: masks.padding_mask([]),
     torch.zeros(0, 0, dtype=torch.bool)),
    ("padding_mask of no sequence, max_len", lambda: masks.padding_mask([], 4),
     torch.zeros(0, 4, dtype=torch.bool)),
    ("padding_mask of empty sequences", lambda: masks.padding_mask([0, 0]),
     torch.zeros(2, 0, dtype=torch.bool)),
    ("padding_mask max_len 0", lambda: masks.padding_mask([0], 0),
     torch.zeros(1, 0, dtype=torch.bool)),
    ("local_mask window 0 is the diagonal", lambda: masks.local_mask(3, 0),
     torch.eye(3, dtype=torch.bool)),
    ("combine_masks of nothing", lambda: masks.combine_masks(), None),
    ("expand_mask (1, L_k) with B = L_q = 1", lambda: masks.expand_mask(ones(1, 3), 1, 1, 3),
     ones(1, 1, 1, 3)),
    ("expand_mask (1, L_k) broadcast", lambda: masks.expand_mask(ones(1, 3), 2, 4, 3),
     ones(1, 1, 1, 3)),
    ("sinusoidal position 0 is (0, 1, 0, 1, ...)", lambda: sinusoidal_encoding(1, 4),
     torch.tensor([[0.0, 1.0, 0.0, 1.0]])),
    ("SinusoidalPositionalEncoding L = 0", lambda: SPE(r(2, 0, 8)), torch.zeros(2, 0, 8)),
    ("LearnedPositionalEmbedding B = 0", lambda: LPE(r(0, 3, 8)), torch.zeros(0, 3, 8)),
    ("TokenEmbedding of no token", lambda: TOK(torch.zeros(2, 0, dtype=torch.long)),
     torch.zeros(2, 0, 8)),
    ("apply_rope L = 0", lambda: apply_rope(r(2, 0, 8)), torch.zeros(2, 0, 8)),
    ("apply_rope position 0 is the identity",
     lambda: apply_rope(torch.ones(1, 1, 4)), torch.ones(1, 1, 4)),
    ("LayerNorm constant row: the bias", lambda: LayerNorm(4)(torch.full((2, 4), 3.0)),
     torch.zeros(2, 4)),
    ("RMSNorm zero row: zeros", lambda: RMSNorm(4)(torch.zeros(2, 4)), torch.zeros(2, 4)),
    ("RMSNorm eps=None zero row: zeros", lambda: RMSNorm(4, eps=None)(torch.zeros(2, 4)),
     torch.zeros(2, 4)),
    ("LayerNorm B = 0", lambda: LayerNorm(4)(r(0, 4)), torch.zeros(0, 4)),
    ("FFN B = 0", lambda: FF(r(0, 8)), torch.zeros(0, 8)),
    ("MoE B = 0", lambda: MOE(r(0, 8)), torch.zeros(0, 8)),
    ("MoE B = 0 counts", lambda: (MOE(r(0, 8)), MOE.last_counts)[1],
     torch.zeros(3, dtype=torch.long)),
    ("max_abs_diff equal -inf", lambda: max_abs_diff(torch.tensor([-INF, 1.0]),
                                                     torch.tensor([-INF, 1.0])), 0.0),
    ("max_abs_diff equal +inf", lambda: max_abs_diff(torch.tensor([INF]), torch.tensor([INF])),
     0.0),
    ("max_abs_diff inf vs finite", lambda: max_abs_diff(torch.tensor([INF]), torch.tensor([1.0])),
     INF),
    ("max_abs_diff inf vs -inf", lambda: max_abs_diff(torch.tensor([INF]), torch.tensor([-INF])),
     INF),
    ("max_abs_diff NaN vs number", lambda: max_abs_diff(torch.tensor([NAN, 0.0]),
                                                        torch.tensor([1.0, 0.0])), INF),
    ("max_abs_diff NaN vs NaN", lambda: max_abs_diff(torch.tensor([NAN]), torch.tensor([NAN])),
     INF),
    ("max_abs_diff finite", lambda: max_abs_diff(torch.tensor([1.0, -2.0]),
                                                 torch.tensor([1.5, -2.0])), 0.5),
    ("max_abs_diff integers", lambda: max_abs_diff(torch.tensor([1, 2]), torch.tensor([1, 5])),
     3.0),
    ("max_abs_diff bool masks", lambda: max_abs_diff(masks.causal_mask(2), ones(2, 2)), 1.0),
    ("max_abs_diff empty", lambda: max_abs_diff(r(0), r(0)), 0.0),
    ("report_close equal infinities", lambda: report_close("x", torch.tensor([-INF]),
                                                           torch.tensor([-INF])), 0.0),
]


@pytest.mark.parametrize("call, expected", [pytest.param(c, e, id=n) for n, c, e in DEGENERATE])
def test_degenerate_input_gives_its_documented_value(call, expected):
    result = call()
    if callable(expected):
        expected = expected(result)
    if isinstance(expected, torch.Tensor):
        assert isinstance(result, torch.Tensor) and result.dtype == expected.dtype
        assert result.shape == expected.shape
        torch.testing.assert_close(result, expected, atol=1e-6, rtol=0)
    else:
        assert result == expected


def test_fully_masked_rows_have_finite_gradients():
    q = Q.clone().requires_grad_()
    out, _ = scaled_dot_product_attention(q, K, V_, torch.zeros(3, 5, dtype=torch.bool))
    out.sum().backward()
    assert torch.equal(q.grad, torch.zeros_like(q))


def test_report_close_fails_on_nan_and_inf():
    with pytest.raises(AssertionError, match="max |diff| = inf"):
        report_close("x", torch.tensor([NAN]), torch.tensor([NAN]))
    with pytest.raises(AssertionError, match="max |diff| = inf"):
        report_close("x", torch.tensor([INF]), torch.tensor([1.0]))


# ---------------------------------------------------------------------------- the mask rule


@pytest.mark.parametrize("cls", [MultiHeadAttention, GroupedQueryAttention])
def test_attention_reads_masks_by_the_library_rule(cls):
    torch.manual_seed(0)
    m = cls(8, 2, keep_weights=True) if cls is MultiHeadAttention else cls(8, 2, 1,
                                                                         keep_weights=True)
    q, kv = r(2, 3, 8), r(2, 7, 8)  # B = 2, L_q = 3, L_k = 7
    pad = masks.padding_mask([7, 4], 7)
    explicit = m(q, kv, kv, pad[:, None, None, :])
    # (B, L_k) padding mask, and its 3-dim form
    assert torch.equal(m(q, kv, kv, pad), explicit)
    assert torch.equal(m(q, kv, kv, pad[:, None, :]), explicit)
    # the padding is obeyed: keys 4..6 of sequence 1 get no weight
    assert torch.all(m.attn_weights[1, :, :, 4:] == 0)
    # (L_q, L_k) shared mask, and its 3-dim form
    shared = masks.local_mask(7, 2)[:3]
    assert torch.equal(m(q, kv, kv, shared), m(q, kv, kv, shared[None]))
    # B == L_q: a 2-dim mask is ambiguous, the explicit forms work
    q3, kv3 = r(3, 3, 8), r(3, 7, 8)
    pad3 = masks.padding_mask([7, 2, 4], 7)
    with pytest.raises(ValueError, match="ambiguous"):
        m(q3, kv3, kv3, pad3)
    assert torch.equal(m(q3, kv3, kv3, pad3[:, None, :]), m(q3, kv3, kv3, pad3[:, None, None]))


# ---------------------------------------------------------------------------- from_torch


def _edited_mha(in_bias: bool, out_bias: bool, batch_first: bool = True) -> nn.MultiheadAttention:
    torch.manual_seed(0)
    m = nn.MultiheadAttention(8, 2, bias=in_bias, batch_first=batch_first)
    if in_bias:
        nn.init.normal_(m.in_proj_bias)
    if out_bias:
        m.out_proj.bias = nn.Parameter(torch.full((8,), 1.3))
    else:
        m.out_proj.bias = None
    return m.eval()


def _torch_mha_out(ref: nn.MultiheadAttention, x: torch.Tensor) -> torch.Tensor:
    if ref.batch_first:
        return ref(x, x, x, need_weights=False)[0]
    xt = x.transpose(0, 1)
    return ref(xt, xt, xt, need_weights=False)[0].transpose(0, 1)


MHA_COPIED = [
    pytest.param(lambda: _edited_mha(True, True), id="biases"),
    pytest.param(lambda: _edited_mha(False, False), id="no biases"),
    pytest.param(lambda: _edited_mha(False, True), id="output bias only"),
    pytest.param(lambda: _edited_mha(True, False), id="input biases only"),
    pytest.param(lambda: _edited_mha(True, True, batch_first=False), id="batch_first=False"),
    pytest.param(lambda: nn.MultiheadAttention(8, 2, dropout=0.1, batch_first=True).eval(),
                 id="dropout"),
    pytest.param(lambda: nn.MultiheadAttention(8, 2, batch_first=True).double().eval(),
                 id="float64"),
]


@pytest.mark.parametrize("make", MHA_COPIED)
def test_mha_from_torch_copies_exactly(make):
    ref = make()
    ours = MultiHeadAttention.from_torch(ref)
    x = r(2, 5, 8).to(ref.out_proj.weight.dtype)
    assert max_abs_diff(ours(x, x, x), _torch_mha_out(ref, x)) <= 1e-6
    assert (ours.w_o.bias is None) == (ref.out_proj.bias is None)
    assert (ours.w_q.bias is None) == (ref.in_proj_bias is None)
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in ref.parameters())
    assert ours.dropout == ref.dropout and ours.training == ref.training
    # and grouped-query attention made from the copy still computes the same
    gqa = GroupedQueryAttention.from_multi_head(ours)
    assert max_abs_diff(gqa(x, x, x), ours(x, x, x)) <= 1e-6


MHA_REFUSED = [
    pytest.param(lambda: nn.Linear(8, 8), InputTypeError,
                 "module must be an nn.MultiheadAttention, got Linear", id="not attention"),
    pytest.param(lambda: None, InputTypeError, "got NoneType", id="None"),
    pytest.param(lambda: nn.MultiheadAttention(8, 2, kdim=4, vdim=4), ValueError,
                 "kdim=4 and vdim=4 different from embed_dim=8", id="kdim/vdim"),
    pytest.param(lambda: nn.MultiheadAttention(8, 2, add_bias_kv=True), ValueError,
                 "add_bias_kv=True or add_zero_attn=True", id="add_bias_kv"),
    pytest.param(lambda: nn.MultiheadAttention(8, 2, add_zero_attn=True), ValueError,
                 "add_bias_kv=True or add_zero_attn=True", id="add_zero_attn"),
]


@pytest.mark.parametrize("make, exc, phrase", MHA_REFUSED)
def test_mha_from_torch_refuses_what_it_cannot_copy(make, exc, phrase):
    with pytest.raises(exc) as info:
        MultiHeadAttention.from_torch(make())
    assert phrase in str(info.value)
    assert torch.is_grad_enabled()


def _ln(**kw):
    torch.manual_seed(0)
    m = nn.LayerNorm(8, **kw)
    for p in m.parameters():
        nn.init.normal_(p)
    return m


def _rms(**kw):
    torch.manual_seed(0)
    m = nn.RMSNorm(8, **kw)
    for p in m.parameters():
        nn.init.normal_(p)
    return m


NORM_COPIED = [
    pytest.param(LayerNorm, lambda: _ln(), id="LayerNorm"),
    pytest.param(LayerNorm, lambda: _ln(eps=0.3), id="LayerNorm eps"),
    pytest.param(LayerNorm, lambda: _ln(elementwise_affine=False), id="LayerNorm no affine"),
    pytest.param(LayerNorm, lambda: _ln(bias=False), id="LayerNorm no bias"),
    pytest.param(LayerNorm, lambda: _ln().double(), id="LayerNorm float64"),
    pytest.param(RMSNorm, lambda: _rms(), id="RMSNorm eps None"),
    pytest.param(RMSNorm, lambda: _rms(eps=0.3), id="RMSNorm eps"),
    pytest.param(RMSNorm, lambda: _rms(elementwise_affine=False), id="RMSNorm no affine"),
]


@pytest.mark.parametrize("cls, make", NORM_COPIED)
def test_norm_from_torch_copies_exactly(cls, make):
    ref = make().train(False)
    ours = cls.from_torch(ref)
    dtype = next(ref.parameters(), torch.empty(0)).dtype
    x = r(3, 8).to(dtype) * 3 + 1
    assert max_abs_diff(ours(x), ref(x)) <= 1e-6
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in ref.named_parameters()]
    assert ours.eps == ref.eps and ours.training is False


NORM_REFUSED = [
    pytest.param(lambda: LayerNorm.from_torch(nn.Linear(2, 2)), InputTypeError,
                 "module must be an nn.LayerNorm, got Linear", id="LayerNorm of Linear"),
    pytest.param(lambda: RMSNorm.from_torch(nn.LayerNorm(4)), InputTypeError,
                 "module must be an nn.RMSNorm, got LayerNorm", id="RMSNorm of LayerNorm"),
    pytest.param(lambda: LayerNorm.from_torch(nn.LayerNorm((2, 4))), ValueError,
                 "over the last 2 dims (2, 4)", id="LayerNorm 2 dims"),
    pytest.param(lambda: RMSNorm.from_torch(nn.RMSNorm((2, 4))), ValueError,
                 "over the last 2 dims (2, 4)", id="RMSNorm 2 dims"),
]


@pytest.mark.parametrize("call, exc, phrase", NORM_REFUSED)
def test_norm_from_torch_refuses_what_it_cannot_copy(call, exc, phrase):
    with pytest.raises(exc) as info:
        call()
    assert phrase in str(info.value)


def test_broadcast_shape_follows_torch():
    """The plain-Python broadcast rule used by the checks agrees with torch.broadcast_shapes,
    including sizes 0 and 1, and shapes that do not broadcast (None where torch raises)."""
    from utils._validation import broadcast_shape

    rng = random.Random(0)
    for _ in range(5000):
        shapes = [tuple(rng.choice([0, 1, 2, 3]) for _ in range(rng.randint(0, 4)))
                  for _ in range(rng.randint(1, 3))]
        try:
            expected = tuple(torch.broadcast_shapes(*shapes))
        except RuntimeError:
            expected = None
        assert broadcast_shape(*shapes) == expected, shapes
    assert broadcast_shape() == ()


def test_module_dtype_device_finds_the_first_parameter_of_parameters():
    """The submodule walk of the checks finds the parameter ``module.parameters()`` yields first
    among the floating-point ones, in nested, shared, integer-first and parameter-free modules."""
    from utils._validation import module_dtype_device
    from utils.models import DecoderOnlyLM

    def expected(m):
        first = next((p for p in m.parameters() if p.is_floating_point()), None)
        return None if first is None else (first.dtype, first.device)

    shared = nn.Linear(2, 2).double()
    odd = nn.Module()
    odd.counts = nn.Parameter(torch.zeros(3, dtype=torch.long), requires_grad=False)
    odd.empty = None
    odd.inner = nn.Sequential(nn.ReLU(), nn.Linear(2, 2).to(torch.float16))
    modules = [nn.Linear(3, 3), nn.Sequential(nn.ReLU(), shared, shared, nn.Linear(2, 2)),
               nn.ReLU(), nn.Sequential(), odd, DecoderOnlyLM(11, d_model=8, nhead=2,
                                                             num_layers=1, max_len=8).double()]
    for m in modules:
        for sub in m.modules():
            assert module_dtype_device(sub) == expected(sub), sub


def test_dropout_is_skipped_only_in_evaluation_mode():
    """`apply_dropout` returns its input itself in eval mode and drops in training mode."""
    from utils._validation import apply_dropout

    drop = nn.Dropout(0.5)
    x = torch.ones(1000)
    assert apply_dropout(drop.eval(), x) is x
    torch.manual_seed(0)
    y = apply_dropout(drop.train(), x)
    assert set(y.unique().tolist()) == {0.0, 2.0}
