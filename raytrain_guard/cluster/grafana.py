"""The guard's Grafana dashboard, generated from the metrics the package exports (pure):
``raytrain-guard grafana-dashboard > raytrain_guard.json``. Variables: ``run``
(``ray_train_run_name``, as Ray Train's own panels) and ``node``. Every query names its metric
through :func:`series`, which refuses a name the package does not export.
"""

from __future__ import annotations

import json
from typing import Any

from raytrain_guard.cluster.metrics import EXPORTED, RUN_NAME_TAG, WORLD_RANK_TAG

#: Ray's Prometheus export prefixes every ``ray.util.metrics`` name with ``ray_``
RAY_PREFIX = "ray_"
UID = "raytrain-guard"
DATASOURCE = "${datasource}"
RUN = f'{RUN_NAME_TAG}=~"$run"'
NODE = 'node_id=~"$node"'
RANK_LEGEND = "rank {{" + WORLD_RANK_TAG + "}}"
#: the panels that read NVML: without a GPU (a CPU node, or NVML unavailable) they stay empty
GPU_PANELS = ("GPU memory", "GPU utilization", "GPU temperature", "GPU throttle reasons")
_NEEDS_GPU = " Needs a GPU (NVML): empty on nodes without one."


def series(name: str) -> str:
    """The Prometheus name of the exported metric ``name`` (``raytrain_guard_...``); KeyError
    for a name the package does not export."""
    if name not in EXPORTED:
        raise KeyError(f"{name} is not a metric raytrain_guard exports")
    return RAY_PREFIX + name


def recent(selector: str, window: str) -> str:
    """How much the counters ``selector`` grew over the last ``window``, counting a series that
    appeared within it from 0. Ray exports a counter only from its first increment on, so
    ``increase(X[W])`` would miss that first event."""
    return f"{selector} - ({selector} offset {window} or {selector} * 0)"


def _target(expr: str, legend: str, ref: str) -> dict[str, Any]:
    return {"datasource": {"type": "prometheus", "uid": DATASOURCE}, "expr": expr,
            "legendFormat": legend, "refId": ref}


def _panel(title: str, targets: list[tuple[str, str]], grid: tuple[int, int, int, int], *,
           unit: str = "s", description: str = "", stack: bool = False,
           kind: str = "timeseries", thresholds: list[tuple[str, float | None]] | None = None
           ) -> dict[str, Any]:
    x, y, w, h = grid
    defaults: dict[str, Any] = {"unit": unit, "custom": {"fillOpacity": 30 if stack else 0,
                                                         "stacking": {"mode": "normal" if stack
                                                                      else "none"}}}
    if thresholds:
        defaults["thresholds"] = {"mode": "absolute", "steps": [
            {"color": color, "value": value} for color, value in thresholds]}
        defaults["custom"]["thresholdsStyle"] = {"mode": "line"}
    options: dict[str, Any] = {"legend": {"displayMode": "table", "placement": "right",
                                          "calcs": ["lastNotNull", "max"]},
                               "tooltip": {"mode": "multi"}}
    if kind == "state-timeline":       # a row per series, a bar while it is there
        options.update(showValue="never", mergeValues=True)
    return {"type": kind, "title": title, "description": description,
            "datasource": {"type": "prometheus", "uid": DATASOURCE},
            "gridPos": {"x": x, "y": y, "w": w, "h": h},
            "fieldConfig": {"defaults": defaults, "overrides": []},
            "options": options,
            "targets": [_target(expr, legend, chr(ord("A") + i))
                        for i, (expr, legend) in enumerate(targets)]}


def _row(title: str, y: int) -> dict[str, Any]:
    return {"type": "row", "title": title, "collapsed": False,
            "gridPos": {"x": 0, "y": y, "w": 24, "h": 1}, "panels": []}


