"""The admission gate on one event loop: leases, the queue's futures, cold-start holds, demand."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from types import MappingProxyType

import pytest
from polling import eventually
from prometheus_client import CollectorRegistry
from router_builders import MODEL, endpoint_entry, snapshot_of

from caravan_llm.common.block_digest import DigestKey
from caravan_llm.common.contract import KVLayout
from caravan_llm.common.kv_stream import KvSnapshot
from caravan_llm.router.core.admission import AdmissionPolicy
from caravan_llm.router.core.balancer import BalancerConfig, Policy, RequestFeatures
from caravan_llm.router.core.errors import ModelNotFound, NoHealthyEndpoint, QueueTimeout
from caravan_llm.router.core.live_state import Outcome, reconcile_live_state
from caravan_llm.router.core.prompt_digests import exact_prompt
from caravan_llm.router.core.routing_state import KnownModel, RoutingState, RoutingView
from caravan_llm.router.edge.admission_gate import AdmissionGate, DemandSignal
from caravan_llm.router.metrics import RouterMetrics


class FakeStore:
    def __init__(self) -> None:
        self.writes: list[tuple[str, dict[str, object]]] = []

    async def kv_put(self, key: str, value: bytes | str) -> bool:
        self.writes.append((key, json.loads(value)))
        return True


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_gate(
    *entries: dict[str, object],
    declared: bool = True,
    queue_timeout_s: float = 5.0,
    demand_interval_s: float = 5.0,
    clock: Clock | None = None,
) -> tuple[AdmissionGate, RoutingState, DemandSignal, FakeStore]:
    state = RoutingState()
    metrics = RouterMetrics(CollectorRegistry())
    store = FakeStore()
    demand = DemandSignal(
        store,
        KVLayout(),
        router_id="r1",
        interval_s=demand_interval_s,
        metrics=metrics,
        clock=clock or Clock(),
        wall_clock=lambda: 1.5,
    )
    gate = AdmissionGate(
        state,
        policy=Policy.LEAST_INFLIGHT,
        balancer=BalancerConfig(),
        admission=AdmissionPolicy(max_queue_per_model=4, queue_timeout_s=queue_timeout_s),
        demand=demand,
        metrics=metrics,
        cold_start_keepalive_s=0.05,
    )
    swap(state, *entries, declared=declared)
    return gate, state, demand, store


def swap(state: RoutingState, *entries: dict[str, object], declared: bool = True) -> None:
    snapshot = snapshot_of(*entries) if entries else snapshot_of()
    profiles = {MODEL: KnownModel("qwen", MODEL)} if declared else {}
    view = RoutingView(snapshot=snapshot, profiles=MappingProxyType(profiles))
    state.swap(view, reconcile_live_state(state.live, snapshot), synced=True)


REQUEST = RequestFeatures(MODEL)


async def test_waiting_request_gets_the_capacity_a_finished_one_frees() -> None:
    """At capacity a request waits; when the running one finishes it is admitted."""
    gate, state, _, _ = make_gate(endpoint_entry("a", capacity=1))
    first = await gate.admit(REQUEST, priority=0)
    waiting = asyncio.create_task(gate.admit(REQUEST, priority=0))
    await asyncio.sleep(0.01)
    depth_while_waiting = gate.queue_depths()

    gate.finish(first, Outcome.SUCCESS)
    second = await asyncio.wait_for(waiting, 1)

    assert {MODEL: 1} == depth_while_waiting
    assert ("a", 1, {}) == (second.endpoint.id, state.live["a"].in_flight, gate.queue_depths())


async def test_cancelled_waiter_leaves_the_queue() -> None:
    """A client that goes away while queued takes its ticket with it."""
    gate, state, _, _ = make_gate(endpoint_entry("a", capacity=1))
    first = await gate.admit(REQUEST, priority=0)
    waiting = asyncio.create_task(gate.admit(REQUEST, priority=0))
    async with asyncio.timeout(2):
        while gate.queue_depths() != {MODEL: 1}:
            await asyncio.sleep(0.001)

    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    gate.finish(first, Outcome.SUCCESS)

    assert ({}, 0) == (gate.queue_depths(), state.live["a"].in_flight)


async def test_queue_timeout_raises_and_empties_the_queue() -> None:
    """A request still waiting at its deadline gets QueueTimeout."""
    gate, _, _, _ = make_gate(endpoint_entry("a", capacity=1), queue_timeout_s=0.05)
    await gate.admit(REQUEST, priority=0)

    with pytest.raises(QueueTimeout):
        await gate.admit(REQUEST, priority=0)

    assert {} == gate.queue_depths()


async def test_unsynced_router_and_unknown_model_are_refused() -> None:
    """Before the first sync: 503; a model nobody serves or declares: 404."""
    gate, state, _, _ = make_gate(endpoint_entry("a"), declared=False)

    with pytest.raises(ModelNotFound):
        await gate.admit(RequestFeatures("other"), priority=0)
    state.synced = False
    with pytest.raises(NoHealthyEndpoint) as caught:
        await gate.admit(REQUEST, priority=0)

    assert "discovery_not_synced" == caught.value.reason


async def test_declared_model_with_only_critical_replicas_is_a_cold_start() -> None:
    """No routable replica of a declared model: held, demand written, admitted when one passes."""
    gate, state, demand, store = make_gate(endpoint_entry("a", status="critical"))
    writer = asyncio.create_task(demand.run())
    holds = 0

    async def hold() -> None:
        nonlocal holds
        holds += 1

    try:
        held = asyncio.create_task(gate.admit(REQUEST, priority=0, hold=hold))
        # Held: the first hold, one keep-alive (every 0.05 s) and the demand written.
        async with asyncio.timeout(2):
            while holds < 2 or not store.writes:
                await asyncio.sleep(0.005)
        assert not held.done()
        swap(state, endpoint_entry("a"))
        admitted = await asyncio.wait_for(held, 1)
    finally:
        writer.cancel()

    assert "a" == admitted.endpoint.id
    assert holds >= 2
    assert [("caravan/demand/qwen", {"at": 1.5, "router": "r1", "waiting": 1})] == store.writes


async def test_demand_is_written_at_most_once_per_interval() -> None:
    """Many waiting requests write the demand key once per interval per model."""
    clock = Clock()
    _, _, demand, store = make_gate(clock=clock)
    writer = asyncio.create_task(demand.run())
    model = KnownModel("qwen", MODEL)
    try:
        for waiting in (1, 2, 3):
            demand.note(model, waiting)
            await asyncio.sleep(0)
        clock.now += 5.0
        demand.note(model, 4)
        await asyncio.sleep(0.01)
    finally:
        writer.cancel()

    assert [1, 4] == [value["waiting"] for _, value in store.writes]


def streamed_gate() -> tuple[AdmissionGate, RoutingState, str]:
    """A gate with one endpoint that has a KV stream (block size 16); its service's name."""
    gate, state, _, _ = make_gate(endpoint_entry("e0"))
    snapshot = state.view.snapshot
    placed = {eid: replace(e, kv_port=9000) for eid, e in snapshot.by_id.items()}
    models = {
        name: replace(m, endpoints=tuple(placed[e.id] for e in m.endpoints))
        for name, m in snapshot.models.items()
    }
    view = RoutingView(snapshot=replace(snapshot, by_id=placed, models=models))
    state.swap(view, state.live, synced=True)
    state.kv.apply_snapshot(
        "e0", KvSnapshot(epoch=1, seq=0, block_size=16, digests=frozenset()), 0.0
    )
    return gate, state, placed["e0"].service


