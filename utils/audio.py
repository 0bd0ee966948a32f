"""Sound as a sequence of vectors: synthesized sounds and their spectrogram frames (chapter 11).

A recording is one long sequence of samples, far too long and too low-level to attend over sample
by sample. Cutting it into short overlapping **frames** and taking the magnitude of each frame's
Fourier transform gives one vector per frame (a column of the spectrogram): the set of vectors that
a Transformer for sound attends over.

Shapes: a signal is (..., T) with T samples; framing gives (..., num_frames, frame_length) with
``num_frames = 1 + (T - frame_length) // hop_length``; a spectrogram is
(..., num_frames, n_fft // 2 + 1), one row per frame, like the (L, d) rows of a sentence. The
spectrogram equals ``torch.stft(..., center=False)`` with a periodic Hann window, transposed.
"""

from __future__ import annotations

import math

import torch

from ._validation import (
    InputTypeError,
    require_bool,
    require_floating,
    require_int,
    require_rank,
    require_real,
    require_tensor,
    shape_str,
)

__all__ = ["num_samples", "tone", "chirp", "noise", "frame_signal", "spectrogram_frames"]


def num_samples(duration: float, sample_rate: int) -> int:
    """The number of samples of a sound ``duration`` seconds long: round(duration * sample_rate).

    Raises:
        ValueError: when the sound would have no sample, or for a duration that is not a finite
            positive number or a sample rate that is not a positive int.
    """
    duration = require_real("duration", duration, low=0.0, low_open=True)
    sample_rate = require_int("sample_rate", sample_rate)
    n = round(duration * sample_rate)
    if n < 1:
        raise ValueError(f"a sound of duration {duration} s at {sample_rate} Hz has no sample")
    return n


def _times(duration: float, sample_rate: int) -> torch.Tensor:
    """The sample times t = n / sample_rate in seconds, float64, shape (T,)."""
    return torch.arange(num_samples(duration, sample_rate), dtype=torch.float64) / sample_rate


def _frequency(name: str, value: object, sample_rate: int) -> float:
    """A frequency in [0, sample_rate / 2]: above the Nyquist frequency it would alias."""
    return require_real(name, value, low=0.0, high=sample_rate / 2)


def tone(frequency: float, duration: float, sample_rate: int = 8000, amplitude: float = 1.0,
         phase: float = 0.0) -> torch.Tensor:
    """A pure tone: ``amplitude * sin(2 pi frequency t + phase)``.

    Args:
        frequency: in Hz, from 0 to the Nyquist frequency ``sample_rate / 2``.
        duration: in seconds, > 0.
        sample_rate: samples per second, a positive int.
        amplitude: a finite number >= 0.
        phase: the phase at t = 0, in radians.

    Returns:
        A float32 tensor of shape (T,), T = round(duration * sample_rate).
    """
    sample_rate = require_int("sample_rate", sample_rate)
    frequency = _frequency("frequency", frequency, sample_rate)
    amplitude = require_real("amplitude", amplitude, low=0.0)
    phase = require_real("phase", phase)
    t = _times(duration, sample_rate)
    return (amplitude * torch.sin(2 * math.pi * frequency * t + phase)).float()


def chirp(f0: float, f1: float, duration: float, sample_rate: int = 8000,
          amplitude: float = 1.0) -> torch.Tensor:
    """A linear chirp: a tone whose frequency glides from ``f0`` to ``f1`` Hz over ``duration``.

    The instantaneous frequency at time t is ``f0 + (f1 - f0) t / duration``; the phase is its
    integral, ``2 pi (f0 t + (f1 - f0) t^2 / (2 duration))``.

    Args:
        f0, f1: start and end frequencies in Hz, each from 0 to ``sample_rate / 2``.
        duration: in seconds, > 0.
        sample_rate: samples per second, a positive int.
        amplitude: a finite number >= 0.

    Returns:
        A float32 tensor of shape (T,), T = round(duration * sample_rate).
    """
    sample_rate = require_int("sample_rate", sample_rate)
    f0 = _frequency("f0", f0, sample_rate)
    f1 = _frequency("f1", f1, sample_rate)
    amplitude = require_real("amplitude", amplitude, low=0.0)
    duration = require_real("duration", duration, low=0.0, low_open=True)
    t = _times(duration, sample_rate)
    phase = 2 * math.pi * (f0 * t + (f1 - f0) * t**2 / (2 * duration))
    return (amplitude * torch.sin(phase)).float()


