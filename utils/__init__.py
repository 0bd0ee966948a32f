"""The Tested Transformer's library: every piece the book builds, kept in one place.

Each chapter derives a piece in the open, checks it against PyTorch, and then moves it here so
that later chapters can import it instead of writing it again.
"""

from __future__ import annotations

import numbers
import os
import random
import sys

import numpy as np
import torch

from ._validation import InputTypeError
from .devices import device, to_device

__all__ = ["seed_everything", "set_deterministic_algorithms", "device", "to_device"]


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and PyTorch, and ask PyTorch for deterministic algorithms.

    After this call, the same code run twice gives the same random numbers and, on the CPU, the
    same results. Notebooks call it in their first code cell so that their stored outputs can be
    reproduced exactly.

    Args:
        seed: an integer from 0 to 2**32 - 1 (the range NumPy accepts).

    Raises:
        InputTypeError: (a TypeError and a ValueError) when ``seed`` is not an int: a float such
            as 1.5, a bool, a string or None.
        ValueError: when ``seed`` is out of range.
    """
    expected = f"seed must be an int from 0 to 2**32 - 1, got {seed!r}"
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise InputTypeError(f"{expected} ({type(seed).__name__})")
    if not 0 <= seed < 2**32:
        raise ValueError(expected)
    seed = int(seed)
    os.environ["PYTHONHASHSEED"] = str(seed)
    # Needed by cuBLAS for deterministic matrix products on a GPU; harmless on the CPU.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    random.seed(seed)
    np.random.seed(seed)  # noqa: NPY002 (the global generator is what np.random.* calls use)
    torch.manual_seed(seed)
    set_deterministic_algorithms(True, warn_only=True)


def set_deterministic_algorithms(mode: bool, warn_only: bool = False) -> None:
    """What ``torch.use_deterministic_algorithms(mode, warn_only=warn_only)`` does for the book,
    without loading torch's compiler.

    PyTorch's function also sets ``torch._inductor.config.deterministic``, and importing that
    module loads the compiler stack of ``torch.compile``: about two seconds, in every notebook
    and every process that seeds. The book never compiles a model, so what matters is the flag
    that every operator reads, set here; the compiler's own copy is set too when the compiler is
    already loaded.
    """
    inductor = sys.modules.get("torch._inductor.config")
    if inductor is not None:
        inductor.deterministic = mode
    torch._C._set_deterministic_algorithms(mode, warn_only=warn_only)
