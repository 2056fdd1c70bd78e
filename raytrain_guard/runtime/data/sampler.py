"""A DistributedSampler that can start an epoch part-way through (resume without re-reading):
one number, the positions consumed by all ranks together, is the whole resume state, valid on
another world size or batch size. How the loader resumes with it: docs/train_loop.md ("The
guarded DataLoader").
"""

from __future__ import annotations

from collections.abc import Iterator, Sized

import torch
from torch.utils.data import DistributedSampler


class ResumableDistributedSampler(DistributedSampler):
    """:class:`DistributedSampler` plus :meth:`set_start` (the first epoch position to deliver).

    Exactly once per epoch (``N`` samples, ``W`` ranks): the order is DistributedSampler's
    permutation of ``range(N)`` from ``seed + epoch``, and rank ``r`` takes every ``W``-th
    position from ``r``, so after ``k`` batches of ``B`` on every rank the job consumed exactly
    the first ``k * B * W`` positions. ``drop_last=False`` pads the rest to a multiple of ``W``
    with the head of the permutation (:attr:`num_padding` samples, fewer than ``W``, come
    twice); ``drop_last=True`` cuts :attr:`num_dropped` (fewer than ``W``).
    """

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
        n, w = self.num_remaining, self.num_replicas
        return n // w if self.drop_last else -(-n // w)

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
