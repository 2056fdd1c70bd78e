"""Lockstep over real gloo processes: ranks fetch decisions at random, different times.

Three processes (torch.multiprocessing, no Ray) run a scripted training: every optimizer step
each rank does ``grad_accum`` micro-steps, each drawing ``micro_batch`` sample ids from its own
``DataLoader`` over a ``DistributedSampler`` of one epoch, and logs the ids it consumed (its
audit, as the train loop's ``audit_dir``). The global batch is counted from those ids: what the
ranks really consumed, not micro_batch x grad_accum. Decisions (cache
releases and micro-batch shrinks that keep micro_batch x grad_accum) are published at fixed
steps; each rank "fetches" each one after its own random delay (some ranks never hear of it,
at least one does) and sleeps randomly so the ranks reach every boundary at different times.
The test reads the ranks' own logs: every decision applied once, at one step on all ranks; the
micro-batch settings equal on all ranks at every step; the samples consumed per step, all
ranks together, never changed, and the epoch was consumed exactly once.
"""

from __future__ import annotations

import json
import os
import random
import time

import pytest
from gloo_world import spawn

WORLD = 3
STEPS = 90
K = 5
MICRO0, ACCUM0 = 8, 1          # global batch = 8 x 1 x 3 ranks = 24 samples
NUM_SAMPLES = STEPS * MICRO0 * ACCUM0 * WORLD   # one epoch: 90 steps of 24 = 2160 ids
# (id, publish step, coordinator step or None, action, params)
SCRIPT = [
    (1, 3, None, "release_cache", {}),
    (2, 12, None, "shrink_micro_batch", {"micro_batch": 4, "grad_accum": 2}),
    (3, 20, 41, "release_cache", {}),      # coordinator asks for step 41: still ahead
    (4, 33, None, "shrink_micro_batch", {"micro_batch": 2, "grad_accum": 4}),
    (5, 50, 52, "checkpoint", {}),         # step 52 likely passed before agreement
    (6, 51, None, "release_cache", {}),
]


def _fetch_steps(seed: int) -> dict[int, list[int | None]]:
    """Per decision, per rank: the step it reaches that rank (None: never); one rank at least."""
    rng = random.Random(seed)
    out = {}
    for did, publish, *_ in SCRIPT:
        delays: list[int | None] = [rng.choice([None, rng.randint(0, 18)]) for _ in range(WORLD)]
        if all(d is None for d in delays):
            delays[rng.randrange(WORLD)] = rng.randint(0, 18)
        out[did] = [None if d is None else publish + d for d in delays]
    return out


