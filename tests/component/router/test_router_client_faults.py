"""Issue 26, deliver 2: malformed bodies are the client's fault, never a replica's.

A two-replica fleet (simulated vLLM, simulated llama.cpp, and the real
llama-server when it is built) takes a flood of malformed chat requests,
some that the router's edge refuses itself and some that only the engine
rejects (a prompt over the context length, vLLM's `top_logprobs` and
`logit_bias` checks, llama-server's HTTP 500 for a non-string
`reasoning_format`), mixed with valid requests. Throughout, both replicas
stay in rotation (routable, breakers closed, Consul passing), no malformed
body gets a 5xx, and every valid request succeeds, during the flood and after.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from router_cluster import (
    FakeEngine,
    RouterUnderTest,
    chat_body,
    register_replica,
    routable_count,
    running_router,
    start_engine,
    wait_until,
)

from caravan_llm.common.consul_api import ConsulClient
from caravan_llm.common.contract import model_service_name
from caravan_llm.devcluster.llama_server_build import find_llama_server

MODEL = "tiny"
# Malformed requests in the flood, and how many are in flight at once.
MALFORMED_REQUESTS = 240
CONCURRENCY = 12
# Every request of the flood is answered within this, or counted as hung (status 0):
# a hang fails the test naming its request instead of running into pytest's timeout.
REQUEST_TIMEOUT_S = 30.0
HUNG = 0
# Tokens of context per slot: a prompt of LONG_PROMPT words is over it on every engine.
CONTEXT_TOKENS = 256
LONG_PROMPT = "word " * 1200
FLAVORS = ("vllm", "llamacpp", "llama-server")


@dataclass(frozen=True)
class Malformed:
    """A malformed chat body, and the flavours whose answer must be a 4xx (else any non-5xx)."""

    name: str
    body: bytes
    refused_by: frozenset[str] = frozenset(FLAVORS)


def _chat(**fields: Any) -> bytes:
    return json.dumps({**chat_body(MODEL, max_tokens=4), **fields}).encode()


MALFORMED = (
    # Caught at the router's edge.
    Malformed("not_json", b'{"model": "tiny", "messages": ['),
    Malformed("tools_true", _chat(tools=True)),
    Malformed("model_number", _chat(model=5)),
    Malformed("messages_string", _chat(messages="hello")),
    Malformed("temperature_string", _chat(temperature="hot")),
    Malformed("top_logprobs_string", _chat(top_logprobs="many")),
    # Rejected by the engine only.
    Malformed("prompt_over_context", _chat(messages=[{"role": "user", "content": LONG_PROMPT}])),
    Malformed(
        "prompt_over_context_stream",
        _chat(messages=[{"role": "user", "content": LONG_PROMPT}], stream=True),
    ),
    Malformed("top_logprobs_over", _chat(logprobs=True, top_logprobs=1000), frozenset({"vllm"})),
    Malformed("top_logprobs_negative", _chat(logprobs=True, top_logprobs=-3), frozenset({"vllm"})),
    Malformed("logit_bias_key", _chat(logit_bias={"abc": 5}), frozenset({"vllm"})),
    # llama-server answers HTTP 500: the router must still answer 4xx and count nothing.
    Malformed(
        "reasoning_format", _chat(reasoning_format=5), frozenset({"llamacpp", "llama-server"})
    ),
    Malformed(
        "reasoning_format_stream",
        _chat(reasoning_format=5, stream=True),
        frozenset({"llamacpp", "llama-server"}),
    ),
)


@dataclass
class Watch:
    """What the fleet looked like while the flood ran (sampled)."""

    min_routable: int = 2
    max_breaker_state: float = 0.0
    min_passing: int = 2
    samples: int = 0


@dataclass
class Tally:
    """The answers of the flood."""

    malformed_5xx: list[tuple[str, int]] = field(default_factory=list)
    malformed_not_refused: list[tuple[str, int]] = field(default_factory=list)
    valid_failed: list[int] = field(default_factory=list)
    valid_ok: int = 0
    reasoning_messages: set[str] = field(default_factory=set)


async def _post(http: aiohttp.ClientSession, url: str, body: bytes) -> tuple[int, bytes]:
    """The answer's status and body; (HUNG, b"") when none came within REQUEST_TIMEOUT_S."""
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    try:
        async with http.post(
            url, data=body, headers={"Content-Type": "application/json"}, timeout=timeout
        ) as response:
            return response.status, await response.read()
    except TimeoutError:
        return HUNG, b""


async def _valid(http: aiohttp.ClientSession, url: str, index: int) -> int:
    """One valid request (streams every other one); its status, 200 only if the answer is whole."""
    stream = index % 2 == 0
    body = json.dumps(chat_body(MODEL, f"valid {index}", max_tokens=4, stream=stream)).encode()
    status, data = await _post(http, url, body)
    if status == 200 and stream and b"data: [DONE]" not in data:
        return 599
    return status


