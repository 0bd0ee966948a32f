"""Tests of utils.lora: LoRA adapters on the book's linear layers, proved equal to peft's."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn

from utils.lora import (
    LoRALinear,
    add_lora,
    lora_layers,
    merge_lora,
    optimizer_state_bytes,
    trainable_parameters,
)
from utils.models import DecoderOnlyLM

TARGETS = ["w_q", "w_k", "w_v", "w_o", "linear1", "linear2"]
R, ALPHA = 4, 8.0


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return (
        DecoderOnlyLM(
            50, d_model=16, nhead=2, num_layers=2, dim_feedforward=32, max_len=12, tie_output=False
        )
        .double()
        .eval()
    )


def _pair(adapter=LoRALinear, targets=TARGETS):
    """Our adapted model and peft's, on the same base weights and the same (random, B != 0)
    adapter values. ``adapter`` builds our layers (a broken subclass for the failing tests)."""
    base = _model()
    theirs = get_peft_model(
        copy.deepcopy(base),
        LoraConfig(r=R, lora_alpha=ALPHA, target_modules=targets, lora_dropout=0.0),
    )
    ours = base
    ours.requires_grad_(False)
    for name, module in list(ours.named_modules()):
        if name and any(name.endswith("." + t) for t in targets):
            parent, _, child = name.rpartition(".")
            setattr(ours.get_submodule(parent), child, adapter(module, R, ALPHA))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, layer in lora_layers(ours):
            layer.lora_A.normal_()
            layer.lora_B.normal_()
            peft_layer = theirs.base_model.model.get_submodule(name)
            peft_layer.lora_A["default"].weight.copy_(layer.lora_A)
            peft_layer.lora_B["default"].weight.copy_(layer.lora_B)
    return ours, theirs


def _gaps(ours, theirs) -> dict[str, float]:
    """The largest |difference| of the outputs and of every adapter's gradients."""
    tokens = torch.randint(0, 50, (3, 10), generator=torch.Generator().manual_seed(2))
    out_ours, out_theirs = ours(tokens), theirs(tokens)
    (out_ours.square().mean() + out_ours.sum()).backward()
    (out_theirs.square().mean() + out_theirs.sum()).backward()
    grad_a = grad_b = 0.0
    for name, layer in lora_layers(ours):
        peft_layer = theirs.base_model.model.get_submodule(name)
        grad_a = max(
            grad_a,
            (layer.lora_A.grad - peft_layer.lora_A["default"].weight.grad).abs().max().item(),
        )
        grad_b = max(
            grad_b,
            (layer.lora_B.grad - peft_layer.lora_B["default"].weight.grad).abs().max().item(),
        )
    return {
        "output": (out_ours - out_theirs).abs().max().item(),
        "grad A": grad_a,
        "grad B": grad_b,
    }


def test_outputs_and_gradients_equal_peft():
    ours, theirs = _pair()
    gaps = _gaps(ours, theirs)
    assert max(gaps.values()) < 1e-6, f"LoRA differs from peft: {gaps}"
    assert trainable_parameters(ours) == theirs.get_nb_trainable_parameters(), (
        f"trainable parameters {trainable_parameters(ours)} != peft's "
        f"{theirs.get_nb_trainable_parameters()}"
    )


class _NoScaling(LoRALinear):
    def forward(self, x):
        return self.base(x) + x @ self.lora_A.T @ self.lora_B.T  # alpha / r forgotten


class _InvertedScale(LoRALinear):
    def forward(self, x):
        return self.base(x) + x @ self.lora_A.T @ self.lora_B.T * (self.r / self.alpha)


@pytest.mark.parametrize("broken", [_NoScaling, _InvertedScale], ids=["no-scaling", "r/alpha"])
def test_the_peft_check_catches_a_broken_adapter(broken):
    gaps = _gaps(*_pair(broken))
    assert gaps["output"] > 1e-3 and gaps["grad B"] > 1e-3, (
        f"a broken adapter ({broken.__name__}) passed the peft check: {gaps}"
    )


def test_merge_equals_unmerged_and_peft_merge_and_unload():
    ours, theirs = _pair()
    tokens = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        unmerged = ours(tokens)
        merged_model = merge_lora(copy.deepcopy(ours))
        merged = merged_model(tokens)
        peft_merged = theirs.merge_and_unload()(tokens)
    assert not list(lora_layers(merged_model)), "merge_lora left an adapter behind"
    gap, gap_peft = (
        (merged - unmerged).abs().max().item(),
        (merged - peft_merged).abs().max().item(),
    )
    assert gap < 1e-6 and gap_peft < 1e-6, (
        f"merged vs unmerged {gap:.1e}, merged vs peft's merge_and_unload {gap_peft:.1e}"
    )
    for name, module in merged_model.named_modules():
        assert type(module) is not LoRALinear, f"{name} is still a LoRALinear"


