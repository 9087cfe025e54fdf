"""The whole OpenAI surface the engines serve goes through the router, in OpenAI's shape."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager

import aiohttp
import openai
import pytest
from aiohttp import web
from router_cluster import (
    LAYOUT,
    Engine,
    declare_model,
    register_replica,
    routable_count,
    running_router,
    start_engine,
    wait_until,
)

from caravan_llm.common.consul_api import ConsulClient

MODEL = "tiny"


async def _register_all(consul: ConsulClient, engines: list[Engine], flavor: str = "vllm") -> None:
    for replica, engine in enumerate(engines):
        await register_replica(consul, MODEL, replica, engine.port, flavor=flavor)


def _client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def llamacpp_engine() -> Iterator[Engine]:
    """One simulated llama-server started with `--embeddings` and `--reranking`."""
    engine = start_engine(MODEL, flavor="llamacpp", extra_args=("--embeddings", "--reranking"))
    try:
        yield engine
    finally:
        engine.stop()


async def test_responses_create_answers_through_the_router(
    consul: ConsulClient, tiny_engines: list[Engine]
) -> None:
    """client.responses.create gets the engine's response object through the router."""
    await _register_all(consul, tiny_engines)
    async with running_router(consul) as router, _client(router.url) as client:
        await wait_until(lambda: routable_count(router, MODEL) == 3, timeout_s=5, what="3 replicas")
        response = await client.responses.create(
            model=MODEL, input="what is a caravan", max_output_tokens=4
        )

    assert ("response", "completed") == (response.object, response.status)
    assert response.output_text
    assert response.usage is not None
    assert response.usage.output_tokens == len(response.output_text.split())


async def test_streamed_response_is_relayed_to_its_last_event(
    consul: ConsulClient, tiny_engines: list[Engine]
) -> None:
    """A streamed response reaches the client event by event, ending with response.completed."""
    await _register_all(consul, tiny_engines)
    async with running_router(consul) as router, _client(router.url) as client:
        await wait_until(lambda: routable_count(router, MODEL) == 3, timeout_s=5, what="3 replicas")
        stream = await client.responses.create(
            model=MODEL, input="tell me a story", max_output_tokens=6, stream=True
        )
        events = [event async for event in stream]

    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    last = events[-1]
    assert "response.completed" == last.type
    assert last.response.output_text == deltas


