"""StepGuard's per-step fast path: quiet steps are buffered and reach the gate in batches, a
step that may decide something reaches it at once, so decisions come at the same steps as
with a gate fed every step."""

from __future__ import annotations

import pytest
from scripted_probes import ScriptedProbe

from raytrain_guard.config import GuardConfig
from raytrain_guard.core.decisions import Cause
from raytrain_guard.core.gate import StepGate
from raytrain_guard.core.steps import StepStats
from raytrain_guard.runtime.guard import step_guard
from raytrain_guard.runtime.guard.step_guard import StepGuard
from raytrain_guard.runtime.guard.timing import StepTimer


@pytest.fixture(autouse=True)
def no_real_cache_release(monkeypatch):
    """The guard's cache release is ``gc.collect()``: 50-300 ms in a test process that holds
    Ray and torch, and a noisy run asks for it several times; what it frees is not this
    module's business (test_probes runs it)."""
    monkeypatch.setattr(step_guard, "release_cache", lambda: "released")


class HandClock:
    """The timer's clock, moved by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _step(guard, clock, step, total_s=0.01, data_s=0.0):
    """One step of ``total_s`` on the hand clock, ``data_s`` of it data wait and the rest
    forward; the step's decisions."""
    guard.begin_step(step)
    if data_s:
        clock.now += data_s
        guard.mark("data")
    clock.now += total_s - data_s
    guard.mark("forward")
    return guard.end_step(step)


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

    def observe(self, stats, **kwargs):
        self.num_observed += 1
        return super().observe(stats, **kwargs)


# 60 steps of 10 ms at 50 % memory, but for one slow step (41) and two in a row (46-47): no run
# of num_slow_steps=3. Then three steps of 50 ms (> 1.3 x the 10 ms median: a run of three slow
# steps -> SLOW_STEP at the third, step 62), 10 ms again, and a reading of 0.89 >= watermark
# 0.88 at step 70 (RELEASE_CACHE there).
TOTALS = ([0.010] * 41 + [0.050] + [0.010] * 4 + [0.050] * 2 + [0.010] * 12 + [0.050] * 3
          + [0.010] * 17)
FRACS = [0.5] * 70 + [0.89] + [0.5] * 9


def _reference() -> dict[int, list[str]]:
    """A gate fed every step directly: which decisions come at which step."""
    return _decisions_by_step(TOTALS, FRACS, GuardConfig(gate_batch_steps=5,
                                                         memory_predict_steps=0), fast=False)


def test_quiet_steps_reach_the_gate_in_batches_and_decisions_keep_their_step():
    # K = gate_batch_steps = 5. The j-th waiting step's quiet bound needs (n - 1) // 2 - j >= 0
    # of the n steps in the window: steps 0-4 go to the gate one by one (no bound under three
    # steps after the 2 warm-up ones); with n = 3, steps 5-6 have bounds and 7-9, over their
    # bound of 0, make a run of three: fed at 9; from then on a batch of K: 10-14 at 14, ...
    config = GuardConfig(gate_batch_steps=5, memory_predict_steps=0)
    clock = HandClock()
    guard = StepGuard(config, probe=ScriptedProbe(FRACS), timer=StepTimer(clock=clock),
                      clock=GateClock())
    gate = CountingGate(config, clock=GateClock())
    guard.gate = gate
    fed_at, got = [], {}
    for step, total in enumerate(TOTALS):
        before = gate.num_observed
        decisions = _step(guard, clock, step, total)
        if gate.num_observed > before:
            fed_at.append(step)
        if decisions:
            got[step] = [d.action.value for d in decisions]
    assert got == _reference() == {62: ["slow_step"], 70: ["release_cache"]}
    assert fed_at[:7] == [0, 1, 2, 3, 4, 9, 14]
    # steps 20-59 decide nothing: the gate is fed at every 5th step only, 8 times instead of
    # 40; the slow steps 41, 46 and 47 wait too (no run of three)
    assert [s for s in fed_at if 20 <= s < 60] == [24, 29, 34, 39, 44, 49, 54, 59]
    # 60 and 61 wait (slow: a run of two), 62 could complete the run (three): fed at once,
    # decided at once. The high reading goes at its own step.
    assert not {60, 61} & set(fed_at) and {62, 70} <= set(fed_at)
    # drain_stats gives every step, in order, without feeding the waiting ones to the gate;
    # reading the gate feeds them: every step reaches it once
    stats = guard.drain_stats()
    assert gate.num_observed < len(TOTALS)
    assert guard.gate.num_observed == len(TOTALS)
    assert [s.step for s in stats][-50:] == list(range(30, 80))
    assert [s.total_s for s in stats][-50:] == pytest.approx(TOTALS[30:])


