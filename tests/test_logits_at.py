"""``logits_at``: a decoder-only model computes its output layer only at the positions asked for,
and `generate`'s first step uses it (the prompt's last token of each row, not all L of them)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from utils.decoding import generate
from utils.models import DecoderOnlyLM


def _model() -> DecoderOnlyLM:
    torch.manual_seed(0)
    return DecoderOnlyLM(37, d_model=16, nhead=2, num_layers=2, max_len=40).eval()


class _WithoutLogitsAt(nn.Module):
    """The same model behind a forward that does not take ``logits_at``: `generate` must then
    compute every position's logits and pick the last ones itself."""

    def __init__(self, model: DecoderOnlyLM):
        super().__init__()
        self.model, self.max_len = model, model.max_len

    def new_cache(self):
        return self.model.new_cache()

    def forward(self, tokens, mask=None, cache=None, positions=None):
        return self.model(tokens, mask, cache=cache, positions=positions)


def test_logits_at_are_the_rows_of_the_full_output():
    model = _model()
    tokens = torch.randint(0, 37, (3, 9))
    at = torch.tensor([[8], [0], [4]])
    with torch.no_grad():
        full = model(tokens)
        picked = model(tokens, logits_at=at)
        two = model(tokens, logits_at=torch.tensor([[1, 8], [2, 2], [0, 5]]))
    assert picked.shape == (3, 1, 37) and two.shape == (3, 2, 37)
    torch.testing.assert_close(picked[:, 0], full[torch.arange(3), at[:, 0]], atol=1e-6, rtol=0)
    torch.testing.assert_close(two[0], full[0, [1, 8]], atol=1e-6, rtol=0)
    torch.testing.assert_close(two[1], full[1, [2, 2]], atol=1e-6, rtol=0)


def test_logits_at_with_a_cache():
    model = _model()
    tokens = torch.randint(0, 37, (2, 7))
    with torch.no_grad():
        full = model(tokens)
        cache = model.new_cache()
        model(tokens[:, :4], cache=cache)
        rest = model(tokens[:, 4:], cache=cache, logits_at=torch.tensor([[2], [0]]))
    torch.testing.assert_close(rest[:, 0], full[[0, 1], [6, 4]], atol=1e-5, rtol=0)


@pytest.mark.parametrize("at, message", [
    (torch.tensor([3, 1]), "logits_at must have shape (B=2, K)"),
    (torch.tensor([[3]]), "logits_at must have shape (B=2, K)"),
    (torch.tensor([[5], [0]]), "logits_at must lie in [0, L=5)"),
    (torch.tensor([[-1], [0]]), "logits_at must lie in [0, L=5)"),
])
def test_bad_logits_at_is_refused(at, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[")):
        _model()(torch.zeros(2, 5, dtype=torch.long), logits_at=at)


def test_float_logits_at_is_refused():
    with pytest.raises((TypeError, ValueError), match="logits_at"):
        _model()(torch.zeros(2, 5, dtype=torch.long), logits_at=torch.zeros(2, 1))


def test_generate_gives_the_same_tokens_with_and_without_logits_at():
    model = _model()
    prompts = [[5, 9, 11, 3, 7, 30], [4, 8], [12, 13, 14, 15]]  # ragged: each row's last differs
    fast = generate(model, prompts, 12, eos=36)
    plain = generate(_WithoutLogitsAt(model), prompts, 12, eos=36)
    uncached = generate(model, prompts, 12, eos=36, use_cache=False)
    assert fast == plain == uncached
    assert sum(len(row) for row in fast) > 12  # something was generated in more than one row
