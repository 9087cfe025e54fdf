"""Locality is kept; Connect and Proxy are never silently dropped (issue 16, item 9).

Locality (Consul 1.17+) is stored and returned: `Locality` in agent, health and
catalog-node views, `ServiceLocality` in /v1/catalog/service, each part left out
when empty. devcluster emulates no service mesh, so a registration that asks
for one (a Connect or Proxy block with content, or a mesh Kind) is refused
with a 400 that says so; a real agent accepts those, so those tests are
devcluster-only. Zero-valued blocks decode to nothing in Go and register as a
plain service on both.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from consul_helpers import Target, raw_request

REGISTER = "/v1/agent/service/register"


async def _register(target: Target, **body: object) -> tuple[int, str]:
    status, text, _ = await raw_request(target, "PUT", REGISTER, body=json.dumps(body))
    return status, text


async def _views(aio, name: str) -> dict[str, dict[str, Any]]:
    agent = (await aio.agent.services())[name]
    _, health = await aio.health.service(name)
    _, catalog = await aio.catalog.service(name)
    _, node_view = await aio.catalog.node(catalog[0]["Node"])
    return {
        "agent": agent,
        "health": health[0]["Service"],
        "catalog": catalog[0],
        "node": node_view["Services"][name],
    }


async def test_locality_is_stored_and_returned_in_every_view(aio, target: Target, unique):
    """Locality comes back as sent: Locality in service views, ServiceLocality in the catalog."""
    name = f"loc-{unique}"
    locality = {"Region": "us-east-1", "Zone": "us-east-1a"}
    status, text = await _register(target, Name=name, Locality=locality)
    views = await _views(aio, name)
    await aio.agent.service.deregister(name)
    assert 200 == status, text
    assert [locality] * 3 == [views[v]["Locality"] for v in ("agent", "health", "node")]
    assert locality == views["catalog"]["ServiceLocality"]


async def test_locality_parts_are_omitted_when_empty(aio, target: Target, unique):
    """A Locality with only a Region shows only the Region; no Locality shows no key."""
    name, plain = f"locr-{unique}", f"locn-{unique}"
    await _register(target, Name=name, Locality={"region": "eu"})
    await _register(target, Name=plain)
    services = await aio.agent.services()
    _, catalog = await aio.catalog.service(plain)
    await aio.agent.service.deregister(name)
    await aio.agent.service.deregister(plain)
    assert {"Region": "eu"} == services[name]["Locality"]
    assert "Locality" not in services[plain]
    assert "ServiceLocality" not in catalog[0]


async def test_agent_services_filter_on_locality(aio, target: Target, unique):
    """api.AgentService's Locality is filterable: `Locality.Region == "eu"`."""
    eu, us = f"loce-{unique}", f"locu-{unique}"
    await _register(target, Name=eu, Locality={"Region": "eu"})
    await _register(target, Name=us, Locality={"Region": "us"})
    status, text, _ = await raw_request(
        target, "GET", "/v1/agent/services?filter=Locality.Region%20%3D%3D%20%22eu%22"
    )
    await aio.agent.service.deregister(eu)
    await aio.agent.service.deregister(us)
    assert 200 == status, text
    assert [eu] == [sid for sid in json.loads(text) if sid in (eu, us)]


async def test_wrongly_typed_locality_is_400(aio, target: Target, unique):
    """Locality must decode into {Region, Zone} strings."""
    name = f"locb-{unique}"
    status, text = await _register(target, Name=name, Locality={"Region": 1})
    services = await aio.agent.services()
    assert 400 == status
    assert text.startswith(
        "Request decode failed: json: cannot unmarshal number into Go struct field"
    ), text
    assert name not in services


@pytest.mark.parametrize(
    "extra",
    [
        {"Connect": {}},
        {"Connect": {"Native": False}},
        {"Connect": None, "Proxy": None},
        {"Proxy": {}},
    ],
)
async def test_zero_valued_connect_and_proxy_register_as_a_plain_service(
    aio, target: Target, unique, extra
):
    """Blocks that decode to Go's zero value change nothing: no Connect, no Proxy in the view."""
    name = f"zero-{unique}"
    status, text = await _register(target, Name=name, Port=80, **extra)
    service = (await aio.agent.services()).get(name, {})
    await aio.agent.service.deregister(name)
    assert 200 == status, text
    assert (name, set()) == (service.get("Service"), {"Connect", "Proxy"} & set(service))


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"Connect": {"Native": True}}, "Connect.Native"),
        ({"Connect": {"SidecarService": {}}}, "Connect.SidecarService"),
        ({"Connect": {"sidecar_service": {"Port": 21000}}}, "Connect.sidecar_service.Port"),
        ({"Proxy": {"DestinationServiceName": "web"}}, "Proxy.DestinationServiceName"),
        (
            {"Kind": "connect-proxy", "Port": 21000, "Proxy": {"DestinationServiceName": "web"}},
            'Kind "connect-proxy"',
        ),
        ({"Kind": "mesh-gateway", "Port": 8443}, 'Kind "mesh-gateway"'),
    ],
)
async def test_service_mesh_registrations_are_refused_clearly(
    aio, target: Target, unique, extra, named
):
    """devcluster answers 400 naming the field, and stores nothing, rather than pretend."""
    target.devcluster()
    name = f"mesh-{unique}"
    status, text = await _register(target, Name=name, **extra)
    services = await aio.agent.services()
    assert 400 == status
    assert text.startswith("devcluster does not emulate Connect (service mesh)"), text
    assert named in text
    assert name not in services
