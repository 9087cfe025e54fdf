"""Nomad's job validation, with its messages and nesting (facts N2, N8).

`validate_job` returns the top-level errors of the `jobValidate` admission
validator for a canonicalized job; Nomad answers a register with HTTP 500 and
the go-multierror text of that list (`validation_failure_text`). Nested
errors are embedded as their own multierror text, exactly where Nomad embeds
them (`Task group X validation failed: 1 error occurred: ...`).
Everything here is pure.
"""

from __future__ import annotations

import json
import posixpath
import re
from collections.abc import Mapping
from typing import Any

from caravan_llm.devcluster.nomad.gotext import NS_PER_S, go_duration, go_quote, multierror
from caravan_llm.devcluster.nomad.matching import (
    DISTINCT_HOSTS,
    DISTINCT_PROPERTY,
    NODE_EXACT_TARGETS,
    TARGET_PREFIXES,
    parse_version_constraint,
    validate_regexp,
)
from caravan_llm.devcluster.nomad.volumes import group_volume_errors, task_mount_errors

Json = dict[str, Any]

JOB_TYPES = frozenset({"service", "batch", "system", "sysbatch", "_core"})
JOB_MAX_PRIORITY = 100
MIN_CPU = 1
MIN_MEMORY_MB = 10
MIN_CHECK_INTERVAL_NS = NS_PER_S
RESTART_MIN_INTERVAL_NS = 5 * NS_PER_S
RESCHEDULE_MIN_DELAY_NS = 5 * NS_PER_S
RESCHEDULE_MIN_INTERVAL_NS = 15 * NS_PER_S
DELAY_FUNCTIONS = ("constant", "exponential", "fibonacci")
SERVICE_NAME = re.compile(r"^(?i:[a-z0-9]|[a-z0-9][a-z0-9\-]{0,61}[a-z0-9])$")
_INTERPOLATION = re.compile(r"\$\{[^}]*\}")
SERVICE_NAME_ERROR = (
    "Service name must be valid per RFC 1123 and can contain only alphanumeric characters "
    "or dashes and must be no longer than 63 characters"
)
CONSTRAINT_OPERANDS = frozenset({"=", "==", "is", "!=", "not", "<", "<=", ">", ">="})


def _nested(errors: list[str]) -> str | None:
    return multierror(errors) if errors else None


def _ascii_quote(text: str) -> str:
    """Go's `%+q`: quoted with non-ASCII escaped."""
    return json.dumps(text, ensure_ascii=True)


def _go_list_quote(values: tuple[str, ...]) -> str:
    return "[" + " ".join(go_quote(v) for v in values) + "]"


# -- constraints, affinities, spreads ------------------------------------


def _constraint_attribute_error(target: str) -> str | None:
    if not target.startswith("$"):
        return None
    if not target.startswith("${"):
        return f"attribute {go_quote(target)} is missing an opening brace"
    if not target.endswith("}"):
        return f"attribute {go_quote(target)} is missing a closing brace"
    if target in NODE_EXACT_TARGETS or target.startswith(TARGET_PREFIXES):
        return None
    return f"unsupported attribute {go_quote(target)}"


def constraint_errors(constraint: Mapping[str, Any]) -> list[str]:
    """`Constraint.Validate` (Nomad 2.x rules, LTarget checked)."""
    errors: list[str] = []
    operand = str(constraint.get("Operand", ""))
    rtarget = str(constraint.get("RTarget", ""))
    if not operand:
        errors.append("Missing constraint operand")
    require_ltarget = True
    if operand == DISTINCT_HOSTS:
        require_ltarget = False
    elif operand in {"set_contains_all", "set_contains_any", "set_contains"}:
        if not rtarget:
            errors.append("Set contains constraint requires an RTarget")
    elif operand == "regexp":
        problem = validate_regexp(rtarget)
        if problem is not None:
            errors.append(f"Regular expression failed to compile: {problem}")
    elif operand in {"version", "semver"}:
        if parse_version_constraint(rtarget, strict_semver=operand == "semver") is None:
            label = "Version" if operand == "version" else "Semver"
            errors.append(f"{label} constraint is invalid: Malformed constraint: {rtarget}")
    elif operand == DISTINCT_PROPERTY:
        if rtarget:
            if not rtarget.isdigit():
                errors.append(
                    f"Failed to convert RTarget {go_quote(rtarget)} to uint64: "
                    f"strconv.ParseUint: parsing {go_quote(rtarget)}: invalid syntax"
                )
            elif int(rtarget) < 1:
                errors.append(
                    f"Distinct Property must have an allowed count of 1 or greater: {rtarget} < 1"
                )
    elif operand in {"is_set", "is_not_set"}:
        if rtarget:
            errors.append(f"Operator {go_quote(operand)} does not support an RTarget")
    elif operand in CONSTRAINT_OPERANDS:
        if not rtarget:
            errors.append(f"Operator {go_quote(operand)} requires an RTarget")
    elif operand:
        errors.append(f"Unknown constraint type {go_quote(operand)}")
    if require_ltarget:
        ltarget = str(constraint.get("LTarget", ""))
        if not ltarget:
            errors.append("no attribute provided but is required by operator")
        else:
            problem = _constraint_attribute_error(ltarget)
            if problem is not None:
                errors.append(problem)
    return errors


