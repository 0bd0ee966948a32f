"""Tests for utils.models: the encoder-decoder, decoder-only and encoder-only models."""

import math

import pytest
import torch
from torch import nn

from utils import seed_everything
from utils.data import BOS, PAD
from utils.masks import causal_mask
from utils.models import DecoderOnlyLM, EncoderOnlyMLM, InputEmbedding, Seq2SeqTransformer
from utils.positional import sinusoidal_encoding
from utils.transformer import Transformer

V = 11


@pytest.fixture(autouse=True)
def _seed():
    seed_everything(0)


def _src_tgt():
    src = torch.tensor([[3, 4, 5, 6], [7, 8, PAD, PAD], [9, 3, 4, PAD]])
    tgt = torch.tensor([[BOS, 6, 5, 4, 3], [BOS, 8, 7, PAD, PAD], [BOS, 4, 3, 9, PAD]])
    return src, src != PAD, tgt, tgt != PAD


def test_token_embedding_is_scaled_embedding_plus_positions():
    emb = InputEmbedding(V, 8, max_len=10)
    tokens = torch.tensor([[3, 4, 5], [6, 7, 0]])
    expected = emb.weight[tokens] * math.sqrt(8) + sinusoidal_encoding(10, 8)[:3]
    assert torch.allclose(emb(tokens), expected)
    plain = InputEmbedding(V, 8, positional=False)
    assert torch.allclose(plain(tokens), plain.weight[tokens] * math.sqrt(8))
    # Scaled entries have about unit size, like the positional encoding's.
    assert 0.7 < (emb.weight * math.sqrt(8)).std().item() < 1.3


def test_seq2seq_matches_torch_transformer():
    """With nn.Transformer's weights copied in, the model computes what torch computes."""
    ref = nn.Transformer(16, 2, 1, 1, 32, dropout=0.0, batch_first=True)
    model = Seq2SeqTransformer(V, V, d_model=16, nhead=2, dim_feedforward=32)
    model.transformer = Transformer.from_torch(ref)
    src, src_mask, tgt, tgt_mask = _src_tgt()
    logits = model(src, tgt, src_mask, tgt_mask)
    out = ref(model.src_embed(src), model.tgt_embed(tgt),
              tgt_mask=~causal_mask(tgt.shape[1]),  # torch: True = may NOT attend
              src_key_padding_mask=~src_mask, tgt_key_padding_mask=~tgt_mask,
              memory_key_padding_mask=~src_mask)
    expected = out @ model.tgt_embed.weight.T + model.head.bias
    assert logits.shape == (3, 5, V)
    assert (logits - expected)[tgt_mask].abs().max() < 1e-5


def test_seq2seq_is_causal_and_ignores_source_padding():
    model = Seq2SeqTransformer(V, V, d_model=16, nhead=2)
    src, src_mask, tgt, tgt_mask = _src_tgt()
    base = model(src, tgt, src_mask, tgt_mask)
    later = tgt.clone()
    later[:, 3] = 10  # change position 3 of every target
    changed = model(src, later, src_mask, tgt_mask)
    assert torch.allclose(base[:, :3], changed[:, :3], atol=1e-6)
    assert not torch.allclose(base[:, 3:], changed[:, 3:], atol=1e-3)
    noisy = src.masked_fill(~src_mask, 10)  # different tokens under the padding
    assert torch.allclose(base, model(noisy, tgt, src_mask, tgt_mask), atol=1e-6)
    # Without the source mask, the padding leaks into the output.
    assert not torch.allclose(model(src, tgt), model(noisy, tgt), atol=1e-3)


def test_seq2seq_output_does_not_depend_on_how_much_source_padding():
    # Chapter 9's exercise on the memory mask relies on this: with the source padding mask,
    # padding a batch further changes nothing at the real positions.
    model = Seq2SeqTransformer(V, V, d_model=16, nhead=2).eval()
    src, src_mask, tgt, tgt_mask = _src_tgt()
    more = 5
    src_long = torch.cat([src, torch.full((src.shape[0], more), PAD)], dim=1)
    mask_long = torch.cat([src_mask, torch.zeros(src.shape[0], more, dtype=torch.bool)], dim=1)
    with torch.no_grad():
        base = model(src, tgt, src_mask, tgt_mask)
        padded = model(src_long, tgt, mask_long, tgt_mask)
        unmasked = model(src_long, tgt, None, tgt_mask), model(src, tgt, None, tgt_mask)
    assert torch.allclose(base, padded, atol=1e-5)
    # Without the mask, more padding means more keys that take weight: the output moves.
    assert not torch.allclose(*unmasked, atol=1e-3)