KEY = DigestKey.from_secret("engine-key")
PROMPT = list(range(100, 100 + 64))


async def test_a_leased_prompt_is_held_in_the_exact_index_until_the_request_ends() -> None:
    """The next request sharing the prefix sees it on the endpoint before the engine's events."""
    gate, state, service = streamed_gate()
    exact = exact_prompt(PROMPT, keys={service: KEY}, kinds=[(service, 16)])
    digests = exact.digests[service, 16]

    admitted = await gate.admit(RequestFeatures(MODEL, exact=exact), priority=0)
    during = state.kv.cached_blocks("e0", digests, block_size=16, now=1.0)
    gate.finish(admitted, Outcome.SUCCESS)
    after = state.kv.cached_blocks("e0", digests, block_size=16, now=1.0)

    assert (4, 0) == (during, after)


async def done_callbacks_ran(future: asyncio.Future[object]) -> None:
    """Return once the callbacks the future had when it was set have run (they run in order,
    each scheduled with `call_soon`, so one added now runs after them)."""
    ran = asyncio.Event()
    future.add_done_callback(lambda _: ran.set())
    await ran.wait()


async def test_a_request_routed_on_leading_ids_holds_its_whole_prompt_once_known() -> None:
    """Routed on its first 2 blocks, the request holds them; when the tokenizer hands over
    the whole prompt, all 4 are held there, and all are released at its end."""
    gate, state, service = streamed_gate()
    leading = exact_prompt(PROMPT[:32], keys={service: KEY}, kinds=[(service, 16)])
    whole = exact_prompt(PROMPT, keys={service: KEY}, kinds=[(service, 16)])
    digests = whole.digests[service, 16]
    later: asyncio.Future[object] = asyncio.get_running_loop().create_future()

    admitted = await gate.admit(RequestFeatures(MODEL, exact=leading), priority=0)
    gate.hold_whole(admitted, later)  # type: ignore[arg-type]
    before = state.kv.cached_blocks("e0", digests, block_size=16, now=1.0)
    later.set_result(whole)
    # The future's callbacks run on a later turn of the loop.
    during = await eventually(
        lambda: state.kv.cached_blocks("e0", digests, block_size=16, now=1.0) == 4 and 4,
        5.0,
        "the whole prompt held",
        interval_s=0.001,
    )
    gate.finish(admitted, Outcome.SUCCESS)
    after = state.kv.cached_blocks("e0", digests, block_size=16, now=1.0)

    assert (2, 4, 0) == (before, during, after)
    assert 0 == state.kv.in_flight_count("e0")


