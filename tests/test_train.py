"""Tests for utils.train, and short training runs that must learn each toy task.

The training runs are scaled-down versions of the chapters' (shorter sequences, fewer steps) so
that each takes a few seconds; each must reach a stated held-out accuracy.
"""

import math
import re
from itertools import islice

import pytest
import torch
from torch import nn

from utils import seed_everything
from utils._validation import InputTypeError
from utils.data import PAD
from utils.decoding import generate, greedy_decode
from utils.models import DecoderOnlyLM, EncoderOnlyMLM, Seq2SeqTransformer
from utils.tasks import MissingDigitTask, ReversalTask, SortingTask
from utils.train import (
    History,
    exact_match,
    token_accuracy,
    token_cross_entropy,
    train,
    train_side_by_side,
    transformer_lr,
    transformer_lr_scheduler,
    warmup_linear_decay,
)

STEPS = {"reversal": 300, "sorting": 250, "mlm": 250}


def test_warmup_linear_decay():
    f = [warmup_linear_decay(s, 4, 12) for s in range(12)]
    assert f[:4] == [0.25, 0.5, 0.75, 1.0]
    assert f[4] == 1.0 and f[8] == 0.5 and f[11] == pytest.approx(1 / 8)
    assert all(a >= b for a, b in zip(f[3:], f[4:], strict=False))
    with pytest.raises(ValueError, match="warmup"):
        warmup_linear_decay(0, 5, 4)


def test_transformer_lr_is_the_papers_formula():
    d, w = 512, 4000
    for step in (1, 10, 1000, 3999, 4000, 4001, 10_000, 100_000):
        expected = d**-0.5 * min(step**-0.5, step * w**-1.5)
        assert transformer_lr(step, d, w) == pytest.approx(expected, rel=1e-12)
    # linear during the warm-up: the rate is proportional to the step
    assert transformer_lr(2000, d, w) == pytest.approx(2 * transformer_lr(1000, d, w))
    # inverse square root after it: four times the step, half the rate
    assert transformer_lr(40_000, d, w) == pytest.approx(transformer_lr(10_000, d, w) / 2)
    assert transformer_lr(1, 512) == transformer_lr(1, 512, 4000)  # the paper's default


@pytest.mark.parametrize("d_model, warmup", [(512, 4000), (32, 100), (1024, 1), (64, 7)])
def test_transformer_lr_peaks_at_the_end_of_warmup(d_model, warmup):
    steps = range(1, 4 * warmup + 10)
    rates = [transformer_lr(s, d_model, warmup) for s in steps]
    peak = max(rates)
    assert rates.index(peak) + 1 == warmup
    assert peak == pytest.approx(d_model**-0.5 * warmup**-0.5, rel=1e-12)
    assert all(a < b for a, b in zip(rates[: warmup - 1], rates[1:warmup], strict=True))
    assert all(a > b for a, b in zip(rates[warmup - 1 :], rates[warmup:], strict=False))


def test_transformer_lr_rejects_bad_arguments():
    for bad in ({"step": 0}, {"step": -3}, {"d_model": 0}, {"warmup_steps": 0}):
        args = {"step": 1, "d_model": 512, "warmup_steps": 4000} | bad
        with pytest.raises(ValueError, match=next(iter(bad))):
            transformer_lr(**args)
    with pytest.raises(InputTypeError):
        transformer_lr(1.5, 512)
    with pytest.raises(InputTypeError):
        transformer_lr(True, 512)


def test_transformer_lr_scheduler_sets_the_rate_of_each_update():
    p = nn.Parameter(torch.zeros(3))
    opt = torch.optim.Adam([p], lr=1.0)
    sched = transformer_lr_scheduler(opt, d_model=16, warmup_steps=5)
    seen = []
    for _ in range(12):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([transformer_lr(s, 16, 5) for s in range(1, 13)])
    opt2 = torch.optim.Adam([p], lr=1.0)
    transformer_lr_scheduler(opt2, 16, 5, factor=2.0)
    assert opt2.param_groups[0]["lr"] == pytest.approx(2 * transformer_lr(1, 16, 5))
    with pytest.raises(InputTypeError):
        transformer_lr_scheduler("adam", 16)
    with pytest.raises(ValueError, match="factor"):
        transformer_lr_scheduler(opt, 16, 5, factor=0.0)
    with pytest.raises(ValueError, match="warmup_steps"):
        transformer_lr_scheduler(opt, 16, 0)


