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
* A 2-dim mask that fits both readings (B == L_q) is ambiguous and raises a `ValueError`; say
  what you mean with 3 dims: ``pad[:, None, :]`` for padding, ``mask[None]`` for a shared mask.
* 3 dims: broadcastable to (B, L_q, L_k), the same for every head; a padding mask is
  (B, 1, L_k), a causal mask combined with padding is ``causal[None] & pad[:, None, :]``.
* 4 dims: broadcastable to (B, h, L_q, L_k).

Code that runs on batches of any size (training loops, decoding) should use the 3- or 4-dim
forms, which are never ambiguous.

PyTorch's own conventions are the opposite polarity (``src_key_padding_mask`` True = ignore,
bool ``attn_mask`` True = not allowed, or float masks with -inf); `utils.masks` converts them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._validation import require_rank, require_tensor, shape_str
from .attention import MultiHeadAttention
from .layers import LayerNorm, PositionwiseFeedForward
from .masks import expand_mask

__all__ = [
    "expand_mask",
    "EncoderLayer",
    "DecoderLayer",
    "Encoder",
    "Decoder",
    "Transformer",
    "count_parameters",
    "transformer_param_breakdown",
    "transformer_param_count",
    "encoder_layer_flops",
]


# --------------------------------------------------------------------------------------------
# Arguments and checks shared by every class
# --------------------------------------------------------------------------------------------

def _resolve_hparams(nhead: int | None, num_heads: int | None, dim_feedforward: int | None,
                     d_ff: int | None, activation: str) -> tuple[int, int]:
    """Accept torch's names (nhead, dim_feedforward) and the book's (num_heads, d_ff)."""
    if nhead is None and num_heads is None:
        raise ValueError("give the number of heads as nhead (or its alias num_heads)")
    if nhead is not None and num_heads is not None and nhead != num_heads:
        raise ValueError(f"nhead={nhead} and num_heads={num_heads} disagree; give only one")
    heads = nhead if nhead is not None else num_heads
    if dim_feedforward is not None and d_ff is not None and dim_feedforward != d_ff:
        raise ValueError(
            f"dim_feedforward={dim_feedforward} and d_ff={d_ff} disagree; give only one"
        )
    width = dim_feedforward if dim_feedforward is not None else d_ff
    if width is None:
        width = 2048  # torch's default
    if activation not in ("relu", "gelu"):
        raise ValueError(f"activation must be 'relu' or 'gelu', got {activation!r}")
    return int(heads), int(width)


def _check_dropout(dropout: float) -> None:
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {dropout}")


def _check_input(name: str, x: object, d_model: int, desc: str = "(B, L, d_model)") -> None:
    require_tensor(name, x)
    require_rank(name, x, desc.replace("d_model", f"d_model={d_model}"), rank=3)
    if x.shape[-1] != d_model:
        raise ValueError(f"{name} must have shape {desc.replace('d_model', f'd_model={d_model}')},"
                         f" got {shape_str(x)}")


def _torch_activation(module: nn.Module) -> str:
    """'relu' or 'gelu' for a torch Transformer layer, or a ValueError for anything else."""
    act = getattr(module, "activation", F.relu)
    if act is F.relu or isinstance(act, nn.ReLU):
        return "relu"
    if act is F.gelu or (isinstance(act, nn.GELU) and act.approximate == "none"):
        return "gelu"
    raise ValueError(f"only relu and (exact) gelu activations are supported, got {act!r}")


def _copy_linear(dst: nn.Linear, src: nn.Linear) -> None:
    if src.bias is None:
        raise ValueError("torch layers built with bias=False are not supported")
    with torch.no_grad():
        dst.weight.copy_(src.weight)
        dst.bias.copy_(src.bias)


def _like(new: nn.Module, module: nn.Module) -> nn.Module:
    """``new`` moved to ``module``'s dtype and device (before copying, so nothing is rounded)."""
    p = next(module.parameters())
    return new.to(dtype=p.dtype, device=p.device)


