"""utils.distributed: ranks that fail fast, and the three ways of splitting a Transformer.

Every multi-process test runs through `run_on_ranks` (forked ranks, gloo on 127.0.0.1) and
compares what the ranks compute together with what one process computes alone:

* data parallelism: PyTorch's DistributedDataParallel on a shard of the batch each equals one
  process trained on the whole batch (with padding, and unequal real tokens per rank);
* tensor parallelism: `TensorParallelMultiHeadAttention` equals `MultiHeadAttention`, outputs
  and gradients;
* sequence parallelism: `ring_attention` equals full attention's rows.

The rank functions live at module level so that they could also be spawned.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from utils._validation import InputTypeError
from utils.attention import MultiHeadAttention, scaled_dot_product_attention
from utils.data import PAD
from utils.distributed import (
    RankError,
    TensorParallelMultiHeadAttention,
    _head_range,
    ring_attention,
    run_on_ranks,
    world,
)
from utils.masks import causal_mask
from utils.models import DecoderOnlyLM
from utils.train import token_cross_entropy

# ---------------------------------------------------------------------------- run_on_ranks


def _sum_of_ranks(rank: int, world_size: int, offset: float) -> tuple:
    t = torch.tensor([rank + offset])
    dist.all_reduce(t)
    return rank, world_size, world(), t


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_run_on_ranks_returns_each_ranks_value_in_rank_order(world_size):
    results = run_on_ranks(_sum_of_ranks, world_size, 10.0)
    total = sum(r + 10.0 for r in range(world_size))
    assert [r[:3] for r in results] == [(r, world_size, (r, world_size)) for r in range(world_size)]
    for r in results:  # the tensor came back through the pipe, with the all-reduced value
        assert torch.equal(r[3], torch.tensor([total]))


def test_world_outside_a_process_group_is_one_process():
    assert world() == (0, 1)


def _one_rank_raises(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("boom")
    dist.all_reduce(torch.ones(1))  # rank 0 waits for a peer that never comes


def test_a_rank_that_raises_fails_fast_with_its_traceback():
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        run_on_ranks(_one_rank_raises, 2, timeout=60)
    assert time.monotonic() - start < 10  # not the 60 s timeout: the peer was killed at once
    message = str(info.value)
    assert message.startswith("rank 1 ")
    assert "ValueError: boom" in message and "Traceback" in message
    assert "_one_rank_raises" in message  # the rank's own traceback, down to the function


def _one_rank_dies(rank: int, world_size: int, how: str) -> None:
    if rank == 1:
        if how == "exit":
            os._exit(3)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(100)


@pytest.mark.parametrize("how, expected", [("exit", "exit code 3"), ("kill", "signal 9")])
def test_a_rank_that_dies_without_a_report_is_named(how, expected):
    start = time.monotonic()
    with pytest.raises(RankError, match=f"rank 1 of run_on_ranks died .*{expected}"):
        run_on_ranks(_one_rank_dies, 2, how, timeout=60)
    assert time.monotonic() - start < 10


def _one_rank_hangs(rank: int, world_size: int) -> int:
    if rank == 1:
        time.sleep(100)
    return rank


def test_a_rank_that_hangs_meets_the_deadline():
    start = time.monotonic()
    with pytest.raises(RankError, match=r"timed out after 3 s: ranks \[1\] had not finished"):
        run_on_ranks(_one_rank_hangs, 2, timeout=3)
    assert time.monotonic() - start < 6


def _returns_a_lambda(rank: int, world_size: int):
    return lambda: rank


def test_a_value_that_cannot_be_pickled_is_the_ranks_error():
    with pytest.raises(RankError, match=r"(?s)rank \d of run_on_ranks raised.*pickle"):
        run_on_ranks(_returns_a_lambda, 2)


@pytest.mark.parametrize(
    "fn, world_size, timeout, backend, match",
    [
        ("f", 2, 60.0, "gloo", "fn must be callable, got str"),
        (_sum_of_ranks, 0, 60.0, "gloo", "world_size"),
        (_sum_of_ranks, 1.5, 60.0, "gloo", "world_size"),
        (_sum_of_ranks, 2, 0, "gloo", "timeout must be a positive number of seconds, got 0"),
        (_sum_of_ranks, 2, "60", "gloo", "timeout must be a number of seconds, got str"),
        (_sum_of_ranks, 2, 60.0, "", "backend must be a backend name"),
    ],
)
def test_run_on_ranks_rejects_bad_arguments(fn, world_size, timeout, backend, match):
    with pytest.raises(ValueError, match=match):  # InputTypeError is a ValueError too
        run_on_ranks(fn, world_size, 1.0, timeout=timeout, backend=backend)


# ---------------------------------------------------------------------- data parallelism

LENGTHS = [7, 2, 5, 3, 7, 7]  # real tokens per sequence: unequal shares on 2 and 3 ranks


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Next-token inputs (6, 6), targets (6, 6) with PAD after each sequence, and its mask."""
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(3, 11, (len(LENGTHS), max(LENGTHS)), generator=gen)
    real = torch.arange(max(LENGTHS))[None, :] < torch.tensor(LENGTHS)[:, None]
    tokens = tokens.masked_fill(~real, PAD)
    return tokens[:, :-1], tokens[:, 1:], real[:, :-1]


