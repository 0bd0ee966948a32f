"""Tests of the fast attention functions of utils.fast_attention: `memory_efficient_attention`
(blocks and the online softmax), `local_attention` (banded attention in O(L * window)) and
`split_k_attention` (the keys split into chunks combined by log-sum-exp, as in Flash-Decoding).

Both are compared with the plain `scaled_dot_product_attention`, itself tested against PyTorch in
tests/test_attention_sdpa.py.
"""

from __future__ import annotations

import pytest
import torch

from utils.attention import scaled_dot_product_attention
from utils.fast_attention import local_attention, memory_efficient_attention, split_k_attention
from utils.masks import causal_mask, local_mask

ATOL = {torch.float32: 1e-5, torch.float64: 1e-10}


def _qkv(batch, l_q, l_k, d_k, d_v, dtype=torch.float32, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(*batch, l_q, d_k, generator=g, dtype=dtype)
    k = torch.randn(*batch, l_k, d_k, generator=g, dtype=dtype)
    v = torch.randn(*batch, l_k, d_v, generator=g, dtype=dtype)
    if grad:
        for t in (q, k, v):
            t.requires_grad_(True)
    return q, k, v


def _plain(q, k, v, mask=None):
    return scaled_dot_product_attention(q, k, v, mask)[0]


def _mask(kind, batch, l_q, l_k, seed=1):
    g = torch.Generator().manual_seed(seed)
    if kind is None:
        return None
    if kind == "causal":
        i = torch.arange(l_q)[:, None]
        return i + (l_k - l_q) >= torch.arange(l_k)[None, :]  # (L_q, L_k), bottom-right aligned
    if kind == "padding":
        lengths = torch.randint(1, l_k + 1, (batch[0],), generator=g)
        pad = torch.arange(l_k)[None, :] < lengths[:, None]  # (B, L_k)
        return pad.reshape(batch[0], *([1] * (len(batch) - 1)), 1, l_k)
    if kind == "random":
        return torch.rand(*batch, l_q, l_k, generator=g) > 0.6
    if kind == "empty_rows":
        mask = torch.rand(*batch, l_q, l_k, generator=g) > 0.5
        mask[..., ::3, :] = False  # every third query sees no key at all
        return mask
    if kind == "late_key":
        # rows 0..L_q-1 see only the LAST key: every earlier key block is fully masked for them
        mask = torch.zeros(l_q, l_k, dtype=torch.bool)
        mask[:, -1] = True
        mask[1::2, :] = False  # and half the rows see nothing at all
        return mask
    if kind == "keys_only":
        return torch.rand(l_k, generator=g) > 0.3  # (L_k,): one row for every query
    raise AssertionError(kind)


SHAPES = [
    # batch, L_q, L_k, d_k, d_v
    ((), 1, 1, 1, 1),
    ((2,), 7, 7, 4, 4),
    ((2, 3), 33, 17, 8, 5),
    ((1, 2), 64, 64, 16, 16),
    ((3, 1), 50, 129, 8, 12),
]
MASKS = [None, "causal", "padding", "random", "empty_rows", "late_key", "keys_only"]
BLOCKS = [1, 4, 16, (5, 7), (64, 3), 128]


# A padding mask needs a batch axis: the unbatched shape is paired with every other mask kind.
SHAPE_MASKS = [(shape, kind) for shape in SHAPES for kind in MASKS
               if not (kind == "padding" and not shape[0])]


# The two functions that cut the keys into pieces, each with the sizes it is tried with: some do
# not divide L_q or L_k, some exceed them (split-K then has empty chunks).
PIECEWISE = {
    "block_size": (lambda q, k, v, mask, n: memory_efficient_attention(q, k, v, mask,
                                                                      block_size=n), BLOCKS),
    "num_splits": (lambda q, k, v, mask, n: split_k_attention(q, k, v, n, mask),
                   [1, 2, 3, 4, 7, 64, 200]),
}


@pytest.mark.parametrize("setting", list(PIECEWISE))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("shape", "mask_kind"), SHAPE_MASKS)
def test_piecewise_attention_matches_plain(shape, mask_kind, dtype, setting):
    attend, sizes = PIECEWISE[setting]
    batch, l_q, l_k, d_k, d_v = shape
    q, k, v = _qkv(batch, l_q, l_k, d_k, d_v, dtype=dtype)
    mask = _mask(mask_kind, batch, l_q, l_k)
    expected = _plain(q, k, v, mask)
    for size in sizes:
        if size == 1 and setting == "block_size" and l_q * l_k > 1024:
            # 1x1 tiles take one Python step per (query, key) pair: the small shapes run the
            # same code path in a fraction of the time (64 x 64 alone is 4,096 steps).
            continue
        out = attend(q, k, v, mask, size)
        assert out.shape == expected.shape and out.dtype == dtype
        assert not out.isnan().any()
        torch.testing.assert_close(out, expected, atol=ATOL[dtype], rtol=0,
                                   msg=f"{setting}={size}")


