"""The grader's sessions with its children: the cells, then the cases, one message at a time.

For the grader (assignments' grading), as the part of `grader.sandbox.Grading` that talks
to children. `Conversation._wait` reads a child's next answer while it counts the child's CPU
time, wall-clock time, threads and scratch folder, handles its flags and answers its oracle
calls (`_answer`); `Sessions` runs the cases that share a child (`_session`: a new child goes on
after a lost case) and those run alone in fresh children by their checker's plan
(`_isolated`). What a child sends is checked by `grader.messages`; what it means for the
grade is decided by `Grading`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Generator
from typing import Any

import torch

from utils.checks.core import Run, Spec

from . import cgroups, kernel
from .children import Child, Stop
from .limits import (
    INTERRUPTED,
    MAX_CALLS,
    MAX_THREADS,
    POLL_S,
    SCRATCH_BYTES,
    SCRATCH_FILES,
    Limits,
)
from .messages import _clean_arg, _fields, _int, _str, clean_ready, clean_result
from .protocol import ProtocolError

_ORACLE_TYPES = ("ValueError", "TypeError", "IndexError", "RuntimeError", "OverflowError")


def _overtime(limits: Limits, what: str, cpu_limit: float, whole: bool) -> str:
    """What ran past which wall-clock backstop: the case's, or the whole notebook's."""
    if whole:
        return (f"the notebook as a whole ran past its wall-clock limit of "
                f"{limits.wall(limits.total_s):g} s")
    return f"{what} did not finish within {limits.wall(cpu_limit):g} s"


class Conversation:
    """Waiting for one child's answers (a mixin of `Grading`, whose state it uses)."""

    def _wait(self, child: Child, cpu_limit: float, what: str, position: int | None,
              oracle: Any = None) -> dict[str, Any]:
        """The next ``ready`` or ``result`` message of ``child``, handling flags and oracle
        calls on the way; raises `Stop` when the child runs out of CPU time, waits too long
        (never past the notebook's own backstop: waits just short of theirs would add up to
        hours), writes too much, dies, or sends something malformed."""
        start_cpu = child.cpu() or 0.0
        wall_by = min(time.monotonic() + self.limits.wall(cpu_limit), self.notebook_wall_by)
        calls = 0
        oracle_s = 0.0  # the grader's own CPU time on the child's calls, charged to the case
        while True:
            try:
                msg = child.reader.read(min(wall_by, time.monotonic() + POLL_S))
            except TimeoutError:
                if INTERRUPTED.is_set():
                    raise Stop("not finished: the grading was interrupted", "interrupted") from None
                used = (child.cpu() or start_cpu) - start_cpu + oracle_s
                if used > cpu_limit:
                    raise Stop(f"{what} did not finish within {cpu_limit:g} s of CPU time: an "
                                "endless loop, or far too much work?", "timeout") from None
                if time.monotonic() >= wall_by:
                    self.stalled = True  # a process that waits instead of computing: no more
                    late = _overtime(self.limits, what, cpu_limit, wall_by >= self.notebook_wall_by)
                    raise Stop(f"{late} (waiting or sleeping, not computing)", "timeout") from None
                if (kernel.thread_count(child.pid) or 0) > MAX_THREADS:
                    raise Stop(f"{what} started more than {MAX_THREADS} threads, past the "
                                "grader's limit", "limits") from None
                over = child.scratch_over()
                if over:
                    raise Stop(f"{what} wrote {over} in its folder, past the grader's limit",
                                "limits") from None
                continue
            except EOFError:
                if "memory" in child.limits_reached():
                    raise Stop(f"{what} used more than {self.limits.memory_mb} MiB of memory, "
                                "past the grader's limit", "limits") from None
                if position is None:
                    raise Stop("the notebook ended its own process while its cells ran "
                                "(os._exit, a signal, or memory use past the limit)",
                                "crashed") from None
                raise Stop("the process running your code ended during this case (os._exit, a "
                            "signal, or memory use past the limit)", "crashed") from None
            except ProtocolError as exc:
                raise Stop(f"the process running your code sent a message the grader could not "
                            f"read during {what} ({exc})", "protocol") from None
            child.cpu()
            op = msg.get("op")
            try:
                if op == "flag":
                    self._on_flag(msg, during_cells=position is None)
                elif op == "confined" and not child.confined:
                    child.confined = True  # from here on, the student's code runs
                elif op == "fatal" and not child.confined:
                    raise Stop("the grader could not confine the process that runs your code "
                                f"({str(msg.get('error'))[:200]}); tell your instructor",
                                "sandbox")
                elif op == "ready" and position is None:
                    self._kernel_limits(child)
                    return msg
                elif op == "result" and position is not None:
                    self._kernel_limits(child)
                    return clean_result(msg, position)
                elif op == "call" and oracle is not None:
                    calls += 1
                    if calls > MAX_CALLS:
                        raise ProtocolError(f"more than {MAX_CALLS} calls of an implementation")
                    began = time.thread_time()
                    self._answer(child, msg, oracle)
                    oracle_s += time.thread_time() - began
                else:
                    raise ProtocolError(f"an unexpected message ({str(op)[:20]})")
            except ProtocolError as exc:
                raise Stop(f"the process running your code sent a message the grader could not "
                            f"read during {what} ({exc})", "protocol") from None

    def _kernel_limits(self, child: Child) -> None:
        """Flag a child that reached its control group's task limit or filled its scratch
        folder: the kernel refused its threads or writes past it, so its code ran with what it
        had, and earns what it computed."""
        reached = child.limits_reached()
        if "tasks" in reached:
            self.result.flag("limits")
            self.result.note(f"your code tried to start more than {MAX_THREADS} threads; the "
                             "kernel refused the rest")
        if "scratch" in reached:
            self.result.flag("limits")
            self.result.note(f"your code filled its folder ({SCRATCH_BYTES // 2**20} MB or "
                             f"{SCRATCH_FILES} files); the kernel refused what came after")

    def _answer(self, child: Child, msg: dict[str, Any], oracle: Any) -> None:
        _fields(msg, {"op", "family", "k", "args"})
        family = _str(msg.get("family"), 20)
        k = _int(msg.get("k"))
        args = msg.get("args")
        if not isinstance(args, list) or len(args) > 4:
            raise ProtocolError("malformed arguments")
        args = [_clean_arg(a) for a in args]
        try:
            value = oracle(family, k, tuple(args))
            if not isinstance(value, torch.Tensor):
                raise RuntimeError("the implementation returned no tensor")
            reply: dict[str, Any] = {"op": "reply", "value": value}
        except Exception as exc:  # noqa: BLE001 (what the planted implementation raises)
            name = type(exc).__name__
            reply = {"op": "raise", "type": name if name in _ORACLE_TYPES else "RuntimeError",
                     "message": " ".join(str(exc).split())[:200]}
        child.send(reply)

    def _begin(self, child: Child) -> None:
        """Wait for the notebook's cells to run in ``child``."""
        msg = self._wait(child, self.limits.cells_s, "your notebook's cells", None)
        errors, mros = clean_ready(msg)
        for err in errors:
            if err not in self.result.cell_errors:
                self.result.cell_errors.append(err)
        self._check_targets(mros)


