"""Fail fast: a model the scheduler recorded as failed is answered at once, held requests too."""

from __future__ import annotations

import asyncio
from types import MappingProxyType

import pytest
from prometheus_client import CollectorRegistry
from router_builders import MODEL, endpoint_entry, snapshot_of

from caravan_llm.common.consul_api import KVEntry
from caravan_llm.common.contract import KVLayout, ModelFailure
from caravan_llm.router.core.admission import AdmissionPolicy
from caravan_llm.router.core.balancer import BalancerConfig, Policy, RequestFeatures
from caravan_llm.router.core.errors import ModelUnavailable, error_body, retry_after_s
from caravan_llm.router.core.live_state import reconcile_live_state
from caravan_llm.router.core.routing_state import KnownModel, RoutingState, RoutingView
from caravan_llm.router.edge.admission_gate import AdmissionGate, DemandSignal
from caravan_llm.router.feeds.model_failures import ModelFailures, failures_from_kv
from caravan_llm.router.metrics import RouterMetrics

REASON = "replica 0: the engine failed and Nomad stopped restarting it (Not Restarting: x)"
FAILURE = ModelFailure(reason=REASON, since=1_700_000_000.0)


def kv_entry(key: str, value: bytes) -> KVEntry:
    return KVEntry(
        key=key, value=value, flags=0, session=None, lock_index=0, create_index=1, modify_index=1
    )


class NoStore:
    async def kv_put(self, key: str, value: bytes | str) -> bool:
        del key, value
        return True


def make_gate(*entries: dict[str, object]) -> tuple[AdmissionGate, RoutingState, ModelFailures]:
    state = RoutingState()
    metrics = RouterMetrics(CollectorRegistry())
    demand = DemandSignal(NoStore(), KVLayout(), router_id="r1", interval_s=5, metrics=metrics)
    failures = ModelFailures()
    gate = AdmissionGate(
        state,
        policy=Policy.LEAST_INFLIGHT,
        balancer=BalancerConfig(),
        admission=AdmissionPolicy(max_queue_per_model=4, cold_start_hold_s=30),
        demand=demand,
        metrics=metrics,
        cold_start_keepalive_s=0.05,
        failures=failures,
    )
    snapshot = snapshot_of(*entries)
    profiles = {MODEL: KnownModel("qwen", MODEL)}
    view = RoutingView(snapshot=snapshot, profiles=MappingProxyType(profiles))
    state.swap(view, reconcile_live_state(state.live, snapshot), synced=True)
    return gate, state, failures


async def test_new_request_for_a_failed_model_gets_503_with_the_reason_at_once() -> None:
    """No replica and a failure record: ModelUnavailable naming model and reason, Retry-After."""
    gate, _, failures = make_gate()
    failures.update({"qwen": FAILURE})

    with pytest.raises(ModelUnavailable) as refused:
        await asyncio.wait_for(gate.admit(RequestFeatures(MODEL), priority=0), 1)

    body = error_body(refused.value)["error"]
    assert (503, "model_unavailable", "unavailable_error") == (
        refused.value.status,
        body["code"],
        body["type"],
    )
    assert f"Model '{MODEL}' is unavailable: {REASON}" in body["message"]
    assert "2023-11-14 22:13:20 UTC" in body["message"]
    assert 10 == retry_after_s(refused.value)
    assert {} == gate.queue_depths()


async def test_held_request_gets_503_when_the_failure_is_recorded() -> None:
    """A request held for a cold start is answered as soon as the record arrives."""
    gate, _, failures = make_gate()
    held = asyncio.create_task(gate.admit(RequestFeatures(MODEL), priority=0))
    await asyncio.sleep(0.02)
    depth_while_held = gate.queue_depths()

    failures.update({"qwen": FAILURE})

    with pytest.raises(ModelUnavailable):
        await asyncio.wait_for(held, 1)
    assert ({MODEL: 1}, {}) == (depth_while_held, gate.queue_depths())


async def test_a_passing_replica_is_used_even_with_a_stale_record() -> None:
    """A routable endpoint wins over a record the scheduler has not cleared yet."""
    gate, _, failures = make_gate(endpoint_entry("a", capacity=2))
    failures.update({"qwen": FAILURE})

    admitted = await asyncio.wait_for(gate.admit(RequestFeatures(MODEL), priority=0), 1)

    assert "a" == admitted.endpoint.id


async def test_other_models_failures_do_not_touch_this_one() -> None:
    """A record for another profile leaves the model's requests held as a cold start."""
    gate, _, failures = make_gate()
    failures.update({"other": FAILURE})
    held = asyncio.create_task(gate.admit(RequestFeatures(MODEL), priority=0))
    await asyncio.sleep(0.02)

    assert {MODEL: 1} == gate.queue_depths()
    held.cancel()
    with pytest.raises(asyncio.CancelledError):
        await held


def test_records_are_read_by_profile_name_and_bad_ones_left_out() -> None:
    """failures_from_kv decodes each record; an unreadable one is a problem line, not a failure."""
    prefix = KVLayout().failures
    entries = [
        kv_entry(f"{prefix}qwen", FAILURE.encode()),
        kv_entry(f"{prefix}bad", b'{"reason": "", "since": 1}'),
    ]

    found, problems = failures_from_kv(entries, prefix)

    assert {"qwen": FAILURE} == found
    assert ["caravan/failed/bad: model failure: reason must be a non-empty string"] == problems
