"""The pieces around attention: feed-forward networks and normalization (chapters 6 and 7).

- `PositionwiseFeedForward`: FFN(x) = act(x W_1 + b_1) W_2 + b_2 at every position alone, with
  ReLU or GELU, and the gated variants GLU, ReGLU, GEGLU and SwiGLU;
- `gated_ffn_width`: the hidden width that gives a gated FFN the parameters of an ungated one;
- `MixtureOfExperts`: several feed-forward experts and a router that sends each token to one;
- `LayerNorm` and `RMSNorm`, each with ``from_torch``.

Every module works on (..., d_model) inputs, batch first, as in the rest of the book. The norms
compute in float32 when given bfloat16 or float16 and round once at the end, as PyTorch's fused
kernels and Hugging Face `transformers` do, rather than rounding every intermediate (the
squares, the mean, the square root) to the 8 significant bits of bfloat16.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._validation import (
    apply_dropout,
    require_bool,
    require_choice,
    require_int,
    require_like_module,
    require_probability,
    require_real,
    require_tensor,
    shape_str,
)
from .convert import copy_norm, norm_size

__all__ = [
    "LayerNorm",
    "RMSNorm",
    "PositionwiseFeedForward",
    "gated_ffn_width",
    "MixtureOfExperts",
    "ACTIVATIONS",
    "GATED_ACTIVATIONS",
]


def _upcast(x: torch.Tensor) -> torch.Tensor:
    """``x`` in float32 when its dtype is narrower (bfloat16, float16); ``x`` itself otherwise,
    so that float32 and float64 inputs go through exactly the operations they always did."""
    return x.float() if x.element_size() < 4 else x


def _require_last_dim(name: str, x: object, module: nn.Module) -> torch.Tensor:
    """A tensor of shape (..., d_model) with the dtype and device of ``module``'s parameters."""
    require_tensor(name, x)
    if x.dim() == 0 or x.shape[-1] != module.d_model:
        raise ValueError(
            f"{name} must have shape (..., d_model={module.d_model}), got {shape_str(x)}"
        )
    require_like_module(name, x, module)
    return x


class LayerNorm(nn.Module):
    """Layer normalization over the last dimension.

    y = (x - mean(x)) / sqrt(var(x) + eps) * gain + bias, with the mean and the biased variance
    (divided by d_model, not d_model - 1) taken over the features of each position.

    Args:
        d_model: the size of the last dimension, a positive int.
        eps: added to the variance for numerical safety, a finite number >= 0. With ``eps=0`` a
            position whose features are all equal gives 0 / 0 = NaN, as in torch; any positive
            eps gives zeros there (then the bias).
        elementwise_affine: whether there is a learned gain (and bias), as in `torch.nn.LayerNorm`.
        bias: whether there is a learned bias (only with ``elementwise_affine``).
        fused: compute the same function with PyTorch's fused kernel ``F.layer_norm`` (the
            default: one call instead of nine small operations, which shows where a model runs
            one token at a time); False runs the formula above step by step, as chapter 7
            derives it. The two agree to rounding (``tests/test_layers.py``). An attribute too:
            set ``module.fused = False`` on a built module.

    In bfloat16 or float16 both paths compute in float32, gain and bias included, and round
    once at the end: the fused kernel does so inside (it is the very call of
    ``torch.nn.LayerNorm``, hence of GPT-2 in `transformers`), the step-by-step path by
    converting the input to float32 first.

    Attributes:
        weight: the gain, shape (d_model,), initialised to ones; None without
            ``elementwise_affine``.
        bias: shape (d_model,), initialised to zeros; None without it.

    Shapes:
        (..., d_model) -> (..., d_model), in the dtype and on the device of the parameters.
        An empty batch gives an empty output.
    """

    def __init__(self, d_model: int, eps: float = 1e-5, elementwise_affine: bool = True,
                 bias: bool = True, fused: bool = True):
        super().__init__()
        self.d_model = require_int("d_model", d_model)
        self.eps = require_real("eps", eps, low=0.0)
        affine = require_bool("elementwise_affine", elementwise_affine)
        with_bias = require_bool("bias", bias) and affine
        self.fused = require_bool("fused", fused)
        self.weight = nn.Parameter(torch.ones(self.d_model)) if affine else None
        self.bias = nn.Parameter(torch.zeros(self.d_model)) if with_bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _require_last_dim("x", x, self)
        return self.compute(x)

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        """`forward` without its checks, for a caller that checked ``x`` once
        (`utils.decoding_plan`): (..., d_model) -> (..., d_model)."""
        if self.fused:
            return F.layer_norm(x, (self.d_model,), self.weight, self.bias, self.eps)
        h = _upcast(x)  # float32 for bfloat16 and float16; x itself for float32 and float64
        centred = h - h.mean(dim=-1, keepdim=True)
        var = (centred ** 2).mean(dim=-1, keepdim=True)
        y = centred / torch.sqrt(var + self.eps)
        if self.weight is not None:
            y = y * self.weight  # a bfloat16 gain times a float32 y is computed in float32
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype)  # no operation at all when x is already float32

    def extra_repr(self) -> str:
        return (f"{self.d_model}, eps={self.eps}, elementwise_affine={self.weight is not None}, "
                f"bias={self.bias is not None}" + ("" if self.fused else ", fused=False"))

    @classmethod
    def from_torch(cls, module: nn.LayerNorm) -> LayerNorm:
        """A `LayerNorm` holding an exact copy of ``module``'s gain, bias and eps.

        Every `torch.nn.LayerNorm` over one dimension is copied: with ``elementwise_affine=False``
        the copy has no parameters, with ``bias=False`` no bias, as the original. The copy has
        the module's dtype, device and train/eval mode, and gives the same output to about 1e-6.

        Raises:
            InputTypeError: when ``module`` is not an ``nn.LayerNorm``.
            ValueError: when it normalizes over more than one dimension.
        """
        d_model = norm_size(module, nn.LayerNorm)
        new = cls(d_model, eps=module.eps, elementwise_affine=module.weight is not None,
                  bias=module.bias is not None)
        return copy_norm(new, module)


