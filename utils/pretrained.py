"""Load GPT-2 and Llama checkpoints into the book's own modules (`utils.checkpoint_models`).

A checkpoint in the Hugging Face layout is a directory holding ``config.json`` (the
hyperparameters) and ``model.safetensors`` (the tensors, by name). `load_gpt2` and `load_llama`
read both, build a `utils.checkpoint_models.CheckpointLM` of the shape the config describes and
copy every tensor into it, after checking that the checkpoint holds exactly the tensors that
model needs, each of the right shape. Nothing is loaded partly: an unknown key, a missing key,
a wrong shape, a config field its tensors contradict (`utils.checkpoint_fields`) or a config
option the book's model does not implement raises a `ValueError` that names it, before any
tensor is copied.

``device=`` and ``dtype=`` say where the model is made and in what precision. The model is built
on PyTorch's ``meta`` device (shapes, no memory), then every parameter is made directly on the
device and in the dtype asked, from the stored tensors read one at a time
(`utils.checkpoint_io`): a GPU or bfloat16 model never exists first as a float32 copy on the CPU,
and ``device="meta"`` reads no tensor data at all (for counting parameters, or checking a
checkpoint's keys and shapes). The numbers are those of copying the stored tensors into a model
of that dtype: in float32 on the CPU, the very bits of the stored tensors.

What has to be translated:

* GPT-2 stores its projections as ``Conv1D`` weights, (d_in, d_out), the transpose of
  `nn.Linear`'s (d_out, d_in); in the book's row-vector notation they are W itself. Its
  ``c_attn`` holds W_Q, W_K and W_V side by side, (d_model, 3 d_model).
* Llama's checkpoints (as converted by Hugging Face) expect RoPE's "half" layout. The model
  uses that layout by default; ``load_llama(..., layout="interleaved")`` instead permutes the
  rows of W_Q and W_K with `utils.positional.permute_rope_weight` and rotates interleaved pairs,
  which gives the same scores (chapter 5).

The families built on Llama's pieces (Mistral, Qwen2, Qwen3, Gemma) load through the same
path, `load_rotary`, with the pieces they change (`utils.families`).

Nothing here touches the network: the directory must already be on disk.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from ._validation import require_choice, require_device, require_dtype
from .attention import MultiHeadAttention
from .checkpoint_fields import check_gpt2_fields, check_llama_fields
from .checkpoint_fields import field as _field
from .checkpoint_fields import int_field as _int_field
from .checkpoint_fields import require_model_type as _require_model_type
from .checkpoint_fields import require_value as _require_value
from .checkpoint_io import (
    Slots,
    StoredTensors,
    fill,
    param_writer,
    read_checkpoint,
)
from .checkpoint_io import linear_slots as _linear_slots
from .checkpoint_io import norm_slots as _norm_slots
from .checkpoint_io import rows_first as _rows_first
from .checkpoint_models import (
    CheckpointLM,
    GELUFeedForward,
    PreNormBlock,
    RotarySelfAttention,
    TokenPositionEmbedding,
)
from .layers import LayerNorm, PositionwiseFeedForward, RMSNorm
from .positional import permute_rope_weight
from .rope_scaling import rope_config, rope_frequencies

__all__ = [
    "read_checkpoint",
    "load_gpt2",
    "load_llama",
    "load_rotary",
    "LLAMA_PARTS",
    "GPT2_ACTIVATIONS",
]

# GPT-2's activation_function -> the approximate= of torch's GELU.
GPT2_ACTIVATIONS = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu": "none"}


# ----------------------------------------------------------------------------------- GPT-2


def _gpt2_settings(config: dict) -> dict:
    """The hyperparameters of a GPT-2 config.json, each checked; unsupported options raise."""
    _require_model_type(config, "gpt2")
    s = {
        name: _int_field(config, name)
        for name in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head")
    }
    if s["n_embd"] % s["n_head"]:
        raise ValueError(f"config: n_embd={s['n_embd']} is not divisible by n_head={s['n_head']}")
    s["n_inner"] = _int_field(config, "n_inner", 4 * s["n_embd"])
    activation = _require_value(config, "activation_function", tuple(GPT2_ACTIVATIONS), "gelu_new")
    s["approximate"] = GPT2_ACTIVATIONS[activation]
    s["eps"] = float(_field(config, "layer_norm_epsilon", 1e-5))
    s["tied"] = bool(_field(config, "tie_word_embeddings", True))
    _require_value(config, "scale_attn_weights", (True,), True)
    _require_value(config, "scale_attn_by_inverse_layer_idx", (False,), False)
    _require_value(config, "add_cross_attention", (False,), False)
    return s


def _gpt2_model(s: dict) -> CheckpointLM:
    d = s["n_embd"]
    blocks = [
        PreNormBlock(
            LayerNorm(d, eps=s["eps"]),
            MultiHeadAttention(d, s["n_head"], bias=True),
            LayerNorm(d, eps=s["eps"]),
            GELUFeedForward(d, s["n_inner"], s["approximate"]),
        )
        for _ in range(s["n_layer"])
    ]
    embed = TokenPositionEmbedding(s["vocab_size"], d, s["n_positions"], learned_positions=True)
    return CheckpointLM(embed, blocks, LayerNorm(d, eps=s["eps"]), s["tied"], "gpt2")


def _qkv_slots(prefix: str, attn: MultiHeadAttention) -> Slots:
    """GPT-2's c_attn: W = [W_Q | W_K | W_V], (d, 3d), and its bias (3d,), split three ways.

    The three weights (and biases) stay side by side in one tensor laid out as the checkpoint
    stores it, (d, 3d): each `nn.Linear` holds a (d, d) view of its third, transposed, so that
    a decoding step can compute the three projections as one product (`utils.decoding_plan`)
    without a copy, reading the numbers row by row as `transformers` does."""
    d = attn.d_model
    parts = (attn.w_q, attn.w_k, attn.w_v)

    def split(name: str, fused: torch.Tensor) -> None:
        old = parts[0]._parameters[name]
        for i, lin in enumerate(parts):
            setattr(
                lin, name, nn.Parameter(fused[i * d : (i + 1) * d], requires_grad=old.requires_grad)
            )

    def weight(stored: torch.Tensor, device: torch.device, dtype: torch.dtype) -> None:
        fused = torch.empty(d, 3 * d, dtype=dtype, device=device)  # [W_Q | W_K | W_V]
        with torch.no_grad():
            fused.copy_(stored)
        split("weight", fused.T)  # (3d, d): rows i d .. (i + 1) d are W_i, (d, d) views

    def bias(stored: torch.Tensor, device: torch.device, dtype: torch.dtype) -> None:
        fused = torch.empty(3 * d, dtype=dtype, device=device)
        with torch.no_grad():
            fused.copy_(stored)
        split("bias", fused)

    return {f"{prefix}.weight": ((d, 3 * d), weight), f"{prefix}.bias": ((3 * d,), bias)}


def _gpt2_slots(model: CheckpointLM) -> Slots:
    slots: Slots = {
        "transformer.wte.weight": (  # (V, d), laid out (d, V): the output layer reads rows
            tuple(model.embed.weight.shape),
            _rows_first(model.embed.tokens, "weight", False),
        ),
        "transformer.wpe.weight": (
            tuple(model.embed.positions.weight.shape),
            param_writer(model.embed.positions, "weight"),
        ),
        **_norm_slots("transformer.ln_f", model.norm),
    }
    for i, block in enumerate(model.blocks):
        p = f"transformer.h.{i}"
        slots |= _norm_slots(f"{p}.ln_1", block.norm1) | _norm_slots(f"{p}.ln_2", block.norm2)
        slots |= _qkv_slots(f"{p}.attn.c_attn", block.attn)
        slots |= _linear_slots(f"{p}.attn.c_proj", block.attn.w_o, conv1d=True)
        slots |= _linear_slots(f"{p}.mlp.c_fc", block.ff.linear1, conv1d=True)
        slots |= _linear_slots(f"{p}.mlp.c_proj", block.ff.linear2, conv1d=True)
    if not model.tie_output:  # (V, d), laid out (d, V) as the tied table is
        head = model.head
        slots["lm_head.weight"] = (tuple(head.weight.shape), _rows_first(head, "weight", False))
    return slots


_GPT2_BUFFER = re.compile(r"h\.\d+\.attn\.(bias|masked_bias)")


def _gpt2_names(stored: StoredTensors) -> None:
    """Address the keys as `transformers` writes them today: the original GPT-2 files name them
    without the ``transformer.`` prefix and also store each layer's causal-mask buffers
    (``h.N.attn.bias``, ``h.N.attn.masked_bias``), which hold no weights and are dropped."""
    if any(k.startswith("transformer.") for k in stored.shapes):
        return
    for key in [k for k in stored.shapes if _GPT2_BUFFER.fullmatch(k)]:
        stored.drop(key)
    stored.rename({k: "transformer." + k for k in stored.shapes if k != "lm_head.weight"})


def _where(dtype: object, device: object) -> tuple[torch.dtype, torch.device]:
    """The loaders' ``dtype`` (floating) and ``device`` (None: the CPU), checked."""
    dtype = require_dtype("dtype", dtype, floating=True)
    device = require_device("device", device)
    return dtype, torch.device("cpu") if device is None else device


