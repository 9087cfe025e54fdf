"""The simulated vLLM publishes KV-cache events in vLLM's wire format, from its own prefix cache."""

from __future__ import annotations

import itertools
import json
import tempfile
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
import zmq
from engine_test_support import StartEngine, free_port, post_json
from kv_subscriber import KvSubscriber
from polling import eventually

from caravan_llm.devcluster.engine.flags import FlagError, parse_engine_args
from caravan_llm.devcluster.engine.kv_events import binds
from caravan_llm.kvrelay.wire import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KvEvent,
    decode_replay_frame,
    replay_request,
)

TOPIC = "kv-events"
BLOCK = 128  # the CPU build's block size, the simulated vLLM's default
CACHE_BLOCKS = 8
WAIT_S = 15.0


@pytest.fixture
def ipc_dir() -> Iterator[Path]:
    """A short folder for ipc:// sockets (their paths are limited to about 100 bytes)."""
    with tempfile.TemporaryDirectory(prefix="kv") as folder:
        yield Path(folder)


def kv_config(endpoint: str, **fields: object) -> str:
    return json.dumps(
        {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "topic": TOPIC}
        | fields
    )


def prompt(name: str, tokens: int) -> str:
    """A completion prompt of exactly `tokens` simulated tokens (one per word)."""
    return "".join(f" {name}{i}" for i in range(tokens))


async def complete(http: aiohttp.ClientSession, base_url: str, text: str) -> None:
    body = {"model": "m", "prompt": text, "max_tokens": 1}
    status, answer = await post_json(http, base_url + "/v1/completions", body)
    assert 200 == status, answer


async def token_ids(http: aiohttp.ClientSession, base_url: str, text: str) -> list[int]:
    status, answer = await post_json(http, base_url + "/tokenize", {"model": "m", "prompt": text})
    assert 200 == status, answer
    return list(answer["tokens"])


def events(batches: list[EventBatch]) -> list[KvEvent]:
    return [event for batch in batches for event in batch.events]


def stored(batches: list[EventBatch]) -> list[BlockStored]:
    return [event for event in events(batches) if isinstance(event, BlockStored)]


def removed_hashes(batches: list[EventBatch]) -> list[BlockHash]:
    return [
        block
        for event in events(batches)
        if isinstance(event, BlockRemoved)
        for block in event.block_hashes
    ]


@pytest.mark.parametrize("encoding", ["map", "array"])
async def test_requests_publish_stored_and_evicted_blocks_in_order(
    sim_engine: StartEngine, http: aiohttp.ClientSession, ipc_dir: Path, encoding: str
) -> None:
    """Full prompt blocks are stored once each, evictions removed, batches numbered from 0."""
    endpoint = f"ipc://{ipc_dir}/kv.ipc"
    engine = await sim_engine(
        "vllm",
        "--model", "m",
        "--num-gpu-blocks-override", str(CACHE_BLOCKS),
        "--kv-events-config", kv_config(endpoint),
        env={"CARAVAN_SIM_KV_EVENTS_ENCODING": encoding},
    )  # fmt: skip
    url = engine.base_url
    shared = prompt("a", 300)  # two full blocks and 44 tokens
    with KvSubscriber.connect(endpoint, TOPIC.encode()) as sub:
        await complete(http, url, shared)
        first = await sub.batches_until(lambda bs: len(bs) >= 1, WAIT_S, "the first batch")
        await complete(http, url, shared)  # both blocks cached: nothing new to store
        await complete(http, url, shared + prompt("b", 200))  # one more full block
        second = await sub.batches_until(lambda bs: len(bs) >= 2, WAIT_S, "the second batch")
        for name in ("c", "d", "e"):  # 4 blocks each: the 8-block cache must evict
            await complete(http, url, prompt(name, 4 * BLOCK + 10))
        batches = await sub.batches_until(
            lambda bs: len(stored(bs)) >= 5 and len(removed_hashes(bs)) >= 7,
            WAIT_S,
            "the evictions",
        )
    ids = await token_ids(http, url, shared + prompt("b", 200))

    assert list(range(len(batches))) == [batch.seq for batch in batches]
    assert {TOPIC.encode()} == {batch.topic for batch in batches}
    a_blocks = first[0].events
    assert 1 == len(first) == len(a_blocks)
    a = a_blocks[0]
    assert isinstance(a, BlockStored)
    assert (2, None, tuple(ids[: 2 * BLOCK])) == (
        len(a.block_hashes),
        a.parent_block_hash,
        a.token_ids,
    )
    b = second[1].events[0]
    assert isinstance(b, BlockStored)
    assert (1, a.block_hashes[1], tuple(ids[2 * BLOCK : 3 * BLOCK])) == (
        len(b.block_hashes),
        b.parent_block_hash,
        b.token_ids,
    )
    every_stored = stored(batches)
    assert {BLOCK} == {event.block_size for event in every_stored}
    assert all(len(event.token_ids) == BLOCK * len(event.block_hashes) for event in every_stored)
    assert {("GPU", 0, "full_attention")} == {
        (event.medium, event.group_idx, event.kv_cache_spec_kind) for event in every_stored
    }
    stored_hashes = [block for event in every_stored for block in event.block_hashes]
    assert len(stored_hashes) == len(set(stored_hashes))
    assert all(isinstance(block, int) and 0 <= block < 2**64 for block in stored_hashes)
    evicted = removed_hashes(batches)
    assert set(evicted) <= set(stored_hashes)
    assert len(evicted) == len(set(evicted))
    # The cache never holds more than its blocks.
    assert len(stored_hashes) - len(evicted) <= CACHE_BLOCKS


