"""The Grafana dashboard: every query names a metric the package exports, the panels the issue
asks for are there, and the CLI writes it. Scraping the metrics from a real Ray head is
tests/test_grafana_ray.py."""

from __future__ import annotations

import json
import re

import pytest
from grafana_queries import queried_metrics

from raytrain_guard.cli import main
from raytrain_guard.cluster import metrics
from raytrain_guard.cluster.grafana import GPU_PANELS, RAY_PREFIX, dashboard, series


def _exprs(model):
    return [t["expr"] for p in model["panels"] for t in p.get("targets", ())]


def test_every_query_names_only_metrics_the_package_exports():
    model = dashboard()
    named = queried_metrics(model)
    exported = {RAY_PREFIX + name for name in metrics.EXPORTED}
    assert named and named <= exported, named - exported
    # and every metric-looking token of every query is one of them (no stray name slips by)
    for expr in _exprs(model):
        for token in re.findall(r"\b(ray_\w+)\s*[{\[(]", expr):
            assert token in exported, (token, expr)


def test_every_panel_queries_something_and_labels_match_the_exported_tags():
    model = dashboard()
    for panel in model["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["targets"], panel["title"]
    for expr in _exprs(model):
        for name in re.findall(r"\bray_(raytrain_guard_\w+)", expr):
            tags = set(metrics.EXPORTED[name][1])
            selector = re.search(re.escape(RAY_PREFIX + name) + r"\{([^}]*)\}", expr)
            used = set(re.findall(r"(\w+)\s*=~?", selector.group(1))) if selector else set()
            assert used <= tags, (name, used - tags)


def test_the_panels_the_issue_asks_for():
    titles = {p["title"] for p in dashboard()["panels"]}
    for wanted in ("Step time per rank", "Phase breakdown per rank", "Data wait",
                   "Memory vs watermark and critical", "Straggler scores", "Decisions",
                   "GPU memory", "GPU utilization", "GPU temperature", "GPU throttle reasons"):
        assert wanted in titles
    text = json.dumps(dashboard())
    for metric in ("raytrain_guard_rank_memory_watermark_frac",
                   "raytrain_guard_rank_memory_critical_frac", "raytrain_guard_gpu_throttled"):
        assert series(metric) in text


def test_per_rank_metrics_carry_ray_trains_labels_and_node_metrics_node_and_gpu():
    for name, (_kind, tags) in metrics.EXPORTED.items():
        if name.startswith("raytrain_guard_rank_"):
            assert tags[:2] == ("ray_train_run_name", "ray_train_worker_world_rank"), name
        if name.startswith("raytrain_guard_gpu_") and name != "raytrain_guard_gpu_monitoring":
            assert tags[:2] == ("node_id", "gpu"), name
    variables = {v["name"]: v for v in dashboard()["templating"]["list"]}
    assert "ray_train_run_name" in variables["run"]["definition"]


def test_decisions_are_annotations():
    annotations = dashboard()["annotations"]["list"]
    assert {series("raytrain_guard_decisions_total"),
            series("raytrain_guard_rank_decisions_total")} <= {
        m for a in annotations for m in re.findall(r"ray_raytrain_guard_\w+", a["expr"])}


def _panel_metrics(panel):
    return {m for t in panel["targets"] for m in re.findall(r"\bray_(raytrain_guard_\w+)",
                                                            t["expr"])}


def test_hangs_and_worker_and_loader_private_memory_are_on_panels():
    on_panels = {m for p in dashboard()["panels"] if p["type"] != "row"
                 for m in _panel_metrics(p)}
    assert {metrics.HANGS, metrics.WORKER_PRIVATE, metrics.LOADER_PRIVATE,
            metrics.STRAGGLER_CAUSE} <= on_panels


def test_gpu_panels_are_the_ones_that_read_nvml_and_say_so():
    nvml = set(metrics.GPU_GAUGES.values()) | {metrics.GPU_THROTTLED}
    panels = [p for p in dashboard()["panels"] if p["type"] != "row"]
    assert {p["title"] for p in panels if _panel_metrics(p) & nvml} == set(GPU_PANELS)
    for panel in panels:
        assert ("Needs a GPU" in panel["description"]) == (panel["title"] in GPU_PANELS), \
            panel["title"]
    # the node variable takes its values from a series every node monitor sets, GPU or not
    variables = {v["name"]: v for v in dashboard()["templating"]["list"]}
    assert metrics.GPU_MONITORING in variables["node"]["definition"]
    assert not any(name in variables["node"]["definition"] for name in nvml)


def test_counters_count_their_first_increment():
    # Ray exports a counter from its first increment on (at 1): increase()/changes() over a
    # window holding that first sample read it as no change; the dashboard subtracts the value
    # a window ago, or 0 where the series did not exist yet
    model = dashboard()
    exprs = _exprs(model) + [a["expr"] for a in model["annotations"]["list"]]
    counters = [RAY_PREFIX + n for n, (kind, _) in metrics.EXPORTED.items() if kind == "counter"]
    counted = [e for e in exprs if any(c in e for c in counters)]
    assert len(counted) >= 5          # decisions x 2, rank decisions x 2, hangs
    for expr in counted:
        assert not re.search(r"\b(increase|changes|rate|irate|delta)\(", expr), expr
        assert re.search(r"offset \d+m or \S+ \* 0\)", expr), expr


def test_a_rank_is_one_straggler_line_whatever_its_cause():
    assert "cause" not in metrics.EXPORTED[metrics.STRAGGLER_EXCESS][1]
    assert "cause" in metrics.EXPORTED[metrics.STRAGGLER_CAUSE][1]
    scores = next(p for p in dashboard()["panels"] if p["title"] == "Straggler scores")
    assert "{{cause}}" not in json.dumps(scores["targets"])


def test_series_refuses_a_name_not_exported():
    with pytest.raises(KeyError, match="not a metric raytrain_guard exports"):
        series("raytrain_guard_made_up_seconds")


def test_cli_writes_the_dashboard(tmp_path, capsys):
    assert main(["grafana-dashboard"]) == 0
    assert json.loads(capsys.readouterr().out)["uid"] == "raytrain-guard"
    out = tmp_path / "dash.json"
    assert main(["grafana-dashboard", "--out", str(out)]) == 0
    assert json.loads(out.read_text()) == dashboard()
    assert main(["grafana-dashboard", "--out", str(tmp_path / "no" / "such" / "dir.json")]) == 2
    assert "--out" in capsys.readouterr().err
