"""Writing a GPT-2 model of the book's modules back as a checkpoint (chapter 18).

`utils.pretrained.load_gpt2` reads ``GPT2LMHeadModel``'s files into a `CheckpointLM`; `save_gpt2`
is its inverse: the same two files, config.json and model.safetensors, with every tensor under
the name and in the layout ``transformers`` writes (GPT-2's ``Conv1D`` weights stored as
(d_in, d_out); the query, key and value weights side by side as one ``c_attn``). So a model the
book has trained can be loaded by ``GPT2LMHeadModel.from_pretrained`` with exactly its weights,
and the two libraries compared on them.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from ._validation import InputTypeError, type_name
from .checkpoint_models import CheckpointLM

__all__ = ["gpt2_state_dict", "save_gpt2"]


def _copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous float32 CPU copy that shares no memory (safetensors refuses shared)."""
    return t.detach().to("cpu", torch.float32).contiguous().clone()


def gpt2_state_dict(model: CheckpointLM) -> dict[str, torch.Tensor]:
    """The tensors of a GPT-2 `CheckpointLM` under ``GPT2LMHeadModel``'s names and layouts:
    ``transformer.wte.weight`` (V, d), ``transformer.wpe.weight`` (n_positions, d), per layer
    ``ln_1``, ``ln_2``, ``attn.c_attn`` (d, 3d) = [W_Q | W_K | W_V] and (3d,), ``attn.c_proj``
    (d, d), ``mlp.c_fc`` (d, d_ff), ``mlp.c_proj`` (d_ff, d), then ``transformer.ln_f``, and
    ``lm_head.weight`` (V, d) only when the output layer is not tied to the embedding."""
    if not isinstance(model, CheckpointLM) or model.family != "gpt2":
        raise InputTypeError(f"model must be a GPT-2 CheckpointLM (as load_gpt2 makes it), got "
                             f"{type_name(model)} of family {getattr(model, 'family', None)!r}")
    out = {"transformer.wte.weight": model.embed.tokens.weight,
           "transformer.wpe.weight": model.embed.positions.weight}

    def norm(prefix: str, module: torch.nn.Module) -> None:
        out[f"{prefix}.weight"], out[f"{prefix}.bias"] = module.weight, module.bias

    for i, block in enumerate(model.blocks):
        p = f"transformer.h.{i}"
        norm(f"{p}.ln_1", block.norm1)
        norm(f"{p}.ln_2", block.norm2)
        attn, ff = block.attn, block.ff
        parts = (attn.w_q, attn.w_k, attn.w_v)
        out[f"{p}.attn.c_attn.weight"] = torch.cat([lin.weight.T for lin in parts], dim=1)
        out[f"{p}.attn.c_attn.bias"] = torch.cat([lin.bias for lin in parts])
        for name, lin in (("attn.c_proj", attn.w_o), ("mlp.c_fc", ff.linear1),
                          ("mlp.c_proj", ff.linear2)):
            out[f"{p}.{name}.weight"], out[f"{p}.{name}.bias"] = lin.weight.T, lin.bias
    norm("transformer.ln_f", model.norm)
    if not model.tie_output:
        out["lm_head.weight"] = model.head.weight
    return {key: _copy(t) for key, t in out.items()}


def save_gpt2(model: CheckpointLM, directory: str | Path, config: dict) -> Path:
    """Write ``model`` as a GPT-2 checkpoint that `load_gpt2` and ``transformers`` both read.

    Args:
        model: a GPT-2 `CheckpointLM` (from `utils.pretrained.load_gpt2`), perhaps trained since.
        directory: the folder to write config.json and model.safetensors into (made if missing).
        config: the GPT-2 config.json the model was loaded from, as a dict; its sizes must be
            the model's (``vocab_size``, ``n_embd``, ``n_layer``, ``n_positions``).

    Returns:
        The folder, as a `Path`.
    """
    state = gpt2_state_dict(model)
    if not isinstance(config, dict):
        raise InputTypeError(f"config must be a dict (a GPT-2 config.json), got "
                             f"{type_name(config)}")
    sizes = {"vocab_size": model.vocab_size, "n_embd": model.d_model,
             "n_layer": model.num_layers, "n_positions": model.max_len}
    wrong = {k: (config.get(k), v) for k, v in sizes.items() if config.get(k) != v}
    if wrong:
        raise ValueError("config does not describe the model: " + ", ".join(
            f"{k}={c!r}, the model has {v}" for k, (c, v) in wrong.items()))
    if bool(config.get("tie_word_embeddings", True)) != model.tie_output:
        raise ValueError(f"config says tie_word_embeddings="
                         f"{config.get('tie_word_embeddings', True)}, the model's output layer "
                         f"is {'tied' if model.tie_output else 'not tied'}")
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    return folder
