"""Probes, the fault injector and the StepGuard that joins timer + probe + gate.

The memory-budget test is real: ProcessMemoryProbe reads this process's RSS against a small
budget, and ballast memory pushes it over the watermark and the critical line.
"""

from __future__ import annotations

import json
import logging

import pytest
from scripted_probes import FailingProbe, ScriptedProbe

from raytrain_guard.config import GuardConfig
from raytrain_guard.core.decisions import Action, Cause
from raytrain_guard.errors import InputError
from raytrain_guard.experiment.rehearsal import FaultInjector
from raytrain_guard.runtime.guard.cache_release import release_cache
from raytrain_guard.runtime.guard.probes import MemoryReading, ProcessMemoryProbe
from raytrain_guard.runtime.guard.step_guard import StepGuard
from raytrain_guard.runtime.guard.timing import StepTimer
from raytrain_guard.units import MiB


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 10.0     # every read 10 s later: release spacing never blocks
        return self.now


def run_steps(guard: StepGuard, steps):
    out = {}
    for step in steps:
        guard.begin_step(step)
        guard.mark("forward")
        got = guard.end_step(step)
        if got:
            out[step] = [d.action for d in got]
    return out


# -- probes ------------------------------------------------------------------------------------
def test_memory_reading_fractions():
    # max(used 60, reserved 80) / 100 = 0.8; cached: (80 - 60) / 100 = 0.2.
    r = MemoryReading(used_bytes=60, reserved_bytes=80, total_bytes=100)
    assert r.frac == 0.8 and r.cached_frac == 0.2


def test_scripted_probe_script_errors_and_repeat():
    boom = RuntimeError("nvml gone")
    probe = ScriptedProbe([0.5, MemoryReading(1, 2, 4), boom], total_bytes=1000)
    assert probe.read() == MemoryReading(500, 500, 1000, cache_known=False)
    assert probe.read().frac == 0.5
    with pytest.raises(RuntimeError, match="nvml gone"):
        probe.read()
    with pytest.raises(RuntimeError):     # the last item repeats
        probe.read()
    once = ScriptedProbe([0.1], repeat_last=False)
    once.read()
    with pytest.raises(IndexError):
        once.read()
    with pytest.raises(InputError, match="readings"):
        ScriptedProbe([])


def test_process_probe_reads_rss_against_budget():
    probe = ProcessMemoryProbe(GuardConfig(cpu_memory_budget_bytes=64 * 1024**3))
    r = probe.read()
    assert r.total_bytes == 64 * 1024**3 and r.used_bytes > 10 * MiB and r.frac < 1
    assert probe.cause is Cause.HOST_MEMORY
    import psutil
    host = ProcessMemoryProbe(local_world_size=4)
    assert host.total_bytes == psutil.virtual_memory().total // 4
    with pytest.raises(InputError, match="local_world_size"):
        ProcessMemoryProbe(local_world_size=0)


def test_cuda_probe_reads_allocator_counters():
    torch = pytest.importorskip("torch")
    from raytrain_guard.runtime.guard.probes import CudaMemoryProbe
    if not torch.cuda.is_available():
        with pytest.raises(InputError, match="CUDA"):
            CudaMemoryProbe()
        pytest.skip("needs CUDA for the reading itself")
    probe = CudaMemoryProbe()
    before = probe.read()
    x = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")
    after = probe.read()
    assert after.used_bytes - before.used_bytes >= 256 * MiB
    del x
    # the CUDA context the allocator does not see counts: config.cuda_context_bytes on top
    # of the allocator's figures (1 GiB by default)
    allocated = torch.cuda.memory_allocated()
    assert probe.context_bytes == GuardConfig().cuda_context_bytes
    assert probe.read().used_bytes == allocated + GuardConfig().cuda_context_bytes
    bare = CudaMemoryProbe(context_bytes=0)
    assert bare.read().used_bytes == torch.cuda.memory_allocated()
    small = CudaMemoryProbe(config=GuardConfig(cuda_context_bytes=3 * MiB))
    assert small.read().reserved_bytes == torch.cuda.memory_reserved() + 3 * MiB


# -- fault injector ------------------------------------------------------------------------------
def test_fault_injector_delays_only_chosen_rank_step_and_phase():
    slept = []
    on1 = FaultInjector(world_rank=1, sleep=slept.append)
    on0 = FaultInjector(world_rank=0, sleep=slept.append)
    for inj in (on0, on1):
        inj.delay(0.5, phase="forward", ranks={1}, steps=range(3, 5))
        inj.delay(0.25, phase="data")                  # every rank, every step
    for step in range(6):
        for inj in (on0, on1):
            inj.on_mark(step, "forward")
    assert slept == [0.5, 0.5]                          # rank 1, steps 3 and 4
    on0.on_mark(0, "data")
    assert slept[-1] == 0.25 and on1.num_delays == 2
    with pytest.raises(InputError, match="phase"):
        on0.delay(1.0, phase="compute")


