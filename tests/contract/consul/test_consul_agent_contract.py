"""Agent endpoints (/v1/agent/*) through py-consul, as caravan and Nomad use them."""

from __future__ import annotations

import asyncio
import json

import consul
import pytest
from consul_helpers import HealthTarget, Target, eventually, raw_request


async def _check(aio, check_id: str) -> dict:
    checks = await aio.agent.checks()
    return checks.get(check_id, {})


async def test_registered_service_is_listed_by_agent_and_catalog(aio, unique):
    """A registered service shows in agent/services and catalog/services with its tags."""
    name = f"web-{unique}"
    registered = await aio.agent.service.register(
        name, service_id=f"{name}-1", port=8080, tags=["a", "b"], meta={"k": "v"}
    )
    services = await aio.agent.services()
    _, catalog = await aio.catalog.services()
    assert registered is True
    assert {"ID": f"{name}-1", "Service": name, "Port": 8080, "Tags": ["a", "b"]} == {
        k: services[f"{name}-1"][k] for k in ("ID", "Service", "Port", "Tags")
    }
    assert {"k": "v"} == services[f"{name}-1"]["Meta"]
    assert ["a", "b"] == catalog[name]


async def test_sync_client_registers_and_deregisters(sync_client, unique):
    """The sync py-consul client can register, read back and deregister a service."""
    name = f"sync-{unique}"
    await asyncio.to_thread(sync_client.agent.service.register, name, port=9000)
    before = await asyncio.to_thread(sync_client.agent.services)
    removed = await asyncio.to_thread(sync_client.agent.service.deregister, name)
    after = await asyncio.to_thread(sync_client.agent.services)
    assert 9000 == before[name]["Port"]
    assert removed is True
    assert name not in after


async def test_deregistering_an_unknown_service_is_404(target: Target, unique):
    """Deregistering an id the agent does not know answers 404 with Consul's hint."""
    status, body, _ = await raw_request(
        target, "PUT", f"/v1/agent/service/deregister/nope-{unique}"
    )
    assert 404 == status
    assert f'Unknown service ID "nope-{unique}". Ensure that the service ID is passed' in body


async def test_new_checks_start_critical_unless_status_given(aio, unique):
    """A check without Status starts critical; one with Status starts there."""
    name = f"svc-{unique}"
    await aio.agent.service.register(
        name,
        check=consul.Check.ttl("30s"),
        extra_checks=[{"TTL": "30s", "Status": "passing", "CheckID": f"{name}-ok"}],
    )
    checks = await aio.agent.checks()
    assert "critical" == checks[f"service:{name}:1"]["Status"]
    assert "passing" == checks[f"{name}-ok"]["Status"]


async def test_ttl_updates_set_status_and_output(aio, unique):
    """TTL pass/warn/fail set the check status and use the note as output."""
    name = f"ttl-{unique}"
    await aio.agent.service.register(name, check=consul.Check.ttl("30s"))
    seen = []
    for verb, method in (
        ("passing", aio.agent.check.ttl_pass),
        ("warning", aio.agent.check.ttl_warn),
        ("critical", aio.agent.check.ttl_fail),
    ):
        await method(f"service:{name}", notes=f"now {verb}")
        check = await _check(aio, f"service:{name}")
        seen.append((check["Status"], check["Output"]))
    assert [
        ("passing", "now passing"),
        ("warning", "now warning"),
        ("critical", "now critical"),
    ] == seen


async def test_check_update_endpoint_sets_status_and_output(aio, target: Target, unique):
    """PUT /v1/agent/check/update/:id sets status and output from a JSON body."""
    name = f"upd-{unique}"
    await aio.agent.service.register(name, check=consul.Check.ttl("30s"))
    status, _, _ = await raw_request(
        target,
        "PUT",
        f"/v1/agent/check/update/service:{name}",
        body=json.dumps({"Status": "warning", "Output": "slow"}),
    )
    check = await _check(aio, f"service:{name}")
    assert 200 == status
    assert ("warning", "slow") == (check["Status"], check["Output"])


async def test_ttl_check_expires_to_critical(aio, unique):
    """A TTL check that is not updated within its TTL turns critical with 'TTL expired'."""
    name = f"exp-{unique}"
    await aio.agent.service.register(name, check=consul.Check.ttl("1s"))
    await aio.agent.check.ttl_pass(f"service:{name}", notes="alive")

    async def expired():
        check = await _check(aio, f"service:{name}")
        return check if check.get("Status") == "critical" else None

    check = await eventually(expired, timeout_s=4)
    assert check["Output"].startswith("TTL expired")


async def test_reregistration_keeps_check_status(aio, unique):
    """Registering the same service again keeps the current status of its checks."""
    name = f"rereg-{unique}"
    await aio.agent.service.register(name, port=1, check=consul.Check.ttl("30s"))
    await aio.agent.check.ttl_pass(f"service:{name}")
    await aio.agent.service.register(name, port=2, check=consul.Check.ttl("30s"))
    check = await _check(aio, f"service:{name}")
    services = await aio.agent.services()
    assert "passing" == check["Status"]
    assert 2 == services[name]["Port"]


async def test_replace_existing_checks_drops_checks_not_in_the_request(aio, unique):
    """With ?replace-existing-checks the service's checks become exactly the new list."""
    name = f"repl-{unique}"
    await aio.agent.service.register(
        name,
        check={"TTL": "30s", "CheckID": f"{name}-a"},
        extra_checks=[{"TTL": "30s", "CheckID": f"{name}-b"}],
    )
    await aio.agent.service.register(
        name, check={"TTL": "30s", "CheckID": f"{name}-a"}, replace_existing_checks=True
    )
    checks = await aio.agent.checks()
    assert {f"{name}-a"} == {c for c in checks if c.startswith(name)}


