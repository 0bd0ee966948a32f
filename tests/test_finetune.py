"""Tests for utils.finetune: the answer-only targets and loss of instruction tuning, checked
against plain loops and torch.nn.functional.cross_entropy, and the classification head on a
decoder body, checked against the body's own forward pass."""

import pytest
import torch
import torch.nn.functional as F

from utils import seed_everything
from utils._validation import InputTypeError
from utils.finetune import (
    IGNORE_INDEX,
    SequenceClassifier,
    answer_only_loss,
    answer_only_targets,
    pack_examples,
)
from utils.models import DecoderOnlyLM


def loop_targets(tokens, prompt_lengths, lengths):
    """The reference, one position at a time: position t predicts token t + 1, which is scored
    when it belongs to the answer (index >= prompt length) and is not padding (< length)."""
    b, length = tokens.shape
    out = torch.full((b, length - 1), IGNORE_INDEX, dtype=torch.long)
    for row in range(b):
        for t in range(length - 1):
            if prompt_lengths[row] <= t + 1 < lengths[row]:
                out[row, t] = tokens[row, t + 1]
    return out


def off_by_one_late(tokens, prompt_lengths, lengths):
    """The classic bug: the first answer token's prediction (at prompt_len - 1) dropped."""
    out = loop_targets(tokens, prompt_lengths, lengths)
    out[torch.arange(len(out)), torch.as_tensor(prompt_lengths) - 1] = IGNORE_INDEX
    return out


def off_by_one_early(tokens, prompt_lengths, lengths):
    """The other side: the prediction of the last prompt token (at prompt_len - 2) kept."""
    out = loop_targets(tokens, prompt_lengths, lengths)
    rows = torch.arange(len(out))
    at = torch.as_tensor(prompt_lengths) - 2
    ok = at >= 0
    out[rows[ok], at[ok]] = tokens[rows[ok], at[ok] + 1]
    return out


def random_batch(seed, b=6, length=9, vocab=11):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, length + 1, (b,), generator=gen)
    lengths[0] = length  # one row without padding
    prompt_lengths = torch.stack(
        [torch.randint(1, int(n), (1,), generator=gen)[0] for n in lengths]
    )
    tokens = torch.randint(0, vocab, (b, length), generator=gen)
    return tokens, prompt_lengths, lengths


def mismatch(got, expected):
    """The first differing (row, position), for a failure message that names the cause."""
    where = (got != expected).nonzero()
    return None if len(where) == 0 else tuple(where[0].tolist())


@pytest.mark.parametrize("seed", range(5))
def test_targets_equal_the_loop(seed):
    tokens, prompt_lengths, lengths = random_batch(seed)
    got = answer_only_targets(tokens, prompt_lengths, lengths)
    expected = loop_targets(tokens, prompt_lengths, lengths)
    assert got.shape == (tokens.shape[0], tokens.shape[1] - 1)
    assert torch.equal(got, expected), (
        f"first difference at (row, position) {mismatch(got, expected)}"
    )


def test_the_first_answer_token_is_predicted_at_prompt_len_minus_one():
    tokens = torch.tensor([[5, 6, 7, 8, 9, 0]])  # prompt 5 6 7, answer 8 9, padding 0
    targets = answer_only_targets(tokens, [3], [5])
    assert targets.tolist() == [[-100, -100, 8, 9, -100]], targets.tolist()
    assert answer_only_targets(tokens, [3], [5], ignore_index=0).tolist() == [[0, 0, 8, 9, 0]]
    assert answer_only_targets(tokens, torch.tensor([1])).tolist() == [[6, 7, 8, 9, 0]]


@pytest.mark.parametrize("broken", [off_by_one_late, off_by_one_early])
def test_the_loop_comparison_catches_an_off_by_one(broken):
    # The check above can fail: each off-by-one differs from the reference on every batch.
    for seed in range(5):
        tokens, prompt_lengths, lengths = random_batch(seed)
        reference = loop_targets(tokens, prompt_lengths, lengths)
        wrong = broken(tokens, prompt_lengths, lengths)
        has_room = broken is off_by_one_late or bool((prompt_lengths >= 2).any())
        if has_room:
            assert not torch.equal(wrong, reference), f"{broken.__name__} was not caught"