async def test_a_prompt_shorter_than_a_block_publishes_nothing(
    sim_engine: StartEngine, http: aiohttp.ClientSession, ipc_dir: Path
) -> None:
    """Only full blocks produce events: the first batch comes from the first full block."""
    endpoint = f"ipc://{ipc_dir}/kv.ipc"
    engine = await sim_engine("vllm", "--model", "m", "--kv-events-config", kv_config(endpoint))
    with KvSubscriber.connect(endpoint, TOPIC.encode()) as sub:
        await complete(http, engine.base_url, prompt("short", BLOCK - 1))
        await complete(http, engine.base_url, prompt("long", BLOCK + 1))
        batches = await sub.batches_until(lambda bs: len(bs) >= 1, WAIT_S, "a batch")
    assert [0] == [batch.seq for batch in batches]
    event = batches[0].events[0]
    assert isinstance(event, BlockStored)
    assert 1 == len(event.block_hashes)


async def test_a_prefix_cache_reset_publishes_all_blocks_cleared_with_the_next_step(
    sim_engine: StartEngine, http: aiohttp.ClientSession, ipc_dir: Path
) -> None:
    """POST /reset_prefix_cache (dev mode) empties the cache; the next batch says so first."""
    endpoint = f"ipc://{ipc_dir}/kv.ipc"
    engine = await sim_engine(
        "vllm",
        "--model", "m",
        "--block-size", "16",
        "--kv-events-config", kv_config(endpoint),
        env={"VLLM_SERVER_DEV_MODE": "1"},
    )  # fmt: skip
    text = prompt("a", 40)
    with KvSubscriber.connect(endpoint, TOPIC.encode()) as sub:
        await complete(http, engine.base_url, text)
        async with http.post(engine.base_url + "/reset_prefix_cache") as response:
            assert 200 == response.status
        await complete(http, engine.base_url, text)
        batches = await sub.batches_until(lambda bs: len(bs) >= 2, WAIT_S, "two batches")
    first, second = batches
    assert [BlockStored] == [type(event) for event in first.events]
    assert [AllBlocksCleared, BlockStored] == [type(event) for event in second.events]
    # The same blocks are stored again: the cache had forgotten them.
    assert first.events[0] == second.events[1]
    assert [16, 16] == [event.block_size for event in stored([first, second])]


async def test_kv_event_sources_reports_the_configuration_in_force(
    sim_engine: StartEngine, http: aiohttp.ClientSession, ipc_dir: Path
) -> None:
    """GET /kv_event_sources answers vLLM 0.32's shape: the config per data-parallel rank."""
    endpoint = f"ipc://{ipc_dir}/kv.ipc"
    engine = await sim_engine(
        "vllm", "--model", "m", "--kv-events-config", kv_config(endpoint, hwm=5)
    )
    plain = await sim_engine("vllm", "--model", "m")
    async with http.get(engine.base_url + "/kv_event_sources") as response:
        assert 200 == response.status
        body = await response.json()
    async with http.get(plain.base_url + "/kv_event_sources") as response:
        off = await response.json()
    expected = {
        "0": {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": endpoint,
            "replay_endpoint": None,
            "buffer_steps": 10000,
            "hwm": 5,
            "max_queue_size": 100000,
            "topic": TOPIC,
        }
    }
    assert (expected, {}) == (body, off)


