"""The Transformer's layers and stacks: encoder, decoder and the two together (chapters 8 to 10).

Everything is built from the pieces of the earlier chapters, `utils.attention.MultiHeadAttention`,
`utils.layers.LayerNorm` and `utils.layers.PositionwiseFeedForward`, and each class has a
``from_torch`` that copies the parameters of its `torch.nn` counterpart (``batch_first=True``)
so that both give the same output to about 1e-6.

Shapes are batch first: ``x`` is (B, L, d_model).

Masks
-----
Every mask argument is a bool tensor in the book's convention, True = "this query may attend to
this key". One rule, the same for every argument (``mask``, ``tgt_mask``, ``memory_mask``,
``src_mask``), decides how a mask is read; `utils.masks.expand_mask` applies it:

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

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ._validation import (
    InputTypeError,
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
from .attention import KVCache, MultiHeadAttention
from .layers import LayerNorm, PositionwiseFeedForward
from .masks import expand_mask

__all__ = [
    "expand_mask",
    "EncoderLayer",
    "DecoderLayer",
    "Encoder",
    "Decoder",
    "Transformer",
    "DecoderCache",
    "share_layers",
    "count_parameters",
    "transformer_param_breakdown",
    "transformer_param_count",
    "encoder_layer_flops",
]

ACTIVATION_CHOICES = ("relu", "gelu")


# --------------------------------------------------------------------------------------------
# Arguments and checks shared by every class
# --------------------------------------------------------------------------------------------

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


# --------------------------------------------------------------------------------------------
# What from_torch checks before it copies anything
# --------------------------------------------------------------------------------------------

def _require_module(name: str, module: object, cls: type[nn.Module]) -> None:
    if not isinstance(module, cls):
        raise InputTypeError(f"{name} must be an nn.{cls.__name__}, got {type(module).__name__}")


def _require_uniform_parameters(name: str, module: nn.Module) -> None:
    """Every parameter floating point, with one dtype on one device (else the copy would round
    or move some of them)."""
    kinds = sorted({(str(p.dtype), str(p.device)) for p in module.parameters()})
    if len(kinds) > 1:
        raise InputTypeError(
            f"{name}'s parameters mix dtypes or devices ({', '.join(' on '.join(k) for k in kinds)}"
            f"); convert it with {name}.to(dtype, device) first"
        )
    if any(not p.is_floating_point() for p in module.parameters()):
        raise InputTypeError(f"{name}'s parameters must be floating point, got {kinds}")


def _torch_activation(name: str, module: nn.Module) -> str:
    """'relu' or 'gelu' for a torch Transformer layer, or a ValueError for anything else."""
    act = getattr(module, "activation", F.relu)
    if act is F.relu or act is torch.relu or isinstance(act, nn.ReLU):
        found = "relu"
    elif act is F.gelu or (isinstance(act, nn.GELU) and act.approximate == "none"):
        found = "gelu"
    else:
        raise ValueError(
            f"{name}.activation must be relu or the exact gelu (approximate='none'), got {act!r}"
        )
    # The encoder layer's fast path (eval mode, no autograd) reads this flag, not .activation
    # (0 turns the fast path off): if someone swapped .activation after construction, torch's
    # two paths compute different functions.
    flag = getattr(module, "activation_relu_or_gelu", 0)
    if flag and flag != {"relu": 1, "gelu": 2}[found]:
        raise ValueError(
            f"{name}.activation is {found} but {name}.activation_relu_or_gelu={flag!r} makes "
            "torch's fast path use another one; build the layer with the activation you want"
        )
    return found


def _torch_attention(name: str, attn: object, d_model: int) -> tuple[int, float]:
    """Check an ``nn.MultiheadAttention`` of a torch layer; return its heads and dropout."""
    _require_module(name, attn, nn.MultiheadAttention)
    if not attn.batch_first:
        raise ValueError(
            f"{name} has batch_first=False, but the book's modules are batch first: the weights "
            "would copy, yet the copy would read (L, B, d_model) inputs as (B, L, d_model). "
            "Build the torch module with batch_first=True and load_state_dict(module.state_dict())"
            " into it, then copy that"
        )
    if attn.embed_dim != d_model:
        raise ValueError(f"{name}.embed_dim must be d_model={d_model}, got {attn.embed_dim}")
    if not attn._qkv_same_embed_dim:
        raise ValueError(f"{name} has kdim/vdim different from embed_dim, which is not supported")
    if attn.bias_k is not None or attn.add_zero_attn:
        raise ValueError(f"{name} uses add_bias_kv or add_zero_attn, which are not supported")
    if attn.in_proj_bias is None or attn.out_proj.bias is None:
        raise ValueError(f"{name} has no bias (bias=False); the book's layers always have biases")
    return attn.num_heads, float(attn.dropout)


def _torch_linear(name: str, linear: object, in_features: int | None,
                  out_features: int | None) -> nn.Linear:
    _require_module(name, linear, nn.Linear)
    for what, want, got in (("in_features", in_features, linear.in_features),
                            ("out_features", out_features, linear.out_features)):
        if want is not None and got != want:
            raise ValueError(f"{name}.{what} must be {want}, got {got}")
    if linear.bias is None:
        raise ValueError(f"{name} has no bias (bias=False); the book's layers always have biases")
    return linear


def _torch_norm(name: str, norm: object, d_model: int) -> float:
    """Check an ``nn.LayerNorm`` the book's `LayerNorm` can copy exactly; return its eps."""
    _require_module(name, norm, nn.LayerNorm)
    if tuple(norm.normalized_shape) != (d_model,):
        raise ValueError(f"{name} must normalize over (d_model,) = ({d_model},), got "
                         f"{tuple(norm.normalized_shape)}")
    if norm.weight is None:
        raise ValueError(f"{name} has no gain and bias (elementwise_affine=False); the book's "
                         "LayerNorm always learns both")
    if norm.bias is None:
        raise ValueError(f"{name} has no bias (bias=False); the book's LayerNorm always has one")
    return float(norm.eps)


