"""The environment Nomad gives a task and its `${...}` interpolation (facts N18).

`task_environment` builds the variables of `client/taskenv` (ports, alloc and
job identity, limits, `NOMAD_META_*`, device visibility); `interpolate`
replaces `${VAR}`, `${node.*}`, `${attr.*}` and `${meta.*}` in a string,
leaving unknown references as they are, like Nomad.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from caravan_llm.devcluster.nomad.model import Allocation, Node, find_group

Json = dict[str, Any]

_REFERENCE = re.compile(r"\$\{([^}]+)\}")
_UNCLEAN = re.compile(r"[^A-Za-z0-9_]")


def clean_env_var(name: str) -> str:
    """`helper.CleanEnvVar`: anything but letters, digits and `_` becomes `_`."""
    return _UNCLEAN.sub("_", name)


def node_variables(node: Node, region: str) -> dict[str, str]:
    variables = {
        "node.unique.id": node.id,
        "node.unique.name": node.name,
        "node.datacenter": node.datacenter,
        "node.region": region,
        "node.class": node.node_class,
        "node.pool": node.node_pool,
    }
    variables.update({f"attr.{key}": value for key, value in node.attributes.items()})
    variables.update({f"meta.{key}": value for key, value in node.meta.items()})
    return variables


def interpolate(text: str, env: Mapping[str, str], node_vars: Mapping[str, str]) -> str:
    def substitute(match: re.Match[str]) -> str:
        name = match.group(1)
        if name in env:
            return env[name]
        if name.startswith("env.") and name[4:] in env:
            return env[name[4:]]
        return node_vars.get(name, match.group(0))

    return _REFERENCE.sub(substitute, text)


def _cpuset(cores: tuple[int, ...]) -> str:
    return ",".join(str(core) for core in sorted(cores))


def alloc_environment(alloc: Allocation, job: Json, node: Node, alloc_dir: Path) -> dict[str, str]:
    """Variables shared by every task of the allocation (and its group services)."""
    group: Json = find_group(job, alloc.task_group) or {}
    env = {
        "NOMAD_ALLOC_DIR": str(alloc_dir / "alloc"),
        "NOMAD_ALLOC_ID": alloc.id,
        "NOMAD_SHORT_ALLOC_ID": alloc.id[:8],
        "NOMAD_ALLOC_NAME": alloc.name,
        "NOMAD_ALLOC_INDEX": str(alloc.index),
        "NOMAD_JOB_ID": str(job.get("ID", "")),
        "NOMAD_JOB_NAME": str(job.get("Name", "")),
        "NOMAD_GROUP_NAME": alloc.task_group,
        "NOMAD_DC": node.datacenter,
        "NOMAD_REGION": str(job.get("Region", "global")),
        "NOMAD_NAMESPACE": alloc.namespace,
    }
    if job.get("ParentID"):
        env["NOMAD_JOB_PARENT_ID"] = str(job["ParentID"])
    for port in alloc.resources.ports:
        label = clean_env_var(port.label)
        container_port = port.to if port.to > 0 else port.value
        env[f"NOMAD_PORT_{label}"] = str(container_port)
        env[f"NOMAD_ALLOC_PORT_{label}"] = str(container_port)
        env[f"NOMAD_HOST_PORT_{label}"] = str(port.value)
        env[f"NOMAD_IP_{label}"] = port.host_ip
        env[f"NOMAD_HOST_IP_{label}"] = port.host_ip
        env[f"NOMAD_ADDR_{label}"] = f"{port.host_ip}:{port.value}"
        env[f"NOMAD_HOST_ADDR_{label}"] = f"{port.host_ip}:{port.value}"
    meta: dict[str, str] = {}
    meta.update(job.get("Meta") or {})
    meta.update(group.get("Meta") or {})
    for key, value in meta.items():
        env[f"NOMAD_META_{clean_env_var(key)}"] = str(value)
        env[f"NOMAD_META_{clean_env_var(key).upper()}"] = str(value)
    return env


def task_environment(
    alloc: Allocation,
    job: Json,
    task: Json,
    node: Node,
    alloc_dir: Path,
    *,
    shared_dir: Path | None = None,
) -> dict[str, str]:
    """Every variable a task process sees, its own `Env` interpolated last.

    `shared_dir`: where the task sees the allocation's shared `alloc/` folder
    when not at its host path (a docker task's `/alloc`, which devcluster
    stands in for with a short link: see `AllocRunner.shared_dir`).
    """
    env = alloc_environment(alloc, job, node, alloc_dir)
    if shared_dir is not None:
        env["NOMAD_ALLOC_DIR"] = str(shared_dir)
    name = str(task.get("Name", ""))
    resources = alloc.resources.tasks.get(name)
    env.update(
        {
            "NOMAD_TASK_NAME": name,
            "NOMAD_TASK_DIR": str(alloc_dir / name / "local"),
            "NOMAD_SECRETS_DIR": str(alloc_dir / name / "secrets"),
        }
    )
    if resources is not None:
        env["NOMAD_CPU_LIMIT"] = str(resources.cpu_shares)
        env["NOMAD_MEMORY_LIMIT"] = str(resources.memory_mb)
        if resources.memory_max_mb:
            env["NOMAD_MEMORY_MAX_LIMIT"] = str(resources.memory_max_mb)
        if resources.reserved_cores:
            env["NOMAD_CPU_CORES"] = _cpuset(resources.reserved_cores)
        gpu_ids = [
            device_id
            for device in resources.devices
            if device.vendor == "nvidia"
            for device_id in device.device_ids
        ]
        if gpu_ids:
            env["NVIDIA_VISIBLE_DEVICES"] = ",".join(gpu_ids)
    for key, value in (task.get("Meta") or {}).items():
        env[f"NOMAD_META_{clean_env_var(key)}"] = str(value)
        env[f"NOMAD_META_{clean_env_var(key).upper()}"] = str(value)
    node_vars = node_variables(node, str(job.get("Region", "global")))
    for key, value in (task.get("Env") or {}).items():
        env[key] = interpolate(str(value), env, node_vars)
    return env
