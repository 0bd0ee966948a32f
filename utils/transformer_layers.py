"""The Transformer's two layers, the encoder layer and the decoder layer (chapters 8 and 9).

Both are built from the pieces of the earlier chapters, `utils.attention.MultiHeadAttention`,
`utils.layers.LayerNorm` and `utils.layers.PositionwiseFeedForward`; the stacks of them are in
`utils.transformer`, which re-exports both layers. Each class has a
``from_torch`` that copies the parameters of its `torch.nn` counterpart (``batch_first=True``)
so that both give the same output to about 1e-6.

Shapes are batch first: ``x`` is (B, L, d_model).

Masks
-----
Every mask argument, of these layers and of `utils.transformer`'s stacks, is a bool tensor in
the book's convention, True = "this query may attend to this key". One rule, the same for every
argument (``mask``, ``tgt_mask``, ``memory_mask``, ``src_mask``), decides how a mask is read;
`utils.masks.expand_mask` applies it:

* 2 dims, shape (B, L_k): a **key padding mask**, True at real tokens, as made by
  `utils.masks.padding_mask`; it applies to every query and every head.
* 2 dims, shape (L_q, L_k): one **attention mask for the whole batch**, such as
  `utils.masks.causal_mask`.
* A 2-dim mask that fits both readings (B == L_q > 1) is ambiguous and raises a `ValueError`; say
  what you mean with 3 dims: ``pad[:, None, :]`` for padding, ``mask[None]`` for a shared mask.
* 3 dims: broadcastable to (B, L_q, L_k), the same for every head; a padding mask is
  (B, 1, L_k), a causal mask combined with padding is ``causal[None] & pad[:, None, :]``.
* 4 dims: broadcastable to (B, h, L_q, L_k).

Code that runs on batches of any size (training loops, decoding) should use the 3- or 4-dim
forms, which are never ambiguous.

PyTorch's own conventions are the opposite polarity (``src_key_padding_mask`` True = ignore,
bool ``attn_mask`` True = not allowed, or float masks with -inf); `utils.masks` converts them.

Checked input, and what degenerate input gives
----------------------------------------------
Every ``forward`` checks its arguments before computing anything and raises a `ValueError` for
a wrong shape and an `utils._validation.InputTypeError` (both a `TypeError` and a `ValueError`)
for a wrong type, dtype or device: inputs must be floating-point tensors with the module's
dtype and on its device, masks bool tensors on the input's device. Valid but degenerate input
has a defined result:

* an empty batch (B = 0) or empty sequences (L = 0) give an empty output of the same shape;
* a query with no key to attend to (every key masked, or an empty ``memory``) gets all-zero
  attention weights: the weighted sum of the values is zero and the attention sublayer gives
  just the output projection's bias b_O. The layer's output there is finite, never NaN (torch's
  own layers give NaN in that case).

``from_torch`` copies only what it can copy exactly (see `EncoderLayer.from_torch`): anything
else is refused before a parameter is copied.
"""

from __future__ import annotations

import torch
from torch import nn

from ._validation import (
    apply_dropout,
    require_bool,
    require_bool_mask,
    require_choice,
    require_int,
    require_like_module,
    require_probability,
    require_rank,
    require_real,
    require_same_device,
    require_tensor,
    shape_str,
)
from .attention import MultiHeadAttention
from .convert import copy_linear, finish_copy, layer_config, like
from .kv_cache import KVCache, require_kv_cache
from .layers import LayerNorm, PositionwiseFeedForward
from .masks import expand_mask

__all__ = ["EncoderLayer", "DecoderLayer"]

ACTIVATION_CHOICES = ("relu", "gelu")



def _resolve_hparams(d_model: object, nhead: object, num_heads: object, dim_feedforward: object,
                     d_ff: object, dropout: object, activation: object, layer_norm_eps: object,
                     norm_first: object) -> tuple[int, int, int]:
    """Check a layer's settings; accept torch's names (nhead, dim_feedforward) and the book's
    (num_heads, d_ff). Returns ``(d_model, heads, width)``."""
    d_model = require_int("d_model", d_model)
    if nhead is None and num_heads is None:
        raise ValueError("give the number of heads as nhead (or its alias num_heads)")
    if nhead is not None:
        nhead = require_int("nhead", nhead)
    if num_heads is not None:
        num_heads = require_int("num_heads", num_heads)
    if nhead is not None and num_heads is not None and nhead != num_heads:
        raise ValueError(f"nhead={nhead} and num_heads={num_heads} disagree; give only one")
    heads = nhead if nhead is not None else num_heads
    if dim_feedforward is not None:
        dim_feedforward = require_int("dim_feedforward", dim_feedforward)
    if d_ff is not None:
        d_ff = require_int("d_ff", d_ff)
    if dim_feedforward is not None and d_ff is not None and dim_feedforward != d_ff:
        raise ValueError(
            f"dim_feedforward={dim_feedforward} and d_ff={d_ff} disagree; give only one"
        )
    width = dim_feedforward if dim_feedforward is not None else d_ff
    if width is None:
        width = 2048  # torch's default
    require_probability("dropout", dropout)
    require_choice("activation", activation, ACTIVATION_CHOICES)
    # eps = 0 would turn a constant input row into 0 / 0 = NaN.
    require_real("layer_norm_eps", layer_norm_eps, low=0.0, low_open=True)
    require_bool("norm_first", norm_first)
    return d_model, heads, width


