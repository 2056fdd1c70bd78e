"""NodeMonitor: samples one node's GPUs and host at a fixed interval (a plain class that
``cluster.actors.start_monitors`` makes one actor of per alive node and run).

Fail-open: a GPU probe that cannot start or fails puts the monitor in host-only mode with one
warning; a failing host probe, metrics or sink is warned about once and skipped.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from raytrain_guard.config import GuardConfig
from raytrain_guard.core.node_samples import NodeSample
from raytrain_guard.log import warn_once

logger = logging.getLogger(__name__)

Sink = Callable[[dict], None]


class NodeMonitor:
    """Samples this node's GPUs (NVML) and host (psutil), or scripted probes in their place.

    ``gpu_probe`` / ``host_probe``: None builds the real ones (:mod:`.probes`). ``sink``
    receives every sample as a dict (the actor sends it to the coordinator). ``metrics``: an
    object with ``record(NodeSample)`` (``NodeMetrics`` in an actor).
    """

    def __init__(self, node_id: str, config: GuardConfig | None = None, *,
                 gpu_probe: Any = None, host_probe: Any = None, sink: Sink | None = None,
                 metrics: Any = None, clock: Callable[[], float] = time.monotonic,
                 autostart: bool = False) -> None:
        from raytrain_guard.cluster.monitor import probes as node_probes
        self.node_id = str(node_id)
        self.config = config or GuardConfig()
        self._clock = clock
        self._sink = sink
        self._metrics = metrics
        self._epoch = uuid.uuid4().hex[:12]
        self._seq = 0
        self._lock = threading.Lock()
        self._workers: dict[int, int | None] = {}
        self._warned: set[str] = set()
        self._gpu_error: str | None = None
        self._gpu_probe = gpu_probe
        if gpu_probe is None:
            try:
                self._gpu_probe = node_probes.default_gpu_probe()
            except Exception as exc:
                self._host_only(f"{exc}")
        self._gpu_takes_workers = node_probes.takes_workers(self._gpu_probe)
        self._host_probe = host_probe
        if host_probe is None:
            try:
                self._host_probe = node_probes.PsutilHostProbe(
                    self.config.worker_memory_interval_s)
            except Exception as exc:
                self._warn_once("host", "host probe unavailable (%s); no host figures", exc)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if autostart:
            self.start()

    # -- registration ------------------------------------------------------------------------
    def register_worker(self, pid: int, world_rank: int | None = None) -> None:
        """Sample this train worker's private memory (and its DataLoader workers') from now on."""
        with self._lock:
            self._workers[int(pid)] = None if world_rank is None else int(world_rank)

    # -- sampling ----------------------------------------------------------------------------
    def sample(self) -> dict:
        """Take one sample now (``NodeSample.to_dict()``), record it and send it to the sink."""
        with self._lock:
            workers = dict(self._workers)
            self._seq += 1
            seq = self._seq
        gpus: tuple = ()
        if self._gpu_probe is not None:
            try:
                gpus = tuple(self._gpu_probe.sample(workers) if self._gpu_takes_workers
                             else self._gpu_probe.sample())
            except Exception as exc:
                self._gpu_probe = None
                self._host_only(f"GPU probe failed: {exc}")
        host = None
        if self._host_probe is not None:
            try:
                host = self._host_probe.sample(workers)
            except Exception as exc:
                self._warn_once("host-sample", "host probe failed (%s); sample without host", exc)
        if host is not None:
            seen = {w.pid for w in host.workers}
            with self._lock:   # pids that are gone stop being sampled
                for pid in [p for p in workers if p not in seen]:
                    self._workers.pop(pid, None)
        sample = NodeSample(self.node_id, seq, self._epoch, self._clock(), host, gpus,
                            self._gpu_error)
        data = sample.to_dict()
        if self._metrics is not None:
            try:
                self._metrics.record(sample)
            except Exception as exc:
                self._warn_once("metrics", "recording metrics failed (%s)", exc)
        if self._sink is not None:
            try:
                self._sink(data)
            except Exception as exc:
                self._warn_once("sink", "sending the sample failed (%s); will keep trying", exc)
        return data

    # -- background thread -------------------------------------------------------------------
    def start(self) -> bool:
        """Start sampling every ``monitor_interval_s`` in a daemon thread. Idempotent."""
        if self._thread is not None and self._thread.is_alive():
            return False
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name=f"monitor-{self.node_id[:8]}",
                                        daemon=True)
        self._thread.start()
        return True

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5 * self.config.monitor_interval_s + 1)

    def _loop(self) -> None:
        interval = self.config.monitor_interval_s
        next_t = time.monotonic()
        while True:
            self.sample()
            next_t = max(next_t + interval, time.monotonic())
            if self._stop.wait(max(0.0, next_t - time.monotonic())):
                return

    # -- warnings ----------------------------------------------------------------------------
    def _host_only(self, why: str) -> None:
        self._gpu_error = why
        self._warn_once("gpu", "host-only monitoring: %s", why)

    def _warn_once(self, key: str, msg: str, *args: Any) -> None:
        warn_once(logger, key, "[node %s] " + msg, self.node_id[:12], *args, said=self._warned)
