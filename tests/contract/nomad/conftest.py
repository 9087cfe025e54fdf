"""The Nomad the contract tests talk to: devcluster in-process, or a real agent.

Without CARAVAN_REAL_NOMAD the fixture starts devcluster's Nomad in the test's
event loop: two CPU nodes and one GPU node, no Consul. These tests are about
API answers, not detection timing, so Nomad's heartbeat TTL and grace are
shortened (0.5 s + 1 s instead of 10 s + 10 s); the heartbeat-timing tests
(test_nomad_heartbeat_contract.py) start their own server with the defaults.
With CARAVAN_REAL_NOMAD=1 the same tests run against the agent at NOMAD_ADDR
(e.g. `nomad agent -dev` with raw_exec enabled); tests of devcluster-only
behaviour skip there, saying so.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator

import aiohttp
import pytest
from nomad_contract_support import REAL, NomadTarget

from caravan_llm.devcluster.nomad.server import NomadServer
from caravan_llm.devcluster.nomad.settings import NodeSpec

HEARTBEAT_GRACE_S = 1.0
MIN_HEARTBEAT_TTL_S = 0.5


@pytest.fixture
async def target() -> AsyncIterator[NomadTarget]:
    if REAL:
        yield NomadTarget(
            address=os.environ.get("NOMAD_ADDR", "http://127.0.0.1:4646"), server=None
        )
        return
    nodes = [
        NodeSpec(),
        NodeSpec(),
        NodeSpec(gpus=2, node_class="gpu", memory_mb=262144),
    ]
    async with NomadServer(
        nodes=nodes, heartbeat_grace_s=HEARTBEAT_GRACE_S, min_heartbeat_ttl_s=MIN_HEARTBEAT_TTL_S
    ) as server:
        yield NomadTarget(address=server.address, server=server)


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


@pytest.fixture
def unique() -> str:
    """A job-id suffix that keeps tests apart (and apart from a real agent's leftovers)."""
    return uuid.uuid4().hex[:8]
