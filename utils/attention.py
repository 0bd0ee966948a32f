"""Scaled dot-product attention and multi-head attention (chapters 1 to 3).

Shapes follow the book's notation: row vectors, batch first. ``q`` is (..., L_q, d_k), ``k`` is
(..., L_k, d_k), ``v`` is (..., L_k, d_v); a mask is a bool tensor where True means "this query may
attend to this key", broadcastable to (..., L_q, L_k). The modules take (B, L, d_model) inputs
and split them into heads, (B, h, L, d_k).

The attention modules run PyTorch's fused kernel by default (`utils.fast_attention`, with the
other fast paths of chapters 11 and 13) and accept a key/value cache (`utils.kv_cache`) for
generating one token at a time; their ``from_torch`` checks and copies through `utils.convert`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ._validation import (
    InputTypeError,
    require_bool,
    require_int,
    require_like_module,
    require_probability,
    require_qkv,
    require_rank,
    require_real,
    require_same_device,
    require_tensor,
    shape_str,
)
from .convert import copy_multihead_attention, match_bias
from .fast_attention import causal_attention_mask, fused_attention
from .kv_cache import KVCache
from .masks import expand_mask

__all__ = ["scaled_dot_product_attention", "MultiHeadAttention", "GroupedQueryAttention",
           "keep_attention_weights"]


def scaled_dot_product_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T / sqrt(d_k)) v, with an optional bool mask.

    Args:
        q: queries, shape (..., L_q, d_k), floating point.
        k: keys, shape (..., L_k, d_k), the dtype and device of ``q``.
        v: values, shape (..., L_k, d_v), the dtype and device of ``q``.
        mask: optional bool tensor broadcastable to (..., L_q, L_k); True = may attend.
        dropout_p: probability of dropping an attention weight (applied after the softmax, with
            the survivors scaled by 1 / (1 - p)); a number in [0, 1), 0 disables it.
        is_causal: causal attention: query i attends to keys up to its own position, the
            queries being the last L_q of the L_k positions (the mask of
            `utils.fast_attention.causal_attention_mask`, ANDed with ``mask`` if given).

    Returns:
        ``(output, weights)``: output of shape (..., L_q, d_v) and weights of shape
        (..., L_q, L_k), each weight row summing to 1.

    Degenerate inputs:
        A query row with no allowed key (every key masked, or L_k = 0) gets all-zero weights and
        a zero output, never NaN, and its gradients are zero too. An empty batch or L_q = 0 gives
        empty outputs. NaN or infinite values in q, k or v are not checked and propagate.

    Raises:
        InputTypeError: (a TypeError and a ValueError) when an argument is not a tensor, q, k
            and v are not floating point or differ in dtype or device, the mask is not bool or
            not on their device, or ``dropout_p`` is not a number.
        ValueError: when the ranks, d_k (which must be at least 1), L_k, the batch dims or the
            mask's shape do not fit together, ``dropout_p`` is outside [0, 1), or
            ``is_causal`` comes with L_q > L_k.
    """
    _, mask = require_qkv(q, k, v, mask)
    dropout_p = require_probability("dropout_p", dropout_p)
    if require_bool("is_causal", is_causal):
        mask = causal_attention_mask(q, k, mask)

    d_k = q.shape[-1]
    scores = q @ k.transpose(-2, -1) / math.sqrt(d_k)  # (..., L_q, L_k)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
        # A row with no allowed key would be softmax of all -inf = NaN; give it zeros instead.
        has_key = mask.any(dim=-1, keepdim=True)
        scores = scores.masked_fill(~has_key, 0.0)
        weights = torch.softmax(scores, dim=-1) * mask
    else:
        weights = torch.softmax(scores, dim=-1)
    if dropout_p > 0.0:
        weights = F.dropout(weights, p=dropout_p, training=True)
    return weights @ v, weights


def keep_attention_weights(module: nn.Module, keep: bool = True) -> nn.Module:
    """Set ``keep_weights`` on every attention module inside ``module`` (itself included).

    With ``keep=True`` each `MultiHeadAttention` runs the from-scratch path and stores its
    weights in ``attn_weights`` at the next forward pass, for a plot; ``keep=False`` returns them
    to the fused kernel. Returns ``module``, so that ``keep_attention_weights(model)(x)`` works.

    Raises:
        InputTypeError: when ``module`` is not an ``nn.Module`` or ``keep`` is not a bool.
    """
    if not isinstance(module, nn.Module):
        raise InputTypeError(f"module must be an nn.Module, got {type(module).__name__}")
    require_bool("keep", keep)
    for sub in module.modules():
        if isinstance(sub, _Attention):
            sub.keep_weights = keep
    return module


