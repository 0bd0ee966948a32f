"""The Transformer's stacks: encoder, decoder and the two together (chapters 8 to 10).

`Encoder` and `Decoder` stack N copies of `utils.transformer_layers`' `EncoderLayer` and
`DecoderLayer` (re-exported here, where the book imports them) with an optional final LayerNorm;
`Transformer` joins an encoder and a decoder as ``nn.Transformer`` does; `share_layers` makes
every layer of a stack one module. Each class has a ``from_torch`` that copies the parameters of
its `torch.nn` counterpart (``batch_first=True``) so that both give the same output to about
1e-6, refusing before anything is copied what it cannot reproduce exactly.

Shapes are batch first: ``src`` and ``x`` are (B, L_s, d_model), ``tgt`` (B, L_t, d_model).
Masks follow the one rule of `utils.transformer_layers` (bool, True = may attend: (B, L_k)
padding, (L_q, L_k) shared, or 3 and 4 dims), and so does what degenerate input gives. A
`utils.kv_cache.DecoderCache` lets a stack run one new position at a time. Parameter counts and
FLOP formulas are in `utils.costs`.
"""

from __future__ import annotations

import torch
from torch import nn

from ._validation import require_bool, require_int
from .convert import finish_copy, require_module, stack_config
from .kv_cache import DecoderCache, require_decoder_cache
from .layers import LayerNorm
from .transformer_layers import (
    DecoderLayer,
    EncoderLayer,
    _check_decoder_inputs,
    _check_input,
    _Layer,
    _read_mask,
)

__all__ = ["EncoderLayer", "DecoderLayer", "Encoder", "Decoder", "Transformer", "share_layers"]


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
        arguments of the copy (see `utils.convert.stack_config`)."""
        return stack_config(module, name, cls.torch_cls, cls.layer_cls._torch_config,
                            cls.__name__)

    @classmethod
    def _from_torch(cls, module: nn.Module) -> _Stack:
        new = cls(**cls._torch_config(module))
        new.layers = nn.ModuleList(cls.layer_cls.from_torch(layer) for layer in module.layers)
        if module.norm is not None:
            new.norm = LayerNorm.from_torch(module.norm)
        return finish_copy(new, module)


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
            require_decoder_cache(cache)
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
            require_decoder_cache(cache)
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
        require_module("module", module, nn.Transformer)
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
        return finish_copy(new, module)


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
    require_module("stack", stack, _Stack)
    first = stack.layers[0]
    stack.layers = nn.ModuleList([first] * stack.num_layers)
    return stack
