"""Decisions are values: what to do, at which step, and why (pure)."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from raytrain_guard.errors import InputError


class Action(str, enum.Enum):
    """What a decision asks the adapters to do."""

    RELEASE_CACHE = "release_cache"          # free cached allocator blocks (empty_cache / gc)
    CHECKPOINT = "checkpoint"                # save a checkpoint now, then carry on
    CHECKPOINT_AND_STOP = "checkpoint_and_stop"  # save, then stop cleanly before an OOM
    SHRINK_MICRO_BATCH = "shrink_micro_batch"    # params: micro_batch, grad_accum (global kept)
    SET_PREFETCH = "set_prefetch"            # params: device_prefetch_depth / prefetch_factor
    PACE = "pace"                            # params: delay_s (seed's throttle; off by default)
    SLOW_STEP = "slow_step"                  # event: consecutive slow steps, with a cause
    FLAG_STRAGGLER = "flag_straggler"        # event: a rank/node is the straggler; drain it


class Cause(str, enum.Enum):
    """Which resource a slow step or a decision is attributed to."""

    DATA = "data"
    COMPUTE = "compute"
    COMMUNICATION = "communication"
    DEVICE_MEMORY = "device_memory"
    HOST_MEMORY = "host_memory"
    THERMAL = "thermal"
    UNKNOWN = "unknown"


CLUSTER_WIDE_ACTIONS = frozenset({Action.SHRINK_MICRO_BATCH})
"""Actions every rank applies together (scope ``"cluster"``): a shrink's loaders agree in one
collective of all ranks, which ranks left out would never join."""


def scope_refusal(action: Action, scope: str) -> str | None:
    """Why ``action`` cannot be decided for ``scope``, or None (pure). Example:
    (SHRINK_MICRO_BATCH, "node:n2") -> refused; (SHRINK_MICRO_BATCH, "cluster") -> None."""
    if action in CLUSTER_WIDE_ACTIONS and scope != "cluster":
        return (f"a {action.value} is for every rank together (scope 'cluster'), not "
                f"{scope!r}: its loaders agree in one collective of all ranks, which the ranks "
                f"left out would never join")
    return None


@dataclass(frozen=True)
class Decision:
    """One action with its reason. ``step``: the boundary every rank concerned applies it at
    (None: the next one of the rank that made it). ``scope``: ``"rank"``, ``"node:<id>"`` or
    ``"cluster"`` (a shrink's only: :func:`scope_refusal`, an InputError otherwise).
    ``predicted``: ``core.effects.Effect.to_dict()`` (None: unpriced); ``measured``:
    ``core.effects.Measured.to_dict()`` with its ``verdict`` (hit, miss, not_judged), once
    the coordinator measured it."""

    action: Action
    reason: str
    step: int | None = None
    cause: Cause = Cause.UNKNOWN
    scope: str = "rank"
    params: Mapping[str, Any] = field(default_factory=dict)
    decision_id: int = 0
    predicted: Mapping[str, Any] | None = None
    measured: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        refusal = scope_refusal(self.action, self.scope)
        if refusal is not None:
            raise InputError("scope", refusal, value=self.scope,
                             fix=f"decide a {self.action.value} with scope 'cluster'")

    def at(self, step: int) -> Decision:
        """The same decision, scheduled at ``step``."""
        return dataclasses.replace(self, step=step, params=dict(self.params))

    def concerns(self, node_id: str) -> bool:
        """Whether the ranks of node ``node_id`` act on it: a ``node:<id>`` decision only
        there; rank and cluster decisions everywhere."""
        return not self.scope.startswith("node:") or self.scope[len("node:"):] == node_id

    def to_dict(self) -> dict[str, Any]:
        return {"action": self.action.value, "reason": self.reason, "step": self.step,
                "cause": self.cause.value, "scope": self.scope, "params": dict(self.params),
                "decision_id": self.decision_id,
                "predicted": None if self.predicted is None else dict(self.predicted),
                "measured": None if self.measured is None else dict(self.measured)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Decision:
        predicted, measured = d.get("predicted"), d.get("measured")
        return cls(Action(d["action"]), str(d["reason"]), d.get("step"),
                   Cause(d.get("cause", "unknown")), str(d.get("scope", "rank")),
                   dict(d.get("params", {})), int(d.get("decision_id", 0)),
                   None if predicted is None else dict(predicted),
                   None if measured is None else dict(measured))

    def __str__(self) -> str:
        when = f" at step {self.step}" if self.step is not None else ""
        return f"{self.action.value}{when} [{self.scope}]: {self.reason}"


def due_at(step: int, pending: list[Decision], polled: Any) -> tuple[list[Decision],
                                                                    list[Decision]]:
    """``(due, still_pending)`` at the boundary after ``step`` steps: the pending decisions
    whose step has come, then the newly ``polled`` ones due now; those for a later step wait
    (pure)."""
    due = [d for d in pending if d.step is not None and d.step <= step]
    waiting = [d for d in pending if d not in due]
    for decision in polled or ():
        (waiting if decision.step is not None and decision.step > step else due).append(decision)
    return due, waiting
