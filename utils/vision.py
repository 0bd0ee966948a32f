"""Images as sequences of patches, and a small vision Transformer (chapter 12).

An image of shape (C, H, W) is cut into non-overlapping p x p patches, read row by row (left to
right, top to bottom); each patch is flattened in the order (channel, row, column), the order in
which ``nn.Conv2d`` stores a kernel, so that a linear map of the flattened patches is exactly a
convolution with kernel size and stride p. The patches are then tokens like any other: the
vision Transformer of Dosovitskiy et al. (2021) embeds them, prepends a learned class token, adds
learned positions and runs the book's Transformer encoder over the N + 1 tokens.

Shapes: images (B, C, H, W), batch first as everywhere in the book; patches (B, N, C * p * p)
with N = (H / p) * (W / p).
"""

from __future__ import annotations

import torch
from torch import nn

from ._validation import (
    InputTypeError,
    require_bool,
    require_int,
    require_like_module,
    require_probability,
    require_rank,
    require_tensor,
    shape_str,
)
from .positional import LearnedPositionalEmbedding
from .transformer import Encoder

__all__ = ["patchify", "unpatchify", "PatchEmbedding", "VisionTransformer"]


def _check_images(name: str, images: object, patch_size: int) -> torch.Tensor:
    """Raise unless ``images`` is a (B, C, H, W) tensor whose H and W are multiples of p."""
    require_tensor(name, images)
    require_rank(name, images, "(B, C, H, W)", rank=4)
    _, _, h, w = images.shape
    if h % patch_size or w % patch_size:
        raise ValueError(
            f"{name} must have a height and width divisible by patch_size={patch_size}, got "
            f"{shape_str(images)} (H={h}, W={w}): crop or pad the images to a multiple of "
            f"{patch_size}"
        )
    return images


