"""Tests for decoding with utils.tokenizer, and for its benchmark (scripts/bench_tokenizer.py).

`decode` checks its ids in bulk (the set of their types, then their min and max) and falls back
to a loop over the ids only when that check fails, to name the first bad one. The bulk check
must refuse exactly what the loop refuses, with the same message: the tests compare it with the
loop on every kind of bad input, at every position, and show that a check with one of its three
parts removed is caught.
"""

from __future__ import annotations

import importlib.util
import numbers
import os
from collections.abc import Iterable
from enum import IntEnum
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAYON_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from utils._validation import InputTypeError, type_name  # noqa: E402
from utils.data import book_prose  # noqa: E402
from utils.tokenizer import _check_ids, train_bpe  # noqa: E402

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_tokenizer.py"
SIZE = 300


class Small(IntEnum):
    THREE = 3


def _loop_check(ids: object, size: int) -> list[int]:
    """The per-id check that `_check_ids` had before the bulk check: the contract to keep."""
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
        raise InputTypeError(f"ids must be a sequence of int, got {type_name(ids)}")
    ids = list(ids)
    for position, index in enumerate(ids):
        if isinstance(index, bool) or not isinstance(index, numbers.Integral):
            raise InputTypeError(f"ids must be ints, got {index!r} at position {position}")
        if not 0 <= index < size:
            raise ValueError(f"unknown id {index} at position {position}: not in [0, {size})")
    return [int(i) for i in ids]


BAD = [
    -1,
    SIZE,
    SIZE + 1,
    2**70,
    -(2**70),
    True,
    False,
    1.5,
    2.0,
    "3",
    None,
    np.bool_(True),
    np.float64(1.0),
    torch.tensor(3),
    [3],
    b"\x03",
]
GOOD = [0, SIZE - 1, np.int64(7), np.int32(SIZE - 1), np.uint8(255), Small.THREE]


def _inputs() -> list[object]:
    """Ids of every shape that decode may be given: good, and with one or two bad ids."""
    cases: list[object] = [
        [],
        [5],
        list(range(SIZE)),
        (1, 2),
        range(4),
        iter([1, 2]),
        torch.tensor([1, 2, SIZE - 1]),
        np.array([0, 9]),
        torch.tensor(5),
        torch.tensor([[1, 2]]),
        torch.tensor([1.0]),
        torch.tensor([True]),
        np.array([SIZE]),
        torch.tensor([-3]),
        "abc",
        b"ab",
        7,
        None,
        {1, 2},
    ]
    for value in BAD + GOOD:
        for position in (0, 1, 40):
            cases.append([5] * position + [value] + [6] * 3)
    cases.append([5, SIZE, 1.5])  # out of range first, then a float: the first one is named
    cases.append([5, 1.5, SIZE])
    cases.append([5, True, -1])
    return cases


def _outcome(check, ids: object) -> tuple:
    """What ``check`` does with ``ids``: its list of ids, or its error's type and message."""
    try:
        out = check(ids, SIZE)
    except (TypeError, ValueError) as error:
        return type(error).__name__, str(error)
    assert all(type(i) is int for i in out), f"{check.__name__} returned {out!r:.80}"
    return "ok", list(out)


def _disagreements(check) -> list[str]:
    """The inputs on which ``check`` and the per-id loop differ, each with the two outcomes."""
    found = []
    for ids in _inputs():
        if isinstance(ids, Iterable) and not hasattr(ids, "__len__"):
            continue  # an iterator is used up by the first check: compared on its own below
        ours, loop = _outcome(check, ids), _outcome(_loop_check, ids)
        if ours != loop:
            found.append(f"{ids!r:.60}: {ours!r:.100} instead of {loop!r:.100}")
    return found


def test_bulk_check_refuses_and_accepts_exactly_what_the_loop_does():
    bad = _disagreements(_check_ids)
    assert not bad, f"{len(bad)} inputs checked differently, the first: {bad[0]}"
    assert _outcome(_check_ids, iter([1, 2])) == ("ok", [1, 2])
    assert _outcome(_check_ids, (i for i in [1, SIZE])) == _outcome(_loop_check, [1, SIZE])


