"""Pure coordinator policy and straggler scores: table-driven, exact expectations.

Default config throughout: watermark 0.88, critical 0.90, oom_stop 0.98, lockstep K=10,
report_every N=10, cooldown 20 steps, straggler_frac 0.10, host watermark 0.90.
"""

from __future__ import annotations

import dataclasses

import pytest

from raytrain_guard.config import GuardConfig
from raytrain_guard.core.decisions import Action, Cause
from raytrain_guard.core.device_memory import run_gpus
from raytrain_guard.core.node_samples import (
    GpuSample,
    HostSample,
    NodeSample,
    RunSetup,
    WorkerMemory,
)
from raytrain_guard.core.policy import decide, default_apply_step, host_rise_per_s
from raytrain_guard.core.steps import StepStats
from raytrain_guard.core.straggler import score_summaries, summarize
from raytrain_guard.core.view import ClusterView, PolicyState, RankView
from raytrain_guard.units import GiB

CFG = GuardConfig()


def score_ranks(windows, **kw):
    return score_summaries({r: summarize(w) for r, w in windows.items()}, **kw)


def window(rank, *, data=0.05, compute=0.5, comm=0.45, mem=None, first=31, n=10, total=None):
    """n steps first..first+n-1; ``mem`` is a constant or a function of the step."""
    total = data + compute + comm if total is None else total
    out = []
    for step in range(first, first + n):
        m = mem(step) if callable(mem) else mem
        out.append(StepStats(step=step, total_s=total, data_wait_s=data, forward_s=compute,
                             comm_wait_s=comm, memory_frac=m, world_rank=rank))
    return tuple(out)


def view(ranks=None, nodes=None):
    return ClusterView(ranks=ranks or {}, nodes=nodes or {})


DEFAULT_SETUP = RunSetup()


def rank(r, node="n0", setup=DEFAULT_SETUP, **kw):
    return RankView(r, node, window(r, **kw), setup)


def node(node_id, *, available_frac=0.5, gpus=()):
    host = HostSample(memory_total_bytes=100 * GiB,
                      memory_available_bytes=int(available_frac * 100 * GiB))
    return NodeSample(node_id, seq=1, monitor_epoch="e", time_s=0.0, host=host, gpus=tuple(gpus))


# -- straggler scores --------------------------------------------------------------------------

STRAGGLER_CASES = [
    # 4 ranks, 1.0 s steps. Reference (median_low): compute 0.5, data 0.05, comm 0.45.
    # rank 3 computes 0.9 s: excess (0.9 - 0.5) / 1.0 = 0.4, COMPUTE; it waits least (0.05).
    ("compute", {0: {}, 1: {}, 2: {}, 3: {"compute": 0.9, "comm": 0.05}},
     {0: (0.0, Cause.UNKNOWN), 1: (0.0, Cause.UNKNOWN), 2: (0.0, Cause.UNKNOWN),
      3: (0.4, Cause.COMPUTE)}),
    # 2 ranks: reference is the faster one. Rank 1 waits 0.45 s for data vs 0.1 s:
    # excess (0.45 - 0.1) / 1.0 = 0.35, DATA; rank 0's comm wait 0.4 is waiting, not blamed.
    ("data, two ranks", {0: {"data": 0.1, "compute": 0.5, "comm": 0.4},
                         1: {"data": 0.45, "compute": 0.5, "comm": 0.05}},
     {0: (0.0, Cause.UNKNOWN), 1: (0.35, Cause.DATA)}),
    # Nobody slow in data/compute; rank 2 waits 0.4 s in communication vs 0.1 s:
    # step_s = median(0.65, 0.65, 0.95) = 0.65; excess (0.4 - 0.1) / 0.65 = 0.461538...
    ("communication", {0: {"comm": 0.1}, 1: {"comm": 0.1}, 2: {"comm": 0.4}},
     {0: (0.0, Cause.UNKNOWN), 1: (0.0, Cause.UNKNOWN), 2: (0.3 / 0.65, Cause.COMMUNICATION)}),
]


