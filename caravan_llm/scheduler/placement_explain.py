"""Say in plain words why Nomad could not place a replica.

Nomad explains a failed placement with an AllocMetric (`FailedTGAllocs` of a
blocked evaluation or a plan): counts of nodes filtered by each constraint
and of nodes exhausted in each resource dimension. `explain_failed_placement`
turns that, plus what the replica asked for, into one sentence a user can act
on, such as "no node has 2 free H100 (5 nodes have no matching GPU)". A
replica restricted to a node pool (every one but pool `all`) names it, since
Nomad considers no node outside it: "every matching node in node pool
"default" is full (...)".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class ReplicaAsk:
    """What one replica needs, in the terms a user wrote."""

    gpu_count: int = 0
    gpu_class: str = ""
    cpu_mhz: int | None = None
    cores: int | None = None
    memory_mb: int | None = None
    driver: str = ""
    # The job's Nomad node pool; "" or "all" when it is not restricted to one.
    node_pool: str = ""

    @classmethod
    def from_job(cls, job: Mapping[str, Any], gpu_class: str = "") -> ReplicaAsk:
        task = job["TaskGroups"][0]["Tasks"][0]
        resources = task.get("Resources") or {}
        devices = resources.get("Devices") or []
        return cls(
            gpu_count=sum(int(d.get("Count", 1)) for d in devices),
            gpu_class=gpu_class,
            cpu_mhz=resources.get("CPU"),
            cores=resources.get("Cores"),
            memory_mb=resources.get("MemoryMB"),
            driver=str(task.get("Driver", "")),
            node_pool=str(job.get("NodePool") or ""),
        )

    @property
    def pool_words(self) -> str:
        """' in node pool "x"' when the replica is kept to a pool, else ''."""
        if self.node_pool in {"", "all"}:
            return ""
        return f' in node pool "{self.node_pool}"'


def _plural(count: int, word: str) -> str:
    return f"{count} {word}" if count == 1 else f"{count} {word}s"


def _gpu_words(ask: ReplicaAsk) -> str:
    label = ask.gpu_class.upper() if ask.gpu_class else "GPU"
    return f"{ask.gpu_count} free {label}"


def _nodes(count: int, one: str, many: str) -> str:
    """'1 node has' / '3 nodes have': the count with a verb that agrees."""
    return f"{_plural(count, 'node')} {one if count == 1 else many}"


def _constraint_reason(reason: str, count: int, ask: ReplicaAsk) -> str:
    if reason == "missing devices":
        return f"{_nodes(count, 'has', 'have')} no matching GPU"
    if reason == "missing drivers":
        return f"{_nodes(count, 'lacks', 'lack')} the {ask.driver or 'task'} driver"
    if reason == "distinct_hosts":
        return f"{_nodes(count, 'already runs', 'already run')} this job"
    if reason.startswith("missing compatible host volumes"):
        return f"{_nodes(count, 'lacks', 'lack')} a host volume"
    return f"{_nodes(count, 'fails', 'fail')} the constraint {reason}"


def _dimension_reason(dimension: str, count: int, ask: ReplicaAsk) -> str:
    has = _nodes(count, "has", "have")
    if dimension.startswith("devices"):
        return f"{has} too few free GPUs"
    if dimension == "cpu":
        wanted = f"{ask.cores} cores" if ask.cores else f"{ask.cpu_mhz} MHz CPU"
        return f"{has} less than {wanted} free"
    if dimension == "cores":
        return f"{has} fewer than {ask.cores} free cores"
    if dimension == "memory":
        return f"{has} less than {ask.memory_mb} MB memory free"
    if dimension.startswith("network"):
        return f"{has} no free port"
    return f"{_nodes(count, 'is', 'are')} out of {dimension}"


def explain_failed_placement(metric: Mapping[str, Any], ask: ReplicaAsk) -> str:
    """One sentence on why a replica could not be placed, from Nomad's AllocMetric."""
    evaluated = int(metric.get("NodesEvaluated") or 0)
    constraint = dict(metric.get("ConstraintFiltered") or {})
    dimension = dict(metric.get("DimensionExhausted") or {})
    details = [
        _constraint_reason(reason, int(count), ask)
        for reason, count in sorted(constraint.items(), key=lambda kv: (-int(kv[1]), kv[0]))
    ]
    details += [
        _dimension_reason(dim, int(count), ask)
        for dim, count in sorted(dimension.items(), key=lambda kv: (-int(kv[1]), kv[0]))
    ]
    gpu_short = "missing devices" in constraint or any(d.startswith("devices") for d in dimension)
    pool = ask.pool_words
    if ask.gpu_count and gpu_short:
        headline = f"no node{pool} has {_gpu_words(ask)}"
    elif evaluated == 0 and pool and not metric.get("NodesInPool"):
        headline = (
            f"no client node is ready{pool} (the profile's node_pool or the cluster "
            "config's node_pools keeps the replica there)"
        )
    elif evaluated == 0 and not metric.get("NodesAvailable"):
        headline = "no client node is available (none registered, all down or ineligible)"
    elif dimension and not constraint:
        headline = f"every matching node{pool} is full"
    else:
        headline = f"no node{pool} satisfies the replica's requirements"
    if metric.get("QuotaExhausted"):
        details.append("the namespace quota is exhausted")
    if evaluated:
        details.append(f"{_plural(evaluated, 'node')} evaluated")
    return f"{headline} ({'; '.join(details)})" if details else headline


def explain_failed_groups(failed: Mapping[str, Any] | None, ask: ReplicaAsk) -> str | None:
    """The explanation for a blocked evaluation's `FailedTGAllocs`, or None if nothing failed."""
    if not failed:
        return None
    return "; ".join(explain_failed_placement(metric, ask) for _, metric in sorted(failed.items()))
