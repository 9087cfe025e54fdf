"""The real llama-server, started from caravan's rendered job, behaves as the adapters assume."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest
from engine_test_support import (
    LLAMA_SERVER_MISSING,
    exposition_types,
    free_port,
    llama_server_process,
    parse_sse,
    rendered_llama_server_command,
    wait_healthy,
)

from caravan_llm.common.engine_metrics import parse_engine_load
from caravan_llm.devcluster.llama_server_build import LlamaServerBuild, find_llama_server
from caravan_llm.scheduler.engines.llamacpp import LLAMACPP_METRIC_NAMES

pytestmark = [pytest.mark.llamacpp]

BUILD = find_llama_server()
needs_build = pytest.mark.skipif(BUILD is None, reason=LLAMA_SERVER_MISSING)

# The metric names and types llama-server exposes (docs/llama-cpp.md, measured).
LLAMACPP_EXPOSITION = {
    "llamacpp:prompt_tokens_total": "counter",
    "llamacpp:prompt_tokens_cached_total": "counter",
    "llamacpp:prompt_seconds_total": "counter",
    "llamacpp:tokens_predicted_total": "counter",
    "llamacpp:tokens_predicted_seconds_total": "counter",
    "llamacpp:n_decode_total": "counter",
    "llamacpp:n_tokens_max": "counter",
    "llamacpp:spec_decode_num_draft_tokens_total": "counter",
    "llamacpp:spec_decode_num_accepted_tokens_total": "counter",
    "llamacpp:spec_decode_num_drafts_total": "counter",
    "llamacpp:prompt_tokens_seconds": "gauge",
    "llamacpp:predicted_tokens_seconds": "gauge",
    "llamacpp:requests_processing": "gauge",
    "llamacpp:requests_deferred": "gauge",
    "llamacpp:n_busy_slots_per_decode": "gauge",
}
CHAT = {"messages": [{"role": "user", "content": "hi there"}], "max_tokens": 4}


def build() -> LlamaServerBuild:
    assert BUILD is not None
    return BUILD


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    # llama-server closes the connection after a streamed reply; never reuse one.
    connector = aiohttp.TCPConnector(force_close=True)
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as client:
        yield client


@pytest.fixture
async def server(session: aiohttp.ClientSession) -> AsyncIterator[str]:
    """A ready real llama-server (2 slots) from the rendered job; its base URL."""
    port = free_port()
    command = rendered_llama_server_command(build().binary, build().model, port=port)
    async with llama_server_process(command):
        base_url = f"http://127.0.0.1:{port}"
        await wait_healthy(session, base_url)
        yield base_url


@needs_build
async def test_health_is_503_loading_model_while_loading_then_200(
    session: aiohttp.ClientSession,
) -> None:
    """Polled from process start, /health is refused, then 503 Loading model, then 200 ok."""
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    command = rendered_llama_server_command(build().binary, build().model, port=port)
    seen: list[tuple[int, str]] = []
    async with llama_server_process(command):
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                async with session.get(base_url + "/health") as response:
                    answer = (response.status, await response.text())
            except aiohttp.ClientConnectorError:
                await asyncio.sleep(0.002)
                continue
            if not seen or seen[-1] != answer:
                seen.append(answer)
            if answer[0] == 200:
                break
            await asyncio.sleep(0.002)

    assert [
        (503, '{"error":{"message":"Loading model","type":"unavailable_error","code":503}}'),
        (200, '{"status":"ok"}'),
    ] == seen


@needs_build
async def test_chat_completion_reports_the_alias_usage_and_timings(
    server: str, session: aiohttp.ClientSession
) -> None:
    """A non-streamed chat reply: the tiny model's " hello" text, the alias, usage, timings."""
    async with session.post(
        server + "/v1/chat/completions", json={**CHAT, "model": "anything", "ignore_eos": True}
    ) as response:
        status, body = response.status, await response.json()

    assert 200 == status
    assert ("tiny-chat", "chat.completion") == (body["model"], body["object"])
    assert (" hello hello hello hello", "length") == (
        body["choices"][0]["message"]["content"],
        body["choices"][0]["finish_reason"],
    )
    assert 4 == body["usage"]["completion_tokens"]
    assert 4 == body["timings"]["predicted_n"]