def affinity_errors(affinity: Mapping[str, Any]) -> list[str]:
    """`Affinity.Validate`."""
    errors: list[str] = []
    operand = str(affinity.get("Operand", ""))
    rtarget = str(affinity.get("RTarget", ""))
    if not operand:
        errors.append("Missing affinity operand")
    if operand in {"set_contains_all", "set_contains_any", "set_contains"}:
        if not rtarget:
            errors.append("Set contains operators require an RTarget")
    elif operand == "regexp":
        problem = validate_regexp(rtarget)
        if problem is not None:
            errors.append(f"Regular expression failed to compile: {problem}")
    elif operand in {"version", "semver"}:
        if parse_version_constraint(rtarget, strict_semver=operand == "semver") is None:
            label = "Version" if operand == "version" else "Semver"
            errors.append(f"{label} affinity is invalid: Malformed constraint: {rtarget}")
    elif operand in CONSTRAINT_OPERANDS:
        if not rtarget:
            errors.append(f"Operator {go_quote(operand)} requires an RTarget")
    else:
        errors.append(f"Unknown affinity operator {go_quote(operand)}")
    if not affinity.get("LTarget"):
        errors.append("No LTarget provided but is required")
    weight = int(affinity.get("Weight", 0))
    if weight == 0:
        errors.append("Affinity weight cannot be zero")
    if not -100 <= weight <= 100:
        errors.append("Affinity weight must be within the range [-100,100]")
    return errors


def spread_errors(spread: Mapping[str, Any]) -> list[str]:
    """`Spread.Validate`."""
    errors: list[str] = []
    if not spread.get("Attribute"):
        errors.append("Missing spread attribute")
    weight = int(spread.get("Weight", 0))
    if weight <= 0 or weight > 100:
        errors.append("Spread block must have a positive weight from 0 to 100")
    seen: set[str] = set()
    total = 0
    for target in spread.get("SpreadTarget") or []:
        value = str(target.get("Value", ""))
        if value in seen:
            errors.append(f"Spread target value {go_quote(value)} already defined")
        seen.add(value)
        percent = int(target.get("Percent", 0))
        if percent > 100:
            errors.append(
                f"Spread target percentage for value {go_quote(value)} must be between 0 and 100"
            )
        total += percent
    if total > 100:
        errors.append(
            f"Sum of spread target percentages must not be greater than 100%; got {total}%"
        )
    return errors


def _numbered(kind: str, items: list[Json] | None, check: Any) -> list[str]:
    errors: list[str] = []
    for position, item in enumerate(items or [], start=1):
        nested = _nested(check(item))
        if nested is not None:
            errors.append(f"{kind} {position} validation failed: {nested}")
    return errors


# -- group policies ------------------------------------------------------


def restart_errors(policy: Mapping[str, Any]) -> list[str]:
    """`RestartPolicy.Validate`."""
    errors: list[str] = []
    mode = str(policy.get("Mode", ""))
    attempts = int(policy.get("Attempts", 0))
    interval = int(policy.get("Interval", 0))
    delay = int(policy.get("Delay", 0))
    if mode not in {"delay", "fail"}:
        errors.append(f"Unsupported restart mode: {go_quote(mode)}")
    if attempts == 0 and mode != "fail":
        errors.append(f"Restart policy {go_quote(mode)} with {attempts} attempts is ambiguous")
    if interval < RESTART_MIN_INTERVAL_NS:
        errors.append(
            f"Interval can not be less than {go_duration(RESTART_MIN_INTERVAL_NS)} "
            f"(got {go_duration(interval)})"
        )
    if attempts * delay > interval:
        errors.append(
            f"Nomad can't restart the TaskGroup {attempts} times in an interval of "
            f"{go_duration(interval)} with a delay of {go_duration(delay)}"
        )
    return errors


def _viable_attempts(policy: Mapping[str, Any]) -> tuple[bool, int, int]:
    attempts = int(policy.get("Attempts", 0))
    interval = int(policy.get("Interval", 0))
    delay = int(policy.get("Delay", 0))
    max_delay = int(policy.get("MaxDelay", 0))
    possible = 0
    recommended = 0
    valid = True
    match policy.get("DelayFunction"):
        case "constant":
            recommended = attempts * delay
            if interval < recommended:
                possible = interval // delay if delay else 0
                valid = False
        case "exponential":
            for step in range(attempts):
                next_delay = (2**step) * delay
                if next_delay > max_delay:
                    recommended += max_delay
                else:
                    recommended = next_delay
                if recommended < interval:
                    possible += 1
            valid = possible >= attempts
        case "fibonacci":
            slots = [delay, delay]
            ceiling = False
            for step in range(2, attempts):
                if ceiling:
                    next_delay = slots[step - 1] + max_delay
                else:
                    next_delay = slots[step - 1] + slots[step - 2]
                    if next_delay > max_delay:
                        next_delay = max_delay
                        ceiling = True
                slots.append(next_delay)
            recommended = slots[-1]
            if interval < recommended:
                valid = False
                possible = next((i for i, slot in enumerate(slots) if slot > interval), 0)
        case _:
            return False, 0, 0
    return valid, max(possible, 0), recommended


