"""How `make bench` times one thing against another, so that the ratio measures the code.

Every comparison of the benchmark goes through `interleave`: the contenders (ours, the peer a
user would pick, and any other) run in one process, in rounds. Each round runs every contender
once, in a fixed order on even rounds and the reverse order on odd ones, so that a contender is
neither always first (cold caches) nor always last; one untimed warm-up call of each comes
first. Each call is timed twice:

* CPU time (``time.process_time``: the time the process's threads spent on a core), which a
  second program on the machine does not inflate: a call that waits for a core is not charged
  for the wait. On one thread it is the work the code does. On a GPU it would miss the device's
  work, so there the clock is the wall clock after a ``torch.cuda.synchronize``.
* wall time (``time.perf_counter``), what a user waits, reported beside it.

A ratio is formed per round (ours in round r over the reference in round r: the two ran
seconds apart, on the same machine state), and the report gives the minimum and the median of
those per-round ratios, with the median wall-time ratio beside them. A goal is judged on the
median CPU-time ratio.

Every contender returns its output, and `interleave` checks after the warm-up that all of them
agree (``same(reference_output, other_output)``, by default `torch.equal` / ``==``): a faster
wrong answer is not a result. The check runs once, before the timed rounds, and raises
`AssertionError` naming the contender.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

__all__ = ["Timing", "interleave", "ratio_summary", "default_same", "one_thread"]


@dataclass
class Timing:
    """One contender's per-round times, in seconds."""

    cpu: list[float] = field(default_factory=list)
    wall: list[float] = field(default_factory=list)

    @property
    def cpu_median(self) -> float:
        return statistics.median(self.cpu)

    @property
    def wall_median(self) -> float:
        return statistics.median(self.wall)


def default_same(a: object, b: object) -> bool:
    """Exact equality of two outputs: tensors by `torch.equal`, anything else by ``==``."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(default_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _sync(device: torch.device | None) -> None:
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def interleave(contenders: dict[str, Callable[[], object]], rounds: int, *,
               reference: str | None = None,
               same: Callable[[object, object], bool] | None = default_same,
               before: Callable[[str], None] | None = None,
               device: torch.device | None = None) -> dict[str, Timing]:
    """Time every contender ``rounds`` times, interleaved, after one untimed warm-up call each.

    Args:
        contenders: name -> a function of no argument that does the work and returns its
            output (kept only for the equality check of the warm-up round).
        rounds: timed rounds, at least 1; each runs every contender once, the order reversed
            on odd rounds.
        reference: the contender whose output the others must equal (default: the first).
        same: ``same(reference_output, output) -> bool``; None skips the check (only for
            contenders whose outputs differ by design, e.g. tokens per second of a copy).
        before: called untimed before each call with the contender's name (e.g. to empty a
            cache that the contender must not find warm).
        device: a CUDA device makes the clock the wall clock after synchronising.

    Returns:
        name -> `Timing` (per-round CPU and wall seconds; on CUDA both are wall seconds).

    Raises:
        AssertionError: when a contender's warm-up output differs from the reference's.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    names = list(contenders)
    reference = names[0] if reference is None else reference
    cuda = device is not None and device.type == "cuda"
    outputs = {}
    for name in names:
        if before is not None:
            before(name)
        outputs[name] = contenders[name]()
    _sync(device)
    if same is not None:
        for name in names:
            if name != reference and not same(outputs[reference], outputs[name]):
                raise AssertionError(f"{name}'s output differs from {reference}'s")
    del outputs
    timings = {name: Timing() for name in names}
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            if before is not None:
                before(name)
            _sync(device)
            wall0, cpu0 = time.perf_counter(), time.process_time()
            contenders[name]()
            _sync(device)
            wall1, cpu1 = time.perf_counter(), time.process_time()
            timings[name].wall.append(wall1 - wall0)
            timings[name].cpu.append((wall1 - wall0) if cuda else (cpu1 - cpu0))
    return timings


def ratio_summary(timings: dict[str, Timing], ours: str, reference: str) -> dict:
    """Per-round ratios ours / reference: the min and median of the CPU-time ones, the median
    of the wall-time ones, and the median seconds of each (CPU and wall)."""
    a, b = timings[ours], timings[reference]
    cpu = [x / y for x, y in zip(a.cpu, b.cpu, strict=True) if y > 0]
    wall = [x / y for x, y in zip(a.wall, b.wall, strict=True) if y > 0]
    return {
        "ours_ms": a.cpu_median * 1e3, "ref_ms": b.cpu_median * 1e3,
        "ours_wall_ms": a.wall_median * 1e3, "ref_wall_ms": b.wall_median * 1e3,
        "ratio_min": min(cpu), "ratio_median": statistics.median(cpu),
        "wall_ratio_median": statistics.median(wall), "rounds": len(cpu),
    }


class one_thread:
    """A context in which torch runs on ``n`` threads (default 1), restored on exit."""

    def __init__(self, n: int = 1):
        self.n, self.saved = n, None

    def __enter__(self) -> one_thread:
        self.saved = torch.get_num_threads()
        torch.set_num_threads(self.n)
        return self

    def __exit__(self, *exc: object) -> None:
        torch.set_num_threads(self.saved)


def make_row(group: str, case: str, ours: str, reference: str, summary: dict, *, setup: str,
             same: str, goal: str | None = None, goal_value: float | None = None,
             goal_met: bool | None = None, note: str = "", **extra: object) -> dict:
    """One row of the benchmark's table.

    Args:
        group, case: the row's group, e.g. ``"(e) tokenizer"``, and its sizes.
        ours, reference: what is timed, and the peer it is timed against.
        summary: `ratio_summary`'s dict (or one with the same keys).
        setup: threads, modes and anything else that fixes what was measured.
        same: what was asserted equal, in words (e.g. ``"ids identical"``).
        goal: the goal in words, or None for a row without one; ``goal_value`` the figure it
            is judged on, ``goal_met`` whether it is met (None: not judged, e.g. quick sizes).
        note: anything else a reader needs; ``extra``: more fields for the JSON.
    """
    return {"group": group, "case": case, "ours": ours, "reference": reference,
            "setup": setup, "same": same, **summary, "goal": goal, "goal_value": goal_value,
            "goal_met": goal_met, "note": note, **extra}
