"""The decoder-only models that `utils.pretrained` fills with GPT-2's and Llama's weights.

Every piece is the book's own: `utils.attention.MultiHeadAttention` (GPT-2) and
`utils.attention.GroupedQueryAttention` (Llama), `utils.layers.LayerNorm` and
`utils.layers.RMSNorm`, `utils.layers.PositionwiseFeedForward` (SwiGLU for Llama),
`utils.positional.LearnedPositionalEmbedding` and `utils.positional.apply_rope`, the causal
masks of `utils.models` and the key/value cache of `utils.kv_cache`. Two small pieces the
library lacked are added here, each a subclass of a book piece:

* `GELUFeedForward`: `PositionwiseFeedForward` with GELU's tanh approximation, the one GPT-2 was
  trained with (``"gelu_new"``); the exact GELU differs from it by up to about 1e-3;
* `RotarySelfAttention`: `GroupedQueryAttention` that rotates its queries and keys with RoPE
  after projecting them and before caching the keys, as Llama does.

`CheckpointLM` puts them together: token embeddings (plus learned positions for GPT-2), pre-norm
blocks x + attn(norm1(x)), x + ffn(norm2(x)), a final norm and an output projection (tied to the
token embeddings or not). Its ``forward(tokens, mask=None, cache=None, positions=None)`` and
``new_cache()`` follow `utils.models.DecoderOnlyLM`, so that `utils.decoding.generate` runs it
with or without the key/value cache.

Shapes are batch first: tokens (B, L) -> logits (B, L, V).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._validation import (
    require_bool,
    require_choice,
    require_int,
    require_like_module,
    require_rank,
    require_real,
    require_tensor,
    shape_str,
)
from .attention import GroupedQueryAttention, scaled_dot_product_attention
from .fast_attention import fused_attention
from .kv_cache import DecoderCache, KVCache
from .layers import LayerNorm, PositionwiseFeedForward, RMSNorm
from .masks import expand_mask
from .models import (
    _check_cache,
    _check_pad_mask,
    _check_positions,
    _check_tokens,
    _rows_at,
    _self_mask,
)
from .positional import LearnedPositionalEmbedding, _batch_first, apply_rope, rotate_pairs
from .rope_scaling import rope_frequencies

__all__ = [
    "GELUFeedForward",
    "RotarySelfAttention",
    "PreNormBlock",
    "TokenPositionEmbedding",
    "CheckpointLM",
]

GELU_APPROXIMATIONS = ("tanh", "none")


def _require_sequence(name: str, x: object, module: nn.Module) -> torch.Tensor:
    """``x`` must be a (B, L, d_model) tensor with ``module``'s dtype and device."""
    require_tensor(name, x)
    require_rank(name, x, f"(B, L, d_model={module.d_model})", rank=3)
    if x.shape[-1] != module.d_model:
        raise ValueError(
            f"{name} must have shape (B, L, d_model={module.d_model}), got {shape_str(x)}"
        )
    require_like_module(name, x, module)
    return x


class GELUFeedForward(PositionwiseFeedForward):
    """FFN(x) = GELU(x W_1 + b_1) W_2 + b_2 with a chosen form of GELU, gated or not.

    GELU(z) = z Phi(z), Phi the standard normal CDF. GPT-2 computes it with the approximation
    0.5 z (1 + tanh(sqrt(2 / pi) (z + 0.044715 z^3))) (``approximate="tanh"``); the parent class
    uses the exact erf form, which differs by up to about 1e-3, too much to reproduce GPT-2's
    logits to 1e-4. ``approximate="none"`` is the exact form. Gated (chapter 6's GeGLU, as
    Gemma computes it with the tanh form), the hidden layer is GELU(x W_gate + b_gate) *
    (x W_1 + b_1).

    Args:
        d_model, d_ff, bias: as in `PositionwiseFeedForward`.
        approximate: "tanh" or "none", as ``torch.nn.functional.gelu`` takes it.
        gated: GeGLU (a third projection, ``gate``) instead of GELU.

    Shapes:
        (..., d_model) -> (..., d_model).
    """

    def __init__(self, d_model: int, d_ff: int, approximate: str = "tanh", bias: bool = True,
                 gated: bool = False):
        activation = "geglu" if require_bool("gated", gated) else "gelu"
        super().__init__(d_model, d_ff, activation=activation, bias=bias)
        self.approximate = require_choice("approximate", approximate, GELU_APPROXIMATIONS)

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        """GELU(x W_1 + b_1), or GELU(x W_gate + b_gate) * (x W_1 + b_1) gated: (..., d_ff)."""
        require_tensor("x", x)
        if x.dim() == 0 or x.shape[-1] != self.d_model:
            raise ValueError(f"x must have shape (..., d_model={self.d_model}), got {shape_str(x)}")
        require_like_module("x", x, self)
        if self.gated:
            return F.gelu(self.gate(x), approximate=self.approximate) * self.linear1(x)
        return F.gelu(self.linear1(x), approximate=self.approximate)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"


