"""SHRINK_MICRO_BATCH in the shared train loop, in-process (one rank, no Ray).

* :func:`shrink_verdict` (pure): which shrinks are applied and why the others are refused.
* A real one-rank :class:`GuardedTrainLoop` run (torch, CPU) shrinking at step 2 against the same
  run without the shrink: the same samples in every step, the same final weights up to float
  summation order, the change recorded in the results and the checkpoint; a run resumed from
  that checkpoint continues with the shrunk layout and ends where the reference does.
* The coordinator client sends the rank's setup (micro_batch, grad_accum, prefetch_factor) with
  its reports, which the coordinator's shrink rule needs.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
from scripted_source import ScriptedDecisionSource  # noqa: E402

import examples.toy as toy  # noqa: E402
from raytrain_guard.coordination.client import (  # noqa: E402
    CoordinatorClient,
    LockstepDecisionSource,
)
from raytrain_guard.coordination.context import WorkerContext  # noqa: E402
from raytrain_guard.coordination.lockstep import Lockstep  # noqa: E402
from raytrain_guard.core.decisions import Action, Cause, Decision  # noqa: E402
from raytrain_guard.core.steps import StepStats  # noqa: E402
from raytrain_guard.runtime.loop.layout import shrink_verdict
from raytrain_guard.runtime.loop.train_loop import (  # noqa: E402
    DirectoryReporter,
    GuardedTrainLoop,
    LoopConfig,
)

# -- the verdict (pure) --------------------------------------------------------------------------

@pytest.mark.parametrize("mb,ga,params,per_rank,expected", [
    # 8 x 2 = 16 per rank and step -> 4 x 4 = 16: kept; 32 samples / 4 = 8 micro-batches >= 4
    (8, 2, {"micro_batch": 4, "grad_accum": 4}, 32, (4, 4)),
    # 8 x 1 -> 2 x 4 = 8: a quarter is fine too (2 divides 8)
    (8, 1, {"micro_batch": 2, "grad_accum": 4}, 32, (2, 4)),
    # 8 x 2 = 16 -> 4 x 2 = 8: the global batch would halve
    (8, 2, {"micro_batch": 4, "grad_accum": 2}, 32, "the global batch"),
    # 6 x 2 = 12 -> 4 x 3 = 12 keeps the batch, but 4 does not divide 6
    (6, 2, {"micro_batch": 4, "grad_accum": 3}, 32, "does not divide the current 6"),
    (4, 2, {"micro_batch": 4, "grad_accum": 2}, 32, "not smaller than the current 4"),
    (4, 2, {"micro_batch": 8, "grad_accum": 1}, 32, "not smaller"),
    (4, 2, {"grad_accum": 4}, 32, "params['micro_batch']: must be an integer >= 1 (got None)"),
    (4, 2, {"micro_batch": 2.0, "grad_accum": 4}, 32,
     "params['micro_batch']: must be an integer >= 1 (got 2.0)"),
    (4, 2, {"micro_batch": 2, "grad_accum": True}, 32,
     "params['grad_accum']: must be an integer >= 1 (got True)"),
    # 4 x 2 -> 1 x 8, but 6 samples per rank hold only ceil(6 / 1) = 6 micro-batches < 8
    (4, 2, {"micro_batch": 1, "grad_accum": 8}, 6, "grad_accum 8 exceeds the 6 micro-batches"),
])
def test_shrink_verdict(mb, ga, params, per_rank, expected):
    verdict = shrink_verdict(mb, ga, params, samples_per_rank=per_rank)
    if isinstance(expected, tuple):
        assert verdict == expected
    else:
        assert isinstance(verdict, str) and expected in verdict, verdict


# -- a real one-rank run ---------------------------------------------------------------------------

NUM_SAMPLES = 32     # one rank: 32 per epoch -> 8 micro-batches of 4 -> 4 steps of grad_accum 2
BASE = dict(model_factory=toy.make_model,
            dataset_factory=functools.partial(toy.make_dataset, NUM_SAMPLES),
            optimizer_factory=toy.make_optimizer, loss_fn=toy.loss_fn, micro_batch=4,
            grad_accum=2, epochs=2, checkpoint_every_steps=100, num_workers=0, seed=3,
            measure_bandwidth=False)


def _shrink(at: int, mb: int = 2, ga: int = 4, decision_id: int = 1) -> dict:
    return Decision(Action.SHRINK_MICRO_BATCH, f"test shrink {mb}x{ga}", at, Cause.DEVICE_MEMORY,
                    "cluster", {"micro_batch": mb, "grad_accum": ga}, decision_id).to_dict()


def _run(tmp: Path, name: str, **changes) -> GuardedTrainLoop:
    config = LoopConfig.from_dict({**BASE, "audit_dir": str(tmp / name), **changes})
    loop = GuardedTrainLoop(config, context=WorkerContext(world_rank=0, world_size=1),
                            reporter=DirectoryReporter(str(tmp / f"{name}-ckpt")))
    loop.run()
    return loop


def _ids_by_step(directory: Path) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for line in (directory / "rank0.jsonl").read_text().splitlines():
        entry = json.loads(line)
        out.setdefault(entry["step"], []).extend(entry["ids"])
    return out


def _sizes_by_step(directory: Path) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for line in (directory / "rank0.jsonl").read_text().splitlines():
        entry = json.loads(line)
        out.setdefault(entry["step"], []).append(len(entry["ids"]))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("shrink")
    reference = _run(tmp, "reference")
    # Handed over at boundary 1, applied at boundary 2 (after 2 of 8 steps); a second shrink
    # that would change the global batch (2 x 2 != 2 x 4) is refused at boundary 5.
    source = ScriptedDecisionSource({0: [(1, _shrink(2)), (5, _shrink(5, 1, 2, 2))]})
    shrunk = _run(tmp, "shrunk", decision_source=source)
    return tmp, reference, shrunk, source


def test_shrink_applies_at_its_step_and_keeps_every_step_sample_set(runs):
    tmp, reference, shrunk, _ = runs
    ref_ids, ids = _ids_by_step(tmp / "reference"), _ids_by_step(tmp / "shrunk")
    assert sorted(ids) == list(range(8))
    # the same samples, in the same order, in every step (positions 8s..8s+7 of the epoch)
    assert ids == ref_ids
    # micro-batches of 4 x 2 before step 2, of 2 x 4 from step 2 on
    sizes = _sizes_by_step(tmp / "shrunk")
    assert [sizes[s] for s in range(8)] == [[4, 4]] * 2 + [[2, 2, 2, 2]] * 6
    layout = shrunk.layout
    assert (layout.micro_batch, layout.grad_accum) == (2, 4)
    assert layout.loader.batch_size == 2 and layout.steps_per_epoch == 4


def test_shrunk_run_ends_with_the_reference_weights(runs):
    import torch
    _, reference, shrunk, _ = runs
    for (name, p), (_, q) in zip(reference.model.planned.module.named_parameters(),
                                 shrunk.model.planned.module.named_parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=name)
    assert float(shrunk.steps.last_loss) == pytest.approx(float(reference.steps.last_loss),
                                                         rel=1e-5)


def test_results_and_setup_record_the_change_and_the_refusal(runs):
    _, _, shrunk, source = runs
    results = shrunk.results
    assert (results["micro_batch"], results["grad_accum"]) == (2, 4)
    applied, refused = results["batch_changes"]
    assert applied == {"step": 2, "decision_id": 1, "from_micro_batch": 4, "from_grad_accum": 2,
                       "micro_batch": 2, "grad_accum": 4, "applied": True,
                       "reason": "test shrink 2x4", "world_rank": 0}
    assert refused["step"] == 5 and refused["applied"] is False
    assert "the global batch" in refused["reason"]
    # what the decision source would report: the layout at each boundary, read at the poll
    # (before the decisions of that boundary apply: step 2 still ran with 4 x 2)
    setups = dict((step, (s["micro_batch"], s["grad_accum"])) for step, s in source.setups)
    assert setups[2] == (4, 2) and setups[3] == (2, 4) and setups[8] == (2, 4)


def test_shrink_at_an_epoch_boundary(runs, tmp_path):
    # applied after step 4 = the end of epoch 0: the rebuilt loader starts epoch 1 at position 0
    import torch
    tmp, reference, _, _ = runs
    source = ScriptedDecisionSource({0: [(4, _shrink(4))]})
    shrunk = _run(tmp_path, "edge", decision_source=source)
    assert _ids_by_step(tmp_path / "edge") == _ids_by_step(tmp / "reference")
    sizes = _sizes_by_step(tmp_path / "edge")
    assert [sizes[s] for s in range(8)] == [[4, 4]] * 4 + [[2, 2, 2, 2]] * 4
    for p, q in zip(reference.model.planned.module.parameters(),
                    shrunk.model.planned.module.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)


def test_resume_continues_with_the_shrunk_layout(runs, tmp_path):
    import shutil

    import torch
    tmp, reference, _, _ = runs
    # first part: the shrink at step 2, stop after step 4 (final checkpoint at 4)
    source = ScriptedDecisionSource({0: [(2, _shrink(2))]})
    first = _run(tmp_path, "part", decision_source=source, max_steps=4)
    assert (first.results["step"], first.layout.micro_batch, first.layout.grad_accum) == (4, 2, 4)
    # second part: the same config (micro_batch 4 x grad_accum 2), resumed from step 4
    config = LoopConfig.from_dict({**BASE, "audit_dir": str(tmp_path / "rest")})
    shutil.copytree(tmp_path / "part-ckpt", tmp_path / "rest-ckpt")
    rest = GuardedTrainLoop(config, context=WorkerContext(world_rank=0, world_size=1),
                            reporter=DirectoryReporter(str(tmp_path / "rest-ckpt")))
    rest.run()
    assert rest.steps.resumed_from == 4
    assert (rest.layout.micro_batch, rest.layout.grad_accum) == (2, 4)
    assert rest.results["batch_changes"][0]["step"] == 2
    ref_ids = _ids_by_step(tmp / "reference")
    assert _ids_by_step(tmp_path / "rest") == {s: ref_ids[s] for s in range(4, 8)}
    assert _sizes_by_step(tmp_path / "rest")[4] == [2, 2, 2, 2]
    for p, q in zip(reference.model.planned.module.parameters(),
                    rest.model.planned.module.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)


# -- the client reports the setup ----------------------------------------------------------------

class _Method:
    def __init__(self, calls: list) -> None:
        self.calls = calls

    def remote(self, *args):
        self.calls.append(args)
        return object()


class _Coordinator:
    """Stands in for the coordinator actor handle: records the calls made on it."""

    def __init__(self) -> None:
        self.reports: list = []
        self.fetches: list = []
        self.report_steps = _Method(self.reports)
        self.decisions_since = _Method(self.fetches)


class _AnsweredClient(CoordinatorClient):
    """The real client; the one method that waits on Ray finds every call answered."""

    def _answers(self, refs):
        return [[] for _ in refs]


def test_client_sends_the_current_setup_with_each_report():
    coordinator = _Coordinator()
    layout = {"micro_batch": 8, "grad_accum": 2, "prefetch_factor": 4}
    client = _AnsweredClient("c", namespace="ns", world_rank=1, node_id="n1",
                               report_every_steps=2, lookup=lambda name, ns: coordinator,
                               background=False)
    source = LockstepDecisionSource(Lockstep(every_steps=100), client)
    source.bind_setup(lambda: dict(layout))
    client.record([StepStats(step=0, total_s=0.1, world_rank=1),
                   StepStats(step=1, total_s=0.1, world_rank=1)])
    layout.update(micro_batch=4, grad_accum=4)         # a shrink applied in between
    client.record([StepStats(step=2, total_s=0.1, world_rank=1),
                   StepStats(step=3, total_s=0.1, world_rank=1)])
    assert [r[4] for r in coordinator.reports] == [
        {"micro_batch": 8, "grad_accum": 2, "prefetch_factor": 4},
        {"micro_batch": 4, "grad_accum": 4, "prefetch_factor": 4}]
    assert coordinator.reports[0][:3] == (1, "n1", 0)


def test_client_reports_without_setup_when_it_fails():
    coordinator = _Coordinator()

    def broken():
        raise RuntimeError("loader gone")
    client = _AnsweredClient("c", namespace="ns", world_rank=0, node_id="n1",
                               report_every_steps=1, lookup=lambda name, ns: coordinator,
                               background=False,
                               setup=broken)
    client.record(StepStats(step=0, total_s=0.1, world_rank=0))
    assert coordinator.reports[0][4] is None and client.connected and client.num_failures == 0


def test_a_scripted_shrink_for_one_node_is_refused_when_scripted():
    from raytrain_guard.errors import InputError
    node_shrink = dict(_shrink(4), scope="node:n1")
    with pytest.raises(InputError, match=r"^script\[1\]\[1\]\.scope: a shrink_micro_batch is "
                                         r"for every rank together"):
        ScriptedDecisionSource({0: [(2, _shrink(4))], 1: [(2, _shrink(4)), (3, node_shrink)]})
    with pytest.raises(InputError, match=r"^script\[0\]\[0\]: is not a decision"):
        ScriptedDecisionSource({0: [(2, {"action": "grow"})]})


def test_a_node_scoped_shrink_from_the_coordinator_is_dropped_by_every_rank(caplog):
    """A coordinator that sent a shrink for one node's ranks: the client drops it on every
    rank alike, before the lockstep (its collective is never started by some ranks only);
    the other decisions of the fetch go on."""
    release = Decision(Action.RELEASE_CACHE, "hot", 8, Cause.DEVICE_MEMORY, "cluster",
                       decision_id=3).to_dict()

    class Fetched(CoordinatorClient):
        def _answers(self, refs):
            return [None, [dict(_shrink(8, decision_id=2), scope="node:n1"), release]]

    client = Fetched("c", namespace="ns", world_rank=0, node_id="n1", report_every_steps=1,
                     lookup=lambda name, ns: _Coordinator(), background=False)
    with caplog.at_level("WARNING"):
        client.record(StepStats(step=0, total_s=0.1))     # a report and a decisions fetch
        decisions = client.poll_decisions()
    assert [d.decision_id for d in decisions] == [3]
    assert "ignoring an unreadable decision" in caplog.text and "scope 'cluster'" in caplog.text


def test_cluster_source_keeps_the_setup_for_the_client_it_builds():
    import pickle

    from raytrain_guard.coordination.client import ClusterDecisionSource
    source = ClusterDecisionSource("r", "ns")
    source.bind_setup(lambda: {"micro_batch": 1})
    assert pickle.loads(pickle.dumps(source))._setup is None    # not shipped to workers
    assert source._setup() == {"micro_batch": 1}
