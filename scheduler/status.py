"""What `caravan list` and `caravan status` show, read from KV, Nomad and Consul.

The readers gather the facts; `summarise_model` and `replica_status` are pure
and say them in plain words: which replica runs where, whether it passes its
check, since when, its last task event, and why a pending replica cannot be
placed (from the blocked evaluation's `FailedTGAllocs`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from caravan.contract import ModelFailure, ScaleOverride, ServiceMetaKey, model_service_name
from caravan.nomad_api import Allocation, Evaluation, JobStub, Node
from scheduler.cluster_config import ClusterConfig
from scheduler.controller import HealthSource, NomadReads, read_nomad
from scheduler.model_store import DesiredState, ModelStore, UnknownModelError
from scheduler.placement_explain import ReplicaAsk, explain_failed_groups
from scheduler.profiles import ModelProfile
from scheduler.render import render, secret_templates, spec_hash
from scheduler.weights import (
    NO_PREFETCH,
    PrefetchGate,
    observe_prefetch,
    prefetch_gate,
    prefetch_job_id,
    render_prefetch,
)
from scheduler.world import NS_PER_S, replica_from_job_stub


class InvalidStoredProfileError(ValueError):
    """The model's profile in KV does not validate (written around caravan)."""


@dataclass(frozen=True, slots=True)
class ReplicaStatus:
    job_id: str
    replica: int
    state: str
    current: bool
    draining: bool
    alloc_id: str | None = None
    node: str | None = None
    health: str | None = None
    since_s: float | None = None
    last_event: str | None = None
    pending_reason: str | None = None


@dataclass(frozen=True, slots=True)
class ModelStatus:
    name: str
    engine: str
    served_model_name: str
    gpu: str
    desired: int
    ready: int
    min: int
    max: int
    status: str
    replicas: tuple[ReplicaStatus, ...] = ()
    problem: str | None = None
    autoscaler: Mapping[str, Any] | None = None
    # A `caravan scale` hold in force: {"count": N, "until": unix seconds}.
    override: Mapping[str, Any] | None = None
    # Why every replica failed for good: {"reason": ..., "since": unix seconds}.
    failure: Mapping[str, Any] | None = None
    # The prefetch job in words ("running for 30 s", "complete", "failed: ..."); None: none.
    prefetch: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _last_event(alloc: Allocation) -> str | None:
    return alloc.task_events[-1].words if alloc.task_events else None


def _gpu_words(profile: ModelProfile) -> str:
    if profile.gpu is None:
        return "cpu"
    return f"{profile.gpu.count}x {profile.gpu.gpu_class}"


def _blocked_reason(
    profile: ModelProfile | None,
    config: ClusterConfig,
    index: int,
    evaluations: Sequence[Evaluation],
) -> str | None:
    """Why Nomad still waits to place the replica: its newest blocked evaluation, in words."""
    blocked = [e for e in evaluations if e.status == "blocked"]
    if not blocked or profile is None:
        return None
    latest = max(blocked, key=lambda e: e.create_index)
    ask = ReplicaAsk.from_job(
        render(profile, max(index, 0), config=config)["Job"],
        profile.gpu.gpu_class if profile.gpu else "",
    )
    return explain_failed_groups(latest.failed_tg_allocs, ask)


