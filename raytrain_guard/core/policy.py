"""The coordinator's policy: cluster state in, cluster-wide decisions out (pure).

:func:`decide` is a pure function of a :class:`ClusterView` (every rank's recent StepStats and
every node monitor's latest sample), the previous :class:`PolicyState`, the config and the step
the decisions would apply at; it returns a :class:`PolicyOutcome` (decisions, new state,
straggler scores, notes). The rules, in order (stop, priced memory remedies, host memory,
stragglers, pacing): docs/coordination.md ("The coordinator's policy").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field

from raytrain_guard.config import GuardConfig
from raytrain_guard.core.decisions import Action, Cause, Decision
from raytrain_guard.core.effects import (
    Effect,
    RunPlan,
    choose,
    prefetch_effect,
    release_effect,
    shrink_effect,
)
from raytrain_guard.core.node_samples import GpuSample, NodeSample, RunSetup
from raytrain_guard.core.stats import slope
from raytrain_guard.core.steps import StepStats
from raytrain_guard.core.straggler import (
    StragglerScore,
    TimingSummary,
    persistent_slowdowns,
    score_summaries,
    summarize,
)


@dataclass(frozen=True)
class MemoryTrend:
    """A rank's latest device memory fraction and its least-squares slope per step."""

    frac: float
    slope_per_step: float
    step: int


@dataclass(frozen=True)
class RankView:
    """One rank as the coordinator knows it: its node and its recent steps (oldest first).

    ``timing`` and ``memory`` summarize the window; they are computed here once, so the
    coordinator builds a view per report and a policy round costs O(ranks), not O(steps).
    """

    world_rank: int
    node_id: str
    window: tuple[StepStats, ...]
    setup: RunSetup = field(default_factory=RunSetup)
    timing: TimingSummary = field(init=False, repr=False, compare=False)
    memory: MemoryTrend | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "timing", summarize(self.window))
        points = [(s.step, s.memory_frac) for s in self.window if s.memory_frac is not None]
        object.__setattr__(self, "memory", MemoryTrend(points[-1][1], slope(points),
                                                       points[-1][0]) if points else None)


@dataclass(frozen=True)
class ClusterView:
    """Everything the policy looks at."""

    ranks: Mapping[int, RankView] = field(default_factory=dict)
    nodes: Mapping[str, NodeSample] = field(default_factory=dict)
    plan: RunPlan | None = None        # the memory model's inputs; None: actions unpriced

    @property
    def latest_step(self) -> int | None:
        steps = [r.window[-1].step for r in self.ranks.values() if r.window]
        return max(steps) if steps else None


@dataclass(frozen=True)
class PolicyState:
    """What the policy remembers between rounds: apply steps of its last actions."""

    last_release_step: int | None = None
    last_shrink_step: int | None = None
    prefetch_steps: Mapping[str, int] = field(default_factory=dict)   # node id -> apply step
    flagged_nodes: frozenset[str] = frozenset()    # whole nodes named (all their ranks slow)
    flagged_ranks: frozenset[int] = frozenset()    # ranks named, alone or with their node
    pacing: bool = False
    stop_step: int | None = None
    missed: frozenset[str] = frozenset()    # "action:cause" measured below its prediction:
                                            # not repeated for that cause (the policy escalates)
    release_armed: bool = True              # a release re-arms below the re-arm line, or when
                                            # the coordinator measured the last one a hit
    last_pace_step: int | None = None


@dataclass(frozen=True)
class PolicyOutcome:
    decisions: tuple[Decision, ...]
    state: PolicyState
    scores: Mapping[int, StragglerScore]
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Pressure:
    """The worst device-memory reading and where it was seen."""

    frac: float
    where: str                    # "rank 5 (node n2)" or "node n2 GPU 3"
    slope_per_step: float = 0.0   # from the rank's window; 0 for NVML readings
    step: int | None = None
    world_rank: int | None = None  # the rank read (or running on the GPU read), when known