@pytest.mark.parametrize("name,ranks,expected", STRAGGLER_CASES, ids=[c[0] for c in STRAGGLER_CASES])
def test_straggler_scores(name, ranks, expected):
    scores = score_ranks({r: window(r, **kw) for r, kw in ranks.items()})
    assert {r: (pytest.approx(s.excess_frac), s.cause) for r, s in scores.items()} == expected


@pytest.mark.parametrize("windows", [
    {0: window(0)},                                   # one rank: nothing to compare with
    {0: window(0, n=2), 1: window(1, n=2)},           # fewer than 3 steps per rank
])
def test_straggler_needs_two_ranks_with_three_steps(windows):
    assert score_ranks(windows) == {}


# -- apply step --------------------------------------------------------------------------------

@pytest.mark.parametrize("latest,expected", [
    (37, 50),   # after 37 + 10 = 47 -> next multiple of 10 is 50
    (40, 60),   # after 50 (strictly) -> 60
    (0, 20),
])
def test_default_apply_step(latest, expected):
    assert default_apply_step(latest, CFG) == expected


# -- decisions ---------------------------------------------------------------------------------
# Windows cover steps 31..40 unless said otherwise, so latest_step = 40 and at = 60.

FRESH_STATE = PolicyState()


def _decide(v, state=FRESH_STATE, cfg=CFG, at=60):
    return decide(v, state, cfg, at)


def test_no_pressure_no_decisions():
    out = _decide(view({0: rank(0, mem=0.5), 1: rank(1, mem=0.6)}, {"n0": node("n0")}))
    assert out.decisions == () and out.state == PolicyState()


DEVICE_CASES = [
    # name, memory of rank 1, setup, state, expected actions with params, new release/shrink step
    ("release at watermark", 0.89, RunSetup(), PolicyState(),
     [(Action.RELEASE_CACHE, {"memory_frac": 0.89})], 60, None),
    # released at 30: cooled at 30 + 20 = 50 <= 40? no -> nothing yet
    ("cooldown holds", 0.89, RunSetup(), PolicyState(last_release_step=30), [], 30, None),
    # released at 20, cooled (40 >= 40), still 0.91 >= critical, micro_batch 8 even:
    # 8 -> 4, grad_accum 2 -> 4 (8 x 2 = 4 x 4: global batch unchanged)
    ("shrink after release", 0.91, RunSetup(8, 2, 4), PolicyState(last_release_step=20),
     [(Action.SHRINK_MICRO_BATCH, {"micro_batch": 4, "grad_accum": 4})], 60, 60),
    # micro_batch 7 is odd: no shrink (a note says so), release again instead
    ("odd micro-batch", 0.91, RunSetup(7, 2, 4), PolicyState(last_release_step=20),
     [(Action.RELEASE_CACHE, {"memory_frac": 0.91})], 60, None),
    # flat at 0.985 >= oom_stop 0.98
    ("stop at the line", 0.985, RunSetup(8, 2, 4), PolicyState(),
     [(Action.CHECKPOINT_AND_STOP, {"memory_frac": 0.985, "projected_frac": 0.985})], None, None),
]


@pytest.mark.parametrize("name,mem,setup,state,expected,release,shrink", DEVICE_CASES,
                         ids=[c[0] for c in DEVICE_CASES])
def test_device_memory_rules(name, mem, setup, state, expected, release, shrink):
    v = view({0: rank(0, mem=0.5, setup=setup), 1: rank(1, mem=mem, setup=setup)})
    out = _decide(v, state)
    assert [(d.action, dict(d.params)) for d in out.decisions] == expected
    assert all(d.step == 60 and d.scope == "cluster" and d.cause is Cause.DEVICE_MEMORY
               for d in out.decisions)
    if expected and expected[0][0] is not Action.CHECKPOINT_AND_STOP:
        assert out.state.last_release_step == release
        assert out.state.last_shrink_step == shrink
    if name == "odd micro-batch":
        assert out.notes == (("cannot shrink the micro-batch 7: it is odd, so halving it "
                              "would change the global batch; only cache releases remain"),)


