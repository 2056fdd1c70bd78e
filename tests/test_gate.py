"""Unit tests of the pure step gate (raytrain_guard.core.gate): a fake clock, scripted numbers.

Memory rules use GuardConfig defaults unless a case says otherwise: watermark 0.88, critical
0.90, hysteresis 0.03 (re-arm below 0.85), release spacing 5 s, trend over 5 readings,
prediction 3 steps ahead. Timing rules: warmup 2 steps, slow = 1.3 x recent median, 3 in a row.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from raytrain_guard.config import GuardConfig
from raytrain_guard.core.decisions import Action, Cause
from raytrain_guard.core.gate import RankRole, StepGate, attribute_across_ranks
from raytrain_guard.core.slow_steps import attribute_slow_steps
from raytrain_guard.core.steps import StepStats
from raytrain_guard.errors import InputError


class FakeClock:
    def __init__(self, step_s: float = 10.0) -> None:
        self.now = 0.0
        self.step_s = step_s

    def __call__(self) -> float:
        return self.now


def feed_memory(gate: StepGate, clock: FakeClock, fracs):
    """{index: [actions]} for every reading that triggered something."""
    out = {}
    for i, frac in enumerate(fracs):
        got = gate.observe_memory(i, frac)
        if got:
            out[i] = [d.action for d in got]
        clock.now += clock.step_s
    return out


R, S, P = Action.RELEASE_CACHE, Action.CHECKPOINT_AND_STOP, Action.PACE

MEMORY_CASES = [
    # (name, config changes, seconds per step, fractions, expected {index: actions})
    # Hysteresis: release at 0.88 (index 1); 0.89/0.87/0.86/0.89 stay >= 0.85 so no re-arm;
    # 0.84 < 0.85 re-arms; 0.88 at index 7 releases again. Prediction off to isolate it.
    ("hysteresis", {"memory_predict_steps": 0}, 10.0,
     [0.80, 0.88, 0.89, 0.87, 0.86, 0.89, 0.84, 0.88], {1: [R], 7: [R]}),
    # Spacing: 1 s per step, releases >= 5 s apart: index 0 (t=0) releases, 0.80 re-arms,
    # t=2,3,4 are too soon (still armed), t=5 releases.
    ("release spacing", {"memory_predict_steps": 0}, 1.0,
     [0.89, 0.80, 0.89, 0.89, 0.89, 0.89, 0.89], {0: [R], 5: [R]}),
    # Critical once: 0.90 >= 0.90 stops (and releases: first crossing); 0.95 and, after
    # re-arming at 0.80, 0.92 release again but never stop twice.
    ("critical escalates once", {"memory_predict_steps": 0}, 10.0,
     [0.85, 0.90, 0.95, 0.80, 0.92], {1: [R, S], 4: [R]}),
    # Trend: readings 0.80 0.83 0.86 0.88 (x = 0..3, means 1.5 and 0.8425): slope =
    # (1.5*.0425 + .5*.0125 + .5*.0175 + 1.5*.0375) / (2.25+.25+.25+2.25) = .135/5 = 0.027 per
    # step; 0.88 + 3 * 0.027 = 0.961 >= 0.90 -> stop at index 3, before any reading hits 0.90.
    ("trend predicts critical", {}, 10.0, [0.80, 0.83, 0.86, 0.88], {3: [R, S]}),
    # Flat at 0.88: slope 0 -> 0.88 predicted, below critical: release only.
    ("flat above watermark", {}, 10.0, [0.88, 0.88, 0.88, 0.88], {0: [R]}),
    # Rising but below the watermark: the prediction only looks above it.
    ("rising below watermark", {}, 10.0, [0.70, 0.75, 0.80, 0.85], {}),
    ("pacing off by default", {"memory_predict_steps": 0}, 10.0,
     [0.80, 0.89, 0.89, 0.84], {1: [R]}),
    # Pacing on: start at the crossing (delay 0.05), stop once below 0.85.
    ("pacing when enabled", {"memory_predict_steps": 0, "pacing_enabled": True}, 10.0,
     [0.80, 0.89, 0.89, 0.84], {1: [R, P], 3: [P]}),
]


@pytest.mark.parametrize("name,changes,step_s,fracs,expected", MEMORY_CASES,
                         ids=[c[0] for c in MEMORY_CASES])
def test_memory_rules(name, changes, step_s, fracs, expected):
    clock = FakeClock(step_s)
    gate = StepGate(GuardConfig(**changes), clock=clock)
    assert feed_memory(gate, clock, fracs) == expected


def test_the_watermark_releases_only_cache_the_allocator_holds():
    # cache_release_min_frac 5 %: 4.9 % cached decides nothing and keeps the rule armed; 5 %
    # releases; then nothing until memory dips under the re-arm line. Unknown (None): the
    # watermark rule alone.
    config = GuardConfig(memory_predict_steps=0)
    gate = StepGate(config, clock=FakeClock(10.0))
    assert gate.observe_memory(0, 0.89, cached_frac=0.0) == []
    assert gate.observe_memory(1, 0.89, cached_frac=0.049) == []
    assert [d.action for d in gate.observe_memory(2, 0.89, cached_frac=0.05)] == [R]
    assert gate.observe_memory(3, 0.89, cached_frac=0.2) == []
    unknown = StepGate(config, clock=FakeClock(10.0))
    assert [d.action for d in unknown.observe(StepStats(0, 0.1, memory_frac=0.89))] == [R]


def test_pacing_params_and_reasons():
    clock = FakeClock()
    gate = StepGate(GuardConfig(pacing_enabled=True, memory_predict_steps=0), clock=clock)
    start = next(d for d in gate.observe_memory(5, 0.89) if d.action is P)
    stop = next(d for d in gate.observe_memory(6, 0.84) if d.action is P)
    assert start.params["delay_s"] == 0.05 and stop.params["delay_s"] == 0.0
    assert "89.0%" in start.reason and "step 5" in start.reason
    assert start.cause is Cause.DEVICE_MEMORY


def test_stop_reason_names_prediction_and_cause():
    gate = StepGate(GuardConfig(), clock=FakeClock(), memory_cause=Cause.HOST_MEMORY)
    decisions = []
    for i, frac in enumerate([0.80, 0.83, 0.86, 0.88]):
        decisions += gate.observe_memory(i, frac, world_rank=3)
    stop = next(d for d in decisions if d.action is S)
    assert stop.cause is Cause.HOST_MEMORY
    assert "rank 3 step 3" in stop.reason and "96.1% predicted in 3 steps" in stop.reason
    assert gate.stopped


# -- slow steps ---------------------------------------------------------------------------------
NORMAL = {"total_s": 0.100, "data_wait_s": 0.010, "forward_s": 0.030, "backward_s": 0.040,
          "optimizer_s": 0.010, "comm_wait_s": 0.010}
# Slow variants: each adds 0.100 s to one component (and to the total): 0.200 > 1.3 x 0.100.
SLOW = {
    "data": dict(NORMAL, total_s=0.200, data_wait_s=0.110),
    "compute": dict(NORMAL, total_s=0.200, forward_s=0.130),
    "comm": dict(NORMAL, total_s=0.200, comm_wait_s=0.110),
    "untimed": dict(NORMAL, total_s=0.200),
}


def feed_steps(gate: StepGate, kinds):
    """Feed steps ('n' normal, or a SLOW key); return [(index, decision)] of SLOW_STEP events."""
    out = []
    for i, kind in enumerate(kinds):
        fields = NORMAL if kind == "n" else SLOW[kind]
        for d in gate.observe(StepStats(step=i, **fields)):
            out.append((i, d))
    return out


def slow_step_events(gate: StepGate, fields_per_step, *, pause_at: int | None = None):
    """Feed one step per dict of StepStats fields (steps 0, 1, ...), noting a pause before
    step ``pause_at``; return [(step, decision)] of the SLOW_STEP decisions."""
    events = []
    for i, fields in enumerate(fields_per_step):
        if i == pause_at:
            gate.note_pause(i)
        events += [(i, d) for d in gate.observe(StepStats(step=i, **fields))
                   if d.action is Action.SLOW_STEP]
    return events


WARM = ["n"] * 2 + ["n"] * 6    # 2 warmup steps, then a baseline of 6 normal steps (median 0.1)

def test_the_steps_after_a_checkpoint_settle_before_they_are_judged():
    # A checkpoint before step 8: its three slow steps 8-10 (slow_step_settle_steps 3) are
    # not judged and stay out of the median; three slow steps at 14-16 make the event at 16.
    # Without the pause, the slow steps at 8-10 make it at 10 (and the streak of 14-16, no
    # longer than the one that ended by itself, none: adaptive persistence).
    kinds = WARM + ["compute"] * 3 + ["n"] * 3 + ["compute"] * 3
    paused = StepGate(GuardConfig())
    events = slow_step_events(paused, [NORMAL if k == "n" else SLOW[k] for k in kinds],
                              pause_at=8)
    assert [i for i, _ in events] == [16]
    assert [s.step for s in paused.window] == [2, 3, 4, 5, 6, 7, 11, 12, 13, 14, 15, 16]
    assert [i for i, _ in feed_steps(StepGate(GuardConfig()), kinds)] == [10]


def test_steps_the_guard_reshaped_are_not_judged():
    # The guard ran steps 8-10 differently (a spike's micro-batch in pieces): their time is
    # the spike's, and the split decision says so; the gate leaves them out of its rules and
    # its window, so the slow-step event is the one of 14-16. Without the note, 8-10 make it.
    kinds = WARM + ["compute"] * 3 + ["n"] * 3 + ["compute"] * 3
    gate = StepGate(GuardConfig())
    events = []
    for i, kind in enumerate(kinds):
        if i in (8, 9, 10):
            gate.note_reshaped(i)
        events += [i for d in gate.observe(StepStats(step=i, **(NORMAL if kind == "n"
                                                                  else SLOW[kind])))
                   if d.action is Action.SLOW_STEP]
    assert events == [16]
    assert [s.step for s in gate.window] == [2, 3, 4, 5, 6, 7, 11, 12, 13, 14, 15, 16]
    assert [i for i, _ in feed_steps(StepGate(GuardConfig()), kinds)] == [10]


def test_slow_steps_on_either_side_of_a_checkpoint_are_not_a_run():
    # Two slow steps before a checkpoint (12, 13), its three settling steps (14-16, not
    # judged) and a slow step after (17): not three slow steps in a row, so no event at 17;
    # the run that step begins (17-19) is named by its own steps.
    kinds = ["n"] * 12 + ["compute"] * 2 + ["n"] * 3 + ["compute"] * 3
    events = [d for _, d in slow_step_events(
        StepGate(GuardConfig(slow_step_adaptive_persistence=False)),
        [NORMAL if k == "n" else SLOW[k] for k in kinds], pause_at=14)]
    assert [(d.params["first_step"], d.params["num_steps"]) for d in events] == [(17, 3)]
    assert "steps 17-19" in events[0].reason


# Another rank of the node did 0.100 s more work (time less communication wait) than this one's
# 0.090 s: this rank's communication wait grew by as much, waiting for it in the collective.
PEER_WORK = {"n": dict(NORMAL, peer_work_s=0.090),
             "waited_for_peer": dict(SLOW["comm"], peer_work_s=0.190),
             "peer_a_little_longer": dict(SLOW["comm"], peer_work_s=0.130),
             "link": dict(SLOW["comm"], peer_work_s=0.090),
             "own_compute": dict(SLOW["compute"], peer_work_s=0.290)}

# A rank's own work is 0.090 s a step (0.100 less 0.010 of communication wait), 0.190 s when
# slow in compute (+0.100). The other rank of its node worked 0.090 s, and in the slow steps
# either as long as before (this rank alone is slow) or 0.100 s more, or 0.040 s more (under
# half of this rank's +0.100), or it has no figure (no board).
NODE_CASES = [
    # (name, config changes, the peer's work in the normal and in the slow steps, node_wide)
    ("the node's other rank slowed as much", {}, 0.090, 0.190, True),
    ("this rank alone", {}, 0.090, 0.090, False),
    ("+0.040 s is under half the +0.100 s", {}, 0.090, 0.130, False),
    ("+0.050 s is half", {}, 0.090, 0.140, True),
    ("no board: no peer figure", {}, None, None, False),
    ("some steps without a peer figure", {}, "every other", 0.190, True),
    ("0 turns the rule off", {"slow_step_peer_work_frac": 0.0}, 0.090, 0.190, False),
]


@pytest.mark.parametrize("name, changes, peer_normal, peer_slow, node_wide", NODE_CASES,
                         ids=[c[0] for c in NODE_CASES])
def test_a_compute_slowdown_is_the_nodes_when_its_other_ranks_slowed_too(
        name, changes, peer_normal, peer_slow, node_wide):
    def peer_normal_at(step):     # "every other": the peers had not written the even steps
        return (None if step % 2 == 0 else 0.090) if peer_normal == "every other" \
            else peer_normal

    def fields(step, kind):
        if kind == "n":
            return dict(NORMAL, peer_work_s=peer_normal_at(step))
        return dict(SLOW["compute"], peer_work_s=peer_slow)

    events = [d for _, d in slow_step_events(
        StepGate(GuardConfig(**changes)),
        [fields(i, k) for i, k in enumerate(["n"] * 8 + ["compute"] * 3)])]
    assert [(d.cause, d.params["node_wide"]) for d in events] == [(Cause.COMPUTE, node_wide)]
    assert ("the node is slow" in events[0].reason) == node_wide


def test_only_a_compute_slowdown_is_read_as_the_nodes():
    # the data wait grew on this rank and its peer worked (and waited) as much longer: a slow
    # input pipeline, which the node-wide reading of compute leaves alone
    events = [d for _, d in slow_step_events(
        StepGate(GuardConfig()),
        [dict(NORMAL, peer_work_s=0.090)] * 8 + [dict(SLOW["data"], peer_work_s=0.190)] * 3)]
    assert [(d.cause, d.params["node_wide"]) for d in events] == [(Cause.DATA, False)]


PEER_WORK_CASES = [
    # (name, config changes, kinds, expected event indices, steps that waited for a peer)
    ("a wait for a rank that worked longer is that rank's", {},
     WARM + ["waited_for_peer"] * 3, [], 3),
    ("a slow link: nobody worked longer", {}, WARM + ["link"] * 3, [10], 0),
    ("0.040 s more work is under half the 0.100 s", {}, WARM + ["peer_a_little_longer"] * 3,
     [10], 0),
    ("0 turns the rule off", {"slow_step_peer_work_frac": 0.0},
     WARM + ["waited_for_peer"] * 3, [10], 0),
    ("a peer's work never excuses this rank's compute", {}, WARM + ["own_compute"] * 3,
     [10], 0),
    # it ends a run not named yet: 8 counts, 9 waited, 10-11 count again: no three in a row
    ("it ends a run", {}, WARM + ["link", "waited_for_peer", "link", "link"], [], 1),
]


@pytest.mark.parametrize("name,changes,kinds,expected,waited", PEER_WORK_CASES,
                         ids=[c[0] for c in PEER_WORK_CASES])
def test_a_step_that_waited_for_a_rank_of_the_node_that_worked_longer(name, changes, kinds,
                                                                       expected, waited):
    gate = StepGate(GuardConfig(**changes))
    events = [i for i, kind in enumerate(kinds)
              for d in gate.observe(StepStats(step=i, **PEER_WORK[kind]))
              if d.action is Action.SLOW_STEP]
    assert events == expected
    assert gate.num_waited_for_peer == waited


SLOW_CASES = [
    # (name, config changes, kinds, expected [(index, cause)])
    ("data grew", {}, WARM + ["data"] * 3, [(10, Cause.DATA)]),
    ("compute grew", {}, WARM + ["compute"] * 3, [(10, Cause.COMPUTE)]),
    ("comm grew, compute did not", {}, WARM + ["comm"] * 3, [(10, Cause.COMMUNICATION)]),
    ("only untimed time grew", {}, WARM + ["untimed"] * 3, [(10, Cause.UNKNOWN)]),
    ("a single slow step is not an event", {}, WARM + ["compute", "n", "n", "compute", "n"], []),
    ("two in a row are not three", {}, WARM + ["data", "data", "n", "data", "data", "n"], []),
    # Six slow steps in a row: one event per run.
    ("once per run", {}, WARM + ["data"] * 6, [(10, Cause.DATA)]),
    # A run of 3, four normal steps, another run (median still 0.1: 10 normal vs 3 slow).
    # Adaptive persistence: the second run must outlast the streak of 3 that ended: 4 steps.
    ("a new run is a new event", {}, WARM + ["data"] * 3 + ["n"] * 4 + ["compute"] * 4,
     [(10, Cause.DATA), (18, Cause.COMPUTE)]),
    ("a new run as long as the last is none", {}, WARM + ["data"] * 3 + ["n"] * 4
     + ["compute"] * 3, [(10, Cause.DATA)]),
    ("without adaptive persistence, 3 again", {"slow_step_adaptive_persistence": False},
     WARM + ["data"] * 3 + ["n"] * 4 + ["compute"] * 3, [(10, Cause.DATA), (17, Cause.COMPUTE)]),
    # Streaks of 2 (noise) raise the bar to 3 only: the seed rule; a streak of 5 raises it to 6.
    ("after streaks of 2, 3 in a row", {}, WARM + ["comm", "comm", "n"] * 2 + ["data"] * 3,
     [(16, Cause.DATA)]),
    ("after a streak of 5, 6 in a row", {"num_slow_steps": 6},
     WARM + ["comm"] * 5 + ["n"] * 6 + ["data"] * 6, [(24, Cause.DATA)]),
    # A lasting slowdown becomes the new normal: after 6 slow steps the window (6 x 0.1,
    # 6 x 0.2) has median 0.15, threshold 0.225, so later 0.2 s steps are not slow.
    ("lasting slowdown becomes the baseline", {}, WARM + ["data"] * 6 + ["n"] + ["data"] * 3,
     [(10, Cause.DATA)]),
    ("num_slow_steps=2", {"num_slow_steps": 2}, WARM + ["comm"] * 2, [(9, Cause.COMMUNICATION)]),
    # Warmup: the first two steps (slow) are ignored, not even in the median.
    ("warmup ignored", {}, ["compute", "compute"] + ["n"] * 6, []),
]


@pytest.mark.parametrize("name,changes,kinds,expected", SLOW_CASES,
                         ids=[c[0] for c in SLOW_CASES])
def test_slow_step_rules(name, changes, kinds, expected):
    gate = StepGate(GuardConfig(**changes), clock=FakeClock())
    got = feed_steps(gate, kinds)
    assert [(i, d.cause) for i, d in got] == expected
    assert all(d.action is Action.SLOW_STEP for _, d in got)


def test_absolute_threshold_without_baseline():
    # slow_step_abs_s 0.05: after the 2 warmup steps, steps of 0.06 s are slow at once (no
    # median yet: fewer than 3 steps in the window) -> event at the 3rd judged step (index 4).
    gate = StepGate(GuardConfig(slow_step_abs_s=0.05), clock=FakeClock())
    events = []
    for i in range(6):
        events += [(i, d) for d in gate.observe(StepStats(step=i, total_s=0.06,
                                                          forward_s=0.05))]
    assert [i for i, _ in events] == [4]
    assert "absolute 0.05 s" in events[0][1].reason
    assert "steps 2-4" in events[0][1].reason


def test_absolute_threshold_lower_than_relative():
    # Median 0.1 -> relative threshold 0.15; absolute 0.12 is lower and wins: 0.13 s is slow.
    gate = StepGate(GuardConfig(slow_step_abs_s=0.12), clock=FakeClock())
    got = feed_steps(gate, WARM)
    for i in range(3):
        got += gate.observe(StepStats(step=100 + i, **dict(NORMAL, total_s=0.13,
                                                           forward_s=0.06)))
    assert len(got) == 1 and got[0].cause is Cause.COMPUTE and "0.1200 s" in got[0].reason


def test_slow_step_reason_has_the_numbers():
    gate = StepGate(GuardConfig(), clock=FakeClock())
    (_, d), = feed_steps(gate, WARM + ["data"] * 3)
    # threshold 1.3 x 0.1 = 0.13; data wait median 0.010 -> 0.110 (+0.1000)
    assert "rank 0 steps 8-10: 3 slow steps in a row" in d.reason
    assert "0.1300 s" in d.reason and "data wait +0.1000 s (0.0100 -> 0.1100)" in d.reason
    assert d.params["num_steps"] == 3


def test_attribute_slow_steps_without_baseline_is_unknown():
    cause, detail = attribute_slow_steps([StepStats(step=0, total_s=1.0)], [])
    assert cause is Cause.UNKNOWN and "no baseline" in detail


# -- state ------------------------------------------------------------------------------------
def test_state_dict_round_trip_gives_the_same_decisions():
    # Release spacing 0: the spacing clock restarts on load by design (monotonic clocks do not
    # cross processes), everything else must carry over.
    config = GuardConfig(pacing_enabled=True, release_cache_min_interval_s=0.0)
    kinds = WARM + ["data"] * 2          # mid-run: two slow steps seen, the third comes later
    fracs = [0.80, 0.88, 0.89, 0.87, 0.86, 0.89, 0.84, 0.83, 0.86, 0.87]
    rest_kinds, rest_fracs = ["data", "n", "compute", "compute", "compute", "compute"], \
        [0.88, 0.89, 0.90, 0.70, 0.70, 0.70]

    def stats(kind, i, frac):
        return StepStats(step=i, memory_frac=frac, **(NORMAL if kind == "n" else SLOW[kind]))

    whole = StepGate(config, clock=FakeClock())
    for i, (k, f) in enumerate(zip(kinds, fracs)):
        whole.observe(stats(k, i, f))
    saved = json.loads(json.dumps(whole.state_dict()))     # JSON-able
    restored = StepGate(config, clock=FakeClock())
    restored.load_state_dict(saved)
    a, b = [], []
    for j, (k, f) in enumerate(zip(rest_kinds, rest_fracs)):
        a += whole.observe(stats(k, len(kinds) + j, f))
        b += restored.observe(stats(k, len(kinds) + j, f))
    # Before the save: release + pace at 0.88 (index 1); at 0.89 (index 2) the trend through
    # 0.80 0.88 0.89 (slope 0.045/step) predicts 1.025 -> stopped; 0.84 re-armed, pacing ended.
    # After: 0.88 releases and paces again, the data run completes (SLOW_STEP), 0.70 ends
    # pacing, the compute run of 4 completes (SLOW_STEP: adaptive persistence asks one more
    # than the data streak of 3 that ended before it). `whole` never stops twice; the
    # restored gate is a resumed run, whose stop rule is live again ("stopped" is not saved):
    # at the first 0.88 after the load the rising trend of the kept readings predicts
    # >= critical, so it asks to stop (decided between release and pace), the only difference.
    assert whole.stopped and restored.stopped
    assert [d.action for d in a] == [R, P, Action.SLOW_STEP, P, Action.SLOW_STEP]
    assert [d.action for d in b] == [R, Action.CHECKPOINT_AND_STOP, P, Action.SLOW_STEP, P,
                                     Action.SLOW_STEP]
    assert "stopped" not in restored.state_dict()
    # everything else carried over; the restored gate issued one decision id more (the stop)
    assert restored.state_dict() == {**whole.state_dict(),
                                     "next_id": whole.state_dict()["next_id"] + 1}


def test_restored_gate_still_stops_after_a_stop():
    # The final checkpoint of a CHECKPOINT_AND_STOP run is taken after the gate decided the
    # stop; resuming from it must not switch the critical rule off (0.97 >= critical 0.95).
    config = GuardConfig()
    gate = StepGate(config, clock=FakeClock())
    assert [d.action for d in gate.observe_memory(0, 0.97)][-1] is Action.CHECKPOINT_AND_STOP
    resumed = StepGate(config, clock=FakeClock())
    resumed.load_state_dict(json.loads(json.dumps(gate.state_dict())))
    assert Action.CHECKPOINT_AND_STOP in [d.action for d in resumed.observe_memory(1, 0.97)]


def test_load_state_dict_rejects_unknown_version():
    with pytest.raises(InputError, match="version"):
        StepGate(GuardConfig()).load_state_dict({"version": 99})


def test_config_must_be_guardconfig():
    with pytest.raises(InputError, match="config"):
        StepGate({"memory_watermark_frac": 0.9})


# -- across ranks -------------------------------------------------------------------------------
def window(rank, *, compute, comm, data=0.005, n=5):
    # forward+backward+optimizer = compute; total = data + compute + comm
    return [StepStats(step=s, total_s=data + compute + comm, data_wait_s=data,
                      forward_s=compute / 2, backward_s=compute / 2, comm_wait_s=comm,
                      world_rank=rank) for s in range(n)]


def test_cross_rank_names_compute_straggler_as_least_waiting():
    # DDP equalizes: rank 1 computes 0.200 s and waits 0.002 s; rank 0 computes 0.100 s and
    # waits 0.102 s for it. Rank 1: compute gap +0.100 > 0.1 x 0.207 = 0.0207 -> straggler.
    # Rank 0: compute gap -0.100; waits 0.100 more than rank 1 > 0.1 x 0.207 -> waiting.
    roles = attribute_across_ranks([window(0, compute=0.100, comm=0.102),
                                    window(1, compute=0.200, comm=0.002)])
    assert [(r.world_rank, r.role) for r in roles] == [(0, RankRole.WAITING),
                                                       (1, RankRole.STRAGGLER_COMPUTE)]
    assert "waiting on rank 1" in roles[0].reason
    assert roles[1].comm_wait_s == pytest.approx(0.002)


CROSS_CASES = [
    # (name, windows as (compute, comm, data), expected roles)
    ("all equal", [(0.1, 0.01, 0.005)] * 4, ["normal"] * 4),
    # Rank 2's loader is slow: data 0.105 vs others 0.005 (gap 0.1 > 0.1 x 0.115); the others
    # wait 0.1 more than rank 2 in communication.
    ("data straggler", [(0.1, 0.11, 0.005), (0.1, 0.11, 0.005), (0.1, 0.01, 0.105),
                        (0.1, 0.11, 0.005)],
     ["waiting", "waiting", "straggler_data", "waiting"]),
    # Within 10 %: 0.105 vs 0.100 compute (gap 0.005 < 0.0115) -> normal.
    ("small jitter", [(0.1, 0.01, 0.005), (0.105, 0.005, 0.005)], ["normal", "normal"]),
    ("one rank", [(0.1, 0.01, 0.005)], ["normal"]),
]


@pytest.mark.parametrize("name,specs,expected", CROSS_CASES, ids=[c[0] for c in CROSS_CASES])
def test_cross_rank_roles(name, specs, expected):
    windows = [window(r, compute=c, comm=m, data=d) for r, (c, m, d) in enumerate(specs)]
    assert [r.role.value for r in attribute_across_ranks(windows)] == expected


def test_cross_rank_empty_window_is_normal():
    roles = attribute_across_ranks([[], window(1, compute=0.1, comm=0.01)])
    assert roles[0].role is RankRole.NORMAL and "no steps" in roles[0].reason


def test_gate_imports_without_torch_ray_psutil():
    code = ("import sys\n"
            "for m in ('torch', 'ray', 'psutil', 'pynvml', 'numpy'): sys.modules[m] = None\n"
            "import raytrain_guard.core.gate as g\n"
            "from raytrain_guard.config import GuardConfig\n"
            "g.StepGate(GuardConfig()).observe_memory(0, 0.95)\n")
    subprocess.run([sys.executable, "-c", code], check=True)


# -- one straggler rule ---------------------------------------------------------------------------
AGREE_CASES = [
    # (name, windows as (compute, comm, data))
    ("two ranks, compute", [(0.100, 0.102, 0.005), (0.200, 0.002, 0.005)]),
    # Two of three ranks compute 0.2 s: against the median of the *others* each of them was
    # 0.05 s over (a straggler, old rule); against the reference rank (median_low = 0.2) no
    # rank is, which is what the coordinator says: one rule now, so both say "no straggler".
    ("most ranks slow", [(0.1, 0.1, 0.005), (0.2, 0.0, 0.005), (0.2, 0.0, 0.005)]),
    ("data", [(0.1, 0.11, 0.005), (0.1, 0.11, 0.005), (0.1, 0.01, 0.105)]),
]


@pytest.mark.parametrize("name,specs", AGREE_CASES, ids=[c[0] for c in AGREE_CASES])
def test_attribution_names_the_coordinators_stragglers(name, specs):
    from raytrain_guard.core.straggler import score_summaries, summarize
    windows = [window(r, compute=c, comm=m, data=d) for r, (c, m, d) in enumerate(specs)]
    frac = GuardConfig().straggler_frac
    role = {Cause.COMPUTE: RankRole.STRAGGLER_COMPUTE, Cause.DATA: RankRole.STRAGGLER_DATA}
    expected = {r: role[s.cause] for r, s in score_summaries({r: summarize(w) for r, w in
                                                            enumerate(windows)}).items()
                if s.excess_frac >= frac and s.cause in role}
    got = {a.world_rank: a.role for a in attribute_across_ranks(windows, straggler_frac=frac)
           if a.role.name.startswith("STRAGGLER")}
    assert got == expected
    if name == "most ranks slow":
        roles = [a.role for a in attribute_across_ranks(windows)]
        # rank 0 waits 0.1 s more than the others (> 0.1 x 0.305), but on no straggler
        assert roles == [RankRole.WAITING, RankRole.NORMAL, RankRole.NORMAL]


@pytest.mark.parametrize("points,expected", [
    ([], 0.0), ([(0, 0.5)], 0.0), ([(3, 0.5), (3, 0.7)], 0.0),      # too few / one x: flat
    # mean x 1, mean y 0.8567: sum (x-1)(y-0.8567) = 0.09 over sum (x-1)^2 = 2 -> 0.045
    ([(0, 0.80), (1, 0.88), (2, 0.89)], 0.045),
    ([(10, 1.0), (20, 0.0)], -0.1),                                # 1.0 down over 10 steps
])
def test_slope(points, expected):
    from raytrain_guard.core.stats import slope
    assert slope(points) == pytest.approx(expected)


@pytest.mark.parametrize("values,q,expected", [
    ([1.0], 0.99, 1.0), (list(range(1, 21)), 0.99, 20), (list(range(1, 101)), 0.99, 99),
    (list(range(1, 11)), 0.5, 5),                      # rank ceil(0.5 x 10) = 5
])
def test_nearest_rank(values, q, expected):
    from raytrain_guard.core.stats import nearest_rank
    assert nearest_rank(values, q) == expected


# -- noise: floor and robust spread (issue 11) ---------------------------------------------------

def _ms_steps(totals_ms, first=0):
    return [StepStats(step=first + i, total_s=t * 1e-3, forward_s=t * 1e-3)
            for i, t in enumerate(totals_ms)]


NOISE_CASES = [
    # (name, config changes, window totals in ms after 2 warm-up steps, run totals, events)
    # A wide but steady box: steps cycle 3 / 4 / 5 ms -> median 4.0, MAD 1.0 ms, robust sigma
    # 1.4826 ms; threshold 4.0 + 3.5 x 1.4826 = 9.19 ms (not 1.3 x 4 = 5.2): three 7 ms steps
    # are this box's noise, three 12.5 ms steps (x2.5 of 5) are a slowdown.
    ("wide box, 7 ms steps", {}, [3.0, 4.0, 5.0] * 7, [7.0] * 3, 0),
    ("wide box, 12.5 ms steps", {}, [3.0, 4.0, 5.0] * 7, [12.5] * 3, 1),
    ("wide box, no spread term", {"slow_step_mad_k": 0.0}, [3.0, 4.0, 5.0] * 7, [7.0] * 3, 1),
    # Sub-millisecond steps: median 0.4 ms, 1.3 x = 0.52 ms, but the floor asks 0.4 + 2 = 2.4 ms
    ("0.4 ms steps, 0.9 ms run", {}, [0.4] * 20, [0.9] * 3, 0),
    ("0.4 ms steps, no floor", {"slow_step_floor_s": 0.0}, [0.4] * 20, [0.9] * 3, 1),
    ("0.4 ms steps, 2.5 ms run", {}, [0.4] * 20, [2.5] * 3, 1),
]


@pytest.mark.parametrize("name,changes,window_ms,run_ms,expected", NOISE_CASES,
                         ids=[c[0] for c in NOISE_CASES])
def test_floor_and_robust_spread(name, changes, window_ms, run_ms, expected):
    gate = StepGate(GuardConfig(**changes), clock=FakeClock())
    steps = _ms_steps([4.0, 4.0] + window_ms + run_ms)
    events = [d for s in steps for d in gate.observe(s) if d.action is Action.SLOW_STEP]
    assert len(events) == expected
    if name == "wide box, 12.5 ms steps":
        assert "recent median 0.0040 s + 3.5 x robust spread 0.0015 s" in events[0].reason
        assert events[0].params["threshold_s"] == pytest.approx(0.0040 + 3.5 * 1.4826 * 0.001)


def test_quiet_bound_holds_with_the_floor():
    # 0.4 ms steps: the quiet bound is max(1.3 x 0.4, 0.4 + 2) ms = 2.4 ms, and a step at the
    # bound decides nothing (StepGuard's fast path relies on it)
    gate = StepGate(GuardConfig(), clock=FakeClock())
    for s in _ms_steps([0.4] * 12):
        gate.observe(s)
    (bound_s,), _ = gate.quiet_limits(1)
    assert bound_s == pytest.approx(0.0024)
    assert all(gate.observe(s) == [] for s in _ms_steps([bound_s * 1e3] * 5, first=12))


def test_cross_rank_attribution_ignores_a_gap_under_the_floor():
    # issue 11: 4 ms steps, rank 1 computes 0.4 ms more (10 % of a step, the old line): jitter,
    # not a straggler; 5 ms more (x2.5 of 3.3 ms) is one
    def w(rank, compute, comm):
        return [StepStats(step=s, total_s=0.0007 + compute + comm, data_wait_s=0.0002,
                          forward_s=compute, comm_wait_s=comm, world_rank=rank)
                for s in range(10)]
    small = attribute_across_ranks([w(0, 0.0033, 0.0004), w(1, 0.0037, 0.0000)])
    assert [a.role for a in small] == [RankRole.NORMAL, RankRole.NORMAL]
    big = attribute_across_ranks([w(0, 0.0033, 0.0050), w(1, 0.0083, 0.0000)])
    assert [a.role for a in big] == [RankRole.WAITING, RankRole.STRAGGLER_COMPUTE]


def _straggler_steps(compute_ms, comm_ms, first=0):
    return [StepStats(step=first + i, total_s=(c + w) * 1e-3, forward_s=c * 1e-3,
                      comm_wait_s=w * 1e-3) for i, (c, w) in enumerate(zip(compute_ms, comm_ms))]


def test_a_straggler_is_named_by_its_compute_where_its_step_hides_it():
    # A wide box: compute steady at 2.3 ms, the wait for the other rank 1.2 / 2.2 / 3.2 ms, so
    # steps of 3.5 / 4.5 / 5.5 ms: median 4.5, robust sigma 1.4826 ms, whole-step line
    # 4.5 + 3.5 x 1.4826 = 9.69 ms. The rank computes x3.3 (7.5 ms) and no longer waits
    # (0.7 ms): 8.2 ms steps, under that line, but compute grew 5.2 ms, more than a median step
    # (4.5 ms), the 2 ms floor and 3.5 robust spreads of compute (0): slow in compute.
    warm = _straggler_steps([2.3] * 23, [1.2, 2.2, 3.2] * 7 + [2.2, 2.2])
    slow = _straggler_steps([7.5] * 3, [0.7] * 3, first=23)

    def events(cfg):
        gate = StepGate(cfg, clock=FakeClock())
        return [d for s in warm + slow for d in gate.observe(s) if d.action is Action.SLOW_STEP]

    (event,) = events(GuardConfig())
    assert event.cause is Cause.COMPUTE and event.params["num_steps"] == 3
    assert "3 of them slow by the rank's own compute, grown by more than 1 median step(s)" \
        in event.reason, event.reason
    assert events(GuardConfig(slow_component_growth_steps=0)) == []
    # growth under a median step (compute 6.5 ms: +4.2 ms) is this box's noise
    slow = _straggler_steps([6.5] * 3, [0.7] * 3, first=23)
    assert events(GuardConfig()) == []
