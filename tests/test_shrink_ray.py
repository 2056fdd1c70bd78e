"""SHRINK_MICRO_BATCH on a real 2-rank TorchTrainer run (gloo, CPU) through the template.

Two runs share one Ray instance, with the same seed and data:

* ``reference``: micro_batch 4 x grad_accum 2 for all 8 steps (2 epochs of 64 samples:
  32 per rank, 8 micro-batches, 4 steps per epoch);
* ``shrunk``: the same, and a SHRINK_MICRO_BATCH to 2 x 4 that rank 0 is handed at boundary 1
  and rank 1 at boundary 2 (as a coordinator delivers it: at different times), both with apply
  step 3, in the middle of epoch 0.

Checks: each rank consumed, in every step, exactly the reference's samples; both ranks switched
at step 3 (micro-batches of 2 from there, 4 of them per step); the final weights and loss match
the reference up to float summation order; the results and the checkpoint record the change.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import scripted_source  # noqa: E402

import examples.toy as toy  # noqa: E402
from raytrain_guard.core.decisions import Action, Cause, Decision  # noqa: E402
from raytrain_guard.runtime.loop.train_loop import train_loop_per_worker  # noqa: E402

ray = pytest.importorskip("ray")

NUM_SAMPLES = 64
APPLY_STEP = 3
BASE = dict(model_factory=toy.make_model, dataset_factory=functools.partial(toy.make_dataset,
                                                                            NUM_SAMPLES),
            optimizer_factory=toy.make_optimizer, loss_fn=toy.loss_fn, micro_batch=4,
            grad_accum=2, epochs=2, checkpoint_every_steps=3, num_workers=0, seed=11)


def _fit(tmp: Path, name: str, config: dict):
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    trainer = TorchTrainer(
        train_loop_per_worker, train_loop_config={**config, "audit_dir": str(tmp / name)},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name=name, storage_path=str(tmp / "storage")))
    return trainer.fit()


def _audit(directory: Path, rank: int) -> list[dict]:
    return [json.loads(line) for line in (directory / f"rank{rank}.jsonl").read_text().splitlines()
            if line]


def _by_step(entries: list[dict]) -> dict[int, list[list[int]]]:
    out: dict[int, list[list[int]]] = {}
    for entry in entries:
        out.setdefault(entry["step"], []).append(entry["ids"])
    return out


def _model_state(result) -> dict:
    from sharded_reader import read_sharded
    with result.checkpoint.as_directory() as directory:
        return read_sharded(directory)


@pytest.fixture(scope="module")
def runs(ray_instance, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("shrink_ray")
    reference = _fit(tmp, "reference", BASE)
    decision = Decision(Action.SHRINK_MICRO_BATCH, "rehearsed: rank 1 near critical memory",
                        APPLY_STEP, Cause.DEVICE_MEMORY, "cluster",
                        {"micro_batch": 2, "grad_accum": 4}, decision_id=7).to_dict()
    ray.cloudpickle.register_pickle_by_value(scripted_source)     # the workers unpickle it
    source = scripted_source.ScriptedDecisionSource({0: [(1, decision)], 1: [(2, decision)]})
    shrunk = _fit(tmp, "shrunk", {**BASE, "decision_source": source})
    return tmp, reference, shrunk


@pytest.mark.ray
def test_every_rank_takes_the_reference_samples_in_every_step(runs):
    tmp, _, _ = runs
    for rank in (0, 1):
        ref, got = _by_step(_audit(tmp / "reference", rank)), _by_step(_audit(tmp / "shrunk", rank))
        assert sorted(got) == list(range(8))
        for step in range(8):
            flat = [i for ids in got[step] for i in ids]
            assert flat == [i for ids in ref[step] for i in ids], (rank, step)
        # the switch: 2 micro-batches of 4 before step 3, 4 of 2 from step 3 on
        assert [[len(ids) for ids in got[s]] for s in range(8)] == \
            [[4, 4]] * APPLY_STEP + [[2, 2, 2, 2]] * (8 - APPLY_STEP), rank
    # and together the ranks still cover each epoch exactly once
    for epoch in (0, 1):
        ids = [i for rank in (0, 1) for e in _audit(tmp / "shrunk", rank) if e["epoch"] == epoch
               for i in e["ids"]]
        assert sorted(ids) == list(range(NUM_SAMPLES)), epoch


@pytest.mark.ray
def test_both_ranks_applied_the_shrink_at_one_step(runs):
    _, _, shrunk = runs
    results = json.loads(shrunk.metrics["results"])
    changes = sorted(results["batch_changes"], key=lambda c: c["world_rank"])
    assert [(c["world_rank"], c["step"], c["applied"], c["micro_batch"], c["grad_accum"])
            for c in changes] == [(0, APPLY_STEP, True, 2, 4), (1, APPLY_STEP, True, 2, 4)]
    assert (results["micro_batch"], results["grad_accum"]) == (2, 4)
    applied = {(d["world_rank"], d["applied_at"]) for d in results["decisions"]
               if d["action"] == "shrink_micro_batch"}
    assert applied == {(0, APPLY_STEP), (1, APPLY_STEP)}
    assert results["step"] == results["total_steps"] == 8
    # the checkpoint carries the layout a resumed run continues with
    batch = _model_state(shrunk)["extra"]["batch"]
    assert (batch["micro_batch"], batch["grad_accum"]) == (2, 4)
    assert batch["changes"][0]["step"] == APPLY_STEP


@pytest.mark.ray
def test_final_weights_and_loss_match_the_reference(runs):
    import torch
    _, reference, shrunk = runs
    ref_model, model = _model_state(reference)["model"], _model_state(shrunk)["model"]
    assert ref_model.keys() == model.keys()
    for name in ref_model:
        torch.testing.assert_close(model[name], ref_model[name], rtol=1e-5, atol=1e-6,
                                   msg=name)
    assert shrunk.metrics["loss"] == pytest.approx(reference.metrics["loss"], rel=1e-5)
    # not vacuous: the weights moved away from the initial ones
    torch.manual_seed(11)
    initial = toy.make_model().state_dict()
    assert not torch.allclose(initial["0.weight"], ref_model["0.weight"])
