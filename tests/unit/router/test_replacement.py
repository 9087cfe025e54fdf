"""Holding a retry or continuation for the replacement of a model's last replica."""

from __future__ import annotations

import asyncio
import json
import time
from types import MappingProxyType

import pytest
from prometheus_client import CollectorRegistry
from router_builders import MODEL, endpoint_entry, snapshot_of

from caravan_llm.common.contract import KVLayout
from caravan_llm.router.core.admission import AdmissionPolicy, Queue, Reject, decide_admission
from caravan_llm.router.core.balancer import (
    BalancerConfig,
    NoEndpointReason,
    NotPicked,
    Policy,
    RequestFeatures,
)
from caravan_llm.router.core.errors import (
    NoHealthyEndpoint,
    ReplacementTimeout,
    UpstreamConnectError,
    UpstreamError,
    UpstreamFirstByteTimeout,
    UpstreamProtocolError,
    UpstreamStatusError,
    UpstreamTimeout,
    error_body,
)
from caravan_llm.router.core.live_state import reconcile_live_state
from caravan_llm.router.core.replacement import (
    ReplacementOutcome,
    replacement_outcome,
    still_excluded,
    waits_for_replacement,
)
from caravan_llm.router.core.routing_state import KnownModel, RoutingState, RoutingView
from caravan_llm.router.edge.admission_gate import AdmissionGate, Admitted, DemandSignal
from caravan_llm.router.metrics import RouterMetrics

POLICY = AdmissionPolicy(max_queue_per_model=2, cold_start_hold_s=300.0)
NOW = 1_000.0
TRIED_A = RequestFeatures(MODEL, exclude=frozenset({"a"}))


class TestWaitsForReplacement:
    @pytest.mark.parametrize(
        ("error", "mid_stream", "expected"),
        [
            # Before the first byte: only a replica that is not there any more.
            (UpstreamConnectError("a", "ConnectionRefusedError"), False, True),
            (UpstreamStatusError("a", 503), False, False),
            (UpstreamStatusError("a", 500), False, False),
            (UpstreamFirstByteTimeout("a", "no headers"), False, False),
            (UpstreamProtocolError("a", "bad HTTP response"), False, False),
            # Mid-stream: the connection was cut, ended early, or went silent.
            (UpstreamConnectError("a", "ClientPayloadError"), True, True),
            (UpstreamProtocolError("a", "the stream ended without [DONE]"), True, True),
            (UpstreamTimeout("a", "the stream went silent"), True, True),
            # A live engine answered the continuation with an error: no replacement is coming.
            (UpstreamStatusError("a", 502), True, False),
            (UpstreamFirstByteTimeout("a", "no event"), True, False),
        ],
    )
    def test_holds_only_when_the_replica_is_gone(
        self, error: UpstreamError, mid_stream: bool, expected: bool
    ) -> None:
        """A reset, refused or cut connection waits; an engine that answered or hangs does not."""
        assert expected == waits_for_replacement(error, mid_stream=mid_stream)


class TestStillExcluded:
    def test_a_tried_endpoint_still_passing_stays_excluded(self) -> None:
        """Consul has not noticed the death yet: the dead endpoint keeps being avoided."""
        endpoints = snapshot_of(endpoint_entry("a")).for_model(MODEL)

        assert frozenset({"a"}) == still_excluded(endpoints, frozenset({"a"}))

    def test_a_critical_or_vanished_endpoint_is_forgotten(self) -> None:
        """Critical or gone from the catalog: taken again once it passes (restart in place)."""
        endpoints = snapshot_of(
            endpoint_entry("a", status="critical"), endpoint_entry("c", port=2)
        ).for_model(MODEL)

        assert frozenset({"c"}) == still_excluded(endpoints, frozenset({"a", "b", "c"}))
        assert frozenset() == still_excluded(None, frozenset({"a"}))


class TestReplacementOutcome:
    @pytest.mark.parametrize(
        ("ok", "timed_out", "client_closed", "expected"),
        [
            (True, False, False, ReplacementOutcome.RESUMED),
            (False, True, False, ReplacementOutcome.TIMED_OUT),
            (False, False, False, ReplacementOutcome.FAILED),
            (False, False, True, ReplacementOutcome.CLIENT_CLOSED),
            (False, True, True, ReplacementOutcome.CLIENT_CLOSED),
        ],
    )
    def test_outcome_of_a_held_request(
        self, ok: bool, timed_out: bool, client_closed: bool, expected: ReplacementOutcome
    ) -> None:
        """A client that left counts as such; then a timeout; else the request's own result."""
        assert expected == replacement_outcome(
            ok=ok, timed_out=timed_out, client_closed=client_closed
        )


