"""Per-step timing and memory figures of one rank (pure)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True, init=False)
class StepStats:
    """What one rank measured for one training step (seconds and fractions).

    ``comm_wait_s``: the wait for gradient communication beyond compute (under DDP a straggler
    waits least). ``idle_before_s``: the loop's time between the previous step's close and
    this step's start (None: it started where the last ended). ``peer_work_s``: the most work
    (time less communication wait) another rank of this node did in the step (None: not
    measured). Their meaning in full: docs/train_loop.md ("Step timings").
    """

    step: int
    total_s: float
    data_wait_s: float = 0.0
    forward_s: float = 0.0
    backward_s: float = 0.0
    comm_wait_s: float = 0.0
    optimizer_s: float = 0.0
    memory_frac: float | None = None    # device (or CPU budget) memory fraction after the step
    world_rank: int = 0
    idle_before_s: float | None = None
    peer_work_s: float | None = None

    def __init__(self, step: int, total_s: float, data_wait_s: float = 0.0,
                 forward_s: float = 0.0, backward_s: float = 0.0, comm_wait_s: float = 0.0,
                 optimizer_s: float = 0.0, memory_frac: float | None = None,
                 world_rank: int = 0, idle_before_s: float | None = None,
                 peer_work_s: float | None = None) -> None:
        # The fields above, in their order, with their defaults (a test holds the two lists
        # together). One dict update instead of the frozen dataclass's eleven object.__setattr__
        # calls: one StepStats is built per training step, and this halves its cost.
        self.__dict__.update(step=step, total_s=total_s, data_wait_s=data_wait_s,
                             forward_s=forward_s, backward_s=backward_s,
                             comm_wait_s=comm_wait_s, optimizer_s=optimizer_s,
                             memory_frac=memory_frac, world_rank=world_rank,
                             idle_before_s=idle_before_s, peer_work_s=peer_work_s)

    @property
    def compute_s(self) -> float:
        """Forward + backward + optimizer, communication wait excluded."""
        return self.forward_s + self.backward_s + self.optimizer_s

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> StepStats:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})
