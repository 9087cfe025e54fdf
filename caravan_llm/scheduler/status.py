"""What `caravan list` and `caravan status` show, read from KV, Nomad and Consul.

The reader observes the world as a reconcile pass does (`scheduler/observe.py`)
and judges it with the same `assess` the planner decides from, so status and
the planner cannot disagree on what is ready, why a replica is not placed, or
what failed. `replica_status`, `model_status` and `summarise_model` are pure
and say the assessment in plain words: which replica runs where, whether it
passes its check, since when, its last task event, and why a pending replica
cannot be placed.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from caravan_llm.common.consul_api import HealthEntry
from caravan_llm.common.contract import (
    ROUTER_SERVICE,
    SCHEDULER_SERVICE,
    ModelAdapters,
    ModelFailure,
    ScaleOverride,
)
from caravan_llm.common.errors import HashiError
from caravan_llm.common.nomad_api import Allocation
from caravan_llm.scheduler.assess import Assessment, ReplicaAssessment, assess
from caravan_llm.scheduler.cluster_config import ClusterConfig
from caravan_llm.scheduler.model_history import ModelHistory, stored_document
from caravan_llm.scheduler.model_store import DesiredState, ModelStore, UnknownModelError
from caravan_llm.scheduler.nomad_time import NS_PER_S
from caravan_llm.scheduler.observe import EngineLogs, HealthSource, NomadReads, observe, read_nomad
from caravan_llm.scheduler.profiles import ModelProfile, profile_to_json
from caravan_llm.scheduler.weights import NO_PREFETCH, PrefetchGate, prefetch_job_id
from caravan_llm.scheduler.world import Observation, ObservedReplica, engine_events


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
    # Why the replica failed for good (scheduler/model_failure.py); None: it has not.
    failed: str | None = None
    # While it is not ready and its engine exited non-zero: the last lines of
    # that run's stderr (scheduler/engine_logs.py), or why they are unavailable.
    engine_stderr: tuple[str, ...] = ()
    engine_stderr_unavailable: str | None = None
    # LoRA adapters (models with LoRA on): what the replica's engine holds and what
    # the scheduler's plan wants it to hold; None: not reported (LoRA off, not ready).
    adapters_loaded: tuple[str, ...] | None = None
    adapters_desired: tuple[str, ...] | None = None
    # CPU models: the sibling job already on this replica's node (the scheduler
    # moves this one apart, plan rule 7); None: it has a node to itself.
    shares_node_with: str | None = None


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
    # Grants the control plane's tokens lack, each as "<component> <where>: <grant>"
    # (the schedulers' and routers' preflights: caravan_llm/common/preflight.py).
    control_plane: tuple[str, ...] = ()
    # The profile's version in its history (`caravan history`); None when it
    # was written around caravan.
    version: int | None = None
    # LoRA (profiles with LoRA on): {"declared": [names], "failed": [{"adapter",
    # "source", "job_id", "reason", "since"}], "unplaced": [names]}; None: LoRA off.
    adapters: Mapping[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _last_event(alloc: Allocation) -> str | None:
    events = engine_events(alloc)
    return events[-1].words if events else None


def _gpu_words(profile: ModelProfile) -> str:
    if profile.gpu is None:
        return "cpu"
    return f"{profile.gpu.count}x {profile.gpu.gpu_class}"


def _shown_alloc(
    judged: ReplicaAssessment, replica: ObservedReplica, observation: Observation
) -> Allocation | None:
    """The allocation a replica's line is about: a ready one when it is ready, else the newest
    live one, else the newest."""
    live = replica.live_allocs()
    if judged.ready:
        live = tuple(
            a
            for a in live
            if a.client_status == "running"
            and (node := observation.nodes.get(a.node_id)) is not None
            and node.ready
        )
    return max(live or replica.allocs, key=lambda a: a.create_time_ns, default=None)


def _engine_stderr(judged: ReplicaAssessment) -> dict[str, Any]:
    tail = judged.engine_log
    if tail is None:
        return {}
    return {"engine_stderr": tail.lines, "engine_stderr_unavailable": tail.unavailable}


def replica_status(
    judged: ReplicaAssessment,
    replica: ObservedReplica,
    observation: Observation,
    now: float,
) -> ReplicaStatus:
    """One replica in plain words (pure): the assessment, and the allocation it is about."""
    current = judged.outdated is False
    chosen = _shown_alloc(judged, replica, observation)
    if chosen is None or (not replica.live_allocs() and judged.unplaceable is not None):
        # Never placed, or every allocation stopped or lost (its node died) and
        # Nomad could not place the replacement: its evaluations say why it waits.
        pending = "pending" if chosen is None else chosen.client_status
        return ReplicaStatus(
            job_id=judged.job_id,
            replica=judged.replica,
            state="pending placement" if judged.unplaceable else pending,
            current=current,
            draining=judged.draining,
            pending_reason=judged.unplaceable,
            failed=judged.failed,
            **_engine_stderr(judged),
        )
    health = observation.health.get(chosen.id)
    node = observation.nodes.get(chosen.node_id)
    client_status = chosen.client_status
    state = client_status
    if judged.ready:
        state = "ready"
    elif client_status == "running" and node is not None and not node.ready:
        state = "node down"
    elif client_status == "running":
        state = "starting" if health in {None, "critical", "passing"} else "saturated"
    modified = chosen.modify_time_ns / NS_PER_S
    return ReplicaStatus(
        job_id=judged.job_id,
        replica=judged.replica,
        state="draining" if judged.draining else state,
        current=current,
        draining=judged.draining,
        alloc_id=chosen.id[:8],
        node=node.name if node is not None else chosen.node_id[:8],
        health=health,
        since_s=round(max(now - modified, 0.0), 1) if modified else None,
        last_event=_last_event(chosen),
        failed=judged.failed,
        shares_node_with=judged.shares_node_with,
        **_engine_stderr(judged),
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


def model_status(
    name: str, state: DesiredState, observation: Observation, assessment: Assessment, now: float
) -> ModelStatus:
    """A model with a profile in `state`, from one observation and its assessment (pure)."""
    profile = state.profiles[name]
    assessed = assessment.models[name]
    replicas = [
        replica_status(judged, observation.replicas[judged.job_id], observation, now)
        for judged in assessed.replicas
    ]
    autoscaler = None
    raw_state = state.autoscaler_state.get(name)
    if raw_state:
        try:
            autoscaler = json.loads(raw_state)
        except ValueError:
            autoscaler = {"error": "autoscaler state in KV is unreadable"}
    override = state.overrides.get(name)
    summary = summarise_model(
        name,
        profile,
        state.desired_count(name),
        replicas,
        autoscaler,
        override=override if override is not None and override.in_force(now) else None,
        failure=state.failures.get(name),
        prefetch=assessed.prefetch,
    )
    return with_adapters(summary, profile, state.adapters.get(name))


def with_adapters(
    status: ModelStatus, profile: ModelProfile, document: ModelAdapters | None
) -> ModelStatus:
    """The status with its LoRA adapters: per replica desired and loaded, and failures (pure).

    A replica is matched by its job (one live allocation each); a replica the
    leader's last document does not name shows none.
    """
    if profile.lora_limits is None:
        return status
    by_job = {} if document is None else {r.job_id: r for r in document.replicas}
    replicas = tuple(
        replace(
            replica,
            adapters_loaded=by_job[replica.job_id].loaded,
            adapters_desired=by_job[replica.job_id].desired,
        )
        if replica.job_id in by_job
        else replica
        for replica in status.replicas
    )
    failed = [] if document is None else [f.model_dump() for f in document.failed]
    return replace(
        status,
        replicas=replicas,
        adapters={
            "declared": [adapter.name for adapter in profile.adapters],
            "failed": failed,
            "unplaced": [] if document is None else list(document.unplaced),
        },
    )


def misconfigured_instances(entries: Iterable[HealthEntry]) -> list[str]:
    """What the health checks of schedulers or routers say their tokens lack (pure).

    A misconfigured instance answers /health with 503 and
    `{"status": "misconfigured", "missing": [...]}`; Consul keeps that body in
    the check's output after `Output: `.
    """
    found: list[str] = []
    for entry in entries:
        for check in entry.checks:
            _, marker, body = check.output.partition("Output: ")
            if not marker:
                continue
            try:
                answer = json.loads(body)
            except ValueError:
                continue
            if not isinstance(answer, dict) or answer.get("status") != "misconfigured":
                continue
            missing = answer.get("missing")
            found.extend(
                f"{entry.service_name} on {entry.node}: token lacks {grant!s}"
                for grant in (missing if isinstance(missing, list) else [])
            )
    return found


def with_version(
    status: ModelStatus, state: DesiredState, history: ModelHistory | None
) -> ModelStatus:
    """The status with the version of the model's stored profile in its history (pure)."""
    if history is None:
        return status
    stored = stored_document(profile_to_json(state.profiles[status.name]))
    return replace(status, version=history.current_version(stored))


