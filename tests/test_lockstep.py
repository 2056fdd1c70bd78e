"""Pure lockstep rules: when ranks agree, how decision sets merge, which step applies."""

from __future__ import annotations

import pytest

from raytrain_guard.coordination.lockstep import (
    NO_DECISION,
    Lockstep,
    SingleRankExchange,
    apply_step,
    is_agreement_step,
    merge_decisions,
    newest_pending_id,
    schedule,
)
from raytrain_guard.core.decisions import Action, Decision
from raytrain_guard.errors import InputError


def _d(i: int, step: int | None = None, action: Action = Action.RELEASE_CACHE) -> Decision:
    return Decision(action, f"decision {i}", step, scope="cluster", decision_id=i)


@pytest.mark.parametrize("step, k, expected", [
    (0, 10, True), (10, 10, True), (11, 10, False), (19, 10, False), (7, 1, True), (9, 3, True),
])
def test_is_agreement_step(step, k, expected):
    assert is_agreement_step(step, k) is expected


@pytest.mark.parametrize("coordinator_step, agreed_at, expected", [
    (None, 20, 20),   # no step from the coordinator: apply at the agreement boundary
    (15, 20, 20),     # coordinator's step already passed (delayed message): agreement boundary
    (20, 20, 20),     # exactly now
    (27, 20, 27),     # still ahead: every rank knows it now and will reach it
])
def test_apply_step(coordinator_step, agreed_at, expected):
    assert apply_step(_d(1, coordinator_step), agreed_at) == expected


def test_newest_pending_id():
    assert newest_pending_id([]) == NO_DECISION
    assert newest_pending_id([_d(3), _d(9), _d(4)]) == 9


def test_merge_is_a_union_by_id_in_id_order_lowest_rank_wins():
    rank0 = [_d(5).to_dict(), _d(2).to_dict()]
    other_2 = Decision(Action.PACE, "rank 1's copy", None, decision_id=2).to_dict()
    rank1 = [other_2, _d(7).to_dict()]
    merged = merge_decisions([rank0, rank1, []])
    assert [d.decision_id for d in merged] == [2, 5, 7]
    assert merged[0].action is Action.RELEASE_CACHE     # rank 0's copy of id 2


def test_merge_drops_agreed_and_unreadable_entries():
    bad = {"action": "no_such_action", "reason": "x", "decision_id": 4}
    merged = merge_decisions([[_d(1).to_dict(), bad], [_d(3).to_dict()]], agreed_ids={1})
    assert [d.decision_id for d in merged] == [3]


def test_schedule_sets_each_apply_step():
    out = schedule([_d(1), _d(2, step=35), _d(3, step=5)], agreed_at=30)
    assert [(d.decision_id, d.step) for d in out] == [(1, 30), (2, 35), (3, 30)]


def test_lockstep_holds_a_fetched_decision_until_the_agreement_boundary():
    ls = Lockstep(every_steps=10, exchange=SingleRankExchange())
    assert ls.poll(0) == []
    ls.offer([_d(1)])
    for step in range(1, 10):        # fetched at step 1, but nothing applies before step 10
        assert ls.poll(step) == []
    due = ls.poll(10)
    assert [(d.decision_id, d.step) for d in due] == [(1, 10)]
    ls.offer([_d(1)])                # a late duplicate of an agreed decision is ignored
    assert all(ls.poll(s) == [] for s in range(11, 31))
    assert ls.applied == [(10, 1)]


def test_lockstep_applies_a_future_coordinator_step_exactly():
    ls = Lockstep(every_steps=4)
    ls.offer([_d(1, step=6), _d(2, step=2)])
    got = {s: [d.decision_id for d in ls.poll(s)] for s in range(0, 9)}
    # agreed at step 0: id 1 at its own step 6, id 2 (step 2 > 0, still ahead) at 2
    assert got == {0: [], 1: [], 2: [2], 3: [], 4: [], 5: [], 6: [1], 7: [], 8: []}
    assert ls.applied == [(2, 2), (6, 1)]


@pytest.mark.parametrize("k", [0, -1, 2.5, True])
def test_lockstep_rejects_a_bad_interval(k):
    with pytest.raises(InputError, match="lockstep_every_steps"):
        Lockstep(every_steps=k)
