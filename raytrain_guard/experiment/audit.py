"""The exactly-once audit of one arm: the sample ids its ranks consumed over the lineage that
finished, step by step (standard library only).

Each rank writes, per micro-batch, the ids it consumed (``audit/rank<r>.jsonl``: ``step``,
``epoch``, ``ids``, ``attempt``); :func:`lineage` keeps each step as the last attempt ran it, and
:func:`audit_arm` checks every step of it: the count per step and rank, and the ids themselves
against the sampler's order when ``epoch_order`` gives it. The rules: docs/experiment.md ("The
audit of the samples consumed"). Nothing checked is "not audited": every figure None, never 0.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

#: what the table shows for a figure that was not audited
NOT_AUDITED = "not audited"


@dataclass(frozen=True)
class AuditResult:
    """What the audit of one arm found; every figure None when nothing could be checked."""

    samples_audited: int | None = None      # sample positions checked
    samples_lost: int | None = None
    samples_repeated: int | None = None
    samples_misplaced: int | None = None    # None also without the sampler's order
    global_batch: int | None = None         # ids consumed per step, all ranks: most steps'
    global_batch_min: int | None = None
    global_batch_max: int | None = None
    audit: str = ""                         # what was checked, or why nothing was

    @classmethod
    def not_audited(cls, why: str) -> AuditResult:
        return cls(audit=f"{NOT_AUDITED}: {why}")

    @property
    def audited(self) -> bool:
        return self.samples_audited is not None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def lineage(audit: Sequence[Mapping[str, Any]], order: Sequence[str]
            ) -> dict[int, tuple[int, list[Any]]]:
    """{step: (epoch, ids)} of the lineage that finished: each step as the last attempt that ran
    it ran it (``order``: the rank's attempt ids in the order they started; an attempt not in it
    counts as the earliest). The micro-batches of one attempt's step are joined."""
    rank_of = {a: i for i, a in enumerate(order)}
    by_step: dict[int, tuple[int, int, list[Any]]] = {}
    for rec in audit:
        key = rank_of.get(rec.get("attempt"), -1)
        step = int(rec["step"])
        known = by_step.get(step)
        if known is None or key > known[0]:
            by_step[step] = (key, int(rec.get("epoch", 0)), list(rec["ids"]))
        elif key == known[0]:
            known[2].extend(rec["ids"])
    return {step: (epoch, ids) for step, (_, epoch, ids) in by_step.items()}


def lost_steps(audit: Sequence[Mapping[str, Any]]) -> int:
    """Steps computed more than once (again after a restart), from one rank's audit."""
    runs = Counter(step for _attempt, step in {(r.get("attempt"), int(r["step"])) for r in audit})
    return sum(n - 1 for n in runs.values())


def audit_arm(audits: Mapping[int, Sequence[Mapping[str, Any]]],
              orders: Mapping[int, Sequence[str]], *, world_size: int, steps_done: int,
              num_samples: int | None, step_samples: Mapping[int, int] | None = None,
              epoch_order: Callable[[int], Sequence[Any]] | None = None,
              audit_dir: str = "audit") -> AuditResult:
    """The audit of steps ``0 .. steps_done - 1``. ``audits``/``orders``: per rank, its audit
    records and its attempt ids in start order. ``step_samples``: {step: micro_batch x
    grad_accum} from the trace (a step not in it: the most any rank consumed there).
    ``epoch_order``: the sampler's order of an epoch, of length ``num_samples``."""
    if steps_done <= 0:
        return AuditResult.not_audited("no step finished")
    silent = [r for r in range(world_size) if not audits.get(r)]
    if silent:
        files = ", ".join(os.path.join(audit_dir, f"rank{r}.jsonl") for r in silent)
        return AuditResult.not_audited(
            f"rank {', '.join(map(str, silent))} trained but recorded no sample ids ({files}; "
            "a dataset whose samples carry no id is not audited)")
    lines = {r: lineage(audits[r], orders.get(r, ())) for r in range(world_size)}
    steps = _steps(lines, range(steps_done), step_samples or {})
    tally = _Tally(world_size, num_samples, epoch_order)
    batches = []
    for i, (step, epoch, count) in enumerate(steps):
        if epoch != tally.epoch:
            tally.close(whole=tally.epoch is not None)   # the lineage went on to another epoch
            tally.open(epoch)
        ids = {r: lines[r][step][1] if step in lines[r] else [] for r in range(world_size)}
        tally.add(ids, count, last=i + 1 == len(steps) or steps[i + 1][1] != epoch)
        batches.append(sum(len(v) for v in ids.values()))
    tally.close(whole=bool(num_samples) and tally.position >= num_samples)
    modal = Counter(batches).most_common()
    basis = ("every step's ids on every rank against the sampler's order"
             if epoch_order is not None else
             "per-step counts per rank and no id twice in an epoch (no sampler order)")
    return AuditResult(
        samples_audited=tally.audited, samples_lost=tally.lost,
        samples_repeated=tally.repeated,
        samples_misplaced=tally.misplaced if epoch_order is not None else None,
        global_batch=max(modal, key=lambda bc: (bc[1], bc[0]))[0],
        global_batch_min=min(batches), global_batch_max=max(batches),
        audit=f"{steps_done} steps: {basis}")


