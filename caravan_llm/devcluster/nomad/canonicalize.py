"""Defaults and implied constraints Nomad adds to a job before validating it.

`canonicalize_job` is `api.Job.Canonicalize` plus the server's own
`structs.Job.Canonicalize` (facts N6); `add_implied_constraints` is the
`jobImpliedConstraints` admission mutator (kill signals, Consul services; facts N7).
Both are visible when the job is read back, as on a real cluster.
"""

from __future__ import annotations

import copy
from typing import Any

from caravan_llm.devcluster.nomad.gotext import NS_PER_HOUR, NS_PER_MIN, NS_PER_S

Json = dict[str, Any]

DEFAULT_NAMESPACE = "default"
DEFAULT_REGION = "global"
DEFAULT_PRIORITY = 50
DEFAULT_WEIGHT = 50


def default_update() -> Json:
    return {
        "Stagger": 30 * NS_PER_S,
        "MaxParallel": 1,
        "HealthCheck": "checks",
        "MinHealthyTime": 10 * NS_PER_S,
        "HealthyDeadline": 5 * NS_PER_MIN,
        "ProgressDeadline": 10 * NS_PER_MIN,
        "AutoRevert": False,
        "Canary": 0,
        "AutoPromote": False,
    }


def default_reschedule(job_type: str) -> Json:
    if job_type == "service":
        return {
            "Attempts": 0,
            "Interval": 0,
            "Delay": 30 * NS_PER_S,
            "DelayFunction": "exponential",
            "MaxDelay": NS_PER_HOUR,
            "Unlimited": True,
        }
    if job_type == "batch":
        return {
            "Attempts": 1,
            "Interval": 24 * NS_PER_HOUR,
            "Delay": 5 * NS_PER_S,
            "DelayFunction": "constant",
            "MaxDelay": 0,
            "Unlimited": False,
        }
    return {
        "Attempts": 0,
        "Interval": 0,
        "Delay": 0,
        "DelayFunction": "",
        "MaxDelay": 0,
        "Unlimited": False,
    }


def default_migrate() -> Json:
    return {
        "MaxParallel": 1,
        "HealthCheck": "checks",
        "MinHealthyTime": 10 * NS_PER_S,
        "HealthyDeadline": 5 * NS_PER_MIN,
    }


def default_restart(job_type: str) -> Json:
    if job_type in {"service", "system"}:
        return {
            "Delay": 15 * NS_PER_S,
            "Attempts": 2,
            "Interval": 30 * NS_PER_MIN,
            "Mode": "fail",
            "RenderTemplates": False,
        }
    return {
        "Delay": 15 * NS_PER_S,
        "Attempts": 3,
        "Interval": 24 * NS_PER_HOUR,
        "Mode": "fail",
        "RenderTemplates": False,
    }


def _merged(base: Json, override: Json | None) -> Json:
    """Fields set in `override` replace those of `base` (the api `Merge` methods)."""
    out = dict(base)
    if override:
        out.update(override)
    return out


def _with_defaults(value: Json, defaults: Json) -> Json:
    return {**defaults, **value}


def _canonicalize_affinities(affinities: list[Json] | None) -> None:
    for affinity in affinities or []:
        affinity.setdefault("Weight", DEFAULT_WEIGHT)


def _canonicalize_check(check: Json, service: Json) -> None:
    restart = service.get("CheckRestart")
    own = check.get("CheckRestart")
    if restart is not None or own is not None:
        merged = dict(restart or {})
        if own:
            if own.get("Limit", 0) > 0:
                merged["Limit"] = own["Limit"]
            if "Grace" in own:
                merged["Grace"] = own["Grace"]
            if own.get("IgnoreWarnings"):
                merged["IgnoreWarnings"] = True
        merged.setdefault("Limit", 0)
        merged.setdefault("Grace", NS_PER_S)
        merged.setdefault("IgnoreWarnings", False)
        check["CheckRestart"] = merged
    for name in ("SuccessBeforePassing", "FailuresBeforeCritical", "FailuresBeforeWarning"):
        if check.get(name, 0) < 0:
            check[name] = 0
    check.setdefault("OnUpdate", service["OnUpdate"])
    # The server side (`structs.ServiceCheck.Canonicalize`).
    if not check.get("Name"):
        check["Name"] = f'service: "{service["Name"]}" check'
    if not check.get("TaskName") and service.get("TaskName"):
        check["TaskName"] = service["TaskName"]


