"""The router passes OpenAI requests through: bodies, streams, headers, errors, operations."""

from __future__ import annotations

import json
import time

import aiohttp
import openai
from openai.types.chat import ChatCompletionMessageParam
from router_cluster import (
    Engine,
    FakeEngine,
    chat_body,
    declare_model,
    register_replica,
    routable_count,
    running_router,
    wait_until,
)

from caravan_llm.common.consul_api import ConsulClient

MODEL = "tiny"


async def register_all(consul: ConsulClient, engines: list[Engine]) -> None:
    for replica, engine in enumerate(engines):
        await register_replica(consul, MODEL, replica, engine.port)


async def test_non_streaming_answer_is_the_engines_answer(
    consul: ConsulClient, tiny_engines: list[Engine], http: aiohttp.ClientSession
) -> None:
    """A non-streaming chat completion comes back with the engine's content and usage."""
    await register_all(consul, tiny_engines)
    body = chat_body(MODEL, "what is a caravan", seed=7)
    async with http.post(tiny_engines[0].url + "/v1/chat/completions", json=body) as direct:
        expected = await direct.json()
    async with running_router(consul) as router:
        await wait_until(lambda: routable_count(router, MODEL) == 3, timeout_s=5, what="3 replicas")
        async with http.post(
            router.url + "/v1/chat/completions", json=body, headers={"X-Request-Id": "req-1"}
        ) as response:
            answer = await response.json()
            request_id = response.headers.get("X-Request-Id")

    assert (200, "req-1") == (response.status, request_id)
    assert expected["choices"][0]["message"] == answer["choices"][0]["message"]
    assert expected["usage"]["completion_tokens"] == answer["usage"]["completion_tokens"]


async def test_stream_reaches_the_client_chunk_by_chunk(
    consul: ConsulClient, tiny_engines: list[Engine], http: aiohttp.ClientSession
) -> None:
    """The first content chunk reaches the client long before the engine finishes the stream."""
    await register_all(consul, tiny_engines)
    async with running_router(consul) as router:
        await wait_until(lambda: routable_count(router, MODEL) == 3, timeout_s=5, what="3 replicas")
        body = chat_body(MODEL, "tell me a story", stream=True, max_tokens=16, seed=3)
        arrivals: list[float] = []
        async with http.post(router.url + "/v1/chat/completions", json=body) as response:
            content_type = response.headers.get("Content-Type", "")
            arrivals.extend(
                [
                    time.monotonic()
                    async for data in response.content.iter_any()
                    if b'"content":"' in data
                ]
            )
            finished = time.monotonic()

    assert content_type.startswith("text/event-stream")
    # 16 tokens at 20 ms each: a buffering proxy would deliver everything at once.
    assert finished - arrivals[0] > 0.15
    assert len(arrivals) > 5


async def test_headers_that_matter_pass_and_hop_by_hop_ones_do_not(
    consul: ConsulClient, http: aiohttp.ClientSession
) -> None:
    """The engine gets x-request-id and openai-* headers, never hop-by-hop or router headers."""
    async with FakeEngine(MODEL) as fake:
        await register_replica(consul, MODEL, 0, fake.port, check="none")
        async with running_router(consul) as router:
            await wait_until(lambda: routable_count(router, MODEL) == 1, timeout_s=5, what="fake")
            async with http.post(
                router.url + "/v1/chat/completions",
                data=json.dumps(chat_body(MODEL)),
                headers={
                    "Content-Type": "application/json",
                    "Authorization": "Bearer client-key",
                    "OpenAI-Organization": "org-1",
                    "X-Request-Id": "abc",
                    "Connection": "keep-alive, X-Secret-Hop",
                    "X-Secret-Hop": "1",
                    "Keep-Alive": "timeout=5",
                    "X-Caravan-Priority": "3",
                    "TE": "trailers",
                },
            ) as response:
                await response.read()
                returned = {name.lower() for name in response.headers}
        seen = {name.lower(): value for name, value in fake.headers[0].items()}

    assert 200 == response.status
    assert ("abc", "org-1") == (seen.get("x-request-id"), seen.get("openai-organization"))
    leaked = {"authorization", "x-secret-hop", "keep-alive", "x-caravan-priority", "te"} & set(seen)
    assert set() == leaked
    assert "openai-processing-ms" in returned


async def test_client_errors_are_openai_shaped(
    consul: ConsulClient, tiny_engines: list[Engine], http: aiohttp.ClientSession
) -> None:
    """Malformed JSON, a missing model, an unknown model and an oversized body get OpenAI errors."""
    await register_all(consul, tiny_engines)
    async with running_router(consul, max_body_bytes=2048) as router:
        url = router.url + "/v1/chat/completions"
        results = []
        for data in (
            b"{not json",
            json.dumps({"messages": []}).encode(),
            json.dumps(chat_body("no-such-model")).encode(),
            json.dumps(chat_body(MODEL, "x" * 4096)).encode(),
        ):
            async with http.post(url, data=data, headers={"Content-Type": "application/json"}) as r:
                error = (await r.json())["error"]
                results.append((r.status, error["type"], error["code"]))

    assert [
        (400, "invalid_request_error", "invalid_request"),
        (400, "invalid_request_error", "invalid_request"),
        (404, "invalid_request_error", "model_not_found"),
        (413, "invalid_request_error", "request_too_large"),
    ] == results