def _all_equal(what: str, values: dict[str, object]) -> object:
    """The one value in ``values`` ({name: value}); a ValueError naming each if they differ."""
    if len(set(values.values())) > 1:
        listed = ", ".join(f"{k}={v!r}" for k, v in values.items())
        raise ValueError(f"{what} must be the same everywhere to be copied, got {listed}")
    return next(iter(values.values()))


def _like(new: nn.Module, module: nn.Module) -> nn.Module:
    """``new`` moved to ``module``'s dtype and device (before copying, so nothing is rounded)."""
    p = next(module.parameters())
    return new.to(dtype=p.dtype, device=p.device)


def _finish_copy(new: nn.Module, module: nn.Module) -> nn.Module:
    new = _like(new, module)
    new.train(module.training)
    return new


def _copy_linear(dst: nn.Linear, src: nn.Linear) -> None:
    with torch.no_grad():
        dst.weight.copy_(src.weight)
        dst.bias.copy_(src.bias)


# --------------------------------------------------------------------------------------------
# Layers
# --------------------------------------------------------------------------------------------

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
        """Check that ``module`` can be copied exactly; return the constructor arguments."""
        _require_module(name, module, cls.torch_cls)
        _require_module(f"{name}.self_attn", module.self_attn, nn.MultiheadAttention)
        d_model = module.self_attn.embed_dim
        attn_names = ("self_attn", "multihead_attn") if cls.cross_attention else ("self_attn",)
        heads, drops = {}, {}
        for attn in attn_names:
            heads[f"{name}.{attn}.num_heads"], drops[f"{name}.{attn}.dropout"] = _torch_attention(
                f"{name}.{attn}", getattr(module, attn), d_model)
        linear1 = _torch_linear(f"{name}.linear1", module.linear1, d_model, None)
        _torch_linear(f"{name}.linear2", module.linear2, linear1.out_features, d_model)
        norms = ("norm1", "norm2", "norm3") if cls.cross_attention else ("norm1", "norm2")
        eps = {f"{name}.{n}.eps": _torch_norm(f"{name}.{n}", getattr(module, n), d_model)
               for n in norms}
        dropouts = ("dropout", "dropout1", "dropout2", "dropout3")[: len(norms) + 1]
        for d in dropouts:
            _require_module(f"{name}.{d}", getattr(module, d), nn.Dropout)
            drops[f"{name}.{d}.p"] = float(getattr(module, d).p)
        if not isinstance(module.norm_first, bool):
            raise InputTypeError(f"{name}.norm_first must be True or False, got "
                                 f"{module.norm_first!r}")
        _require_uniform_parameters(name, module)
        return dict(d_model=d_model, nhead=_all_equal("the number of heads", heads),
                    dim_feedforward=linear1.out_features,
                    dropout=_all_equal("the dropout probability", drops),
                    activation=_torch_activation(name, module),
                    layer_norm_eps=_all_equal("the LayerNorm eps", eps),
                    norm_first=module.norm_first)

    @classmethod
    def _from_torch(cls, module: nn.Module) -> _Layer:
        new = _like(cls(**cls._torch_config(module)), module)
        new.self_attn = MultiHeadAttention.from_torch(module.self_attn)
        if cls.cross_attention:
            new.cross_attn = MultiHeadAttention.from_torch(module.multihead_attn)
        _copy_linear(new.ff.linear1, module.linear1)
        _copy_linear(new.ff.linear2, module.linear2)
        new.norm1 = LayerNorm.from_torch(module.norm1)
        new.norm2 = LayerNorm.from_torch(module.norm2)
        if cls.cross_attention:
            new.norm3 = LayerNorm.from_torch(module.norm3)
        return _finish_copy(new, module)


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
                  cache: KVCache | None = None) -> torch.Tensor:
        return apply_dropout(self.dropout1, self.self_attn(x, x, x, mask, cache=cache))

    def _ff_block(self, x: torch.Tensor) -> torch.Tensor:
        return apply_dropout(self.dropout2, self.ff(x))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None,
                cache: KVCache | None = None) -> torch.Tensor:
        """Run the layer.

        Args:
            x: (B, L, d_model), with the layer's dtype and device.
            mask: optional bool mask, True = may attend: a (B, L) padding mask, an (L, L) mask,
                or one broadcastable to (B, L, L) or (B, h, L, L). With a cache holding L_past
                positions, the keys number L_past + L: (B, L_past + L), (L, L_past + L), ...
            cache: optional `utils.attention.KVCache` of this layer's self-attention: ``x`` is
                then only the new positions, whose keys and values are appended to it (used by
                a decoder-only model generating text one token at a time).

        Returns:
            (B, L, d_model).
        """
        _check_input("x", x, self)
        l_k = x.shape[1] + (0 if cache is None else _cache_length(cache))
        mask = _read_mask("mask", mask, x, x.shape[1], l_k)
        if self.norm_first:
            x = x + self._sa_block(self.norm1(x), mask, cache)
            x = x + self._ff_block(self.norm2(x))
        else:
            x = self.norm1(x + self._sa_block(x, mask, cache))
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
                  cache: KVCache | None = None) -> torch.Tensor:
        return apply_dropout(self.dropout1, self.self_attn(x, x, x, mask, cache=cache))

    def _ca_block(self, x: torch.Tensor, memory: torch.Tensor, mask: torch.Tensor | None,
                  cache: KVCache | None = None) -> torch.Tensor:
        return apply_dropout(self.dropout2, self.cross_attn(x, memory, memory, mask, cache=cache))

    def _ff_block(self, x: torch.Tensor) -> torch.Tensor:
        return apply_dropout(self.dropout3, self.ff(x))

    def forward(self, x: torch.Tensor, memory: torch.Tensor, tgt_mask: torch.Tensor | None = None,
                memory_mask: torch.Tensor | None = None, cache: KVCache | None = None,
                memory_cache: KVCache | None = None) -> torch.Tensor:
        """Run the layer.

        Args:
            x: the target side, (B, L_t, d_model).
            memory: the encoder's output, (B, L_s, d_model).
            tgt_mask: self-attention mask, usually causal (and padding): (L_t, L_t), (B, L_t),
                or broadcastable to (B, L_t, L_t) or (B, h, L_t, L_t). With a ``cache`` of
                L_past positions, the keys number L_past + L_t.
            memory_mask: cross-attention mask, usually the source padding mask (B, L_s); or
                (L_t, L_s), or broadcastable to (B, L_t, L_s) or (B, h, L_t, L_s).
            cache: optional `utils.attention.KVCache` of the self-attention (``x`` is then only
                the new positions).
            memory_cache: optional static `utils.attention.KVCache` of the cross-attention: the
                memory's keys and values, computed on the first call and reused afterwards.

        Returns:
            (B, L_t, d_model).
        """
        past = 0 if cache is None else _cache_length(cache)
        tgt_mask, memory_mask = _check_decoder_inputs(self, x, memory, tgt_mask, memory_mask,
                                                      past=past)
        if self.norm_first:
            x = x + self._sa_block(self.norm1(x), tgt_mask, cache)
            x = x + self._ca_block(self.norm2(x), memory, memory_mask, memory_cache)
            x = x + self._ff_block(self.norm3(x))
        else:
            x = self.norm1(x + self._sa_block(x, tgt_mask, cache))
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


