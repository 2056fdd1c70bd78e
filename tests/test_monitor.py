"""NodeMonitor with scripted probes, NVML absent, and the real psutil host probe."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import time

import pytest

from raytrain_guard.cluster.monitor.monitor import NodeMonitor
from raytrain_guard.cluster.monitor.probes import (
    ProbeError,
    PsutilHostProbe,
    ScriptedGpuProbe,
    ScriptedHostProbe,
)
from raytrain_guard.config import GuardConfig
from raytrain_guard.core.node_samples import GpuSample, HostSample, NodeSample
from raytrain_guard.units import GiB, MiB

HOST = HostSample(memory_total_bytes=64 * GiB, memory_available_bytes=16 * GiB,
                  swap_used_bytes=1 * GiB, swap_total_bytes=8 * GiB, cpu_frac=0.5)


class Recorder:
    """A metrics sink that keeps what it was given (stands in for NodeMetrics, not under test)."""

    def __init__(self):
        self.samples = []

    def record(self, sample):
        self.samples.append(sample)
        return 1


def test_scripted_probes_sampled_in_order_to_sink_and_metrics():
    gpus = ScriptedGpuProbe([
        [GpuSample(0, 40 * GiB, 80 * GiB, 0.9, 70.0, 500.0)],
        [GpuSample(0, 76 * GiB, 80 * GiB, 1.0, 88.0, 700.0, ("thermal", "power"))],
    ])
    sent, metrics = [], Recorder()
    t = iter([10.0, 11.0, 12.0])
    mon = NodeMonitor("node-a", gpu_probe=gpus, host_probe=ScriptedHostProbe([HOST]),
                      sink=sent.append, metrics=metrics, clock=lambda: next(t))
    first, second, third = mon.sample(), mon.sample(), mon.sample()
    assert [s["seq"] for s in sent] == [1, 2, 3]
    assert [s["time_s"] for s in sent] == [10.0, 11.0, 12.0]
    s2 = NodeSample.from_dict(second)
    # 76 / 80 GiB = 0.95; throttled for thermal and power
    assert s2.gpus[0].memory_frac == 0.95 and s2.gpus[0].throttle_reasons == ("thermal", "power")
    assert third["gpus"] == second["gpus"]            # the script's last entry repeats
    # host: 1 - 16/64 = 0.75 used
    assert s2.host.memory_used_frac == 0.75 and s2.gpu_error is None
    assert [m.seq for m in metrics.samples] == [1, 2, 3]
    assert sent[-1] == third
    assert NodeSample.from_dict(first) == NodeSample.from_dict(sent[0])


def test_nvml_absent_is_host_only_with_one_warning(caplog, monkeypatch):
    # This machine has no NVML library; force it anyway where one exists.
    monkeypatch.setenv("RAYTRAIN_GUARD_DISABLE_NVML", "1")
    with caplog.at_level(logging.WARNING, logger="raytrain_guard.cluster.monitor.monitor"):
        mon = NodeMonitor("node-b", host_probe=ScriptedHostProbe([HOST]))
        samples = [mon.sample() for _ in range(5)]
    warnings = [r for r in caplog.records if "host-only" in r.getMessage()]
    assert len(warnings) == 1
    assert all(s["gpus"] == [] and s["gpu_error"] and s["host"] for s in samples)


def test_real_nvml_probe_without_nvml_falls_back(caplog):
    # Without a GPU here, the default (real) probe must not crash the monitor.
    from raytrain_guard.cluster.monitor.probes import NvmlGpuProbe
    try:
        NvmlGpuProbe()
    except ProbeError:
        pass
    else:
        pytest.skip("NVML present on this machine")
    with caplog.at_level(logging.WARNING):
        mon = NodeMonitor("node-c", host_probe=ScriptedHostProbe([HOST]))
        mon.sample()
        mon.sample()
    assert sum("host-only" in r.getMessage() for r in caplog.records) == 1
    assert "NVML" in mon.sample()["gpu_error"]


def test_gpu_probe_failing_mid_run_goes_host_only(caplog):
    gpus = ScriptedGpuProbe([[GpuSample(0, 1, 2)], RuntimeError("Xid 79: GPU fell off the bus")])
    with caplog.at_level(logging.WARNING):
        mon = NodeMonitor("node-d", gpu_probe=gpus, host_probe=ScriptedHostProbe([HOST]))
        a, b, c = mon.sample(), mon.sample(), mon.sample()
    assert len(a["gpus"]) == 1 and b["gpus"] == [] == c["gpus"]
    assert "Xid 79" in b["gpu_error"] and c["host"] is not None
    assert sum("host-only" in r.getMessage() for r in caplog.records) == 1


def test_failing_sink_and_host_probe_never_raise(caplog):
    def broken_sink(_):
        raise ConnectionError("coordinator gone")
    with caplog.at_level(logging.WARNING):
        mon = NodeMonitor("node-e", gpu_probe=ScriptedGpuProbe([[]]),
                          host_probe=ScriptedHostProbe([OSError("proc unreadable")]),
                          sink=broken_sink)
        out = [mon.sample() for _ in range(3)]
    assert [s["host"] for s in out] == [None] * 3
    messages = [r.getMessage() for r in caplog.records]
    assert sum("sending the sample failed" in m for m in messages) == 1
    assert sum("host probe failed" in m for m in messages) == 1


def test_registered_workers_reach_the_sample():
    mon = NodeMonitor("node-f", gpu_probe=ScriptedGpuProbe([[]]),
                      host_probe=ScriptedHostProbe([HOST], worker_private_bytes=5 * MiB))
    mon.register_worker(111, 0)
    mon.register_worker(222, 1)
    workers = mon.sample()["host"]["workers"]
    assert workers == [{"pid": pid, "world_rank": rank, "private_bytes": 5 * MiB,
                        "loader_private_bytes": 0, "num_loader_processes": 0}
                       for pid, rank in ((111, 0), (222, 1))]


def _hold_memory(n_bytes, ready):
    block = bytearray(n_bytes)          # touched pages: private memory of this child
    for i in range(0, n_bytes, 4096):
        block[i] = 1
    ready.set()
    time.sleep(60)


def test_psutil_probe_measures_a_worker_and_its_loader_children():
    """A real process tree: this test process is the 'train worker', a child holding 64 MiB
    is its 'DataLoader worker'; the probe must find the child and its private memory."""
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    child = ctx.Process(target=_hold_memory, args=(64 * MiB, ready), daemon=True)
    child.start()
    try:
        assert ready.wait(30)
        mon = NodeMonitor("node-g", gpu_probe=ScriptedGpuProbe([[]]), host_probe=PsutilHostProbe())
        mon.register_worker(os.getpid(), 0)
        mon.register_worker(999_999_999, 7)          # no such process: dropped
        host = NodeSample.from_dict(mon.sample()).host
        (w,) = host.workers
        assert w.pid == os.getpid() and w.world_rank == 0 and w.private_bytes > 0
        assert w.num_loader_processes >= 1
        assert w.loader_private_bytes >= 64 * MiB    # the child's touched 64 MiB
        assert 0.0 < host.memory_used_frac < 1.0 and host.memory_total_bytes > 0
    finally:
        child.kill()
        child.join()


def test_private_memory_is_read_once_per_interval_and_forgotten_when_gone(monkeypatch):
    """A USS reading walks a process's page tables (some 7 ms for a rank holding torch): the
    probe reads each process again only after ``private_interval_s``, and drops the readings
    of processes that are gone."""
    from raytrain_guard.cluster.monitor import probes
    reads = []
    monkeypatch.setattr(probes, "private_bytes", lambda pid: reads.append(pid) or 1 * MiB)
    now = [100.0]
    probe = PsutilHostProbe(5.0, clock=lambda: now[0])
    me = os.getpid()
    assert probe.sample({me: 0}).workers[0].private_bytes == 1 * MiB
    first = len(reads)                                   # this process and its children
    assert reads.count(me) == 1
    now[0] += 4.9                                        # within the interval: the last one
    assert probe.sample({me: 0}).workers[0].private_bytes == 1 * MiB
    assert len(reads) == first
    now[0] += 0.1                                        # 5 s after the first: read again
    probe.sample({me: 0})
    assert reads.count(me) == 2
    probe.sample({})                                     # no longer registered: forgotten,
    probe.sample({me: 0})                                # so read at once when it is again
    assert reads.count(me) == 3
    alone = PsutilHostProbe()                            # no interval: every sample reads
    alone.sample({me: 0})
    alone.sample({me: 0})
    assert reads.count(me) == 5


def test_the_monitors_host_probe_reads_private_memory_at_the_configured_interval():
    mon = NodeMonitor("node-i", GuardConfig(worker_memory_interval_s=7.0),
                      gpu_probe=ScriptedGpuProbe([[]]))
    assert mon._host_probe._private_interval_s == 7.0


def test_background_thread_samples_at_the_interval():
    sent = []
    cfg = GuardConfig(monitor_interval_s=0.05)
    mon = NodeMonitor("node-h", cfg, gpu_probe=ScriptedGpuProbe([[]]),
                      host_probe=ScriptedHostProbe([HOST]), sink=sent.append)
    assert mon.start() is True and mon.start() is False     # idempotent
    deadline = time.monotonic() + 10
    while len(sent) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    mon.stop()
    mon._thread.join(timeout=30)     # stop() waits a bounded time; a stalled box may need more
    n = len(sent)
    assert n >= 3 and not mon._thread.is_alive()
    time.sleep(0.15)
    assert len(sent) == n                                   # stopped means stopped


@pytest.mark.gpu
def test_nvml_probe_reads_every_gpu_when_nvml_exists():
    """Runs where NVML and a GPU exist (skipped here): one reading per device, sane figures."""
    from raytrain_guard.cluster.monitor.probes import NvmlGpuProbe
    try:
        probe = NvmlGpuProbe()
    except ProbeError as exc:
        pytest.skip(f"no NVML here: {exc}")
    import pynvml
    gpus = probe.sample()
    assert len(gpus) == pynvml.nvmlDeviceGetCount() >= 1
    for g in gpus:
        assert 0 < g.memory_used_bytes <= g.memory_total_bytes
        assert g.utilization_frac is None or 0.0 <= g.utilization_frac <= 1.0
        assert g.temperature_c is None or 0 < g.temperature_c < 120
        assert set(g.throttle_reasons) <= {"thermal", "power", "slowdown"}
    # process_pids: a list of ints (this test holds no CUDA context, so maybe empty) or None
    assert all(g.process_pids is None or all(isinstance(p, int) for p in g.process_pids)
               for g in gpus)
    mon = NodeMonitor("gpu-node", gpu_probe=probe, host_probe=ScriptedHostProbe([HOST]))
    sample = mon.sample()
    assert len(sample["gpus"]) == len(gpus) and sample["gpu_error"] is None


def test_psutil_probe_reads_the_container_limit(monkeypatch):
    """In a container with an 8 GiB cgroup limit and 6 GiB used in it, the host is 8 GiB with
    at most 2 GiB available, whatever the machine's RAM (the cgroup files are simulated: this
    machine's container is unlimited)."""
    import psutil

    import raytrain_guard.runtime.host_memory as hm
    if psutil.virtual_memory().total <= 8 * GiB:
        pytest.skip("needs a machine with more than 8 GiB of RAM")
    monkeypatch.setattr(hm, "read_cgroup_memory", lambda: (8 * GiB, 6 * GiB))
    host = PsutilHostProbe().sample({})
    assert host.memory_total_bytes == 8 * GiB
    assert host.memory_available_bytes <= 2 * GiB and host.memory_used_frac >= 0.75


def test_scripted_gpus_mark_the_ones_holding_registered_workers():
    # GPU 0 holds the run's workers, GPU 1 another job's process 999
    gpus = ScriptedGpuProbe([[GpuSample(0, 50, 100), GpuSample(1, 99, 100, process_pids=(999,))]],
                            worker_gpus=[0])
    mon = NodeMonitor("node-i", gpu_probe=gpus, host_probe=ScriptedHostProbe([HOST]))
    mon.register_worker(222, 1)
    mon.register_worker(111, 0)
    got = NodeSample.from_dict(mon.sample()).gpus
    assert [g.process_pids for g in got] == [(111, 222), (999,)]
    plain = NodeMonitor("node-j", gpu_probe=ScriptedGpuProbe([[GpuSample(0, 50, 100)]]),
                        host_probe=ScriptedHostProbe([HOST]))
    plain.register_worker(111, 0)
    assert plain.sample()["gpus"][0]["process_pids"] is None     # unknown, as scripted


def test_empty_scripts_are_input_errors():
    from raytrain_guard.errors import InputError
    with pytest.raises(InputError, match="script"):
        ScriptedGpuProbe([])
    with pytest.raises(InputError, match="script"):
        ScriptedHostProbe([])
