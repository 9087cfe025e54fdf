"""The Grafana dashboard only queries metrics that caravan really exports.

The metric names come from fresh registries built by the scheduler's and the
router's own metric factories, so renaming a metric (or forgetting a
`_total`/`_bucket` suffix in a query) fails here instead of leaving an empty
panel on somebody's wall.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric

from caravan_llm.router.metrics import RouterMetrics, RouterStateView
from caravan_llm.router.wiring.workers import merge_expositions
from caravan_llm.scheduler.metrics import SchedulerMetrics

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "docs" / "grafana" / "caravan-dashboard.json"
DATASOURCE_INPUT = "DS_PROMETHEUS"
MODEL_VARIABLE_QUERY = "label_values(caravan_scheduler_replicas_desired, model)"

# The series names Prometheus sees for one metric family, by its type.
_SERIES_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
    "summary": ("", "_count", "_sum", "_created"),
    "gauge": ("",),
}
# Quoted PromQL strings (label values, regexes): metric names never hide in them.
_PROMQL_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_CARAVAN_IDENTIFIER = re.compile(r"(?<![A-Za-z0-9_:])caravan_[a-z_]+(?![A-Za-z0-9_:])")
_GRAFANA_VARIABLE = re.compile(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)")
_GRAFANA_BUILTINS = frozenset({"__rate_interval", "__interval", "__range", "__range_s"})


def _empty_router_state() -> RouterStateView:
    return RouterStateView(
        endpoints=(), queue_depths={}, discovery_synced=False, discovery_staleness_s=0.0
    )


def caravan_metric_families() -> list[Metric]:
    """Every family the scheduler and the router register, from their own factories."""
    registry = CollectorRegistry()
    SchedulerMetrics.create(registry)
    RouterMetrics(registry).add_state_collector(_empty_router_state)
    # The multi-worker supervisor adds one family of its own to the workers' merged scrape.
    supervisor = [f for f in merge_expositions({0: None}) if f.name == "caravan_router_worker_up"]
    return [*registry.collect(), *supervisor]


def exported_series_names() -> frozenset[str]:
    """Every series name a query may use: family names with their type's suffixes."""
    names: set[str] = set()
    for family in caravan_metric_families():
        names.update(f"{family.name}{suffix}" for suffix in _SERIES_SUFFIXES[family.type])
        names.update(sample.name for sample in family.samples)
    return frozenset(names)


def promql_metric_names(expr: str) -> set[str]:
    """The caravan metric names an expression refers to (outside quoted strings)."""
    return set(_CARAVAN_IDENTIFIER.findall(_PROMQL_STRING.sub('""', expr)))


def unknown_metric_names(exprs: list[str], known: frozenset[str]) -> dict[str, set[str]]:
    """Each expression that names a caravan metric nobody exports, with those names."""
    found = {expr: promql_metric_names(expr) - known for expr in exprs}
    return {expr: names for expr, names in found.items() if names}


def all_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Every panel, rows included, with the panels of collapsed rows."""
    for panel in panels:
        yield panel
        yield from all_panels(panel.get("panels") or [])


def load_dashboard(path: Path = DASHBOARD) -> dict[str, Any]:
    document: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return document


def query_panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in all_panels(dashboard["panels"]) if p.get("type") != "row"]


def dashboard_exprs(dashboard: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in query_panels(dashboard) for t in p.get("targets", [])]


def test_every_panel_has_a_unique_id():
    """No two panels, rows included, share an id (Grafana links and edits panels by id)."""
    ids = [panel["id"] for panel in all_panels(load_dashboard()["panels"])]
    assert [] == sorted({i for i in ids if ids.count(i) > 1})


def test_every_panel_has_a_title_and_queries():
    """Each panel has a title and at least one target, and every target has an expression."""
    problems = []
    for panel in query_panels(load_dashboard()):
        if not str(panel.get("title", "")).strip():
            problems.append(f"panel {panel['id']}: no title")
        targets = panel.get("targets") or []
        if not targets:
            problems.append(f"panel {panel['id']}: no targets")
        problems.extend(
            f"panel {panel['id']} target {t.get('refId')}: empty expr"
            for t in targets
            if not str(t.get("expr", "")).strip()
        )
    assert [] == problems


def test_panels_fit_the_grid():
    """Every panel lies inside Grafana's 24-column grid."""
    outside = [
        panel["id"]
        for panel in all_panels(load_dashboard()["panels"])
        if panel["gridPos"]["x"] < 0 or panel["gridPos"]["x"] + panel["gridPos"]["w"] > 24
    ]
    assert [] == outside