async def test_anthropic_messages_answer_and_stream(
    consul: ConsulClient, tiny_engines: list[Engine], http: aiohttp.ClientSession
) -> None:
    """POST /v1/messages answers an Anthropic message, and streams until message_stop."""
    await _register_all(consul, tiny_engines)
    body = {"model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
    async with running_router(consul) as router:
        await wait_until(lambda: routable_count(router, MODEL) == 3, timeout_s=5, what="3 replicas")
        async with http.post(router.url + "/v1/messages", json=body) as response:
            message = await response.json()
        async with http.post(router.url + "/v1/messages", json={**body, "stream": True}) as stream:
            raw = await stream.read()

    event_types = [
        line.removeprefix(b"event: ").decode()
        for line in raw.split(b"\n")
        if line.startswith(b"event: ")
    ]
    assert (200, "message", "max_tokens") == (
        response.status,
        message["type"],
        message["stop_reason"],
    )
    assert ("message_start", "message_stop") == (event_types[0], event_types[-1])


async def test_messages_without_messages_is_refused_naming_the_field(
    consul: ConsulClient, tiny_engines: list[Engine], http: aiohttp.ClientSession
) -> None:
    """A /v1/messages body without `messages` is a 400 whose param is `messages`."""
    await _register_all(consul, tiny_engines)
    async with running_router(consul) as router:
        await wait_until(lambda: routable_count(router, MODEL) == 3, timeout_s=5, what="3 replicas")
        async with http.post(
            router.url + "/v1/messages", json={"model": MODEL, "max_tokens": 3}
        ) as response:
            answer = await response.json()

    assert (400, "messages") == (response.status, answer["error"]["param"])


async def test_embeddings_on_a_generate_model_is_an_openai_error(
    consul: ConsulClient, tiny_engines: list[Engine]
) -> None:
    """vLLM's own 404 for embeddings on a generate model reaches the client in OpenAI's shape."""
    await _register_all(consul, tiny_engines)
    async with running_router(consul) as router, _client(router.url) as client:
        await wait_until(lambda: routable_count(router, MODEL) == 3, timeout_s=5, what="3 replicas")
        with pytest.raises(openai.NotFoundError) as caught:
            await client.embeddings.create(model=MODEL, input="hello")

    error = caught.value.body
    assert isinstance(error, dict)
    assert "route_not_supported" == error["code"]
    assert "/v1/embeddings" in error["message"]
    assert MODEL in error["message"]


async def test_embeddings_and_rerank_on_llamacpp(
    consul: ConsulClient, llamacpp_engine: Engine, http: aiohttp.ClientSession
) -> None:
    """Embeddings (openai client) and rerank reach a llama-server started with both flags."""
    await _register_all(consul, [llamacpp_engine], flavor="llamacpp")
    rerank = {"model": MODEL, "query": "caravan", "documents": ["a camel", "a truck"]}
    async with running_router(consul) as router, _client(router.url) as client:
        await wait_until(lambda: routable_count(router, MODEL) == 1, timeout_s=5, what="replica")
        vectors = await client.embeddings.create(model=MODEL, input=["one", "two"])
        async with http.post(router.url + "/rerank", json=rerank) as response:
            ranked = await response.json()

    assert [0, 1] == [item.index for item in vectors.data]
    assert [0, 1] == sorted(result["index"] for result in ranked["results"])


async def test_a_route_no_replica_serves_is_refused_before_any_engine(
    consul: ConsulClient, llamacpp_engine: Engine, http: aiohttp.ClientSession
) -> None:
    """/v1/score on a llama.cpp model (whose Meta lists no score route) is a 404 naming both."""
    await _register_all(consul, [llamacpp_engine], flavor="llamacpp")
    body = {"model": MODEL, "text_1": "a", "text_2": "b"}
    async with running_router(consul) as router:
        await wait_until(lambda: routable_count(router, MODEL) == 1, timeout_s=5, what="replica")
        async with http.post(router.url + "/v1/score", json=body) as response:
            answer = await response.json()

    assert (404, "route_not_supported") == (response.status, answer["error"]["code"])
    assert f"No replica of model '{MODEL}' serves /v1/score" in answer["error"]["message"]


async def test_tokenize_and_detokenize_round_trip(
    consul: ConsulClient, tiny_engines: list[Engine], http: aiohttp.ClientSession
) -> None:
    """/tokenize and /detokenize go to a replica of the model and give the text back."""
    # One replica: a simulated engine can only map back the ids it handed out
    # itself (real replicas share their tokenizer).
    await _register_all(consul, tiny_engines[:1])
    text = "a caravan crosses the desert"
    async with running_router(consul) as router:
        await wait_until(lambda: routable_count(router, MODEL) == 1, timeout_s=5, what="replica")
        async with http.post(
            router.url + "/tokenize", json={"model": MODEL, "prompt": text}
        ) as response:
            tokens = await response.json()
        async with http.post(
            router.url + "/detokenize", json={"model": MODEL, "tokens": tokens["tokens"]}
        ) as response:
            back = await response.json()

    assert text == back["prompt"]


async def test_tokenize_needs_the_api_key(
    consul: ConsulClient, tiny_engines: list[Engine], http: aiohttp.ClientSession
) -> None:
    """A keyed router refuses /tokenize without a key (it carries a prompt, as chat does)."""
    await _register_all(consul, tiny_engines)
    async with running_router(consul, api_keys=("sk-test-key-1",)) as router:
        async with http.post(
            router.url + "/tokenize", json={"model": MODEL, "prompt": "x"}
        ) as response:
            answer = await response.json()

    assert (401, "invalid_api_key") == (response.status, answer["error"]["code"])


async def test_models_retrieve_knows_served_models_only(
    consul: ConsulClient, tiny_engines: list[Engine]
) -> None:
    """client.models.retrieve finds a served model and says model_not_found for another."""
    await _register_all(consul, tiny_engines)
    async with running_router(consul) as router, _client(router.url) as client:
        await wait_until(lambda: routable_count(router, MODEL) == 3, timeout_s=5, what="3 replicas")
        found = await client.models.retrieve(MODEL)
        with pytest.raises(openai.NotFoundError) as caught:
            await client.models.retrieve("org/nope")

    error = caught.value.body
    assert isinstance(error, dict)
    assert (MODEL, "model_not_found") == (found.id, error["code"])


@asynccontextmanager
async def _capturing_engine(bodies: list[bytes], *, cut: bool = False) -> AsyncIterator[int]:
    """An engine that records /v1/responses bodies; `cut`: it drops its stream after one event."""

    async def responses(request: web.Request) -> web.StreamResponse:
        bodies.append(await request.read())
        if not cut:
            return web.json_response({"id": "resp_1", "object": "response", "status": "completed"})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'event: response.created\ndata: {"type":"response.created"}\n\n')
        transport = request.transport
        if transport is not None:
            transport.abort()
        return response

    app = web.Application()
    app.router.add_post("/v1/responses", responses)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield int(runner.addresses[0][1])
    finally:
        await runner.cleanup()


