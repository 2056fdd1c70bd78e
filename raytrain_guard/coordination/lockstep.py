"""Lockstep: every rank applies every cluster decision at the same step boundary.

Every ``lockstep_every_steps`` steps the ranks agree on the newest pending decision id in one
24-byte control-plane round, exchange their pending decisions only when some rank has one,
merge them in rank order and schedule each at :func:`apply_step`. The collective is one
method, :meth:`ProcessGroupExchange.exchange`. Why, step by step: docs/coordination.md.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from raytrain_guard.coordination.control_plane import (
    NO_DECISION,
    ControlPlane,
    shared_control_plane,
)
from raytrain_guard.core.decisions import Decision
from raytrain_guard.errors import check_int

logger = logging.getLogger(__name__)

# -- pure part ---------------------------------------------------------------------------------

def is_agreement_step(step: int, every_steps: int) -> bool:
    """The ranks agree at every multiple of ``every_steps``."""
    return step % every_steps == 0


def apply_step(decision: Decision, agreed_at: int) -> int:
    """The step every rank applies ``decision`` at, agreed at boundary ``agreed_at``: the
    coordinator's step when still ahead, else the agreement boundary itself."""
    if decision.step is not None and decision.step > agreed_at:
        return int(decision.step)
    return agreed_at


def newest_pending_id(pending: Iterable[Decision]) -> int:
    """This rank's contribution to the ``all_reduce(MAX)``."""
    return max((d.decision_id for d in pending), default=NO_DECISION)


def merge_decisions(per_rank: Sequence[Sequence[Mapping[str, Any]]],
                    agreed_ids: frozenset[int] | set[int] = frozenset()) -> list[Decision]:
    """Union of the ranks' pending decisions (``per_rank[r]``: rank ``r``'s dicts), ordered by
    id, the same on every rank: the lowest rank's copy wins; agreed ids and unreadable entries
    are dropped."""
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
        """Every rank's pending list, in rank order (``[]`` when nobody had any)."""


class SingleRankExchange:
    """The exchange of a world of one rank: nothing to share."""

    def exchange(self, newest_id: int,
                 pending: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
        return [pending]


class ProcessGroupExchange:
    """The exchange over ``torch.distributed``: the newest-id round on ``plane`` (default: the
    shared control plane), then the pending lists over its gloo group."""

    def __init__(self, plane: ControlPlane | None = None) -> None:
        self.plane = plane

    def exchange(self, newest_id: int,
                 pending: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
        """The one method that touches ``torch.distributed``: ``all_gather_object`` only when
        some rank has a pending decision."""
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
    """One rank's side of the agreement: ``offer()`` the decisions this rank fetched,
    ``poll(step)`` at every boundary; ``applied``: the log of ``(step, decision_id)``."""

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
        """Held until the next agreement boundary."""
        for d in decisions:
            if d.decision_id not in self.agreed_ids:
                self.pending.setdefault(d.decision_id, d)

    def poll(self, step: int) -> list[Decision]:
        """The decisions due at boundary ``step``."""
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