def _cache_length(cache: object) -> int:
    if not isinstance(cache, KVCache):
        raise InputTypeError(f"cache must be a utils.attention.KVCache or None, got "
                             f"{type(cache).__name__}")
    return cache.length


@dataclass
class DecoderCache:
    """The key/value caches of a whole stack, for generating one token at a time.

    One `utils.attention.KVCache` per layer for the self-attention (``self_attn``) and, for an
    encoder-decoder's decoder, one static cache per layer for the cross-attention
    (``cross_attn``: the memory's keys and values, computed once). Make one with
    `DecoderCache.for_stack` (or a model's ``new_cache()``), pass it to every call of the
    stack, and feed it only the new positions.

    Attributes:
        self_attn: N caches, each k, v of shape (B, h_kv, L_past, d_k).
        cross_attn: N static caches (B, h_kv, L_s, d_k), or an empty list.
    """

    self_attn: list[KVCache] = field(default_factory=list)
    cross_attn: list[KVCache] = field(default_factory=list)

    @classmethod
    def for_stack(cls, num_layers: int, cross_attention: bool = False,
                  max_len: int | None = None) -> DecoderCache:
        """Empty caches for ``num_layers`` layers; each self-attention cache holds at most
        ``max_len`` positions (None: no limit)."""
        num_layers = require_int("num_layers", num_layers)
        require_bool("cross_attention", cross_attention)
        if max_len is not None:
            max_len = require_int("max_len", max_len)
        return cls([KVCache(max_len=max_len) for _ in range(num_layers)],
                   [KVCache(static=True) for _ in range(num_layers)] if cross_attention else [])

    @property
    def length(self) -> int:
        """L_past, the number of positions already processed (0 for a fresh cache)."""
        return self.self_attn[0].length if self.self_attn else 0

    @property
    def nbytes(self) -> int:
        """Bytes held by every key and value, self- and cross-attention."""
        return sum(c.nbytes for c in (*self.self_attn, *self.cross_attn))

    @property
    def self_attn_nbytes(self) -> int:
        """Bytes of the self-attention caches only: 2 * N * B * h_kv * L_past * d_k * bytes."""
        return sum(c.nbytes for c in self.self_attn)

    def memory_bytes(self) -> int:
        """The same as `nbytes`."""
        return self.nbytes

    def reserve(self, length: int) -> DecoderCache:
        """Reserve room for ``length`` positions in every self-attention cache (see
        `utils.attention.KVCache.reserve`): later steps write in place instead of copying the
        cache. Returns the cache."""
        for c in self.self_attn:
            c.reserve(length)
        return self

    def check(self, num_layers: int, cross_attention: bool, batch: int) -> None:
        """Raise a `ValueError` unless the cache fits a stack of ``num_layers`` layers (with
        cross-attention caches when ``cross_attention``) fed a batch of ``batch`` rows."""
        if len(self.self_attn) != num_layers:
            raise ValueError(f"the cache has {len(self.self_attn)} self-attention caches but the "
                             f"stack has {num_layers} layers")
        if cross_attention and len(self.cross_attn) != num_layers:
            raise ValueError(f"the cache has {len(self.cross_attn)} cross-attention caches but "
                             f"the decoder has {num_layers} layers")
        held = self.self_attn[0].batch_size
        if held is not None and held != batch:
            raise ValueError(f"the cache holds a batch of B={held} sequences, got an input of "
                             f"B={batch}: a cache serves the batch it was started with")


