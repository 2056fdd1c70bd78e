"""Lockstep: every rank applies every cluster decision at the same step boundary.

A rank never applies a decision it fetched by itself: every ``lockstep_every_steps`` steps the
ranks agree on the newest pending decision id in one 16-byte control-plane round
(:mod:`raytrain_guard.runtime.control_plane`), exchange their pending decisions only when some
rank has one, merge them in rank order and schedule each at :func:`apply_step`. The pure part
is plain functions over :class:`~raytrain_guard.core.decisions.Decision` values; the collective
is one method, :meth:`ProcessGroupExchange.exchange`. Why, step by step: docs/coordination.md.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from raytrain_guard.core.decisions import Decision
from raytrain_guard.errors import check_int
from raytrain_guard.runtime.control_plane import NO_DECISION, ControlPlane, shared_control_plane

logger = logging.getLogger(__name__)

__all__ = ["NO_DECISION", "Lockstep", "ProcessGroupExchange", "SingleRankExchange",
           "apply_step", "is_agreement_step", "merge_decisions", "newest_pending_id", "schedule"]


# -- pure part ---------------------------------------------------------------------------------

def is_agreement_step(step: int, every_steps: int) -> bool:
    """True at the step boundaries where the ranks agree: every multiple of ``every_steps``."""
    return step % every_steps == 0


def apply_step(decision: Decision, agreed_at: int) -> int:
    """The step at which every rank applies ``decision``, agreed at boundary ``agreed_at``.

    The coordinator's step when it is still ahead (every rank will reach it, and every rank
    knows it now); otherwise the agreement boundary itself: the merge happens before any rank
    applies anything at that boundary, so applying there is already in lockstep.
    """
    if decision.step is not None and decision.step > agreed_at:
        return int(decision.step)
    return agreed_at


def newest_pending_id(pending: Iterable[Decision]) -> int:
    """The value this rank contributes to the ``all_reduce(MAX)``: its newest pending id."""
    return max((d.decision_id for d in pending), default=NO_DECISION)


def merge_decisions(per_rank: Sequence[Sequence[Mapping[str, Any]]],
                    agreed_ids: frozenset[int] | set[int] = frozenset()) -> list[Decision]:
    """Union of the ranks' pending decisions, by id, new ones only, ordered by id.

    ``per_rank[r]`` is rank ``r``'s list of ``Decision.to_dict()``. Every rank calls this with
    the same lists in the same order, so every rank gets the same result: for an id known to
    several ranks the lowest rank's copy wins; an id already agreed is dropped; an entry that
    does not parse is dropped (on every rank alike) with a warning.
    """
    merged: dict[int, Decision] = {}
    for rank, entries in enumerate(per_rank):
        for entry in entries:
            try:
                decision = Decision.from_dict(entry)
            except (KeyError, ValueError, TypeError) as exc:
                logger.warning("lockstep: dropping an unreadable decision from rank %d: %s (%r)",
                               rank, exc, entry)
                continue
            if decision.decision_id in agreed_ids or decision.decision_id in merged:
                continue
            merged[decision.decision_id] = decision
    return [merged[i] for i in sorted(merged)]


def schedule(decisions: Iterable[Decision], agreed_at: int) -> list[Decision]:
    """The merged decisions with their apply step set (``Decision.at``)."""
    return [d.at(apply_step(d, agreed_at)) for d in decisions]


# -- the collective ----------------------------------------------------------------------------

class Exchange(Protocol):
    """Shares pending decisions among the ranks; one call per agreement boundary on every rank."""

    def exchange(self, newest_id: int,
                 pending: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
        """Every rank's pending list, in rank order (``[]`` lists when nobody had any)."""
        ...


class SingleRankExchange:
    """The exchange of a world of one rank: nothing to share."""

    def exchange(self, newest_id: int,
                 pending: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
        return [pending]


class ProcessGroupExchange:
    """The exchange over ``torch.distributed``: the newest-id round is ``plane``'s (default:
    this process's :func:`~raytrain_guard.runtime.control_plane.shared_control_plane`, the one
    the train loop's stop flag rides on), the pending lists go over the plane's gloo group."""

    def __init__(self, plane: ControlPlane | None = None) -> None:
        self.plane = plane

    def exchange(self, newest_id: int,
                 pending: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
        """The one method that touches ``torch.distributed``: the plane's allreduce(MAX), then
        ``all_gather_object`` only when some rank has a pending decision.

        Every rank of the group must call it at the same boundary (it is a collective).
        """
        if self.plane is None:
            self.plane = shared_control_plane()
        plane = self.plane
        if plane.agree(newest_id) == NO_DECISION:
            return []
        if plane.world_size == 1:
            return [pending]
        import torch.distributed as dist

        gathered: list[Any] = [None] * plane.world_size
        dist.all_gather_object(gathered, pending, group=plane.group)
        return [list(g or []) for g in gathered]


# -- the per-rank state ------------------------------------------------------------------------

@dataclass
class Lockstep:
    """One rank's side of the agreement.

    ``offer()`` hands it decisions this rank fetched (from the coordinator client, at any
    time); ``poll(step)`` is called at every step boundary by every rank, and returns the
    decisions to apply at exactly that step. ``applied`` is the rank's log of
    ``(step, decision_id)``.
    """

    every_steps: int
    exchange: Exchange = field(default_factory=SingleRankExchange)
    world_rank: int = 0
    pending: dict[int, Decision] = field(default_factory=dict)
    agreed_ids: set[int] = field(default_factory=set)
    scheduled: list[Decision] = field(default_factory=list)
    applied: list[tuple[int, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        check_int("lockstep_every_steps", self.every_steps, at_least=1,
                  fix="set GuardConfig.lockstep_every_steps")

    def offer(self, decisions: Iterable[Decision]) -> None:
        """Decisions this rank heard of; held until the next agreement boundary."""
        for d in decisions:
            if d.decision_id not in self.agreed_ids:
                self.pending.setdefault(d.decision_id, d)

    def poll(self, step: int) -> list[Decision]:
        """At step boundary ``step`` (every rank, every step): the decisions due now.

        At an agreement boundary this runs the exchange (a collective) first.
        """
        if is_agreement_step(step, self.every_steps):
            self._agree(step)
        due = [d for d in self.scheduled if d.step == step]
        if due:
            self.scheduled = [d for d in self.scheduled if d.step != step]
            for d in due:
                self.applied.append((step, d.decision_id))
                logger.info("rank %d step %d: applying decision %d: %s",
                            self.world_rank, step, d.decision_id, d)
        return due

    def _agree(self, step: int) -> None:
        mine = sorted(self.pending.values(), key=lambda d: d.decision_id)
        per_rank = self.exchange.exchange(newest_pending_id(mine), [d.to_dict() for d in mine])
        if not per_rank:
            return
        merged = merge_decisions(per_rank, self.agreed_ids)
        self.agreed_ids.update(d.decision_id for d in merged)
        for d in mine:  # everything any rank had pending is now agreed (or dropped everywhere)
            self.pending.pop(d.decision_id, None)
        self.scheduled.extend(schedule(merged, step))
        if merged:
            logger.info("rank %d step %d: agreed on decisions %s", self.world_rank, step,
                        [(d.decision_id, apply_step(d, step)) for d in merged])
