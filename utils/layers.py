"""The pieces around attention: feed-forward networks and normalization (chapters 6 and 7).

- `PositionwiseFeedForward`: FFN(x) = act(x W_1 + b_1) W_2 + b_2 at every position alone, with
  ReLU or GELU, and the gated variants GLU, ReGLU, GEGLU and SwiGLU;
- `gated_ffn_width`: the hidden width that gives a gated FFN the parameters of an ungated one;
- `MixtureOfExperts`: several feed-forward experts and a router that sends each token to one;
- `LayerNorm` and `RMSNorm`, each with ``from_torch``.

Every module works on (..., d_model) inputs, batch first, as in the rest of the book.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._validation import require_tensor, shape_str

__all__ = [
    "LayerNorm",
    "RMSNorm",
    "PositionwiseFeedForward",
    "gated_ffn_width",
    "MixtureOfExperts",
    "ACTIVATIONS",
    "GATED_ACTIVATIONS",
]


def _require_last_dim(name: str, x: object, d_model: int) -> torch.Tensor:
    require_tensor(name, x)
    if x.dim() == 0 or x.shape[-1] != d_model:
        raise ValueError(f"{name} must have shape (..., d_model={d_model}), got {shape_str(x)}")
    return x


def _require_positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


class LayerNorm(nn.Module):
    """Layer normalization over the last dimension.

    y = (x - mean(x)) / sqrt(var(x) + eps) * gain + bias, with the mean and the biased variance
    (divided by d_model, not d_model - 1) taken over the features of each position.

    Args:
        d_model: the size of the last dimension.
        eps: added to the variance for numerical safety.

    Attributes:
        weight: the gain, shape (d_model,), initialised to ones.
        bias: shape (d_model,), initialised to zeros.

    Shapes:
        (..., d_model) -> (..., d_model).
    """

    def __init__(self, d_model: int, eps: float = 1e-5):
        super().__init__()
        _require_positive("d_model", d_model)
        if not eps >= 0:
            raise ValueError(f"eps must be non-negative, got {eps!r}")
        self.d_model = d_model
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model))
        self.bias = nn.Parameter(torch.zeros(d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _require_last_dim("x", x, self.d_model)
        mean = x.mean(dim=-1, keepdim=True)
        var = ((x - mean) ** 2).mean(dim=-1, keepdim=True)
        return (x - mean) / torch.sqrt(var + self.eps) * self.weight + self.bias

    def extra_repr(self) -> str:
        return f"{self.d_model}, eps={self.eps}"

    @classmethod
    def from_torch(cls, module: nn.LayerNorm) -> LayerNorm:
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


class RMSNorm(nn.Module):
    """Root-mean-square normalization over the last dimension (no centring, no bias).

    y = x / sqrt(mean(x^2) + eps) * gain.

    Args:
        d_model: the size of the last dimension.
        eps: added to the mean square; None means the machine epsilon of the input's dtype,
            as in `torch.nn.RMSNorm`.

    Attributes:
        weight: the gain, shape (d_model,), initialised to ones.

    Shapes:
        (..., d_model) -> (..., d_model).
    """

    def __init__(self, d_model: int, eps: float | None = 1e-6):
        super().__init__()
        _require_positive("d_model", d_model)
        if eps is not None and not eps >= 0:
            raise ValueError(f"eps must be non-negative or None, got {eps!r}")
        self.d_model = d_model
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _require_last_dim("x", x, self.d_model)
        eps = torch.finfo(x.dtype).eps if self.eps is None else self.eps
        ms = (x * x).mean(dim=-1, keepdim=True)
        return x * torch.rsqrt(ms + eps) * self.weight

    def extra_repr(self) -> str:
        return f"{self.d_model}, eps={self.eps}"

    @classmethod
    def from_torch(cls, module: nn.RMSNorm) -> RMSNorm:
        """An `RMSNorm` holding a copy of ``module``'s gain and eps."""
        if not isinstance(module, nn.RMSNorm):
            raise ValueError(f"expected nn.RMSNorm, got {type(module).__name__}")
        if len(module.normalized_shape) != 1:
            raise ValueError(
                f"only a single normalized dimension is supported, got {module.normalized_shape}"
            )
        new = cls(module.normalized_shape[0], eps=module.eps)
        if module.weight is not None:
            new = new.to(dtype=module.weight.dtype, device=module.weight.device)
            with torch.no_grad():
                new.weight.copy_(module.weight)
        return new


ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu}
# A gated FFN computes act(x W_gate) * (x W_1): the gate's nonlinearity for each variant.
GATED_ACTIVATIONS = {"glu": torch.sigmoid, "reglu": F.relu, "geglu": F.gelu, "swiglu": F.silu}


