"""A DistributedSampler that can start an epoch part-way through (resume without re-reading).

Exactly-once contract, per epoch (``N`` samples, ``W`` ranks):

* The epoch order is one permutation of ``range(N)``, from ``seed + epoch`` exactly as in
  :class:`torch.utils.data.DistributedSampler` (a loader that never resumes gives the very
  same indices on every rank as a plain DistributedSampler would).
* Rank ``r`` takes every ``W``-th position starting at ``r``. So after every rank has consumed
  ``k`` batches of ``B`` samples, the samples consumed by the whole job are exactly the first
  ``k * B * W`` positions of the permutation: that one number (``start``) is the whole resume
  state, and it stays valid when the job resumes with another world size or batch size.
* ``drop_last=False``: the remaining positions are padded to a multiple of ``W`` with the head
  of the permutation (as DistributedSampler does), so every rank gets the same number of
  samples and the same number of steps. Those ``pad = (-(N - start)) % W`` samples (fewer than
  ``W``) are delivered twice in that epoch; :attr:`num_padding` says how many. The union of the
  shards is the dataset plus these documented duplicates.
* ``drop_last=True``: the remainder is cut to a multiple of ``W`` (at most ``W - 1`` samples
  skipped, different ones each epoch because the permutation changes); no sample repeats.

Skipping happens on the index list (integers), never by loading and discarding samples.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized

import torch
from torch.utils.data import DistributedSampler


class ResumableDistributedSampler(DistributedSampler):
    """:class:`DistributedSampler` plus :meth:`set_start` (the first epoch position to deliver)."""

    def __init__(self, dataset: Sized, *, num_replicas: int, rank: int, shuffle: bool = True,
                 seed: int = 0, drop_last: bool = False) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle,
                         seed=seed, drop_last=drop_last)
        self.start = 0

    def set_start(self, start: int) -> None:
        """Deliver, from the next ``iter()``, the epoch permutation from position ``start`` on."""
        self.start = max(0, min(int(start), len(self.dataset)))  # type: ignore[arg-type]

    @property
    def num_remaining(self) -> int:
        """Positions of the permutation still to deliver this epoch, all ranks together."""
        return len(self.dataset) - self.start  # type: ignore[arg-type]

    @property
    def num_padding(self) -> int:
        """Samples delivered twice this epoch to equalize the shards (0 with drop_last)."""
        return 0 if self.drop_last else (-self.num_remaining) % self.num_replicas

    @property
    def num_dropped(self) -> int:
        """Samples not delivered this epoch because of drop_last (fewer than num_replicas)."""
        return self.num_remaining % self.num_replicas if self.drop_last else 0

    def __len__(self) -> int:
        if self.drop_last:
            return self.num_remaining // self.num_replicas
        return -(-self.num_remaining // self.num_replicas)

    def epoch_permutation(self) -> list[int]:
        """The order of this epoch, all ranks together (identical to DistributedSampler's)."""
        n = len(self.dataset)  # type: ignore[arg-type]
        if not self.shuffle:
            return list(range(n))
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        return torch.randperm(n, generator=g).tolist()

    def __iter__(self) -> Iterator[int]:
        perm = self.epoch_permutation()
        rest = perm[self.start:]
        if self.drop_last:
            rest = rest[:len(rest) - self.num_dropped]
        else:
            pad = self.num_padding
            while pad > 0:  # the head of the permutation, repeated if N < pad
                chunk = perm[:pad]
                rest += chunk
                pad -= len(chunk)
        return iter(rest[self.rank::self.num_replicas])