def _model() -> DecoderOnlyLM:
    torch.manual_seed(0)
    lm = DecoderOnlyLM(11, d_model=16, nhead=2, num_layers=1, dim_feedforward=32, max_len=8)
    return lm.double()


def _train(model: torch.nn.Module, rows: slice, world_size: int, scale: bool) -> None:
    """Four SGD steps on ``rows`` of the batch; with ``scale``, the loss is weighted so that
    DDP's average over the ranks is the mean over every real token of the whole batch."""
    inputs, targets, mask = _batch()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    share = (targets[rows] != PAD).sum() / (targets != PAD).sum()
    for _ in range(4):
        opt.zero_grad()
        loss = token_cross_entropy(model(inputs[rows], mask[rows]), targets[rows])
        (loss * share * world_size if scale else loss).backward()
        opt.step()


def _ddp_rank(rank: int, world_size: int, scale: bool) -> dict[str, torch.Tensor]:
    model = _model()
    size = len(LENGTHS) // world_size
    _train(DistributedDataParallel(model), slice(rank * size, (rank + 1) * size), world_size, scale)
    return {k: v.detach() for k, v in model.state_dict().items()}


def _one_process() -> dict[str, torch.Tensor]:
    model = _model()
    _train(model, slice(None), 1, True)
    return model.state_dict()


@pytest.mark.parametrize("world_size", [2, 3])
def test_ddp_on_shards_equals_one_process_on_the_whole_batch(world_size):
    expected = _one_process()
    moved = max((v - _model().state_dict()[k]).abs().max().item() for k, v in expected.items())
    assert moved > 1e-2  # the steps changed the weights: the comparison below means something
    for state in run_on_ranks(_ddp_rank, world_size, True):
        for name, value in expected.items():
            torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-5, msg=name)


def test_ddp_without_weighting_the_loss_by_real_tokens_differs():
    """A plain mean per rank, averaged by DDP, weighs the tokens of short shards more."""
    expected = _one_process()
    state = run_on_ranks(_ddp_rank, 2, False)[0]
    assert max((state[k] - v).abs().max().item() for k, v in expected.items()) > 1e-4


# -------------------------------------------------------------------- tensor parallelism


def _masks(b: int, l_q: int, l_k: int, h: int) -> dict[str, torch.Tensor | None]:
    """The masks to try: none, causal (self-attention), key padding, one mask per head."""
    pad = torch.ones(b, l_k, dtype=torch.bool)
    pad[1, l_k - 3 :] = False
    per_head = torch.rand(b, h, l_q, l_k, generator=torch.Generator().manual_seed(2)) > 0.3
    masks = {"none": None, "padding": pad, "per head": per_head}
    if l_q == l_k:
        masks["causal"] = causal_mask(l_q)
    return masks


