"""The Hugging Face integration: a real ``transformers.Trainer`` (a tiny random GPT-2) with
Ray's ``prepare_trainer`` and ``RayTrainReportCallback`` and the guard's ``GuardCallback``, in
``raytrain_guard.train.TorchTrainer`` on 2 gloo workers.

One stopped run and its resume carry the Ray checks:

* rank 1 is 3x slower in forward (a forward hook of this test sleeps twice the forward's time):
  the guard names it the compute straggler;
* the Trainer's ``dataloader_num_workers=1, dataloader_prefetch_factor=4`` fit the host budget
  and are kept;
* a stop requested from the driver ends both ranks at the same step, an agreement step, with a
  Hugging Face checkpoint of that step reported to Ray;
* the run resumed from that checkpoint trains the rest, and the two runs together train every
  sample exactly once; that run's host is given 360 KiB of RAM (the figure the loader rule
  reads), and its ``dataloader_prefetch_factor=4`` is lowered to the budget, the warning naming
  the rule and the figures.

Without Ray: the loader rule's figures, the batch plan for a global batch, and the one-line error
without transformers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("transformers")

from stop_when_training import StopWhenTraining

from examples import hf_trainer
from examples.hf_trainer import build_trainer, train
from raytrain_guard.config import GuardConfig
from raytrain_guard.integrations.trainer_loader import fit_settings

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]

RAY_NAMESPACE = "rtg_test_hf"
RAY_NUM_CPUS = 4
SAMPLES, BATCH, WORKERS = 960, 8, 2
STEPS = SAMPLES // (BATCH * WORKERS)           # 60: one epoch


# -- the loader rule (pure) ------------------------------------------------------------------------

GiB = 2**30


@pytest.mark.parametrize("workers, prefetch, batch, expect, lowered", [
    # 64 GiB host, 8 GPUs: budget 5 % x 64 GiB / 8 = 409.6 MiB (429496729 bytes)
    (4, 4, 10 * 2**20, (4, 4), False),      # 4 x 4 x 10 MiB = 160 MiB fits: kept
    (4, 8, 40 * 2**20, (4, 2), True),       # 4 x 8 x 40 MiB = 1.25 GiB; 409.6 // 160 = 2
    (8, 2, 100 * 2**20, (4, 1), True),      # even 8 x 1 x 100 MiB is over: 4 workers x 1
    (2, None, 10 * 2**20, (2, 2), False),   # prefetch left out: torch's 2, fits
])
def test_given_settings_are_kept_or_lowered_to_the_host_budget(workers, prefetch, batch,
                                                                expect, lowered):
    fit = fit_settings(num_workers=workers, prefetch_factor=prefetch, batch_bytes=batch,
                       host_memory_bytes=64 * GiB, gpus_per_node=8, cpus_per_node=64,
                       pin_memory=False, config=GuardConfig())
    assert fit.budget_bytes == 429496729
    assert (fit.num_workers, fit.prefetch_factor) == expect
    assert bool(fit.lowered) == lowered
    if lowered:
        assert "host_prefetch_frac 5% of host RAM per GPU" in fit.lowered[0]
        assert f"{workers} workers x prefetch_factor" in fit.lowered[0]


def test_default_workers_are_sized_by_the_guard():
    # 64 cores // 8 GPUs = 8 per GPU, - 1 = 7 workers; prefetch min(8, 409.6 MiB // (7 x 10 MiB))
    fit = fit_settings(num_workers=0, prefetch_factor=None, batch_bytes=10 * 2**20,
                       host_memory_bytes=64 * GiB, gpus_per_node=8, cpus_per_node=64,
                       pin_memory=False, config=GuardConfig())
    assert (fit.num_workers, fit.prefetch_factor) == (7, 5)
    assert fit.lowered == ()


# -- the batch plan (the planner on the traced model, no Ray) -------------------------------------

def _one_sample():
    import torch
    ids = torch.zeros(1, hf_trainer.SEQ, dtype=torch.long)
    return {"input_ids": ids, "labels": ids}


@pytest.mark.parametrize("memory_mib, micro, accum, fits", [
    # the traced GPT-2 of examples/hf_trainer.py, fp32 AdamW: static 2.6-3.2 MiB, activations
    # ~0.7 MiB a sample, reserve 1 GiB (CUDA context); budget 85 % of the card (15 % headroom)
    (1250, 32, 1, True),      # 1062.5 MiB budget: the per-rank 32 fits (1.0 GiB + 25 MiB)
    (1230, 16, 2, True),      # 1045.5 MiB: 32 does not, 16 does (activations 11.5 MiB)
    (1220, 8, 4, True),       # 1037 MiB: 8 (activations 6.0 MiB)
    (1210, 1, 32, False),     # 1028.5 MiB: not even 1 (over by 56.4 KiB)
])
def test_batch_plan_splits_the_global_batch_into_what_fits(memory_mib, micro, accum, fits):
    from raytrain_guard.integrations.transformers import plan_batch_size

    planned = plan_batch_size(hf_trainer.make_model, _one_sample, global_batch=64,
                              num_workers=2, use_gpu=True,
                              device_memory_bytes=memory_mib * 2**20)
    assert (planned.per_device_train_batch_size, planned.gradient_accumulation_steps,
            planned.fits) == (micro, accum, fits)
    assert micro * accum * 2 == 64
    assert planned.training_args() == {"per_device_train_batch_size": micro,
                                       "gradient_accumulation_steps": accum}
    assert planned.reason.startswith(f"micro_batch {micro} x grad_accum {accum} x 2 workers "
                                     "= 64 (asked 64); " + ("fits" if fits else "DOES NOT FIT"))


def test_batch_plan_for_a_gpu_needs_its_memory():
    from raytrain_guard.errors import InputError
    from raytrain_guard.integrations.transformers import plan_batch_size

    with pytest.raises(InputError, match="device_memory_bytes"):
        plan_batch_size(hf_trainer.make_model, _one_sample, global_batch=64, num_workers=2,
                        use_gpu=True)
    with pytest.raises(InputError, match="global_batch"):
        plan_batch_size(hf_trainer.make_model, _one_sample, global_batch=0, num_workers=2,
                        use_gpu=True, device_memory_bytes=2**30)


# -- the missing framework -------------------------------------------------------------------------

BLOCKED = r"""
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == %r:
            raise ImportError(f"No module named {name!r}")
        return None