async def test_api_keys_are_checked(
    consul: ConsulClient, tiny_engines: list[Engine], http: aiohttp.ClientSession
) -> None:
    """With API keys configured, a request needs one of them as a Bearer token."""
    await register_all(consul, tiny_engines)
    async with running_router(consul, api_keys="k-one,k-two") as router:
        await wait_until(lambda: routable_count(router, MODEL) == 3, timeout_s=5, what="replicas")
        statuses = []
        for header in (None, "Bearer wrong", "Bearer k-two", "Basic k-two"):
            headers = {"Authorization": header} if header else {}
            async with http.post(
                router.url + "/v1/chat/completions", json=chat_body(MODEL), headers=headers
            ) as response:
                await response.read()
                statuses.append(response.status)
        async with http.get(router.url + "/health") as health:
            health_status = health.status

    assert [401, 401, 200, 401] == statuses
    assert 200 == health_status


async def test_models_lists_served_and_declared_models(
    consul: ConsulClient, tiny_engines: list[Engine], http: aiohttp.ClientSession
) -> None:
    """`/v1/models` lists models with a routable replica and profiles scaled to zero."""
    await register_all(consul, tiny_engines)
    await declare_model(consul, "sleeper", served_model_name="sleeper-7b")
    async with running_router(consul) as router:
        await wait_until(lambda: routable_count(router, MODEL) == 3, timeout_s=5, what="replicas")
        async with http.get(router.url + "/v1/models") as response:
            listing = await response.json()

    assert "list" == listing["object"]
    assert ["sleeper-7b", MODEL] == [card["id"] for card in listing["data"]]
    assert {"model"} == {card["object"] for card in listing["data"]}


async def test_official_openai_client_works_through_the_router(
    consul: ConsulClient, tiny_engines: list[Engine]
) -> None:
    """The `openai` package talks to the router, streaming and not, and gets the same text."""
    await register_all(consul, tiny_engines)
    async with running_router(consul) as router:
        await wait_until(lambda: routable_count(router, MODEL) == 3, timeout_s=5, what="replicas")
        client = openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)
        async with client:
            messages: list[ChatCompletionMessageParam] = [
                {"role": "user", "content": "name three caravans"}
            ]
            whole = await client.chat.completions.create(
                model=MODEL, messages=messages, seed=11, max_tokens=12
            )
            stream = await client.chat.completions.create(
                model=MODEL, messages=messages, seed=11, max_tokens=12, stream=True
            )
            streamed = ""
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    streamed += chunk.choices[0].delta.content
            models = await client.models.list()

    assert whole.choices[0].message.content == streamed
    assert 12 >= len(streamed.split())
    assert [MODEL] == [model.id for model in models.data]


async def test_health_and_metrics(
    consul: ConsulClient, tiny_engines: list[Engine], http: aiohttp.ClientSession
) -> None:
    """`/health` reports a fresh view; `/metrics` has requests, queue depth and endpoint gauges."""
    await register_all(consul, tiny_engines)
    async with running_router(consul) as router:
        await wait_until(lambda: routable_count(router, MODEL) == 3, timeout_s=5, what="replicas")
        async with http.post(router.url + "/v1/chat/completions", json=chat_body(MODEL)) as r:
            await r.read()
        async with http.get(router.url + "/health") as response:
            health = await response.json()
        async with http.get(router.url + "/metrics") as response:
            exposition = await response.text()

    assert ("ok", "fresh") == (health["status"], health["discovery"])
    assert 'caravan_router_requests_total{model="tiny",outcome="ok"} 1.0' in exposition
    assert 'caravan_router_queue_depth{model="tiny"} 0.0' in exposition
    assert 'caravan_router_queue_wait_seconds_count{model="tiny"} 1.0' in exposition
    assert 'caravan_router_endpoints{model="tiny",state="passing"} 3.0' in exposition
    assert "caravan_router_discovery_staleness_seconds 0.0" in exposition


async def test_embeddings_are_routed_by_model(
    consul: ConsulClient, http: aiohttp.ClientSession
) -> None:
    """`/v1/embeddings` goes to a replica of the body's model and comes back unchanged."""
    async with FakeEngine("embedder") as engine:
        await register_replica(consul, "embedder", 0, engine.port, check="none")
        async with running_router(consul) as router:
            await wait_until(
                lambda: routable_count(router, "embedder") == 1, timeout_s=5, what="embedder"
            )
            body = {"model": "embedder", "input": "hello"}
            async with http.post(router.url + "/v1/embeddings", json=body) as response:
                answer = await response.json()

    assert 200 == response.status
    assert [0.25, -0.5] == answer["data"][0]["embedding"]
    assert [body] == engine.bodies
