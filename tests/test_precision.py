"""Tests of training on a device and in lower precision, and of the norms in bfloat16.

- ``train(device=...)`` moves the model and every batch; ``device="cpu"`` changes no bit.
- ``train(precision="bf16" | "fp16")`` runs the forward pass under autocast (bfloat16 and
  float16 autocast both run on the CPU), stays close to float32, and for float16 scales the loss
  so that small gradients survive; ``"fp32"`` runs no autocast at all.
- `LayerNorm` and `RMSNorm` compute in float32 when given bfloat16, as PyTorch's kernels and
  `transformers` do, and give float32 inputs exactly the results of the formulas they had.
"""

from __future__ import annotations

from itertools import islice

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from utils import seed_everything
from utils.devices import MixedPrecision
from utils.layers import LayerNorm, RMSNorm
from utils.models import Seq2SeqTransformer
from utils.tasks import ReversalTask
from utils.train import token_cross_entropy, train, train_side_by_side

TASK = ReversalTask(min_len=3, max_len=6)
STEPS = 30


def _model() -> Seq2SeqTransformer:
    seed_everything(0)
    return Seq2SeqTransformer(
        len(TASK.vocab),
        len(TASK.vocab),
        d_model=16,
        nhead=2,
        num_encoder_layers=1,
        num_decoder_layers=1,
        dim_feedforward=32,
        norm_first=True,
    )


def _seq2seq_loss(model, batch):
    logits = model(batch.src, batch.tgt_in, batch.src_mask, batch.tgt_mask)
    return token_cross_entropy(logits, batch.tgt_out)


def _run(steps: int = STEPS, **kwargs):
    """Train the small reversal model; return its history, the model and what loss_fn saw."""
    seen = []

    def loss_fn(model, batch):
        logits = model(batch.src, batch.tgt_in, batch.src_mask, batch.tgt_mask)
        on = torch.is_autocast_enabled("cpu")
        seen.append((on, torch.get_autocast_dtype("cpu") if on else None))
        return token_cross_entropy(logits, batch.tgt_out)

    model = _model()
    history = train(
        model,
        islice(TASK.batches(8, seed=0), steps),
        loss_fn,
        steps=steps,
        lr=1e-2,
        print_fn=None,
        **kwargs,
    )
    return history, model, seen


# ----- device= -------------------------------------------------------------------------------


def test_train_on_the_cpu_is_bit_identical_to_no_device():
    plain, plain_model, _ = _run()
    on_cpu, cpu_model, _ = _run(device="cpu")
    as_device, _, _ = _run(device=torch.device("cpu"))
    assert on_cpu.step_losses == plain.step_losses, "device='cpu' changed the losses"
    assert as_device.step_losses == plain.step_losses
    for (name, a), b in zip(plain_model.named_parameters(), cpu_model.parameters(), strict=True):
        assert torch.equal(a, b), f"device='cpu' changed {name}"


class _Seen(Exception):
    """Raised by a loss_fn once it has looked at its first batch."""


def test_train_moves_the_model_and_every_batch():
    """On the meta device a tensor that was not moved would still say cpu."""
    model = nn.Linear(2, 1)
    got = {}

    def loss_fn(m, batch):
        got["model"] = {p.device for p in m.parameters()}
        got["batch"] = [batch[0].device, batch[1]["y"].device, batch[2]]
        raise _Seen

    with pytest.raises(_Seen):
        train(
            model,
            [(torch.ones(3, 2), {"y": torch.ones(3)}, "label")],
            loss_fn,
            steps=1,
            device="meta",
            print_fn=None,
        )
    meta = torch.device("meta")
    assert got["model"] == {meta}, f"the model is on {got['model']}"
    assert got["batch"] == [meta, meta, "label"], f"the batch is on {got['batch']}"


@pytest.mark.parametrize(
    "kwargs, phrase",
    [
        ({"device": "gpu"}, "device='gpu' is not a device name; available here:"),
        ({"device": "cuda:7"}, "there is no cuda:7 here; available here:"),
        ({"precision": "fp8"}, "precision must be one of 'fp32', 'bf16', 'fp16', got 'fp8'"),
        ({"precision": "float16"}, "must be one of 'fp32', 'bf16', 'fp16'"),
        ({"precision": None}, "got None"),
    ],
)
def test_train_refuses_bad_devices_and_precisions_before_any_step(kwargs, phrase):
    model = nn.Linear(2, 1)
    before = model.weight.detach().clone()
    with pytest.raises(ValueError) as caught:
        train(
            model, [torch.ones(1, 2)] * 2, lambda m, b: m(b).sum(), steps=2, print_fn=None, **kwargs
        )
    assert phrase in str(caught.value), f"the message was: {caught.value}"
    assert torch.equal(model.weight, before)