def replica_status(
    *,
    profile: ModelProfile | None,
    config: ClusterConfig,
    job_stub: JobStub,
    allocs: Sequence[Allocation],
    node_names: Mapping[str, str],
    node_up: Mapping[str, bool],
    health_by_alloc: Mapping[str, str],
    evaluations: Sequence[Evaluation],
    draining: bool,
    now: float,
) -> ReplicaStatus:
    """One replica in plain words (pure)."""
    replica = replica_from_job_stub(job_stub)
    job_id = job_stub.id
    index = replica.replica if replica is not None else -1
    current = (
        profile is not None
        and replica is not None
        and replica.spec_hash == spec_hash(profile, replica.replica, config)
    )
    live = [a for a in allocs if a.live]
    chosen = max(live or allocs, key=lambda a: a.create_time_ns, default=None)
    if chosen is None:
        ask = ReplicaAsk()
        if profile is not None:
            ask = ReplicaAsk.from_job(
                render(profile, max(index, 0), config=config)["Job"],
                profile.gpu.gpu_class if profile.gpu else "",
            )
        reason = None
        for evaluation in sorted(evaluations, key=lambda e: e.create_index):
            explained = explain_failed_groups(evaluation.failed_tg_allocs, ask)
            if explained:
                reason = explained
        return ReplicaStatus(
            job_id=job_id,
            replica=index,
            state="pending placement" if reason else "pending",
            current=current,
            draining=draining,
            pending_reason=reason,
        )
    if not live:
        # Every allocation is stopped or lost (its node died) and Nomad could not
        # place the replacement: its blocked evaluation says why it waits.
        waiting = _blocked_reason(profile, config, index, evaluations)
        if waiting is not None:
            return ReplicaStatus(
                job_id=job_id,
                replica=index,
                state="pending placement",
                current=current,
                draining=draining,
                pending_reason=waiting,
            )
    alloc_id = chosen.id
    node_id = chosen.node_id
    health = health_by_alloc.get(alloc_id)
    client_status = chosen.client_status
    state = client_status
    if client_status == "running" and not node_up.get(node_id, True):
        state = "node down"
    elif client_status == "running" and health == "passing":
        state = "ready"
    elif client_status == "running":
        state = "starting" if health in {None, "critical"} else "saturated"
    modified = chosen.modify_time_ns / NS_PER_S
    return ReplicaStatus(
        job_id=job_id,
        replica=index,
        state="draining" if draining else state,
        current=current,
        draining=draining,
        alloc_id=alloc_id[:8],
        node=node_names.get(node_id, node_id[:8]),
        health=health,
        since_s=round(max(now - modified, 0.0), 1) if modified else None,
        last_event=_last_event(chosen),
    )


def summarise_model(
    name: str,
    profile: ModelProfile,
    desired: int,
    replicas: Sequence[ReplicaStatus],
    autoscaler: Mapping[str, Any] | None = None,
    *,
    override: ScaleOverride | None = None,
    failure: ModelFailure | None = None,
    prefetch: PrefetchGate = NO_PREFETCH,
) -> ModelStatus:
    """The model's line for `caravan list` and the header of `caravan status` (pure).

    `override` is a hold in force (the caller checks its expiry); `failure`
    is the scheduler's record that every replica failed for good.
    """
    ready = sum(1 for r in replicas if r.state == "ready")
    problem: str | None = None
    if prefetch.failed:
        problem = f"prefetch job {prefetch_job_id(name)} {prefetch.status}"
    if prefetch.failed and desired > 0 and ready == 0:
        status = "prefetch failed"
    elif failure is not None and ready == 0:
        status = "failed"
    elif not prefetch.ready and desired > 0 and not replicas:
        status = "prefetching"
    elif desired == 0 and not replicas:
        status = "scaled to zero"
    elif ready >= desired and all(r.current for r in replicas if not r.draining):
        status = "ready"
    elif any(r.state == "pending placement" for r in replicas):
        status = "unplaceable"
    elif any(not r.current for r in replicas if not r.draining):
        status = "updating"
    elif ready < desired:
        status = "starting" if ready == 0 else "degraded"
    else:
        status = "scaling down"
    return ModelStatus(
        name=name,
        engine=profile.engine.value,
        served_model_name=profile.served_name,
        gpu=_gpu_words(profile),
        desired=desired,
        ready=ready,
        min=profile.replicas.min,
        max=profile.replicas.max,
        status=status,
        replicas=tuple(replicas),
        problem=problem,
        autoscaler=autoscaler,
        override=None if override is None else {"count": override.count, "until": override.until},
        failure=None if failure is None else {"reason": failure.reason, "since": failure.since},
        prefetch=prefetch.status,
    )


