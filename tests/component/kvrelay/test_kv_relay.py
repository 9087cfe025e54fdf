"""The KV relay beside a simulated vLLM: routers following its stream hold the engine's blocks.

The engine publishes KV events on an ipc:// socket in a temporary folder (as
inside an allocation); the relay reads them and serves `/v1/kv/stream`; a
router-side follower decodes the stream (`caravan_llm.common.kv_stream`) into
the router's `KvIndex`, reading through a TCP proxy that records every byte
the relay sends.

Resync bound: when the engine goes away the relay tells every router at once
(an empty snapshot of a new epoch, within one event-loop turn of ZeroMQ
reporting the disconnect); the tests allow `RESYNC_BOUND_S`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import struct
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import msgpack
import pytest
import zmq
import zmq.asyncio
from kv_subscriber import KvSubscriber
from polling import eventually
from prometheus_client.parser import text_string_to_metric_families

from caravan_llm.common.block_digest import BlockDigest, DigestKey, block_digests
from caravan_llm.common.kv_stream import (
    STREAM_PATH,
    KvDelta,
    KvHeartbeat,
    KvSnapshot,
    KvStreamMessage,
    SseDecoder,
)
from caravan_llm.devcluster.engine.flags import parse_engine_args
from caravan_llm.devcluster.engine.server import RunningEngine, run_engine
from caravan_llm.kvrelay.relay import running_relay
from caravan_llm.kvrelay.settings import RelaySettings
from caravan_llm.kvrelay.wire import BlockStored
from caravan_llm.router.core.kv_index import KvIndex

KEY = "engine-key-for-the-relay-test"
TOPIC = "kv-events"
BLOCK = 16
REPLICA = "replica-0"
WAIT_S = 15.0
RESYNC_BOUND_S = 5.0
SYSTEM = " ".join(f"rule{i} is to answer briefly and kindly" for i in range(12))


@pytest.fixture
def ipc_dir() -> Iterator[Path]:
    """A short folder for ipc:// sockets (their paths are limited to about 100 bytes)."""
    with tempfile.TemporaryDirectory(prefix="kvr") as folder:
        yield Path(folder)


def kv_config(endpoint: str, **fields: object) -> str:
    return json.dumps(
        {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "topic": TOPIC}
        | fields
    )


def engine_args(endpoint: str, *, blocks: int = 4096, **kv: object) -> list[str]:
    return [
        "--flavor", "vllm", "--host", "127.0.0.1", "--model", "m",
        "--block-size", str(BLOCK), "--num-gpu-blocks-override", str(blocks),
        "--sim-load-seconds", "0", "--kv-events-config", kv_config(endpoint, **kv),
    ]  # fmt: skip


@contextlib.asynccontextmanager
async def engine(
    endpoint: str, *, blocks: int = 4096, **kv: object
) -> AsyncIterator[RunningEngine]:
    """A simulated vLLM in this loop, with the engine key, publishing on `endpoint`."""
    args = [*engine_args(endpoint, blocks=blocks, **kv), "--port", "0"]
    settings = parse_engine_args(args, env={"VLLM_API_KEY": KEY})
    async with run_engine(settings) as running:
        await asyncio.wait_for(running.engine.ready.wait(), timeout=10)
        yield running


def relay_settings(endpoint: str, **overrides: object) -> RelaySettings:
    fields: dict[str, object] = {
        "events_endpoint": endpoint,
        "topic": TOPIC,
        "block_size": BLOCK,
        "engine_api_key": KEY,
        "host": "127.0.0.1",
        "port": 0,
        "heartbeat_interval_s": 0.2,
    }
    return RelaySettings.model_validate(fields | overrides)


