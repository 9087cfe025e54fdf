"""Acceptance: mid-stream failover, 200 concurrent streams, prefix affinity against round robin."""

from __future__ import annotations

import asyncio
import math
import random
from typing import Any

import aiohttp
import pytest
from router_cluster import (
    Engine,
    chat_body,
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

RUNNING_METRIC = {"vllm": "vllm:num_requests_running", "llamacpp": "llamacpp:requests_processing"}


@pytest.mark.slow
@pytest.mark.parametrize("flavor", ["vllm", "llamacpp"])
async def test_stream_survives_its_engine_being_killed(
    consul: ConsulClient, http: aiohttp.ClientSession, flavor: str
) -> None:
    """SIGKILL of the engine mid-stream: the client's one stream still has the whole text.

    The continuation comes from the other engine, and the client sees one
    uninterrupted stream: one role chunk, one id, one finish, one `[DONE]`.
    """
    model = f"fo-{flavor}"
    sim = {"step_seconds": "0.02", "output_tokens": "64"}
    engines = await asyncio.gather(
        asyncio.to_thread(start_engine, model, flavor=flavor, sim=sim),
        asyncio.to_thread(start_engine, model, flavor=flavor, sim=sim),
    )
    try:
        for replica, engine in enumerate(engines):
            await register_replica(consul, model, replica, engine.port, flavor=flavor)
        body = chat_body(model, "tell me everything about caravans", seed=5, max_tokens=60)
        async with http.post(engines[0].url + "/v1/chat/completions", json=body) as direct:
            expected = (await direct.json())["choices"][0]["message"]["content"]
        async with running_router(consul) as router:
            await wait_until(lambda: routable_count(router, model) == 2, timeout_s=5, what="eps")
            events: list[dict[str, Any]] = []
            raw = b""
            async with http.post(
                router.url + "/v1/chat/completions", json={**body, "stream": True}
            ) as response:
                killed = False
                async for data in response.content.iter_any():
                    raw += data
                    if not killed and raw.count(b'"content":" ') >= 8:
                        running = [
                            await engine_metric(http, engine, RUNNING_METRIC[flavor])
                            for engine in engines
                        ]
                        engines[running.index(1.0)].kill()
                        killed = True
            resumed = router.metric(
                "caravan_router_failovers_total", model=model, outcome="resumed"
            )
    finally:
        for engine in engines:
            engine.stop()
    text, events, done = parse_sse(raw)

    assert (True, True) == (killed, done)
    assert expected == text
    assert 1 == len({event["id"] for event in events})
    assert 1 == sum(1 for event in events if "role" in event["choices"][0].get("delta", {}))
    assert 1 == sum(1 for event in events if event["choices"][0].get("finish_reason"))
    assert 1.0 == resumed


@pytest.mark.slow
async def test_200_concurrent_streams_all_complete_with_correct_text(
    consul: ConsulClient, tiny_engines: list[Engine]
) -> None:
    """200 streaming chat completions at once over three replicas all finish, text intact."""
    for replica, engine in enumerate(tiny_engines):
        await register_replica(consul, "tiny", replica, engine.port)
    prompts = [f"question number {index} about the caravan" for index in range(10)]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        expected = {}
        for prompt in prompts:
            body = chat_body("tiny", prompt, seed=1)
            async with http.post(tiny_engines[0].url + "/v1/chat/completions", json=body) as r:
                expected[prompt] = (await r.json())["choices"][0]["message"]["content"]
        async with running_router(consul) as router:
            await wait_until(lambda: routable_count(router, "tiny") == 3, timeout_s=5, what="eps")

            async def one(index: int) -> tuple[str, str, bool, int]:
                prompt = prompts[index % len(prompts)]
                body = chat_body("tiny", prompt, seed=1, stream=True)
                async with http.post(router.url + "/v1/chat/completions", json=body) as response:
                    text, _, done = await read_stream(response)
                    return prompt, text, done, response.status

            results = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(200))), 60)

    wrong = [(prompt, text) for prompt, text, done, status in results if text != expected[prompt]]
    assert [] == wrong
    assert {(True, 200)} == {(done, status) for _, _, done, status in results}


def _document(rng: random.Random, words: int) -> str:
    vocabulary = ["alpha", "bravo", "delta", "gamma", "omega", "sigma", "kappa", "theta", "zeta"]
    return " ".join(f"{rng.choice(vocabulary)}{rng.randrange(1000)}" for _ in range(words))


