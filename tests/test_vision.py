"""Tests of utils.vision: patches, the patch embedding and the vision Transformer."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from utils._validation import InputTypeError
from utils.attention import keep_attention_weights
from utils.vision import PatchEmbedding, VisionTransformer, patchify, unpatchify


@pytest.mark.parametrize(("c", "h", "w", "p"), [(1, 8, 8, 2), (3, 8, 12, 4), (2, 6, 6, 1),
                                                (1, 8, 8, 8), (3, 10, 4, 2)])
def test_patchify_matches_unfold_and_inverts(c, h, w, p):
    x = torch.randn(2, c, h, w)
    patches = patchify(x, p)
    assert patches.shape == (2, (h // p) * (w // p), c * p * p)
    torch.testing.assert_close(patches, F.unfold(x, p, stride=p).transpose(1, 2), atol=0, rtol=0)
    assert torch.equal(unpatchify(patches, p, h, w), x)


def test_patch_order_is_row_major_and_channel_first():
    x = torch.arange(2 * 4 * 4).reshape(1, 2, 4, 4)
    patches = patchify(x, 2)
    # patch 1 is the top row's second patch: columns 2-3 of rows 0-1, channel 0 then channel 1
    assert patches[0, 1].tolist() == [2, 3, 6, 7, 18, 19, 22, 23]
    assert patches[0, 2].tolist()[:4] == [8, 9, 12, 13]


def test_patchify_errors():
    with pytest.raises(ValueError, match=r"divisible by patch_size=3.*\(1, 1, 8, 8\)"):
        patchify(torch.randn(1, 1, 8, 8), 3)
    with pytest.raises(ValueError, match=r"\(B, C, H, W\)"):
        patchify(torch.randn(8, 8), 2)
    with pytest.raises(InputTypeError):
        patchify(torch.randn(1, 1, 8, 8), 2.0)
    with pytest.raises(InputTypeError):
        patchify([[1.0]], 1)
    with pytest.raises(ValueError, match=r"N=16"):
        unpatchify(torch.randn(1, 15, 4), 2, 8, 8)
    with pytest.raises(ValueError, match="multiples of patch_size=3"):
        unpatchify(torch.randn(1, 4, 9), 3, 8, 8)


def test_patch_embedding_from_torch_equals_conv2d():
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 16, kernel_size=4, stride=4)
    emb = PatchEmbedding.from_torch(conv)
    x = torch.randn(2, 3, 8, 12)
    expected = conv(x).flatten(2).transpose(1, 2)                # (B, N, d_model)
    torch.testing.assert_close(emb(x), expected, atol=1e-5, rtol=0)


def test_patch_embedding_refuses_other_convolutions():
    with pytest.raises(ValueError, match="stride"):
        PatchEmbedding.from_torch(nn.Conv2d(1, 4, 4, stride=2))
    with pytest.raises(ValueError, match="padding"):
        PatchEmbedding.from_torch(nn.Conv2d(1, 4, 2, stride=2, padding=1))
    with pytest.raises(InputTypeError):
        PatchEmbedding.from_torch(nn.Linear(4, 4))
    emb = PatchEmbedding(3, 2, 8)
    with pytest.raises(ValueError, match=r"C=3"):
        emb(torch.randn(1, 1, 4, 4))


def test_vit_shapes_and_class_attention():
    torch.manual_seed(0)
    vit = VisionTransformer(8, 2, 1, 10, d_model=16, num_heads=4, num_layers=2, d_ff=32)
    with pytest.raises(RuntimeError, match="forward pass"):
        vit.class_attention()
    x = torch.randn(5, 1, 8, 8)
    logits = vit(x)
    assert logits.shape == (5, 10)
    with pytest.raises(RuntimeError, match="keep_attention_weights"):
        vit.class_attention()  # the default fast path keeps no weights
    keep_attention_weights(vit)
    torch.testing.assert_close(vit(x), logits, atol=1e-5, rtol=1e-4)
    assert vit.tokens(x).shape == (5, 17, 16)
    att = vit.class_attention()
    assert att.shape == (5, 4, 4, 4)
    assert torch.all(att >= 0) and torch.all(att.sum((-2, -1)) <= 1 + 1e-6)
    assert vit.class_attention(0).shape == (5, 4, 4, 4)
    with pytest.raises(ValueError, match="layer"):
        vit.class_attention(2)


def test_vit_is_permutation_sensitive_through_positions_only():
    # Without its position vectors the encoder cannot tell where a patch came from: shuffling
    # the patches then leaves the class token's output unchanged.
    torch.manual_seed(0)
    vit = VisionTransformer(4, 2, 1, 3, d_model=8, num_heads=2, num_layers=1, d_ff=16).eval()
    with torch.no_grad():
        vit.pos.weight.zero_()
    x = torch.randn(2, 1, 4, 4)
    flipped = unpatchify(patchify(x, 2).flip(1), 2, 4, 4)       # patches reversed, each intact
    torch.testing.assert_close(vit(flipped), vit(x), atol=1e-5, rtol=0)


def test_vit_learns_a_trivial_task():
    torch.manual_seed(0)
    vit = VisionTransformer(4, 2, 1, 2, d_model=16, num_heads=2, num_layers=1, d_ff=32)
    x = torch.randn(64, 1, 4, 4)
    y = (x[:, 0, :2].sum((-1, -2)) > x[:, 0, 2:].sum((-1, -2))).long()   # top half brighter?
    opt = torch.optim.Adam(vit.parameters(), lr=1e-2)
    for _ in range(60):
        loss = F.cross_entropy(vit(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert (vit(x).argmax(-1) == y).float().mean() > 0.9


def test_vit_errors():
    with pytest.raises(ValueError, match="multiple of patch_size=3"):
        VisionTransformer(8, 3, 1, 10)
    vit = VisionTransformer(8, 4, 1, 10, d_model=8, num_heads=2, num_layers=1, d_ff=8)
    with pytest.raises(ValueError, match=r"\(B, C=1, H=8, W=8\)"):
        vit(torch.randn(2, 1, 4, 4))
    with pytest.raises(ValueError, match="4 dims"):
        vit(torch.randn(1, 8, 8))
    with pytest.raises(InputTypeError):
        vit(torch.randn(2, 1, 8, 8, dtype=torch.float64))
