"""Tests of utils.seed_everything."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from utils import seed_everything


def _draw():
    return (
        random.random(),
        np.random.rand(3).tolist(),  # noqa: NPY002 (the global generator is what is seeded)
        torch.randn(3).tolist(),
        torch.nn.Linear(4, 2).weight.detach().clone(),
    )


def test_same_seed_same_numbers():
    seed_everything(123)
    a = _draw()
    seed_everything(123)
    b = _draw()
    assert a[:3] == b[:3]
    assert torch.equal(a[3], b[3])


def test_other_seed_other_numbers():
    seed_everything(1)
    a = _draw()
    seed_everything(2)
    b = _draw()
    assert a[0] != b[0] and a[1] != b[1] and a[2] != b[2]


def test_sets_determinism_and_hash_seed(monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", "x")
    seed_everything(7)
    import os

    assert os.environ["PYTHONHASHSEED"] == "7"
    assert torch.are_deterministic_algorithms_enabled()


@pytest.mark.parametrize("seed", [0, 2**32 - 1, np.int64(5)])
def test_accepts_the_whole_range(seed):
    seed_everything(seed)


@pytest.mark.parametrize("seed", [-1, 2**32, 1.5, "0", None, True])
def test_rejects_bad_seeds(seed):
    with pytest.raises(ValueError, match="seed must be an int") as info:
        seed_everything(seed)
    assert repr(seed) in str(info.value)
