"""Making attention fast (chapters 11 and 13): the same function, computed without the weights.

Every function here computes ``softmax(q k^T / sqrt(d_k)) v``, the output of
`utils.attention.scaled_dot_product_attention`, with the same checks, the same mask convention
(a bool mask, True = "this query may attend to this key", broadcastable to (..., L_q, L_k)) and
the same degenerate cases (a query row with no allowed key gets a zero output, never NaN), but
returns the output only: the L_q x L_k weights are never kept, and most of these never form them.

* `fused_attention`: PyTorch's fused kernel (``F.scaled_dot_product_attention``), the default
  path of `utils.attention.MultiHeadAttention` (chapter 13), with its causal kernel
  (``is_causal=True``) for causal attention, declared by ``is_causal`` or recognized by the
  mark of the library's causal masks (`utils.masks.is_marked_causal`).
* `memory_efficient_attention`: blocks of queries and keys and the online softmax, the idea of
  FlashAttention, in O(block_q * block_k + L_q * d_v) extra memory (chapter 13).
* `local_attention`: banded attention in O(L * window) time and memory (chapter 11).
* `split_k_attention`: the keys cut into chunks combined by their log-sum-exp, the idea of
  Flash-Decoding (chapter 13).

Shapes: q (..., L_q, d_k), k (..., L_k, d_k), v (..., L_k, d_v) -> (..., L_q, d_v), with any
leading batch dims that broadcast together.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ._validation import (
    require_bool,
    require_int,
    require_probability,
    require_qkv,
    shape_str,
)
from .masks import is_marked_causal

__all__ = ["fused_attention", "causal_attention_mask", "memory_efficient_attention",
           "local_attention", "split_k_attention", "online_softmax_step",
           "online_softmax_finish"]


def causal_attention_mask(q: torch.Tensor, k: torch.Tensor,
                          mask: torch.Tensor | None = None) -> torch.Tensor:
    """The explicit mask that ``is_causal=True`` stands for, combined with ``mask`` if given.

    The L_q queries are the last L_q of the L_k positions (bottom-right alignment): query i sits
    at position L_k - L_q + i and may attend to keys 0 .. L_k - L_q + i. With L_q == L_k this is
    the usual causal mask; with L_q < L_k the queries follow L_k - L_q earlier positions, as
    new tokens follow a key/value cache. (PyTorch's own ``is_causal`` aligns top-left, so
    `fused_attention` hands it only the square case.) A ``mask`` narrows it further: the result
    is ``causal & mask``, e.g. causal attention that also skips padding.

    Args:
        q: (..., L_q, d_k); k: (..., L_k, d_k); only their lengths and device are read.
        mask: optional bool mask broadcastable to (..., L_q, L_k), True = may attend.

    Returns:
        Bool (L_q, L_k), or the broadcast shape of (L_q, L_k) and ``mask``.

    Raises:
        ValueError: when L_q > L_k: the queries cannot be the last L_q of L_k positions.
    """
    l_q, l_k = q.shape[-2], k.shape[-2]
    if l_q > l_k:
        raise ValueError(
            f"is_causal=True needs L_q <= L_k (the queries are the last L_q of the L_k "
            f"positions): q is {shape_str(q)} (L_q={l_q}), k is {shape_str(k)} (L_k={l_k})"
        )
    causal = torch.ones(l_q, l_k, dtype=torch.bool, device=q.device).tril(l_k - l_q)
    return causal if mask is None else causal & mask


def _read_causal(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None,
                 is_causal: object) -> tuple[torch.Tensor | None, bool]:
    """What the kernel is given for a ``mask`` and an ``is_causal`` flag: ``(None, True)`` for
    plain causal attention with L_q == L_k, declared or a mask of `utils.masks.mark_causal`;
    otherwise ``(mask, False)`` with causality, if declared, written into the mask."""
    require_bool("is_causal", is_causal)
    l_q, l_k = q.shape[-2], k.shape[-2]
    if is_causal:
        if mask is None and l_q == l_k:
            return None, True
        return causal_attention_mask(q, k, mask), False
    if (mask is not None and l_q == l_k and mask.shape[-2:] == (l_q, l_k)
            and all(n == 1 for n in mask.shape[:-2]) and is_marked_causal(mask)):
        return None, True  # the library's own causal mask, unedited: O(1) to recognize
    return mask, False


def fused_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
) -> torch.Tensor:
    """`scaled_dot_product_attention`'s output, computed by PyTorch's fused kernel.

    The same function as `scaled_dot_product_attention` (same shapes, checks, mask convention
    and degenerate cases), but it returns the output only: ``F.scaled_dot_product_attention``
    picks the fastest kernel for the device and never builds the weights as a tensor of their
    own. A query row with no allowed key gets a zero output and zero gradients, whatever the
    kernel does with such a row: its mask row is opened before the call and its output
    multiplied by zero after.

    Args:
        q: (..., L_q, d_k); k: (..., L_k, d_k); v: (..., L_k, d_v), one dtype and device.
        mask: optional bool mask broadcastable to (..., L_q, L_k), True = may attend.
        dropout_p: dropout on the weights, in [0, 1) (the kernel's own random numbers).
        is_causal: causal attention, exactly (not a hint): query i may attend to keys up to
            its own position, the queries being the last L_q of the L_k positions (see
            `causal_attention_mask`); with a ``mask`` too, both apply. With L_q == L_k and no
            mask the kernel runs with ``is_causal=True`` and never reads an L x L mask.

    The causal kernel also runs when ``mask`` is the library's own causal mask
    (`utils.masks.causal_mask`, or a model's), recognized in O(1) by its mark
    (`utils.masks.is_marked_causal`) while it is unedited and square with only size-1 leading
    dims; any other mask, or one written into since it was made, is read as it is.

    Returns:
        (..., L_q, d_v). On a CPU the causal kernel gives the same output and gradients as the
        explicit mask to the bit; elsewhere to float rounding.

    Raises:
        InputTypeError, ValueError: as `scaled_dot_product_attention`; also for an
            ``is_causal`` that is not a bool, and a ValueError for ``is_causal`` with
            L_q > L_k.
    """
    batch, mask = require_qkv(q, k, v, mask)
    dropout_p = require_probability("dropout_p", dropout_p)
    mask, is_causal = _read_causal(q, k, mask, is_causal)
    q, k, v = (t.expand(*batch, *t.shape[-2:]) for t in (q, k, v))
    if q.numel() == 0 or k.shape[-2] == 0:
        # Chapter 1's function defines these degenerate cases (zeros, and zero gradients); it
        # imports this module for its modules' fast path, hence the import here.
        from .attention import scaled_dot_product_attention

        return scaled_dot_product_attention(q, k, v, mask, dropout_p, is_causal=is_causal)[0]
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=is_causal)
    has_key = mask.any(dim=-1, keepdim=True)  # (..., L_q, 1)
    if mask.device.type == "cpu" and has_key.all():
        # Every query sees a key (a causal mask always does): nothing to open or zero, and three
        # operations fewer, forward and backward (about 7% of a training step of chapter 9's
        # model). The mask goes in contiguous, as the line below gives it; the output and every
        # gradient are the same to the bit (tests/test_fused_attention.py). Not on a GPU, where
        # reading has_key.all() would wait for the GPU.
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.contiguous(),
                                              dropout_p=dropout_p)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask | ~has_key, dropout_p=dropout_p)
    return out * has_key


def _block_sizes(block_size: object) -> tuple[int, int]:
    """Read ``block_size``: one positive int for both, or a pair (block_q, block_k)."""
    if isinstance(block_size, tuple | list):
        if len(block_size) != 2:
            raise ValueError(
                f"block_size must be an int or a pair (block_q, block_k), got {block_size!r}"
            )
        return (require_int("block_size[0]", block_size[0]),
                require_int("block_size[1]", block_size[1]))
    size = require_int("block_size", block_size)
    return size, size


def _tile(mask: torch.Tensor, rows: slice, cols: slice) -> torch.Tensor:
    """The (rows, cols) tile of a mask broadcastable to (..., L_q, L_k), a view.

    An axis of size 1 (broadcast over the queries or the keys) is kept whole.
    """
    r = rows if mask.shape[-2] != 1 else slice(None)
    c = cols if mask.shape[-1] != 1 else slice(None)
    return mask[..., r, c]


def online_softmax_step(
    m: torch.Tensor,
    l_sum: torch.Tensor,
    acc: torch.Tensor,
    scores: torch.Tensor,
    v_blk: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fold one tile of scores and its block of values into the online softmax's running state.

    For each query row the state holds the largest score seen so far ``m``, the sum ``l_sum``
    of exp(score - m) over the keys seen so far and ``acc``, the sum of exp(score - m) v. When
    the new tile raises the maximum, the old sums are rescaled by exp(m_old - m_new) so that
    every term is again relative to one maximum. Start from ``m = -inf``, ``l_sum = 0``,
    ``acc = 0``; `online_softmax_finish` turns the final state into the attention output.

    Args:
        m: running maximum, (..., n, 1); -inf for a row that has seen no allowed key yet.
        l_sum: running sum of the exponentials, (..., n, 1).
        acc: running weighted sum of values, (..., n, d_v).
        scores: the scaled scores of this tile, (..., n, b), -inf where masked.
        v_blk: the values of this tile's keys, (..., b, d_v).

    Returns:
        The new ``(m, l_sum, acc)``, of the same shapes. The maximum is detached: the result
        does not depend on it, it only keeps exp from overflowing.
    """
    m_new = torch.maximum(m, scores.amax(dim=-1, keepdim=True).detach())
    # A row with no allowed key so far has m_new = -inf; subtract 0 instead, so that its
    # exp(-inf) terms are 0 rather than exp(-inf - (-inf)) = NaN.
    m_safe = torch.where(torch.isinf(m_new), 0.0, m_new)
    p = torch.exp(scores - m_safe)  # (..., n, b), masked entries exactly 0
    alpha = torch.exp(m - m_safe)  # rescales what was summed against the old maximum
    l_sum = alpha * l_sum + p.sum(dim=-1, keepdim=True)
    acc = alpha * acc + p @ v_blk
    return m_new, l_sum, acc


def _online_softmax_step_(
    m: torch.Tensor,
    l_sum: torch.Tensor,
    acc: torch.Tensor,
    scores: torch.Tensor,
    v_blk: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`online_softmax_step` line for line, in place, for use without autograd.

    ``scores`` is overwritten by its exponentials ``p``, ``l_sum`` and ``acc`` are updated where
    they are: the tile is the only tile-sized tensor alive, and no pass over it allocates
    memory. Under autograd every tile is kept for the backward pass whatever is done in place,
    so `online_softmax_step` is the version autograd differentiates.
    """
    m_new = torch.maximum(m, scores.amax(dim=-1, keepdim=True))
    m_safe = torch.where(torch.isinf(m_new), 0.0, m_new)
    p = scores.sub_(m_safe).exp_()  # the tile, now exp(scores - m_safe)
    alpha = (m - m_safe).exp_()
    l_sum.mul_(alpha).add_(p.sum(dim=-1, keepdim=True))
    acc.mul_(alpha).add_(p @ v_blk)
    return m_new, l_sum, acc


def online_softmax_finish(acc: torch.Tensor, l_sum: torch.Tensor) -> torch.Tensor:
    """The attention output ``acc / l_sum``, (..., n, d_v), from the online softmax's state.

    ``l_sum`` is 0 only for a row without any allowed key; its ``acc`` is 0 too, so its output
    is 0, never NaN.
    """
    return acc / torch.where(l_sum > 0, l_sum, 1.0)


def memory_efficient_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    block_size: int | tuple[int, int] = 256,
) -> torch.Tensor:
    """softmax(q k^T / sqrt(d_k)) v computed block by block, never holding an L_q x L_k matrix.

    The queries are cut into blocks of ``block_q`` rows and the keys into blocks of ``block_k``
    rows. For each query block, the key blocks arrive one at a time and an *online softmax*
    keeps, for each query row, three running quantities: the largest score seen so far ``m``,
    the sum ``l`` of exp(score - m) over the keys seen so far, and the output accumulator
    ``acc`` = sum of exp(score - m) v. When a key block raises the maximum from ``m_old`` to
    ``m_new``, the old ``l`` and ``acc`` are rescaled by exp(m_old - m_new) so that every term is
    again relative to the same maximum. After the last block, ``acc / l`` is exactly the softmax
    average. Only ``block_q x block_k`` score tiles and (..., block_q, d_v) accumulators exist
    at any time, so the extra memory is O(block_q * block_k + L_q * d_v) instead of O(L_q L_k).

    Args:
        q: queries, shape (..., L_q, d_k), floating point.
        k: keys, shape (..., L_k, d_k), the dtype and device of ``q``.
        v: values, shape (..., L_k, d_v), the dtype and device of ``q``.
        mask: optional bool tensor broadcastable to (..., L_q, L_k), True = may attend. It is
            sliced tile by tile, never expanded to its full size.
        block_size: the tile size, one positive int for queries and keys, or a pair
            ``(block_q, block_k)``. It need not divide L_q or L_k (the last block is shorter).
            Larger tiles mean fewer Python steps and larger matrix products, smaller ones less
            memory. On one CPU thread at L = 4096 and 8192 (4 heads, d_k = 64), 256 and 512
            were about equally fast and 128 about 1.4 times slower; 256 holds a quarter of
            512's tile.

    Returns:
        The output (..., L_q, d_v), equal to ``scaled_dot_product_attention(q, k, v, mask)[0]``
        up to rounding (about 1e-6 in float32). The weights are never formed, so none are
        returned.

    Degenerate inputs:
        A query row with no allowed key gets a zero output, never NaN, also when its first key
        blocks are all masked and an allowed key only comes later. L_k = 0 gives zeros; an empty
        batch or L_q = 0 gives an empty output.

    Gradients:
        Autograd differentiates through the loop; the running maximum is detached (the result
        does not depend on it, it only keeps exp from overflowing). Autograd keeps each tile for
        the backward pass, so training through this function stores O(L_q L_k) numbers in
        total; the memory saving is for inference (``torch.no_grad()``). FlashAttention saves
        the memory in training too by recomputing the tiles in a hand-written backward pass.
        Without autograd (``torch.no_grad()``, or no input that requires grad) each tile is
        worked on in place (`_online_softmax_step_`), so one tile-sized tensor is alive at a
        time; the inputs are never written to.

    Raises:
        InputTypeError, ValueError: as `scaled_dot_product_attention`, and for a ``block_size``
            that is not a positive int or a pair of them.
    """
    batch, mask = require_qkv(q, k, v, mask)
    block_q, block_k = _block_sizes(block_size)
    l_q, l_k, d_v = q.shape[-2], k.shape[-2], v.shape[-1]
    scale = 1.0 / math.sqrt(q.shape[-1])
    q = q.expand(*batch, *q.shape[-2:])
    k = k.expand(*batch, *k.shape[-2:])
    v = v.expand(*batch, *v.shape[-2:])
    # Without autograd, each tile is worked on in place (the inputs never are).
    in_place = not (torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)))
    step = _online_softmax_step_ if in_place else online_softmax_step
    out = torch.empty((*batch, l_q, d_v), dtype=q.dtype, device=q.device)
    for qs in range(0, l_q, block_q):
        rows = slice(qs, min(qs + block_q, l_q))
        q_blk = q[..., rows, :] * scale  # (..., bq, d_k)
        n = q_blk.shape[-2]
        m = torch.full((*batch, n, 1), float("-inf"), dtype=q.dtype, device=q.device)
        l_sum = torch.zeros((*batch, n, 1), dtype=q.dtype, device=q.device)
        acc = torch.zeros((*batch, n, d_v), dtype=q.dtype, device=q.device)
        for ks in range(0, l_k, block_k):
            cols = slice(ks, min(ks + block_k, l_k))
            s = q_blk @ k[..., cols, :].transpose(-2, -1)  # (..., bq, bk): one tile
            if mask is not None:  # in place: the product's backward needs its inputs only
                s.masked_fill_(~_tile(mask, rows, cols), float("-inf"))
            m, l_sum, acc = step(m, l_sum, acc, s, v[..., cols, :])
            del s  # freed before the next tile is made: one tile alive, not two
        out[..., rows, :] = online_softmax_finish(acc, l_sum)
    return out


def local_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: int,
    causal: bool = False,
) -> torch.Tensor:
    """Banded (local) self-attention in O(L * window) time and memory.

    Computes the same as ``scaled_dot_product_attention(q, k, v, local_mask(L, window,
    causal))[0]``: query i attends to key j when ``|i - j| <= window`` (``0 <= i - j <= window``
    with ``causal=True``), without forming the L x L scores.

    How: the queries are cut into blocks of ``b = max(window, 16)`` positions (fewer when L is
    smaller). Every query of a block needs keys only from ``window`` positions before the block
    to ``window`` positions after it (to the block's end when causal), so K and V are padded by
    ``window`` at the start (and the end) and `torch.Tensor.unfold` cuts them into overlapping
    slabs of ``b + 2 * window`` (causal: ``b + window``) keys, one slab per block, without
    copying. The scores are then (..., L / b, b, b + 2 * window): O(L * window) numbers, with
    no factor d_k (a slab of keys per *query*, (..., L, 2 * window + 1, d_k), would cost
    O(L * window * d_k)). Inside a slab, the keys outside the band and the padding are masked
    before a softmax that cannot give NaN.

    Args:
        q: queries, shape (..., L, d_k), floating point.
        k: keys, shape (..., L, d_k), the same L: this is self-attention over one sequence.
        v: values, shape (..., L, d_v).
        window: how far a query may look, an int >= 0 (0: each position sees only itself).
        causal: only look back (the query itself and ``window`` earlier positions).

    Returns:
        The output (..., L, d_v). Every query sees at least itself, so no row is empty.

    Raises:
        InputTypeError, ValueError: as `scaled_dot_product_attention`; also when q and k differ
            in length, or for a ``window`` that is not an int >= 0 or a ``causal`` that is not a
            bool.
    """
    batch, _ = require_qkv(q, k, v, None)
    if q.shape[-2] != k.shape[-2]:
        raise ValueError(
            f"local attention needs as many queries as keys (one sequence): q is {shape_str(q)}"
            f" (L_q={q.shape[-2]}), k is {shape_str(k)} (L_k={k.shape[-2]})"
        )
    if isinstance(window, int) and not isinstance(window, bool) and window < 0:
        raise ValueError(f"window must be a non-negative int, got {window}")
    window = require_int("window", window, minimum=0)
    require_bool("causal", causal)
    length, d_v = q.shape[-2], v.shape[-1]
    if length == 0 or math.prod(batch) == 0:
        return torch.zeros((*batch, length, d_v), dtype=q.dtype, device=q.device)
    b = min(max(window, 16), length)
    n_blocks = -(-length // b)
    padded = n_blocks * b
    left, right = window, (0 if causal else window)
    span = b + left + right  # keys in one slab
    q = q.expand(*batch, *q.shape[-2:])
    k = k.expand(*batch, *k.shape[-2:])
    v = v.expand(*batch, *v.shape[-2:])
    # queries: pad to a whole number of blocks, then (..., n_blocks, b, d_k)
    q_blocks = F.pad(q, (0, 0, 0, padded - length)).unflatten(-2, (n_blocks, b))
    # keys and values: `left` positions before, `right` after, and the block padding.
    pad_kv = (0, 0, left, right + padded - length)
    k_slabs = F.pad(k, pad_kv).unfold(-2, span, b)  # (..., n_blocks, d_k, span): K^T per slab
    v_slabs = F.pad(v, pad_kv).unfold(-2, span, b).transpose(-2, -1)  # (..., n_blocks, span, d_v)
    scores = (q_blocks / math.sqrt(q.shape[-1])) @ k_slabs  # (..., n_blocks, b, span)

    # Query r of block n sits at n * b + r; key c of its slab at n * b + c - left.
    r = torch.arange(b, device=q.device)[:, None]
    c = torch.arange(span, device=q.device)[None, :]
    offset = r - c + left  # i - j, the same for every block
    band = (offset >= 0) & (offset <= window) if causal else offset.abs() <= window
    key_pos = torch.arange(n_blocks, device=q.device)[:, None] * b + c - left  # (n_blocks, span)
    in_range = (key_pos >= 0) & (key_pos < length)
    allowed = band[None, :, :] & in_range[:, None, :]  # (n_blocks, b, span)

    # In place: the matrix product's backward needs its inputs, not its output.
    scores.masked_fill_(~allowed, float("-inf"))
    # A padding query past L may have no key in range; fill its row with zeros instead of -inf
    # so that the softmax gives no NaN. Its output is cut off below. Every real query has at
    # least itself, so its weights outside the band are exactly exp(-inf) = 0.
    has_key = allowed.any(dim=-1, keepdim=True)
    scores.masked_fill_(~has_key, 0.0)
    weights = torch.softmax(scores, dim=-1)
    out = weights @ v_slabs  # (..., n_blocks, b, d_v)
    return out.flatten(-3, -2)[..., :length, :]


def split_k_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    num_splits: int = 4,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention with the keys split into chunks, each chunk's softmax computed on its own and the
    partial results combined by their log-sum-exp: the idea of Flash-Decoding (split-K).

    The L_k keys and values are cut into ``num_splits`` chunks of ``ceil(L_k / num_splits)``
    positions (the last one shorter, padded and masked). For every chunk c and query row, on its
    own: the largest score ``m_c``, ``l_c = sum exp(s - m_c)``, the chunk's softmax average
    ``o_c = sum exp(s - m_c) v / l_c`` and its log-sum-exp ``lse_c = m_c + log l_c``. The chunks
    do not depend on each other (on a GPU they run in parallel, which is the point when there is
    a single query per sequence); the combination is

        lse = log sum_c exp(lse_c),    output = sum_c exp(lse_c - lse) o_c,

    the rescaling of the online softmax applied once, to whole chunks. All chunks are computed at
    once here, as one batched matrix product of shape (..., num_splits, L_q, chunk): the memory
    is that of plain attention; what the function shows is that the split changes nothing.

    Args:
        q: queries, shape (..., L_q, d_k), floating point; in decoding L_q = 1.
        k: keys, shape (..., L_k, d_k), the dtype and device of ``q`` (the cache).
        v: values, shape (..., L_k, d_v).
        num_splits: how many chunks to cut the keys into, an int >= 1; more chunks than keys
            leaves some chunks empty, which is allowed (they weigh 0).
        mask: optional bool tensor broadcastable to (..., L_q, L_k), True = may attend.

    Returns:
        The output (..., L_q, d_v), equal to ``scaled_dot_product_attention(q, k, v, mask)[0]``
        up to rounding. A query row with no allowed key gets zeros, never NaN.

    Raises:
        InputTypeError, ValueError: as `scaled_dot_product_attention`, and for a ``num_splits``
            that is not an int >= 1.
    """
    batch, mask = require_qkv(q, k, v, mask)
    num_splits = require_int("num_splits", num_splits, minimum=1)
    l_q, l_k, d_v = q.shape[-2], k.shape[-2], v.shape[-1]
    if l_k == 0 or l_q == 0 or math.prod(batch) == 0:
        return torch.zeros((*batch, l_q, d_v), dtype=q.dtype, device=q.device)
    chunk = -(-l_k // num_splits)
    padded = chunk * num_splits
    allowed = torch.ones(l_q, l_k, dtype=torch.bool, device=q.device) if mask is None else mask
    allowed = F.pad(allowed, (0, padded - l_k), value=False)  # padding keys: never allowed
    # (..., num_splits, chunk, d) for keys and values; the mask (..., num_splits, L_q, chunk)
    k_chunks = F.pad(k, (0, 0, 0, padded - l_k)).unflatten(-2, (num_splits, chunk))
    v_chunks = F.pad(v, (0, 0, 0, padded - l_k)).unflatten(-2, (num_splits, chunk))
    m_chunks = allowed.unflatten(-1, (num_splits, chunk)).movedim(-2, -3)
    scores = (q.unsqueeze(-3) / math.sqrt(q.shape[-1])) @ k_chunks.transpose(-2, -1)
    scores = scores.masked_fill(~m_chunks, float("-inf"))  # (..., num_splits, L_q, chunk)

    # Each chunk on its own: its maximum, sum of exponentials and softmax average.
    m = scores.amax(dim=-1, keepdim=True).detach()
    m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # an all-masked chunk: 0
    p = torch.exp(scores - m_safe)  # masked entries exactly 0
    l_sum = p.sum(dim=-1, keepdim=True)
    o = (p @ v_chunks) / torch.where(l_sum > 0, l_sum, torch.ones_like(l_sum))
    lse = m_safe + torch.log(l_sum)  # -inf for a chunk with no allowed key

    # Combine: weights exp(lse_c - lse) over the chunks, summing to 1 (0 if no chunk has a key).
    lse_all = torch.logsumexp(lse, dim=-3, keepdim=True)
    lse_all = torch.where(torch.isinf(lse_all), torch.zeros_like(lse_all), lse_all)
    weights = torch.exp(lse - lse_all)  # (..., num_splits, L_q, 1)
    return (weights * o).sum(dim=-3)
