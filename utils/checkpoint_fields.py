"""A checkpoint's config.json checked against its tensors, before any is read (`utils.pretrained`).

The loaders build the model the config describes and then check every stored shape against
it, so a config that does not fit its tensors is always refused; but the message would name a
tensor (``k_proj.weight has shape (24, 32), expected (16, 32)``), and the mistake is in a
config field. This module checks the fields first, each against the tensor dims it fixes, and
names the field and what the tensors hold instead:

* GPT-2: ``vocab_size`` and ``n_embd`` (the token table), ``n_positions`` (the position
  table), ``n_inner`` (the first feed-forward matrix), ``n_layer`` (the layers stored);
* Llama and the families of `utils.families` (Mistral, Qwen2, Qwen3, Gemma): ``vocab_size`` and
  ``hidden_size`` (the token table), ``num_attention_heads`` and ``head_dim`` (the rows of
  W_Q: their product; ``head_dim`` defaults to hidden_size / num_attention_heads), then
  ``num_key_value_heads`` (the rows of W_K: it times the head width), ``head_dim`` again where
  Qwen3's norms on queries and keys hold one gain per head feature, ``intermediate_size``
  (the gate), ``num_hidden_layers``.

It also reads the config itself (`field`, `int_field`, `require_value`, `require_model_type`):
a missing field, a field of the wrong kind or an option the loader does not implement raises
a ValueError naming it.

What no tensor records cannot be checked: how d_model splits into heads when there are as many
key/value heads as query heads (W_Q, W_K, W_V are (d, d) for any split; GPT-2's ``n_head`` is
always so). A wrong ``n_head`` there loads, and only the logits show it (chapter 14).
"""

from __future__ import annotations

import re

__all__ = [
    "check_gpt2_fields",
    "check_llama_fields",
    "field",
    "int_field",
    "require_value",
    "require_model_type",
]


def field(config: dict, name: str, default: object = None, required: bool = False) -> object:
    """config[name]; a missing required field is a ValueError naming it."""
    if name not in config or config[name] is None:
        if required:
            raise ValueError(f"config.json has no {name!r}, which the model needs")
        return default
    return config[name]


def int_field(config: dict, name: str, default: int | None = None) -> int:
    """config[name], a positive int (``default`` when missing; required when that is None)."""
    value = field(config, name, default, required=default is None)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"config field {name!r} must be a positive int, got {value!r}")
    return value


def require_value(config: dict, name: str, allowed: tuple, default: object) -> object:
    """A config option the model implements only for the values ``allowed``."""
    value = field(config, name, default)
    if value not in allowed:
        raise ValueError(
            f"unsupported config: {name}={value!r}; this loader implements "
            f"{name} in {list(allowed)}"
        )
    return value


def require_model_type(config: dict, expected: str) -> None:
    """config.json's model_type must be ``expected``."""
    found = config.get("model_type")
    if found != expected:
        raise ValueError(f"config.json has model_type={found!r}; expected {expected!r}")


def _dim(shapes: dict, key: str, axis: int) -> int | None:
    shape = shapes.get(key)
    return shape[axis] if shape is not None and len(shape) > axis else None


def _layers(shapes: dict, prefix: str) -> list[int]:
    """The layer numbers of the keys ``prefix.N. ...``, sorted."""
    found = {int(m.group(1)) for k in shapes if (m := re.match(re.escape(prefix) + r"(\d+)\.", k))}
    return sorted(found)


def _require(where: str, field: str, value: int, held: int | None, what: str) -> None:
    if held is not None and held != value:
        raise ValueError(
            f"{where}: config.json has {field}={value}, but the tensors hold {held} {what}"
        )


def _require_layers(where: str, field: str, value: int, layers: list[int]) -> None:
    if layers and layers != list(range(value)):
        held = f"layers {layers[0]} to {layers[-1]}" if len(layers) > 1 else f"layer {layers[0]}"
        raise ValueError(
            f"{where}: config.json has {field}={value}, but the tensors hold {held} "
            f"({len(layers)} numbered)"
        )


def check_gpt2_fields(shapes: dict[str, tuple[int, ...]], s: dict, where: str) -> None:
    """Each GPT-2 config field against the tensor dims it fixes (keys as `transformers` writes
    them today, ``transformer.`` first); a ValueError names the field."""
    table = "transformer.wte.weight"
    _require(where, "vocab_size", s["vocab_size"], _dim(shapes, table, 0), f"rows in {table}")
    _require(where, "n_embd", s["n_embd"], _dim(shapes, table, 1), f"columns in {table}")
    positions = "transformer.wpe.weight"
    _require(
        where, "n_positions", s["n_positions"], _dim(shapes, positions, 0), f"rows in {positions}"
    )
    fc = "transformer.h.0.mlp.c_fc.weight"
    _require(where, "n_inner", s["n_inner"], _dim(shapes, fc, 1), f"columns in {fc}")
    _require_layers(where, "n_layer", s["n_layer"], _layers(shapes, "transformer.h."))


def check_llama_fields(shapes: dict[str, tuple[int, ...]], s: dict, where: str) -> None:
    """Each config field of Llama (or of a family of `utils.families`, whose tensors are named
    alike) against the tensor dims it fixes; a ValueError names the field, and for the heads,
    what the tensors hold instead. ``s["head_dim"]`` is the head width the config gives
    (``s["head_dim_given"]``: written in config.json, else hidden_size / num_attention_heads)."""
    table = "model.embed_tokens.weight"
    _require(where, "vocab_size", s["vocab_size"], _dim(shapes, table, 0), f"rows in {table}")
    _require(where, "hidden_size", s["hidden_size"], _dim(shapes, table, 1), f"columns in {table}")
    h, kv, head = s["num_attention_heads"], s["kv_heads"], s["head_dim"]
    why = "head_dim" if s.get("head_dim_given") else "hidden_size / num_attention_heads"
    attn = "model.layers.0.self_attn"
    q_rows = _dim(shapes, f"{attn}.q_proj.weight", 0)
    if q_rows is not None and q_rows != h * head:
        raise ValueError(
            f"{where}: config.json has num_attention_heads={h} and heads of {head} = {why}, so "
            f"{h * head} rows in {attn}.q_proj.weight, but it has {q_rows}"
        )
    k_rows = _dim(shapes, f"{attn}.k_proj.weight", 0)
    # A W_K of a whole number of heads of this width: the head fields are wrong (else the
    # tensor is, and the shape check names it).
    if k_rows is not None and k_rows != kv * head and k_rows % head == 0:
        raise ValueError(
            f"{where}: config.json has num_attention_heads={h} and num_key_value_heads={kv}, "
            f"so heads of {head} = {why} and {kv * head} rows in "
            f"{attn}.k_proj.weight, but it has {k_rows}: {k_rows // head} "
            f"key/value heads of {head}, or heads of another width"
        )
    for norm in ("q_norm", "k_norm"):  # Qwen3: one gain per feature of a head
        key = f"{attn}.{norm}.weight"
        _require(where, "head_dim", head, _dim(shapes, key, 0), f"entries in {key}")
    gate = "model.layers.0.mlp.gate_proj.weight"
    _require(
        where, "intermediate_size", s["intermediate_size"], _dim(shapes, gate, 0), f"rows in {gate}"
    )
    _require_layers(
        where, "num_hidden_layers", s["num_hidden_layers"], _layers(shapes, "model.layers.")
    )