def _finish_copy(new: nn.Module, module: nn.Module) -> nn.Module:
    new = _like(new, module)
    new.train(module.training)
    return new


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

    def __init__(self, d_model: int, nhead: int | None = None, dim_feedforward: int | None = None,
                 dropout: float = 0.1, activation: str = "relu", *, layer_norm_eps: float = 1e-5,
                 norm_first: bool = False, num_heads: int | None = None, d_ff: int | None = None):
        super().__init__()
        heads, width = _resolve_hparams(nhead, num_heads, dim_feedforward, d_ff, activation)
        _check_dropout(dropout)
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
    def _from_torch(cls, module: nn.Module, torch_cls: type[nn.Module]) -> _Layer:
        if not isinstance(module, torch_cls):
            raise ValueError(f"expected nn.{torch_cls.__name__}, got {type(module).__name__}")
        new = cls(module.self_attn.embed_dim, module.self_attn.num_heads,
                  module.linear1.out_features, module.dropout.p, _torch_activation(module),
                  layer_norm_eps=module.norm1.eps, norm_first=module.norm_first)
        new = _like(new, module)
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
        d_model: width of the token vectors.
        nhead: number of heads (``num_heads`` is accepted as an alias).
        dim_feedforward: hidden width of the feed-forward network (alias ``d_ff``; default 2048).
        dropout: dropout on the attention weights, inside the feed-forward network and on each
            sublayer's output before the residual addition, as in torch (default 0.1).
        activation: ``"relu"`` or ``"gelu"``.
        layer_norm_eps: the LayerNorms' eps.
        norm_first: pre-LN when True, post-LN when False.

    Shapes:
        x (B, L, d_model) -> (B, L, d_model). ``mask``: see the module docstring.
    """

    cross_attention = False

    def _sa_block(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        return self.dropout1(self.self_attn(x, x, x, mask))

    def _ff_block(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout2(self.ff(x))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Run the layer.

        Args:
            x: (B, L, d_model).
            mask: optional bool mask, True = may attend: a (B, L) padding mask, an (L, L) mask,
                or one broadcastable to (B, L, L) or (B, h, L, L).

        Returns:
            (B, L, d_model).
        """
        _check_input("x", x, self.d_model)
        mask = expand_mask(mask, x.shape[0], x.shape[1], x.shape[1])
        if self.norm_first:
            x = x + self._sa_block(self.norm1(x), mask)
            x = x + self._ff_block(self.norm2(x))
        else:
            x = self.norm1(x + self._sa_block(x, mask))
            x = self.norm2(x + self._ff_block(x))
        return x

    @classmethod
    def from_torch(cls, module: nn.TransformerEncoderLayer) -> EncoderLayer:
        """An `EncoderLayer` holding a copy of ``module``'s parameters and settings.

        Raises:
            ValueError: for a module that is not an ``nn.TransformerEncoderLayer``, or one with
                options this class does not have (``bias=False``, another activation).
        """
        return cls._from_torch(module, nn.TransformerEncoderLayer)


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
        x (B, L_t, d_model), memory (B, L_s, d_model) -> (B, L_t, d_model).
    """

    cross_attention = True

    def _sa_block(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        return self.dropout1(self.self_attn(x, x, x, mask))

    def _ca_block(self, x: torch.Tensor, memory: torch.Tensor,
                  mask: torch.Tensor | None) -> torch.Tensor:
        return self.dropout2(self.cross_attn(x, memory, memory, mask))

    def _ff_block(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout3(self.ff(x))

    def forward(self, x: torch.Tensor, memory: torch.Tensor, tgt_mask: torch.Tensor | None = None,
                memory_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Run the layer.

        Args:
            x: the target side, (B, L_t, d_model).
            memory: the encoder's output, (B, L_s, d_model).
            tgt_mask: self-attention mask, usually causal (and padding): (L_t, L_t), (B, L_t),
                or broadcastable to (B, L_t, L_t) or (B, h, L_t, L_t).
            memory_mask: cross-attention mask, usually the source padding mask (B, L_s); or
                (L_t, L_s), or broadcastable to (B, L_t, L_s) or (B, h, L_t, L_s).

        Returns:
            (B, L_t, d_model).
        """
        _check_input("x", x, self.d_model, "(B, L_t, d_model)")
        _check_input("memory", memory, self.d_model, "(B, L_s, d_model)")
        if memory.shape[0] != x.shape[0]:
            raise ValueError(f"x {shape_str(x)} and memory {shape_str(memory)} must have the same "
                             "batch size B")
        b, l_t, l_s = x.shape[0], x.shape[1], memory.shape[1]
        tgt_mask = expand_mask(tgt_mask, b, l_t, l_t, "tgt_mask")
        memory_mask = expand_mask(memory_mask, b, l_t, l_s, "memory_mask")
        if self.norm_first:
            x = x + self._sa_block(self.norm1(x), tgt_mask)
            x = x + self._ca_block(self.norm2(x), memory, memory_mask)
            x = x + self._ff_block(self.norm3(x))
        else:
            x = self.norm1(x + self._sa_block(x, tgt_mask))
            x = self.norm2(x + self._ca_block(x, memory, memory_mask))
            x = self.norm3(x + self._ff_block(x))
        return x

    @classmethod
    def from_torch(cls, module: nn.TransformerDecoderLayer) -> DecoderLayer:
        """A `DecoderLayer` holding a copy of ``module``'s parameters and settings.

        torch's ``multihead_attn`` becomes ``cross_attn``.
        """
        return cls._from_torch(module, nn.TransformerDecoderLayer)


