"""Admission, the I/O half: pick now, or wait in the model's queue, then hold a lease.

`AdmissionGate.admit` asks the balancer for an endpoint. When there is one
(and nobody of the model is already waiting), the request leaves with a
`Lease` at once. Otherwise `decide_admission` (pure) says queue, hold for a
cold start, or reject, and a queued request awaits a future that the gate
resolves when capacity frees up: a request finishes (`finish`), a new
snapshot arrives (discovery calls `capacity_changed`), or the periodic tick
runs (a breaker's cool-down ends). Everything runs on the one event loop and
the drain never awaits, so tickets keep their (priority, arrival) order.

A declared model with no routable endpoint (none at all, or all critical or
draining) is a cold start: the request is held up to the cold-start timeout,
`DemandSignal` writes `<prefix>demand/<name>` for the scheduler (at most once
per model per `demand_interval_s`), and a streaming client gets an SSE
comment every `cold_start_keepalive_s` through the `hold` callback.

A retry or continuation whose replica died (`admit(..., replacement=True)`)
and that finds every endpoint already tried is held the same way, for the
replacement the scheduler rebuilds (`caravan_llm.router.core.replacement`): while it waits, a
tried endpoint that Consul reports critical or that left the catalog stops
being excluded, so a replica restarted in place is taken again once it passes.

Held for a rebuild: a declared model (not failed for good) whose every
replica is out is rebuilt by the scheduler, which takes Nomad's down
detection (10-30 s with its defaults) plus a reschedule and a model load.
So a request that finds every replica's breaker open (the replica died
under earlier requests), a retry whose last replica died (above), and a
request that queued for capacity and saw every replica go out while it
waited, are all held up to the rebuild bound (`AdmissionPolicy.rebuild_bound_s`)
rather than the capacity wait; streams get the keep-alive comments. They
show in `caravan_router_rebuild_held_requests{model}` while held and in
`caravan_router_rebuild_holds_total{model,outcome}` when they leave, and one
that waits the whole bound gets `RebuildTimeout`, which says what it waited for.

LoRA adapters (issue 25): a request for an adapter is admitted on its base
model's replicas like any other; once it has its endpoint and lease, the
gate has the adapter loaded there when that replica does not hold it
(`AdapterLoads`, `caravan_llm.router.edge.adapter_loader`), holding the
request meanwhile; the load's seconds are `Admitted.adapter_load_s`, and a
failed load gives the lease back and raises its `AdapterUnavailable`.

Fail fast: when the scheduler has recorded that every replica of a declared
model failed for good (`ModelFailures`, KV `failed/<name>`), a request that
finds no routable endpoint is answered at once with `ModelUnavailable` (503,
the reason, `Retry-After`) instead of being held, and requests already held
for that model get the same answer as soon as the record arrives.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Protocol, assert_never

from caravan_llm.common.block_digest import BlockDigest
from caravan_llm.common.contract import DemandRecord, KVLayout, encode_demand
from caravan_llm.common.errors import HashiError
from caravan_llm.router.core.adapters import AdapterWant
from caravan_llm.router.core.admission import (
    AdmissionPolicy,
    AdmissionQueues,
    Admit,
    Queue,
    Reject,
    Ticket,
    UnknownModel,
    decide_admission,
    rebuild_hold,
)
from caravan_llm.router.core.balancer import (
    BalancerConfig,
    NoEndpointReason,
    NotPicked,
    Picked,
    PickerMemory,
    PickResult,
    Policy,
    RequestFeatures,
    pick,
)
from caravan_llm.router.core.cost_model import (
    Prefill,
    begin_prefill,
    end_prefill,
    peer_rate_of,
    restart_prefill_clock,
)
from caravan_llm.router.core.endpoints import Endpoint
from caravan_llm.router.core.errors import (
    ModelNotFound,
    ModelUnavailable,
    NoHealthyEndpoint,
    QueueTimeout,
    ReplacementTimeout,
    RouteNotServed,
)
from caravan_llm.router.core.live_state import Lease, Outcome, finish_request, start_request
from caravan_llm.router.core.prompt_digests import ExactPrompt, endpoint_digests, events_cached
from caravan_llm.router.core.replacement import still_excluded
from caravan_llm.router.core.routing_state import KnownModel, RoutingState
from caravan_llm.router.feeds.model_failures import ModelFailures
from caravan_llm.router.metrics import OTHER_MODEL, RebuildHoldOutcome, RouterMetrics

# Named as before the router's sub-packages: the logger is a field of every log line.
log = logging.getLogger("router.admission_gate")

Hold = Callable[[], Awaitable[None]]
# Priority of a continuation after a mid-stream failure: its client is already
# reading, so it goes before everything that has not started yet.
CONTINUATION_PRIORITY = -(2**31)
_TICK_S = 0.25
# No endpoint at all, or none routable: what a failed model looks like.
_NO_ROUTABLE = frozenset({NoEndpointReason.NO_ENDPOINTS, NoEndpointReason.NONE_HEALTHY})


@dataclass(frozen=True, slots=True)
class Admitted:
    """A request's place on one endpoint; give it back with `AdmissionGate.finish`."""

    endpoint: Endpoint
    lease: Lease
    # Its prompt as the cost model counts it there, until its first byte or its end.
    prefill: Prefill | None = None
    # Its prompt's block digests, held in the exact index as in flight there until its end.
    held: tuple[BlockDigest, ...] = ()
    # Seconds spent loading the request's LoRA adapter there first; None: no load.
    adapter_load_s: float | None = field(default=None, compare=False)