async def test_tools_and_unknown_fields_reach_the_engine_byte_for_byte(
    consul: ConsulClient, http: aiohttp.ClientSession
) -> None:
    """The body of a responses request with tools is what the engine receives, unchanged."""
    bodies: list[bytes] = []
    tools = [{"type": "function", "name": "f", "parameters": {"type": "object"}}]
    sent = json.dumps(
        {"model": MODEL, "input": "hi", "tools": tools, "x_vendor": {"k": [1, 2]}}
    ).encode()
    async with _capturing_engine(bodies) as port:
        await register_replica(consul, MODEL, 0, port, check="none")
        async with running_router(consul) as router:
            await wait_until(lambda: routable_count(router, MODEL) == 1, timeout_s=5, what="one")
            async with http.post(
                router.url + "/v1/responses",
                data=sent,
                headers={"Content-Type": "application/json"},
            ) as response:
                await response.read()

    assert (200, [sent]) == (response.status, bodies)


async def test_a_relayed_stream_cut_by_its_engine_ends_with_an_error_event(
    consul: ConsulClient, http: aiohttp.ClientSession
) -> None:
    """A responses stream whose engine dies ends with an `error` event, not a hang or [DONE]."""
    bodies: list[bytes] = []
    body = {"model": MODEL, "input": "hi", "stream": True}
    async with _capturing_engine(bodies, cut=True) as port:
        await register_replica(consul, MODEL, 0, port, check="none")
        async with running_router(consul) as router:
            await wait_until(lambda: routable_count(router, MODEL) == 1, timeout_s=5, what="one")
            async with http.post(router.url + "/v1/responses", json=body) as response:
                raw = await response.read()

    events = [event for event in raw.split(b"\n\n") if event]
    assert b"event: response.created" in events[0]
    assert events[-1].startswith(b"event: error\n")
    assert b"[DONE]" not in raw


@pytest.mark.parametrize("flavor", ["vllm", "llamacpp"])
async def test_messages_count_tokens_answers_the_prompt_tokens(
    flavor: str,
    consul: ConsulClient,
    tiny_engines: list[Engine],
    llamacpp_engine: Engine,
    http: aiohttp.ClientSession,
) -> None:
    """/v1/messages/count_tokens reaches vLLM and llama-server; a longer prompt counts more."""
    engines = tiny_engines if flavor == "vllm" else [llamacpp_engine]
    await _register_all(consul, engines, flavor=flavor)
    counts = []
    async with running_router(consul) as router:
        await wait_until(
            lambda: routable_count(router, MODEL) == len(engines), timeout_s=5, what="replicas"
        )
        for text in ["hi", "hi there, how is the caravan today"]:
            body = {"model": MODEL, "messages": [{"role": "user", "content": text}]}
            async with http.post(router.url + "/v1/messages/count_tokens", json=body) as response:
                assert 200 == response.status
                counts.append((await response.json())["input_tokens"])

    assert 0 < counts[0] < counts[1]


