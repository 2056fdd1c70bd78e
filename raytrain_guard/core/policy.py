"""The coordinator's policy: cluster state in, cluster-wide decisions out (pure).

:func:`decide` is a pure function of a :class:`ClusterView` (every rank's recent StepStats and
every node monitor's latest sample), the previous :class:`PolicyState`, the config and the step
the decisions would apply at (``next_apply_step``: the lockstep layer's rule chooses it; see
:func:`default_apply_step`). It returns a :class:`PolicyOutcome`: the new decisions (ids are
given by the coordinator), the new state, the straggler scores and notes for the status page.

Device memory is each rank's own reading and the NVML reading of the GPUs that hold this
run's workers (:func:`run_gpus`: another job's GPU on a shared node does not count; when the
pids cannot tell, every GPU counts and a note says so).

Rules, in order (the first device-memory rule that fires wins; host and straggler rules are
per node and independent):

1. Stop: the worst device memory is at or above the watermark and its linear trend, projected
   to ``next_apply_step + lockstep_every_steps``, reaches ``oom_stop_frac``
   -> CHECKPOINT_AND_STOP on all ranks. After it the policy decides nothing more.
2. Shrink: still at or above ``memory_critical_frac`` after a cache release has been applied
   -> SHRINK_MICRO_BATCH: halve the micro-batch and double gradient accumulation, so the global
   batch (micro_batch x grad_accum x world size) and the mathematics stay the same. Only when
   the micro-batch is even; otherwise a note says why not and rule 3 applies.
3. Release: at or above ``memory_watermark_frac`` -> RELEASE_CACHE on all ranks at one step.
4. Pace (only with ``pacing_enabled``): at or above the watermark -> PACE with
   ``pacing_delay_s``; below it again -> PACE with delay 0.
5. Host memory: a node at or above ``host_memory_watermark_frac`` -> SET_PREFETCH on that node
   with half its prefetch factor (at least 1).
6. Straggler: a node whose worst rank adds ``straggler_frac`` of a step or more
   -> FLAG_STRAGGLER on that node (an event and the recommendation to drain it), once until it
   recovers below half the threshold.

An action is not repeated (nor escalated) until ``decision_cooldown_steps`` steps after its
apply step have been reported, so each decision is judged on statistics that show its effect.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Mapping

from raytrain_guard.config import GuardConfig
from raytrain_guard.core.decisions import Action, Cause, Decision
from raytrain_guard.core.node_samples import GpuSample, NodeSample, RunSetup
from raytrain_guard.core.stats import slope
from raytrain_guard.core.steps import StepStats
from raytrain_guard.core.straggler import (StragglerScore, TimingSummary, score_summaries,
                                           summarize)


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
    setup: RunSetup = RunSetup()
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
    flagged_nodes: frozenset[str] = frozenset()
    pacing: bool = False
    stop_step: int | None = None


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
        return PolicyOutcome((), state, scores, ("stopping: checkpoint_and_stop already decided "
                                                 f"for step {state.stop_step}",))
    latest = view.latest_step
    decisions: list[Decision] = []
    notes: list[str] = []
    state = _device_memory(view, state, config, next_apply_step, latest, decisions, notes)
    if state.stop_step is None:
        state = _host_memory(view, state, config, next_apply_step, latest, decisions, notes)
        state = _stragglers(view, state, config, next_apply_step, scores, decisions)
    return PolicyOutcome(tuple(decisions), state, scores, tuple(notes))


# -- device memory -----------------------------------------------------------------------------

def worst_device_pressure(view: ClusterView, notes: list[str] | None = None
                          ) -> Pressure | None:
    """The highest device memory fraction: each rank's latest StepStats, and the NVML reading
    of each GPU that holds this run's workers (:func:`run_gpus`; its notes go to ``notes``)."""
    worst: Pressure | None = None
    for rank in view.ranks.values():
        m = rank.memory
        if m is not None and (worst is None or m.frac > worst.frac):
            worst = Pressure(m.frac, f"rank {rank.world_rank} (node {rank.node_id})",
                             m.slope_per_step, m.step)
    rank_nodes = {r.node_id for r in view.ranks.values()}
    for node_id in sorted(view.nodes):
        gpus, note = run_gpus(view.nodes[node_id], node_id in rank_nodes)
        if note is not None and notes is not None:
            notes.append(note)
        for gpu in gpus:
            if worst is None or gpu.memory_frac > worst.frac:
                worst = Pressure(gpu.memory_frac, f"node {node_id} GPU {gpu.index}")
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
    return node.gpus, (f"node {node.node_id}: every GPU counts as this run's memory pressure: "
                       f"{why}")


