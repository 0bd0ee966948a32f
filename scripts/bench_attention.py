"""Rows (a) to (c) of ``make bench``: the book's attention against the PyTorch code a user would
pick instead, timed with `bench_harness.interleave` (CPU time per round, order reversed every
round, outputs asserted equal to rounding before timing).

(a) `utils.attention.MultiHeadAttention` against "the SDPA block" (what one writes by hand: one
    fused Q/K/V projection, ``F.scaled_dot_product_attention``, the output projection) and
    against ``nn.MultiheadAttention(need_weights=False)``, all three holding the same weights;
    in evaluation mode (forward under ``torch.inference_mode()``) and in training mode
    (forward and backward), without a mask and causal (ours ``is_causal=True``, the block
    ``is_causal=True``, ``nn.MultiheadAttention`` its causal mask with the ``is_causal`` hint).
(b) `scaled_dot_product_attention` (chapter 1's, which forms the weights) and
    `memory_efficient_attention` (chapter 13's online softmax) against
    ``F.scaled_dot_product_attention``: time and peak memory (each variant once, in a fresh
    process: `benchmark.measure_memory`).
(c) `local_attention` (a band of ``window`` keys) against ``F.scaled_dot_product_attention``
    under the same banded mask, as L grows; time and peak memory.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from bench_harness import interleave, make_row, ratio_summary
from torch import nn

from utils.attention import MultiHeadAttention, scaled_dot_product_attention
from utils.fast_attention import local_attention, memory_efficient_attention
from utils.masks import local_mask

MHA_GOAL = 1.2  # MultiHeadAttention's time over nn.MultiheadAttention's, at most, every row
CAUSAL_GOAL = 1.1  # causal MultiHeadAttention over the SDPA block at the causal goal's L
ME_TIME_GOAL = 1.5  # memory_efficient_attention's time over F.scaled_dot_product_attention's
ME_MEMORY_GOAL = 1.0  # ... and its peak memory over F.scaled_dot_product_attention's
PLAIN_MEMORY_GOAL = 1 / 8  # memory_efficient_attention's peak over chapter 1's function's
MIB = 2**20


def _close(a: object, b: object) -> bool:
    """Outputs equal to float32 rounding: tensors (or tuples of them) within 2e-5 + 1e-4 |b|."""
    if isinstance(a, tuple):
        return all(_close(x, y) for x, y in zip(a, b, strict=True))
    return a.shape == b.shape and bool(torch.allclose(a, b, atol=2e-5, rtol=1e-4))


class SDPABlock(nn.Module):
    """Self-attention as one writes it with PyTorch's kernel: (B, L, d) -> (B, L, d), the
    weights of an ``nn.MultiheadAttention`` (its fused ``in_proj``)."""

    def __init__(self, ref: nn.MultiheadAttention):
        super().__init__()
        self.h = ref.num_heads
        self.qkv = nn.Linear(ref.embed_dim, 3 * ref.embed_dim)
        self.out = nn.Linear(ref.embed_dim, ref.embed_dim)
        with torch.no_grad():
            self.qkv.weight.copy_(ref.in_proj_weight)
            self.qkv.bias.copy_(ref.in_proj_bias)
            self.out.weight.copy_(ref.out_proj.weight)
            self.out.bias.copy_(ref.out_proj.bias)

    def forward(self, x: torch.Tensor, is_causal: bool = False) -> torch.Tensor:
        b, length, d = x.shape
        q, k, v = self.qkv(x).view(b, length, 3, self.h, d // self.h).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
        return self.out(out.transpose(1, 2).reshape(b, length, d))


def _contenders(x: torch.Tensor, ours: nn.Module, block: nn.Module, ref: nn.Module,
                causal: bool, train: bool) -> dict:
    """name -> a call returning the output (and, in training, the input's gradient)."""
    length = x.shape[1]
    ref_mask = (torch.ones(length, length, dtype=torch.bool, device=x.device).triu(1)
                if causal else None)  # nn.MultiheadAttention: True = may NOT attend
    calls = {
        "ours": lambda t: ours(t, t, t, is_causal=True) if causal else ours(t, t, t),
        "block": lambda t: block(t, is_causal=causal),
        "nn": lambda t: ref(t, t, t, attn_mask=ref_mask, is_causal=causal,
                            need_weights=False)[0],
    }
    for m in (ours, block, ref):
        m.train(train)

    def run(call: object) -> object:
        if not train:
            with torch.inference_mode():
                return call(x)
        t = x.detach().requires_grad_()
        for m in (ours, block, ref):
            m.zero_grad(set_to_none=True)
        out = call(t)
        out.sum().backward()
        return out.detach(), t.grad

    return {name: (lambda c=call: run(c)) for name, call in calls.items()}


def mha_rows(shapes: list[tuple], causal_length: int, rounds: int, device: torch.device,
             quick: bool) -> list[dict]:
    rows = []
    for b, length, d, h in shapes:
        torch.manual_seed(0)
        ref = nn.MultiheadAttention(d, h, batch_first=True).to(device)
        ours, block = MultiHeadAttention.from_torch(ref), SDPABlock(ref).to(device)
        x = torch.randn(b, length, d, device=device)
        for causal in (False, True):
            for train in (False, True):
                timings = interleave(_contenders(x, ours, block, ref, causal, train), rounds,
                                     same=_close, device=device)
                mode = ("training: forward + backward" if train
                        else "evaluation: forward, inference mode")
                case = f"B={b}, L={length}, d={d}, h={h}, {'causal' if causal else 'no mask'}"
                for ref_name, label in (("block", "the SDPA block"),
                                        ("nn", "nn.MultiheadAttention")):
                    s = ratio_summary(timings, "ours", ref_name)
                    goal = value = met = None
                    if ref_name == "nn":
                        goal, value = f"at most {MHA_GOAL:g}x", s["ratio_median"]
                    elif causal and length == causal_length:
                        goal, value = f"at most {CAUSAL_GOAL:g}x (causal, L={length})", \
                            s["ratio_median"]
                    if goal is not None and not quick:
                        met = value <= (MHA_GOAL if ref_name == "nn" else CAUSAL_GOAL)
                    rows.append(make_row(
                        "(a) attention module", case, "MultiHeadAttention", label, s,
                        setup=f"{mode}; 1 thread", same="outputs (and input gradients) "
                        "equal to 2e-5", goal=goal, goal_value=value, goal_met=met))
    return rows


def _plain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Chapter 1's function's output (its weights dropped)."""
    return scaled_dot_product_attention(q, k, v)[0]


def _inputs(length: int, heads: int, d_k: int, device: torch.device) -> tuple:
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(1, heads, length, d_k, generator=g).to(device) for _ in range(3))


def sdpa_rows(s: dict, rounds: int, device: torch.device, quick: bool,
              memory: object) -> list[dict]:
    """Rows (b); ``memory(variant, length)`` measures a variant's peak in a fresh process."""
    rows = []
    heads, d_k, block = s["heads"], s["d_k"], s["block"]
    for length in s["lengths"]:
        q, k, v = _inputs(length, heads, d_k, device)
        calls = {"torch": partial(F.scaled_dot_product_attention, q, k, v),
                 "memory_efficient": partial(memory_efficient_attention, q, k, v,
                                             block_size=block)}
        if length <= s["plain_up_to"]:
            calls["plain"] = partial(_plain, q, k, v)
        with torch.inference_mode():
            timings = interleave(calls, rounds, same=_close, device=device)
        peaks = {name: memory(variant, length) for name, variant in (
            ("torch", "torch_sdpa"), ("memory_efficient", "memory_efficient"),
            ("plain", "utils_sdpa")) if name in calls}
        flops = 4 * length * length * d_k * heads
        case = f"L={length}, h={heads}, d_k={d_k}"
        for name, label in (("memory_efficient", f"memory_efficient_attention (block {block})"),
                            ("plain", "scaled_dot_product_attention (chapter 1)")):
            if name not in calls:
                continue
            summary = ratio_summary(timings, name, "torch")
            mem_ratio = peaks[name] / max(peaks["torch"], 1)
            extra = {"ours_mib": peaks[name] / MIB, "ref_mib": peaks["torch"] / MIB,
                     "memory_ratio": mem_ratio}
            goal = value = met = None
            note = (f"{flops / timings[name].cpu_median / 1e9:.1f} vs "
                    f"{flops / timings['torch'].cpu_median / 1e9:.1f} GFLOP/s")
            if name == "memory_efficient":
                goal = (f"time at most {ME_TIME_GOAL:g}x and peak memory at most "
                        f"{ME_MEMORY_GOAL:g}x F.scaled_dot_product_attention's")
                value = summary["ratio_median"]
                met = None if quick else (value <= ME_TIME_GOAL and mem_ratio <= ME_MEMORY_GOAL)
                if "plain" in peaks:
                    plain = peaks[name] / max(peaks["plain"], 1)
                    extra["over_plain_memory"] = plain
                    judged = ("not judged" if quick
                              else "met" if plain <= PLAIN_MEMORY_GOAL else "NOT met")
                    note += (f"; peak {plain:.3f} of chapter 1's function's (goal at most "
                             f"{PLAIN_MEMORY_GOAL:.3f}: {judged})")
            rows.append(make_row("(b) attention function", case, label,
                                 "F.scaled_dot_product_attention", summary,
                                 setup="inference mode, 1 thread", same="outputs equal to 2e-5",
                                 goal=goal, goal_value=value, goal_met=met, note=note, **extra))
    return rows


def local_rows(s: dict, rounds: int, device: torch.device, memory: object) -> list[dict]:
    """Rows (c); ``memory(variant, length)`` as in `sdpa_rows`."""
    rows = []
    window, heads, d_k = s["window"], s["heads"], s["d_k"]
    for length in s["lengths"]:
        q, k, v = _inputs(length, heads, d_k, device)
        mask = local_mask(length, window, device=device)
        with torch.inference_mode():
            timings = interleave({
                "local": partial(local_attention, q, k, v, window),
                "torch": partial(F.scaled_dot_product_attention, q, k, v, attn_mask=mask),
            }, rounds, same=_close, device=device)
        peaks = {name: memory(variant, length) for name, variant in (
            ("local", "local"), ("torch", "torch_sdpa_banded"))}
        rows.append(make_row(
            "(c) local attention", f"L={length}, window={window}, h={heads}, d_k={d_k}",
            "local_attention", "F.scaled_dot_product_attention(local_mask)",
            ratio_summary(timings, "local", "torch"), setup="inference mode, 1 thread",
            same="outputs equal to 2e-5", ours_mib=peaks["local"] / MIB,
            ref_mib=peaks["torch"] / MIB, memory_ratio=peaks["local"] / max(peaks["torch"], 1)))
    return rows
