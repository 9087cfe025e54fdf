"""The reconcile loop: observe -> desired -> plan -> apply, on change or on a timer.

`reconcile_once()` follows controller-runtime's contract: it reads the whole
world (KV desired state, Nomad jobs, allocations and nodes, Consul health of
the replicas), asks the pure planner what to do, applies the actions with
bounded concurrency, and says when to come back. It is level-based and
idempotent, so missing a change notification only delays the next pass.

Safety rules that hold whatever the planner says:
- nothing is applied while this process is not the leader;
- a pass whose reads failed applies nothing (outage: retry with backoff);
- a job list that suddenly comes back empty while profiles exist is suspect:
  the pass is skipped until the emptiness has been seen for a while.

Each pass also publishes, per model, the live allocations of caravan's replica
jobs and where Nomad put their engine (`<prefix>placements/<model>`, one codec
in `caravan.contract`), written only when the set changes. Routers accept a
Consul service as an endpoint only if it is Nomad's registration of one of
these allocations (docs/security.md, "Endpoint verification").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any, Protocol

from caravan.consul_api import HealthEntry, KVEntry
from caravan.contract import (
    ALLOC_ID_PATTERN,
    HTTP_PORT_LABEL,
    JOB_PREFIX,
    MODEL_NAME_PATTERN,
    PlacedAllocation,
    Placements,
    PlacementsError,
    ServiceMetaKey,
    decode_placements,
    encode_placements,
    model_service_name,
)
from caravan.errors import HashiError, HashiNotFound, JobModifyIndexConflict
from caravan.nomad_api import (
    AllocatedPort,
    Allocation,
    DeregisterResult,
    Evaluation,
    JobStub,
    Node,
    QueryResult,
    RegisterResult,
)
from scheduler.cluster_config import ClusterConfig
from scheduler.engine_keys import EngineKeys
from scheduler.metrics import SchedulerMetrics
from scheduler.model_failure import (
    failure_updates,
    impossible_placement,
    model_failures,
    publish_failures,
)
from scheduler.model_store import DesiredState, ModelStore
from scheduler.placement_explain import ReplicaAsk
from scheduler.plan import (
    Action,
    ClearDrainMarker,
    Deregister,
    Plan,
    PlanSettings,
    Register,
    RegisterPrefetch,
    Replace,
    StartDrain,
    drain_record_for,
    plan,
)
from scheduler.render import RenderError, render
from scheduler.weights import ObservedPrefetch, observe_prefetch, prefetch_job_id
from scheduler.world import (
    NS_PER_S,
    DesiredModel,
    Observation,
    ObservedReplica,
    PlannerMemory,
    replica_from_job_stub,
)

log = logging.getLogger(__name__)

# A replica without a node for this long is logged as unplaced.
UNPLACED_LOG_AFTER_S = 10.0
# Lost EnforceIndex races (facts N3) one reconcile call re-plans at once before
# it backs off: a few mean a concurrent writer, many a writer that never stops.
CONFLICT_REPLANS = 3


class NomadReads(Protocol):
    """The Nomad reads the scheduler needs (implemented by caravan.nomad_api.NomadClient)."""

    async def list_jobs(
        self,
        prefix: str = "",
        *,
        meta: bool = False,
        index: int | None = None,
        wait_s: float | None = None,
    ) -> QueryResult[list[JobStub]]: ...

    async def list_allocations(
        self,
        prefix: str = "",
        *,
        resources: bool = False,
        index: int | None = None,
        wait_s: float | None = None,
    ) -> QueryResult[list[Allocation]]: ...

    async def list_nodes(
        self, *, resources: bool = True, index: int | None = None, wait_s: float | None = None
    ) -> QueryResult[list[Node]]: ...

    async def job_evaluations(
        self, job_id: str, *, index: int | None = None, wait_s: float | None = None
    ) -> QueryResult[list[Evaluation]]: ...


@dataclass(frozen=True, slots=True)
class AllocEngine:
    """The port Nomad allocated for an allocation's `http` label, and the node it runs on."""

    port: AllocatedPort
    node_name: str