class RMSNorm(nn.Module):
    """Root-mean-square normalization over the last dimension (no centring, no bias).

    y = x / sqrt(mean(x^2) + eps) * gain.

    Args:
        d_model: the size of the last dimension, a positive int.
        eps: added to the mean square, a finite number >= 0; None means the machine epsilon of
            the input's dtype, as in `torch.nn.RMSNorm`. With ``eps=0`` an all-zero position
            gives 0 / 0 = NaN, as in torch; None or a positive eps gives zeros there.
        elementwise_affine: whether there is a learned gain, as in `torch.nn.RMSNorm`.

    In bfloat16 or float16 the mean square and the division are computed in float32, the
    result is rounded back to the input's dtype, and only then multiplied by the gain, in that
    dtype: the order of Llama's ``LlamaRMSNorm`` in `transformers`, which the book's Llama
    checkpoints are compared with. (`torch.nn.RMSNorm` multiplies by the gain before rounding,
    so in bfloat16 the two can differ by one unit in the last place.)

    Attributes:
        weight: the gain, shape (d_model,), initialised to ones; None without
            ``elementwise_affine``.

    Shapes:
        (..., d_model) -> (..., d_model), in the dtype and on the device of the gain.
        An empty batch gives an empty output.
    """

    def __init__(self, d_model: int, eps: float | None = 1e-6, elementwise_affine: bool = True):
        super().__init__()
        self.d_model = require_int("d_model", d_model)
        self.eps = None if eps is None else require_real("eps", eps, low=0.0)
        affine = require_bool("elementwise_affine", elementwise_affine)
        self.weight = nn.Parameter(torch.ones(self.d_model)) if affine else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _require_last_dim("x", x, self)
        return self.compute(x)

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        """`forward` without its checks (see `LayerNorm.compute`)."""
        eps = torch.finfo(x.dtype).eps if self.eps is None else self.eps
        h = _upcast(x)  # float32 for bfloat16 and float16; x itself for float32 and float64
        ms = (h * h).mean(dim=-1, keepdim=True)
        y = (h * torch.rsqrt(ms + eps)).to(x.dtype)  # no operation when x is float32
        return y if self.weight is None else y * self.weight

    def extra_repr(self) -> str:
        return f"{self.d_model}, eps={self.eps}, elementwise_affine={self.weight is not None}"

    @classmethod
    def from_torch(cls, module: nn.RMSNorm) -> RMSNorm:
        """An `RMSNorm` holding an exact copy of ``module``'s gain and eps (None included).

        A `torch.nn.RMSNorm` with ``elementwise_affine=False`` gives a copy without a gain. The
        copy has the module's dtype, device and train/eval mode.

        Raises:
            InputTypeError: when ``module`` is not an ``nn.RMSNorm``.
            ValueError: when it normalizes over more than one dimension.
        """
        d_model = norm_size(module, nn.RMSNorm)
        new = cls(d_model, eps=module.eps, elementwise_affine=module.weight is not None)
        return copy_norm(new, module)


ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu}
# A gated FFN computes act(x W_gate) * (x W_1): the gate's nonlinearity for each variant.
GATED_ACTIVATIONS = {"glu": torch.sigmoid, "reglu": F.relu, "geglu": F.gelu, "swiglu": F.silu}