@dataclass(slots=True)
class StatusReader:
    """Gathers status from KV, Nomad and Consul for the CLI and the HTTP API."""

    store: ModelStore
    nomad: NomadReads
    health: HealthSource
    clock: Callable[[], float] = field(default=time.time)
    # Used when no scheduler has published its cluster config to KV yet.
    config: ClusterConfig = field(default_factory=ClusterConfig)
    # In a scheduler: the grants its own tokens lack (its preflight).
    scheduler_missing: Callable[[], tuple[str, ...]] | None = None
    # Reads crashed engines' stderr tails (needs read-logs); None: not shown.
    engine_logs: EngineLogs | None = None

    async def control_plane(self) -> tuple[str, ...]:
        """Grants this scheduler's, and any scheduler's or router's in Consul, tokens lack."""
        problems = [
            f"this scheduler: token lacks {grant}"
            for grant in (self.scheduler_missing() if self.scheduler_missing else ())
        ]
        for service in (SCHEDULER_SERVICE, ROUTER_SERVICE):
            try:
                _, entries = await self.health.health_service(service)
            except HashiError:
                continue  # status is still worth showing without this part
            problems.extend(misconfigured_instances(entries))
        return tuple(problems)

    async def _assess(
        self, state: DesiredState, models: Collection[str]
    ) -> tuple[Observation, Assessment, float]:
        """Observe `models` as a reconcile pass would, and judge them the same way."""
        readout = await read_nomad(self.nomad)
        now = self.clock()
        observation = await observe(
            self.nomad,
            self.health,
            readout,
            draining=state.draining,
            models=models,
            now=now,
            scope=models,
            engine_logs=self.engine_logs,
        )
        desired = {n: d for n, d in state.desired_models().items() if n in models}
        config = state.cluster_config or self.config
        return observation, assess(desired, observation, config, now), now

    async def model(self, name: str, *, desired_state: DesiredState | None = None) -> ModelStatus:
        state = desired_state or await self.store.read()
        if name not in state.profiles:
            if name in state.invalid:
                raise InvalidStoredProfileError(
                    f"{name}: its profile in KV is invalid: {state.invalid[name]}"
                )
            raise UnknownModelError(name)
        observation, assessment, now = await self._assess(state, {name})
        history = await self.store.history(name)
        status = model_status(name, state, observation, assessment, now)
        status = with_version(status, state, history)
        return replace(status, control_plane=await self.control_plane())

    async def models(self) -> list[ModelStatus]:
        state = await self.store.read()
        observation, assessment, now = await self._assess(state, set(state.profiles))
        histories = await self.store.histories()
        result = [
            with_version(
                model_status(name, state, observation, assessment, now),
                state,
                histories.get(name),
            )
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
