"""Builders for the pure Nomad stand-in tests: nodes, jobs and allocations."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Any

from caravan_llm.devcluster.nomad.canonicalize import add_implied_constraints, canonicalize_job
from caravan_llm.devcluster.nomad.decode import JOB_REGISTER_REQUEST, decode_body
from caravan_llm.devcluster.nomad.fingerprint import loopback_address, node_from_spec
from caravan_llm.devcluster.nomad.model import AllocatedResources, Allocation, Node, TaskResources
from caravan_llm.devcluster.nomad.settings import NodeSpec

FIXTURES = Path(__file__).parents[2] / "contract" / "nomad" / "fixtures"
NS = 1_000_000_000


def make_node(number: int, **spec: Any) -> Node:
    """A ready node `node-<number>` with id `node-id-<number>`."""
    node = node_from_spec(
        NodeSpec(**spec),
        node_id=f"node-id-{number}",
        name=f"node-{number}",
        address=loopback_address(number),
        registered_at_ns=0,
    )
    return dataclasses.replace(node, status="ready")


def admitted(job: dict[str, Any]) -> dict[str, Any]:
    """A job as the server stores it: decoded, canonicalized, with implied constraints."""
    decoded = decode_body(json.dumps({"Job": job}).encode(), JOB_REGISTER_REQUEST)["Job"]
    stored = add_implied_constraints(canonicalize_job(decoded))
    stored.setdefault("Version", 0)
    stored.setdefault("CreateIndex", 1)
    stored.setdefault("JobModifyIndex", 1)
    return stored


def example_job(name: str) -> dict[str, Any]:
    job: dict[str, Any] = json.loads((FIXTURES / name).read_text())["Job"]
    return job


def cpu_job(
    job_id: str = "web", *, count: int = 1, cpu: int = 100, memory: int = 64, **extra: Any
) -> dict[str, Any]:
    """A raw_exec service job with one dynamic port, admitted."""
    job: dict[str, Any] = {
        "ID": job_id,
        "Datacenters": ["dc1"],
        "TaskGroups": [
            {
                "Name": "g",
                "Count": count,
                "Networks": [{"Mode": "host", "DynamicPorts": [{"Label": "http"}]}],
                "Tasks": [
                    {
                        "Name": "t",
                        "Driver": "raw_exec",
                        "Config": {"command": "true"},
                        "Resources": {"CPU": cpu, "MemoryMB": memory},
                    }
                ],
            }
        ],
    }
    job.update(copy.deepcopy(extra))
    return admitted(job)


def make_alloc(
    job: dict[str, Any],
    node: Node,
    index: int = 0,
    *,
    alloc_id: str | None = None,
    cpu: int = 100,
    memory: int = 64,
    **changes: Any,
) -> Allocation:
    group = job["TaskGroups"][0]
    alloc = Allocation(
        id=alloc_id or f"{job['ID']}-alloc-{index}",
        namespace=job["Namespace"],
        eval_id="eval-0",
        name=f"{job['ID']}.{group['Name']}[{index}]",
        node_id=node.id,
        node_name=node.name,
        job_id=job["ID"],
        job_version=int(job.get("Version", 0)),
        task_group=group["Name"],
        resources=AllocatedResources(
            tasks={
                "t": TaskResources(
                    cpu_shares=cpu, reserved_cores=(), memory_mb=memory, memory_max_mb=0
                )
            },
            disk_mb=300,
            ip=node.address,
        ),
        metrics={},
        create_time_ns=0,
        modify_time_ns=0,
        client_status="running",
        create_index=1,
    )
    return dataclasses.replace(alloc, **changes)
