"""Mistral, Qwen2, Qwen3 and Gemma checkpoints in the book's parts, and one loader for all.

Each of these families is Llama (`utils.pretrained.load_llama`: RMSNorm before each sublayer,
RoPE, grouped-query attention, a gated feed-forward network) with a few pieces changed, and
`FAMILY_CHANGES` says which, against the 2017 Transformer. The loaders read the config of
their ``model_type``, check it (an option the book's model does not implement is refused by
name; fields the tensors contradict are named by `utils.checkpoint_fields`), build the model
of `utils.pretrained.LLAMA_PARTS` with the family's own pieces (`utils.family_parts`) in place,
and fill it through `utils.pretrained.load_rotary`, as `load_llama` does: sharded files,
``inv_freq`` buffers, scaled RoPE, ``device=`` and ``dtype=`` alike.

* `load_mistral`: Llama plus a sliding window (``sliding_window``: a query sees its own and
  the ``sliding_window - 1`` previous positions; null: none, plain Llama); no biases.
* `load_qwen2`: biases on W_Q, W_K and W_V (none on W_O, none in the feed-forward network);
  a sliding window on the layers ``layer_types`` marks "sliding_attention" (with
  ``use_sliding_window``: the layers from ``max_window_layers`` on).
* `load_qwen3`: RMSNorm on every query and key head before RoPE (``q_norm``, ``k_norm``), and
  a head width ``head_dim`` of its own (default 128), which may differ from hidden_size /
  num_attention_heads; biases on all four projections when ``attention_bias``; windows as Qwen2.
* `load_gemma` (the first Gemma, model_type "gemma"): token vectors times sqrt(hidden_size),
  RMSNorm with gain 1 + w, GeGLU with GELU's tanh form (``hidden_act`` "gelu_pytorch_tanh", or
  the legacy "gelu" that the reference reads as it; ``hidden_activation`` is ignored, as the
  reference ignores it), ``head_dim`` (default 256), the output tied to the token table.

A field missing from config.json takes the default of the family's config class in
`transformers` (Mistral: 8 key/value heads and a window of 4096; Qwen2 and Qwen3: 32 key/value
heads; Gemma: 16), as the reference would; an explicit null key/value head count means as many
as query heads.

`load_checkpoint` reads config.json's ``model_type`` and calls the loader of that family
(GPT-2 and Llama included).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from .checkpoint_fields import field, require_value
from .checkpoint_io import _config, _paths
from .checkpoint_models import CheckpointLM, GELUFeedForward
from .family_parts import FamilyAttention, OffsetRMSNorm, ScaledTokenEmbedding
from .pretrained import (
    _rotary_attention,
    _rotary_settings,
    load_gpt2,
    load_llama,
    load_rotary,
)

__all__ = [
    "FAMILY_CHANGES",
    "load_mistral",
    "load_qwen2",
    "load_qwen3",
    "load_gemma",
    "load_checkpoint",
]

# What each family changes, piece by piece, from the 2017 Transformer's decoder; "extends":
# the chapter whose piece the family's own is built from. The book prints it as a table.
FAMILY_CHANGES: dict[str, dict[str, str]] = {
    "transformer_2017": {
        "norm": "LayerNorm after each sublayer",
        "positions": "sinusoids added to the input",
        "attention": "multi-head, with biases",
        "feed-forward": "ReLU, with biases",
        "embedding": "times sqrt(d_model), tied",
        "extends": "chapters 1-9",
    },
    "gpt2": {
        "norm": "LayerNorm before each sublayer",
        "positions": "learned, added to the input",
        "attention": "multi-head, with biases",
        "feed-forward": "GELU (tanh form), with biases",
        "embedding": "unscaled, tied",
        "extends": "chapter 14",
    },
    "llama": {
        "norm": "RMSNorm before each sublayer",
        "positions": "RoPE on queries and keys",
        "attention": "grouped-query, no biases",
        "feed-forward": "SwiGLU, no biases",
        "embedding": "unscaled, untied",
        "extends": "chapter 14 (chapters 3, 5, 6, 7)",
    },
    "mistral": {
        "norm": "as Llama",
        "positions": "as Llama",
        "attention": "grouped-query, sliding window",
        "feed-forward": "as Llama",
        "embedding": "as Llama",
        "extends": "chapters 4 and 13 (local attention)",
    },
    "qwen2": {
        "norm": "as Llama",
        "positions": "as Llama",
        "attention": "grouped-query, biases on Q, K, V",
        "feed-forward": "as Llama",
        "embedding": "as Llama; tied in the small models",
        "extends": "chapter 3 (projections)",
    },
    "qwen3": {
        "norm": "as Llama, and on each query and key head",
        "positions": "as Llama",
        "attention": "grouped-query, heads of their own width",
        "feed-forward": "as Llama",
        "embedding": "as Llama; tied in the small models",
        "extends": "chapters 7 and 3 (RMSNorm, heads)",
    },
    "gemma": {
        "norm": "RMSNorm with gain 1 + w",
        "positions": "as Llama",
        "attention": "as Llama, heads of their own width",
        "feed-forward": "GeGLU (tanh form)",
        "embedding": "times sqrt(d_model), tied",
        "extends": "chapters 3, 5, 6, 7",
    },
}

LAYER_TYPES = ("full_attention", "sliding_attention")


def _window(config: dict, default: int | None) -> int | None:
    """``sliding_window``: None (null) or a positive int; ``default`` when the field is absent."""
    value = config.get("sliding_window", default)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(
            f"config field 'sliding_window' must be a positive int or null, got {value!r}"
        )
    return value


def _layer_windows(config: dict, layers: int) -> list[int | None]:
    """Qwen2's and Qwen3's window of each layer: ``sliding_window`` (default 4096) where
    ``layer_types`` says "sliding_attention", None where "full_attention". Without
    ``layer_types``, the reference's rule: with ``use_sliding_window``, the layers from
    ``max_window_layers`` (default 28) on; without it, none."""
    use = require_value(config, "use_sliding_window", (False, True), False)
    window = _window(config, 4096) if use else None
    types = config.get("layer_types")
    if types is None:
        first = config.get("max_window_layers", 28)
        if isinstance(first, bool) or not isinstance(first, int) or first < 0:
            raise ValueError(
                f"config field 'max_window_layers' must be an int >= 0, got {first!r}"
            )
        types = [LAYER_TYPES[window is not None and i >= first] for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or not set(types) <= set(LAYER_TYPES):
        raise ValueError(
            f"config field 'layer_types' must list {layers} of {LAYER_TYPES} (one per layer, "
            f"num_hidden_layers={layers}), got {types!r}"
        )
    if "sliding_attention" in types and window is None:
        raise ValueError(
            "unsupported config: layer_types has 'sliding_attention' layers but "
            "use_sliding_window is false or sliding_window null: no window to apply"
        )
    return [window if t == "sliding_attention" else None for t in types]


def _family_attention(s: dict, layout: str, layer: int) -> nn.Module:
    """A layer's attention: `FamilyAttention` where it has a window or q/k norms, else Llama's
    `RotarySelfAttention` (which the fast decoding path of `utils.decoding_plan` runs)."""
    window = s["windows"][layer]
    if window is None and not s.get("qk_norm"):
        return _rotary_attention(s, layout, layer)
    norm_eps = s["eps"] if s.get("qk_norm") else None
    return _rotary_attention(s, layout, layer, FamilyAttention, window=window, qk_norm_eps=norm_eps)


def _settings(config: dict, model_type: str, defaults: dict) -> dict:
    """`_rotary_settings` of ``defaults | config`` (the family's defaults for absent fields),
    with SiLU, no feed-forward biases and the family's attention as defaults."""
    s = _rotary_settings(defaults | config, model_type)
    s["attention_bias"] = s["mlp_bias"] = False
    s["windows"] = [None] * s["num_hidden_layers"]
    s["parts"] = {"attention": _family_attention}
    return s


def _silu(config: dict) -> None:
    require_value(config, "hidden_act", ("silu",), "silu")


def _mistral_settings(config: dict) -> dict:
    s = _settings(config, "mistral", {"num_key_value_heads": 8})
    _silu(config)
    s["windows"] = [_window(config, 4096)] * s["num_hidden_layers"]
    return s


def _qwen2_settings(config: dict) -> dict:
    s = _settings(config, "qwen2", {"num_key_value_heads": 32})
    _silu(config)
    s["attention_bias"], s["out_bias"] = True, False
    s["windows"] = _layer_windows(config, s["num_hidden_layers"])
    return s


def _qwen3_settings(config: dict) -> dict:
    s = _settings(config, "qwen3", {"num_key_value_heads": 32, "head_dim": 128})
    _silu(config)
    s["attention_bias"] = bool(require_value(config, "attention_bias", (False, True), False))
    s["windows"] = _layer_windows(config, s["num_hidden_layers"])
    s["qk_norm"] = True
    return s


def _gemma_settings(config: dict) -> dict:
    defaults = {"num_key_value_heads": 16, "head_dim": 256, "tie_word_embeddings": True}
    s = _settings(config, "gemma", defaults)
    # "gelu" is what the first Gemma files say; the reference computes the tanh form for it
    require_value(config, "hidden_act", ("gelu_pytorch_tanh", "gelu"), "gelu_pytorch_tanh")
    require_value(config, "use_bidirectional_attention", (False,), False)
    s["attention_bias"] = bool(require_value(config, "attention_bias", (False, True), False))
    s["parts"] |= {"norm": OffsetRMSNorm, "ff": _geglu, "embed": _scaled_embedding}
    return s


def _geglu(s: dict) -> GELUFeedForward:
    """Gemma's feed-forward network: GeGLU, GELU's tanh form, no biases."""
    return GELUFeedForward(s["hidden_size"], s["intermediate_size"], "tanh", False, gated=True)


def _scaled_embedding(s: dict) -> ScaledTokenEmbedding:
    """Gemma's token vectors, times sqrt(hidden_size)."""
    return ScaledTokenEmbedding(s["vocab_size"], s["hidden_size"])


_COMMON = """

    Args:
        directory: the folder with config.json and model.safetensors (or shards and their
            index).
        dtype: the floating dtype of the returned model.
        layout: "half" (RoPE as the checkpoint expects it) or "interleaved", as in `load_llama`.
        device: where the model is made, as in `utils.pretrained.load_gpt2`; None: the CPU.

    Returns:
        A `CheckpointLM` in eval mode, ``family`` "{family}": tokens (B, L) -> logits (B, L, V).

    Raises:
        FileNotFoundError: for a missing folder or file.
        ValueError: for another model_type, an unsupported option (named), a config its
            tensors contradict (the field named), or an unknown, missing or misshapen tensor.
"""


def _loader(family: str, settings: Callable[[dict], dict], summary: str) -> Callable:
    """The loader ``load_<family>`` of the checkpoints ``settings`` reads, documented."""

    def load(
        directory: str | Path,
        dtype: torch.dtype = torch.float32,
        layout: str = "half",
        device: torch.device | str | None = None,
    ) -> CheckpointLM:
        return load_rotary(directory, dtype, layout, device, settings)

    load.__name__ = load.__qualname__ = f"load_{family}"
    load.__doc__ = summary + _COMMON.format(family=family)
    return load


load_mistral = _loader(
    "mistral",
    _mistral_settings,
    "A Mistral checkpoint (``MistralForCausalLM``'s files): Llama with a sliding window of "
    "``sliding_window`` positions (`utils.family_parts.FamilyAttention`) on every layer, or "
    "none when it is null.",
)
load_qwen2 = _loader(
    "qwen2",
    _qwen2_settings,
    "A Qwen2 checkpoint (``Qwen2ForCausalLM``'s files): Llama with biases on W_Q, W_K, W_V, "
    "and a sliding window on the layers ``layer_types`` (or ``use_sliding_window`` and "
    "``max_window_layers``) give one.",
)
load_qwen3 = _loader(
    "qwen3",
    _qwen3_settings,
    "A Qwen3 checkpoint (``Qwen3ForCausalLM``'s files): Qwen2's windows, RMSNorm on each query "
    "and key head before RoPE, heads of ``head_dim`` features, biases on the four projections "
    "only with ``attention_bias``.",
)
load_gemma = _loader(
    "gemma",
    _gemma_settings,
    "A Gemma checkpoint (``GemmaForCausalLM``'s files, the first Gemma): token vectors times "
    "sqrt(hidden_size), RMSNorm with gain 1 + w, GeGLU with the tanh GELU, heads of "
    "``head_dim`` features, the output tied to the token table.",
)

LOADERS: dict[str, Callable[..., CheckpointLM]] = {
    "gpt2": load_gpt2,
    "llama": load_llama,
    "mistral": load_mistral,
    "qwen2": load_qwen2,
    "qwen3": load_qwen3,
    "gemma": load_gemma,
}


def load_checkpoint(
    directory: str | Path,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> CheckpointLM:
    """The checkpoint in ``directory`` loaded by its family's loader, which config.json's
    ``model_type`` names: "gpt2", "llama", "mistral", "qwen2", "qwen3" or "gemma".

    Args:
        directory, dtype, device: as the loaders take them (RoPE in the checkpoint's layout).

    Returns:
        A `CheckpointLM` in eval mode whose ``family`` is the model_type.

    Raises:
        FileNotFoundError: for a missing folder, config.json or weights.
        ValueError: for a model_type no loader reads (naming it and those read), and whatever
            the family's loader raises.
    """
    config = _config(_paths(directory)[0])
    model_type = field(config, "model_type", required=True) if isinstance(config, dict) else None
    if not isinstance(model_type, str) or model_type not in LOADERS:
        raise ValueError(
            f"config.json has model_type={model_type!r}; load_checkpoint reads "
            f"{list(LOADERS)}"
        )
    return LOADERS[model_type](directory, dtype=dtype, device=device)