sys.meta_path.insert(0, Block())
try:
    import %s
except ImportError as exc:
    print(type(exc).__name__, "|", exc)
"""


@pytest.mark.parametrize("framework, module", [
    ("transformers", "raytrain_guard.integrations.transformers")])
def test_missing_framework_is_one_line_naming_the_extra(framework, module):
    out = subprocess.run([sys.executable, "-c", BLOCKED % (framework, module)],
                         check=False, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("MissingExtra | ")
    assert f"pip install 'raytrain-guard[{framework}]'" in lines[0]


# -- a real Trainer on Ray -------------------------------------------------------------------------

def slowed_train_func(config):
    """examples/hf_trainer.py's Trainer; this test's hooks record the sample ids each rank
    trains on, and make rank 1's forward 3x as long."""
    import ray.train

    from raytrain_guard.train import get_guard

    if config.get("host_memory_bytes"):        # this worker's host RAM, as the loader rule reads it
        from raytrain_guard.integrations import trainer_loader
        trainer_loader.host_memory = lambda: (config["host_memory_bytes"],) * 2
    trainer = build_trainer(config)
    rank = ray.train.get_context().get_world_rank()
    seen: list[int] = []
    started: dict[str, float] = {}

    def record(module, args, kwargs):
        seen.extend(kwargs["input_ids"][:, 0].tolist())
        started["t"] = time.perf_counter()

    def slow(module, args, kwargs, output):
        time.sleep(2 * (time.perf_counter() - started["t"]))

    trainer.model.register_forward_pre_hook(record, with_kwargs=True)
    if rank == 1 and config["slow"]:
        trainer.model.register_forward_hook(slow, with_kwargs=True)
    try:
        train(trainer)
    finally:
        path = os.path.join(config["record_dir"], f"{config['attempt']}-{rank}.json")
        with open(path, "w") as f:
            json.dump({"ids": seen, "global_step": trainer.state.global_step,
                       "stopped_at": get_guard().stopped_at}, f)