@pytest.mark.parametrize("seed", range(3))
def test_loss_equals_cross_entropy_with_ignore_index(seed):
    tokens, prompt_lengths, lengths = random_batch(seed)
    gen = torch.Generator().manual_seed(100 + seed)
    logits = torch.randn(*tokens.shape, 11, generator=gen, dtype=torch.float64)
    loss = answer_only_loss(logits, tokens, prompt_lengths, lengths)
    targets = loop_targets(tokens, prompt_lengths, lengths)
    expected = F.cross_entropy(
        logits[:, :-1].reshape(-1, 11), targets.reshape(-1), ignore_index=-100
    )
    # the same mean by hand: -log p of each answer token, averaged
    log_p = logits.log_softmax(-1)
    terms = [
        -log_p[r, t, tokens[r, t + 1]]
        for r in range(len(tokens))
        for t in range(tokens.shape[1] - 1)
        if targets[r, t] != IGNORE_INDEX
    ]
    by_hand = torch.stack(terms).mean()
    diff = max((loss - expected).abs().item(), (loss - by_hand).abs().item())
    assert diff < 1e-12, f"max |diff| {diff:.3g} against F.cross_entropy and the loop"
    shorter = answer_only_loss(logits[:, :-1], tokens, prompt_lengths, lengths)
    assert shorter.item() == loss.item()


def test_prompt_and_padding_positions_get_no_gradient():
    tokens, prompt_lengths, lengths = random_batch(0)
    logits = torch.randn(*tokens.shape, 11, dtype=torch.float64, requires_grad=True)
    answer_only_loss(logits, tokens, prompt_lengths, lengths).backward()
    scored = loop_targets(tokens, prompt_lengths, lengths) != IGNORE_INDEX
    touched = logits.grad[:, :-1].abs().sum(-1) > 0
    assert torch.equal(touched, scored), f"gradient where unscored at {mismatch(touched, scored)}"
    assert logits.grad[:, -1].abs().max() == 0


def test_pack_examples():
    tokens, prompt_lengths, lengths = pack_examples([[1, 2], [3]], [[4], [5, 6, 7]], pad=0)
    assert tokens.tolist() == [[1, 2, 4, 0], [3, 5, 6, 7]]
    assert prompt_lengths.tolist() == [2, 1] and lengths.tolist() == [3, 4]
    with pytest.raises(ValueError, match="at least one token"):
        pack_examples([[1], []], [[2], [3]])
    with pytest.raises(ValueError, match="as many answers as prompts"):
        pack_examples([[1]], [[2], [3]])


def test_targets_and_loss_errors_name_expected_and_actual():
    tokens = torch.tensor([[5, 6, 7, 8]])
    with pytest.raises(ValueError, match=r"row 0 has prompt_length 3 and length 3"):
        answer_only_targets(tokens, [3], [3])
    with pytest.raises(
        ValueError,
        match=r"prompt_lengths must lie in \[1, L - 1=3\], got "
        r"values from 4 to 4",
    ):
        answer_only_targets(tokens, [4])
    with pytest.raises(ValueError, match=r"\(B,\) = \(1,\)"):
        answer_only_targets(tokens, [1, 2])
    with pytest.raises(ValueError, match="at least 2 positions"):
        answer_only_targets(tokens[:, :1], [1])
    with pytest.raises(InputTypeError, match="integer token ids"):
        answer_only_targets(tokens.float(), [1])
    with pytest.raises(ValueError, match=r"\(B, L, V\) = \(1, 4, V\) or \(B, L - 1, V\)"):
        answer_only_loss(torch.zeros(1, 2, 9), tokens, [1])
    with pytest.raises(InputTypeError, match="floating point"):
        answer_only_loss(torch.zeros(1, 4, 9, dtype=torch.long), tokens, [1])