def _canonicalize_service(service: Json, job: Json, group: Json, task: Json | None) -> None:
    if not service.get("Name"):
        base = f"{job['Name']}-{group['Name']}"
        service["Name"] = f"{base}-{task['Name']}" if task is not None else base
    service["Name"] = (
        service["Name"]
        .replace("${JOB}", job["Name"])
        .replace("${TASKGROUP}", group["Name"])
        .replace("${TASK}", task["Name"] if task is not None else "group")
        .replace("${BASE}", f"{job['Name']}-{group['Name']}-{task['Name'] if task else 'group'}")
    )
    service.setdefault("AddressMode", "auto")
    service.setdefault("OnUpdate", "require_healthy")
    service.setdefault("Provider", "consul")
    service.setdefault("Cluster", "default")
    for key in ("Meta", "CanaryMeta", "TaggedAddresses", "Tags", "CanaryTags", "Checks"):
        if not service.get(key):
            service.pop(key, None)
    if task is not None and not service.get("TaskName"):
        service["TaskName"] = task["Name"]
    if service["Provider"] == "consul":
        service.setdefault("Namespace", DEFAULT_NAMESPACE)
    for check in service.get("Checks") or []:
        _canonicalize_check(check, service)


def _canonicalize_resources(resources: Json) -> None:
    if "Cores" not in resources:
        resources["Cores"] = 0
        resources.setdefault("CPU", 100)
    resources.setdefault("CPU", 0)
    resources.setdefault("MemoryMB", 300)
    for device in resources.get("Devices") or []:
        device.setdefault("Count", 1)
        _canonicalize_affinities(device.get("Affinities"))


def _canonicalize_task(task: Json, group: Json, job: Json) -> None:
    task.setdefault("Resources", {})
    _canonicalize_resources(task["Resources"])
    task.setdefault("KillTimeout", 5 * NS_PER_S)
    task["LogConfig"] = _with_defaults(
        task.get("LogConfig") or {}, {"MaxFiles": 10, "MaxFileSizeMB": 10, "Disabled": False}
    )
    for service in task.get("Services") or []:
        _canonicalize_service(service, job, group, task)
    _canonicalize_affinities(task.get("Affinities"))
    task["RestartPolicy"] = _merged(group["RestartPolicy"], task.get("RestartPolicy"))


def _canonicalize_group(group: Json, job: Json) -> None:
    job_type = job["Type"]
    group.setdefault("Name", "")
    if "Count" not in group:
        scaling_min = (group.get("Scaling") or {}).get("Min")
        group["Count"] = int(scaling_min) if scaling_min is not None else 1
    scaling = group.get("Scaling")
    if scaling is not None:
        scaling.setdefault("Enabled", True)
        scaling.setdefault("Min", group["Count"])
        scaling.setdefault("Type", "horizontal")
    group["EphemeralDisk"] = _with_defaults(
        group.get("EphemeralDisk") or {}, {"Sticky": False, "Migrate": False, "SizeMB": 300}
    )
    job_update = job.get("Update")
    if job_update is not None and "Update" in group:
        group["Update"] = _merged(job_update, group["Update"])
    elif job_update is not None:
        group["Update"] = dict(job_update)
    if "Update" in group:
        group["Update"] = _with_defaults(group["Update"], default_update())
    job_reschedule = job.get("Reschedule")
    if job_reschedule is not None:
        group["ReschedulePolicy"] = _merged(job_reschedule, group.get("ReschedulePolicy"))
    if "ReschedulePolicy" not in group and job_type not in {"system", "sysbatch"}:
        group["ReschedulePolicy"] = default_reschedule(job_type)
    if "ReschedulePolicy" in group:
        group["ReschedulePolicy"] = _with_defaults(
            group["ReschedulePolicy"], default_reschedule(job_type)
        )
    job_migrate = job.get("Migrate")
    if job_migrate is not None:
        group["Migrate"] = _merged(job_migrate, group.get("Migrate"))
    if "Migrate" not in group and job_type == "service":
        group["Migrate"] = {}
    if "Migrate" in group:
        group["Migrate"] = _with_defaults(group["Migrate"], default_migrate())
    group["RestartPolicy"] = _merged(default_restart(job_type), group.get("RestartPolicy"))
    for task in group.get("Tasks") or []:
        _canonicalize_task(task, group, job)
    for spread in group.get("Spreads") or []:
        spread.setdefault("Weight", DEFAULT_WEIGHT)
    _canonicalize_affinities(group.get("Affinities"))
    for service in group.get("Services") or []:
        _canonicalize_service(service, job, group, None)