@pytest.mark.parametrize("scope", ["node:n1", "rank", "all", ""])
def test_a_shrink_for_part_of_the_ranks_is_refused_when_it_is_decided(scope):
    from raytrain_guard.core.decisions import Decision
    from raytrain_guard.errors import InputError

    shrink = {"action": "shrink_micro_batch", "reason": "memory", "step": 60,
              "cause": "device_memory", "params": {"micro_batch": 4, "grad_accum": 4}}
    with pytest.raises(InputError, match=r"^scope: a shrink_micro_batch is for every rank "
                                         r"together \(scope 'cluster'\)"):
        Decision(Action.SHRINK_MICRO_BATCH, "memory", 60, Cause.DEVICE_MEMORY, scope)
    with pytest.raises(InputError, match="scope: a shrink_micro_batch"):   # off the wire too
        Decision.from_dict({**shrink, "scope": scope})
    cluster = Decision.from_dict({**shrink, "scope": "cluster"})
    with pytest.raises(InputError, match="scope: a shrink_micro_batch"):   # nor re-scoped
        dataclasses.replace(cluster, scope=scope)
    # other actions keep their scopes
    assert Decision(Action.SET_PREFETCH, "host", 60, Cause.HOST_MEMORY, "node:n1").scope == \
        "node:n1"


def test_rising_memory_stops_before_oom():
    # memory 0.80 at step 31 rising 0.01 per step -> 0.89 at step 40 (>= watermark).
    # horizon = at + K = 60 + 10 = 70; projected 0.89 + 0.01 x (70 - 40) = 1.19 >= 0.98
    v = view({0: rank(0, mem=lambda s: 0.80 + 0.01 * (s - 31)), 1: rank(1, mem=0.5)})
    out = _decide(v)
    (d,) = out.decisions
    assert d.action is Action.CHECKPOINT_AND_STOP and d.step == 60
    assert d.params == {"memory_frac": 0.89, "projected_frac": 1.19}
    assert "rank 0 (node n0) at 89%" in d.reason and "by step 70" in d.reason
    assert out.state.stop_step == 60
    # once stopping, nothing more is decided
    assert _decide(v, out.state).decisions == ()


def test_nvml_reading_counts_as_device_pressure():
    gpu = GpuSample(index=2, memory_used_bytes=95, memory_total_bytes=100)
    # rank 1 runs on n1; no pid information: every GPU of n1 counts, and a note says so
    out = _decide(view({0: rank(0), 1: rank(1, node="n1")}, {"n1": node("n1", gpus=[gpu])}))
    assert out.notes == (("node n1: every GPU counts as this run's memory pressure: no "
                          "train worker of the run is registered with its monitor yet"),)
    (d,) = out.decisions
    assert d.action is Action.RELEASE_CACHE
    assert d.step == 60
    assert d.reason == ("release cached memory on all ranks: node n1 GPU 2 at 95% of "
                        "device memory (watermark 88%); unpriced: no allocator figures "
                        "reported, released once until memory falls under the re-arm line")
    assert str(d).startswith("release_cache at step 60 [cluster]: release cached memory")