class RotarySelfAttention(GroupedQueryAttention):
    """Self-attention with rotary positions (RoPE) on the queries and keys.

    The projections, heads, key/value groups, cache and mask rule are `GroupedQueryAttention`'s
    (``num_kv_heads == num_heads`` is plain multi-head attention, 1 is multi-query); between the
    projections and the attention, q and k are rotated by `apply_rope` at their positions.
    The keys go into the cache already rotated, so that a cached key keeps the position it was
    computed at.

    Args:
        d_model, num_heads, num_kv_heads, bias: as in `GroupedQueryAttention`.
        head_dim: the width d_k of each head; None: d_model / num_heads, as in
            `GroupedQueryAttention`. Another width (a checkpoint's ``head_dim``) makes W_Q
            d_model -> num_heads * head_dim, W_K and W_V d_model -> num_kv_heads * head_dim and
            W_O num_heads * head_dim -> d_model; num_heads need not divide d_model then.
        out_bias: whether W_O has a bias; None: ``bias`` (Qwen2 has biases on W_Q, W_K, W_V
            only).
        base: RoPE's wavelength scale (Llama's ``rope_theta``), a finite number > 0.
        layout: "half" (pairs (x_k, x_{k + d/2}), the Hugging Face Llama layout) or
            "interleaved" (pairs (x_2k, x_2k+1)); see `utils.positional.permute_rope_weight`.
        scaling: None for plain RoPE, or a scaled RoPE's settings as `utils.rope_scaling.
            rope_config` reads them from a checkpoint (linear, dynamic, llama3); "dynamic" picks
            its frequencies from the largest position of each call, as the reference does.

    Shapes:
        ``forward(x, mask=None, cache=None, positions=None)``: x (B, L, d_model) -> (B, L,
        d_model). ``mask`` is read as in `GroupedQueryAttention` (with a cache, L_k counts the
        cached positions too); without one every position sees every other: `CheckpointLM`
        passes the causal mask. ``positions`` (L,) or (B, L), default 0 .. L - 1.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        num_kv_heads: int,
        base: float = 10000.0,
        layout: str = "half",
        bias: bool = False,
        scaling: dict | None = None,
        head_dim: int | None = None,
        out_bias: bool | None = None,
    ):
        inner = d_model  # h * d_k, the width of the heads side by side
        if head_dim is not None:
            inner = require_int("num_heads", num_heads) * require_int("head_dim", head_dim)
        super().__init__(inner, num_heads, num_kv_heads, bias=bias)
        self.base = require_real("base", base, low=0.0, low_open=True)
        self.layout = require_choice("layout", layout, ("half", "interleaved"))
        self.scaling = None if scaling is None else dict(scaling)
        _reshape_projections(self, d_model, bias, bias if out_bias is None else out_bias)

    def frequencies(self, length: int | None = None) -> torch.Tensor:
        """The (d_k / 2,) float64 frequencies w_k (`utils.rope_scaling.rope_frequencies`) for a
        call whose positions reach ``length - 1`` (read by dynamic scaling only)."""
        return rope_frequencies(self.d_k, self.base, self.scaling, length)

    def rotate(self, t: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        """RoPE on split heads (B, heads, L, d_k) at ``positions`` ((L,) or (B, L))."""
        if self.scaling is None:
            return apply_rope(t, positions, self.base, self.layout)
        if positions is None:
            positions = torch.arange(t.shape[-2], device=t.device)
        length = int(positions.max()) + 1 if positions.numel() else 0
        w = self.frequencies(length).to(t.device)
        theta = _batch_first(positions, t).to(torch.float64)[..., None] * w  # (B, 1, L, d_k/2)
        return rotate_pairs(t, theta, self.layout)

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """(B, L, d_model) -> (B, L, d_model); see the class docstring for the arguments."""
        _require_sequence("x", x, self)
        b, length, _ = x.shape
        q, k, v = self.project(x, positions)
        if cache is not None:
            k, v = cache.append(k, v)
        mask = self.key_mask(mask, b, length, k.shape[2], cache, positions)
        k, v = self._expand_kv(k, v)
        if self.keep_weights:
            out, weights = scaled_dot_product_attention(q, k, v, mask)
            self.attn_weights = weights.detach()
        else:
            out = fused_attention(q, k, v, mask)
            self.attn_weights = None
        return self.w_o(self._merge(out))

    def project(
        self, x: torch.Tensor, positions: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (B, h, L, d_k), k and v (B, h_kv, L, d_k) of x (B, L, d_model), q and k rotated
        at ``positions``."""
        q = self.rotate(self._split(self.w_q(x), self.num_heads), positions)
        k = self.rotate(self._split(self.w_k(x), self.num_kv_heads), positions)
        return q, k, self._split(self.w_v(x), self.num_kv_heads)

    def key_mask(self, mask: torch.Tensor | None, b: int, length: int, l_k: int,
                 cache: KVCache | None, positions: torch.Tensor | None) -> torch.Tensor | None:
        """The mask (B, 1 or h, L, L_k) the queries attend with: ``mask`` read by
        `utils.masks.expand_mask` (a subclass may narrow it: a sliding window)."""
        return expand_mask(mask, b, length, l_k)

    def _merge(self, x: torch.Tensor) -> torch.Tensor:
        """(B, h, L, d_k) -> (B, L, h * d_k), the input of W_O (h * d_k may differ from
        d_model when ``head_dim`` was given)."""
        b, _, length, _ = x.shape
        return x.transpose(1, 2).reshape(b, length, self.num_heads * self.d_k)

    def extra_repr(self) -> str:
        wide = self.num_heads * self.d_k != self.d_model  # a head_dim of its own
        extra = f", head_dim={self.d_k}" if wide else ""
        return f"base={self.base}, layout={self.layout!r}{extra}"