def test_memory_efficient_random_shapes():
    g = torch.Generator().manual_seed(5)
    for trial in range(25):
        dims = torch.randint(1, 4, (int(torch.randint(0, 3, (1,), generator=g)),), generator=g)
        batch = tuple(int(x) for x in dims)
        l_q, l_k = (int(x) for x in torch.randint(1, 90, (2,), generator=g))
        d_k, d_v = (int(x) for x in torch.randint(1, 20, (2,), generator=g))
        q, k, v = _qkv(batch, l_q, l_k, d_k, d_v, seed=trial)
        mask = torch.rand(*batch, l_q, l_k, generator=g) > float(torch.rand(1, generator=g))
        block = int(torch.randint(1, 40, (1,), generator=g))
        torch.testing.assert_close(memory_efficient_attention(q, k, v, mask, block_size=block),
                                   _plain(q, k, v, mask), atol=1e-5, rtol=0)


def test_memory_efficient_broadcast_batch_dims():
    q, _, _ = _qkv((2, 4), 10, 12, 8, 8)
    _, k, v = _qkv((1, 4), 10, 12, 8, 8, seed=3)
    mask = torch.rand(2, 1, 1, 12) > 0.3
    torch.testing.assert_close(memory_efficient_attention(q, k, v, mask, block_size=3),
                               _plain(q, k, v, mask), atol=1e-5, rtol=0)


def test_memory_efficient_fully_masked_rows_are_zero():
    q, k, v = _qkv((2,), 9, 11, 4, 3)
    mask = torch.zeros(9, 11, dtype=torch.bool)
    mask[4:, 10] = True  # rows 0..3 see nothing; 4..8 only the last key (the last key block)
    out = memory_efficient_attention(q, k, v, mask, block_size=2)
    assert not out.isnan().any()
    assert (out[:, :4] == 0).all()
    torch.testing.assert_close(out[:, 4:], v[:, 10:11].expand(2, 5, 3), atol=1e-6, rtol=0)


def test_memory_efficient_degenerate_sizes():
    q, k, v = _qkv((2,), 5, 0, 4, 3)
    assert (memory_efficient_attention(q, k, v) == 0).all()
    q, k, v = _qkv((2,), 0, 6, 4, 3)
    assert memory_efficient_attention(q, k, v).shape == (2, 0, 3)
    q, k, v = _qkv((0,), 5, 6, 4, 3)
    assert memory_efficient_attention(q, k, v).shape == (0, 5, 3)


def test_memory_efficient_large_scores_do_not_overflow():
    q, k, v = _qkv((1,), 20, 30, 4, 4)
    q = q * 300  # scores in the thousands: exp without the running maximum would overflow
    mask = causal_mask(30)[-20:]
    out = memory_efficient_attention(q, k, v, mask, block_size=4)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, _plain(q, k, v, mask), atol=1e-5, rtol=0)


@pytest.mark.parametrize("mask_kind", [None, "causal", "random", "empty_rows", "late_key"])
@pytest.mark.parametrize("block", [3, (16, 5), 64])
def test_memory_efficient_gradients_match_plain(mask_kind, block):
    batch = (2, 2)
    q, k, v = _qkv(batch, 21, 19, 6, 5, dtype=torch.float64, grad=True)
    mask = _mask(mask_kind, batch, 21, 19)
    g = torch.randn(*batch, 21, 5, dtype=torch.float64)
    grads_plain = torch.autograd.grad((_plain(q, k, v, mask) * g).sum(), (q, k, v))
    out = memory_efficient_attention(q, k, v, mask, block_size=block)
    grads_fast = torch.autograd.grad((out * g).sum(), (q, k, v))
    for name, a, b in zip("qkv", grads_fast, grads_plain, strict=True):
        assert not a.isnan().any(), name
        torch.testing.assert_close(a, b, atol=1e-10, rtol=0, msg=f"grad of {name}")