def test_failing_probe():
    probe = FailingProbe(ScriptedProbe([0.5]), fail_reads={1})
    assert probe.read().frac == 0.5
    with pytest.raises(RuntimeError, match="injected"):
        probe.read()
    assert probe.read().frac == 0.5


# -- StepGuard ---------------------------------------------------------------------------------
def test_ballast_over_a_cpu_budget_checkpoints_and_stops_once_and_releases_nothing():
    # Budget: current RSS / 0.70, so the process sits at about 70 %. Ballast of 25 % of the
    # budget takes it to about 95 %: >= 0.90 checkpoints and stops; past the watermark nothing
    # is released (host memory has no allocator cache). Without the ballast it falls back to
    # about 70 %; ballast again decides nothing: the stop never repeats.
    rss = ProcessMemoryProbe(budget_bytes=1).read().used_bytes
    budget = int(rss / 0.70)
    config = GuardConfig(cpu_memory_budget_bytes=budget, memory_predict_steps=0)
    seen = []
    guard = StepGuard(config, probe=ProcessMemoryProbe(config), clock=FakeClock(),
                      on_decision=seen.append)
    assert run_steps(guard, range(3)) == {}
    inj = FaultInjector()
    inj.allocate_ballast(int(0.25 * budget))
    assert run_steps(guard, [3, 4]) == {3: [Action.CHECKPOINT_AND_STOP]}
    del inj                                             # the ballast goes with it
    assert run_steps(guard, [5]) == {}
    inj = FaultInjector()
    inj.allocate_ballast(int(0.25 * budget))
    assert run_steps(guard, [6]) == {}
    del inj
    assert [d.action for d in seen] == [Action.CHECKPOINT_AND_STOP]
    assert seen[0].cause is Cause.HOST_MEMORY and "rank 0 step 3" in seen[0].reason
    stats = guard.drain_stats()
    assert [s.step for s in stats] == list(range(7)) and guard.drain_stats() == []
    assert stats[3].memory_frac >= 0.90 and stats[5].memory_frac < 0.85


def test_a_release_is_decided_only_where_the_allocator_holds_cache_to_free():
    # 89 % of the card, past the watermark (prediction off): 10 % of it cached but unallocated
    # releases; the same 89 % all allocated (a simulated card, or a CUDA allocator with no
    # slack) does not, and the rule stays armed for a reading with cache; a bare scripted
    # fraction does not tell the cache and keeps the watermark rule alone.
    total = 1000
    config = GuardConfig(memory_predict_steps=0)
    cases = {"cached": [MemoryReading(790, 890, total)],
             "allocated": [MemoryReading(890, 890, total)] * 2 + [MemoryReading(790, 890, total)],
             "unknown": [0.89]}
    got = {}
    for name, script in cases.items():
        guard = StepGuard(config, probe=ScriptedProbe(script, total_bytes=total),
                          clock=FakeClock())
        got[name] = run_steps(guard, range(len(script) + 1))
    assert got == {"cached": {0: [Action.RELEASE_CACHE]},
                   "allocated": {2: [Action.RELEASE_CACHE]},
                   "unknown": {0: [Action.RELEASE_CACHE]}}
    assert MemoryReading(790, 890, total).cached_frac == pytest.approx(0.1)
    assert MemoryReading(890, 890, total).cached_frac == 0.0
    assert ScriptedProbe([0.89]).read().cached_frac is None


def test_fill_to_reaches_the_fraction():
    # Budget = RSS / 0.5, fill to 0.8: about 0.3 x budget of ballast; the probe then reads
    # 0.8 give or take what else the process allocated meanwhile.
    rss = ProcessMemoryProbe(budget_bytes=1).read().used_bytes
    probe = ProcessMemoryProbe(budget_bytes=int(rss / 0.5))
    inj = FaultInjector()
    added = inj.fill_to(probe, 0.8)
    assert added > 0 and 0.75 <= probe.read().frac <= 0.85
    assert inj.fill_to(probe, 0.5) == 0                # already above: nothing more
    with pytest.raises(InputError, match="frac"):
        inj.fill_to(probe, 0)
    del inj                                             # the ballast goes with it


