"""The coordinator's policy: cluster state in, cluster-wide decisions out (pure).

:func:`decide` is a pure function of a :class:`~raytrain_guard.core.view.ClusterView` (every
rank's recent StepStats and every node monitor's latest sample), the previous
:class:`~raytrain_guard.core.view.PolicyState`, the config and the step the decisions would
apply at; it returns a :class:`PolicyOutcome` (decisions, new state, straggler scores, notes).
The rules, in order: device memory (stop or a priced remedy: :mod:`.device_memory`), host
memory, stragglers, pacing; docs/coordination.md ("The coordinator's policy").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from raytrain_guard.config import GuardConfig
from raytrain_guard.core.decisions import Action, Cause, Decision
from raytrain_guard.core.device_memory import device_memory
from raytrain_guard.core.effects import prefetch_effect
from raytrain_guard.core.recent_steps import MIN_MEDIAN_POINTS
from raytrain_guard.core.stats import median_of_sorted, slope
from raytrain_guard.core.straggler import (
    Slowdown,
    StragglerScore,
    persistent_slowdowns,
    score_summaries,
)
from raytrain_guard.core.view import (  # noqa: F401 - RankView: the policy's input, named here
    ClusterView,
    PolicyState,
    RankView,
    Round,
    missed_key,
    rank_gpu,
    short_node_id,
)


@dataclass(frozen=True)
class PolicyOutcome:
    decisions: tuple[Decision, ...]
    state: PolicyState
    scores: Mapping[int, StragglerScore]
    notes: tuple[str, ...] = ()


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
    r = Round(view, config, next_apply_step)
    state = device_memory(r, state)
    if state.stop_step is None:
        state = _host_memory(r, state)
    if state.stop_step is None:
        state = _stragglers(r, state, scores)
        state = _pacing(r, state)
    return PolicyOutcome(tuple(r.decisions), state, scores, tuple(r.notes))


# -- host memory -------------------------------------------------------------------------------

def _host_memory(r: Round, state: PolicyState) -> PolicyState:
    """Checkpoint and stop every rank when a node reaches ``host_memory_stop_frac``, or when,
    past ``host_memory_watermark_frac``, the line through its last readings reaches it before a
    stop decided at the next round could land (before Ray's memory monitor or the kernel kills
    a worker there); else lower the prefetch factor of a node past the watermark, priced from
    its ranks' loader figures when every rank reports them, where its ranks have loader
    workers to lower. Below the watermark a fast rise is not read as a leak: a loader or a
    model filling the node's memory rises as fast and then holds."""
    config, steps = r.config, dict(state.prefetch_steps)
    line = config.host_memory_stop_frac
    horizon_s = _next_stop_lands_in_s(r)
    for node_id in sorted(r.view.nodes):
        host = r.view.nodes[node_id].host
        if host is None:
            continue
        frac, params = host.memory_used_frac, {"node_id": node_id}
        rise = host_rise_per_s(r.view.host_readings.get(node_id, ()))
        if frac >= line:
            why = f"past the stop line {line:.0%}"
        elif frac >= config.host_memory_watermark_frac and frac + rise * horizon_s >= line:
            why = (f"rising {rise:.1%} of it a second: on that line it reaches the stop line "
                   f"{line:.0%} in {(line - frac) / rise:.1f} s, before a stop decided at the "
                   f"next round could land (in about {horizon_s:.1f} s)")
            params["rise_per_s"] = round(rise, 5)
        else:
            continue
        r.decisions.append(Decision(
            Action.CHECKPOINT_AND_STOP,
            f"checkpoint and stop: node {short_node_id(node_id)} at {frac:.0%} of host memory, "
            f"{why} (Ray's memory monitor kills a worker at 95%, the kernel at 100%)",
            r.at, Cause.HOST_MEMORY, "cluster", {**params, "memory_frac": round(frac, 4)}))
        return dataclasses.replace(state, stop_step=r.at)
    for node_id in sorted(r.view.nodes):
        host = r.view.nodes[node_id].host
        if host is None or host.memory_used_frac < config.host_memory_watermark_frac \
                or not r.cooled(steps.get(node_id)):
            continue
        short = short_node_id(node_id)
        here = [v for v in r.view.ranks.values() if v.node_id == node_id]
        if here and all(v.setup.num_workers == 0 for v in here):
            r.notes.append(f"node {short}: host memory at {host.memory_used_frac:.0%}; its "
                           f"ranks load in the training process (no loader workers): no "
                           f"prefetch to lower")
            continue
        if missed_key(Action.SET_PREFETCH, Cause.HOST_MEMORY, f"node:{node_id}") in state.missed:
            r.notes.append(f"node {short}: lowering prefetch missed its prediction before; "
                           f"not repeated")
            continue
        current = min((v.setup.prefetch_factor for v in here
                       if v.setup.prefetch_factor is not None), default=None)
        if current == 1:
            r.notes.append(f"node {short}: host memory at {host.memory_used_frac:.0%} with "
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
        r.decisions.append(Decision(Action.SET_PREFETCH, reason, r.at, Cause.HOST_MEMORY,
                                    f"node:{node_id}", {"prefetch_factor": new},
                                    predicted=predicted))
        steps[node_id] = r.at
    return dataclasses.replace(state, prefetch_steps=steps)


def host_rise_per_s(readings: Sequence[tuple[float, float]]) -> float:
    """A node's host memory rise per second from its last ``(time_s, used fraction)``
    readings: the least-squares slope, and never steeper than the last interval's rise (a
    one-off jump that then holds is no leak); 0 under :data:`MIN_MEDIAN_POINTS` readings.

    Example: ``[(0, 0.80), (1, 0.82), (2, 0.84)]`` -> slope 0.02, last interval 0.02 -> 0.02;
    ``[(0, 0.60), (1, 0.85), (2, 0.85)]`` -> slope 0.125, last interval 0 -> 0.
    """
    if len(readings) < MIN_MEDIAN_POINTS:
        return 0.0
    (t0, f0), (t1, f1) = readings[-2], readings[-1]
    last = (f1 - f0) / (t1 - t0) if t1 > t0 else 0.0
    return min(slope(readings), last)


def _next_stop_lands_in_s(r: Round) -> float:
    """How long after a node's sample a stop decided at the next round lands, at most: a
    monitor interval (the sample's age), a decision interval, and the steps from the latest
    reported to this round's apply step at the ranks' median step time."""
    config = r.config
    steps = max(0, r.at - r.latest) if r.latest is not None else 0
    totals = sorted(v.timing.total_s for v in r.view.ranks.values() if v.timing.total_s > 0)
    step_s = median_of_sorted(totals) if totals else 0.0
    return config.monitor_interval_s + config.decision_interval_s + steps * step_s


# -- pacing ------------------------------------------------------------------------------------

def comm_backpressure(view: ClusterView, config: GuardConfig) -> str | None:
    """Why communication backpressure is on, or None: every rank (two or more) waits longer
    in communication over its last ``num_slow_steps`` steps than over its window, by at least
    the larger of ``straggler_frac`` of its median step and the absolute floor."""
    ranks = [v for v in view.ranks.values() if len(v.columns) > config.num_slow_steps]
    if len(ranks) < 2 or len(ranks) < len(view.ranks):
        return None
    rises = []
    for v in ranks:
        recent = min(v.columns.comm[-config.num_slow_steps:])
        rise = recent - v.timing.comm_wait_s
        if rise < max(config.straggler_frac * v.timing.total_s, config.slow_step_floor_s):
            return None
        rises.append(rise)
    return (f"communication wait rising on every rank (at least +{min(rises) * 1e3:.1f} ms a "
            f"step over the last {config.num_slow_steps} steps)")


def _pacing(r: Round, state: PolicyState) -> PolicyState:
    """Pacing (off unless ``pacing_enabled``) answers communication backpressure only: a
    sleep before a synchronous step lowers no memory peak."""
    if not r.config.pacing_enabled:
        return state
    why = comm_backpressure(r.view, r.config)
    delay_ms = r.config.pacing_delay_s * 1e3
    if why is not None and not state.pacing:
        r.decisions.append(Decision(
            Action.PACE, f"pace every step by {delay_ms:.0f} ms from step {r.at}: {why}", r.at,
            Cause.COMMUNICATION, "cluster", {"delay_s": r.config.pacing_delay_s}))
        return dataclasses.replace(state, pacing=True, last_pace_step=r.at)
    if why is None and state.pacing and r.cooled(state.last_pace_step):
        r.decisions.append(Decision(
            Action.PACE, f"stop pacing from step {r.at}: communication wait no longer rising "
            f"on every rank", r.at, Cause.COMMUNICATION, "cluster", {"delay_s": 0.0}))
        return dataclasses.replace(state, pacing=False, last_pace_step=r.at)
    return state


# -- stragglers ---------------------------------------------------------------------------------

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


def _stragglers(r: Round, state: PolicyState,
                scores: Mapping[int, StragglerScore]) -> PolicyState:
    """Rank scope when ranks of one node differ; node scope when every rank of a node is slow
    (a one-rank node included: its GPU is named too). Draining is recommended only for a node,
    and never for the only node of the cluster."""
    config, ranks_of = r.config, r.view.ranks
    slow = persistent_slowdowns({k: v.columns for k, v in ranks_of.items()},
                                {k: v.timing for k, v in ranks_of.items()},
                                num_steps=config.straggler_steps,
                                straggler_frac=config.straggler_frac,
                                floor_s=config.slow_step_floor_s, mad_k=config.slow_step_mad_k,
                                scan_steps=max(config.report_every_steps,
                                               config.straggler_steps))
    recovered_below = config.straggler_frac * STRAGGLER_NOISE_SHARE
    flagged_ranks = {k for k in state.flagged_ranks if k in slow or (
        k in scores and scores[k].excess_frac >= recovered_below)}
    flagged_nodes = {n for n in state.flagged_nodes
                     if any(k in flagged_ranks for k, v in ranks_of.items() if v.node_id == n)}
    by_node: dict[str, list[int]] = {}
    for k, v in ranks_of.items():
        by_node.setdefault(v.node_id, []).append(k)
    for node_id in sorted(by_node):
        ranks = sorted(by_node[node_id])
        slow_here = [k for k in ranks if k in slow]
        if not slow_here:
            continue
        if len(slow_here) == len(ranks):            # the whole node
            if node_id not in flagged_nodes:
                worst = max((slow[k] for k in ranks), key=lambda d: d.excess_s)
                r.decisions.append(_flag(r, node_id, ranks, worst, "node", len(by_node)))
                flagged_nodes.add(node_id)
                flagged_ranks.update(ranks)
            continue
        for k in slow_here:
            if k not in flagged_ranks:
                r.decisions.append(_flag(r, node_id, [k], slow[k], "rank", len(by_node)))
                flagged_ranks.add(k)
    return dataclasses.replace(state, flagged_nodes=frozenset(flagged_nodes),
                               flagged_ranks=frozenset(flagged_ranks))


def _flag(r: Round, node_id: str, ranks: list[int], worst: Slowdown, target: str,
          num_nodes: int) -> Decision:
    node = r.view.nodes.get(node_id)
    short = short_node_id(node_id)
    cause, why = worst.cause, worst.cause.value
    gpu_index = rank_gpu(r.view, worst.world_rank) if target == "rank" or len(ranks) == 1 \
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
                    f"recommend: {text}", r.at, cause, f"node:{node_id}", params)
