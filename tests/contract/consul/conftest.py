"""The Consul the contract tests talk to: devcluster in-process, or a real agent.

Without CARAVAN_REAL_CONSUL the fixture starts devcluster's Consul in the
test's event loop (short session TTL floor and reaper period so tests stay
quick) and stops it afterwards. With CARAVAN_REAL_CONSUL=1 the same tests
run against the agent at CONSUL_HTTP_ADDR (e.g. `consul agent -dev`; DNS on
CARAVAN_DNS_PORT, default 8600), which must run without ACLs, as
`consul agent -dev` does by default. Tests of devcluster-only extensions skip
there, saying so.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Iterator

import consul
import consul.aio
import pytest
from consul_helpers import REAL, HealthTarget, Target, devcluster_config

from caravan_llm.devcluster.consul.server import ConsulServer


@pytest.fixture
async def target() -> AsyncIterator[Target]:
    if REAL:
        address = os.environ.get("CONSUL_HTTP_ADDR", "127.0.0.1:8500").split("://")[-1]
        host, _, port = address.rpartition(":")
        yield Target(
            host=host,
            port=int(port),
            dns_port=int(os.environ.get("CARAVAN_DNS_PORT", "8600")),
            server=None,
            session_ttl_s=10.0,
        )
        return
    async with ConsulServer(devcluster_config()) as server:
        yield Target(
            host=server.config.host,
            port=server.http_port,
            dns_port=server.dns_port,
            server=server,
            session_ttl_s=1.0,
        )


@pytest.fixture
async def aio(target: Target) -> AsyncIterator[consul.aio.Consul]:
    client = consul.aio.Consul(host=target.host, port=target.port)
    client.token = None
    yield client
    await client.close()


@pytest.fixture
def sync_client(target: Target) -> Iterator[consul.Consul]:
    """py-consul's sync client; call it through asyncio.to_thread (the server shares our loop)."""
    client = consul.Consul(host=target.host, port=target.port)
    client.token = None
    yield client
    client.http.close()


@pytest.fixture
def unique() -> str:
    """A suffix that keeps names apart between tests (and from a real agent's leftovers)."""
    return uuid.uuid4().hex[:8]


@pytest.fixture
async def health_target() -> AsyncIterator[HealthTarget]:
    server = HealthTarget()
    await server.start()
    yield server
    await server.stop()
