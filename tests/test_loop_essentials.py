"""The train loop's essentials on one rank in-process (CPU, no Ray): an epoch is an epoch, the
LR schedule, gradient clipping, precision, and the layout kept at another world size."""

from __future__ import annotations

import functools
import json

import pytest
import torch

from examples import toy
from raytrain_guard.errors import InputError
from raytrain_guard.runtime.loop.config import REHEARSAL
from raytrain_guard.runtime.loop.layout import relayout
from raytrain_guard.runtime.loop.rehearsal import Rehearsal
from raytrain_guard.runtime.loop.train_loop import DirectoryReporter, GuardedTrainLoop, LoopConfig

BASE = {"model_factory": toy.make_model, "optimizer_factory": toy.make_optimizer,
        "loss_fn": toy.loss_fn, "num_workers": 0, "seed": 2, "measure_bandwidth": False,
        "checkpoint_every_steps": 100}


def _loop(tmp_path, **changes):
    config = LoopConfig.from_dict({**BASE, "dataset_factory": functools.partial(
        toy.make_dataset, changes.pop("num_samples", 18)), **changes})
    return GuardedTrainLoop(config, reporter=DirectoryReporter(str(tmp_path)))


def _audit(tmp_path):
    return [json.loads(line) for line in (tmp_path / "audit" / "rank0.jsonl").read_text()
            .splitlines()]


def test_an_epoch_ends_with_a_shorter_step_and_trains_every_sample(tmp_path):
    # 18 samples in micro-batches of 4: 4, 4, 4, 4, 2. grad_accum 3: steps of 3 and 2
    # micro-batches, the last weighted 4/6 and 2/6 (the mean over its 6 samples)
    loop = _loop(tmp_path, micro_batch=4, grad_accum=3, epochs=2,
                 audit_dir=str(tmp_path / "audit"))
    results = loop.run()
    assert results["step"] == results["total_steps"] == 4
    audit = _audit(tmp_path)
    assert [(a["step"], a["epoch"], len(a["ids"])) for a in audit] == [
        (0, 0, 4), (0, 0, 4), (0, 0, 4), (1, 0, 4), (1, 0, 2),
        (2, 1, 4), (2, 1, 4), (2, 1, 4), (3, 1, 4), (3, 1, 2)]
    for epoch in (0, 1):
        assert sorted(i for a in audit if a["epoch"] == epoch for i in a["ids"]) == \
            list(range(18))


def test_the_short_steps_weights_are_the_samples_shares(tmp_path):
    loop = _loop(tmp_path, micro_batch=4, grad_accum=3)
    loop._build()
    batches = iter(loop.layout.loader)
    assert loop.layout.step_weights(batches) == [1 / 3] * 3
    for _ in range(3):
        next(batches)
    assert loop.layout.step_weights(batches) == pytest.approx([4 / 6, 2 / 6])


def test_dropping_the_epoch_tail_skips_the_leftover_micro_batches(tmp_path):
    loop = _loop(tmp_path, micro_batch=4, grad_accum=3, epochs=2, epoch_tail="drop",
                 audit_dir=str(tmp_path / "audit"))
    assert loop.run()["total_steps"] == 2
    assert [(a["step"], a["epoch"]) for a in _audit(tmp_path)] == [(0, 0)] * 3 + [(1, 1)] * 3


def test_the_scheduler_steps_per_optimizer_step_and_is_checkpointed(tmp_path):
    loop = _loop(tmp_path, micro_batch=6, epochs=2, checkpoint_every_steps=2,
                 scheduler_factory=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, 0.5))
    loop.run()                                              # 3 steps an epoch: 6 steps
    assert loop.model.optimizer.param_groups[0]["lr"] == pytest.approx(0.02 * 0.5 ** 6)
    reports = loop.reporter.reports
    assert [r["lr"] for r in reports] == pytest.approx([0.02 * 0.5 ** s for s in (2, 4, 6)])
    from raytrain_guard.runtime.dist.checkpoint import META_FILE
    meta = torch.load(tmp_path / "checkpoint_4" / META_FILE, weights_only=True)
    assert meta["extra"]["scheduler"]["last_epoch"] == 4