async def test_a_request_routed_on_the_approximate_index_holds_its_prompt_once_known() -> None:
    """Past the budget with no leading ids (a system prompt the router never saw): nothing
    is held at admission, then the whole prompt once tokenized, so that the next request
    on that prompt finds it on this replica before its events do."""
    gate, state, service = streamed_gate()
    whole = exact_prompt(PROMPT, keys={service: KEY}, kinds=[(service, 16)])
    digests = whole.digests[service, 16]
    later: asyncio.Future[object] = asyncio.get_running_loop().create_future()

    admitted = await gate.admit(RequestFeatures(MODEL), priority=0)
    gate.hold_whole(admitted, later)  # type: ignore[arg-type]
    before = state.kv.cached_blocks("e0", digests, block_size=16, now=1.0)
    later.set_result(whole)
    await asyncio.wait_for(done_callbacks_ran(later), 5.0)
    during = state.kv.cached_blocks("e0", digests, block_size=16, now=1.0)
    gate.finish(admitted, Outcome.SUCCESS)

    assert (0, 4) == (before, during)
    assert 0 == state.kv.in_flight_count("e0")


async def test_a_whole_prompt_known_after_the_request_ended_holds_nothing() -> None:
    """The tokenizer finishing late, or failing, leaves nothing held."""
    gate, state, service = streamed_gate()
    leading = exact_prompt(PROMPT[:32], keys={service: KEY}, kinds=[(service, 16)])
    whole = exact_prompt(PROMPT, keys={service: KEY}, kinds=[(service, 16)])
    loop = asyncio.get_running_loop()

    ended: asyncio.Future[object] = loop.create_future()
    admitted = await gate.admit(RequestFeatures(MODEL, exact=leading), priority=0)
    gate.hold_whole(admitted, ended)  # type: ignore[arg-type]
    gate.finish(admitted, Outcome.SUCCESS)
    ended.set_result(whole)
    await asyncio.wait_for(done_callbacks_ran(ended), 5.0)
    assert 0 == state.kv.in_flight_count("e0")

    failed: asyncio.Future[object] = loop.create_future()
    admitted = await gate.admit(RequestFeatures(MODEL, exact=leading), priority=0)
    gate.hold_whole(admitted, failed)  # type: ignore[arg-type]
    failed.set_result(None)
    await asyncio.wait_for(done_callbacks_ran(failed), 5.0)
    assert 2 == state.kv.in_flight_count("e0")
    gate.finish(admitted, Outcome.SUCCESS)
    assert 0 == state.kv.in_flight_count("e0")
