"""The experiment's timeline plot and the attempts it marks, from hand-written traces (no Ray).

The arm here: 2 ranks, 10 steps, a slowed rank 1 at steps 2-4, an activation spike on rank 1
at steps 6-7 and memory growing on rank 0 from step 8 to the end. Observing, rank 1 runs out of memory at step 6 twice (rank 0's broken
collective follows it, earlier on the clock), each restart resuming from the checkpoint at
step 4; acting, it finishes in one attempt. The card: 1000 bytes, a step that asked for 1750.
"""

from __future__ import annotations

import json

import matplotlib
import pytest
from matplotlib.colors import to_rgba
from matplotlib.patches import Polygon, Rectangle

from raytrain_guard.config import GuardConfig
from raytrain_guard.experiment import analysis, report
from raytrain_guard.experiment.faults import parse_fault

matplotlib.use("Agg")

FAULTS = [parse_fault("slow_compute:rank=1,start=2,stop=5,factor=3"),
          parse_fault("activation_spike:rank=1,start=6,factor=8,steps=2"),
          parse_fault("memory_growth:rank=0,start=8,per_step=1KiB")]
OOM = {"error": "OutOfMemoryError", "needed_bytes": 1750, "capacity_bytes": 1000}


def rank_trace(rank: int, attempts: list[tuple[str, int | None, int, dict | None]]
               ) -> list[dict]:
    """(attempt id, resumed_from, steps finished, error record or None: it ended) per attempt."""
    out, wall = [], 100.0
    for attempt, resumed, finished, error in attempts:
        out.append({"t": "start", "attempt": attempt, "wall": wall, "resumed_from": resumed,
                    "world_size": 2, "micro_batch": 4, "grad_accum": 1, "total_steps": 10})
        out += [{"t": "step", "attempt": attempt, "wall": wall + 1, "step": s,
                 "total_s": 0.03 if rank == 1 and 2 <= s < 5 else 0.01, "data_wait_s": 0.001,
                 "memory_frac": 0.3} for s in range(resumed or 0, finished)]
        if error is None:
            out.append({"t": "end", "attempt": attempt, "wall": wall + 2, "step": finished})
        else:
            out.append({"t": "error", "attempt": attempt, "step": finished, **error,
                        "wall": wall + (2.0 if error["error"] == "OutOfMemoryError" else 1.5)})
        wall += 10
    return out


