"""Node pools (Nomad 1.6+) as Nomad answers them: `/v1/node/pools`, `/v1/node/pool/:name`,
the built-in `all` and `default`, and a job's `NodePool` restricting placement (issue 14 item 4)."""

from __future__ import annotations

import aiohttp
import pytest
from nomad_contract_support import NomadTarget, get_json, running_allocs, sleeper_job

from caravan_llm.devcluster.nomad.settings import NodeSpec


async def test_built_in_pools_are_listed_with_nomads_descriptions(
    target: NomadTarget, http: aiohttp.ClientSession
) -> None:
    """`all` and `default` always exist, created at index 1, with Nomad's descriptions."""
    async with http.get(f"{target.address}/v1/node/pools") as response:
        assert 200 == response.status
        assert int(response.headers["X-Nomad-Index"]) >= 1
        pools = {pool["Name"]: pool for pool in await response.json()}
    assert "Node pool with all nodes in the cluster." == pools["all"]["Description"]
    assert "Default node pool." == pools["default"]["Description"]
    assert (1, 1) == (pools["default"]["CreateIndex"], pools["default"]["ModifyIndex"])
    assert None is pools["default"]["Meta"]
    assert None is pools["default"]["SchedulerConfiguration"]
    one = await get_json(http, f"{target.address}/v1/node/pool/default")
    assert pools["default"] == one
    prefixed = await get_json(http, f"{target.address}/v1/node/pools?prefix=def")
    assert ["default"] == [pool["Name"] for pool in prefixed]


async def test_unknown_pool_is_404_and_lists_nothing(
    target: NomadTarget, http: aiohttp.ClientSession, unique: str
) -> None:
    """Reading a pool that does not exist is a 404; its node and job lists are empty."""
    async with http.get(f"{target.address}/v1/node/pool/nope-{unique}") as response:
        assert (404, "node pool not found") == (response.status, (await response.text()).strip())
    assert [] == await get_json(http, f"{target.address}/v1/node/pool/nope-{unique}/nodes")
    assert [] == await get_json(http, f"{target.address}/v1/node/pool/nope-{unique}/jobs")
    async with http.get(f"{target.address}/v1/node/pool/default/nodes?prefix=ab") as response:
        assert (400, "prefix argument not allowed") == (
            response.status,
            (await response.text()).strip(),
        )


async def test_pool_is_created_read_and_deleted(
    target: NomadTarget, http: aiohttp.ClientSession, unique: str
) -> None:
    """PUT creates a pool (empty answer, new index); GET reads it; DELETE removes it."""
    name = f"team-{unique}"
    body = {"Name": name, "Description": "a team's nodes", "Meta": {"owner": "ml"}}
    async with http.put(f"{target.address}/v1/node/pools", json=body) as response:
        assert 200 == response.status
        assert "" == (await response.text()).strip()
        index = int(response.headers["X-Nomad-Index"])
    pool = await get_json(http, f"{target.address}/v1/node/pool/{name}")
    assert (name, "a team's nodes", {"owner": "ml"}) == (
        pool["Name"],
        pool["Description"],
        pool["Meta"],
    )
    assert index == pool["CreateIndex"] == pool["ModifyIndex"]
    assert [] == await get_json(http, f"{target.address}/v1/node/pool/{name}/nodes")
    async with http.delete(f"{target.address}/v1/node/pool/{name}") as response:
        assert 200 == response.status
    async with http.get(f"{target.address}/v1/node/pool/{name}") as response:
        assert 404 == response.status


async def test_built_in_pools_cannot_be_changed_and_names_are_checked(
    target: NomadTarget, http: aiohttp.ClientSession
) -> None:
    """Modifying or deleting a built-in pool, or a bad name, is refused with Nomad's text."""
    async with http.put(
        f"{target.address}/v1/node/pools", json={"Name": "default", "Description": "x"}
    ) as response:
        assert (400, 'modifying node pool "default" is not allowed') == (
            response.status,
            (await response.text()).strip(),
        )
    async with http.put(f"{target.address}/v1/node/pools", json={"Name": "bad name"}) as response:
        assert 400 == response.status
        assert (await response.text()).startswith('invalid node pool "bad name": 1 error occurred')
    async with http.put(
        f"{target.address}/v1/node/pool/other", json={"Name": "different"}
    ) as response:
        assert (400, "Node pool name does not match request path") == (
            response.status,
            (await response.text()).strip(),
        )
    async with http.delete(f"{target.address}/v1/node/pool/all") as response:
        assert 500 == response.status
        assert 'deleting node pool "all" is not allowed' in await response.text()


async def test_job_in_a_nonexistent_pool_is_refused(
    target: NomadTarget, http: aiohttp.ClientSession, unique: str
) -> None:
    """Registering a job whose NodePool does not exist is a 500 naming the job and pool."""
    job = sleeper_job(f"pool-{unique}")
    job["Job"]["NodePool"] = f"nope-{unique}"
    async with http.put(f"{target.address}/v1/jobs", json=job) as response:
        assert 500 == response.status
        expected = f'job "pool-{unique}" is in nonexistent node pool "nope-{unique}"'
        assert expected in await response.text()


async def test_nodes_join_their_pool_and_jobs_stay_in_theirs(
    target: NomadTarget, http: aiohttp.ClientSession, unique: str
) -> None:
    """A node naming a new pool creates it; a job's NodePool keeps it on that pool's nodes."""
    server = target.devcluster()
    pool = f"gpu-{unique}"
    node = await server.add_node(NodeSpec(node_pool=pool, gpus=1))
    listed = await get_json(http, f"{target.address}/v1/node/pool/{pool}/nodes")
    assert [node.id] == [stub["ID"] for stub in listed]
    assert pool == listed[0]["NodePool"]
    every = await get_json(http, f"{target.address}/v1/node/pool/all/nodes")
    assert node.id in {stub["ID"] for stub in every}
    in_default = await get_json(http, f"{target.address}/v1/node/pool/default/nodes")
    assert node.id not in {stub["ID"] for stub in in_default}

    kept = sleeper_job(f"kept-{unique}", count=3)
    kept["Job"]["NodePool"] = pool
    async with http.put(f"{target.address}/v1/jobs", json=kept) as response:
        assert 200 == response.status, await response.text()
    allocs = await running_allocs(http, target.address, f"kept-{unique}", 3)
    assert {node.id} == {alloc["NodeID"] for alloc in allocs}
    jobs = await get_json(http, f"{target.address}/v1/node/pool/{pool}/jobs")
    assert [f"kept-{unique}"] == [job["ID"] for job in jobs]

    plain = sleeper_job(f"plain-{unique}", count=4)
    async with http.put(f"{target.address}/v1/jobs", json=plain) as response:
        assert 200 == response.status, await response.text()
    allocs = await running_allocs(http, target.address, f"plain-{unique}", 4)
    assert node.id not in {alloc["NodeID"] for alloc in allocs}

    async with http.delete(f"{target.address}/v1/node/pool/{pool}") as response:
        assert 500 == response.status
        text = await response.text()
    assert f'node pool "{pool}" has non-terminal jobs in regions: [global]' in text
    assert f'node pool "{pool}" has nodes in regions: [global]' in text


def test_a_node_may_not_join_pool_all() -> None:
    """Nomad refuses a node registering in the built-in `all` pool."""
    with pytest.raises(ValueError, match='node is not allowed to register in node pool "all"'):
        NodeSpec(node_pool="all")