def test_memory_efficient_gradcheck():
    q, k, v = _qkv((1,), 5, 7, 3, 2, dtype=torch.float64, grad=True)
    mask = torch.rand(5, 7) > 0.4
    mask[0] = False
    assert torch.autograd.gradcheck(
        lambda q, k, v: memory_efficient_attention(q, k, v, mask, block_size=2), (q, k, v)
    )


def test_memory_efficient_never_builds_a_full_score_matrix():
    """No tensor made inside the call has L_q * L_k elements or more (only tiles)."""
    l_q, l_k, block = 96, 80, 16
    q, k, v = _qkv((2,), l_q, l_k, 8, 8)
    mask = torch.rand(1, l_q, l_k) > 0.3  # the caller's mask is not counted
    sizes = []

    class Spy(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and out.data_ptr() != mask.data_ptr():
                sizes.append((func, tuple(out.shape)))
            return out

    with Spy():
        memory_efficient_attention(q, k, v, mask, block_size=block)
    tiles = [s for f, s in sizes if len(s) >= 2 and s[-2:] == (block, block)]
    assert tiles, "expected (block_q, block_k) score tiles"
    too_big = [(f, s) for f, s in sizes
               if len(s) >= 2 and s[-1] > block and s[-2] > block and s[-1] * s[-2] >= l_q * l_k]
    assert not too_big


def _changed_inputs(fn, q, k, v, mask):
    """The names of the inputs that ``fn(q, k, v, mask)`` wrote to (an empty list: none)."""
    before = {name: t.clone() for name, t in zip("qkvm", (q, k, v, mask), strict=True)}
    fn(q, k, v, mask)
    return [
        name
        for name, t in zip("qkvm", (q, k, v, mask), strict=True)
        if not torch.equal(t, before[name])
    ]


def _peak_live_bytes(fn, *inputs):
    """The most bytes that the tensors made by ``fn(*inputs)`` held at once (inputs excluded)."""
    import weakref

    live, peak, seen = [0], [0], {t.untyped_storage().data_ptr() for t in inputs}

    def freed(key, size):
        live[0] -= size
        seen.discard(key)

    class Count(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, tuple | list) else (out,):
                if isinstance(t, torch.Tensor):
                    storage = t.untyped_storage()
                    key, size = storage.data_ptr(), storage.nbytes()
                    if key not in seen and size > 0:
                        seen.add(key)
                        live[0] += size
                        peak[0] = max(peak[0], live[0])
                        weakref.finalize(storage, freed, key, size)
            return out

    with Count():
        fn(*inputs)
    return peak[0]


@pytest.mark.parametrize("mask_kind", [None, "causal", "empty_rows", "late_key"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_memory_efficient_in_place_path_equals_autograd_path(mask_kind, dtype, monkeypatch):
    """Without autograd the tiles are worked on in place; with it, out of place. Same output."""
    import utils.fast_attention as fa

    batch, l_q, l_k = (2, 3), 37, 29
    q, k, v = _qkv(batch, l_q, l_k, 8, 5, dtype=dtype)
    mask = _mask(mask_kind, batch, l_q, l_k)
    calls = []
    for name in ("online_softmax_step", "_online_softmax_step_"):
        real = getattr(fa, name)
        monkeypatch.setattr(
            fa, name, lambda *a, real=real, name=name: (calls.append(name), real(*a))[1]
        )
    for block in (4, (16, 5), 64):
        calls.clear()
        with torch.no_grad():
            fast = memory_efficient_attention(q, k, v, mask, block_size=block)
        assert set(calls) == {"_online_softmax_step_"}, f"no_grad used {set(calls)}"
        calls.clear()
        qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
        slow = memory_efficient_attention(qg, kg, vg, mask, block_size=block)
        assert set(calls) == {"online_softmax_step"}, f"autograd used {set(calls)}"
        assert slow.requires_grad and not fast.requires_grad
        assert not fast.isnan().any(), f"NaN in the in-place output, block {block}"
        torch.testing.assert_close(
            fast,
            slow.detach(),
            atol=ATOL[dtype],
            rtol=0,
            msg=f"in place vs autograd, block {block}",
        )
        torch.testing.assert_close(
            fast,
            _plain(q, k, v, mask),
            atol=ATOL[dtype],
            rtol=0,
            msg=f"in place vs plain attention, block {block}",
        )


@pytest.mark.parametrize("causal", [False, True])
def test_memory_efficient_gradients_match_torch_sdpa(causal):
    import torch.nn.functional as F

    q, k, v = _qkv((2, 2), 33, 33, 8, 6, dtype=torch.float64, grad=True)
    mask = causal_mask(33) if causal else None
    g = torch.randn(2, 2, 33, 6, dtype=torch.float64)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    ours = memory_efficient_attention(q, k, v, mask, block_size=(8, 5))
    torch.testing.assert_close(ours, ref, atol=1e-10, rtol=0, msg="output")
    grads_ref = torch.autograd.grad((ref * g).sum(), (q, k, v))
    grads_ours = torch.autograd.grad((ours * g).sum(), (q, k, v))
    for name, a, b in zip("qkv", grads_ours, grads_ref, strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=0, msg=f"grad of {name}")


def test_memory_efficient_in_place_path_leaves_the_inputs_alone(monkeypatch):
    import utils.fast_attention as fa

    q, k, v = _qkv((2, 2), 20, 24, 8, 8)
    mask = _mask("random", (2, 2), 20, 24)
    for block in (4, (7, 24), 64):  # 64: one tile covers everything (views of whole inputs)
        with torch.no_grad():
            changed = _changed_inputs(
                lambda *a, b=block: memory_efficient_attention(*a, block_size=b), q, k, v, mask
            )
        assert not changed, f"block {block}: the no-grad path wrote to {changed}"
        changed = _changed_inputs(  # no input requires grad: the in-place path as well
            lambda *a, b=block: memory_efficient_attention(*a, block_size=b), q, k, v, mask
        )
        assert not changed, f"block {block}: the in-place path wrote to {changed}"

    # The check can fail: a step that writes into its block of values is caught.
    real = fa._online_softmax_step_

    def writes_to_v(m, l_sum, acc, scores, v_blk):
        v_blk.mul_(2)
        return real(m, l_sum, acc, scores, v_blk)

    monkeypatch.setattr(fa, "_online_softmax_step_", writes_to_v)
    with torch.no_grad():
        assert _changed_inputs(memory_efficient_attention, q, k, v, mask) == ["v"]


def test_memory_efficient_no_grad_holds_the_output_and_one_tile():
    """Without autograd the call's tensors peak at the output, one tile and a few (block_q, d)
    rows: no second copy of the output (a list joined by torch.cat), no second tile alive."""
    batch, l_q, l_k, d_k, d_v, block = (2,), 512, 256, 8, 32, 64
    q, k, v = _qkv(batch, l_q, l_k, d_k, d_v)
    out_bytes, tile_bytes = 2 * l_q * d_v * 4, 2 * block * block * 4
    rows_bytes = 2 * block * (d_k + 2 * d_v) * 4  # scaled q block, accumulator, p @ v
    bound = out_bytes + tile_bytes + rows_bytes + 8 * 1024  # + the (block_q, 1) statistics
    with torch.no_grad():
        peak = _peak_live_bytes(
            lambda q, k, v: memory_efficient_attention(q, k, v, block_size=block), q, k, v
        )
    assert peak <= bound, (
        f"peak {peak} B over output {out_bytes} + tile {tile_bytes} + rows "
        f"{rows_bytes} + 8 KiB = {bound} B"
    )

    def two_copies(q, k, v):  # what a list of blocks joined by torch.cat holds at its end
        parts = [
            memory_efficient_attention(q[..., i : i + block, :], k, v, block_size=block)
            for i in range(0, l_q, block)
        ]
        return torch.cat(parts, dim=-2)

    with torch.no_grad():
        assert _peak_live_bytes(two_copies, q, k, v) > bound  # the bound can fail


def test_memory_efficient_errors():
    q, k, v = _qkv((2,), 4, 5, 3, 3)
    with pytest.raises(ValueError, match="block_size"):
        memory_efficient_attention(q, k, v, block_size=0)
    with pytest.raises(ValueError, match="block_size"):
        memory_efficient_attention(q, k, v, block_size=(2, 3, 4))
    with pytest.raises(ValueError, match="d_k"):
        memory_efficient_attention(q, k[..., :2], v)
    with pytest.raises(ValueError, match="mask"):
        memory_efficient_attention(q, k, v, torch.ones(4, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="bool"):
        memory_efficient_attention(q, k, v, torch.ones(4, 5))
    with pytest.raises(TypeError, match="dtype"):
        memory_efficient_attention(q, k.double(), v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [0, 1, 2, 5, 16, 17, 40, 200])
@pytest.mark.parametrize("batch,length,d_k,d_v", [
    ((), 1, 3, 2), ((2,), 9, 4, 4), ((2, 3), 37, 8, 5), ((1, 2), 64, 16, 16), ((3,), 100, 5, 7),
])
def test_local_matches_masked_plain(batch, length, d_k, d_v, window, causal, dtype):
    q, k, v = _qkv(batch, length, length, d_k, d_v, dtype=dtype, seed=window)
    expected = _plain(q, k, v, local_mask(length, window, causal))
    out = local_attention(q, k, v, window, causal=causal)
    assert out.shape == expected.shape and out.dtype == dtype
    assert not out.isnan().any()
    torch.testing.assert_close(out, expected, atol=ATOL[dtype], rtol=0)


def test_local_random_shapes():
    g = torch.Generator().manual_seed(11)
    for trial in range(25):
        batch = tuple(int(x) for x in torch.randint(1, 4, (int(torch.randint(0, 3, (1,),
                                                                              generator=g)),),
                                                    generator=g))
        length = int(torch.randint(1, 150, (1,), generator=g))
        window = int(torch.randint(0, 70, (1,), generator=g))
        causal = bool(torch.rand(1, generator=g) < 0.5)
        q, k, v = _qkv(batch, length, length, 8, 6, seed=trial)
        torch.testing.assert_close(local_attention(q, k, v, window, causal),
                                   _plain(q, k, v, local_mask(length, window, causal)),
                                   atol=1e-5, rtol=0)


def test_local_gradients_match_masked_plain():
    q, k, v = _qkv((2,), 40, 40, 4, 3, dtype=torch.float64, grad=True)
    for causal in (False, True):
        mask = local_mask(40, 6, causal)
        g = torch.randn(2, 40, 3, dtype=torch.float64)
        want = torch.autograd.grad((_plain(q, k, v, mask) * g).sum(), (q, k, v))
        got = torch.autograd.grad((local_attention(q, k, v, 6, causal) * g).sum(), (q, k, v))
        for a, b in zip(got, want, strict=True):
            assert not a.isnan().any()
            torch.testing.assert_close(a, b, atol=1e-10, rtol=0)


def test_local_scores_grow_as_l_times_window():
    """The largest tensor made inside the call grows linearly in L, not as L**2."""
    window = 8

    def largest(length):
        q, k, v = _qkv((1,), length, length, 4, 4)
        biggest = 0

        class Spy(torch.overrides.TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                nonlocal biggest
                out = func(*args, **(kwargs or {}))
                if isinstance(out, torch.Tensor):
                    biggest = max(biggest, out.numel())
                return out

        with Spy():
            local_attention(q, k, v, window)
        return biggest

    small, large = largest(256), largest(1024)
    assert large <= 4 * small + 64  # linear: 4x the length, at most 4x the memory
    assert large < 1024 * 1024 // 8


def test_local_errors():
    q, k, v = _qkv((2,), 6, 6, 3, 3)
    with pytest.raises(ValueError, match="window"):
        local_attention(q, k, v, -1)
    with pytest.raises(TypeError):
        local_attention(q, k, v, 1.5)
    with pytest.raises(TypeError):
        local_attention(q, k, v, 2, causal="yes")
    q2, k2, v2 = _qkv((2,), 6, 7, 3, 3)
    with pytest.raises(ValueError, match="as many queries as keys"):
        local_attention(q2, k2, v2, 2)


def test_local_empty():
    q, k, v = _qkv((0, 2), 5, 5, 3, 4)
    assert local_attention(q, k, v, 2).shape == (0, 2, 5, 4)
    q, k, v = _qkv((2,), 0, 0, 3, 4)
    assert local_attention(q, k, v, 2).shape == (2, 0, 4)


def test_split_k_one_query_against_torch():
    # decoding: one query per sequence and head against a long cache, scores spread wide
    q, k, v = _qkv((2, 4), 1, 1000, 16, 16, seed=3)
    k = 4 * k
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    for splits in (1, 8, 13, 1000):
        torch.testing.assert_close(split_k_attention(q, k, v, splits), expected, atol=1e-5,
                                   rtol=0)


def test_split_k_chunks_matter():
    # Combining the chunks without their log-sum-exp weights (a plain mean of the chunk
    # averages) is wrong: the test above would catch a function that forgot the rescaling.
    q, k, v = _qkv((), 1, 40, 8, 4, seed=4)
    k = k.clone()
    k[:20] *= 5  # the first chunk's scores dominate
    chunk_means = torch.stack([_plain(q, k[i:i + 20], v[i:i + 20]) for i in (0, 20)]).mean(0)
    out = split_k_attention(q, k, v, 2)
    torch.testing.assert_close(out, _plain(q, k, v), atol=1e-5, rtol=0)
    assert (out - chunk_means).abs().max() > 1e-2


def test_split_k_fully_masked_rows_and_gradients():
    q, k, v = _qkv((2,), 6, 30, 8, 4, seed=5, grad=True)
    mask = torch.rand(6, 30, generator=torch.Generator().manual_seed(0)) > 0.7
    mask[1] = False  # no key at all
    mask[4] = False
    mask[4, -1] = True  # only the last key: every chunk but the last is empty
    out = split_k_attention(q, k, v, 4, mask)
    assert (out[:, 1] == 0).all() and not out.isnan().any()
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    expected = torch.autograd.grad(_plain(q, k, v, mask).square().sum(), (q, k, v))
    for ours, ref in zip(grads, expected, strict=True):
        assert not ours.isnan().any()
        torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)


def test_split_k_degenerate_sizes():
    q, k, v = _qkv((2,), 3, 0, 4, 5)
    assert torch.equal(split_k_attention(q, k, v, 4), torch.zeros(2, 3, 5))
    q, k, v = _qkv((2,), 0, 6, 4, 5)
    assert split_k_attention(q, k, v, 4).shape == (2, 0, 5)


def test_split_k_errors():
    q, k, v = _qkv((2,), 1, 5, 3, 3)
    for bad in (0, -2):
        with pytest.raises(ValueError, match="num_splits"):
            split_k_attention(q, k, v, bad)
    for bad in (2.0, True, "4"):
        with pytest.raises(TypeError, match="num_splits"):
            split_k_attention(q, k, v, bad)
    with pytest.raises(ValueError, match="d_k"):
        split_k_attention(q, k[..., :2], v)
    with pytest.raises(ValueError, match="mask"):
        split_k_attention(q, k, v, 2, torch.ones(4, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="bool"):
        split_k_attention(q, k, v, 2, torch.ones(1, 5))
    with pytest.raises(TypeError, match="dtype"):
        split_k_attention(q, k.double(), v)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fast_attention_on_cuda():
    q, k, v = (t.cuda() for t in _qkv((2, 2), 50, 50, 8, 8))
    mask = torch.rand(50, 50, device="cuda") > 0.5
    out = memory_efficient_attention(q, k, v, mask, block_size=16)
    assert out.device == q.device
    torch.testing.assert_close(out, _plain(q, k, v, mask), atol=1e-5, rtol=0)
    out = local_attention(q, k, v, 5, causal=True)
    assert out.device == q.device
    torch.testing.assert_close(out, _plain(q, k, v, local_mask(50, 5, True, device="cuda")),
                               atol=1e-5, rtol=0)
    out = split_k_attention(q, k, v, 4, mask)
    assert out.device == q.device
    torch.testing.assert_close(out, _plain(q, k, v, mask), atol=1e-5, rtol=0)
