"""Tests of the fast default path of the attention modules: `fused_attention` (PyTorch's fused
kernel behind the library's own checks and degenerate cases) and `MultiHeadAttention` /
`GroupedQueryAttention` with ``keep_weights=False`` (the default), each against the from-scratch
path the chapters teach (``keep_weights=True``), which tests/test_multi_head_attention.py checks
against ``nn.MultiheadAttention``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from utils._validation import InputTypeError
from utils.attention import (
    GroupedQueryAttention,
    MultiHeadAttention,
    keep_attention_weights,
    scaled_dot_product_attention,
)
from utils.fast_attention import fused_attention
from utils.kv_cache import KVCache

TOL = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.float64: dict(atol=1e-10, rtol=1e-9)}


def _mask(kind: str | None, b: int, l_q: int, l_k: int, g: torch.Generator):
    if kind is None:
        return None
    if kind == "causal":
        return torch.ones(l_q, l_k, dtype=torch.bool).tril(l_k - l_q)
    if kind == "padding":
        lengths = torch.randint(1, l_k + 1, (b,), generator=g)
        return torch.arange(l_k)[None, :] < lengths[:, None]  # (B, L_k)
    if kind == "random":
        return torch.rand(b, 1, l_q, l_k, generator=g) > 0.5
    if kind == "empty_rows":  # some queries see no key at all
        mask = torch.rand(b, l_q, l_k, generator=g) > 0.4
        mask[:, ::2, :] = False
        return mask
    raise AssertionError(kind)


MASKS = [None, "causal", "padding", "random", "empty_rows"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("mask_kind", MASKS)
def test_fused_attention_matches_plain(mask_kind, dtype):
    g = torch.Generator().manual_seed(0)
    for trial in range(6):
        b, h = (int(x) for x in torch.randint(1, 4, (2,), generator=g))
        l_q, l_k = (int(x) for x in torch.randint(1, 17, (2,), generator=g))
        if mask_kind == "causal":
            l_k = max(l_k, l_q)
        d_k, d_v = (int(x) for x in torch.randint(1, 9, (2,), generator=g))
        q = torch.randn(b, h, l_q, d_k, generator=g, dtype=dtype, requires_grad=True)
        k = torch.randn(b, h, l_k, d_k, generator=g, dtype=dtype, requires_grad=True)
        v = torch.randn(b, h, l_k, d_v, generator=g, dtype=dtype, requires_grad=True)
        mask = _mask(mask_kind, b, l_q, l_k, g)
        if mask_kind == "padding":
            mask = mask[:, None, None, :]
        elif mask_kind == "empty_rows":
            mask = mask[:, None]
        grad = torch.randn(b, h, l_q, d_v, generator=g, dtype=dtype)
        want = scaled_dot_product_attention(q, k, v, mask)[0]
        want_grads = torch.autograd.grad(want, (q, k, v), grad)
        got = fused_attention(q, k, v, mask)
        got_grads = torch.autograd.grad(got, (q, k, v), grad)
        torch.testing.assert_close(got, want, **TOL[dtype], msg=f"trial {trial}")
        for name, a, e in zip("qkv", got_grads, want_grads, strict=True):
            torch.testing.assert_close(a, e, **TOL[dtype], msg=f"grad {name}, trial {trial}")
        assert not torch.isnan(got).any()


def test_fused_attention_fully_masked_rows_and_degenerate_sizes():
    q, k, v = torch.randn(2, 4, 3), torch.randn(2, 5, 3), torch.randn(2, 5, 6)
    mask = torch.zeros(2, 4, 5, dtype=torch.bool)
    mask[0, 1, 2] = True
    out = fused_attention(q, k, v, mask)
    assert torch.equal(out[1], torch.zeros(4, 6)) and torch.equal(out[0, 0], torch.zeros(6))
    torch.testing.assert_close(out[0, 1], v[0, 2])
    assert fused_attention(q, k[:, :0], v[:, :0]).shape == (2, 4, 6)
    assert torch.equal(fused_attention(q, k[:, :0], v[:, :0]), torch.zeros(2, 4, 6))
    assert fused_attention(q[:0], k[:0], v[:0]).shape == (0, 4, 6)
    assert fused_attention(q[:, :0], k, v).shape == (2, 0, 6)
    # broadcast batch dimensions, as in scaled_dot_product_attention
    kb, vb = torch.randn(1, 5, 3), torch.randn(1, 5, 6)
    torch.testing.assert_close(fused_attention(q, kb, vb),
                               scaled_dot_product_attention(q, kb, vb)[0])


@pytest.mark.parametrize("mask_kind", ["causal", "padding", "random", "empty_rows"])
def test_fused_attention_is_bit_for_bit_the_open_and_zero_formula(mask_kind):
    """Where every query sees a key, `fused_attention` skips opening the empty rows and zeroing
    their outputs (three operations fewer). Skipping them must change no bit of the output or
    of any gradient, since the stored outputs of every chapter that trains depend on them."""
    g = torch.Generator().manual_seed(3)
    b, h, l_q, l_k, d = 6, 4, 7, 7, 8
    mask = _mask(mask_kind, b, l_q, l_k, g)
    mask = mask[:, None, None, :] if mask_kind == "padding" else mask
    if mask_kind == "empty_rows":
        mask = mask[:, None]
    if mask_kind == "random":
        mask[..., 0] = True  # every query sees a key
    w_o = torch.randn(h * d, 5, generator=g)
    grads = []
    for formula in (True, False):
        q, k, v = (torch.randn(b, h, n, d, generator=torch.Generator().manual_seed(i),
                               requires_grad=True) for i, n in enumerate((l_q, l_k, l_k)))
        if formula:
            has_key = mask.any(dim=-1, keepdim=True)
            out = nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=mask | ~has_key) * has_key
        else:
            out = fused_attention(q, k, v, mask)
        # as a module uses it: heads merged, then a projection
        (out.transpose(1, 2).reshape(b, l_q, h * d) @ w_o).square().sum().backward()
        grads.append((out.detach(), q.grad, k.grad, v.grad))
    for ours, formula in zip(grads[1], grads[0], strict=True):
        assert torch.equal(ours, formula)


def test_fused_attention_errors_are_the_plain_ones():
    q, k, v = torch.randn(2, 4, 3), torch.randn(2, 5, 3), torch.randn(2, 5, 6)
    for args, kwargs in [((q, k[..., :2], v), {}), ((q, k, v[:, :4]), {}),
                         ((q, k, v), {"mask": torch.ones(2, 4, 6, dtype=torch.bool)}),
                         ((q, k, v), {"dropout_p": 1.0})]:
        with pytest.raises(ValueError) as plain:
            scaled_dot_product_attention(*args, **kwargs)
        with pytest.raises(ValueError) as fused:
            fused_attention(*args, **kwargs)
        assert str(fused.value) == str(plain.value)
    with pytest.raises(InputTypeError):
        fused_attention(q, k, v, mask=torch.ones(2, 4, 5))


def _pair(cls, *args, bias=True, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    fast = cls(*args, bias=bias).to(dtype)
    slow = cls(*args, bias=bias, keep_weights=True).to(dtype)
    slow.load_state_dict(fast.state_dict())
    return fast, slow


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize("self_attention", [True, False])
@pytest.mark.parametrize("cls,heads", [(MultiHeadAttention, (16, 4)),
                                       (GroupedQueryAttention, (16, 4, 2))])
def test_module_fast_path_equals_from_scratch_path(cls, heads, self_attention, mask_kind, dtype):
    g = torch.Generator().manual_seed(3)
    for bias in (True, False):
        fast, slow = _pair(cls, *heads, bias=bias, dtype=dtype)
        b, l_q = 3, 7
        l_k = l_q if self_attention else 5 + (mask_kind == "causal") * 4
        x = torch.randn(b, l_q, 16, generator=g, dtype=dtype)
        mem = x if self_attention else torch.randn(b, l_k, 16, generator=g, dtype=dtype)
        mask = _mask(mask_kind, b, l_q, l_k, g)
        grad = torch.randn(b, l_q, 16, generator=g, dtype=dtype)
        outs, grads = [], []
        for module in (fast, slow):
            xi = x.clone().requires_grad_(True)
            mi = xi if self_attention else mem.clone().requires_grad_(True)
            out = module(xi, mi, mi, mask=mask)
            out.backward(grad)
            outs.append(out)
            grads.append([xi.grad, mi.grad] + [p.grad for p in module.parameters()])
        torch.testing.assert_close(outs[0], outs[1], **TOL[dtype])
        for a, e in zip(grads[0], grads[1], strict=True):
            torch.testing.assert_close(a, e, **TOL[dtype])
        assert fast.attn_weights is None
        assert slow.attn_weights is not None and slow.attn_weights.shape == (b, heads[1], l_q, l_k)


def test_fast_path_with_a_cache_equals_from_scratch_path():
    fast, slow = _pair(MultiHeadAttention, 16, 4)
    x = torch.randn(2, 6, 16)
    caches = (KVCache(), KVCache())
    for t in range(6):
        step = x[:, t:t + 1]
        a = fast(step, step, step, cache=caches[0])
        b = slow(step, step, step, cache=caches[1])
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)


def test_fast_path_matches_nn_multihead_attention():
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(32, 4, batch_first=True).eval()
    ours = MultiHeadAttention.from_torch(ref)
    assert ours.keep_weights is False
    x = torch.randn(3, 9, 32)
    pad = torch.rand(3, 9) > 0.2
    pad[:, 0] = True
    want = ref(x, x, x, key_padding_mask=~pad, need_weights=False)[0]
    torch.testing.assert_close(ours(x, x, x, mask=pad), want, atol=1e-5, rtol=1e-4)


def test_dropout_in_training_on_the_fast_path():
    fast = MultiHeadAttention(16, 4, dropout=0.5).train()
    x = torch.randn(2, 5, 16)
    torch.manual_seed(0)
    a = fast(x, x, x)
    torch.manual_seed(0)
    b = fast(x, x, x)
    torch.manual_seed(1)
    c = fast(x, x, x)
    assert torch.equal(a, b) and not torch.equal(a, c)
    fast.eval()
    slow = MultiHeadAttention(16, 4, dropout=0.5, keep_weights=True).eval()
    slow.load_state_dict(fast.state_dict())
    torch.testing.assert_close(fast(x, x, x), slow(x, x, x), atol=2e-5, rtol=1e-4)


def test_keep_attention_weights_switches_every_attention_module():
    model = nn.Sequential(MultiHeadAttention(8, 2), nn.ModuleList([GroupedQueryAttention(8, 2, 1)]))
    assert keep_attention_weights(model) is model
    assert all(m.keep_weights for m in (model[0], model[1][0]))
    x = torch.randn(1, 3, 8)
    model[0](x, x, x)
    assert model[0].attn_weights.shape == (1, 2, 3, 3)
    keep_attention_weights(model, False)
    model[0](x, x, x)
    assert model[0].attn_weights is None and not model[1][0].keep_weights
    with pytest.raises(InputTypeError):
        keep_attention_weights(x)
    with pytest.raises(InputTypeError):
        keep_attention_weights(model, 1)
    with pytest.raises(InputTypeError):
        MultiHeadAttention(8, 2, keep_weights="yes")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fast_path_on_cuda():
    fast, slow = _pair(MultiHeadAttention, 32, 4)
    fast, slow = fast.cuda(), slow.cuda()
    x = torch.randn(2, 9, 32, device="cuda")
    mask = torch.ones(9, 9, dtype=torch.bool, device="cuda").tril()
    mask[0] = False  # a row with no key: zeros on every kernel
    torch.testing.assert_close(fast(x, x, x, mask=mask), slow(x, x, x, mask=mask),
                               atol=1e-4, rtol=1e-3)
