"""Launcher pieces without Ray: merging the ranks' decision logs, the summary, the progress line,
and the plan check."""

from __future__ import annotations

import pytest

from raytrain_guard.cluster.launcher import (PlanDoesNotFit, RunSummary, check_plan,
                                             merge_applied, progress_line, summarize)


def test_merge_applied_groups_cluster_decisions_by_id_and_keeps_local_ones_per_rank():
    logs = [
        {"decision_id": 7, "action": "release_cache", "reason": "hot", "applied_at": 20,
         "world_rank": 0},
        {"decision_id": 7, "action": "release_cache", "reason": "hot", "applied_at": 20,
         "world_rank": 1},
        {"decision_id": 0, "action": "slow_step", "reason": "r1 slow", "applied_at": 31,
         "world_rank": 1},
    ]
    merged = merge_applied(logs)
    assert [(m["decision_id"], m["steps"], m["ranks"]) for m in merged] == [
        (7, [20], [0, 1]), (0, [31], [1])]


def test_merge_applied_shows_a_split_decision():
    # a lockstep failure would show as two steps for one id
    merged = merge_applied([{"decision_id": 3, "applied_at": 10, "world_rank": 0},
                            {"decision_id": 3, "applied_at": 20, "world_rank": 1}])
    assert merged[0]["steps"] == [10, 20]


def test_summarize_throughput_and_data_wait():
    results = {"step": 100, "total_steps": 100, "world_size": 2, "wall_s": 10.0,
               "loader": [{"data_wait_frac": 0.1}, {"data_wait_frac": 0.3}],
               "attribution": [{"role": "straggler", "reason": "rank 1 slow"},
                               {"role": "normal", "reason": "fine"}],
               "decisions": []}
    status = {"step_p50_s": 0.05, "step_p99_s": 0.2, "straggler_nodes": ["n2"], "notes": []}
    s = summarize("r", results, status, wall_s=30.0, global_batch=16)
    # 100 steps x 16 samples / 10 s of training loop = 160 samples/s; data wait mean(0.1, 0.3)
    assert s.samples_per_s == 160.0 and s.data_wait_frac == 0.2
    assert s.detections == ("rank 1 slow", "straggler node n2")
    text = s.format()
    assert "160.0 samples/s" in text and "p50 0.050 s" in text and "p99 0.200 s" in text


def test_progress_line():
    status = {"latest_step": 40, "ranks": {0: {"memory_frac": 0.5}, 1: {"memory_frac": 0.7}},
              "step_p50_s": 0.1, "step_p99_s": 0.3, "active_decisions": [{}]}
    line = progress_line(status, 200, started=10.0, clock=lambda: 25.0)
    assert line == ("step 40/200 | 2 ranks | step p50 0.100 s p99 0.300 s | memory 70% | "
                    "decisions 1 | 15 s")


class _Plan:
    def __init__(self, fits: bool) -> None:
        self.fits, self.micro_batch, self.grad_accum = fits, 8, 2
        self.total_bytes, self.budget_bytes = 3 << 30, 2 << 30
        self.arithmetic = "static 2.0 GiB + activations 1.0 GiB = 3.0 GiB > 2.0 GiB budget"
        self.warnings = ("use fsdp-full",)

        class _S:
            world_size = 4
        self.setup = _S()


def test_check_plan_refuses_with_the_arithmetic_unless_forced():
    with pytest.raises(PlanDoesNotFit) as err:
        check_plan(_Plan(fits=False), force=False)
    assert "3.0 GiB > 2.0 GiB budget" in str(err.value) and "use fsdp-full" in str(err.value)
    assert check_plan(_Plan(fits=False), force=True).endswith("(forced)")
    assert check_plan(_Plan(fits=True), force=False).startswith("fits: micro_batch 8 x "
                                                                "grad_accum 2 x 4 ranks")


def test_run_summary_round_trips_to_dict():
    s = RunSummary(run_id="r", steps=1, total_steps=1, world_size=1, global_batch=1, wall_s=1.0,
                   samples_per_s=None, step_p50_s=None, step_p99_s=None, data_wait_frac=None)
    assert s.to_dict()["run_id"] == "r" and "-" in s.format()


def test_effective_config_is_one_config_from_config_and_guard():
    import pytest

    from raytrain_guard.cluster.launcher import effective_config
    from raytrain_guard.config import GuardConfig
    from raytrain_guard.errors import ConfigError, InputError
    base = GuardConfig(lockstep_every_steps=5)
    assert effective_config(None, None) == GuardConfig()
    assert effective_config(base, None) is base
    # a GuardConfig as the loop's guard is the run's config (dict(guard) raised TypeError)
    given = GuardConfig(memory_watermark_frac=0.8)
    assert effective_config(base, given) is given
    # a dict replaces single fields of config: K=5 stays, the watermark changes
    merged = effective_config(base, {"memory_watermark_frac": 0.8})
    assert (merged.lockstep_every_steps, merged.memory_watermark_frac) == (5, 0.8)
    with pytest.raises(ConfigError, match="memory_watermark_fra"):
        effective_config(base, {"memory_watermark_fra": 0.8})
    with pytest.raises(InputError, match="guard"):
        effective_config(base, 0.8)