def _check_input(name: str, x: object, module: nn.Module, desc: str = "(B, L, d_model)") -> None:
    """``x`` must be a (B, L, d_model) tensor with ``module``'s dtype and device."""
    expected = desc.replace("d_model", f"d_model={module.d_model}")
    require_tensor(name, x)
    require_rank(name, x, expected, rank=3)
    if x.shape[-1] != module.d_model:
        raise ValueError(f"{name} must have shape {expected}, got {shape_str(x)}")
    require_like_module(name, x, module)


def _check_same_batch(a_name: str, a: torch.Tensor, b_name: str, b: torch.Tensor) -> None:
    if a.shape[0] != b.shape[0]:
        raise ValueError(f"{a_name} {shape_str(a)} and {b_name} {shape_str(b)} must have the same "
                         "batch size B")


def _read_mask(name: str, mask: object, x: torch.Tensor, l_q: int,
               l_k: int) -> torch.Tensor | None:
    """Check a mask's type, dtype and device against the input ``x``, then read it with
    `utils.masks.expand_mask` (None stays None)."""
    if mask is None:
        return None
    require_tensor(name, mask)
    require_bool_mask(name, mask)
    require_same_device(input=x, **{name: mask})
    return expand_mask(mask, x.shape[0], l_q, l_k, name)


class _Layer(nn.Module):
    """What `EncoderLayer` and `DecoderLayer` share: their construction and ``from_torch``.

    A decoder layer (``cross_attention = True``) has a third sublayer, ``cross_attn``, with its
    own ``norm3`` and ``dropout3``. The submodules are made in a fixed order (self_attn,
    cross_attn, ff, the norms, the dropouts), which fixes the initial weights a seed gives.
    """

    cross_attention: bool
    torch_cls: type[nn.Module]

    def __init__(self, d_model: int, nhead: int | None = None, dim_feedforward: int | None = None,
                 dropout: float = 0.1, activation: str = "relu", *, layer_norm_eps: float = 1e-5,
                 norm_first: bool = False, num_heads: int | None = None, d_ff: int | None = None):
        super().__init__()
        d_model, heads, width = _resolve_hparams(d_model, nhead, num_heads, dim_feedforward,
                                                 d_ff, dropout, activation, layer_norm_eps,
                                                 norm_first)
        self.d_model = d_model
        self.nhead = heads
        self.dim_feedforward = width
        self.norm_first = norm_first
        self.self_attn = MultiHeadAttention(d_model, heads, dropout=dropout)
        if self.cross_attention:
            self.cross_attn = MultiHeadAttention(d_model, heads, dropout=dropout)
        self.ff = PositionwiseFeedForward(d_model, width, dropout=dropout, activation=activation)
        self.norm1 = LayerNorm(d_model, eps=layer_norm_eps)
        self.norm2 = LayerNorm(d_model, eps=layer_norm_eps)
        if self.cross_attention:
            self.norm3 = LayerNorm(d_model, eps=layer_norm_eps)
        self.dropout1 = nn.Dropout(dropout)
        self.dropout2 = nn.Dropout(dropout)
        if self.cross_attention:
            self.dropout3 = nn.Dropout(dropout)

    @classmethod
    def _torch_config(cls, module: object, name: str = "module") -> dict[str, object]:
        """Check that ``module`` can be copied exactly; return the constructor arguments (see
        `utils.convert.layer_config`)."""
        return layer_config(module, name, cls.torch_cls, cls.cross_attention)

    @classmethod
    def _from_torch(cls, module: nn.Module) -> _Layer:
        new = like(cls(**cls._torch_config(module)), module)
        new.self_attn = MultiHeadAttention.from_torch(module.self_attn)
        if cls.cross_attention:
            new.cross_attn = MultiHeadAttention.from_torch(module.multihead_attn)
        copy_linear(new.ff.linear1, module.linear1)
        copy_linear(new.ff.linear2, module.linear2)
        new.norm1 = LayerNorm.from_torch(module.norm1)
        new.norm2 = LayerNorm.from_torch(module.norm2)
        if cls.cross_attention:
            new.norm3 = LayerNorm.from_torch(module.norm3)
        return finish_copy(new, module)


