"""Where a GuardedDataLoader stands in its epoch: what its resume state is made of."""

from __future__ import annotations

from dataclasses import dataclass


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