async def test_a_concrete_tcp_endpoint_connects_to_a_binding_subscriber(
    sim_engine: StartEngine, http: aiohttp.ClientSession
) -> None:
    """With tcp://127.0.0.1:PORT the engine connects (vLLM's rule), so the subscriber binds."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    with KvSubscriber.bind(endpoint, b"") as sub:
        engine = await sim_engine("vllm", "--model", "m", "--kv-events-config", kv_config(endpoint))

        sent = itertools.count()

        async def published() -> bool:
            # Batches before the connection are lost (as with vLLM): new prompts until one arrives.
            await complete(http, engine.base_url, prompt(f"p{next(sent)}x", BLOCK))
            return bool(sub.drain())

        await eventually(published, WAIT_S, "a batch over tcp")
    assert isinstance(sub.batches[0].events[0], BlockStored)


async def test_the_replay_endpoint_sends_the_backlog_then_the_end(
    sim_engine: StartEngine, http: aiohttp.ClientSession, ipc_dir: Path
) -> None:
    """A DEALER on replay_endpoint gets every buffered batch from a sequence number on, then -1."""
    endpoint, replay = f"ipc://{ipc_dir}/kv.ipc", f"ipc://{ipc_dir}/replay.ipc"
    engine = await sim_engine(
        "vllm",
        "--model", "m",
        "--block-size", "16",
        "--kv-events-config", kv_config(endpoint, replay_endpoint=replay),
    )  # fmt: skip
    # Nobody subscribes: the batches are published to no one, and kept for replay.
    for name in ("a", "b", "c"):
        await complete(http, engine.base_url, prompt(name, 20))
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    answers: list[EventBatch | None] = []

    def ended() -> bool:
        # Never a blocking read: the engine answers from this test's event loop.
        while dealer.poll(0):
            answers.append(decode_replay_frame(dealer.recv_multipart(), topic=TOPIC.encode()))
        return bool(answers) and answers[-1] is None

    try:
        dealer.connect(replay)
        dealer.send_multipart(replay_request(1))
        await eventually(ended, WAIT_S, "the end of the replay")
    finally:
        dealer.close(linger=0)
        context.term()
    assert [1, 2, None] == [batch and batch.seq for batch in answers]
    assert all(isinstance(batch.events[0], BlockStored) for batch in answers[:-1] if batch)


@pytest.mark.parametrize(
    ("endpoint", "expected"),
    [
        ("tcp://*:5557", True),
        ("tcp://[::]:5557", True),
        ("ipc:///run/kv.ipc", True),
        ("inproc://kv", True),
        ("tcp://127.0.0.1:5557", False),
        ("tcp://10.0.0.1:5557", False),
    ],
)
def test_the_publisher_binds_only_where_vllm_binds(endpoint: str, expected: bool) -> None:
    """Wildcards and local transports bind; a concrete tcp address connects."""
    assert expected == binds(endpoint)


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--kv-events-config", "{nope"], {}, "--kv-events-config: not JSON"),
        (["--kv-events-config", "[]"], {}, "expected a JSON object"),
        (["--kv-events-config", '{"hwm": "lots"}'], {}, "--kv-events-config: hwm"),
        (["--kv-events-config", '{"colour": 1}'], {}, "--kv-events-config: colour"),
        (["--kv-events-config", '{"publisher": "kafka"}'], {}, "--kv-events-config: publisher"),
        ([], {"CARAVAN_SIM_KV_EVENTS_ENCODING": "json"}, "map or array, got 'json'"),
        ([], {"VLLM_SERVER_DEV_MODE": "yes"}, "VLLM_SERVER_DEV_MODE"),
    ],
)
def test_bad_kv_event_settings_name_the_field(
    args: list[str], env: dict[str, str], message: str
) -> None:
    """A KV-events config vLLM would refuse is a flag error naming the field."""
    with pytest.raises(FlagError, match=message.replace("[", r"\[")):
        parse_engine_args(["--flavor", "vllm", "--model", "m", *args], env=env)


def test_kv_events_are_off_by_default() -> None:
    """Without --kv-events-config the settings hold vLLM's defaults, publishing nothing."""
    settings = parse_engine_args(["--flavor", "vllm", "--model", "m"], env={})
    assert (False, "null", "tcp://*:5557", "map") == (
        settings.kv_events.enable_kv_cache_events,
        settings.kv_events.resolved_publisher,
        settings.kv_events.endpoint,
        settings.kv_events_encoding,
    )
