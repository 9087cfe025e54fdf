"""Failure handling: retries before the first byte only, per-endpoint circuit breakers."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import aiohttp
import pytest
from router_cluster import (
    Engine,
    FakeEngine,
    ManualClock,
    chat_body,
    read_stream,
    register_replica,
    routable_count,
    running_router,
    wait_until,
)

from caravan_llm.common.consul_api import ConsulClient

MODEL = "tiny"


def closed_port() -> int:
    """A loopback port nothing listens on (connections are refused)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_refused_connection_is_retried_on_another_endpoint(
    consul: ConsulClient, tiny_engines: list[Engine], http: aiohttp.ClientSession
) -> None:
    """An endpoint that refuses connections costs a retry, never a failed request."""
    await register_replica(consul, MODEL, 0, tiny_engines[0].port)
    # Consul still says passing (no check has noticed yet), but nothing listens.
    await register_replica(consul, MODEL, 1, closed_port(), check="none")
    async with running_router(consul, policy="round_robin") as router:
        await wait_until(lambda: routable_count(router, MODEL) == 2, timeout_s=5, what="replicas")
        statuses = []
        for index in range(6):
            body = chat_body(MODEL, f"q{index}", stream=index % 2 == 0)
            async with http.post(router.url + "/v1/chat/completions", json=body) as response:
                await response.read()
                statuses.append(response.status)
        retries = router.metric("caravan_router_retries_total", model=MODEL)

    assert [200] * 6 == statuses
    assert retries is not None
    assert retries >= 1


@pytest.mark.parametrize("status", [500, 503])
async def test_engine_error_status_is_retried_on_another_endpoint(
    consul: ConsulClient, http: aiohttp.ClientSession, status: int
) -> None:
    """An engine answering 500 or 503 before any byte is replaced by another endpoint."""
    async with FakeEngine(MODEL, mode="status", status=status) as broken, FakeEngine(MODEL) as good:
        await register_replica(consul, MODEL, 0, broken.port, check="none")
        await register_replica(consul, MODEL, 1, good.port, check="none")
        async with running_router(consul, policy="round_robin") as router:
            await wait_until(lambda: routable_count(router, MODEL) == 2, timeout_s=5, what="eps")
            statuses = []
            for index in range(4):
                body = chat_body(MODEL, f"q{index}", stream=index % 2 == 1)
                async with http.post(router.url + "/v1/chat/completions", json=body) as response:
                    await response.read()
                    statuses.append(response.status)

    assert [200] * 4 == statuses
    assert broken.requests >= 1
    assert 4 == good.requests


async def test_every_endpoint_failing_answers_502_after_max_attempts(
    consul: ConsulClient, http: aiohttp.ClientSession
) -> None:
    """When every attempt fails, the client gets one OpenAI error after `max_attempts` tries."""
    async with FakeEngine(MODEL, mode="status", status=500) as first:
        async with FakeEngine(MODEL, mode="status", status=500) as second:
            await register_replica(consul, MODEL, 0, first.port, check="none")
            await register_replica(consul, MODEL, 1, second.port, check="none")
            async with running_router(consul, max_attempts=2) as router:
                await wait_until(
                    lambda: routable_count(router, MODEL) == 2, timeout_s=5, what="eps"
                )
                async with http.post(
                    router.url + "/v1/chat/completions", json=chat_body(MODEL)
                ) as response:
                    error = (await response.json())["error"]

    assert (502, "upstream_status_error") == (response.status, error["code"])
    assert (1, 1) == (first.requests, second.requests)


async def test_no_retry_once_the_stream_has_started(
    consul: ConsulClient, http: aiohttp.ClientSession
) -> None:
    """A stream that breaks after its first bytes is never re-sent as a new request.

    The request asks for a JSON response format, which no continuation could
    honour, so the client gets what was sent, an error event and `[DONE]`.
    """
    async with FakeEngine(MODEL, mode="die", events=3) as first:
        async with FakeEngine(MODEL, mode="die", events=3) as second:
            await register_replica(consul, MODEL, 0, first.port, check="none")
            await register_replica(consul, MODEL, 1, second.port, check="none")
            async with running_router(consul) as router:
                await wait_until(
                    lambda: routable_count(router, MODEL) == 2, timeout_s=5, what="eps"
                )
                body = chat_body(MODEL, stream=True, response_format={"type": "json_object"})
                async with http.post(router.url + "/v1/chat/completions", json=body) as response:
                    text, events, done = await read_stream(response)

    assert (200, " w0 w1 w2", True) == (response.status, text, done)
    assert "stream_interrupted" == events[-1]["error"]["code"]
    assert 1 == first.requests + second.requests