# --------------------------------------------------------------------------------------------
# Stacks
# --------------------------------------------------------------------------------------------

class _Stack(nn.Module):
    """What `Encoder` and `Decoder` share: N layers and an optional final LayerNorm."""

    layer_cls: type[nn.Module]

    def __init__(self, num_layers: int, d_model: int, nhead: int | None = None,
                 dim_feedforward: int | None = None, dropout: float = 0.1,
                 activation: str = "relu", *, layer_norm_eps: float = 1e-5,
                 norm_first: bool = False, final_norm: bool = False,
                 num_heads: int | None = None, d_ff: int | None = None):
        super().__init__()
        if not isinstance(num_layers, int) or num_layers <= 0:
            raise ValueError(f"num_layers must be a positive int, got {num_layers!r}")
        self.d_model = d_model
        self.num_layers = num_layers
        self.layers = nn.ModuleList(
            self.layer_cls(d_model, nhead, dim_feedforward, dropout, activation,
                           layer_norm_eps=layer_norm_eps, norm_first=norm_first,
                           num_heads=num_heads, d_ff=d_ff)
            for _ in range(num_layers)
        )
        self.norm = LayerNorm(d_model, eps=layer_norm_eps) if final_norm else None

    @classmethod
    def _from_torch(cls, module: nn.Module, torch_cls: type[nn.Module]) -> _Stack:
        if not isinstance(module, torch_cls):
            raise ValueError(f"expected nn.{torch_cls.__name__}, got {type(module).__name__}")
        if len(module.layers) == 0:
            raise ValueError(f"the {type(module).__name__} has no layers to copy")
        layers = [cls.layer_cls.from_torch(layer) for layer in module.layers]
        first = layers[0]
        new = cls(len(layers), first.d_model, first.nhead, first.dim_feedforward,
                  first.dropout1.p, first.ff.activation, layer_norm_eps=first.norm1.eps,
                  norm_first=first.norm_first, final_norm=module.norm is not None)
        new.layers = nn.ModuleList(layers)
        if module.norm is not None:
            new.norm = LayerNorm.from_torch(module.norm)
        return _finish_copy(new, module)


