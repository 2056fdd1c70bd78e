"""A driver-side thread that asks a running ``raytrain_guard.train.TorchTrainer`` to stop once
its coordinator has seen 10 steps (the integrations' stop-and-resume tests)."""

from __future__ import annotations

import threading
import time

import ray


class StopWhenTraining(threading.Thread):
    """Asks the run to stop once the coordinator (in ``namespace``) has seen 10 steps."""

    def __init__(self, trainer, namespace: str) -> None:
        super().__init__(daemon=True)
        self.trainer, self.namespace, self.asked_at, self.error = trainer, namespace, None, None
        self.done = threading.Event()

    def run(self) -> None:
        from raytrain_guard.coordination.client import coordinator_name
        try:
            while not self.done.is_set():
                time.sleep(0.5)
                try:
                    handle = ray.get_actor(coordinator_name(self.trainer.run_id),
                                           namespace=self.namespace)
                    step = ray.get(handle.status.remote(), timeout=10).get("latest_step") or 0
                except ValueError:
                    continue
                if step >= 10:
                    self.asked_at = step
                    self.trainer.request_stop("the test asks")
                    return
        except Exception as exc:  # noqa: BLE001 - surfaced by the test
            self.error = exc