async def _hit_rate_through(
    router_url: str,
    engines: list[Engine],
    http: aiohttp.ClientSession,
    *,
    seed: int,
    groups: int = 10,
    rounds: int = 6,
    concurrency: int = 6,
    sample: Any = None,
) -> float:
    """Prefix-cache hit rate of the engines while conversations share long prefixes."""
    rng = random.Random(seed)
    conversations = [
        (_document(rng, 160), _document(rng, 120)) for _ in range(groups)
    ]  # (system prompt, first user message): the shared prefix of a group
    # Conversations take turns in a fixed cycle, like users who each wait for
    # their answer before asking again.
    order = [(group, turn) for turn in range(rounds) for group in range(groups)]
    before = [
        (
            await engine_metric(http, engine, "vllm:prefix_cache_hits_total"),
            await engine_metric(http, engine, "vllm:prefix_cache_queries_total"),
        )
        for engine in engines
    ]
    limit = asyncio.Semaphore(concurrency)

    async def one(group: int, turn: int) -> None:
        system, first = conversations[group]
        body = {
            "model": "aff",
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": first},
                {"role": "assistant", "content": "noted"},
                {"role": "user", "content": f"follow-up {turn} of {group}"},
            ],
            "max_tokens": 4,
        }
        async with limit, http.post(router_url + "/v1/chat/completions", json=body) as response:
            await response.read()
            assert 200 == response.status

    sampler = asyncio.create_task(sample()) if sample is not None else None
    try:
        await asyncio.gather(*(one(group, turn) for group, turn in order))
    finally:
        if sampler is not None:
            sampler.cancel()
    hits = queries = 0.0
    for engine, (hits_before, queries_before) in zip(engines, before, strict=True):
        hits += await engine_metric(http, engine, "vllm:prefix_cache_hits_total") - hits_before
        queries += (
            await engine_metric(http, engine, "vllm:prefix_cache_queries_total") - queries_before
        )
    return hits / queries


@pytest.mark.slow
async def test_prefix_affinity_triples_the_cache_hit_rate_of_round_robin(
    consul: ConsulClient, http: aiohttp.ClientSession
) -> None:
    """Conversations sharing long prefixes hit the engines' prefix caches 3x more than RR.

    Ten conversations take turns; each replica's KV cache holds about half of
    their prefixes. Round robin moves a conversation to another replica at
    every turn (10 is not a multiple of 3), so its prefix is cold wherever it
    lands; affinity keeps each conversation on its replica. No replica ever
    holds more in-flight requests than the CHWBL bound allows.
    """
    sim = {"step_seconds": "0.01", "output_tokens": "4", "kv_cache_tokens": "2400"}
    engines = list(
        await asyncio.gather(*(asyncio.to_thread(start_engine, "aff", sim=sim) for _ in range(3)))
    )
    try:
        for replica, engine in enumerate(engines):
            await register_replica(consul, "aff", replica, engine.port)
        async with running_router(consul, policy="round_robin") as router:
            await wait_until(lambda: routable_count(router, "aff") == 3, timeout_s=5, what="eps")
            round_robin = await _hit_rate_through(router.url, engines, http, seed=1)
        async with running_router(consul, policy="prefix_affinity") as router:
            await wait_until(lambda: routable_count(router, "aff") == 3, timeout_s=5, what="eps")
            peak = {"in_flight": 0}
            live = router.runtime.state

            async def sample() -> None:
                while True:
                    for state in live.live.values():
                        peak["in_flight"] = max(peak["in_flight"], state.in_flight)
                    await asyncio.sleep(0.002)

            affinity = await _hit_rate_through(router.url, engines, http, seed=2, sample=sample)
    finally:
        for engine in engines:
            engine.stop()

    # With 6 requests in flight at most over 3 replicas: ceil(1.25 * 6 / 3) = 3.
    assert peak["in_flight"] <= math.ceil(1.25 * 6 / 3), peak
    assert affinity >= 0.5, (affinity, round_robin)
    assert affinity >= 3 * round_robin, (affinity, round_robin)


@pytest.mark.slow
async def test_predicted_ttft_keeps_conversations_where_their_prefix_is_cached(
    consul: ConsulClient, http: aiohttp.ClientSession
) -> None:
    """The cost model (the default policy) beats round robin's hit rate 3x, as affinity does.

    Same workload as above: each replica's KV holds about half of the ten
    conversations' prefixes. The prefix index follows where each conversation
    went, so later turns return there; no replica exceeds its capacity.
    """
    sim = {"step_seconds": "0.01", "output_tokens": "4", "kv_cache_tokens": "2400"}
    engines = list(
        await asyncio.gather(*(asyncio.to_thread(start_engine, "aff", sim=sim) for _ in range(3)))
    )
    try:
        for replica, engine in enumerate(engines):
            await register_replica(consul, "aff", replica, engine.port)
        async with running_router(consul, policy="round_robin") as router:
            await wait_until(lambda: routable_count(router, "aff") == 3, timeout_s=5, what="eps")
            round_robin = await _hit_rate_through(router.url, engines, http, seed=1)
        async with running_router(consul) as router:
            assert router.runtime.settings.policy == "predicted_ttft"
            await wait_until(lambda: routable_count(router, "aff") == 3, timeout_s=5, what="eps")
            predicted = await _hit_rate_through(router.url, engines, http, seed=2)
    finally:
        for engine in engines:
            engine.stop()

    assert predicted >= 0.5, (predicted, round_robin)
    assert predicted >= 3 * round_robin, (predicted, round_robin)