def small_body(layers=2):
    seed_everything(0)
    return DecoderOnlyLM(
        13, d_model=16, nhead=2, num_layers=layers, dim_feedforward=32, max_len=10, tie_output=False
    ).double()


def test_pooled_state_is_what_the_body_reads_at_the_last_token():
    body = small_body()
    clf = SequenceClassifier(body, 3).double().eval()
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 13, (4, 10), generator=gen)
    lengths = torch.tensor([10, 3, 7, 1])
    with torch.no_grad():
        pooled = clf.pooled(tokens, lengths)
        # the body's own language-model output at each row's last real token
        lm = body(tokens)[torch.arange(4), lengths - 1]
        diff = (body.head(pooled) - lm).abs().max().item()
        assert diff < 1e-12, f"max |diff| {diff:.3g} against the body's forward"
        # padding after a row's end changes nothing: the causal mask hides it
        junk = tokens.clone()
        junk[1, 3:] = 12
        diff = (clf(junk, lengths) - clf(tokens, lengths)).abs().max().item()
        assert diff < 1e-12, f"the padding changed the logits by {diff:.3g}"
        # each row alone, unpadded, gives the same logits
        alone = torch.cat([clf(tokens[i : i + 1, : int(n)]) for i, n in enumerate(lengths)])
        diff = (alone - clf(tokens, lengths)).abs().max().item()
        assert diff < 1e-12, f"a padded row differs from the row alone by {diff:.3g}"
        assert clf(tokens, lengths).shape == (4, 3)


def test_a_wrong_position_is_caught():
    # The check above can fail: reading position length - 2 (an off-by-one) differs.
    body = small_body()
    clf = SequenceClassifier(body, 3).double().eval()
    tokens = torch.randint(0, 13, (2, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        lm = body(tokens)[:, -1]
        wrong = body.head(clf.hidden(tokens)[:, -2])
    assert (wrong - lm).abs().max().item() > 1e-3


def test_mean_pooling_equals_the_loop():
    clf = SequenceClassifier(small_body(1), 2, pool="mean").double().eval()
    tokens = torch.randint(0, 13, (3, 8), generator=torch.Generator().manual_seed(3))
    lengths = torch.tensor([8, 2, 5])
    with torch.no_grad():
        h = clf.hidden(tokens)
        expected = torch.stack([h[i, : int(n)].mean(0) for i, n in enumerate(lengths)])
        diff = (clf.pooled(tokens, lengths) - expected).abs().max().item()
    assert diff < 1e-12, f"max |diff| {diff:.3g} against the loop"


def test_classifier_loss_equals_cross_entropy_by_hand():
    clf = SequenceClassifier(small_body(1), 4).double()
    tokens = torch.randint(0, 13, (5, 6), generator=torch.Generator().manual_seed(4))
    labels = torch.tensor([0, 3, 1, 1, 2])
    logits = clf(tokens)
    by_hand = -(logits - logits.logsumexp(-1, keepdim=True))[torch.arange(5), labels].mean()
    diff = (by_hand - F.cross_entropy(logits, labels)).abs().item()
    assert diff < 1e-12, f"max |diff| {diff:.3g}"


def test_classifier_errors():
    body = small_body(1)
    with pytest.raises(InputTypeError, match="body must be a DecoderOnlyLM"):
        SequenceClassifier(torch.nn.Linear(2, 2), 2)
    with pytest.raises(ValueError, match="num_classes must be an int >= 2, got 1"):
        SequenceClassifier(body, 1)
    with pytest.raises(ValueError, match="pool must be one of"):
        SequenceClassifier(body, 2, pool="first")
    clf = SequenceClassifier(body, 2)
    with pytest.raises(ValueError, match=r"lengths must lie in \[1, L=3\], got values from 0"):
        clf(torch.zeros(2, 3, dtype=torch.long), torch.tensor([0, 3]))
