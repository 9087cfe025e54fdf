"""Exact prefix routing end to end: simulated vLLM -> KV relay process -> router(s) (issue 24).

A simulated vLLM publishes KV events on an ipc:// socket; a relay process
(`python -m caravan_llm.kvrelay`) beside it serves the digest stream on
loopback; the replica is registered and placed with that `kv_port` in the
devcluster Consul; routers read the engine key from a fake Nomad and the
prompts' token ids from a tokenizer that mirrors the simulated engine's
(its tokenizer, vocabulary ids and ChatML template), so the router's digests
are the ones the relay publishes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from router_cluster import (
    REPO,
    Engine,
    KeyVariables,
    RouterUnderTest,
    declare_model,
    register_replica,
    routable_count,
    running_router,
    start_engine,
    wait_until,
)

from caravan_llm.common.block_digest import BlockDigest, DigestKey, block_digests
from caravan_llm.common.consul_api import ConsulClient
from caravan_llm.common.contract import EngineRoute, ModelView
from caravan_llm.devcluster.engine.text import ChatMessage, Vocabulary, render_chatml, tokenize
from caravan_llm.router.tokens.registry import Tokenizers

MODEL = "tiny"
KEY = "engine-key-of-tiny-for-kv-events"
TOPIC = "kv-events"
BLOCK = 16
WAIT_S = 30.0
# The router's stale bound in these tests: a relay that stops is not believed longer.
STALE_AFTER_S = 2.0
SYSTEM = " ".join(f"rule {i}: answer briefly, cite the manual, stay kind" for i in range(10))
AUTH = {"Authorization": f"Bearer {KEY}"}


class SimulatedEngineTokens:
    """The simulated vLLM's tokenizer as a router's PromptTokens: ChatML, its tokens, its ids."""

    def __init__(self) -> None:
        self._vocabulary = Vocabulary()

    async def prompt_token_ids(
        self,
        view: ModelView,
        route: EngineRoute,
        payload: Mapping[str, Any],
        *,
        on_prefix: Callable[[Sequence[int], int], None] | None = None,
    ) -> Sequence[int] | None:
        del view, on_prefix
        return self.ids(route, payload)

    def ids(self, route: EngineRoute, payload: Mapping[str, Any]) -> Sequence[int] | None:
        """The ids, computed on the caller's thread."""
        messages = payload.get("messages")
        if route is not EngineRoute.CHAT_COMPLETIONS or not isinstance(messages, list):
            return None
        chat = [ChatMessage(str(m["role"]), str(m["content"])) for m in messages]
        prompt = render_chatml(chat, add_generation_prompt=True)
        return [self._vocabulary.id_of(token) for token in tokenize(prompt)]


def digests_of(user: str) -> tuple[BlockDigest, ...]:
    """The prompt's block digests as the relay names the engine's blocks."""
    ids = SimulatedEngineTokens().ids(EngineRoute.CHAT_COMPLETIONS, chat(user))
    assert ids is not None
    return block_digests(ids, block_size=BLOCK, key=DigestKey.from_secret(KEY))


def chat(user: str) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
        "max_tokens": 2,
    }


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def ipc_dir() -> Iterator[Path]:
    """A short folder for ipc:// sockets (their paths are limited to about 100 bytes)."""
    with tempfile.TemporaryDirectory(prefix="kvr") as folder:
        yield Path(folder)


def kv_engine(ipc_dir: Path, tokenizer: Path | None = None) -> Engine:
    """A simulated vLLM with the engine key, publishing KV events on an ipc socket
    (`tokenizer`: a tokenizer.json directory it tokenizes with, as vLLM's --tokenizer)."""
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"ipc://{ipc_dir}/kv.ipc",
        "topic": TOPIC,
    }
    return start_engine(
        MODEL,
        extra_args=[
            "--block-size",
            str(BLOCK),
            "--num-gpu-blocks-override",
            "4096",
            "--kv-events-config",
            json.dumps(config),
            *(["--tokenizer", str(tokenizer)] if tokenizer is not None else []),
        ],
        env={"VLLM_API_KEY": KEY},
    )


@contextlib.asynccontextmanager
async def relay_process(ipc_dir: Path, port: int) -> AsyncIterator[asyncio.subprocess.Process]:
    """`python -m caravan_llm.kvrelay` beside the engine, listening on `port` when yielded."""
    env = {
        **os.environ,
        "CARAVAN_KV_RELAY_EVENTS_ENDPOINT": f"ipc://{ipc_dir}/kv.ipc",
        "CARAVAN_KV_RELAY_TOPIC": TOPIC,
        "CARAVAN_KV_RELAY_BLOCK_SIZE": str(BLOCK),
        "CARAVAN_KV_RELAY_HOST": "127.0.0.1",
        "CARAVAN_KV_RELAY_PORT": str(port),
        "CARAVAN_KV_RELAY_HEARTBEAT_INTERVAL_S": "0.5",
        "VLLM_API_KEY": KEY,
    }
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "caravan_llm.kvrelay",
        cwd=REPO,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        assert process.stdout is not None
        line = await asyncio.wait_for(process.stdout.readline(), timeout=WAIT_S)
        assert b"caravan kv-relay on" in line, line
        yield process
    finally:
        if process.returncode is None:
            process.kill()
        await process.wait()