async def test_service_maintenance_adds_and_removes_a_critical_check(aio, unique):
    """Maintenance mode adds a critical _service_maintenance check; disabling removes it."""
    name = f"maint-{unique}"
    await aio.agent.service.register(name)
    await aio.agent.service.maintenance(name, "true", reason="upgrading")
    during = await _check(aio, f"_service_maintenance:{name}")
    await aio.agent.service.maintenance(name, "false")
    after = await aio.agent.checks()
    assert ("critical", "upgrading") == (during["Status"], during["Notes"])
    assert f"_service_maintenance:{name}" not in after


async def test_http_check_probes_the_registered_url(aio, health_target: HealthTarget, unique):
    """An HTTP check runs at its interval: 2xx passing, 429 warning, other codes critical."""
    name = f"http-{unique}"
    await aio.agent.service.register(
        name, port=health_target.port, check=consul.Check.http(health_target.url, "1s")
    )
    check_id = f"service:{name}"

    async def status_is(wanted: str):
        check = await _check(aio, check_id)
        return check if check.get("Status") == wanted else None

    passing = await eventually(lambda: status_is("passing"), timeout_s=5)
    health_target.status = 429
    await eventually(lambda: status_is("warning"), timeout_s=5)
    health_target.status = 503
    await eventually(lambda: status_is("critical"), timeout_s=5)
    assert f"HTTP GET {health_target.url}: 200 OK Output: ok" == passing["Output"]


async def test_http_check_to_a_closed_port_is_critical(aio, health_target: HealthTarget, unique):
    """An HTTP check whose target refuses connections is critical with Go's dial error."""
    url = health_target.url
    await health_target.stop()
    name = f"down-{unique}"
    await aio.agent.service.register(name, check=consul.Check.http(url, "1s"), extra_checks=[])

    async def with_output():
        check = await _check(aio, f"service:{name}")
        return check if check.get("Output") else None

    check = await eventually(with_output, timeout_s=5)
    assert "critical" == check["Status"]
    assert "connection refused" in check["Output"]


async def test_node_level_check_register_and_deregister(aio, unique):
    """agent/check/register adds a node check; deregister removes it."""
    check_id = f"node-check-{unique}"
    await aio.agent.check.register(
        f"disk {unique}", check=consul.Check.ttl("30s"), check_id=check_id
    )
    during = await _check(aio, check_id)
    await aio.agent.check.deregister(check_id)
    after = await aio.agent.checks()
    assert ("critical", "") == (during["Status"], during["ServiceID"])
    assert check_id not in after


async def test_agent_self_and_members(aio):
    """agent/self names the datacenter and node; agent/members lists that node alive."""
    me = await aio.agent.self()
    members = await aio.agent.members()
    names = {m["Name"]: m["Status"] for m in members}
    assert "dc1" == me["Config"]["Datacenter"]
    assert 1 == names[me["Config"]["NodeName"]]


async def test_agent_service_by_id(aio, target: Target, unique):
    """agent/service/:id returns the service with a ContentHash; unknown ids are 404."""
    name = f"one-{unique}"
    await aio.agent.service.register(name, port=7000)
    service = await aio.agent.service_definition(name)
    status, body, _ = await raw_request(target, "GET", f"/v1/agent/service/nope-{unique}")
    assert (name, 7000) == (service["Service"], service["Port"])
    assert service["ContentHash"]
    assert (404, f"unknown service ID: nope-{unique}") == (status, body)


async def test_critical_service_is_reaped_after_deregister_critical_service_after(
    target: Target, aio, unique
):
    """A service critical for longer than DeregisterCriticalServiceAfter is removed."""
    target.devcluster()  # the reaper floor (1m) and period (30s) are shortened here only
    name = f"reap-{unique}"
    await aio.agent.service.register(
        name, check={"TTL": "30s", "DeregisterCriticalServiceAfter": "1s"}
    )

    async def gone():
        return name not in await aio.agent.services()

    assert await eventually(gone, timeout_s=6)


async def test_devcluster_node_header_scopes_agent_endpoints(target: Target, aio, unique):
    """X-Devcluster-Node makes agent endpoints act on that node's local agent."""
    server = target.devcluster()
    node = f"n-{unique}"
    server.register_node(node, "127.0.0.9")
    header = {"X-Devcluster-Node": node}
    status, _, _ = await raw_request(
        target,
        "PUT",
        "/v1/agent/service/register",
        body=json.dumps({"Name": f"s-{unique}", "Port": 1}),
        headers=header,
    )
    _, own, _ = await raw_request(target, "GET", "/v1/agent/services", headers=header)
    _, entries = await aio.health.service(f"s-{unique}")
    server_services = await aio.agent.services()
    assert 200 == status
    assert [f"s-{unique}"] == list(json.loads(own))
    assert [(node, "127.0.0.9")] == [(e["Node"]["Node"], e["Node"]["Address"]) for e in entries]
    assert f"s-{unique}" not in server_services


@pytest.mark.parametrize("verb", ["pass", "warn", "fail"])
async def test_ttl_update_of_unknown_check_is_404(target: Target, verb, unique):
    """TTL updates for a check the agent does not know answer 404 naming the check."""
    status, body, _ = await raw_request(target, "PUT", f"/v1/agent/check/{verb}/nope-{unique}")
    assert 404 == status
    assert f'Unknown check ID "nope-{unique}"' in body