def _tensor_parallel_rank(rank: int, world_size: int, h: int) -> dict[str, float]:
    """Largest differences from the full module: outputs, input and parameter gradients."""
    torch.manual_seed(0)
    mha = MultiHeadAttention(4 * h, h).double()
    diffs = {}
    for l_q, l_k in [(5, 5), (4, 7)]:  # self- and cross-attention
        x = torch.randn(2, l_q, 4 * h, dtype=torch.float64, requires_grad=True)
        mem = x if l_q == l_k else torch.randn(2, l_k, 4 * h, dtype=torch.float64)
        for name, mask in _masks(2, l_q, l_k, h).items():
            mha.zero_grad()
            x.grad = None
            full = mha(x, mem, mem, mask)
            full.pow(2).sum().backward()
            expected = [x.grad.clone()] + [p.grad.clone() for p in mha.parameters()]
            tp = TensorParallelMultiHeadAttention.from_module(mha)
            x.grad = None
            out = tp(x, mem, mem, mask)
            out.pow(2).sum().backward()
            cols = slice(tp.heads.start * mha.d_k, tp.heads.stop * mha.d_k)
            w_q, b_q, w_k, b_k, w_v, b_v, w_o, b_o = expected[1:]
            pairs = [(out, full), (x.grad, expected[0]), (tp.w_q.weight.grad, w_q[cols]),
                     (tp.w_q.bias.grad, b_q[cols]), (tp.w_k.weight.grad, w_k[cols]),
                     (tp.w_v.bias.grad, b_v[cols]), (tp.w_o.weight.grad, w_o[:, cols]),
                     (tp.out_bias.grad, b_o)]  # fmt: skip
            diffs[f"{l_q}x{l_k} {name}"] = max((a - b).abs().max().item() for a, b in pairs)
    diffs["heads"] = list(tp.heads)
    diffs["share"] = tp.parameter_count() / sum(p.numel() for p in mha.parameters())
    return diffs


@pytest.mark.parametrize("world_size, h", [(2, 6), (3, 6), (3, 4)])
def test_tensor_parallel_attention_equals_the_full_module(world_size, h):
    results = run_on_ranks(_tensor_parallel_rank, world_size, h)
    heads = [r.pop("heads") for r in results]
    assert heads == [list(_head_range(h, world_size, r)) for r in range(world_size)]
    assert sorted(sum(heads, [])) == list(range(h))  # every head on exactly one rank
    shares = [r.pop("share") for r in results]
    d = 4 * h  # every weight held once, but W_O's bias (d numbers) held by every rank
    assert sum(shares) == pytest.approx(1 + (world_size - 1) * d / (4 * d * d + 4 * d))
    assert max(shares) < 0.6  # each rank holds about 1/P of the weights
    for rank, diffs in enumerate(results):
        bad = {case: d for case, d in diffs.items() if not d < 1e-12}
        assert not bad, f"rank {rank}: {bad}"


def test_head_range_gives_the_first_ranks_one_more_head():
    assert [list(_head_range(4, 3, r)) for r in range(3)] == [[0, 1], [2], [3]]
    assert [len(_head_range(6, 4, r)) for r in range(4)] == [2, 2, 1, 1]


def test_tensor_parallel_attention_alone_is_the_whole_module():
    torch.manual_seed(0)
    mha = MultiHeadAttention(8, 2)
    tp = TensorParallelMultiHeadAttention.from_module(mha)
    x = torch.randn(2, 3, 8)
    assert list(tp.heads) == [0, 1]
    torch.testing.assert_close(tp(x, x, x, causal_mask(3)), mha(x, x, x, causal_mask(3)))
    with pytest.raises(InputTypeError, match="mha must be a utils.attention.MultiHeadAttention"):
        TensorParallelMultiHeadAttention.from_module(torch.nn.Linear(8, 8))
    with pytest.raises(ValueError, match=r"query must have shape \(B, L, d_model=8\)"):
        tp(x[..., :4], x, x)


def _too_many_ranks(rank: int, world_size: int) -> None:
    TensorParallelMultiHeadAttention.from_module(MultiHeadAttention(4, 2))


def test_tensor_parallel_attention_needs_a_head_per_rank():
    with pytest.raises(RankError, match="h=2 heads cannot be split over P=3 ranks"):
        run_on_ranks(_too_many_ranks, 3)


# ------------------------------------------------------------------ sequence parallelism


