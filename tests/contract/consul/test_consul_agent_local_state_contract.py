"""/v1/agent/* sees only the agent's own registrations (issue 16, item 4).

The `consul` service and each node's `serfHealth` check are written by the
servers (leader reconciliation and serf), not by any agent: they are in
/v1/catalog/* and /v1/health/*, never in /v1/agent/services or /v1/agent/checks,
and the agent endpoints that act on one service or check answer 404 for them.
"""

from __future__ import annotations

import json

import pytest
from consul_helpers import Target, raw_request

UNKNOWN_SERVICE = 'Unknown service ID "consul". Ensure that the service ID is passed'
UNKNOWN_CHECK = 'Unknown check ID "serfHealth". Ensure that the check ID is passed'


async def _agent_node_name(aio) -> str:
    me = await aio.agent.self()
    return str(me["Config"]["NodeName"])


async def test_agent_lists_hold_neither_the_consul_service_nor_serf_health(aio):
    """agent/services and agent/checks leave out what only the catalog holds."""
    services = await aio.agent.services()
    checks = await aio.agent.checks()
    node = await _agent_node_name(aio)
    _, catalog = await aio.catalog.service("consul")
    _, node_checks = await aio.health.node(node)
    assert "consul" not in services
    assert "serfHealth" not in checks
    assert ["consul"] == [entry["ServiceID"] for entry in catalog]
    assert "serfHealth" in {check["CheckID"] for check in node_checks}


async def test_agent_service_consul_is_unknown(target: Target):
    """GET /v1/agent/service/consul is 404 `unknown service ID: consul`."""
    status, text, _ = await raw_request(target, "GET", "/v1/agent/service/consul")
    assert (404, "unknown service ID: consul") == (status, text.strip())


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("/v1/agent/service/deregister/consul", UNKNOWN_SERVICE),
        ("/v1/agent/service/maintenance/consul?enable=true", UNKNOWN_SERVICE),
        ("/v1/agent/check/pass/serfHealth", UNKNOWN_CHECK),
        ("/v1/agent/check/warn/serfHealth", UNKNOWN_CHECK),
        ("/v1/agent/check/fail/serfHealth", UNKNOWN_CHECK),
        ("/v1/agent/check/deregister/serfHealth", UNKNOWN_CHECK),
    ],
)
async def test_agent_writes_to_catalog_only_rows_are_404(aio, target: Target, path, expected):
    """Deregistering, maintaining or updating the server-owned rows through an agent is a 404."""
    status, text, _ = await raw_request(target, "PUT", path)
    node = await _agent_node_name(aio)
    _, node_checks = await aio.health.node(node)
    _, catalog = await aio.catalog.service("consul")
    serf = next(check for check in node_checks if check["CheckID"] == "serfHealth")
    assert 404 == status
    assert text.startswith(expected), text
    assert ("passing", 1) == (serf["Status"], len(catalog))


async def test_check_update_of_serf_health_is_404(target: Target):
    """The PUT form of a TTL update is refused the same way."""
    body = json.dumps({"Status": "critical", "Output": "x"})
    status, text, _ = await raw_request(
        target, "PUT", "/v1/agent/check/update/serfHealth", body=body
    )
    assert 404 == status
    assert text.startswith(UNKNOWN_CHECK), text


async def test_agent_health_views_do_not_know_the_consul_service(target: Target):
    """agent/health/service by name and by id answer as for any service the agent lacks."""
    by_name = await raw_request(target, "GET", "/v1/agent/health/service/name/consul?format=text")
    by_id = await raw_request(target, "GET", "/v1/agent/health/service/id/consul?format=text")
    assert (404, "ServiceName consul Not Found") == (by_name[0], by_name[1].strip())
    assert (404, "ServiceId consul not found") == (by_id[0], by_id[1].strip())


async def test_check_registered_against_the_consul_service_is_refused(target: Target, unique):
    """A check cannot attach to the `consul` service through the agent: it is not the agent's."""
    body = json.dumps({"Name": f"c-{unique}", "TTL": "30s", "ServiceID": "consul"})
    status, text, _ = await raw_request(target, "PUT", "/v1/agent/check/register", body=body)
    assert (404, 'ServiceID "consul" does not exist') == (status, text.strip())


async def test_agent_created_maintenance_checks_are_listed(aio, unique):
    """Maintenance checks are the agent's own, so agent/checks shows them."""
    name = f"maint-{unique}"
    await aio.agent.service.register(name)
    await aio.agent.service.maintenance(name, "true", reason="test")
    await aio.agent.maintenance("true", reason="test")
    try:
        checks = await aio.agent.checks()
    finally:
        await aio.agent.maintenance("false")
        await aio.agent.service.deregister(name)
    assert {f"_service_maintenance:{name}", "_node_maintenance"} <= set(checks)


async def test_a_fresh_agent_lists_nothing(aio, target: Target):
    """On a fresh dev agent both agent lists are empty (devcluster's is fresh per test)."""
    target.devcluster()
    assert ({}, {}) == (await aio.agent.services(), await aio.agent.checks())


async def test_each_simulated_node_agent_lists_only_its_own(target: Target):
    """A simulated node's agent lists what was registered through it, not its serfHealth."""
    server = target.devcluster()
    server.register_node("n1")
    headers = {"X-Devcluster-Node": "n1"}
    fresh = [
        await raw_request(target, "GET", path, headers=headers)
        for path in ("/v1/agent/services", "/v1/agent/checks")
    ]
    body = json.dumps({"Name": "web", "Check": {"TTL": "30s"}})
    await raw_request(target, "PUT", "/v1/agent/service/register", body=body, headers=headers)
    _, services, _ = await raw_request(target, "GET", "/v1/agent/services", headers=headers)
    _, checks, _ = await raw_request(target, "GET", "/v1/agent/checks", headers=headers)
    assert [(200, {}), (200, {})] == [(status, json.loads(text)) for status, text, _ in fresh]
    assert ["web"] == list(json.loads(services))
    assert ["service:web"] == list(json.loads(checks))
