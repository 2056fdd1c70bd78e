"""The Lightning integration: a real ``lightning.pytorch.Trainer`` with Ray's
``RayDDPStrategy`` or ``RayFSDPStrategy`` (FSDP1 on CPU: tests/fsdp1_cpu.py),
``RayLightningEnvironment``, ``prepare_trainer`` and ``RayTrainReportCallback`` and the guard's
``GuardCallback``, in ``raytrain_guard.train.TorchTrainer`` on 2 gloo workers.

One stopped run and its resume:

* rank 1 is 3x slower in forward (a forward hook of this test): named the compute straggler;
* a ``checkpoint`` decision at step 5 (injected where the guard answers ``should_checkpoint``)
  saves and reports a checkpoint of step 5 through Ray's callback, and training goes on;
* the driver asks for a stop (``TorchTrainer.request_stop``) while rank 0 waits at step 45,
  inside the second epoch (its callback holds the step until the driver has asked, so that
  the stop lands inside the epoch on any box: unheld, it landed 10-40 steps after the ask);
  both ranks stop at the same agreement step after 45 and before the epoch's end, Ray's
  callback reports the checkpoint of that step, and no epoch-end checkpoint follows it;
* the run resumed with ``ckpt_path`` continues from that step to the end: each rank trains, epoch
  by epoch, exactly the samples in exactly the order of an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("lightning")

import fsdp1_cpu
from fsdp1_cpu import allow_fsdp1_on_cpu

from examples import lightning_trainer
from examples.lightning_trainer import Regressor, build_trainer, fit, make_loader
from raytrain_guard.config import GuardConfig

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]

RAY_NAMESPACE = "rtg_test_lightning"
RAY_NUM_CPUS = 4
SAMPLES, BATCH, WORKERS, EPOCHS = 10240, 128, 2, 2
STEPS_PER_EPOCH = SAMPLES // (BATCH * WORKERS)        # 40
CHECKPOINT_AT = 5                                     # a checkpoint decision, without a stop
STOP_ASKED = 45                     # rank 0 asks; every rank stops at the next agreement step

BLOCKED = r"""
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "lightning":
            raise ImportError(f"No module named {name!r}")
        return None
sys.meta_path.insert(0, Block())
try:
    import raytrain_guard.integrations.lightning
except ImportError as exc:
    print(type(exc).__name__, "|", exc)