def write_observe(root):
    (root / "trace").mkdir(parents=True)
    for rank in (0, 1):
        error = OOM if rank == 1 else {"error": "DistBackendError"}
        attempts = [(f"r{rank}a", None, 6, error), (f"r{rank}b", 4, 6, error),
                    (f"r{rank}c", 4, 6, error)]
        (root / "trace" / f"rank{rank}.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in rank_trace(rank, attempts)))
    return root


def analyze(root):
    return analysis.analyze_arm(str(root), FAULTS, num_samples=None, launch_error=None,
                                wall_s=1.0, num_workers=2)


def test_each_attempt_has_its_start_step_and_the_error_that_ended_it(tmp_path):
    observe = analyze(write_observe(tmp_path / "observe"))
    # the out-of-memory error on rank 1, not rank 0's broken collective that came earlier;
    # needed: 1750 of 1000 bytes
    failed = {"error": "OutOfMemoryError", "error_rank": 1, "error_step": 6,
              "needed_frac": 1.75}
    assert observe["attempt_spans"] == [{"attempt": 0, "start_step": 0, **failed},
                                        {"attempt": 1, "start_step": 4, **failed},
                                        {"attempt": 2, "start_step": 4, **failed}]
    assert observe["attempts"] == 3             # the keys read before stay as they were
    assert observe["attempt_errors"] == ["OutOfMemoryError on rank 1 at step 6"] * 3


def test_an_error_without_the_bytes_it_asked_for_has_no_needed_frac(tmp_path):
    root = tmp_path / "act"
    (root / "trace").mkdir(parents=True)
    for rank in (0, 1):
        (root / "trace" / f"rank{rank}.jsonl").write_text("".join(
            json.dumps(r) + "\n" for r in rank_trace(
                rank, [("a", None, 3, {"error": "ValueError"}), ("b", 2, 10, None)])))
    spans = analyze(root)["attempt_spans"]
    assert spans == [{"attempt": 0, "start_step": 0, "error": "ValueError", "error_rank": 0,
                      "error_step": 3, "needed_frac": None},
                     {"attempt": 1, "start_step": 2, "error": None, "error_rank": None,
                      "error_step": None, "needed_frac": None}]


@pytest.fixture
def figure(tmp_path):
    observe_dir = write_observe(tmp_path / "observe")
    observe = analyze(observe_dir)
    act_trace = {rank: rank_trace(rank, [(f"act{rank}", None, 10, None)]) for rank in (0, 1)}
    act = {"total_steps": 10, "attempt_spans": [{"attempt": 0, "start_step": 0, "error": None,
                                                 "error_rank": None, "error_step": None,
                                                 "needed_frac": None}],
           "decisions": [{"applied": True, "step": 6}],
           "detections": [{"rank": 1, "step": 3}]}
    traces = {"observe": analysis.read_ranks(str(observe_dir / "trace")), "act": act_trace}
    fig = report.timeline_figure(traces, {"observe": observe, "act": act}, FAULTS,
                                 GuardConfig())
    yield fig
    matplotlib.pyplot.close(fig)


def x_extent(patch):
    """An axvspan's steps: a Rectangle (matplotlib 3.9 on) or a Polygon (before)."""
    if isinstance(patch, Rectangle):
        return round(patch.get_x()), round(patch.get_x() + patch.get_width())
    xs = [x for x, _ in patch.get_xy()]
    return round(min(xs)), round(max(xs))


def texts(ax):
    return [t.get_text() for t in ax.texts]


def test_every_panel_shades_each_faults_window_and_the_first_names_it(figure):
    for ax in figure.axes:
        spans = [p for p in ax.patches if isinstance(p, (Polygon, Rectangle))]
        # axvspan: x from the start to the step after the last one (the open growth: to 10)
        assert sorted(map(x_extent, spans)) == [(2, 5), (6, 8), (8, 10)]
    assert {"slow_compute rank 1", "activation_spike rank 1",
            "memory_growth rank 0"} <= set(texts(figure.axes[0]))


def test_crashes_and_restarts_are_lines_on_every_panel_and_named_once(figure):
    for ax in figure.axes:
        vertical = {(round(line.get_xdata()[0]), line.get_linestyle()) for line in ax.lines
                    if len(set(line.get_xdata())) == 1 and len(line.get_xdata()) == 2}
        assert {(6, "-"), (4, "-.")} <= vertical
    notes = texts(figure.axes[0])
    assert "observe attempts 1, 2, 3: OutOfMemoryError on rank 1 at step 6" in notes
    assert "observe attempts 2, 3 resumed from step 4" in notes


def test_thresholds_are_labelled_in_colours_no_rank_uses(figure):
    ax_m = figure.axes[1]
    ranks = {to_rgba(c) for c in report.RANK_COLOURS}
    lines = {line.get_label(): line for line in ax_m.lines}
    for label, frac in (("watermark 88%", 0.88), ("critical 90%", 0.90), ("card full 100%", 1.0)):
        line = lines[label]
        assert list(line.get_ydata()) == [frac, frac]
        assert to_rgba(line.get_color()) not in ranks
        assert label in texts(ax_m)
    # the ranks' lines: rank 1 in its colour in both arms, observe dashed and act solid
    styles = {(line.get_label(), line.get_linestyle()) for line in figure.axes[0].lines
              if line.get_color() == report.rank_colour(1)}
    assert {("observe rank 1", "--"), ("act rank 1", "-")} <= styles


def test_the_memory_a_failed_step_asked_for_is_a_star_above_the_card(figure):
    ax_m = figure.axes[1]
    stars = [line for line in ax_m.lines if line.get_marker() == "*"]
    assert len(stars) == 1                       # three attempts, one step, one figure
    assert (list(stars[0].get_xdata()), list(stars[0].get_ydata())) == ([6], [1.75])
    assert stars[0].get_color() == report.rank_colour(1)
    assert ax_m.get_ylim()[1] > 1.75
    assert "observe rank 1 asked for 175% of the card" in texts(ax_m)


def test_plot_timeline_reads_the_traces_and_writes_the_png(tmp_path):
    write_observe(tmp_path / "observe")

    class Setup:
        faults = FAULTS

        def guard_config(self):
            return GuardConfig()

    path = report.plot_timeline(str(tmp_path), {"observe": analyze(tmp_path / "observe")},
                                Setup())
    assert path == str(tmp_path / "timeline.png")
    assert (tmp_path / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
