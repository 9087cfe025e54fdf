"""agent/self's Stats and the WAN member pool (issue 16, item 8).

A server's `Stats.consul` carries `server`, `leader`, `leader_addr` (the RPC
address /v1/status/leader answers and /v1/status/peers contains),
`bootstrap`, `known_datacenters` and `acl`; a client's carries `server`,
`known_servers` and `acl`. `/v1/agent/members?wan=1` answers the WAN pool:
servers only, named `<node>.<dc>`, on the serf WAN port 8302.
"""

from __future__ import annotations

import json

import pytest
from consul_helpers import REAL, Target, devcluster_config, raw_request

from caravan_llm.devcluster.consul.server import ConsulServer


async def test_server_stats_name_the_leader_as_status_does(aio):
    """Stats.consul.leader_addr is the string status/leader answers, and a peer."""
    me = await aio.agent.self()
    leader = await aio.status.leader()
    peers = await aio.status.peers()
    stats = me["Stats"]["consul"]
    assert {"server", "leader", "leader_addr", "bootstrap", "known_datacenters", "acl"} <= set(
        stats
    )
    assert leader == stats["leader_addr"]
    assert leader in peers
    assert leader.endswith(":8300")
    assert ("true", "true", "disabled") == (stats["server"], stats["leader"], stats["acl"])
    assert int(stats["known_datacenters"]) >= 1


async def test_dev_server_bootstraps_itself(aio):
    """A dev agent is a bootstrapping server of one datacenter."""
    stats = (await aio.agent.self())["Stats"]
    assert ("true", "1") == (stats["consul"]["bootstrap"], stats["consul"]["known_datacenters"])
    assert {"check_monitors", "check_ttls", "checks", "services"} <= set(stats["agent"])
    assert {"revision", "version", "prerelease"} <= set(stats["build"])


async def test_wan_members_are_the_servers_named_node_dot_datacenter(aio):
    """members(wan=True) lists the server as `<node>.<dc>` on port 8302; LAN uses the node name."""
    me = await aio.agent.self()
    node, datacenter = me["Config"]["NodeName"], me["Config"]["Datacenter"]
    wan = await aio.agent.members(wan=True)
    lan = await aio.agent.members()
    mine = next(m for m in wan if m["Name"] == f"{node}.{datacenter}")
    assert all(m["Tags"]["role"] == "consul" for m in wan)
    assert (8302, "consul", datacenter) == (mine["Port"], mine["Tags"]["role"], mine["Tags"]["dc"])
    assert node in {m["Name"] for m in lan}
    assert f"{node}.{datacenter}" not in {m["Name"] for m in lan}


async def test_segment_with_wan_is_400(target: Target):
    """A network segment does not apply to the WAN pool."""
    status, text, _ = await raw_request(target, "GET", "/v1/agent/members?wan=1&segment=alpha")
    assert (400, "Cannot provide a segment with wan=true") == (status, text.strip())


async def test_simulated_client_node_stats_and_wan_pool(target: Target):
    """A simulated node's agent is a client: known_servers, no leader fields, no WAN pool."""
    server = target.devcluster()
    server.register_node("n1")
    headers = {"X-Devcluster-Node": "n1"}
    _, me, _ = await raw_request(target, "GET", "/v1/agent/self", headers=headers)
    status, wan, _ = await raw_request(target, "GET", "/v1/agent/members?wan=1", headers=headers)
    assert {"server": "false", "known_servers": "1", "acl": "disabled"} == json.loads(me)["Stats"][
        "consul"
    ]
    assert (200, None) == (status, json.loads(wan))


async def test_acl_stat_says_enabled_under_acls():
    """With ACLs on (a management token), Stats.consul.acl is `enabled`."""
    if REAL:
        pytest.skip("needs an agent with ACLs enabled; runs against devcluster only")
    token = "mgmt-token-for-test"
    async with ConsulServer(devcluster_config(management_token=token)) as server:
        target = Target(server.config.host, server.http_port, server.dns_port, server, 1.0)
        status, me, _ = await raw_request(
            target, "GET", "/v1/agent/self", headers={"X-Consul-Token": token}
        )
    assert (200, "enabled") == (status, json.loads(me)["Stats"]["consul"]["acl"])
