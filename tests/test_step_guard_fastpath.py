"""StepGuard's per-step fast path: quiet steps are buffered and reach the gate in batches, a
step that may decide something reaches it at once, so decisions come at the same steps as
with a gate fed every step."""

from __future__ import annotations

import pytest

from raytrain_guard.config import GuardConfig
from raytrain_guard.core.decisions import Cause
from raytrain_guard.core.gate import StepGate
from raytrain_guard.core.steps import StepStats
from raytrain_guard.runtime.probes import ScriptedProbe
from raytrain_guard.runtime.step_guard import StepGuard
from raytrain_guard.runtime.timing import StepTimer


class HandClock:
    """The timer's clock, moved by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class GateClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 10.0     # release spacing never blocks
        return self.now


class CountingGate(StepGate):
    """The real gate, counting the steps it is fed."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.num_observed = 0

    def observe(self, stats):
        self.num_observed += 1
        return super().observe(stats)


# 60 steps of 10 ms at 50 % memory, then three steps of 50 ms (> 1.5 x the 10 ms median: a
# run of num_slow_steps=3 slow steps -> SLOW_STEP at the third, step 62), 10 ms again, and a
# reading of 0.89 >= watermark 0.88 at step 70 (RELEASE_CACHE there).
TOTALS = [0.010] * 60 + [0.050] * 3 + [0.010] * 17
FRACS = [0.5] * 70 + [0.89] + [0.5] * 9


def _reference() -> dict[int, list[str]]:
    """A gate fed every step directly: which decisions come at which step."""
    gate = StepGate(GuardConfig(lockstep_every_steps=5, memory_predict_steps=0),
                    clock=GateClock())
    out = {}
    for step, (total, frac) in enumerate(zip(TOTALS, FRACS)):
        got = gate.observe(StepStats(step=step, total_s=total, forward_s=total,
                                     memory_frac=frac))
        if got:
            out[step] = [d.action.value for d in got]
    return out


def test_quiet_steps_reach_the_gate_in_batches_and_decisions_keep_their_step():
    # K = lockstep_every_steps = 5. The quiet bound needs (n - 1) // 2 - (K - 1) >= 0, n >= 9
    # steps in the window: steps 2-10 (after 2 warm-up steps) go to the gate one by one, then
    # quiet steps wait: 11-15 go at 15, 16-20 at 20, ...
    config = GuardConfig(lockstep_every_steps=5, memory_predict_steps=0)
    clock = HandClock()
    guard = StepGuard(config, probe=ScriptedProbe(FRACS), timer=StepTimer(clock=clock),
                      clock=GateClock())
    gate = CountingGate(config, clock=GateClock())
    guard.gate = gate
    fed_at, got = [], {}
    for step, total in enumerate(TOTALS):
        guard.begin_step(step)
        clock.now += total
        guard.mark("forward")
        before = gate.num_observed
        decisions = guard.end_step(step)
        if gate.num_observed > before:
            fed_at.append(step)
        if decisions:
            got[step] = [d.action.value for d in decisions]
    assert got == _reference() == {62: ["slow_step"], 70: ["release_cache"]}
    # steps 20-59 are quiet: the gate is fed at every 5th step only, 8 times instead of 40
    assert [s for s in fed_at if 20 <= s < 60] == [20, 25, 30, 35, 40, 45, 50, 55]
    # each slow step and the high reading go to the gate at their own step
    assert {60, 61, 62, 70} <= set(fed_at)
    # every step reaches the gate once, and drain_stats gives every step, in order
    stats = guard.drain_stats()
    assert gate.num_observed == len(TOTALS)
    assert [s.step for s in stats][-50:] == list(range(30, 80))
    assert [s.total_s for s in stats][-50:] == pytest.approx(TOTALS[30:])


def test_drain_and_state_dict_see_buffered_steps():
    config = GuardConfig(lockstep_every_steps=10)
    clock = HandClock()
    guard = StepGuard(config, timer=StepTimer(clock=clock))
    for step in range(45):
        guard.begin_step(step)
        clock.now += 0.01
        guard.mark("forward")
        assert guard.end_step(step) == []
    assert guard._buffer                    # quiet steps are waiting (45 is no multiple of 10)
    assert [s.step for s in guard.drain_stats()][-1] == 44
    assert guard.state_dict()["gate"]["num_seen"] == 45


def test_host_memory_far_below_the_watermark_is_read_every_few_steps():
    # memory_read_every_steps=4, lockstep_every_steps=5: quiet bounds from step 11 on (see
    # above). Steps 0-10 read every step (11 reads); from 11 on, 0.50 < 0.88 - 0.05 is reused
    # for 3 steps: reads at 11, 15, 19 (3 reads). At 19 the script reads 0.84 >= 0.83: every
    # step from then on (20-24: 5 reads) -> 19 reads for 25 steps.
    config = GuardConfig(lockstep_every_steps=5, memory_read_every_steps=4)
    fracs = [0.5] * 13 + [0.84]             # read number 14 (step 19) is 0.84, then repeats
    probe = ScriptedProbe(fracs, cause=Cause.HOST_MEMORY)
    clock = HandClock()
    guard = StepGuard(config, probe=probe, timer=StepTimer(clock=clock))
    for step in range(25):
        guard.begin_step(step)
        clock.now += 0.01
        guard.mark("forward")
        guard.end_step(step)
    assert probe.num_reads == 19
    stats = guard.drain_stats()
    assert [s.memory_frac for s in stats[11:20]] == pytest.approx([0.5] * 8 + [0.84])
    # a device probe is read every step
    device = ScriptedProbe([0.5])
    guard = StepGuard(config, probe=device, timer=StepTimer(clock=clock))
    for step in range(25):
        guard.begin_step(step)
        clock.now += 0.01
        guard.mark("forward")
        guard.end_step(step)
    assert device.num_reads == 25