def test_token_cross_entropy_ignores_padding():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 5)
    targets = torch.tensor([[1, 2, PAD], [4, PAD, PAD]])
    keep = targets != PAD
    expected = nn.functional.cross_entropy(logits[keep], targets[keep])
    assert torch.allclose(token_cross_entropy(logits, targets), expected)
    with pytest.raises(ValueError, match=r"\(B, L\)"):
        token_cross_entropy(logits, targets[:, :2])
    with pytest.raises(ValueError, match=r"\(B, L, V\)"):
        token_cross_entropy(logits[0], targets[0])


@pytest.mark.parametrize("eps", [0.0, 0.1, 0.5, 1.0])
@pytest.mark.parametrize("ignore_index", [PAD, -100])
def test_label_smoothing_matches_torch(eps, ignore_index):
    torch.manual_seed(0)
    logits = torch.randn(3, 4, 6, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(1, 6, (3, 4))
    targets[0, 2:] = ignore_index
    targets[2, 1:] = ignore_index
    ours = token_cross_entropy(logits, targets, ignore_index, label_smoothing=eps)
    theirs = nn.functional.cross_entropy(logits.reshape(-1, 6), targets.reshape(-1),
                                         ignore_index=ignore_index, label_smoothing=eps)
    assert torch.allclose(ours, theirs, atol=1e-12)
    (g_ours,) = torch.autograd.grad(ours, logits)
    (g_theirs,) = torch.autograd.grad(theirs, logits)
    assert torch.allclose(g_ours, g_theirs, atol=1e-12)
    assert g_ours[targets == ignore_index].abs().max() == 0     # ignored positions: no gradient


def test_label_smoothing_formula_and_floor():
    eps, vocab = 0.1, 5
    logits = torch.randn(2, 3, vocab, dtype=torch.float64)
    targets = torch.tensor([[1, 2, 3], [4, 1, PAD]])
    keep = targets != PAD
    log_p = logits[keep].log_softmax(-1)
    q = torch.full_like(log_p, eps / vocab)
    q[torch.arange(len(q)), targets[keep]] += 1 - eps                # the smoothed target
    expected = -(q * log_p).sum(-1).mean()
    assert torch.allclose(token_cross_entropy(logits, targets, label_smoothing=eps), expected)
    # The loss is smallest when the model predicts q itself, and that minimum is q's entropy.
    best = torch.zeros(1, 1, vocab, dtype=torch.float64)
    best[0, 0] = q[0].log()
    entropy = -(q[0] * q[0].log()).sum()
    floor = token_cross_entropy(best, targets[:1, :1], label_smoothing=eps)
    assert torch.allclose(floor, entropy) and floor > 0.3
    sharper = best * 2                                                # more confident than q
    assert token_cross_entropy(sharper, targets[:1, :1], label_smoothing=eps) > floor
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="label_smoothing"):
            token_cross_entropy(logits, targets, label_smoothing=bad)
    with pytest.raises(TypeError, match="label_smoothing"):
        token_cross_entropy(logits, targets, label_smoothing="0.1")


def test_token_accuracy_and_exact_match():
    logits = torch.zeros(1, 4, 5)
    logits[0, torch.arange(4), torch.tensor([1, 2, 3, 4])] = 1.0
    assert token_accuracy(logits, torch.tensor([[1, 2, 0, 3]])) == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="no position is scored"):
        token_accuracy(logits, torch.zeros(1, 4, dtype=torch.long))
    assert exact_match([[1, 2], [3], [4, 4]], [[1, 2], [3, 3], [4, 4]]) == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="predictions"):
        exact_match([[1]], [[1], [2]])