class Sessions(Conversation):
    """Running the cases in children (a mixin of `Grading`, whose state it uses)."""

    def _spawn(self, positions: list[int]) -> Child:
        if INTERRUPTED.is_set():
            raise Stop("not run: the grading was interrupted", "interrupted")
        targets = sorted({self.items[i][0].target for i in positions})
        start = self._start_message(self._rules_for(positions), targets)
        try:
            return Child(self.data, self.notebook.name if self.notebook.name.isprintable()
                          else "notebook.ipynb", start)
        except cgroups.GroupError as exc:
            raise Stop(f"the grader could not confine a process for your code ({exc.strerror}); "
                        "nothing of yours ran: ask for a regrade", "sandbox") from None
        except OSError as exc:
            why = exc.strerror or str(exc)
            raise Stop(f"the grader could not start a process for your code ({why}); the "
                        "machine was out of processes or memory: ask for a regrade",
                        "crashed") from None

    def _session(self, positions: list[int], start: int) -> int:
        """One child: run the cells, then the cases ``positions[start:]``; return where the next
        child starts."""
        try:
            child = self._spawn(positions)
        except Stop as stop:
            for i in positions[start:]:
                if self.outcome[i] is None:
                    self.outcome[i] = (stop.hint, stop.flag)
            return len(positions)
        try:
            try:
                self._begin(child)
            except Stop as stop:
                for i in positions[start:]:
                    if self.outcome[i] is None:
                        self.outcome[i] = (stop.hint, stop.flag)
                return len(positions)
            k = start
            while k < len(positions) and not self.stalled:
                i = positions[k]
                checker, case, spec = self.items[i]
                limit = case.time_limit(self.limits.case_s) or self.limits.case_s
                try:
                    child.send({"op": "case", "id": i, "target": checker.target,
                                "spec": _payload(spec)})
                    raw = self._wait(child, limit, checker.what, i)
                except Stop as stop:
                    self.outcome[i] = (stop.hint, stop.flag)
                    return k + 1
                self._judge(i, raw)
                k += 1
            with contextlib.suppress(Stop):
                child.send({"op": "end"}, timeout=1.0)
            return k
        finally:
            self.cpu_used += child.cpu_used()
            child.kill()

    def _run_alone(self, i: int, run: Run) -> dict[str, Any]:
        """One `Run` of case ``i`` in a fresh child; its raw result (raises `Stop`)."""
        checker, case, _ = self.items[i]
        child = self._spawn([i])
        try:
            self._begin(child)
            child.send({"op": "case", "id": i, "target": checker.target,
                        "spec": _payload(run.spec)})
            limit = case.time_limit(self.limits.case_s) or self.limits.case_s
            return self._wait(child, limit, checker.what, i, run.oracle)
        finally:
            self.cpu_used += child.cpu_used()
            child.kill()

    def _isolated(self, i: int) -> None:
        """Case ``i``, run by its checker's plan of fresh processes."""
        checker, _, spec = self.items[i]
        plan: Generator[Run, dict[str, Any], dict[str, Any]] | None = checker.isolated(spec)
        if plan is None:
            return
        try:
            run = next(plan)
            while True:
                if self._out_of_time():
                    raise Stop("the CPU time allowed for the whole notebook ran out before "
                                "this case", "timeout")
                raw = self._run_alone(i, run)
                if raw["status"] != "ok":
                    plan.close()
                    self._judge(i, raw)
                    return
                run = plan.send(raw)
        except StopIteration as done:
            self._judge(i, done.value)
        except Stop as stop:
            plan.close()
            self.outcome[i] = (stop.hint, stop.flag)
        except Exception as exc:  # noqa: BLE001 (results the plan cannot use lose this case)
            self.outcome[i] = (f"the results could not be compared ({type(exc).__name__})", "")


def _payload(spec: Spec) -> dict[str, Any]:
    """What the child gets of a spec: everything but the trusted side's ``config``."""
    payload = spec.to_payload()
    payload.pop("config", None)
    return payload
