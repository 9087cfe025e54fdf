"""The last replica of a model dies: the router holds the request for its replacement.

A declared model with one replica. The replica dies under a stream (SIGKILL)
or refuses a request's connection; no other endpoint is left, so instead of
failing, the router holds the request (SSE comments for streams) and sends it
on, or continues the stream, on the replacement once it passes, up to the
cold-start deadline.
"""

from __future__ import annotations

import asyncio
import socket

import aiohttp
from router_cluster import (
    FakeEngine,
    chat_body,
    declare_model,
    engine_metric,
    parse_sse,
    read_stream,
    register_replica,
    routable_count,
    running_router,
    start_engine,
    wait_until,
)

from caravan_llm.common.consul_api import ConsulClient

HOLD_COMMENT = b": waiting for a replica\n\n"


def closed_port() -> int:
    """A loopback port nothing listens on (connections are refused)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_stream_is_held_and_continued_on_the_replacement(
    consul: ConsulClient, http: aiohttp.ClientSession
) -> None:
    """SIGKILL of the only engine mid-stream: keep-alives, then the rest from the replacement."""
    model = "solo"
    await declare_model(consul, model)
    sim = {"step_seconds": "0.02", "output_tokens": "64"}
    first = await asyncio.to_thread(start_engine, model, sim=sim)
    replacement = None
    try:
        await register_replica(consul, model, 0, first.port)
        body = chat_body(model, "tell me everything about caravans", seed=5, max_tokens=60)
        async with http.post(first.url + "/v1/chat/completions", json=body) as direct:
            expected = (await direct.json())["choices"][0]["message"]["content"]
        async with running_router(consul, cold_start_keepalive_s=0.2) as router:
            await wait_until(lambda: routable_count(router, model) == 1, timeout_s=5, what="ep")
            raw = b""
            async with http.post(
                router.url + "/v1/chat/completions", json={**body, "stream": True}
            ) as response:
                async for data in response.content.iter_any():
                    raw += data
                    if first.process.poll() is None and raw.count(b'"content":" ') >= 8:
                        first.kill()
                    if replacement is None and HOLD_COMMENT in raw:
                        # Held: the replacement starts only now, so the wait was real.
                        replacement = await asyncio.to_thread(start_engine, model, sim=sim)
                        await register_replica(consul, model, 0, replacement.port)
            holds = router.metric(
                "caravan_router_replacement_holds_total",
                model=model,
                kind="stream",
                outcome="resumed",
            )
            resumed = router.metric(
                "caravan_router_failovers_total", model=model, outcome="resumed"
            )
    finally:
        first.stop()
        if replacement is not None:
            replacement.stop()
    text, events, done = parse_sse(raw)

    assert replacement is not None, "the stream was never held"
    assert (200, True) == (response.status, done)
    assert expected == text
    assert 1 == len({event["id"] for event in events})
    assert 1 == sum(1 for event in events if event["choices"][0].get("finish_reason"))
    assert (1.0, 1.0) == (holds, resumed)


async def test_refused_request_waits_for_the_replacement(
    consul: ConsulClient, http: aiohttp.ClientSession
) -> None:
    """Non-streaming: the only replica refuses the connection; the replacement answers."""
    model = "solo-unary"
    await declare_model(consul, model)
    await register_replica(consul, model, 0, closed_port(), check="none")
    async with FakeEngine(model) as engine, running_router(consul) as router:
        await wait_until(lambda: routable_count(router, model) == 1, timeout_s=5, what="ep")
        request = asyncio.create_task(
            http.post(router.url + "/v1/chat/completions", json=chat_body(model))
        )
        await wait_until(
            lambda: router.runtime.gate.queue_depths() == {model: 1}, timeout_s=5, what="hold"
        )
        await register_replica(consul, model, 0, engine.port, check="none")
        response = await asyncio.wait_for(request, 10)
        answer = await response.json()
        holds = router.metric(
            "caravan_router_replacement_holds_total", model=model, kind="unary", outcome="resumed"
        )

    assert 200 == response.status
    assert "chat.completion" == answer["object"]
    assert 1 == engine.requests
    assert 1.0 == holds


async def test_unary_request_cut_by_the_kill_is_answered_by_the_replacement(
    consul: ConsulClient, http: aiohttp.ClientSession
) -> None:
    """Non-streaming, the only engine killed while generating: the replacement answers it."""
    model = "solo-cut"
    await declare_model(consul, model)
    sim = {"step_seconds": "0.05", "output_tokens": "64"}
    first = await asyncio.to_thread(start_engine, model, sim=sim)
    replacement = None
    try:
        await register_replica(consul, model, 0, first.port)
        body = chat_body(model, "a long answer please", seed=3, max_tokens=40)
        async with http.post(first.url + "/v1/chat/completions", json=body) as direct:
            expected = (await direct.json())["choices"][0]["message"]["content"]
        async with running_router(consul) as router:
            await wait_until(lambda: routable_count(router, model) == 1, timeout_s=5, what="ep")
            request = asyncio.create_task(http.post(router.url + "/v1/chat/completions", json=body))

            async def generating() -> bool:
                return await engine_metric(http, first, "vllm:num_requests_running") == 1.0

            await wait_until(generating, timeout_s=5, what="the engine generating")
            first.kill()
            await wait_until(
                lambda: router.runtime.gate.queue_depths() == {model: 1}, timeout_s=5, what="hold"
            )
            replacement = await asyncio.to_thread(start_engine, model, sim=sim)
            await register_replica(consul, model, 0, replacement.port)
            response = await asyncio.wait_for(request, 15)
            answer = await response.json()
            holds = router.metric(
                "caravan_router_replacement_holds_total",
                model=model,
                kind="unary",
                outcome="resumed",
            )
    finally:
        first.stop()
        if replacement is not None:
            replacement.stop()

    assert 200 == response.status
    assert expected == answer["choices"][0]["message"]["content"]
    assert 1.0 == holds


async def test_no_replacement_in_time_ends_the_stream_with_a_named_error(
    consul: ConsulClient, http: aiohttp.ClientSession
) -> None:
    """Past the cold-start deadline: the held stream ends with an error event, unary gets 503."""
    model = "solo-gone"
    await declare_model(consul, model)
    await register_replica(consul, model, 0, closed_port(), check="none")
    async with running_router(
        consul, cold_start_timeout_s=0.5, cold_start_keepalive_s=0.1
    ) as router:
        await wait_until(lambda: routable_count(router, model) == 1, timeout_s=5, what="ep")
        url = router.url + "/v1/chat/completions"
        async with http.post(url, json=chat_body(model, stream=True)) as streamed:
            raw = await streamed.read()
        async with http.post(url, json=chat_body(model)) as plain:
            error = (await plain.json())["error"]
        timed_out = [
            router.metric(
                "caravan_router_replacement_holds_total",
                model=model,
                kind=kind,
                outcome="timed_out",
            )
            for kind in ("stream", "unary")
        ]
    _, events, done = parse_sse(raw)

    assert raw.startswith(HOLD_COMMENT)
    assert (200, True) == (streamed.status, done)
    assert "replacement_timeout" == events[-1]["error"]["code"]
    assert (503, "replacement_timeout", "10") == (
        plain.status,
        error["code"],
        plain.headers.get("Retry-After"),
    )
    assert [1.0, 1.0] == timed_out


async def test_a_live_engine_answering_503_is_not_waited_for(
    consul: ConsulClient, http: aiohttp.ClientSession
) -> None:
    """The only replica answers 503: no replacement is coming, so the client gets 503 at once."""
    model = "solo-busy"
    await declare_model(consul, model)
    async with FakeEngine(model, mode="status", status=503) as engine:
        await register_replica(consul, model, 0, engine.port, check="none")
        async with running_router(consul) as router:
            await wait_until(lambda: routable_count(router, model) == 1, timeout_s=5, what="ep")
            async with http.post(
                router.url + "/v1/chat/completions", json=chat_body(model, stream=True)
            ) as response:
                await read_stream(response)
            holds = router.registry.get_sample_value(
                "caravan_router_replacement_holds_total",
                {"model": model, "kind": "stream", "outcome": "failed"},
            )

    assert 503 == response.status
    assert 1 == engine.requests
    assert holds is None
