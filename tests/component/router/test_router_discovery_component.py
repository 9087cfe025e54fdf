"""Discovery against the devcluster Consul: drains, saturation, outages."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry
from router_cluster import (
    LAYOUT,
    Engine,
    FakeEngine,
    chat_body,
    read_stream,
    register_replica,
    routable_count,
    running_consul,
    running_router,
    wait_until,
)

from caravan_llm.common.consul_api import ConsulClient, ConsulSettings
from caravan_llm.common.contract import replica_job_id
from caravan_llm.router.settings import RouterSettings
from caravan_llm.router.wiring.app import app_runner, create_app

MODEL = "tiny"


@pytest.mark.parametrize("how", ["deregister", "kv_marker"])
async def test_drained_endpoint_finishes_its_stream_and_gets_nothing_new(
    consul: ConsulClient, http: aiohttp.ClientSession, how: str
) -> None:
    """A replica leaving (deregistered, or marked draining in KV) completes its in-flight stream.

    New requests all go to the other replica from then on.
    """
    async with FakeEngine(MODEL, mode="held", events=4) as leaving, FakeEngine(MODEL) as staying:
        leaving_id = await register_replica(consul, MODEL, 0, leaving.port, check="none")
        async with running_router(consul) as router:
            await wait_until(lambda: routable_count(router, MODEL) == 1, timeout_s=5, what="ep")
            stream = asyncio.create_task(
                http.post(router.url + "/v1/chat/completions", json=chat_body(MODEL, stream=True))
            )
            await wait_until(lambda: leaving.in_flight == 1, timeout_s=5, what="stream started")
            await register_replica(consul, MODEL, 1, staying.port, check="none")
            if how == "deregister":
                await consul.agent_service_deregister(leaving_id)
            else:
                drain = '{"model": "tiny", "since": 0, "drain_s": 30, "reason": "test"}'
                await consul.kv_put(LAYOUT.draining_key(replica_job_id(MODEL, 0)), drain)
            await wait_until(
                lambda: (
                    routable_count(router, MODEL) == 1
                    and router.runtime.state.view.snapshot.for_model(MODEL) is not None
                    and any(
                        endpoint.port == staying.port
                        for endpoint in router.runtime.state.view.snapshot.by_id.values()
                    )
                ),
                timeout_s=5,
                what="drain seen",
            )
            for index in range(4):
                async with http.post(
                    router.url + "/v1/chat/completions", json=chat_body(MODEL, f"{index}")
                ) as response:
                    assert 200 == response.status
            leaving.release.set()
            response = await stream
            text, _, done = await read_stream(response)

    assert (200, " w0 w1 w2 w3", True) == (response.status, text, done)
    assert (1, 4) == (leaving.requests, staying.requests)


async def test_warning_replica_is_used_only_when_passing_ones_are_full(
    consul: ConsulClient, http: aiohttp.ClientSession
) -> None:
    """Consul `warning` means saturated: used only when no passing endpoint has room."""
    async with FakeEngine(MODEL, mode="held", events=2) as passing, FakeEngine(MODEL) as saturated:
        await register_replica(consul, MODEL, 0, passing.port, check="none", capacity=1)
        warning_id = await register_replica(consul, MODEL, 1, saturated.port, check="ttl")
        await consul.agent_check_warn(f"ttl-{warning_id}", "engine queue full")
        async with running_router(consul) as router:
            await wait_until(lambda: routable_count(router, MODEL) == 2, timeout_s=5, what="eps")
            first = asyncio.create_task(
                http.post(router.url + "/v1/chat/completions", json=chat_body(MODEL, stream=True))
            )
            await wait_until(lambda: passing.in_flight == 1, timeout_s=5, what="passing busy")
            async with http.post(
                router.url + "/v1/chat/completions", json=chat_body(MODEL, "second")
            ) as second:
                await second.read()
            passing.release.set()
            response = await first
            await response.read()

    assert (200, 200) == (response.status, second.status)
    assert (1, 1) == (passing.requests, saturated.requests)


async def test_consul_outage_keeps_serving_from_the_last_view(
    tiny_engines: list[Engine], http: aiohttp.ClientSession
) -> None:
    """With Consul gone the router still routes, and `/health` says its view is stale."""
    async with running_consul() as (server, consul):
        await register_replica(consul, MODEL, 0, tiny_engines[0].port)
        async with running_router(consul, consul_wait_s=5.0) as router:
            await wait_until(lambda: routable_count(router, MODEL) == 1, timeout_s=5, what="ep")
            await server.__aexit__(None, None, None)

            async def stale() -> bool:
                async with http.get(router.url + "/health") as response:
                    return bool((await response.json()).get("discovery") == "stale")

            await wait_until(stale, timeout_s=10, what="stale discovery")
            async with http.get(router.url + "/health") as response:
                health_status = response.status
            async with http.post(
                router.url + "/v1/chat/completions", json=chat_body(MODEL)
            ) as response:
                answer = await response.json()
            staleness = router.metric("caravan_router_discovery_staleness_seconds")

    assert 200 == health_status
    assert 200 == response.status
    assert answer["choices"][0]["message"]["content"]
    assert staleness is not None
    assert staleness > 0


async def test_router_that_never_synced_is_not_healthy(http: aiohttp.ClientSession) -> None:
    """Before its first full read of Consul, `/health` answers 503 and requests get 503."""
    unreachable = ConsulSettings(host="127.0.0.1", port=1, request_timeout_s=0.5)
    settings = RouterSettings(port=0, register_service=False, log_format="text")
    async with ConsulClient(unreachable) as consul:
        app = create_app(settings, consul=consul, registry=CollectorRegistry())
        runner = app_runner(app, settings)
        await runner.setup()
        try:
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            url = f"http://127.0.0.1:{runner.addresses[0][1]}"
            async with http.get(url + "/health") as response:
                health = (response.status, await response.json())
            async with http.post(url + "/v1/chat/completions", json=chat_body(MODEL)) as response:
                error = (response.status, response.headers.get("Retry-After"))
        finally:
            await runner.cleanup()

    assert (503, {"status": "starting", "discovery": "never_synced"}) == health
    assert (503, "1") == error
