"""The pieces Mistral, Qwen2, Qwen3 and Gemma add to the book's Llama (`utils.families`).

Each family is Llama (`utils.pretrained.load_llama`) with a few pieces changed, and every new
piece here is a subclass of a piece the book has built, which it extends:

* `FamilyAttention` extends chapter 14's `RotarySelfAttention` (chapter 3's grouped-query
  attention with chapter 5's RoPE) by two options:

  - ``window`` (Mistral; Qwen2 and Qwen3 on some layers): chapter 4's local attention, by
    positions: a query at position p sees the keys at positions p' with
    p - window < p' <= p, that is ``window`` keys, itself included (chapter 4's
    ``local_mask(L, window - 1, causal=True)``). The positions of the cached keys are kept in
    the cache (`utils.kv_cache.KVCache.positions`), so that a row whose new tokens sit in the
    cache after a gap of padding (a ragged batch in `utils.decoding.generate`) still sees the
    keys of its own last ``window`` positions;
  - ``qk_norm_eps`` (Qwen3): chapter 7's `RMSNorm` over the d_k features of every query head
    and key head, before RoPE, one gain per feature shared by the heads.

* `OffsetRMSNorm` extends chapter 7's `RMSNorm` (Gemma): the gain is 1 + w, the stored w
  starting at zero, computed in float32 and rounded to the input's dtype only at the end.
* Gemma's feed-forward network is chapter 6's gated GELU (GeGLU) with GELU's tanh form:
  chapter 14's `GELUFeedForward` with ``gated=True`` (chapter 6's ``"geglu"`` uses the exact
  GELU, which differs by up to about 1e-3).
* `ScaledTokenEmbedding` extends chapter 14's `TokenPositionEmbedding` (Gemma): the token
  vectors times sqrt(d_model), as chapter 5's `TokenEmbedding` scales them, the factor rounded to
  float32 and then to the model's dtype, as the reference rounds it.

Shapes are batch first, as in `utils.checkpoint_models`.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ._validation import require_int, require_real
from .checkpoint_models import RotarySelfAttention, TokenPositionEmbedding
from .kv_cache import KVCache
from .layers import RMSNorm

__all__ = ["FamilyAttention", "OffsetRMSNorm", "ScaledTokenEmbedding"]


class FamilyAttention(RotarySelfAttention):
    """`RotarySelfAttention` with a sliding window and/or norms on the queries and keys.

    Args:
        args, kwargs: `RotarySelfAttention`'s (d_model, num_heads, num_kv_heads, base, layout,
            bias, scaling, head_dim, out_bias).
        window: None (every earlier position) or a positive int w: the query at position p sees
            the keys at positions p - w < p' <= p (Mistral's ``sliding_window``: w keys).
        qk_norm_eps: None, or the epsilon of the `RMSNorm`s ``q_norm`` and ``k_norm`` (d_k
            gains each) applied to every query and key head before RoPE (Qwen3).

    Shapes:
        as `RotarySelfAttention`: x (B, L, d_model) -> (B, L, d_model); ``positions`` (L,) or
        (B, L), default the cache slots L_past .. L_past + L - 1. With a window and a cache,
        the cache keeps every key's position (`KVCache.positions`), so every call that fills
        it must go through this module.
    """

    def __init__(
        self,
        *args: object,
        window: int | None = None,
        qk_norm_eps: float | None = None,
        **kwargs: object,
    ):
        super().__init__(*args, **kwargs)
        self.window = None if window is None else require_int("window", window)
        self.q_norm = self.k_norm = None
        if qk_norm_eps is not None:
            self.q_norm = RMSNorm(self.d_k, eps=qk_norm_eps)
            self.k_norm = RMSNorm(self.d_k, eps=qk_norm_eps)

    def project(
        self, x: torch.Tensor, positions: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """As `RotarySelfAttention.project`, each query and key head normalized before RoPE
        when there are q/k norms."""
        if self.q_norm is None:
            return super().project(x, positions)
        q = self.rotate(self.q_norm(self._split(self.w_q(x), self.num_heads)), positions)
        k = self.rotate(self.k_norm(self._split(self.w_k(x), self.num_kv_heads)), positions)
        return q, k, self._split(self.w_v(x), self.num_kv_heads)

    def key_mask(
        self,
        mask: torch.Tensor | None,
        b: int,
        length: int,
        l_k: int,
        cache: KVCache | None,
        positions: torch.Tensor | None,
    ) -> torch.Tensor | None:
        """``mask`` (as `RotarySelfAttention.key_mask`) AND the window's band, (B or 1, 1, L,
        L_k): True where the key's position is within ``window - 1`` before the query's."""
        full = super().key_mask(mask, b, length, l_k, cache, positions)
        if self.window is None:
            return full
        keys = self.key_positions(l_k, length, cache, positions)  # (B or 1, L_k)
        band = keys[:, None, :] > keys[:, -length:, None] - self.window  # (B or 1, L, L_k)
        return band[:, None] if full is None else full & band[:, None]

    def key_positions(
        self, l_k: int, length: int, cache: KVCache | None, positions: torch.Tensor | None
    ) -> torch.Tensor:
        """The positions (B or 1, L_k) of all L_k keys, the last ``length`` the new ones; with a
        cache, those of the cached keys come from it, and all are kept in it."""
        past = l_k - length
        if positions is None:
            new = torch.arange(past, l_k, device=self.w_q.weight.device)[None]
        else:
            new = positions if positions.dim() == 2 else positions[None]
        if cache is None:
            return new
        if past:
            held = cache.positions
            if held is None or held.shape[-1] != past:
                kept = 0 if held is None else held.shape[-1]
                raise ValueError(
                    f"the cache holds {past} keys but the positions of {kept}: a sliding "
                    "window needs the position of every cached key, which only this module's "
                    "own calls keep"
                )
            rows = max(held.shape[0], new.shape[0])
            new = torch.cat([held.expand(rows, -1), new.expand(rows, -1)], dim=1)
        cache.positions = new
        return new

    def extra_repr(self) -> str:
        extra = f", window={self.window}" if self.window is not None else ""
        return super().extra_repr() + extra + (", qk_norm" if self.q_norm is not None else "")


class OffsetRMSNorm(RMSNorm):
    """Gemma's RMSNorm: y = x / sqrt(mean(x^2) + eps) * (1 + w), w stored (zeros at first).

    Computed in float32 for bfloat16 and float16 inputs, the gain included, and rounded to the
    input's dtype at the end, in the reference's order (`RMSNorm` rounds before the gain).

    Args:
        d_model, eps: as in `RMSNorm` (with a gain).

    Shapes:
        (..., d_model) -> (..., d_model).
    """

    def __init__(self, d_model: int, eps: float | None = 1e-6):
        super().__init__(d_model, eps=eps)
        nn.init.zeros_(self.weight)

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        """`forward` without its checks."""
        eps = torch.finfo(x.dtype).eps if self.eps is None else self.eps
        h = x.float() if x.element_size() < 4 else x
        y = h * torch.rsqrt(h.pow(2).mean(dim=-1, keepdim=True) + eps)
        return (y * (1.0 + self.weight.to(h.dtype))).to(x.dtype)


class ScaledTokenEmbedding(TokenPositionEmbedding):
    """Token ids -> E[token] * sqrt(d_model) (Gemma), no position vectors (RoPE's model).

    The factor is rounded to float32 and then to the table's dtype before the product, as the
    reference does (in bfloat16, sqrt(3072) = 55.43 becomes 55.5).

    Args:
        vocab_size, d_model: as in `TokenPositionEmbedding`.
        scale: the factor; None: sqrt(d_model).

    Shapes:
        ``forward(tokens, positions)``: (B, L) ints -> (B, L, d_model).
    """

    def __init__(self, vocab_size: int, d_model: int, scale: float | None = None):
        super().__init__(vocab_size, d_model, None, learned_positions=False)
        self.scale = math.sqrt(d_model) if scale is None else require_real("scale", scale)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = super().forward(tokens, positions)
        factor = torch.tensor(self.scale, dtype=torch.float32, device=x.device)
        return x * factor.to(x.dtype)

    def extra_repr(self) -> str:
        return f"scale={self.scale:.6g}"