class EncoderLayer(_Layer):
    """One encoder layer: self-attention, then a feed-forward network, each with a residual.

    Post-LN (``norm_first=False``, the original paper)::

        x = norm1(x + dropout1(self_attn(x)))
        x = norm2(x + dropout2(ff(x)))

    Pre-LN (``norm_first=True``)::

        x = x + dropout1(self_attn(norm1(x)))
        x = x + dropout2(ff(norm2(x)))

    Args:
        d_model: width of the token vectors, a positive int.
        nhead: number of heads, a positive int dividing ``d_model`` (``num_heads`` is accepted
            as an alias).
        dim_feedforward: hidden width of the feed-forward network, a positive int (alias
            ``d_ff``; default 2048).
        dropout: dropout on the attention weights, inside the feed-forward network and on each
            sublayer's output before the residual addition, as in torch: a probability in
            [0, 1) (default 0.1).
        activation: ``"relu"`` or ``"gelu"``.
        layer_norm_eps: the LayerNorms' eps, a number > 0.
        norm_first: pre-LN when True, post-LN when False (a bool).

    A count that is not a positive int (``2.5``, ``True``, ``"2"``) raises; nothing is rounded.

    Shapes:
        x (B, L, d_model) -> (B, L, d_model). ``mask``: see the module docstring. B = 0 or
        L = 0 gives an empty output; a query whose keys are all masked gets the attention's
        bias b_O as the self-attention sublayer's output.
    """

    cross_attention = False
    torch_cls = nn.TransformerEncoderLayer

    def _sa_block(self, x: torch.Tensor, mask: torch.Tensor | None,
                  cache: KVCache | None = None, is_causal: bool = False) -> torch.Tensor:
        return apply_dropout(self.dropout1, self.self_attn(x, x, x, mask, cache=cache,
                                                           is_causal=is_causal))

    def _ff_block(self, x: torch.Tensor) -> torch.Tensor:
        return apply_dropout(self.dropout2, self.ff(x))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None,
                cache: KVCache | None = None, is_causal: bool = False) -> torch.Tensor:
        """Run the layer.

        Args:
            x: (B, L, d_model), with the layer's dtype and device.
            mask: optional bool mask, True = may attend: a (B, L) padding mask, an (L, L) mask,
                or one broadcastable to (B, L, L) or (B, h, L, L). With a cache holding L_past
                positions, the keys number L_past + L: (B, L_past + L), (L, L_past + L), ...
            cache: optional `utils.kv_cache.KVCache` of this layer's self-attention: ``x`` is
                then only the new positions, whose keys and values are appended to it (used by
                a decoder-only model generating text one token at a time).
            is_causal: causal self-attention, exactly as in `MultiHeadAttention` (with ``mask``
                too, both apply); torch's layer takes the same flag as a hint about its mask.

        Returns:
            (B, L, d_model).
        """
        _check_input("x", x, self)
        require_bool("is_causal", is_causal)
        l_k = x.shape[1] + (0 if cache is None else require_kv_cache(cache).length)
        mask = _read_mask("mask", mask, x, x.shape[1], l_k)
        if self.norm_first:
            x = x + self._sa_block(self.norm1(x), mask, cache, is_causal)
            x = x + self._ff_block(self.norm2(x))
        else:
            x = self.norm1(x + self._sa_block(x, mask, cache, is_causal))
            x = self.norm2(x + self._ff_block(x))
        return x

    @classmethod
    def from_torch(cls, module: nn.TransformerEncoderLayer) -> EncoderLayer:
        """An `EncoderLayer` holding a copy of ``module``'s parameters and settings.

        The copy has ``module``'s dtype, device and train/eval mode, and gives the same output
        on the same input (to about 1e-6 in float32).

        Raises:
            InputTypeError: ``module`` is not an ``nn.TransformerEncoderLayer``, a submodule has
                been replaced by another kind (an ``nn.RMSNorm`` for a norm, say), or its
                parameters mix dtypes or devices.
            ValueError: for everything this class cannot reproduce exactly: ``batch_first=False``
                (the copy is batch first: it would read torch's (L, B, d_model) inputs the wrong
                way round; rebuild the torch module with ``batch_first=True``), an activation
                other than relu and the exact gelu, ``bias=False`` or a missing bias anywhere, a
                LayerNorm without gain and bias, different eps in the two norms, different
                dropout probabilities in different places, ``kdim``/``vdim``,
                ``add_bias_kv``/``add_zero_attn``.
        """
        return cls._from_torch(module)


