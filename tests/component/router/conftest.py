"""Fixtures of the router component tests: devcluster Consul in-process, simulated engines."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import aiohttp
import pytest
from router_cluster import Engine, running_consul, start_engine

from caravan_llm.common.consul_api import ConsulClient
from caravan_llm.devcluster.consul.server import ConsulServer

MODEL = "tiny"


@pytest.fixture(scope="session")
def tiny_engines() -> Iterator[list[Engine]]:
    """Three simulated vLLM replicas of model `tiny` (20 ms per token, 16-token replies).

    Shared by the whole session (they start as processes, which takes a while);
    tests that kill or slow an engine start their own.
    """
    engines: list[Engine] = []
    try:
        engines.extend(
            start_engine(MODEL, max_num_seqs=256, sim={"step_seconds": "0.02"}) for _ in range(3)
        )
        yield engines
    finally:
        for engine in engines:
            engine.stop()


@pytest.fixture
async def consul_pair() -> AsyncIterator[tuple[ConsulServer, ConsulClient]]:
    async with running_consul() as pair:
        yield pair


@pytest.fixture
async def consul(consul_pair: tuple[ConsulServer, ConsulClient]) -> ConsulClient:
    return consul_pair[1]


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session
