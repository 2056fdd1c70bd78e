"""Where a GuardedDataLoader stands in its epoch, and its resume state: the dict it saves and
how a saved one is read back, on any world size or batch size."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from raytrain_guard.errors import InputError

logger = logging.getLogger(__name__)

ORDER_KEYS = ("seed", "shuffle", "drop_last")   # with the epoch, they fix its permutation


@dataclass
class EpochPosition:
    """The epoch, and the position in its permutation (samples of all ranks together, so it
    does not depend on the world size or the batch size) where the current iterator started,
    plus the batches this rank delivered before it and since."""

    num_samples: int
    samples_per_batch: int          # batch_size x world_size: one batch on every rank
    epoch: int = 0
    start: int = 0
    batches_before: int = 0
    batches_in_iter: int = 0
    started: bool = False           # an epoch began (iterated or restored)

    @property
    def samples_consumed(self) -> int:
        """The position the loop reached: batches fetched ahead are not counted."""
        consumed = self.batches_in_iter * self.samples_per_batch
        return min(self.num_samples, self.start + consumed)

    @property
    def batches_consumed(self) -> int:
        """Batches this rank delivered in the current epoch (resumed ones included)."""
        return self.batches_before + self.batches_in_iter

    def rebase(self) -> None:
        """A new iterator starts where the loop is."""
        self.start = self.samples_consumed
        self.batches_before += self.batches_in_iter
        self.batches_in_iter = 0

    def move_to(self, epoch: int, start: int = 0, batches_before: int = 0) -> None:
        """Stand at ``start`` of ``epoch`` (0: its beginning)."""
        self.epoch = epoch
        self.start = min(self.num_samples, start)
        self.batches_before = batches_before
        self.batches_in_iter = 0


def resume_state(pos: EpochPosition, order: dict[str, Any], *, batch_size: int,
                 world_size: int) -> dict[str, Any]:
    """The state to save: enough to continue with no sample lost or repeated."""
    return {"epoch": pos.epoch, "batches_consumed": pos.batches_consumed,
            "samples_consumed": pos.samples_consumed, **order, "num_samples": pos.num_samples,
            "batch_size": batch_size, "world_size": world_size}


def saved_position(state: dict[str, Any], *, num_samples: int, batch_size: int,
                   world_size: int) -> tuple[int, int, int]:
    """(epoch, samples consumed, batches consumed) of a saved state, checked against this
    dataset. A state without ``samples_consumed`` counts it from its batches and the batch and
    world size it was saved with."""
    for key in ("epoch", "batches_consumed"):
        if key not in state:
            raise InputError(f"state_dict[{key!r}]", "missing", value=sorted(state),
                             fix="pass a dict from GuardedDataLoader.state_dict()")
    if state.get("num_samples", num_samples) != num_samples:
        raise InputError("state_dict['num_samples']", "differs from this dataset's length "
                         f"{num_samples}", value=state["num_samples"],
                         fix="resume with the dataset the state was saved with")
    position = state.get("samples_consumed")
    if position is None:
        position = (int(state["batches_consumed"]) * int(state.get("batch_size", batch_size))
                    * int(state.get("world_size", world_size)))
    return int(state["epoch"]), int(position), int(state["batches_consumed"])


def saved_order(state: dict[str, Any], order: dict[str, Any], world_rank: int) -> dict[str, Any]:
    """The seed, shuffle and drop_last to continue with: the saved ones, so the epoch's order
    matches; each that differs from ``order`` (this loader's) is warned of."""
    resumed = dict(order)
    for key in ORDER_KEYS:
        if key in state and state[key] != order[key]:
            logger.warning("rank %d: resuming with the saved %s=%r instead of %r, so the epoch "
                           "order matches", world_rank, key, state[key], order[key])
            resumed[key] = state[key]
    return resumed