class TestDecideAdmission:
    def test_every_endpoint_tried_without_replacement_is_503_at_once(self) -> None:
        """Retries that may not wait (or undeclared models) end with 503 as before."""
        for replacement, declared in ((False, True), (True, False)):
            decision = decide_admission(
                NotPicked(NoEndpointReason.ALL_EXCLUDED),
                queue_depth=0,
                model_declared=declared,
                policy=POLICY,
                now=NOW,
                replacement=replacement,
            )

            assert Reject(503, 1, NoEndpointReason.ALL_EXCLUDED, queue_full=False) == decision

    def test_every_endpoint_tried_waiting_for_replacement_is_held_like_a_cold_start(self) -> None:
        """A declared model's dead last replica: held up to the cold-start deadline."""
        decision = decide_admission(
            NotPicked(NoEndpointReason.ALL_EXCLUDED),
            queue_depth=0,
            model_declared=True,
            policy=POLICY,
            now=NOW,
            replacement=True,
        )

        assert Queue(deadline=NOW + 300.0, cold_start=True) == decision

    def test_a_full_queue_still_rejects_a_replacement_hold(self) -> None:
        """The queue bound holds for replacement waits too (503, cold-start Retry-After)."""
        decision = decide_admission(
            NotPicked(NoEndpointReason.ALL_EXCLUDED),
            queue_depth=2,
            model_declared=True,
            policy=POLICY,
            now=NOW,
            replacement=True,
        )

        assert Reject(503, 10, NoEndpointReason.ALL_EXCLUDED, queue_full=True) == decision


# -- the gate ----------------------------------------------------------------------------


def make_gate(
    *entries: dict[str, object], hold_s: float = 300.0
) -> tuple[AdmissionGate, RoutingState]:
    state = RoutingState()
    metrics = RouterMetrics(CollectorRegistry())
    demand = DemandSignal(NullStore(), KVLayout(), router_id="r1", interval_s=5.0, metrics=metrics)
    gate = AdmissionGate(
        state,
        policy=Policy.LEAST_INFLIGHT,
        balancer=BalancerConfig(),
        admission=AdmissionPolicy(max_queue_per_model=4, cold_start_hold_s=hold_s),
        demand=demand,
        metrics=metrics,
        cold_start_keepalive_s=0.05,
    )
    swap(state, *entries)
    return gate, state


class NullStore:
    async def kv_put(self, key: str, value: bytes | str) -> bool:
        json.loads(value)
        return True


def swap(state: RoutingState, *entries: dict[str, object]) -> None:
    snapshot = snapshot_of(*entries)
    profiles = {MODEL: KnownModel("qwen", MODEL)}
    view = RoutingView(snapshot=snapshot, profiles=MappingProxyType(profiles))
    state.swap(view, reconcile_live_state(state.live, snapshot), synced=True)


async def held(gate: AdmissionGate, features: RequestFeatures) -> asyncio.Task[Admitted]:
    """Start an admission that waits for a replacement; return once its hold has begun."""
    began = asyncio.Event()

    async def hold() -> None:
        began.set()

    task = asyncio.create_task(gate.admit(features, priority=0, hold=hold, replacement=True))
    await asyncio.wait_for(began.wait(), 2)
    return task


async def test_without_replacement_the_last_replica_tried_is_503() -> None:
    """The behaviour a plain retry keeps: every endpoint tried, nothing to wait for."""
    gate, _ = make_gate(endpoint_entry("a"))

    with pytest.raises(NoHealthyEndpoint) as caught:
        await gate.admit(TRIED_A, priority=0)

    assert "all_excluded" == caught.value.reason


async def test_held_request_goes_to_the_replacement_once_it_passes() -> None:
    """Dead `a` goes critical, its replacement `b` starts then passes: the request gets `b`."""
    gate, state = make_gate(endpoint_entry("a"))
    task = await held(gate, TRIED_A)

    swap(state, endpoint_entry("a", status="critical"))
    swap(state, endpoint_entry("a", status="critical"), endpoint_entry("b", status="critical"))
    still_waiting = not task.done()
    swap(state, endpoint_entry("b", port=2))
    admitted = await asyncio.wait_for(task, 2)

    assert still_waiting
    assert "b" == admitted.endpoint.id
    assert {} == gate.queue_depths()


