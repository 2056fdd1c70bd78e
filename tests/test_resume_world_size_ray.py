"""A run resumed on another number of workers keeps its global batch and its samples (real
TorchTrainer runs, gloo, CPU): Ray Train restores a run by its name and storage path, with
whatever ScalingConfig the second trainer has.

48 samples, global batch 24 (micro-batch 4 x accumulation 3 x 2 workers): 2 steps an epoch.
The 2-worker run stops after step 1 (mid-epoch); one copy of it resumes on 1 worker (4 x 6),
another on 3 workers (4 x 2); both finish 2 epochs in 4 steps, with every sample of each epoch
consumed exactly once by the lineage. Under ZeRO-1, whose optimizer state each rank saves for
the parameters it owns and a resume reads back under the new partition (on 1 worker into a
plain optimizer); DDP resumes on another size in tests/test_elastic_ray.py, and every
strategy's state is held exact on gloo ranks in tests/test_checkpoint_sharded_gloo.py. (A
world size that cannot keep the global batch is refused: tests/test_loop_essentials.py.)
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from examples import toy  # noqa: E402
from raytrain_guard.runtime.loop.train_loop import train_loop_per_worker  # noqa: E402

pytestmark = pytest.mark.ray
BASE = dict(model_factory=toy.make_model, dataset_factory=functools.partial(toy.make_dataset, 48),
            optimizer_factory=toy.make_optimizer, loss_fn=toy.loss_fn, micro_batch=4,
            grad_accum=3, epochs=2, checkpoint_every_steps=100, num_workers=0, seed=5,
            measure_bandwidth=False, strategy="zero1")


def _fit(storage: Path, workers: int, config: dict, *, max_failures: int = 0):
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    return TorchTrainer(train_loop_per_worker, train_loop_config=config,
                        scaling_config=ScalingConfig(num_workers=workers),
                        run_config=RunConfig(name="elastic", storage_path=str(storage),
                                             failure_config=FailureConfig(max_failures))).fit()


def _ids_by_epoch(audit: Path) -> dict[int, list[int]]:
    """The finished lineage's ids per epoch: a step run again after a restart counts once."""
    by_step: dict[tuple[int, int], list[int]] = {}
    for path in sorted(audit.glob("rank*.jsonl")):
        rank = int(path.stem[4:])
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            by_step.setdefault((entry["step"], rank, entry["attempt"]), []).extend(entry["ids"])
    out: dict[int, list[int]] = {}
    for (step, _, _), ids in by_step.items():
        out.setdefault(step // 2, []).extend(ids)
    return out


@pytest.fixture(scope="module")
def first_run(ray_instance, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("first")
    result = _fit(tmp / "storage", 2, {**BASE, "max_steps": 1, "audit_dir": str(tmp / "audit")})
    results = json.loads(result.metrics["results"])
    assert results["step"] == 1 and results["model"]["strategy"] == "zero1", results["model"]
    return tmp


@pytest.mark.parametrize("workers, layout", [(1, (4, 6)), (3, (4, 2))])
def test_a_resume_on_another_world_size_keeps_the_global_batch(first_run, tmp_path, workers,
                                                                layout):
    shutil.copytree(first_run, tmp_path, dirs_exist_ok=True)
    result = _fit(tmp_path / "storage", workers, {**BASE, "audit_dir": str(tmp_path / "audit")})
    results = json.loads(result.metrics["results"])
    assert results["resumed_from"] == 1 and results["world_size"] == workers
    assert results["step"] == results["total_steps"] == 4
    assert (results["micro_batch"], results["grad_accum"]) == layout
    change = [c for c in results["batch_changes"] if c.get("kind") == "world_size"][0]
    assert change["from_world_size"] == 2 and change["global_batch"] == 24
    for epoch, ids in _ids_by_epoch(tmp_path / "audit").items():
        assert sorted(ids) == list(range(48)), f"epoch {epoch}"

