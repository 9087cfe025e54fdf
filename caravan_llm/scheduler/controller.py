"""The reconcile loop: observe -> assess -> plan -> apply -> publish, on change or on a timer.

`reconcile_once()` follows controller-runtime's contract. One pass:

1. observe (`scheduler/observe.py`): read KV's desired state, then Nomad's
   jobs, allocations, nodes and evaluations and Consul's health, once;
2. assess (`scheduler/assess.py`, pure): what that means per replica (ready,
   outdated, placed, draining, unplaceable, failed) and per model;
3. plan (`scheduler/plan.py`, pure): the actions that move the world towards
   the profiles;
4. apply: the actions, with bounded concurrency; then the LoRA step
   (`scheduler/lora/apply.py`): each ready replica's adapters, read, planned
   (`scheduler/lora/plan.py`, pure) and loaded or unloaded through the engine;
5. publish (`scheduler/publish.py`): metrics, `placements/`, `failed/` and
   `adapters/`, on change only.

Each step hands the next its result; nothing of a pass is kept on the
controller. What it keeps between passes is the planner's returned memory,
the empty-list suspicion and the publisher's record of what it last wrote.
The pass is level-based and idempotent, so missing a change notification
only delays the next pass.

Safety rules that hold whatever the planner says:
- nothing is applied while this process is not the leader;
- a pass whose reads failed applies nothing (outage: retry with backoff);
- a job list that suddenly comes back empty while profiles exist is suspect:
  the pass is skipped until the emptiness has been seen for a while;
- a registration that lost an EnforceIndex race re-plans from a fresh read
  (facts N3), a few times before backing off.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any, Protocol

from caravan_llm.common.contract import AdapterDemandRecord
from caravan_llm.common.errors import HashiError, HashiNotFound, JobModifyIndexConflict
from caravan_llm.common.nomad_api import DeregisterResult, RegisterResult
from caravan_llm.scheduler.assess import assess
from caravan_llm.scheduler.cluster_config import ClusterConfig
from caravan_llm.scheduler.engine_keys import EngineKeys
from caravan_llm.scheduler.lora.apply import LoraApplier
from caravan_llm.scheduler.lora.plan import (
    AdapterDemand,
    demand_from_records,
    forgotten_demand,
)
from caravan_llm.scheduler.metrics import SchedulerMetrics
from caravan_llm.scheduler.model_store import DesiredState, ModelStore
from caravan_llm.scheduler.observe import HealthSource, NomadReads, observe, read_nomad
from caravan_llm.scheduler.plan import (
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
from caravan_llm.scheduler.publish import Publisher, placements_of
from caravan_llm.scheduler.world import Observation, ObservedReplica, PlannerMemory

log = logging.getLogger(__name__)

# Lost EnforceIndex races (facts N3) one reconcile call re-plans at once before
# it backs off: a few mean a concurrent writer, many a writer that never stops.
CONFLICT_REPLANS = 3


class NomadJobs(NomadReads, Protocol):
    """The reads of an observation plus the two writes the controller makes."""

    async def register_job(
        self, job: Mapping[str, Any], *, enforce_index: int | None = None
    ) -> RegisterResult: ...

    async def deregister_job(self, job_id: str, *, purge: bool = True) -> DeregisterResult: ...


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
    """What the loop carries from one pass to the next (never a pass's own state)."""

    planner: PlannerMemory = field(default_factory=PlannerMemory)
    saw_jobs: bool = False
    empty_since: float | None = None


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
        lora: LoraApplier | None = None,
    ) -> None:
        self.engine_keys = engine_keys
        self.lora = lora or LoraApplier(
            engine_key=None if engine_keys is None else engine_keys.cached_model_key
        )
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
        self.publisher = Publisher(store=store, metrics=metrics)

    async def observe(self, desired: DesiredState) -> Observation:
        """Read Nomad (jobs, allocations, nodes, evaluations) and Consul health, once."""
        try:
            readout = await read_nomad(self.nomad)
        except HashiError:
            self.metrics.backend_up.labels(backend="nomad").set(0)
            raise
        self.metrics.backend_up.labels(backend="nomad").set(1)
        return await observe(
            self.nomad,
            self.health,
            readout,
            draining=desired.draining,
            models=set(desired.profiles),
            now=self.clock(),
            inflight=self.inflight,
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
            self.publisher.forget_placements()
            self.metrics.reconcile_passes.labels(outcome="skipped").inc()
            return ReconcileResult(requeue_after_s=None, skipped="not the leader")
        try:
            desired = await self.store.read()
        except HashiError:
            self.metrics.backend_up.labels(backend="consul").set(0)
            raise
        self.metrics.backend_up.labels(backend="consul").set(1)
        observed = await self.observe(desired)
        now = observed.taken_at
        for name, problem in desired.invalid.items():
            self.metrics.errors.labels(kind="invalid_profile").inc()
            log.error("profile_invalid", extra={"model": name, "reason": problem})
        if self._suspect_empty(desired, observed, now):
            log.warning("nomad_job_list_suspect", extra={"reason": "empty after non-empty"})
            self.metrics.reconcile_passes.labels(outcome="skipped").inc()
            return ReconcileResult(requeue_after_s=self.settings.plan.requeue_s, skipped="suspect")
        models = desired.desired_models()
        assessment = assess(models, observed, self.config, now)
        result = plan(
            models,
            observed,
            self._memory.planner,
            config=self.config,
            settings=self.settings.plan,
            now=now,
            leave_alone=frozenset(desired.invalid),
            assessment=assessment,
        )
        self._memory.planner = result.memory
        self.publisher.record_plan(result, observed)
        if not self.is_leader():
            # Leadership can be lost while we read: never write after that.
            self.publisher.forget_placements()
            return ReconcileResult(requeue_after_s=None, plan=result, skipped="lost leadership")
        await self.publisher.publish_placements(placements_of(observed.replicas, observed.engines))
        outcomes = await self.apply_all(result.actions)
        applied, failed = outcomes.count(_Outcome.APPLIED), outcomes.count(_Outcome.FAILED)
        conflicts = outcomes.count(_Outcome.CONFLICT)
        if self.is_leader():
            # The adapters each ready replica holds (scheduler/lora/apply.py).
            records = desired.adapter_demand

            def demand(model: str) -> AdapterDemand:
                return demand_from_records(records.get(model, ()), self.clock())

            adapters = await self.lora.reconcile(models, observed, assessment, demand)
            await self.publisher.publish_adapters(adapters)
            await self._forget_demand(records)
        await self.publisher.publish_failures(desired, assessment, now)
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

    async def _forget_demand(self, records: Mapping[str, tuple[AdapterDemandRecord, ...]]) -> None:
        """Delete the adapter-demand records of routers gone long ago (`forgotten_demand`)."""
        for model, router in forgotten_demand(records, self.clock()):
            try:
                await self.store.forget_adapter_demand(model, router)
            except HashiError as exc:
                log.warning(
                    "adapter_demand_forget_failed",
                    extra={"model": model, "router": router, "error": str(exc)},
                )
                return
            log.info("adapter_demand_forgotten", extra={"model": model, "router": router})

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
