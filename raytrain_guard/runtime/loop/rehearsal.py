"""The loop's seam for a rehearsal (``LoopConfig.rehearsal``): :class:`Rehearsal`, whose hooks
do nothing. The experiment's (:mod:`raytrain_guard.experiment.rehearsal`) injects its faults
through them. A plain run has none, and the loop calls no hook."""

from __future__ import annotations

from typing import Any


class Rehearsal:
    """The hooks the loop calls where a rehearsal is set, in the order of a run.

    ``card``: a card that prices micro-batches and counts their memory (a simulated one on a
    CPU), None: the loop's own (CUDA's allocator). ``marks``: an object whose
    ``on_mark(step, phase)`` the step guard calls before each phase mark (injected delays),
    None: none. ``num_applied``: the faults applied so far (the results' ``faults_applied``).
    """

    card: Any = None
    marks: Any = None
    num_applied = 0

    def probe(self) -> Any:
        """The memory probe that reads :attr:`card`; None: the loop's own probe."""
        return None

    def wrap_dataset(self, dataset: Any) -> Any:
        return dataset

    def attach(self, model: Any) -> None:
        """The model, before it is wrapped (a device-time hook, say)."""

    def measure(self, module: Any, optimizer: Any) -> None:
        """The wrapped model and its optimizer (the card counts their state)."""

    def comm_hook(self) -> Any:
        """A DDP communication hook to time (None: the plain allreduce)."""
        return None

    def delay_comm(self) -> None:
        """Called before each FSDP2 reduce-scatter."""

    def begin_step(self, step: int, probe: Any) -> None:
        """Step ``step`` starts; ``probe``: the rank's memory probe (None: none)."""

    def transform(self, batch: Any) -> Any:
        """A micro-batch before its forward."""
        return batch

    def after_backward(self, elapsed_s: float) -> None:
        """A micro-batch's forward and backward took ``elapsed_s``."""

    def close(self) -> None:
        """The run is over (or failed)."""
