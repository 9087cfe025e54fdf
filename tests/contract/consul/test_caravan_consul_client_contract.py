"""caravan_llm.common.consul_api.ConsulClient against the Consul target: typed results, mapped
errors."""

from __future__ import annotations

import asyncio
import socket

import pytest
from consul_helpers import HealthTarget, Target, eventually

from caravan_llm.common.consul_api import (
    ConsulClient,
    ConsulSettings,
    HttpCheck,
    ServiceRegistration,
    TtlCheck,
)
from caravan_llm.common.errors import HashiBadRequest, HashiNotFound, HashiUnavailable


@pytest.fixture
async def client(target: Target):
    async with ConsulClient(ConsulSettings(host=target.host, port=target.port)) as opened:
        yield opened


async def test_register_and_read_health_entries(client: ConsulClient, unique):
    """A registration with a TTL check reads back as typed entries with aggregated status."""
    name = f"cc-{unique}"
    await client.agent_service_register(
        ServiceRegistration(
            name=name,
            service_id=f"{name}-0",
            address="127.0.0.5",
            port=8000,
            tags=("caravan", "x"),
            meta={"engine": "llamacpp"},
            checks=(TtlCheck(ttl_s=60, check_id=f"{name}-ttl"),),
        )
    )
    _, critical = await client.health_service(name)
    await client.agent_check_warn(f"{name}-ttl", note="slow")
    _, warning = await client.health_service(name, tags=("caravan",))
    _, passing_only = await client.health_service(name, passing=True)
    await client.agent_check_pass(f"{name}-ttl")
    index, passing = await client.health_service(name, passing=True)
    entry = passing[0]
    assert ["critical"] == [e.status for e in critical]
    assert ["warning"] == [e.status for e in warning]
    assert () == passing_only
    assert (f"{name}-0", "127.0.0.5", 8000, ("caravan", "x"), "llamacpp") == (
        entry.service_id,
        entry.address,
        entry.port,
        entry.tags,
        entry.meta["engine"],
    )
    assert index >= 1


async def test_http_check_registration_runs(
    client: ConsulClient, health_target: HealthTarget, unique
):
    """An HttpCheck registered through the adapter is probed and turns passing."""
    name = f"cchttp-{unique}"
    await client.agent_service_register(
        ServiceRegistration(
            name=name, port=health_target.port, checks=(HttpCheck(health_target.url, 1, 1),)
        )
    )

    async def passing():
        _, entries = await client.health_service(name, passing=True)
        return entries

    entries = await eventually(passing, timeout_s=5)
    assert "passing" == entries[0].status


async def test_agent_errors_map_to_caravan_errors(client: ConsulClient, unique):
    """Unknown checks and services are HashiNotFound; an invalid registration HashiBadRequest."""
    with pytest.raises(HashiNotFound):
        await client.agent_check_pass(f"nope-{unique}")
    with pytest.raises(HashiNotFound):
        await client.agent_service_maintenance(f"nope-{unique}", enable=True)
    with pytest.raises(HashiBadRequest) as bad:
        await client.agent_service_register(ServiceRegistration(name=""))
    assert await client.agent_service_deregister(f"nope-{unique}") is False
    assert (400, True) == (bad.value.status, "Missing service name" in str(bad.value))


async def test_maintenance_and_deregister(client: ConsulClient, unique):
    """Maintenance makes an instance critical; deregistering removes it."""
    name = f"ccm-{unique}"
    await client.agent_service_register(ServiceRegistration(name=name))
    await client.agent_service_maintenance(name, enable=True, reason="drain")
    _, during = await client.health_service(name)
    removed = await client.agent_service_deregister(name)
    _, after = await client.health_service(name)
    assert ["critical"] == [e.status for e in during]
    assert removed is True
    assert () == after


