"""A hang watchdog on every rank: a step that does not end in time is named, and ended.

A daemon thread looks at the step in progress every ``interval_s``; past
``max(hang_floor_s, hang_step_multiple x median step)`` it hands ``on_hang`` a record of the
rank, its node, the phase, how long, and where the training thread is (inside
``torch.distributed`` or not). Why this ends the process: docs/coordination.md ("Hangs").
"""

from __future__ import annotations

import logging
import os
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)


class StepWatchdog:
    """Watches the step in progress of the thread that builds it (the training thread).
    ``warmup_steps``: steps that must end before it arms (start-up, the first DDP iteration).
    ``clock`` and ``start_thread`` are seams for tests, which call :meth:`check` by hand.
    """

    def __init__(self, *, floor_s: float, step_multiple: float,
                 on_hang: Callable[[dict[str, Any]], None], world_rank: int = 0,
                 node_id: str = "", world_size: int | None = None, warmup_steps: int = 3,
                 interval_s: float = 0.5, clock: Callable[[], float] = time.monotonic,
                 start_thread: bool = True) -> None:
        self.floor_s = floor_s
        self.step_multiple = step_multiple
        self.on_hang = on_hang
        self.world_rank = world_rank
        self.node_id = node_id
        self.world_size = world_size
        self._watched = threading.get_ident()
        self.warmup_steps = warmup_steps
        self.interval_s = interval_s
        self._clock = clock
        self._durations: deque[float] = deque(maxlen=64)
        self.step: int | None = None          # the step in progress; None between steps
        self.phase = "data"
        self.step_since = 0.0
        self.phase_since = 0.0
        self.fired: dict[str, Any] | None = None
        self._stop = threading.Event()
        self._thread = None
        if start_thread:
            self._thread = threading.Thread(target=self._run, name="raytrain-guard-watchdog",
                                            daemon=True)
            self._thread.start()

    # -- the loop's calls ----------------------------------------------------------------------
    def begin(self, step: int) -> None:
        self.step_since = self.phase_since = self._clock()
        self.phase = "data"
        self.step = step

    def enter(self, phase: str) -> None:
        self.phase_since = self._clock()
        self.phase = phase

    def end(self) -> None:
        if self.step is not None:
            self._durations.append(self._clock() - self.step_since)
        self.step = None

    # -- the thread ----------------------------------------------------------------------------
    def limit_s(self) -> float | None:
        """The time a step may take now; None before ``warmup_steps`` steps ended."""
        if len(self._durations) < self.warmup_steps:
            return None
        median = statistics.median(self._durations) if self._durations else 0.0
        return max(self.floor_s, self.step_multiple * median)

    def check(self) -> dict[str, Any] | None:
        """One look; the record handed to ``on_hang`` when the step in progress is too long
        (once per run: after that the process is expected to end)."""
        step, limit = self.step, self.limit_s()
        if step is None or limit is None or self.fired is not None:
            return None
        now = self._clock()
        running = now - self.step_since
        if running <= limit:
            return None
        in_collective, where = thread_position(self._watched)
        self.fired = {
            "world_rank": self.world_rank, "node_id": self.node_id, "step": step,
            "world_size": self.world_size,
            "phase": self.phase, "phase_for_s": round(now - self.phase_since, 3),
            "step_for_s": round(running, 3), "limit_s": round(limit, 3),
            "last_progress_wall": time.time() - (now - self.phase_since),
            "in_collective": in_collective, "where": where,
            "reason": (f"rank {self.world_rank} (node {self.node_id[:8]}) step {step} has run "
                       f"{running:.1f} s, over its limit of {limit:.1f} s; it has been in "
                       f"{self.phase} for {now - self.phase_since:.1f} s"),
        }
        try:
            self.on_hang(self.fired)
        except Exception:
            logger.warning("rank %d: the watchdog's hang handler failed", self.world_rank,
                           exc_info=True)
        return self.fired

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.check()

    def close(self) -> None:
        self._stop.set()


def thread_position(thread_ident: int) -> tuple[bool | None, str]:
    """``(in torch.distributed, "file:line function")`` of a thread's innermost Python frame;
    ``(None, "")`` when the thread is gone. Read once, when a hang is named."""
    frame = sys._current_frames().get(thread_ident)
    if frame is None:
        return None, ""
    path = frame.f_code.co_filename.replace(os.sep, "/")
    short = path.split("site-packages/", 1)[-1] if "site-packages/" in path else \
        "/".join(path.split("/")[-3:])
    return "torch/distributed/" in path, f"{short}:{frame.f_lineno} {frame.f_code.co_name}"
