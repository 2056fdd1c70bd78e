"""The before/after experiment: the same training with the guard observing and acting.

:func:`run_experiment` runs one training per arm, same seed, data order and fault schedule,
each under ``FailureConfig(max_failures)``: ``observe`` (the shared train loop with every
measurement on and every action off) and ``act`` (the guard as shipped, with
``restart_after_stop``); with ``repeat`` N, N pairs of them interleaved (observe, act, observe,
act, ...), pair ``i`` at seed ``seed + i``. It runs on the Ray of this process when one is
initialized, else on the cluster at ``address`` (or ``RAY_ADDRESS``), else on a local cluster it
starts (:mod:`~raytrain_guard.experiment.ray_cluster`). It then reads what each arm's ranks
wrote (:mod:`~raytrain_guard.experiment.analysis`), summarises the repeats
(:mod:`~raytrain_guard.experiment.stats`) and writes ``report.md`` and the plots
(:mod:`~raytrain_guard.experiment.report`). Every folder the ranks
write to is made absolute in the driver: a Ray worker runs in its own working directory.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from raytrain_guard.config import GuardConfig
from raytrain_guard.errors import InputError, one_line
from raytrain_guard.experiment import analysis, stats
from raytrain_guard.experiment.faults import FaultSpec
from raytrain_guard.experiment.node_memory import oom_kills
from raytrain_guard.experiment.ray_cluster import check_node_memory, experiment_ray
from raytrain_guard.runtime.loop.config import REHEARSAL
from raytrain_guard.units import MiB

logger = logging.getLogger(__name__)

ARMS = ("observe", "act")
BUILT_IN = {"model_factory": "raytrain_guard.experiment.model:make_model",
            "dataset_factory": "raytrain_guard.experiment.model:make_dataset",
            "optimizer_factory": "raytrain_guard.experiment.model:make_optimizer",
            "loss_fn": "raytrain_guard.experiment.model:loss_fn"}
#: the built-in job's simulated card: its normal peak (2.7 MiB at micro-batch 8, 2 ranks) is
#: ~27 % of it, so an 8x activation spike overflows it and a leak of 40 KiB a step reaches the
#: critical line in ~160 steps
BUILT_IN_DEVICE_MEMORY_BYTES = 10 * MiB
#: the built-in job's device time per micro-batch (experiment.device_time): GPU-like steps of
#: ~60 ms with the real ~8 ms of CPU compute, beside which the host's own noise is small
BUILT_IN_DEVICE_STEP_MS = 50.0
#: the observe arm's hang ends at the collective timeout, set short so that it ends at all
DEFAULT_COLLECTIVE_TIMEOUT_S = 120.0
RAY_DEFAULT_COLLECTIVE_TIMEOUT_S = 1800.0


@dataclass(frozen=True)
class ExperimentSetup:
    """One experiment: faults, arms and the training both arms run."""

    faults: Sequence[FaultSpec]
    arms: Sequence[str] = ARMS
    num_workers: int = 2
    epochs: int = 2
    max_steps: int | None = None
    seed: int = 0
    device_memory_bytes: int | None = None
    strategy: str = "ddp"
    micro_batch: int = 8
    grad_accum: int = 1
    factories: Mapping[str, str] = field(default_factory=lambda: dict(BUILT_IN))
    num_samples: int | None = None          # the dataset's size, for the exactly-once audit
    max_failures: int = 2
    collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S
    checkpoint_every_steps: int = 25
    guard: Mapping[str, Any] = field(default_factory=dict)
    device_step_ms: float | None = None     # None: BUILT_IN_DEVICE_STEP_MS for the built-in job
    nodes: int = 1                          # Ray nodes on this machine, the workers spread
    repeat: int = 1                         # pairs of arms, interleaved; pair i at seed + i
    node_memory_bytes: int | None = None    # each local node in a memory cgroup of this size

    @property
    def built_in(self) -> bool:
        return dict(self.factories) == BUILT_IN

    def guard_config(self) -> GuardConfig:
        return GuardConfig.from_dict(dict(self.guard))

    def check(self) -> None:
        """Bad input as one InputError naming the flag and the fix."""
        for arm in self.arms:
            if arm not in ARMS:
                raise InputError("--arms", f"unknown arm {arm!r}", value=",".join(self.arms),
                                 fix="use observe, act or observe,act")
        if not 1 <= self.nodes <= self.num_workers:
            raise InputError("--nodes", f"must be 1..--workers {self.num_workers} (a node "
                             f"holds at least one worker)", value=self.nodes,
                             fix=f"use --nodes 1..{self.num_workers}, or more --workers")
        for f in self.faults:
            if f.node is not None and f.node >= self.nodes:
                raise InputError("--fault", f"node {f.node} of {f} is not below --nodes "
                                 f"{self.nodes}", value=str(f),
                                 fix=f"use node 0..{self.nodes - 1}, or pass --nodes "
                                     f"{f.node + 1}")
            if any(r >= self.num_workers for r in f.ranks):
                raise InputError("--fault", f"rank {max(f.ranks)} of {f} is not below "
                                 f"--workers {self.num_workers}", value=str(f),
                                 fix=f"use ranks 0..{self.num_workers - 1}")
        if not (isinstance(self.repeat, int) and self.repeat >= 1):
            raise InputError("--repeat", "must be an integer >= 1", value=self.repeat,
                             fix="e.g. --repeat 10 (1: one run of each arm)")
        memory_kinds = {"memory_growth", "activation_spike"}
        if self.device_step_ms is not None and not self.device_step_ms >= 0:
            raise InputError("--device-step-ms", "must be a number >= 0",
                             value=self.device_step_ms, fix="e.g. --device-step-ms 50, or 0 "
                             "for the model's real compute only")
        if any(f.kind in memory_kinds for f in self.faults) and not self.card_bytes():
            raise InputError("--device-memory", "memory faults need a card to overflow",
                             value=None, fix="pass --device-memory SIZE (e.g. 10MiB)")

    def of_repeat(self, index: int) -> ExperimentSetup:
        """The setup of pair ``index`` (from 0): the same but its seed, ``seed + index``, which
        both arms of the pair share."""
        return replace(self, seed=self.seed + index)

    def repeat_dir(self, out_dir: str, index: int = 0) -> str:
        """The folder of pair ``index``'s arms: ``<out>`` for one repeat, ``<out>/repeat-<index>``
        for several."""
        return out_dir if self.repeat == 1 else os.path.join(out_dir, f"repeat-{index}")

    def arm_dir(self, out_dir: str, arm: str, index: int = 0) -> str:
        """Where an arm of pair ``index`` writes: ``<out>/<arm>`` for one repeat,
        ``<out>/repeat-<index>/<arm>`` for several."""
        return os.path.join(self.repeat_dir(out_dir, index), arm)

    def device_step_s(self) -> float:
        """Device time per micro-batch (0: the model's real compute only)."""
        if self.device_step_ms is not None:
            return self.device_step_ms / 1000
        return BUILT_IN_DEVICE_STEP_MS / 1000 if self.built_in else 0.0

    def card_bytes(self) -> int | None:
        if self.device_memory_bytes is not None:
            return self.device_memory_bytes
        return BUILT_IN_DEVICE_MEMORY_BYTES if self.built_in else None


def loop_config(setup: ExperimentSetup, arm: str, arm_dir: str,
                node_ids: Sequence[str] = ()) -> dict[str, Any]:
    """The train loop's config of one arm (the same for both but ``act``), its folders absolute.
    ``node_ids``: the experiment's Ray nodes, node 0 first (for the faults scoped to a node)."""
    act = arm == "act"
    arm_dir = os.path.abspath(arm_dir)
    config: dict[str, Any] = {
        **setup.factories, "micro_batch": setup.micro_batch, "grad_accum": setup.grad_accum,
        "epochs": setup.epochs, "seed": setup.seed, "strategy": setup.strategy,
        "checkpoint_every_steps": setup.checkpoint_every_steps, "measure_bandwidth": False,
        "num_workers": 0, "act": act, "restart_after_stop": act, "rehearsal": REHEARSAL,
        "device_memory_bytes": setup.card_bytes(),
        "trace_dir": os.path.join(arm_dir, "trace"), "audit_dir": os.path.join(arm_dir, "audit"),
        "faults": {"inject": [f.to_dict() for f in setup.faults],
                   "marker_dir": os.path.join(arm_dir, "markers"),
                   "device_step_s": setup.device_step_s()},
        "guard": dict(setup.guard)}
    if node_ids:
        config["faults"]["node_ids"] = list(node_ids)
    if setup.max_steps is not None:       # that many steps, over as many epochs as it takes
        config["max_steps"] = setup.max_steps
        config["epochs"] = setup.max_steps
    return config


def run_arm(setup: ExperimentSetup, arm: str, arm_dir: str, *,
            namespace: str = "raytrain_guard", node_ids: Sequence[str] = (),
            node_cgroups: Sequence[str] = ()) -> dict[str, Any]:
    """Run one arm and return its figures (the ARM object of the report); ArmTracesError when
    its ranks left no trace in ``arm_dir``. ``node_ids``: the experiment's Ray nodes, node 0
    first; with several, the workers spread over them. ``node_cgroups``: their memory cgroups
    (``--node-memory``), whose OOM kills during the arm it counts."""
    from raytrain_guard.cluster.launcher import launch

    arm_dir = os.path.abspath(arm_dir)
    os.makedirs(os.path.join(arm_dir, "markers"), exist_ok=True)
    storage = tempfile.mkdtemp(prefix=f"rtg-exp-{arm}-")
    kills_before = [oom_kills(path) for path in node_cgroups]
    started = time.perf_counter()
    error, summary = None, None
    try:
        summary = launch(
            loop_config(setup, arm, arm_dir, node_ids), num_workers=setup.num_workers,
            placement_strategy="SPREAD" if setup.nodes > 1 else "PACK",
            config=setup.guard_config(),
            plan=False, run_id=f"{arm}-{uuid.uuid4().hex[:6]}", namespace=namespace,
            storage_path=storage, max_failures=setup.max_failures,
            collective_timeout_s=setup.collective_timeout_s)
    except Exception as exc:  # noqa: BLE001 - an arm that fails is a result, not an error
        error = one_line(exc)
        logger.info("arm %s failed: %s", arm, error)
    finally:
        shutil.rmtree(storage, ignore_errors=True)
    wall = time.perf_counter() - started
    try:
        result = analysis.analyze_arm(
            arm_dir, setup.faults, num_samples=_num_samples(setup), launch_error=error,
            wall_s=wall, num_workers=setup.num_workers, epoch_order=_epoch_order(setup),
            lateness=detection_lateness(setup), node_ids=node_ids)
    except analysis.ArmTracesError as exc:
        raise analysis.ArmTracesError(f"arm {arm}: {exc}") from None
    if node_cgroups:                   # what the kernel killed on each node, this arm
        by_node = [oom_kills(p) - k for p, k in zip(node_cgroups, kills_before)]
        result["host_oom_kills"], result["host_oom_kills_by_node"] = sum(by_node), by_node
    if summary is not None:            # the rank the coordinator named live, per hung attempt
        result["coordinator_hangs"] = list(summary.coordinator.get("hangs") or [])
    if any(f.kind == "hang" for f in setup.faults) and arm == "observe":
        result["hang_cost_at_default_timeout_s"] = RAY_DEFAULT_COLLECTIVE_TIMEOUT_S
    return result


def run_experiment(setup: ExperimentSetup, out_dir: str, *,
                   progress: Callable[[str], None] | None = None,
                   namespace: str = "raytrain_guard",
                   address: str | None = None) -> dict[str, Any]:
    """Every arm of every repeat, interleaved (observe, act, observe, act, ...), then the
    report, on the Ray :func:`experiment_ray` gives. Returns the ``--json`` object."""
    from raytrain_guard.experiment.report import write_report

    setup.check()
    check_node_memory(setup.node_memory_bytes, address)
    out_dir = os.path.abspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in setup.arms}
    with experiment_ray(setup, namespace, address) as (node_ids, cluster):
        for index in range(setup.repeat):
            label = f"repeat-{index} of {setup.repeat}: " if setup.repeat > 1 else ""
            for arm in setup.arms:
                if progress:
                    progress(f"{label}arm {arm}: training {setup.num_workers} workers with the "
                             "guard " + ("observing only" if arm == "observe" else "acting")
                             + " ...")
                t0 = time.perf_counter()
                a = run_arm(setup.of_repeat(index), arm, setup.arm_dir(out_dir, arm, index),
                            namespace=namespace, node_ids=node_ids,
                            node_cgroups=cluster.get("node_memory", {}).get("cgroups", ()))
                runs[arm].append(a)
                if progress:
                    progress(f"{label}arm {arm}: "
                             f"{'completed' if a['completed'] else 'did not complete'}"
                             f", {a['steps']}/{a['total_steps']} steps, {a['attempts']} "
                             f"attempt(s) in {time.perf_counter() - t0:.0f} s"
                             + (f"; {a['error']}" if a["error"] else ""))
    if setup.repeat == 1:
        arms = {arm: repeats[0] for arm, repeats in runs.items()}
    else:
        arms = stats.summarize_repeats(
            runs, setup.faults, late_steps=detection_lateness(setup).cluster_steps)
    result = {"arms": arms, "faults": [str(f) for f in setup.faults], "node_ids": node_ids,
              "device": _device_line(setup), "step_model": step_model_line(setup),
              "machine": machine_line(), "cluster": cluster}
    if setup.repeat > 1:
        result["repeat"] = {"pairs": setup.repeat,
                            "seeds": [setup.seed + i for i in range(setup.repeat)]}
    report, plots = write_report(result, out_dir, setup)
    result["report"], result["plots"] = report, plots
    with open(os.path.join(out_dir, "result.json"), "w") as fh:   # what --json prints
        json.dump(result, fh, default=str)
    return result