def _steps(lines: Mapping[int, Mapping[int, tuple[int, list[Any]]]], steps: range,
           step_samples: Mapping[int, int]) -> list[tuple[int, int, int]]:
    """(step, epoch, samples a rank should consume before the epoch's end clips it) per step.
    A step no rank recorded (a gap) takes the epoch and count of the nearest step before it
    (after it, for the first)."""
    known: dict[int, tuple[int, int]] = {}
    for step in steps:
        got = [line[step] for line in lines.values() if step in line]
        if got:
            epoch = Counter(e for e, _ in got).most_common(1)[0][0]
            count = step_samples.get(step) or max(len(ids) for _, ids in got)
            known[step] = (epoch, count)
    out = []
    for step in steps:
        near = known.get(step)
        if near is None:
            before = [s for s in known if s < step]
            after = [s for s in known if s > step]
            near = known[max(before)] if before else known[min(after)] if after else (0, 0)
        out.append((step, *near))
    return out


class _Tally:
    """Running figures of :func:`audit_arm`, one epoch at a time."""

    def __init__(self, world_size: int, num_samples: int | None,
                 epoch_order: Callable[[int], Sequence[Any]] | None) -> None:
        self.world, self.n = world_size, num_samples
        self.epoch_order = epoch_order
        self.epoch: int | None = None
        self.order: Sequence[Any] | None = None
        self.position = 0
        self.audited = self.lost = self.repeated = self.misplaced = 0
        self.seen: Counter = Counter()
        self.expected: Counter = Counter()
        self.foreign = self.short = 0

    def open(self, epoch: int) -> None:
        self.epoch, self.position = epoch, 0
        self.order = self.epoch_order(epoch) if self.epoch_order is not None else None
        self.seen, self.expected = Counter(), Counter()
        self.foreign = self.short = 0

    def add(self, ids: Mapping[int, Sequence[Any]], count: int, *, last: bool) -> None:
        """One step: every rank's ids; ``count``, what a rank should consume, is clipped at the
        epoch's end to what the sampler leaves each rank (without ``N``: the most consumed)."""
        w = self.world
        if self.n:
            count = max(0, min(count, -(-self.n // w) - self.position // w))
        elif last:
            count = min(count, max(len(got) for got in ids.values()))
        for r, got in ids.items():
            self.seen.update(got)
            if self.order is not None:
                n = len(self.order)     # positions past the end wrap: the sampler's padding
                want = [self.order[(self.position + r + w * i) % n] for i in range(count)]
                self.expected.update(want)
                self.foreign += sum((Counter(got) - Counter(want)).values())
            else:
                self.short += max(0, count - len(got))
        self.audited += count * w
        self.position += count * w

    def close(self, *, whole: bool) -> None:
        """Fold the open epoch into the totals; ``whole``: the lineage finished it."""
        if self.epoch is None:
            return
        if self.order is not None:
            repeated = sum((self.seen - self.expected).values())
            self.lost += sum((self.expected - self.seen).values())
            self.repeated += repeated
            self.misplaced += self.foreign - repeated
            return
        extra = sum(c - 1 for c in self.seen.values() if c > 1)
        padding = (-self.n) % self.world if whole and self.n else 0
        self.repeated += max(0, extra - padding)
        self.lost += max(self.short, self.n - len(self.seen)) if whole and self.n \
            else self.short