async def test_a_replica_restarted_in_place_is_taken_again_after_it_was_critical() -> None:
    """Same service id after an in-place restart: excluded until seen critical, then taken."""
    gate, state = make_gate(endpoint_entry("a"))
    task = await held(gate, TRIED_A)

    swap(state, endpoint_entry("a", status="critical"))
    swap(state, endpoint_entry("a"))
    admitted = await asyncio.wait_for(task, 2)

    assert "a" == admitted.endpoint.id


async def test_a_tried_replica_that_stays_passing_is_not_taken_again() -> None:
    """Until Consul reports the death, the held request does not go back to the dead endpoint."""
    gate, state = make_gate(endpoint_entry("a"))
    task = await held(gate, TRIED_A)

    swap(state, endpoint_entry("a"))
    gate.tick()

    assert not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert {} == gate.queue_depths()


@pytest.mark.parametrize("evidence", ["last_success_at", "load_scraped_at"])
async def test_a_tried_replica_seen_alive_since_the_hold_began_is_taken_again(
    evidence: str,
) -> None:
    """Both replicas tried, both still serving others: no replacement is coming, retry one.

    Found by the soak: a request whose attempts on both replicas met connections
    the engines were closing was held for the rebuild deadline (300 s) while both
    replicas served everyone else.
    """
    gate, state = make_gate(endpoint_entry("a"), endpoint_entry("b", port=2))
    tried_both = RequestFeatures(MODEL, exclude=frozenset({"a", "b"}))
    task = await held(gate, tried_both)
    gate.tick()
    still_held = not task.done()

    # A request on `b` succeeds (or its metrics are scraped) after the hold began.
    setattr(state.live["b"], evidence, time.monotonic())
    gate.tick()
    admitted = await asyncio.wait_for(task, 2)

    assert still_held
    assert "b" == admitted.endpoint.id
    assert {} == gate.queue_depths()


def test_evidence_from_before_the_hold_does_not_count() -> None:
    """A success or scrape older than the hold says nothing about the failure after it."""
    snapshot = snapshot_of(endpoint_entry("a"), endpoint_entry("b", port=2))
    live = reconcile_live_state({}, snapshot)
    live["a"].last_success_at = 99.0
    live["b"].load_scraped_at = 100.0
    endpoints = snapshot.for_model(MODEL)
    exclude = frozenset({"a", "b"})

    assert exclude == still_excluded(endpoints, exclude, live, since=100.0)
    assert frozenset({"a"}) == still_excluded(endpoints, exclude, live, since=99.5)
    assert exclude == still_excluded(endpoints, exclude, live)  # no hold time: no evidence


async def test_no_replacement_before_the_deadline_is_a_replacement_timeout() -> None:
    """The hold ends at the cold-start deadline with a 503 that says what it waited for."""
    gate, _ = make_gate(endpoint_entry("a"), hold_s=0.1)
    task = await held(gate, TRIED_A)

    with pytest.raises(ReplacementTimeout) as caught:
        await asyncio.wait_for(task, 2)

    body = error_body(caught.value)["error"]
    assert (503, "replacement_timeout", 10) == (
        caught.value.status,
        body["code"],
        caught.value.retry_after_s,
    )
    assert MODEL in body["message"]
    assert {} == gate.queue_depths()


async def test_a_held_request_never_holds_up_the_queue_behind_it() -> None:
    """Held for a replacement after trying `a` and `b`, one request waits; the others go on.

    Found by the soak: such a request at the head of the queue stopped a router
    from admitting anything for half a minute while both replicas stood idle
    (its queue filled and every newcomer got 429).
    """
    gate, _ = make_gate(endpoint_entry("a"), endpoint_entry("b", port=2))
    tried_both = RequestFeatures(MODEL, exclude=frozenset({"a", "b"}))
    task = await held(gate, tried_both)

    newcomer = await asyncio.wait_for(gate.admit(RequestFeatures(MODEL), priority=0), 2)
    later = await asyncio.wait_for(gate.admit(RequestFeatures(MODEL), priority=0), 2)

    assert {newcomer.endpoint.id, later.endpoint.id} <= {"a", "b"}
    assert not task.done()  # still held, in its place
    assert {MODEL: 1} == gate.queue_depths()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
