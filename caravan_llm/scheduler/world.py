"""What the scheduler sees and wants: immutable snapshots the planner works on.

`Observation` is the actual state read from Nomad (and Consul health) in one
reconcile pass, made of the typed values `caravan_llm.common.nomad_api` decoded (its
allocations are `Allocation`s, its nodes `Node`s: no JSON is read here);
`DesiredModel` is what the profiles and desired counts ask for. Both are
plain frozen values, so `assess()` and `plan()` are pure functions of them.
`scheduler/observe.py` reads an `Observation` once per pass; the controller
and `caravan status` both start from it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

# DrainRecord is the draining/ document; its one codec is in caravan_llm/common/contract.py.
from caravan_llm.common.contract import (
    JOB_PREFIX,
    MANAGED_BY_VALUE,
    TASK_NAME,
    DrainRecord,
    JobMetaKey,
)
from caravan_llm.common.nomad_api import (
    AllocatedPort,
    Allocation,
    Evaluation,
    JobStub,
    Node,
    TaskEvent,
)

if TYPE_CHECKING:
    from caravan_llm.scheduler.profiles import ModelProfile
    from caravan_llm.scheduler.weights import ObservedPrefetch


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
    allocs: tuple[Allocation, ...] = ()
    # Consul's view of the replica's service instance: True passing, False
    # warning/critical, None not registered (yet) or unknown.
    passing: bool | None = None
    # running + waiting as the engine reports it; None when not scraped.
    inflight: float | None = None
    # The job's JobModifyIndex when read: a re-registration enforces it (facts N3).
    job_modify_index: int = 0
    # The job's version: only its allocations say how the current spec did.
    version: int = 0

    def live_allocs(self) -> tuple[Allocation, ...]:
        return tuple(a for a in self.allocs if a.live)

    def latest_alloc(self) -> Allocation | None:
        if not self.allocs:
            return None
        return max(self.allocs, key=lambda a: a.create_time_ns)


def engine_events(alloc: Allocation) -> tuple[TaskEvent, ...]:
    """The allocation's events of its engine task, oldest first (a replica's group may also
    run a KV relay, whose events say nothing of the engine)."""
    return tuple(e for e in alloc.task_events if e.task in {TASK_NAME, ""})


@dataclass(frozen=True, slots=True)
class AllocEngine:
    """The port Nomad allocated for an allocation's `http` label, and the node it runs on."""

    port: AllocatedPort
    node_name: str
    # The host port of its `kv` label (the KV relay's digest stream), when
    # Nomad allocated one at the engine's address; None: the replica has no relay.
    kv_port: int | None = None


@dataclass(frozen=True, slots=True)
class EngineLogTail:
    """The last stderr lines of one allocation's engine, or why they could not be read
    (scheduler/engine_logs.py)."""

    alloc_id: str
    lines: tuple[str, ...] = ()
    # Set when the lines could not be read (then `lines` is empty).
    unavailable: str | None = None


@dataclass(frozen=True, slots=True)
class Observation:
    """The actual state of caravan's replicas in one reconcile pass."""

    replicas: Mapping[str, ObservedReplica]
    nodes: Mapping[str, Node]
    # Drain markers from KV, by job id: these replicas get no new requests.
    draining: Mapping[str, DrainRecord]
    # Wall-clock time the observation was taken (seconds), to compare with
    # Nomad's nanosecond timestamps.
    taken_at: float
    # Each model's prefetch job as Nomad reports it (models with one only).
    prefetch: Mapping[str, ObservedPrefetch] = field(default_factory=dict)
    # Where each allocation's engine listens (its `http` port) and on which node.
    engines: Mapping[str, AllocEngine] = field(default_factory=dict)
    # Consul's check status ("passing", "warning", "critical") by allocation id;
    # an allocation with no registered instance is absent.
    health: Mapping[str, str] = field(default_factory=dict)
    # The evaluations of replica jobs without a live allocation, by job id
    # (why Nomad does not place them); a job whose evaluations were not read is absent.
    evaluations: Mapping[str, tuple[Evaluation, ...]] = field(default_factory=dict)
    # The stderr tail of each replica job's newest allocation whose engine
    # exited non-zero, by job id; absent: none crashed, or nobody asked to read.
    engine_logs: Mapping[str, EngineLogTail] = field(default_factory=dict)

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
    # When each model's last crowded replica was moved apart (plan rule 7),
    # kept for the move backoff.
    moved_at: Mapping[str, float] = field(default_factory=dict)


def replica_from_job_stub(stub: JobStub) -> ObservedReplica | None:
    """A replica from a `GET /v1/jobs?meta=true` stub; None for jobs caravan does not own."""
    meta = stub.meta
    if not stub.id.startswith(JOB_PREFIX) or meta.get(JobMetaKey.MANAGED_BY) != MANAGED_BY_VALUE:
        return None
    try:
        replica = int(meta[JobMetaKey.REPLICA])
        model = str(meta[JobMetaKey.MODEL])
    except (KeyError, ValueError):
        return None
    return ObservedReplica(
        job_id=stub.id,
        model=model,
        replica=replica,
        spec_hash=str(meta.get(JobMetaKey.SPEC_HASH, "")),
        job_status=stub.status,
        stopped=stub.stop,
        submit_time_ns=stub.submit_time_ns,
        job_modify_index=stub.job_modify_index,
        version=stub.version,
    )