# --------------------------------------------------------------------------------------------
# Stacks
# --------------------------------------------------------------------------------------------

class _Stack(nn.Module):
    """What `Encoder` and `Decoder` share: N layers and an optional final LayerNorm."""

    layer_cls: type[_Layer]
    torch_cls: type[nn.Module]

    def __init__(self, num_layers: int, d_model: int, nhead: int | None = None,
                 dim_feedforward: int | None = None, dropout: float = 0.1,
                 activation: str = "relu", *, layer_norm_eps: float = 1e-5,
                 norm_first: bool = False, final_norm: bool = False,
                 num_heads: int | None = None, d_ff: int | None = None):
        super().__init__()
        num_layers = require_int("num_layers", num_layers)
        require_bool("final_norm", final_norm)
        self.num_layers = num_layers
        self.layers = nn.ModuleList(
            self.layer_cls(d_model, nhead, dim_feedforward, dropout, activation,
                           layer_norm_eps=layer_norm_eps, norm_first=norm_first,
                           num_heads=num_heads, d_ff=d_ff)
            for _ in range(num_layers)
        )
        self.d_model = self.layers[0].d_model
        self.norm = LayerNorm(self.d_model, eps=layer_norm_eps) if final_norm else None

    @classmethod
    def _torch_config(cls, module: object, name: str = "module") -> dict[str, object]:
        """Check that the torch stack ``module`` can be copied exactly; return the constructor
        arguments of the copy."""
        _require_module(name, module, cls.torch_cls)
        layers = list(module.layers)
        if not layers:
            raise ValueError(f"the {type(module).__name__} {name} has no layers to copy")
        configs = [cls.layer_cls._torch_config(layer, f"{name}.layers[{i}]")
                   for i, layer in enumerate(layers)]
        for i, config in enumerate(configs[1:], start=1):
            for key, value in config.items():
                if value != configs[0][key]:
                    raise ValueError(
                        f"{name}.layers[{i}] has {key}={value!r} but {name}.layers[0] has "
                        f"{configs[0][key]!r}: {cls.__name__} needs every layer configured alike"
                    )
        own = sum(len(list(m.parameters())) for m in [*layers, module.norm] if m is not None)
        if len(list(module.parameters())) != own:
            raise ValueError(f"{name}'s layers share parameters; the copy would give each "
                             "layer its own, untying them")
        if module.norm is not None:
            eps = _torch_norm(f"{name}.norm", module.norm, configs[0]["d_model"])
            _all_equal("the LayerNorm eps", {f"{name}.norm.eps": eps,
                                             f"{name}.layers[0].norm1.eps":
                                                 configs[0]["layer_norm_eps"]})
        # With nested tensors and mask_check=False, torch trusts without checking that padding
        # sits at the end of each row; for any other padding mask its output is not the
        # function the layers define, and no copy can reproduce it.
        if getattr(module, "use_nested_tensor", False) and not getattr(module, "mask_check", True):
            raise ValueError(
                f"{name} uses nested tensors with mask_check=False: torch's output then depends "
                "on an unchecked promise that padding is on the right. Build it with "
                "mask_check=True or enable_nested_tensor=False"
            )
        _require_uniform_parameters(name, module)
        return dict(num_layers=len(layers), **configs[0], final_norm=module.norm is not None)

    @classmethod
    def _from_torch(cls, module: nn.Module) -> _Stack:
        new = cls(**cls._torch_config(module))
        new.layers = nn.ModuleList(cls.layer_cls.from_torch(layer) for layer in module.layers)
        if module.norm is not None:
            new.norm = LayerNorm.from_torch(module.norm)
        return _finish_copy(new, module)