def noise(duration: float, sample_rate: int = 8000, amplitude: float = 1.0,
          generator: torch.Generator | None = None) -> torch.Tensor:
    """White noise: independent Gaussian samples of standard deviation ``amplitude``.

    Args:
        duration: in seconds, > 0.
        sample_rate: samples per second, a positive int.
        amplitude: the standard deviation, a finite number >= 0.
        generator: an optional ``torch.Generator`` for reproducible noise (default: torch's
            global generator).

    Returns:
        A float32 tensor of shape (T,), T = round(duration * sample_rate).
    """
    sample_rate = require_int("sample_rate", sample_rate)
    amplitude = require_real("amplitude", amplitude, low=0.0)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise InputTypeError(f"generator must be a torch.Generator or None, got "
                             f"{type(generator).__name__}")
    n = num_samples(duration, sample_rate)
    return amplitude * torch.randn(n, generator=generator)


def _require_signal(signal: object, frame_length: int) -> torch.Tensor:
    require_tensor("signal", signal)
    require_rank("signal", signal, "(..., T)", min_rank=1)
    require_floating("signal", signal)
    if signal.shape[-1] < frame_length:
        raise ValueError(
            f"signal of shape {shape_str(signal)} has T={signal.shape[-1]} samples, fewer than "
            f"one frame of {frame_length}: need T >= {frame_length}"
        )
    return signal


def frame_signal(signal: torch.Tensor, frame_length: int, hop_length: int) -> torch.Tensor:
    """Cut a signal into overlapping frames, one row per frame.

    Frame ``i`` holds samples ``i * hop_length`` to ``i * hop_length + frame_length - 1``. Samples
    after the last whole frame are dropped (no padding), as ``torch.stft(center=False)`` does.

    Args:
        signal: (..., T) floating point, T >= ``frame_length``.
        frame_length: samples per frame, a positive int.
        hop_length: samples from the start of one frame to the next, a positive int.

    Returns:
        (..., num_frames, frame_length) with ``num_frames = 1 + (T - frame_length) // hop_length``
        (a view of ``signal``: frames that overlap share memory).

    Raises:
        InputTypeError: for a signal that is not a floating-point tensor or lengths that are not
            ints.
        ValueError: for a 0-dim signal or one shorter than a frame.
    """
    frame_length = require_int("frame_length", frame_length)
    hop_length = require_int("hop_length", hop_length)
    signal = _require_signal(signal, frame_length)
    return signal.unfold(-1, frame_length, hop_length)


def spectrogram_frames(signal: torch.Tensor, n_fft: int = 256, hop_length: int = 128,
                       log: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """The magnitude spectrogram of ``signal``, one row (a vector of ``n_fft // 2 + 1`` frequency
    bins) per frame.

    Each frame of ``n_fft`` samples is multiplied by a periodic Hann window (which tapers its
    ends to zero, so that cutting the sound does not add false frequencies) and Fourier
    transformed; the magnitudes of the non-negative frequencies form the row. Bin ``k`` is the
    frequency ``k * sample_rate / n_fft``. With ``log=True`` the result is ``log(magnitude +
    eps)``: loud and quiet components then differ by an amount a network handles well.

    The same numbers as ``torch.stft(signal, n_fft, hop_length, window=torch.hann_window(n_fft),
    center=False, return_complex=True).abs()``, transposed to (..., num_frames, n_freq).

    Args:
        signal: (..., T) floating point, T >= ``n_fft``.
        n_fft: samples per frame, a positive int.
        hop_length: hop between frames, a positive int.
        log: return ``log(magnitude + eps)`` instead of the magnitude.
        eps: a finite number > 0 that keeps the log of a silent bin finite.

    Returns:
        (..., num_frames, n_fft // 2 + 1), ``num_frames = 1 + (T - n_fft) // hop_length``.
    """
    n_fft = require_int("n_fft", n_fft)
    hop_length = require_int("hop_length", hop_length)
    require_bool("log", log)
    eps = require_real("eps", eps, low=0.0, low_open=True)
    frames = frame_signal(signal, n_fft, hop_length)  # (..., num_frames, n_fft)
    window = torch.hann_window(n_fft, periodic=True, dtype=signal.dtype, device=signal.device)
    magnitude = torch.fft.rfft(frames * window, dim=-1).abs()
    return torch.log(magnitude + eps) if log else magnitude