@needs_build
async def test_chat_stream_sends_role_tokens_finish_usage_and_done(
    server: str, session: aiohttp.ClientSession
) -> None:
    """A streamed chat reply: role chunk, one chunk per token, finish chunk, usage, [DONE]."""
    request = {
        **CHAT,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    async with session.post(server + "/v1/chat/completions", json=request) as response:
        status, events = response.status, parse_sse(await response.text())

    assert 200 == status
    assert {"role": "assistant", "content": None} == events[0]["choices"][0]["delta"]
    assert [{"content": " hello"}] * 4 == [e["choices"][0]["delta"] for e in events[1:5]]
    assert "length" == events[5]["choices"][0]["finish_reason"]
    assert ([], 4) == (events[6]["choices"], events[6]["usage"]["completion_tokens"])
    assert "[DONE]" == events[-1]


@needs_build
async def test_metrics_expose_exactly_the_known_names_and_caravans_mapping_reads_them(
    server: str, session: aiohttp.ClientSession
) -> None:
    """/metrics has llama-server's known names and types; an upstream rename fails here."""
    async with session.get(server + "/metrics") as response:
        text = await response.text()

    assert LLAMACPP_EXPOSITION == exposition_types(text)
    load = parse_engine_load(text, LLAMACPP_METRIC_NAMES)
    assert (0.0, 0.0, None) == (load.running, load.waiting, load.kv_cache_usage)


@needs_build
async def test_a_burst_of_six_against_two_slots_shows_two_processing_and_some_deferred(
    server: str, session: aiohttp.ClientSession
) -> None:
    """-np 2 under 6 long requests: processing 2, deferred > 0, and no free slot."""
    request = {**CHAT, "max_tokens": 600, "ignore_eos": True}
    burst = [
        asyncio.create_task(session.post(server + "/v1/chat/completions", json=request))
        for _ in range(6)
    ]
    loads = []
    no_slot_status = None
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            async with session.get(server + "/metrics") as response:
                load = parse_engine_load(await response.text(), LLAMACPP_METRIC_NAMES)
            loads.append((load.running, load.waiting))
            if load.running == 2 and (load.waiting or 0) > 0:
                async with session.get(server + "/slots?fail_on_no_slot=1") as response:
                    no_slot_status = response.status
                break
            await asyncio.sleep(0.01)
    finally:
        responses = await asyncio.gather(*burst, return_exceptions=True)
        for response in responses:
            if isinstance(response, aiohttp.ClientResponse):
                response.release()

    assert max(running or 0 for running, _ in loads) == 2
    assert any(running == 2 and (waiting or 0) > 0 for running, waiting in loads), loads
    assert 503 == no_slot_status


@needs_build
async def test_slots_and_props_report_the_rendered_parallelism(
    server: str, session: aiohttp.ClientSession
) -> None:
    """/slots lists 2 idle slots of 2048 tokens (4096 / 2) and /props says total_slots 2."""
    async with session.get(server + "/slots") as response:
        slots = await response.json()
    async with session.get(server + "/props") as response:
        props = await response.json()

    assert [(0, 2048, False), (1, 2048, False)] == [
        (s["id"], s["n_ctx"], s["is_processing"]) for s in slots
    ]
    assert (2, "tiny-chat") == (props["total_slots"], props["model_alias"])


@needs_build
async def test_the_tiny_model_says_hello_and_stops_by_itself(
    server: str, session: aiohttp.ClientSession
) -> None:
    """Without ignore_eos the tiny model answers only "hello" and ends with EOS ("stop")."""
    request = {**CHAT, "max_tokens": 300, "seed": 42}
    async with session.post(server + "/v1/chat/completions", json=request) as response:
        body = await response.json()

    choice = body["choices"][0]
    assert "stop" == choice["finish_reason"]
    assert {"hello"} == set(choice["message"]["content"].split())
    assert 0 < body["usage"]["completion_tokens"] < 300


@needs_build
async def test_api_key_from_env_guards_all_but_health(session: aiohttp.ClientSession) -> None:
    """With LLAMA_API_KEY (how caravan's template passes the key) a request without the
    key is 401, /health stays public, and Bearer or X-Api-Key with the key pass."""
    port = free_port()
    command = rendered_llama_server_command(build().binary, build().model, port=port)
    assert not any("api-key" in arg for arg in command)
    async with llama_server_process(command, env={"LLAMA_API_KEY": "engine-k"}):
        base_url = f"http://127.0.0.1:{port}"
        await wait_healthy(session, base_url)
        async with session.post(f"{base_url}/v1/chat/completions", json=CHAT) as response:
            body = await response.json()
        assert 401 == response.status
        assert {"message": "Invalid API Key", "type": "authentication_error", "code": 401} == (
            body["error"]
        )
        for path in ("/metrics", "/v1/models", "/models", "/slots", "/props"):
            async with session.get(f"{base_url}{path}") as response:
                assert 401 == response.status, path
        for path in ("/health", "/v1/health"):
            async with session.get(f"{base_url}{path}") as response:
                assert 200 == response.status, path
        for headers in ({"Authorization": "Bearer engine-k"}, {"X-Api-Key": "engine-k"}):
            async with session.post(
                f"{base_url}/v1/chat/completions", json=CHAT, headers=headers
            ) as response:
                assert 200 == response.status
            async with session.get(f"{base_url}/metrics", headers=headers) as response:
                assert 200 == response.status
        wrong = {"Authorization": "Bearer nope"}
        async with session.get(f"{base_url}/metrics", headers=wrong) as response:
            assert 401 == response.status
