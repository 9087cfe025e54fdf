"""What the scheduler sees and wants: immutable snapshots the planner works on.

`Observation` is the actual state read from Nomad (and Consul health) in one
reconcile pass; `DesiredModel` is what the profiles and desired counts ask
for. Both are plain frozen values, so `plan()` is a pure function of them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any

# DrainRecord is the draining/ document; its one codec is in caravan/contract.py.
from caravan.contract import JOB_PREFIX, MANAGED_BY_VALUE, DrainRecord, JobMetaKey

if TYPE_CHECKING:
    from scheduler.profiles import ModelProfile

NS_PER_S = 1_000_000_000


class AllocState(StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    COMPLETE = "complete"
    FAILED = "failed"
    LOST = "lost"
    UNKNOWN = "unknown"


@dataclass(frozen=True, slots=True)
class ObservedAlloc:
    """One allocation of a replica job, as Nomad's allocation stub says."""

    id: str
    node_id: str
    client_status: str
    desired_status: str
    healthy: bool | None
    create_time_ns: int
    modify_time_ns: int

    @property
    def wants_to_run(self) -> bool:
        return self.desired_status == "run"

    @property
    def is_live(self) -> bool:
        """Pending or running, and Nomad still wants it to run."""
        return self.wants_to_run and self.client_status in {"pending", "running"}


@dataclass(frozen=True, slots=True)
class ObservedReplica:
    """One caravan replica job on Nomad, with its allocations and health."""

    job_id: str
    model: str
    replica: int
    spec_hash: str
    job_status: str
    stopped: bool
    submit_time_ns: int
    allocs: tuple[ObservedAlloc, ...] = ()
    # Consul's view of the replica's service instance: True passing, False
    # warning/critical, None not registered (yet) or unknown.
    passing: bool | None = None
    # running + waiting as the engine reports it; None when not scraped.
    inflight: float | None = None
    # The job's JobModifyIndex when read: a re-registration enforces it (facts N3).
    job_modify_index: int = 0

    def live_allocs(self) -> tuple[ObservedAlloc, ...]:
        return tuple(a for a in self.allocs if a.is_live)

    def latest_alloc(self) -> ObservedAlloc | None:
        if not self.allocs:
            return None
        return max(self.allocs, key=lambda a: a.create_time_ns)


@dataclass(frozen=True, slots=True)
class NodeView:
    id: str
    name: str
    status: str
    eligible: bool
    address: str = ""

    @property
    def is_up(self) -> bool:
        return self.status == "ready"


@dataclass(frozen=True, slots=True)
class Observation:
    """The actual state of caravan's replicas in one reconcile pass."""

    replicas: Mapping[str, ObservedReplica]
    nodes: Mapping[str, NodeView]
    # Drain markers from KV, by job id: these replicas get no new requests.
    draining: Mapping[str, DrainRecord]
    # Wall-clock time the observation was taken (seconds), to compare with
    # Nomad's nanosecond timestamps.
    taken_at: float

    def of_model(self, model: str) -> list[ObservedReplica]:
        return sorted(
            (r for r in self.replicas.values() if r.model == model), key=lambda r: r.replica
        )

    def models(self) -> set[str]:
        return {r.model for r in self.replicas.values()}


@dataclass(frozen=True, slots=True)
class DesiredModel:
    """A model as the desired state says: its profile and replica count."""

    profile: ModelProfile
    count: int


@dataclass(frozen=True, slots=True)
class PlannerMemory:
    """What the planner remembers between passes (returned, never hidden)."""

    # When each model was first seen with replicas but without a profile:
    # removal waits for a confirmation window (an empty read is suspect).
    orphaned_since: Mapping[str, float] = field(default_factory=dict)
    # The drain window of each model's last known profile, so a deleted
    # model's replicas still drain as long as their profile asked.
    drain_s: Mapping[str, float] = field(default_factory=dict)


def replica_from_job_stub(stub: Mapping[str, Any]) -> ObservedReplica | None:
    """A replica from a `GET /v1/jobs?meta=true` stub; None for jobs caravan does not own."""
    job_id = str(stub.get("ID", ""))
    meta = stub.get("Meta") or {}
    if not job_id.startswith(JOB_PREFIX) or meta.get(JobMetaKey.MANAGED_BY) != MANAGED_BY_VALUE:
        return None
    try:
        replica = int(meta[JobMetaKey.REPLICA])
        model = str(meta[JobMetaKey.MODEL])
    except (KeyError, ValueError):
        return None
    return ObservedReplica(
        job_id=job_id,
        model=model,
        replica=replica,
        spec_hash=str(meta.get(JobMetaKey.SPEC_HASH, "")),
        job_status=str(stub.get("Status", "")),
        stopped=bool(stub.get("Stop", False)),
        submit_time_ns=int(stub.get("SubmitTime") or 0),
        job_modify_index=int(stub.get("JobModifyIndex") or 0),
    )


def alloc_from_stub(stub: Mapping[str, Any]) -> ObservedAlloc:
    """An allocation from a `GET /v1/job/:id/allocations` stub."""
    deployment = stub.get("DeploymentStatus") or {}
    healthy = deployment.get("Healthy")
    return ObservedAlloc(
        id=str(stub["ID"]),
        node_id=str(stub.get("NodeID", "")),
        client_status=str(stub.get("ClientStatus", "")),
        desired_status=str(stub.get("DesiredStatus", "")),
        healthy=healthy if isinstance(healthy, bool) else None,
        create_time_ns=int(stub.get("CreateTime") or 0),
        modify_time_ns=int(stub.get("ModifyTime") or 0),
    )


def node_from_stub(stub: Mapping[str, Any]) -> NodeView:
    return NodeView(
        id=str(stub["ID"]),
        name=str(stub.get("Name", "")),
        status=str(stub.get("Status", "")),
        eligible=stub.get("SchedulingEligibility", "eligible") == "eligible",
        address=str(stub.get("Address", "")),
    )