def rank_panels(y: int) -> list[dict[str, Any]]:
    step, phase = series("raytrain_guard_rank_step_seconds"), \
        series("raytrain_guard_rank_phase_seconds")
    mem = series("raytrain_guard_rank_memory_frac")
    decisions = f"{series('raytrain_guard_decisions_total')}{{{RUN}}}"
    rank_decisions = f"{series('raytrain_guard_rank_decisions_total')}{{{RUN}}}"
    hangs = f"{series('raytrain_guard_hangs_total')}{{{RUN}}}"
    return [
        _row("Ranks (labelled like Ray Train's workers)", y),
        _panel("Step time per rank", [
            (f"{step}{{{RUN}}}", RANK_LEGEND),
            (f"{series('raytrain_guard_step_time_seconds')}{{{RUN}}}",
             "all ranks {{quantile}}")], (0, y + 1, 12, 8),
            description="Each rank's latest step (from the guard's batch every "
                        "report_every_steps steps) and the coordinator's p50/p99."),
        _panel("Phase breakdown per rank", [
            (f"{phase}{{{RUN}}}", RANK_LEGEND + " {{phase}}")], (12, y + 1, 12, 8), stack=True,
            description="data_wait, forward, backward, comm_wait, optimizer of the latest "
                        "step. Under DDP the straggler waits least in comm_wait."),
        _panel("Data wait", [
            (f'{phase}{{{RUN}, phase="data_wait"}}', RANK_LEGEND + " s"),
            (f"{series('raytrain_guard_rank_data_wait_frac')}{{{RUN}}}",
             RANK_LEGEND + " of the step")], (0, y + 9, 12, 8), unit="s",
            description="Time the loop waited for its batch, and its fraction of the step."),
        _panel("Memory vs watermark and critical", [
            (f"{mem}{{{RUN}}}", RANK_LEGEND),
            (f"max({series('raytrain_guard_rank_memory_watermark_frac')}{{{RUN}}})",
             "watermark (release cache)"),
            (f"max({series('raytrain_guard_rank_memory_critical_frac')}{{{RUN}}})",
             "critical (checkpoint and stop)")], (12, y + 9, 12, 8), unit="percentunit",
            description="Device memory (on CPU: the rank's share of host RAM) after each step."),
        _panel("Straggler scores", [
            (f"{series('raytrain_guard_straggler_excess_frac')}{{{RUN}}}",
             RANK_LEGEND + " (node {{node_id}})"),
            (f"{series('raytrain_guard_straggler_node')}{{{RUN}}}", "node {{node_id}} flagged")],
            (0, y + 17, 12, 8), unit="percentunit",
            description="Fraction of a step each rank adds over the reference rank (one line "
                        "per rank; its cause is the next panel), and the nodes flagged "
                        "stragglers (1)."),
        _panel("Decisions", [
            (f"sum by (action) ({recent(decisions, '5m')})", "cluster {{action}}"),
            (f"sum by ({WORLD_RANK_TAG}, action) ({recent(rank_decisions, '5m')})",
             RANK_LEGEND + " {{action}}")], (12, y + 17, 12, 8), unit="short",
            description="Decisions made by the coordinator, and applied on each rank, in the "
                        "last 5 minutes (also annotations)."),
        _panel("Straggler cause", [
            (f"{series('raytrain_guard_straggler_cause')}{{{RUN}}} == 1",
             RANK_LEGEND + " {{cause}}")], (0, y + 25, 12, 8), unit="short",
            kind="state-timeline",
            description="What each rank's straggler score is attributed to: data, compute, "
                        "communication; unknown while it adds nothing."),
        _panel("Hangs", [
            (f"sum by ({WORLD_RANK_TAG}, node_id, phase) ({recent(hangs, '5m')})",
             RANK_LEGEND + " hung in {{phase}} (node {{node_id}})")],
            (12, y + 25, 12, 8), unit="short",
            description="Hung attempts in the last 5 minutes, by the rank the coordinator "
                        "named (empty rank: it could not tell) and the phase it hung in. "
                        "Empty until a rank hangs."),
        _panel("DataLoader settings in force", [
            (f"{series('raytrain_guard_rank_loader_num_workers')}{{{RUN}}}",
             RANK_LEGEND + " num_workers"),
            (f"{series('raytrain_guard_rank_loader_prefetch_factor')}{{{RUN}}}",
             RANK_LEGEND + " prefetch_factor")], (0, y + 33, 24, 6), unit="short"),
    ]


