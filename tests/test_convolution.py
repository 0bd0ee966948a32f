"""Tests of utils.convolution: nn.Conv1d and nn.Conv2d written as masked multi-head attention."""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch
from torch import nn

from utils._validation import InputTypeError
from utils.convolution import ConvAsAttention1d, ConvAsAttention2d, conv_head_masks

# kernel size, stride, padding, dilation
CONFIGS_1D = [
    (k, s, p, d)
    for k, s, p, d in itertools.product((1, 2, 3, 5), (1, 2), (0, 1, 2, "same", "valid"), (1, 2))
    if not (p == "same" and s != 1)
]


@pytest.fixture(autouse=True)
def _quiet_same_padding():
    # torch warns that padding='same' with an even kernel copies the input; not our concern.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Using padding='same'")
        yield


@pytest.mark.parametrize(("kernel", "stride", "padding", "dilation"), CONFIGS_1D)
def test_from_torch_conv1d_equal(kernel, stride, padding, dilation):
    torch.manual_seed(kernel * 100 + stride * 10 + dilation)
    for c_in, c_out, bias in ((1, 1, True), (3, 5, True), (4, 2, False)):
        conv = nn.Conv1d(c_in, c_out, kernel, stride=stride, padding=padding,
                         dilation=dilation, bias=bias)
        ours = ConvAsAttention1d.from_torch(conv)
        x = torch.randn(3, c_in, 13)
        torch.testing.assert_close(ours(x), conv(x), atol=1e-5, rtol=0)


@pytest.mark.parametrize("kernel", [(1, 1), (3, 3), (2, 3), (5, 1)])
@pytest.mark.parametrize("padding", [0, 1, (2, 0), "same", "valid"])
def test_from_torch_conv2d_equal(kernel, padding):
    torch.manual_seed(7)
    for stride, dilation in ((1, 1), ((2, 1), (1, 2))):
        if padding == "same" and stride != 1:
            continue
        conv = nn.Conv2d(3, 4, kernel, stride=stride, padding=padding, dilation=dilation)
        ours = ConvAsAttention2d.from_torch(conv)
        x = torch.randn(2, 3, 9, 7)
        torch.testing.assert_close(ours(x), conv(x), atol=1e-5, rtol=0)


def test_gradients_match_torch():
    torch.manual_seed(0)
    conv = nn.Conv1d(3, 4, 3, padding=1)
    ours = ConvAsAttention1d.from_torch(conv)
    x = torch.randn(2, 3, 9, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    conv(x).square().sum().backward()
    ours(x2).square().sum().backward()
    torch.testing.assert_close(x2.grad, x.grad, atol=1e-5, rtol=0)
    torch.testing.assert_close(ours.w_o.bias.grad, conv.bias.grad, atol=1e-5, rtol=0)
    grad_w = ours.w_v.weight.grad.reshape(3, 4, 3).permute(1, 2, 0)   # back to (C_out, C_in, K)
    torch.testing.assert_close(grad_w, conv.weight.grad, atol=1e-5, rtol=0)


def test_each_head_attends_to_one_key_or_none():
    conv = nn.Conv1d(2, 2, 3, padding=1)
    ours = ConvAsAttention1d.from_torch(conv)
    ours(torch.randn(1, 2, 6))
    w = ours.attn_weights                                # (B, K, L_out, L_in)
    assert w.shape == (1, 3, 6, 6)
    row_sums = w.sum(-1)[0]
    # head 0 looks one step left: query 0 falls in the padding; head 2, one step right.
    assert row_sums[0, 0] == 0 and row_sums[2, -1] == 0
    assert torch.all((row_sums == 0) | (row_sums == 1))
    assert not torch.isnan(w).any()
    assert torch.equal(w[0, 1], torch.eye(6))            # the centre head: the query itself


def test_conv_head_masks_layout():
    m = conv_head_masks(5, 3, padding=1)
    assert m.shape == (3, 5, 5) and m.dtype == torch.bool
    assert torch.equal(m[1], torch.eye(5, dtype=torch.bool))
    # head 0 reads one step to the left, head 2 one step to the right
    assert torch.equal(m[0], torch.diag(torch.ones(4, dtype=torch.bool), -1))
    assert torch.equal(m[2], torch.diag(torch.ones(4, dtype=torch.bool), 1))
    assert conv_head_masks(10, 3, stride=2).shape == (3, 4, 10)
    assert conv_head_masks(10, 3, dilation=3).shape == (3, 4, 10)
    assert conv_head_masks(6, 4, padding="same").shape == (4, 6, 6)


def test_init_output_projection_sums_heads():
    layer = ConvAsAttention1d(2, 3, 4)
    torch.testing.assert_close(layer.w_o.weight, torch.eye(3).repeat(1, 4))
    assert layer.w_v.weight.shape == (12, 2)


def test_copy_keeps_dtype_and_mode():
    conv = nn.Conv1d(2, 3, 3).double().eval()
    ours = ConvAsAttention1d.from_torch(conv)
    assert ours.w_v.weight.dtype == torch.float64 and not ours.training
    x = torch.randn(1, 2, 7, dtype=torch.float64)
    torch.testing.assert_close(ours(x), conv(x), atol=1e-12, rtol=0)


def test_refuses_what_it_cannot_copy():
    with pytest.raises(ValueError, match="groups=2"):
        ConvAsAttention1d.from_torch(nn.Conv1d(4, 4, 3, groups=2))
    with pytest.raises(ValueError, match="padding_mode='circular'"):
        ConvAsAttention2d.from_torch(nn.Conv2d(1, 1, 3, padding=1, padding_mode="circular"))
    with pytest.raises(InputTypeError, match="nn.Conv1d"):
        ConvAsAttention1d.from_torch(nn.Conv2d(1, 1, 3))
    with pytest.raises(InputTypeError, match="nn.Conv2d"):
        ConvAsAttention2d.from_torch(nn.Linear(2, 2))


def test_clear_errors_on_bad_shapes_and_arguments():
    layer = ConvAsAttention1d(3, 2, 3)
    with pytest.raises(ValueError, match=r"\(B, C_in=3, L\).*\(2, 4, 9\)"):
        layer(torch.randn(2, 4, 9))
    with pytest.raises(ValueError, match="3 dims"):
        layer(torch.randn(3, 9))
    with pytest.raises(ValueError, match="does not fit an input of length 2"):
        layer(torch.randn(1, 3, 2))
    with pytest.raises(InputTypeError):
        layer(torch.randn(1, 3, 9, dtype=torch.float64))
    with pytest.raises(InputTypeError):
        layer([1.0, 2.0])
    layer2 = ConvAsAttention2d(1, 2, 3)
    with pytest.raises(ValueError, match=r"\(B, C_in=1, H, W\)"):
        layer2(torch.randn(2, 3, 8, 8))
    with pytest.raises(ValueError, match="'same' needs stride=1"):
        ConvAsAttention1d(1, 1, 3, stride=2, padding="same")
    with pytest.raises(ValueError, match="'valid' or 'same'"):
        ConvAsAttention1d(1, 1, 3, padding="full")
    with pytest.raises(ValueError, match="pair"):
        ConvAsAttention2d(1, 1, (3, 3, 3))
    with pytest.raises(InputTypeError):
        ConvAsAttention1d(1, 1, 2.5)
    with pytest.raises(ValueError):
        ConvAsAttention1d(0, 1, 3)
