"""The policy's device-memory rules (pure): the worst reading of the run, then stop, a priced
remedy, an unpriced one, or wait (docs/coordination.md, "The coordinator's policy").

Past the watermark, the candidates (a cache release priced from the rank's allocator figures,
a micro-batch shrink priced by the memory model) are weighed and the cheapest predicted to
bring memory under the re-arm line is chosen. Without figures or a plan, the ladder: release
once per crossing, shrink at critical. A projection past ``oom_stop_frac`` by the step after
the apply step, or critical memory with nothing left to try, checkpoints and stops.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from raytrain_guard.core.decisions import Action, Cause, Decision
from raytrain_guard.core.effects import Effect, choose, release_effect, shrink_effect
from raytrain_guard.core.node_samples import GpuSample, NodeSample, RunSetup
from raytrain_guard.core.view import (
    ClusterView,
    PolicyState,
    Round,
    missed_key,
    rank_gpu,
    short_node_id,
)


@dataclass(frozen=True)
class Pressure:
    """The worst device-memory reading and where it was seen."""

    frac: float
    where: str                    # "rank 5 (node n2)" or "node n2 GPU 3"
    slope_per_step: float = 0.0   # from the rank's window; 0 for NVML readings
    step: int | None = None
    world_rank: int | None = None  # the rank read (or running on the GPU read), when known


def worst_device_pressure(view: ClusterView, notes: list[str] | None = None
                          ) -> Pressure | None:
    """The highest device memory fraction: each rank's latest step, and the NVML reading of
    each of the run's GPUs (:func:`run_gpus`, its notes to ``notes``; none when every rank
    runs on CPU)."""
    rank = max((r for r in view.ranks.values() if r.memory is not None),
               key=lambda r: r.memory.frac, default=None)
    worst = None if rank is None else Pressure(
        rank.memory.frac, f"rank {rank.world_rank} (node {short_node_id(rank.node_id)})",
        rank.memory.slope_per_step, rank.memory.step, rank.world_rank)
    if view.ranks and {r.setup.device for r in view.ranks.values()} == {"cpu"}:
        if notes is not None and any(n.gpus for n in view.nodes.values()):
            notes.append("GPU readings left out: every rank of the run runs on CPU")
        return worst
    rank_nodes = {r.node_id for r in view.ranks.values()}
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
    """The GPUs of ``node`` that count as this run's memory pressure: those running a train
    worker registered with the node's monitor (another job's full GPU is not this run's); none
    on a node without registered workers unless ``runs_ranks``. Every GPU counts, with a note
    saying why, when that cannot be told (no worker registered yet, no pids listed, or no GPU
    lists a registered pid: another pid namespace). Example: workers {11, 12}; GPU 0 runs
    (11,), GPU 1 runs (99,) -> (GPU 0,), no note."""
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


def device_memory(r: Round, state: PolicyState) -> PolicyState:
    """The device-memory rules of one round (see the module docstring)."""
    config = r.config
    p = worst_device_pressure(r.view, r.notes)
    if p is None:
        return state
    rearm_below = config.memory_watermark_frac - config.memory_hysteresis_frac
    if p.frac < rearm_below and not state.release_armed:
        state = dataclasses.replace(state, release_armed=True)
    if p.frac < config.memory_watermark_frac:
        return state
    pct = f"{p.frac:.0%}"

    horizon = r.at + config.lockstep_every_steps
    projected = p.frac + max(0.0, p.slope_per_step) * (horizon - (p.step or r.at))
    if projected >= config.oom_stop_frac:
        trend = (f", rising {p.slope_per_step:.2%} per step to {projected:.0%} by step {horizon}"
                 if p.slope_per_step > 0 else "")
        return _stop(r, state, f"{p.where} at {pct} of device memory{trend}, past the "
                     f"out-of-memory line {config.oom_stop_frac:.0%}",
                     {"memory_frac": round(p.frac, 4), "projected_frac": round(projected, 4)})

    setup = _setup_of(r.view, p.world_rank)
    critical = p.frac >= config.memory_critical_frac
    priced: list[Effect] = []
    unpriced: list[Action] = []
    release = _release_candidate(r, state, p, setup)
    if isinstance(release, Effect):
        priced.append(release)
    elif release:
        unpriced.append(Action.RELEASE_CACHE)
    # a priced shrink is weighed from the watermark on: waiting for critical would leave it to
    # the rank's own gate, which checkpoints and stops there; unpriced, only at critical
    if (critical or r.view.plan is not None) and r.cooled(state.last_shrink_step):
        shrink = _shrink_candidate(r, state, p, setup)
        if isinstance(shrink, Effect):
            priced.append(shrink)
        elif shrink and critical:
            unpriced.append(Action.SHRINK_MICRO_BATCH)

    chosen = choose(priced, rearm_below)
    for e in priced:
        if not e.helps(rearm_below):
            r.notes.append(f"{e.action.value} not chosen: predicted {e.memory_frac_before:.1%} "
                           f"-> {e.memory_frac_after:.1%}, not under {rearm_below:.0%} "
                           f"({e.basis})")
    if chosen is not None:
        return _act(r, state, chosen, p)
    if unpriced:    # fail open: no plan or no allocator figures, today's ladder, once a crossing
        return _act_unpriced(r, state, unpriced[-1], p, setup)   # the shrink when allowed
    waiting = [a for a, last in (("cache release", state.last_release_step),
                                 ("micro-batch shrink", state.last_shrink_step))
               if not r.cooled(last)]
    if critical and waiting:        # an action's effect is not reported yet: judge it first
        r.notes.append(f"{p.where} at {pct} of device memory: waiting for the effect of the "
                       f"{' and '.join(waiting)} before escalating")
        return state
    if critical:
        tried = "; ".join(f"{e.action.value} predicted {e.memory_frac_after:.1%}"
                          for e in priced) or "no action left to try"
        return _stop(r, state, f"{p.where} at {pct} of device memory (critical "
                     f"{config.memory_critical_frac:.0%}) and no action is predicted to bring "
                     f"it under {rearm_below:.0%} ({tried})", {"memory_frac": round(p.frac, 4)})
    return state


def _setup_of(view: ClusterView, world_rank: int | None) -> RunSetup:
    """The setup of the rank behind a reading; behind a GPU reading with no known rank, the
    run's device when every rank reports the same one."""
    if world_rank in view.ranks:
        return view.ranks[world_rank].setup
    devices = {r.setup.device for r in view.ranks.values()}
    return RunSetup(device=devices.pop()) if len(devices) == 1 else RunSetup()


