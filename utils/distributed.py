"""Beyond one machine (chapter 16): processes that cooperate through ``torch.distributed``.

`run_on_ranks` runs one function in P processes (ranks) of one gloo process group, and fails
fast with the failing rank's traceback; `TensorParallelMultiHeadAttention` splits the heads of
a `MultiHeadAttention` over the ranks (tensor parallelism); `ring_attention` passes key/value
chunks around a ring of ranks into chapter 13's online softmax (sequence parallelism), forward
only. Importing the module starts no process and no process group.
"""

from __future__ import annotations

import datetime
import math
import os
import pickle
import socket
import sys
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn

from ._validation import (
    InputTypeError,
    require_bool,
    require_bool_mask,
    require_floating,
    require_int,
    require_rank,
    require_tensor,
    shape_str,
)
from .attention import MultiHeadAttention, _check_qkv, _read_mask, scaled_dot_product_attention
from .fast_attention import online_softmax_finish, online_softmax_step

__all__ = ["RankError", "run_on_ranks", "world"]
__all__ += ["TensorParallelMultiHeadAttention", "ring_attention"]

Group = dist.ProcessGroup | None  # a process group; None: the default one


class RankError(RuntimeError):
    """A rank of `run_on_ranks` raised, died, or had not finished before the deadline."""


def world() -> tuple[int, int]:
    """(rank, world size) of the default process group, or (0, 1) when none is initialised."""
    return _group_rank_size(None)


def _free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_method() -> str:
    """Fork on Linux and macOS (a notebook's functions can run in the ranks), else spawn."""
    return "fork" if hasattr(os, "fork") and sys.platform in ("linux", "darwin") else "spawn"


def _rank_main(job: tuple, rank: int, conn: Connection) -> None:
    """The body of one rank: join the group, run ``fn``, send back a pickled report.

    ``job`` is ``(fn, world_size, args, port, timeout, backend)``. The report, ``("ok", value)``
    or ``("error", traceback, time of failure)``, is pickled into bytes by the standard `pickle`
    (tensors copied, not left in shared memory that dies with this process).
    """
    torch.set_num_threads(1)  # first: a forked OpenMP pool hangs on its first parallel op
    fn, world_size, args, port, timeout, backend = job
    try:
        url, wait_for = f"tcp://127.0.0.1:{port}", datetime.timedelta(seconds=timeout)
        dist.init_process_group(backend, url, timeout=wait_for, world_size=world_size, rank=rank)
        value = fn(rank, world_size, *args)
        dist.destroy_process_group()
        report = pickle.dumps(("ok", value))
    except BaseException:  # noqa: BLE001 - every failure is reported to the parent
        # Reported before anything else (no goodbye to the group): the parent kills the rest.
        report = pickle.dumps(("error", traceback.format_exc(), time.time()))
    conn.send_bytes(report)
    conn.close()


def _check_arguments(fn: object, world_size: object, timeout: object, backend: object) -> None:
    """Raise a clear error for a bad argument of `run_on_ranks`."""
    if not callable(fn):
        raise InputTypeError(f"fn must be callable, got {type(fn).__name__}")
    require_int("world_size", world_size)
    if isinstance(timeout, bool) or not isinstance(timeout, int | float):
        raise InputTypeError(f"timeout must be a number of seconds, got {type(timeout).__name__}")
    if not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout}")
    if not isinstance(backend, str) or not backend:
        raise ValueError(f"backend must be a backend name such as 'gloo', got {backend!r}")


def _stop(procs: list[mp.Process]) -> None:
    """Kill every rank still running and reap them all."""
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=5)


def _failure(errors: dict[int, tuple], dead: dict[int, int | None]) -> RankError:
    """The error to raise: the ranks that raised, the first to fail (by its clock) first, then
    the ranks that died without a report."""
    order = sorted(errors, key=lambda r: errors[r][2])
    lines = [f"rank {r} of run_on_ranks raised:\n{errors[r][1]}" for r in order]
    for r, code in sorted(dead.items()):
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        lines.append(f"rank {r} of run_on_ranks died without a report ({how})")
    return RankError("\n".join(lines))