@pytest.mark.parametrize("prefetch,expected,note", [
    (4, [("node:n1", {"prefetch_factor": 2})], ()),     # 4 // 2
    (3, [("node:n1", {"prefetch_factor": 1})], ()),     # 3 // 2
    (None, [("node:n1", {"prefetch_factor": 1})], ()),  # unknown -> the minimum
    (1, [], ("node n1: host memory at 92% with prefetch_factor already 1; nothing left to lower",)),
])
def test_host_pressure_lowers_prefetch_on_that_node(prefetch, expected, note):
    setup = RunSetup(8, 1, prefetch)
    v = view({0: rank(0, "n0", setup), 1: rank(1, "n1", setup)},
             {"n0": node("n0", available_frac=0.5), "n1": node("n1", available_frac=0.08)})
    out = _decide(v)
    assert [(d.scope, dict(d.params)) for d in out.decisions] == expected
    assert all(d.action is Action.SET_PREFETCH and d.cause is Cause.HOST_MEMORY
               for d in out.decisions)
    assert out.notes == note
    if expected:
        assert out.state.prefetch_steps == {"n1": 60}
        # cooldown: the same node is not lowered again before step 60 + 20 = 80
        assert _decide(v, out.state).decisions == ()


def test_host_memory_past_the_stop_line_stops_every_rank_naming_the_node():
    # n1 at 95 % (stop line 0.93): lowering prefetch would come too late; and rank 3 is a
    # straggler, which a stopping run does not act on
    ranks = {r: rank(r, "n0" if r < 2 else "n1", first=21, n=20,
                     **({"compute": 0.9, "comm": 0.05} if r == 3 else {})) for r in range(4)}
    v = view(ranks, {"n0": node("n0", available_frac=0.5), "n1": node("n1", available_frac=0.05)})
    out = _decide(v)
    (d,) = out.decisions
    assert (d.action, d.cause, d.scope, d.step) == (Action.CHECKPOINT_AND_STOP,
                                                    Cause.HOST_MEMORY, "cluster", 60)
    assert dict(d.params) == {"node_id": "n1", "memory_frac": 0.95}
    assert d.reason == ("checkpoint and stop: node n1 at 95% of host memory, past the stop "
                        "line 93% (Ray's memory monitor kills a worker at 95%, the kernel at "
                        "100%)")
    assert out.state.stop_step == 60
    # the next rounds decide nothing more
    assert _decide(v, out.state).decisions == ()
    # just under the line: the watermark's prefetch rule instead
    v = view(ranks, {"n1": node("n1", available_frac=0.0701)})
    assert [d.action for d in _decide(v).decisions if d.cause is Cause.HOST_MEMORY] == \
        [Action.SET_PREFETCH]


@pytest.mark.parametrize("readings,rise", [
    ([(0, 0.80), (1, 0.82), (2, 0.84)], 0.02),        # a steady leak: slope = last interval
    ([(0, 0.60), (1, 0.85), (2, 0.85)], 0.0),         # a jump that then holds: no leak
    ([(0, 0.80), (2, 0.84), (3, 0.86)], 0.02),        # a missed sample: per second, not per sample
    ([(0, 0.80), (1, 0.84), (2, 0.85)], 0.01),        # slowing: the last interval's 0.01 < 0.025
    ([(0, 0.84), (1, 0.82), (2, 0.80)], -0.02),       # falling
    ([(0, 0.80), (1, 0.84)], 0.0),                    # two readings: no trend yet
])
def test_a_nodes_host_memory_rise_per_second(readings, rise):
    assert host_rise_per_s(readings) == pytest.approx(rise)


def _leaking_node_view(readings, *, total=1.0, available_frac=None):
    frac = readings[-1][1]
    ranks = {r: rank(r, "n0" if r < 2 else "n1", total=total) for r in range(4)}
    nodes = {"n0": node("n0"), "n1": node("n1", available_frac=available_frac or 1 - frac)}
    return ClusterView(ranks, nodes, host_readings={"n1": readings, "n0": [(0, 0.5)] * 3})


