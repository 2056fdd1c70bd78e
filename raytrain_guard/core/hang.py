"""Which rank hung: the coordinator's rule over the ranks' watchdog records (pure).

When one rank blocks, every other rank blocks in the next collective that waits for it, and
every rank's watchdog fires, each naming itself. :func:`name_hung_rank` names the hung rank of
an attempt from their :class:`HangRecord` values (step, phase and time in it, last progress,
whether the thread was inside ``torch.distributed``), or lists the suspects when it cannot
tell. The rules, why each holds, and a worked example: docs/coordination.md ("Hangs").
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from raytrain_guard.core.view import short_node_id
from raytrain_guard.errors import check_int

#: a step's phases in order, as the train loop tells the watchdog: a rank that stopped in an
#: earlier phase than another stopped first (the other went on until a collective held it)
PHASE_ORDER = {"data": 0, "forward": 1, "backward": 2, "optimizer": 3}

#: phases whose wait is a collective under DDP: backward holds the all-reduce of the
#: gradients; the optimizer step's start waits for it (ZeRO-1 also broadcasts there)
WAITING_PHASES = frozenset({"backward", "optimizer"})

SETTLE_S = 5.0
"""Seconds after the first record until a silent rank counts as silent: the watchdogs fire
within about 0.5 s of each other and each sends within 1.5 s; 5 s leaves room for a loaded
coordinator."""

TIE_S = 0.05
"""Last-progress times closer than this are a tie (two nodes' clocks, NTP, are rarely
closer)."""


@dataclass(frozen=True)
class HangRecord:
    """One rank's watchdog record. ``in_collective``: its training thread was inside
    ``torch.distributed`` (None: not sampled); ``where``: its innermost frame; ``world_size``:
    the attempt's ranks, when known."""

    world_rank: int
    step: int
    phase: str
    phase_for_s: float
    step_for_s: float
    last_progress_wall: float
    node_id: str = ""
    world_size: int | None = None
    in_collective: bool | None = None
    where: str = ""

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> HangRecord:
        """From the watchdog's dict; ValueError naming the field when it is unusable."""
        def number(key: str) -> float:
            v = d.get(key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                    or v < 0:
                raise ValueError(f"hang record {key} must be a finite number >= 0, got {v!r}")
            return float(v)

        def integer(key: str, v: Any) -> int:
            return check_int(f"hang record {key}", v)

        world_size = d.get("world_size")
        in_collective = d.get("in_collective")
        if in_collective is not None and not isinstance(in_collective, bool):
            raise ValueError(f"hang record in_collective must be a bool, got {in_collective!r}")
        return cls(world_rank=integer("world_rank", d.get("world_rank")),
                   step=integer("step", d.get("step")), phase=str(d.get("phase", "")),
                   phase_for_s=number("phase_for_s"), step_for_s=number("step_for_s"),
                   last_progress_wall=number("last_progress_wall"),
                   node_id=str(d.get("node_id") or ""),
                   world_size=None if world_size is None else
                   integer("world_size", world_size),
                   in_collective=in_collective, where=str(d.get("where") or ""))

    @property
    def looks_waiting(self) -> bool:
        """Blocked in a collective by what it says: its stack was in ``torch.distributed``,
        or it is past its forward (:data:`WAITING_PHASES`)."""
        return self.in_collective is True or self.phase in WAITING_PHASES

    def describe(self) -> str:
        """``rank 0 in backward of step 40 for 9.8 s (in torch.distributed)``."""
        inside = " (in torch.distributed)" if self.in_collective else ""
        return (f"rank {self.world_rank} in {self.phase} of step {self.step} for "
                f"{self.phase_for_s:.1f} s{inside}")


@dataclass(frozen=True)
class HungRank:
    """The verdict on one attempt's hang; ``world_rank`` None: no single rank can be named
    (``suspects``). ``basis``: the rule that decided (``silent``, ``not_in_collective``,
    ``earliest_step``, ``earliest_phase``, ``earliest_progress``, ``only_report``, ``tie``)."""

    world_rank: int | None
    node_id: str | None
    step: int | None
    phase: str | None
    basis: str
    reason: str
    settled: bool
    reported: tuple[int, ...]
    silent: tuple[int, ...]
    suspects: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"world_rank": self.world_rank, "node_id": self.node_id, "step": self.step,
                "phase": self.phase, "basis": self.basis, "reason": self.reason,
                "settled": self.settled, "reported": list(self.reported),
                "silent": list(self.silent), "suspects": list(self.suspects)}