def test_a_checkpoint_copy_cut_short_leaves_no_checkpoint(tmp_path, monkeypatch):
    import shutil

    loop = _loop(tmp_path, micro_batch=6, checkpoint_every_steps=2)
    loop.run()                                      # 3 steps: checkpoints 2 and 3
    copied, real_copytree = [], shutil.copytree

    def copy_then_fail(src, dst, **kw):             # the disk fills after the first file
        if copied:
            raise OSError(28, "No space left on device")
        copied.append(src)
        return shutil.copy2(src, dst, **kw)

    monkeypatch.setattr(shutil, "copytree", lambda src, dst, **kw: real_copytree(
        src, dst, copy_function=copy_then_fail, **kw))
    with pytest.raises(OSError, match="No space left"):
        loop.reporter.report({"step": 9}, str(tmp_path / "checkpoint_3"))
    assert copied and not (tmp_path / "checkpoint_9").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint_2", "checkpoint_3"]
    with loop.reporter.latest_checkpoint_dir() as latest:
        assert latest == str(tmp_path / "checkpoint_3")


@pytest.mark.parametrize("tear", ["no meta", "short shard"])
def test_resume_skips_a_torn_checkpoint_for_the_newest_complete_one(tmp_path, caplog, tear):
    from raytrain_guard.runtime.dist.checkpoint import META_FILE

    _loop(tmp_path, micro_batch=6, epochs=2, checkpoint_every_steps=2).run()    # 2, 4, 6
    newest = tmp_path / "checkpoint_6"
    if tear == "no meta":
        (newest / META_FILE).unlink()
    else:
        shard = newest / "__0_0.distcp"
        shard.write_bytes(shard.read_bytes()[:100])
    again = _loop(tmp_path, micro_batch=6, epochs=2, checkpoint_every_steps=2)
    with caplog.at_level("WARNING"):
        results = again.run()
    assert results["resumed_from"] == 4 and results["step"] == 6
    assert f"checkpoint {newest} is torn" in caplog.text


def test_clipping_bounds_the_update(tmp_path):
    clipped = _loop(tmp_path / "a", micro_batch=6, max_grad_norm=1e-6)
    free = _loop(tmp_path / "b", micro_batch=6)
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    torch.manual_seed(2)
    start = toy.make_model().state_dict()
    clipped.run()
    free.run()
    moved = sum((p - start[k]).abs().sum().item()
                for k, p in clipped.model.planned.module.state_dict().items())
    moved_free = sum((p - start[k]).abs().sum().item()
                     for k, p in free.model.planned.module.state_dict().items())
    assert moved < 1e-4 < moved_free
    assert clipped.reporter.reports[-1]["grad_norm"] > 1e-6     # the norm before clipping


def test_amp_bf16_runs_the_forward_under_autocast(tmp_path):
    seen = []

    def loss_fn(model, batch):
        seen.append(torch.is_autocast_enabled("cpu"))
        return toy.loss_fn(model, batch)

    _loop(tmp_path, micro_batch=6, precision="amp-bf16", loss_fn=loss_fn).run()
    assert seen and all(seen)


@pytest.mark.parametrize("changes, match", [
    ({"precision": "fp16"}, "precision: unknown precision"),
    ({"precision": "bf16-master"}, "FSDP2 mixed-precision policies"),
    ({"max_grad_norm": 0}, "max_grad_norm: must be > 0"),
    ({"epoch_tail": "spill"}, "epoch_tail: unknown"),
    ({"fsdp_grad_sync": "sometimes"}, "fsdp_grad_sync: unknown"),
    ({"faults": {"delay": [{"seconds": 0.1}]}},
     "faults: are applied by a rehearsal, and none is set .* set rehearsal='raytrain_guard"),
    ({"rehearsal": "no_such_module:f"}, "rehearsal: cannot import module"),
])
def test_bad_essentials_name_the_key(changes, match):
    with pytest.raises(InputError, match=match):
        LoopConfig.from_dict({**BASE, "dataset_factory": toy.make_dataset, **changes})


@pytest.mark.parametrize("global_batch, world, micro, layout", [
    (24, 1, 4, (4, 6)), (24, 3, 4, (4, 2)), (24, 4, 4, (3, 2)), (16, 4, 8, (4, 1)),
    (16, 3, 8, None), (8, 8, 4, (1, 1)),
])
def test_relayout_keeps_the_global_batch(global_batch, world, micro, layout):
    assert relayout(global_batch, world, micro) == layout


