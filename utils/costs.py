"""What a Transformer costs, by formula: parameters, FLOPs and cache memory (chapters 8, 10, 13).

* `count_parameters`: the scalars a module holds, each shared tensor once;
* `transformer_param_breakdown` and `transformer_param_count`: where the parameters of an
  encoder-decoder Transformer (d_model, h heads, d_ff, N_e and N_d layers, a vocabulary) sit;
* `encoder_layer_flops`: the matrix-product FLOPs of one encoder layer on one sequence of L
  tokens: 8 L d^2 + 4 L^2 d + 4 L d d_ff;
* `kv_cache_bytes`: the memory of a self-attention key/value cache, N layers of (B, h_kv, L, d_k)
  keys and values.

Every argument is checked: counts are ints (a float or a bool raises), sizes positive.
"""

from __future__ import annotations

import torch
from torch import nn

from ._validation import InputTypeError, require_bool, require_int, type_name
from .convert import require_module

__all__ = ["count_parameters", "transformer_param_breakdown", "transformer_param_count",
           "encoder_layer_flops", "kv_cache_bytes"]


def count_parameters(module: nn.Module, trainable_only: bool = False) -> int:
    """The number of scalars in ``module``'s parameters, each shared tensor counted once.

    A module without parameters gives 0; ``trainable_only=True`` counts only those with
    ``requires_grad``.
    """
    require_module("module", module, nn.Module)
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


def kv_cache_bytes(num_layers: int, batch_size: int, num_kv_heads: int, length: int, d_k: int,
                   dtype: torch.dtype = torch.float32) -> int:
    """The memory of a self-attention key/value cache, by formula, in bytes.

    2 (keys and values) * num_layers * B * h_kv * L * d_k * (bytes per number of ``dtype``).
    It grows linearly with the generated length L and the batch, and shrinks with fewer
    key/value heads (grouped-query attention).
    """
    num_layers, batch_size, num_kv_heads, d_k = (
        require_int(n, v) for n, v in (("num_layers", num_layers), ("batch_size", batch_size),
                                      ("num_kv_heads", num_kv_heads), ("d_k", d_k)))
    length = require_int("length", length, minimum=0)
    if not isinstance(dtype, torch.dtype):
        raise InputTypeError(f"dtype must be a torch.dtype, got {type_name(dtype)}")
    size = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * batch_size * num_kv_heads * length * d_k * size
