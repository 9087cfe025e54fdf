"""Admission through the running router: queueing, 429, priority, cold-start hold."""

from __future__ import annotations

import asyncio
import json

import aiohttp
from router_cluster import (
    LAYOUT,
    FakeEngine,
    chat_body,
    declare_model,
    read_stream,
    register_replica,
    routable_count,
    running_router,
    start_engine,
    wait_until,
)

from caravan_llm.common.consul_api import ConsulClient

MODEL = "tiny"


async def test_full_model_queues_then_rejects_with_429(
    consul: ConsulClient, http: aiohttp.ClientSession
) -> None:
    """At capacity, one request waits in the bounded queue and the next gets 429 + Retry-After.

    The waiting one is sent as soon as the running request finishes.
    """
    async with FakeEngine(MODEL, mode="held", events=2) as engine:
        await register_replica(consul, MODEL, 0, engine.port, check="none", capacity=1)
        async with running_router(consul, queue_max_per_model=1) as router:
            await wait_until(lambda: routable_count(router, MODEL) == 1, timeout_s=5, what="ep")
            url = router.url + "/v1/chat/completions"
            running = asyncio.create_task(http.post(url, json=chat_body(MODEL, stream=True)))
            await wait_until(lambda: engine.in_flight == 1, timeout_s=5, what="running")
            waiting = asyncio.create_task(http.post(url, json=chat_body(MODEL, "waits")))
            await wait_until(
                lambda: router.metric("caravan_router_queue_depth", model=MODEL) == 1.0,
                timeout_s=5,
                what="queued",
            )
            async with http.post(url, json=chat_body(MODEL, "rejected")) as rejected:
                rejection = (
                    rejected.status,
                    rejected.headers.get("Retry-After"),
                    (await rejected.json())["error"]["code"],
                )
            engine.release.set()
            first = await running
            await first.read()
            second = await waiting
            await second.read()
            waits = router.metric("caravan_router_queue_wait_seconds_count", model=MODEL)

    assert (429, "1", "queue_full") == rejection
    assert (200, 200) == (first.status, second.status)
    assert 2 == engine.requests
    assert 2.0 == waits


async def test_queued_request_times_out_with_503(
    consul: ConsulClient, http: aiohttp.ClientSession
) -> None:
    """A request that waits longer than the queue timeout gets 503 with Retry-After."""
    async with FakeEngine(MODEL, mode="held", events=2) as engine:
        await register_replica(consul, MODEL, 0, engine.port, check="none", capacity=1)
        async with running_router(consul, queue_timeout_s=0.3) as router:
            await wait_until(lambda: routable_count(router, MODEL) == 1, timeout_s=5, what="ep")
            url = router.url + "/v1/chat/completions"
            running = asyncio.create_task(http.post(url, json=chat_body(MODEL, stream=True)))
            await wait_until(lambda: engine.in_flight == 1, timeout_s=5, what="running")
            async with http.post(url, json=chat_body(MODEL, "late")) as late:
                outcome = (late.status, late.headers.get("Retry-After"))
                code = (await late.json())["error"]["code"]
            engine.release.set()
            await (await running).read()

    assert ((503, "1"), "queue_timeout") == (outcome, code)


async def test_queue_serves_lower_priority_numbers_first(
    consul: ConsulClient, http: aiohttp.ClientSession
) -> None:
    """Waiting requests go in priority order (x-caravan-priority, lower first), not arrival.

    Without API keys the router honours the header only when the operator trusts it.
    """
    async with FakeEngine(MODEL, mode="held", events=2) as engine:
        await register_replica(consul, MODEL, 0, engine.port, check="none", capacity=1)
        async with running_router(consul, trust_priority_header=True) as router:
            await wait_until(lambda: routable_count(router, MODEL) == 1, timeout_s=5, what="ep")
            url = router.url + "/v1/chat/completions"
            running = asyncio.create_task(http.post(url, json=chat_body(MODEL, "0", stream=True)))
            await wait_until(lambda: engine.in_flight == 1, timeout_s=5, what="running")
            tasks = []
            for text, priority in (("late-low", "5"), ("late-high", "-1"), ("later-mid", "2")):
                tasks.append(
                    asyncio.create_task(
                        http.post(
                            url,
                            json=chat_body(MODEL, text),
                            headers={"x-caravan-priority": priority},
                        )
                    )
                )
                depth = len(tasks)

                def queued(depth: int = depth) -> bool:
                    return router.metric("caravan_router_queue_depth", model=MODEL) == depth

                await wait_until(queued, timeout_s=5, what=f"{depth} queued")
            engine.release.set()
            for response in [await running, *[await task for task in tasks]]:
                await response.read()
        order = [body["messages"][0]["content"] for body in engine.bodies]

    assert ["0", "late-high", "later-mid", "late-low"] == order


async def test_cold_start_holds_requests_and_signals_demand(
    consul: ConsulClient, http: aiohttp.ClientSession
) -> None:
    """A declared model with no replica holds requests, writes demand, and serves on arrival.

    The demand signal is refreshed while requests wait; the streaming client
    gets SSE keep-alive comments meanwhile.
    """
    model = "cold"
    await declare_model(consul, model)
    async with running_router(consul, cold_start_keepalive_s=0.2, demand_interval_s=0.2) as router:
        url = router.url + "/v1/chat/completions"
        plain = asyncio.create_task(http.post(url, json=chat_body(model, "hi", seed=1)))
        streamed = asyncio.create_task(
            http.post(url, json=chat_body(model, "hi", seed=1, stream=True))
        )

        async def demand_for_both() -> bool:
            _, entry = await consul.kv_get(LAYOUT.demand_key(model))
            return entry is not None and json.loads(entry.value)["waiting"] == 2

        await wait_until(demand_for_both, timeout_s=5, what="demand key with 2 waiting")
        _, entry = await consul.kv_get(LAYOUT.demand_key(model))
        assert entry is not None
        demand = json.loads(entry.value)
        engine = await asyncio.to_thread(start_engine, model)
        try:
            await register_replica(consul, model, 0, engine.port)
            stream_response = await asyncio.wait_for(streamed, 15)
            raw = await stream_response.read()
            plain_response = await asyncio.wait_for(plain, 15)
            answer = await plain_response.json()
        finally:
            engine.stop()

    assert 2 == demand["waiting"]
    assert {"at", "router", "waiting"} == set(demand)
    assert raw.startswith(b": waiting for a replica\n\n")
    text = "".join(
        json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
        for line in raw.split(b"\n")
        if line.startswith(b"data: {")
    )
    assert (200, 200) == (stream_response.status, plain_response.status)
    assert answer["choices"][0]["message"]["content"] == text
    assert raw.endswith(b"data: [DONE]\n\n")


async def test_cold_start_times_out_with_an_sse_error_for_streams(
    consul: ConsulClient, http: aiohttp.ClientSession
) -> None:
    """A held stream whose replica never comes ends with an error event, not a hang."""
    await declare_model(consul, "never")
    async with running_router(
        consul, cold_start_timeout_s=0.5, cold_start_keepalive_s=0.1
    ) as router:
        body = chat_body("never", stream=True)
        async with http.post(router.url + "/v1/chat/completions", json=body) as response:
            _, events, done = await read_stream(response)

    assert (200, True) == (response.status, done)
    assert "queue_timeout" == events[-1]["error"]["code"]
