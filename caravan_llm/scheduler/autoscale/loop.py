"""The autoscaler loop: gather signals, call `decide`, write the desired count.

Runs inside the scheduler process and only while it leads. Every tick, for
each model with an enabled `autoscaling` block:

1. the replicas passing in Consul are scraped (engine metrics, with the
   names in their service Meta), and so are the routers' queue metrics;
2. `decide()` (pure) gets the signals, the current desired count and the
   memory stored in KV `state/<name>`;
3. `override.constrain()` (pure) applies what outranks the load: a manual
   `caravan scale` override in force holds the count, and a model whose
   every replica failed for good is not scaled up;
4. a changed count is written to KV `desired/<name>`, which wakes the
   reconcile loop; the memory is written back every tick so a restart or a
   leader change resumes the windows instead of forgetting them.

The autoscaler never talks to Nomad: one writer per resource.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field, replace

import aiohttp

from caravan_llm.common.consul_api import HealthEntry
from caravan_llm.common.contract import (
    ROUTER_SERVICE,
    ModelFailure,
    ScaleOverride,
    ServiceMetaKey,
    decode_metric_names,
    model_service_name,
    router_metrics_base_url,
)
from caravan_llm.common.errors import HashiError
from caravan_llm.scheduler.autoscale.adapters import holders_by_adapter, spread_first
from caravan_llm.scheduler.autoscale.inflight import InflightView
from caravan_llm.scheduler.autoscale.memory import (
    Direction,
    Memory,
    memory_from_json,
    memory_to_json,
)
from caravan_llm.scheduler.autoscale.override import constrain, override_in_force
from caravan_llm.scheduler.autoscale.policy import ScaleDecision, decide
from caravan_llm.scheduler.autoscale.scrape import (
    ReplicaScrape,
    ReplicaTarget,
    RouterTarget,
    scrape_replicas,
    scrape_routers,
)
from caravan_llm.scheduler.autoscale.signals import (
    ModelSignals,
    ReplicaLoad,
    RouterQueueReport,
    router_queue,
)
from caravan_llm.scheduler.lora.plan import demand_from_records
from caravan_llm.scheduler.metrics import SchedulerMetrics
from caravan_llm.scheduler.model_store import DesiredState, ModelStore
from caravan_llm.scheduler.observe import HealthSource
from caravan_llm.scheduler.profiles import ModelProfile

log = logging.getLogger(__name__)


# A demand signal older than this is stale (the router rewrites it while it
# holds requests).
DEMAND_FRESH_S = 120.0
# An in-flight reading older than this many ticks reads as unknown.
INFLIGHT_MAX_AGE_TICKS = 3


@dataclass(frozen=True, slots=True)
class AutoscalerSettings:
    tick_s: float = 5.0
    scrape_timeout_s: float = 2.0


def replica_target(entry: HealthEntry) -> ReplicaTarget | None:
    """Where a passing replica's metrics are, from its Consul entry and Meta."""
    meta = entry.meta
    if not entry.address or not entry.port:
        return None
    names = decode_metric_names(meta)
    host = f"[{entry.address}]" if ":" in entry.address else entry.address
    return ReplicaTarget(
        replica_id=entry.service_id,
        base_url=f"http://{host}:{entry.port}",
        metrics_path=meta.get(ServiceMetaKey.METRICS_PATH) or "/metrics",
        metric_names=names,
    )


def router_targets(routers: Iterable[HealthEntry]) -> list[RouterTarget]:
    """Where each passing router's /metrics is: its `metrics_addr` Meta, else its public port."""
    return [
        RouterTarget(router_id=r.service_id, base_url=url)
        for r in routers
        if r.address
        and r.port
        and (url := router_metrics_base_url(r.address, r.port, r.meta)) is not None
    ]