def _broken(drop: str):
    """`_check_ids` with one part of its bulk check removed (the loop is then skipped too)."""

    def check(ids: object, size: int) -> list[int]:
        ids = ids.tolist() if hasattr(ids, "tolist") else ids
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
            raise InputTypeError(f"ids must be a sequence of int, got {type_name(ids)}")
        ids = list(ids)
        types_ok = drop == "types" or set(map(type, ids)) == {int}
        if not ids or (
            types_ok and (drop == "min" or min(ids) >= 0) and (drop == "max" or max(ids) < size)
        ):
            return [int(i) for i in ids]
        return _loop_check(ids, size)

    check.__name__ = f"check_without_{drop}"
    return check


@pytest.mark.parametrize("drop", ["types", "min", "max"])
def test_a_bulk_check_without_one_of_its_parts_is_caught(drop):
    bad = _disagreements(_broken(drop))
    assert bad, f"the check without its {drop} part passed every input"


@pytest.fixture(scope="module")
def tok():
    tokenizer = train_bpe(book_prose([1])[:6000], SIZE)
    assert tokenizer.vocab_size == SIZE, tokenizer.vocab_size
    return tokenizer


@pytest.mark.parametrize("value", BAD, ids=repr)
@pytest.mark.parametrize("later", [None, -5], ids=["alone", "then_another"])
def test_decode_names_the_first_bad_id_in_a_long_list(tok, value, later):
    ids = tok.encode(book_prose([1])[:3000])
    position = len(ids) // 2
    ids[position] = value
    if later is not None:
        ids.append(later)  # a second bad id, after the first
    expected = _outcome(_loop_check, ids)
    assert expected[0] != "ok" and f"at position {position}" in expected[1], expected
    for decode in (tok.decode, tok.decode_bytes):
        with pytest.raises((TypeError, ValueError)) as caught:
            decode(ids)
        assert (type(caught.value).__name__, str(caught.value)) == expected, caught.value


def test_decode_accepts_the_same_ids_in_every_form(tok):
    text = book_prose([1])[:3000]
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    forms = [
        tuple(ids),
        iter(ids),
        torch.tensor(ids),
        np.array(ids),
        np.array(ids, np.int32),
        [np.int64(i) for i in ids],
        ids[:5] + [Small.THREE] + ids[5:],
    ]
    for form in forms[:-1]:
        assert tok.decode(form) == text, type(form)
    assert tok.decode_bytes(forms[-1]) == tok.decode_bytes(ids[:5] + [3] + ids[5:])
    assert tok.decode([]) == "" and tok.id_to_token(np.int64(65)) == "A"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_tokenizer", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_bench_tokenizer_rows_quick_the_three_agree():
    bench = _bench()
    rows = bench.bench_tokenizer_rows(book_prose([1]), SIZE, 1, quick=True)
    assert [(r["group"], r["reference"].split(":")[1].strip()) for r in rows] == [
        ("(e) tokenizer", call)
        for call in ("encode_batch", "encode_ordinary", "decode_batch", "decode")
    ], rows
    for r in rows:
        assert "1 thread" in r["setup"] and r["rounds"] == 1, r
        assert r["same"].startswith("ids identical" if "encode" in r["ours"] else "text"), r
        assert r["ours_ms"] > 0 and r["ref_ms"] > 0 and r["ratio_median"] > 0, r
        assert r["tokens"] > 1000 and r["goal_met"] is None, r
    goals = [r for r in rows if r["goal"]]
    assert len(goals) == 1 and goals[0]["goal"] == bench.DECODE_GOAL, goals
    assert goals[0]["goal_value"] == goals[0]["ratio_median"] and "batch" in goals[0]["setup"]


def test_bench_tokenizer_stops_when_a_peer_disagrees(monkeypatch):
    bench = _bench()
    right = bench.tiktoken_encoding

    def swapped(ours):  # two merged tokens' ranks exchanged: tiktoken then merges otherwise
        enc = right(ours)
        ranks = dict(enc._mergeable_ranks)
        a, b = ours.decode_bytes([256]), ours.decode_bytes([257])
        ranks[a], ranks[b] = ranks[b], ranks[a]
        return bench.tiktoken.Encoding(
            name="swapped", pat_str=enc._pat_str, mergeable_ranks=ranks, special_tokens={}
        )

    monkeypatch.setattr(bench, "tiktoken_encoding", swapped)
    with pytest.raises(AssertionError, match="tiktoken's output differs from ours's"):
        bench.bench_tokenizer_rows(book_prose([1])[:4000], SIZE, 1, quick=True)
    with pytest.raises(ValueError, match="text must be a non-empty str"):
        bench.bench_tokenizer_rows("  ", SIZE, 1, quick=True)