def canonicalize_job(decoded: Json) -> Json:
    """A copy of the decoded job with every default Nomad fills in."""
    job = copy.deepcopy(decoded)
    job.setdefault("ID", "")
    job.setdefault("Name", job["ID"])
    job.setdefault("ParentID", "")
    job.setdefault("Namespace", DEFAULT_NAMESPACE)
    job.setdefault("Priority", DEFAULT_PRIORITY)
    job.setdefault("Stop", False)
    job.setdefault("Region", DEFAULT_REGION)
    job.setdefault("Type", "service")
    job.setdefault("AllAtOnce", False)
    for name in ("ConsulNamespace", "VaultNamespace", "NomadTokenID", "Status"):
        job.setdefault(name, "")
    job.setdefault("StatusDescription", "")
    job.setdefault("Stable", False)
    if "Update" in job:
        job["Update"] = _with_defaults(job["Update"], default_update())
    elif job["Type"] in {"service", "system"}:
        job["Update"] = default_update()
    for group in job.get("TaskGroups") or []:
        _canonicalize_group(group, job)
    for spread in job.get("Spreads") or []:
        spread.setdefault("Weight", DEFAULT_WEIGHT)
    _canonicalize_affinities(job.get("Affinities"))
    parameterized = job.get("ParameterizedJob")
    if isinstance(parameterized, dict) and not parameterized.get("Payload"):
        parameterized["Payload"] = "optional"
    # The server's own Canonicalize.
    if not job.get("Datacenters"):
        job["Datacenters"] = ["*"]
    if not job.get("NodePool"):
        job["NodePool"] = "default"
    if not job.get("Priority"):
        job["Priority"] = DEFAULT_PRIORITY
    return job


CONSUL_VERSION_CONSTRAINT: Json = {
    "LTarget": "${attr.consul.version}",
    "RTarget": ">= 1.8.0",
    "Operand": "semver",
}
NOMAD_SERVICES_CONSTRAINT: Json = {
    "LTarget": "${attr.nomad.service_discovery}",
    "RTarget": "true",
    "Operand": "=",
}


def _group_services(group: Json) -> list[Json]:
    services = list(group.get("Services") or [])
    for task in group.get("Tasks") or []:
        services.extend(task.get("Services") or [])
    return services


def _add_constraint(group: Json, constraint: Json, *, match_left_only: bool) -> None:
    existing = group.setdefault("Constraints", [])
    for current in existing:
        if match_left_only and current.get("LTarget") == constraint["LTarget"]:
            return
        if not match_left_only and all(current.get(k) == v for k, v in constraint.items()):
            return
    existing.append(dict(constraint))


def add_implied_constraints(job: Json) -> Json:
    """`jobImpliedConstraints`: kill signals and service providers need node support."""
    job = copy.deepcopy(job)
    for group in job.get("TaskGroups") or []:
        signals = sorted(
            {task["KillSignal"] for task in group.get("Tasks") or [] if task.get("KillSignal")}
        )
        if signals:
            signal_constraint = {
                "LTarget": "${attr.os.signals}",
                "RTarget": ",".join(signals),
                "Operand": "set_contains",
            }
            _add_constraint(group, signal_constraint, match_left_only=False)
        services = _group_services(group)
        if any(service.get("Provider") == "nomad" for service in services):
            _add_constraint(group, NOMAD_SERVICES_CONSTRAINT, match_left_only=False)
        for service in services:
            if service.get("Provider", "consul") != "consul":
                continue
            cluster = service.get("Cluster") or "default"
            constraint = dict(CONSUL_VERSION_CONSTRAINT)
            if cluster != "default":
                constraint["LTarget"] = f"${{attr.consul.{cluster}.version}}"
            _add_constraint(group, constraint, match_left_only=True)
    return job