class AdapterLoads(Protocol):
    """Loads a request's LoRA adapter on its endpoint (`caravan_llm.router.edge.adapter_loader`)."""

    async def ensure_want(self, endpoint: Endpoint, want: AdapterWant) -> float | None:
        """The seconds the load took, None when the endpoint holds it; raises RouterError."""
        ...


@dataclass(slots=True)
class _Waiter:
    ticket: Ticket
    features: RequestFeatures
    future: asyncio.Future[Admitted]
    # Held for the replacement of a dead replica (caravan_llm.router.core.replacement).
    replacement: bool = False
    # Called when a cold-start or rebuild hold begins and at every keep-alive interval.
    hold: Hold | None = None
    # Counted in caravan_router_rebuild_held_requests now.
    rebuild_counted: bool = False
    # When it began to wait (router clock): a tried endpoint seen alive since is tried again.
    since: float | None = None


class DemandStore(Protocol):
    async def kv_put(self, key: str, value: bytes | str) -> bool: ...


class DemandSignal:
    """Writes the cold-start demand of a model to KV, at most once per interval per model.

    `note` only records and signals; `run` does the writes, so a slow Consul
    never delays a request.
    """

    def __init__(
        self,
        store: DemandStore,
        layout: KVLayout,
        *,
        router_id: str,
        interval_s: float,
        metrics: RouterMetrics,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._store = store
        self._layout = layout
        self.router_id = router_id
        self._interval_s = interval_s
        self._metrics = metrics
        self._clock = clock
        self._wall_clock = wall_clock
        self._last_noted: dict[str, float] = {}
        self._pending: dict[str, tuple[KnownModel, int]] = {}
        self._wake = asyncio.Event()

    def note(self, model: KnownModel, waiting: int) -> None:
        now = self._clock()
        last = self._last_noted.get(model.name)
        if last is not None and now - last < self._interval_s:
            return
        self._last_noted[model.name] = now
        self._pending[model.name] = (model, waiting)
        self._wake.set()

    async def run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            pending, self._pending = self._pending, {}
            for model, waiting in pending.values():
                await self._write(model, waiting)

    async def _write(self, model: KnownModel, waiting: int) -> None:
        value = encode_demand(
            DemandRecord(at=round(self._wall_clock(), 3), router=self.router_id, waiting=waiting)
        )
        try:
            await self._store.kv_put(self._layout.demand_key(model.name), value)
        except HashiError as exc:
            # Forget the write so that the next waiting request tries again.
            self._last_noted.pop(model.name, None)
            log.warning("demand_signal_failed", extra={"model": model.name, "error": str(exc)})
            return
        self._metrics.demand_signals.labels(model.name).inc()
        log.info("demand_signal_written", extra={"model": model.name, "waiting": waiting})


class AdmissionGate:
    """Hands out endpoints to requests, queueing them when there is no capacity."""

    def __init__(
        self,
        state: RoutingState,
        *,
        policy: Policy,
        balancer: BalancerConfig,
        admission: AdmissionPolicy,
        demand: DemandSignal,
        metrics: RouterMetrics,
        cold_start_keepalive_s: float,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
        failures: ModelFailures | None = None,
        adapters: AdapterLoads | None = None,
    ) -> None:
        self._adapters = adapters
        self._state = state
        self._policy = policy
        self._balancer = balancer
        self._admission = admission
        self._demand = demand
        self._metrics = metrics
        self._keepalive_s = cold_start_keepalive_s
        self._clock = clock
        self._memory = PickerMemory(rng=rng or random.Random())
        self._queues = AdmissionQueues(admission.max_queue_per_model)
        self._waiters: dict[int, _Waiter] = {}
        # Blocks held late for an admitted request (`hold_whole`), by its `id`, until `finish`.
        self._late_held: dict[int, tuple[BlockDigest, ...]] = {}
        self._failures = failures if failures is not None else ModelFailures()
        state.subscribe(self.capacity_changed)
        self._failures.subscribe(self.failures_changed)

    # -- the request path ------------------------------------------------------------

    async def admit(
        self,
        features: RequestFeatures,
        *,
        priority: int,
        hold: Hold | None = None,
        replacement: bool = False,
    ) -> Admitted:
        """An endpoint for the request, now or after waiting; raises the RouterError to answer.

        `hold` is awaited when a cold-start wait begins and every keep-alive
        interval during it (streams use it to send SSE comments).
        `replacement`: the request's replica died in a way that a rebuilt one
        can make good (`caravan_llm.router.core.replacement.waits_for_replacement`); when every
        endpoint was already tried, wait for one up to the cold-start deadline.
        A request for a LoRA adapter gets it loaded on its endpoint first (module docstring).
        """
        admitted = await self._admit_endpoint(
            features, priority=priority, hold=hold, replacement=replacement
        )
        if features.adapter is None or self._adapters is None:
            return admitted
        try:
            load_s = await self._adapters.ensure_want(admitted.endpoint, features.adapter)
        except BaseException:
            self.finish(admitted, Outcome.NO_VERDICT)
            raise
        if load_s is None:
            return admitted
        if admitted.prefill is not None:
            restart_prefill_clock(admitted.prefill, self._clock())
        return replace(admitted, adapter_load_s=load_s)

    async def _admit_endpoint(
        self,
        features: RequestFeatures,
        *,
        priority: int,
        hold: Hold | None,
        replacement: bool,
    ) -> Admitted:
        now = self._clock()
        model = features.model
        state = self._state
        if not state.synced:
            raise NoHealthyEndpoint(model, "discovery_not_synced", self._admission.retry_after_s)
        # Waiters that could go anywhere but found no room: a newcomer waits behind them.
        blocked = self._drain(model, now) if self._queues.depth(model) else False
        result: PickResult = self._pick(features, now)
        if isinstance(result, Picked):
            if not blocked:
                self._metrics.for_model(model).wait.observe(0.0)
                return self._lease(result.endpoint, features, now)
            # Capacity exists but others were first: wait behind them.
            result = NotPicked(NoEndpointReason.AT_CAPACITY)
        declared = model in state.view.profiles
        unavailable = self._unavailable(model)
        if unavailable is not None and result.reason in _NO_ROUTABLE:
            raise unavailable
        if declared and result.reason is NoEndpointReason.NONE_HEALTHY:
            # Every replica is starting, failed or draining: no routable replica,
            # which for the scheduler is the same as none at all (cold start).
            result = NotPicked(NoEndpointReason.NO_ENDPOINTS)
        decision = decide_admission(
            result,
            queue_depth=self._queues.depth(model),
            model_declared=declared,
            policy=self._admission,
            now=now,
            replacement=replacement,
            # The scheduler keeps a declared model's replicas up unless they failed for good.
            rebuild_expected=declared and unavailable is None,
        )
        match decision:
            case Admit(endpoint=endpoint):
                return self._lease(endpoint, features, now)
            case UnknownModel():
                raise ModelNotFound(model)
            case Reject():
                raise decision.error(model)
            case Queue(deadline=deadline, cold_start=cold_start, rebuild=rebuild):
                return await self._wait(
                    features,
                    priority=priority,
                    now=now,
                    deadline=deadline,
                    cold_start=cold_start,
                    hold=hold,
                    replacement=replacement,
                    rebuild=rebuild,
                )
            case _:
                assert_never(decision)

    def first_byte(self, admitted: Admitted) -> None:
        """The endpoint's answer reached the client: its prefill is over (the cost model learns)."""
        if admitted.prefill is not None:
            end_prefill(
                self._state.live,
                admitted.prefill,
                self._clock(),
                self._balancer.cost,
                first_token=True,
            )

    def finish(self, admitted: Admitted, outcome: Outcome) -> None:
        """Give the lease back with what it said about the endpoint; wakes waiters."""
        if admitted.prefill is not None:
            # Ended without a first byte (or after it: then this does nothing).
            end_prefill(
                self._state.live,
                admitted.prefill,
                self._clock(),
                self._balancer.cost,
                first_token=False,
            )
        if admitted.held:
            self._state.kv.release(admitted.endpoint.id, admitted.held)
        late = self._late_held.pop(id(admitted), None)
        if late:
            self._state.kv.release(admitted.endpoint.id, late)
        finish_request(
            self._state.live, admitted.lease, outcome, self._balancer.breaker, self._clock()
        )
        if self._waiters:
            self.capacity_changed()

    def capacity_changed(self) -> None:
        """Something may have freed capacity: hand it to waiting requests, in order."""
        if not self._waiters:
            return
        for waiter in list(self._waiters.values()):
            unserved = None if waiter.future.done() else self._route_unserved(waiter.features)
            if unserved is not None:
                waiter.future.set_exception(unserved)
        now = self._clock()
        for model in list(self._queues.depths()):
            self._drain(model, now)

    def failures_changed(self) -> None:
        """A failure record arrived: answer the requests held for that model now."""
        for waiter in list(self._waiters.values()):
            if waiter.future.done():
                continue
            unavailable = self._unavailable(waiter.ticket.model)
            if unavailable is None:
                continue
            result = self._pick(waiter.features, self._clock())
            if isinstance(result, NotPicked) and result.reason in _NO_ROUTABLE:
                waiter.future.set_exception(unavailable)

    def _unavailable(self, model: str) -> ModelUnavailable | None:
        """The error to answer a request for `model` with, when it failed for good."""
        known = self._state.view.profiles.get(model)
        failure = self._failures.get(known.name) if known is not None else None
        if failure is None:
            return None
        since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(failure.since))
        return ModelUnavailable(
            model, failure.reason, since, self._admission.cold_start_retry_after_s
        )

    def _route_unserved(self, features: RequestFeatures) -> RouteNotServed | None:
        """The answer for a held request once the model's replicas show they lack its route.

        A replica registers in Consul (with the routes its engine serves) while it
        starts, so a request held on a cold start learns this as soon as the first
        one appears, instead of waiting for the cold-start deadline.
        """
        route = features.route
        endpoints = self._state.view.snapshot.for_model(features.model)
        if route is None or endpoints is None or not endpoints.endpoints:
            return None
        if any(endpoint.serves(route) for endpoint in endpoints.endpoints):
            return None
        return RouteNotServed(
            features.model, route.engine_path, "its engine does not serve this route"
        )

    def queue_depths(self) -> dict[str, int]:
        return self._queues.depths()

    # -- background ----------------------------------------------------------------

    async def run(self) -> None:
        """Expire late tickets, retry waiters (breaker cool-downs), refresh demand; forever."""
        while True:
            await asyncio.sleep(_TICK_S)
            self.tick()

    def tick(self) -> None:
        now = self._clock()
        self._hold_for_rebuild(now)
        for ticket in self._queues.expire(now):
            waiter = self._waiters.get(ticket.seq)
            if waiter is not None and not waiter.future.done():
                waiter.future.set_exception(self._timeout_error(ticket, waiter.replacement))
        self.capacity_changed()
        cold: dict[str, int] = {}
        for waiter in self._waiters.values():
            if waiter.ticket.cold_start and not waiter.future.done():
                cold[waiter.ticket.model] = cold.get(waiter.ticket.model, 0) + 1
        profiles = self._state.view.profiles
        for model, waiting in cold.items():
            known = profiles.get(model)
            if known is not None:
                self._demand.note(known, waiting)

    # -- internals -----------------------------------------------------------------

    def _hold_for_rebuild(self, now: float) -> None:
        """Waiters whose model's replicas all went out while they waited: hold them for the
        rebuild (`caravan_llm.router.core.admission.rebuild_hold`)."""
        for waiter in self._waiters.values():
            ticket = waiter.ticket
            if waiter.future.done() or ticket.cold_start:
                continue
            known = self._state.view.profiles.get(ticket.model)
            if known is None or self._failures.get(known.name) is not None:
                continue
            result = self._pick(waiter.features, now)
            if not isinstance(result, NotPicked):
                continue
            held = rebuild_hold(
                ticket, result.reason, rebuild_expected=True, policy=self._admission
            )
            if held is not None and self._queues.update(held):
                waiter.ticket = held
                self._count_rebuild_hold(waiter)
                log.info("rebuild_hold", extra={"model": ticket.model})

    def _count_rebuild_hold(self, waiter: _Waiter) -> None:
        if not waiter.rebuild_counted:
            waiter.rebuild_counted = True
            self._metrics.rebuild_held.labels(waiter.ticket.model).inc()

    def _uncount_rebuild_hold(self, waiter: _Waiter, outcome: RebuildHoldOutcome) -> None:
        if waiter.rebuild_counted:
            waiter.rebuild_counted = False
            model = waiter.ticket.model
            self._metrics.rebuild_held.labels(model).dec()
            self._metrics.rebuild_holds.labels(model, outcome.value).inc()

    def hold_whole(self, admitted: Admitted, whole: asyncio.Future[ExactPrompt | None]) -> None:
        """Hold the rest of a request's blocks on its endpoint once its whole prompt is known.

        A request routed on its leading ids' digests (`prompt_digests`: past
        the tokenizing budget) holds only those; when the tokenizer is done,
        the blocks past them are held too, until `finish`. Nothing when the
        request has ended by then, or the tokenizing failed.
        """
        key = id(admitted)
        self._late_held[key] = ()

        def held(done: asyncio.Future[ExactPrompt | None]) -> None:
            if key not in self._late_held or done.cancelled() or done.exception() is not None:
                return
            prompt = done.result()
            if prompt is None:
                return
            kv = self._state.kv
            already = set(admitted.held)
            rest = tuple(
                d for d in endpoint_digests(kv, admitted.endpoint, prompt) if d not in already
            )
            if rest:
                kv.hold(admitted.endpoint.id, rest)
                self._late_held[key] = rest

        whole.add_done_callback(held)

    def _pick(self, features: RequestFeatures, now: float) -> PickResult:
        state = self._state
        return pick(
            state.view.snapshot,
            state.live,
            features,
            self._policy,
            now,
            config=self._balancer,
            memory=self._memory,
            kv=state.kv,
        )

    def _lease(self, endpoint: Endpoint, features: RequestFeatures, now: float) -> Admitted:
        """Count the request on the endpoint, and its prompt for the cost model."""
        live = self._state.live
        lease = start_request(live, endpoint.id, self._balancer.breaker, now)
        kv = self._state.kv
        # Its blocks are the engine's from now until it ends (computed, then kept for it):
        # a request sharing them is told so before the engine's events can say it.
        held = endpoint_digests(kv, endpoint, features.exact)
        if features.prompt is None:
            if held:
                kv.hold(endpoint.id, held)
            return Admitted(endpoint, lease, held=held)
        prefill = begin_prefill(
            live,
            endpoint,
            features.prompt,
            now,
            self._balancer.cost,
            max_age_s=self._balancer.load_max_age_s,
            peer=peer_rate_of(self._state.view.snapshot, live, features.model),
            events=events_cached(kv, endpoint, features.exact, now),
        )
        if held:
            kv.hold(endpoint.id, held)
        return Admitted(endpoint, lease, prefill, held)

    async def _wait(
        self,
        features: RequestFeatures,
        *,
        priority: int,
        now: float,
        deadline: float,
        cold_start: bool,
        hold: Hold | None,
        replacement: bool = False,
        rebuild: bool = False,
    ) -> Admitted:
        model = features.model
        retry_after = (
            self._admission.cold_start_retry_after_s
            if cold_start
            else self._admission.retry_after_s
        )
        ticket = self._queues.enqueue(
            model,
            priority=priority,
            now=now,
            deadline=deadline,
            cold_start=cold_start,
            retry_after_s=retry_after,
            rebuild=rebuild,
        )
        future: asyncio.Future[Admitted] = asyncio.get_running_loop().create_future()
        waiter = _Waiter(ticket, features, future, replacement, hold, since=now)
        self._waiters[ticket.seq] = waiter
        if rebuild or (replacement and cold_start):
            self._count_rebuild_hold(waiter)
        if cold_start:
            known = self._state.view.profiles.get(model)
            if known is not None:
                self._demand.note(known, self._queues.depth(model))
            event = "cold_start_hold"
            if replacement or rebuild:
                event = "replacement_hold" if replacement else "rebuild_hold"
            log.info(event, extra={"model": model})
        outcome = RebuildHoldOutcome.REFUSED
        try:
            admitted = await self._await_turn(waiter, replacement=replacement)
            outcome = RebuildHoldOutcome.ADMITTED
        except QueueTimeout:
            outcome = RebuildHoldOutcome.TIMED_OUT
            self._abandon(waiter.ticket, future)
            raise
        except asyncio.CancelledError:
            outcome = RebuildHoldOutcome.ABANDONED
            self._abandon(waiter.ticket, future)
            raise
        except BaseException:
            self._abandon(waiter.ticket, future)
            raise
        finally:
            self._waiters.pop(ticket.seq, None)
            self._uncount_rebuild_hold(waiter, outcome)
        self._metrics.for_model(model).wait.observe(self._clock() - now)
        return admitted

    async def _await_turn(self, waiter: _Waiter, *, replacement: bool = False) -> Admitted:
        """Wait for the waiter's future, up to its ticket's deadline.

        The ticket may be replaced while it waits (held for a rebuild: a later
        deadline, and a cold-start hold from then on), so it is read afresh on
        every step; the `hold` callback runs when a hold begins and at every
        keep-alive interval.
        """
        future = waiter.future
        hold_began = False
        while True:
            ticket = waiter.ticket
            hold = waiter.hold if ticket.cold_start else None
            if hold is not None and not hold_began:
                hold_began = True
                await hold()
            if future.done():
                return future.result()
            remaining = ticket.deadline - self._clock()
            if remaining <= 0:
                raise self._timeout_error(ticket, replacement)
            # Wakes at least every keep-alive interval, to see a replaced ticket.
            step = min(remaining, self._keepalive_s)
            try:
                async with asyncio.timeout(step):
                    # Shielded: a timeout must not cancel a future the drain may
                    # resolve in the same loop step (its lease would leak).
                    return await asyncio.shield(future)
            except TimeoutError:
                if hold is not None and not future.done() and self._clock() < ticket.deadline:
                    await hold()

    def _timeout_error(self, ticket: Ticket, replacement: bool) -> QueueTimeout:
        if replacement and ticket.cold_start:
            return ReplacementTimeout(ticket.model, self._admission.cold_start_retry_after_s)
        return ticket.timeout_error(self._admission)

    def _abandon(self, ticket: Ticket, future: asyncio.Future[Admitted]) -> None:
        """The waiter leaves (timeout, client gone): give back a lease it got too late."""
        if future.done() and not future.cancelled() and future.exception() is None:
            self.finish(future.result(), Outcome.NO_VERDICT)
            return
        self._queues.cancel(ticket)
        future.cancel()

    def _drain(self, model: str, now: float) -> bool:
        """Hand free capacity to the model's waiters in order; True when one found none.

        A waiter that excludes endpoints (a retry, or a request held for a
        replacement after trying every replica) may find nothing where the
        others would: it keeps its place and the drain goes on past it, so one
        such request never holds the queue up behind it (in the soak, a retry
        held for a replacement stopped a router from admitting anything for
        half a minute while both replicas stood idle). A waiter with no
        exclusions that finds no room stops the drain: the ones after it
        would find none either, and they keep their order.
        """
        passed: list[Ticket] = []
        try:
            return self._drain_past(model, now, passed)
        finally:
            for ticket in passed:
                self._queues.requeue(ticket)

    def _drain_past(self, model: str, now: float, passed: list[Ticket]) -> bool:
        while True:
            ticket = self._queues.pop_ready(model, now)
            if ticket is None:
                return False
            waiter = self._waiters.get(ticket.seq)
            if waiter is None or waiter.future.done():
                continue
            if waiter.replacement and waiter.features.exclude:
                exclude = still_excluded(
                    self._state.view.snapshot.for_model(model),
                    waiter.features.exclude,
                    self._state.live,
                    since=waiter.since,
                )
                if exclude is not waiter.features.exclude:
                    waiter.features = replace(waiter.features, exclude=exclude)
            result = self._pick(waiter.features, now)
            if isinstance(result, Picked):
                waiter.future.set_result(self._lease(result.endpoint, waiter.features, now))
                continue
            if result.reason is NoEndpointReason.ALL_EXCLUDED and not (
                waiter.replacement and ticket.cold_start
            ):
                waiter.future.set_exception(
                    NoHealthyEndpoint(model, result.reason.value, self._admission.retry_after_s)
                )
                continue
            if waiter.features.exclude:
                passed.append(ticket)
                continue
            self._queues.requeue(ticket)
            return True


def model_label(state: RoutingState, model: str) -> str:
    """The `model` label of a request: the model if Consul knows it, else `OTHER_MODEL`."""
    return model if state.view.is_known(model) else OTHER_MODEL