def reschedule_errors(policy: Mapping[str, Any]) -> list[str]:
    """`ReschedulePolicy.Validate`."""
    attempts = int(policy.get("Attempts", 0))
    unlimited = bool(policy.get("Unlimited", False))
    if not (attempts > 0 or unlimited):
        return []
    interval = int(policy.get("Interval", 0))
    delay = int(policy.get("Delay", 0))
    max_delay = int(policy.get("MaxDelay", 0))
    function = str(policy.get("DelayFunction", ""))
    errors: list[str] = []
    if attempts > 0:
        if interval <= 0:
            errors.append("Interval must be a non zero value if Attempts > 0")
        if unlimited:
            errors.append(
                f"Reschedule Policy with Attempts = {attempts}, "
                f"Interval = {go_duration(interval)}, "
                f"and Unlimited = {str(unlimited).lower()} is ambiguous"
            )
            errors.append("If Attempts >0, Unlimited cannot also be set to true")
    pre_check = True
    if delay < RESCHEDULE_MIN_DELAY_NS:
        errors.append(
            f"Delay cannot be less than {go_duration(RESCHEDULE_MIN_DELAY_NS)} "
            f"(got {go_duration(delay)})"
        )
        pre_check = False
    if function not in DELAY_FUNCTIONS:
        errors.append(
            f"Invalid delay function {go_quote(function)}, must be one of "
            f"{_go_list_quote(DELAY_FUNCTIONS)}"
        )
        pre_check = False
    if function != "constant":
        if max_delay < RESCHEDULE_MIN_DELAY_NS:
            errors.append(
                f"Max Delay cannot be less than {go_duration(RESCHEDULE_MIN_DELAY_NS)} "
                f"(got {go_duration(delay)})"
            )
            pre_check = False
        if max_delay < delay:
            errors.append(
                f"Max Delay cannot be less than Delay {go_duration(delay)} "
                f"(got {go_duration(max_delay)})"
            )
            pre_check = False
    if not unlimited:
        if interval < RESCHEDULE_MIN_INTERVAL_NS:
            errors.append(
                f"Interval cannot be less than {go_duration(RESCHEDULE_MIN_INTERVAL_NS)} "
                f"(got {go_duration(interval)})"
            )
        if pre_check:
            valid, possible, recommended = _viable_attempts(policy)
            if not valid:
                if function == "constant":
                    errors.append(
                        f"Nomad can only make {possible} attempts in {go_duration(interval)} "
                        f"with initial delay {go_duration(delay)} and delay function "
                        f"{go_quote(function)}"
                    )
                else:
                    errors.append(
                        f"Nomad can only make {possible} attempts in {go_duration(interval)} "
                        f"with initial delay {go_duration(delay)}, delay function "
                        f"{go_quote(function)}, and delay ceiling {go_duration(max_delay)}"
                    )
                rounded = round(recommended / NS_PER_S) * NS_PER_S
                errors.append(
                    f"Set the interval to at least {go_duration(rounded)} to accommodate "
                    f"{attempts} attempts"
                )
    return errors


def update_errors(update: Mapping[str, Any]) -> list[str]:
    """`UpdateStrategy.Validate`."""
    errors: list[str] = []
    health = str(update.get("HealthCheck", ""))
    if health not in {"checks", "task_states", "manual"}:
        errors.append(f"Invalid health check given: {go_quote(health)}")
    max_parallel = int(update.get("MaxParallel", 0))
    canary = int(update.get("Canary", 0))
    min_healthy = int(update.get("MinHealthyTime", 0))
    healthy_deadline = int(update.get("HealthyDeadline", 0))
    progress = int(update.get("ProgressDeadline", 0))
    stagger = int(update.get("Stagger", 0))
    if max_parallel < 0:
        errors.append(f"Max parallel can not be less than zero: {max_parallel} < 0")
    if canary < 0:
        errors.append(f"Canary count can not be less than zero: {canary} < 0")
    if canary == 0 and update.get("AutoPromote"):
        errors.append("Auto Promote requires a Canary count greater than zero")
    if min_healthy < 0:
        errors.append(f"Minimum healthy time may not be less than zero: {go_duration(min_healthy)}")
    if healthy_deadline <= 0:
        errors.append(
            f"Healthy deadline must be greater than zero: {go_duration(healthy_deadline)}"
        )
    if progress < 0:
        errors.append(f"Progress deadline must be zero or greater: {go_duration(progress)}")
    if min_healthy >= healthy_deadline:
        errors.append(
            "Minimum healthy time must be less than healthy deadline: "
            f"{go_duration(min_healthy)} > {go_duration(healthy_deadline)}"
        )
    if progress != 0 and healthy_deadline >= progress:
        errors.append(
            "Healthy deadline must be less than progress deadline: "
            f"{go_duration(healthy_deadline)} > {go_duration(progress)}"
        )
    if stagger <= 0:
        errors.append(f"Stagger must be greater than zero: {go_duration(stagger)}")
    return errors