def _cooled(last_apply_step: int | None, latest: int | None, config: GuardConfig) -> bool:
    return (last_apply_step is None or
            (latest is not None and latest >= last_apply_step + config.decision_cooldown_steps))


def _device_memory(view, state, config, at, latest, decisions, notes) -> PolicyState:
    p = worst_device_pressure(view, notes)
    if p is None:
        return state
    pct = f"{p.frac:.0%}"
    if config.pacing_enabled and state.pacing and p.frac < config.memory_watermark_frac:
        decisions.append(Decision(Action.PACE, f"stop pacing: worst device memory "
                                  f"{pct} at {p.where}, below the watermark "
                                  f"{config.memory_watermark_frac:.0%}", at,
                                  Cause.DEVICE_MEMORY, "cluster", {"delay_s": 0.0}))
        state = dataclasses.replace(state, pacing=False)
    if p.frac < config.memory_watermark_frac:
        return state

    horizon = at + config.lockstep_every_steps
    projected = p.frac + max(0.0, p.slope_per_step) * (horizon - (p.step or at))
    if projected >= config.oom_stop_frac:
        trend = (f", rising {p.slope_per_step:.2%} per step to {projected:.0%} by step {horizon}"
                 if p.slope_per_step > 0 else "")
        decisions.append(Decision(
            Action.CHECKPOINT_AND_STOP,
            f"checkpoint and stop: {p.where} at {pct} of device memory{trend}, "
            f"past the out-of-memory line {config.oom_stop_frac:.0%}", at,
            Cause.DEVICE_MEMORY, "cluster", {"memory_frac": round(p.frac, 4),
                                             "projected_frac": round(projected, 4)}))
        return dataclasses.replace(state, stop_step=at)

    release_judged = state.last_release_step is not None and \
        _cooled(state.last_release_step, latest, config)
    if p.frac >= config.memory_critical_frac and release_judged and \
            _cooled(state.last_shrink_step, latest, config):
        shrink = _shrink(view)
        if isinstance(shrink, str):
            notes.append(shrink)
        else:
            (mb, ga), (new_mb, new_ga) = shrink
            decisions.append(Decision(
                Action.SHRINK_MICRO_BATCH,
                f"shrink micro-batch {mb}->{new_mb} and raise gradient accumulation {ga}->{new_ga}: "
                f"{p.where} still at {pct} of device memory after a cache release "
                f"(critical {config.memory_critical_frac:.0%}); the global batch is unchanged",
                at, Cause.DEVICE_MEMORY, "cluster", {"micro_batch": new_mb, "grad_accum": new_ga}))
            return dataclasses.replace(state, last_shrink_step=at, last_release_step=at)

    if _cooled(state.last_release_step, latest, config):
        decisions.append(Decision(
            Action.RELEASE_CACHE, f"release cached memory on all ranks: {p.where} at "
            f"{pct} of device memory (watermark {config.memory_watermark_frac:.0%})", at,
            Cause.DEVICE_MEMORY, "cluster", {"memory_frac": round(p.frac, 4)}))
        state = dataclasses.replace(state, last_release_step=at)
    if config.pacing_enabled and not state.pacing:
        decisions.append(Decision(
            Action.PACE, f"pace every step by {config.pacing_delay_s * 1e3:.0f} ms from step {at}: "
            f"{p.where} at {pct} of device memory", at, Cause.DEVICE_MEMORY, "cluster",
            {"delay_s": config.pacing_delay_s}))
        state = dataclasses.replace(state, pacing=True)
    return state


