"""Positional information for attention (chapter 5).

Attention on its own treats its input as a set: permute the positions and the outputs are permuted
the same way. This module holds the three ways the book gives a model a sense of order:

- `sinusoidal_encoding` (and the module `SinusoidalPositionalEncoding`): the fixed encoding of
  "Attention Is All You Need", added to the token embeddings;
- `LearnedPositionalEmbedding`: one trained vector per position, added the same way;
- `apply_rope` (and the module `RotaryEmbedding`): rotary position embedding, which rotates the
  queries and keys instead of adding anything, so that their dot product depends only on the
  offset between the two positions. Two layouts of the feature pairs are in use: "interleaved",
  pairs (x_0, x_1), (x_2, x_3), ... as in the RoFormer paper, and "half", pairs
  (x_i, x_{i + d/2}) with ``rotate_half`` as in the Hugging Face Llama and GPT-NeoX code.
  `rope_permutation` and `permute_rope_weight` convert between them.

It also has `TokenEmbedding` (token vectors scaled by sqrt(d_model)) and `sinusoidal_shift_matrix`,
the fixed linear map that takes PE(t) to PE(t + k).

Shapes follow the book: batch first, (B, L, d_model).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ._validation import (
    InputTypeError,
    apply_dropout,
    require_bool,
    require_choice,
    require_floating,
    require_int,
    require_integer_ids,
    require_like_module,
    require_module_device,
    require_probability,
    require_rank,
    require_real,
    require_same_device,
    require_tensor,
    shape_str,
)

__all__ = [
    "sinusoidal_encoding",
    "sinusoidal_shift_matrix",
    "SinusoidalPositionalEncoding",
    "LearnedPositionalEmbedding",
    "TokenEmbedding",
    "rope_angles",
    "apply_rope",
    "RotaryEmbedding",
    "ROPE_LAYOUTS",
    "rope_permutation",
    "permute_rope_weight",
]

ROPE_LAYOUTS = ("interleaved", "half")


def _require_even(name: str, value: object) -> int:
    """A positive even int: an odd width has a sine without its cosine, so it is refused."""
    value = require_int(name, value)
    if value % 2 != 0:
        raise ValueError(f"{name} must be even (sines and cosines come in pairs), got {value}")
    return value


def _require_base(base: object) -> float:
    return require_real("base", base, low=0.0, low_open=True)


def _frequencies(dim: int, base: float) -> torch.Tensor:
    """w_k = base^(-2k / dim) for k = 0 .. dim/2 - 1, float64, shape (dim / 2,)."""
    base = _require_base(base)
    k2 = torch.arange(0, dim, 2, dtype=torch.float64)
    return torch.exp(-math.log(base) * k2 / dim)


def sinusoidal_encoding(max_len: int, d_model: int, base: float = 10000.0) -> torch.Tensor:
    """The sinusoidal positional encoding of "Attention Is All You Need".

    PE[t, 2k] = sin(t * w_k) and PE[t, 2k + 1] = cos(t * w_k), with w_k = base^(-2k / d_model).

    Args:
        max_len: number of positions, a positive int.
        d_model: width of each encoding, a positive even int (an odd width would leave the last
            sine without its cosine, so it is refused rather than truncated).
        base: the wavelength scale (10000 in the paper), a finite positive number.

    Returns:
        (max_len, d_model) float32 tensor; row t is the encoding of position t.

    Raises:
        InputTypeError: if ``max_len`` or ``d_model`` is not an int (2.5, True) or ``base`` is
            not a number.
        ValueError: if ``max_len`` is below 1, ``d_model`` is not positive and even, or ``base``
            is not finite and positive.
    """
    max_len = require_int("max_len", max_len)
    _require_even("d_model", d_model)
    t = torch.arange(max_len, dtype=torch.float64)[:, None]
    w = _frequencies(d_model, base)
    pe = torch.zeros(max_len, d_model, dtype=torch.float64)
    pe[:, 0::2] = torch.sin(t * w)
    pe[:, 1::2] = torch.cos(t * w)
    return pe.float()


def sinusoidal_shift_matrix(offset: float, d_model: int, base: float = 10000.0) -> torch.Tensor:
    """The fixed matrix R_k with PE(t + k) = PE(t) R_k for every position t (row vectors).

    R_k is block diagonal with one 2 x 2 rotation per frequency: the pair
    (sin(t w), cos(t w)) becomes (sin((t + k) w), cos((t + k) w)) by the angle-addition formulas.
    In code: ``pe[t + k] == pe[t] @ sinusoidal_shift_matrix(k, d_model)`` for every t.

    Args:
        offset: the shift k (any finite real number; negative shifts go back).
        d_model: width of the encoding, a positive even int.
        base: as in `sinusoidal_encoding`.

    Returns:
        (d_model, d_model) float64 tensor; it does not depend on t.

    Raises:
        InputTypeError, ValueError: for an offset that is not a finite number, or a bad
            ``d_model`` or ``base`` (as in `sinusoidal_encoding`).
    """
    offset = require_real("offset", offset)
    _require_even("d_model", d_model)
    w = _frequencies(d_model, base) * float(offset)
    c, s = torch.cos(w), torch.sin(w)
    m = torch.zeros(d_model, d_model, dtype=torch.float64)
    i = torch.arange(0, d_model, 2)
    # sin(a + b) = sin a cos b + cos a sin b;  cos(a + b) = cos a cos b - sin a sin b
    m[i, i], m[i, i + 1] = c, -s
    m[i + 1, i], m[i + 1, i + 1] = s, c
    return m


def _require_sequence(name: str, x: object, d_model: int, max_len: int,
                      rows: str) -> torch.Tensor:
    """A floating (B, L, d_model) tensor with L <= max_len (``rows`` says what max_len counts)."""
    require_tensor(name, x)
    require_rank(name, x, "(B, L, d_model)", rank=3)
    if x.shape[-1] != d_model:
        raise ValueError(f"{name} must have shape (B, L, d_model={d_model}), got {shape_str(x)}")
    require_floating(name, x)
    if x.shape[1] > max_len:
        raise ValueError(
            f"{name} has L={x.shape[1]} positions but {rows.format(max_len=max_len)}: "
            f"{name} is {shape_str(x)}"
        )
    return x


class SinusoidalPositionalEncoding(nn.Module):
    """Adds the sinusoidal encoding to a batch of embeddings, then applies dropout.

    The encoding is a buffer (saved with the model, never trained).

    Args:
        d_model: embedding width, a positive even int.
        max_len: the longest sequence it accepts, a positive int.
        dropout: dropout probability applied to the sum, as in the original Transformer, in
            [0, 1).
        base: as in `sinusoidal_encoding`.

    Shapes:
        (B, L, d_model) -> (B, L, d_model), with L <= max_len; x may have any floating dtype (the
        encoding is cast to it) but must be on the module's device. L = 0 or B = 0 gives an
        empty output; L > max_len raises a `ValueError` (there is no row for those positions).
    """

    def __init__(self, d_model: int, max_len: int = 5000, dropout: float = 0.0,
                 base: float = 10000.0):
        super().__init__()
        pe = sinusoidal_encoding(max_len, d_model, base)
        self.d_model = int(d_model)
        self.max_len = int(max_len)
        self.register_buffer("pe", pe, persistent=False)
        self.dropout = nn.Dropout(require_probability("dropout", dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _require_sequence("x", x, self.d_model, self.max_len,
                          "the encoding was built for max_len={max_len}")
        require_module_device("x", x, self)
        return apply_dropout(self.dropout, x + self.pe[: x.shape[1]].to(x.dtype))


class LearnedPositionalEmbedding(nn.Module):
    """One trained vector per position, added to the token embeddings (as in BERT and GPT-2).

    Unlike the sinusoidal encoding it has no rule for positions it has no row for: a sequence
    longer than ``max_len`` is an error, and rows for positions never seen in training stay at
    their random initial values.

    Args:
        max_len: number of positions it has a vector for, a positive int.
        d_model: embedding width, a positive int.
        init_std: standard deviation of the normal initialisation of the table, >= 0.

    Attributes:
        weight: the (max_len, d_model) table of position vectors.

    Shapes:
        (B, L, d_model) -> (B, L, d_model), with L <= max_len, in the dtype and on the device of
        ``weight``. L = 0 or B = 0 gives an empty output; L > max_len raises a `ValueError`.
    """

    def __init__(self, max_len: int, d_model: int, init_std: float = 0.02):
        super().__init__()
        self.max_len = require_int("max_len", max_len)
        self.d_model = require_int("d_model", d_model)
        init_std = require_real("init_std", init_std, low=0.0)
        self.weight = nn.Parameter(torch.randn(self.max_len, self.d_model) * init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _require_sequence("x", x, self.d_model, self.max_len,
                          "there are only max_len={max_len} learned position vectors")
        require_like_module("x", x, self)
        return x + self.weight[: x.shape[1]]


class TokenEmbedding(nn.Module):
    """Token ids to vectors, multiplied by sqrt(d_model) as in "Attention Is All You Need".

    The paper states the scale (section 3.4) but gives no reason for it. A plausible one, not the
    paper's: with the table initialised with standard deviation 1 / sqrt(d_model), as here,
    token vectors have norm about 1 and the scale brings them to about sqrt(d_model), the order
    of the sinusoidal encoding's norm sqrt(d_model / 2). That only holds for this
    initialisation; with `nn.Embedding`'s default (standard deviation 1) the scale makes the
    tokens about sqrt(2 d_model) times larger than the encoding.

    Args:
        vocab_size: number of tokens, a positive int.
        d_model: embedding width, a positive int.
        scale: multiply by sqrt(d_model) (True, the paper's choice) or not.

    Shapes:
        (B, L) integer ids, each in [0, vocab_size), on the module's device -> (B, L, d_model).
        Any shape of ids works (an empty one gives an empty output); an id outside the
        vocabulary raises a `ValueError` naming the range found.
    """

    def __init__(self, vocab_size: int, d_model: int, scale: bool = True):
        super().__init__()
        self.vocab_size = require_int("vocab_size", vocab_size)
        self.d_model = require_int("d_model", d_model)
        self.scale = math.sqrt(self.d_model) if require_bool("scale", scale) else 1.0
        self.embedding = nn.Embedding(self.vocab_size, self.d_model)
        nn.init.normal_(self.embedding.weight, std=self.d_model**-0.5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        require_tensor("ids", ids)
        require_module_device("ids", ids, self)
        # A meta tensor has no values to range-check; its dtype is still checked.
        vocab = None if ids.device.type == "meta" else self.vocab_size
        require_integer_ids("ids", ids, vocab_size=vocab)
        return self.embedding(ids) * self.scale


def rope_angles(positions: torch.Tensor, dim: int, base: float = 10000.0) -> torch.Tensor:
    """The rotation angles of rotary position embedding: theta[..., t, k] = positions[..., t] * w_k.

    Args:
        positions: (..., L) positions, an integer or a real tensor with finite values.
        dim: the width of the vectors to rotate, a positive even int.
        base: w_k = base^(-2k / dim), as in the sinusoidal encoding.

    Returns:
        (..., L, dim / 2) float64 tensor of angles, on the device of ``positions``.

    Raises:
        InputTypeError: for positions that are not a real (integer or floating) tensor.
        ValueError: for a bad ``dim`` or ``base``, or positions holding NaN or infinity.
    """
    _require_even("dim", dim)
    _require_positions(positions)
    return positions.to(torch.float64)[..., None] * _frequencies(dim, base).to(positions.device)


def _require_positions(positions: object) -> torch.Tensor:
    require_tensor("positions", positions)
    if positions.dtype == torch.bool or positions.is_complex():
        raise InputTypeError(
            f"positions must be an integer or real tensor, got dtype {positions.dtype}"
        )
    if (positions.is_floating_point() and positions.device.type != "meta"
            and not torch.isfinite(positions).all()):
        raise ValueError(f"positions must be finite, got {positions.tolist()}")
    return positions


def _require_layout(layout: object) -> str:
    return require_choice("layout", layout, ROPE_LAYOUTS)


def rope_permutation(dim: int, to: str = "half") -> torch.Tensor:
    """The feature order that turns one RoPE layout into the other, for vectors of width dim.

    With ``p = rope_permutation(d)``, ``x[..., p]`` puts the interleaved pair k = (x_2k, x_2k+1)
    at features (k, k + d/2), where the half layout expects it: p = [0, 2, 4, ..., d - 2,
    1, 3, ..., d - 1]. Hence, for every x and positions,
    ``apply_rope(x[..., p], layout="half") == apply_rope(x, layout="interleaved")[..., p]``.
    ``rope_permutation(d, to="interleaved")`` is the inverse permutation.

    Args:
        dim: the width d of the rotated vectors (d_k per head), a positive even int.
        to: the layout to convert to, "half" (from interleaved) or "interleaved" (from half).

    Returns:
        (dim,) int64 index tensor, a permutation of 0 .. dim - 1.

    Raises:
        InputTypeError, ValueError: for a ``dim`` that is not a positive even int, or an unknown
            ``to``.
    """
    dim = _require_even("dim", dim)
    to = require_choice("to", to, ROPE_LAYOUTS)
    perm = torch.cat([torch.arange(0, dim, 2), torch.arange(1, dim, 2)])
    return perm if to == "half" else torch.argsort(perm)


def permute_rope_weight(weight: torch.Tensor, num_heads: int, to: str = "half") -> torch.Tensor:
    """Reorder a query or key projection so that one RoPE layout gives the other's scores.

    ``weight`` is stored as `nn.Linear` stores it, one row per output feature: shape
    (num_heads * d_k, d_in), head after head (in the book's row-vector notation these rows are the
    columns of W_Q or W_K). The rows of every head are permuted by `rope_permutation` (d_k, to),
    so that the projection of the new weight, rotated in the ``to`` layout, is the old projection
    rotated in the other layout with its features permuted; dot products, hence attention
    scores, are unchanged when W_Q and W_K are both converted. A bias of shape
    (num_heads * d_k,) is converted by the same call. This is the conversion the Hugging Face
    script applies to Meta's Llama checkpoints (interleaved) for its half-layout code.

    Args:
        weight: (num_heads * d_k, ...) tensor, e.g. ``linear.weight`` or ``linear.bias``.
        num_heads: the number of heads h; the first dim must split into h heads of even width.
        to: "half" (from interleaved) or "interleaved" (from half).

    Returns:
        A new tensor of the same shape, dtype and device.

    Raises:
        InputTypeError: for a weight that is not a tensor or a num_heads that is not an int.
        ValueError: if the weight has no dims, or its first dim is not num_heads times an even
            d_k, or ``to`` is unknown.
    """
    require_tensor("weight", weight)
    num_heads = require_int("num_heads", num_heads)
    to = require_choice("to", to, ROPE_LAYOUTS)
    if weight.dim() == 0 or weight.shape[0] % num_heads != 0 or (weight.shape[0] // num_heads) % 2:
        raise ValueError(
            f"weight must have shape (num_heads * d_k, ...) with num_heads={num_heads} and d_k "
            f"even, got {shape_str(weight)}"
        )
    d_k = weight.shape[0] // num_heads
    perm = rope_permutation(d_k, to).to(weight.device)
    heads = weight.reshape(num_heads, d_k, *weight.shape[1:])
    return heads[:, perm].reshape(weight.shape).clone()


def _batch_first(positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Positions (P_0, ..., P_{k-1}, L) for x (D_0, ..., D_{n-1}, L, d), as a view with x's rank.

    The leading dims of ``positions`` are matched with x's from the left, batch first as
    everywhere in the book, and the missing ones become 1: (B, L) positions for queries
    (B, h, L, d_k) are viewed as (B, 1, L), so that row b of every head sits at positions[b].
    (Broadcasting from the right would match B with h instead.) Each P_j must be 1 or D_j.
    """
    lead, extra = x.dim() - 2, positions.dim() - 1
    fits = extra <= lead and all(
        p in (1, s) for p, s in zip(positions.shape[:-1], x.shape[:extra], strict=True)
    )
    if not fits:
        raise ValueError(
            f"positions of shape {shape_str(positions)} do not broadcast to x's (..., L) = "
            f"{shape_str(x.shape[:-1])}: x is {shape_str(x)}, and positions are read batch "
            f"first, (L,), (B, L) or (B, ..., L), each dim 1 or x's"
        )
    return positions.reshape(*positions.shape[:-1], *([1] * (lead - extra)),
                             positions.shape[-1])


def apply_rope(x: torch.Tensor, positions: torch.Tensor | None = None,
               base: float = 10000.0, layout: str = "interleaved") -> torch.Tensor:
    """Rotary position embedding (RoPE): rotate each pair of features by a position's angle.

    Pair k of the vector at position t, (a, b), becomes (a cos - b sin, a sin + b cos) of the
    angle t * w_k, w_k = base^(-2k / d): a counter-clockwise rotation, written for a column vector
    (a, b)^T as in the RoFormer paper. In the book's row-vector notation that is x -> x R_t^T =
    x R_{-t}, with R_t = `sinusoidal_shift_matrix` (t, d) in the interleaved layout, so the score
    of a query at m and a key at n is q R_{n-m} k^T: it depends on n - m only. Apply it to queries
    and keys, never to values.

    Args:
        x: (..., L, d) vectors, for instance queries of shape (B, h, L, d_k); d must be even.
        positions: the position of each of the L vectors; defaults to 0, 1, ..., L - 1.
            Shape (L,), shared by every row, or (B, L), one row of positions per batch row, or
            more generally (D_0, ..., D_{k-1}, L) with k <= x.dim() - 2, read batch first: its
            dims are matched with x's leading dims from the left, each 1 or equal to x's. For
            queries (B, h, L, d_k), (B, L) positions rotate row b of every head by
            ``positions[b]`` (they are viewed as (B, 1, L)).
        base: the wavelength scale (10000 in the RoFormer paper).
        layout: which features form pair k: "interleaved", (x_2k, x_2k+1) as in the RoFormer
            paper and `sinusoidal_encoding`; or "half", (x_k, x_{k + d/2}) as in the
            ``rotate_half`` code of Hugging Face's Llama and GPT-NeoX. `permute_rope_weight`
            converts projection weights from one to the other.

    Returns:
        A tensor of the same shape and dtype as ``x`` (empty when x is: L = 0 or B = 0).

    Raises:
        InputTypeError: if x is not a floating-point tensor, or positions are not a real tensor
            on x's device.
        ValueError: if x has fewer than 2 dims, an odd last dim, positions of the wrong shape or
            with NaN, a bad ``base`` or an unknown ``layout``.
    """
    require_tensor("x", x)
    require_rank("x", x, "(..., L, d)", min_rank=2)
    require_floating("x", x)
    _require_base(base)
    _require_layout(layout)
    length, d = x.shape[-2], x.shape[-1]
    if d % 2 != 0:
        raise ValueError(
            f"x must have shape (..., L, d) with d even (features rotate in pairs), "
            f"got {shape_str(x)}"
        )
    if positions is None:
        positions = torch.arange(length, device=x.device)
    _require_positions(positions)
    require_same_device(x=x, positions=positions)
    if positions.dim() == 0 or positions.shape[-1] != length:
        raise ValueError(
            f"positions must have shape (L={length},) or (..., L={length}) to match x "
            f"{shape_str(x)}, got {shape_str(positions)}"
        )
    theta = rope_angles(_batch_first(positions, x), d, base)  # (..., L, d/2), x's rank
    return rotate_pairs(x, theta, layout)


def rotate_pairs(x: torch.Tensor, theta: torch.Tensor, layout: str) -> torch.Tensor:
    """`apply_rope`'s rotation, unchecked: x (..., L, d) by angles theta broadcastable to
    (..., L, d/2) (float64, from `rope_angles`), pairs laid out as ``layout`` says. For callers
    that checked their inputs once (`utils.decoding_plan`)."""
    d = x.shape[-1]
    cos = torch.cos(theta).to(x.dtype)
    sin = torch.sin(theta).to(x.dtype)
    if layout == "half":
        first, second = x[..., : d // 2], x[..., d // 2:]  # pair k is (x_k, x_{k + d/2})
        return torch.cat([first * cos - second * sin, first * sin + second * cos], dim=-1)
    x1, x2 = x[..., 0::2], x[..., 1::2]  # the two coordinates of every pair
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out


class RotaryEmbedding(nn.Module):
    """`apply_rope` as a module with no parameters: ``RotaryEmbedding(d)(q)`` rotates q.

    Args:
        dim: the width d of the vectors it rotates (d_k per head); must be even.
        base: as in `apply_rope`.
        layout: "interleaved" (default) or "half", as in `apply_rope`.

    Shapes:
        (..., L, dim) -> (..., L, dim); ``forward(x, positions=None)``.
    """

    def __init__(self, dim: int, base: float = 10000.0, layout: str = "interleaved"):
        super().__init__()
        self.dim = _require_even("dim", dim)
        self.base = _require_base(base)
        self.layout = _require_layout(layout)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        require_tensor("x", x)
        if x.dim() == 0 or x.shape[-1] != self.dim:
            raise ValueError(f"x must have shape (..., L, dim={self.dim}), got {shape_str(x)}")
        return apply_rope(x, positions, self.base, self.layout)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, base={self.base}, layout={self.layout!r}"
