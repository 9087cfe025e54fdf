"""Holding requests for the rebuild of a declared model whose every replica is out."""

from __future__ import annotations

import asyncio
import json
from types import MappingProxyType

import pytest
from prometheus_client import CollectorRegistry
from router_builders import MODEL, endpoint_entry, snapshot_of

from caravan_llm.common.contract import KVLayout
from caravan_llm.router.core.admission import (
    AdmissionPolicy,
    AdmissionQueues,
    Queue,
    Ticket,
    decide_admission,
    rebuild_hold,
)
from caravan_llm.router.core.balancer import (
    BalancerConfig,
    NoEndpointReason,
    NotPicked,
    Policy,
    RequestFeatures,
)
from caravan_llm.router.core.errors import RebuildTimeout, error_body
from caravan_llm.router.core.live_state import Outcome, reconcile_live_state
from caravan_llm.router.core.routing_state import KnownModel, RoutingState, RoutingView
from caravan_llm.router.edge.admission_gate import AdmissionGate, Admitted, DemandSignal
from caravan_llm.router.metrics import RouterMetrics

POLICY = AdmissionPolicy(max_queue_per_model=4, queue_timeout_s=30.0, cold_start_hold_s=300.0)
NOW = 1_000.0
PLAIN = RequestFeatures(MODEL)


def decide(reason: NoEndpointReason, *, policy: AdmissionPolicy = POLICY, expected: bool = True):
    return decide_admission(
        NotPicked(reason),
        queue_depth=0,
        model_declared=True,
        policy=policy,
        now=NOW,
        rebuild_expected=expected,
    )


def queued_ticket(*, cold_start: bool = False) -> Ticket:
    queues = AdmissionQueues(4)
    return queues.enqueue(
        MODEL, priority=0, now=NOW, deadline=NOW + 30.0, cold_start=cold_start, retry_after_s=1
    )


class TestDecideAdmission:
    def test_every_breaker_open_with_a_rebuild_expected_is_held_up_to_the_rebuild_bound(
        self,
    ) -> None:
        """Every replica's breaker open (it died under requests): held like a cold start."""
        assert Queue(deadline=NOW + 300.0, cold_start=True, rebuild=True) == decide(
            NoEndpointReason.BREAKERS_OPEN
        )

    def test_the_rebuild_bound_is_its_own_setting_when_given(self) -> None:
        """`rebuild_hold_s` bounds the hold instead of the cold-start timeout."""
        policy = AdmissionPolicy(cold_start_hold_s=300.0, rebuild_hold_s=90.0)

        assert Queue(deadline=NOW + 90.0, cold_start=True, rebuild=True) == decide(
            NoEndpointReason.BREAKERS_OPEN, policy=policy
        )

    @pytest.mark.parametrize(
        ("expected", "hold"), [(False, True), (True, False)], ids=["not-expected", "hold-off"]
    )
    def test_without_a_rebuild_to_wait_for_breakers_open_queue_for_capacity(
        self, expected: bool, hold: bool
    ) -> None:
        """A model failed for good, or holds switched off: the capacity wait, as before."""
        policy = AdmissionPolicy(queue_timeout_s=30.0, hold_for_rebuild=hold)

        assert Queue(deadline=NOW + 30.0, cold_start=False) == decide(
            NoEndpointReason.BREAKERS_OPEN, policy=policy, expected=expected
        )

    def test_a_full_model_still_waits_for_capacity_only(self) -> None:
        """An endpoint that is merely full is no reason to wait for a rebuild."""
        assert Queue(deadline=NOW + 30.0, cold_start=False) == decide(NoEndpointReason.AT_CAPACITY)


