"""Agent, status and node-list answers as Nomad gives them (issue 16 items 1, 2 and 3)."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from nomad_contract_support import NomadTarget, get_json, running_allocs, sleeper_job


async def test_leader_and_peers_are_the_rpc_address_the_agent_reports(target: NomadTarget) -> None:
    """status/leader and peers name the RPC address; agent/self, servers and members agree."""
    client = target.python_nomad()
    leader = await asyncio.to_thread(client.status.leader.get_leader)
    peers = await asyncio.to_thread(client.status.peers.get_peers)
    agent = await asyncio.to_thread(client.agent.get_agent)
    servers = await asyncio.to_thread(client.agent.get_servers)
    members = await asyncio.to_thread(client.agent.get_members)
    config = agent["config"]
    rpc = f"{config['Addresses']['RPC']}:{config['Ports']['RPC']}"
    http_port = int(target.address.rsplit(":", 1)[1])
    assert (rpc, [rpc], [rpc]) == (leader, peers, servers)
    assert http_port == config["Ports"]["HTTP"]
    assert config["Ports"]["RPC"] != http_port
    assert rpc == agent["stats"]["nomad"]["leader_addr"]
    server = members["Members"][0]
    assert (config["Ports"]["Serf"], str(config["Ports"]["RPC"])) == (
        server["Port"],
        server["Tags"]["port"],
    )


async def test_join_and_force_leave_answer_like_nomad(
    target: NomadTarget, http: aiohttp.ClientSession
) -> None:
    """agent/join needs an address and reports num_joined; force-leave needs a node."""
    async with http.post(f"{target.address}/v1/agent/join") as response:
        assert (400, "missing address to join") == (
            response.status,
            (await response.text()).strip(),
        )
    agent = await get_json(http, f"{target.address}/v1/agent/self")
    own = f"{agent['config']['Addresses']['Serf']}:{agent['config']['Ports']['Serf']}"
    client = target.python_nomad()
    joined = await asyncio.to_thread(client.agent.join_agent, [own])
    assert (1, "") == (joined["num_joined"], joined["error"])
    async with http.put(f"{target.address}/v1/agent/force-leave") as response:
        assert (400, "missing node to force leave") == (
            response.status,
            (await response.text()).strip(),
        )
    status = await asyncio.to_thread(client.agent.force_leave, "no-such-member")
    assert 200 == status


async def test_join_elsewhere_is_refused_in_the_answer(target: NomadTarget) -> None:
    """devcluster has one server: another address is not joined and `error` says why."""
    target.devcluster()
    client = target.python_nomad()
    joined = await asyncio.to_thread(client.agent.join_agent, ["10.255.0.1:4648"])
    assert 0 == joined["num_joined"]
    assert "Failed to join 10.255.0.1:4648" in joined["error"]


async def test_node_list_leaves_out_fields_that_were_not_asked_for(
    target: NomadTarget, http: aiohttp.ClientSession
) -> None:
    """`Attributes` and `NodeResources` appear only with `os=true` / `resources=true`."""
    plain = await get_json(http, f"{target.address}/v1/nodes")
    assert plain
    assert all("Attributes" not in n and "NodeResources" not in n for n in plain)
    blank = await get_json(http, f"{target.address}/v1/nodes?resources=&os=")
    assert all("Attributes" not in n and "NodeResources" not in n for n in blank)
    with_os = await get_json(http, f"{target.address}/v1/nodes?os=T")
    assert all("os.name" in n["Attributes"] for n in with_os)
    assert all("NodeResources" not in n for n in with_os)
    full = await get_json(http, f"{target.address}/v1/nodes?resources=1")
    assert all(n["NodeResources"] and "Attributes" not in n for n in full)
    client = target.python_nomad()
    listed = await asyncio.to_thread(client.nodes.get_nodes)
    assert all("NodeResources" not in n for n in listed)


@pytest.mark.parametrize("value", ["yes", "tRuE", "2"])
async def test_bool_parameters_follow_go_parsebool(
    target: NomadTarget, http: aiohttp.ClientSession, value: str
) -> None:
    """Values `strconv.ParseBool` refuses are errors: 400 on node lists, 500 on job lists."""
    parse_error = (
        f'Failed to parse value of "resources" ({value}) as a bool: strconv.ParseBool: '
        f'parsing "{value}": invalid syntax'
    )
    async with http.get(f"{target.address}/v1/nodes?resources={value}") as response:
        assert (400, f"Failed to parse node list fields: {parse_error}") == (
            response.status,
            (await response.text()).strip(),
        )
    async with http.get(f"{target.address}/v1/jobs?meta={value}") as response:
        assert (500, parse_error.replace('"resources"', '"meta"')) == (
            response.status,
            (await response.text()).strip(),
        )


async def test_node_evaluate_creates_an_eval_per_job_on_the_node(
    target: NomadTarget, http: aiohttp.ClientSession, unique: str
) -> None:
    """`POST /v1/node/:id/evaluate` answers EvalIDs and indexes; unknown nodes are a 500."""
    client = target.python_nomad()
    job_id = f"neval-{unique}"
    await asyncio.to_thread(client.jobs.register_job, sleeper_job(job_id))
    allocs = await running_allocs(http, target.address, job_id)
    node_id = next(a["NodeID"] for a in allocs if a["ClientStatus"] == "running")
    result = await asyncio.to_thread(client.node.evaluate_node, node_id)
    assert {"EvalIDs", "EvalCreateIndex", "NodeModifyIndex", "Index"} <= set(result)
    assert 1 == len(result["EvalIDs"])
    evaluation = await get_json(http, f"{target.address}/v1/evaluation/{result['EvalIDs'][0]}")
    assert (job_id, node_id, "node-update") == (
        evaluation["JobID"],
        evaluation["NodeID"],
        evaluation["TriggeredBy"],
    )
    async with http.post(
        f"{target.address}/v1/node/00000000-0000-0000-0000-000000000000/evaluate"
    ) as response:
        assert (500, "node not found") == (response.status, (await response.text()).strip())
    await asyncio.to_thread(client.job.deregister_job, job_id, purge=True)