def _regression_run(seed):
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    w = torch.tensor([[1.0, -2.0, 0.5]])
    gen = torch.Generator().manual_seed(1)

    def batches():
        while True:
            x = torch.randn(16, 3, generator=gen)
            yield x, x @ w.T

    lines = []
    hist = train(model, batches(), lambda m, b: ((m(b[0]) - b[1]) ** 2).mean(), steps=200,
                 lr=0.05, report_every=50, seed=seed, print_fn=lines.append)
    return hist, lines


def test_train_reports_at_fixed_steps_and_is_deterministic():
    hist, lines = _regression_run(seed=0)
    assert hist.steps == [50, 100, 150, 200]
    assert len(hist.step_losses) == 200 and len(lines) == 4
    assert lines[0].startswith("step    50   loss ")
    assert hist.losses[-1] < 0.01 * hist.losses[0]
    assert math.isclose(hist.losses[0], sum(hist.step_losses[:50]) / 50)
    again, _ = _regression_run(seed=0)
    assert again.step_losses == hist.step_losses


def test_train_rejects_bad_arguments():
    model = nn.Linear(2, 1)

    def loss(m, b):
        return m(b).sum()

    with pytest.raises(ValueError, match="steps"):
        train(model, iter([]), loss, steps=0)
    with pytest.raises(ValueError, match="lr"):
        train(model, iter([]), loss, steps=1, lr=0.0)
    with pytest.raises(ValueError, match="ran out"):
        train(model, iter([torch.ones(1, 2)]), loss, steps=3, print_fn=None)
    with pytest.raises(ValueError, match="scalar"):
        train(model, iter([torch.ones(4, 2)]), lambda m, b: m(b), steps=1, print_fn=None)


def _small_seq2seq_runs(n, steps):
    task = ReversalTask(min_len=3, max_len=6)
    runs = []
    for seed in range(n):
        seed_everything(seed)
        model = Seq2SeqTransformer(len(task.vocab), len(task.vocab), d_model=16, nhead=2,
                                   num_encoder_layers=1, num_decoder_layers=1,
                                   dim_feedforward=32, norm_first=True)
        runs.append((model, list(islice(task.batches(8, seed=seed), steps))))
    return runs


def _seq2seq_loss(model, batch):
    logits = model(batch.src, batch.tgt_in, batch.src_mask, batch.tgt_mask)
    return token_cross_entropy(logits, batch.tgt_out)


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_train_side_by_side_equals_train_one_after_another(workers):
    steps = 25
    alone = _small_seq2seq_runs(3, steps)
    expected = [train(m, b, _seq2seq_loss, steps=steps, lr=1e-2, print_fn=None) for m, b in alone]
    together = _small_seq2seq_runs(3, steps)
    got = train_side_by_side(together, _seq2seq_loss, steps=steps, workers=workers, lr=1e-2,
                             print_fn=None)
    assert len(got) == 3
    for (m1, _), (m2, _), h1, h2 in zip(alone, together, expected, got, strict=True):
        assert h2.step_losses == h1.step_losses  # to the bit, each run its own
        for p1, p2 in zip(m1.parameters(), m2.parameters(), strict=True):
            assert torch.equal(p1, p2)
        assert not m2.training  # train ends in evaluation mode
    # the runs differ from one another: each trained on its own model and batches
    assert got[0].step_losses != got[1].step_losses


def test_train_side_by_side_refuses_what_it_cannot_do_reproducibly():
    runs = _small_seq2seq_runs(2, 3)
    with pytest.raises(ValueError, match="share a parameter"):
        train_side_by_side([runs[0], (runs[0][0], runs[1][1])], _seq2seq_loss, steps=3)
    dropping = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.1))
    with pytest.raises(ValueError, match=r"runs\[1\]: 1 has dropout above 0"):
        train_side_by_side([runs[0], (dropping, [])], _seq2seq_loss, steps=3)
    seed_everything(0)
    with_attention_dropout = Seq2SeqTransformer(13, 13, d_model=16, nhead=2,
                                                num_encoder_layers=1, num_decoder_layers=1,
                                                dropout=0.1)
    with pytest.raises(ValueError, match="dropout above 0"):
        train_side_by_side([(with_attention_dropout, [])], _seq2seq_loss, steps=3)
    for bad in ([], "ab", [runs[0][0]], [(runs[0][1], runs[0][0])]):
        with pytest.raises(InputTypeError, match="runs"):
            train_side_by_side(bad, _seq2seq_loss, steps=3)
    with pytest.raises(ValueError, match="workers"):
        train_side_by_side(runs, _seq2seq_loss, steps=3, workers=0)
    with pytest.raises(ValueError, match="ran out"):  # train's own errors come through
        train_side_by_side([(runs[0][0], runs[0][1][:1])], _seq2seq_loss, steps=3,
                           print_fn=None)


