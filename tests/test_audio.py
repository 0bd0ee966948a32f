"""utils.audio (chapter 11): synthesized sounds, framing, spectrogram frames equal to torch.stft."""

from __future__ import annotations

import math

import pytest
import torch

from utils.audio import chirp, frame_signal, noise, num_samples, spectrogram_frames, tone


def test_tone_values_and_length():
    x = tone(1000, 0.01, sample_rate=8000, amplitude=0.5)
    assert x.shape == (80,) and x.dtype == torch.float32
    t = torch.arange(80, dtype=torch.float64) / 8000
    torch.testing.assert_close(x, (0.5 * torch.sin(2 * math.pi * 1000 * t)).float())


def test_tone_peak_bin():
    # A tone at an exact bin frequency puts its largest magnitude in that bin of every frame.
    spec = spectrogram_frames(tone(31.25 * 40, 0.25), n_fft=256, hop_length=128, log=False)
    assert torch.equal(spec.argmax(-1), torch.full((spec.shape[0],), 40))


def test_chirp_rises_from_f0_to_f1():
    spec = spectrogram_frames(chirp(500, 3000, 0.5), n_fft=256, hop_length=128, log=False)
    peaks = spec.argmax(-1).tolist()
    assert peaks == sorted(peaks) and peaks[-1] - peaks[0] > 60
    hz = 8000 / 256
    assert abs(peaks[0] * hz - 500) < 150 and abs(peaks[-1] * hz - 3000) < 150


def test_noise_is_reproducible_with_a_generator():
    a = noise(0.1, generator=torch.Generator().manual_seed(3))
    b = noise(0.1, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, b) and a.shape == (800,)
    assert 0.8 < float(a.std()) < 1.2


def test_frame_signal_by_hand():
    x = torch.arange(10.0)
    frames = frame_signal(x, frame_length=4, hop_length=3)
    assert torch.equal(frames, torch.tensor([[0.0, 1, 2, 3], [3, 4, 5, 6], [6, 7, 8, 9]]))
    batch = frame_signal(torch.randn(2, 3, 100), 20, 10)
    assert batch.shape == (2, 3, 9, 20)


@pytest.mark.parametrize("n_fft, hop", [(256, 128), (64, 16), (100, 100)])
def test_spectrogram_frames_equals_torch_stft(n_fft, hop):
    x = torch.randn(3, 1000, dtype=torch.float64)
    ours = spectrogram_frames(x, n_fft, hop, log=False)
    theirs = torch.stft(x, n_fft, hop, window=torch.hann_window(n_fft, dtype=torch.float64),
                        center=False, return_complex=True).abs().transpose(-1, -2)
    assert ours.shape == (3, 1 + (1000 - n_fft) // hop, n_fft // 2 + 1)
    torch.testing.assert_close(ours, theirs)
    torch.testing.assert_close(spectrogram_frames(x, n_fft, hop), torch.log(theirs + 1e-6))


@pytest.mark.parametrize(
    "call, error, pattern",
    [
        (lambda: frame_signal(torch.randn(10), 20, 5), ValueError, r"T=10.*need T >= 20"),
        (lambda: frame_signal(torch.tensor(1.0), 1, 1), ValueError, r"\(\.\.\., T\)"),
        (lambda: frame_signal(torch.arange(10), 4, 2), TypeError, "floating-point"),
        (lambda: frame_signal([1.0, 2.0], 1, 1), TypeError, "torch.Tensor"),
        (lambda: frame_signal(torch.randn(10), 0, 1), ValueError, "positive int"),
        (lambda: spectrogram_frames(torch.randn(100), n_fft=2.5), TypeError, "n_fft"),
        (lambda: spectrogram_frames(torch.randn(100), n_fft=64, eps=0.0), ValueError, "eps"),
        (lambda: tone(5000, 1.0, sample_rate=8000), ValueError, "frequency"),
        (lambda: chirp(100, 4001, 1.0), ValueError, "f1"),
        (lambda: tone(100, 0.0), ValueError, "duration"),
        (lambda: num_samples(1e-6, 8000), ValueError, "no sample"),
        (lambda: noise(0.1, generator=3), TypeError, "generator"),
    ],
)
def test_errors(call, error, pattern):
    with pytest.raises(error, match=pattern):
        call()
