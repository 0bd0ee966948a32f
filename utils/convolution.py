"""Convolution written as multi-head attention (chapter 12).

A convolution with a kernel of K positions is multi-head attention with K heads in which head k
may attend to exactly one key: the input position at kernel offset k from the query. With one
allowed key, the softmax gives that key a weight of exactly 1, whatever the queries and keys
are, so head k returns the value of that one position; the value projection of head k is the
kernel slice for offset k, and an output projection that adds up the heads (plus the
convolution's bias) gives the convolution. Where the offset falls outside the input, the head's
row has no allowed key at all, and the book's convention (an all-masked row gets zero weights
and a zero output, never NaN) is exactly zero padding. Cordonnier, Loukas and Jaggi (2020) prove
the general statement, with a relative positional attention whose softmax peaks at the offset;
the hard mask here is the limit of their sharpening.

The modules take and return the convolution's layout, channels first: (B, C, L) in 1-D and
(B, C, H, W) in 2-D, so that they can replace ``nn.Conv1d`` and ``nn.Conv2d`` as they are;
inside, the positions are tokens, batch first, (B, L, C).

This is a proof, not a fast convolution: the masks are dense (heads, L_out, L_in) tensors, so
time and memory grow with the square of the number of positions.
"""

from __future__ import annotations

import torch
from torch import nn

from ._validation import (
    InputTypeError,
    require_bool,
    require_int,
    require_like_module,
    require_rank,
    require_tensor,
    shape_str,
)
from .attention import scaled_dot_product_attention

__all__ = ["conv_head_masks", "ConvAsAttention1d", "ConvAsAttention2d"]


def _read_padding(padding: object, kernel_size: int, stride: int, dilation: int,
                  name: str = "padding") -> tuple[int, bool]:
    """(left padding, same) for an int padding >= 0, "valid" or "same" (stride 1 only)."""
    if isinstance(padding, str):
        if padding == "valid":
            return 0, False
        if padding == "same":
            if stride != 1:
                raise ValueError(f"{name}='same' needs stride=1 (as in torch), got "
                                 f"stride={stride}")
            return dilation * (kernel_size - 1) // 2, True
        raise ValueError(f"{name} must be an int >= 0, 'valid' or 'same', got {padding!r}")
    return require_int(name, padding, minimum=0), False


def _output_length(length: int, kernel_size: int, stride: int, left: int, same: bool,
                   dilation: int) -> int:
    """The number of output positions of a convolution over ``length`` inputs."""
    if same:
        return length
    span = dilation * (kernel_size - 1) + 1
    return (length + 2 * left - span) // stride + 1


def conv_head_masks(length: int, kernel_size: int, stride: int = 1, padding: int | str = 0,
                    dilation: int = 1) -> torch.Tensor:
    """The attention masks of a 1-D convolution written as attention: one head per offset.

    Head k lets output position i attend to input position ``j = i * stride - padding +
    k * dilation`` and to nothing else; where that j lies outside [0, length) the row has no
    allowed key (zero padding).

    Args:
        length: L_in, the number of input positions, a positive int.
        kernel_size: K, the number of kernel positions (= heads), a positive int.
        stride: a positive int.
        padding: zeros added on each side, an int >= 0, or ``"valid"`` (0) or ``"same"``
            (output as long as the input, stride 1 only; torch's split: the left side gets
            ``dilation * (K - 1) // 2``, the right side the rest).
        dilation: the spacing of the kernel positions, a positive int.

    Returns:
        A bool tensor (K, L_out, L_in), True = may attend, with L_out the convolution's output
        length ``(L_in + 2 * padding - dilation * (K - 1) - 1) // stride + 1``.

    Raises:
        InputTypeError: for an argument that is not an int (or one of the two strings).
        ValueError: for values out of range, or a kernel wider than the padded input (no
            output position).
    """
    length = require_int("length", length)
    kernel_size = require_int("kernel_size", kernel_size)
    stride = require_int("stride", stride)
    dilation = require_int("dilation", dilation)
    left, same = _read_padding(padding, kernel_size, stride, dilation)
    l_out = _output_length(length, kernel_size, stride, left, same, dilation)
    if l_out < 1:
        raise ValueError(
            f"a kernel of size {kernel_size} (dilation {dilation}) does not fit an input of "
            f"length {length} with padding {padding!r}: no output position"
        )
    i = torch.arange(l_out)[None, :, None]                  # (1, L_out, 1) query positions
    k = torch.arange(kernel_size)[:, None, None]            # (K, 1, 1) offsets, one per head
    j = torch.arange(length)[None, None, :]                 # (1, 1, L_in) key positions
    return j == i * stride - left + k * dilation            # (K, L_out, L_in)