def migrate_errors(migrate: Mapping[str, Any]) -> list[str]:
    """`MigrateStrategy.Validate`."""
    errors: list[str] = []
    max_parallel = int(migrate.get("MaxParallel", 0))
    health = str(migrate.get("HealthCheck", ""))
    min_healthy = int(migrate.get("MinHealthyTime", 0))
    deadline = int(migrate.get("HealthyDeadline", 0))
    if max_parallel < 0:
        errors.append(f"MaxParallel must be >= 0 but found {max_parallel}")
    if health == "" and max_parallel > 0:
        errors.append("Missing HealthCheck")
    elif health not in {"", "checks", "task_states"}:
        errors.append(f"Invalid HealthCheck: {go_quote(health)}")
    if min_healthy < 0:
        errors.append(f"MinHealthyTime is {go_duration(min_healthy)} and must be >= 0")
    if deadline < 0:
        errors.append(f"HealthyDeadline is {go_duration(deadline)} and must be >= 0")
    if min_healthy > deadline:
        errors.append("MinHealthyTime must be less than HealthyDeadline")
    return errors


# -- services ------------------------------------------------------------


def _check_error(check: Mapping[str, Any]) -> str | None:
    """`ServiceCheck.validateCommon` + `validateConsul`: the first problem, as Nomad stops there."""
    kind = str(check.get("Type", "")).lower()
    allowed = ("grpc", "tcp", "http", "script")
    if kind not in allowed:
        return f"invalid check type ({go_quote(kind)}), must be one of {', '.join(allowed)}"
    if kind == "http":
        path = str(check.get("Path", ""))
        if not path:
            return "http type must have http path"
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.\-]*:", path):
            return "http type must have relative http path"
    if kind == "script" and not check.get("Command"):
        return "script type must have a valid script path"
    interval = int(check.get("Interval", 0))
    if interval == 0:
        return "missing required value interval. Interval cannot be less than 1s"
    if interval < MIN_CHECK_INTERVAL_NS:
        return f"interval ({go_duration(interval)}) cannot be lower than 1s"
    timeout = int(check.get("Timeout", 0))
    if timeout == 0:
        return "missing required value timeout. Timeout cannot be less than 1s"
    if timeout < MIN_CHECK_INTERVAL_NS:
        return f"timeout ({go_duration(timeout)}) is lower than required minimum timeout 1s"
    initial = str(check.get("InitialStatus", ""))
    if initial not in {"", "passing", "warning", "critical"}:
        return (
            f"invalid initial check state ({initial}), must be one of "
            '"passing", "warning", "critical" or empty'
        )
    mode = str(check.get("AddressMode", ""))
    if mode == "auto":
        return f'invalid address_mode "{mode}" - auto only valid for services'
    if mode not in {"", "host", "driver", "alloc", "alloc_ipv6"}:
        return f"invalid address_mode {go_quote(mode)}"
    on_update = str(check.get("OnUpdate", ""))
    if on_update not in {"", "ignore", "require_healthy", "ignore_warnings"}:
        return (
            'on_update must be "require_healthy", "ignore_warnings", or "ignore"; '
            f"got {go_quote(on_update)}"
        )
    restart = check.get("CheckRestart")
    if restart is not None:
        if on_update == "ignore":
            return f"on_update value {go_quote(on_update)} is not compatible with check_restart"
        if not restart.get("IgnoreWarnings") and on_update == "ignore_warnings":
            return (
                f"on_update value {go_quote(on_update)} not supported with check_restart "
                'ignore_warnings value "false"'
            )
        restart_problems = []
        if int(restart.get("Limit", 0)) < 0:
            restart_problems.append(
                f"limit must be greater than or equal to 0 but found {restart['Limit']}"
            )
        if int(restart.get("Grace", 0)) < 0:
            restart_problems.append(
                f"grace period must be greater than or equal to 0 but found {restart['Grace']}"
            )
        if restart_problems:
            return multierror(restart_problems)
    for name, label in (
        ("SuccessBeforePassing", "success_before_passing"),
        ("FailuresBeforeCritical", "failures_before_critical"),
        ("FailuresBeforeWarning", "failures_before_warning"),
    ):
        value = int(check.get(name, 0))
        if value < 0:
            return f"{label} must be non-negative"
        if value > 0 and kind not in {"tcp", "http", "grpc"}:
            return f"{label} not supported for check of type {go_quote(kind)}"
    if len(str(check.get("Notes", ""))) > 255:
        return "notes must not be longer than 255 characters"
    return None