@pytest.mark.parametrize("path", ["/pooling", "/classify"])
async def test_pooling_routes_on_a_generate_model_are_route_not_supported(
    path: str, consul: ConsulClient, tiny_engines: list[Engine], http: aiohttp.ClientSession
) -> None:
    """vLLM mounts /pooling and /classify only for pooling models: OpenAI's 404, naming both."""
    await _register_all(consul, tiny_engines)
    body = {"model": MODEL, "input": "hello"}
    async with running_router(consul) as router:
        await wait_until(lambda: routable_count(router, MODEL) == 3, timeout_s=5, what="3 replicas")
        async with http.post(router.url + path, json=body) as response:
            answer = await response.json()

    assert (404, "route_not_supported") == (response.status, answer["error"]["code"])
    assert f"No replica of model '{MODEL}' serves {path}" in answer["error"]["message"]


async def test_a_held_request_learns_at_once_that_the_starting_replica_lacks_its_route(
    consul: ConsulClient, llamacpp_engine: Engine, http: aiohttp.ClientSession
) -> None:
    """A cold-start hold for /v1/score ends in route_not_supported as soon as a llama.cpp
    replica registers, long before the cold-start deadline."""
    model = "cold-score"
    await declare_model(consul, model)
    body = {"model": model, "text_1": "a", "text_2": "b"}
    async with running_router(consul, cold_start_timeout_s=120.0) as router:
        loop = asyncio.get_running_loop()
        started = loop.time()
        request = asyncio.create_task(http.post(router.url + "/v1/score", json=body))

        async def held() -> bool:
            _, entry = await consul.kv_get(LAYOUT.demand_key(model))
            return entry is not None and json.loads(entry.value)["waiting"] == 1

        await wait_until(held, timeout_s=5, what="the cold-start hold")
        assert not request.done()
        await register_replica(consul, model, 0, llamacpp_engine.port, flavor="llamacpp")
        async with await asyncio.wait_for(request, 30) as response:
            answer = await response.json()
        elapsed = loop.time() - started

    assert (404, "route_not_supported") == (response.status, answer["error"]["code"])
    assert f"No replica of model '{model}' serves /v1/score" in answer["error"]["message"]
    assert elapsed < 60.0


async def test_malformed_bodies_are_the_clients_400_and_no_replica_leaves_rotation(
    consul: ConsulClient, llamacpp_engine: Engine, http: aiohttp.ClientSession
) -> None:
    """200 bodies whose `tools` llama-server would answer with a 500 are 400s naming the
    field; the replica stays routable and then serves a good request."""
    await _register_all(consul, [llamacpp_engine], flavor="llamacpp")
    bad = [True, 0, {"a": [None]}, "x"]
    async with running_router(consul) as router:
        await wait_until(lambda: routable_count(router, MODEL) == 1, timeout_s=5, what="replica")

        async def send(tools: object) -> tuple[int, str]:
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
            async with http.post(
                router.url + "/v1/chat/completions", json={**body, "tools": tools}
            ) as response:
                return response.status, (await response.json())["error"]["param"]

        answers = await asyncio.gather(*(send(bad[i % len(bad)]) for i in range(200)))
        routable_after = routable_count(router, MODEL)
        async with http.post(
            router.url + "/v1/chat/completions",
            json={"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
        ) as good:
            good_status = good.status

    assert {(400, "tools")} == set(answers)
    assert (1, 200) == (routable_after, good_status)