def _reshape_projections(
    attn: RotarySelfAttention, d_model: int, bias: bool, out_bias: bool
) -> None:
    """Give ``attn`` (built for a width h * d_k) projections between d_model and h * d_k when
    the two differ (a ``head_dim`` of its own), and W_O a bias only when ``out_bias``."""
    inner = attn.num_heads * attn.d_k
    require_bool("out_bias", out_bias)
    if inner != d_model:  # the projections between d_model and h * d_k, made anew
        attn.d_model = require_int("d_model", d_model)
        kv_width = attn.num_kv_heads * attn.d_k
        attn.w_q = nn.Linear(d_model, inner, bias=bias)
        attn.w_k = nn.Linear(d_model, kv_width, bias=bias)
        attn.w_v = nn.Linear(d_model, kv_width, bias=bias)
        attn.w_o = nn.Linear(inner, d_model, bias=out_bias)
    elif out_bias != bias:
        attn.w_o = nn.Linear(inner, d_model, bias=out_bias)


class PreNormBlock(nn.Module):
    """One pre-norm decoder block: x + attn(norm1(x)), then x + ffn(norm2(x)).

    Args:
        norm1, norm2: the two norms (`LayerNorm` for GPT-2, `RMSNorm` for Llama).
        attn: a `MultiHeadAttention` (called as self-attention) or a `RotarySelfAttention`.
        ff: the feed-forward network.

    Shapes:
        ``forward(x, mask, cache=None, positions=None)``: (B, L, d_model) -> (B, L, d_model).
    """

    def __init__(self, norm1: nn.Module, attn: nn.Module, norm2: nn.Module, ff: nn.Module):
        super().__init__()
        self.norm1, self.attn, self.norm2, self.ff = norm1, attn, norm2, ff

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None,
        cache: KVCache | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        h = self.norm1(x)
        if isinstance(self.attn, RotarySelfAttention):
            x = x + self.attn(h, mask, cache=cache, positions=positions)
        else:  # learned positions were added to the input: attention needs none
            x = x + self.attn(h, h, h, mask, cache=cache)
        return x + self.ff(self.norm2(x))


class TokenPositionEmbedding(nn.Module):
    """Token ids -> vectors: E[token] (unscaled), plus a learned position vector if any.

    Args:
        vocab_size: V.
        d_model: the width.
        max_len: the most positions the model takes; None for no limit (RoPE: positions are
            rotations computed for any position, not rows of a table).
        learned_positions: add `LearnedPositionalEmbedding` rows (GPT-2) or not (Llama, whose
            positions enter the attention as rotations).

    Shapes:
        ``forward(tokens, positions)``: tokens (B, L) ints, positions (L,) or (B, L) ints ->
        (B, L, d_model).
    """

    def __init__(
        self, vocab_size: int, d_model: int, max_len: int | None, learned_positions: bool
    ):
        super().__init__()
        self.vocab_size, self.d_model, self.max_len = vocab_size, d_model, max_len
        self.tokens = nn.Embedding(vocab_size, d_model)
        if learned_positions and max_len is None:
            raise ValueError("learned positions need max_len, the rows of their table")
        self.positions = LearnedPositionalEmbedding(max_len, d_model) if learned_positions else None

    @property
    def weight(self) -> nn.Parameter:
        """The (V, d_model) token table."""
        return self.tokens.weight

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.tokens(tokens)
        if self.positions is None:
            return x
        return x + self.positions.weight[positions]


