"""Checks that a rendered job meets the facts a real Nomad enforces.

Each rule names its source in `docs/nomad-consul-facts.md`. The checker returns a
list of violations so a failing test says every problem at once.
"""

from __future__ import annotations

import re
from typing import Any

# Duration fields of the structs caravan renders (facts N5): Go
# time.Duration, so integer nanoseconds in JSON.
DURATION_KEYS = frozenset(
    {
        "Interval",
        "Timeout",
        "Delay",
        "MaxDelay",
        "Grace",
        "MinHealthyTime",
        "HealthyDeadline",
        "ProgressDeadline",
        "Stagger",
        "KillTimeout",
        "ShutdownDelay",
    }
)
SERVICE_NAME = re.compile(r"^(?i:[a-z0-9]|[a-z0-9][a-z0-9\-]{0,61}[a-z0-9])$")
VALID_OPERANDS = frozenset(
    {
        "=",
        "==",
        "is",
        "!=",
        "not",
        "<",
        "<=",
        ">",
        ">=",
        "regexp",
        "version",
        "semver",
        "set_contains",
        "set_contains_all",
        "set_contains_any",
        "distinct_hosts",
        "distinct_property",
        "is_set",
        "is_not_set",
    }
)
ONE_SECOND_NS = 1_000_000_000
ALLOWED_LTARGET_PREFIXES = ("${attr.", "${device.", "${meta.")
ALLOWED_LTARGETS = frozenset(
    {
        "${node.unique.id}",
        "${node.datacenter}",
        "${node.unique.name}",
        "${node.class}",
        "${node.pool}",
    }
)


def _walk(node: Any, path: str, problems: list[str]) -> None:
    if isinstance(node, dict):
        for key, value in node.items():
            where = f"{path}.{key}"
            if key in DURATION_KEYS and not (isinstance(value, int) and value >= 0):
                problems.append(f"{where}: duration must be integer nanoseconds, got {value!r}")
            if key in {"Constraints", "Affinities"}:
                for i, item in enumerate(value):
                    _check_constraint(item, f"{where}[{i}]", problems)
            _walk(value, where, problems)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            _walk(value, f"{path}[{i}]", problems)


def _check_constraint(item: dict[str, Any], where: str, problems: list[str]) -> None:
    operand = item.get("Operand")
    if not operand:
        problems.append(f"{where}: Missing constraint operand (facts N5: JSON has no default)")
    elif operand not in VALID_OPERANDS:
        problems.append(f"{where}: Unknown constraint type {operand!r}")
    ltarget = item.get("LTarget", "")
    if operand != "distinct_hosts" and not ltarget:
        problems.append(f"{where}: no attribute provided but is required by operator")
    if ltarget.startswith("${") and not (
        ltarget in ALLOWED_LTARGETS or ltarget.startswith(ALLOWED_LTARGET_PREFIXES)
    ):
        problems.append(f"{where}: unsupported attribute {ltarget!r} (Nomad >= 2.0)")
    if "Weight" in item and not (-100 <= item["Weight"] <= 100 and item["Weight"] != 0):
        problems.append(f"{where}: affinity weight must be in [-100, 100] and non-zero")


def nomad_fact_violations(body: dict[str, Any]) -> list[str]:
    """Every way `body` (a PUT /v1/jobs body) breaks a rule real Nomad enforces."""
    problems: list[str] = []
    job = body.get("Job")
    if not isinstance(job, dict):
        return ["body: Job must be specified"]
    if not job.get("ID") or " " in job["ID"]:
        problems.append("Job.ID: missing or contains a space")
    _walk(job, "Job", problems)
    for group in job.get("TaskGroups", []):
        labels = {
            port["Label"]: port
            for network in group.get("Networks", [])
            for port in network.get("DynamicPorts", []) + network.get("ReservedPorts", [])
        }
        drivers = {task["Driver"] for task in group.get("Tasks", [])}
        if "raw_exec" in drivers or "exec" in drivers:
            for label, port in labels.items():
                if port.get("To"):
                    problems.append(f"port {label}: no To on raw_exec host ports (facts N18)")
        for service in group.get("Services", []):
            name = service.get("Name", "")
            if not SERVICE_NAME.fullmatch(name):
                problems.append(f"service {name!r}: not valid per RFC 1123 or longer than 63")
            if service.get("PortLabel") not in labels:
                problems.append(
                    f"service {name!r}: port label {service.get('PortLabel')!r} unknown"
                )
            for check in service.get("Checks", []):
                if check.get("Interval", 0) < ONE_SECOND_NS:
                    problems.append(f"service {name!r}: check interval below 1s")
                if check.get("Timeout", 0) < ONE_SECOND_NS:
                    problems.append(f"service {name!r}: check timeout below 1s")
                if check.get("Type") == "http" and not str(check.get("Path", "")).startswith("/"):
                    problems.append(f"service {name!r}: http type must have relative http path")
        for task in group.get("Tasks", []):
            resources = task.get("Resources", {})
            if "CPU" in resources and "Cores" in resources:
                problems.append(f"task {task['Name']}: cpu and cores both set")
            for device in resources.get("Devices", []):
                parts = device.get("Name", "").split("/")
                if not 1 <= len(parts) <= 3 or not all(parts):
                    problems.append(f"task {task['Name']}: bad device name {device.get('Name')!r}")
        update = job.get("Update", {})
        if update and update["MinHealthyTime"] >= update["HealthyDeadline"]:
            problems.append("Update: Minimum healthy time must be less than healthy deadline")
        if update and update["HealthyDeadline"] >= update["ProgressDeadline"]:
            problems.append("Update: Healthy deadline must be less than progress deadline")
        restart = group.get("RestartPolicy", {})
        if restart and restart["Attempts"] * restart["Delay"] > restart["Interval"]:
            problems.append("RestartPolicy: cannot restart that often in the interval")
    return problems