def service_errors(service: Mapping[str, Any]) -> list[str]:
    """`Service.Validate` (Consul provider checks in full, Nomad provider's basics)."""
    errors: list[str] = []
    name = str(service.get("Name", ""))
    if not SERVICE_NAME.match(_INTERPOLATION.sub("ENV-VAR", name)):
        errors.append(f"{SERVICE_NAME_ERROR}: {go_quote(name)}")
    mode = str(service.get("AddressMode", ""))
    if mode in {"host", "driver", "alloc", "alloc_ipv6"} and service.get("Address"):
        errors.append('Service address_mode must be "auto" if address is set')
    elif mode not in {"", "auto", "host", "driver", "alloc", "alloc_ipv6"}:
        errors.append(
            f'Service address_mode must be "auto", "host", or "driver"; not {go_quote(mode)}'
        )
    on_update = str(service.get("OnUpdate", ""))
    if on_update not in {"", "ignore", "require_healthy", "ignore_warnings"}:
        errors.append(
            'Service on_update must be "require_healthy", "ignore_warnings", or "ignore"; '
            f"not {go_quote(on_update)}"
        )
    provider = str(service.get("Provider", ""))
    if provider not in {"consul", "nomad"}:
        errors.append(f'Service provider must be "consul", or "nomad"; not {go_quote(provider)}')
        return errors
    for check in service.get("Checks") or []:
        check_name = str(check.get("Name", ""))
        requires_port = str(check.get("Type", "")) in {"grpc", "http", "tcp"}
        if not service.get("PortLabel") and not check.get("PortLabel") and requires_port:
            errors.append(
                f"Check {check_name} invalid: check requires a port but neither check nor "
                f"service {_ascii_quote(name)} have a port"
            )
            continue
        problem = _check_error(check)
        if problem is not None:
            errors.append(f"Check {check_name} invalid: {problem}")
    return errors


def _group_service_errors(group: Json) -> list[str]:
    errors: list[str] = []
    providers: set[str] = set()
    seen: set[tuple[str, str, str]] = set()
    duplicates: list[tuple[str, str, str]] = []
    for task in group.get("Tasks") or []:
        for service in task.get("Services") or []:
            key = (
                str(service.get("Name")),
                str(task.get("Name")),
                str(service.get("PortLabel", "")),
            )
            if key in seen:
                duplicates.append(key)
            seen.add(key)
            providers.add(str(service.get("Provider", "consul")))
    for position, service in enumerate(group.get("Services") or []):
        key = (str(service.get("Name")), "group", str(service.get("PortLabel", "")))
        if key in seen:
            duplicates.append(key)
        seen.add(key)
        providers.add(str(service.get("Provider", "consul")))
        nested = _nested(service_errors(service))
        if nested is not None:
            errors.append(
                f"Service[{position}] {service.get('Name', '')} validation failed: {nested}"
            )
    if duplicates:
        listed = ", ".join(
            f"{task}->{name}" + (f":{port}" if port else "") for name, task, port in duplicates
        )
        errors.append(f"Services are not unique: {listed}")
    if len(providers) > 1:
        errors.append(
            "Multiple service providers used: task group services must use the same provider"
        )
    return errors


def _network_errors(group: Json) -> list[str]:
    errors: list[str] = []
    labels: dict[str, str] = {}
    static: dict[int, str] = {}
    for network in group.get("Networks") or []:
        for port in [*(network.get("ReservedPorts") or []), *(network.get("DynamicPorts") or [])]:
            label = str(port.get("Label", ""))
            if label in labels:
                errors.append(f"Port label {label} already in use by {labels[label]}")
            else:
                labels[label] = "taskgroup network"
            value = int(port.get("Value", 0))
            if value != 0:
                if value in static and not port.get("IgnoreCollision"):
                    errors.append(f"Static port {value} already reserved by {static[value]}")
                elif value > 65535:
                    errors.append(f"Port {label} ({value}) cannot be greater than 65535")
                else:
                    static[value] = f"taskgroup network:{label}"
            to = int(port.get("To", 0))
            if to < -1:
                errors.append(f"Port {go_quote(label)} cannot be mapped to negative value {to}")
            elif to > 65535:
                errors.append(
                    f"Port {go_quote(label)} cannot be mapped to a port ({to}) greater than 65535"
                )
    return errors


# -- tasks ---------------------------------------------------------------


def _device_errors(device: Mapping[str, Any]) -> list[str]:
    errors: list[str] = []
    if not device.get("Name"):
        errors.append(
            "device name must be given as one of the following: type, vendor/type, "
            "or vendor/type/name"
        )
    for position, constraint in enumerate(device.get("Constraints") or [], start=1):
        operand = str(constraint.get("Operand", ""))
        if operand in {DISTINCT_HOSTS, DISTINCT_PROPERTY}:
            errors.append(
                f"Constraint {position} validation failed: using unsupported operand "
                f"{go_quote(operand)}"
            )
            continue
        nested = _nested(constraint_errors(constraint))
        if nested is not None:
            errors.append(f"Constraint {position} validation failed: {nested}")
    errors += _numbered("Affinity", device.get("Affinities"), affinity_errors)
    return errors


