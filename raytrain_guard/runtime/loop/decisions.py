"""Decisions at a step boundary: the rank's own gate's, the cluster's, the stop agreement."""

from __future__ import annotations

import logging

from raytrain_guard.core.decisions import Action, Cause, Decision, due_at
from raytrain_guard.core.steps import StepStats
from raytrain_guard.errors import InputError

logger = logging.getLogger("raytrain_guard.runtime.train_loop")

_OTHER_RANK_STOP = "another rank's gate asked to checkpoint and stop"


class DecisionsMixin:
    """After each step: record and apply the local decisions and those of the decision source due
    now (every rank at the same step), agree on a stop, checkpoint when due. With ``act`` off
    (the experiment's observe arm) decisions are recorded, never applied."""

    def _boundary(self, step: int, local: list[Decision], stats: list[StepStats]) -> bool:
        """After ``step`` steps: local and cluster decisions, the stop agreement, checkpoints.
        Returns True when the run stops here."""
        cfg = self.config
        checkpoint_now = step % cfg.every_checkpoint == 0 and step < self.total_steps
        act = cfg.act
        for decision in local:
            self._record(step, decision, applied=act or decision.action is Action.SLOW_STEP)
            if not act:
                continue
            if decision.action is Action.CHECKPOINT_AND_STOP and self._local_stop is None:
                self._local_stop = decision
            elif decision.action is Action.SLOW_STEP and decision.cause is Cause.DATA:
                self._add_loader_workers(step, decision)
        control = self.control
        control.local_stop = self._local_stop is not None    # rides on a lockstep round too
        rounds_before = control.num_rounds
        polled = cfg.decision_source.poll(step, stats) if cfg.decision_source is not None \
            else ()
        due, self.pending = due_at(step, self.pending, polled)
        stop = False
        for decision in due:
            self._record(step, decision, applied=act and decision.concerns(self.ctx.node_id))
            if not act:
                continue
            checkpoint_now |= self._apply_cluster(decision)
            stop |= decision.action is Action.CHECKPOINT_AND_STOP
        if stop:
            self.stop_reason = next(d.reason for d in due
                                    if d.action is Action.CHECKPOINT_AND_STOP)
        else:
            if control.stop_agreed(rounds_before, check_now=step % cfg.every_stop_check == 0):
                stop = True
                self.stop_reason = (self._local_stop.reason if self._local_stop is not None
                                    else _OTHER_RANK_STOP)
        if stop:
            logger.warning("rank %d: checkpoint and stop at step %d: %s", self.rank, step,
                           self.stop_reason)
            if cfg.restart_after_stop and step < self.total_steps:
                self.restart_reason = self.stop_reason
            return True
        if checkpoint_now:
            self._checkpoint({"kind": "periodic"})
        return False

    def _apply_cluster(self, decision: Decision) -> bool:
        """Apply a decision from the decision source; True when it asks for a checkpoint."""
        from raytrain_guard.runtime.cache_release import release_cache

        action = decision.action
        if not decision.concerns(self.ctx.node_id):
            logger.debug("rank %d (node %s): %s is not for this node", self.rank,
                         self.ctx.node_id, decision)
            return False
        if action is Action.RELEASE_CACHE:
            if self.guard.gate.claim_release():    # one spacing with the gate's own releases
                release_cache()
            else:
                logger.info("rank %d: cluster release_cache skipped: a release ran less than "
                            "release_cache_min_interval_s (%g s) ago", self.rank,
                            self.config.guard.release_cache_min_interval_s)
        elif action is Action.PACE:
            try:
                self.guard.set_pace(decision.params.get("delay_s", 0.0))
            except InputError as exc:
                logger.warning("rank %d: pace decision ignored: %s", self.rank, exc)
        elif action is Action.SET_PREFETCH:
            if "prefetch_factor" in decision.params:
                self._requested_prefetch = decision.params["prefetch_factor"]
                self.loader.request_prefetch_factor(decision.params["prefetch_factor"])
            if "device_prefetch_depth" in decision.params:
                self.loader.set_device_prefetch_depth(int(decision.params["device_prefetch_depth"]))
        elif action is Action.CHECKPOINT:
            return True
        elif action is Action.SHRINK_MICRO_BATCH:
            self._shrink(decision)
        return False

    def _record(self, step: int, decision: Decision, *, applied: bool = True) -> None:
        """Keep ``decision`` for the results; ``applied`` False: seen at ``step`` but meant for
        another node's ranks."""
        entry = decision.to_dict()
        entry.update(applied_at=step, world_rank=self.rank, applied=applied)
        self.decisions.append(entry)
        if applied:
            self.metrics.record_decision(decision)
        if self._trace is not None:
            self._trace_event("decision", **entry)
