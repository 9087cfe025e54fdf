"""A vLLM replica as the scheduler renders it, on devcluster: the engine publishes its KV events
on an ipc socket in the allocation, the group's kv-relay task serves their digests on the `kv`
port, and the placements routers trust carry that port (issue 24, rendering and endpoint proof).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from polling import eventually

from caravan_llm.cli.local_stack import LocalStack, StackOptions, local_stack
from caravan_llm.common.contract import (
    ENGINE_KEY_ITEM,
    KV_PORT_LABEL,
    KVLayout,
    Placements,
    decode_placements,
    engine_key_path,
    model_service_name,
)
from caravan_llm.common.kv_stream import STREAM_PATH, KvDelta, KvSnapshot, SseDecoder
from caravan_llm.scheduler.model_store import ModelStore
from caravan_llm.scheduler.profiles import ModelProfile, load_profile

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples/profiles/qwen-vllm-h100.yaml"
WAIT_S = 60.0
# Far more words than one of the simulated vLLM's 128-token blocks.
LONG_PROMPT = " ".join(f"word{n}" for n in range(400))


def vllm_profile() -> ModelProfile:
    """The example vLLM profile, one replica, a fast simulated load, no autoscaler."""
    document = load_profile(EXAMPLE).model_dump(mode="json", by_alias=True, exclude_none=True)
    document.pop("autoscaling")
    document.update(
        replicas={"min": 1, "max": 1, "initial": 1},
        env={**document["env"], "CARAVAN_SIM_LOAD_SECONDS": "0.5"},
        startup_timeout_s=60,
    )
    return ModelProfile.model_validate(document)


async def placements(stack: LocalStack, model: str) -> Placements | None:
    key = KVLayout().placements_key(model)
    _, entry = await stack.scheduler.consul.kv_get(key)
    return None if entry is None else decode_placements(entry.value, key=key, model=model)


async def nomad_ports(stack: LocalStack, alloc_id: str) -> dict[str, Any]:
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"{stack.nomad_addr}/v1/allocation/{alloc_id}") as response,
    ):
        assert 200 == response.status
        alloc = await response.json()
    ports = alloc["AllocatedResources"]["Shared"]["Ports"]
    return {port["Label"]: port for port in ports}


@contextlib.asynccontextmanager
async def stream(
    http: aiohttp.ClientSession, url: str, key: str
) -> AsyncIterator[list[KvSnapshot | KvDelta]]:
    """The relay's digest stream, read in the background into a list (heartbeats left out)."""
    received: list[KvSnapshot | KvDelta] = []

    async def read() -> None:
        decoder = SseDecoder()
        async with http.get(url, headers={"Authorization": f"Bearer {key}"}) as response:
            assert 200 == response.status
            async for chunk in response.content.iter_any():
                received.extend(
                    m for m in decoder.feed(chunk) if isinstance(m, KvSnapshot | KvDelta)
                )

    task = asyncio.create_task(read())
    try:
        await eventually(lambda: received or task.done(), WAIT_S, "the stream's snapshot")
        if task.done():
            task.result()
        yield received
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@pytest.mark.slow
async def test_a_vllm_replica_serves_its_kv_digests_from_its_allocation(tmp_path: Path) -> None:
    """Served as before; placements carry the relay's port; its stream follows the engine."""
    options = StackOptions(
        prefer_real_llama_server=False,
        cpu_nodes=1,
        gpu_nodes=1,
        gpus_per_node=2,
        autoscale=False,
        work_dir=tmp_path,
        resync_s=2.0,
    )
    profile = vllm_profile()
    async with local_stack(options) as stack:
        await ModelStore(stack.scheduler.consul, KVLayout()).submit([profile])
        consul = stack.scheduler.consul

        async def passing() -> Any:
            _, entries = await consul.health_service(model_service_name(profile.name), passing=True)
            return entries[0] if entries else None

        entry = await eventually(passing, 90, "a passing replica")

        async def placed() -> Placements | None:
            found = await placements(stack, profile.name)
            return found if found is not None and found.allocations else None

        allocation = (await eventually(placed, WAIT_S, "the replica's placements")).allocations[0]
        # The endpoint proof: the relay's port is Nomad's `kv` port at the engine's address.
        ports = await nomad_ports(stack, allocation.alloc_id)
        assert (entry.address, entry.port) == (allocation.address, allocation.port)
        assert (ports[KV_PORT_LABEL]["HostIP"], ports[KV_PORT_LABEL]["Value"]) == (
            allocation.address,
            allocation.kv_port,
        )

        variable = await stack.scheduler.nomad.get_variable(engine_key_path(profile.name))
        assert variable is not None
        key = str(variable.items[ENGINE_KEY_ITEM])
        engine = f"http://{allocation.address}:{allocation.port}"
        relay = f"http://{allocation.address}:{allocation.kv_port}"
        timeout = aiohttp.ClientTimeout(total=WAIT_S)
        async with aiohttp.ClientSession(timeout=timeout) as http:

            async def connected() -> bool:
                async with http.get(f"{relay}/health") as response:
                    return response.status == 200 and (await response.json())["engine_connected"]

            await eventually(connected, WAIT_S, "the relay connected to its engine's events")

            # The engine publishes on the allocation's ipc socket only, never tcp://*.
            async with http.get(f"{engine}/kv_event_sources") as response:
                sources = await response.json()
            endpoints = [
                source[name]
                for source in sources.values()
                for name in ("endpoint", "replay_endpoint")
            ]
            assert endpoints
            assert all(e.startswith("ipc://") and e.endswith(".ipc") for e in endpoints)

            async with http.get(f"{relay}{STREAM_PATH}") as response:
                assert 401 == response.status

            async with stream(http, f"{relay}{STREAM_PATH}", key) as received:
                assert isinstance(received[0], KvSnapshot)
                chat = {
                    "model": profile.served_name,
                    "messages": [{"role": "user", "content": LONG_PROMPT}],
                    "max_tokens": 2,
                }
                headers = {"Authorization": f"Bearer {key}"}
                async with http.post(
                    f"{engine}/v1/chat/completions", json=chat, headers=headers
                ) as response:
                    assert 200 == response.status

                def added() -> KvDelta | None:
                    return next((m for m in received if isinstance(m, KvDelta) and m.added), None)

                delta = await eventually(added, WAIT_S, "a delta adding the prompt's blocks")
        # The simulated vLLM's blocks (its CPU build's 128 tokens), learned from the events.
        assert 128 == delta.block_size
