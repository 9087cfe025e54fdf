"""Health entries from the Consul target keep every check with its ID, status and output,
and a service put into maintenance reads critical through the one aggregate status."""

from __future__ import annotations

import pytest
from consul_helpers import Target

from caravan_llm.common.consul_api import (
    CheckStatus,
    ConsulClient,
    ConsulSettings,
    ServiceRegistration,
    TtlCheck,
)


@pytest.fixture
async def client(target: Target):
    async with ConsulClient(ConsulSettings(host=target.host, port=target.port)) as opened:
        yield opened


async def test_entry_checks_keep_ids_status_and_output(client: ConsulClient, unique):
    """The service's check and the node's serfHealth both arrive, each with its own fields."""
    name = f"he-{unique}"
    check_id = f"{name}-ttl"
    await client.agent_service_register(
        ServiceRegistration(
            name=name,
            service_id=f"{name}-0",
            port=8000,
            checks=(TtlCheck(ttl_s=60, check_id=check_id),),
        )
    )
    try:
        await client.agent_check_warn(check_id, note="queue is deep")
        _, (entry,) = await client.health_service(name)
        by_id = {check.check_id: check for check in entry.checks}
        assert "serfHealth" in by_id
        assert ("", "passing") == (by_id["serfHealth"].service_id, by_id["serfHealth"].status)
        mine = by_id[check_id]
        assert (f"{name}-0", "warning", "queue is deep") == (
            mine.service_id,
            mine.status,
            mine.output,
        )
        assert CheckStatus.WARNING == entry.status

        await client.agent_service_maintenance(f"{name}-0", enable=True, reason="upgrade")
        _, (entry,) = await client.health_service(name)
        assert any(check.is_maintenance for check in entry.checks)
        assert CheckStatus.CRITICAL == entry.status
    finally:
        await client.agent_service_deregister(f"{name}-0")