def test_drain_and_state_dict_see_buffered_steps():
    config = GuardConfig(gate_batch_steps=10)
    clock = HandClock()
    guard = StepGuard(config, timer=StepTimer(clock=clock))
    guard.gate = gate = CountingGate(config)
    for step in range(45):
        assert _step(guard, clock, step) == []
    assert gate.num_observed < 45           # quiet steps are waiting (45 is no multiple of 10)
    assert [s.step for s in guard.drain_stats()][-1] == 44
    assert guard.state_dict()["gate"]["num_seen"] == 45


def test_host_memory_far_below_the_watermark_is_read_every_few_steps():
    # memory_read_every_steps=4, gate_batch_steps=5: quiet bounds from step 5 on (see
    # above); the reuse line is 0.88 - 0.05 = 0.83 and the margin is sized for a growth of
    # 0.05 / 4 = 0.0125 per step. Steps 0-4 read every step (5 reads). Step 5 reads 0.50:
    # 3 + int((0.83 - 0.50) / 0.0125) = 29 steps, capped at 4 x 4 - 1 = 15: reused at 6-20.
    # Step 21 reads 0.80: 3 + int(0.03 / 0.0125) = 5 steps reused (22-26). Step 27 reads
    # 0.84 >= 0.83: every step from then on (27-44: 18 reads) -> 25 reads for 45 steps.
    config = GuardConfig(gate_batch_steps=5, memory_read_every_steps=4)
    fracs = [0.5] * 6 + [0.80, 0.84]        # the last reading repeats
    probe = ScriptedProbe(fracs, cause=Cause.HOST_MEMORY)
    clock = HandClock()
    guard = StepGuard(config, probe=probe, timer=StepTimer(clock=clock))
    for step in range(45):
        _step(guard, clock, step)
    assert probe.num_reads == 25
    stats = guard.drain_stats()
    assert [s.memory_frac for s in stats] == pytest.approx([0.5] * 21 + [0.80] * 6
                                                          + [0.84] * 18)
    # a device probe is read every step
    device = ScriptedProbe([0.5])
    guard = StepGuard(config, probe=device, timer=StepTimer(clock=clock))
    for step in range(25):
        _step(guard, clock, step)
    assert device.num_reads == 25


def _decisions_by_step(totals, fracs, config, *, fast: bool, drain_every: int = 0,
                       datas=None) -> dict[int, list[str]]:
    """Decisions per step of a StepGuard (fast path: a host timer) or of a gate fed every
    step (fast=False: the reference). ``drain_every``: drain the guard's stats every this many
    steps too, checking that every step comes out once, in order, with its own figures."""
    if not fast:
        probe = ScriptedProbe(fracs)         # the fractions as the guard reads them (bytes)
        fracs = [probe.read().frac for _ in fracs]
        gate = StepGate(config, clock=GateClock())
        out = {}
        for step, (total, frac, data) in enumerate(zip(totals, fracs, datas or [0.0] * len(totals))):
            got = gate.observe(StepStats(step=step, total_s=total, data_wait_s=data,
                                         forward_s=total - data, memory_frac=frac))
            if got:
                out[step] = [d.action.value for d in got]
        return out
    clock = HandClock()
    guard = StepGuard(config, probe=ScriptedProbe(fracs), timer=StepTimer(clock=clock),
                      clock=GateClock(), sleep=lambda s: None)
    out, drained = {}, []
    for step, (total, data) in enumerate(zip(totals, datas or [0.0] * len(totals))):
        got = _step(guard, clock, step, total, data)
        if got:
            out[step] = [d.action.value for d in got]
        if drain_every and step % drain_every == 0:
            drained += guard.drain_stats()
    if drain_every:
        drained += guard.drain_stats()
        assert [s.step for s in drained] == list(range(len(totals)))
        assert [s.total_s for s in drained] == pytest.approx(totals)
    return out


@pytest.mark.parametrize(("batch", "run"), [(b, r) for b in (1, 5, 10, 20) for r in (1, 2, 3, 4)])
def test_noisy_steps_decide_at_the_same_steps_as_a_gate_fed_every_step(batch, run):
    # A noisy loop: 10 ms steps with 0-30 % jitter, isolated slow steps (15 %), bursts of 1-5
    # slow steps, memory wandering up to and past the watermark and back. Whatever waits in
    # the buffer, the decisions (kind and step) equal those of a gate fed every step, for every
    # batch size and run length (pacing on in half of them).
    import random

    rng = random.Random(batch * 10 + run)
    totals, fracs, frac = [], [], 0.5
    while len(totals) < 400:
        if rng.random() < 0.05:
            totals += [0.010 * rng.uniform(1.6, 4.0) for _ in range(rng.randint(1, 5))]
        else:
            totals.append(0.010 * (rng.uniform(1.6, 3.0) if rng.random() < 0.15
                                   else rng.uniform(1.0, 1.3)))
    for _ in totals:
        frac = min(0.99, max(0.3, frac + rng.choice((-0.02, 0.0, 0.0, 0.0, 0.03))))
        fracs.append(frac)
    config = GuardConfig(gate_batch_steps=batch, num_slow_steps=run, memory_predict_steps=0,
                         pacing_enabled=(batch + run) % 2 == 0)
    expected = _decisions_by_step(totals, fracs, config, fast=False)
    assert any("slow_step" in kinds for kinds in expected.values())
    assert _decisions_by_step(totals, fracs, config, fast=True) == expected
    # reading the stats every few steps (the train loop's report cadence) changes nothing
    assert _decisions_by_step(totals, fracs, config, fast=True,
                              drain_every=rng.choice((1, 3, 10))) == expected


