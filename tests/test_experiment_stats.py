"""The experiment's figures over repeats (``--repeat N``), from hand-made ARM objects: no Ray.

Two repeats of an observe and an act arm under ``slow_compute`` on rank 1 over steps 40-59,
100 steps each; the decisions' lateness is the coordinator's default, 20 steps.
"""

from __future__ import annotations

import copy

import pytest

from raytrain_guard.experiment import stats
from raytrain_guard.experiment.faults import parse_fault
from raytrain_guard.experiment.ray_cluster import cluster_address
from raytrain_guard.experiment.report import format_text
from raytrain_guard.experiment.report_repeats import plot_repeats, repeats_section
from raytrain_guard.experiment.runner import ExperimentSetup

FAULT = parse_fault("slow_compute:rank=1,start=40,stop=60,factor=2", world_size=2)
SPEC = str(FAULT)
LATE = 20


def arm(*, pace=100.0, delay=2, detections=(), decisions=(), wait=0.01):
    named = None if delay is None else FAULT.start + delay
    return {"completed": True, "steps": 100, "total_steps": 100, "samples_per_s": pace * 0.8,
            "step_samples_per_s": pace, "data_wait_frac": wait, "peak_memory_frac": 0.3,
            "lost_steps": 0, "samples_lost": 0, "samples_repeated": 0,
            "detections": list(detections), "decisions": list(decisions),
            "fault_detection": [{"fault": SPEC, "cause": "compute", "named_at_step": named,
                                 "delay_steps": delay,
                                 "in_time": delay is not None and delay <= 5}]}


def test_the_bootstrap_interval_holds_the_median_and_reproduces_with_its_seed():
    values = [98.0, 101.0, 103.0, 97.0, 120.0, 99.0, 100.0]
    interval = stats.bootstrap_median(values)
    assert interval.median == 100.0                       # sorted: 97 98 99 [100] 101 103 120
    assert 97.0 <= interval.low <= interval.median <= interval.high <= 120.0
    assert interval.low < interval.high
    assert stats.bootstrap_median(values) == interval     # the same seed, the same interval
    assert stats.bootstrap_median(list(reversed(values))).low == interval.low
    # few resamples of many values: the interval moves with the draws, and the seed fixes them
    spread = [float((7 * i) % 23) for i in range(23)]
    few = stats.bootstrap_median(spread, resamples=50, seed=3)
    assert stats.bootstrap_median(spread, resamples=50, seed=3) == few
    assert len({stats.bootstrap_median(spread, resamples=50, seed=s) for s in range(10)}) > 1
    assert interval.to_dict()["values"] == values and interval.to_dict()["n"] == 7


def test_one_value_is_its_own_interval_and_no_value_gives_none():
    assert stats.bootstrap_median([5.0]) == stats.Interval(5.0, 5.0, 5.0, (5.0,))
    assert stats.bootstrap_median([4.0, 6.0]).median == 5.0   # the mean of the middle two
    assert stats.bootstrap_median([]) is None


def test_named_within_5_counts_the_repeats_that_named_the_fault_in_time():
    repeats = [arm(delay=2), arm(delay=7), arm(delay=None), arm(delay=5)]
    assert stats.named_within(repeats, SPEC) == [2, 4]       # +2 and +5; +7 late, one missed
    assert stats.named_within(repeats, "crash:ranks=1,start=3") == [0, 4]


def test_false_events_are_unmatched_detections_and_decisions_outside_every_fault():
    detections = [{"kind": "slow_step (compute)", "rank": 0, "step": 12, "fault": None},
                  {"kind": "slow_step (compute)", "rank": 1, "step": 42,
                   "fault": "slow_compute"}]
    decisions = [{"action": "pace", "step": 45, "applied": True},      # dated 44: in the fault
                 {"action": "pace", "step": 80, "applied": True},      # dated 79 = 59 + 20: in
                 {"action": "pace", "step": 90, "applied": True},      # dated 89: false
                 {"action": "pace", "step": 95, "applied": False}]     # not applied: no event
    a = arm(detections=detections, decisions=decisions)
    assert stats.clean_steps(100, [FAULT]) == 80                # steps 40-59 are the fault's
    assert stats.false_events(a, [FAULT], late_steps=LATE) == 2
    assert stats.false_events_per_1000(a, [FAULT], late_steps=LATE) == 25.0   # 2 / 80 steps
    # a spike split at the fault's first step answers that step's own batch: dated 40, in
    # the fault (a lockstep decision applied at 40 answers step 39: false)
    split = [{"action": "split_micro_batch", "step": 40, "applied": True}]
    assert stats.false_events(arm(decisions=split), [FAULT], late_steps=LATE) == 0
    paced = [{"action": "pace", "step": 40, "applied": True}]
    assert stats.false_events(arm(decisions=paced), [FAULT], late_steps=LATE) == 1
    # a clean run: every step is clean, every applied decision false
    assert stats.false_events_per_1000(a, [], late_steps=LATE) == 40.0        # 4 / 100 steps
    assert stats.false_events_per_1000({**a, "steps": 0}, [], late_steps=LATE) is None