def messages(user: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


async def chat(http: aiohttp.ClientSession, base_url: str, user: str) -> None:
    body = {"model": "m", "messages": messages(user), "max_tokens": 1}
    async with http.post(base_url + "/v1/chat/completions", json=body, headers=AUTH) as answer:
        assert 200 == answer.status, await answer.text()


async def prompt_tokens(http: aiohttp.ClientSession, base_url: str, user: str) -> list[int]:
    """The chat prompt's token ids as the engine tokenizes it (template applied)."""
    body = {"model": "m", "messages": messages(user)}
    async with http.post(base_url + "/tokenize", json=body, headers=AUTH) as answer:
        assert 200 == answer.status, await answer.text()
        return list((await answer.json())["tokens"])


AUTH = {"Authorization": f"Bearer {KEY}"}
DIGEST_KEY = DigestKey.from_secret(KEY)


def digests_of(tokens: Sequence[int]) -> tuple[BlockDigest, ...]:
    return block_digests(tokens, block_size=BLOCK, key=DIGEST_KEY)


# --- the router's side ------------------------------------------------------------------


@dataclass
class Capture:
    """A TCP proxy in front of the relay that records every byte the relay sends."""

    port: int
    from_relay: bytearray = field(default_factory=bytearray)


@contextlib.asynccontextmanager
async def capturing_proxy(relay_port: int) -> AsyncIterator[Capture]:
    capture = Capture(port=0)
    pumps: set[asyncio.Task[None]] = set()
    writers: list[asyncio.StreamWriter] = []

    async def pump(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, record: bytearray | None
    ) -> None:
        with contextlib.suppress(ConnectionError):
            while chunk := await reader.read(65536):
                if record is not None:
                    record += chunk
                writer.write(chunk)
                await writer.drain()
        writer.close()

    async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        writers.append(client_w)
        relay_r, relay_w = await asyncio.open_connection("127.0.0.1", relay_port)
        writers.append(relay_w)
        for task in (
            asyncio.create_task(pump(client_r, relay_w, None)),
            asyncio.create_task(pump(relay_r, client_w, capture.from_relay)),
        ):
            pumps.add(task)
            task.add_done_callback(pumps.discard)

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    capture.port = server.sockets[0].getsockname()[1]
    try:
        yield capture
    finally:
        server.close()
        for task in list(pumps):
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
        for writer in writers:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
        await server.wait_closed()


@dataclass
class Follower:
    """A router following one relay's stream into a KvIndex, as the router's feed will."""

    index: KvIndex = field(default_factory=lambda: KvIndex(stale_after_s=5.0))
    received: list[KvStreamMessage] = field(default_factory=list)
    ended: bool = False

    def apply(self, message: KvStreamMessage) -> None:
        now = time.monotonic()
        self.received.append(message)
        match message:
            case KvSnapshot():
                self.index.apply_snapshot(REPLICA, message, now)
            case KvDelta():
                self.index.apply_delta(REPLICA, message, now)
            case KvHeartbeat():
                self.index.heartbeat(REPLICA, message, now)

    def digests(self) -> frozenset[BlockDigest]:
        """What the index believes the replica holds (empty when not in sync)."""
        held = [
            digest
            for digest in self.all_digests_seen()
            if self.index.cached_blocks(REPLICA, [digest], block_size=BLOCK, now=time.monotonic())
        ]
        return frozenset(held)

    def all_digests_seen(self) -> set[BlockDigest]:
        seen: set[BlockDigest] = set()
        for message in self.received:
            if isinstance(message, KvSnapshot):
                seen |= message.digests
            elif isinstance(message, KvDelta):
                seen.update(message.added)
        return seen

    def epoch(self) -> int | None:
        position = self.index.position(REPLICA)
        return None if position is None else position[0]


@contextlib.asynccontextmanager
async def follow(
    http: aiohttp.ClientSession, port: int, headers: dict[str, str] | None = None
) -> AsyncIterator[Follower]:
    follower = Follower()

    async def read() -> None:
        decoder = SseDecoder()
        url = f"http://127.0.0.1:{port}{STREAM_PATH}"
        async with http.get(url, headers=AUTH if headers is None else headers) as response:
            assert 200 == response.status
            async for chunk in response.content.iter_any():
                for message in decoder.feed(chunk):
                    follower.apply(message)
        follower.ended = True

    task = asyncio.create_task(read())
    try:
        await eventually(lambda: follower.received or task.done(), WAIT_S, "the snapshot")
        if task.done():
            task.result()
        yield follower
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        yield session


def metric(text: str, name: str, **labels: str) -> float | None:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return None


# --- token ids in bytes -----------------------------------------------------------------

_RUN = 4
_SEPARATOR = rb"[^0-9A-Za-z]{1,8}"


def carries_token_ids(data: bytes, ids: Sequence[int]) -> bool:
    """Whether `data` holds 4 consecutive ids of `ids` in any encoding a relay could use.

    Decimal text with any separators (JSON, CSV, Python reprs), 2/4/8-byte
    integers in either byte order (raw, and as hex text), msgpack.
    """
    for start in range(len(ids) - _RUN + 1):
        window = ids[start : start + _RUN]
        decimal = _SEPARATOR.join(str(token).encode() for token in window)
        if re.search(rb"(?<![0-9])" + decimal + rb"(?![0-9])", data):
            return True
        if b"".join(msgpack.packb(token) for token in window) in data:
            return True
        for fmt in ("<H", ">H", "<I", ">I", "<Q", ">Q"):
            packed = b"".join(struct.pack(fmt, token) for token in window)
            if packed in data or packed.hex().encode() in data:
                return True
    return False


# --- the tests --------------------------------------------------------------------------


async def test_a_router_following_the_stream_holds_the_digests_of_the_prompts_cached(
    http: aiohttp.ClientSession, ipc_dir: Path
) -> None:
    """Snapshot then deltas converge to block_digests() of every prompt the engine cached."""
    endpoint = f"ipc://{ipc_dir}/kv.ipc"
    async with (
        engine(endpoint) as sim,
        running_relay(relay_settings(endpoint)) as relay,
    ):
        await eventually(lambda: relay.relay.engine_connected, WAIT_S, "the engine connected")
        await chat(http, sim.base_url, "first question about the weather")
        async with follow(http, relay.port) as late:
            await chat(http, sim.base_url, "second question about the sea")
            await chat(http, sim.base_url, "first question about the weather")
            expected: set[BlockDigest] = set()
            for user in ("first question about the weather", "second question about the sea"):
                expected |= set(digests_of(await prompt_tokens(http, sim.base_url, user)))
            assert len(expected) > len(digests_of(await prompt_tokens(http, sim.base_url, "")))
            await eventually(lambda: late.digests() == expected, WAIT_S, "the prompts' digests")
            assert "live" == late.index.state(REPLICA, time.monotonic())


async def test_evicted_blocks_leave_the_routers_index(
    http: aiohttp.ClientSession, ipc_dir: Path
) -> None:
    """A small cache evicts the first prompt's blocks: the router stops believing them."""
    endpoint = f"ipc://{ipc_dir}/kv.ipc"
    async with (
        engine(endpoint, blocks=24) as sim,
        running_relay(relay_settings(endpoint)) as relay,
    ):
        await eventually(lambda: relay.relay.engine_connected, WAIT_S, "the engine connected")
        async with follow(http, relay.port) as router:
            first = digests_of(await prompt_tokens(http, sim.base_url, "one"))
            await chat(http, sim.base_url, "one")
            await eventually(
                lambda: set(first) <= router.digests(), WAIT_S, "the first prompt's blocks"
            )
            for i in range(8):  # other prompts of the same length push it out (LRU)
                body = {
                    "model": "m",
                    "messages": [{"role": "system", "content": f"other{i} " + SYSTEM}],
                    "max_tokens": 1,
                }
                async with http.post(
                    sim.base_url + "/v1/chat/completions", json=body, headers=AUTH
                ) as answer:
                    assert 200 == answer.status
            await eventually(
                lambda: not set(first) & router.digests(), WAIT_S, "the evicted blocks gone"
            )
            assert len(router.digests()) <= 24


async def test_the_stream_refuses_a_caller_without_the_engine_key(
    http: aiohttp.ClientSession, ipc_dir: Path
) -> None:
    """No key or a wrong key gets 401 in OpenAI's error shape, and is counted."""
    endpoint = f"ipc://{ipc_dir}/kv.ipc"
    async with running_relay(relay_settings(endpoint)) as relay:
        url = f"http://127.0.0.1:{relay.port}{STREAM_PATH}"
        answers = []
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            async with http.get(url, headers=headers) as answer:
                answers.append((answer.status, (await answer.json())["error"]["type"]))
        async with http.get(f"http://127.0.0.1:{relay.port}/metrics") as answer:
            refused = metric(await answer.text(), "caravan_kv_relay_unauthorized_total")
    assert [(401, "authentication_error")] * 3 == answers
    assert 3 == refused


async def test_no_token_id_of_the_prompt_crosses_to_the_router(
    http: aiohttp.ClientSession, ipc_dir: Path
) -> None:
    """Every byte the relay sends a router is free of the prompt's token ids (which the engine's
    own events carry, as the same detector finds)."""
    endpoint = f"ipc://{ipc_dir}/kv.ipc"
    async with (
        engine(endpoint) as sim,
        running_relay(relay_settings(endpoint)) as relay,
        capturing_proxy(relay.port) as capture,
    ):
        await eventually(lambda: relay.relay.engine_connected, WAIT_S, "the engine connected")
        with KvSubscriber.connect(endpoint, TOPIC.encode()) as side:
            async with follow(http, capture.port) as router:
                tokens = await prompt_tokens(http, sim.base_url, "a private question")
                await chat(http, sim.base_url, "a private question")
                await eventually(
                    lambda: set(digests_of(tokens)) <= router.digests(), WAIT_S, "the digests"
                )
                held = router.digests()
            batches = await side.batches_until(lambda bs: len(bs) >= 1, WAIT_S, "a batch")
            engine_bytes = b"".join(part for frame in side.frames for part in frame)
    assert any(isinstance(event, BlockStored) for batch in batches for event in batch.events)
    assert carries_token_ids(engine_bytes, tokens)
    assert carries_token_ids(json.dumps(tokens).encode(), tokens)
    sent = bytes(capture.from_relay)
    assert b"event: snapshot" in sent
    assert b"event: delta" in sent
    assert not carries_token_ids(sent, tokens)
    # The names the router holds are digests, not the ids (nor ids of a block) themselves.
    assert set() == held & set(tokens)
    assert not carries_token_ids(json.dumps(sorted(held)).encode(), tokens)


# --- losing the engine, losing batches --------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.asynccontextmanager
async def engine_process(endpoint: str) -> AsyncIterator[asyncio.subprocess.Process]:
    """A simulated vLLM as its own process (so it can be SIGKILLed), ready when yielded."""
    port = free_port()
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "caravan_llm.devcluster.engine",
        *engine_args(endpoint),
        "--port",
        str(port),
        env={**os.environ, "VLLM_API_KEY": KEY},
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    base_url = f"http://127.0.0.1:{port}"

    async def healthy() -> bool:
        try:
            async with aiohttp.ClientSession() as session, session.get(base_url + "/health") as r:
                return r.status == 200
        except aiohttp.ClientError:
            return False

    try:
        await eventually(healthy, 60, "the engine process healthy")
        process.base_url = base_url  # type: ignore[attr-defined]
        yield process
    finally:
        if process.returncode is None:
            process.kill()
        await process.wait()


def epoch_after(router: Follower, old: int | None) -> int | None:
    epoch = router.epoch()
    return epoch if epoch is not None and epoch != old else None


async def test_a_killed_engine_empties_the_routers_index_in_a_new_epoch_within_the_bound(
    http: aiohttp.ClientSession, ipc_dir: Path
) -> None:
    """SIGKILL the engine: routers hold nothing of it within the bound; the restarted engine's
    blocks arrive in the new epoch."""
    endpoint = f"ipc://{ipc_dir}/kv.ipc"
    async with running_relay(relay_settings(endpoint)) as relay, follow(http, relay.port) as router:
        async with engine_process(endpoint) as first:
            url = first.base_url  # type: ignore[attr-defined]
            await eventually(lambda: relay.relay.engine_connected, WAIT_S, "the engine connected")
            tokens = await prompt_tokens(http, url, "before the crash")
            await chat(http, url, "before the crash")
            await eventually(
                lambda: set(digests_of(tokens)) <= router.digests(), WAIT_S, "the blocks"
            )
            old_epoch = router.epoch()
            os.kill(first.pid, signal.SIGKILL)
            killed_at = time.monotonic()
            await eventually(
                lambda: epoch_after(router, old_epoch) is not None and not router.digests(),
                RESYNC_BOUND_S,
                "the routers told of the lost engine",
            )
            told_after_s = time.monotonic() - killed_at
            new_epoch = router.epoch()
        async with engine_process(endpoint) as second:
            url = second.base_url  # type: ignore[attr-defined]
            await eventually(lambda: relay.relay.engine_connected, WAIT_S, "the new engine")
            await chat(http, url, "after the restart")
            tokens = await prompt_tokens(http, url, "after the restart")
            await eventually(
                lambda: set(digests_of(tokens)) <= router.digests(), WAIT_S, "the new blocks"
            )
            assert new_epoch == router.epoch()
        assert told_after_s < RESYNC_BOUND_S


@contextlib.asynccontextmanager
async def lossy_forwarder(source: str, target: str, drop: set[int]) -> AsyncIterator[list[int]]:
    """Forward the engine's frames from `source` to `target`, dropping those with a seq in
    `drop`; yields the seqs forwarded so far."""
    context = zmq.asyncio.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    pub = context.socket(zmq.PUB)
    pub.bind(target)
    sub.connect(source)
    forwarded: list[int] = []

    async def run() -> None:
        while True:
            frame = await sub.recv_multipart()
            seq = int.from_bytes(frame[1], "big")
            if seq not in drop:
                forwarded.append(seq)
                await pub.send_multipart(frame)

    task = asyncio.create_task(run())
    try:
        yield forwarded
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        sub.close(linger=0)
        pub.close(linger=0)
        context.term()


@pytest.mark.parametrize("replay", [True, False])
async def test_a_lost_batch_is_replayed_or_starts_a_new_epoch(
    http: aiohttp.ClientSession, ipc_dir: Path, replay: bool
) -> None:
    """With a replay endpoint the relay fills the gap (same epoch, every prompt's blocks);
    without one it starts a new epoch holding only what it saw after the gap."""
    engine_events = f"ipc://{ipc_dir}/engine.ipc"
    replay_endpoint = f"ipc://{ipc_dir}/replay.ipc"
    relayed = f"ipc://{ipc_dir}/relayed.ipc"
    overrides = {"replay_endpoint": replay_endpoint} if replay else {}
    users = [f"topic{i}" for i in range(3)]

    async def send(url: str, i: int) -> tuple[BlockDigest, ...]:
        body = {
            "model": "m",
            "messages": [{"role": "system", "content": f"{users[i]} {SYSTEM}"}],
            "max_tokens": 1,
        }
        async with http.post(url + "/v1/chat/completions", json=body, headers=AUTH) as answer:
            assert 200 == answer.status
        body.pop("max_tokens")
        async with http.post(url + "/tokenize", json=body, headers=AUTH) as answer:
            return digests_of((await answer.json())["tokens"])

    async with (
        engine(engine_events, replay_endpoint=replay_endpoint) as sim,
        lossy_forwarder(engine_events, relayed, drop={1}) as forwarded,
        running_relay(relay_settings(relayed, **overrides)) as relay,
        follow(http, relay.port) as router,
    ):
        await eventually(lambda: relay.relay.engine_connected, WAIT_S, "the forwarder connected")
        prompts = [await send(sim.base_url, 0)]
        await eventually(lambda: set(prompts[0]) <= router.digests(), WAIT_S, "batch 0")
        old_epoch = router.epoch()
        prompts += [await send(sim.base_url, 1), await send(sim.base_url, 2)]
        await eventually(lambda: forwarded == [0, 2], WAIT_S, "batch 1 dropped, 2 forwarded")
        if replay:
            expected = set(prompts[0]) | set(prompts[1]) | set(prompts[2])
            await eventually(lambda: router.digests() == expected, WAIT_S, "the gap filled")
            assert old_epoch == router.epoch()
        else:
            await eventually(
                lambda: epoch_after(router, old_epoch) and router.digests() == set(prompts[2]),
                WAIT_S,
                "a new epoch after the gap",
            )
        async with http.get(f"http://127.0.0.1:{relay.port}/metrics") as answer:
            text = await answer.text()
    resyncs = metric(text, "caravan_kv_relay_resyncs_total", reason="gap")
    filled = metric(text, "caravan_kv_relay_replays_total", outcome="filled")
    assert ((None, 1.0) if replay else (1.0, None)) == (resyncs, filled)


async def test_the_relay_process_refuses_a_wildcard_endpoint_naming_the_setting() -> None:
    """`caravan kv-relay` with tcp://* exits 2 naming events_endpoint, before opening anything."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "caravan_llm.cli",
        "kv-relay",
        "--events-endpoint",
        "tcp://*:5557",
        "--block-size",
        str(BLOCK),
        env={**os.environ, "VLLM_API_KEY": KEY},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), timeout=60)
    assert 2 == process.returncode
    assert "error: events_endpoint:" in err.decode()
    assert KEY not in (out + err).decode()


async def test_the_relay_process_ends_its_streams_and_exits_cleanly_on_sigterm(
    http: aiohttp.ClientSession, ipc_dir: Path
) -> None:
    """`python -m caravan_llm.kvrelay`: SIGTERM ends each router's stream and exits 0; the key
    never appears in its output."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "caravan_llm.kvrelay",
        env={
            **os.environ,
            "CARAVAN_KV_RELAY_EVENTS_ENDPOINT": f"ipc://{ipc_dir}/kv.ipc",
            "CARAVAN_KV_RELAY_BLOCK_SIZE": str(BLOCK),
            "CARAVAN_KV_RELAY_LOG_LEVEL": "debug",
            "NOMAD_IP_kv": "127.0.0.1",
            "NOMAD_PORT_kv": "0",
            "VLLM_API_KEY": KEY,
        },
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    assert process.stdout is not None
    assert process.stderr is not None
    try:
        line = await asyncio.wait_for(process.stdout.readline(), timeout=60)
        port = int(line.decode().rsplit(":", 1)[1])
        async with follow(http, port) as router:
            process.send_signal(signal.SIGTERM)
            await eventually(lambda: router.ended, WAIT_S, "the stream ended")
        code = await asyncio.wait_for(process.wait(), timeout=WAIT_S)
        logs = (await process.stderr.read()).decode()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert 0 == code
    assert "kv_relay_stopped" in logs
    assert KEY not in logs + line.decode()