def _fit(config, storage):
    from ray.train import RunConfig, ScalingConfig

    from raytrain_guard.train import TorchTrainer
    trainer = TorchTrainer(slowed_train_func, train_loop_config=config,
                           scaling_config=ScalingConfig(num_workers=WORKERS),
                           run_config=RunConfig(name="hf_guarded", storage_path=storage),
                           guard={"namespace": RAY_NAMESPACE, "decision_interval_s": 1e9})
    return trainer


def test_trainer_is_guarded_stopped_and_resumed_exactly_once(ray_instance):
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(hf_trainer)
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    storage = tempfile.mkdtemp(prefix="rtg-hf-test-")
    records = os.path.join(storage, "records")
    os.makedirs(records)
    config = {"output_dir": os.path.join(storage, "hf"), "batch_size": BATCH,
              "max_steps": STEPS, "samples": SAMPLES, "record_dir": records}

    start = time.perf_counter()
    trainer = _fit({**config, "attempt": 1, "slow": True}, storage)
    stopper = StopWhenTraining(trainer, RAY_NAMESPACE)
    stopper.start()
    try:
        first = trainer.fit()
    finally:
        stopper.done.set()
        stopper.join(timeout=30)
    print(first.guard.format(), f"\nfirst run {time.perf_counter() - start:.1f} s")
    assert stopper.error is None and first.error is None, (stopper.error, first.error)

    # every rank stopped at the same agreement step, the Trainer's global step there
    report = first.guard
    ranks = {r["world_rank"]: r for r in report.ranks}
    stopped = {r: s["stopped_at"] for r, s in ranks.items()}
    k = GuardConfig().lockstep_every_steps
    assert stopped[0] == stopped[1] and stopped[0] % k == 0, stopped
    assert stopper.asked_at < stopped[0] < STEPS, (stopper.asked_at, stopped)
    assert "the test asks" in report.run.stop_reason
    run1 = [_read(os.path.join(records, f"1-{r}.json")) for r in range(WORKERS)]
    assert [r["global_step"] for r in run1] == [stopped[0]] * WORKERS

    # the checkpoint of that step reached Ray
    assert first.checkpoint is not None
    with first.checkpoint.as_directory() as path:
        state = _read(os.path.join(path, "checkpoint", "trainer_state.json"))
    assert state["global_step"] == stopped[0]

    # the slow rank is named, the loader settings were kept
    roles = {a["world_rank"]: a for a in report.attribution}
    assert roles[1]["role"] == "straggler_compute", roles
    assert roles[0]["role"] != "straggler_compute", roles
    for loader in report.loaders:
        assert (loader["num_workers"], loader["prefetch_factor"], loader["lowered"]) == \
            (1, 4, []), loader
        assert loader["batches"] == stopped[0]

    # the same run again on a host of 360 KiB: it resumes from that checkpoint and trains the
    # rest, the Trainer's loader lowered to that host's budget
    second = _fit({**config, "attempt": 2, "slow": False, "host_memory_bytes": 360 * 1024},
                  storage).fit()
    print(second.guard.format(), f"\nboth runs {time.perf_counter() - start:.1f} s")
    assert second.error is None, second.error
    # a batch: input_ids and labels, 8 x 32 int64 = 4 KiB; budget 5 % x 360 KiB / 2 ranks
    # = 9 KiB: 1 worker x 4 x 4 KiB = 16 KiB is over, 9 // 4 = prefetch_factor 2
    for loader in second.guard.loaders:
        assert (loader["num_workers"], loader["prefetch_factor"]) == (1, 2), loader
        assert loader["lowered"] == [LOWERED], loader
    run2 = [_read(os.path.join(records, f"2-{r}.json")) for r in range(WORKERS)]
    assert [r["global_step"] for r in run2] == [STEPS] * WORKERS
    assert all(len(r["ids"]) == stopped[0] * BATCH for r in run1)
    trained = sorted(i for run in (run1, run2) for r in run for i in r["ids"])
    assert trained == list(range(SAMPLES))      # every sample once, none twice


LOWERED = ("prefetch_factor 4 lowered to 2: 1 workers x prefetch_factor 4 x 4.0 KiB per batch "
           "= 16.0 KiB in flight exceed the host prefetch budget of 9.0 KiB (rule: "
           "host_prefetch_frac 5% of host RAM per GPU); 1 x 2 x 4.0 KiB = 8.0 KiB fits")


def _read(path: str) -> dict:
    with open(path) as f:
        return json.load(f)