# --- Short runs on the toy tasks: each must reach its stated held-out accuracy. ---
# Smaller versions of the chapters' runs (a few seconds each).

def test_reversal_learns():
    seed_everything(0)
    task = ReversalTask(min_len=3, max_len=6)
    test = task.sample(300, seed=1)
    model = Seq2SeqTransformer(len(task.vocab), len(task.vocab), d_model=32, nhead=4,
                               norm_first=True, share_embeddings=True)
    train(model, task.batches(48, seed=0, exclude=test, pad_to=16),
          lambda m, b: token_cross_entropy(m(b.src, b.tgt_in, b.src_mask, b.tgt_mask),
                                           b.tgt_out),
          steps=STEPS["reversal"], lr=1e-2, print_fn=None)
    batch = task.collate(test, pad_to=16)
    pred = greedy_decode(model, batch.src, batch.src_mask, max_len=7)
    assert exact_match(pred, [list(t) for _, t in test]) >= 0.95


def test_sorting_learns():
    seed_everything(0)
    task = SortingTask(min_len=3, max_len=6, distinct=True)
    test = task.sample(300, seed=1)
    model = DecoderOnlyLM(len(task.vocab), d_model=32, nhead=4, num_layers=2)
    train(model, task.batches(64, seed=0, exclude=test, pad_to=16),
          lambda m, b: token_cross_entropy(m(b.inputs), b.targets),
          steps=STEPS["sorting"], lr=1e-2, print_fn=None)
    pred = generate(model, [p for p, _ in test], max_new_tokens=7)
    assert exact_match(pred, [list(a[:-1]) for _, a in test]) >= 0.95


def test_missing_digit_mlm_learns():
    seed_everything(0)
    task = MissingDigitTask(min_len=4, max_len=10)
    test = task.sample(300, seed=1)
    model = EncoderOnlyMLM(len(task.vocab), d_model=32, nhead=4, num_layers=1, norm_first=True)
    train(model, task.batches(64, seed=0, exclude=test, pad_to=16),
          lambda m, b: token_cross_entropy(m(b.inputs, b.mask), b.targets),
          steps=STEPS["mlm"], lr=1e-2, print_fn=None)
    batch = task.collate(test, pad_to=16)
    with torch.no_grad():
        acc = token_accuracy(model(batch.inputs, batch.mask), batch.targets)
    assert acc >= 0.95


def test_history_mean_loss_averages_the_steps_asked_for():
    h = History(step_losses=[4.0, 2.0, 1.0, 0.5, 0.5])
    assert h.mean_loss(1, 1) == 4.0
    assert h.mean_loss(1, 2) == 3.0
    assert h.mean_loss(4, 5) == 0.5
    assert h.mean_loss(1, 5) == pytest.approx(8.0 / 5)


@pytest.mark.parametrize(("first", "last", "error", "phrase"), [
    (0, 2, ValueError, "1 <= first <= last <= 5"),
    (3, 2, ValueError, "first=3, last=2"),
    (1, 6, ValueError, "last=6"),
    (1.0, 2, TypeError, "first must be an int"),
    (1, True, TypeError, "last must be an int"),
])
def test_history_mean_loss_refuses_steps_it_does_not_have(first, last, error, phrase):
    h = History(step_losses=[4.0, 2.0, 1.0, 0.5, 0.5])
    with pytest.raises(error, match=re.escape(phrase)):
        h.mean_loss(first, last)