def _require_module_cache(cache: object) -> None:
    if not isinstance(cache, DecoderCache):
        raise InputTypeError(f"cache must be a DecoderCache or None, got {type(cache).__name__}")


class Encoder(_Stack):
    """A stack of `EncoderLayer`s, with an optional final LayerNorm.

    ``nn.TransformerEncoder`` adds the final norm only when it is given one (``norm=``);
    ``nn.Transformer`` always gives it one. A pre-LN stack needs it: without it the residual
    stream leaves the last layer unnormalized.

    Args:
        num_layers: N, the number of layers, a positive int.
        d_model, nhead (num_heads), dim_feedforward (d_ff), dropout, activation, layer_norm_eps,
            norm_first: as in `EncoderLayer`, the same for every layer.
        final_norm: add a LayerNorm after the last layer (default False, as in torch).

    Shapes:
        x (B, L, d_model) -> (B, L, d_model); degenerate inputs as in `EncoderLayer`.
    """

    layer_cls = EncoderLayer
    torch_cls = nn.TransformerEncoder

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None,
                cache: DecoderCache | None = None) -> torch.Tensor:
        """Run every layer, then the final norm if there is one.

        Args:
            x: (B, L, d_model); with a cache, only the new positions.
            mask: as in `EncoderLayer.forward`; read once and given to every layer.
            cache: optional `DecoderCache` (one self-attention cache per layer), for a stack
                run under a causal mask as a decoder-only model one token at a time.
        """
        _check_input("x", x, self)
        past = 0
        if cache is not None:
            _require_module_cache(cache)
            cache.check(self.num_layers, False, x.shape[0])
            past = cache.length
        mask = _read_mask("mask", mask, x, x.shape[1], past + x.shape[1])
        for i, layer in enumerate(self.layers):
            x = layer(x, mask, None if cache is None else cache.self_attn[i])
        return x if self.norm is None else self.norm(x)

    @classmethod
    def from_torch(cls, module: nn.TransformerEncoder) -> Encoder:
        """An `Encoder` holding copies of ``module``'s layers and its final norm (if any).

        Refused, besides what `EncoderLayer.from_torch` refuses in any layer: layers that differ
        from one another in any setting, layers that share parameters, a final norm that is not
        an affine ``nn.LayerNorm`` with the layers' eps, and ``mask_check=False`` together with
        nested tensors (torch's output then depends on where the padding is).

        With nested tensors on (torch's default), torch's fast path (eval mode, no autograd,
        a ``src_key_padding_mask``) returns zeros at padded positions, where the copy computes
        them as every other position: the real positions agree.
        """
        return cls._from_torch(module)


