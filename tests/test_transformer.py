"""utils.transformer: every layer and stack equals its torch.nn counterpart, and bad input fails.

PyTorch's Transformer modules take a "fast path" in eval mode when autograd is off: fused kernels
and, in nn.TransformerEncoder with a key padding mask, nested tensors that drop the padded
positions and give zeros there. Our modules compute every position. So each comparison is made
(a) on the slow path (autograd on), on every position, (b) on the fast path, on the real
positions only, and (c) with the fast path switched off, on every position.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from utils.attention import MultiHeadAttention, keep_attention_weights
from utils.costs import (
    count_parameters,
    encoder_layer_flops,
    transformer_param_breakdown,
    transformer_param_count,
)
from utils.layers import LayerNorm, PositionwiseFeedForward
from utils.masks import causal_mask, expand_mask, padding_mask
from utils.transformer import (
    Decoder,
    DecoderLayer,
    Encoder,
    EncoderLayer,
    Transformer,
    share_layers,
)

# torch warns that nested tensors are a prototype, and that a pre-LN encoder cannot use them.
pytestmark = [
    pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning"),
    pytest.mark.filterwarnings("ignore:enable_nested_tensor is True:UserWarning"),
]

TOL = 1e-5
D, H, FF = 16, 4, 24
CONFIGS = list(itertools.product([False, True], ["relu", "gelu"]))
IDS = [f"{'preLN' if nf else 'postLN'}-{act}" for nf, act in CONFIGS]

SRC_LENGTHS = [6, 4, 1]  # B = 3, L_s = 6: one full row, one padded, one with a single token
TGT_LENGTHS = [5, 2, 3]  # L_t = 5


@pytest.fixture
def no_fastpath():
    """Switch torch's MHA/Transformer fast path off for one test, then restore it."""
    before = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    yield
    torch.backends.mha.set_fastpath_enabled(before)


def max_diff(a: torch.Tensor, b: torch.Tensor, where: torch.Tensor | None = None) -> float:
    if where is not None:
        a, b = a[where], b[where]
    return (a - b).abs().max().item()


def enc_layer(nf: bool, act: str, dropout: float = 0.0) -> nn.TransformerEncoderLayer:
    return nn.TransformerEncoderLayer(D, H, FF, dropout=dropout, activation=act,
                                      batch_first=True, norm_first=nf)


def dec_layer(nf: bool, act: str, dropout: float = 0.0) -> nn.TransformerDecoderLayer:
    return nn.TransformerDecoderLayer(D, H, FF, dropout=dropout, activation=act,
                                      batch_first=True, norm_first=nf)


