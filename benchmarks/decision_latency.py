"""Decision latency: from a node signal to the step at which every rank applies the decision.

A real guarded run (``launch``: 2 gloo ranks on a local Ray cluster, the toy MLP, every forward
slowed by ``--step-delay-s`` so a step looks like a small real one). The node monitor's GPU
probe is scripted: it reads 50 % until rank 0 creates a marker file at step ``--trigger-step``,
then 89 % (above the 0.88 watermark). The coordinator decides a cache release; the ranks fetch
it on their next report, agree in the lockstep collective and apply it.

Measured, per run, from the processes' own monotonic clocks (one machine, one clock):

* the event: rank 0 creates the marker (step ``trigger_step``);
* the signal: the monitor's first sample that reads 89 %;
* the apply: the step boundary at which the release is applied, the same step on every rank
  (checked), and the moment the last rank passed it.

Latency in steps (apply step - the step rank 0 was at when the signal was sampled) and in
milliseconds (apply moment - signal moment), for the default K = N = 10 and for K = N = 5
(``lockstep_every_steps`` / ``report_every_steps``), one after the other on one Ray instance.

    python benchmarks/decision_latency.py
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import ray  # noqa: E402

import examples.toy as toy  # noqa: E402
from raytrain_guard.cluster.launcher import launch  # noqa: E402
from raytrain_guard.config import GuardConfig  # noqa: E402
from raytrain_guard.coordination.client import ClusterDecisionSource  # noqa: E402
from raytrain_guard.core.node_samples import GpuSample  # noqa: E402
from raytrain_guard.units import GiB  # noqa: E402


class MarkerGpuProbe:
    """One 80 GiB GPU at ``low`` until ``marker`` exists, then at ``high``; logs the first
    high sample's time (monotonic) to ``log``."""

    def __init__(self, marker: str, log: str, low: float = 0.5, high: float = 0.89) -> None:
        self.marker, self.log, self.low, self.high = marker, log, low, high
        self._logged = False

    def sample(self):
        total = 80 * GiB
        hot = os.path.exists(self.marker)
        if hot and not self._logged:
            with open(self.log, "w") as fh:
                json.dump({"signal_t": time.monotonic()}, fh)
            self._logged = True
        return (GpuSample(0, int((self.high if hot else self.low) * total), total),)


class MarkerProbes:
    def __init__(self, marker: str, log: str) -> None:
        self.marker, self.log = marker, log

    def __call__(self, node_id: str):
        return MarkerGpuProbe(self.marker, self.log), None


class TimedSource(ClusterDecisionSource):
    """The launcher's decision source, plus a per-rank log of step times and applied decisions;
    rank 0 creates the marker at ``trigger_step``."""

    def __init__(self, run_id, namespace, guard, *, out_dir: str, trigger_step: int) -> None:
        super().__init__(run_id, namespace, guard)
        self.out_dir, self.trigger_step = out_dir, trigger_step
        self._steps: list = []
        self._applied: list = []

    def poll(self, step, stats=None):
        decisions = super().poll(step, stats)
        now = time.monotonic()
        rank = ray.train.get_context().get_world_rank()
        self._steps.append((step, now))
        for d in decisions:
            if d.decision_id:
                self._applied.append({"id": d.decision_id, "action": d.action.value,
                                      "step": step, "t": now})
        if rank == 0 and step == self.trigger_step:
            open(os.path.join(self.out_dir, "marker"), "w").close()
            with open(os.path.join(self.out_dir, "event.json"), "w") as fh:
                json.dump({"event_t": now, "event_step": step}, fh)
        if step % 10 == 0 or decisions:
            with open(os.path.join(self.out_dir, f"rank{rank}.json"), "w") as fh:
                json.dump({"steps": self._steps, "applied": self._applied}, fh)
        return decisions


def one_run(every: int, args) -> dict:
    out = tempfile.mkdtemp(prefix=f"rtg-latency-k{every}-")
    marker, signal_log = os.path.join(out, "marker"), os.path.join(out, "signal.json")
    guard = GuardConfig(lockstep_every_steps=every, report_every_steps=every)
    config = {"model_factory": toy.make_model,
              "dataset_factory": functools.partial(toy.make_dataset, 256),
              "optimizer_factory": toy.make_optimizer, "loss_fn": toy.loss_fn,
              "micro_batch": 8, "epochs": args.epochs, "num_workers": 0,
              "measure_bandwidth": False, "checkpoint_every_steps": 10_000,
              "rehearsal": "raytrain_guard.experiment.rehearsal:build_rehearsal",
              "faults": {"delay": [{"seconds": args.step_delay_s, "phase": "forward"}]}}
    summary = launch(config, num_workers=2, config=guard, namespace="rtg_latency",
                     storage_path=os.path.join(out, "storage"),
                     probe_factory=MarkerProbes(marker, signal_log),
                     decision_source=lambda run_id, ns, g: TimedSource(
                         run_id, ns, g, out_dir=out, trigger_step=args.trigger_step))
    ranks = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(2)]
    event = json.load(open(os.path.join(out, "event.json")))
    signal_t = json.load(open(signal_log))["signal_t"]
    releases = [[a for a in r["applied"] if a["action"] == "release_cache"] for r in ranks]
    first = [r[0] for r in releases]
    assert len({a["id"] for a in first}) == 1, f"ranks applied different decisions: {first}"
    assert len({a["step"] for a in first}) == 1, f"release applied at different steps: {first}"
    apply_step = first[0]["step"]
    apply_t = max(a["t"] for a in first)
    signal_step = max(s for s, t in ranks[0]["steps"] if t <= signal_t)
    return {"K=N": every, "event_step": event["event_step"], "signal_step": signal_step,
            "apply_step": apply_step, "latency_steps": apply_step - signal_step,
            "latency_ms": round((apply_t - signal_t) * 1000, 1),
            "event_to_apply_ms": round((apply_t - event["event_t"]) * 1000, 1),
            "event_to_signal_ms": round((signal_t - event["event_t"]) * 1000, 1),
            "step_p50_s": summary.step_p50_s, "steps": summary.steps}


def main() -> int:
    parser = argparse.ArgumentParser(description="decision latency, node signal to lockstep apply")
    parser.add_argument("--epochs", type=int, default=14)
    parser.add_argument("--trigger-step", type=int, default=60)
    parser.add_argument("--step-delay-s", type=float, default=0.02)
    args = parser.parse_args()
    from ray import cloudpickle
    cloudpickle.register_pickle_by_value(toy)
    ray.init(address="local", namespace="rtg_latency", num_cpus=4, include_dashboard=False,
             log_to_driver=False, logging_level="error")
    rows = []
    try:
        for every in (10, 5):
            rows.append(one_run(every, args))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        ray.shutdown()
    print("\n| K = N | signal at step | applied at step | latency (steps) | signal -> apply (ms) "
          "| event -> signal (ms) | step p50 (s) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['K=N']} | {r['signal_step']} | {r['apply_step']} | {r['latency_steps']} | "
              f"{r['latency_ms']} | {r['event_to_signal_ms']} | {r['step_p50_s']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