async def test_breaker_opens_then_half_opens_for_one_probe(
    consul: ConsulClient, http: aiohttp.ClientSession
) -> None:
    """Consecutive failures open an endpoint's breaker; after the cool-down one probe goes there.

    The router's clock is a manual one, so the cool-down passes exactly when the
    test says, however slowly the machine serves the requests.
    """
    clock = ManualClock(time.monotonic())
    async with FakeEngine(MODEL, mode="status", status=503) as failing, FakeEngine(MODEL) as good:
        await register_replica(consul, MODEL, 0, failing.port, check="none")
        await register_replica(consul, MODEL, 1, good.port, check="none")
        async with running_router(
            consul,
            policy="round_robin",
            breaker_failure_threshold=2,
            breaker_cool_down_s=1.0,
            clock=clock,
        ) as router:
            await wait_until(lambda: routable_count(router, MODEL) == 2, timeout_s=5, what="eps")
            failing_id = next(
                endpoint.id
                for endpoint in router.runtime.state.view.snapshot.by_id.values()
                if endpoint.port == failing.port
            )

            async def send(count: int) -> list[int]:
                statuses = []
                for index in range(count):
                    async with http.post(
                        router.url + "/v1/chat/completions", json=chat_body(MODEL, f"{index}")
                    ) as response:
                        await response.read()
                        statuses.append(response.status)
                return statuses

            def breaker() -> float | None:
                return router.metric(
                    "caravan_router_endpoint_breaker_state", model=MODEL, endpoint=failing_id
                )

            first = await send(8)
            opened = (failing.requests, breaker())
            clock.advance(1.1)
            half_open = breaker()
            second = await send(4)
            reopened = (failing.requests, breaker())

    assert [200] * 8 == first
    assert (2, 2.0) == opened
    assert 1.0 == half_open
    assert [200] * 4 == second
    assert (3, 2.0) == reopened


async def test_error_answer_of_the_engine_passes_through(
    consul: ConsulClient, http: aiohttp.ClientSession
) -> None:
    """A 4xx from the engine is its verdict on the request: passed through, not retried."""
    async with FakeEngine(MODEL, mode="status", status=400) as engine:
        await register_replica(consul, MODEL, 0, engine.port, check="none")
        async with running_router(consul) as router:
            await wait_until(lambda: routable_count(router, MODEL) == 1, timeout_s=5, what="eps")
            async with http.post(
                router.url + "/v1/chat/completions", data=json.dumps(chat_body(MODEL))
            ) as response:
                error = (await response.json())["error"]

    assert (400, "fake failure", 1) == (response.status, error["message"], engine.requests)


async def test_hung_engine_is_given_up_after_the_first_byte_timeout(
    consul: ConsulClient, http: aiohttp.ClientSession
) -> None:
    """An engine that never answers costs one first-byte timeout, then another endpoint serves."""
    async with FakeEngine(MODEL, mode="hang") as hung, FakeEngine(MODEL) as good:
        await register_replica(consul, MODEL, 0, hung.port, check="none")
        await register_replica(consul, MODEL, 1, good.port, check="none")
        async with running_router(consul, policy="round_robin", first_byte_timeout_s=0.3) as router:
            await wait_until(lambda: routable_count(router, MODEL) == 2, timeout_s=5, what="eps")
            statuses = []
            for index in range(2):
                async with http.post(
                    router.url + "/v1/chat/completions", json=chat_body(MODEL, f"{index}")
                ) as response:
                    await response.read()
                    statuses.append(response.status)

    assert [200, 200] == statuses
    assert (1, 2) == (hung.requests, good.requests)


async def test_silent_stream_fails_over_with_a_continuation_request(
    consul: ConsulClient, http: aiohttp.ClientSession
) -> None:
    """A stream silent past the idle timeout goes on elsewhere as a continuation of its text.

    The second engine receives the partial answer as an assistant message to
    continue, with the token limit reduced by what was already sent.
    """
    async with FakeEngine(MODEL, mode="stall", events=2) as stalling:
        await register_replica(consul, MODEL, 0, stalling.port, check="none")
        async with (
            FakeEngine(MODEL, events=3) as rescuer,
            running_router(consul, stream_idle_timeout_s=0.3) as router,
        ):
            await wait_until(lambda: routable_count(router, MODEL) == 1, timeout_s=5, what="ep")
            body = chat_body(MODEL, "go on", stream=True, max_tokens=10)
            text_task = asyncio.create_task(
                http.post(router.url + "/v1/chat/completions", json=body)
            )
            await wait_until(lambda: stalling.in_flight == 1, timeout_s=5, what="stream started")
            await register_replica(consul, MODEL, 1, rescuer.port, check="none")
            await wait_until(lambda: routable_count(router, MODEL) == 2, timeout_s=5, what="both")
            response = await text_task
            text, events, done = await read_stream(response)

    continued = rescuer.bodies[0]
    assert (" w0 w1 w0 w1 w2", True) == (text, done)
    assert {"role": "assistant", "content": " w0 w1"} == continued["messages"][-1]
    assert (8, True, False) == (
        continued["max_tokens"],
        continued["continue_final_message"],
        continued["add_generation_prompt"],
    )
    assert 1 == sum(1 for event in events if "role" in event["choices"][0]["delta"])