def test_pacing_sleeps_before_steps_only_when_enabled():
    fracs = [0.80, 0.89, 0.89, 0.84, 0.84]
    for enabled, expected in ((False, []), (True, [0.05, 0.05])):
        slept = []
        config = GuardConfig(pacing_enabled=enabled, memory_predict_steps=0)
        guard = StepGuard(config, probe=ScriptedProbe(fracs), clock=FakeClock(),
                          sleep=slept.append)
        run_steps(guard, range(5))
        # Crossing at step 1 paces steps 2 and 3; 0.84 at step 3 stops it before step 4.
        assert slept == expected


def test_fails_open_when_probe_or_gate_raise(caplog):
    probe = FailingProbe(ScriptedProbe([0.5, 0.95]), fail_reads={0, 1})
    guard = StepGuard(GuardConfig(), probe=probe, clock=FakeClock())
    with caplog.at_level(logging.WARNING, logger="raytrain_guard.runtime.guard.step_guard"):
        got = run_steps(guard, range(4))
    # Reads 0 and 1 raise (logged once, the inner probe is not read); read 2 gives the
    # script's 0.5, read 3 its 0.95 -> release and stop.
    assert got == {3: [Action.RELEASE_CACHE, Action.CHECKPOINT_AND_STOP]}
    assert sum("guard part 'probe' failed" in r.message for r in caplog.records) == 1
    assert len(guard.drain_stats()) == 4

    class BrokenGate:
        def observe(self, stats, **kwargs):
            raise ZeroDivisionError("bug")

    guard.gate = BrokenGate()
    assert run_steps(guard, [4, 5]) == {}


def test_release_cache_on_cpu_collects_and_trims():
    assert release_cache() in ("gc.collect + malloc_trim", "gc.collect")


def test_phase_context_passthrough_and_injected_data_delay():
    slept = []
    inj = FaultInjector(sleep=slept.append)
    inj.delay(0.1, phase="data", steps={1})
    guard = StepGuard(GuardConfig(), fault_injector=inj)
    for step in range(3):
        guard.begin_step(step)
        with guard.phase("data"):
            pass
        guard.end_step(step)
    assert slept == [0.1]
    assert [s.step for s in guard.drain_stats()] == [0, 1, 2]


def test_pacing_survives_a_checkpoint_round_trip():
    # Crossing the watermark at step 1 paces (0.05 s); a guard restored from that state keeps
    # sleeping before each step (the gate's "pacing" flag alone would not make it sleep),
    # and stops when memory falls below the re-arm line (0.84 < 0.88 - 0.03).
    config = GuardConfig(pacing_enabled=True, memory_predict_steps=0)
    guard = StepGuard(config, probe=ScriptedProbe([0.80, 0.89]), clock=FakeClock())
    run_steps(guard, range(2))
    assert guard.pace_delay_s == 0.05
    slept = []
    resumed = StepGuard(config, probe=ScriptedProbe([0.89, 0.84, 0.84]), clock=FakeClock(),
                        sleep=slept.append)
    resumed.load_state_dict(json.loads(json.dumps(guard.state_dict())))
    run_steps(resumed, range(2, 5))
    assert slept == [0.05, 0.05]
    # an older state (gate only) restores without pacing
    resumed.load_state_dict({"gate": guard.gate.state_dict()})
    assert resumed.pace_delay_s == 0.0


def test_set_pace_is_public_and_checked():
    slept = []
    guard = StepGuard(GuardConfig(), sleep=slept.append)
    guard.set_pace(0.02)
    guard.begin_step(0)
    guard.set_pace(0)
    guard.begin_step(1)
    assert slept == [0.02]
    with pytest.raises(InputError, match="delay_s"):
        guard.set_pace(-1)


@pytest.mark.parametrize("marked", [True, False])
def test_injected_optimizer_delay_runs_whether_or_not_the_loop_marks_optimizer(marked):
    # A fake clock that a sleep advances: forward and backward take 1 s each, the injected
    # optimizer delay 0.5 s at step 1 only. The train loop marks no optimizer phase (the
    # rest after backward is the optimizer's): the delay must run there too, once.
    now = [0.0]
    inj = FaultInjector(sleep=lambda s: now.__setitem__(0, now[0] + s))
    inj.delay(0.5, phase="optimizer", steps={1})
    guard = StepGuard(GuardConfig(), fault_injector=inj,
                      timer=StepTimer(clock=lambda: now[0]))
    for step in range(3):
        guard.begin_step(step)
        for phase in ("forward", "backward"):
            now[0] += 1.0
            guard.mark(phase)
        if marked:
            guard.mark("optimizer")
        guard.end_step(step)
    assert inj.num_delays == 1
    assert [s.optimizer_s for s in guard.drain_stats()] == [0.0, 0.5, 0.0]
