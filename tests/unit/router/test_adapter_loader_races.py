"""The router's on-demand adapter loads against a scheduler that moves adapters meanwhile:
the slot left to routers, documents that are behind the router, an engine that no longer
holds an adapter (issue 25's limit: no replica asked to hold more than `max_loras`)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from router_builders import endpoint_entry, snapshot_of

from caravan_llm.common.contract import ModelAdapters, ReplicaAdapters, nomad_service_id
from caravan_llm.router.core.adapters import (
    AdapterRoute,
    AdapterTable,
    eviction_victim,
    on_demand_victim,
)
from caravan_llm.router.core.cost_model import load_cost
from caravan_llm.router.core.endpoints import Endpoint
from caravan_llm.router.core.routing_state import RoutingState, RoutingView
from caravan_llm.router.edge.adapter_loader import AdapterLoader

MODEL = "qwen"
ALLOC = "5d3c2a4e-8b1f-4c0d-9e6a-7f8b9c0d1e2f"
OTHER = "6e4d3b5f-9c2a-4d1e-8f7b-8a9c0d1e2f3a"
ENDPOINT_ID = nomad_service_id(ALLOC, MODEL)


def test_with_a_slot_left_to_routers_only_a_routers_copy_makes_way() -> None:
    """The adapter held beyond the plan goes even while there is room; with none, a free slot
    takes the load; nothing reserved: the full replica's rule (`eviction_victim`)."""
    common = {"max_loras": 4, "copies": {}, "demand": {"x": 2.0, "y": 1.0}}
    assert "y" == on_demand_victim(["a", "b", "x", "y"], ["a", "b"], reserved=1, **common)
    assert "x" == on_demand_victim(["a", "b", "x"], ["a", "b", "c"], reserved=1, **common)
    assert on_demand_victim(["a", "b", "c"], ["a", "b", "c"], reserved=1, **common) is None
    held = ["a", "b", "c", "d"]
    assert eviction_victim(held, max_loras=4, copies={}, demand={}) == on_demand_victim(
        held, held, reserved=1, **common
    )


def test_a_load_holds_every_request_in_flight_on_its_replica() -> None:
    """The load cost counts the request and each one in flight there (they wait for it)."""
    assert [0.5, 2.0, 0.5] == [load_cost(0.5, 0), load_cost(0.5, 3), load_cost(0.5, -1)]


def route() -> AdapterRoute:
    return AdapterRoute("sql", MODEL, "qwen-chat", "/loras/sql", max_loras=2)


def document(loaded: tuple[str, ...], *, other: tuple[str, ...] = ()) -> ModelAdapters:
    return ModelAdapters(
        model=MODEL,
        replicas=(
            ReplicaAdapters(alloc_id=ALLOC, job_id="j", loaded=loaded, desired=loaded),
            ReplicaAdapters(alloc_id=OTHER, job_id="j", loaded=other, desired=other),
        ),
        load_path="/v1/load_lora_adapter",
        unload_path="/v1/unload_lora_adapter",
    )


def swap(state: RoutingState, doc: ModelAdapters) -> None:
    table = AdapterTable(routes={"sql": route()}, documents={MODEL: doc})
    state.swap(RoutingView(adapters=table), {}, synced=True)


@pytest.fixture
async def engine() -> AsyncIterator[tuple[Endpoint, list[str]]]:
    """A replica's engine that loads anything; the endpoint, and the calls it got."""
    calls: list[str] = []

    async def call(request: web.Request) -> web.Response:
        calls.append(f"{request.path} {(await request.json())['lora_name']}")
        return web.Response(text="Success")

    app = web.Application()
    app.router.add_post("/v1/load_lora_adapter", call)
    app.router.add_post("/v1/unload_lora_adapter", call)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    (endpoint,) = snapshot_of(endpoint_entry(ENDPOINT_ID, model="qwen-chat")).by_id.values()
    try:
        yield replace(endpoint, address="127.0.0.1", port=server.port or 0), calls
    finally:
        await server.close()


async def test_a_document_read_before_a_load_does_not_undo_it(
    engine: tuple[Endpoint, list[str]],
) -> None:
    """After the router loaded an adapter, a document that does not list it yet (the scheduler
    read the engine before) leaves it counted as held there; one that lists it settles it."""
    endpoint, calls = engine
    state = RoutingState()
    swap(state, document(()))
    async with aiohttp.ClientSession() as session:
        loader = AdapterLoader(
            state,
            session=lambda: session,
            engine_keys=None,
            timeout_s=5.0,
            failure_backoff_s=30.0,
            confirm_after_s=30.0,
            retry_after_s=1,
        )
        assert await loader.ensure(endpoint, route()) is not None
        swap(state, document((), other=("chat",)))
        assert endpoint.id in loader.want(route(), 0.0).holders
        assert await loader.ensure(endpoint, route()) is None
        swap(state, document(("sql",)))
        assert endpoint.id in loader.want(route(), 0.0).holders
    assert ["/v1/load_lora_adapter sql"] == calls


async def test_an_engine_that_no_longer_holds_an_adapter_is_not_routed_to_for_it(
    engine: tuple[Endpoint, list[str]],
) -> None:
    """`not_held` (the engine's 404) takes the replica out of the holders until a document
    says otherwise, so the retry loads it there or goes elsewhere."""
    endpoint, _ = engine
    state = RoutingState()
    swap(state, document(("sql",)))
    async with aiohttp.ClientSession() as session:
        loader = AdapterLoader(
            state,
            session=lambda: session,
            engine_keys=None,
            timeout_s=5.0,
            failure_backoff_s=30.0,
            confirm_after_s=30.0,
            retry_after_s=1,
        )
        assert endpoint.id in loader.want(route(), 0.0).holders
        loader.not_held(endpoint.id, "sql")
        assert endpoint.id not in loader.want(route(), 0.0).holders
        swap(state, document(("sql",), other=("chat",)))
        assert endpoint.id not in loader.want(route(), 0.0).holders
        swap(state, document((), other=("chat",)))
        swap(state, document(("sql",)))
        assert endpoint.id in loader.want(route(), 0.0).holders


async def test_loads_on_one_replica_decide_one_after_the_other(
    engine: tuple[Endpoint, list[str]],
) -> None:
    """Two adapters loaded at once on a replica with one free slot: the second unloads the
    first rather than both taking the same free slot (which would ask for 3 of 2)."""
    endpoint, calls = engine
    state = RoutingState()
    two = AdapterTable(
        routes={
            "sql": route(),
            "chat": replace(route(), name="chat", source="/loras/chat"),
        },
        documents={MODEL: document(("base-copy",))},
    )
    state.swap(RoutingView(adapters=two), {}, synced=True)
    async with aiohttp.ClientSession() as session:
        loader = AdapterLoader(
            state,
            session=lambda: session,
            engine_keys=None,
            timeout_s=5.0,
            failure_backoff_s=30.0,
            confirm_after_s=30.0,
            retry_after_s=1,
        )
        routes = state.view.adapters.routes
        await asyncio.gather(
            loader.ensure(endpoint, routes["sql"]), loader.ensure(endpoint, routes["chat"])
        )
    held = {"base-copy"}
    for line in calls:
        path, name = line.split()
        if path.endswith("unload_lora_adapter"):
            held.discard(name)
        else:
            held.add(name)
        assert len(held) <= 2, calls