def load_gpt2(
    directory: str | Path,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> CheckpointLM:
    """A GPT-2 checkpoint (``GPT2LMHeadModel``'s files) as a `CheckpointLM` of the book's parts.

    Learned positions, pre-LN blocks of `MultiHeadAttention` (with biases) and a GELU
    feed-forward network (the tanh approximation for ``"gelu_new"``), a final `LayerNorm` and
    an output projection tied to the token embeddings (unless ``tie_word_embeddings`` is false).

    Args:
        directory: the folder with config.json and model.safetensors.
        dtype: the floating dtype of the returned model (the stored tensors are cast to it).
        device: where the model is made, e.g. "cuda" or "meta" (shapes only, nothing read);
            None: the CPU. The model is built on ``meta`` and each parameter made where
            asked, from one stored tensor at a time: no float32 copy of it on the CPU first.

    Returns:
        The model, in eval mode: tokens (B, L) -> logits (B, L, V); ``generate`` runs it.

    Raises:
        FileNotFoundError: for a missing folder or file.
        ValueError: for an unsupported config (another model_type, an unknown activation,
            cross-attention, unscaled or layer-scaled attention), or a checkpoint with an
            unknown key, a missing key or a tensor of the wrong shape, each named; for a
            ``dtype`` that is not floating or a ``device`` that names no device.
        InputTypeError: for a ``dtype`` or ``device`` of the wrong type.
    """
    where = str(directory)
    with StoredTensors(directory) as stored:  # the files exist: now the arguments
        dtype, device = _where(dtype, device)
        stored.meta = device.type == "meta"
        settings = _gpt2_settings(stored.config)
        _gpt2_names(stored)
        check_gpt2_fields(stored.shapes, settings, where)
        if settings["tied"]:
            stored.tied_head("lm_head.weight", "transformer.wte.weight", where)
        with torch.device("meta"):  # shapes only: no memory, no random initialization
            model = _gpt2_model(settings)
        return fill(model, stored, _gpt2_slots(model), where, device, dtype)


# ----------------------------------------------------------------------------------- Llama


def _rotary_settings(config: dict, model_type: str) -> dict:
    """What every RoPE family (Llama, and those of `utils.families`) reads from config.json,
    each checked: sizes, key/value heads, the head width (``head_dim``, else hidden_size /
    num_attention_heads), RoPE, RMSNorm's epsilon, whether the output projection is tied."""
    _require_model_type(config, model_type)
    s = {
        name: _int_field(config, name)
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "max_position_embeddings",
        )
    }
    d, h = s["hidden_size"], s["num_attention_heads"]
    s["family"], s["kv_heads"] = model_type, _int_field(config, "num_key_value_heads", h)
    s["head_dim_given"] = _field(config, "head_dim") is not None
    if not s["head_dim_given"] and d % h:
        raise ValueError(
            f"config: hidden_size={d} is not divisible by num_attention_heads={h}, and no "
            "head_dim says how wide a head is"
        )
    s["head_dim"] = _int_field(config, "head_dim", d // h)
    if h % s["kv_heads"]:
        raise ValueError(
            f"config: num_attention_heads={h} and num_key_value_heads={s['kv_heads']} do not "
            "split into groups: each key/value head serves the same number of query heads"
        )
    s["eps"] = float(_field(config, "rms_norm_eps", 1e-6))
    s["theta"], s["scaling"] = rope_config(config, s["max_position_embeddings"])
    s["tied"] = bool(_field(config, "tie_word_embeddings", False))
    return s


def _llama_settings(config: dict) -> dict:
    """The hyperparameters of a Llama config.json, each checked; unsupported options raise."""
    s = _rotary_settings(config, "llama")
    _require_value(config, "hidden_act", ("silu",), "silu")
    _require_value(config, "pretraining_tp", (1,), 1)
    s["attention_bias"] = bool(_require_value(config, "attention_bias", (False, True), False))
    s["mlp_bias"] = bool(_require_value(config, "mlp_bias", (False, True), False))
    return s


# Files written by older transformers keep each layer's RoPE frequencies as a buffer.
_INV_FREQ = re.compile(r"model\.(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq")


def _drop_inv_freq(stored: StoredTensors, s: dict, where: str) -> None:
    """Drop stored ``rotary_emb.inv_freq`` buffers: the model computes its frequencies from the
    config, as the reference does (it ignores the buffers). A buffer of the wrong shape says that
    the file's head width is not the config's, and is refused; buffers whose frequencies differ
    from the config's are dropped with a `UserWarning` that names them (on ``meta`` only their
    shapes are read). Older files legitimately hold such buffers: linear scaling was once applied
    to the positions, the buffers keeping plain RoPE's frequencies."""
    half = s["head_dim"] // 2
    differ: list[tuple[str, float]] = []
    for key in [k for k in stored.shapes if _INV_FREQ.fullmatch(k)]:
        if stored.shapes[key] != (half,):
            raise ValueError(f"{where}: {key} has shape {stored.shapes[key]}, expected ({half},)")
        if not stored.meta:
            expected = rope_frequencies(2 * half, s["theta"], s["scaling"])
            worst = ((stored.get(key).double() - expected).abs() / expected).max().item()
            if worst > 1e-5:
                differ.append((key, worst))
        stored.drop(key)
    if differ:
        key, worst = max(differ, key=lambda kw: kw[1])
        warnings.warn(
            f"{where}: {len(differ)} stored rotary_emb.inv_freq buffer(s) (such as {key}) hold "
            f"RoPE frequencies that differ from those config.json gives (rope_theta="
            f"{s['theta']}, scaling={s['scaling']}) by up to {worst:.1e} relative; they are "
            f"ignored, as the reference ignores them: the config's frequencies are used",
            UserWarning,
            stacklevel=3,
        )


def _rotary_attention(
    s: dict, layout: str, layer: int, kind: type = RotarySelfAttention, **options: object
) -> RotarySelfAttention:
    """Llama's attention: RoPE, grouped keys and values, biases as the config says; ``kind``
    and ``options``: a subclass and its own arguments (`utils.families`)."""
    return kind(
        s["hidden_size"],
        s["num_attention_heads"],
        s["kv_heads"],
        base=s["theta"],
        layout=layout,
        bias=s["attention_bias"],
        scaling=s["scaling"],
        head_dim=s["head_dim"],
        out_bias=s.get("out_bias"),
        **options,
    )


def _swiglu(s: dict) -> PositionwiseFeedForward:
    """Llama's feed-forward network: SwiGLU, gate_proj the gate, up_proj linear1."""
    d, d_ff = s["hidden_size"], s["intermediate_size"]
    return PositionwiseFeedForward(d, d_ff, activation="swiglu", bias=s["mlp_bias"])


def _rope_embedding(s: dict) -> TokenPositionEmbedding:
    # No max_len: RoPE computes the rotation of any position, and the reference runs on past
    # max_position_embeddings (the length trained on, not a table's size).
    d = s["hidden_size"]
    return TokenPositionEmbedding(s["vocab_size"], d, None, learned_positions=False)


# The pieces of a Llama; a family of `utils.families` replaces some (its own ``s["parts"]``).
LLAMA_PARTS = {
    "norm": RMSNorm,  # (d, eps=) -> module
    "attention": _rotary_attention,  # (settings, layout, layer) -> module
    "ff": _swiglu,  # (settings) -> module
    "embed": _rope_embedding,  # (settings) -> module
}


def _llama_model(s: dict, layout: str) -> CheckpointLM:
    """The `CheckpointLM` of a Llama config's settings ``s``, with the pieces `LLAMA_PARTS`
    names, or those a family's ``s["parts"]`` puts in their place."""
    parts = LLAMA_PARTS | s.get("parts", {})
    d, eps, norm = s["hidden_size"], s["eps"], parts["norm"]
    blocks = [
        PreNormBlock(
            norm(d, eps=eps), parts["attention"](s, layout, i), norm(d, eps=eps), parts["ff"](s)
        )
        for i in range(s["num_hidden_layers"])
    ]
    family = s.get("family", "llama")
    return CheckpointLM(parts["embed"](s), blocks, norm(d, eps=eps), s["tied"], family)


def _rope_slots(prefix: str, linear: nn.Module, heads: int, layout: str) -> Slots:
    """W_Q or W_K (and bias), or Qwen3's gain of one head's features (an `RMSNorm`, heads=1):
    as stored for the half layout, rows permuted for interleaved."""
    norm = isinstance(linear, RMSNorm)
    slots = _norm_slots(prefix, linear) if norm else _linear_slots(prefix, linear)
    if layout == "interleaved":
        for name in ("weight", "bias"):
            key = f"{prefix}.{name}"
            if key in slots:
                slots[key] = (
                    slots[key][0],
                    param_writer(
                        linear, name, lambda t: permute_rope_weight(t, heads, to="interleaved")
                    ),
                )
    return slots


def _llama_slots(model: CheckpointLM, layout: str) -> Slots:
    slots: Slots = {
        "model.embed_tokens.weight": (
            tuple(model.embed.weight.shape),
            param_writer(model.embed.tokens, "weight"),
        ),
        **_norm_slots("model.norm", model.norm),
    }
    for i, block in enumerate(model.blocks):
        p, attn, ff = f"model.layers.{i}", block.attn, block.ff
        slots |= _norm_slots(f"{p}.input_layernorm", block.norm1)
        slots |= _norm_slots(f"{p}.post_attention_layernorm", block.norm2)
        slots |= _rope_slots(f"{p}.self_attn.q_proj", attn.w_q, attn.num_heads, layout)
        slots |= _rope_slots(f"{p}.self_attn.k_proj", attn.w_k, attn.num_kv_heads, layout)
        slots |= _linear_slots(f"{p}.self_attn.v_proj", attn.w_v)
        slots |= _linear_slots(f"{p}.self_attn.o_proj", attn.w_o)
        for name in ("q_norm", "k_norm"):  # Qwen3: a gain per head feature, permuted as W_Q
            norm = getattr(attn, name, None)
            if norm is not None:
                slots |= _rope_slots(f"{p}.self_attn.{name}", norm, 1, layout)
        slots |= _linear_slots(f"{p}.mlp.gate_proj", ff.gate)
        slots |= _linear_slots(f"{p}.mlp.up_proj", ff.linear1)
        slots |= _linear_slots(f"{p}.mlp.down_proj", ff.linear2)
    if not model.tie_output:
        slots |= _linear_slots("lm_head", model.head)
    return slots


def load_llama(
    directory: str | Path,
    dtype: torch.dtype = torch.float32,
    layout: str = "half",
    device: torch.device | str | None = None,
) -> CheckpointLM:
    """A Llama checkpoint (``LlamaForCausalLM``'s files) as a `CheckpointLM` of the book's parts.

    RoPE with base ``rope_theta`` on queries and keys (`RotarySelfAttention`), scaled as the
    config's ``rope_parameters`` (or ``rope_scaling``) say (`utils.rope_scaling`), grouped-query
    attention with ``num_key_value_heads`` key/value heads of ``head_dim`` features (default
    hidden_size / num_attention_heads, as in the reference), `RMSNorm` (``rms_norm_eps``) before
    each sublayer and at the end, a SwiGLU feed-forward network (`PositionwiseFeedForward` with
    ``activation="swiglu"``: gate_proj is ``gate``, up_proj ``linear1``, down_proj ``linear2``),
    no biases unless the config asks for them, and an output projection tied to the token
    embeddings when ``tie_word_embeddings`` is true. Inputs may be longer than
    ``max_position_embeddings``, as the reference allows: RoPE has no table of positions (the
    model's ``max_len`` is None), though the model was trained on no longer text.
    ``rotary_emb.inv_freq`` buffers, which files written by older versions of `transformers`
    hold, are dropped, as the reference ignores them; those whose frequencies differ from the
    config's are named in a `UserWarning` (the config's frequencies are used).

    Args:
        directory: the folder with config.json and model.safetensors.
        dtype: the floating dtype of the returned model.
        device: where the model is made, as in `load_gpt2`; None: the CPU.
        layout: "half" (RoPE as the checkpoint expects it) or "interleaved" (W_Q and W_K
            permuted by `permute_rope_weight`, pairs (x_2k, x_2k+1) rotated): the same logits.

    Returns:
        The model, in eval mode: tokens (B, L) -> logits (B, L, V); ``generate`` runs it.

    Raises:
        FileNotFoundError: for a missing folder or file.
        ValueError: for an unsupported config (another model_type, a RoPE type other than
            `utils.rope_scaling.ROPE_TYPES`, an activation other than SiLU, pretraining_tp > 1),
            a config its tensors contradict (heads, head_dim, sizes: `utils.checkpoint_fields`),
            or a checkpoint with an unknown key, a missing key or a tensor of the wrong shape,
            each named; a bad ``dtype`` or ``device`` as in `load_gpt2`.
    """
    return load_rotary(directory, dtype, layout, device, _llama_settings)


def load_rotary(
    directory: str | Path,
    dtype: object,
    layout: str,
    device: object,
    settings: Callable[[dict], dict],
) -> CheckpointLM:
    """What `load_llama` and the loaders of `utils.families` share: ``settings(config)`` reads
    and checks the config (its ``"parts"``, if any, replace Llama's pieces), then the stored
    ``inv_freq`` buffers are checked and dropped, the config is checked against the tensors
    (`check_llama_fields`), a tied head checked and dropped, and the model built on ``meta``
    and filled."""
    layout = require_choice("layout", layout, ("half", "interleaved"))
    where = str(directory)
    with StoredTensors(directory) as stored:  # the files exist: now the arguments
        dtype, device = _where(dtype, device)
        stored.meta = device.type == "meta"
        s = settings(stored.config)
        _drop_inv_freq(stored, s, where)
        check_llama_fields(stored.shapes, s, where)
        if s["tied"]:
            stored.tied_head("lm_head.weight", "model.embed_tokens.weight", where)
        with torch.device("meta"):  # shapes only: no memory, no random initialization
            model = _llama_model(s, layout)
        return fill(model, stored, _llama_slots(model, layout), where, device, dtype)
