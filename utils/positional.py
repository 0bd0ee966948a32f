"""Positional encodings (chapter 5)."""

from __future__ import annotations

import math

import torch

__all__ = ["sinusoidal_encoding"]


def sinusoidal_encoding(max_len: int, d_model: int, base: float = 10000.0) -> torch.Tensor:
    """The sinusoidal positional encoding of "Attention Is All You Need".

    PE[t, 2k] = sin(t * w_k) and PE[t, 2k + 1] = cos(t * w_k), with w_k = base^(-2k / d_model).

    Args:
        max_len: number of positions.
        d_model: width of each encoding; must be even.
        base: the wavelength scale (10000 in the paper).

    Returns:
        (max_len, d_model) float32 tensor.
    """
    if max_len <= 0 or d_model <= 0 or d_model % 2 != 0:
        raise ValueError(
            f"max_len must be positive and d_model positive and even, got max_len={max_len}, "
            f"d_model={d_model}"
        )
    t = torch.arange(max_len, dtype=torch.float64)[:, None]
    k = torch.arange(0, d_model, 2, dtype=torch.float64)
    w = torch.exp(-math.log(base) * k / d_model)
    pe = torch.zeros(max_len, d_model, dtype=torch.float64)
    pe[:, 0::2] = torch.sin(t * w)
    pe[:, 1::2] = torch.cos(t * w)
    return pe.float()
