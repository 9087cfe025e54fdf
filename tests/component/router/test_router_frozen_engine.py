"""Issue 26, deliver 6: a frozen engine (SIGSTOP: accepts connections, never answers).

Two simulated vLLM replicas with Consul HTTP checks (1 s interval, 1 s
timeout, as devcluster's Consul applies a check's `Timeout` like Consul's own
HTTP check: a check that does not answer in time is critical). Four streams
run, two on each; one engine is frozen. Its streams go silent and continue on
the other replica; new requests are answered within the first-byte timeout;
Consul marks the frozen replica critical and the router stops sending to it.
Thawed (SIGCONT), it passes again and the router takes it back.
"""

from __future__ import annotations

import asyncio
import signal
import time
from typing import Any

import aiohttp
import pytest
from router_cluster import (
    Engine,
    RouterUnderTest,
    chat_body,
    parse_sse,
    register_replica,
    routable_count,
    running_router,
    start_engine,
    wait_until,
)

from caravan_llm.common.consul_api import ConsulClient
from caravan_llm.common.contract import model_service_name

MODEL = "frozen"
FIRST_BYTE_TIMEOUT_S = 3.0
STREAM_IDLE_TIMEOUT_S = 1.5
STREAMS = 4


async def _stream(
    http: aiohttp.ClientSession, url: str, index: int, started: asyncio.Event
) -> tuple[str, list[dict[str, Any]], bool]:
    """One streamed chat of 100 tokens; `started` is set once its first content arrived."""
    body = chat_body(MODEL, f"stream {index}", stream=True, max_tokens=100, ignore_eos=True)
    raw = b""
    async with http.post(url, json=body) as response:
        async for chunk in response.content.iter_any():
            raw += chunk
            if b'"content"' in raw:
                started.set()
    return parse_sse(raw)


async def _passing(consul: ConsulClient) -> set[int]:
    entries = (await consul.health_service(model_service_name(MODEL), passing=True))[1]
    return {entry.port for entry in entries}


async def _unary(http: aiohttp.ClientSession, url: str, index: int) -> tuple[int, float]:
    started = time.monotonic()
    body = chat_body(MODEL, f"while frozen {index}", max_tokens=4)
    async with http.post(url, json=body) as response:
        await response.read()
        return response.status, time.monotonic() - started


@pytest.mark.slow
async def test_frozen_engine_is_bypassed_and_its_streams_continue(
    consul: ConsulClient, http: aiohttp.ClientSession
) -> None:
    """SIGSTOP one of two engines under 4 streams: nothing fails, both views drop it; SIGCONT."""
    engines: list[Engine] = [
        start_engine(MODEL, sim={"step_seconds": "0.03", "output_tokens": "400"}) for _ in range(2)
    ]
    frozen, other = engines
    try:
        for index, engine in enumerate(engines):
            await register_replica(consul, MODEL, index, engine.port)
        async with running_router(
            consul,
            policy="round_robin",
            first_byte_timeout_s=FIRST_BYTE_TIMEOUT_S,
            stream_idle_timeout_s=STREAM_IDLE_TIMEOUT_S,
            log_level="warning",
        ) as router:
            url = router.url + "/v1/chat/completions"
            await wait_until(lambda: routable_count(router, MODEL) == 2, timeout_s=10, what="both")
            starts = [asyncio.Event() for _ in range(STREAMS)]
            streams = [
                asyncio.create_task(_stream(http, url, index, starts[index]))
                for index in range(STREAMS)
            ]
            await wait_until(
                lambda: all(event.is_set() for event in starts), timeout_s=10, what="streams"
            )
            frozen.process.send_signal(signal.SIGSTOP)
            try:
                unary = await asyncio.gather(*(_unary(http, url, i) for i in range(4)))
                results = await asyncio.gather(*streams)
                await wait_until(
                    _agree(router, consul, {other.port}, routable=1),
                    timeout_s=10,
                    what="Consul critical and the router not routing to the frozen engine",
                )
            finally:
                frozen.process.send_signal(signal.SIGCONT)
            await wait_until(
                _agree(router, consul, {frozen.port, other.port}, routable=2),
                timeout_s=10,
                what="the thawed engine back in Consul and in the router",
            )
            after = [await _unary(http, url, index) for index in range(4)]
            failovers = router.metric(
                "caravan_router_failovers_total", model=MODEL, outcome="resumed"
            )
    finally:
        for engine in engines:
            engine.stop()

    errors = [event for _, events, _ in results for event in events if "error" in event]
    assert ([], [True] * STREAMS) == (errors, [done for _, _, done in results])
    assert [200] * 4 == [status for status, _ in unary]
    # Each new request was answered within the first-byte timeout (plus a retry's time).
    assert max(seconds for _, seconds in unary) < FIRST_BYTE_TIMEOUT_S + 2.0
    assert [200] * 4 == [status for status, _ in after]
    assert failovers is not None
    assert failovers >= 1


def _agree(router: RouterUnderTest, consul: ConsulClient, ports: set[int], *, routable: int) -> Any:
    async def check() -> bool:
        return ports == await _passing(consul) and routable == routable_count(router, MODEL)

    return check