class TestRebuildHold:
    @pytest.mark.parametrize(
        "reason",
        [
            NoEndpointReason.BREAKERS_OPEN,
            NoEndpointReason.NONE_HEALTHY,
            NoEndpointReason.NO_ENDPOINTS,
        ],
    )
    def test_a_queued_ticket_whose_replicas_went_out_gets_the_rebuild_deadline(
        self, reason: NoEndpointReason
    ) -> None:
        """Queued for capacity, then every replica out: the deadline moves to the rebuild bound."""
        ticket = queued_ticket()

        held = rebuild_hold(ticket, reason, rebuild_expected=True, policy=POLICY)

        assert held is not None
        assert (ticket.seq, NOW + 300.0, True, True) == (
            held.seq,
            held.deadline,
            held.cold_start,
            held.rebuild,
        )

    @pytest.mark.parametrize(
        ("reason", "expected", "cold_start"),
        [
            (NoEndpointReason.AT_CAPACITY, True, False),
            (NoEndpointReason.BREAKERS_OPEN, False, False),
            (NoEndpointReason.BREAKERS_OPEN, True, True),
        ],
        ids=["merely-full", "no-rebuild-expected", "already-held"],
    )
    def test_nothing_changes_otherwise(
        self, reason: NoEndpointReason, expected: bool, cold_start: bool
    ) -> None:
        """Full endpoints, no rebuild coming, or a ticket already held long: left as it is."""
        ticket = queued_ticket(cold_start=cold_start)

        assert rebuild_hold(ticket, reason, rebuild_expected=expected, policy=POLICY) is None

    def test_an_updated_ticket_keeps_its_place_in_the_queue(self) -> None:
        """The held ticket replaces the queued one in place: it still leaves first."""
        queues = AdmissionQueues(4)
        first = queues.enqueue(MODEL, priority=0, now=NOW, deadline=NOW + 30.0)
        queues.enqueue(MODEL, priority=0, now=NOW, deadline=NOW + 30.0)
        held = rebuild_hold(
            first, NoEndpointReason.BREAKERS_OPEN, rebuild_expected=True, policy=POLICY
        )
        assert held is not None

        updated = queues.update(held)

        assert (True, held) == (updated, queues.pop_ready(MODEL, NOW + 100.0))

    def test_a_rebuild_hold_that_expires_says_what_it_waited_for(self) -> None:
        """The 503 names the model, the rebuild and how long it waited, with Retry-After."""
        held = rebuild_hold(
            queued_ticket(), NoEndpointReason.BREAKERS_OPEN, rebuild_expected=True, policy=POLICY
        )
        assert held is not None

        error = held.timeout_error(POLICY)

        body = error_body(error)["error"]
        assert (RebuildTimeout, 503, "rebuild_timeout", 10) == (
            type(error),
            error.status,
            body["code"],
            error.retry_after_s,
        )
        assert f"Every replica of model '{MODEL}'" in body["message"]
        assert "within 300 s" in body["message"]


# -- the gate ----------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = NOW

    def __call__(self) -> float:
        return self.now


class NullStore:
    async def kv_put(self, key: str, value: bytes | str) -> bool:
        json.loads(value)
        return True


def swap(state: RoutingState, *entries: dict[str, object]) -> None:
    snapshot = snapshot_of(*entries)
    profiles = {MODEL: KnownModel("qwen", MODEL)}
    view = RoutingView(snapshot=snapshot, profiles=MappingProxyType(profiles))
    state.swap(view, reconcile_live_state(state.live, snapshot), synced=True)


def make_gate(
    *entries: dict[str, object], clock: Clock
) -> tuple[AdmissionGate, RoutingState, CollectorRegistry]:
    state = RoutingState()
    registry = CollectorRegistry()
    metrics = RouterMetrics(registry)
    demand = DemandSignal(NullStore(), KVLayout(), router_id="r1", interval_s=5.0, metrics=metrics)
    gate = AdmissionGate(
        state,
        policy=Policy.LEAST_INFLIGHT,
        balancer=BalancerConfig(),
        admission=POLICY,
        demand=demand,
        metrics=metrics,
        cold_start_keepalive_s=0.05,
        clock=clock,
    )
    swap(state, *entries)
    return gate, state, registry