def test_repeats_keep_the_first_repeats_figures_and_gain_repeats_and_stats():
    observe = [arm(pace=100.0, delay=2),
               arm(pace=90.0, delay=8, detections=[{"rank": 0, "step": 3, "fault": None}])]
    act = [arm(pace=99.0, delay=3), arm(pace=91.8, delay=4)]
    before = copy.deepcopy(observe[0])
    arms = stats.summarize_repeats({"observe": observe, "act": act}, [FAULT], late_steps=LATE)

    o, a = arms["observe"], arms["act"]
    assert {k: v for k, v in o.items() if k not in ("repeats", "stats", "fault_detection")} \
        == {k: v for k, v in before.items() if k != "fault_detection"}
    assert o["fault_detection"] == [{**before["fault_detection"][0], "named_within_5": [1, 2]}]
    assert a["fault_detection"][0]["named_within_5"] == [2, 2]
    assert o["repeats"] == observe and len(a["repeats"]) == 2
    assert "named_within_5" not in o["repeats"][0]["fault_detection"][0]
    keys = {"samples_per_s", "step_samples_per_s", "data_wait_frac", "peak_memory_frac",
            "lost_steps", "samples_lost", "samples_repeated", f"delay_steps {SPEC}",
            "false_events_per_1000_clean_steps"}
    assert set(o["stats"]) == keys
    assert set(a["stats"]) == keys | {"act_observe_step_samples_per_s"}
    assert o["stats"]["step_samples_per_s"]["median"] == 95.0
    # 1 false event in the 80 clean steps of the second repeat, none in the first
    assert o["stats"]["false_events_per_1000_clean_steps"]["values"] == [0.0, 12.5]
    ratio = a["stats"]["act_observe_step_samples_per_s"]     # per pair: 0.99 and 1.02
    assert ratio["values"] == [0.99, 1.02] and ratio["median"] == pytest.approx(1.005)
    assert ratio["low"] >= 0.99 and ratio["high"] <= 1.02
    for entry in a["stats"].values():
        assert entry["low"] <= entry["median"] <= entry["high"]


def test_the_report_and_the_cli_give_the_intervals_and_the_spread_plot(tmp_path):
    runs = {"observe": [arm(pace=100.0), arm(pace=90.0, delay=None)],
            "act": [arm(pace=99.0), arm(pace=92.0)]}
    result = {"arms": stats.summarize_repeats(runs, [FAULT], late_steps=LATE),
              "repeat": {"pairs": 2, "seeds": [0, 1]}}
    section = "\n".join(repeats_section(result))
    assert "## Repeats" in section and "pair i at seed 0 + i" in section
    assert "| step samples/s | 95.0 [90.0, 100.0] | 95.5 [92.0, 99.0] |" in section
    assert f"| steps to name `{SPEC}` | 2 [2, 2] (n 1) | 2 [2, 2] |" in section
    assert f"- observe: `{SPEC}`: compute named within 5 steps in 1 of 2 repeats" in section
    text = format_text(result)
    assert "over 2 repeats: median [95 % bootstrap interval]" in text
    assert "act: act/observe step samples/s: " in text
    assert f"observe: {SPEC}: named within 5 steps in 1/2 repeats" in text

    pytest.importorskip("matplotlib")
    import matplotlib.image
    path = plot_repeats(str(tmp_path), result["arms"])
    assert path == str(tmp_path / "repeats.png") and matplotlib.image.imread(path).std() > 0.01
    one = {"arms": {"observe": runs["observe"][0], "act": runs["act"][0]}}
    assert repeats_section(one) == [] and plot_repeats(str(tmp_path / "x"), one["arms"]) is None
    assert "repeats" not in format_text(one)


def test_each_repeat_has_its_folder_and_its_seed_one_repeat_keeps_the_arms_folder():
    one, three = ExperimentSetup(faults=(), seed=7), ExperimentSetup(faults=(), seed=7, repeat=3)
    assert one.arm_dir("/o", "act") == "/o/act"
    assert three.arm_dir("/o", "act", 2) == "/o/repeat-2/act"
    assert [three.of_repeat(i).seed for i in range(3)] == [7, 8, 9]
    assert three.of_repeat(1).repeat == 3 and three.of_repeat(1).faults == ()


@pytest.mark.parametrize("flag, env, joined", [
    (None, None, None), (None, "10.0.0.1:6379", "10.0.0.1:6379"),
    ("10.0.0.2:6379", "10.0.0.1:6379", "10.0.0.2:6379"), ("local", "10.0.0.1:6379", None),
    (None, "local", None), (None, "", None), ("auto", None, "auto"),
])
def test_address_flag_wins_over_ray_address_and_local_means_start_one(flag, env, joined,
                                                                      monkeypatch):
    if env is None:
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
    else:
        monkeypatch.setenv("RAY_ADDRESS", env)
    assert cluster_address(flag) == joined


def test_host_oom_kills_read_per_node_and_summarize_where_node_memory_counted_them():
    from raytrain_guard.experiment.report import side_by_side

    observe = [dict(arm(), host_oom_kills=k, host_oom_kills_by_node=[0, k]) for k in (1, 2)]
    act = [dict(arm(), host_oom_kills=0, host_oom_kills_by_node=[0, 0]) for _ in range(2)]
    arms = stats.summarize_repeats({"observe": observe, "act": act}, [FAULT], late_steps=LATE)
    assert arms["observe"]["stats"]["host_oom_kills"]["values"] == [1, 2]
    assert arms["act"]["stats"]["host_oom_kills"]["median"] == 0
    assert "| host OOM kills | 1 (node 1: 1) | 0 |" in side_by_side(arms)
    # without --node-memory nothing counted them: no row, no metric
    plain = stats.summarize_repeats({"observe": [arm(), arm()]}, [FAULT], late_steps=LATE)
    assert "host_oom_kills" not in plain["observe"]["stats"]
    assert "host OOM kills" not in side_by_side(plain)