class Lines:
    """The routers' canonical request lines."""

    def __init__(self) -> None:
        self.lines: list[dict[str, Any]] = []

    def __call__(self, fields: dict[str, Any]) -> None:
        self.lines.append(dict(fields))


async def post(http: aiohttp.ClientSession, router: RouterUnderTest, user: str) -> None:
    async with http.post(router.url + "/v1/chat/completions", json=chat(user)) as answer:
        assert 200 == answer.status, await answer.text()


def stream_state(router: RouterUnderTest, endpoint: str) -> str:
    return router.runtime.state.kv.state(endpoint, time.monotonic())


def cached(router: RouterUnderTest, endpoint: str, user: str) -> int | None:
    return router.runtime.state.kv.cached_blocks(
        endpoint, digests_of(user), block_size=BLOCK, now=time.monotonic()
    )


def router_options(lines: Lines) -> dict[str, Any]:
    return {
        "request_log": lines,
        "prompt_tokens": SimulatedEngineTokens(),
        "kv_events_stale_after_s": STALE_AFTER_S,
        "kv_events_backoff_min_s": 0.1,
        "kv_events_backoff_max_s": 0.5,
    }


async def test_the_router_routes_on_the_engines_events_and_falls_back_when_the_relay_dies(
    consul: ConsulClient,
    http: aiohttp.ClientSession,
    ipc_dir: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Events counted, `prefix_source: events` while the stream lives, `approximate` within the
    stale bound of the relay's death, a `reconnect` resync when it is back, and a `new_epoch`
    resync when the engine restarts."""
    caplog.set_level(logging.INFO, logger="router.proxy")  # request lines are written at info
    engine = kv_engine(ipc_dir)
    relay_port = free_port()
    lines = Lines()
    try:
        async with relay_process(ipc_dir, relay_port) as relay:
            endpoint = await register_replica(consul, MODEL, 0, engine.port, kv_port=relay_port)
            async with running_router(
                consul, nomad=KeyVariables({MODEL: KEY}), **router_options(lines)
            ) as router:
                await wait_until(
                    lambda: routable_count(router, MODEL) == 1,
                    timeout_s=WAIT_S,
                    what="the replica routable",
                )
                await wait_until(
                    lambda: stream_state(router, endpoint) == "live",
                    timeout_s=WAIT_S,
                    what="the stream live",
                )
                await post(http, router, "first question")
                await wait_until(
                    lambda: (cached(router, endpoint, "first question") or 0) > 0,
                    timeout_s=WAIT_S,
                    what="the prompt's blocks held",
                )
                await post(http, router, "second question")
                # The router names the blocks exactly as the relay does: all of them match.
                total = len(digests_of("second question"))
                await wait_until(
                    lambda: cached(router, endpoint, "second question") == total,
                    timeout_s=WAIT_S,
                    what="every block of the prompt held",
                )
                events = router.metric("caravan_router_kv_events_total", endpoint=endpoint)
                sources_live = [line["prefix_source"] for line in lines.lines]

                relay.send_signal(signal.SIGKILL)
                killed_at = time.monotonic()
                await wait_until(
                    lambda: stream_state(router, endpoint) != "live",
                    timeout_s=WAIT_S,
                    what="the stream not live",
                )
                fell_back_after_s = time.monotonic() - killed_at
                await post(http, router, "while the relay is down")
                source_down = lines.lines[-1]["prefix_source"]

                async with relay_process(ipc_dir, relay_port):
                    await wait_until(
                        lambda: stream_state(router, endpoint) == "live",
                        timeout_s=WAIT_S,
                        what="the stream back",
                    )
                    await post(http, router, "after the relay came back")
                    source_back = lines.lines[-1]["prefix_source"]
                    reconnects = router.metric(
                        "caravan_router_kv_resyncs_total", reason="reconnect"
                    )

                    engine.kill()
                    await wait_until(
                        lambda: router.metric(
                            "caravan_router_kv_resyncs_total", reason="new_epoch"
                        ),
                        timeout_s=WAIT_S,
                        what="a new epoch after the engine died",
                    )
                    after_engine = cached(router, endpoint, "first question")
    finally:
        engine.stop()

    assert total > 1
    assert events is not None
    assert events > 0
    assert ["events", "events"] == sources_live
    assert fell_back_after_s < STALE_AFTER_S
    assert ("approximate", "events") == (source_down, source_back)
    assert reconnects is not None
    assert reconnects >= 1
    assert 0 == after_engine


async def test_two_routers_reading_one_relay_agree_without_talking(
    consul: ConsulClient, http: aiohttp.ClientSession, ipc_dir: Path
) -> None:
    """Requests through one router only: both routers' exact indexes hold the same blocks."""
    engine = kv_engine(ipc_dir)
    relay_port = free_port()
    try:
        async with relay_process(ipc_dir, relay_port):
            endpoint = await register_replica(consul, MODEL, 0, engine.port, kv_port=relay_port)
            keys = KeyVariables({MODEL: KEY})
            async with (
                running_router(consul, nomad=keys, **router_options(Lines())) as sender,
                running_router(consul, nomad=keys, **router_options(Lines())) as watcher,
            ):
                for router in (sender, watcher):
                    await wait_until(
                        lambda r=router: stream_state(r, endpoint) == "live",
                        timeout_s=WAIT_S,
                        what="the stream live",
                    )
                users = [f"conversation {i}" for i in range(3)]
                for user in users:
                    await post(http, sender, user)
                expected = [len(digests_of(user)) for user in users]
                await wait_until(
                    lambda: [cached(watcher, endpoint, u) for u in users] == expected,
                    timeout_s=WAIT_S,
                    what="the watcher holds what the sender sent",
                )
                positions = [r.runtime.state.kv.position(endpoint) for r in (sender, watcher)]
                held = [[cached(r, endpoint, u) for u in users] for r in (sender, watcher)]
    finally:
        engine.stop()

    assert [expected, expected] == held
    assert positions[0] == positions[1]


async def test_the_routers_own_tokenizers_name_the_blocks_the_engine_reports(
    consul: ConsulClient,
    http: aiohttp.ClientSession,
    ipc_dir: Path,
    tiny_tokenizer_dir: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The router's real Tokenizers (the profile's `tokenizer`) on an engine tokenizing with the
    same tokenizer.json: the second request with a shared system prompt is routed on events."""
    caplog.set_level(logging.INFO, logger="router.proxy")  # request lines are written at info
    engine = kv_engine(ipc_dir, tiny_tokenizer_dir)
    relay_port = free_port()
    lines = Lines()
    tokenizers = Tokenizers()
    options = {
        **router_options(lines),
        "prompt_tokens": tokenizers,
        # Wiring, not speed: a loaded test machine must not route approximately for time.
        "exact_prefix_budget_ms": 30_000.0,
    }
    try:
        async with relay_process(ipc_dir, relay_port):
            await declare_model(consul, MODEL, tokenizer=str(tiny_tokenizer_dir))
            endpoint = await register_replica(consul, MODEL, 0, engine.port, kv_port=relay_port)
            async with running_router(
                consul, nomad=KeyVariables({MODEL: KEY}), **options
            ) as router:
                await wait_until(
                    lambda: stream_state(router, endpoint) == "live",
                    timeout_s=WAIT_S,
                    what="the stream live",
                )
                await post(http, router, "first question")
                await wait_until(
                    lambda: (
                        (router.metric("caravan_router_kv_events_total", endpoint=endpoint) or 0)
                        > 0
                    ),
                    timeout_s=WAIT_S,
                    what="the first prompt's blocks reported",
                )
                await post(http, router, "second question")
                view = ModelView(name=MODEL, tokenizer=str(tiny_tokenizer_dir))
                ids = await tokenizers.prompt_token_ids(
                    view, EngineRoute.CHAT_COMPLETIONS, chat("second question")
                )
                assert ids is not None
                digests = block_digests(ids, block_size=BLOCK, key=DigestKey.from_secret(KEY))
                # The router names the blocks exactly as the engine's events do: all held.
                await wait_until(
                    lambda: (
                        router.runtime.state.kv.cached_blocks(
                            endpoint, digests, block_size=BLOCK, now=time.monotonic()
                        )
                        == len(digests)
                    ),
                    timeout_s=WAIT_S,
                    what="every block of the second prompt held",
                )
                events = router.metric("caravan_router_kv_events_total", endpoint=endpoint)
                exact = router.metric("caravan_router_exact_prompts_total", outcome="exact")
    finally:
        tokenizers.close()
        engine.stop()

    assert len(digests) > 1
    assert ["events", "events"] == [line["prefix_source"] for line in lines.lines]
    assert events is not None
    assert events > 0
    assert 2.0 == exact