def test_the_dashboard_covers_the_three_rows():
    """The Models, Router and Scheduler rows are there, in that order."""
    rows = [p["title"] for p in load_dashboard()["panels"] if p.get("type") == "row"]
    assert ["Models", "Router", "Scheduler"] == rows


def test_every_query_names_only_exported_metrics():
    """Each caravan metric name in a PromQL expression is a series the factories export."""
    assert {} == unknown_metric_names(dashboard_exprs(load_dashboard()), exported_series_names())


def test_the_dashboard_queries_every_metric_family():
    """Each family of the scheduler and the router has a panel that queries it."""
    used = {
        name for expr in dashboard_exprs(load_dashboard()) for name in promql_metric_names(expr)
    }
    families = caravan_metric_families()
    unqueried = [
        family.name
        for family in families
        if not any(f"{family.name}{suffix}" in used for suffix in _SERIES_SUFFIXES[family.type])
    ]
    assert [] == unqueried


def test_the_checker_flags_a_metric_nobody_exports():
    """A misspelt name, a counter without `_total` and a bare histogram are all caught."""
    exprs = [
        'sum(rate(caravan_router_requests_totl{model="caravan_scheduler_leader"}[5m]))',
        "rate(caravan_router_retries[5m])",
        "rate(caravan_router_queue_wait_seconds[5m])",
        "caravan_scheduler_leader",
    ]
    expected = {
        exprs[0]: {"caravan_router_requests_totl"},
        exprs[1]: {"caravan_router_retries"},
        exprs[2]: {"caravan_router_queue_wait_seconds"},
    }
    assert expected == unknown_metric_names(exprs, exported_series_names())


def test_every_datasource_is_the_prometheus_input():
    """The dashboard asks for one Prometheus data source on import and every query uses it."""
    dashboard = load_dashboard()
    inputs = {i["name"]: (i["type"], i["pluginId"]) for i in dashboard["__inputs"]}
    assert {DATASOURCE_INPUT: ("datasource", "prometheus")} == inputs
    expected = {"type": "prometheus", "uid": f"${{{DATASOURCE_INPUT}}}"}
    sources = [p["datasource"] for p in query_panels(dashboard)]
    sources += [t["datasource"] for p in query_panels(dashboard) for t in p["targets"]]
    sources += [v["datasource"] for v in dashboard["templating"]["list"]]
    assert [] == [source for source in sources if source != expected]


def test_the_model_variable_lists_the_schedulers_models():
    """A `model` query variable lists the profiles from the scheduler's desired-replica gauge."""
    variables = {v["name"]: v for v in load_dashboard()["templating"]["list"]}
    model = variables["model"]
    assert ("query", MODEL_VARIABLE_QUERY) == (model["type"], model["query"]["query"])
    assert MODEL_VARIABLE_QUERY == model["definition"]


def test_queries_use_only_defined_variables():
    """Every `$variable` in a query is a template variable of the dashboard or a Grafana one."""
    dashboard = load_dashboard()
    defined = {v["name"] for v in dashboard["templating"]["list"]} | _GRAFANA_BUILTINS
    used = {name for expr in dashboard_exprs(dashboard) for name in _GRAFANA_VARIABLE.findall(expr)}
    assert set() == used - defined
    assert "model" in used


def test_the_dashboard_is_a_current_grafana_schema():
    """The schema version is one current Grafana (10 and later) reads without migrating."""
    assert load_dashboard()["schemaVersion"] >= 38
