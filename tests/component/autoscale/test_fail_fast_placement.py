"""Fail fast with the reason when a replica can never be placed (devcluster, simulated vLLM).

devcluster's GPU nodes carry H100s only, so a replica asking for an L4 is
filtered out on every node: no freed capacity would place it. The scheduler
records it, and a request held for the model's cold start gets a 503 that
says so instead of waiting out the router's cold-start hold.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from test_fail_fast import router_lists_the_model

from caravan_llm.cli.local_stack import LocalStack, StackOptions, local_stack
from caravan_llm.common.contract import KVLayout
from caravan_llm.router.settings import RouterSettings
from caravan_llm.scheduler.model_store import ModelStore
from caravan_llm.scheduler.profiles import ModelProfile

NAME = "wrong-gpu"


@pytest.fixture
async def stack(tmp_path: Path) -> AsyncIterator[LocalStack]:
    options = StackOptions(
        prefer_real_llama_server=False,
        cpu_nodes=1,
        gpu_nodes=1,
        gpus_per_node=2,
        autoscale=True,
        autoscale_tick_s=1.0,
        work_dir=tmp_path,
        resync_s=1.0,
        router=RouterSettings(port=0, log_level="warning"),
    )
    async with local_stack(options) as running:
        yield running


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_a_gpu_class_no_node_has_answers_503_naming_it(stack: LocalStack):
    """min 0, an L4 replica on an H100-only cluster: the held request learns why within 60 s."""
    profile = ModelProfile.model_validate(
        {
            "name": NAME,
            "model": "sim/l4",
            "engine": "vllm",
            "gpu": {"class": "l4", "count": 1},
            "replicas": {"min": 0, "max": 1, "initial": 0},
            "autoscaling": {"target_inflight": 2, "scale_to_zero_after_s": 300},
        }
    )
    await ModelStore(stack.scheduler.consul, KVLayout()).submit([profile])
    await router_lists_the_model(stack, NAME)
    assert stack.router is not None
    body = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

    started = time.monotonic()
    async with (
        aiohttp.ClientSession(
            headers=stack.router.headers, timeout=aiohttp.ClientTimeout(total=90)
        ) as session,
        session.post(f"{stack.router.base_url}/v1/chat/completions", json=body) as response,
    ):
        document = await response.json(content_type=None)
        status, retry_after = response.status, response.headers.get("Retry-After")
    took_s = time.monotonic() - started

    assert (503, "model_unavailable") == (status, document["error"]["code"]), document
    assert took_s < 60
    assert retry_after == "10"
    assert (
        f"Model '{NAME}' is unavailable: replica 0: cannot be placed: no node has 1 free L4 "
        "(2 nodes have no matching GPU" in document["error"]["message"]
    )