def _num_samples(setup: ExperimentSetup) -> int | None:
    if setup.num_samples is not None:
        return setup.num_samples
    if setup.built_in:
        from raytrain_guard.experiment.model import NUM_SAMPLES
        return NUM_SAMPLES
    return None


def _epoch_order(setup: ExperimentSetup) -> Callable[[int], list[int]] | None:
    """The built-in job's order of an epoch's sample ids (its id is the sample's index), for the
    exact audit; None for your own job, whose ids need not be indices."""
    if not setup.built_in:
        return None
    from raytrain_guard.experiment.model import NUM_SAMPLES
    from raytrain_guard.runtime.data.sampler import ResumableDistributedSampler

    # the loop's loader: shuffle=True, seed=the loop's seed, drop_last=False
    sampler = ResumableDistributedSampler(range(NUM_SAMPLES), num_replicas=1, rank=0,
                                          shuffle=True, seed=setup.seed)
    cache: dict[int, list[int]] = {}

    def order(epoch: int) -> list[int]:
        if epoch not in cache:
            sampler.set_epoch(epoch)
            cache[epoch] = sampler.epoch_permutation()
        return cache[epoch]
    return order


def detection_lateness(setup: ExperimentSetup) -> analysis.Lateness:
    """How late a detection may come after a fault's last step and still name it: a rank's
    gate, ``num_slow_steps``; the coordinator, a report batch and then a lockstep step."""
    guard = setup.guard_config()
    return analysis.Lateness(rank_steps=guard.num_slow_steps,
                             cluster_steps=guard.report_every_steps + guard.lockstep_every_steps)


def _device_line(setup: ExperimentSetup) -> str:
    import torch
    card = setup.card_bytes()
    if card is None:
        return "no device-memory limit (memory faults off)"
    if torch.cuda.is_available():
        return f"CUDA card capped at {card / MiB:.0f} MiB (set_per_process_memory_fraction)"
    return (f"simulated card of {card / MiB:.1f} MiB per rank on CPU (parameters, gradients, "
            "optimizer state, saved activations and fault memory counted; past it "
            "torch.OutOfMemoryError)")


def step_model_line(setup: ExperimentSetup) -> str:
    """Which step model the run used: the device-time model, or the model's real compute."""
    step_s = setup.device_step_s()
    if not step_s:
        return "the model's real compute only (no device-time model)"
    return (f"device-time model: {step_s * 1000:g} ms of device time per micro-batch of "
            f"{setup.micro_batch} (a third in forward, two thirds in backward; the host waits "
            f"it out, as beside a GPU), scaled by the batch's elements, plus the model's real "
            f"CPU compute; slow_compute stretches the device time")


def machine_line() -> str:
    import ray
    import torch
    return (f"{platform.node()}: {os.cpu_count()} CPUs, Python {platform.python_version()}, "
            f"torch {torch.__version__}, ray {ray.__version__}")
