"""Every Grafana panel and variable queries metrics Loom really exports.

The names come from the registry the services serve (:func:`loom.telemetry.metrics.exported_names`),
never from a list written here; the PromQL is taken apart just enough to find its metric names.
"""

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from loom.telemetry.metrics import exported_names

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = sorted((ROOT / "deploy" / "grafana" / "dashboards").glob("*.json"))

PROMQL_WORDS = frozenset(
    [
        "sum",
        "min",
        "max",
        "avg",
        "group",
        "stddev",
        "stdvar",
        "count",
        "count_values",
        "bottomk",
        "topk",
        "quantile",
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
        "and",
        "or",
        "unless",
        "offset",
        "bool",
        "rate",
        "irate",
        "increase",
        "delta",
        "idelta",
        "deriv",
        "predict_linear",
        "histogram_quantile",
        "abs",
        "ceil",
        "floor",
        "round",
        "clamp",
        "clamp_min",
        "clamp_max",
        "label_replace",
        "label_join",
        "vector",
        "scalar",
        "time",
        "timestamp",
        "sort",
        "sort_desc",
        "absent",
        "absent_over_time",
        "changes",
        "resets",
        "sum_over_time",
        "avg_over_time",
        "max_over_time",
        "min_over_time",
        "count_over_time",
        "last_over_time",
        "quantile_over_time",
        "exp",
        "ln",
        "log2",
        "log10",
        "sqrt",
        "inf",
        "nan",
        "label_values",
    ]
)
_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGES = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_WORD = re.compile(r"(?<![\w.$])[a-zA-Z_:][a-zA-Z0-9_:]*")


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression (or a ``label_values(metric, label)``) reads."""
    text = expr.replace("$__rate_interval", "5m")
    label_values = re.fullmatch(r"\s*label_values\(\s*([^,{)]+)(\{[^}]*\})?\s*,\s*\w+\s*\)\s*", text)
    if label_values:
        return {label_values.group(1).strip()}
    text = _STRINGS.sub('""', text)
    text = _MATCHERS.sub("", text)
    text = _RANGES.sub("", text)
    text = _GROUPING.sub("", text)
    text = re.sub(r"\boffset\s+-?(\d+(ms|[smhdwy]))+", " ", text)
    text = re.sub(r"\d+(\.\d+)?(e[+-]?\d+)?", " ", text)
    return {w for w in _WORD.findall(text) if w not in PROMQL_WORDS}


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))


def _queries(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    for panel in _panels(dashboard["panels"]):
        for target in panel.get("targets", []):
            yield panel["title"], target["expr"]
    for variable in dashboard.get("templating", {}).get("list", []):
        query = variable.get("query")
        yield f"variable {variable['name']}", query["query"] if isinstance(query, dict) else query


def test_the_extractor_finds_metric_names_and_nothing_else() -> None:
    expr = (
        "histogram_quantile(0.99, sum by (le, shard) "
        '(rate(loom_decision_latency_seconds_bucket{shard=~"$shard"}[5m])))'
        ' / on(shard) group_left sum(loom_queue_depth offset 5m) + topk(5, loom_link_rtt_ms{src="a"})'
    )
    assert metric_names(expr) == {
        "loom_decision_latency_seconds_bucket",
        "loom_queue_depth",
        "loom_link_rtt_ms",
    }
    assert metric_names('label_values(loom_cluster_gpus{region=~"$region"}, cluster)') == {
        "loom_cluster_gpus"
    }
    # A misspelt name is found, and is not exported: the check below could fail.
    assert metric_names("rate(loom_decisions_totl[1m])") == {"loom_decisions_totl"}
    assert "loom_decisions_totl" not in exported_names()


def test_the_four_dashboards_are_there_with_unique_uids() -> None:
    titles = {json.loads(p.read_text())["uid"] for p in DASHBOARDS}
    assert titles == {"loom-overview", "loom-network", "loom-scheduling", "loom-usage"}


@pytest.mark.parametrize("path", DASHBOARDS, ids=[p.stem for p in DASHBOARDS])
def test_every_panel_queries_only_metrics_loom_exports(path: Path) -> None:
    dashboard = json.loads(path.read_text())
    exported = exported_names()
    checked = 0
    for where, expr in _queries(dashboard):
        names = metric_names(expr)
        assert names, f"{path.name} / {where}: no metric in {expr!r}"
        unknown = names - exported
        assert not unknown, f"{path.name} / {where}: {sorted(unknown)} not exported by Loom ({expr!r})"
        checked += 1
    panels = [p for p in _panels(dashboard["panels"]) if p["type"] != "row"]
    assert panels and all(p.get("targets") for p in panels), f"{path.name}: a panel without a query"
    assert checked >= len(panels)


def test_the_overview_drills_down_to_a_cluster() -> None:
    overview = json.loads((ROOT / "deploy/grafana/dashboards/platform-overview.json").read_text())
    variables = {v["name"]: v for v in overview["templating"]["list"]}
    assert "cluster" in variables
    exprs = [t["expr"] for p in _panels(overview["panels"]) for t in p.get("targets", [])]
    assert any('cluster=~"$cluster"' in e for e in exprs)
    links = [
        link["url"]
        for p in _panels(overview["panels"])
        for link in p.get("fieldConfig", {}).get("defaults", {}).get("links", [])
    ]
    assert any("var-cluster=${__field.labels.cluster}" in url for url in links)


def test_grafana_reads_the_prometheus_the_dashboards_name() -> None:
    sources = yaml.safe_load((ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text())
    uids = {s["uid"] for s in sources["datasources"]}
    for path in DASHBOARDS:
        for panel in _panels(json.loads(path.read_text())["panels"]):
            if "datasource" in panel:
                assert panel["datasource"]["uid"] in uids, f"{path.name} / {panel['title']}"