def test_a_merge_without_the_scale_is_caught():
    ours, _ = _pair()
    layer = next(lora_layers(ours))[1]
    wrong = layer.base.weight + layer.lora_B @ layer.lora_A  # scaling forgotten
    gap = (layer.merge().weight - wrong).abs().max().item()
    assert gap > 1e-3, f"a merge without alpha / r = {layer.scaling} was not told apart: {gap}"


def test_starts_unchanged_with_b_zero_and_a_as_peft_draws_it():
    base = _model()
    tokens = torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        before = base(tokens)
        adapted = add_lora(copy.deepcopy(base), TARGETS, r=R, alpha=ALPHA)
        gap = (adapted(tokens) - before).abs().max().item()
    assert gap == 0.0, f"the adapted model does not start as the base model: {gap}"
    for name, layer in lora_layers(adapted):
        assert not layer.lora_B.any(), f"{name}: B does not start at zero"
        bound = 1 / math.sqrt(layer.in_features)  # kaiming_uniform_(a=sqrt(5))
        assert 0.5 * bound < layer.lora_A.abs().max() <= bound, (
            f"{name}: A's largest |value| {layer.lora_A.abs().max():.3f}, bound {bound:.3f}"
        )
        assert layer.scaling == ALPHA / R


def test_add_lora_matches_peft_names_and_freezes_the_rest():
    for targets in (["w_q", "w_v"], r".*\.ff\.linear[12]", ["head.proj", "w_o"]):
        ours = add_lora(_model(), targets, r=2, alpha=4.0)
        theirs = get_peft_model(_model(), LoraConfig(r=2, lora_alpha=4.0, target_modules=targets))
        peft_names = {
            n.removeprefix("base_model.model.")
            for n, m in theirs.named_modules()
            if hasattr(m, "lora_A") and n.startswith("base_model.model.")
        }
        our_names = {n for n, _ in lora_layers(ours)}
        assert our_names == peft_names, f"{targets}: ours {our_names}, peft {peft_names}"
        trainable = {n for n, p in ours.named_parameters() if p.requires_grad}
        assert all(n.endswith(("lora_A", "lora_B")) for n in trainable), trainable
        assert trainable_parameters(ours) == theirs.get_nb_trainable_parameters()


def test_optimizer_state_is_two_moments_per_trainable_parameter():
    model = add_lora(_model(), TARGETS, r=R, alpha=ALPHA)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    assert optimizer_state_bytes(opt) == 0, "state before the first step"
    model(torch.zeros(1, 4, dtype=torch.long)).sum().backward()
    opt.step()
    trainable, _ = trainable_parameters(model)
    tensors = sum(1 for p in model.parameters() if p.requires_grad)
    step_bytes = sum(s["step"].numel() * s["step"].element_size() for s in opt.state.values())
    expected = 2 * trainable * 8 + step_bytes  # float64 moments
    assert optimizer_state_bytes(opt) == expected, (
        f"optimizer state {optimizer_state_bytes(opt)} bytes, expected {expected} for "
        f"{trainable} trainable scalars in {tensors} tensors"
    )


def test_errors_name_what_was_expected():
    with pytest.raises(TypeError, match="nn.Linear"):
        LoRALinear(nn.Conv1d(2, 2, 1), 2, 4.0)
    with pytest.raises(ValueError, match="positive int"):
        LoRALinear(nn.Linear(3, 3), 0, 4.0)
    with pytest.raises(ValueError, match="alpha"):
        LoRALinear(nn.Linear(3, 3), 2, 0.0)
    with pytest.raises(ValueError, match="match no module"):
        add_lora(_model(), ["w_z"], 2, 4.0)
    with pytest.raises(ValueError, match="must be an nn.Linear"):
        add_lora(_model(), ["norm1"], 2, 4.0)
    twice = add_lora(_model(), ["w_q"], 2, 4.0)
    with pytest.raises(ValueError, match="already has"):
        add_lora(twice, ["w_q"], 2, 4.0)
    with pytest.raises(TypeError, match="target_modules"):
        add_lora(_model(), [3], 2, 4.0)
    with pytest.raises(TypeError, match="Optimizer"):
        optimizer_state_bytes("adam")