def gated_ffn_width(d_ff: int, multiple_of: int = 1) -> int:
    """The hidden width of a gated FFN with about the parameters of an ungated one of width d_ff.

    A gated FFN has three weight matrices of d_model x width instead of two, so width = 2/3 d_ff
    keeps the count (about) the same; it is rounded up to a multiple of ``multiple_of``.

    Example: ``gated_ffn_width(2048) == 1365``; ``gated_ffn_width(2048, 8) == 1368``.
    """
    _require_positive("d_ff", d_ff)
    _require_positive("multiple_of", multiple_of)
    width = max(1, round(2 * d_ff / 3))
    return -(-width // multiple_of) * multiple_of


class PositionwiseFeedForward(nn.Module):
    """FFN(x) = act(x W_1 + b_1) W_2 + b_2, applied to every position alone.

    With a gated activation ("glu", "reglu", "geglu", "swiglu") a third projection, ``gate``,
    is added and the hidden layer becomes act(x W_gate + b_gate) * (x W_1 + b_1): the gate decides,
    feature by feature, how much of the linear path passes. ``linear1``, ``dropout`` and
    ``linear2`` keep the names and order of `torch.nn.TransformerEncoderLayer`, so that its
    weights can be copied in.

    Args:
        d_model: input and output width.
        d_ff: hidden width (4 * d_model in the original Transformer; for a gated activation,
            `gated_ffn_width` gives the width with the same number of parameters).
        dropout: dropout on the hidden activations during training.
        activation: "relu", "gelu", "glu", "reglu", "geglu" or "swiglu".
        bias: whether the projections have biases.

    Shapes:
        (..., d_model) -> (..., d_model).
    """

    def __init__(self, d_model: int, d_ff: int, dropout: float = 0.0, activation: str = "relu",
                 bias: bool = True):
        super().__init__()
        choices = sorted(ACTIVATIONS) + sorted(GATED_ACTIVATIONS)
        if activation not in choices:
            raise ValueError(f"activation must be one of {choices}, got {activation!r}")
        _require_positive("d_model", d_model)
        _require_positive("d_ff", d_ff)
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        self.d_model = d_model
        self.d_ff = d_ff
        self.activation = activation
        self.gated = activation in GATED_ACTIVATIONS
        self.linear1 = nn.Linear(d_model, d_ff, bias=bias)
        self.gate = nn.Linear(d_model, d_ff, bias=bias) if self.gated else None
        self.dropout = nn.Dropout(dropout)
        self.linear2 = nn.Linear(d_ff, d_model, bias=bias)

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        """The hidden activations, (..., d_ff), before dropout."""
        _require_last_dim("x", x, self.d_model)
        if self.gated:
            return GATED_ACTIVATIONS[self.activation](self.gate(x)) * self.linear1(x)
        return ACTIVATIONS[self.activation](self.linear1(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear2(self.dropout(self.hidden(x)))

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}"


class MixtureOfExperts(nn.Module):
    """A mixture-of-experts feed-forward layer with top-1 routing (as in the Switch Transformer).

    A router, a linear map d_model -> num_experts, scores every token; each token goes to the
    expert with the highest softmax probability p, and its output is p * expert(x). Only one
    expert runs per token, so the layer has num_experts times the parameters of one FFN for about
    the compute of one.

    Args:
        d_model: input and output width.
        d_ff: hidden width of each expert.
        num_experts: number of experts E.
        activation: the experts' activation (see `PositionwiseFeedForward`).

    Attributes:
        router: nn.Linear(d_model, num_experts, bias=False).
        experts: nn.ModuleList of E `PositionwiseFeedForward`.
        last_assignment: after a forward pass, (...,) the expert index of every token.
        last_counts: after a forward pass, (E,) how many tokens each expert received.

    Shapes:
        (..., d_model) -> (..., d_model).
    """

    def __init__(self, d_model: int, d_ff: int, num_experts: int, activation: str = "relu"):
        super().__init__()
        _require_positive("num_experts", num_experts)
        self.d_model = d_model
        self.num_experts = num_experts
        self.router = nn.Linear(d_model, num_experts, bias=False)
        self.experts = nn.ModuleList(
            PositionwiseFeedForward(d_model, d_ff, activation=activation)
            for _ in range(num_experts)
        )
        self.last_assignment: torch.Tensor | None = None
        self.last_counts: torch.Tensor | None = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The chosen expert (..., ) and its router probability (..., ) for every token."""
        _require_last_dim("x", x, self.d_model)
        probs = torch.softmax(self.router(x), dim=-1)
        p, idx = probs.max(dim=-1)
        return idx, p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        idx, p = self.route(x)
        flat_x = x.reshape(-1, self.d_model)
        flat_idx, flat_p = idx.reshape(-1), p.reshape(-1)
        out = torch.zeros_like(flat_x)
        for e, expert in enumerate(self.experts):
            rows = (flat_idx == e).nonzero(as_tuple=True)[0]
            if rows.numel():
                out[rows] = flat_p[rows, None] * expert(flat_x[rows])
        self.last_assignment = idx.detach()
        self.last_counts = torch.bincount(flat_idx, minlength=self.num_experts).detach()
        return out.reshape(x.shape)