def test_a_resume_that_cannot_keep_the_global_batch_is_refused_unless_allowed(tmp_path):
    from raytrain_guard.coordination.context import WorkerContext

    def loop(**changes):
        cfg = LoopConfig.from_dict({**BASE, "dataset_factory": toy.make_dataset,
                                    "micro_batch": 4, **changes})
        made = GuardedTrainLoop(cfg, context=WorkerContext(world_rank=0, world_size=3),
                                reporter=DirectoryReporter(str(tmp_path)))
        made._build()
        return made.layout

    keeps = loop()
    keeps.resume_on_other_world(4, 3, 2)                   # 24 on 3 ranks: 4 x 2
    assert (keeps.micro_batch, keeps.grad_accum) == (4, 2)
    with pytest.raises(InputError, match="global batch 16 .* is no multiple of 3"):
        loop().resume_on_other_world(4, 2, 2)
    changed = loop(allow_global_batch_change=True)
    changed.resume_on_other_world(4, 2, 2)                  # 16 / 3 ranks: 4 x 1 = 12
    assert changed.changes[-1]["global_batch"] == 12
    assert "changes the global batch from 16 to 12" in changed.changes[-1]["reason"]


def test_resizes_back_and_forth_do_not_ratchet_the_micro_batch_down(tmp_path):
    """Global batch 24, config micro-batch 8: on 2 ranks 6 x 2 (8 does not divide 12), on 3
    ranks 8 x 1 again (from the config's 8, not the checkpoint's 6), unless a shrink chose a
    smaller one for memory."""
    from raytrain_guard.coordination.context import WorkerContext

    def on(world, changes=()):
        cfg = LoopConfig.from_dict({**BASE, "dataset_factory": toy.make_dataset,
                                    "micro_batch": 8})
        made = GuardedTrainLoop(cfg, context=WorkerContext(world_rank=0, world_size=world),
                                reporter=DirectoryReporter(str(tmp_path)))
        made._build()
        made.layout.changes = [dict(c) for c in changes]
        return made.layout

    two = on(2)
    two.resume_on_other_world(8, 1, 3)                     # 24: from 3 ranks to 2
    assert (two.micro_batch, two.grad_accum) == (6, 2)
    three = on(3, two.changes)
    three.resume_on_other_world(6, 2, 2)                   # and back to 3
    assert (three.micro_batch, three.grad_accum) == (8, 1)
    shrunk = on(3, [{"decision_id": 7, "applied": True, "micro_batch": 4, "grad_accum": 2}])
    shrunk.resume_on_other_world(4, 3, 2)                  # a shrink to 4 holds
    assert (shrunk.micro_batch, shrunk.grad_accum) == (4, 2)


def test_the_loop_runs_the_fsdp_grad_sync_its_plan_chose_unless_told():
    import types

    from raytrain_guard.cluster.launcher import with_planned_grad_sync
    fsdp = types.SimpleNamespace(fsdp_grad_sync="every_micro_batch")
    assert with_planned_grad_sync({"x": 1}, fsdp)["fsdp_grad_sync"] == "every_micro_batch"
    assert with_planned_grad_sync({"fsdp_grad_sync": "auto"}, fsdp)["fsdp_grad_sync"] == \
        "every_micro_batch"
    told = {"fsdp_grad_sync": "last_micro_batch"}
    assert with_planned_grad_sync(told, fsdp) is told
    ddp = types.SimpleNamespace(fsdp_grad_sync=None)
    assert "fsdp_grad_sync" not in with_planned_grad_sync({}, ddp)
    assert with_planned_grad_sync({}, False) == {}


def test_a_global_batch_is_laid_out_on_the_world_the_run_starts_with():
    from raytrain_guard.coordination.context import WorkerContext

    def first(world, **changes):
        config = LoopConfig.from_dict({**BASE, "dataset_factory": toy.make_dataset,
                                       "micro_batch": 4, **changes})
        loop = GuardedTrainLoop(config, reporter=DirectoryReporter("/tmp"),
                                context=WorkerContext(world_rank=0, world_size=world))
        loop._build()
        return loop.layout.micro_batch, loop.layout.grad_accum

    assert first(1) == (4, 1)                                # no global batch: as configured
    assert first(1, global_batch=24) == (4, 6)
    assert first(2, global_batch=24) == (4, 3)
    assert first(4, global_batch=24) == (3, 2)               # 6 a rank: 4 does not divide it
    with pytest.raises(InputError, match="global_batch.*cannot be shared evenly by 5"):
        first(5, global_batch=24)