def _where(setup: RunSetup) -> str:
    return "a simulated card" if setup.device == "simulated" else "CPU"


def _release_candidate(r: Round, state: PolicyState, p: Pressure,
                       setup: RunSetup) -> Effect | bool:
    """The cache release priced from the rank's allocator figures; True: allowed unpriced
    (once per crossing of the watermark); False: not a candidate."""
    if setup.without_cache:
        r.notes.append(f"no cache release: the run is on {_where(setup)}, where there is no "
                       f"allocator cache")
        return False
    if missed_key(Action.RELEASE_CACHE, Cause.DEVICE_MEMORY) in state.missed or \
            not r.cooled(state.last_release_step):
        return False
    cached = setup.cached_free_bytes
    plan = r.view.plan
    total = setup.device_total_bytes or (plan.device_memory_bytes if plan else None)
    if cached is None or not total:
        return state.release_armed
    if not state.release_armed:     # released: again once its measured effect is known
        return False                # (the coordinator re-arms it) or memory dipped under the line
    if cached < r.config.cache_release_min_frac * total:
        r.notes.append(f"no cache release: {p.where} holds {cached / 2**20:.0f} MiB cached but "
                       f"unallocated, under {r.config.cache_release_min_frac:.0%} of the card")
        return False
    return release_effect(p.frac, setup.allocated_bytes, setup.reserved_bytes, total, plan,
                          setup.micro_batch, setup.grad_accum, r.config)