def _pair(name: str, value: object) -> tuple[object, object]:
    """An int or a string for both dimensions, or a pair (one per dimension)."""
    if isinstance(value, (tuple, list)):
        if len(value) != 2:
            raise ValueError(f"{name} must be one value or a pair (height, width), got {value!r}")
        return value[0], value[1]
    return value, value


class _ConvAsAttention(nn.Module):
    """What the 1-D and 2-D modules share: K heads, their value and output projections.

    ``w_v`` maps a token of C_in channels to K heads of C_out channels each (head k's slice of
    ``w_v.weight`` is the kernel at offset k); ``w_o`` adds the heads up and adds the bias. The
    queries and keys play no part: each head's mask leaves one key per query, and a softmax over
    one score is 1 whatever the score.
    """

    def __init__(self, in_channels: int, out_channels: int, heads: int, bias: bool):
        super().__init__()
        self.in_channels = require_int("in_channels", in_channels)
        self.out_channels = require_int("out_channels", out_channels)
        self.num_heads = heads
        require_bool("bias", bias)
        self.w_v = nn.Linear(self.in_channels, heads * self.out_channels, bias=False)
        self.w_o = nn.Linear(heads * self.out_channels, self.out_channels, bias=bias)
        with torch.no_grad():       # W_O = [I I ... I]: the output is the sum of the heads
            self.w_o.weight.copy_(torch.eye(self.out_channels).repeat(1, heads))
            if bias:
                self.w_o.bias.zero_()
        self.attn_weights: torch.Tensor | None = None

    def _attend(self, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """tokens (B, L_in, C_in), mask (K, L_out, L_in) -> (B, L_out, C_out)."""
        b, l_in, _ = tokens.shape
        heads, l_out = mask.shape[0], mask.shape[1]
        v = self.w_v(tokens).view(b, l_in, heads, self.out_channels).transpose(1, 2)
        q = tokens.new_zeros(b, heads, l_out, 1)             # (B, K, L_out, 1): never matter
        k = tokens.new_zeros(b, heads, l_in, 1)              # (B, K, L_in, 1)
        out, weights = scaled_dot_product_attention(q, k, v, mask.to(tokens.device))
        self.attn_weights = weights.detach()                 # (B, K, L_out, L_in)
        return self.w_o(out.transpose(1, 2).reshape(b, l_out, heads * self.out_channels))

    def _check_input(self, x: object, layout: str, rank: int) -> torch.Tensor:
        require_tensor("x", x)
        expected = layout.replace("C_in", f"C_in={self.in_channels}")
        require_rank("x", x, expected, rank=rank)
        if x.shape[1] != self.in_channels:
            raise ValueError(f"x must have shape {expected}, got {shape_str(x)}")
        require_like_module("x", x, self)
        return x


def _check_torch_conv(conv: object, cls: type[nn.Module]) -> None:
    if not isinstance(conv, cls):
        raise InputTypeError(f"conv must be an nn.{cls.__name__}, got {type(conv).__name__}")
    if conv.groups != 1:
        raise ValueError(f"cannot copy a convolution with groups={conv.groups}: each head's "
                         "value projection here reads every input channel (groups=1)")
    if conv.padding_mode != "zeros":
        raise ValueError(f"cannot copy a convolution with padding_mode={conv.padding_mode!r}: "
                         "an all-masked row is zero padding ('zeros') only")


class ConvAsAttention1d(_ConvAsAttention):
    """``nn.Conv1d`` computed as multi-head attention, one head per kernel offset.

    Args:
        in_channels: C_in, a positive int.
        out_channels: C_out, a positive int.
        kernel_size: K, the number of heads, a positive int.
        stride, padding, dilation: as in ``nn.Conv1d`` (padding: an int >= 0, "valid" or
            "same"; zeros only).
        bias: whether the output projection has a bias (the convolution's bias).

    Attributes:
        w_v: ``nn.Linear(C_in, K * C_out, bias=False)``; rows ``k * C_out`` to
            ``(k + 1) * C_out`` are the kernel at offset k, ``conv.weight[:, :, k]``.
        w_o: ``nn.Linear(K * C_out, C_out)``, set to add up the heads.
        attn_weights: after a forward pass, (B, K, L_out, L_in): a single 1 per row, or a row of
            zeros where the offset falls in the padding.

    Shapes:
        x (B, C_in, L_in) -> (B, C_out, L_out), channels first as in ``nn.Conv1d``.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int = 1,
                 padding: int | str = 0, dilation: int = 1, bias: bool = True):
        kernel_size = require_int("kernel_size", kernel_size)
        super().__init__(in_channels, out_channels, kernel_size, bias)
        self.kernel_size = kernel_size
        self.stride = require_int("stride", stride)
        self.dilation = require_int("dilation", dilation)
        _read_padding(padding, self.kernel_size, self.stride, self.dilation)
        self.padding = padding

    def head_masks(self, length: int) -> torch.Tensor:
        """The (K, L_out, L_in) bool masks for an input of ``length`` positions."""
        return conv_head_masks(length, self.kernel_size, self.stride, self.padding,
                               self.dilation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C_in, L_in) -> (B, C_out, L_out).

        Raises:
            InputTypeError: for a non-tensor, or a dtype or device other than the parameters'.
            ValueError: for a shape other than (B, C_in, L_in), or an input shorter than the
                kernel's reach.
        """
        self._check_input(x, "(B, C_in, L)", 3)
        tokens = x.transpose(1, 2)                                   # (B, L_in, C_in)
        return self._attend(tokens, self.head_masks(x.shape[2])).transpose(1, 2)

    @classmethod
    def from_torch(cls, conv: nn.Conv1d) -> ConvAsAttention1d:
        """A `ConvAsAttention1d` that computes what ``conv`` computes (to about 1e-6).

        Head k's value projection is ``conv.weight[:, :, k]``; the output projection adds the
        heads and carries ``conv.bias``. The copy has the convolution's dtype, device and
        train/eval mode.

        Raises:
            InputTypeError: when ``conv`` is not an ``nn.Conv1d``.
            ValueError: for ``groups`` other than 1 or a ``padding_mode`` other than zeros.
        """
        _check_torch_conv(conv, nn.Conv1d)
        padding = conv.padding if isinstance(conv.padding, str) else conv.padding[0]
        new = cls(conv.in_channels, conv.out_channels, conv.kernel_size[0], conv.stride[0],
                  padding, conv.dilation[0], bias=conv.bias is not None)
        new = new.to(dtype=conv.weight.dtype, device=conv.weight.device)
        with torch.no_grad():      # (C_out, C_in, K) -> (K, C_out, C_in) -> (K * C_out, C_in)
            new.w_v.weight.copy_(conv.weight.permute(2, 0, 1).reshape(-1, conv.in_channels))
            if conv.bias is not None:
                new.w_o.bias.copy_(conv.bias)
        new.train(conv.training)
        return new


class ConvAsAttention2d(_ConvAsAttention):
    """``nn.Conv2d`` computed as multi-head attention over the H * W pixels as tokens.

    A kh x kw kernel gives kh * kw heads; head ``a * kw + b`` lets output pixel (r, c) attend to
    the single input pixel at offset (a, b) of its window: row ``r * stride_h - pad_h + a *
    dilation_h``, column ``c * stride_w - pad_w + b * dilation_w``.

    Args:
        in_channels: C_in, a positive int.
        out_channels: C_out, a positive int.
        kernel_size: an int or a pair (kh, kw).
        stride, padding, dilation: as in ``nn.Conv2d``, each one value or a pair (padding: ints
            >= 0, "valid" or "same"; zeros only).
        bias: whether the output projection has a bias.

    Attributes:
        attn_weights: after a forward pass, (B, kh * kw, H_out * W_out, H * W).

    Shapes:
        x (B, C_in, H, W) -> (B, C_out, H_out, W_out), channels first as in ``nn.Conv2d``.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int | tuple[int, int],
                 stride: int | tuple[int, int] = 1, padding: int | str | tuple[int, int] = 0,
                 dilation: int | tuple[int, int] = 1, bias: bool = True):
        kh, kw = _pair("kernel_size", kernel_size)
        kh, kw = require_int("kernel_size", kh), require_int("kernel_size", kw)
        super().__init__(in_channels, out_channels, kh * kw, bias)
        self.kernel_size = (kh, kw)
        sh, sw = _pair("stride", stride)
        self.stride = (require_int("stride", sh), require_int("stride", sw))
        dh, dw = _pair("dilation", dilation)
        self.dilation = (require_int("dilation", dh), require_int("dilation", dw))
        self.padding = _pair("padding", padding)
        for axis in range(2):
            _read_padding(self.padding[axis], self.kernel_size[axis], self.stride[axis],
                          self.dilation[axis])

    def _axis_masks(self, height: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The 1-D masks of the rows (kh, H_out, H) and of the columns (kw, W_out, W)."""
        rows = conv_head_masks(height, self.kernel_size[0], self.stride[0], self.padding[0],
                               self.dilation[0])
        cols = conv_head_masks(width, self.kernel_size[1], self.stride[1], self.padding[1],
                               self.dilation[1])
        return rows, cols

    def head_masks(self, height: int, width: int) -> torch.Tensor:
        """The (kh * kw, H_out * W_out, H * W) bool masks for an H x W input."""
        rows, cols = self._axis_masks(height, width)
        kh, h_out, h = rows.shape
        kw, w_out, w = cols.shape
        # Head (a, b), query (r, c), key (y, x): allowed when row offset a takes r to y and
        # column offset b takes c to x.
        both = rows[:, None, :, None, :, None] & cols[None, :, None, :, None, :]
        return both.reshape(kh * kw, h_out * w_out, h * w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C_in, H, W) -> (B, C_out, H_out, W_out).

        Raises:
            InputTypeError: for a non-tensor, or a dtype or device other than the parameters'.
            ValueError: for a shape other than (B, C_in, H, W), or an image smaller than the
                kernel's reach.
        """
        self._check_input(x, "(B, C_in, H, W)", 4)
        b, _, h, w = x.shape
        h_out = self._axis_masks(h, w)[0].shape[1]
        tokens = x.flatten(2).transpose(1, 2)                          # (B, H * W, C_in)
        out = self._attend(tokens, self.head_masks(h, w))              # (B, H_out W_out, C_out)
        return out.transpose(1, 2).reshape(b, self.out_channels, h_out, -1)

    @classmethod
    def from_torch(cls, conv: nn.Conv2d) -> ConvAsAttention2d:
        """A `ConvAsAttention2d` that computes what ``conv`` computes (to about 1e-6).

        Raises:
            InputTypeError: when ``conv`` is not an ``nn.Conv2d``.
            ValueError: for ``groups`` other than 1 or a ``padding_mode`` other than zeros.
        """
        _check_torch_conv(conv, nn.Conv2d)
        new = cls(conv.in_channels, conv.out_channels, tuple(conv.kernel_size),
                  tuple(conv.stride), conv.padding if isinstance(conv.padding, str)
                  else tuple(conv.padding), tuple(conv.dilation), bias=conv.bias is not None)
        new = new.to(dtype=conv.weight.dtype, device=conv.weight.device)
        with torch.no_grad():  # (C_out, C_in, kh, kw) -> (kh, kw, C_out, C_in) -> (K C_out, C_in)
            new.w_v.weight.copy_(conv.weight.permute(2, 3, 0, 1).reshape(-1, conv.in_channels))
            if conv.bias is not None:
                new.w_o.bias.copy_(conv.bias)
        new.train(conv.training)
        return new