def test_a_host_leak_past_the_watermark_is_stopped_on_its_trend_before_the_line():
    # n1 at 90 % (the watermark), rising 2 % a second. A stop decided at the next round lands
    # within a monitor interval (1 s) + a decision interval (1 s) + steps 40 -> 60 at 1.0 s =
    # 22 s: on the line 90 % + 0.44 is past the stop line 93 %, reached in 1.5 s: stop now
    out = _decide(_leaking_node_view([(0, 0.86), (1, 0.88), (2, 0.90)]))
    (d,) = out.decisions
    assert (d.action, d.cause, d.step) == (Action.CHECKPOINT_AND_STOP, Cause.HOST_MEMORY, 60)
    assert dict(d.params) == {"node_id": "n1", "rise_per_s": 0.02, "memory_frac": 0.9}
    assert d.reason == ("checkpoint and stop: node n1 at 90% of host memory, rising 2.0% of it "
                        "a second: on that line it reaches the stop line 93% in 1.5 s, before "
                        "a stop decided at the next round could land (in about 22.0 s) (Ray's "
                        "memory monitor kills a worker at 95%, the kernel at 100%)")
    assert out.state.stop_step == 60


def test_host_memory_that_jumped_and_holds_or_rises_slowly_is_not_stopped():
    # a loader's buffers taken at once, then flat: no leak, and under the watermark: nothing
    assert _decide(_leaking_node_view([(0, 0.60), (1, 0.85), (2, 0.85)])).decisions == ()
    # a fill of 10 % a second, at 84 %: under the watermark a rise is not read as a leak (a
    # fill rises as fast and then holds); the 0.93 line still stops it if it does not hold
    assert _decide(_leaking_node_view([(0, 0.64), (1, 0.74), (2, 0.84)])).decisions == ()
    # 0.5 % a second at 90 % with 50 ms steps: 2 s + 20 x 0.05 s = 3 s ahead is 91.5 %, under
    # the stop line: the watermark's prefetch rule acts instead
    out = _decide(_leaking_node_view([(0, 0.89), (1, 0.895), (2, 0.9)], total=0.05,
                                     available_frac=0.0999))
    assert [d.action for d in out.decisions] == [Action.SET_PREFETCH]


def test_host_pressure_without_loader_workers_lowers_nothing():
    # every rank of n1 loads in its training process: no prefetch to lower, a note says so
    setup = RunSetup(8, 1, None, num_workers=0)
    v = view({0: rank(0, "n0", setup), 1: rank(1, "n1", setup)},
             {"n1": node("n1", available_frac=0.08)})
    out = _decide(v)
    assert out.decisions == ()
    assert out.notes == (("node n1: host memory at 92%; its ranks load in the training process "
                          "(no loader workers): no prefetch to lower"),)


def _straggler_view(gpus=(), slow=(3,), nodes=("n0", "n0", "n1", "n1"), workers=(), **slow_kw):
    slow_kw = slow_kw or {"compute": 0.9, "comm": 0.05}
    # 20 steps, 21-40: the slow ranks are slow at each of the straggler_steps (20)
    ranks = {r: rank(r, n, first=21, n=20, **(slow_kw if r in slow else {}))
             for r, n in enumerate(nodes)}
    host = HostSample(100 * GiB, 50 * GiB, workers=tuple(workers))
    samples = {n: NodeSample(n, 1, "e", 0.0, host, tuple(gpus) if n == nodes[-1] else ())
               for n in set(nodes)}
    return view(ranks, samples)