@asynccontextmanager
async def _fleet(flavor: str, consul: ConsulClient) -> AsyncIterator[list[str]]:
    """Two replicas of MODEL of the flavour, registered with Consul HTTP checks; their ids."""
    if flavor == "llama-server":
        async with _real_llama_servers(consul) as ids:
            yield ids
        return
    engine_flavor = "vllm" if flavor == "vllm" else "llamacpp"
    context = (
        ["--max-model-len", str(CONTEXT_TOKENS)]
        if flavor == "vllm"
        else ["-c", str(CONTEXT_TOKENS * 8)]
    )
    engines = [
        start_engine(MODEL, flavor=engine_flavor, max_num_seqs=8, extra_args=context)
        for _ in range(2)
    ]
    try:
        yield [
            await register_replica(consul, MODEL, index, engine.port, flavor=engine_flavor)
            for index, engine in enumerate(engines)
        ]
    finally:
        for engine in engines:
            engine.stop()


@asynccontextmanager
async def _real_llama_servers(consul: ConsulClient) -> AsyncIterator[list[str]]:
    build = find_llama_server()
    assert build is not None
    processes: list[asyncio.subprocess.Process] = []
    ids: list[str] = []
    try:
        async with aiohttp.ClientSession() as http:
            for index in range(2):
                port = _free_port()
                process = await asyncio.create_subprocess_exec(
                    str(build.binary),
                    *("-m", str(build.model), "--host", "127.0.0.1", "--port", str(port)),
                    *("-c", str(CONTEXT_TOKENS * 4), "-np", "4", "--metrics", "-a", MODEL),
                    stdout=asyncio.subprocess.DEVNULL,
                    stderr=asyncio.subprocess.DEVNULL,
                )
                processes.append(process)
                await wait_until(
                    _health_ok(http, port), timeout_s=30, what=f"llama-server {index} loaded"
                )
                ids.append(await register_replica(consul, MODEL, index, port, flavor="llamacpp"))
        yield ids
    finally:
        for process in processes:
            if process.returncode is None:
                process.terminate()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(process.wait(), timeout=5)
            if process.returncode is None:
                process.kill()
                await process.wait()


def _free_port() -> int:
    import socket  # noqa: PLC0415

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _health_ok(http: aiohttp.ClientSession, port: int) -> Callable[[], Any]:
    async def check() -> bool:
        try:
            async with http.get(f"http://127.0.0.1:{port}/health") as response:
                return response.status == 200
        except aiohttp.ClientError:
            return False

    return check


async def _watch(
    router: RouterUnderTest, consul: ConsulClient, ids: list[str], watch: Watch
) -> None:
    """Sample rotation, breakers and Consul health until cancelled."""
    service = model_service_name(MODEL)
    while True:
        watch.min_routable = min(watch.min_routable, routable_count(router, MODEL))
        for endpoint_id in ids:
            state = router.metric(
                "caravan_router_endpoint_breaker_state", model=MODEL, endpoint=endpoint_id
            )
            watch.max_breaker_state = max(watch.max_breaker_state, state or 0.0)
        passing = (await consul.health_service(service, passing=True))[1]
        watch.min_passing = min(watch.min_passing, len(passing))
        watch.samples += 1
        await asyncio.sleep(0.1)


async def _flood(http: aiohttp.ClientSession, url: str, flavor: str, tally: Tally) -> None:
    """MALFORMED_REQUESTS malformed bodies, CONCURRENCY at a time, with valid ones beside."""
    queue: asyncio.Queue[Malformed] = asyncio.Queue()
    for index in range(MALFORMED_REQUESTS):
        queue.put_nowait(MALFORMED[index % len(MALFORMED)])

    async def malformed_worker() -> None:
        while not queue.empty():
            case = queue.get_nowait()
            status, data = await _post(http, url, case.body)
            if status >= 500 or status == HUNG:
                tally.malformed_5xx.append((case.name, status))
            elif flavor in case.refused_by and not 400 <= status < 500:
                tally.malformed_not_refused.append((case.name, status))
            if case.name.startswith("reasoning_format") and status == 400:
                tally.reasoning_messages.add(json.loads(data)["error"]["message"])

    async def valid_worker(done: asyncio.Event) -> None:
        index = 0
        while not done.is_set():
            status = await _valid(http, url, index)
            if status == 200:
                tally.valid_ok += 1
            else:
                tally.valid_failed.append(status)
            index += 1

    done = asyncio.Event()
    valid = asyncio.create_task(valid_worker(done))
    try:
        await asyncio.gather(*(malformed_worker() for _ in range(CONCURRENCY)))
    finally:
        done.set()
        await valid