def resources_errors(resources: Mapping[str, Any]) -> list[str]:
    """`Resources.Validate`."""
    errors: list[str] = []
    cpu = int(resources.get("CPU", 0))
    cores = int(resources.get("Cores", 0))
    memory = int(resources.get("MemoryMB", 0))
    if cores > 0 and cpu > 0:
        errors.append("Task can only ask for 'cpu' or 'cores' resource, not both.")
    if cores < 0:
        errors.append(f"cores value ({cores}) cannot be negative")
    minimums: list[str] = []
    if cpu < MIN_CPU and cores == 0:
        minimums.append(f"minimum CPU value is {MIN_CPU}; got {cpu}")
    if memory < MIN_MEMORY_MB:
        minimums.append(f"minimum MemoryMB value is {MIN_MEMORY_MB}; got {memory}")
    if minimums:
        errors.append(multierror(minimums))
    if int(resources.get("DiskMB", 0)) > 0:
        errors.append(
            "Task can't ask for disk resources, they have to be specified at the task group level."
        )
    for position, device in enumerate(resources.get("Devices") or [], start=1):
        nested = _nested(_device_errors(device))
        if nested is not None:
            errors.append(f"device {position} failed validation: {nested}")
    memory_max = int(resources.get("MemoryMaxMB", 0))
    if memory_max not in {0, -1} and memory_max < memory:
        errors.append(
            f"MemoryMaxMB value ({memory_max}) should be larger than MemoryMB value ({memory})"
        )
    return errors


def _task_service_errors(task: Json, group: Json) -> list[str]:
    errors: list[str] = []
    ports: dict[str, set[str]] = {}
    known: set[str] = set()
    for position, service in enumerate(task.get("Services") or []):
        name = str(service.get("Name", ""))
        nested = _nested(service_errors(service))
        if nested is not None:
            errors.append(f"service[{position}] {_ascii_quote(name)} validation failed: {nested}")
        key = name + str(service.get("PortLabel", ""))
        if key in known:
            errors.append(f"service {go_quote(name)} is duplicate")
        known.add(key)
        if service.get("PortLabel"):
            ports.setdefault(str(service["PortLabel"]), set()).add(name)
        for check in service.get("Checks") or []:
            if str(check.get("Type", "")) not in {"grpc", "http", "tcp"}:
                continue
            label = str(check.get("PortLabel") or service.get("PortLabel") or "")
            if label and not label.isdigit():
                ports.setdefault(label, set()).add(name)
    labels: set[str] = set()
    networks = group.get("Networks") or []
    if networks:
        for port in [
            *(networks[0].get("ReservedPorts") or []),
            *(networks[0].get("DynamicPorts") or []),
        ]:
            labels.add(str(port.get("Label", "")))
    for label in sorted(ports):
        if label not in labels:
            names = ", ".join(sorted(ports[label]))
            errors.append(
                f"port label {go_quote(label)} referenced by services {names} does not exist"
            )
    return errors


def task_errors(task: Json, group: Json, job_type: str) -> list[str]:
    """`Task.Validate`: nested multierrors stay nested, as in Nomad."""
    errors: list[str] = []
    name = str(task.get("Name", ""))
    if not name:
        errors.append("Missing task name")
    if name == "alloc":
        errors.append('Task cannot be named "alloc"')
    if "/" in name or "\\" in name:
        errors.append("Task name cannot include slashes")
    if not task.get("Driver"):
        errors.append("Missing task driver")
    kill_timeout = int(task.get("KillTimeout", 0))
    update = group.get("Update") or {}
    progress = int(update.get("ProgressDeadline", 0))
    if kill_timeout < 0:
        errors.append("KillTimeout must be a positive value")
    elif job_type == "service" and update and progress > 0 and kill_timeout > progress:
        errors.append(
            f"KillTimout ({go_duration(kill_timeout)}) longer than the group's "
            f"ProgressDeadline ({go_duration(progress)})"
        )
    if int(task.get("ShutdownDelay", 0)) < 0:
        errors.append("ShutdownDelay must be a positive value")
    resources = task.get("Resources")
    if resources is None:
        errors.append("Missing task resources")
    else:
        nested = _nested(resources_errors(resources))
        if nested is not None:
            errors.append(nested)
    log_config = task.get("LogConfig") or {}
    log_problems: list[str] = []
    max_files = int(log_config.get("MaxFiles", 0))
    max_size = int(log_config.get("MaxFileSizeMB", 0))
    if max_files < 1:
        log_problems.append(f"minimum number of files is 1; got {max_files}")
    if max_size < 1:
        log_problems.append(f"minimum file size is 1MB; got {max_size}")
    disk = int((group.get("EphemeralDisk") or {}).get("SizeMB", 0))
    if disk <= max_files * max_size:
        log_problems.append(
            f"log storage ({max_files * max_size} MB) must be less than requested disk "
            f"capacity ({disk} MB)"
        )
    if log_problems:
        errors.append(multierror(log_problems))
    for position, constraint in enumerate(task.get("Constraints") or [], start=1):
        nested = _nested(constraint_errors(constraint))
        if nested is not None:
            errors.append(f"Constraint {position} validation failed: {nested}")
        if constraint.get("Operand") in {DISTINCT_HOSTS, DISTINCT_PROPERTY}:
            errors.append(
                f"Constraint {position} has disallowed Operand at task level: "
                f"{constraint['Operand']}"
            )
    if job_type == "system" and task.get("Affinities") is not None:
        errors.append("System jobs may not have an affinity block")
    else:
        errors += _numbered("Affinity", task.get("Affinities"), affinity_errors)
    nested = _nested(_task_service_errors(task, group))
    if nested is not None:
        errors.append(nested)
    payload = task.get("DispatchPayload")
    if payload is not None and dispatch_file_escapes(str(payload.get("File") or "")):
        errors.append(
            "Dispatch Payload validation failed: destination escapes allocation directory"
        )
    errors += task_mount_errors(task, group)
    return errors