def test_seq2seq_output_tying_and_sharing():
    tied = Seq2SeqTransformer(V, V, d_model=16, nhead=2)
    untied = Seq2SeqTransformer(V, V, d_model=16, nhead=2, tie_output=False)
    shared = Seq2SeqTransformer(V, V, d_model=16, nhead=2, share_embeddings=True)

    def count(m):
        return sum(p.numel() for p in m.parameters())

    assert count(untied) - count(tied) == V * 16  # the projection's matrix (its bias is in both)
    assert count(tied) - count(shared) == V * 16  # one embedding table fewer
    assert shared.src_embed is shared.tgt_embed
    src, src_mask, tgt, tgt_mask = _src_tgt()
    tied(src, tgt, src_mask, tgt_mask).sum().backward()
    assert tied.tgt_embed.weight.grad is not None  # reached through the embedding and the head
    with pytest.raises(ValueError, match="equal vocabularies"):
        Seq2SeqTransformer(V, V + 1, share_embeddings=True)


def test_encode_decode_equal_forward():
    model = Seq2SeqTransformer(V, V, d_model=16, nhead=2, num_encoder_layers=2,
                               num_decoder_layers=2)
    src, src_mask, tgt, tgt_mask = _src_tgt()
    memory = model.encode(src, src_mask)
    assert memory.shape == (3, 4, 16)
    assert torch.equal(model.decode(tgt, memory, src_mask, tgt_mask),
                       model(src, tgt, src_mask, tgt_mask))


def test_decoder_only_is_causal_and_padding_free():
    model = DecoderOnlyLM(V, d_model=16, nhead=2, num_layers=2)
    tokens = torch.tensor([[BOS, 3, 4, 5, 6], [BOS, 7, 8, PAD, PAD]])
    base = model(tokens)
    assert base.shape == (2, 5, V)
    later = tokens.clone()
    later[:, 3:] = 9
    assert torch.allclose(base[:, :3], model(later)[:, :3], atol=1e-6)
    # Right padding is invisible to real tokens even without a padding mask.
    mask = tokens != PAD
    assert torch.allclose(base[mask], model(tokens, mask)[mask], atol=1e-6)
    assert torch.allclose(model(tokens[1:, :3]), base[1:, :3], atol=1e-6)


def test_encoder_only_sees_both_ways_but_not_padding():
    model = EncoderOnlyMLM(V, d_model=16, nhead=2, num_layers=2)
    tokens = torch.tensor([[3, 4, 5, 6], [7, 8, PAD, PAD]])
    mask = tokens != PAD
    base = model(tokens, mask)
    later = tokens.clone()
    later[0, 3] = 9
    assert not torch.allclose(base[0, 0], model(later, mask)[0, 0], atol=1e-4)  # looks right
    noisy = tokens.masked_fill(~mask, 9)
    assert torch.allclose(base[mask], model(noisy, mask)[mask], atol=1e-6)
    assert torch.allclose(model(tokens[1:, :2]), base[1:, :2], atol=1e-5)


@pytest.mark.parametrize("make", [
    lambda: Seq2SeqTransformer(V, V, d_model=16, nhead=2),
    lambda: DecoderOnlyLM(V, d_model=16, nhead=2, num_layers=1),
    lambda: EncoderOnlyMLM(V, d_model=16, nhead=2, num_layers=1),
])
def test_models_reject_bad_tokens(make):
    model = make()

    def run(tokens, mask=None):
        if isinstance(model, Seq2SeqTransformer):
            return model(tokens, torch.tensor([[BOS]] * tokens.shape[0]), mask)
        return model(tokens, mask)

    with pytest.raises(ValueError, match=r"ids must lie in \[0, 11\)"):
        run(torch.tensor([[3, 11]]))
    with pytest.raises(ValueError, match=r"\(B, L\)"):
        run(torch.tensor([3, 4]))
    with pytest.raises(ValueError, match="integer"):
        run(torch.tensor([[3.0, 4.0]]))
    with pytest.raises(ValueError, match="padding mask"):
        run(torch.tensor([[3, 4]]), torch.ones(1, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="max_len"):
        run(torch.full((1, 65), 3))


def test_model_arguments_are_checked():
    with pytest.raises(ValueError, match="even"):
        DecoderOnlyLM(V, d_model=15, nhead=3)
    with pytest.raises(ValueError, match="divisible"):
        EncoderOnlyMLM(V, d_model=16, nhead=3)
    with pytest.raises(ValueError, match="positive"):
        InputEmbedding(0, 8)
