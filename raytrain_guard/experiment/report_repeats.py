"""The experiment's figures over its repeats (``--repeat N``, N > 1): the report's section of
medians and 95 % bootstrap intervals (:func:`repeats_section`), the lines the CLI prints
(:func:`repeats_text`) and ``repeats.png`` (:func:`plot_repeats`), each metric's value in every
repeat per arm. All read the arms' ``stats`` (:mod:`~raytrain_guard.experiment.stats`); an
arm without them (one repeat) gives nothing.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from raytrain_guard.experiment import stats

#: how a metric reads: stats key -> (label, format of one value)
LABELS: Mapping[str, tuple[str, str]] = {
    "samples_per_s": ("samples/s", "{:.1f}"),
    "step_samples_per_s": ("step samples/s", "{:.1f}"),
    stats.ACT_OBSERVE: ("act/observe step samples/s", "{:.3f}"),
    "data_wait_frac": ("data wait", "{:.1%}"),
    "peak_memory_frac": ("peak memory", "{:.1%}"),
    "lost_steps": ("steps computed again", "{:g}"),
    "samples_lost": ("samples lost", "{:g}"),
    "samples_repeated": ("samples repeated", "{:g}"),
    "host_oom_kills": ("processes the host's OOM killer killed", "{:g}"),
    stats.FALSE_EVENTS: ("false events / 1000 clean steps", "{:.2f}"),
}


def has_repeats(arms: Mapping[str, Mapping[str, Any]]) -> bool:
    return any("stats" in arm for arm in arms.values())


def _label(key: str) -> tuple[str, str]:
    if key.startswith(stats.delay_key("")):
        return f"steps to name `{key[len(stats.delay_key('')):]}`", "{:g}"
    return LABELS.get(key, (key, "{:g}"))


def interval_text(entry: Mapping[str, Any], fmt: str) -> str:
    """``median [low, high]`` of a stats entry."""
    return (f"{fmt.format(entry['median'])} [{fmt.format(entry['low'])}, "
            f"{fmt.format(entry['high'])}]")


def _keys(arms: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Every stats key of the arms, the table's order: :data:`LABELS`' then the faults'."""
    present = list(dict.fromkeys(k for arm in arms.values() for k in arm.get("stats", {})))
    return [k for k in LABELS if k in present] + [k for k in present if k not in LABELS]


def repeats_section(result: Mapping[str, Any]) -> list[str]:
    """The report's "Repeats" section (markdown lines); none for one repeat."""
    arms = result["arms"]
    if not has_repeats(arms):
        return []
    names = list(arms)
    pairs = len(next(iter(arms.values()))["repeats"])
    seeds = (result.get("repeat") or {}).get("seeds") or []
    lines = ["## Repeats", "",
             f"{pairs} pairs of arms, interleaved ({', '.join(names)}, ...), pair i at seed "
             + (f"{seeds[0]} + i" if seeds else "seed + i") + " in both of its arms. Each "
             "figure is the median over the repeats and its 95 % percentile-bootstrap interval "
             f"({stats.RESAMPLES} resamples, RNG seed {stats.BOOTSTRAP_SEED}); a delay is over "
             "the repeats that named the fault (n). The figures above are the first repeat's.",
             "", "| | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for key in _keys(arms):
        label, fmt = _label(key)
        cells = []
        for n in names:
            entry = arms[n].get("stats", {}).get(key)
            cells.append("-" if entry is None else interval_text(entry, fmt)
                         + (f" (n {entry['n']})" if entry["n"] != pairs else ""))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines.append("")
    for name in names:
        for f in arms[name].get("fault_detection", ()):
            k, total = f.get(stats.NAMED_WITHIN, (0, 0))
            lines.append(f"- {name}: `{f['fault']}`: {f['cause']} named within "
                         f"{stats.DETECTION_DELAY_TARGET_STEPS} steps in {k} of {total} "
                         "repeats")
    return lines + [""]


def repeats_text(result: Mapping[str, Any]) -> list[str]:
    """What the CLI prints of the repeats: each arm's intervals, each fault's share."""
    arms = result["arms"]
    if not has_repeats(arms):
        return []
    pairs = len(next(iter(arms.values()))["repeats"])
    out = [f"over {pairs} repeats: median [95 % bootstrap interval]"]
    for name, arm in arms.items():
        for key in _keys({name: arm}):
            label, fmt = _label(key)
            entry = arm["stats"][key]
            out.append(f"{name}: {label}: {interval_text(entry, fmt)}"
                       + (f" (n {entry['n']})" if entry["n"] != pairs else ""))
        for f in arm.get("fault_detection", ()):
            k, total = f.get(stats.NAMED_WITHIN, (0, 0))
            out.append(f"{name}: {f['fault']}: named within "
                       f"{stats.DETECTION_DELAY_TARGET_STEPS} steps in {k}/{total} repeats")
    return out


def plot_repeats(out_dir: str, arms: Mapping[str, Mapping[str, Any]]) -> str | None:
    """``repeats.png``: per metric a panel, per arm each repeat's value (dots), the median
    (a bar) and the 95 % interval (a line); None for one repeat."""
    if not has_repeats(arms):
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = _keys(arms)
    cols = 3
    rows = max(1, -(-len(keys) // cols))
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 2.8 * rows), squeeze=False)
    names: Sequence[str] = list(arms)
    for ax, key in zip(axes.flat, keys):
        label, _ = _label(key)
        for x, name in enumerate(names):
            entry = arms[name].get("stats", {}).get(key)
            if entry is None:
                continue
            values = entry["values"]
            spread = [x + 0.15 * ((i % 5) - 2) / 2 for i in range(len(values))]
            ax.plot(spread, values, "o", markersize=4, alpha=0.6, color=f"C{x}")
            ax.plot([x, x], [entry["low"], entry["high"]], color="black", linewidth=1.5)
            ax.plot([x - 0.25, x + 0.25], [entry["median"]] * 2, color="black", linewidth=2)
        ax.set_xticks(range(len(names)), names)
        ax.set_xlim(-0.6, len(names) - 0.4)
        ax.set_title(label.replace("`", ""), fontsize=8)
        ax.grid(alpha=0.3, axis="y")
    for ax in list(axes.flat)[len(keys):]:
        ax.set_visible(False)
    fig.suptitle("each repeat (dots), median (bar) and 95 % bootstrap interval (line)",
                 fontsize=9)
    fig.tight_layout()
    path = os.path.join(out_dir, "repeats.png")
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