def gated_ffn_width(d_ff: int, multiple_of: int = 1) -> int:
    """The hidden width of a gated FFN with about the parameters of an ungated one of width d_ff.

    A gated FFN has three weight matrices of d_model x width instead of two, so width = 2/3 d_ff
    keeps the count (about) the same; it is rounded up to a multiple of ``multiple_of``.

    Example: ``gated_ffn_width(2048) == 1365``; ``gated_ffn_width(2048, 8) == 1368``.
    """
    d_ff = require_int("d_ff", d_ff)
    multiple_of = require_int("multiple_of", multiple_of)
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
        dropout: dropout on the hidden activations during training, after the activation and
            before ``linear2``, where `torch.nn.TransformerEncoderLayer` puts its ``dropout``.
            The dropout that the original Transformer applies to each sublayer's output before
            the residual addition is not part of this module; the layer adds it
            (`utils.transformer`).
        activation: "relu", "gelu", "glu", "reglu", "geglu" or "swiglu".
        bias: whether the projections have biases.

    Shapes:
        (..., d_model) -> (..., d_model), in the dtype and on the device of the parameters; an
        empty batch gives an empty output.

    Raises:
        InputTypeError: for a width that is not an int, an activation that is not a string, a
            dropout that is not a number, a bias that is not a bool, or (in forward) an input
            of another dtype or device than the parameters.
        ValueError: for a width below 1, an unknown activation, a dropout outside [0, 1), or
            an input whose last dim is not d_model.
    """

    def __init__(self, d_model: int, d_ff: int, dropout: float = 0.0, activation: str = "relu",
                 bias: bool = True):
        super().__init__()
        choices = (*sorted(ACTIVATIONS), *sorted(GATED_ACTIVATIONS))
        self.activation = require_choice("activation", activation, choices)
        self.d_model = require_int("d_model", d_model)
        self.d_ff = require_int("d_ff", d_ff)
        dropout = require_probability("dropout", dropout)
        require_bool("bias", bias)
        self.gated = activation in GATED_ACTIVATIONS
        self.linear1 = nn.Linear(self.d_model, self.d_ff, bias=bias)
        self.gate = nn.Linear(self.d_model, self.d_ff, bias=bias) if self.gated else None
        self.dropout = nn.Dropout(dropout)
        self.linear2 = nn.Linear(self.d_ff, self.d_model, bias=bias)

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        """The hidden activations, (..., d_ff), before dropout."""
        _require_last_dim("x", x, self)
        if self.gated:
            return GATED_ACTIVATIONS[self.activation](self.gate(x)) * self.linear1(x)
        return ACTIVATIONS[self.activation](self.linear1(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear2(apply_dropout(self.dropout, self.hidden(x)))

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
        (..., d_model) -> (..., d_model), in the dtype and on the device of the parameters. An
        empty batch gives an empty output, an empty ``last_assignment`` and all-zero
        ``last_counts``.

    Raises:
        InputTypeError, ValueError: as `PositionwiseFeedForward`, and for a ``num_experts`` that
            is not a positive int.
    """

    def __init__(self, d_model: int, d_ff: int, num_experts: int, activation: str = "relu"):
        super().__init__()
        self.d_model = require_int("d_model", d_model)
        require_int("d_ff", d_ff)
        self.num_experts = require_int("num_experts", num_experts)
        self.router = nn.Linear(self.d_model, self.num_experts, bias=False)
        self.experts = nn.ModuleList(
            PositionwiseFeedForward(d_model, d_ff, activation=activation)
            for _ in range(self.num_experts)
        )
        self.last_assignment: torch.Tensor | None = None
        self.last_counts: torch.Tensor | None = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The chosen expert (..., ) and its router probability (..., ) for every token."""
        _require_last_dim("x", x, self)
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
