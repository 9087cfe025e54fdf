"""A killed node is detected on Nomad's and Consul's real schedule (issue 16 item 10).

devcluster-only (killing a node is its fault injection). This module starts
its own Consul and Nomad with the default timings: Nomad's min_heartbeat_ttl
10 s (+ up to 10 s of stagger) and heartbeat_grace 10 s, so a dead node is
down 10-30 s after it dies; memberlist's LAN defaults, so Consul's serfHealth
turns critical seconds after (a probe round plus the 4-24 s suspicion).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from nomad_contract_support import DEVCLUSTER_ONLY, REAL, eventually, get_json

from caravan_llm.devcluster.consul.server import ConsulConfig, ConsulServer
from caravan_llm.devcluster.nomad.server import NomadServer
from caravan_llm.devcluster.nomad.settings import NodeSpec

pytestmark = [pytest.mark.slow, pytest.mark.skipif(REAL, reason=DEVCLUSTER_ONLY)]

GRACE_S = 10.0
MAX_TTL_S = 20.0


@pytest.fixture
async def cluster() -> AsyncIterator[tuple[ConsulServer, NomadServer]]:
    async with ConsulServer(ConsulConfig()) as consul:
        async with NomadServer(
            consul_addr=consul.http_addr, nodes=[NodeSpec(), NodeSpec()]
        ) as nomad:
            yield consul, nomad


async def test_kill_is_detected_after_the_real_delays(
    cluster: tuple[ConsulServer, NomadServer], http: aiohttp.ClientSession
) -> None:
    """serfHealth stays passing for seconds, then critical; Nomad waits TTL + grace."""
    consul, nomad = cluster
    consul_url = f"http://{consul.http_addr}"
    node = min(nomad.state.nodes.values(), key=lambda n: n.name)
    async with http.post(f"{nomad.address}/v1/devcluster/node/{node.id}/kill") as response:
        assert 200 == response.status
    killed_at = time.monotonic()

    async def serf_health() -> str:
        checks = await get_json(http, f"{consul_url}/v1/health/node/{node.name}")
        return str(next(c["Status"] for c in checks if c["CheckID"] == "serfHealth"))

    assert "passing" == await serf_health()
    async with http.get(
        f"{consul_url}/v1/agent/services", headers={"X-Devcluster-Node": node.name}
    ) as response:
        assert 503 == response.status  # the node's agent died with it
    assert "ready" == (await get_json(http, f"{nomad.address}/v1/node/{node.id}"))["Status"]

    async def critical() -> bool:
        return await serf_health() == "critical"

    await eventually(critical, timeout_s=30, interval_s=0.1)
    consul_s = time.monotonic() - killed_at

    async def down() -> dict[str, Any] | None:
        found = await get_json(http, f"{nomad.address}/v1/node/{node.id}")
        return found if found["Status"] == "down" else None

    await eventually(down, timeout_s=MAX_TTL_S + GRACE_S + 5, interval_s=0.1)
    nomad_s = time.monotonic() - killed_at
    timeline = f"kill -> Consul serfHealth critical {consul_s:.1f}s, -> Nomad down {nomad_s:.1f}s"
    print(timeline)  # noqa: T201 - the measured delays are the point of this test (pytest -s)
    assert 1.0 + 4.0 - 0.5 <= consul_s < 30.0
    assert GRACE_S - 0.5 <= nomad_s <= MAX_TTL_S + GRACE_S + 1.0