def _shrink_candidate(r: Round, state: PolicyState, p: Pressure,
                      setup: RunSetup) -> Effect | bool:
    """The micro-batch shrink priced by the memory model; True: allowed unpriced (no plan, and
    a cache release was judged first, or there is no cache to release); False: not one."""
    if missed_key(Action.SHRINK_MICRO_BATCH, Cause.DEVICE_MEMORY) in state.missed:
        return False
    plan = r.view.plan
    if plan is None and not setup.without_cache and not (
            state.last_release_step is not None and r.cooled(state.last_release_step)):
        return False            # unpriced: today's ladder, a cache release judged first
    layout = _smallest_layout(r.view)
    if layout is None:
        r.notes.append("cannot shrink the micro-batch: no rank reported its micro_batch and "
                       "grad_accum")
        return False
    mb, ga = layout
    if plan is None:
        if mb % 2:
            r.notes.append(f"cannot shrink the micro-batch {mb}: it is odd, so halving it would "
                           f"change the global batch; only cache releases remain")
            return False
        return True
    effect = shrink_effect(plan, mb, ga, p.frac, r.config)
    if isinstance(effect, str):
        r.notes.append(effect)
        return False
    return effect


def _smallest_layout(view: ClusterView) -> tuple[int, int] | None:
    """The smallest (micro_batch, grad_accum) the ranks report; None when none does."""
    return min(((v.setup.micro_batch, v.setup.grad_accum) for v in view.ranks.values()
                if v.setup.micro_batch is not None and v.setup.grad_accum is not None),
               default=None)


def _act(r: Round, state: PolicyState, e: Effect, p: Pressure) -> PolicyState:
    if e.action is Action.RELEASE_CACHE:
        return _release(r, state, f"{p.where} at {p.frac:.0%} of device memory (watermark "
                        f"{r.config.memory_watermark_frac:.0%}); predicted "
                        f"{e.memory_frac_after:.1%}: {e.basis}", p, e)
    mb, ga = e.params["micro_batch"], e.params["grad_accum"]
    return _shrink(r, state, mb * 2, ga // 2, f"{p.where} at {p.frac:.0%} of device memory "
                   f"(watermark {r.config.memory_watermark_frac:.0%}, critical "
                   f"{r.config.memory_critical_frac:.0%}); predicted {e.memory_frac_after:.1%} "
                   f"at about {e.cost_frac:.0%} of throughput: {e.basis}", e)


def _act_unpriced(r: Round, state: PolicyState, action: Action, p: Pressure,
                  setup: RunSetup) -> PolicyState:
    if action is Action.RELEASE_CACHE:
        return _release(r, state, f"{p.where} at {p.frac:.0%} of device memory (watermark "
                        f"{r.config.memory_watermark_frac:.0%}); unpriced: no allocator "
                        f"figures reported, released once until memory falls under the "
                        f"re-arm line", p)
    mb, ga = _smallest_layout(r.view)
    after = f"on {_where(setup)} (no cache to release)" if setup.without_cache else \
        "still, after a cache release,"
    return _shrink(r, state, mb, ga, f"{p.where} {after} at {p.frac:.0%} of memory (critical "
                   f"{r.config.memory_critical_frac:.0%}); unpriced: the coordinator has no "
                   f"plan")


def _release(r: Round, state: PolicyState, why: str, p: Pressure,
             e: Effect | None = None) -> PolicyState:
    r.decisions.append(Decision(
        Action.RELEASE_CACHE, f"release cached memory on all ranks: {why}", r.at,
        Cause.DEVICE_MEMORY, "cluster", {"memory_frac": round(p.frac, 4)},
        predicted=None if e is None else e.to_dict()))
    return dataclasses.replace(state, last_release_step=r.at, release_armed=False)


def _shrink(r: Round, state: PolicyState, mb: int, ga: int, why: str,
            e: Effect | None = None) -> PolicyState:
    """Halve the micro-batch ``mb`` and double the accumulation ``ga``."""
    r.decisions.append(Decision(
        Action.SHRINK_MICRO_BATCH, f"shrink micro-batch {mb}->{mb // 2} and raise gradient "
        f"accumulation {ga}->{ga * 2}: {why}; the global batch is unchanged", r.at,
        Cause.DEVICE_MEMORY, "cluster", {"micro_batch": mb // 2, "grad_accum": ga * 2},
        predicted=None if e is None else e.to_dict()))
    return dataclasses.replace(state, last_shrink_step=r.at, last_release_step=r.at)


def _stop(r: Round, state: PolicyState, why: str, params: dict) -> PolicyState:
    r.decisions.append(Decision(Action.CHECKPOINT_AND_STOP, f"checkpoint and stop: {why}",
                                r.at, Cause.DEVICE_MEMORY, "cluster", params))
    return dataclasses.replace(state, stop_step=r.at)