def _check_qkv(module: nn.Module, query: object, key: object, value: object,
               is_causal: object = False) -> None:
    """Validate the (B, L_q, d_model) query and (B, L_k, d_model) key and value of a module,
    and its ``is_causal`` flag (a bool)."""
    require_bool("is_causal", is_causal)
    d_model = module.d_model
    for name, t in (("query", query), ("key", key), ("value", value)):
        require_tensor(name, t)
        require_rank(name, t, f"(B, L, d_model={d_model})", rank=3)
        if t.shape[-1] != d_model:
            raise ValueError(
                f"{name} must have shape (B, L, d_model={d_model}), got {shape_str(t)}"
            )
    if key.shape[:2] != value.shape[:2]:
        raise ValueError(
            f"key and value must have the same (B, L_k): key {shape_str(key)}, "
            f"value {shape_str(value)}"
        )
    if query.shape[0] != key.shape[0]:
        raise ValueError(
            f"query and key must have the same batch size B: query {shape_str(query)}, "
            f"key {shape_str(key)}"
        )
    checked: list[torch.Tensor] = []
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not any(t is seen for seen in checked):  # self-attention passes one tensor thrice
            require_like_module(name, t, module)
            checked.append(t)


def _read_mask(mask: object, query: torch.Tensor, l_k: int, num_heads: int,
               cached: bool = False) -> torch.Tensor | None:
    """A multi-head mask read by `utils.masks.expand_mask`, checked, as (B, 1 or h, L_q, L_k);
    ``l_k`` counts the cached keys too when ``cached``."""
    b, l_q = query.shape[0], query.shape[1]
    full = expand_mask(mask, b, l_q, l_k)
    if full is None:
        return None
    if full.shape[1] not in (1, num_heads):
        message = (f"mask of shape {shape_str(mask)} has {full.shape[1]} heads but the "
                   f"attention has h={num_heads}")
        if not cached:
            message += (": a 4-dim mask must broadcast to (B, h, L_q, L_k) = "
                        f"{shape_str((b, num_heads, l_q, l_k))}")
        raise ValueError(message)
    require_same_device(query=query, mask=full)
    return full


def _require_divisible(name: str, value: int, by_name: str, by: int) -> None:
    """Raise a ValueError unless ``by`` divides ``value``: heads split a width evenly."""
    if value % by != 0:
        raise ValueError(f"{name} must be divisible by {by_name}: {name}={value}, "
                         f"{by_name}={by} leaves a remainder of {value % by}")


def _check_heads(d_model: object, num_heads: object, dropout: object, bias: object) -> None:
    """Raise unless d_model and num_heads are positive ints, num_heads divides d_model,
    0 <= dropout < 1 and bias is a bool."""
    require_int("d_model", d_model)
    require_int("num_heads", num_heads)
    _require_divisible("d_model", d_model, "num_heads", num_heads)
    dropout = require_real("dropout", dropout)
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {dropout}")
    require_bool("bias", bias)