@dataclass(slots=True)
class Autoscaler:
    store: ModelStore
    health: HealthSource
    metrics: SchedulerMetrics
    is_leader: Callable[[], bool]
    settings: AutoscalerSettings = field(default_factory=AutoscalerSettings)
    clock: Callable[[], float] = time.time
    # Last in-flight requests read per live allocation, for the planner's
    # scale-down choice (the controller reads it through `inflight.of`).
    inflight: InflightView = field(init=False)
    # When the cold start of a model began (demand seen at zero replicas).
    cold_start_began: dict[str, float] = field(default_factory=dict)
    last_decisions: dict[str, ScaleDecision] = field(default_factory=dict)
    # Seconds from demand to the first ready replica, per model, last time.
    last_cold_start_s: dict[str, float] = field(default_factory=dict)
    # The model's engine API key (caravan_llm.scheduler.engine_keys), for engines that guard
    # /metrics.
    engine_key: Callable[[str], Awaitable[str]] | None = None

    def __post_init__(self) -> None:
        # A reading older than a few ticks is stale: the autoscaler stopped (lost the lead).
        self.inflight = InflightView(
            max_age_s=INFLIGHT_MAX_AGE_TICKS * self.settings.tick_s, clock=self.clock
        )

    async def run(self) -> None:
        # Ticks keep their cadence: the time a tick took (scrapes, KV reads)
        # comes off the wait for the next one, so the evaluation interval is
        # what the profile says, not that plus the tick's own time.
        loop = asyncio.get_running_loop()
        async with aiohttp.ClientSession() as session:
            while True:
                started = loop.time()
                if self.is_leader():
                    try:
                        await self.tick(session)
                    except HashiError as exc:
                        log.warning("autoscaler_tick_failed", extra={"error": str(exc)})
                await asyncio.sleep(next_tick_in(self.settings.tick_s, loop.time() - started))

    async def _router_reports(
        self, session: aiohttp.ClientSession
    ) -> tuple[RouterQueueReport, ...]:
        _, routers = await self.health.health_service(ROUTER_SERVICE, passing=True)
        scrapes = await scrape_routers(
            session, router_targets(routers), timeout_s=self.settings.scrape_timeout_s
        )
        return tuple(s.report for s in scrapes)

    async def tick(self, session: aiohttp.ClientSession) -> None:
        state = await self.store.read()
        self.inflight.retain_models(state.profiles)
        scaled = {
            name: profile
            for name, profile in state.profiles.items()
            if profile.autoscaling is not None and profile.autoscaling.enabled
        }
        # Models with a manual count are scraped too: the planner drains the
        # replica with the fewest in-flight requests when they scale down.
        for name in sorted(set(state.profiles) - set(scaled)):
            await self._scrape_model(session, name)
        if not scaled:
            return
        reports = await self._router_reports(session)
        for name, profile in sorted(scaled.items()):
            await self._evaluate(session, name, profile, state, reports)

    async def _scrape_model(
        self, session: aiohttp.ClientSession, name: str
    ) -> tuple[tuple[HealthEntry, ...], tuple[ReplicaScrape, ...]]:
        """Scrape the model's passing replicas and remember their in-flight requests."""
        _, entries = await self.health.health_service(model_service_name(name), passing=True)
        targets = [t for t in (replica_target(e) for e in entries) if t is not None]
        if targets and self.engine_key is not None:
            key = await self.engine_key(name)
            targets = [replace(target, api_key=key) for target in targets]
        scrapes = await scrape_replicas(
            session, targets, clock=self.clock, timeout_s=self.settings.scrape_timeout_s
        )
        alloc_of = {e.service_id: e.meta.get(ServiceMetaKey.ALLOC_ID, "") for e in entries}
        self.inflight.replace_model(
            name,
            {alloc_of.get(s.load.replica_id, ""): _inflight(s.load) for s in scrapes},
            at=self.clock(),
        )
        return entries, scrapes

    async def _evaluate(
        self,
        session: aiohttp.ClientSession,
        name: str,
        profile: ModelProfile,
        state: DesiredState,
        reports: tuple[RouterQueueReport, ...],
    ) -> None:
        assert profile.autoscaling is not None  # noqa: S101 - filtered by the caller
        now = self.clock()
        entries, scrapes = await self._scrape_model(session, name)
        # Routers label their queues with the OpenAI model name clients send.
        queue = router_queue(reports, profile.served_name)
        demand = state.demand.get(name)
        demand_pending = demand is not None and now - demand.at < DEMAND_FRESH_S
        signals = ModelSignals(
            replicas=tuple(s.load for s in scrapes),
            ready_replicas=len(entries),
            router_queue_depth=queue.depth,
            router_queue_wait_s=queue.wait_s,
            demand_pending=demand_pending,
            last_request_at=None,
        )
        raw_memory = state.autoscaler_state.get(name)
        memory = memory_from_json(raw_memory) if raw_memory else Memory()
        if memory.load_warning:
            log.warning(
                "autoscaler_memory_reset", extra={"model": name, "why": memory.load_warning}
            )
        current = state.desired_count(name)
        decided, after = decide(
            signals, current, profile.autoscaling, profile.replicas, memory, now
        )
        # A hot LoRA adapter spreads to replicas with room before the model scales out.
        decided = spread_first(
            decided,
            current,
            inflight={load.replica_id: _inflight(load) for load in signals.replicas},
            holders=holders_by_adapter(state.adapters.get(name), name),
            demand=demand_from_records(state.adapter_demand.get(name, ()), now),
            target_inflight=profile.autoscaling.target_inflight,
        )
        override = override_in_force(state.overrides.get(name), now)
        failure = state.failures.get(name)
        decision, memory = constrain(
            decided, memory, after, current=current, override=override, failure=failure, now=now
        )
        self.metrics.autoscale_overridden.labels(model=name).set(1 if override else 0)
        self.last_decisions[name] = decision
        self._observe(name, decision, current, len(entries), scrapes_age(signals, self.clock()))
        await self._cold_start(
            name,
            current=current,
            decision=decision,
            ready=len(entries),
            demand_pending=demand_pending,
            now=now,
        )
        if decision.target != current:
            log.info(
                "autoscale",
                extra={
                    "model": name,
                    "from": current,
                    "to": decision.target,
                    "reason": decision.reason,
                },
            )
            await self.store.set_desired(name, decision.target)
        await self.store.put_autoscaler_state(
            name,
            state_document(
                memory,
                decision,
                self.last_cold_start_s.get(name),
                override=override,
                failure=failure,
            ),
        )

    def _observe(
        self, name: str, decision: ScaleDecision, current: int, ready: int, age: float | None
    ) -> None:
        self.metrics.autoscale_decisions.labels(model=name, direction=decision.direction).inc()
        self.metrics.autoscale_desired.labels(model=name).set(decision.target)
        self.metrics.autoscale_current.labels(model=name).set(ready)
        self.metrics.signal_age.labels(model=name).set(math.nan if age is None else age)
        del current

    async def _cold_start(
        self,
        name: str,
        *,
        current: int,
        decision: ScaleDecision,
        ready: int,
        demand_pending: bool,
        now: float,
    ) -> None:
        began, took = cold_start_step(
            self.cold_start_began.get(name),
            current=current,
            direction=decision.direction,
            ready=ready,
            now=now,
        )
        if took is None:
            if began is not None:
                self.cold_start_began[name] = began
            return
        self.metrics.cold_start.labels(model=name).observe(took)
        log.info(
            "cold_start_done",
            extra={"model": name, "seconds": round(took, 1), "demand": demand_pending},
        )
        self.cold_start_began.pop(name, None)
        self.last_cold_start_s[name] = round(took, 1)
        await self.store.clear_demand(name)


