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
    if kind in _FORMATS:
        return _FORMATS[kind].format(value * 1000 if kind == "ms" else value)
    return str(value).replace("|", "/")


def side_by_side(arms: Mapping[str, Mapping[str, Any]]) -> str:
    """The table a person reads first (markdown; also printed by the CLI)."""
    names = list(arms)
    lines = ["| | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for label, key, kind in ROWS:
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
        f"Training: {setup.num_workers} workers, strategy {setup.strategy}, micro-batch "
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
            lines.append(f"- {name}: `{f['fault']}`: " + (
                f"{f['cause']} named at step {f['named_at_step']}, {f['delay_steps']} steps "
                f"after its start ({'within' if f['in_time'] else 'over'} the "
                f"{analysis.DETECTION_DELAY_TARGET_STEPS}-step target)"
                if f["named_at_step"] is not None else f"{f['cause']} not named"))
    lines += ["", "## Audit of the samples consumed", ""]
    lines += [f"- {name}: {arm.get('audit') or NOT_AUDITED}"
              for name, arm in result["arms"].items()]
    lines += ["", "## Detections", ""]
    for name, arm in result["arms"].items():
        lines += [f"- {name}: {d['kind']} on rank {d['rank']} at step {d['step']}"
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


def plot_timeline(out_dir: str, arms: Mapping[str, Mapping[str, Any]], setup: Any) -> str:
    """Step time, memory fraction and data wait per rank over steps, both arms on shared
    axes; decisions (triangles) and detections (crosses) on the step-time panel."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    guard = setup.guard_config()
    fig, (ax_t, ax_m, ax_d) = plt.subplots(3, 1, figsize=(11, 9), sharex=True)
    styles = {"observe": "--", "act": "-"}
    for arm in arms:
        traces = analysis.read_ranks(os.path.join(out_dir, arm, "trace"))
        for rank, records in sorted(traces.items()):
            steps = sorted(((r["step"], r) for r in records if r.get("t") == "step"),
                           key=lambda sr: sr[0])
            if not steps:
                continue
            xs = [s for s, _ in steps]
            style = {"linestyle": styles.get(arm, "-"), "linewidth": 1,
                     "label": f"{arm} rank {rank}"}
            ax_t.plot(xs, [r["total_s"] * 1000 for _, r in steps], **style)
            ax_m.plot(xs, [r["memory_frac"] if r.get("memory_frac") is not None else float("nan")
                           for _, r in steps], **style)
            ax_d.plot(xs, [r["data_wait_s"] * 1000 for _, r in steps], **style)
        top = ax_t.get_ylim()[1] if ax_t.lines else 1.0
        for d in arms[arm]["decisions"]:
            if d["applied"] and d["step"] is not None:
                ax_t.plot([d["step"]], [top * 0.95], marker="v", color="tab:green",
                          linestyle="none")
        for d in arms[arm]["detections"]:
            if d.get("step") is not None:
                ax_t.plot([d["step"]], [top * 0.9], marker="x", color="tab:red",
                          linestyle="none")
    ax_m.axhline(guard.memory_watermark_frac, color="tab:orange", linewidth=0.8,
                 label="watermark")
    ax_m.axhline(guard.memory_critical_frac, color="tab:red", linewidth=0.8, label="critical")
    ax_t.set_ylabel("step time (ms)")
    ax_t.set_title("step time per rank (v decision applied, x detection)")
    ax_m.set_ylabel("memory fraction")
    ax_d.set_ylabel("data wait (ms)")
    ax_d.set_xlabel("step")
    for ax in (ax_t, ax_m, ax_d):
        ax.grid(alpha=0.3)
    ax_m.legend(fontsize=7, ncol=3, loc="upper left")
    fig.tight_layout()
    path = os.path.join(out_dir, "timeline.png")
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
