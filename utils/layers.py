"""Layer normalization and the position-wise feed-forward network (chapters 6 and 7)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._validation import require_tensor, shape_str

__all__ = ["LayerNorm", "PositionwiseFeedForward"]


class LayerNorm(nn.Module):
    """Layer normalization over the last dimension.

    y = (x - mean(x)) / sqrt(var(x) + eps) * gain + bias, with the mean and the biased variance
    (divided by d_model, not d_model - 1) taken over the features of each position.

    Args:
        d_model: the size of the last dimension.
        eps: added to the variance for numerical safety.

    Shapes:
        (..., d_model) -> (..., d_model).
    """

    def __init__(self, d_model: int, eps: float = 1e-5):
        super().__init__()
        if d_model <= 0:
            raise ValueError(f"d_model must be positive, got {d_model}")
        self.d_model = d_model
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model))
        self.bias = nn.Parameter(torch.zeros(d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        require_tensor("x", x)
        if x.dim() == 0 or x.shape[-1] != self.d_model:
            raise ValueError(f"x must have shape (..., d_model={self.d_model}), got {shape_str(x)}")
        mean = x.mean(dim=-1, keepdim=True)
        var = ((x - mean) ** 2).mean(dim=-1, keepdim=True)
        return (x - mean) / torch.sqrt(var + self.eps) * self.weight + self.bias

    @classmethod
    def from_torch(cls, module: nn.LayerNorm) -> "LayerNorm":
        """A `LayerNorm` holding a copy of ``module``'s gain, bias and eps."""
        if not isinstance(module, nn.LayerNorm):
            raise ValueError(f"expected nn.LayerNorm, got {type(module).__name__}")
        if len(module.normalized_shape) != 1:
            raise ValueError(
                f"only a single normalized dimension is supported, got {module.normalized_shape}"
            )
        w = module.weight
        new = cls(module.normalized_shape[0], eps=module.eps)
        if w is not None:
            new = new.to(dtype=w.dtype, device=w.device)
        with torch.no_grad():
            if module.weight is not None:
                new.weight.copy_(module.weight)
            if module.bias is not None:
                new.bias.copy_(module.bias)
        return new


_ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu}


class PositionwiseFeedForward(nn.Module):
    """FFN(x) = act(x W_1 + b_1) W_2 + b_2, applied to every position alone.

    Args:
        d_model: input and output width.
        d_ff: hidden width (4 * d_model in the original Transformer).
        dropout: dropout on the hidden activations during training.
        activation: ``"relu"`` or ``"gelu"``.

    Shapes:
        (..., d_model) -> (..., d_model).
    """

    def __init__(self, d_model: int, d_ff: int, dropout: float = 0.0, activation: str = "relu"):
        super().__init__()
        if activation not in _ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(_ACTIVATIONS)}, got {activation!r}")
        if d_model <= 0 or d_ff <= 0:
            raise ValueError(f"d_model and d_ff must be positive, got {d_model}, {d_ff}")
        self.d_model = d_model
        self.d_ff = d_ff
        self.activation = activation
        self.linear1 = nn.Linear(d_model, d_ff)
        self.dropout = nn.Dropout(dropout)
        self.linear2 = nn.Linear(d_ff, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        require_tensor("x", x)
        if x.dim() == 0 or x.shape[-1] != self.d_model:
            raise ValueError(f"x must have shape (..., d_model={self.d_model}), got {shape_str(x)}")
        return self.linear2(self.dropout(_ACTIVATIONS[self.activation](self.linear1(x))))