@dataclass(frozen=True, slots=True)
class NomadReadout:
    """caravan's jobs (stubs with Meta), their allocations grouped by job, and the nodes,
    as `caravan.nomad_api` decoded them."""

    job_stubs: list[JobStub]
    allocs_by_job: dict[str, list[Allocation]]
    nodes: list[Node]
    # Where each allocation's engine listens (its `http` port) and on which node.
    engines: dict[str, AllocEngine] = field(default_factory=dict)


async def read_nomad(nomad: NomadReads) -> NomadReadout:
    """The three Nomad reads the controller and `caravan status` both start from."""
    job_stubs = (await nomad.list_jobs(JOB_PREFIX, meta=True)).value
    allocations = (await nomad.list_allocations(resources=True)).value
    nodes = (await nomad.list_nodes(resources=False)).value
    allocs_by_job: dict[str, list[Allocation]] = {}
    engines: dict[str, AllocEngine] = {}
    for allocation in allocations:
        allocs_by_job.setdefault(allocation.job_id, []).append(allocation)
        for port in allocation.ports or ():
            if port.label == HTTP_PORT_LABEL and port.host_ip and port.value > 0:
                engines[allocation.id] = AllocEngine(port, allocation.node_name)
    return NomadReadout(job_stubs, allocs_by_job, nodes, engines)


def placements_of(
    replicas: Mapping[str, ObservedReplica], engines: Mapping[str, AllocEngine]
) -> dict[str, Placements]:
    """Per model, the live allocations of its replica jobs and where their engine listens (pure).

    An allocation whose `http` port Nomad has not reported is left out (the
    next pass publishes it): routers must never be told an address that is not
    Nomad's. So is a job whose Meta names no valid model, or an allocation id
    that is not Nomad's UUID form (neither can be a replica caravan rendered).
    """
    placed: dict[str, list[PlacedAllocation]] = {}
    for job_id in sorted(replicas):
        replica = replicas[job_id]
        if not MODEL_NAME_PATTERN.match(replica.model):
            continue
        allocations = placed.setdefault(replica.model, [])
        for alloc in replica.live_allocs():
            engine = engines.get(alloc.id)
            if engine is None or not re.match(ALLOC_ID_PATTERN, alloc.id):
                continue
            allocations.append(
                PlacedAllocation(
                    alloc_id=alloc.id,
                    job_id=job_id,
                    address=engine.port.host_ip,
                    port=engine.port.value,
                    node=engine.node_name,
                )
            )
    return {
        model: Placements(model=model, allocations=tuple(allocations))
        for model, allocations in placed.items()
    }


class NomadJobs(NomadReads, Protocol):
    """Reads plus the two writes the controller makes."""

    async def register_job(
        self, job: Mapping[str, Any], *, enforce_index: int | None = None
    ) -> RegisterResult: ...

    async def deregister_job(self, job_id: str, *, purge: bool = True) -> DeregisterResult: ...


class HealthSource(Protocol):
    """Consul health of a service (implemented by caravan.consul_api.ConsulClient)."""

    async def health_service(
        self,
        name: str,
        *,
        passing: bool = False,
        tags: tuple[str, ...] = (),
        filter_expr: str | None = None,
        index: int = 0,
        wait_s: float | None = None,
    ) -> tuple[int, tuple[HealthEntry, ...]]: ...


@dataclass(frozen=True, slots=True)
class ControllerSettings:
    plan: PlanSettings = field(default_factory=PlanSettings)
    # Periodic resync even when no change was signalled.
    resync_s: float = 30.0
    # Actions applied at once.
    apply_concurrency: int = 4
    # How long a suddenly empty job list must persist before it is believed.
    empty_list_confirm_s: float = 30.0
    backoff_initial_s: float = 1.0
    backoff_max_s: float = 30.0


@dataclass(frozen=True, slots=True)
class ReconcileResult:
    """What one pass did and when to come back (None = only on change or resync)."""

    requeue_after_s: float | None
    plan: Plan | None = None
    skipped: str | None = None
    applied: int = 0
    failed: int = 0
    # Registrations that lost an EnforceIndex race (facts N3) and were re-planned.
    conflicts: int = 0