def next_tick_in(tick_s: float, took_s: float) -> float:
    """Seconds to wait before the next tick, when this one took `took_s`.

    A tick that overran its interval is followed by a short pause, not by a
    burst of catch-up ticks.
    """
    return max(tick_s - took_s, tick_s / 10)


def cold_start_step(
    began: float | None, *, current: int, direction: Direction, ready: int, now: float
) -> tuple[float | None, float | None]:
    """When the model's cold start began, and how long it took once it is over.

    A cold start is any scale-up from zero desired replicas, whatever asked
    for it: a router's demand record, or its queue report alone (either can
    reach the autoscaler first). It ends at the first ready replica. Returns
    (began, None) while it runs, (None, None) when there is none, and
    (None, seconds) on the tick it ends.
    """
    if began is None and current == 0 and direction is Direction.UP:
        began = now
    if began is not None and ready > 0:
        return None, now - began
    return began, None


def _inflight(load: ReplicaLoad) -> float | None:
    if load.running is None or load.waiting is None:
        return None
    return load.running + load.waiting


def state_document(
    memory: Memory,
    decision: ScaleDecision,
    cold_start_s: float | None,
    *,
    override: ScaleOverride | None = None,
    failure: ModelFailure | None = None,
) -> str:
    """What goes to KV `state/<name>`: the memory, plus what `caravan status` shows.

    The memory reader ignores keys it does not know, so the signals of the
    last decision, the last cold start, the override in force and the
    failure it held for ride along in the same document.
    """
    document = json.loads(memory_to_json(memory))
    document["last_signals"] = {
        key: (None if value is None or math.isnan(value) else value)
        for key, value in decision.signals_used.items()
    }
    if cold_start_s is not None:
        document["last_cold_start_s"] = cold_start_s
    if override is not None:
        document["overridden"] = {"count": override.count, "until": override.until}
    if failure is not None:
        document["failure"] = {"reason": failure.reason, "since": failure.since}
    return json.dumps(document, separators=(",", ":"), allow_nan=False)


def scrapes_age(signals: ModelSignals, now: float) -> float | None:
    """Age of the oldest successful scrape, or None when nothing was read."""
    stamps = [r.scraped_at for r in signals.replicas if r.scraped_at is not None]
    return now - min(stamps) if stamps else None
