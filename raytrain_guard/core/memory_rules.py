"""The step gate's memory rules (pure): release cached blocks at the watermark, checkpoint and
stop at the critical line or ahead of it, pace while over the watermark."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from raytrain_guard.config import GuardConfig
from raytrain_guard.core.decisions import Action, Cause, Decision
from raytrain_guard.core.recent_steps import MIN_MEDIAN_POINTS
from raytrain_guard.core.stats import slope

Decide = Callable[..., Decision]   # (action, cause, reason, **params) -> a numbered Decision


def trend_ahead(readings: Sequence[float], steps: int, *,
                least: int = MIN_MEDIAN_POINTS) -> tuple[float, float] | None:
    """``(rise per step, fraction steps ahead)`` on the least-squares line through
    ``readings`` (one a step, the last the latest); None with fewer than ``least``."""
    if len(readings) < least:
        return None
    rise = slope(list(enumerate(readings)))
    return rise, readings[-1] + rise * steps


class MemoryRules:
    """One rank's memory rules (``cause``: what the fraction measures). RELEASE_CACHE at
    ``memory_watermark_frac``, again only after a reading under the re-arm line (the watermark
    less ``memory_hysteresis_frac``) and ``release_cache_min_interval_s`` on ``clock``;
    CHECKPOINT_AND_STOP once, at ``memory_critical_frac`` or, over the watermark, when the
    trend of ``memory_trend_steps`` readings reaches it within ``memory_predict_steps``; PACE
    (``pacing_enabled``) from the watermark to the re-arm line. ``decide`` numbers them."""

    def __init__(self, config: GuardConfig, *, clock: Callable[[], float], cause: Cause,
                 decide: Decide) -> None:
        self.config = config
        self.cause = cause
        self._clock = clock
        self._decide = decide
        self.readings: deque[float] = deque(maxlen=config.memory_trend_steps)
        self.armed = True                  # the watermark rule may fire
        self.pacing = False
        self.stopped = False               # CHECKPOINT_AND_STOP decided already
        self._last_release_s: float | None = None
        self.rearm_below = config.memory_watermark_frac - config.memory_hysteresis_frac

    def observe(self, step: int, frac: float, *, world_rank: int = 0,
                cached_frac: float | None = None) -> list[Decision]:
        """The decisions a reading of ``frac`` triggers; ``cached_frac``: the part of it
        cached but unallocated (None: not known), a release asks ``cache_release_min_frac``."""
        frac = float(frac)
        self.readings.append(frac)
        rearm_below = self.rearm_below
        if frac < rearm_below and self.armed and not self.pacing:
            return []                      # the common case: nothing to decide
        cfg = self.config
        where = f"rank {world_rank} step {step}"
        decisions: list[Decision] = []
        if not self.armed and frac < rearm_below:
            self.armed = True
        if (frac >= cfg.memory_watermark_frac and self.armed and self._release_spaced()
                and (cached_frac is None or cached_frac >= cfg.cache_release_min_frac)):
            self.armed = False
            self._last_release_s = self._clock()
            decisions.append(self._decide(
                Action.RELEASE_CACHE, self.cause,
                f"{where}: memory at {frac:.1%} >= watermark {cfg.memory_watermark_frac:.0%}; "
                f"release cached blocks (re-arms below {rearm_below:.0%})"))
        if not self.stopped:
            reason = self._critical_reason(frac)
            if reason is not None:
                self.stopped = True
                decisions.append(self._decide(Action.CHECKPOINT_AND_STOP, self.cause,
                                              f"{where}: {reason}; checkpoint and stop before "
                                              f"running out of memory"))
        if cfg.pacing_enabled:
            if not self.pacing and frac >= cfg.memory_watermark_frac:
                self.pacing = True
                decisions.append(self._decide(
                    Action.PACE, self.cause,
                    f"{where}: memory at {frac:.1%} >= watermark; pace each step by "
                    f"{cfg.pacing_delay_s:g} s", delay_s=cfg.pacing_delay_s))
            elif self.pacing and frac < rearm_below:
                self.pacing = False
                decisions.append(self._decide(
                    Action.PACE, self.cause,
                    f"{where}: memory at {frac:.1%} < {rearm_below:.0%}; stop pacing",
                    delay_s=0.0))
        return decisions

    def quiet_frac(self) -> float:
        """A reading under this decides nothing and changes no state but the trend: the
        re-arm line while armed and not pacing, else -inf (every reading counts then)."""
        return self.rearm_below if self.armed and not self.pacing else float("-inf")

    def claim_release(self) -> bool:
        """Whether a cache release may run now, and if so, count it: one spacing
        (``release_cache_min_interval_s``) for this rank's releases and the cluster's."""
        if not self._release_spaced():
            return False
        self._last_release_s = self._clock()
        return True

    def _release_spaced(self) -> bool:
        return (self._last_release_s is None or self._clock() - self._last_release_s
                >= self.config.release_cache_min_interval_s)

    def _critical_reason(self, frac: float) -> str | None:
        cfg = self.config
        if frac >= cfg.memory_critical_frac:
            return f"memory at {frac:.1%} >= critical {cfg.memory_critical_frac:.0%}"
        if cfg.memory_predict_steps == 0 or frac < cfg.memory_watermark_frac:
            return None
        trend = trend_ahead(self.readings, cfg.memory_predict_steps,
                            least=min(MIN_MEDIAN_POINTS, cfg.memory_trend_steps))
        if trend is None:
            return None
        rise, predicted = trend
        if rise > 0 and predicted >= cfg.memory_critical_frac:
            return (f"memory at {frac:.1%} rising {rise:.2%} per step, {predicted:.1%} predicted "
                    f"in {cfg.memory_predict_steps} steps >= critical "
                    f"{cfg.memory_critical_frac:.0%}")
        return None

    def state_dict(self) -> dict[str, Any]:
        """The readings and the two flags; the release spacing restarts on load (a monotonic
        clock means nothing in another process) and ``stopped`` is not kept (a resumed run is
        protected anew)."""
        return {"memory": list(self.readings), "armed": self.armed, "pacing": self.pacing}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.readings = deque((float(x) for x in state["memory"]),
                              maxlen=self.config.memory_trend_steps)
        self.armed = bool(state["armed"])
        self.pacing = bool(state["pacing"])
        self.stopped = False
        self._last_release_s = None