class _Outcome(StrEnum):
    APPLIED = "applied"
    FAILED = "failed"
    CONFLICT = "conflict"


@dataclass(slots=True)
class _ControllerMemory:
    planner: PlannerMemory = field(default_factory=PlannerMemory)
    saw_jobs: bool = False
    empty_since: float | None = None


def _passing_by_alloc(entries: tuple[HealthEntry, ...]) -> dict[str, bool]:
    result: dict[str, bool] = {}
    for entry in entries:
        alloc_id = entry.meta.get(ServiceMetaKey.ALLOC_ID)
        if alloc_id:
            result[alloc_id] = entry.status == "passing"
    return result


def _with_health(replica: ObservedReplica, passing_by_alloc: Mapping[str, bool]) -> ObservedReplica:
    states = [passing_by_alloc[a.id] for a in replica.live_allocs() if a.id in passing_by_alloc]
    passing = any(states) if states else None
    return replace(replica, passing=passing)


def _stored_placements(entries: tuple[KVEntry, ...], prefix: str) -> dict[str, str]:
    """What is under placements/ now, by model, normalised; unreadable documents are rewritten."""
    stored: dict[str, str] = {}
    for entry in entries:
        model = entry.key[len(prefix) :]
        if not model or "/" in model:
            continue
        try:
            stored[model] = encode_placements(
                decode_placements(entry.value, key=entry.key, model=model)
            )
        except PlacementsError:
            stored[model] = ""
    return stored