class DecoderLayer(_Layer):
    """One decoder layer: masked self-attention, cross-attention over the encoder's output
    (``memory``), then a feed-forward network, each with a residual.

    Post-LN (``norm_first=False``)::

        x = norm1(x + dropout1(self_attn(x, tgt_mask)))
        x = norm2(x + dropout2(cross_attn(x, memory, memory_mask)))
        x = norm3(x + dropout3(ff(x)))

    Pre-LN (``norm_first=True``) normalizes each sublayer's input instead:
    ``x = x + dropout1(self_attn(norm1(x)))`` and so on.

    Arguments as in `EncoderLayer`.

    Shapes:
        x (B, L_t, d_model), memory (B, L_s, d_model) -> (B, L_t, d_model). With an empty
        ``memory`` (L_s = 0) or a fully masked one, the cross-attention sublayer gives just its
        output bias b_O.
    """

    cross_attention = True
    torch_cls = nn.TransformerDecoderLayer

    def _sa_block(self, x: torch.Tensor, mask: torch.Tensor | None,
                  cache: KVCache | None = None, is_causal: bool = False) -> torch.Tensor:
        return apply_dropout(self.dropout1, self.self_attn(x, x, x, mask, cache=cache,
                                                           is_causal=is_causal))

    def _ca_block(self, x: torch.Tensor, memory: torch.Tensor, mask: torch.Tensor | None,
                  cache: KVCache | None = None) -> torch.Tensor:
        return apply_dropout(self.dropout2, self.cross_attn(x, memory, memory, mask, cache=cache))

    def _ff_block(self, x: torch.Tensor) -> torch.Tensor:
        return apply_dropout(self.dropout3, self.ff(x))

    def forward(self, x: torch.Tensor, memory: torch.Tensor, tgt_mask: torch.Tensor | None = None,
                memory_mask: torch.Tensor | None = None, cache: KVCache | None = None,
                memory_cache: KVCache | None = None, tgt_is_causal: bool = False) -> torch.Tensor:
        """Run the layer.

        Args:
            x: the target side, (B, L_t, d_model).
            memory: the encoder's output, (B, L_s, d_model).
            tgt_mask: self-attention mask, usually causal (and padding): (L_t, L_t), (B, L_t),
                or broadcastable to (B, L_t, L_t) or (B, h, L_t, L_t). With a ``cache`` of
                L_past positions, the keys number L_past + L_t.
            memory_mask: cross-attention mask, usually the source padding mask (B, L_s); or
                (L_t, L_s), or broadcastable to (B, L_t, L_s) or (B, h, L_t, L_s).
            cache: optional `utils.kv_cache.KVCache` of the self-attention (``x`` is then only
                the new positions).
            memory_cache: optional static `utils.kv_cache.KVCache` of the cross-attention: the
                memory's keys and values, computed on the first call and reused afterwards.
            tgt_is_causal: causal self-attention, exactly (with ``tgt_mask`` too, both apply):
                as ``is_causal`` of `MultiHeadAttention`. A ``tgt_mask`` made by
                `utils.masks.causal_mask` runs the same fast kernel without it.

        Returns:
            (B, L_t, d_model).
        """
        require_bool("tgt_is_causal", tgt_is_causal)
        past = 0 if cache is None else require_kv_cache(cache).length
        tgt_mask, memory_mask = _check_decoder_inputs(self, x, memory, tgt_mask, memory_mask,
                                                      past=past)
        if self.norm_first:
            x = x + self._sa_block(self.norm1(x), tgt_mask, cache, tgt_is_causal)
            x = x + self._ca_block(self.norm2(x), memory, memory_mask, memory_cache)
            x = x + self._ff_block(self.norm3(x))
        else:
            x = self.norm1(x + self._sa_block(x, tgt_mask, cache, tgt_is_causal))
            x = self.norm2(x + self._ca_block(x, memory, memory_mask, memory_cache))
            x = self.norm3(x + self._ff_block(x))
        return x

    @classmethod
    def from_torch(cls, module: nn.TransformerDecoderLayer) -> DecoderLayer:
        """A `DecoderLayer` holding a copy of ``module``'s parameters and settings.

        torch's ``multihead_attn`` becomes ``cross_attn``. What is refused, and why, as in
        `EncoderLayer.from_torch` (the three norms must share one eps, and both attentions
        one number of heads).
        """
        return cls._from_torch(module)


def _check_decoder_inputs(module: nn.Module, x: object, memory: object, tgt_mask: object,
                          memory_mask: object, x_name: str = "x", memory_name: str = "memory",
                          past: int = 0) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Check a decoder's inputs; return its two masks read by `utils.masks.expand_mask`
    (``past``: the positions already in the self-attention cache)."""
    _check_input(x_name, x, module, "(B, L_t, d_model)")
    _check_input(memory_name, memory, module, "(B, L_s, d_model)")
    _check_same_batch(memory_name, memory, x_name, x)
    l_t, l_s = x.shape[1], memory.shape[1]
    return (_read_mask("tgt_mask", tgt_mask, x, l_t, past + l_t),
            _read_mask("memory_mask", memory_mask, x, l_t, l_s))