async def test_client_that_goes_away_is_logged_as_499_and_frees_its_lease(
    consul: ConsulClient, http: aiohttp.ClientSession
) -> None:
    """A client disconnecting mid-stream is counted as client_closed and its lease comes back."""
    async with FakeEngine(MODEL, mode="held", events=3) as engine:
        await register_replica(consul, MODEL, 0, engine.port, check="none")
        async with running_router(consul) as router:
            await wait_until(lambda: routable_count(router, MODEL) == 1, timeout_s=5, what="ep")
            response = await http.post(
                router.url + "/v1/chat/completions", json=chat_body(MODEL, stream=True)
            )
            await response.content.readany()
            response.close()
            await wait_until(
                lambda: (
                    router.metric(
                        "caravan_router_requests_total", model=MODEL, outcome="client_closed"
                    )
                    == 1.0
                ),
                timeout_s=5,
                what="499 counted",
            )
            state = router.runtime.state

            def released() -> bool:
                return all(live.in_flight == 0 for live in state.live.values())

            await wait_until(released, timeout_s=5, what="lease back")
            in_flight = [live.in_flight for live in state.live.values()]
            closed = router.metric(
                "caravan_router_requests_total", model=MODEL, outcome="client_closed"
            )

    assert ([0], 1.0) == (in_flight, closed)


async def test_an_engine_abort_mid_stream_is_continued_elsewhere(
    consul: ConsulClient, http: aiohttp.ClientSession
) -> None:
    """vLLM ends its streams with `finish_reason: "abort"` when it stops: the router
    hides that ending and continues the answer on another replica, in the same stream."""
    async with FakeEngine(MODEL, mode="abort", events=3) as stopping:
        async with FakeEngine(MODEL, events=2) as good:
            await register_replica(consul, MODEL, 0, stopping.port, check="none")
            await register_replica(consul, MODEL, 1, good.port, check="none")
            async with running_router(consul, policy="round_robin") as router:
                await wait_until(
                    lambda: routable_count(router, MODEL) == 2, timeout_s=5, what="eps"
                )
                statuses, texts = [], []
                # Round robin: one of two requests starts on the stopping engine.
                for index in range(2):
                    body = chat_body(MODEL, f"q{index}", stream=True)
                    async with http.post(
                        router.url + "/v1/chat/completions", json=body
                    ) as response:
                        text, events, done = await read_stream(response)
                    statuses.append(response.status)
                    finishes = [
                        choice.get("finish_reason")
                        for event in events
                        for choice in event.get("choices", [])
                    ]
                    texts.append((text, done, "abort" in finishes, "error" in events[-1]))

    assert [200, 200] == statuses
    assert 1 == stopping.requests
    assert 2 == good.requests  # the other request, and the continuation
    assert (" w0 w1 w2 w0 w1", True, False, False) in texts


@pytest.mark.parametrize(("flavor", "reused"), [("vllm", True), ("llamacpp", False)])
async def test_a_stream_connection_is_pooled_only_for_an_engine_that_keeps_it(
    consul: ConsulClient, http: aiohttp.ClientSession, flavor: str, *, reused: bool
) -> None:
    """llama-server drops the connection after every stream (its keep-alive header notwithstanding).

    The router closes its end after a llama.cpp stream (its engine's stream
    traits: `keeps_stream_connections` false), so no later request goes out on
    a connection the engine is closing; a vLLM one goes back to the pool.
    """
    async with FakeEngine(MODEL, events=2) as engine:
        await register_replica(consul, MODEL, 0, engine.port, flavor=flavor, check="none")
        async with running_router(consul, policy="round_robin") as router:
            await wait_until(
                lambda: routable_count(router, MODEL) == 1, timeout_s=5, what="replica"
            )
            for index in range(4):
                body = chat_body(MODEL, f"q{index}", stream=True)
                async with http.post(router.url + "/v1/chat/completions", json=body) as response:
                    _, _, done = await read_stream(response)
                    assert (200, True) == (response.status, done)

    assert 4 == len(engine.peer_ports)
    distinct = len(set(engine.peer_ports))
    assert (distinct < 4) if reused else (distinct == 4)