def _ring_case(l: int, causal: bool) -> tuple[torch.Tensor, ...]:
    """q, k, v (2, 3, l, 4), a key padding where sequence 1 has no real key, and the full
    attention's output under the same mask."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 3, l, 4, generator=gen, dtype=torch.float64) for _ in range(3))
    pad = torch.ones(2, l, dtype=torch.bool)
    pad[0, 2:4] = False
    pad[1] = False  # every key of sequence 1 is padding: its rows must be zeros
    mask = pad[:, None, None, :] & (causal_mask(l) if causal else True)
    return q, k, v, pad, scaled_dot_product_attention(q, k, v, mask)[0]


def _ring_rank(rank: int, world_size: int, chunks: list[int], causal: bool) -> tuple:
    q, k, v, pad, full = _ring_case(sum(chunks), causal)
    start = sum(chunks[:rank])
    rows = slice(start, start + chunks[rank])
    out = ring_attention(q[:, :, rows], k[:, :, rows], v[:, :, rows], causal, pad[:, rows])
    unpadded = ring_attention(q[:, :, rows], k[:, :, rows], v[:, :, rows], causal)
    mask = causal_mask(sum(chunks)) if causal else None
    expected = scaled_dot_product_attention(q, k, v, mask)[0][:, :, rows]
    return out, full[:, :, rows], unpadded, expected


@pytest.mark.parametrize("chunks", [[5, 5], [6, 4], [4, 3, 3], [0, 7, 3]])
@pytest.mark.parametrize("causal", [False, True])
def test_ring_attention_equals_full_attention_rows(chunks, causal):
    for out, expected, unpadded, expected_unpadded in run_on_ranks(
        _ring_rank, len(chunks), chunks, causal
    ):
        assert not out.isnan().any()
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
        torch.testing.assert_close(unpadded, expected_unpadded, rtol=0, atol=1e-12)
        assert torch.equal(out[1], torch.zeros_like(out[1]))  # no real key: zeros


def test_ring_attention_alone_is_full_attention_and_checks_its_inputs():
    q, k, v, pad, full = _ring_case(6, True)
    torch.testing.assert_close(ring_attention(q, k, v, True, pad), full, rtol=0, atol=1e-12)
    wide = torch.randn(2, 3, 6, 7)  # d_v = 7 != d_k = 4, in float32
    expected = scaled_dot_product_attention(q.float(), k.float(), wide, pad[:, None, None])[0]
    torch.testing.assert_close(ring_attention(q.float(), k.float(), wide, False, pad), expected)
    with pytest.raises(ValueError, match=r"k and v must have the same length L_k"):
        ring_attention(q, k, v[:, :, :5])
    with pytest.raises(ValueError, match=r"q, k and v must share \(B, H\)"):
        ring_attention(q, k[:, :2], v[:, :2])
    with pytest.raises(ValueError, match=r"key_padding must have shape \(B, L_k\) = \(2, 6\)"):
        ring_attention(q, k, v, key_padding=pad[:, :5])
    with pytest.raises(InputTypeError, match="key_padding"):
        ring_attention(q, k, v, key_padding=pad.float())
    with pytest.raises(ValueError, match=r"q must have shape \(B, H, L, d\)"):
        ring_attention(q[0], k, v)
    with pytest.raises(InputTypeError, match="v must have the dtype of q"):
        ring_attention(q, k, v.float())


def _ring_disagrees(rank: int, world_size: int) -> None:
    d = 4 + rank  # rank 1 has wider heads than rank 0
    ring_attention(torch.randn(1, 2, 3, d), torch.randn(1, 2, 3, d), torch.randn(1, 2, 3, d))


def test_ring_attention_ranks_must_agree_on_the_shapes():
    with pytest.raises(RankError, match=r"must share \(B, H, d_k, d_v\)"):
        run_on_ranks(_ring_disagrees, 2)


def _ring_with_grad(rank: int, world_size: int, which: str) -> bool:
    q, k, v, _, _ = _ring_case(4, True)
    rows = slice(2 * rank, 2 * rank + 2)
    parts = {name: t[:, :, rows].clone() for name, t in zip("qkv", (q, k, v), strict=True)}
    parts[which].requires_grad_(True)
    try:
        ring_attention(parts["q"], parts["k"], parts["v"], True)
    except ValueError as error:  # refused in every rank, before any message is sent
        assert "forward only" in str(error) and "torch.no_grad()" in str(error)
    else:
        return False
    with torch.no_grad():  # the same inputs without autograd: accepted
        out = ring_attention(parts["q"], parts["k"], parts["v"], True)
    return not out.requires_grad


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_ring_attention_refuses_inputs_that_need_gradients(which):
    # Its sends carry no gradient: autograd through it would give wrong dk and dv (the other
    # ranks' queries never reach this rank's keys in the backward pass), so it refuses.
    assert run_on_ranks(_ring_with_grad, 2, which) == [True, True]
    q, k, v, _, _ = _ring_case(4, False)
    with pytest.raises(ValueError, match="ring_attention is forward only"):
        ring_attention(q, k.requires_grad_(True), v)  # one process, no group: refused too