def default_apply_step(latest_step: int, config: GuardConfig) -> int:
    """The first lockstep boundary that every rank can still reach before applying.

    Ranks run ahead of the coordinator by up to one report batch, so the decision goes to the
    first multiple of ``lockstep_every_steps`` strictly after ``latest_step +
    report_every_steps``. Example (K=10, N=10): latest 37 -> after 47 -> 50.
    """
    k = config.lockstep_every_steps
    return ((latest_step + config.report_every_steps) // k + 1) * k


STRAGGLER_NOISE_SHARE = 0.5
"""Share of ``straggler_frac`` below which a data/compute excess is jitter (communication may
then be blamed), and below which a flagged node counts as recovered: half the threshold, so a
node hovering at it is flagged once, not at every round."""


def decide(view: ClusterView, state: PolicyState, config: GuardConfig,
           next_apply_step: int) -> PolicyOutcome:
    """One policy round (pure). See the module docstring for the rules."""
    scores = score_summaries({r: v.timing for r, v in view.ranks.items()},
                             min_steps=min(config.straggler_min_steps, config.step_window),
                             noise_frac=config.straggler_frac * STRAGGLER_NOISE_SHARE)
    if state.stop_step is not None:
        why = f"stopping: checkpoint_and_stop already decided for step {state.stop_step}"
        return PolicyOutcome((), state, scores, (why,))
    latest = view.latest_step
    decisions: list[Decision] = []
    notes: list[str] = []
    state = _device_memory(view, state, config, next_apply_step, latest, decisions, notes)
    if state.stop_step is None:
        state = _host_memory(view, state, config, next_apply_step, latest, decisions, notes)
        state = _stragglers(view, state, config, next_apply_step, scores, decisions)
        state = _pacing(view, state, config, next_apply_step, latest, decisions)
    return PolicyOutcome(tuple(decisions), state, scores, tuple(notes))


# -- device memory -----------------------------------------------------------------------------

def worst_device_pressure(view: ClusterView, notes: list[str] | None = None
                          ) -> Pressure | None:
    """The highest device memory fraction: each rank's latest StepStats, and the NVML reading
    of each GPU that holds this run's workers (:func:`run_gpus`; its notes go to ``notes``),
    none when every rank reports running on CPU (no GPU reading is the run's then)."""
    worst: Pressure | None = None
    for rank in view.ranks.values():
        m = rank.memory
        if m is not None and (worst is None or m.frac > worst.frac):
            worst = Pressure(m.frac, f"rank {rank.world_rank} (node "
                             f"{short_node_id(rank.node_id)})", m.slope_per_step, m.step,
                             rank.world_rank)
    rank_nodes = {r.node_id for r in view.ranks.values()}
    if view.ranks and {r.setup.device for r in view.ranks.values()} == {"cpu"}:
        if notes is not None and any(n.gpus for n in view.nodes.values()):
            notes.append("GPU readings left out: every rank of the run runs on CPU")
        return worst
    for node_id in sorted(view.nodes):
        gpus, note = run_gpus(view.nodes[node_id], node_id in rank_nodes)
        if note is not None and notes is not None:
            notes.append(note)
        for gpu in gpus:
            if worst is None or gpu.memory_frac > worst.frac:
                on = [r for r, v in view.ranks.items() if v.node_id == node_id
                      and rank_gpu(view, r) == gpu.index]
                worst = Pressure(gpu.memory_frac, f"node {short_node_id(node_id)} GPU "
                                 f"{gpu.index}", world_rank=on[0] if on else None)
    return worst


def run_gpus(node: NodeSample, runs_ranks: bool = True
             ) -> tuple[tuple[GpuSample, ...], str | None]:
    """The GPUs of ``node`` that count as this run's memory pressure, and a note when every GPU
    counts because that cannot be told.

    A GPU counts when its compute processes include a train worker registered with the node's
    monitor (``host.workers``): another job's full GPU on a shared node is not this run's
    pressure. A node with no registered worker counts no GPU unless ``runs_ranks`` (ranks
    report from it: their registration is late or failed). Every GPU counts, with the note,
    when ranks run there but no worker is registered, the probe did not list pids, or no GPU
    lists a registered pid (the driver sees another pid namespace): the safe side.

    Example: workers {11, 12}; GPU 0 runs (11,), GPU 1 runs (99,) -> (GPU 0,), no note.
    """
    if not node.gpus:
        return (), None
    workers = {w.pid for w in node.host.workers} if node.host is not None else set()
    if not workers:
        if not runs_ranks:
            return (), None
        why = "no train worker of the run is registered with its monitor yet"
    elif any(g.process_pids is None for g in node.gpus):
        why = "the GPU probe does not list the processes on its GPUs"
    else:
        mine = tuple(g for g in node.gpus if workers.intersection(g.process_pids or ()))
        if mine:
            return mine, None
        why = "no GPU lists a registered worker's pid (the driver sees another pid namespace?)"
    return node.gpus, (f"node {short_node_id(node.node_id)}: every GPU counts as this run's "
                       f"memory pressure: {why}")


def _cooled(last_apply_step: int | None, latest: int | None, config: GuardConfig) -> bool:
    return (last_apply_step is None or
            (latest is not None and latest >= last_apply_step + config.decision_cooldown_steps))


def _missed_key(action: Action, cause: Cause) -> str:
    return f"{action.value}:{cause.value}"


def missed_key(decision: Decision) -> str:
    """The key a decision that missed its prediction is remembered by in
    ``PolicyState.missed``: ``action:cause``, and ``@node`` for a node's prefetch change."""
    key = _missed_key(decision.action, decision.cause)
    if decision.action is Action.SET_PREFETCH and decision.scope.startswith("node:"):
        key += "@" + decision.scope.split(":", 1)[1]
    return key


def _device_memory(view, state, config, at, latest, decisions, notes) -> PolicyState:
    p = worst_device_pressure(view, notes)
    if p is None:
        return state
    rearm_below = config.memory_watermark_frac - config.memory_hysteresis_frac
    if p.frac < rearm_below and not state.release_armed:
        state = dataclasses.replace(state, release_armed=True)
    if p.frac < config.memory_watermark_frac:
        return state
    pct = f"{p.frac:.0%}"

    horizon = at + config.lockstep_every_steps
    projected = p.frac + max(0.0, p.slope_per_step) * (horizon - (p.step or at))
    if projected >= config.oom_stop_frac:
        trend = (f", rising {p.slope_per_step:.2%} per step to {projected:.0%} by step {horizon}"
                 if p.slope_per_step > 0 else "")
        return _stop(state, decisions, at, f"{p.where} at {pct} of device memory{trend}, "
                     f"past the out-of-memory line {config.oom_stop_frac:.0%}",
                     {"memory_frac": round(p.frac, 4), "projected_frac": round(projected, 4)})

    setup = _setup_of(view, p.world_rank)
    critical = p.frac >= config.memory_critical_frac
    priced: list[Effect] = []
    unpriced: list[Action] = []
    release = _release_candidate(view, state, config, latest, p, setup, notes)
    if isinstance(release, Effect):
        priced.append(release)
    elif release:
        unpriced.append(Action.RELEASE_CACHE)
    # a priced shrink is weighed from the watermark on: waiting for critical would leave it to
    # the rank's own gate, which checkpoints and stops there; unpriced, only at critical
    if (critical or view.plan is not None) and _cooled(state.last_shrink_step, latest, config):
        shrink = _shrink_candidate(view, state, config, latest, p, setup, notes)
        if isinstance(shrink, Effect):
            priced.append(shrink)
        elif shrink and critical:
            unpriced.append(Action.SHRINK_MICRO_BATCH)

    chosen = choose(priced, rearm_below)
    for e in priced:
        if not e.helps(rearm_below):
            notes.append(f"{e.action.value} not chosen: predicted {e.memory_frac_before:.1%} "
                         f"-> {e.memory_frac_after:.1%}, not under {rearm_below:.0%} "
                         f"({e.basis})")
    if chosen is not None:
        return _act(state, decisions, at, chosen, p, config)
    if unpriced:    # fail open: no plan or no allocator figures, today's ladder, once a crossing
        action = unpriced[-1]      # the shrink when it is allowed (a release was judged)
        return _act_unpriced(view, state, decisions, at, action, p, config, setup)
    waiting = [a for a, last in (("cache release", state.last_release_step),
                                 ("micro-batch shrink", state.last_shrink_step))
               if not _cooled(last, latest, config)]
    if critical and waiting:        # an action's effect is not reported yet: judge it first
        notes.append(f"{p.where} at {pct} of device memory: waiting for the effect of the "
                     f"{' and '.join(waiting)} before escalating")
        return state
    if critical:
        tried = "; ".join(f"{e.action.value} predicted {e.memory_frac_after:.1%}"
                          for e in priced) or "no action left to try"
        return _stop(state, decisions, at, f"{p.where} at {pct} of device memory (critical "
                     f"{config.memory_critical_frac:.0%}) and no action is predicted to bring "
                     f"it under {rearm_below:.0%} ({tried})",
                     {"memory_frac": round(p.frac, 4)})
    return state


def _setup_of(view: ClusterView, world_rank: int | None) -> RunSetup:
    """The setup of the rank behind a reading. Behind a GPU reading no rank is known yet (the
    workers not registered with their monitor): the run's device when every reporting rank
    says one (a simulated run has no cache to release then either), else unknown."""
    if world_rank in view.ranks:
        return view.ranks[world_rank].setup
    devices = {r.setup.device for r in view.ranks.values()}
    return RunSetup(device=devices.pop()) if len(devices) == 1 else RunSetup()


def _where(setup: RunSetup) -> str:
    return "a simulated card" if setup.device == "simulated" else "CPU"


def _release_candidate(view, state, config, latest, p, setup, notes) -> Effect | bool:
    """The cache release, priced from the rank's allocator figures; True: allowed unpriced
    (no figures reported: once per crossing of the watermark); False: not a candidate."""
    if setup.without_cache:
        notes.append(f"no cache release: the run is on {_where(setup)}, where there is no "
                     f"allocator cache")
        return False
    if _missed_key(Action.RELEASE_CACHE, Cause.DEVICE_MEMORY) in state.missed:
        return False
    if not _cooled(state.last_release_step, latest, config):
        return False
    cached = setup.cached_free_bytes
    total = setup.device_total_bytes or (view.plan.device_memory_bytes if view.plan else None)
    if cached is None or not total:
        return state.release_armed
    if not state.release_armed:     # released: again once its measured effect is known
        return False                # (the coordinator re-arms it) or memory dipped under the line
    if cached < config.cache_release_min_frac * total:
        notes.append(f"no cache release: {p.where} holds {cached / 2**20:.0f} MiB cached but "
                     f"unallocated, under {config.cache_release_min_frac:.0%} of the card")
        return False
    mb, ga = setup.micro_batch, setup.grad_accum
    return release_effect(p.frac, setup.allocated_bytes, setup.reserved_bytes, total,
                          view.plan, mb, ga, config)


def _shrink_candidate(view, state, config, latest, p, setup, notes) -> Effect | bool:
    """The micro-batch shrink priced by the memory model; True: allowed unpriced (no plan,
    and a cache release was applied and judged first, today's ladder, or the run is on CPU
    where there is no cache to release); False: not a candidate."""
    if _missed_key(Action.SHRINK_MICRO_BATCH, Cause.DEVICE_MEMORY) in state.missed:
        return False
    if view.plan is None and not setup.without_cache and not (
            state.last_release_step is not None and
            _cooled(state.last_release_step, latest, config)):
        return False            # unpriced: today's ladder, a cache release judged first
    layouts = {(v.setup.micro_batch, v.setup.grad_accum) for v in view.ranks.values()
               if v.setup.micro_batch is not None and v.setup.grad_accum is not None}
    if not layouts:
        notes.append("cannot shrink the micro-batch: no rank reported its micro_batch and "
                     "grad_accum")
        return False
    mb, ga = min(layouts)
    if view.plan is None:
        if mb % 2:
            notes.append(f"cannot shrink the micro-batch {mb}: it is odd, so halving it would "
                         f"change the global batch; only cache releases remain")
            return False
        return True
    effect = shrink_effect(view.plan, mb, ga, p.frac, config)
    if isinstance(effect, str):
        notes.append(effect)
        return False
    return effect


def _act(state, decisions, at, e: Effect, p: Pressure, config) -> PolicyState:
    if e.action is Action.RELEASE_CACHE:
        decisions.append(Decision(
            Action.RELEASE_CACHE, f"release cached memory on all ranks: {p.where} at "
            f"{p.frac:.0%} of device memory (watermark {config.memory_watermark_frac:.0%}); "
            f"predicted {e.memory_frac_after:.1%}: {e.basis}", at, Cause.DEVICE_MEMORY,
            "cluster", {"memory_frac": round(p.frac, 4)}, predicted=e.to_dict()))
        return dataclasses.replace(state, last_release_step=at, release_armed=False)
    (mb, ga) = e.params["micro_batch"] * 2, e.params["grad_accum"] // 2
    decisions.append(Decision(
        Action.SHRINK_MICRO_BATCH,
        f"shrink micro-batch {mb}->{e.params['micro_batch']} and raise gradient accumulation "
        f"{ga}->{e.params['grad_accum']}: {p.where} at {p.frac:.0%} of device memory "
        f"(watermark {config.memory_watermark_frac:.0%}, critical "
        f"{config.memory_critical_frac:.0%}); predicted {e.memory_frac_after:.1%} at about "
        f"{e.cost_frac:.0%} of throughput: {e.basis}; the global batch is unchanged",
        at, Cause.DEVICE_MEMORY, "cluster", dict(e.params), predicted=e.to_dict()))
    return dataclasses.replace(state, last_shrink_step=at, last_release_step=at)


def _act_unpriced(view, state, decisions, at, action, p, config, setup) -> PolicyState:
    pct = f"{p.frac:.0%}"
    if action is Action.RELEASE_CACHE:
        decisions.append(Decision(
            Action.RELEASE_CACHE, f"release cached memory on all ranks: {p.where} at "
            f"{pct} of device memory (watermark {config.memory_watermark_frac:.0%}); "
            f"unpriced: no allocator figures reported, released once until memory falls "
            f"under the re-arm line", at, Cause.DEVICE_MEMORY, "cluster",
            {"memory_frac": round(p.frac, 4)}))
        return dataclasses.replace(state, last_release_step=at, release_armed=False)
    mb, ga = min((v.setup.micro_batch, v.setup.grad_accum) for v in view.ranks.values()
                 if v.setup.micro_batch is not None and v.setup.grad_accum is not None)
    after = f"on {_where(setup)} (no cache to release)" if setup.without_cache else \
        "still, after a cache release,"
    decisions.append(Decision(
        Action.SHRINK_MICRO_BATCH,
        f"shrink micro-batch {mb}->{mb // 2} and raise gradient accumulation {ga}->{ga * 2}: "
        f"{p.where} {after} at {pct} of memory (critical "
        f"{config.memory_critical_frac:.0%}); unpriced: the coordinator has no plan; the "
        f"global batch is unchanged",
        at, Cause.DEVICE_MEMORY, "cluster", {"micro_batch": mb // 2, "grad_accum": ga * 2}))
    return dataclasses.replace(state, last_shrink_step=at, last_release_step=at)


def _stop(state, decisions, at, why, params) -> PolicyState:
    decisions.append(Decision(Action.CHECKPOINT_AND_STOP, f"checkpoint and stop: {why}", at,
                              Cause.DEVICE_MEMORY, "cluster", params))
    return dataclasses.replace(state, stop_step=at)


# -- host memory -------------------------------------------------------------------------------

def _host_memory(view, state, config, at, latest, decisions, notes) -> PolicyState:
    steps = dict(state.prefetch_steps)
    for node_id in sorted(view.nodes):
        host = view.nodes[node_id].host
        if host is None or host.memory_used_frac < config.host_memory_watermark_frac:
            continue
        if not _cooled(steps.get(node_id), latest, config):
            continue
        short = short_node_id(node_id)
        if _missed_key(Action.SET_PREFETCH, Cause.HOST_MEMORY) + f"@{node_id}" in state.missed:
            notes.append(f"node {short}: lowering prefetch missed its prediction before; "
                         f"not repeated")
            continue
        here = [v for v in view.ranks.values() if v.node_id == node_id]
        factors = [v.setup.prefetch_factor for v in here if v.setup.prefetch_factor is not None]
        current = min(factors) if factors else None
        if current == 1:
            notes.append(f"node {short}: host memory at {host.memory_used_frac:.0%} with "
                         f"prefetch_factor already 1; nothing left to lower")
            continue
        new = 1 if current is None else max(1, current // 2)
        was = "unknown" if current is None else str(current)
        reason = (f"lower prefetch_factor {was}->{new} on node {short}: host memory "
                  f"{host.memory_used_frac:.0%} used (watermark "
                  f"{config.host_memory_watermark_frac:.0%}, Ray kills workers at 95%)")
        sizes = [(v.setup.num_workers, v.setup.batch_bytes) for v in here]
        predicted = None
        if current is not None and here and all(w is not None and b is not None
                                                for w, b in sizes):
            waits = [v.timing.data_wait_s / v.timing.total_s for v in here
                     if v.timing.total_s > 0]
            e = prefetch_effect(host.memory_used_frac, host.memory_total_bytes, current, new,
                                sizes, max(waits, default=0.0))
            predicted = e.to_dict()
            reason += f"; predicted {e.memory_frac_after:.1%}: {e.basis}"
            if not e.helps(config.host_memory_watermark_frac):
                reason += ("; short of the watermark: the rest of the node's memory is not "
                           "the loaders'")
        decisions.append(Decision(Action.SET_PREFETCH, reason, at, Cause.HOST_MEMORY,
                                  f"node:{node_id}", {"prefetch_factor": new},
                                  predicted=predicted))
        steps[node_id] = at
    return dataclasses.replace(state, prefetch_steps=steps)


# -- pacing ------------------------------------------------------------------------------------

def comm_backpressure(view: ClusterView, config: GuardConfig) -> str | None:
    """Why communication backpressure is on, or None: every rank (two or more) waits longer
    in communication over its last ``num_slow_steps`` steps than over its window, by at least
    the larger of ``straggler_frac`` of its median step and the absolute floor."""
    ranks = [v for v in view.ranks.values() if len(v.window) > config.num_slow_steps]
    if len(ranks) < 2 or len(ranks) < len(view.ranks):
        return None
    rises = []
    for v in ranks:
        recent = min(s.comm_wait_s for s in v.window[-config.num_slow_steps:])
        rise = recent - v.timing.comm_wait_s
        if rise < max(config.straggler_frac * v.timing.total_s, config.slow_step_floor_s):
            return None
        rises.append(rise)
    return (f"communication wait rising on every rank (at least +{min(rises) * 1e3:.1f} ms a "
            f"step over the last {config.num_slow_steps} steps)")


def _pacing(view, state, config, at, latest, decisions) -> PolicyState:
    """Pacing (off unless ``pacing_enabled``) answers communication backpressure only: a
    sleep before a synchronous step lowers no memory peak."""
    if not config.pacing_enabled:
        return state
    why = comm_backpressure(view, config)
    if why is not None and not state.pacing:
        decisions.append(Decision(
            Action.PACE, f"pace every step by {config.pacing_delay_s * 1e3:.0f} ms from step "
            f"{at}: {why}", at, Cause.COMMUNICATION, "cluster",
            {"delay_s": config.pacing_delay_s}))
        return dataclasses.replace(state, pacing=True, last_pace_step=at)
    if why is None and state.pacing and _cooled(state.last_pace_step, latest, config):
        decisions.append(Decision(
            Action.PACE, f"stop pacing from step {at}: communication wait no longer rising on "
            f"every rank", at, Cause.COMMUNICATION, "cluster", {"delay_s": 0.0}))
        return dataclasses.replace(state, pacing=False, last_pace_step=at)
    return state


# -- stragglers ---------------------------------------------------------------------------------

SHORT_NODE_ID_CHARS = 8
"""Characters of a node id kept in messages: Ray's 56-hex-digit ids differ in their first
eight (params and state keep the full id)."""


def short_node_id(node_id: str) -> str:
    """``node_id`` as messages print it: its first 8 characters, with "..." when cut.
    Example: "a1b2c3d4e5f6..." (56 hex digits) -> "a1b2c3d4..."; "n1" -> "n1"."""
    return node_id if len(node_id) <= SHORT_NODE_ID_CHARS + 3 else \
        node_id[:SHORT_NODE_ID_CHARS] + "..."


def rank_gpu(view: ClusterView, world_rank: int) -> int | None:
    """The GPU index a rank runs on: its reported ``device_index``, else the GPU of its node's
    sample whose processes include the rank's registered pid; None when neither tells."""
    rv = view.ranks[world_rank]
    if rv.setup.device_index is not None:
        return rv.setup.device_index
    node = view.nodes.get(rv.node_id)
    if node is None or node.host is None:
        return None
    pids = {w.pid for w in node.host.workers if w.world_rank == world_rank}
    for gpu in node.gpus:
        if pids.intersection(gpu.process_pids or ()):
            return gpu.index
    return None


_RECOMMEND = {
    # (cause, target) -> (recommendation key, text); {gpu} / {node} / {rank} filled in
    (Cause.COMPUTE, "rank"): ("check_gpu", ("check the clocks and throttle reasons of {gpu} "
                                            "(nvidia-smi -q -d PERFORMANCE)")),
    (Cause.THERMAL, "rank"): ("check_gpu", "check the cooling and power cap of {gpu}"),
    (Cause.DATA, "rank"): ("check_input", ("check rank {rank}'s input pipeline (loader "
                                           "workers, storage reads)")),
    (Cause.COMMUNICATION, "rank"): ("check_link", "look at the network link of node {node}"),
    (Cause.COMPUTE, "node"): ("drain_node", "drain node {node}"),
    (Cause.THERMAL, "node"): ("drain_node", "drain node {node}"),
    (Cause.DATA, "node"): ("drain_node", ("drain node {node} (its CPUs or storage feed every "
                                          "rank slowly)")),
    (Cause.COMMUNICATION, "node"): ("check_link", "look at the network link of node {node}"),
}


def _stragglers(view, state, config, at, scores, decisions) -> PolicyState:
    """Rank scope when ranks of one node differ; node scope when every rank of a node is slow
    (a one-rank node included: its GPU is named too). Draining is recommended only for a node,
    and never for the only node of the cluster."""
    slow = persistent_slowdowns({r: v.window for r, v in view.ranks.items()},
                                {r: v.timing for r, v in view.ranks.items()},
                                num_steps=config.straggler_steps,
                                straggler_frac=config.straggler_frac,
                                floor_s=config.slow_step_floor_s, mad_k=config.slow_step_mad_k,
                                scan_steps=max(config.report_every_steps,
                                               config.straggler_steps),
                                host_wait_frac=config.slow_step_host_wait_frac,
                                host_settle_steps=config.slow_step_host_settle_steps,
                                host_settle_factor=config.slow_step_factor)
    recovered_below = config.straggler_frac * STRAGGLER_NOISE_SHARE
    flagged_ranks = {r for r in state.flagged_ranks if r in slow or (
        r in scores and scores[r].excess_frac >= recovered_below)}
    flagged_nodes = {n for n in state.flagged_nodes
                     if any(r in flagged_ranks for r, v in view.ranks.items() if v.node_id == n)}
    by_node: dict[str, list[int]] = {}
    for r, v in view.ranks.items():
        by_node.setdefault(v.node_id, []).append(r)
    nodes_of_run = set(by_node)
    for node_id in sorted(by_node):
        ranks = sorted(by_node[node_id])
        slow_here = [r for r in ranks if r in slow]
        if not slow_here:
            continue
        whole_node = len(slow_here) == len(ranks)
        if whole_node:
            if node_id in flagged_nodes:
                continue
            worst = max((slow[r] for r in ranks), key=lambda d: d.excess_s)
            decisions.append(_flag(view, config, at, node_id, ranks, worst, "node",
                                   len(nodes_of_run)))
            flagged_nodes.add(node_id)
            flagged_ranks.update(ranks)
            continue
        for r in slow_here:
            if r in flagged_ranks:
                continue
            decisions.append(_flag(view, config, at, node_id, [r], slow[r], "rank",
                                   len(nodes_of_run)))
            flagged_ranks.add(r)
    return dataclasses.replace(state, flagged_nodes=frozenset(flagged_nodes),
                               flagged_ranks=frozenset(flagged_ranks))


def _flag(view, config, at, node_id, ranks, worst, target, num_nodes) -> Decision:
    node = view.nodes.get(node_id)
    short = short_node_id(node_id)
    cause, why = worst.cause, worst.cause.value
    gpu_index = rank_gpu(view, worst.world_rank) if target == "rank" or len(ranks) == 1 \
        else None
    gpus = [g for g in (node.gpus if node is not None else ())
            if target == "node" or gpu_index is None or g.index == gpu_index]
    throttled = sorted({reason for g in gpus for reason in g.throttle_reasons})
    if cause is Cause.COMPUTE and throttled:
        cause, why = Cause.THERMAL, f"compute, GPUs throttled ({', '.join(throttled)})"
    gpu = f"GPU {gpu_index} of node {short}" if gpu_index is not None else \
        f"the GPU of rank {worst.world_rank} on node {short}"
    key, text = _RECOMMEND[(cause, target)]
    if key == "drain_node" and num_nodes < 2:
        key, text = "check_node", ("check node {node}: it is the only node of the run, so "
                                   "draining it would stop training")
    text = text.format(gpu=gpu, node=short, rank=worst.world_rank)
    each = "a step each" if worst.num_over == len(worst.steps) else \
        f"at {worst.num_over} of those {len(worst.steps)} steps"
    figures = (f"{worst.component_s * 1e3:.1f} ms vs {worst.reference_s * 1e3:.1f} ms at "
               f"steps {worst.steps[0]}-{worst.steps[-1]}, at least "
               f"+{worst.excess_s * 1e3:.1f} ms {each} (threshold "
               f"{worst.threshold_s * 1e3:.1f} ms, median step {worst.step_s * 1e3:.1f} ms)")
    if target == "node" and len(ranks) == 1:
        on = f", GPU {gpu_index}" if gpu_index is not None else ""
        who = f"node {short} is a straggler ({why}): its only rank {worst.world_rank}{on} is slow"
    elif target == "node":
        who = f"node {short} is a straggler ({why}): all its ranks {ranks} are slow, worst " \
              f"rank {worst.world_rank}"
    else:
        where = f"GPU {gpu_index}, node {short}" if gpu_index is not None else f"node {short}"
        who = f"rank {worst.world_rank} ({where}) is a straggler ({why})"
    params = {"node_id": node_id, "world_ranks": list(ranks), "target": target,
              "excess_frac": round(worst.excess_frac, 4),
              "excess_s": round(worst.excess_s, 6), "recommendation": key}
    if gpu_index is not None:
        params["gpu_index"] = gpu_index
    return Decision(Action.FLAG_STRAGGLER, f"{who}: {worst.cause.value} {figures}; "
                    f"recommend: {text}", at, cause, f"node:{node_id}", params)