STRAGGLER_SCOPE_CASES = [
    # name, view arguments, expected (scope, target, world_ranks, cause, recommendation)
    # Windows: 20 steps of 1.0 s; a slow rank computes 0.9 s against the reference 0.5 s at
    # each of them (straggler_steps 20): +0.4 s >= max(0.1 x 1.0 s, floor 2 ms, 3.5 x 1.41 x
    # MAD 0).
    # Rank 3 slow, rank 2 (same node) not: the rank, and its GPU, not the node.
    ("one rank of a node", {}, ("node:n1", "rank", [3], Cause.COMPUTE, "check_gpu")),
    # Ranks 2 and 3 (all of n1) slow: the node; drain it (another node carries on).
    ("every rank of a node", {"slow": (2, 3)},
     ("node:n1", "node", [2, 3], Cause.COMPUTE, "drain_node")),
    # One rank per node: every rank of n1 is slow: the node (with its GPU when known).
    ("one-rank nodes", {"nodes": ("n0", "n1"), "slow": (1,)},
     ("node:n1", "node", [1], Cause.COMPUTE, "drain_node")),
    # A one-node cluster: never drain the only node.
    ("one node", {"nodes": ("n1", "n1", "n1", "n1")},
     ("node:n1", "rank", [3], Cause.COMPUTE, "check_gpu")),
    ("data on a rank", {"data": 0.45, "comm": 0.05},
     ("node:n1", "rank", [3], Cause.DATA, "check_input")),
    # Nobody slow in data or compute; rank 3 alone waits 0.4 s more in communication: its link
    ("communication on a rank", {"comm": 0.85}, ("node:n1", "rank", [3], Cause.COMMUNICATION,
                                                 "check_link")),
]


@pytest.mark.parametrize("name,kw,expected", STRAGGLER_SCOPE_CASES,
                         ids=[c[0] for c in STRAGGLER_SCOPE_CASES])
def test_straggler_scope_and_recommendation(name, kw, expected):
    out = _decide(_straggler_view(**kw))
    (d,) = out.decisions
    assert (d.scope, d.params["target"], d.params["world_ranks"], d.cause,
            d.params["recommendation"]) == expected
    assert "drain" not in d.reason or expected[1] == "node"
    # named once: the next round with the same figures decides nothing
    assert _decide(_straggler_view(**kw), out.state).decisions == ()
    assert set(d.params["world_ranks"]) <= out.state.flagged_ranks


def test_straggler_rank_reason_names_its_gpu_and_a_short_node_id():
    node_id = "a1b2c3d4" + "e" * 48                       # a Ray node id: 56 hex digits
    workers = [WorkerMemory(pid=13, world_rank=3, private_bytes=1)]
    gpus = [GpuSample(0, 10, 100, process_pids=(12,)), GpuSample(1, 10, 100, process_pids=(13,))]
    out = _decide(_straggler_view(gpus, nodes=("n0", "n0", node_id, node_id), workers=workers))
    (d,) = out.decisions
    assert d.params["gpu_index"] == 1 and d.params["node_id"] == node_id
    assert d.reason.startswith("rank 3 (GPU 1, node a1b2c3d4...) is a straggler (compute): "
                               "compute 900.0 ms vs 500.0 ms at steps 21-40, at least +400.0 ms "
                               "a step each (threshold 100.0 ms, median step 1000.0 ms); "
                               "recommend: check the clocks and throttle reasons of GPU 1 of "
                               "node a1b2c3d4...")
    assert node_id not in d.reason


def test_straggler_node_reason_recommends_draining():
    (d,) = _decide(_straggler_view(slow=(2, 3))).decisions
    assert d.reason.startswith("node n1 is a straggler (compute): all its ranks [2, 3] are "
                               "slow, worst rank 2: compute 900.0 ms")
    assert d.reason.endswith("recommend: drain node n1")


def test_a_flagged_rank_recovers_and_may_be_named_again():
    out = _decide(_straggler_view())
    healthy = _decide(_straggler_view(slow=()), out.state)
    assert healthy.decisions == () and healthy.state.flagged_ranks == frozenset()
    assert [d.action for d in _decide(_straggler_view(), healthy.state).decisions] == \
        [Action.FLAG_STRAGGLER]


def test_throttled_straggler_is_thermal():
    gpu = GpuSample(0, 10, 100, throttle_reasons=("thermal",))
    (d,) = _decide(_straggler_view([gpu])).decisions
    assert d.cause is Cause.THERMAL and "GPUs throttled (thermal)" in d.reason
    assert "check the cooling and power cap" in d.reason


