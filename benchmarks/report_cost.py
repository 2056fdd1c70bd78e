"""What a rank's reports to the coordinator cost its training thread.

    python benchmarks/report_cost.py [--steps 5000] [--every 10] [--step-ms 1]

Every ``report_every_steps`` steps the :class:`~raytrain_guard.coordination.client.
CoordinatorClient` hands the kept steps to its link's daemon thread, which sends them
(``report_steps``), asks for new decisions (``decisions_since``) and leaves them in an inbox that
the training thread empties at agreement steps. This script times, on the training thread,
``client.record(stats)`` on every step and ``client.poll_decisions()`` on the steps that send,
against a live coordinator actor (a local Ray cluster); it prints the cost of a step that
sends, per step amortized, and the bytes one report carries (its pickled rows).
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ray

from raytrain_guard.cluster.actors import start_coordinator, stop_all
from raytrain_guard.config import GuardConfig
from raytrain_guard.coordination.client import CoordinatorClient, coordinator_name, step_row
from raytrain_guard.core.steps import StepStats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--every", type=int, default=GuardConfig().report_every_steps)
    parser.add_argument("--step-ms", type=float, default=1.0,
                        help="time between steps (a sleep: the link's thread runs meanwhile)")
    args = parser.parse_args()
    ray.init(address="local", namespace="rtg-bench", include_dashboard=False,
             logging_level="error", log_to_driver=False)
    run_id = f"bench-{uuid.uuid4().hex[:6]}"
    try:
        coordinator = start_coordinator("rtg-bench", run_id)     # kept: it lives while held
        ray.get(coordinator.status.remote())                      # up and named
        client = CoordinatorClient(coordinator_name(run_id), namespace="rtg-bench",
                                   world_rank=0, node_id="n0", report_every_steps=args.every)
        deadline = time.monotonic() + 30
        while not client.connected and time.monotonic() < deadline:
            time.sleep(0.05)
        step_s, send_s = [], []
        for step in range(args.steps):
            stats = StepStats(step=step, total_s=0.1, forward_s=0.03, backward_s=0.06,
                              comm_wait_s=0.005, optimizer_s=0.005, memory_frac=0.5)
            sending = (step + 1) % args.every == 0
            t0 = time.perf_counter()
            client.record(stats)
            if sending:
                client.poll_decisions()          # an agreement step's take of the replies
            elapsed = time.perf_counter() - t0
            (send_s if sending else step_s).append(elapsed)
            time.sleep(args.step_ms / 1e3)       # the link's thread runs meanwhile
        rows = [step_row(StepStats(step=i, total_s=0.1)) for i in range(args.every)]
        client.flush()
        per_step = (sum(step_s) + sum(send_s)) / args.steps
        print(f"{args.steps} steps {args.step_ms:g} ms apart, a report every {args.every} steps "
              f"({client.num_reports_sent} sent, {client.num_reports_dropped} dropped)")
        print(f"  step without a report: median {statistics.median(step_s) * 1e6:.1f} us")
        print(f"  step with a report and a decisions fetch: median "
              f"{statistics.median(send_s) * 1e6:.0f} us, p99 "
              f"{sorted(send_s)[int(0.99 * len(send_s))] * 1e6:.0f} us")
        print(f"  per step, amortized: {per_step * 1e6:.1f} us")
        print(f"  one report's rows, pickled: {len(pickle.dumps(rows))} bytes")
    finally:
        stop_all("rtg-bench", run_id)
        ray.shutdown()


if __name__ == "__main__":
    main()
