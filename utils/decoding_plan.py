"""One decoding step of the library's decoder-only models, checked once (`utils.decoding`).

A module of the library checks its inputs at every call: shapes, dtypes, devices, the range of
every id. That is what a reader wants when calling a layer by hand, and what a decoding loop
pays for nothing: after the first step it feeds the model only what it made itself (one token
per row, at a position it computed, into a cache it reserved), and at a small model's size the
checks cost more than the arithmetic (chapter 13 measures it). `DecodePlan` is the decoding
loop's step without them: the same operations on the same parameters as the modules'
``forward``, in the same order, for the model families the library builds and loads:

* `utils.models.DecoderOnlyLM` (its `utils.transformer.EncoderLayer` stack, pre- or post-LN);
* `utils.checkpoint_models.CheckpointLM` as `utils.pretrained` fills it: GPT-2 (LayerNorm,
  learned positions, GELU) and Llama (RMSNorm, RoPE, grouped keys and values, SwiGLU, heads of
  any ``head_dim``), and the families of `utils.families`, whose pieces of
  `utils.family_parts` it runs too: a sliding window (the positions of the cache's slots kept
  beside them, as `utils.family_parts.FamilyAttention` keeps them in the cache), Qwen3's norms
  on queries and keys, Gemma's scaled embedding, (1 + w) RMSNorm and gated tanh GELU.

It also keeps the query, key and value projections of a layer as one product, where the three
weights lie side by side in memory as GPT-2's checkpoint stores them (`utils.pretrained` loads
them so); otherwise it joins them once, for the call (a copy of 3 d_model^2 numbers per layer).

What is checked, and where: `utils.decoding.generate` checks its arguments and the prompts once
(every id against the vocabulary, the room in the model), and runs the first step, the prompts,
through the model's own checked ``forward``; `plan_for` then accepts a model only if every
module is exactly one of the classes above (a subclass may compute something else), in
evaluation mode, without forward hooks (a hook would not run) and without kept attention
weights. Anything else decodes through the checked modules, step by step, as before. The tokens
are the same either way (tests/test_decoding_plan.py runs both on every family).

Shapes: a step takes (B, 1) token ids and positions and an optional (B, L_k) bool key mask
(True = may attend) and returns (B, V) logits.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .attention import GroupedQueryAttention, MultiHeadAttention
from .checkpoint_models import (
    CheckpointLM,
    GELUFeedForward,
    PreNormBlock,
    RotarySelfAttention,
    TokenPositionEmbedding,
)
from .family_parts import FamilyAttention, OffsetRMSNorm, ScaledTokenEmbedding
from .kv_cache import DecoderCache, _in_room
from .layers import (
    ACTIVATIONS,
    GATED_ACTIVATIONS,
    LayerNorm,
    PositionwiseFeedForward,
    RMSNorm,
)
from .models import DecoderOnlyLM, InputEmbedding, _OutputHead
from .positional import (
    LearnedPositionalEmbedding,
    SinusoidalPositionalEncoding,
    TokenEmbedding,
    rotate_pairs,
)
from .transformer import Encoder
from .transformer_layers import EncoderLayer

__all__ = ["DecodePlan", "plan_for"]

# Every class a planned model may hold: the library's own, and torch's that compute nothing else.
_KNOWN = (DecoderOnlyLM, CheckpointLM, Encoder, EncoderLayer, PreNormBlock, MultiHeadAttention,
          GroupedQueryAttention, RotarySelfAttention, PositionwiseFeedForward, GELUFeedForward,
          LayerNorm, RMSNorm, InputEmbedding, _OutputHead, TokenEmbedding,
          SinusoidalPositionalEncoding, LearnedPositionalEmbedding, TokenPositionEmbedding,
          FamilyAttention, OffsetRMSNorm, ScaledTokenEmbedding,
          nn.Linear, nn.Embedding, nn.Dropout, nn.ModuleList)


def _plain(model: nn.Module) -> bool:
    """Every module exactly a class of `_KNOWN`, in evaluation mode, without forward hooks (of
    its own or global), kept attention weights, an embedding's max_norm (which would rescale
    the table's rows as they are read) or a dynamically scaled RoPE (whose frequencies change
    with every step's position)."""
    hooks = nn.modules.module
    if hooks._global_forward_hooks or hooks._global_forward_pre_hooks:
        return False
    for m in model.modules():
        if type(m) not in _KNOWN or m.training or m._forward_hooks or m._forward_pre_hooks:
            return False
        if getattr(m, "keep_weights", False) or getattr(m, "max_norm", None) is not None:
            return False
        if (getattr(m, "scaling", None) or {}).get("rope_type") == "dynamic":
            return False
    return True