class Encoder(_Stack):
    """A stack of `EncoderLayer`s, with an optional final LayerNorm.

    ``nn.TransformerEncoder`` adds the final norm only when it is given one (``norm=``);
    ``nn.Transformer`` always gives it one. A pre-LN stack needs it: without it the residual
    stream leaves the last layer unnormalized.

    Args:
        num_layers: N, the number of layers.
        d_model, nhead (num_heads), dim_feedforward (d_ff), dropout, activation, layer_norm_eps,
            norm_first: as in `EncoderLayer`, the same for every layer.
        final_norm: add a LayerNorm after the last layer (default False, as in torch).

    Shapes:
        x (B, L, d_model) -> (B, L, d_model).
    """

    layer_cls = EncoderLayer

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Run every layer, then the final norm if there is one.

        Args:
            x: (B, L, d_model).
            mask: as in `EncoderLayer.forward`; read once and given to every layer.
        """
        _check_input("x", x, self.d_model)
        mask = expand_mask(mask, x.shape[0], x.shape[1], x.shape[1])
        for layer in self.layers:
            x = layer(x, mask)
        return x if self.norm is None else self.norm(x)

    @classmethod
    def from_torch(cls, module: nn.TransformerEncoder) -> Encoder:
        """An `Encoder` holding copies of ``module``'s layers and its final norm (if any)."""
        return cls._from_torch(module, nn.TransformerEncoder)