def dispatch_file_escapes(file: str) -> bool:
    """`PathEscapesAllocViaRelative("task/local/", file)`: cleaned, it leaves the alloc dir."""
    cleaned = posixpath.normpath(posixpath.join("task/local/", file))
    return cleaned == ".." or cleaned.startswith("../") or posixpath.isabs(cleaned)


def group_errors(group: Json, job: Json) -> list[str]:
    """`TaskGroup.Validate`, flattening exactly where `multierror.Append` flattens."""
    errors: list[str] = []
    job_type = str(job.get("Type", ""))
    name = str(group.get("Name", ""))
    if not name:
        errors.append("Missing task group name")
    if int(group.get("Count", 0)) < 0:
        errors.append("Task group count can't be negative")
    tasks = group.get("Tasks") or []
    if not tasks:
        errors.append("Missing tasks for task group")
    errors += _numbered("Constraint", group.get("Constraints"), constraint_errors)
    if job_type == "system" and group.get("Affinities") is not None:
        errors.append("System jobs may not have an affinity block")
    else:
        errors += _numbered("Affinity", group.get("Affinities"), affinity_errors)
    if group.get("RestartPolicy") is not None:
        errors += restart_errors(group["RestartPolicy"])
    else:
        errors.append(f"Task Group {name} should have a restart policy")
    if job_type == "system" and group.get("Spreads") is not None:
        errors.append("System jobs may not have a spread block")
    else:
        errors += _numbered("Spread", group.get("Spreads"), spread_errors)
    if job_type in {"system", "sysbatch"}:
        if group.get("ReschedulePolicy") is not None:
            errors.append("System or sysbatch jobs should not have a reschedule policy")
    elif group.get("ReschedulePolicy") is not None:
        errors += reschedule_errors(group["ReschedulePolicy"])
    else:
        errors.append(f"Task Group {name} should have a reschedule policy")
    disk = group.get("EphemeralDisk")
    if disk is None:
        errors.append(f"Task Group {name} should have an ephemeral disk object")
    elif int(disk.get("SizeMB", 0)) < 10:
        errors.append(f"minimum DiskMB value is 10; got {int(disk.get('SizeMB', 0))}")
    if group.get("Update") is not None:
        if job_type not in {"service", "system"}:
            errors.append(f"Job type {go_quote(job_type)} does not allow update block")
        errors += update_errors(group["Update"])
    if group.get("Migrate") is not None:
        if job_type == "service":
            errors += migrate_errors(group["Migrate"])
        else:
            errors.append(f"Job type {go_quote(job_type)} does not allow migrate block")
    seen: dict[str, int] = {}
    for position, task in enumerate(tasks, start=1):
        task_name = str(task.get("Name", ""))
        if not task_name:
            errors.append(f"Task {position} missing name")
        elif task_name in seen:
            errors.append(f"Task {position} redefines '{task_name}' from task {seen[task_name]}")
        else:
            seen[task_name] = position
    errors += group_volume_errors(group, job_type)
    nested = _nested(_network_errors(group))
    if nested is not None:
        errors.append(f"Task group network validation failed: {nested}")
    nested = _nested(_group_service_errors(group))
    if nested is not None:
        errors.append(f"Task group service validation failed: {nested}")
    scaling = group.get("Scaling")
    if scaling is not None:
        scaling_problems: list[str] = []
        count = int(group.get("Count", 0))
        if int(scaling.get("Max", 0)) < int(scaling.get("Min", 0)):
            scaling_problems.append(
                "Scaling policy invalid: maximum count must not be less than minimum count"
            )
        if int(scaling.get("Max", 0)) < count:
            scaling_problems.append(
                "Scaling policy invalid: task group count must not be greater than maximum "
                "count in scaling policy"
            )
        if count < int(scaling.get("Min", 0)):
            scaling_problems.append(
                "Scaling policy invalid: task group count must not be less than minimum "
                "count in scaling policy"
            )
        nested = _nested(scaling_problems)
        if nested is not None:
            errors.append(f"Task group scaling policy validation failed: {nested}")
    for task in tasks:
        nested = _nested(task_errors(task, group, job_type))
        if nested is not None:
            errors.append(f"Task {task.get('Name', '')} validation failed: {nested}")
    return errors


def is_parameterized(job: Json) -> bool:
    """`Job.IsParameterized`: a parameterized job that is not itself a dispatched child."""
    return job.get("ParameterizedJob") is not None and not job.get("Dispatched")