async def open_breaker(gate: AdmissionGate) -> None:
    """Five requests fail on the only replica: its breaker opens (the default threshold)."""
    for _ in range(5):
        admitted = await gate.admit(PLAIN, priority=0)
        gate.finish(admitted, Outcome.FAILURE)


def held_now(registry: CollectorRegistry) -> float | None:
    return registry.get_sample_value("caravan_router_rebuild_held_requests", {"model": MODEL})


def holds(registry: CollectorRegistry, outcome: str) -> float | None:
    return registry.get_sample_value(
        "caravan_router_rebuild_holds_total", {"model": MODEL, "outcome": outcome}
    )


async def started(gate: AdmissionGate, features: RequestFeatures) -> asyncio.Task[Admitted]:
    """Start an admission; return once its hold has begun."""
    began = asyncio.Event()

    async def hold() -> None:
        began.set()

    task = asyncio.create_task(gate.admit(features, priority=0, hold=hold))
    await asyncio.wait_for(began.wait(), 2)
    return task


async def test_breaker_open_only_replica_holds_past_the_capacity_wait_until_the_rebuild() -> None:
    """Held past the 30 s capacity wait (Consul reports it dead), then the rebuilt one takes it."""
    clock = Clock()
    gate, state, registry = make_gate(endpoint_entry("a"), clock=clock)
    await open_breaker(gate)
    task = await started(gate, PLAIN)
    during = held_now(registry)

    swap(state, endpoint_entry("a", status="critical"))
    clock.now += 60.0
    gate.tick()
    still_waiting = not task.done()
    swap(state, endpoint_entry("a", status="critical"), endpoint_entry("b", port=2))
    admitted = await asyncio.wait_for(task, 2)

    assert (1.0, True, "b") == (during, still_waiting, admitted.endpoint.id)
    assert (0.0, 1.0) == (held_now(registry), holds(registry, "admitted"))


async def test_a_request_queued_for_capacity_is_held_once_every_replica_is_out() -> None:
    """Queued behind a full replica that then dies: its deadline becomes the rebuild bound."""
    clock = Clock()
    gate, state, registry = make_gate(endpoint_entry("a", capacity=1), clock=clock)
    busy = await gate.admit(PLAIN, priority=0)
    task = asyncio.create_task(gate.admit(PLAIN, priority=0))
    await asyncio.sleep(0)
    swap(state, endpoint_entry("a", status="critical", capacity=1))
    gate.tick()
    during = held_now(registry)

    clock.now += 60.0
    gate.tick()
    still_waiting = not task.done()
    gate.finish(busy, Outcome.FAILURE)
    swap(state, endpoint_entry("b", port=2))
    admitted = await asyncio.wait_for(task, 2)

    assert (1.0, True, "b") == (during, still_waiting, admitted.endpoint.id)
    assert (0.0, 1.0) == (held_now(registry), holds(registry, "admitted"))


async def test_no_rebuild_within_the_bound_is_a_rebuild_timeout() -> None:
    """Nothing comes back within the rebuild bound: 503 `rebuild_timeout`, counted as timed out."""
    clock = Clock()
    gate, _, registry = make_gate(endpoint_entry("a"), clock=clock)
    await open_breaker(gate)
    task = await started(gate, PLAIN)

    clock.now += 301.0
    gate.tick()

    with pytest.raises(RebuildTimeout):
        await asyncio.wait_for(task, 2)
    assert (0.0, 1.0, {}) == (held_now(registry), holds(registry, "timed_out"), gate.queue_depths())


async def test_a_client_leaving_a_rebuild_hold_is_counted_as_abandoned() -> None:
    """The client goes away while held: nothing stays queued, the hold counts as abandoned."""
    clock = Clock()
    gate, _, registry = make_gate(endpoint_entry("a"), clock=clock)
    await open_breaker(gate)
    task = await started(gate, PLAIN)

    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    assert (0.0, 1.0, {}) == (held_now(registry), holds(registry, "abandoned"), gate.queue_depths())