def test_train_side_by_side_passes_device_and_precision_to_each_run():
    """autocast is per thread: each run in its own thread gets it, as train alone does."""
    alone = [_run(steps=5, device="cpu", precision="bf16")[0].step_losses for _ in range(2)]
    runs = [(_model(), list(islice(TASK.batches(8, seed=0), 5))) for _ in range(2)]
    together = train_side_by_side(
        runs, _seq2seq_loss, steps=5, lr=1e-2, print_fn=None, device="cpu", precision="bf16"
    )
    assert [h.step_losses for h in together] == alone


# ----- precision= ----------------------------------------------------------------------------

BF16_TOLERANCE = 0.05  # largest |loss - float32 loss| over 30 steps (measured: about 0.004)
FP16_TOLERANCE = 0.02  # (measured: about 0.001; float16 has 3 more bits of mantissa)


def test_fp32_runs_no_autocast_and_bf16_fp16_do():
    _, _, fp32 = _run(steps=2)
    _, _, bf16 = _run(steps=2, precision="bf16")
    _, _, fp16 = _run(steps=2, precision="fp16")
    assert fp32 == [(False, None)] * 2, fp32
    assert bf16 == [(True, torch.bfloat16)] * 2, bf16
    assert fp16 == [(True, torch.float16)] * 2, fp16


@pytest.mark.parametrize(
    "precision, tolerance", [("bf16", BF16_TOLERANCE), ("fp16", FP16_TOLERANCE)]
)
def test_lower_precision_training_stays_close_to_float32(precision, tolerance):
    fp32, fp32_model, _ = _run()
    low, low_model, _ = _run(precision=precision)
    worst = max(abs(a - b) for a, b in zip(fp32.step_losses, low.step_losses, strict=True))
    assert worst < tolerance, f"{precision} losses differ from float32's by up to {worst:.4f}"
    assert low.step_losses != fp32.step_losses, f"{precision} gave float32's losses to the bit"
    assert low.skipped_steps == [], low.skipped_steps
    for p in low_model.parameters():  # the weights and the optimizer stay float32
        assert p.dtype == torch.float32
    first, last = low.mean_loss(1, 5), low.mean_loss(STEPS - 4, STEPS)
    assert last < first - 0.3, f"it must still learn: mean loss {first:.3f} -> {last:.3f}"


def _tiny_gradient_loss(model, batch):
    """A loss whose gradient with respect to the float16 activation is 1e-8, below float16's
    smallest subnormal (2**-24, about 6e-8): without scaling it rounds to zero."""
    return (model(batch).float() * 1e-8).sum()


def test_float16_gradients_underflow_without_loss_scaling_and_survive_with_it():
    torch.manual_seed(0)
    x = torch.randn(4, 3)
    reference = nn.Linear(3, 2)
    _tiny_gradient_loss(reference, x).backward()  # float32: the true gradient, about 1e-8
    assert reference.weight.grad.abs().min() > 0

    unscaled = nn.Linear(3, 2)
    unscaled.load_state_dict(reference.state_dict())
    with torch.autocast("cpu", dtype=torch.float16):
        loss = _tiny_gradient_loss(unscaled, x)
    loss.backward()
    assert torch.count_nonzero(unscaled.weight.grad) == 0, (
        f"float16 without scaling kept a gradient: {unscaled.weight.grad}"
    )

    scaled = nn.Linear(3, 2)
    scaled.load_state_dict(reference.state_dict())
    amp = MixedPrecision("fp16", "cpu")
    opt = torch.optim.SGD(scaled.parameters(), lr=0.0)  # look at the gradient, change nothing
    with amp.autocast():
        loss = _tiny_gradient_loss(scaled, x)
    assert amp.step(loss, opt, list(scaled.parameters()), clip=None)
    # the scaler's step divided .grad by the scale: what is left is the true gradient
    torch.testing.assert_close(scaled.weight.grad, reference.weight.grad, rtol=1e-2, atol=0)


