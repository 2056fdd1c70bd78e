"""Issue 11's cry-wolf fix: nothing raised on 600 clean noisy steps, a real slowdown named
within 5 steps of its start, with its cause and its rank (step gate and coordinator policy).

Series from tests/step_series.py: 2 DDP ranks, 3-5 ms CPU steps, seeded. Profiles:

=================  ============================================================================
jitter             every phase log-normal (sigma 0.05), levels drifting in 3-5 ms, no outlier
sub-ms steps       0.3-0.5 ms steps with 0.2-1.5 ms outliers in 20 % of steps: a relative
                   threshold on such a median flags a fraction of a millisecond (the floor)
outliers           3 % of steps per rank get 2-30 ms in a random phase; under DDP the other
                   rank waits for it in communication
bursts             as outliers, 30 % of them spanning two steps
=================  ============================================================================

The robust spread (MAD) term is pinned by a deterministic case in tests/test_gate.py.

Limits, measured with the same generator and not pinned here (seeds 0-9; the tests use 0-4):
"outliers" raise 1 gate event on 1 of the 10 seeds and "bursts" 1-2 events on 3 of them (a
two-step burst next to a fresh outlier is three slow steps in one phase); outliers on 8 % of the
steps of each rank leave 0-3 events per 600 steps (a rank that waits three steps in a row on
another's outliers is, to its own gate, slow three steps in a row in one component); a compute
speed that wanders (log-normal AR(1), sigma 0.3, rho 0.8) leaves 0-4 (the seed's 1.5 x median
alone: 1-12). Real steps recorded on this box with a third busy process on its 2 cores
alternate normal and ~2.4x steps in streaks of 3-7: 34 and 27 gate events in 650 steps with a
fixed 3 in a row, 9 and 10 with adaptive persistence; within 5 steps such a streak cannot be
told from a real x2.5 slowdown, on one rank's gate as across ranks (the coordinator's rule,
at 3 steps in a row, named 7 in the same 650 steps, alternating between the two ranks; it now
asks straggler_steps=20).
"""

from __future__ import annotations

import pytest
from step_series import Fault, Noise, series

from raytrain_guard.config import GuardConfig
from raytrain_guard.core.decisions import Action, Cause
from raytrain_guard.core.gate import StepGate
from raytrain_guard.core.node_samples import RunSetup
from raytrain_guard.core.policy import ClusterView, PolicyState, RankView, decide

CLEAN = [
    Noise("jitter", outlier_p=0.0),
    Noise("sub-ms steps", level_ms=(0.3, 0.5), drift_ms=0.005, jitter=0.15, outlier_p=0.2,
          outlier_ms=(0.2, 1.5)),
    Noise("outliers", outlier_p=0.03),
    Noise("bursts", outlier_p=0.03, burst_p=0.3),
]
SEEDS = range(5)
DETECT = [n for n in CLEAN if n.name != "sub-ms steps"]
FAULTS = [("compute", Cause.COMPUTE), ("data", Cause.DATA), ("comm", Cause.COMMUNICATION)]
START = 300


DEFAULTS = GuardConfig()


def gate_events(steps, cfg=DEFAULTS):
    gate = StepGate(cfg, clock=lambda: 0.0)
    return [(s.step, d) for s in steps for d in gate.observe(s) if d.action is Action.SLOW_STEP]


# -- the step gate -----------------------------------------------------------------------------

@pytest.mark.parametrize("noise", CLEAN, ids=[n.name for n in CLEAN])
def test_gate_raises_nothing_on_600_clean_noisy_steps(noise):
    for seed in SEEDS:
        for rank, steps in series(noise, seed=seed).items():
            assert gate_events(steps) == [], (noise.name, seed, rank)


def test_a_relative_threshold_alone_cries_wolf_on_sub_ms_steps():
    """What the floor is for: without it (the seed's 1.5 x median alone) the same series raise
    events."""
    noise = CLEAN[1]
    bare = GuardConfig(slow_step_floor_s=0.0, slow_step_mad_k=0.0)
    assert sum(len(gate_events(steps, bare)) for seed in SEEDS
               for steps in series(noise, seed=seed).values()) > 0


