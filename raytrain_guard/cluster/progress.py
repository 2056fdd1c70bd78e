"""A run's progress while it trains: the coordinator's status read on a thread, as one line."""

from __future__ import annotations

import logging
import shutil
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, TextIO

logger = logging.getLogger(__name__)


class ProgressWatcher:
    """Reads the coordinator's status every ``interval_s`` on a thread (kept in ``latest``, for
    the summary should the coordinator die) and hands it to ``progress``. :meth:`read_now` is
    the one method that touches ``ray.get``."""

    def __init__(self, coordinator: Any, progress: Callable[[Mapping[str, Any]], None] | None,
                 interval_s: float) -> None:
        self.coordinator = coordinator
        self.progress = progress
        self.interval_s = interval_s
        self.latest: dict[str, Any] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="raytrain_guard-progress",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def read_now(self, timeout_s: float = 5.0) -> dict[str, Any] | None:
        import ray
        try:
            self.latest = dict(ray.get(self.coordinator.status.remote(), timeout=timeout_s))
        except Exception as exc:  # noqa: BLE001 - progress is best effort
            logger.debug("coordinator status unavailable: %r", exc)
            return None
        return self.latest

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            status = self.read_now()
            if status is not None and self.progress is not None:
                try:
                    self.progress(status)
                except Exception:  # a progress callback must not stop the run (logged)
                    logger.debug("progress callback failed", exc_info=True)


def progress_line(status: Mapping[str, Any], total_steps: int | None = None,
                  started: float | None = None, clock: Callable[[], float] = time.monotonic
                  ) -> str:
    """A one-line live view of a coordinator status. ``rank mem``: the highest of the ranks'
    own memory figures; ``node GPU mem``: the fullest GPU the node monitors read, if any;
    ``active decisions``: those still to apply or in force."""
    step = status.get("latest_step")
    ranks = status.get("ranks") or {}
    mem = [r.get("memory_frac") for r in ranks.values()
           if isinstance(r, Mapping) and r.get("memory_frac") is not None]
    nodes = status.get("nodes") or {}
    gpu = [g.get("memory_frac") for n in nodes.values() if isinstance(n, Mapping)
           for g in n.get("gpus") or () if isinstance(g, Mapping)
           and g.get("memory_frac") is not None]
    p50, p99 = status.get("step_p50_s"), status.get("step_p99_s")
    parts = [f"step {'-' if step is None else step}"
             + (f"/{total_steps}" if total_steps else ""),
             f"{len(ranks)} ranks",
             f"step p50 {p50:.3f} s p99 {p99:.3f} s" if p50 is not None and p99 is not None
             else "step time -",
             f"rank mem {max(mem):.0%}" if mem else "rank mem -"]
    if gpu:
        parts.append(f"node GPU mem {max(gpu):.0%}")
    parts.append(f"active decisions {len(status.get('active_decisions') or [])}")
    if started is not None:
        parts.append(f"{clock() - started:.0f} s")
    return " | ".join(parts)


class ProgressPrinter:
    """A ``progress`` callback for ``launch`` that writes :func:`progress_line` to ``out``: on a
    terminal one line redrawn in place (cut to its width, so it does not wrap); in a log, a
    line each time the step moves on."""

    def __init__(self, out: TextIO, total_steps: int | None = None,
                 started: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.out, self.total_steps, self.started, self.clock = out, total_steps, started, clock
        self.tty = out.isatty()
        self._last_step: Any = ...

    def __call__(self, status: Mapping[str, Any]) -> None:
        line = progress_line(status, self.total_steps, self.started, self.clock)
        if self.tty:
            width = shutil.get_terminal_size((100, 24)).columns - 1
            self.out.write("\r" + line[:width] + "\x1b[K")
        else:
            step = status.get("latest_step")
            if step == self._last_step:
                return
            self._last_step = step
            self.out.write(line + "\n")
        self.out.flush()