def test_train_in_float16_moves_weights_that_unscaled_float16_would_freeze():
    torch.manual_seed(0)
    x = torch.randn(4, 3)
    model = nn.Linear(3, 2)
    before = model.weight.detach().clone()
    history = train(
        model,
        [x] * 3,
        _tiny_gradient_loss,
        steps=3,
        lr=1e-3,
        warmup=0,
        clip=None,
        print_fn=None,
        precision="fp16",
    )
    assert history.skipped_steps == []
    moved = (model.weight - before).abs().min()
    assert moved > 1e-4, f"a weight moved by only {moved:.2e}: its gradient was lost"


def test_the_scaler_skips_overflowing_steps_and_train_records_them():
    """A gradient of 10 per float16 activation, times the initial scale 2**16, overflows
    float16 (largest 65504): the scaler skips the step and halves the scale, four times, until
    10 * 2**12 fits (one row, so the weight's gradient is no larger)."""
    model = nn.Linear(3, 2)
    x = torch.ones(1, 3)
    history = train(
        model,
        [x] * 6,
        lambda m, b: (m(b).float() * 10).sum(),
        steps=6,
        clip=1.0,
        print_fn=None,
        precision="fp16",
    )
    assert history.skipped_steps == [1, 2, 3, 4], history.skipped_steps
    plain = train(
        nn.Linear(3, 2),
        [x] * 6,
        lambda m, b: (m(b).float() * 10).sum(),
        steps=6,
        print_fn=None,
        precision="bf16",
    )
    assert plain.skipped_steps == [], "bfloat16 has float32's range and needs no scaler"


def test_the_scaler_unscales_before_clipping():
    """The true gradient (0.5 everywhere, norm 1.41) is clipped to norm 1, so SGD with lr=1
    moves the weights by exactly 1. Clipping the scaled gradient (2**15 larger) instead would
    move them by 1 / 2**16."""
    model = nn.Linear(3, 2)
    before = [p.detach().clone() for p in model.parameters()]
    amp = MixedPrecision("fp16", "cpu")
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    with amp.autocast():
        loss = (model(torch.ones(1, 3)).float() * 0.5).sum()
    assert amp.step(loss, opt, list(model.parameters()), clip=1.0)
    change = torch.cat([(p - b).flatten() for p, b in zip(model.parameters(), before, strict=True)])
    assert 0.99 < change.norm() < 1.01, f"the update's norm is {change.norm():.4f}, not 1"


def test_mixed_precision_refuses_fp32_and_unknown_precisions():
    with pytest.raises(ValueError, match="plain step"):
        MixedPrecision("fp32", "cpu")
    with pytest.raises(ValueError, match="precision must be one of"):
        MixedPrecision("half", "cpu")


