"""Scaled RoPE: the frequency schedules of checkpoints stretched to longer text (chapter 14).

RoPE rotates pair k of a query or key at position t by the angle t * w_k, with
w_k = base^(-2k / d) (`utils.positional.apply_rope`). A model trained on texts of at most
L_train positions has never seen angles t * w_k for t >= L_train; the slow pairs (small w_k)
have not even turned once. Checkpoints meant for longer text change the frequencies, and say
how in their config (``rope_parameters`` in transformers 5, ``rope_scaling`` before), with a
``rope_type``:

* ``"default"``: w_k as above.
* ``"linear"`` (position interpolation): every w_k divided by ``factor``: position t is
  rotated as t / factor was, so factor * L_train positions fit the angles of L_train.
* ``"dynamic"`` (NTK-aware): unchanged up to ``max_position_embeddings``; for a text of
  n > L_train positions the base grows to base * (factor * n / L_train - (factor - 1))^(d /
  (d - 2)), which slows the slow pairs most and leaves the fastest almost as they were. The
  frequencies depend on n: a call on positions up to t_max uses n = t_max + 1.
* ``"llama3"`` (Llama 3.1): by wavelength 2 pi / w_k against the original context L_orig:
  pairs whose wavelength is shorter than L_orig / ``high_freq_factor`` keep w_k, pairs whose
  wavelength is longer than L_orig / ``low_freq_factor`` get w_k / factor, and the pairs
  between are blended linearly in L_orig / wavelength.

None of these changes the scores' scale (the ``attention_factor`` of the reference is 1 for
all four). `rope_frequencies` gives the w_k of each type, in float64; `rope_config` reads a
config. Other types (``yarn``, ``longrope``, ...) are refused by name.
"""

from __future__ import annotations

import math

import torch

__all__ = ["ROPE_TYPES", "rope_config", "rope_frequencies"]

ROPE_TYPES = ("default", "linear", "dynamic", "llama3")
# the fields each type needs besides rope_theta
_NEEDS = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


def _number(name: str, value: object, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"config field {where}[{name!r}] must be a positive number, got {value!r}")
    return float(value)


def rope_config(config: dict, max_position_embeddings: int) -> tuple[float, dict | None]:
    """``(rope_theta, scaling)`` of a Llama-style config.json: the base, and None for plain
    RoPE or a dict ``{"rope_type": ..., "factor": ..., ...}`` with every field its type needs
    (``original_max_position_embeddings`` defaulting to ``max_position_embeddings``, and a
    ``max_position_embeddings`` entry for "dynamic"), as floats.

    Reads ``rope_parameters`` (transformers 5) or ``rope_scaling`` with a top-level
    ``rope_theta`` (before), ``rope_type`` or the older ``type``.

    Raises:
        ValueError: naming the field, for a type other than `ROPE_TYPES`, a missing or
            non-positive field, or a ``low_freq_factor`` not below ``high_freq_factor``.
    """
    theta = config.get("rope_theta", 10000.0)
    scaling = None
    for name in ("rope_parameters", "rope_scaling"):
        params = config.get(name) or {}
        if not isinstance(params, dict):
            raise ValueError(f"config field {name!r} must be a dict or null, got {params!r}")
        theta = params.get("rope_theta", theta)
        kind = params.get("rope_type", params.get("type", "default"))
        if kind not in ROPE_TYPES:
            raise ValueError(
                f"unsupported config: {name} has rope_type={kind!r}; this loader implements "
                f"the RoPE types {ROPE_TYPES}"
            )
        if kind == "default":
            continue
        fields = dict(params)
        fields.setdefault("original_max_position_embeddings", max_position_embeddings)
        scaling = {"rope_type": kind}
        for field in _NEEDS[kind]:
            if field not in fields:
                raise ValueError(f"config: {name} of rope_type={kind!r} lacks {field!r}")
            scaling[field] = _number(field, fields[field], name)
        if kind == "dynamic":
            scaling["max_position_embeddings"] = float(max_position_embeddings)
        if kind == "llama3" and not scaling["low_freq_factor"] < scaling["high_freq_factor"]:
            raise ValueError(
                f"config: {name} needs low_freq_factor < high_freq_factor, got "
                f"{scaling['low_freq_factor']} and {scaling['high_freq_factor']}"
            )
    return _number("rope_theta", theta, "config"), scaling


def rope_frequencies(
    dim: int, base: float, scaling: dict | None = None, length: int | None = None
) -> torch.Tensor:
    """The (dim / 2,) float64 frequencies w_k of RoPE over ``dim`` features (see the module
    docstring), plain when ``scaling`` is None, else of ``scaling["rope_type"]``; ``length``
    (the positions of the text, max position + 1) is read by "dynamic" only."""
    k2 = torch.arange(0, dim, 2, dtype=torch.float64)
    kind = "default" if scaling is None else scaling["rope_type"]
    if kind == "dynamic":
        trained = scaling["max_position_embeddings"]
        n = max(float(length or 0), trained)
        factor = scaling["factor"]
        base = base * (factor * n / trained - (factor - 1)) ** (dim / (dim - 2))
    w = torch.exp(-math.log(base) * k2 / dim)
    if kind == "linear":
        return w / scaling["factor"]
    if kind == "llama3":
        factor, old = scaling["factor"], scaling["original_max_position_embeddings"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        wavelength = 2 * math.pi / w
        blend = (old / wavelength - low) / (high - low)  # 0 at the long end, 1 at the short
        blended = (1 - blend) * w / factor + blend * w
        w = torch.where(wavelength > old / low, w / factor, w)
        between = (wavelength >= old / high) & (wavelength <= old / low)
        return torch.where(between, blended, w)
    return w