def _shrink(view: ClusterView) -> tuple[tuple[int, int], tuple[int, int]] | str:
    """((micro_batch, grad_accum), (halved, doubled)), or a note saying why it cannot be done."""
    setups = [view.ranks[r].setup for r in sorted(view.ranks)]
    known = [s for s in setups if s.micro_batch is not None and s.grad_accum is not None]
    if not known:
        return "cannot shrink the micro-batch: no rank reported its micro_batch and grad_accum"
    mb, ga = known[0].micro_batch, known[0].grad_accum
    if mb % 2:
        return (f"cannot shrink the micro-batch {mb}: it is odd, so halving it would change "
                f"the global batch; only cache releases remain")
    return (mb, ga), (mb // 2, ga * 2)


# -- host memory -------------------------------------------------------------------------------

def _host_memory(view, state, config, at, latest, decisions, notes) -> PolicyState:
    steps = dict(state.prefetch_steps)
    for node_id in sorted(view.nodes):
        host = view.nodes[node_id].host
        if host is None or host.memory_used_frac < config.host_memory_watermark_frac:
            continue
        if not _cooled(steps.get(node_id), latest, config):
            continue
        factors = [r.setup.prefetch_factor for r in view.ranks.values()
                   if r.node_id == node_id and r.setup.prefetch_factor is not None]
        current = min(factors) if factors else None
        if current == 1:
            notes.append(f"node {node_id}: host memory at {host.memory_used_frac:.0%} with "
                         f"prefetch_factor already 1; nothing left to lower")
            continue
        new = 1 if current is None else max(1, current // 2)
        was = "unknown" if current is None else str(current)
        decisions.append(Decision(
            Action.SET_PREFETCH, f"lower prefetch_factor {was}->{new} on node {node_id}: "
            f"host memory {host.memory_used_frac:.0%} used (watermark "
            f"{config.host_memory_watermark_frac:.0%}, Ray kills workers at 95%)", at,
            Cause.HOST_MEMORY, f"node:{node_id}", {"prefetch_factor": new}))
        steps[node_id] = at
    return dataclasses.replace(state, prefetch_steps=steps)


# -- stragglers --------------------------------------------------------------------------------

def _stragglers(view, state, config, at, scores, decisions) -> PolicyState:
    by_node: dict[str, list[StragglerScore]] = {}
    for rank, score in scores.items():
        by_node.setdefault(view.ranks[rank].node_id, []).append(score)
    flagged = set(state.flagged_nodes)
    for node_id in sorted(by_node):
        worst = max(by_node[node_id], key=lambda s: s.excess_frac)
        if worst.excess_frac < config.straggler_frac * STRAGGLER_NOISE_SHARE:
            flagged.discard(node_id)
        if worst.excess_frac < config.straggler_frac or node_id in flagged:
            continue
        cause = worst.cause
        throttled = sorted({reason for g in (view.nodes[node_id].gpus if node_id in view.nodes
                                             else ()) for reason in g.throttle_reasons})
        why = f"{cause.value}"
        if cause is Cause.COMPUTE and throttled:
            cause, why = Cause.THERMAL, f"compute, GPUs throttled ({', '.join(throttled)})"
        ranks = sorted(s.world_rank for s in by_node[node_id]
                       if s.excess_frac >= config.straggler_frac)
        decisions.append(Decision(
            Action.FLAG_STRAGGLER, f"node {node_id} is a straggler ({why}): rank "
            f"{worst.world_rank} adds {worst.excess_frac:.0%} of a {worst.step_s * 1e3:.0f} ms "
            f"step; recommend draining the node", at, cause, f"node:{node_id}",
            {"node_id": node_id, "world_ranks": ranks,
             "excess_frac": round(worst.excess_frac, 4), "recommendation": "drain"}))
        flagged.add(node_id)
    return dataclasses.replace(state, flagged_nodes=frozenset(flagged))