@pytest.mark.slow
@pytest.mark.parametrize("flavor", FLAVORS)
async def test_malformed_flood_never_takes_a_replica_out_of_rotation(
    consul: ConsulClient, http: aiohttp.ClientSession, flavor: str
) -> None:
    """Malformed bodies at a 2-replica fleet: all 4xx, both replicas stay in rotation."""
    if flavor == "llama-server" and find_llama_server() is None:
        pytest.skip("the real llama-server is not built: run scripts/build-llama-server.sh")
    async with (
        _fleet(flavor, consul) as ids,
        running_router(consul, policy="round_robin", log_level="warning") as router,
    ):
        url = router.url + "/v1/chat/completions"
        await wait_until(lambda: routable_count(router, MODEL) == 2, timeout_s=10, what="fleet")
        # Both replicas have served (what vouches for them when an engine answers 500).
        warm = [await _valid(http, url, index) for index in range(4)]
        watch, tally = Watch(), Tally()
        watcher = asyncio.create_task(_watch(router, consul, ids, watch))
        try:
            await _flood(http, url, flavor, tally)
            after = [await _valid(http, url, index) for index in range(6)]
            await wait_until(lambda: watch.samples >= 3, timeout_s=5, what="watch samples")
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
        rejections = sum(
            router.metric("caravan_router_engine_rejections_total", model=MODEL, status=status)
            or 0.0
            for status in ("400", "500")
        )

    assert [200] * 4 == warm
    assert {
        "malformed_5xx": [],
        "malformed_not_refused": [],
        "valid_failed": [],
        "min_routable": 2,
        "max_breaker_state": 0.0,
        "min_passing": 2,
        "after": [200] * 6,
    } == {
        "malformed_5xx": tally.malformed_5xx,
        "malformed_not_refused": tally.malformed_not_refused,
        "valid_failed": tally.valid_failed,
        "min_routable": watch.min_routable,
        "max_breaker_state": watch.max_breaker_state,
        "min_passing": watch.min_passing,
        "after": after,
    }
    assert tally.valid_ok > 0
    # The engine-only rejections were the engines' (the edge caught the rest).
    assert rejections > 0
    if flavor != "vllm":
        # llama-server's 500 reached the client as a 400 carrying the engine's own message.
        assert {"[json.exception.type_error.302] type must be string, but is number"} == (
            tally.reasoning_messages
        )


async def _warm(http: aiohttp.ClientSession, router: RouterUnderTest, count: int) -> list[int]:
    statuses = []
    for index in range(count):
        body = chat_body(MODEL, f"warm {index}")
        async with http.post(router.url + "/v1/chat/completions", json=body) as response:
            await response.read()
            statuses.append(response.status)
    return statuses


async def test_a_serving_replica_that_breaks_while_another_serves_is_blamed(
    consul: ConsulClient, http: aiohttp.ClientSession
) -> None:
    """A 500 contradicted by another replica's answer counts: the broken replica's breaker opens."""
    async with FakeEngine(MODEL) as breaking, FakeEngine(MODEL) as good:
        first = await register_replica(consul, MODEL, 0, breaking.port, check="none")
        await register_replica(consul, MODEL, 1, good.port, check="none")
        async with running_router(
            consul, policy="round_robin", breaker_failure_threshold=2
        ) as router:
            await wait_until(lambda: routable_count(router, MODEL) == 2, timeout_s=5, what="eps")
            warm = await _warm(http, router, 4)
            breaking.mode, breaking.status = "status", 500
            statuses = await _warm(http, router, 6)
            state = router.metric(
                "caravan_router_endpoint_breaker_state", model=MODEL, endpoint=first
            )

    assert ([200] * 4, [200] * 6, 2.0) == (warm, statuses, state)


async def test_every_serving_replica_answering_500_is_the_inputs_fault(
    consul: ConsulClient, http: aiohttp.ClientSession
) -> None:
    """Two serving replicas both answering 500: the client gets 400 with the engine's message."""
    async with FakeEngine(MODEL) as first, FakeEngine(MODEL) as second:
        ids = [
            await register_replica(consul, MODEL, index, engine.port, check="none")
            for index, engine in enumerate((first, second))
        ]
        async with running_router(
            consul, policy="round_robin", breaker_failure_threshold=2
        ) as router:
            await wait_until(lambda: routable_count(router, MODEL) == 2, timeout_s=5, what="eps")
            warm = await _warm(http, router, 2)
            for engine in (first, second):
                engine.mode, engine.status = "status", 500
            answers = []
            for index in range(6):
                body = chat_body(MODEL, f"bad {index}", stream=index % 2 == 0)
                async with http.post(router.url + "/v1/chat/completions", json=body) as response:
                    answers.append((response.status, (await response.json())["error"]["message"]))
            states = [
                router.metric("caravan_router_endpoint_breaker_state", model=MODEL, endpoint=eid)
                for eid in ids
            ]
            requests = first.requests + second.requests

    assert [200] * 2 == warm
    assert [(400, "fake failure")] * 6 == answers
    assert ([0.0, 0.0], 2 + 6 * 2) == (states, requests)