def validate_job(job: Json) -> list[str]:
    """The top-level error list of `jobValidate.Validate` for a canonicalized job."""
    errors: list[str] = []
    job_id = str(job.get("ID", ""))
    if not job.get("Region"):
        errors.append("Missing job region")
    if not job_id:
        errors.append("Missing job ID")
    elif " " in job_id:
        errors.append("Job ID contains a space")
    elif "\x00" in job_id:
        errors.append("Job ID contains a null character")
    if not job.get("Name"):
        errors.append("Missing job name")
    if not job.get("Namespace"):
        errors.append("Job must be in a namespace")
    job_type = str(job.get("Type", ""))
    if not job_type:
        errors.append("Missing job type")
    elif job_type not in JOB_TYPES:
        errors.append(f"Invalid job type: {go_quote(job_type)}")
    datacenters = job.get("Datacenters") or []
    if not datacenters:
        errors.append("Missing job datacenters")
    elif any(dc == "" for dc in datacenters):
        errors.append("Job datacenter must be non-empty string")
    groups = job.get("TaskGroups") or []
    if not groups:
        errors.append("Missing job task groups")
    errors += _numbered("Constraint", job.get("Constraints"), constraint_errors)
    if job_type == "system":
        if job.get("Affinities") is not None:
            errors.append("System jobs may not have an affinity block")
        if job.get("Spreads") is not None:
            errors.append("System jobs may not have a spread block")
    else:
        errors += _numbered("Affinity", job.get("Affinities"), affinity_errors)
        errors += _numbered("Spread", job.get("Spreads"), spread_errors)
    names: dict[str, int] = {}
    for position, group in enumerate(groups, start=1):
        name = str(group.get("Name", ""))
        if not name:
            errors.append(f"Job task group {position} missing name")
        elif name in names:
            errors.append(f"Job task group {position} redefines '{name}' from group {names[name]}")
        else:
            names[name] = position
        if int(group.get("ShutdownDelay", 0)) < 0:
            errors.append("ShutdownDelay must be a positive value")
        if job_type == "system" and int(group.get("Count", 0)) > 1:
            errors.append(
                f"Job task group {name} has count {group['Count']}. "
                "Count cannot exceed 1 with system scheduler"
            )
    for group in groups:
        nested = _nested(group_errors(group, job))
        if nested is not None:
            errors.append(f"Task group {group.get('Name', '')} validation failed: {nested}")
    if is_parameterized(job) and job_type not in {"batch", "sysbatch"}:
        errors.append('Parameterized job can only be used with "batch" or "sysbatch" scheduler')
    if job_type == "_core":
        errors.append("job type cannot be core")
    priority = int(job.get("Priority", 0))
    if not 1 <= priority <= JOB_MAX_PRIORITY:
        errors.append(f"job priority must be between [1, {JOB_MAX_PRIORITY}]")
    return errors


def job_warnings(job: Json) -> list[str]:
    """`Job.Warnings`: the ones that apply to what caravan renders."""
    warnings: list[str] = []
    for group in job.get("TaskGroups") or []:
        name = str(group.get("Name", ""))
        update = group.get("Update")
        count = int(group.get("Count", 0))
        if update is not None and count > 1 and int(update.get("MaxParallel", 0)) > count:
            message = (
                "Update max parallel count is greater than task group count "
                f"({update['MaxParallel']} > {count}). A destructive change would result "
                "in the simultaneous replacement of all allocations."
            )
            nested = multierror([message])
            warnings.append(f"Group {go_quote(name)} has warnings: {nested}")
        warnings += _shutdown_delay_warnings(group)
    return warnings


def _shutdown_delay_warnings(group: Json) -> list[str]:
    warnings: list[str] = []
    name = str(group.get("Name", ""))
    referenced: set[str] = set()
    unscoped = False
    for service in group.get("Services") or []:
        if service.get("TaskName"):
            referenced.add(str(service["TaskName"]))
        else:
            unscoped = True
    any_task_delay = False
    for task in group.get("Tasks") or []:
        task_name = str(task.get("Name", ""))
        delay = int(task.get("ShutdownDelay", 0))
        if task_name in referenced and delay == 0:
            warnings.append(
                f"group {go_quote(name)} references task {go_quote(task_name)} in a service "
                "definition, but the task has no shutdown_delay set"
            )
        if delay > 0:
            any_task_delay = True
        elif task.get("Services"):
            warnings.append(
                f"task {go_quote(task_name)} in group {go_quote(name)} defines services, "
                "but has no shutdown_delay set"
            )
    if unscoped and int(group.get("ShutdownDelay", 0)) <= 0 and not any_task_delay:
        warnings.append(
            f"group {go_quote(name)} defines services, but neither the group nor any of its "
            "tasks have shutdown_delay set"
        )
    return warnings


def warnings_text(warnings: list[str]) -> str:
    """`helper.MergeMultierrorWarnings`: "" or "N warning(s):\\n\\n* ..."."""
    if not warnings:
        return ""
    head = "1 warning:\n" if len(warnings) == 1 else f"{len(warnings)} warnings:\n"
    return head + "".join(f"\n* {warning.strip()}" for warning in warnings)


def validation_failure_text(errors: list[str]) -> str:
    """The HTTP 500 body Nomad answers a register of an invalid job with."""
    return multierror(errors)