# ----- the norms in bfloat16 and float32 -----------------------------------------------------


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance between two bfloat16 tensors in units in the last place."""

    def ordered(t):
        bits = t.contiguous().view(torch.int16).to(torch.int32)
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)

    return int((ordered(a) - ordered(b)).abs().max())


def _inputs(d: int = 256) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    scale = torch.logspace(-2, 2, 8)[:, None, None]  # small and large rows
    return (torch.randn(8, 16, d, generator=g) * scale + 0.5 * scale).to(torch.bfloat16)


def _gain(module: nn.Module) -> nn.Module:
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return module


@pytest.mark.parametrize("eps", [1e-6, 1e-5])
@torch.no_grad()
def test_rms_norm_in_bfloat16_is_llamas(eps):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    x = _inputs()
    ours = _gain(RMSNorm(256, eps=eps)).to(torch.bfloat16)
    llama = LlamaRMSNorm(256, eps=eps).to(torch.bfloat16)
    llama.load_state_dict(ours.state_dict())
    y = ours(x)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, llama(x)), f"{_ulps(y, llama(x))} ulps from LlamaRMSNorm"
    # Llama's order: normalize in float32, round to bfloat16, then multiply by the gain.
    h = x.float()
    reference = (h * torch.rsqrt((h * h).mean(-1, keepdim=True) + eps)).bfloat16() * ours.weight
    assert torch.equal(y, reference)
    # torch.nn.RMSNorm multiplies before it rounds: one unit in the last place apart at most.
    torchs = nn.RMSNorm(256, eps=eps).to(torch.bfloat16)
    torchs.load_state_dict(ours.state_dict())
    assert _ulps(y, torchs(x)) <= 1, f"{_ulps(y, torchs(x))} ulps from torch.nn.RMSNorm"
    without_gain = RMSNorm(256, eps=eps, elementwise_affine=False)(x)
    assert _ulps(without_gain, F.rms_norm(x.float(), (256,), eps=eps).bfloat16()) == 0


def _bf16_ulp(v: torch.Tensor) -> torch.Tensor:
    """The spacing of bfloat16 numbers at each value of ``v`` (8 significant bits)."""
    _, exponent = torch.frexp(v.float().abs().clamp_min(torch.finfo(torch.bfloat16).tiny))
    return torch.ldexp(torch.ones_like(v, dtype=torch.float32), exponent - 8)


def _excess_over_one_ulp(y: torch.Tensor, exact: torch.Tensor, terms: torch.Tensor) -> float:
    """How far a bfloat16 ``y`` lies beyond one bfloat16 unit of the float32 value ``exact``.

    Where gain * x_hat and the bias nearly cancel, float32's own rounding of the two terms
    (about 2**-24 of their size ``terms``) is more than one unit of the small result, so that
    much is allowed too (2**-20 of the terms: 16 float32 units, still 16 times finer than one
    bfloat16 unit of them). Returns the largest excess, 0.0 when there is none."""
    allowed = _bf16_ulp(exact) + 2.0**-20 * terms
    return float(((y.float() - exact).abs() - allowed).clamp_min(0).max())


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "from-scratch"])
@torch.no_grad()
def test_layer_norm_in_bfloat16_is_float32_rounded_once(fused):
    x = _inputs()
    ours = _gain(LayerNorm(256, fused=fused)).to(torch.bfloat16)
    torchs = nn.LayerNorm(256).to(torch.bfloat16)  # what GPT-2 in transformers uses
    torchs.load_state_dict(ours.state_dict())
    y = ours(x)
    assert y.dtype == torch.bfloat16
    w, b = ours.weight.float(), ours.bias.float()
    x_hat = F.layer_norm(x.float(), (256,), eps=1e-5)
    exact = x_hat * w + b  # computed in float32, never rounded to bfloat16
    excess = _excess_over_one_ulp(y, exact, (x_hat * w).abs() + b.abs())
    assert excess == 0.0, f"LayerNorm is {excess:.3g} beyond one bfloat16 unit of float32's"
    differ = int((y != torchs(x)).sum())
    if fused:  # the very call of torch.nn.LayerNorm
        assert differ == 0, f"{differ} elements differ from torch.nn.LayerNorm"
    else:  # the same float32 function summed in another order: a value near a tie may round
        # the other way, one unit in the last place, at a few elements
        assert differ <= 1e-3 * y.numel(), f"{differ} elements differ from torch.nn.LayerNorm"


@torch.no_grad()
def test_norms_in_float32_and_float64_are_the_formulas_to_the_bit():
    """The upcast is no operation for float32 and float64: the results are those of the
    formulas as they were written before it, bit for bit."""
    for dtype in (torch.float32, torch.float64):
        x = _inputs().to(dtype)
        rms = _gain(RMSNorm(256)).to(dtype)
        expected = x * torch.rsqrt((x * x).mean(dim=-1, keepdim=True) + 1e-6) * rms.weight
        assert torch.equal(rms(x), expected), f"RMSNorm changed in {dtype}"
        norm = _gain(LayerNorm(256, fused=False)).to(dtype)
        centred = x - x.mean(dim=-1, keepdim=True)
        var = (centred**2).mean(dim=-1, keepdim=True)
        expected = centred / torch.sqrt(var + 1e-5) * norm.weight + norm.bias
        assert torch.equal(norm(x), expected), f"LayerNorm (from scratch) changed in {dtype}"
        norm.fused = True
        expected = F.layer_norm(x, (256,), norm.weight, norm.bias, 1e-5)
        assert torch.equal(norm(x), expected), f"LayerNorm (fused) changed in {dtype}"
        assert rms(x).dtype == norm(x).dtype == dtype
