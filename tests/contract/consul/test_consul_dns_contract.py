"""Consul DNS through dnspython's resolver: A and SRV answers for healthy instances."""

from __future__ import annotations

import json

import consul
import dns.asyncquery
import dns.asyncresolver
import dns.flags
import dns.message
import dns.rcode
import dns.resolver
import pytest
from consul_helpers import Target, raw_request


@pytest.fixture
def resolver(target: Target) -> dns.asyncresolver.Resolver:
    resolver = dns.asyncresolver.Resolver(configure=False)
    resolver.nameservers = [target.host]
    resolver.port = target.dns_port
    resolver.lifetime = 3.0
    return resolver


async def _instances(aio, name: str) -> dict[str, int]:
    """Register name-1 passing, name-2 warning, name-3 critical; returns status -> port."""
    ports = {}
    for number, (verb, status) in enumerate(
        (("pass", "passing"), ("warn", "warning"), ("fail", "critical")), start=1
    ):
        service_id = f"{name}-{number}"
        port = 20000 + number
        await aio.agent.service.register(
            name,
            service_id=service_id,
            port=port,
            tags=["primary"] if number == 1 else ["replica"],
            check=consul.Check.ttl("60s"),
        )
        await getattr(aio.agent.check, f"ttl_{verb}")(f"service:{service_id}")
        ports[status] = port
    return ports


async def test_srv_lists_passing_and_warning_instances(aio, resolver, unique):
    """An SRV query answers the ports of instances that are not critical, with target A records."""
    name = f"dns-{unique}"
    ports = await _instances(aio, name)
    answer = await resolver.resolve(f"{name}.service.consul", "SRV")
    me = await aio.agent.self()
    node = me["Config"]["NodeName"]
    targets = {str(r.target) for r in answer}
    additional = {
        str(rrset.name): [r.address for r in rrset] for rrset in answer.response.additional
    }
    assert {ports["passing"], ports["warning"]} == {r.port for r in answer}
    assert {f"{node}.node.dc1.consul."} == targets
    assert [me["Member"]["Addr"]] == additional[f"{node}.node.dc1.consul."]


async def test_a_record_prefers_the_service_address(aio, resolver, unique):
    """The A answer is the service address when one is registered, else the node's."""
    await aio.agent.service.register(f"addr-{unique}", address="127.0.0.42", port=1)
    await aio.agent.service.register(f"plain-{unique}", port=1)
    me = await aio.agent.self()
    with_address = await resolver.resolve(f"addr-{unique}.service.consul", "A")
    without = await resolver.resolve(f"plain-{unique}.service.consul", "A")
    assert ["127.0.0.42"] == [r.address for r in with_address]
    assert [me["Member"]["Addr"]] == [r.address for r in without]


async def test_tag_and_rfc2782_lookups(aio, resolver, unique):
    """<tag>.<svc>, _<svc>._<tag> and _<svc>._tcp select instances by tag (tcp = any)."""
    name = f"tagged-{unique}"
    ports = await _instances(aio, name)
    by_tag = await resolver.resolve(f"primary.{name}.service.consul", "SRV")
    rfc = await resolver.resolve(f"_{name}._replica.service.consul", "SRV")
    any_tag = await resolver.resolve(f"_{name}._tcp.service.dc1.consul", "SRV")
    assert [ports["passing"]] == [r.port for r in by_tag]
    assert [ports["warning"]] == [r.port for r in rfc]
    assert {ports["passing"], ports["warning"]} == {r.port for r in any_tag}


async def test_node_lookup_and_unknown_names(aio, resolver, unique):
    """<node>.node.consul answers the node address; unknown services and nodes are NXDOMAIN."""
    me = await aio.agent.self()
    node = me["Config"]["NodeName"]
    answer = await resolver.resolve(f"{node}.node.consul", "A")
    assert [me["Member"]["Addr"]] == [r.address for r in answer]
    with pytest.raises(dns.resolver.NXDOMAIN):
        await resolver.resolve(f"missing-{unique}.service.consul", "A")
    with pytest.raises(dns.resolver.NXDOMAIN):
        await resolver.resolve(f"missing-{unique}.node.consul", "A")


async def test_nxdomain_is_authoritative_with_a_soa(target: Target, unique):
    """A miss is an authoritative NXDOMAIN with the consul. SOA in the authority section."""
    query = dns.message.make_query(f"missing-{unique}.service.consul", "A")
    response = await dns.asyncquery.udp(query, target.host, port=target.dns_port, timeout=3)
    assert dns.rcode.NXDOMAIN == response.rcode()
    assert response.flags & dns.flags.AA
    assert ["consul."] == [str(rrset.name) for rrset in response.authority]


async def test_instances_on_a_failed_node_are_not_answered(target: Target, resolver, unique):
    """When a node fails, DNS stops answering its instances."""
    server = target.devcluster()
    node = f"dnsnode-{unique}"
    server.register_node(node, "127.0.0.7")
    name = f"onnode-{unique}"
    body = {"Name": name, "Port": 4242, "Check": {"TTL": "60s", "Status": "passing"}}
    await raw_request(
        target,
        "PUT",
        "/v1/agent/service/register",
        body=json.dumps(body),
        headers={"X-Devcluster-Node": node},
    )
    before = await resolver.resolve(f"{name}.service.consul", "A")
    server.fail_node(node)
    with pytest.raises(dns.resolver.NXDOMAIN):
        await resolver.resolve(f"{name}.service.consul", "A")
    assert ["127.0.0.7"] == [r.address for r in before]
