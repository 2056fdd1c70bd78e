"""A shrink is applied by every rank or by none (real gloo processes, no Ray).

Two ranks run the shared train loop with a scripted shrink at step 4. In the first run rank 1
cannot build its new loader: every rank keeps micro-batch 8 x accumulation 1 and records why.
In the second run both can: both switch at step 4. Either way every sample of the epoch is
consumed exactly once.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from gloo_world import spawn

ROOT = Path(__file__).resolve().parents[1]


class _Source:
    """Every rank hears of the same shrink for step 4 (what lockstep delivers)."""

    def poll(self, step, stats):
        from raytrain_guard.core.decisions import Action, Decision
        if step == 2:
            return [Decision(Action.SHRINK_MICRO_BATCH, "scripted", 4, scope="cluster",
                             params={"micro_batch": 4, "grad_accum": 2}, decision_id=7)]
        return []


def _worker(rank: int, out: str, fail_rank: int) -> None:
    sys.path.insert(0, str(ROOT))
    from examples import toy
    from raytrain_guard.coordination.context import WorkerContext
    from raytrain_guard.runtime.loop.layout import BatchLayout
    from raytrain_guard.runtime.loop.train_loop import (
        DirectoryReporter,
        GuardedTrainLoop,
        LoopConfig,
    )

    built = BatchLayout.new_loader

    def new_loader(self, micro_batch, **kwargs):     # a rebuilt loader (no dataset: a shrink)
        if self.rank == fail_rank and kwargs.get("dataset") is None:
            raise OSError("no room for the loader's workers")
        return built(self, micro_batch, **kwargs)

    BatchLayout.new_loader = new_loader               # this process's only

    config = LoopConfig.from_dict({
        "model_factory": toy.make_model,
        "dataset_factory": functools.partial(toy.make_dataset, 128),
        "optimizer_factory": toy.make_optimizer, "loss_fn": toy.loss_fn, "micro_batch": 8,
        "num_workers": 0, "measure_bandwidth": False, "checkpoint_every_steps": 100,
        "decision_source": _Source(), "audit_dir": os.path.join(out, "audit"),
        "guard": {"lockstep_every_steps": 2}})
    loop = GuardedTrainLoop(config, reporter=DirectoryReporter(out),
                            context=WorkerContext(world_rank=rank, world_size=2))
    results = loop.run()
    layout = loop.layout
    with open(os.path.join(out, f"result{rank}.json"), "w") as fh:
        json.dump({"micro_batch": layout.micro_batch, "grad_accum": layout.grad_accum,
                   "changes": layout.changes, "step": results["step"]}, fh)


@pytest.mark.parametrize("fail_rank, layout", [(1, (8, 1)), (-1, (4, 2))])
def test_a_shrink_is_applied_everywhere_or_nowhere(tmp_path, fail_rank, layout):
    spawn(_worker, 2, str(tmp_path), fail_rank)
    results = [json.loads((tmp_path / f"result{r}.json").read_text()) for r in (0, 1)]
    for r, result in enumerate(results):
        assert (result["micro_batch"], result["grad_accum"]) == layout
        assert result["step"] == 8                         # 128 / (2 x 8): the global batch kept
        change = result["changes"][0]
        assert change["step"] == 4 and change["applied"] == (fail_rank < 0)
        if fail_rank >= 0:
            assert ("this rank could not" if r == fail_rank else "another rank could not") \
                in change["reason"]
    ids = []
    for r in (0, 1):
        for line in (tmp_path / "audit" / f"rank{r}.jsonl").read_text().splitlines():
            ids.extend(json.loads(line)["ids"])
    assert sorted(ids) == list(range(128))
