"""The operations runbook keeps up with the metrics, the alert rules and the KV layout.

Adding a metric to `scheduler/metrics.py` or `router/metrics.py` without a row
in `docs/operations.md`, or an alert rule that queries a name nobody exports,
fails here.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
from typing import Any

import yaml
from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.metrics_core import Metric
from test_grafana_dashboard import (
    ROOT,
    caravan_metric_families,
    exported_series_names,
    promql_metric_names,
    unknown_metric_names,
)

from caravan_llm.cli.main import build_parser
from caravan_llm.common.contract import KVLayout, ModelFailure, ScaleOverride
from caravan_llm.router.metrics import (
    EndpointGauge,
    RouterMetrics,
    RouterStateCollector,
    RouterStateView,
)
from caravan_llm.router.wiring.workers import merge_expositions
from caravan_llm.scheduler.metrics import SchedulerMetrics

OPERATIONS_DOC = ROOT / "docs" / "operations.md"
_YAML_FENCE = re.compile(r"^```yaml\n(.*?)^```", re.DOTALL | re.MULTILINE)
# A metric row of a table: | `name` | type | `label`, `label` | meaning |
_METRIC_ROW = re.compile(r"^\|\s*`(caravan_[a-z_]+)`\s*\|\s*([a-z]+)\s*\|([^|]*)\|", re.MULTILINE)
_BACKTICKED = re.compile(r"`([^`]+)`")
SEVERITIES = frozenset({"critical", "warning", "info"})


def doc_text() -> str:
    return OPERATIONS_DOC.read_text(encoding="utf-8")


def documented_name(family: Metric) -> str:
    """The name an operator sees on /metrics and in PromQL: counters carry `_total`."""
    return f"{family.name}_total" if family.type == "counter" else family.name


def _one_of_everything() -> RouterStateView:
    endpoint = EndpointGauge(
        endpoint="e",
        model="m",
        in_flight=0,
        breaker_phase="closed",
        status="passing",
        draining=False,
    )
    return RouterStateView(
        endpoints=(endpoint,),
        queue_depths={"m": 0},
        discovery_synced=True,
        discovery_staleness_s=0.0,
        kv_streams={"live": 1},
    )


def label_names_by_family() -> dict[str, frozenset[str]]:
    """The label names of every family, from the metric objects and a populated scrape."""
    registry = CollectorRegistry()
    scheduler = SchedulerMetrics.create(registry)
    router = RouterMetrics(registry)
    wrappers = [getattr(scheduler, field.name) for field in dataclasses.fields(scheduler)]
    wrappers += [value for value in vars(router).values() if isinstance(value, MetricWrapperBase)]
    labels = {metric._name: frozenset(metric._labelnames) for metric in wrappers}
    for family in RouterStateCollector(_one_of_everything).collect():
        labels[family.name] = frozenset(family.samples[0].labels)
    for family in merge_expositions({0: None}):
        labels[family.name] = frozenset(family.samples[0].labels)
    return labels


def yaml_blocks() -> list[Any]:
    return [yaml.safe_load(block) for block in _YAML_FENCE.findall(doc_text())]


def alert_rules() -> list[dict[str, Any]]:
    return [
        rule
        for block in yaml_blocks()
        if isinstance(block, dict) and "groups" in block
        for group in block["groups"]
        for rule in group["rules"]
    ]


def _balanced(expr: str) -> bool:
    depth: list[str] = []
    pairs = {")": "(", "]": "[", "}": "{"}
    for char in re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr):
        if char in "([{":
            depth.append(char)
        elif char in pairs and (not depth or depth.pop() != pairs[char]):
            return False
    return not depth


def test_every_metric_family_is_mentioned():
    """Each family the scheduler and the router register is named in the runbook."""
    text = doc_text()
    missing = [
        documented_name(family)
        for family in caravan_metric_families()
        if not re.search(rf"(?<![A-Za-z0-9_]){documented_name(family)}(?![A-Za-z0-9_])", text)
    ]
    assert [] == missing


def test_metric_tables_state_each_metrics_type_and_labels():
    """The metric tables have one row per family, with its real type and label names."""
    documented = {
        name: (kind, frozenset(_BACKTICKED.findall(labels)))
        for name, kind, labels in _METRIC_ROW.findall(doc_text())
    }
    labels = label_names_by_family()
    expected = {
        documented_name(family): (family.type, labels[family.name])
        for family in caravan_metric_families()
    }
    assert expected == documented


def test_every_yaml_block_parses():
    """Each ```yaml block of the runbook is valid YAML, and alert rules are among them."""
    blocks = yaml_blocks()
    assert blocks
    assert [] == [index for index, block in enumerate(blocks) if block is None]
    assert alert_rules()


def test_alert_rules_are_complete():
    """Each rule has a unique name, a balanced expression, a known severity and a summary."""
    problems = []
    names = [str(rule.get("alert")) for rule in alert_rules()]
    problems += [f"{name}: duplicate" for name in sorted({n for n in names if names.count(n) > 1})]
    for rule in alert_rules():
        name = rule.get("alert")
        expr = str(rule.get("expr", ""))
        if not expr.strip() or not _balanced(expr):
            problems.append(f"{name}: empty or unbalanced expr")
        if rule.get("labels", {}).get("severity") not in SEVERITIES:
            problems.append(f"{name}: severity not one of {sorted(SEVERITIES)}")
        if not rule.get("annotations", {}).get("summary"):
            problems.append(f"{name}: no summary")
        if "for" in rule and not re.fullmatch(r"\d+[smh]", str(rule["for"])):
            problems.append(f"{name}: `for` is not a duration")
    assert [] == problems


def test_alert_rules_query_only_exported_metrics():
    """Each caravan metric in an alert expression is a series the factories export."""
    exprs = [str(rule["expr"]) for rule in alert_rules()]
    assert {} == unknown_metric_names(exprs, exported_series_names())


def test_alert_rules_watch_what_needs_a_person():
    """Leadership, readiness, placement, reconciling and the router's health all have a rule."""
    used = {name for rule in alert_rules() for name in promql_metric_names(str(rule["expr"]))}
    watched = {
        "caravan_scheduler_leader",
        "caravan_scheduler_replicas_ready",
        "caravan_scheduler_replicas_unplaced",
        "caravan_scheduler_reconcile_passes_total",
        "caravan_router_discovery_staleness_seconds",
        "caravan_router_endpoint_breaker_state",
        "caravan_router_queue_wait_seconds_bucket",
        "caravan_router_requests_total",
    }
    assert set() == watched - used


def test_kv_reference_names_every_key_of_the_layout():
    """The KV table names every prefix and key of `KVLayout`, under the default prefix."""
    layout = KVLayout()
    keys = [
        layout.model_key("<name>"),
        layout.desired_key("<name>"),
        layout.state_key("<name>"),
        layout.demand_key("<name>"),
        layout.draining_key("<job-id>"),
        layout.leader,
        layout.cluster_config,
        layout.override_key("<name>"),
        layout.failure_key("<name>"),
    ]
    text = doc_text()
    assert [] == [key for key in keys if f"| `{key}` |" not in text]


_SH_FENCE = re.compile(r"^```sh\n(.*?)^```", re.DOTALL | re.MULTILINE)
# Placeholders the runbook uses in commands, and a value of the right kind for each.
_PLACEHOLDERS = {"NAME": "qwen2-5-7b", "N+k": "3", "<node-id>": "node-1"}


def runbook_caravan_commands() -> list[list[str]]:
    """Each `caravan ...` line of the runbook's sh blocks, as argv, placeholders filled in."""
    commands = []
    for block in _SH_FENCE.findall(doc_text()):
        for raw in block.splitlines():
            line = raw.split("  #")[0].strip().rstrip("\\").strip()
            if not line.startswith("caravan "):
                continue
            for placeholder, value in _PLACEHOLDERS.items():
                line = line.replace(placeholder, value)
            commands.append(shlex.split(line.split("|")[0])[1:])
    return commands


def test_every_caravan_command_of_the_runbook_is_one_the_cli_takes():
    """The CLI parses each command line the runbook tells operators to run, flags included."""
    commands = runbook_caravan_commands()
    refused = []
    for argv in commands:
        try:
            build_parser().parse_args(argv)
        except SystemExit:
            refused.append(" ".join(argv))
    assert ["scale", "qwen2-5-7b", "--auto"] in commands
    assert [] == refused


def test_the_scale_hold_fields_the_runbook_names_are_the_codecs():
    """The override and failure documents shown in the KV table are what the codecs write."""
    text = doc_text()
    override = json.loads(ScaleOverride(count=3, until=2.0, set_at=1.0).encode())
    failure = json.loads(ModelFailure(reason="r", since=1.0).encode())
    for document in (override, failure):
        shown = ", ".join(f'"{key}": ' for key in document)
        assert all(f'"{key}": ' in text for key in document), shown
    assert '`{"count": 3, "until": <unix time>, "set_at": <unix time>}`' in text
    assert '`{"reason": "...", "since": <unix time>}`' in text