"""


def test_missing_lightning_is_one_line_naming_the_extra():
    out = subprocess.run([sys.executable, "-c", BLOCKED], check=False, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("MissingExtra | "), lines
    assert "pip install 'raytrain-guard[lightning]'" in lines[0]


def slowed_train_func(config):
    """examples/lightning_trainer.py's Trainer; this test's hooks record the sample ids each
    rank trains on in each epoch, make rank 1's forward 3x as long, and ask for a stop."""
    import lightning.pytorch as pl
    import ray.train

    from raytrain_guard.train import get_guard

    rank = ray.train.get_context().get_world_rank()
    seen: dict[int, list[int]] = {}
    started: dict[str, float] = {}

    class Record(pl.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            seen.setdefault(trainer.current_epoch, []).extend(batch["id"].tolist())
            if rank == 0 and trainer.global_step == config.get("stop_asked"):
                # hold the step until the driver has asked for the stop (StopFromDriver)
                records = config["record_dir"]
                open(os.path.join(records, "reached"), "w").close()
                deadline = time.monotonic() + 120
                while (not os.path.exists(os.path.join(records, "asked"))
                       and time.monotonic() < deadline):
                    time.sleep(0.05)

    def start(module, args):
        started["t"] = time.perf_counter()

    def slow(module, args, output):
        time.sleep(2 * (time.perf_counter() - started["t"]))

    trainer = build_trainer(config) if config["strategy"] == "ddp" else fsdp_trainer(config)
    trainer.callbacks.append(Record())
    if config.get("checkpoint_at"):
        # a ``checkpoint`` decision applying at that step on every rank, as the boundary's
        # lockstep delivers one (the coordinator issues them under memory pressure only)
        guard = get_guard()
        decided = guard.should_checkpoint
        guard.should_checkpoint = lambda: guard.step == config["checkpoint_at"] or decided()
    model = Regressor(config["hidden"])
    if rank == 1 and config["slow"]:
        model.net.register_forward_pre_hook(start)
        model.net.register_forward_hook(slow)
    try:
        fit(trainer, model, make_loader(config))
    finally:
        path = os.path.join(config["record_dir"], f"{config['attempt']}-{rank}.json")
        with open(path, "w") as f:
            json.dump({"ids": {str(e): ids for e, ids in seen.items()},
                       "global_step": trainer.global_step,
                       "stopped_at": get_guard().stopped_at}, f)


def fsdp_trainer(config):
    """examples/lightning_trainer.py's Trainer with Ray's RayFSDPStrategy instead of DDP."""
    import lightning.pytorch as pl
    from ray.train.lightning import (
        RayFSDPStrategy,
        RayLightningEnvironment,
        RayTrainReportCallback,
        prepare_trainer,
    )

    from raytrain_guard.integrations.lightning import GuardCallback

    allow_fsdp1_on_cpu()
    trainer = pl.Trainer(
        max_epochs=config["max_epochs"], accelerator="cpu", devices="auto",
        strategy=RayFSDPStrategy(state_dict_type="sharded"), plugins=[RayLightningEnvironment()],
        callbacks=[RayTrainReportCallback(), GuardCallback()], enable_progress_bar=False,
        enable_checkpointing=False, logger=False)
    return prepare_trainer(trainer)


class StopFromDriver(threading.Thread):
    """The driver's stop: once rank 0 holds step STOP_ASKED (its ``reached`` file), asks the
    run to stop (``TorchTrainer.request_stop``), then lets rank 0 go on (``asked``)."""

    def __init__(self, trainer, records: str) -> None:
        super().__init__(daemon=True)
        self.trainer, self.records, self.asked, self.error = trainer, records, False, None

    def run(self) -> None:
        try:
            deadline = time.monotonic() + 400
            while not os.path.exists(os.path.join(self.records, "reached")):
                if time.monotonic() > deadline:
                    return
                time.sleep(0.05)
            self.trainer.request_stop("the test asks")
            self.asked = True
        except Exception as exc:  # noqa: BLE001 - surfaced by the test
            self.error = exc
        finally:
            open(os.path.join(self.records, "asked"), "w").close()


def _trainer(config, storage):
    from ray.train import RunConfig, ScalingConfig

    from raytrain_guard.train import TorchTrainer
    return TorchTrainer(slowed_train_func, train_loop_config=config,
                        scaling_config=ScalingConfig(num_workers=WORKERS),
                        run_config=RunConfig(name="lightning_guarded", storage_path=storage),
                        guard={"namespace": RAY_NAMESPACE, "decision_interval_s": 1e9})


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_lightning_is_guarded_stopped_and_resumed(ray_instance, strategy):
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(lightning_trainer)
    cloudpickle.register_pickle_by_value(fsdp1_cpu)
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    storage = tempfile.mkdtemp(prefix="rtg-lightning-test-")
    records = os.path.join(storage, "records")
    os.makedirs(records)
    # compute grows with the batch, the allreduce with the parameters: a 3x forward shows
    config = {"max_epochs": EPOCHS, "batch_size": BATCH, "samples": SAMPLES, "hidden": 1024,
              "record_dir": records, "strategy": strategy}

    start = time.perf_counter()
    trainer = _trainer({**config, "attempt": 1, "slow": True, "checkpoint_at": CHECKPOINT_AT,
                        "stop_asked": STOP_ASKED}, storage)
    stopper = StopFromDriver(trainer, records)
    stopper.start()
    try:
        first = trainer.fit()
    finally:
        stopper.join(timeout=30)
    print(first.guard.format(), f"\nfirst run {time.perf_counter() - start:.1f} s")
    assert stopper.error is None and stopper.asked, stopper.error
    assert first.error is None, first.error

    report = first.guard
    assert "the test asks" in report.run.stop_reason
    ranks = {r["world_rank"]: r for r in report.ranks}
    stopped = {r: s["stopped_at"] for r, s in ranks.items()}
    k = GuardConfig().lockstep_every_steps
    stop = stopped[0]
    # both at one agreement step after the ask, inside the second epoch (40-80)
    assert stopped == {0: stop, 1: stop} and stop % k == 0, stopped
    assert STOP_ASKED < stop < EPOCHS * STEPS_PER_EPOCH, stopped
    run1 = [_read(os.path.join(records, f"1-{r}.json")) for r in range(WORKERS)]
    assert [r["global_step"] for r in run1] == [stop] * WORKERS
    assert first.checkpoint is not None
    assert first.metrics["step"] == stop                # Ray's callback: the stopped step
    # the checkpoint decision's (step 5, training went on), the first epoch's end, the stop's;
    # no epoch-end checkpoint after the stop's (it would mark the second epoch trained)
    steps = [metrics["step"] for _, metrics in first.best_checkpoints]
    assert sorted(steps) == [CHECKPOINT_AT, STEPS_PER_EPOCH, stop], steps

    roles = {a["world_rank"]: a for a in report.attribution}
    assert roles[1]["role"] == "straggler_compute", roles
    assert roles[0]["role"] != "straggler_compute", roles

    second = _trainer({**config, "attempt": 2, "slow": False}, storage).fit()
    print(f"both runs {time.perf_counter() - start:.1f} s")
    assert second.error is None, second.error
    run2 = [_read(os.path.join(records, f"2-{r}.json")) for r in range(WORKERS)]
    assert [r["global_step"] for r in run2] == [EPOCHS * STEPS_PER_EPOCH] * WORKERS, \
        [r["global_step"] for r in run2]
    for rank in range(WORKERS):
        for epoch in range(EPOCHS):
            trained = (run1[rank]["ids"].get(str(epoch), [])
                       + run2[rank]["ids"].get(str(epoch), []))
            assert trained == _uninterrupted_order(rank, epoch), (
                rank, epoch, len(trained), len(set(trained)))


def _uninterrupted_order(rank: int, epoch: int) -> list[int]:
    """The sample ids rank ``rank`` trains in ``epoch`` without a stop: Lightning's
    DistributedSampler (shuffled, seed 0) over the dataset."""
    from torch.utils.data import DistributedSampler

    sampler = DistributedSampler(range(SAMPLES), num_replicas=WORKERS, rank=rank, shuffle=True,
                                 seed=0)
    sampler.set_epoch(epoch)
    return list(sampler)


def _read(path: str) -> dict:
    with open(path) as f:
        return json.load(f)
