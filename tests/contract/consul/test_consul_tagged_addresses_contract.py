"""Service TaggedAddresses decoded to {Address, Port}, with the agent's defaults (issue 16, item 7).

The agent decodes each value as a structs.ServiceAddress (field names matched
case-insensitively, wrong types a 400), refuses a `lan_ipv4`/`wan_ipv4`/
`lan_ipv6` that is not an address of that family (500, from AddService), and
adds `lan_ipv4`/`wan_ipv4` (or `_ipv6`) from the service's address and port
when the address is an IP literal. Agent, health and catalog-node views show
them as `TaggedAddresses`, /v1/catalog/service as `ServiceTaggedAddresses`;
both are left out when empty.
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


async def _views(aio, service_id: str, name: str) -> dict[str, dict[str, Any]]:
    """The service as the agent, health, catalog-service and catalog-node views show it."""
    agent = (await aio.agent.services())[service_id]
    _, health = await aio.health.service(name)
    _, catalog = await aio.catalog.service(name)
    node = catalog[0]["Node"]
    _, node_view = await aio.catalog.node(node)
    return {
        "agent": agent,
        "health": health[0]["Service"],
        "catalog": catalog[0],
        "node": node_view["Services"][service_id],
    }


def _addr(address: str, port: int) -> dict[str, object]:
    return {"Address": address, "Port": port}


async def test_ip_address_gets_lan_and_wan_ipv4_in_every_view(aio, target: Target, unique):
    """An IPv4 service address adds lan_ipv4 and wan_ipv4 {Address, Port}, shown everywhere."""
    name = f"ta-{unique}"
    status, text = await _register(target, Name=name, Address="10.1.2.3", Port=8080)
    views = await _views(aio, name, name)
    expected = {"lan_ipv4": _addr("10.1.2.3", 8080), "wan_ipv4": _addr("10.1.2.3", 8080)}
    await aio.agent.service.deregister(name)
    assert 200 == status, text
    assert expected == views["agent"]["TaggedAddresses"]
    assert expected == views["health"]["TaggedAddresses"]
    assert expected == views["node"]["TaggedAddresses"]
    assert expected == views["catalog"]["ServiceTaggedAddresses"]


async def test_ipv6_address_gets_lan_and_wan_ipv6(aio, target: Target, unique):
    """An IPv6 literal adds the _ipv6 pair instead."""
    name = f"ta6-{unique}"
    status, text = await _register(target, Name=name, Address="2001:db8::7", Port=443)
    tagged = (await aio.agent.services())[name]["TaggedAddresses"]
    await aio.agent.service.deregister(name)
    assert 200 == status, text
    assert {"lan_ipv6": _addr("2001:db8::7", 443), "wan_ipv6": _addr("2001:db8::7", 443)} == tagged


async def test_hostname_or_empty_address_has_no_tagged_addresses(aio, target: Target, unique):
    """Without an IP-literal address nothing is added, and the keys are left out."""
    named, empty = f"tah-{unique}", f"tae-{unique}"
    await _register(target, Name=named, Address="db.example.com", Port=5432)
    await _register(target, Name=empty, Port=5432)
    services = await aio.agent.services()
    _, catalog = await aio.catalog.service(named)
    await aio.agent.service.deregister(named)
    await aio.agent.service.deregister(empty)
    assert "TaggedAddresses" not in services[named]
    assert "TaggedAddresses" not in services[empty]
    assert "ServiceTaggedAddresses" not in catalog[0]


async def test_sent_addresses_are_decoded_and_explicit_ones_kept(aio, target: Target, unique):
    """Field names match case-insensitively; a given lan_ipv4 wins over the default."""
    name = f"tas-{unique}"
    status, text = await _register(
        target,
        Name=name,
        Address="10.0.0.5",
        Port=80,
        TaggedAddresses={
            "lan": {"address": "10.0.0.5", "port": 80},
            "lan_ipv4": {"ADDRESS": "10.9.9.9", "Port": 81},
            "virtual": {"Address": "240.0.0.1"},
        },
    )
    tagged = (await aio.agent.services())[name]["TaggedAddresses"]
    await aio.agent.service.deregister(name)
    assert 200 == status, text
    assert {
        "lan": _addr("10.0.0.5", 80),
        "lan_ipv4": _addr("10.9.9.9", 81),
        "virtual": _addr("240.0.0.1", 0),
        "wan_ipv4": _addr("10.0.0.5", 80),
    } == tagged


UNMARSHAL = "json: cannot unmarshal {} into Go struct field"
DECODE_CASES = [
    ({"lan": "1.2.3.4"}, UNMARSHAL.format("string"), "Addresses of type structs.ServiceAddress"),
    ({"lan": {"Port": "80"}}, UNMARSHAL.format("string"), "TaggedAddresses.Port of type int"),
    (["10.0.0.1"], UNMARSHAL.format("array"), "of type map[string]structs.ServiceAddress"),
    ({"lan": {"Addr": "10.0.0.1"}}, 'json: unknown field "Addr"', ""),
]  # fmt: skip


@pytest.mark.parametrize("case", DECODE_CASES)
async def test_wrongly_typed_tagged_addresses_are_400(aio, target: Target, unique, case):
    """Values that are not {Address string, Port int} are refused; nothing is stored."""
    tagged, start, end = case
    name = f"tab-{unique}"
    status, text = await _register(target, Name=name, TaggedAddresses=tagged)
    services = await aio.agent.services()
    assert 400 == status
    assert text.startswith(f"Request decode failed: {start}"), text
    assert text.strip().endswith(end), text
    assert name not in services


@pytest.mark.parametrize(
    "case",
    [
        ("lan_ipv4", "db.example.com", "ipv4"),
        ("wan_ipv4", "2001:db8::1", "ipv4"),
        ("lan_ipv6", "10.0.0.1", "ipv6"),
    ],
)
async def test_family_tagged_address_that_is_not_of_its_family_is_refused(
    aio, target: Target, unique, case
):
    """lan_ipv4/wan_ipv4 must be IPv4 and lan_ipv6 IPv6 (AddService error: 500)."""
    key, address, family = case
    name = f"taf-{unique}"
    status, text = await _register(
        target, Name=name, TaggedAddresses={key: {"Address": address, "Port": 1}}
    )
    services = await aio.agent.services()
    assert 500 == status
    assert f'Service tagged address "{key}" must be a valid {family} address' == text.strip()
    assert name not in services


async def test_filter_selects_on_a_tagged_address_field(aio, target: Target, unique):
    """`?filter=` reaches into TaggedAddresses values: `TaggedAddresses.lan_ipv4.Port`."""
    name = f"taq-{unique}"
    await _register(target, Name=f"{name}-a", Address="10.0.0.1", Port=1001)
    await _register(target, Name=f"{name}-b", Address="10.0.0.2", Port=1002)
    status, text, _ = await raw_request(
        target,
        "GET",
        "/v1/agent/services?filter=" + "TaggedAddresses.lan_ipv4.Port%20%3D%3D%201002",
    )
    await aio.agent.service.deregister(f"{name}-a")
    await aio.agent.service.deregister(f"{name}-b")
    assert 200 == status, text
    assert [f"{name}-b"] == [sid for sid in json.loads(text) if sid.startswith(name)]
