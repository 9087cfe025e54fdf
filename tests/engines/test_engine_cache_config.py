"""The simulated vLLM states its KV capacity in `vllm:cache_config_info`, as vLLM does."""

from __future__ import annotations

import aiohttp
from engine_test_support import StartEngine
from prometheus_client.parser import text_string_to_metric_families


async def test_cache_config_info_carries_the_kv_capacity(
    sim_engine: StartEngine, http: aiohttp.ClientSession
) -> None:
    """num_gpu_blocks and block_size labels give the KV capacity (real vLLM writes both)."""
    engine = await sim_engine(
        "vllm", "--model", "m", "--block-size", "32", "--num-gpu-blocks-override", "777"
    )
    async with http.get(engine.base_url + "/metrics") as response:
        text = await response.text()
    labels = [
        sample.labels
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "vllm:cache_config_info"
    ]
    assert len(labels) == 1
    assert (labels[0]["num_gpu_blocks"], labels[0]["block_size"]) == ("777", "32")