@dataclass(slots=True)
class StatusReader:
    """Gathers status from KV, Nomad and Consul for the CLI and the HTTP API."""

    store: ModelStore
    nomad: NomadReads
    health: HealthSource
    clock: Callable[[], float] = field(default=time.time)
    # Used when no scheduler has published its cluster config to KV yet.
    config: ClusterConfig = field(default_factory=ClusterConfig)

    def _now(self) -> float:
        return self.clock()

    async def _world(
        self,
    ) -> tuple[list[JobStub], dict[str, list[Allocation]], list[Node]]:
        readout = await read_nomad(self.nomad)
        return readout.job_stubs, readout.allocs_by_job, readout.nodes

    async def model(self, name: str, *, desired_state: DesiredState | None = None) -> ModelStatus:
        state = desired_state or await self.store.read()
        if name not in state.profiles:
            if name in state.invalid:
                raise InvalidStoredProfileError(
                    f"{name}: its profile in KV is invalid: {state.invalid[name]}"
                )
            raise UnknownModelError(name)
        jobs, allocs_by_job, nodes = await self._world()
        return await self._model(name, state, jobs, allocs_by_job, nodes, detailed=True)

    async def models(self) -> list[ModelStatus]:
        state = await self.store.read()
        jobs, allocs_by_job, nodes = await self._world()
        result = [
            await self._model(name, state, jobs, allocs_by_job, nodes, detailed=False)
            for name in sorted(state.profiles)
        ]
        result.extend(
            ModelStatus(
                name=name,
                engine="?",
                served_model_name="?",
                gpu="?",
                desired=0,
                ready=0,
                min=0,
                max=0,
                status="invalid profile",
                problem=problem,
            )
            for name, problem in sorted(state.invalid.items())
        )
        return result

    async def _model(
        self,
        name: str,
        state: DesiredState,
        jobs: list[JobStub],
        allocs_by_job: dict[str, list[Allocation]],
        nodes: list[Node],
        *,
        detailed: bool,
    ) -> ModelStatus:
        profile = state.profiles[name]
        now = self._now()
        _, entries = await self.health.health_service(model_service_name(name))
        health_by_alloc = {
            e.meta.get(ServiceMetaKey.ALLOC_ID, ""): e.status
            for e in entries
            if e.meta.get(ServiceMetaKey.ALLOC_ID)
        }
        node_names = {n.id: n.name for n in nodes}
        node_up = {n.id: n.ready for n in nodes}
        replicas: list[ReplicaStatus] = []
        for stub in jobs:
            replica = replica_from_job_stub(stub)
            if replica is None or replica.model != name or replica.stopped:
                continue
            allocs = allocs_by_job.get(replica.job_id, [])
            evaluations: list[Evaluation] = []
            if detailed and not any(a.live for a in allocs):
                evaluations = (await self.nomad.job_evaluations(replica.job_id)).value
            replicas.append(
                replica_status(
                    profile=profile,
                    config=state.cluster_config or self.config,
                    job_stub=stub,
                    allocs=allocs,
                    node_names=node_names,
                    node_up=node_up,
                    health_by_alloc=health_by_alloc,
                    evaluations=evaluations,
                    draining=replica.job_id in state.draining,
                    now=now,
                )
            )
        replicas.sort(key=lambda r: r.replica)
        autoscaler = None
        raw_state = state.autoscaler_state.get(name)
        if raw_state:
            try:
                autoscaler = json.loads(raw_state)
            except ValueError:
                autoscaler = {"error": "autoscaler state in KV is unreadable"}
        override = state.overrides.get(name)
        gate = self._prefetch(profile, state, jobs, allocs_by_job, now)
        return summarise_model(
            name,
            profile,
            state.desired_count(name),
            replicas,
            autoscaler,
            override=override if override is not None and override.in_force(now) else None,
            failure=state.failures.get(name),
            prefetch=gate,
        )

    def _prefetch(
        self,
        profile: ModelProfile,
        state: DesiredState,
        jobs: list[JobStub],
        allocs_by_job: dict[str, list[Allocation]],
        now: float,
    ) -> PrefetchGate:
        """The model's prefetch as the planner sees it (same render, same gate)."""
        weights = profile.weights
        if weights is None or weights.prefetch is None:
            return NO_PREFETCH
        observed = None
        for stub in jobs:
            found = observe_prefetch(stub, allocs_by_job.get(stub.id, []))
            if found is not None and found.model == profile.name:
                observed = found
        body = render_prefetch(
            profile, state.cluster_config or self.config, secret_templates(profile)
        )
        return prefetch_gate(body, observed, now, weights.prefetch.timeout_s)