def src_data(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(3, 6, D, generator=g), padding_mask(SRC_LENGTHS, 6)


def tgt_data(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(3, 5, D, generator=g), padding_mask(TGT_LENGTHS, 5)


# ---------------------------------------------------------------------------------------------
# Encoder layer and stack
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("nf,act", CONFIGS, ids=IDS)
@pytest.mark.parametrize("padded", [False, True], ids=["nomask", "padded"])
def test_encoder_layer_matches_torch(nf, act, padded):
    torch.manual_seed(0)
    ref = enc_layer(nf, act).eval()
    ours = EncoderLayer.from_torch(ref)
    x, pad = src_data()
    kpm = ~pad if padded else None
    mask = pad if padded else None
    # (a) slow path: autograd on, every position
    assert max_diff(ref(x, src_key_padding_mask=kpm), ours(x, mask)) < TOL
    # (b) fast path: real positions only
    with torch.no_grad():
        assert max_diff(ref(x, src_key_padding_mask=kpm), ours(x, mask), pad) < TOL


@pytest.mark.parametrize("nf,act", CONFIGS, ids=IDS)
@pytest.mark.parametrize("final_norm", [False, True], ids=["nonorm", "norm"])
def test_encoder_matches_torch(nf, act, final_norm):
    torch.manual_seed(0)
    norm = nn.LayerNorm(D) if final_norm else None
    # enable_nested_tensor is left at its default (True): the nested path is the one users hit.
    ref = nn.TransformerEncoder(enc_layer(nf, act), num_layers=2, norm=norm).eval()
    ours = Encoder.from_torch(ref)
    assert len(ours.layers) == 2 and (ours.norm is not None) == final_norm
    x, pad = src_data()
    for kpm, mask in ((None, None), (~pad, pad)):
        assert max_diff(ref(x, src_key_padding_mask=kpm), ours(x, mask)) < TOL
        with torch.no_grad():  # fast path: nested tensors give zeros at padded positions
            assert max_diff(ref(x, src_key_padding_mask=kpm), ours(x, mask), pad) < TOL


@pytest.mark.parametrize("nf,act", CONFIGS, ids=IDS)
def test_encoder_without_fastpath_every_position(nf, act, no_fastpath):
    torch.manual_seed(0)
    ref = nn.TransformerEncoder(enc_layer(nf, act), 2, norm=nn.LayerNorm(D),
                                enable_nested_tensor=False).eval()
    ours = Encoder.from_torch(ref)
    x, pad = src_data()
    with torch.no_grad():
        assert max_diff(ref(x, src_key_padding_mask=~pad), ours(x, pad)) < TOL


@pytest.mark.parametrize("nf,act", CONFIGS, ids=IDS)
def test_encoder_with_full_attention_masks(nf, act):
    """Attention masks, shared (L, L) and per example (B, L, L), against torch's attn_mask."""
    torch.manual_seed(0)
    ref = nn.TransformerEncoder(enc_layer(nf, act), 2, enable_nested_tensor=False).eval()
    ours = Encoder.from_torch(ref)
    x, pad = src_data()
    causal = causal_mask(6)
    # shared: torch's bool attn_mask is True where attention is NOT allowed
    assert max_diff(ref(x, mask=~causal), ours(x, causal)) < TOL
    # the same as an additive float mask
    float_mask = nn.Transformer.generate_square_subsequent_mask(6)
    assert max_diff(ref(x, mask=float_mask), ours(x, causal)) < TOL
    # per example: causal and padding together; torch wants (B * h, L, L)
    per_example = causal[None] & pad[:, None, :]  # (B, L, L)
    torch_mask = (~per_example).repeat_interleave(H, dim=0)
    assert max_diff(ref(x, mask=torch_mask), ours(x, per_example)) < TOL
    # 4-dim form gives the same as the 3-dim one
    assert max_diff(ours(x, per_example[:, None]), ours(x, per_example)) == 0.0


# ---------------------------------------------------------------------------------------------
# Decoder layer and stack
# ---------------------------------------------------------------------------------------------

def decoder_masks():
    _, src_pad = src_data()
    _, tgt_pad = tgt_data()
    causal = causal_mask(5)
    ours = {"tgt_mask": causal[None] & tgt_pad[:, None, :], "memory_mask": src_pad}
    ref = {"tgt_mask": ~causal, "tgt_key_padding_mask": ~tgt_pad,
           "memory_key_padding_mask": ~src_pad}
    return ours, ref, tgt_pad


@pytest.mark.parametrize("nf,act", CONFIGS, ids=IDS)
def test_decoder_layer_matches_torch(nf, act):
    torch.manual_seed(0)
    ref = dec_layer(nf, act).eval()
    ours = DecoderLayer.from_torch(ref)
    memory, _ = src_data()
    y, _ = tgt_data()
    assert max_diff(ref(y, memory), ours(y, memory)) < TOL
    m_ours, m_ref, tgt_pad = decoder_masks()
    assert max_diff(ref(y, memory, **m_ref), ours(y, memory, **m_ours)) < TOL
    with torch.no_grad():
        assert max_diff(ref(y, memory, **m_ref), ours(y, memory, **m_ours), tgt_pad) < TOL
    # only a causal mask, shared by the batch, given as (L_t, L_t)
    causal = causal_mask(5)
    assert max_diff(ref(y, memory, tgt_mask=~causal), ours(y, memory, tgt_mask=causal)) < TOL


@pytest.mark.parametrize("nf,act", CONFIGS, ids=IDS)
def test_decoder_matches_torch(nf, act):
    torch.manual_seed(0)
    ref = nn.TransformerDecoder(dec_layer(nf, act), 2, norm=nn.LayerNorm(D)).eval()
    ours = Decoder.from_torch(ref)
    memory, _ = src_data()
    y, _ = tgt_data()
    m_ours, m_ref, tgt_pad = decoder_masks()
    assert max_diff(ref(y, memory), ours(y, memory)) < TOL
    assert max_diff(ref(y, memory, **m_ref), ours(y, memory, **m_ours)) < TOL
    with torch.no_grad():
        assert max_diff(ref(y, memory, **m_ref), ours(y, memory, **m_ours), tgt_pad) < TOL
    ref_plain = nn.TransformerDecoder(dec_layer(nf, act), 2).eval()
    assert Decoder.from_torch(ref_plain).norm is None


# ---------------------------------------------------------------------------------------------
# The whole Transformer
# ---------------------------------------------------------------------------------------------

def small_torch_transformer(nf: bool, act: str, dropout: float = 0.0) -> nn.Transformer:
    return nn.Transformer(D, H, num_encoder_layers=2, num_decoder_layers=3, dim_feedforward=FF,
                          dropout=dropout, activation=act, batch_first=True, norm_first=nf)


@pytest.mark.parametrize("nf,act", CONFIGS, ids=IDS)
def test_transformer_matches_torch(nf, act):
    torch.manual_seed(0)
    ref = small_torch_transformer(nf, act).eval()
    ours = Transformer.from_torch(ref)
    assert len(ours.encoder.layers) == 2 and len(ours.decoder.layers) == 3
    src, src_pad = src_data()
    tgt, tgt_pad = tgt_data()
    causal = causal_mask(5)
    assert max_diff(ref(src, tgt), ours(src, tgt)) < TOL
    kw_ref = dict(tgt_mask=~causal, src_key_padding_mask=~src_pad,
                  tgt_key_padding_mask=~tgt_pad, memory_key_padding_mask=~src_pad)
    kw_ours = dict(src_mask=src_pad, tgt_mask=causal[None] & tgt_pad[:, None, :],
                   memory_mask=src_pad)
    assert max_diff(ref(src, tgt, **kw_ref), ours(src, tgt, **kw_ours)) < TOL
    with torch.no_grad():
        assert max_diff(ref(src, tgt, **kw_ref), ours(src, tgt, **kw_ours), tgt_pad) < TOL
    # encode + decode is forward
    memory = ours.encode(src, src_pad)
    out = ours.decode(tgt, memory, causal, src_pad)
    assert max_diff(out, ours(src, tgt, src_pad, causal, src_pad)) == 0.0


@pytest.mark.parametrize("nf,act", CONFIGS, ids=IDS)
def test_train_mode_with_zero_dropout_matches(nf, act):
    torch.manual_seed(0)
    ref = small_torch_transformer(nf, act, dropout=0.0).train()
    ours = Transformer.from_torch(ref)
    assert ours.training
    src, src_pad = src_data()
    tgt, _ = tgt_data()
    causal = causal_mask(5)
    a = ref(src, tgt, tgt_mask=~causal, src_key_padding_mask=~src_pad,
            memory_key_padding_mask=~src_pad)
    b = ours(src, tgt, src_mask=src_pad, tgt_mask=causal, memory_mask=src_pad)
    assert max_diff(a, b) < TOL
    # the gradients agree too
    a.square().sum().backward()
    b.square().sum().backward()
    g_ref = ref.encoder.layers[0].linear1.weight.grad
    g_ours = ours.encoder.layers[0].ff.linear1.weight.grad
    assert max_diff(g_ref, g_ours) < 1e-4


def test_dropout_is_active_in_train_mode_only():
    torch.manual_seed(0)
    ref = small_torch_transformer(False, "relu", dropout=0.3)
    ours = Transformer.from_torch(ref)
    src, _ = src_data()
    tgt, _ = tgt_data()
    ours.train()
    assert max_diff(ours(src, tgt), ours(src, tgt)) > 1e-3
    ours.eval()
    ref.eval()
    assert max_diff(ours(src, tgt), ours(src, tgt)) == 0.0
    assert max_diff(ref(src, tgt), ours(src, tgt)) < TOL
    layer = ours.encoder.layers[0]
    assert layer.dropout1.p == layer.dropout2.p == layer.ff.dropout.p == 0.3
    assert layer.self_attn.dropout == 0.3


def test_from_torch_keeps_dtype_eps_and_mode():
    torch.manual_seed(0)
    ref = nn.TransformerEncoderLayer(D, H, FF, dropout=0.0, batch_first=True,
                                     layer_norm_eps=1e-6, dtype=torch.float64).eval()
    ours = EncoderLayer.from_torch(ref)
    assert not ours.training
    assert ours.norm1.eps == 1e-6 and ours.norm2.eps == 1e-6
    assert all(p.dtype == torch.float64 for p in ours.parameters())
    x = torch.randn(2, 4, D, dtype=torch.float64)
    assert max_diff(ref(x), ours(x)) < 1e-12


def test_from_torch_rejects_what_it_cannot_copy():
    with pytest.raises(ValueError, match="TransformerEncoderLayer"):
        EncoderLayer.from_torch(nn.Linear(4, 4))
    with pytest.raises(ValueError, match="TransformerDecoderLayer"):
        DecoderLayer.from_torch(enc_layer(False, "relu"))
    with pytest.raises(ValueError, match="TransformerEncoder"):
        Encoder.from_torch(enc_layer(False, "relu"))
    with pytest.raises(ValueError, match="nn.Transformer"):
        Transformer.from_torch(nn.TransformerEncoder(enc_layer(False, "relu"), 1,
                                                     enable_nested_tensor=False))
    with pytest.raises(ValueError, match="no layers"):
        Decoder.from_torch(nn.TransformerDecoder(dec_layer(False, "relu"), 0))
    with pytest.raises(ValueError, match="bias"):
        EncoderLayer.from_torch(nn.TransformerEncoderLayer(D, H, FF, batch_first=True,
                                                           bias=False))
    with pytest.raises(ValueError, match="activation"):
        EncoderLayer.from_torch(nn.TransformerEncoderLayer(D, H, FF, batch_first=True,
                                                           activation=torch.tanh))


# ---------------------------------------------------------------------------------------------
# Construction, aliases, structure
# ---------------------------------------------------------------------------------------------

def test_built_from_the_book_pieces():
    layer = DecoderLayer(D, H, FF)
    assert isinstance(layer.self_attn, MultiHeadAttention)
    assert isinstance(layer.cross_attn, MultiHeadAttention)
    assert isinstance(layer.ff, PositionwiseFeedForward)
    assert all(isinstance(n, LayerNorm) for n in (layer.norm1, layer.norm2, layer.norm3))
    model = Transformer(D, H, 1, 1, FF)
    assert isinstance(model.encoder.norm, LayerNorm) and isinstance(model.decoder.norm, LayerNorm)
    assert Encoder(2, D, H, FF).norm is None
    assert isinstance(Encoder(2, D, H, FF, final_norm=True).norm, LayerNorm)


def test_aliases():
    torch.manual_seed(0)
    a = EncoderLayer(D, nhead=H, dim_feedforward=FF)
    torch.manual_seed(0)
    b = EncoderLayer(D, num_heads=H, d_ff=FF)
    assert a.nhead == b.nhead == H and a.dim_feedforward == b.dim_feedforward == FF
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert Encoder(1, D, num_heads=2, d_ff=8).layers[0].ff.d_ff == 8
    assert Transformer(D, num_heads=2, d_ff=8).nhead == 2
    assert EncoderLayer(D, 4).dim_feedforward == 2048  # torch's default
    with pytest.raises(ValueError, match="disagree"):
        EncoderLayer(D, nhead=4, num_heads=2)
    with pytest.raises(ValueError, match="disagree"):
        EncoderLayer(D, 4, dim_feedforward=8, d_ff=16)
    with pytest.raises(ValueError, match="nhead"):
        EncoderLayer(D)


def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match="activation"):
        EncoderLayer(D, H, FF, activation="tanh")
    with pytest.raises(ValueError, match="divisible"):
        EncoderLayer(D, 5, FF)
    with pytest.raises(ValueError, match="dropout"):
        DecoderLayer(D, H, FF, dropout=1.0)
    with pytest.raises(ValueError, match="num_layers"):
        Encoder(0, D, H, FF)


def test_stack_layers_are_independent():
    enc = Encoder(2, D, H, FF)
    assert enc.layers[0].ff.linear1.weight is not enc.layers[1].ff.linear1.weight
    assert not torch.equal(enc.layers[0].ff.linear1.weight, enc.layers[1].ff.linear1.weight)


# ---------------------------------------------------------------------------------------------
# Masks and shapes
# ---------------------------------------------------------------------------------------------

def test_expand_mask_rule():
    pad = padding_mask([3, 1], 4)  # (B=2, L=4)
    assert expand_mask(pad, 2, 4, 4).shape == (2, 1, 1, 4)
    assert expand_mask(causal_mask(4), 2, 4, 4).shape == (1, 1, 4, 4)
    assert expand_mask(pad[:, None, :], 2, 4, 4).shape == (2, 1, 1, 4)
    assert expand_mask(torch.ones(2, 3, 4, 4, dtype=torch.bool), 2, 4, 4).shape == (2, 3, 4, 4)
    assert expand_mask(None, 2, 4, 4) is None
    # cross-attention: (B, L_k) and (L_q, L_k) differ when B != L_q
    assert expand_mask(padding_mask([2, 5], 5), 2, 3, 5).shape == (2, 1, 1, 5)
    assert expand_mask(torch.ones(3, 5, dtype=torch.bool), 2, 3, 5).shape == (1, 1, 3, 5)
    with pytest.raises(ValueError, match="ambiguous"):
        expand_mask(causal_mask(4), 4, 4, 4)
    with pytest.raises(ValueError, match="padding mask"):
        expand_mask(torch.ones(3, 4, dtype=torch.bool), 2, 4, 4)
    with pytest.raises(ValueError, match="bool"):
        expand_mask(pad.float(), 2, 4, 4)
    with pytest.raises(ValueError, match="2, 3 or 4 dims"):
        expand_mask(torch.ones(4, dtype=torch.bool), 2, 4, 4)
    with pytest.raises(ValueError, match=r"\(B, L_q, L_k\)"):
        expand_mask(torch.ones(3, 4, 4, dtype=torch.bool), 2, 4, 4)


def test_padding_mask_equals_its_explicit_forms():
    torch.manual_seed(0)
    layer = EncoderLayer(D, H, FF, dropout=0.0).eval()
    x, pad = src_data()
    out = layer(x, pad)
    assert torch.equal(out, layer(x, pad[:, None, :]))
    assert torch.equal(out, layer(x, pad[:, None, None, :]))
    # padding changes nothing at the real positions of a sequence that has no padding
    assert max_diff(layer(x[:1]), out[:1]) < 1e-6
    # and what sits at padded positions does not reach the real ones
    x2 = x.clone()
    x2[~pad] = 100.0
    assert max_diff(layer(x2, pad), out, pad) < 1e-5


def test_fully_masked_rows_give_no_nan():
    layer = EncoderLayer(D, H, FF, dropout=0.0).eval()
    x = torch.randn(2, 4, D)
    out = layer(x, padding_mask([4, 0], 4))
    assert torch.isfinite(out).all()


def test_bad_shapes_raise():
    layer = EncoderLayer(D, H, FF)
    with pytest.raises(ValueError, match=r"\(B, L, d_model=16\)"):
        layer(torch.randn(4, D))
    with pytest.raises(ValueError, match=r"d_model=16"):
        layer(torch.randn(2, 4, D + 1))
    with pytest.raises(ValueError, match="mask"):
        layer(torch.randn(2, 4, D), torch.ones(2, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="ambiguous"):
        layer(torch.randn(4, 4, D), causal_mask(4))
    dec = DecoderLayer(D, H, FF)
    with pytest.raises(ValueError, match="batch size"):
        dec(torch.randn(2, 3, D), torch.randn(3, 5, D))
    with pytest.raises(ValueError, match="memory"):
        dec(torch.randn(2, 3, D), torch.randn(2, 5))
    with pytest.raises(ValueError, match="memory_mask"):
        dec(torch.randn(2, 3, D), torch.randn(2, 5, D), memory_mask=torch.ones(2, 4).bool())
    with pytest.raises(ValueError, match="tgt_mask"):
        Decoder(1, D, H, FF)(torch.randn(2, 3, D), torch.randn(2, 5, D),
                             tgt_mask=torch.ones(4, 4).bool())
    model = Transformer(D, H, 1, 1, FF)
    with pytest.raises(ValueError, match="batch size"):
        model(torch.randn(2, 3, D), torch.randn(3, 3, D))
    with pytest.raises(ValueError, match="src"):
        model(torch.randn(2, 3, 8), torch.randn(2, 3, D))


# ---------------------------------------------------------------------------------------------
# Parameter and FLOP counts
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("d,h,ff,ne,nd", [(16, 4, 24, 2, 3), (32, 8, 128, 1, 1), (8, 2, 8, 0, 2)])
def test_param_count_formula_matches_torch(d, h, ff, ne, nd):
    with torch.device("meta"):  # shapes without memory: counting needs no values
        ref = nn.Transformer(d, h, ne, nd, ff, batch_first=True)
        ours = Transformer(d, h, max(ne, 1), max(nd, 1), ff)
    assert count_parameters(ref) == transformer_param_count(d, h, ff, ne, nd)
    if ne and nd:
        assert count_parameters(ours) == count_parameters(ref)
    vocab = 50
    emb = nn.Embedding(vocab, d, device="meta")
    assert (transformer_param_count(d, h, ff, ne, nd, vocab, tied=True)
            == count_parameters(ref) + count_parameters(emb))
    assert (transformer_param_count(d, h, ff, ne, nd, vocab, tied=False)
            == count_parameters(ref) + 3 * count_parameters(emb))


def test_param_breakdown_matches_the_modules():
    d, h, ff = 16, 4, 24
    model = Transformer(d, h, 2, 3, ff)
    parts = transformer_param_breakdown(d, h, ff, 2, 3)
    by_type = {"attention": 0, "feed_forward": 0, "layer_norm": 0}
    for m in model.modules():
        if isinstance(m, MultiHeadAttention):
            by_type["attention"] += count_parameters(m)
        elif isinstance(m, PositionwiseFeedForward):
            by_type["feed_forward"] += count_parameters(m)
        elif isinstance(m, LayerNorm):
            by_type["layer_norm"] += count_parameters(m)
    assert parts == {"embeddings": 0, **by_type}
    assert sum(parts.values()) == count_parameters(model)


def test_paper_sizes():
    base = transformer_param_count(512, 8, 2048, 6, 6, 37000)
    big = transformer_param_count(1024, 16, 4096, 6, 6, 37000)
    assert 60e6 < base < 66e6  # the paper reports 65M
    assert 210e6 < big < 216e6  # the paper reports 213M
    with pytest.raises(ValueError, match="divisible"):
        transformer_param_count(512, 7, 2048, 6, 6)


def test_count_parameters_counts_shared_once():
    emb = nn.Embedding(10, 4)
    proj = nn.Linear(4, 10, bias=False)
    proj.weight = emb.weight
    assert count_parameters(nn.ModuleList([emb, proj])) == 40
    proj2 = nn.Linear(4, 3)
    proj2.weight.requires_grad_(False)
    assert count_parameters(proj2, trainable_only=True) == 3


@pytest.mark.parametrize("length", [4, 12])
def test_encoder_layer_flops_match_flop_counter(length):
    d, ff = 16, 40
    # The from-scratch attention, whose two matmuls the counter sees (it has no formula for the
    # fused CPU kernel of the default path).
    layer = keep_attention_weights(EncoderLayer(d, 4, ff, dropout=0.0).eval())
    x = torch.randn(1, length, d)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        layer(x)
    assert counter.get_total_flops() == sum(encoder_layer_flops(length, d, ff).values())
    f = encoder_layer_flops(length, d, ff)
    assert f["attention_scores"] == 4 * length**2 * d
    with pytest.raises(ValueError):
        encoder_layer_flops(0, d, ff)


@pytest.mark.parametrize("norm_first", [False, True])
def test_share_layers_is_one_layer_applied_n_times(norm_first):
    torch.manual_seed(0)
    enc = share_layers(Encoder(4, 16, 4, 32, dropout=0.0, norm_first=norm_first, final_norm=True))
    assert all(layer is enc.layers[0] for layer in enc.layers)
    one_layer = count_parameters(enc.layers[0])
    assert count_parameters(enc) == one_layer + 2 * 16                 # + the final norm
    assert count_parameters(Encoder(4, 16, 4, 32, final_norm=True)) == 4 * one_layer + 2 * 16
    x, pad = torch.randn(2, 5, 16), padding_mask([5, 3], 5)
    h = x
    for _ in range(4):
        h = enc.layers[0](h, pad)
    assert torch.equal(enc(x, pad), enc.norm(h))
    # The gradient of a shared weight is the sum over its four applications: nonzero, finite.
    enc(x, pad).sum().backward()
    grad = enc.layers[0].ff.linear1.weight.grad
    assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0
    assert share_layers(enc) is enc and count_parameters(enc) == one_layer + 2 * 16


def test_share_layers_decoder_and_bad_input():
    torch.manual_seed(0)
    dec = share_layers(Decoder(3, 16, 4, 32, dropout=0.0))
    y, memory = torch.randn(2, 4, 16), torch.randn(2, 6, 16)
    h = y
    for _ in range(3):
        h = dec.layers[0](h, memory, causal_mask(4))
    assert torch.equal(dec(y, memory, causal_mask(4)), h)
    assert count_parameters(dec) == count_parameters(dec.layers[0])
    with pytest.raises(TypeError, match="stack"):
        share_layers(EncoderLayer(16, 4, 32))