class Decoder(_Stack):
    """A stack of `DecoderLayer`s, with an optional final LayerNorm (see `Encoder`).

    Shapes:
        x (B, L_t, d_model), memory (B, L_s, d_model) -> (B, L_t, d_model); degenerate inputs
        as in `DecoderLayer`.
    """

    layer_cls = DecoderLayer
    torch_cls = nn.TransformerDecoder

    def forward(self, x: torch.Tensor, memory: torch.Tensor, tgt_mask: torch.Tensor | None = None,
                memory_mask: torch.Tensor | None = None,
                cache: DecoderCache | None = None) -> torch.Tensor:
        """Run every layer on the same ``memory``, then the final norm if there is one.

        Masks as in `DecoderLayer.forward`. With a `DecoderCache` (see
        `DecoderCache.for_stack`), ``x`` holds only the new target positions: each layer's
        self-attention appends their keys and values to its cache, and its cross-attention
        projects the memory once, on the first call, and reuses it afterwards.
        """
        past = 0
        if cache is not None:
            _require_module_cache(cache)
            _check_input("x", x, self, "(B, L_t, d_model)")
            cache.check(self.num_layers, True, x.shape[0])
            past = cache.length
        tgt_mask, memory_mask = _check_decoder_inputs(self, x, memory, tgt_mask, memory_mask,
                                                      past=past)
        for i, layer in enumerate(self.layers):
            if cache is None:
                x = layer(x, memory, tgt_mask, memory_mask)
            else:
                x = layer(x, memory, tgt_mask, memory_mask, cache.self_attn[i],
                          cache.cross_attn[i])
        return x if self.norm is None else self.norm(x)

    @classmethod
    def from_torch(cls, module: nn.TransformerDecoder) -> Decoder:
        """A `Decoder` holding copies of ``module``'s layers and its final norm (if any).

        Refused as in `Encoder.from_torch` (with `DecoderLayer.from_torch` for each layer).
        """
        return cls._from_torch(module)


