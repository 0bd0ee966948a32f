"""Tests of utils.preference: the DPO loss against its closed form, answer log-probabilities."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from utils.models import DecoderOnlyLM
from utils.preference import dpo_loss, sequence_log_probs


def _sigmoid(z: float) -> float:
    return 1 / (1 + math.exp(-z))


def test_dpo_loss_equals_the_closed_form_and_its_gradient():
    # hand-made log-probabilities: the policy moved towards the chosen answer of pair 0 and
    # towards the rejected one of pair 1
    pc = torch.tensor([-1.0, -4.0], dtype=torch.float64, requires_grad=True)
    pr = torch.tensor([-3.0, -1.5], dtype=torch.float64, requires_grad=True)
    rc = torch.tensor([-2.0, -3.0], dtype=torch.float64)
    rr = torch.tensor([-2.0, -2.0], dtype=torch.float64)
    beta = 0.5
    loss, chosen, rejected = dpo_loss(pc, pr, rc, rr, beta)
    margins = [beta * ((-1 + 2) - (-3 + 2)), beta * ((-4 + 3) - (-1.5 + 2))]  # [1.0, -0.75]
    expected = sum(math.log(1 + math.exp(-m)) for m in margins) / 2
    assert abs(loss.item() - expected) < 1e-12, f"loss {loss.item()} != closed form {expected}"
    assert chosen.tolist() == [0.5, -0.5] and rejected.tolist() == [-0.5, 0.25], (
        f"rewards {chosen.tolist()}, {rejected.tolist()}"
    )
    assert not chosen.requires_grad and not rejected.requires_grad
    loss.backward()
    # d loss / d log pi(y_w) = -beta * sigmoid(-margin) / B: a pair the policy already ranks
    # well weighs little, a pair it ranks wrongly weighs much
    weights = [beta * _sigmoid(-m) / 2 for m in margins]
    grad_c = [-w for w in weights]
    assert torch.allclose(pc.grad, torch.tensor(grad_c, dtype=torch.float64), atol=1e-12), (
        f"gradient of the chosen log-probs {pc.grad.tolist()}, expected {grad_c}"
    )
    assert torch.allclose(pr.grad, torch.tensor(weights, dtype=torch.float64), atol=1e-12)
    assert pc.grad[1].abs() > pc.grad[0].abs(), "the wrongly ranked pair must weigh more"


def test_the_closed_form_check_catches_a_sign_error():
    pc, pr = torch.tensor([-1.0]), torch.tensor([-3.0])
    rc = rr = torch.tensor([-2.0])
    loss = dpo_loss(pc, pr, rc, rr, 1.0)[0].item()
    flipped = -F.logsigmoid(torch.tensor(-2.0)).item()  # rejected minus chosen
    assert abs(loss - flipped) > 1.0, f"a flipped margin gives {flipped}, the loss {loss}"


def _model():
    torch.manual_seed(0)
    return (
        DecoderOnlyLM(30, d_model=16, nhead=2, num_layers=1, dim_feedforward=32, max_len=16)
        .double()
        .eval()
    )


def _loop_log_probs(model, tokens, prompt_lengths, lengths):
    """Answer log-probabilities one row and one token at a time."""
    out = []
    for row, p, n in zip(tokens, prompt_lengths.tolist(), lengths.tolist(), strict=True):
        logits = model(row[None, :n])[0]
        out.append(sum(logits[t - 1].log_softmax(-1)[row[t]].item() for t in range(p, n)))
    return out


def test_sequence_log_probs_equals_a_loop_and_ignores_padding():
    model = _model()
    tokens = torch.randint(0, 30, (3, 9), generator=torch.Generator().manual_seed(1))
    prompt, lengths = torch.tensor([1, 4, 3]), torch.tensor([9, 6, 4])
    with torch.no_grad():
        got = sequence_log_probs(model, tokens, prompt, lengths)
        padded = tokens.clone()
        padded[1, 6:], padded[2, 4:] = 7, 0
        again = sequence_log_probs(model, padded, prompt, lengths)
    expected = _loop_log_probs(model, tokens, prompt, lengths)
    gap = max(abs(a - b) for a, b in zip(got.tolist(), expected, strict=True))
    assert gap < 1e-10, f"sequence_log_probs {got.tolist()} != loop {expected}"
    assert torch.equal(got, again), "the padding changed an answer's log-probability"
    # an independent reference: cross-entropy with the prompt and padding targets ignored
    targets = tokens[:, 1:].clone()
    pos = torch.arange(1, 9)
    targets[(pos < prompt[:, None]) | (pos >= lengths[:, None])] = -100
    with torch.no_grad():
        ce = F.cross_entropy(model(tokens[:, :-1]).transpose(1, 2), targets, reduction="none")
    gap_ce = (got + ce.sum(-1)).abs().max().item()
    assert gap_ce < 1e-10, f"sequence_log_probs differs from -sum cross-entropy by {gap_ce}"
    assert got.shape == (3,)


def test_an_off_by_one_prompt_is_caught():
    model = _model()
    tokens = torch.randint(0, 30, (2, 8), generator=torch.Generator().manual_seed(2))
    prompt = torch.tensor([3, 5])
    with torch.no_grad():
        right = sequence_log_probs(model, tokens, prompt)
        shifted = sequence_log_probs(model, tokens, prompt + 1)  # first answer token dropped
    assert (right - shifted).abs().min() > 1e-3, (
        f"dropping the first answer token went unnoticed: {right.tolist()} {shifted.tolist()}"
    )


def test_gradient_reaches_the_model():
    model = _model().train()
    tokens = torch.randint(0, 30, (2, 6), generator=torch.Generator().manual_seed(3))
    sequence_log_probs(model, tokens, torch.tensor([2, 3])).sum().backward()
    assert model.head.bias.grad is not None and model.head.bias.grad.abs().sum() > 0


def test_errors_name_what_was_expected():
    x = torch.zeros(2)
    with pytest.raises(ValueError, match=r"shape of policy_chosen_logps"):
        dpo_loss(x, torch.zeros(3), x, x, 0.1)
    with pytest.raises(ValueError, match="beta"):
        dpo_loss(x, x, x, x, 0.0)
    with pytest.raises(TypeError, match="floating-point"):
        dpo_loss(x.long(), x, x, x, 0.1)
    model, tokens = _model(), torch.zeros(2, 5, dtype=torch.long)
    with pytest.raises(ValueError, match=r"prompt length must be in \[1, length - 1\]"):
        sequence_log_probs(model, tokens, torch.tensor([0, 2]))
    with pytest.raises(ValueError, match=r"prompt length must be in \[1, length - 1\]"):
        sequence_log_probs(model, tokens, torch.tensor([2, 5]))
    with pytest.raises(ValueError, match=r"shape \(B=2,\)"):
        sequence_log_probs(model, tokens, torch.tensor([2]))
    with pytest.raises(ValueError, match="lengths must be in"):
        sequence_log_probs(model, tokens, torch.tensor([1, 1]), torch.tensor([5, 6]))
    with pytest.raises(TypeError, match="integer"):
        sequence_log_probs(model, tokens.double(), torch.tensor([1, 1]))