def run_on_ranks(
    fn: Callable, world_size: int, *args: Any, timeout: float = 60.0, backend: str = "gloo"
) -> list:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` processes, one process group.

    Each rank is a process forked on Linux and macOS (so ``fn`` may be defined in a notebook;
    "fork" is the default only on Linux) and spawned elsewhere (``fn`` and ``args`` must then
    be importable). It sets ``torch.set_num_threads(1)`` (one core per rank), joins the default
    process group (``backend``, TCP on 127.0.0.1 and a free port, ``timeout`` for collectives),
    calls ``fn``, leaves the group and sends its return value back pickled into bytes.

    Args:
        fn: called as ``fn(rank, world_size, *args)`` in each rank; returns anything picklable.
        world_size: the number of ranks P, an int >= 1.
        *args: passed to ``fn`` in every rank.
        timeout: seconds for the whole call, and for any collective waiting on a peer.
        backend: the process group's backend ("gloo" on CPU).

    Returns:
        The P return values, in rank order.

    Raises:
        RankError: as soon as a rank raises (with its traceback) or dies without a report
            (with its exit code): the other ranks are killed at once, never left waiting. Also
            when the ranks have not all finished after ``timeout`` seconds (naming them).
        InputTypeError, ValueError: for a ``fn`` that is not callable, a ``world_size`` that
            is not an int >= 1, a ``timeout`` that is not a positive number, or a bad backend.
    """
    _check_arguments(fn, world_size, timeout, backend)
    ctx = mp.get_context(_start_method())
    port, deadline = _free_port(), time.monotonic() + timeout
    procs, readers, job = [], [], (fn, world_size, args, port, float(timeout), backend)
    for rank in range(world_size):
        reader, writer = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_rank_main, args=(job, rank, writer), daemon=True)
        p.start()
        writer.close()  # the child holds the only writer: EOF when it dies
        procs.append(p)
        readers.append(reader)
    try:
        return _collect(procs, readers, deadline, timeout)
    finally:
        _stop(procs)
        for reader in readers:
            reader.close()


def _collect(
    procs: list[mp.Process], readers: list[Connection], deadline: float, timeout: float
) -> list:
    """Wait for every rank's report; raise `RankError` at the first failure or the deadline."""
    results, errors, dead = {}, {}, {}  # rank -> value, error report, exit code
    while len(results) < len(procs):
        waiting = [r for r in range(len(procs)) if r not in results]
        left = deadline - time.monotonic()
        if left <= 0:
            raise RankError(
                f"run_on_ranks timed out after {timeout} s: ranks {waiting} had not "
                "finished (a rank that hangs, or waits for a peer that never comes)"
            )
        wait([readers[r] for r in waiting] + [procs[r].sentinel for r in waiting], left)
        for r in waiting:
            if readers[r].poll():
                try:
                    report = pickle.loads(readers[r].recv_bytes())
                except EOFError:  # the rank closed its end without a report
                    report = None
                if report is None:
                    procs[r].join(timeout=5)
                    dead[r] = procs[r].exitcode
                elif report[0] == "ok":
                    results[r] = report[1]
                else:
                    errors[r] = report
            elif not procs[r].is_alive():
                dead[r] = procs[r].exitcode
        if errors or dead:
            raise _failure(errors, dead)
    return [results[r] for r in range(len(procs))]


def _group_rank_size(group: Group) -> tuple[int, int]:
    """(rank, size) of this process in ``group`` (the default group when None); (0, 1) when no
    process group is initialised, so that a single process runs the same code alone."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _global_rank(group: Group, group_rank: int) -> int:
    """The default group's rank of the process that is ``group_rank`` in ``group``."""
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def _summed(x: Tensor, group: Group) -> Tensor:
    """A new tensor: the sum of ``x`` over the ranks of ``group`` (an all-reduce)."""
    out = x.contiguous().clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out


class _SumOnce(torch.autograd.Function):
    """The sum over the ranks in one direction of autograd, the identity in the other.

    ``sum_forward=True``, after the heads: every rank gets the summed output and computes the
    same loss from it, so the gradient goes back as it is. ``sum_forward=False``, before them:
    every rank holds the same input and used it for its own heads only, so the input's
    gradient is the sum over the ranks.
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any, sum_forward: bool) -> Tensor:
        ctx.group, ctx.sum_forward = group, sum_forward
        return _summed(x, group) if sum_forward else x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return (grad if ctx.sum_forward else _summed(grad, ctx.group)), None, None


def _linear_from(weight: Tensor, bias: Tensor | None) -> nn.Linear:
    """A new ``nn.Linear`` holding copies of ``weight`` (out, in) and ``bias`` (out,) or none;
    nothing random is drawn (the global random state is left as it was)."""
    out_f, in_f = weight.shape
    kind = {"dtype": weight.dtype, "device": weight.device, "bias": bias is not None}
    linear = nn.utils.skip_init(nn.Linear, in_f, out_f, **kind)
    with torch.no_grad():
        linear.weight.copy_(weight)
        if bias is not None:
            linear.bias.copy_(bias)
    return linear


def _head_range(num_heads: int, world_size: int, rank: int) -> range:
    """The heads rank ``rank`` of ``world_size`` holds: as even a split as can be, the first
    ``num_heads % world_size`` ranks holding one head more (6 heads on 4 ranks: 2, 2, 1, 1)."""
    base, extra = divmod(num_heads, world_size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))


class TensorParallelMultiHeadAttention(nn.Module):
    """This rank's heads of a `utils.attention.MultiHeadAttention`: tensor parallelism.

    Each of the P ranks of ``group`` keeps the columns of W_Q, W_K, W_V (and biases) of its
    heads and the matching rows of W_O: about 1/P of the weights. One all-reduce (a sum over
    the ranks) of its heads times its rows of W_O gives every rank ``concat(heads) W_O``; W_O's
    bias, kept by every rank, is added once, after the sum. Build it with `from_module` inside
    a rank after the process group is initialised (without one, one process holds every head).

    ``heads`` is the range of global head indices this rank holds; ``d_model``, ``num_heads``
    (all heads) and ``d_k`` are the original's. Gradients: the all-reduce passes the gradient
    through and the inputs' gradients are summed over the ranks, so each rank's parameter
    gradients are the slices of the original's (for a loss every rank computes alike).
    """

    def __init__(self, mha: MultiHeadAttention, heads: range, group: Group) -> None:
        super().__init__()
        self.d_model, self.num_heads, self.d_k = mha.d_model, mha.num_heads, mha.d_k
        self.heads, self.group, self.dropout = heads, group, mha.dropout
        cols = slice(heads.start * self.d_k, heads.stop * self.d_k)
        # nn.Linear stores W^T: the columns of W_Q are rows of w_q.weight, W_O's rows its columns
        self.w_q, self.w_k, self.w_v = (
            _linear_from(lin.weight[cols], None if lin.bias is None else lin.bias[cols])
            for lin in (mha.w_q, mha.w_k, mha.w_v)
        )
        self.w_o = _linear_from(mha.w_o.weight[:, cols], None)
        out_bias = mha.w_o.bias
        self.out_bias = None if out_bias is None else nn.Parameter(out_bias.detach().clone())
        self.train(mha.training)

    @classmethod
    def from_module(
        cls, mha: MultiHeadAttention, group: Group = None
    ) -> TensorParallelMultiHeadAttention:
        """This rank's share of ``mha``'s heads (see `_head_range`), its weights copied.

        Raises:
            InputTypeError: when ``mha`` is not a `utils.attention.MultiHeadAttention`.
            ValueError: when the group has more ranks than ``mha`` has heads.
        """
        if not isinstance(mha, MultiHeadAttention):
            raise InputTypeError(
                f"mha must be a utils.attention.MultiHeadAttention, got {type(mha).__name__}"
            )
        rank, size = _group_rank_size(group)
        if size > mha.num_heads:
            raise ValueError(
                f"tensor parallelism needs at least one head per rank: "
                f"h={mha.num_heads} heads cannot be split over P={size} ranks"
            )
        return cls(mha, _head_range(mha.num_heads, size, rank), group)

    def parameter_count(self) -> int:
        """The number of weights this rank holds (W_O's bias, kept by every rank, included)."""
        return sum(p.numel() for p in self.parameters())

    def forward(
        self, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None = None
    ) -> Tensor:
        """The original module's output, (B, L_q, d_model), on every rank.

        Args and mask rule as `utils.attention.MultiHeadAttention.forward`: query
        (B, L_q, d_model), key and value (B, L_k, d_model), mask broadcastable to
        (B, h, L_q, L_k) with h the original module's number of heads.
        """
        _check_qkv(self, query, key, value)
        mask = _read_mask(mask, query, key.shape[1], self.num_heads)
        if mask is not None and mask.shape[1] == self.num_heads:
            mask = mask[:, self.heads.start : self.heads.stop]
        distributed = _group_rank_size(self.group)[1] > 1
        shared: dict[int, Tensor] = {}
        if distributed:  # one gradient sum per distinct input (self-attention: only one)
            query, key, value = (
                shared.setdefault(id(t), _SumOnce.apply(t, self.group, False))
                for t in (query, key, value)
            )
        n = len(self.heads)
        q, k, v = (
            self._split(lin(x), n)
            for lin, x in ((self.w_q, query), (self.w_k, key), (self.w_v, value))
        )
        p = self.dropout if self.training else 0.0
        out = scaled_dot_product_attention(q, k, v, mask, dropout_p=p)[0]
        out = self.w_o(out.transpose(1, 2).reshape(*out.shape[:1], out.shape[2], n * self.d_k))
        if distributed:
            out = _SumOnce.apply(out, self.group, True)
        return out if self.out_bias is None else out + self.out_bias

    def _split(self, x: Tensor, n: int) -> Tensor:
        """(B, L, n * d_k) -> (B, n, L, d_k)."""
        return x.view(x.shape[0], x.shape[1], n, self.d_k).transpose(1, 2)


def _check_ring_inputs(q: object, k: object, v: object, key_padding: object) -> None:
    """Raise unless q (B, H, L_q, d_k), k (B, H, L_k, d_k), v (B, H, L_k, d_v) and key_padding
    (B, L_k) bool (or None) fit together, on one dtype and device."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        require_tensor(name, t)
        require_rank(name, t, "(B, H, L, d)", rank=4)
        require_floating(name, t)
        if t.dtype != q.dtype:
            raise InputTypeError(f"{name} must have the dtype of q, {q.dtype}, got {t.dtype}")
    if k.shape[:2] != q.shape[:2] or v.shape[:2] != q.shape[:2] or k.shape[3] != q.shape[3]:
        raise ValueError(
            f"q, k and v must share (B, H) and q, k their width d_k: q "
            f"{shape_str(q)}, k {shape_str(k)}, v {shape_str(v)}"
        )
    if v.shape[2] != k.shape[2]:
        raise ValueError(
            f"k and v must have the same length L_k: k {shape_str(k)}, v {shape_str(v)}"
        )
    if key_padding is not None:
        require_tensor("key_padding", key_padding)
        require_bool_mask("key_padding", key_padding)
        if tuple(key_padding.shape) != (k.shape[0], k.shape[2]):
            raise ValueError(
                f"key_padding must have shape (B, L_k) = "
                f"{shape_str((k.shape[0], k.shape[2]))}, got {shape_str(key_padding)}"
            )


def _chunk_mask(
    causal: bool, rows: range, cols: range, padding: Tensor | None, device: torch.device
) -> Tensor | None:
    """The mask (B or 1, 1, L_q, L_k) of the queries at global positions ``rows`` against the
    keys at ``cols`` (causal: key j allowed for query i when j <= i) and the keys' padding."""
    mask = None
    if causal and cols[-1] > rows[0]:  # some key after some query: not all allowed
        i = torch.arange(rows.start, rows.stop, device=device)
        j = torch.arange(cols.start, cols.stop, device=device)
        mask = (j[None, :] <= i[:, None])[None, None]
    if padding is not None:
        mask = padding[:, None, None, :] if mask is None else mask & padding[:, None, None, :]
    return mask


def _ring_layout(q: Tensor, k: Tensor, v: Tensor, group: Group, size: int) -> Tensor:
    """Every rank's (L_q, L_k, B, H, d_k, d_v), (P, 6); a ValueError if B, H, d_k, d_v differ."""
    mine = torch.tensor([q.shape[2], k.shape[2], *q.shape[:2], q.shape[3], v.shape[3]])
    if size == 1:
        return mine[None]
    parts = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(parts, mine, group=group)
    layout = torch.stack(parts)
    if not bool((layout[:, 2:] == layout[0, 2:]).all()):
        raise ValueError(
            "every rank's q, k, v must share (B, H, d_k, d_v); the ranks hold "
            f"(B, H, d_k, d_v) = {layout[:, 2:].tolist()}"
        )
    return layout


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool = False,
    key_padding: Tensor | None = None,
    group: Group = None,
) -> Tensor:
    """This rank's rows of attention over a sequence cut into one contiguous chunk per rank.

    Rank r of the P ranks of ``group`` holds chunk r (in rank order, lengths may differ) of the
    queries, keys and values. At each of P - 1 steps a rank sends the key/value chunk it holds
    (and its padding) to rank r + 1 and receives one from rank r - 1, while it folds the one it
    holds into its queries' online softmax (`utils.fast_attention.online_softmax_step`). No rank
    holds more than its queries, two key/value chunks and L_r x L_r' scores.

    Args:
        q, k, v: this rank's queries (B, H, L_q, d_k), keys (B, H, L_k, d_k) and values
            (B, H, L_k, d_v); float, one dtype and device.
        causal: query at global position i sees key j only when j <= i; a chunk entirely after
            this rank's queries is skipped (no work).
        key_padding: optional bool (B, L_k), True = a real key; it travels with its chunk.
        group: the ring's process group (None: the default one; none at all: one process).

    Returns:
        This rank's rows of ``scaled_dot_product_attention(q_full, k_full, v_full, mask)[0]``,
        (B, H, L_q, d_v), where the mask is causal and/or the key padding. A query with no
        allowed key gets zeros, never NaN.

    Raises:
        InputTypeError, ValueError: for shapes, dtypes or a padding that do not fit, ranks that
            disagree on B, H, d_k, d_v, or (forward only: the chunks sent around the ring carry
            no gradient, so autograd's would be wrong) q, k or v requiring grad.
    """
    _check_ring_inputs(q, k, v, key_padding)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise ValueError(
            "ring_attention is forward only (its sends carry no gradient): use torch.no_grad()"
        )
    require_bool("causal", causal)
    rank, size = _group_rank_size(group)
    layout = _ring_layout(q, k, v, group, size)
    q_starts, k_starts = (torch.cumsum(layout[:, i], 0) - layout[:, i] for i in (0, 1))
    b, h, l_q, d_k = q.shape
    rows = range(int(q_starts[rank]), int(q_starts[rank]) + l_q)
    parts = [k, v]  # one message per step: keys, values and the padding as a 0/1 column
    if key_padding is not None:
        parts.append(key_padding[:, None, :, None].to(q.dtype).expand(b, h, -1, 1))
    held = torch.cat(parts, dim=-1).contiguous()
    m = torch.full((b, h, l_q, 1), float("-inf"), dtype=q.dtype, device=q.device)
    l_sum = torch.zeros_like(m)
    acc = torch.zeros((b, h, l_q, v.shape[3]), dtype=q.dtype, device=q.device)
    q = q / math.sqrt(d_k)
    for step in range(size):
        src = (rank - step) % size  # whose chunk this rank holds now
        pending, incoming = [], None
        if step < size - 1:
            pending, incoming = _pass_on(held, layout[:, 1], rank, src, group)
        cols = range(int(k_starts[src]), int(k_starts[src] + layout[src, 1]))
        if cols and rows and not (causal and cols[0] > rows[-1]):  # else: nothing to see
            blk_k, blk_v = held[..., :d_k], held[..., d_k : d_k + v.shape[3]]
            pad = None if key_padding is None else held[:, 0, :, -1] > 0.5
            mask = _chunk_mask(causal, rows, cols, pad, q.device)
            scores = q @ blk_k.transpose(-2, -1)
            if mask is not None:
                scores = scores.masked_fill(~mask, float("-inf"))
            m, l_sum, acc = online_softmax_step(m, l_sum, acc, scores, blk_v)
        for work in pending:
            work.wait()
        if incoming is not None:
            held = incoming
    return online_softmax_finish(acc, l_sum)


def _pass_on(held: Tensor, lens: Tensor, rank: int, src: int, group: Group) -> tuple[list, Tensor]:
    """Start sending the chunk held (rank ``src``'s) to the next rank and receiving the previous
    rank's (rank ``src - 1``'s), sized by its length; empty chunks are not sent at all."""
    pending, size = [], len(lens)
    if held.shape[2] > 0:
        pending.append(dist.isend(held, _global_rank(group, (rank + 1) % size), group=group))
    incoming = held.new_empty((*held.shape[:2], int(lens[src - 1]), held.shape[3]))
    if incoming.shape[2] > 0:
        pending.append(dist.irecv(incoming, _global_rank(group, (rank - 1) % size), group=group))
    return pending, incoming