def node_panels(y: int) -> list[dict[str, Any]]:
    gpu = "node {{node_id}} GPU {{gpu}}"
    worker = "node {{node_id}} rank {{world_rank}} (pid {{pid}})"
    return [
        _row("Nodes (node monitors)", y),
        _panel("GPU memory", [
            (f"{series('raytrain_guard_gpu_memory_frac')}{{{NODE}}}", gpu)],
            (0, y + 1, 12, 8), unit="percentunit",
            description="NVML used / total (counts the CUDA context and other processes)."
                        + _NEEDS_GPU),
        _panel("GPU utilization", [
            (f"{series('raytrain_guard_gpu_utilization_frac')}{{{NODE}}}", gpu)],
            (12, y + 1, 12, 8), unit="percentunit", description=_NEEDS_GPU.strip()),
        _panel("GPU temperature", [
            (f"{series('raytrain_guard_gpu_temperature_celsius')}{{{NODE}}}", gpu)],
            (0, y + 9, 12, 8), unit="celsius", description=_NEEDS_GPU.strip()),
        _panel("GPU throttle reasons", [
            (f"{series('raytrain_guard_gpu_throttled')}{{{NODE}}} > 0", gpu + " {{reason}}")],
            (12, y + 9, 12, 8), unit="short", stack=True,
            description="1 while the GPU's clocks are throttled for the reason (empty while "
                        "none is)." + _NEEDS_GPU),
        _panel("Host memory", [
            (f"{series('raytrain_guard_host_memory_used_frac')}{{{NODE}}}", "node {{node_id}}")],
            (0, y + 17, 12, 8), unit="percentunit"),
        _panel("Train worker and DataLoader private memory", [
            (f"{series('raytrain_guard_worker_private_bytes')}{{{NODE}}}", worker + " worker"),
            (f"{series('raytrain_guard_loader_private_bytes')}{{{NODE}}}",
             worker + " DataLoader workers")], (12, y + 17, 12, 8), unit="bytes",
            description="Private memory (USS) of each train worker the node monitor samples, "
                        "and the sum over its DataLoader worker processes (0 without any)."),
    ]


def annotations() -> list[dict[str, Any]]:
    """Decisions as annotations: a marker where a decision counter went up (or appeared)."""
    def annotation(name: str, metric: str, color: str) -> dict[str, Any]:
        return {"name": name, "enable": True, "iconColor": color,
                "datasource": {"type": "prometheus", "uid": DATASOURCE},
                "expr": f"{recent(f'{series(metric)}{{{RUN}}}', '1m')} > 0", "step": "30s",
                "titleFormat": "{{action}}", "textFormat": name + ": {{action}}",
                "tagKeys": "action", "useValueForTime": False}
    return [annotation("cluster decisions", "raytrain_guard_decisions_total", "orange"),
            annotation("rank decisions", "raytrain_guard_rank_decisions_total", "red")]


def _variable(name: str, metric: str, label: str) -> dict[str, Any]:
    return {"name": name, "label": name, "type": "query", "refresh": 2, "includeAll": True,
            "multi": True, "current": {"text": "All", "value": "$__all"}, "allValue": ".*",
            "datasource": {"type": "prometheus", "uid": DATASOURCE},
            "query": {"query": f"label_values({series(metric)}, {label})",
                      "refId": f"{name}-values"},
            "definition": f"label_values({series(metric)}, {label})"}


def dashboard() -> dict[str, Any]:
    """The dashboard as Grafana's JSON model (a dict)."""
    return {
        "uid": UID, "title": "raytrain_guard", "tags": ["ray", "train", "raytrain_guard"],
        "schemaVersion": 39, "version": 1, "editable": True, "refresh": "10s",
        "time": {"from": "now-30m", "to": "now"},
        "description": "raytrain_guard beside Ray Train: per-rank step phases, data wait, "
                       "memory against its lines, stragglers, decisions, hangs, node GPUs and "
                       "host memory. Generated by `raytrain-guard grafana-dashboard`.",
        "templating": {"list": [
            {"name": "datasource", "label": "data source", "type": "datasource",
             "query": "prometheus", "current": {}},
            _variable("run", "raytrain_guard_rank_step_seconds", RUN_NAME_TAG),
            # every node monitor sets it (1 with NVML readings, 0 in host-only mode)
            _variable("node", "raytrain_guard_gpu_monitoring", "node_id"),
        ]},
        "annotations": {"list": annotations()},
        "panels": rank_panels(0) + node_panels(40),
    }


def dashboard_json() -> str:
    return json.dumps(dashboard(), indent=2, sort_keys=False) + "\n"
