"""A rank tells the coordinator the step its lockstep applied each decision at, with its next
report, so the effect is measured from the step the decision took effect."""

from __future__ import annotations

from raytrain_guard.coordination.client import CoordinatorClient, LockstepDecisionSource
from raytrain_guard.coordination.lockstep import Lockstep, SingleRankExchange
from raytrain_guard.core.decisions import Action, Cause, Decision
from raytrain_guard.core.steps import StepStats


class Handle:
    """Stands in for the coordinator actor handle: records the report calls."""

    def __init__(self) -> None:
        self.reports: list[tuple[tuple, dict]] = []
        handle = self

        class Reports:
            def remote(self, *args, **kwargs):
                handle.reports.append((args, kwargs))
                return object()

        class Fetches:
            def remote(self, cursor):
                return object()

        self.report_steps, self.decisions_since = Reports(), Fetches()


class DeliveringClient(CoordinatorClient):
    """The real client; its one method that waits on Ray finds every call answered, and the
    first fetch brings ``decision``."""

    def __init__(self, decision: Decision, **kw) -> None:
        super().__init__(**kw)
        self.delivery = [decision.to_dict()]

    def _answers(self, refs):
        delivery, self.delivery = self.delivery, []
        return [None, delivery]


def _stats(*steps):
    return [StepStats(step=s, total_s=0.01, world_rank=0) for s in steps]


def test_the_step_a_decision_was_applied_at_goes_with_the_next_report():
    # decided for step 2, fetched at boundary 4 (K = 4): the lockstep applies it there, at 4
    handle = Handle()
    shrink = Decision(Action.SHRINK_MICRO_BATCH, "test", 2, Cause.DEVICE_MEMORY, "cluster",
                      {"micro_batch": 4, "grad_accum": 2}, decision_id=9)
    client = DeliveringClient(shrink, name="c", namespace="ns", world_rank=0, node_id="n0",
                              report_every_steps=2, lookup=lambda name, ns: handle,
                              background=False)
    source = LockstepDecisionSource(Lockstep(every_steps=4, exchange=SingleRankExchange()),
                                    client)
    assert source.poll(2, _stats(0, 1)) == []
    assert [d.decision_id for d in source.poll(4, _stats(2, 3))] == [9]
    assert source.poll(6, _stats(4, 5)) == []
    assert source.poll(8, _stats(6, 7)) == []
    kwargs = [kw for _, kw in handle.reports]
    # the report at boundary 4 left before the lockstep applied it; the next one carries it,
    # once
    assert kwargs == [{}, {}, {"applied": [(4, 9)]}, {}]