def _rank_main(rank: int, seed: int, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    from raytrain_guard.coordination.lockstep import Lockstep, ProcessGroupExchange
    from raytrain_guard.core.decisions import Action, Decision

    fetch = _fetch_steps(seed)
    rng = random.Random(seed * 1000 + rank)
    decisions = {did: Decision(Action(action), f"scripted {did}", cstep, scope="cluster",
                               params=params, decision_id=did)
                 for did, _, cstep, action, params in SCRIPT}
    lockstep = Lockstep(every_steps=K, exchange=ProcessGroupExchange(), world_rank=rank)
    from torch.utils.data import DataLoader, DistributedSampler
    ids = torch.arange(NUM_SAMPLES)
    batches = iter(DataLoader(ids, batch_size=None, sampler=DistributedSampler(
        ids, num_replicas=WORLD, rank=rank, shuffle=True, seed=seed)))
    micro, accum = MICRO0, ACCUM0
    steps_log = []
    for step in range(STEPS):
        time.sleep(rng.uniform(0.0, 0.004))            # ranks reach the boundary at different times
        lockstep.offer([decisions[did] for did, per_rank in fetch.items()
                        if per_rank[rank] == step])
        for d in lockstep.poll(step):
            if d.action is Action.SHRINK_MICRO_BATCH:
                micro, accum = int(d.params["micro_batch"]), int(d.params["grad_accum"])
        consumed = []
        for _ in range(accum):                         # micro-batches drawn from the loader
            consumed += [int(next(batches)) for _ in range(micro)]
        samples = torch.tensor([len(consumed)], dtype=torch.int64)
        dist.all_reduce(samples)                       # the global batch this step really used
        steps_log.append([step, micro, accum, int(samples.item()), consumed])
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump({"applied": lockstep.applied, "steps": steps_log}, fh)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("seed", [1, 7])
def test_every_decision_applies_at_one_step_on_all_ranks(tmp_path, seed):
    spawn(_rank_main, WORLD, seed, str(tmp_path))
    logs = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    fetch = _fetch_steps(seed)

    applied = [dict((did, step) for step, did in log["applied"]) for log in logs]
    for r, log in enumerate(logs):       # each decision applied once per rank
        assert len(log["applied"]) == len(applied[r]), f"rank {r} applied a decision twice"
    for did, _, cstep, *_ in SCRIPT:
        steps = {applied[r].get(did) for r in range(WORLD)}
        assert len(steps) == 1 and None not in steps, f"decision {did} applied at {steps}"
        (at,) = steps
        first_known = min(s for s in fetch[did] if s is not None)
        assert at >= first_known                        # never before any rank knew of it
        agreed = -(-first_known // K) * K               # first agreement boundary after that
        assert at == (cstep if cstep is not None and cstep > agreed else agreed)

    consumed_all = []
    for step in range(STEPS):
        rows = [tuple(log["steps"][step][1:4]) for log in logs]
        assert len(set(rows)) == 1, f"ranks disagree at step {step}: {rows}"
        # the global batch from the ids each rank logged it consumed in this step
        per_rank = [log["steps"][step][4] for log in logs]
        assert sum(len(ids) for ids in per_rank) == rows[0][2] == MICRO0 * ACCUM0 * WORLD, step
        consumed_all += [i for ids in per_rank for i in ids]
    # every sample of the epoch consumed exactly once, by one rank
    assert sorted(consumed_all) == list(range(NUM_SAMPLES))
    # the shrinks really happened (the run ends with micro 2 x accum 4)
    assert logs[0]["steps"][-1][1:3] == [2, 4]


def _nccl_main(rank: int, out_dir: str) -> None:
    """Two ranks on nccl (one GPU each): the lockstep exchange and the attempt agreement run on
    the control plane's gloo side group, between real nccl collectives on the default group."""
    import torch
    import torch.distributed as dist

    from raytrain_guard.coordination.client import agree_on_start
    from raytrain_guard.coordination.control_plane import shared_control_plane
    from raytrain_guard.coordination.lockstep import ProcessGroupExchange

    before = torch.full((1,), float(rank + 1), device="cuda")
    dist.all_reduce(before)                          # nccl: 1 + 2
    ex = ProcessGroupExchange()
    nothing = ex.exchange(-1, [])
    mine = [{"action": "release_cache", "reason": "r", "decision_id": 5}] if rank == 1 else []
    one = ex.exchange(5 if rank == 1 else -1, mine)  # only rank 1 heard of decision 5
    attempt, _ = agree_on_start(1234 if rank == 0 else 0, True)   # rank 0 brings the number
    after = torch.full((1,), 10.0 * (rank + 1), device="cuda")
    dist.all_reduce(after)                           # nccl again: 10 + 20
    torch.cuda.synchronize()
    got = {"nothing": nothing, "one": one, "attempt": attempt,
           "side_group": shared_control_plane().group is not None,
           "nccl": [before.item(), after.item()]}
    with open(os.path.join(out_dir, f"nccl{rank}.json"), "w") as fh:
        json.dump(got, fh)


@pytest.mark.gpu
@pytest.mark.timeout(180)
def test_exchange_on_nccl_runs_beside_it(tmp_path):
    import torch
    import torch.distributed as dist
    if torch.cuda.device_count() < 2 or not dist.is_nccl_available():
        pytest.skip("needs 2 CUDA devices and nccl")
    spawn(_nccl_main, 2, str(tmp_path), backend="nccl")
    for rank in (0, 1):
        got = json.loads((tmp_path / f"nccl{rank}.json").read_text())
        # both ranks see rank 1's pending decision, in rank order; the attempt is rank 0's
        assert got["nothing"] == [] and got["one"] == [[], [
            {"action": "release_cache", "reason": "r", "decision_id": 5}]], got
        assert got["attempt"] == 1234
        # the control plane made its own gloo group beside nccl, and nccl kept working
        assert got["side_group"] is True and got["nccl"] == [3.0, 30.0]


# -- the control plane: one round per K steps carries the stop flag and the newest id -----------

LOOP_STEPS, LOOP_K = 12, 4


def _loop_main(rank: int, out_dir: str) -> None:
    """A real GuardedTrainLoop (toy model, 2 gloo ranks, no Ray) with a lockstep decision
    source: rank 1 alone hears of a cache release at boundary 1 and a PACE for another node
    at boundary 2 (both agreed at boundary 4 on both ranks); rank 0 hears of a PACE for this
    node at boundary 6 (agreed at 8)."""
    import functools
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import examples.toy as toy
    from raytrain_guard.coordination.client import LockstepDecisionSource
    from raytrain_guard.coordination.context import WorkerContext
    from raytrain_guard.coordination.lockstep import Lockstep, ProcessGroupExchange
    from raytrain_guard.core.decisions import Action, Decision
    from raytrain_guard.runtime.loop.train_loop import (
        DirectoryReporter,
        GuardedTrainLoop,
        LoopConfig,
    )

    class OneRankHears(LockstepDecisionSource):
        def poll(self, step, stats=None):
            if rank == 1 and step == 1:
                self.lockstep.offer([Decision(Action.RELEASE_CACHE, "hot", None,
                                              scope="cluster", decision_id=3)])
            if rank == 1 and step == 2:
                self.lockstep.offer([Decision(Action.PACE, "elsewhere", None,
                                              scope="node:elsewhere", params={"delay_s": 5.0},
                                              decision_id=4)])
            if rank == 0 and step == 6:
                self.lockstep.offer([Decision(Action.PACE, "this node", None,
                                              scope="node:here", params={"delay_s": 0.001},
                                              decision_id=5)])
            return super().poll(step, stats)

    source = OneRankHears(Lockstep(every_steps=LOOP_K, exchange=ProcessGroupExchange(),
                                   world_rank=rank))
    config = LoopConfig.from_dict({
        "model_factory": toy.make_model, "optimizer_factory": toy.make_optimizer,
        "dataset_factory": functools.partial(toy.make_dataset, 8 * LOOP_STEPS),
        "loss_fn": toy.loss_fn, "micro_batch": 4, "epochs": 1, "num_workers": 0,
        "measure_bandwidth": False, "stop_check_every_steps": LOOP_K,
        "guard": {"lockstep_every_steps": LOOP_K}, "decision_source": source})
    loop = GuardedTrainLoop(config, reporter=DirectoryReporter(os.path.join(out_dir, "ckpt")),
                            context=WorkerContext(world_rank=rank, world_size=2,
                                                  node_id="here"))
    results = loop.run()
    # the source's decisions only: the gate's own (scope "rank", e.g. a slow-step detection
    # when the 2-core box stalls a rank) may come at any step and are not what this test pins
    mine = [d for d in results["decisions"] if d["world_rank"] == rank and d["scope"] != "rank"]
    with open(os.path.join(out_dir, f"loop{rank}.json"), "w") as fh:
        json.dump({"rounds": results["control_rounds"], "steps": results["step"],
                   "side_group": loop.control.group is not None,
                   "pace": loop.guard.pace_delay_s,
                   "final_results": "results" in loop.reporter.reports[-1],
                   "decisions": [(d["decision_id"], d["applied_at"], d["applied"])
                                 for d in mine]}, fh)


@pytest.mark.timeout(180)
def test_loop_runs_one_control_round_per_k_steps(tmp_path):
    spawn(_loop_main, 2, str(tmp_path))
    for rank in (0, 1):
        got = json.loads((tmp_path / f"loop{rank}.json").read_text())
        # 12 steps, boundaries 4, 8, 12: three rounds, each carrying both the lockstep's newest
        # id and the stop flag (a separate stop allreduce would make it six)
        assert got["steps"] == LOOP_STEPS and got["rounds"] == LOOP_STEPS // LOOP_K, got
        assert got["side_group"] is False        # the default group is gloo: reused
        # agreed at boundary 4 on both ranks; the PACE for node "elsewhere" is seen, not applied;
        # the PACE for this node ("here", the worker context's) paces both ranks from step 8
        assert got["decisions"] == [[3, 4, True], [4, 4, False], [5, 8, True]], got
        assert got["pace"] == 0.001
        # the final report carries the run's results on rank 0 only (Ray keeps rank 0's metrics
        # and logs every rank's report)
        assert got["final_results"] is (rank == 0)
    # the final checkpoint (its meta, written by rank 0) keeps each rank's pacing sleep, which a resumed
    # run restores (the gate's own "pacing" flag alone did not)
    import torch

    from raytrain_guard.runtime.dist.checkpoint import META_FILE
    saved = torch.load(tmp_path / "ckpt" / f"checkpoint_{LOOP_STEPS}" / META_FILE,
                       weights_only=True)
    assert [g["pace_delay_s"] for g in saved["guard"]] == [0.001, 0.001]


def _side_group_main(rank: int, out_dir: str) -> None:
    from raytrain_guard.coordination.control_plane import shared_control_plane

    plane = shared_control_plane()
    buffer = plane._buffer
    plane.local_stop = rank == 1
    first = plane.agree(10 + rank)            # MAX(10, 11) = 11; rank 1 asked to stop
    stop_first = plane.agreed_stop
    plane.local_stop = False
    second = plane.agree(-1)
    with open(os.path.join(out_dir, f"side{rank}.json"), "w") as fh:
        json.dump({"side_group": plane.group is not None, "same": shared_control_plane() is plane,
                   "buffer_kept": plane._buffer is buffer, "device": str(buffer.device),
                   "got": [first, stop_first, second, plane.agreed_stop, plane.num_rounds]}, fh)


@pytest.mark.timeout(120)
def test_control_plane_reduces_on_a_gloo_side_group_in_a_cpu_tensor(tmp_path):
    # "cpu:gloo" is not the plain "gloo" backend: the plane makes its own gloo group, as it
    # does beside nccl
    spawn(_side_group_main, 2, str(tmp_path), backend="cpu:gloo")
    for rank in (0, 1):
        got = json.loads((tmp_path / f"side{rank}.json").read_text())
        assert got == {"side_group": True, "same": True, "buffer_kept": True, "device": "cpu",
                       "got": [11, True, -1, False, 2]}, (rank, got)


# -- a fast leak: the stop is agreed every step while a rank's memory may reach the critical line

LEAK_STEPS, LEAK_K = 60, 10


def leak_frac(steps_done: int) -> float:
    """Rank 1's card after ``steps_done`` steps: 2 % more a step, over the watermark (0.88) at
    step 31, just after a regular round, and full (1.0) at step 37, before the next (40)."""
    return 0.265 + 0.02 * steps_done


def _leak_main(rank: int, out_dir: str) -> None:
    import logging

    from raytrain_guard.config import GuardConfig
    from raytrain_guard.coordination.control_plane import ControlPlane
    from raytrain_guard.runtime.guard.boundary import BoundaryActions, StepBoundary
    from raytrain_guard.runtime.guard.fail_open import FailOpen
    from raytrain_guard.runtime.guard.probes import MemoryReading
    from raytrain_guard.runtime.guard.step_guard import StepGuard

    class Card:
        """One reading a step: flat at half the card, or rank 1's leak."""

        def __init__(self, leak: bool) -> None:
            self.leak, self.done = leak, 0

        def read(self) -> MemoryReading:
            self.done += 1
            frac = leak_frac(self.done) if self.leak else 0.5
            return MemoryReading(int(frac * 1e9), int(frac * 1e9), 10**9)

    config = GuardConfig(lockstep_every_steps=LEAK_K)
    got = {}
    for name, leak in (("flat", False), ("leak", rank == 1)):
        control = ControlPlane(2)
        guard = StepGuard(config, probe=Card(leak), world_rank=rank)
        boundary = StepBoundary(config, world_rank=rank, node_id="n", step_guard=guard,
                                control=control, source=None, metrics=None,
                                actions=BoundaryActions(rank),
                                fail_open=FailOpen(logging.getLogger("test"), lambda: "t"))
        for step in range(LEAK_STEPS):
            guard.begin_step(step)
            boundary.end_step()
            if boundary.stop_reason is not None:
                break
        got[name] = {"stopped_at": boundary.stopped_at, "rounds": control.num_rounds,
                     "reason": boundary.stop_reason}
    with open(os.path.join(out_dir, f"leak{rank}.json"), "w") as fh:
        json.dump(got, fh)


@pytest.mark.timeout(120)
def test_a_fast_leak_is_stopped_before_the_card_fills_not_at_the_next_round(tmp_path):
    spawn(_leak_main, 2, str(tmp_path))
    runs = [json.loads((tmp_path / f"leak{rank}.json").read_text()) for rank in (0, 1)]
    for got in runs:
        # flat memory: one round per K steps, no stop
        assert got["flat"] == {"stopped_at": None, "rounds": LEAK_STEPS // LEAK_K,
                               "reason": None}, got
        # the round at 30 saw rank 1 reach the critical line (0.90) within K steps on its
        # trend (1.065 at 40), so the stop is agreed every step after it: rank 1's gate
        # decides at step 31 (0.885, over the watermark and rising) and both ranks stop there,
        # with rank 1's card at 88.5 %; at the next regular round (40) it would be full since
        # step 37
        leak = got["leak"]
        assert leak["stopped_at"] == 31 and leak_frac(leak["stopped_at"]) < 1.0, got
        assert leak["rounds"] == 3 + 1, got        # 10, 20, 30, then 31
    assert "rank 1 step" in runs[1]["leak"]["reason"]
    assert runs[0]["leak"]["reason"] == "another rank asked to checkpoint and stop"