class _Attention(nn.Module):
    """What `MultiHeadAttention` and `GroupedQueryAttention` share: the four projections (made
    in the order W_Q, W_K, W_V, W_O, which fixes the initial weights a seed gives), splitting
    into heads, the key/value cache, the mask rule and the two attention paths.

    ``kv_heads`` key/value heads of width d_k = d_model / num_heads: ``w_k`` and ``w_v`` map
    d_model -> kv_heads * d_k. The arguments are checked by the subclasses.
    """

    def __init__(self, d_model: int, num_heads: int, kv_heads: int, bias: bool, dropout: float,
                 keep_weights: bool):
        super().__init__()
        self.d_model = int(d_model)
        self.num_heads = int(num_heads)
        self._kv_heads = int(kv_heads)
        self.d_k = self.d_model // self.num_heads
        self.dropout = float(dropout)
        self.keep_weights = keep_weights
        kv_width = self._kv_heads * self.d_k
        self.w_q = nn.Linear(self.d_model, self.d_model, bias=bias)
        self.w_k = nn.Linear(self.d_model, kv_width, bias=bias)
        self.w_v = nn.Linear(self.d_model, kv_width, bias=bias)
        self.w_o = nn.Linear(self.d_model, self.d_model, bias=bias)
        self.attn_weights: torch.Tensor | None = None

    def _split(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        """(B, L, heads * d_k) -> (B, heads, L, d_k)."""
        b, length, _ = x.shape
        return x.view(b, length, heads, self.d_k).transpose(1, 2)

    def _merge(self, x: torch.Tensor) -> torch.Tensor:
        """(B, h, L, d_k) -> (B, L, d_model)."""
        b, _, length, _ = x.shape
        return x.transpose(1, 2).reshape(b, length, self.d_model)

    def _project_kv(self, key: torch.Tensor, value: torch.Tensor,
                    cache: KVCache | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Project ``key``/``value`` into (B, kv_heads, L, d_k), through ``cache`` when there is
        one: a filled static cache is read without projecting anything; any other is appended
        to."""
        if cache is not None and not isinstance(cache, KVCache):
            raise InputTypeError(f"cache must be a KVCache or None, got {type(cache).__name__}")
        if cache is not None and cache.static and cache.k is not None:
            if cache.k.shape[0] != key.shape[0] or cache.k.shape[2] != key.shape[1]:
                raise ValueError(f"the static cache holds keys {shape_str(cache.k)} for a memory "
                                 f"of (B={cache.k.shape[0]}, L_s={cache.k.shape[2]}), got key "
                                 f"{shape_str(key)}")
            return cache.k, cache.v
        k = self._split(self.w_k(key), self._kv_heads)
        v = self._split(self.w_v(value), self._kv_heads)
        return (k, v) if cache is None else cache.append(k, v)

    def _expand_kv(self, k: torch.Tensor,
                   v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values of every query head, (B, h, L_k, d_k)."""
        return k, v

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
        is_causal: bool = False,
    ) -> torch.Tensor:
        """Attend from ``query`` to ``key``/``value``.

        Args:
            query: (B, L_q, d_model), with the dtype and device of the module's parameters.
            key: (B, L_k, d_model), likewise.
            value: (B, L_k, d_model), likewise.
            mask: optional bool mask, True = may attend, read by the library's one rule
                (`utils.masks.expand_mask`):

                * 2 dims (B, L_k): a key padding mask, the same for every query and head;
                * 2 dims (L_q, L_k): one mask shared by the whole batch (a causal mask);
                * a 2-dim mask that fits both (B == L_q > 1) is ambiguous and raises: write
                  ``pad[:, None, :]`` for padding or ``mask[None]`` for a shared mask;
                * 3 dims: broadcastable to (B, L_q, L_k), the same for every head;
                * 4 dims: broadcastable to (B, h, L_q, L_k).

                With a cache, L_k counts the cached positions too (L_past + L_k).
            cache: optional `KVCache` for incremental decoding. The keys and values of ``key`` and
                ``value`` (the new positions only) are appended to it and the queries attend to
                all the stored ones; a filled ``static`` cache is used as it is (``key`` and
                ``value`` are then only checked). A `GroupedQueryAttention`'s cache stores only
                its ``num_kv_heads`` key/value heads, before they are repeated: a smaller cache.
            is_causal: causal attention, exactly (not a hint as in nn.MultiheadAttention): query
                i sees the keys up to its own position, the queries being the last L_q of the
                L_k positions (after the cached ones); with ``mask`` too, both apply. Without
                mask and cache it runs PyTorch's causal kernel, as `utils.masks.causal_mask` does.

        Returns:
            (B, L_q, d_model). A query with no allowed key (every key masked, or L_k = 0) gets
            zero attention weights, so its output is W_O's bias (zero without biases), never NaN.
            An empty batch or L_q = 0 gives an empty output.

        Raises:
            InputTypeError: for a non-tensor, a dtype or device other than the parameters', or a
                mask that is not bool or not on the inputs' device.
            ValueError: for shapes, masks (ambiguous too) or an ``is_causal`` that do not fit.
        """
        _check_qkv(self, query, key, value, is_causal)
        if cache is None:
            mask = _read_mask(mask, query, key.shape[1], self.num_heads)
            k, v = self._project_kv(key, value, None)
        else:
            k, v = self._project_kv(key, value, cache)
            mask = _read_mask(mask, query, k.shape[2], self.num_heads, cached=True)
        q = self._split(self.w_q(query), self.num_heads)  # (B, h, L_q, d_k)
        k, v = self._expand_kv(k, v)
        p = self.dropout if self.training else 0.0
        if self.keep_weights:
            out, weights = scaled_dot_product_attention(q, k, v, mask, p, is_causal)
            self.attn_weights = weights.detach()
        else:
            out = fused_attention(q, k, v, mask, dropout_p=p, is_causal=is_causal)
            self.attn_weights = None
        return self.w_o(self._merge(out))


class MultiHeadAttention(_Attention):
    """Multi-head attention, batch first, as in "Attention Is All You Need".

    ``h`` heads of width ``d_k = d_model / h`` attend in parallel; their outputs are concatenated
    and mixed by the output projection W_O.

    Args:
        d_model: width of the input and output vectors, a positive int.
        num_heads: number of heads h, a positive int that divides ``d_model``.
        bias: whether the four projections have biases.
        dropout: dropout on the attention weights during training, in [0, 1).
        keep_weights: whether to keep the attention weights of each forward pass (for plots).
            False (the default): the attention itself runs in PyTorch's fused kernel
            (``F.scaled_dot_product_attention``), which never returns the weights, and
            ``attn_weights`` is None. True: it runs in this book's `scaled_dot_product_attention`
            (the from-scratch path of chapter 3) and ``attn_weights`` holds the weights. Both give
            the same output and gradients to float rounding; dropout draws different random
            numbers in each. The attribute can be switched at any time (see
            `keep_attention_weights`).

    Shapes:
        query (B, L_q, d_model), key and value (B, L_k, d_model) -> output (B, L_q, d_model).
        After a forward pass with ``keep_weights``, ``attn_weights`` holds the weights
        (B, h, L_q, L_k); without, it is None.

    Raises:
        InputTypeError: for a count that is not an int (``2.5``, ``True``), a dropout that is not
            a number or a bias that is not a bool.
        ValueError: for a count below 1, ``num_heads`` not dividing ``d_model``, or a dropout
            outside [0, 1).
    """

    def __init__(self, d_model: int, num_heads: int, bias: bool = True, dropout: float = 0.0,
                 keep_weights: bool = False):
        _check_heads(d_model, num_heads, dropout, bias)
        require_bool("keep_weights", keep_weights)
        super().__init__(d_model, num_heads, num_heads, bias, dropout, keep_weights)

    def split_heads(self, x: torch.Tensor) -> torch.Tensor:
        """(B, L, d_model) -> (B, h, L, d_k)."""
        require_tensor("x", x)
        require_rank("x", x, f"(B, L, d_model={self.d_model})", rank=3)
        if x.shape[-1] != self.d_model:
            raise ValueError(
                f"x must have shape (B, L, d_model={self.d_model}), got {shape_str(x)}"
            )
        return self._split(x, self.num_heads)

    def merge_heads(self, x: torch.Tensor) -> torch.Tensor:
        """(B, h, L, d_k) -> (B, L, d_model)."""
        require_tensor("x", x)
        expected = f"(B, h={self.num_heads}, L, d_k={self.d_k})"
        require_rank("x", x, expected, rank=4)
        if x.shape[1] != self.num_heads or x.shape[3] != self.d_k:
            raise ValueError(f"x must have shape {expected}, got {shape_str(x)}")
        return self._merge(x)

    @classmethod
    def from_torch(cls, module: nn.MultiheadAttention) -> MultiHeadAttention:
        """A `MultiHeadAttention` holding an exact copy of ``module``'s parameters.

        The result gives the same output as ``module`` to about 1e-6 in float32, on the same
        inputs batch first: with ``batch_first=False`` only the parameters are copied, and the
        copy still expects (B, L, d_model). It has the module's dtype, device, dropout and
        train/eval mode. A module whose input projections have biases and whose output
        projection has none, or the reverse (possible by editing ``out_proj.bias``), is copied
        as it is: ``w_o`` then has a bias exactly when ``out_proj`` has one.

        Raises:
            InputTypeError: when ``module`` is not an ``nn.MultiheadAttention``.
            ValueError: for what this class cannot compute: key and value widths (``kdim``,
                ``vdim``) other than ``embed_dim``, ``add_bias_kv`` and ``add_zero_attn``.
        """
        return copy_multihead_attention(cls, module)


class GroupedQueryAttention(_Attention):
    """Grouped-query attention: groups of query heads share one key/value head.

    ``num_heads`` query heads of width ``d_k = d_model / num_heads`` attend with only
    ``num_kv_heads`` key/value heads: query head i reads key/value head ``i // (num_heads /
    num_kv_heads)``. ``num_kv_heads == num_heads`` is ordinary multi-head attention,
    ``num_kv_heads == 1`` is multi-query attention. Fewer key/value heads mean smaller key and value
    projections and, above all, a smaller key/value cache when generating text.

    Args:
        d_model: width of the input and output vectors, a positive int.
        num_heads: number of query heads h, a positive int that divides ``d_model``.
        num_kv_heads: number of key/value heads, a positive int that divides ``num_heads``.
        bias: whether the four projections have biases.
        dropout: dropout on the attention weights during training, in [0, 1).
        keep_weights: as in `MultiHeadAttention`: False runs PyTorch's fused kernel and keeps no
            weights, True runs the from-scratch path and keeps them in ``attn_weights``.

    Shapes:
        query (B, L_q, d_model), key and value (B, L_k, d_model) -> output (B, L_q, d_model).
        ``w_k`` and ``w_v`` map d_model -> num_kv_heads * d_k. After a forward pass with
        ``keep_weights``, ``attn_weights`` holds the weights (B, h, L_q, L_k); without, None.

    Raises:
        InputTypeError, ValueError: as `MultiHeadAttention`, and when ``num_kv_heads`` is not a
            positive int dividing ``num_heads``.
    """

    def __init__(self, d_model: int, num_heads: int, num_kv_heads: int, bias: bool = True,
                 dropout: float = 0.0, keep_weights: bool = False):
        _check_heads(d_model, num_heads, dropout, bias)
        require_bool("keep_weights", keep_weights)
        require_int("num_kv_heads", num_kv_heads)
        _require_divisible("num_heads", num_heads, "num_kv_heads", num_kv_heads)
        super().__init__(d_model, num_heads, num_kv_heads, bias, dropout, keep_weights)
        self.num_kv_heads = int(num_kv_heads)
        self.group_size = self.num_heads // self.num_kv_heads

    def kv_cache_per_token(self) -> int:
        """How many numbers one token adds to the key/value cache of this layer: 2 * h_kv * d_k."""
        return 2 * self.num_kv_heads * self.d_k

    def _expand_kv(self, k: torch.Tensor,
                   v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Each key/value head serves group_size consecutive query heads: (B, h, L_k, d_k).
        return (k.repeat_interleave(self.group_size, dim=1),
                v.repeat_interleave(self.group_size, dim=1))

    @classmethod
    def from_multi_head(
        cls, mha: MultiHeadAttention, num_kv_heads: int | None = None
    ) -> GroupedQueryAttention:
        """A `GroupedQueryAttention` made from a `MultiHeadAttention`'s parameters.

        The query and output projections are copied; the key and value projections of the heads in
        each group are averaged into one head. With ``num_kv_heads`` equal to the number of heads
        (the default) nothing is averaged and the result computes exactly what ``mha`` does. Each
        projection has a bias exactly when ``mha``'s has; dtype, device, dropout and train/eval
        mode are ``mha``'s.

        Raises:
            InputTypeError: when ``mha`` is not a `MultiHeadAttention` or ``num_kv_heads`` is
                not an int.
            ValueError: when ``num_kv_heads`` is below 1 or does not divide the number of heads.
        """
        if not isinstance(mha, MultiHeadAttention):
            raise InputTypeError(f"mha must be a MultiHeadAttention, got {type(mha).__name__}")
        h = mha.num_heads
        num_kv_heads = h if num_kv_heads is None else num_kv_heads
        bias = mha.w_q.bias is not None
        new = cls(mha.d_model, h, num_kv_heads, bias=bias, dropout=mha.dropout)
        match_bias(new, mha.w_o)
        new = new.to(dtype=mha.w_q.weight.dtype, device=mha.w_q.weight.device)
        g, d_k = new.group_size, mha.d_k

        def pool(t: torch.Tensor) -> torch.Tensor:
            # rows of a projection are (head, d_k) pairs; average the heads of each group
            return t.reshape(new.num_kv_heads, g, d_k, *t.shape[1:]).mean(dim=1).reshape(
                new.num_kv_heads * d_k, *t.shape[1:]
            )

        with torch.no_grad():
            new.w_q.load_state_dict(mha.w_q.state_dict())
            new.w_o.load_state_dict(mha.w_o.state_dict())
            new.w_k.weight.copy_(pool(mha.w_k.weight))
            new.w_v.weight.copy_(pool(mha.w_v.weight))
            if bias:
                new.w_k.bias.copy_(pool(mha.w_k.bias))
                new.w_v.bias.copy_(pool(mha.w_v.bias))
        new.train(mha.training)
        return new