async def test_kv_operations(client: ConsulClient, unique):
    """KV get/put/cas/keys/recurse/delete through the adapter."""
    prefix = f"cc/{unique}/"
    assert await client.kv_put(prefix + "a", b"1", flags=7)
    assert await client.kv_put(prefix + "b/c", "2")
    _, entry = await client.kv_get(prefix + "a")
    _, missing = await client.kv_get(prefix + "zzz")
    assert entry is not None
    stale = await client.kv_put(prefix + "a", b"x", cas=entry.modify_index - 1)
    fresh = await client.kv_put(prefix + "a", b"3", cas=entry.modify_index)
    _, keys = await client.kv_keys(prefix, separator="/")
    _, entries = await client.kv_get_recurse(prefix)
    deleted = await client.kv_delete(prefix, recurse=True)
    _, after = await client.kv_get_recurse(prefix)
    assert (b"1", 7) == (entry.value, entry.flags)
    assert missing is None
    assert (False, True) == (stale, fresh)
    assert (prefix + "a", prefix + "b/") == keys
    assert [b"3", b"2"] == [e.value for e in entries]
    assert deleted is True
    assert () == after


async def test_kv_blocking_get(client: ConsulClient, unique):
    """kv_get with index and wait_s blocks until the key changes."""
    key = f"cc/{unique}/block"
    await client.kv_put(key, b"v1")
    index, _ = await client.kv_get(key)

    reader = asyncio.create_task(client.kv_get(key, index=index, wait_s=5))
    # Not a wait: with nothing written for 0.2 s the read must still be blocked.
    await asyncio.sleep(0.2)
    blocked = not reader.done()
    await client.kv_put(key, b"v2")
    new_index, entry = await reader
    assert blocked
    assert entry is not None
    assert b"v2" == entry.value
    assert new_index > index


async def test_sessions_and_locks(client: ConsulClient, target: Target, unique):
    """Sessions can be created, renewed, used for a lock, destroyed; gone sessions are NotFound."""
    key = f"cc/{unique}/lock"
    session_id = await client.session_create(
        name="cc", ttl_s=max(target.session_ttl_s, 10), lock_delay_s=0
    )
    renewed = await client.session_renew(session_id)
    _, info = await client.session_info(session_id)
    acquired = await client.kv_put(key, b"me", acquire=session_id)
    _, held = await client.kv_get(key)
    await client.session_destroy(session_id)
    _, released = await client.kv_get(key)
    assert info is not None
    assert (session_id, "cc", 0.0) == (renewed.session_id, info.name, info.lock_delay_s)
    assert acquired is True
    assert held is not None
    assert session_id == held.session
    assert released is not None
    assert released.session is None
    with pytest.raises(HashiNotFound):
        await client.session_renew(session_id)
    with pytest.raises(HashiNotFound):
        await client.kv_put(key, b"me", acquire=session_id)


async def test_session_ttl_below_minimum_is_a_bad_request(client: ConsulClient):
    """A TTL under the agent's minimum is refused as HashiBadRequest (not retryable)."""
    with pytest.raises(HashiBadRequest) as refused:
        await client.session_create(name="short", ttl_s=0.001)
    assert refused.value.retryable is False


async def test_catalog_services_blocks(client: ConsulClient, unique):
    """catalog_services returns names with tags and blocks until the catalog changes."""
    index, before = await client.catalog_services()

    reader = asyncio.create_task(client.catalog_services(index=index, wait_s=5))
    # Not a wait: with nothing written for 0.2 s the read must still be blocked.
    await asyncio.sleep(0.2)
    blocked = not reader.done()
    await client.agent_service_register(ServiceRegistration(name=f"ccs-{unique}", tags=("t",)))
    new_index, after = await reader
    assert blocked
    assert "consul" in before
    assert ("t",) == after[f"ccs-{unique}"]
    assert new_index > index


async def test_unreachable_agent_is_unavailable():
    """A refused connection is HashiUnavailable (retryable)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    settings = ConsulSettings(host="127.0.0.1", port=port, request_timeout_s=2)
    async with ConsulClient(settings) as client:
        with pytest.raises(HashiUnavailable) as down:
            await client.kv_get("k")
    assert down.value.retryable is True