def _fused_qkv(attn: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """W_Q, W_K, W_V as one (d + 2 d_kv, d) weight (and bias): a view where the three lie side
    by side in one storage, else a copy."""
    ws = [attn.w_q.weight, attn.w_k.weight, attn.w_v.weight]
    bs = [attn.w_q.bias, attn.w_k.bias, attn.w_v.bias]
    return _joined(ws), (None if bs[0] is None else _joined(bs))


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(parts)`` (along dim 0), as a view of their storage when they are its
    consecutive pieces: the same strides, each starting where the one before ends (rows of one
    contiguous matrix, or, as `utils.pretrained` loads GPT-2, the (d, d) transposed thirds of
    one (d, 3d) matrix); else a copy."""
    first = parts[0]
    step = first.stride(0)
    adjacent = all(
        p.stride() == first.stride() and p.shape[1:] == first.shape[1:]
        and p.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
        for p in parts) and all(
        b.storage_offset() == a.storage_offset() + a.shape[0] * step
        for a, b in zip(parts, parts[1:], strict=False))
    if not adjacent:
        return torch.cat([p.detach() for p in parts])
    rows = sum(p.shape[0] for p in parts)
    return first.detach().as_strided((rows, *first.shape[1:]), first.stride())


def _ffn(ff: PositionwiseFeedForward) -> Callable[[torch.Tensor], torch.Tensor]:
    """The feed-forward network's computation (dropout is the identity in evaluation mode)."""
    w1, b1, w2, b2 = ff.linear1.weight, ff.linear1.bias, ff.linear2.weight, ff.linear2.bias
    act = (GATED_ACTIVATIONS if ff.gated else ACTIVATIONS)[ff.activation]
    if type(ff) is GELUFeedForward:  # GELU's chosen form, gated (GeGLU) or not
        act = functools.partial(F.gelu, approximate=ff.approximate)
    if ff.gated:
        wg, bg = ff.gate.weight, ff.gate.bias
        return lambda x: F.linear(act(F.linear(x, wg, bg)) * F.linear(x, w1, b1), w2, b2)
    return lambda x: F.linear(act(F.linear(x, w1, b1)), w2, b2)


class _Layer:
    """One block's step: its norms, its fused projections, its cache room, its feed-forward."""

    def __init__(self, norm1: nn.Module, attn: nn.Module, norm2: nn.Module, ff: nn.Module,
                 pre_norm: bool, room: tuple[torch.Tensor, torch.Tensor]):
        self.norm1, self.norm2, self.ffn = norm1.compute, norm2.compute, _ffn(ff)
        self.pre_norm = pre_norm
        self.w_qkv, self.b_qkv = _fused_qkv(attn)
        self.w_o, self.b_o = attn.w_o.weight, attn.w_o.bias
        self.h, self.d_k = attn.num_heads, attn.d_k
        self.h_kv = getattr(attn, "num_kv_heads", attn.num_heads)
        self.heads = [self.h, self.h_kv, self.h_kv]
        self.rope = None
        if type(attn) in (RotarySelfAttention, FamilyAttention):
            self.rope = (attn.frequencies(), attn.layout)
        # a family's window and q/k norms (`utils.family_parts`); key_pos: the plan's positions
        # of the cache slots, (B, room), given to a layer with a window
        self.window, self.qk_norms, self.key_pos = getattr(attn, "window", None), None, None
        if getattr(attn, "q_norm", None) is not None:
            self.qk_norms = (attn.q_norm.compute, attn.k_norm.compute)
        self.k_room, self.v_room = room

    def attend(self, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None,
               slot: int) -> torch.Tensor:
        """Self-attention of (B, 1, d_model) new vectors over the cache's slots 0 .. slot."""
        b = x.shape[0]
        qkv = F.linear(x, self.w_qkv, self.b_qkv)  # (B, 1, (h + 2 h_kv) d_k)
        # (B, h + 2 h_kv, 1, d_k), cut into q (B, h, 1, d_k), k and v (B, h_kv, 1, d_k)
        q, k, v = qkv.view(b, 1, -1, self.d_k).transpose(1, 2).split_with_sizes(self.heads, dim=1)
        if self.qk_norms is not None:
            q, k = self.qk_norms[0](q), self.qk_norms[1](k)
        if self.window is not None:  # the keys within the window's positions (B, slot + 1)
            band = self.key_pos[:, : slot + 1] > positions - self.window
            mask = band if mask is None else mask & band
        if self.rope is not None:
            freqs, layout = self.rope
            theta = positions.to(torch.float64)[:, None, :, None] * freqs  # (B, 1, 1, d_k/2)
            q, k = rotate_pairs(q, theta, layout), rotate_pairs(k, theta, layout)
        self.k_room[:, :, slot: slot + 1] = k
        self.v_room[:, :, slot: slot + 1] = v
        keys, values = self.k_room[:, :, : slot + 1], self.v_room[:, :, : slot + 1]
        if self.h_kv != self.h:  # as GroupedQueryAttention: each key/value head serves a group
            group = self.h // self.h_kv
            keys = keys.repeat_interleave(group, dim=1)
            values = values.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=None if mask is None else mask[:, None, None, :])
        return F.linear(out.transpose(1, 2).reshape(b, 1, self.h * self.d_k), self.w_o, self.b_o)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None,
                 slot: int) -> torch.Tensor:
        if self.pre_norm:
            x = x + self.attend(self.norm1(x), positions, mask, slot)
            return x + self.ffn(self.norm2(x))
        x = self.norm1(x + self.attend(x, positions, mask, slot))
        return self.norm2(x + self.ffn(x))