def test_an_elastic_range_needs_a_global_batch_every_size_shares_and_a_restart():
    from raytrain_guard.cluster.launcher import elastic_loop_config, worker_range

    assert worker_range(3) == (3, 3) and worker_range((1, 4)) == (1, 4)
    for bad, field in ((0, "num_workers"), (True, "num_workers"), (2.0, "num_workers"),
                       ((3, 2), "num_workers"), ((1, 2, 3), "num_workers"),
                       ((0, 2), "num_workers[0]"), ((1, "4"), "num_workers[1]")):
        with pytest.raises(InputError) as err:
            worker_range(bad)
        assert err.value.field == field and err.value.fix == "e.g. 2, or (2, 4)"
    config = {"micro_batch": 2, "grad_accum": 3}
    assert elastic_loop_config(config, 1, 2, 1)["global_batch"] == 12   # at the most workers
    assert elastic_loop_config({**config, "global_batch": 12}, 2, 4, 1)["global_batch"] == 12
    with pytest.raises(InputError, match="evenly by 4 workers"):
        elastic_loop_config(config, 4, 5, 1)                 # 2 x 3 x 5 = 30: not by 4
    with pytest.raises(InputError, match="max_failures"):
        elastic_loop_config(config, 1, 2, 0)
    assert elastic_loop_config(config, 1, 2, -1)["global_batch"] == 12    # -1: no limit


def test_an_elastic_run_is_planned_in_the_layout_it_takes_on_its_fewest_workers():
    from raytrain_guard.cluster.launcher import layout_on

    config = {"micro_batch": 8, "grad_accum": 1, "global_batch": 16}
    assert layout_on(config, 1) == {**config, "micro_batch": 8, "grad_accum": 2}
    assert layout_on(config, 2) == config
    plain = {"micro_batch": 8, "grad_accum": 3}
    assert layout_on(plain, 1) is plain


class CountingRehearsal(Rehearsal):
    """A rehearsal of one's own: counts the loop's calls of each hook."""

    def __init__(self, config, *, world_rank, device):
        self.calls: dict[str, int] = {}
        CountingRehearsal.made = self

    def _count(self, hook):
        self.calls[hook] = self.calls.get(hook, 0) + 1

    def wrap_dataset(self, dataset):
        self._count("wrap_dataset")
        return dataset

    def attach(self, model):
        self._count("attach")

    def measure(self, module, optimizer):
        self._count("measure")

    def begin_step(self, step, probe):
        self._count("begin_step")

    def transform(self, batch):
        self._count("transform")
        return batch

    def after_backward(self, elapsed_s):
        self._count("after_backward")

    def close(self):
        self._count("close")


def test_the_rehearsal_seam_calls_each_hook_where_it_belongs(tmp_path):
    # 3 steps of 2 micro-batches: a step's hook 3 times, a micro-batch's 6, the run's once
    _loop(tmp_path, micro_batch=3, grad_accum=2, max_steps=3, rehearsal=CountingRehearsal).run()
    assert CountingRehearsal.made.calls == {
        "wrap_dataset": 1, "attach": 1, "measure": 1, "begin_step": 3, "transform": 6,
        "after_backward": 6, "close": 1}


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA the size caps the real card")
def test_a_card_size_on_a_cpu_asks_for_the_rehearsal_that_simulates_it(tmp_path):
    with pytest.raises(InputError, match="device_memory_bytes: caps a CUDA card; on a CPU a "
                                         "rehearsal simulates the card"):
        _loop(tmp_path, micro_batch=6, device_memory_bytes=1 << 30)._build()
    loop = _loop(tmp_path, micro_batch=6, device_memory_bytes=1 << 30, rehearsal=REHEARSAL)
    loop._build()
    assert loop.rehearsal.card.capacity_bytes == 1 << 30
