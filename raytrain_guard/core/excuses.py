"""What makes a slow step not this rank's slowdown (pure): the step gate's excuses.

A step over the gate's line may have been slowed by something the rank's device, link or data
did not do. :class:`SlowStepExcuses` tells three such steps apart, each from figures the step
carries (:class:`~raytrain_guard.core.steps.StepStats`), and the gate counts none of them toward
a run of slow steps (docs/train_loop.md, "The gate's rules"):

- **host**: the training thread waited for a CPU (``cpu_wait_s``: runnable, not running) for
  ``slow_step_host_wait_frac`` of the step's excess or more; for a step slow in communication,
  the wait of the node peer that waited most (``peer_cpu_wait_s``) adds to it;
- **aftermath**: one of the ``slow_step_host_settle_steps`` steps after a host-starved one, no
  slower than ``slow_step_factor`` x it (cold caches, the starved rank's catch-up);
- **peer**: a step slow in communication while a node peer did more work in it
  (``peer_work_s``: its time less its communication wait) than this rank by
  ``slow_step_peer_work_frac`` of the excess: this rank waited for that one, whose own gate
  judges it.

Example (median step 10 ms, a step of 30 ms, 20 ms of excess, frac 0.5): a thread that waited
12 ms over its usual wait for a CPU is the host's (12 >= 10); the next 3 steps up to 45 ms are
its aftermath. Slow in communication with 4 ms waited here and 7 ms by a node peer: 11 >= 10,
the host's. With a node peer that worked 10 ms more than this rank: the peer's.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

from raytrain_guard.config import GuardConfig
from raytrain_guard.core.decisions import Cause
from raytrain_guard.core.stats import nearest_rank
from raytrain_guard.core.steps import StepStats

__all__ = ["Excuse", "SlowStepExcuses", "cpu_waited_s", "usual_cpu_waits"]

_WAITS = ("cpu_wait_s", "peer_cpu_wait_s")


USUAL_WAIT_QUANTILE = 0.25
"""Where in the window's waits for a CPU the usual one lies. The waits are read only on the
steps over the gate's quiet bound (the slower ones, whose waits run high), so their median
overstates a typical step's wait and the host rule then missed starved steps by a fraction of
a millisecond: replayed over 122 clean 600-step arms, the lower quartile gives 8 slow-step
events against the median's 10, and names every one of 96 fault arms at the same step."""


def usual_cpu_waits(window: Sequence[StepStats]) -> dict[str, float]:
    """This thread's and the node peer's usual wait for a CPU: the ``USUAL_WAIT_QUANTILE`` of
    each one over the window's steps that carry it (0 where none does)."""
    usual = {}
    for name in _WAITS:
        waits = sorted(w for s in window if (w := getattr(s, name)) is not None)
        usual[name] = nearest_rank(waits, USUAL_WAIT_QUANTILE) if waits else 0.0
    return usual


def cpu_waited_s(stats: StepStats, usual: dict[str, float], with_peer: bool) -> float:
    """How much longer than usual (:func:`usual_cpu_waits`) the step's thread waited for a
    CPU, with the node peer's wait added when ``with_peer`` (a step slow in communication:
    this rank waited for that one in the collective, after its own work was late by its own
    wait)."""
    waited_s = 0.0
    for name in _WAITS if with_peer else _WAITS[:1]:
        wait_s = getattr(stats, name)
        if wait_s is not None:
            waited_s += max(0.0, wait_s - usual[name])
    return waited_s


class Excuse(str, enum.Enum):
    HOST = "host"
    AFTERMATH = "aftermath"
    PEER = "peer"


class SlowStepExcuses:
    """The excuses of one rank's slow steps, and the aftermath of the last host-starved one."""

    def __init__(self, config: GuardConfig) -> None:
        self.config = config
        #: slow steps the host's contention or its aftermath explains
        self.num_host_starved = 0
        #: slow steps in communication that waited for a rank of the node that worked longer
        self.num_waited_for_peer = 0
        self._host_until = 0                  # steps before this one follow a starved one
        self._host_total_s = 0.0              # the total_s of that starved step

    def judge(self, stats: StepStats, cause: Cause | None, window: Sequence[StepStats],
              median_s: float) -> Excuse | None:
        """The excuse of a slow step (None: it is this rank's). ``window``: the gate's recent
        steps; ``median_s``: their median step."""
        cfg = self.config
        if self._host_starved(stats, cause, window, median_s):
            self._host_until = stats.step + 1 + cfg.slow_step_host_settle_steps
            self._host_total_s = stats.total_s
            self.num_host_starved += 1
            return Excuse.HOST
        if (stats.step < self._host_until
                and stats.total_s <= cfg.slow_step_factor * self._host_total_s):
            self.num_host_starved += 1
            return Excuse.AFTERMATH
        if cause is Cause.COMMUNICATION and self._waited_for_peer(stats, median_s):
            self.num_waited_for_peer += 1
            return Excuse.PEER
        return None

    def note_settling(self, stats: StepStats, cause: Cause, window: Sequence[StepStats],
                      median_s: float) -> None:
        """A step the gate does not judge (it settles after a pause) that the host starved
        starts the aftermath all the same: a checkpoint's contention often outlasts the
        settling steps. ``cause``: the part of the step that grew most."""
        if (stats.total_s > self.config.slow_step_factor * median_s
                and self._host_starved(stats, cause, window, median_s)):
            self._host_until = stats.step + 1 + self.config.slow_step_host_settle_steps
            self._host_total_s = stats.total_s

    def _line_s(self, frac: float, stats: StepStats, median_s: float) -> float:
        """``frac`` of the step's excess over the median, the floor at least (a step slow by
        its parts may have grown less)."""
        return frac * max(stats.total_s - median_s, self.config.slow_step_floor_s)

    def _host_starved(self, stats: StepStats, cause: Cause | None,
                      window: Sequence[StepStats], median_s: float) -> bool:
        """Whether the step waited for a CPU longer than usual (:func:`cpu_waited_s`, the node
        peer's wait added for a step slow in communication) by the line."""
        frac = self.config.slow_step_host_wait_frac
        if frac <= 0:
            return False
        waited_s = cpu_waited_s(stats, usual_cpu_waits(window), cause is Cause.COMMUNICATION)
        return waited_s >= self._line_s(frac, stats, median_s)

    def _waited_for_peer(self, stats: StepStats, median_s: float) -> bool:
        """Whether a node peer did more work in the step than this rank (its time less its
        communication wait) by the line."""
        frac = self.config.slow_step_peer_work_frac
        if frac <= 0 or stats.peer_work_s is None:
            return False
        own_s = stats.total_s - stats.comm_wait_s
        return stats.peer_work_s - own_s >= self._line_s(frac, stats, median_s)