class CheckpointLM(nn.Module):
    """A decoder-only language model assembled from the book's pieces (see the module docstring).

    Args:
        embed: the `TokenPositionEmbedding`.
        blocks: the `PreNormBlock`s, in order.
        norm: the final norm.
        tie_output: the output projection reuses the token table (GPT-2, and Llama when its
            config says so) or has its own (V, d_model) weight; never a bias.
        family: the checkpoint's ``model_type`` ("gpt2", "llama", "mistral", "qwen2", "qwen3",
            "gemma"), for the repr and the reader.

    Attributes:
        vocab_size, max_len, d_model, num_layers: read by `utils.decoding`, and by the reader
            (``max_len`` None: no limit, a RoPE model's).
        head: nn.Linear(d_model, V, bias=False), its weight the token table when tied.

    Shapes:
        tokens (B, L) -> logits (B, L, V).
    """

    def __init__(
        self,
        embed: TokenPositionEmbedding,
        blocks: list[PreNormBlock],
        norm: LayerNorm | RMSNorm,
        tie_output: bool,
        family: str,
    ):
        super().__init__()
        self.embed = embed
        self.blocks = nn.ModuleList(blocks)
        self.norm = norm
        self.head = nn.Linear(embed.d_model, embed.vocab_size, bias=False)
        if tie_output:
            self.head.weight = embed.tokens.weight
        self.tie_output, self.family = tie_output, family
        self.vocab_size, self.max_len, self.d_model = embed.vocab_size, embed.max_len, embed.d_model
        self.num_layers = len(blocks)

    def tie_weights(self) -> None:
        """Make the output projection share the token table again (when tied): a loader that
        replaces ``embed.tokens.weight`` by a new parameter calls this afterwards."""
        if self.tie_output:
            self.head.weight = self.embed.tokens.weight

    def new_cache(self) -> DecoderCache:
        """An empty key/value cache (one per block) holding up to ``max_len`` positions (any
        number when ``max_len`` is None)."""
        return DecoderCache.for_stack(self.num_layers, max_len=self.max_len)

    def forward(
        self,
        tokens: torch.Tensor,
        mask: torch.Tensor | None = None,
        cache: DecoderCache | None = None,
        positions: torch.Tensor | None = None,
        logits_at: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits (B, L, V) of ``tokens`` (B, L); the same contract as `DecoderOnlyLM.forward`,
        ``logits_at`` ((B, K) positions: logits (B, K, V) computed only there) included.

        ``mask`` (B, L_past + L), True at the positions each row may attend to, is optional.
        With a ``cache`` (from `new_cache`) holding L_past positions, ``tokens`` are only the
        new ones, at positions L_past .. L_past + L - 1 unless ``positions`` ((L,) or (B, L)
        ints) says otherwise; the logits equal the last L rows of a call on the whole sequence.
        Without a cache the positions are 0 .. L - 1.
        """
        _check_tokens("tokens", tokens, self.embed)
        past = 0
        if cache is not None:
            _check_cache(cache, tokens)
            cache.check(self.num_layers, False, tokens.shape[0])
            past = cache.length
        elif positions is not None:
            raise ValueError("positions are only taken together with a cache")
        _check_pad_mask("mask", mask, tokens, (tokens.shape[0], past + tokens.shape[1]))
        attn_mask = _self_mask(past, tokens.shape[1], mask, cache, tokens.device)
        if positions is None:
            positions = torch.arange(past, past + tokens.shape[1], device=tokens.device)
        else:
            positions = _check_positions(positions, tokens, self.max_len)
        x = self.embed(tokens, positions)
        for i, block in enumerate(self.blocks):
            layer_cache = None if cache is None else cache.self_attn[i]
            x = block(x, attn_mask, cache=layer_cache, positions=positions)
        return self.head(self.norm(_rows_at(x, logits_at)))

    def extra_repr(self) -> str:
        return f"family={self.family!r}, tie_output={self.tie_output}"
