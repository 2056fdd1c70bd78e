"""The experiment's report: ``report.md`` (the side-by-side table, one column per arm, the fault
schedule, detections and decisions) and ``timeline.png``; over several repeats, also their
intervals and ``repeats.png`` (:mod:`~raytrain_guard.experiment.report_repeats`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from raytrain_guard.experiment import analysis, report_repeats
from raytrain_guard.experiment.audit import NOT_AUDITED

#: the rows of the side-by-side table: (label, key, format); an audit figure that is None
#: reads "not audited" (or "not checked" where the audit ran without it), any other None "-"
ROWS: Sequence[tuple[str, str, str]] = (
    ("completed", "completed", "bool"), ("error", "error", "text"),
    ("attempts", "attempts", "int"), ("steps", "steps", "steps"),
    ("steps computed again", "lost_steps", "audit"),
    ("samples audited", "samples_audited", "audit"), ("samples lost", "samples_lost", "audit"),
    ("samples repeated", "samples_repeated", "audit"),
    ("samples misplaced", "samples_misplaced", "audit"), ("wall time", "wall_s", "s"),
    ("training time", "train_wall_s", "s"), ("samples/s", "samples_per_s", "float"),
    ("step p50", "step_p50_s", "ms"), ("step p99", "step_p99_s", "ms"),
    ("data wait", "data_wait_frac", "pct"), ("peak memory", "peak_memory_frac", "pct"),
    ("global batch", "global_batch", "batch"),
    ("host OOM kills", "host_oom_kills", "kills"),
)


_FORMATS = {"s": "{:.1f} s", "ms": "{:.1f} ms", "pct": "{:.1%}", "float": "{:.1f}"}


def _cell(arm: Mapping[str, Any], key: str, kind: str) -> str:
    value = arm.get(key)
    if value is None:
        if kind not in ("audit", "batch"):
            return "-"
        return NOT_AUDITED if arm.get("samples_audited") is None else "not checked"
    if kind == "batch":
        low, high = arm.get("global_batch_min"), arm.get("global_batch_max")
        return str(value) if low == high else f"{value} ({low}-{high})"
    if kind == "bool":
        return "yes" if value else "**no**"
    if kind == "steps":
        return f"{value}/{arm.get('total_steps')}"
    if kind == "kills":
        where = ", ".join(f"node {i}: {k}" for i, k in
                          enumerate(arm.get("host_oom_kills_by_node") or ()) if k)
        return f"{value} ({where})" if where else str(value)
    if kind in _FORMATS:
        return _FORMATS[kind].format(value * 1000 if kind == "ms" else value)
    return str(value).replace("|", "/")


def side_by_side(arms: Mapping[str, Mapping[str, Any]]) -> str:
    """The table a person reads first (markdown; also printed by the CLI)."""
    names = list(arms)
    lines = ["| | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for label, key, kind in ROWS:
        if kind == "kills" and all(arms[n].get(key) is None for n in names):
            continue                    # counted only with --node-memory
        lines.append(f"| {label} | " + " | ".join(_cell(arms[n], key, kind) for n in names)
                     + " |")
    lines.append("| detections | " + " | ".join(str(len(arms[n]["detections"])) for n in names)
                 + " |")
    lines.append("| decisions applied | " + " | ".join(
        str(sum(1 for d in arms[n]["decisions"] if d["applied"])) for n in names) + " |")
    return "\n".join(lines)


def format_text(result: Mapping[str, Any]) -> str:
    """What the CLI prints: the table, how each fault was named, where the report is."""
    out = [side_by_side(result["arms"]), ""]
    if result.get("step_model"):
        out.append(f"steps: {result['step_model']}")
    for name, arm in result["arms"].items():
        if arm.get("audit"):
            out.append(f"{name}: audit: {arm['audit']}")
        for f in arm.get("fault_detection", ()):
            named = (f"named {f['cause']} at step {f['named_at_step']} "
                     f"({f['delay_steps']} steps after its start)" if f["named_at_step"]
                     is not None else f"its cause ({f['cause']}) was not named")
            out.append(f"{name}: {f['fault']}: {named}")
        for d in arm["decisions"]:
            if d["applied"]:
                out.append(f"{name}: {d['action']} at step {d['step']} on ranks {d['ranks']}: "
                           f"{d['reason']}")
    out += report_repeats.repeats_text(result)
    return "\n".join(out)


def write_report(result: Mapping[str, Any], out_dir: str, setup: Any) -> tuple[str, list[str]]:
    """``report.md`` and the plots in ``out_dir`` (the timeline of the first repeat in its
    folder); returns their paths."""
    plots = [plot_timeline(setup.repeat_dir(out_dir, 0), result["arms"], setup)]
    spread = report_repeats.plot_repeats(out_dir, result["arms"])
    plots += [spread] if spread else []
    guard = setup.guard_config()
    lines = [
        "# raytrain-guard experiment", "",
        f"Faults: {', '.join(result['faults']) or 'none'}", "",
        f"Training: {setup.num_workers} workers"
        + (f" spread over {setup.nodes} Ray nodes" if setup.nodes > 1 else "")
        + f", strategy {setup.strategy}, micro-batch "
        f"{setup.micro_batch} x grad_accum {setup.grad_accum}, "
        + (f"{setup.max_steps} steps" if setup.max_steps else f"{setup.epochs} epochs")
        + f", seed {setup.seed}, max_failures {setup.max_failures}, checkpoint every "
        f"{setup.checkpoint_every_steps} steps, collective timeout "
        f"{setup.collective_timeout_s:.0f} s", "",
        f"Device: {result['device']}", "",
        f"Steps: {result.get('step_model', 'not recorded')}", "",
        f"Machine: {result['machine']}", "",
        (f"Memory watermark {guard.memory_watermark_frac:.0%}, critical "
         f"{guard.memory_critical_frac:.0%}."), "",
        "## Side by side", "", side_by_side(result["arms"]), "",
        *report_repeats.repeats_section(result),
        "## Faults named", ""]
    for name, arm in result["arms"].items():
        for f in arm.get("fault_detection", ()):
            on = f" (its ranks {f['ranks']})" if "node_index" in f else ""
            lines.append(f"- {name}: `{f['fault']}`{on}: " + (
                f"{f['cause']} named at step {f['named_at_step']}, {f['delay_steps']} steps "
                f"after its start ({'within' if f['in_time'] else 'over'} the "
                f"{analysis.DETECTION_DELAY_TARGET_STEPS}-step target)"
                if f["named_at_step"] is not None else f"{f['cause']} not named"))
    lines += ["", "## Audit of the samples consumed", ""]
    lines += [f"- {name}: {arm.get('audit') or NOT_AUDITED}"
              for name, arm in result["arms"].items()]
    lines += ["", "## Detections", ""]
    for name, arm in result["arms"].items():
        lines += [f"- {name}: {d['kind']} on rank {d['rank']}"
                  + (f" (node {d['node_index']} as a node)" if d.get("target") == "node"
                     and d.get("node_index") is not None else "") + f" at step {d['step']}"
                  + (f" ({d['delay_steps']} steps after {d['fault']} began)"
                     if d.get("fault") else "") + f": {d['reason']}" for d in arm["detections"]]
    lines += ["", "## Decisions", ""]
    for name, arm in result["arms"].items():
        for d in arm["decisions"]:
            effect = ""
            if d.get("predicted") or d.get("measured"):
                effect = f" (predicted {d.get('predicted')}, measured {d.get('measured')})"
            lines.append(f"- {name}: {d['action']} at step {d['step']} on ranks {d['ranks']}"
                         f"{'' if d['applied'] else ' (not applied)'}: {d['reason']}{effect}")
    lines += ["", "## Plots", ""] + [
        f"![{os.path.basename(p)}]({os.path.relpath(p, out_dir)})" for p in plots]
    path = os.path.join(out_dir, "report.md")
    with open(path, "w") as fh:
        fh.write("\n".join(lines) + "\n")
    return path, plots


#: one colour per rank (tab10 without its grey), the same rank alike in every arm and panel;
#: thresholds, crashes, restarts and decisions are drawn in black and grey, which no rank uses
RANK_COLOURS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown",
                "tab:pink", "tab:olive", "tab:cyan")
#: the faults' windows, pale so the lines over them stay readable
FAULT_COLOURS = ("#f6d7a7", "#c9e4f0", "#d9c8e6", "#cfe8c4")
ARM_LINESTYLES = {"observe": "--", "act": "-"}


def rank_colour(rank: int) -> str:
    return RANK_COLOURS[rank % len(RANK_COLOURS)]


def plot_timeline(out_dir: str, arms: Mapping[str, Mapping[str, Any]], setup: Any) -> str:
    """``timeline.png`` in ``out_dir`` (:func:`timeline_figure` of the arms' traces there)."""
    import matplotlib.pyplot as plt

    traces = {arm: analysis.read_ranks(os.path.join(out_dir, arm, "trace")) for arm in arms}
    fig = timeline_figure(traces, arms, setup.faults, setup.guard_config())
    path = os.path.join(out_dir, "timeline.png")
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def timeline_figure(traces: Mapping[str, Mapping[int, Sequence[Mapping[str, Any]]]],
                    arms: Mapping[str, Mapping[str, Any]], faults: Sequence[Any],
                    guard: Any) -> Any:
    """Step time, memory fraction and data wait per rank over steps (``traces``: {arm: {rank:
    trace records}}), a colour per rank (:data:`RANK_COLOURS`) and a line style per arm, each
    attempt its own line. On every panel: each fault's window shaded and named, each crash (a
    solid black line; the step-time panel names the error) and restart (dash-dotted, from the
    step it resumed at). The memory panel: the watermark, critical and full-card lines (grey
    and black dashes, labelled) and, where a step ran out of memory, the fraction of the card
    it asked for (a star above 1.0). Decisions applied (black triangles) and detections (crosses
    in the colour of the rank named) on the step-time panel. Returns the matplotlib Figure."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m, ax_d) = plt.subplots(3, 1, figsize=(13, 10), sharex=True)
    panels = (ax_t, ax_m, ax_d)
    for arm, ranks in traces.items():
        for rank, records in sorted(ranks.items()):
            _plot_rank(panels, arm, rank, records)
    last = max([int(a.get("total_steps") or 0) for a in arms.values()]
               + [int(r["step"]) + 1 for ranks in traces.values() for records in ranks.values()
                  for r in records if r.get("t") == "step"] + [1])
    ax_t.set_xlim(0, last)                 # shared by the three panels
    _shade_faults(panels, faults, last)
    _draw_thresholds(ax_m, guard)
    top = ax_t.get_ylim()[1] if ax_t.lines else 1.0
    for arm, result in arms.items():
        for d in result["decisions"]:
            if d["applied"] and d["step"] is not None:
                ax_t.plot([d["step"]], [top * 0.97], marker="v", color="black",
                          linestyle="none")
        for d in result["detections"]:
            if d.get("step") is not None:
                colour = rank_colour(d["rank"]) if isinstance(d.get("rank"), int) else "black"
                ax_t.plot([d["step"]], [top * 0.92], marker="x", color=colour,
                          linestyle="none")
    _mark_attempts(panels, arms)
    ax_t.set_ylim(top=top)
    ax_t.set_ylabel("step time (ms)")
    ax_t.set_title("step time per rank (v decision applied, x detection; shaded: faults; "
                   "black lines: crashes, dash-dotted: restarts)", fontsize=10, pad=16)
    ax_m.set_ylabel("memory fraction of the card")
    ax_d.set_ylabel("data wait (ms)")
    ax_d.set_xlabel("step")
    for ax in panels:
        ax.grid(alpha=0.3)
    for ax in (ax_t, ax_m):
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.005, 1.0), borderaxespad=0)
    fig.tight_layout()
    return fig


def _plot_rank(panels: Sequence[Any], arm: str, rank: int,
               records: Sequence[Mapping[str, Any]]) -> None:
    """One rank's step time, memory fraction and data wait, one line per attempt."""
    ax_t, ax_m, ax_d = panels
    by_attempt: dict[Any, list[Mapping[str, Any]]] = {}
    for r in records:
        if r.get("t") == "step":
            by_attempt.setdefault(r.get("attempt"), []).append(r)
    for i, steps in enumerate(by_attempt.values()):
        steps = sorted(steps, key=lambda r: r["step"])
        xs = [r["step"] for r in steps]
        style = {"linestyle": ARM_LINESTYLES.get(arm, "-"), "linewidth": 1,
                 "color": rank_colour(rank)}
        ax_t.plot(xs, [r["total_s"] * 1000 for r in steps], **style,
                  label=f"{arm} rank {rank}" if i == 0 else None)
        ax_m.plot(xs, [r["memory_frac"] if r.get("memory_frac") is not None else float("nan")
                       for r in steps], **style)
        ax_d.plot(xs, [(r.get("data_wait_s") or 0.0) * 1000 for r in steps], **style)


def _shade_faults(panels: Sequence[Any], faults: Sequence[Any], last_step: int) -> None:
    """Each fault's steps, ``start`` to its last step (:attr:`FaultSpec.last_step`; to
    ``last_step`` for a fault without end), shaded on every panel and named on the first."""
    for i, f in enumerate(faults):
        end = f.last_step
        stop = last_step if end is None else end + 1
        label = f"{f.kind} node {f.node}" if f.node is not None else \
            f"{f.kind} rank {'+'.join(map(str, f.ranks))}"
        for ax in panels:
            ax.axvspan(f.start, stop, color=FAULT_COLOURS[i % len(FAULT_COLOURS)], alpha=0.6,
                       linewidth=0, zorder=0, label=label if ax is panels[0] else None)
        panels[0].annotate(label, xy=(f.start, 1.0), xycoords=("data", "axes fraction"),
                           xytext=(2, 2), textcoords="offset points", fontsize=8,
                           va="bottom", ha="left", weight="bold")


def _draw_thresholds(ax_m: Any, guard: Any) -> None:
    """The guard's memory watermark (grey dashes), its critical line and the full card (black
    dots), each labelled at the panel's left edge (and in its legend)."""
    for frac, name, colour, style in (
            (guard.memory_watermark_frac, "watermark", "dimgray", "--"),
            (guard.memory_critical_frac, "critical", "black", "--"),
            (1.0, "card full", "black", ":")):
        ax_m.axhline(frac, color=colour, linestyle=style, linewidth=1,
                     label=f"{name} {frac:.0%}")
        below = name == "watermark"       # apart from the critical line just above it
        ax_m.annotate(f"{name} {frac:.0%}", xy=(0.0, frac), xycoords=("axes fraction", "data"),
                      xytext=(3, -2 if below else 2), textcoords="offset points", fontsize=7,
                      va="top" if below else "bottom", color=colour)


def _mark_attempts(panels: Sequence[Any], arms: Mapping[str, Mapping[str, Any]]) -> None:
    """Each arm's crashes (a black line at the step that raised, the error's name on the
    step-time panel; for an out-of-memory error what the step asked for, a star on the memory
    panel) and restarts (a dash-dotted line at the step the attempt resumed from). Attempts
    that crashed or resumed alike share one note ("attempts 2, 3")."""
    ax_t, ax_m, _ = panels
    notes: dict[tuple[Any, ...], list[int]] = {}
    starred = set()
    for arm, result in arms.items():
        for span in result.get("attempt_spans", ()):
            number = span["attempt"] + 1
            if span["attempt"] > 0:
                notes.setdefault(("restart", arm, span["start_step"]), []).append(number)
            if span["error"] is not None and span["error_step"] is not None:
                notes.setdefault(("crash", arm, span["error_step"], span["error"],
                                  span["error_rank"]), []).append(number)
                star = (arm, span["error_step"], span["error_rank"], span.get("needed_frac"))
                if star[-1] is not None and star not in starred:
                    starred.add(star)
                    _mark_needed(ax_m, arm, span)
    right = ax_t.get_xlim()[1]
    for row, (key, numbers) in enumerate(notes.items()):
        kind, arm, step = key[:3]
        for ax in panels:
            ax.axvline(step, color="black", linewidth=1.2 if kind == "crash" else 1,
                       linestyle="-" if kind == "crash" else "-.")
        which = f"attempt{'s' if len(numbers) > 1 else ''} {', '.join(map(str, numbers))}"
        text = (f"{arm} {which}: {key[3]} on rank {key[4]} at step {step}" if kind == "crash"
                else f"{arm} {which} resumed from step {step}")
        left = step > right / 2         # the note on the side with room for it
        ax_t.annotate(text, xy=(step, 0.84 - 0.08 * (row % 10)),
                      xycoords=("data", "axes fraction"), xytext=(-3 if left else 3, 0),
                      textcoords="offset points", fontsize=7, va="center",
                      ha="right" if left else "left",
                      bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none",
                            "alpha": 0.85})


def _mark_needed(ax_m: Any, arm: str, span: Mapping[str, Any]) -> None:
    """A star at the fraction of the card the step that ran out of memory asked for."""
    rank, frac = span["error_rank"], span["needed_frac"]
    ax_m.plot([span["error_step"]], [frac], marker="*", markersize=14, linestyle="none",
              markeredgecolor="black",
              color=rank_colour(rank) if isinstance(rank, int) else "black",
              label=f"{arm} rank {rank}: asked for (out of memory)")
    ax_m.annotate(f"{arm} rank {rank} asked for {frac:.0%} of the card",
                  xy=(span["error_step"], frac), xytext=(8, 0), textcoords="offset points",
                  fontsize=7, va="center")
    ax_m.set_ylim(top=max(ax_m.get_ylim()[1], frac * 1.08))
