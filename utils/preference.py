"""Learning from preferences: direct preference optimization (DPO, chapter 20).

A preference set holds, for each prompt x, an answer people prefer, y_w ("chosen"), and one
they do not, y_l ("rejected"). DPO (Rafailov et al. 2023) trains a policy pi directly on the
pairs, against a frozen reference model pi_ref (the model before this training):

    loss = -log sigmoid(beta * [(log pi(y_w|x) - log pi_ref(y_w|x))
                               - (log pi(y_l|x) - log pi_ref(y_l|x))]),

where beta * (log pi - log pi_ref) is the *implicit reward* of an answer. ``sequence_log_probs``
gives the log-probabilities of whole answers, ``dpo_loss`` the loss and the two rewards.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._validation import (
    InputTypeError,
    require_floating,
    require_rank,
    require_real,
    require_tensor,
    shape_str,
    type_name,
)

__all__ = ["dpo_loss", "sequence_log_probs"]


def dpo_loss(policy_chosen_logps: torch.Tensor, policy_rejected_logps: torch.Tensor,
             ref_chosen_logps: torch.Tensor, ref_rejected_logps: torch.Tensor,
             beta: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The DPO loss of a batch of preference pairs.

    Args:
        policy_chosen_logps: log pi(y_w | x), (B,) floating point, with gradient.
        policy_rejected_logps: log pi(y_l | x), (B,).
        ref_chosen_logps: log pi_ref(y_w | x), (B,) (no gradient is taken through it).
        ref_rejected_logps: log pi_ref(y_l | x), (B,).
        beta: the strength of the pull towards the reference, a finite number > 0.

    Returns:
        ``(loss, chosen_rewards, rejected_rewards)``: the mean over the batch of
        -log sigmoid(r_w - r_l), a scalar, and the implicit rewards
        r = beta * (log pi - log pi_ref) of the chosen and rejected answers, (B,) each,
        detached (they are for watching training, not for its gradient).

    Raises:
        InputTypeError: for a non-tensor, a non-floating tensor or a ``beta`` that is not a
            number.
        ValueError: when the four are not (B,) tensors of the same shape, or beta <= 0.
    """
    named = {"policy_chosen_logps": policy_chosen_logps,
             "policy_rejected_logps": policy_rejected_logps,
             "ref_chosen_logps": ref_chosen_logps, "ref_rejected_logps": ref_rejected_logps}
    for name, t in named.items():
        require_tensor(name, t)
        require_floating(name, t)
        require_rank(name, t, "(B,)", rank=1)
        if t.shape != policy_chosen_logps.shape:
            raise ValueError(f"{name} must have the shape of policy_chosen_logps "
                             f"{shape_str(policy_chosen_logps)}, got {shape_str(t)}")
    beta = require_real("beta", beta, low=0.0, low_open=True)
    chosen = beta * (policy_chosen_logps - ref_chosen_logps.detach())
    rejected = beta * (policy_rejected_logps - ref_rejected_logps.detach())
    loss = -F.logsigmoid(chosen - rejected).mean()
    return loss, chosen.detach(), rejected.detach()


def _check_lengths(tokens: torch.Tensor, prompt_lengths: object,
                   lengths: object) -> tuple[torch.Tensor, torch.Tensor]:
    b, length = tokens.shape
    out = []
    for name, t in (("prompt_lengths", prompt_lengths), ("lengths", lengths)):
        if t is None:
            t = torch.full((b,), length, device=tokens.device)
        require_tensor(name, t)
        if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            raise InputTypeError(f"{name} must be an integer tensor, got {type_name(t)}")
        if t.shape != (b,):
            raise ValueError(f"{name} must have shape (B={b},), got {shape_str(t)}")
        out.append(t.to(tokens.device))
    prompt, total = out
    if b and (total.max() > length or total.min() < 2):
        raise ValueError(f"lengths must be in [2, L={length}], got {total.tolist()}")
    if b and ((prompt < 1).any() or (prompt >= total).any()):
        raise ValueError(f"each prompt length must be in [1, length - 1] (a token to read and "
                         f"one answer token to score), got prompt_lengths {prompt.tolist()} "
                         f"with lengths {total.tolist()}")
    return prompt, total


def sequence_log_probs(model: nn.Module, tokens: torch.Tensor, prompt_lengths: torch.Tensor,
                       lengths: torch.Tensor | None = None) -> torch.Tensor:
    """The log-probability the model gives each row's answer: sum over the answer tokens of
    log p(token | the tokens before it).

    Args:
        model: a causal language model, ``model(tokens) -> logits`` (B, L, V), position t
            scoring token t + 1 (`utils.models.DecoderOnlyLM`).
        tokens: (B, L) integer ids, each row a prompt followed by its answer, right-padded.
        prompt_lengths: (B,) ints, the number of prompt tokens of each row, in [1, length - 1].
        lengths: (B,) ints, the number of real tokens of each row (None: every row is L long).

    Returns:
        (B,) floating point, with the gradient of the model's parameters: row i sums the
        log-probabilities of tokens prompt_lengths[i] .. lengths[i] - 1, predicted at positions
        prompt_lengths[i] - 1 .. lengths[i] - 2 (the first answer token is predicted by the last
        prompt position; the padding is left out). The model reads ``tokens[:, :-1]``: with a
        causal model the padding after a row's end cannot change its real positions.

    Raises:
        InputTypeError: for a non-module, non-tensor or non-integer ``tokens`` or lengths.
        ValueError: for shapes that do not fit, or lengths outside the ranges above.
    """
    if not isinstance(model, nn.Module):
        raise InputTypeError(f"model must be an nn.Module, got {type_name(model)}")
    require_tensor("tokens", tokens)
    require_rank("tokens", tokens, "(B, L)", rank=2)
    if tokens.dtype.is_floating_point or tokens.dtype == torch.bool:
        raise InputTypeError(f"tokens must be integer ids, got {type_name(tokens)}")
    prompt, total = _check_lengths(tokens, prompt_lengths, lengths)
    logits = model(tokens[:, :-1])  # (B, L - 1, V)
    log_probs = logits.log_softmax(dim=-1).gather(-1, tokens[:, 1:, None])[..., 0]
    target = torch.arange(1, tokens.shape[1], device=tokens.device)  # the token scored at t
    keep = (target >= prompt[:, None]) & (target < total[:, None])  # (B, L - 1)
    return log_probs.masked_fill(~keep, 0.0).sum(dim=-1)