def _comm_view(rise):
    """2 ranks, 10 steps of 1.0 s; communication wait 0.45 s, the last 3 steps ``rise`` more."""
    def ranked(r):
        steps = list(window(r))
        for i in (-3, -2, -1):
            s = steps[i]
            steps[i] = StepStats(step=s.step, total_s=s.total_s + rise, data_wait_s=0.05,
                                 forward_s=0.5, comm_wait_s=0.45 + rise, world_rank=r)
        return RankView(r, "n0", tuple(steps))
    return view({0: ranked(0), 1: ranked(1)})


def test_pacing_only_against_communication_backpressure():
    cfg = CFG.replace(pacing_enabled=True)
    # every rank waits 0.2 s more in communication (>= 0.1 x its 1.0 s median step): pace
    out = _decide(_comm_view(0.2), cfg=cfg)
    (d,) = out.decisions
    assert (d.action, dict(d.params), d.cause) == (Action.PACE, {"delay_s": 0.05},
                                                   Cause.COMMUNICATION)
    assert out.state.pacing and out.state.last_pace_step == 60
    # memory at the watermark is no reason to pace (a sleep lowers no peak): release only
    hot = view({0: rank(0, mem=0.89), 1: rank(1, mem=0.5)})
    assert [d.action for d in _decide(hot, cfg=cfg).decisions] == [Action.RELEASE_CACHE]
    # backpressure gone, after the cooldown (60 + 20 = 80 <= latest): stop pacing
    calm = _comm_view(0.0)
    assert _decide(calm, out.state, cfg=cfg).decisions == ()        # latest 40: too soon
    later = dataclasses.replace(out.state, last_pace_step=20)
    (off,) = _decide(calm, later, cfg=cfg).decisions
    assert dict(off.params) == {"delay_s": 0.0} and not _decide(calm, later, cfg=cfg).state.pacing
    # off by default
    assert _decide(_comm_view(0.2)).decisions == ()


@pytest.mark.parametrize("name,ranks,expected", STRAGGLER_CASES[:2],
                         ids=[c[0] for c in STRAGGLER_CASES[:2]])
def test_scores_agree_with_the_gates_cross_rank_attribution(name, ranks, expected):
    """The coordinator scores ranks in O(ranks) from per-report medians; the step gate's
    attribute_across_ranks (O(ranks^2)) must name the same compute/data stragglers."""
    from raytrain_guard.core.gate import RankRole, attribute_across_ranks
    windows = {r: window(r, **kw) for r, kw in ranks.items()}
    gate = {a.world_rank: a.role for a in attribute_across_ranks(list(windows.values()),
                                                                 straggler_frac=CFG.straggler_frac)}
    ours = score_ranks(windows)
    role = {Cause.COMPUTE: RankRole.STRAGGLER_COMPUTE, Cause.DATA: RankRole.STRAGGLER_DATA}
    assert {r: role[s.cause] for r, s in ours.items() if s.excess_frac >= CFG.straggler_frac} \
        == {r: g for r, g in gate.items() if g.name.startswith("STRAGGLER")}


# -- which GPUs are this run's -----------------------------------------------------------------

def _gpu(index, used, pids):
    return GpuSample(index, used, 100, process_pids=pids)


def _node_with(workers, gpus):
    host = HostSample(100 * GiB, 50 * GiB, workers=tuple(WorkerMemory(p, i, 1)
                                                          for i, p in enumerate(workers)))
    return NodeSample("n1", 1, "e", 0.0, host, tuple(gpus))


RUN_GPU_CASES = [
    # name, registered worker pids, GPUs (index, used of 100, pids), ranks on the node,
    # expected GPU indexes, note ending (None: no note)
    ("only the GPUs holding workers", (11, 12), [(0, 50, (11,)), (1, 99, (99,)), (2, 60, (12, 99))],
     True, [0, 2], None),
    ("pids unknown: every GPU", (11,), [(0, 50, (11,)), (1, 99, None)], True, [0, 1],
     "the GPU probe does not list the processes on its GPUs"),
    ("no GPU lists a worker: every GPU", (11,), [(0, 50, (7,)), (1, 99, ())], True, [0, 1],
     "no GPU lists a registered worker's pid (the driver sees another pid namespace?)"),
    ("ranks but nobody registered: every GPU", (), [(0, 99, (7,))], True, [0],
     "no train worker of the run is registered with its monitor yet"),
    ("another job's node: none", (), [(0, 99, (7,))], False, [], None),
]