def test_waiting_steps_are_capped_by_the_window():
    # gate_batch_steps=20 with step_window=20: the batch is capped at 20 // 2 - 5 = 5 steps, so
    # the last waiting step's quiet bound (the (19 // 2 - 4) = 5th smallest total + the floor)
    # stays off the fastest steps; steady 10 ms steps reach the gate every 5th step, not every
    # 20th.
    config = GuardConfig(step_window=20, gate_batch_steps=20)
    clock = HandClock()
    guard = StepGuard(config, timer=StepTimer(clock=clock))
    gate = CountingGate(config, clock=GateClock())
    guard.gate = gate
    fed_at = []
    for step in range(80):
        before = gate.num_observed
        _step(guard, clock, step)
        if gate.num_observed > before:
            fed_at.append(step)
    late = [s for s in fed_at if s >= 40]
    assert late == list(range(44, 80, 5))
    guard.feed.flush()
    assert gate.num_observed == 80


@pytest.mark.parametrize("seed", range(20))
def test_a_part_that_grows_decides_at_the_same_steps_as_a_gate_fed_every_step(seed):
    # A straggler's step: its compute grows while the wait before it shrinks, so the step
    # grows less than its compute (slow_component_growth_steps). 10.5-13 ms steps, 8-10 ms of
    # them data wait; runs of 1-8 steps whose forward grows to 15.8-17.5 ms (by more than a
    # median step) while the data wait drops to about nothing: the step stays under a
    # whole-step line of 1.5 x (set here), slow by its part.
    import random

    rng = random.Random(seed)
    totals, datas = [], []
    while len(totals) < 300:
        if rng.random() < 0.04:
            for _ in range(rng.randint(1, 8)):
                datas.append(0.0003 * rng.random())
                totals.append(datas[-1] + rng.uniform(0.0158, 0.0175))
        else:
            datas.append(rng.uniform(0.008, 0.010))
            totals.append(datas[-1] + 0.0025 * rng.uniform(1.0, 1.2))
    fracs = [0.5] * len(totals)
    config = GuardConfig(gate_batch_steps=rng.choice((1, 5, 10, 20)),
                         num_slow_steps=rng.choice((1, 2, 3)), slow_step_factor=1.5)
    expected = _decisions_by_step(totals, fracs, config, fast=False, datas=datas)
    assert any("slow_step" in kinds for kinds in expected.values())
    assert _decisions_by_step(totals, fracs, config, fast=True, datas=datas) == expected
    # the whole-step rule alone sees fewer of them: the part is what makes these steps slow
    alone = GuardConfig(gate_batch_steps=config.gate_batch_steps,
                        num_slow_steps=config.num_slow_steps, slow_component_growth_steps=0,
                        slow_step_factor=1.5)
    seen_alone = _decisions_by_step(totals, fracs, alone, fast=False, datas=datas)
    assert (sum("slow_step" in kinds for kinds in seen_alone.values())
            < sum("slow_step" in kinds for kinds in expected.values()))


@pytest.mark.parametrize("gap_s,expected", [(0.0, [22]), (0.031, [26]), (0.029, [22])])
def test_a_pause_between_steps_lets_the_next_steps_settle(gap_s, expected):
    # 10 ms steps; before step 20 the loop spends gap_s between steps (a user's checkpoint,
    # which the guard does not see). Over 3 median steps (30 ms) it is a pause: steps
    # 20-22, twice as long, settle (slow_step_settle_steps 3) and the event comes from three
    # slow steps 24-26 after them; a shorter gap is no pause and 20-22 make the event at 22.
    clock = HandClock()
    guard = StepGuard(GuardConfig(), timer=StepTimer(clock=clock), clock=GateClock())
    slow = {20, 21, 22, 24, 25, 26}
    events = []
    for step in range(30):
        if step == 20:
            clock.now += gap_s
        events += [step for d in _step(guard, clock, step, 0.02 if step in slow else 0.01)
                   if d.action.value == "slow_step"]
    guard.feed.flush()
    assert events == expected