class Controller:
    """Keeps Nomad's caravan jobs equal to what the profiles in KV ask for."""

    def __init__(
        self,
        *,
        store: ModelStore,
        nomad: NomadJobs,
        health: HealthSource,
        config: ClusterConfig,
        metrics: SchedulerMetrics,
        settings: ControllerSettings | None = None,
        is_leader: Callable[[], bool] = lambda: True,
        inflight: Callable[[ObservedReplica], float | None] = lambda _replica: None,
        clock: Callable[[], float] = time.time,
        engine_keys: EngineKeys | None = None,
    ) -> None:
        self.engine_keys = engine_keys
        self.store = store
        self.nomad = nomad
        self.health = health
        self.config = config
        self.metrics = metrics
        self.settings = settings or ControllerSettings()
        self.is_leader = is_leader
        self.inflight = inflight
        self.clock = clock
        self._memory = _ControllerMemory()
        self.last_desired: DesiredState | None = None
        self.last_observation: Observation | None = None
        self.last_plan: Plan | None = None
        self._reported_models: set[str] = set()
        self._unplaced: set[str] = set()
        self.last_placements: dict[str, Placements] = {}
        # What this process last wrote (or found) under placements/, by model;
        # None until read from KV, which a new leader does once.
        self._published: dict[str, str] | None = None
        self._engines: dict[str, AllocEngine] = {}
        # The last Nomad readout and Consul health, for the failure record.
        self._last_readout: tuple[NomadReadout, dict[str, bool]] | None = None
        self._failure_gauges: set[str] = set()
        # Models whose prefetch has failed (logged once when it does).
        self._prefetch_failed: set[str] = set()

    async def observe(self, desired: DesiredState) -> Observation:
        """Read Nomad (jobs, allocations, nodes) and Consul health into one snapshot."""
        try:
            readout = await read_nomad(self.nomad)
        except HashiError:
            self.metrics.backend_up.labels(backend="nomad").set(0)
            raise
        self.metrics.backend_up.labels(backend="nomad").set(1)
        self._engines = readout.engines
        replicas: dict[str, ObservedReplica] = {}
        for job_stub in readout.job_stubs:
            replica = replica_from_job_stub(job_stub)
            if replica is None:
                continue
            allocs = tuple(readout.allocs_by_job.get(replica.job_id, ()))
            with_allocs = replace(replica, allocs=allocs)
            replicas[replica.job_id] = replace(with_allocs, inflight=self.inflight(with_allocs))
        prefetch: dict[str, ObservedPrefetch] = {}
        for job_stub in readout.job_stubs:
            found = observe_prefetch(job_stub, readout.allocs_by_job.get(job_stub.id, []))
            if found is not None:
                prefetch[found.model] = found
        models = {r.model for r in replicas.values()} | set(desired.profiles)
        passing: dict[str, bool] = {}
        for model in sorted(models):
            _, entries = await self.health.health_service(model_service_name(model))
            passing.update(_passing_by_alloc(entries))
        replicas = {job_id: _with_health(r, passing) for job_id, r in replicas.items()}
        self._last_readout = (readout, passing)
        nodes = {node.id: node for node in readout.nodes}
        return Observation(
            replicas=replicas,
            nodes=nodes,
            draining=desired.draining,
            taken_at=self.clock(),
            prefetch=prefetch,
        )

    def _suspect_empty(self, desired: DesiredState, observed: Observation, now: float) -> bool:
        memory = self._memory
        if observed.replicas:
            memory.saw_jobs = True
            memory.empty_since = None
            return False
        if not memory.saw_jobs or not desired.profiles:
            return False
        if all(desired.desired_count(name) == 0 for name in desired.profiles):
            # Every model is at zero: the empty list is what caravan asked for
            # (scale to zero), so the next cold start must not wait out the
            # suspicion window.
            memory.saw_jobs = False
            memory.empty_since = None
            return False
        if memory.empty_since is None:
            memory.empty_since = now
        if now - memory.empty_since < self.settings.empty_list_confirm_s:
            return True
        # Confirmed: believe it (for example the Nomad cluster was rebuilt).
        memory.saw_jobs = False
        memory.empty_since = None
        return False

    def desired_models(self, desired: DesiredState) -> dict[str, DesiredModel]:
        return {
            name: DesiredModel(profile=profile, count=desired.desired_count(name))
            for name, profile in desired.profiles.items()
        }

    async def reconcile_once(self) -> ReconcileResult:
        started = time.monotonic()
        try:
            return await self._reconcile()
        finally:
            self.metrics.reconcile_duration.observe(time.monotonic() - started)

    async def _reconcile(self) -> ReconcileResult:
        conflicts = 0
        while True:
            result = await self._pass()
            if not result.conflicts:
                return replace(result, conflicts=conflicts)
            conflicts += result.conflicts
            if conflicts > CONFLICT_REPLANS:
                # Someone keeps changing the jobs under us: come back after a pause.
                return replace(
                    result,
                    conflicts=conflicts,
                    requeue_after_s=self.settings.backoff_initial_s,
                )
            # A registration lost an EnforceIndex race (facts N3): what the plan
            # was made from is stale. Read again and decide again, now.
            log.info("replan_after_conflict", extra={"conflicts": result.conflicts})

    async def _pass(self) -> ReconcileResult:
        if not self.is_leader():
            # Another leader may write placements meanwhile: re-read them when leading again.
            self._published = None
            self.metrics.reconcile_passes.labels(outcome="skipped").inc()
            return ReconcileResult(requeue_after_s=None, skipped="not the leader")
        try:
            desired = await self.store.read()
        except HashiError:
            self.metrics.backend_up.labels(backend="consul").set(0)
            raise
        self.metrics.backend_up.labels(backend="consul").set(1)
        observed = await self.observe(desired)
        self.last_desired, self.last_observation = desired, observed
        now = self.clock()
        for name, problem in desired.invalid.items():
            self.metrics.errors.labels(kind="invalid_profile").inc()
            log.error("profile_invalid", extra={"model": name, "problem": problem})
        if self._suspect_empty(desired, observed, now):
            log.warning("nomad_job_list_suspect", extra={"reason": "empty after non-empty"})
            self.metrics.reconcile_passes.labels(outcome="skipped").inc()
            return ReconcileResult(requeue_after_s=self.settings.plan.requeue_s, skipped="suspect")
        result = plan(
            self.desired_models(desired),
            observed,
            self._memory.planner,
            config=self.config,
            settings=self.settings.plan,
            now=now,
            leave_alone=frozenset(desired.invalid),
        )
        self._memory.planner = result.memory
        self.last_plan = result
        self._record(result)
        if not self.is_leader():
            # Leadership can be lost while we read: never write after that.
            self._published = None
            return ReconcileResult(requeue_after_s=None, plan=result, skipped="lost leadership")
        await self.publish_placements(placements_of(observed.replicas, self._engines))
        outcomes = await self.apply_all(result.actions)
        applied, failed = outcomes.count(_Outcome.APPLIED), outcomes.count(_Outcome.FAILED)
        conflicts = outcomes.count(_Outcome.CONFLICT)
        await self._record_failures(desired, now)
        self.metrics.reconcile_passes.labels(outcome="ok" if not failed else "error").inc()
        requeue = result.requeue_after_s
        if failed:
            requeue = self.settings.backoff_initial_s
        return ReconcileResult(
            requeue_after_s=requeue,
            plan=result,
            applied=applied,
            failed=failed,
            conflicts=conflicts,
        )

    def _record(self, result: Plan) -> None:
        reported = {report.model for report in result.reports}
        for gone in self._reported_models - reported:
            # A deleted model's series must not linger at their last values.
            for gauge in (
                self.metrics.replicas_desired,
                self.metrics.replicas_live,
                self.metrics.replicas_ready,
                self.metrics.replicas_unplaced,
            ):
                with contextlib.suppress(KeyError):
                    gauge.remove(gone)
        self._reported_models = reported
        unplaced = {job for report in result.reports for job in report.unplaced}
        observed = self.last_observation
        if observed is not None:
            # A job registered a moment ago has no allocation yet: not news.
            unplaced = {
                job
                for job in unplaced
                if job in observed.replicas
                and observed.taken_at - observed.replicas[job].submit_time_ns / NS_PER_S
                > UNPLACED_LOG_AFTER_S
            }
        for job_id in sorted(unplaced - self._unplaced):
            log.warning("replica_unplaced", extra={"job_id": job_id, "see": "caravan status"})
        self._unplaced = unplaced
        self._record_prefetch(result)
        for report in result.reports:
            self.metrics.replicas_desired.labels(model=report.model).set(report.desired)
            self.metrics.replicas_live.labels(model=report.model).set(report.live)
            self.metrics.replicas_ready.labels(model=report.model).set(report.ready)
            self.metrics.replicas_unplaced.labels(model=report.model).set(len(report.unplaced))
        for name, problem in result.errors.items():
            self.metrics.errors.labels(kind="render").inc()
            log.error("profile_unrenderable", extra={"model": name, "problem": problem})

    def _record_prefetch(self, result: Plan) -> None:
        """The prefetch gauge per model with a prefetch; one error log when one fails."""
        failed: set[str] = set()
        for report in result.reports:
            if report.prefetch is None:
                with contextlib.suppress(KeyError):
                    self.metrics.prefetch_failed.remove(report.model)
                continue
            self.metrics.prefetch_failed.labels(model=report.model).set(
                1 if report.prefetch_failed else 0
            )
            if report.prefetch_failed:
                failed.add(report.model)
        for model in sorted(self._prefetch_failed - {r.model for r in result.reports}):
            with contextlib.suppress(KeyError):
                self.metrics.prefetch_failed.remove(model)
        reports = {r.model: r for r in result.reports}
        for model in sorted(failed - self._prefetch_failed):
            log.error(
                "prefetch_failed",
                extra={"model": model, "reason": reports[model].prefetch, "see": "caravan status"},
            )
        self._prefetch_failed = failed

    async def publish_placements(self, placements: Mapping[str, Placements]) -> None:
        """Write each model's placements where they changed; delete those of models gone.

        Failures are logged and retried on the next pass (they only delay a
        new replica's first request, or keep a gone one listed a little longer).
        """
        self.last_placements = dict(placements)
        kv = self.store.kv
        prefix = self.store.layout.placements
        try:
            if self._published is None:
                _, entries = await kv.kv_get_recurse(prefix)
                self._published = _stored_placements(entries, prefix)
            published = self._published
            wanted = {model: encode_placements(doc) for model, doc in placements.items()}
            for model in sorted(published.keys() - wanted.keys()):
                await kv.kv_delete(self.store.layout.placements_key(model))
                published.pop(model, None)
                log.info("placements_cleared", extra={"model": model})
            for model, document in sorted(wanted.items()):
                if published.get(model) == document:
                    continue
                await kv.kv_put(self.store.layout.placements_key(model), document)
                published[model] = document
                log.info(
                    "placements_published",
                    extra={"model": model, "allocations": len(placements[model].allocations)},
                )
        except HashiError as exc:
            self._published = None
            # Counted by class like every failed Nomad or Consul call (the alerts read these).
            self.metrics.errors.labels(kind=type(exc).__name__).inc()
            log.warning("placements_publish_failed", extra={"error": str(exc)})

    async def _record_failures(self, desired: DesiredState, now: float) -> None:
        """Publish which models failed for good (scheduler/model_failure.py), on change only."""
        if self._last_readout is None:
            return
        readout, passing = self._last_readout
        found = model_failures(
            readout.job_stubs,
            readout.allocs_by_job,
            passing,
            frozenset(desired.profiles),
            await self._unplaceable(desired, readout),
        )
        # A failed prefetch holds every replica back until the profile changes:
        # as permanent as a replica Nomad gave up on (issue: fail fast).
        if self.last_plan is not None:
            for report in self.last_plan.reports:
                if (
                    report.prefetch_failed
                    and report.ready == 0
                    and report.model in desired.profiles
                ):
                    found.setdefault(
                        report.model,
                        f"prefetch job {prefetch_job_id(report.model)} {report.prefetch}",
                    )
        for name in desired.profiles:
            self.metrics.model_failed.labels(model=name).set(1 if name in found else 0)
        for gone in self._failure_gauges - set(desired.profiles):
            # A deleted model must not stay "failed" on a dashboard.
            with contextlib.suppress(KeyError):
                self.metrics.model_failed.remove(gone)
        self._failure_gauges = set(desired.profiles)
        await publish_failures(self.store, failure_updates(found, desired.failures, now))

    async def _unplaceable(self, desired: DesiredState, readout: NomadReadout) -> dict[str, str]:
        """Replica jobs without any allocation that no freed capacity would place, with why."""
        found: dict[str, str] = {}
        now = self.clock()
        for stub in readout.job_stubs:
            replica = replica_from_job_stub(stub)
            if (
                replica is None
                or replica.stopped
                or replica.model not in desired.profiles
                or readout.allocs_by_job.get(replica.job_id)
                # Nomad evaluates a new job in a moment: not news yet.
                or now - replica.submit_time_ns / NS_PER_S < UNPLACED_LOG_AFTER_S
            ):
                continue
            try:
                evaluations = (await self.nomad.job_evaluations(replica.job_id)).value
                profile = desired.profiles[replica.model]
                job = render(profile, replica.replica, config=self.config)["Job"]
            except (HashiError, RenderError) as exc:
                # Only the failure record waits for the next pass; reconciling goes on.
                log.debug(
                    "placement_check_skipped", extra={"job_id": replica.job_id, "error": str(exc)}
                )
                continue
            latest = max(evaluations, key=lambda e: e.create_index, default=None)
            if latest is None:
                continue
            ask = ReplicaAsk.from_job(job, profile.gpu.gpu_class if profile.gpu else "")
            reason = impossible_placement(latest.failed_tg_allocs, ask)
            if reason is not None:
                found[replica.job_id] = reason
        return found

    async def apply(self, actions: tuple[Action, ...]) -> tuple[int, int]:
        """Apply actions with bounded concurrency; returns (applied, not applied)."""
        outcomes = await self.apply_all(actions)
        applied = outcomes.count(_Outcome.APPLIED)
        return applied, len(outcomes) - applied

    async def apply_all(self, actions: tuple[Action, ...]) -> list[_Outcome]:
        """Apply actions with bounded concurrency; one outcome per action."""
        if not actions:
            return []
        semaphore = asyncio.Semaphore(self.settings.apply_concurrency)
        outcomes: list[_Outcome] = []

        async def one(action: Action) -> None:
            async with semaphore:
                if not self.is_leader():
                    outcomes.append(_Outcome.FAILED)
                    return
                outcomes.append(await self._apply_one(action))

        async with asyncio.TaskGroup() as group:
            for action in actions:
                group.create_task(one(action))
        return outcomes

    async def _apply_one(self, action: Action) -> _Outcome:
        kind = type(action).__name__.lower()
        try:
            await self._dispatch(action)
        except JobModifyIndexConflict:
            # Not a failure: the job changed since the plan read it; the pass re-plans.
            self.metrics.actions.labels(kind=kind, outcome="conflict").inc()
            log.info("action_conflict", extra={"action": kind, "job_id": action.job_id})
            return _Outcome.CONFLICT
        except HashiError as exc:
            self.metrics.actions.labels(kind=kind, outcome="error").inc()
            self.metrics.errors.labels(kind=type(exc).__name__).inc()
            log.warning(
                "action_failed",
                extra={"action": kind, "job_id": action.job_id, "error": str(exc)},
            )
            return _Outcome.FAILED
        self.metrics.actions.labels(kind=kind, outcome="ok").inc()
        log.info(
            "action_applied",
            extra={"action": kind, "job_id": action.job_id, "reason": action.reason},
        )
        return _Outcome.APPLIED

    async def _dispatch(self, action: Action) -> None:
        match action:
            case Register():
                await self._hand_engine_key(action.model, action.job_id)
                await self.nomad.register_job(action.body, enforce_index=action.enforce_index)
            case Replace():
                await self._deregister(action.job_id)
                await self._hand_engine_key(action.model, action.job_id)
                await self.nomad.register_job(action.body, enforce_index=action.enforce_index)
            case StartDrain():
                await self.store.mark_draining(
                    action.job_id, drain_record_for(action, self.clock())
                )
            case Deregister():
                await self._deregister(action.job_id)
                if self.engine_keys is not None:
                    await self.engine_keys.remove_replica_key(action.job_id)
            case ClearDrainMarker():
                await self.store.clear_draining(action.job_id)
            case RegisterPrefetch():
                await self.nomad.register_job(action.body, enforce_index=action.enforce_index)

    async def _hand_engine_key(self, model: str, job_id: str) -> None:
        """Before a replica job is registered, its own variable holds the model's key."""
        if self.engine_keys is not None:
            await self.engine_keys.ensure_replica_key(model, job_id)

    async def _deregister(self, job_id: str) -> None:
        try:
            await self.nomad.deregister_job(job_id, purge=True)
        except HashiNotFound:
            log.debug("deregister_absent", extra={"job_id": job_id})

    async def run(
        self,
        wake: asyncio.Event,
        *,
        sleep: Callable[[float], Awaitable[None]] | None = None,
    ) -> None:
        """Reconcile whenever `wake` is set, a requeue is due, or the resync timer fires."""
        failures = 0
        while True:
            wake.clear()
            try:
                result = await self.reconcile_once()
                failures = 0 if not result.failed else failures + 1
                delay = result.requeue_after_s or self.settings.resync_s
            except HashiError as exc:
                failures += 1
                self.metrics.reconcile_passes.labels(outcome="error").inc()
                self.metrics.errors.labels(kind=type(exc).__name__).inc()
                # Jittered so that several schedulers (and a recovering
                # Nomad) are not hit in lockstep.
                delay = random.uniform(0.5, 1.0) * min(
                    self.settings.backoff_initial_s * 2 ** (failures - 1),
                    self.settings.backoff_max_s,
                )
                log.warning(
                    "reconcile_failed",
                    extra={"error": str(exc), "retry_in_s": round(delay, 1)},
                )
            if sleep is not None:
                await sleep(delay)
                continue
            try:
                async with asyncio.timeout(delay):
                    await wake.wait()
            except TimeoutError:
                pass