@pytest.mark.parametrize("name,workers,gpus,runs_ranks,expected,why", RUN_GPU_CASES,
                         ids=[c[0] for c in RUN_GPU_CASES])
def test_run_gpus(name, workers, gpus, runs_ranks, expected, why):
    mine, note = run_gpus(_node_with(workers, [_gpu(*g) for g in gpus]), runs_ranks)
    assert [g.index for g in mine] == expected
    if why is None:
        assert note is None
    else:
        assert note == f"node n1: every GPU counts as this run's memory pressure: {why}"


def test_another_jobs_full_gpu_is_not_this_runs_pressure():
    # n1 runs rank 1 (pid 11, on GPU 0 at 50 %); GPU 1 holds another job at 99 %, past the
    # out-of-memory line 0.98: counted, it would stop the run; filtered, nothing happens
    n1 = _node_with((11,), [_gpu(0, 50, (11,)), _gpu(1, 99, (99,))])
    out = _decide(view({0: rank(0), 1: rank(1, node="n1")}, {"n1": n1}))
    assert out.decisions == () and out.notes == ()
    # without pid information it would (the safe side): checkpoint and stop
    blind = _node_with((11,), [_gpu(0, 50, None), _gpu(1, 99, None)])
    (d,) = _decide(view({0: rank(0), 1: rank(1, node="n1")}, {"n1": blind})).decisions
    assert d.action is Action.CHECKPOINT_AND_STOP and "node n1 GPU 1 at 99%" in d.reason


def test_node_ids_are_short_in_messages_and_whole_in_params():
    from raytrain_guard.core.view import short_node_id
    node_id = "f" * 56
    assert short_node_id(node_id) == "ffffffff..." and short_node_id("n1") == "n1"
    gpu = GpuSample(index=0, memory_used_bytes=95, memory_total_bytes=100)
    out = _decide(view({0: rank(0, node=node_id)}, {node_id: node(node_id, gpus=[gpu])}))
    (d,) = out.decisions
    assert "node ffffffff... GPU 0 at 95%" in d.reason and node_id not in d.reason
    assert out.notes[0].startswith("node ffffffff...: every GPU counts")


def test_due_at_splits_pending_and_polled_decisions_by_their_step():
    from raytrain_guard.core.decisions import Action, Decision, due_at
    old = Decision(Action.CHECKPOINT, "old", 10)
    later = Decision(Action.CHECKPOINT, "later", 30)
    now = Decision(Action.CHECKPOINT, "now", None)
    polled_later = Decision(Action.CHECKPOINT, "polled later", 40)
    due, waiting = due_at(20, [old, later], [now, polled_later])
    assert due == [old, now] and waiting == [later, polled_later]
    assert due_at(20, [], None) == ([], [])


def test_a_straggler_with_steps_under_the_line_says_how_many_cleared_it():
    v = _straggler_view()
    slow = v.ranks[3]
    steps = tuple(StepStats(step=s.step, total_s=s.total_s, data_wait_s=s.data_wait_s,
                            forward_s=0.5 if s.step in (25, 30) else s.forward_s,
                            comm_wait_s=s.comm_wait_s, world_rank=3) for s in slow.window)
    v = view({**v.ranks, 3: RankView(3, slow.node_id, steps)}, v.nodes)
    (d,) = _decide(v).decisions
    assert "at least +400.0 ms at 18 of those 20 steps (threshold 100.0 ms" in d.reason