def name_hung_rank(records: Iterable[HangRecord], expected_ranks: Iterable[int] = (), *,
                   waited_s: float = 0.0, settle_s: float = SETTLE_S, tie_s: float = TIE_S,
                   nodes: Mapping[int, str] | None = None) -> HungRank | None:
    """The hung rank of one attempt from its ranks' watchdog records; None without records.

    Rules, in order (docs/coordination.md gives why): 1. every reporter looks blocked in a
    collective and exactly one rank never reported: that one (``silent``); 2. when some
    reporters were inside ``torch.distributed`` and some not, the suspects are those not
    (``not_in_collective``); 3. the suspect at the earliest step, then phase
    (:data:`PHASE_ORDER`), then last progress; 4. suspects at one step and phase whose last
    progress is within ``tie_s``: no rank named (``tie``). Settled once every rank reported or
    ``settle_s`` after the first record.

    ``expected_ranks``: the attempt's ranks as the coordinator knows them (those that reported
    steps); ``range(world_size)`` of any record is added. ``waited_s``: time since the first
    record arrived. ``nodes``: rank -> node id, for a silent rank's node.
    """
    by_rank = {r.world_rank: r for r in records}
    if not by_rank:
        return None
    expected = set(expected_ranks) | set(by_rank)
    for r in by_rank.values():
        if r.world_size:
            expected |= set(range(r.world_size))
    reported = tuple(sorted(by_rank))
    silent = tuple(sorted(expected - set(by_rank)))
    settled = not silent or waited_s >= settle_s
    pending = "" if settled else (f" (provisional: rank(s) {list(silent)} may still report, "
                                  f"for {max(0.0, settle_s - waited_s):.1f} s more)")
    reps = [by_rank[r] for r in reported]
    others = "; ".join(r.describe() for r in reps)

    if silent and all(r.looks_waiting for r in reps):
        step = min(r.step for r in reps)
        if len(silent) == 1:
            rank = silent[0]
            node = (nodes or {}).get(rank) or None
            return HungRank(rank, node, step, None, "silent",
                            f"rank {rank}{_on(node)} is the hung rank: it never reported while "
                            f"every other rank's watchdog did, each blocked in a collective "
                            f"waiting for it ({others}){pending}",
                            settled, reported, silent, silent)
        return HungRank(None, None, step, None, "silent",
                        f"cannot tell which rank hung: ranks {list(silent)} never reported "
                        f"while the others wait in a collective ({others}){pending}",
                        settled, reported, silent, silent)

    suspects = reps
    filtered = False
    if any(r.in_collective is True for r in reps) and not all(
            r.in_collective is True for r in reps):
        suspects = [r for r in reps if r.in_collective is not True]
        filtered = True

    def key(r: HangRecord) -> tuple[int, int, float]:
        return r.step, PHASE_ORDER.get(r.phase, len(PHASE_ORDER)), r.last_progress_wall

    suspects = sorted(suspects, key=key)
    first = suspects[0]
    tied = [r for r in suspects if r.step == first.step and r.phase == first.phase
            and r.last_progress_wall - first.last_progress_wall <= tie_s]
    if len(tied) > 1:
        ranks = tuple(r.world_rank for r in tied)
        return HungRank(None, None, first.step, first.phase, "tie",
                        f"cannot tell which rank hung: ranks {list(ranks)} are all in "
                        f"{first.phase} of step {first.step}, their last progress within "
                        f"{tie_s:g} s of each other ({others}){pending}",
                        settled, reported, silent, ranks)
    rest = [r for r in reps if r is not first]
    if filtered:
        basis, why = "not_in_collective", "it is the one not inside torch.distributed"
    elif not rest:
        basis, why = "only_report", "it is the only rank that reported"
    else:
        second = suspects[1]
        if second.step != first.step:
            basis, why = "earliest_step", "it stopped at the earliest step"
        elif PHASE_ORDER.get(second.phase) != PHASE_ORDER.get(first.phase):
            basis, why = "earliest_phase", "it stopped earliest in its step"
        else:
            basis, why = "earliest_progress", "its last progress is the earliest"
    waiting = (f"; the others wait for it: {'; '.join(r.describe() for r in rest)}"
               if rest else "")
    node = first.node_id or (nodes or {}).get(first.world_rank) or None
    return HungRank(first.world_rank, node, first.step, first.phase, basis,
                    f"rank {first.world_rank}{_on(node)} is the hung rank: stuck in "
                    f"{first.phase} of step {first.step} for {first.phase_for_s:.1f} s "
                    f"({first.step_for_s:.1f} s into the step"
                    + (f", at {first.where}" if first.where else "") + f"): {why}{waiting}"
                    + (f"; rank(s) {list(silent)} did not report" if silent else "")
                    + pending,
                    settled, reported, silent, (first.world_rank,))


def _on(node: str | None) -> str:
    """`` (node a1b2c3d4...)``, or nothing without a node."""
    return f" (node {short_node_id(node)})" if node else ""