class Decoder(_Stack):
    """A stack of `DecoderLayer`s, with an optional final LayerNorm (see `Encoder`).

    Shapes:
        x (B, L_t, d_model), memory (B, L_s, d_model) -> (B, L_t, d_model).
    """

    layer_cls = DecoderLayer

    def forward(self, x: torch.Tensor, memory: torch.Tensor, tgt_mask: torch.Tensor | None = None,
                memory_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Run every layer on the same ``memory``, then the final norm if there is one.

        Masks as in `DecoderLayer.forward`.
        """
        _check_input("x", x, self.d_model, "(B, L_t, d_model)")
        _check_input("memory", memory, self.d_model, "(B, L_s, d_model)")
        if memory.shape[0] != x.shape[0]:
            raise ValueError(f"x {shape_str(x)} and memory {shape_str(memory)} must have the same "
                             "batch size B")
        b, l_t, l_s = x.shape[0], x.shape[1], memory.shape[1]
        tgt_mask = expand_mask(tgt_mask, b, l_t, l_t, "tgt_mask")
        memory_mask = expand_mask(memory_mask, b, l_t, l_s, "memory_mask")
        for layer in self.layers:
            x = layer(x, memory, tgt_mask, memory_mask)
        return x if self.norm is None else self.norm(x)

    @classmethod
    def from_torch(cls, module: nn.TransformerDecoder) -> Decoder:
        """A `Decoder` holding copies of ``module``'s layers and its final norm (if any)."""
        return cls._from_torch(module, nn.TransformerDecoder)


class Transformer(nn.Module):
    """The encoder-decoder Transformer of "Attention Is All You Need", as ``nn.Transformer``.

    An `Encoder` and a `Decoder`, each with a final LayerNorm (as ``nn.Transformer`` has). There
    are no embeddings and no output projection: inputs and outputs are d_model-wide vectors.
    Weight matrices start from Xavier-uniform values, as in ``nn.Transformer``.

    Args:
        d_model, nhead (num_heads), dim_feedforward (d_ff), dropout, activation,
            layer_norm_eps, norm_first: as in `EncoderLayer`; torch's defaults.
        num_encoder_layers, num_decoder_layers: the depth of each stack.

    Shapes:
        src (B, L_s, d_model), tgt (B, L_t, d_model) -> (B, L_t, d_model).
    """

    def __init__(self, d_model: int = 512, nhead: int | None = None, num_encoder_layers: int = 6,
                 num_decoder_layers: int = 6, dim_feedforward: int | None = None,
                 dropout: float = 0.1, activation: str = "relu", *, layer_norm_eps: float = 1e-5,
                 norm_first: bool = False, num_heads: int | None = None, d_ff: int | None = None):
        super().__init__()
        if nhead is None and num_heads is None:
            nhead = 8  # torch's default
        kwargs = dict(layer_norm_eps=layer_norm_eps, norm_first=norm_first, final_norm=True,
                      num_heads=num_heads, d_ff=d_ff)
        self.encoder = Encoder(num_encoder_layers, d_model, nhead, dim_feedforward, dropout,
                               activation, **kwargs)
        self.decoder = Decoder(num_decoder_layers, d_model, nhead, dim_feedforward, dropout,
                               activation, **kwargs)
        self.d_model = d_model
        self.nhead = self.encoder.layers[0].nhead
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.xavier_uniform_(p)

    def encode(self, src: torch.Tensor, src_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The encoder's output (the ``memory``), (B, L_s, d_model)."""
        return self.encoder(src, src_mask)

    def decode(self, tgt: torch.Tensor, memory: torch.Tensor,
               tgt_mask: torch.Tensor | None = None,
               memory_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The decoder's output for ``tgt`` given an encoded ``memory``, (B, L_t, d_model)."""
        return self.decoder(tgt, memory, tgt_mask, memory_mask)

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
        _check_input("src", src, self.d_model, "(B, L_s, d_model)")
        _check_input("tgt", tgt, self.d_model, "(B, L_t, d_model)")
        if src.shape[0] != tgt.shape[0]:
            raise ValueError(f"src {shape_str(src)} and tgt {shape_str(tgt)} must have the same "
                             "batch size B")
        memory = self.encode(src, src_mask)
        return self.decode(tgt, memory, tgt_mask, memory_mask)

    @classmethod
    def from_torch(cls, module: nn.Transformer) -> Transformer:
        """A `Transformer` holding copies of ``module``'s encoder and decoder."""
        if not isinstance(module, nn.Transformer):
            raise ValueError(f"expected nn.Transformer, got {type(module).__name__}")
        enc = Encoder.from_torch(module.encoder)
        dec = Decoder.from_torch(module.decoder)
        first = enc.layers[0]
        new = cls(first.d_model, first.nhead, 1, 1, first.dim_feedforward, first.dropout1.p,
                  first.ff.activation, layer_norm_eps=first.norm1.eps,
                  norm_first=first.norm_first)
        new.encoder, new.decoder = enc, dec
        return _finish_copy(new, module)


# --------------------------------------------------------------------------------------------
# Counting parameters and FLOPs
# --------------------------------------------------------------------------------------------

def count_parameters(module: nn.Module, trainable_only: bool = False) -> int:
    """The number of scalars in ``module``'s parameters, each shared tensor counted once."""
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

    Returns:
        ``{"embeddings", "attention", "feed_forward", "layer_norm"}`` counts; their sum is
        `transformer_param_count`.
    """
    for name, v in (("d_model", d_model), ("nhead", nhead), ("d_ff", d_ff)):
        if v <= 0:
            raise ValueError(f"{name} must be positive, got {v}")
    if d_model % nhead != 0:
        raise ValueError(f"d_model={d_model} must be divisible by nhead={nhead}")
    if num_encoder_layers < 0 or num_decoder_layers < 0 or vocab_size < 0:
        raise ValueError("layer counts and vocab_size must be non-negative, got "
                         f"{num_encoder_layers}, {num_decoder_layers}, {vocab_size}")
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
    next to these.
    """
    if seq_len <= 0 or d_model <= 0 or d_ff <= 0:
        raise ValueError(f"seq_len, d_model and d_ff must be positive, got {seq_len}, {d_model},"
                         f" {d_ff}")
    length, d = seq_len, d_model
    return {
        "attention_projections": 8 * length * d * d,
        "attention_scores": 4 * length * length * d,
        "feed_forward": 4 * length * d * d_ff,
    }