@pytest.mark.parametrize("kind,cause", FAULTS, ids=[f[0] for f in FAULTS])
@pytest.mark.parametrize("noise", DETECT, ids=[n.name for n in DETECT])
def test_gate_names_a_slowdown_within_5_steps(noise, kind, cause):
    for seed in SEEDS:
        s = series(noise, seed=seed, fault=Fault(kind, rank=1, start=START))
        got = [(step, d.cause) for step, d in gate_events(s[1]) if step >= START - 2]
        assert got and got[0][0] <= START + 4 and got[0][1] is cause, (noise.name, seed, got)


def test_a_slowdown_under_the_floor_is_not_named():
    # x2.5 compute on 0.3-0.5 ms steps adds about 0.5 ms a step: under the 2 ms floor, by design
    s = series(CLEAN[1], seed=0, fault=Fault("compute", rank=1, start=START))
    assert gate_events(s[1]) == []
    # a lower floor sees it (with a fixed 3 in a row: the 20 % outliers come in streaks)
    assert gate_events(s[1], GuardConfig(slow_step_floor_s=0.0002,
                                         slow_step_adaptive_persistence=False))


def test_the_waiting_rank_names_communication():
    # rank 1 computes x2.5: rank 0 waits for it in the allreduce, and says so
    s = series(CLEAN[0], seed=0, fault=Fault("compute", rank=1, start=START))
    (step, d), *_ = [e for e in gate_events(s[0]) if e[0] >= START]
    assert d.cause is Cause.COMMUNICATION and step <= START + 4


def test_a_run_must_stay_in_one_cause():
    # compute, data, compute slow steps in a row: three slow steps, no persistent cause
    from test_gate import NORMAL, SLOW, WARM, feed_steps
    gate = StepGate(GuardConfig(), clock=lambda: 0.0)
    assert feed_steps(gate, WARM + ["compute", "data", "compute", "n"]) == []
    # then four compute steps (one more than the streak of 3 that just ended: adaptive
    # persistence) are a slowdown in one cause
    assert [d.cause for _, d in feed_steps(gate, ["compute"] * 4)] == [Cause.COMPUTE]
    assert NORMAL and SLOW


# -- the coordinator's policy, across ranks ------------------------------------------------------

def _rounds(steps_by_rank, cfg=DEFAULTS, nodes=None, every=10):
    """Feed the policy as the coordinator does: a round after each report batch of ``every``
    steps, each rank's window the last step_window steps. Returns [(latest step, decision)]."""
    state, out = PolicyState(), []
    num = len(next(iter(steps_by_rank.values())))
    nodes = nodes or {r: "n0" for r in steps_by_rank}
    for end in range(every, num + 1, every):
        ranks = {r: RankView(r, nodes[r], tuple(w[max(0, end - cfg.step_window):end]),
                             RunSetup())
                 for r, w in steps_by_rank.items()}
        result = decide(ClusterView(ranks), state, cfg, end + 20)
        state = result.state
        out += [(end - 1, d) for d in result.decisions]
    return out


@pytest.mark.parametrize("noise", CLEAN, ids=[n.name for n in CLEAN])
def test_policy_flags_no_straggler_on_clean_noisy_steps(noise):
    for seed in SEEDS:
        assert _rounds(series(noise, seed=seed)) == [], (noise.name, seed)


@pytest.mark.parametrize("kind,cause", FAULTS, ids=[f[0] for f in FAULTS])
@pytest.mark.parametrize("noise", DETECT, ids=[n.name for n in DETECT])
def test_policy_names_the_rank_and_cause_in_the_first_report_after_straggler_steps(noise, kind,
                                                                                  cause):
    # the fault starts at 303: steps 303-322 (straggler_steps=20) end in the report of steps
    # 320-329, so the round after it (latest step 329) names rank 1. Two of the 20 may miss
    # the line, so a burst of rank 1 just before the start can begin the run: bursts, seed 4,
    # compute, named at 319 on steps 300-319. Other ranks' outliers no longer delay a slow
    # link by a report (a strict 20 in a row did, for 2 of the 15 seeded cases)
    assert GuardConfig().straggler_steps == 20
    for seed in SEEDS:
        s = series(noise, seed=seed, num_ranks=4,
                   fault=Fault(kind, rank=1, start=START + 3))
        got = _rounds(s, nodes={0: "n0", 1: "n0", 2: "n1", 3: "n1"})
        assert got, (noise.name, seed)
        latest, d = got[0]
        early = (noise.name, kind, seed) == ("bursts", "compute", 4)
        assert latest == START + (19 if early else 29) and d.cause is cause, \
            (noise.name, seed, latest, d.reason)
        assert d.params["world_ranks"] == [1] and d.params["target"] == "rank"