class DecodePlan:
    """The step of `utils.decoding.generate` after the first, for a model `plan_for` accepted.

    Made after the first step has filled ``cache`` (from the model's ``new_cache()``, with room
    reserved for the whole decoding): each `step` writes its keys and values into the next slot
    of that room and attends to the slots before it. `close` leaves the cache as the checked
    path would (its keys and values the filled slots).
    """

    def __init__(self, model: nn.Module, cache: DecoderCache):
        self.cache = cache
        self.slot = cache.length
        rooms = [c._buffers for c in cache.self_attn]
        if type(model) is DecoderOnlyLM:
            embed = model.embed
            self.table, self.scale = embed.weight, embed.tokens.scale
            self.pe = (None if embed.positions is None
                       else embed.positions.pe.to(self.table.dtype))  # once, not every step
            self.learned = None
            self.layers = [_Layer(layer.norm1, layer.self_attn, layer.norm2, layer.ff,
                                  layer.norm_first, room)
                           for layer, room in zip(model.blocks.layers, rooms, strict=True)]
            self.norm = None if model.blocks.norm is None else model.blocks.norm.compute
            head = model.head
            self.tied = head.tied  # x E^T + b, as `_OutputHead` computes it (not one addmm)
            self.head_w = head.embedding[0].weight if head.tied else head.proj.weight
            self.head_b = head.bias if head.tied else head.proj.bias
        else:
            embed = model.embed
            self.table, self.scale, self.pe = embed.tokens.weight, None, None
            self.learned = None if embed.positions is None else embed.positions.weight
            self.layers = [_Layer(block.norm1, block.attn, block.norm2, block.ff, True, room)
                           for block, room in zip(model.blocks, rooms, strict=True)]
            self.norm, self.head_w, self.head_b = model.norm.compute, model.head.weight, None
            self.tied = False
            if type(embed) is ScaledTokenEmbedding:  # Gemma: the factor as its forward rounds it
                factor = torch.tensor(embed.scale, dtype=torch.float32, device=self.table.device)
                self.scale = factor.to(self.table.dtype)
        self.key_pos = None  # with a window: the position of every cache slot, (B, room)
        windowed = [c for c, layer in zip(cache.self_attn, self.layers, strict=True)
                    if layer.window is not None]
        if windowed:
            held = windowed[0].positions  # (B or 1, slot), kept by the checked first step
            bk = rooms[0][0]
            self.key_pos = held.new_zeros(bk.shape[0], bk.shape[2])
            self.key_pos[:, : self.slot] = held
            for layer in self.layers:
                layer.key_pos = self.key_pos

    def step(self, tokens: torch.Tensor, positions: torch.Tensor,
             mask: torch.Tensor | None) -> torch.Tensor:
        """(B, 1) new tokens at (B, 1) positions, (B, slot + 1) key mask or None -> (B, V)."""
        x = torch.embedding(self.table, tokens)  # F.embedding without its wrapper
        if self.scale is not None:
            x = x * self.scale
        if self.pe is not None:
            x = x + self.pe[positions]
        if self.learned is not None:
            x = x + self.learned[positions]
        if self.key_pos is not None:
            self.key_pos[:, self.slot] = positions[:, 0]
        for layer in self.layers:
            x = layer(x, positions, mask, self.slot)
        self.slot += 1
        if self.norm is not None:
            x = self.norm(x)
        x = x[:, 0]
        if self.tied:
            return x @ self.head_w.T + self.head_b
        return F.linear(x, self.head_w, self.head_b)

    def close(self) -> None:
        """The cache's keys and values become the slots filled so far, as after the checked
        path's appends."""
        for c, layer in zip(self.cache.self_attn, self.layers, strict=True):
            bk, bv = c._buffers
            c.k, c.v = bk[:, :, : self.slot], bv[:, :, : self.slot]
            if layer.window is not None:
                c.positions = self.key_pos[:, : self.slot]


def plan_for(model: nn.Module, cache: DecoderCache | None) -> DecodePlan | None:
    """A `DecodePlan` when ``model`` is one of the library's decoder-only models, unchanged (see
    the module docstring) and ``cache`` a filled `DecoderCache` with reserved room; else None,
    and the caller goes on through the model's checked ``forward``."""
    if type(model) not in (DecoderOnlyLM, CheckpointLM) or not isinstance(cache, DecoderCache):
        return None
    if not cache.self_attn or not all(_in_room(c) for c in cache.self_attn):
        return None
    if not _plain(model):
        return None
    if type(model) is CheckpointLM and not all(
            c.positions is not None and c.positions.shape[-1] == c.length
            for block, c in zip(model.blocks, cache.self_attn, strict=True)
            if getattr(block.attn, "window", None) is not None):
        return None  # a window needs every cached key's position
    return DecodePlan(model, cache)