def patchify(images: torch.Tensor, patch_size: int) -> torch.Tensor:
    """Cut images into non-overlapping square patches and flatten each one.

    Args:
        images: (B, C, H, W), any dtype; H and W must be multiples of ``patch_size``.
        patch_size: p, the side of a patch, a positive int.

    Returns:
        (B, N, C * p * p) with N = (H / p) * (W / p): patch n = (row r, column c) of the grid of
        patches is number n = r * (W / p) + c, and its C * p * p numbers are in the order
        (channel, row in the patch, column in the patch), as in ``nn.Conv2d``'s weights and in
        ``torch.nn.functional.unfold(images, p, stride=p).transpose(1, 2)``.

    Raises:
        InputTypeError: when ``images`` is not a tensor or ``patch_size`` not an int.
        ValueError: when ``images`` is not 4-dimensional, or H or W is not a multiple of
            ``patch_size``.
    """
    p = require_int("patch_size", patch_size)
    _check_images("images", images, p)
    b, c, h, w = images.shape
    grid = images.reshape(b, c, h // p, p, w // p, p)        # (B, C, H/p, p, W/p, p)
    grid = grid.permute(0, 2, 4, 1, 3, 5)                     # (B, H/p, W/p, C, p, p)
    return grid.reshape(b, (h // p) * (w // p), c * p * p)


def unpatchify(patches: torch.Tensor, patch_size: int, height: int, width: int) -> torch.Tensor:
    """Put flattened patches back together into images: the inverse of `patchify`.

    Args:
        patches: (B, N, C * p * p) with N = (height / p) * (width / p).
        patch_size: p, a positive int.
        height, width: H and W of the images, positive multiples of ``patch_size``.

    Returns:
        (B, C, H, W), with ``unpatchify(patchify(x, p), p, H, W)`` equal to ``x``.

    Raises:
        InputTypeError: for a non-tensor or a count that is not an int.
        ValueError: when ``patches`` is not 3-dimensional, H or W is not a multiple of p, N is
            not (H / p) * (W / p), or the last dimension is not a multiple of p * p.
    """
    p = require_int("patch_size", patch_size)
    h = require_int("height", height)
    w = require_int("width", width)
    require_tensor("patches", patches)
    require_rank("patches", patches, "(B, N, C * p * p)", rank=3)
    if h % p or w % p:
        raise ValueError(f"height and width must be multiples of patch_size={p}, got "
                         f"height={h}, width={w}")
    b, n, dim = patches.shape
    expected_n = (h // p) * (w // p)
    if n != expected_n or dim % (p * p) or dim == 0:
        raise ValueError(
            f"patches must have shape (B, N={expected_n}, C * {p * p}) for {h} x {w} images cut "
            f"into {p} x {p} patches, got {shape_str(patches)}"
        )
    c = dim // (p * p)
    grid = patches.reshape(b, h // p, w // p, c, p, p).permute(0, 3, 1, 4, 2, 5)
    return grid.reshape(b, c, h, w)


class PatchEmbedding(nn.Module):
    """A linear map of each flattened patch: ``patchify`` then ``nn.Linear(C * p * p, d_model)``.

    This is the same function as ``nn.Conv2d(C, d_model, kernel_size=p, stride=p)`` followed by
    flattening the output grid into tokens, and `from_torch` copies such a convolution.

    Args:
        in_channels: C, a positive int.
        patch_size: p, a positive int.
        d_model: the width of a token, a positive int.

    Shapes:
        images (B, C, H, W), H and W multiples of p -> tokens (B, N, d_model), N = HW / p^2.
    """

    def __init__(self, in_channels: int, patch_size: int, d_model: int):
        super().__init__()
        self.in_channels = require_int("in_channels", in_channels)
        self.patch_size = require_int("patch_size", patch_size)
        self.d_model = require_int("d_model", d_model)
        self.proj = nn.Linear(self.in_channels * self.patch_size ** 2, self.d_model)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> (B, N, d_model)."""
        _check_images("images", images, self.patch_size)
        if images.shape[1] != self.in_channels:
            raise ValueError(f"images must have shape (B, C={self.in_channels}, H, W), got "
                             f"{shape_str(images)}")
        require_like_module("images", images, self)
        return self.proj(patchify(images, self.patch_size))

    @classmethod
    def from_torch(cls, conv: nn.Conv2d) -> PatchEmbedding:
        """A `PatchEmbedding` equal to ``conv``, a ``nn.Conv2d`` with kernel size = stride = p.

        Raises:
            InputTypeError: when ``conv`` is not an ``nn.Conv2d``.
            ValueError: when its kernel is not square, its stride differs from its kernel size,
                or it has padding, dilation, groups or a bias-free layout a patch embedding
                does not have.
        """
        if not isinstance(conv, nn.Conv2d):
            raise InputTypeError(f"conv must be an nn.Conv2d, got {type(conv).__name__}")
        k = conv.kernel_size
        problems = []
        if k[0] != k[1]:
            problems.append(f"kernel_size={k} is not square")
        if tuple(conv.stride) != tuple(k):
            problems.append(f"stride={conv.stride} differs from kernel_size={k}")
        if conv.padding not in ((0, 0), "valid"):
            problems.append(f"padding={conv.padding}")
        if tuple(conv.dilation) != (1, 1):
            problems.append(f"dilation={conv.dilation}")
        if conv.groups != 1:
            problems.append(f"groups={conv.groups}")
        if conv.bias is None:
            problems.append("bias=False")
        if problems:
            raise ValueError("a patch embedding is a Conv2d with a square kernel, stride = "
                             "kernel size, no padding or dilation, groups=1 and a bias; got "
                             + ", ".join(problems))
        new = cls(conv.in_channels, k[0], conv.out_channels)
        new = new.to(dtype=conv.weight.dtype, device=conv.weight.device)
        with torch.no_grad():
            new.proj.weight.copy_(conv.weight.reshape(conv.out_channels, -1))
            new.proj.bias.copy_(conv.bias)
        new.train(conv.training)
        return new


class VisionTransformer(nn.Module):
    """A vision Transformer (ViT): patches as tokens, a class token, a Transformer encoder.

    ``images -> PatchEmbedding -> [class token; patch tokens] + learned positions -> Encoder
    (pre-LN, final LayerNorm) -> the class token's output -> linear head -> class scores``.

    Args:
        image_size: H = W of the (square) images, a positive multiple of ``patch_size``.
        patch_size: p, a positive int.
        in_channels: C, a positive int.
        num_classes: the number of classes, a positive int.
        d_model: token width, a positive int divisible by ``num_heads``.
        num_heads: attention heads per layer, a positive int.
        num_layers: encoder layers, a positive int.
        d_ff: hidden width of the feed-forward networks, a positive int.
        dropout: dropout probability in the encoder, in [0, 1).
        norm_first: pre-LN layers (True, as in ViT) or post-LN (False).

    Shapes:
        images (B, C, image_size, image_size) -> logits (B, num_classes). After a forward pass,
        `class_attention` returns the class token's attention over the patches.
    """

    def __init__(self, image_size: int, patch_size: int, in_channels: int, num_classes: int,
                 d_model: int = 32, num_heads: int = 4, num_layers: int = 2, d_ff: int = 64,
                 dropout: float = 0.0, norm_first: bool = True):
        super().__init__()
        self.image_size = require_int("image_size", image_size)
        self.patch_size = require_int("patch_size", patch_size)
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size={self.image_size} must be a multiple of "
                             f"patch_size={self.patch_size}")
        self.num_classes = require_int("num_classes", num_classes)
        require_probability("dropout", dropout)
        require_bool("norm_first", norm_first)
        self.grid = self.image_size // self.patch_size
        self.num_patches = self.grid ** 2
        self.patch_embed = PatchEmbedding(in_channels, self.patch_size, d_model)
        self.cls_token = nn.Parameter(torch.randn(1, 1, d_model) * 0.02)
        self.pos = LearnedPositionalEmbedding(self.num_patches + 1, d_model)
        self.encoder = Encoder(num_layers, d_model, num_heads, d_ff, dropout, "gelu",
                               norm_first=norm_first, final_norm=True)
        self.head = nn.Linear(d_model, self.num_classes)

    def tokens(self, images: torch.Tensor) -> torch.Tensor:
        """The encoder's input: (B, C, H, W) -> (B, 1 + N, d_model), class token first."""
        require_tensor("images", images)
        require_rank("images", images, "(B, C, H, W)", rank=4)
        size = self.image_size
        if tuple(images.shape[1:]) != (self.patch_embed.in_channels, size, size):
            raise ValueError(f"images must have shape (B, C={self.patch_embed.in_channels}, "
                             f"H={size}, W={size}), got {shape_str(images)}")
        patches = self.patch_embed(images)                          # (B, N, d_model)
        cls = self.cls_token.expand(images.shape[0], -1, -1)        # (B, 1, d_model)
        return self.pos(torch.cat([cls, patches], dim=1))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> class scores (B, num_classes), read from the class token."""
        h = self.encoder(self.tokens(images))                       # (B, 1 + N, d_model)
        return self.head(h[:, 0])

    def class_attention(self, layer: int = -1) -> torch.Tensor:
        """The class token's attention over the patches in the last forward pass.

        The attention modules keep their weights only when asked: call
        ``utils.attention.keep_attention_weights(model)`` before that forward pass.

        Args:
            layer: which encoder layer (an index into ``encoder.layers``; -1 = the last).

        Returns:
            (B, h, grid, grid): for each head, the weight the class token gave each patch,
            arranged as the patches lie in the image (the weight it gave itself is left out,
            so a map sums to at most 1).

        Raises:
            RuntimeError: before any forward pass with the weights kept.
        """
        if isinstance(layer, bool) or not isinstance(layer, int):
            raise InputTypeError(f"layer must be an int, got {layer!r}")
        n = len(self.encoder.layers)
        if not -n <= layer < n:
            raise ValueError(f"layer must be in [-{n}, {n}), got {layer}")
        weights = self.encoder.layers[layer].self_attn.attn_weights   # (B, h, 1 + N, 1 + N)
        if weights is None:
            raise RuntimeError("no attention weights kept from a forward pass: switch them on "
                               "with utils.attention.keep_attention_weights(model), then run "
                               "the model on a batch of images before asking for its attention")
        b, h = weights.shape[:2]
        return weights[:, :, 0, 1:].reshape(b, h, self.grid, self.grid)