class Transformer(nn.Module):
    """The encoder-decoder Transformer of "Attention Is All You Need", as ``nn.Transformer``.

    An `Encoder` and a `Decoder`, each with a final LayerNorm (as ``nn.Transformer`` has). There
    are no embeddings and no output projection: inputs and outputs are d_model-wide vectors.
    Weight matrices start from Xavier-uniform values, as in ``nn.Transformer``.

    Args:
        d_model, nhead (num_heads), dim_feedforward (d_ff), dropout, activation,
            layer_norm_eps, norm_first: as in `EncoderLayer`; torch's defaults.
        num_encoder_layers, num_decoder_layers: the depth of each stack, positive ints.

    Shapes:
        src (B, L_s, d_model), tgt (B, L_t, d_model) -> (B, L_t, d_model). With an empty
        source (L_s = 0) or a fully masked one, each cross-attention gives just its bias b_O.
    """

    def __init__(self, d_model: int = 512, nhead: int | None = None, num_encoder_layers: int = 6,
                 num_decoder_layers: int = 6, dim_feedforward: int | None = None,
                 dropout: float = 0.1, activation: str = "relu", *, layer_norm_eps: float = 1e-5,
                 norm_first: bool = False, num_heads: int | None = None, d_ff: int | None = None):
        super().__init__()
        if nhead is None and num_heads is None:
            nhead = 8  # torch's default
        require_int("num_encoder_layers", num_encoder_layers)
        require_int("num_decoder_layers", num_decoder_layers)
        kwargs = dict(layer_norm_eps=layer_norm_eps, norm_first=norm_first, final_norm=True,
                      num_heads=num_heads, d_ff=d_ff)
        self.encoder = Encoder(num_encoder_layers, d_model, nhead, dim_feedforward, dropout,
                               activation, **kwargs)
        self.decoder = Decoder(num_decoder_layers, d_model, nhead, dim_feedforward, dropout,
                               activation, **kwargs)
        self.d_model = self.encoder.d_model
        self.nhead = self.encoder.layers[0].nhead
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.xavier_uniform_(p)

    def encode(self, src: torch.Tensor, src_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The encoder's output (the ``memory``), (B, L_s, d_model)."""
        _check_input("src", src, self, "(B, L_s, d_model)")
        return self.encoder(src, src_mask)

    def decode(self, tgt: torch.Tensor, memory: torch.Tensor,
               tgt_mask: torch.Tensor | None = None,
               memory_mask: torch.Tensor | None = None,
               cache: DecoderCache | None = None) -> torch.Tensor:
        """The decoder's output for ``tgt`` given an encoded ``memory``, (B, L_t, d_model).

        With a `DecoderCache` (see `Decoder.forward`), ``tgt`` holds only the new positions.
        """
        if cache is None:
            _check_decoder_inputs(self, tgt, memory, tgt_mask, memory_mask, x_name="tgt")
        return self.decoder(tgt, memory, tgt_mask, memory_mask, cache=cache)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor, src_mask: torch.Tensor | None = None,
                tgt_mask: torch.Tensor | None = None,
                memory_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Encode ``src``, then decode ``tgt`` against it.

        Args:
            src: (B, L_s, d_model).
            tgt: (B, L_t, d_model).
            src_mask: the encoder's self-attention mask, usually the source padding mask (B, L_s).
            tgt_mask: the decoder's self-attention mask, usually causal: (L_t, L_t), or
                ``causal[None] & tgt_pad[:, None, :]`` with target padding.
            memory_mask: the cross-attention mask, usually the source padding mask (B, L_s).
                None lets every target position see every source position, padding included,
                as in torch: pass the source padding mask here too.

        Returns:
            (B, L_t, d_model).
        """
        # Every argument is checked before the encoder runs (the memory has src's shape).
        _check_decoder_inputs(self, tgt, src, tgt_mask, memory_mask, x_name="tgt",
                              memory_name="src")
        _read_mask("src_mask", src_mask, src, src.shape[1], src.shape[1])
        memory = self.encode(src, src_mask)
        return self.decode(tgt, memory, tgt_mask, memory_mask)

    @classmethod
    def from_torch(cls, module: nn.Transformer) -> Transformer:
        """A `Transformer` holding copies of ``module``'s encoder and decoder.

        Refused, besides what `Encoder.from_torch` and `Decoder.from_torch` refuse: a custom
        encoder or decoder that is not a torch stack, one without a final norm, and an encoder
        and a decoder whose layers differ in any setting (one `Transformer` has one).
        """
        _require_module("module", module, nn.Transformer)
        enc = Encoder._torch_config(module.encoder, "module.encoder")
        dec = Decoder._torch_config(module.decoder, "module.decoder")
        for name, config in (("encoder", enc), ("decoder", dec)):
            if not config["final_norm"]:
                raise ValueError(f"module.{name} has no final norm, which a Transformer always "
                                 f"has; copy it alone with {name.capitalize()}.from_torch")
        for key, value in enc.items():
            if key != "num_layers" and dec[key] != value:
                raise ValueError(f"module.encoder has {key}={value!r} but module.decoder has "
                                 f"{dec[key]!r}: a Transformer uses one configuration for both")
        new = cls(enc["d_model"], enc["nhead"], 1, 1, enc["dim_feedforward"], enc["dropout"],
                  enc["activation"], layer_norm_eps=enc["layer_norm_eps"],
                  norm_first=enc["norm_first"])
        new.encoder = Encoder.from_torch(module.encoder)
        new.decoder = Decoder.from_torch(module.decoder)
        return _finish_copy(new, module)


def share_layers(stack: Encoder | Decoder) -> Encoder | Decoder:
    """Make every layer of ``stack`` one and the same module, its first layer; in place.

    This is cross-layer parameter sharing, as in ALBERT (Lan et al., 2020) and the Universal
    Transformer (Dehghani et al., 2019): the stack still runs N layers, but they all hold the
    first layer's weights, so it stores the parameters of one layer (plus the final norm, if
    any) instead of N. The output is the first layer applied N times, then the final norm; the
    compute is unchanged. The weights the other layers held are dropped. Gradients of the
    shared weights add up the contributions of every application.

    Args:
        stack: an `Encoder` or a `Decoder` (also one already shared: nothing changes).

    Returns:
        ``stack`` itself, so that ``share_layers(Encoder(...))`` reads as a constructor.
    """
    _require_module("stack", stack, _Stack)
    first = stack.layers[0]
    stack.layers = nn.ModuleList([first] * stack.num_layers)
    return stack


# --------------------------------------------------------------------------------------------
# Counting parameters and FLOPs
# --------------------------------------------------------------------------------------------

def count_parameters(module: nn.Module, trainable_only: bool = False) -> int:
    """The number of scalars in ``module``'s parameters, each shared tensor counted once.

    A module without parameters gives 0; ``trainable_only=True`` counts only those with
    ``requires_grad``.
    """
    _require_module("module", module, nn.Module)
    require_bool("trainable_only", trainable_only)
    return sum(p.numel() for p in module.parameters() if p.requires_grad or not trainable_only)


def transformer_param_breakdown(d_model: int, nhead: int, d_ff: int, num_encoder_layers: int,
                                num_decoder_layers: int, vocab_size: int = 0,
                                tied: bool = True) -> dict[str, int]:
    """Where the parameters of an encoder-decoder Transformer sit, by formula.

    The stacks are those of ``nn.Transformer`` (biases everywhere, a final LayerNorm on each
    stack). With ``d = d_model``:

    * attention: 4 d^2 + 4 d per attention block (W_Q, W_K, W_V, W_O and their biases); one
      block per encoder layer, two per decoder layer. It does not depend on ``nhead``.
    * feed_forward: 2 d d_ff + d_ff + d per layer.
    * layer_norm: 2 d per LayerNorm (gain and bias): 2 per encoder layer, 3 per decoder layer,
      and the 2 final norms.
    * embeddings: a (vocab_size, d) matrix. ``tied=True`` shares one matrix between the source
      embedding, the target embedding and the output projection, as the paper does; ``tied=False``
      counts three separate matrices (the output projection without a bias).

    ``d_model``, ``nhead`` (dividing ``d_model``) and ``d_ff`` are positive ints; the layer
    counts and ``vocab_size`` are ints >= 0 (0 counts nothing for that part; the two final
    norms are always counted). Anything else raises.

    Returns:
        ``{"embeddings", "attention", "feed_forward", "layer_norm"}`` counts; their sum is
        `transformer_param_count`.
    """
    d_model, nhead, d_ff = (require_int(n, v) for n, v in
                            (("d_model", d_model), ("nhead", nhead), ("d_ff", d_ff)))
    if d_model % nhead != 0:
        raise ValueError(f"d_model={d_model} must be divisible by nhead={nhead}")
    num_encoder_layers, num_decoder_layers, vocab_size = (
        require_int(n, v, minimum=0) for n, v in (("num_encoder_layers", num_encoder_layers),
                                                 ("num_decoder_layers", num_decoder_layers),
                                                 ("vocab_size", vocab_size)))
    require_bool("tied", tied)
    d = d_model
    attn_block = 4 * d * d + 4 * d
    ffn = 2 * d * d_ff + d_ff + d
    norm = 2 * d
    n_e, n_d = num_encoder_layers, num_decoder_layers
    return {
        "embeddings": vocab_size * d * (1 if tied else 3),
        "attention": attn_block * (n_e + 2 * n_d),
        "feed_forward": ffn * (n_e + n_d),
        "layer_norm": norm * (2 * n_e + 3 * n_d + 2),
    }


def transformer_param_count(d_model: int, nhead: int, d_ff: int, num_encoder_layers: int,
                            num_decoder_layers: int, vocab_size: int = 0,
                            tied: bool = True) -> int:
    """The total of `transformer_param_breakdown`: ``nn.Transformer``'s count plus embeddings."""
    return sum(transformer_param_breakdown(d_model, nhead, d_ff, num_encoder_layers,
                                           num_decoder_layers, vocab_size, tied).values())


