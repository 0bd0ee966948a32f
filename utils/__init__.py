"""The Tested Transformer's library: every piece the book builds, kept in one place.

Each chapter derives a piece in the open, checks it against PyTorch, and then moves it here so
that later chapters can import it instead of writing it again.
"""

from __future__ import annotations

import os
import random

import numpy as np
import torch

__all__ = ["seed_everything"]


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and PyTorch, and ask PyTorch for deterministic algorithms.

    After this call, the same code run twice gives the same random numbers and, on the CPU, the
    same results. Notebooks call it in their first code cell so that their stored outputs can be
    reproduced exactly.

    Args:
        seed: any non-negative integer.
    """
    if not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    os.environ["PYTHONHASHSEED"] = str(seed)
    # Needed by cuBLAS for deterministic matrix products on a GPU; harmless on the CPU.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True, warn_only=True)
