"""Launcher pieces without Ray: merging the ranks' decision logs, the summary, the progress line,
and the plan check."""

from __future__ import annotations

import pytest

from raytrain_guard.cluster.planning import PlanDoesNotFit, check_plan
from raytrain_guard.cluster.progress import progress_line
from raytrain_guard.cluster.summary import RunSummary, merge_applied, summarize

NODE = "9e7532"


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


def test_merge_applied_keeps_each_ranks_own_gate_decisions_apart():
    # each rank's gate numbers its decisions from 1: rank 0's #1 and rank 1's #1 are two
    # events at different steps, not one decision "on ranks [0, 1]"
    logs = [
        {"decision_id": 1, "action": "slow_step", "scope": "rank", "reason": "rank 0 slow",
         "applied_at": 12, "world_rank": 0},
        {"decision_id": 1, "action": "slow_step", "scope": "rank", "reason": "rank 1 slow",
         "applied_at": 31, "world_rank": 1},
    ]
    assert [(m["ranks"], m["steps"], m["reason"]) for m in merge_applied(logs)] == [
        ([0], [12], "rank 0 slow"), ([1], [31], "rank 1 slow")]


def test_merge_applied_lists_only_the_ranks_a_node_decision_was_for():
    # a set_prefetch for node n2 is seen by every rank; only n2's rank applies it
    logs = [{"decision_id": 9, "action": "set_prefetch", "scope": "node:n2", "applied_at": 30,
             "world_rank": r, "applied": r == 1} for r in (0, 1)]
    assert [(m["decision_id"], m["ranks"]) for m in merge_applied(logs)] == [(9, [1])]


def test_summary_files_events_under_detections_and_applied_actions_under_decisions():
    """slow_step (a rank's gate) and flag_straggler (the coordinator) report what was seen;
    release_cache changes the run. A flagged node is not listed twice."""
    decisions = [
        *({"decision_id": 1, "action": "slow_step", "scope": "rank", "applied_at": 12 + r,
           "world_rank": r, "reason": f"rank {r} steps 10-12: 3 slow steps in a row"}
          for r in (0, 1)),
        *({"decision_id": 77, "action": "release_cache", "scope": "cluster", "applied_at": 20,
           "world_rank": r, "reason": "GPU 0 at 89%"} for r in (0, 1)),
        *({"decision_id": 78, "action": "flag_straggler", "scope": f"node:{NODE}",
           "applied_at": 40, "world_rank": r, "params": {"node_id": NODE},
           "reason": f"node {NODE} is a straggler; recommend draining the node"}
          for r in (0, 1)),
    ]
    s = summarize("r", {"step": 50, "world_size": 2, "decisions": decisions},
                  {"straggler_nodes": [NODE, "n3"]}, wall_s=5.0, global_batch=16)
    assert [d["action"] for d in s.decisions] == ["release_cache"]
    assert s.detections == (
        "rank 0 steps 10-12: 3 slow steps in a row", "rank 1 steps 10-12: 3 slow steps in a row",
        f"flag_straggler at step 40: node {NODE} is a straggler; recommend draining the node",
        "straggler node n3")
    text = s.format()
    assert "detections   4" in text and "decisions    1" in text
    assert "#77 release_cache at step 20 on ranks [0, 1]: GPU 0 at 89%" in text


def test_a_ranks_own_gate_action_is_shown_as_that_ranks():
    s = summarize("r", {"step": 5, "decisions": [
        {"decision_id": 2, "action": "release_cache", "scope": "rank", "applied_at": 4,
         "world_rank": 1, "reason": "rank 1 at 91%"}]}, {}, wall_s=1.0)
    assert "    - release_cache at step 4 on rank 1 (its own gate): rank 1 at 91%" in s.format()


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
    assert line == ("step 40/200 | 2 ranks | step p50 0.100 s p99 0.300 s | rank mem 70% | "
                    "active decisions 1 | 15 s")


def test_progress_line_says_which_memory():
    # the ranks' own figure (4 %, a CPU process of its RAM budget) and the node monitors' GPU
    # (89 %, what the summary's release_cache reason quotes) are two different numbers
    status = {"latest_step": 9, "ranks": {0: {"memory_frac": 0.04}},
              "nodes": {"n1": {"gpus": [{"memory_frac": 0.5}, {"memory_frac": 0.89}]},
                        "n2": {"gpus": []}}}
    assert progress_line(status) == ("step 9 | 1 ranks | step time - | rank mem 4% | "
                                     "node GPU mem 89% | active decisions 0")


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
    assert "force=True" in str(err.value) and "--force" not in str(err.value)   # no such flag
    assert check_plan(_Plan(fits=False), force=True).endswith("(forced)")
    assert check_plan(_Plan(fits=True), force=False).startswith("fits: micro_batch 8 x "
                                                                "grad_accum 2 x 4 ranks")


def test_check_plan_gives_the_callers_own_fixes_instead_of_the_planners():
    # the demo has no --strategy and no force: it says what its own user can change
    with pytest.raises(PlanDoesNotFit) as err:
        check_plan(_Plan(fits=False), force=False, fixes=("pass --workers 3 or fewer",))
    assert str(err.value) == ("the capacity plan does not fit:\n"
                              "static 2.0 GiB + activations 1.0 GiB = 3.0 GiB > 2.0 GiB budget\n"
                              "  - pass --workers 3 or fewer")


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