def encoder_layer_flops(seq_len: int, d_model: int, d_ff: int) -> dict[str, int]:
    """Floating-point operations of one encoder layer on one sequence, matrix products only.

    A product of an (m, k) and a (k, n) matrix costs 2 m k n operations (a multiply and an add
    per term). With L = ``seq_len`` and d = ``d_model``:

    * ``attention_projections``: W_Q, W_K, W_V and W_O, 4 * 2 L d^2 = 8 L d^2, linear in L.
    * ``attention_scores``: Q K^T and the weights times V, 2 * 2 L^2 d = 4 L^2 d, quadratic in L
      (summed over the heads, it does not depend on their number).
    * ``feed_forward``: two products, 2 * 2 L d d_ff = 4 L d d_ff, linear in L.

    Softmax, LayerNorm, biases and activations are left out: they cost O(L d) or O(L^2 h), small
    next to these. Every argument is a positive int.
    """
    seq_len, d_model, d_ff = (require_int(n, v) for n, v in
                              (("seq_len", seq_len), ("d_model", d_model), ("d_ff", d_ff)))
    length, d = seq_len, d_model
    return {
        "attention_projections": 8 * length * d * d,
        "attention_scores": 4 * length * length * d,
        "feed_forward": 4 * length * d * d_ff,
    }

