"""devcluster-only: simulated nodes over /v1/devcluster/*, and `python -m caravan_llm.devcluster`
itself."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

import aiohttp
import pytest
from consul_helpers import DEVCLUSTER_ONLY, REAL, Target, eventually, raw_request

pytestmark = pytest.mark.skipif(REAL, reason=DEVCLUSTER_ONLY)


async def _put(target: Target, path: str, body: object | None = None):
    data = json.dumps(body) if body is not None else None
    return await raw_request(target, "PUT", path, body=data)


async def test_register_node_is_idempotent_and_gets_a_loopback_address(target: Target, aio):
    """Registering a node twice changes nothing; without Address it gets the next 127.0.0.N."""
    first = await _put(target, "/v1/devcluster/node/register", {"Node": "n1", "Meta": {"r": "a"}})
    index_after_first, _ = await aio.catalog.nodes()
    again = await _put(target, "/v1/devcluster/node/register", {"Node": "n1", "Meta": {"r": "a"}})
    index_after_again, nodes = await aio.catalog.nodes()
    _, checks = await aio.health.node("n1")
    node = next(n for n in nodes if n["Node"] == "n1")
    assert (200, 200) == (first[0], again[0])
    assert index_after_first == index_after_again
    assert ("127.0.0.2", "a") == (node["Address"], node["Meta"]["r"])
    assert [("serfHealth", "passing")] == [(c["CheckID"], c["Status"]) for c in checks]


async def test_fail_and_recover_a_node(target: Target, aio):
    """fail turns serfHealth critical and makes the node's agent unreachable; recover undoes it."""
    await _put(target, "/v1/devcluster/node/register", {"Node": "n2", "Address": "127.0.0.3"})
    failed = await _put(target, "/v1/devcluster/node/n2/fail")
    _, during = await aio.health.node("n2")
    members = {m["Name"]: m["Status"] for m in await aio.agent.members()}
    unreachable = await raw_request(
        target, "GET", "/v1/agent/services", headers={"X-Devcluster-Node": "n2"}
    )
    recovered = await _put(target, "/v1/devcluster/node/n2/recover")
    _, after = await aio.health.node("n2")
    assert (200, 200) == (failed[0], recovered[0])
    assert ("critical", "Agent not live or unreachable") == (
        during[0]["Status"],
        during[0]["Output"],
    )
    assert 4 == members["n2"]
    assert 503 == unreachable[0]
    assert "passing" == after[0]["Status"]


async def test_deleting_a_node_removes_its_services_and_sessions(target: Target, aio):
    """DELETE /v1/devcluster/node/<name> removes the node, its services and its sessions."""
    await _put(target, "/v1/devcluster/node/register", {"Node": "n3"})
    await raw_request(
        target,
        "PUT",
        "/v1/agent/service/register",
        body=json.dumps({"Name": "gone-soon"}),
        headers={"X-Devcluster-Node": "n3"},
    )
    session_id = await aio.session.create(node="n3")
    deleted = await raw_request(target, "DELETE", "/v1/devcluster/node/n3")
    _, nodes = await aio.catalog.nodes()
    _, entries = await aio.health.service("gone-soon")
    _, session = await aio.session.info(session_id)
    assert 200 == deleted[0]
    assert "n3" not in {n["Node"] for n in nodes}
    assert [] == entries
    assert session is None


async def test_unknown_node_and_bad_address_are_refused(target: Target):
    """Actions on unknown nodes are 404; a non-loopback address is 400."""
    unknown = await _put(target, "/v1/devcluster/node/ghost/fail")
    header = await raw_request(
        target, "GET", "/v1/agent/services", headers={"X-Devcluster-Node": "ghost"}
    )
    bad = await _put(target, "/v1/devcluster/node/register", {"Node": "n4", "Address": "10.0.0.1"})
    assert 404 == unknown[0]
    assert 404 == header[0]
    assert 400 == bad[0]
    assert "loopback" in bad[1]


async def test_http_checks_of_a_failed_node_stop_running(target: Target, aio, health_target):
    """While its node is failed a check keeps its last status (the agent is not running it)."""
    server = target.devcluster()
    server.register_node("n5")
    body = {"Name": "probed", "Check": {"HTTP": health_target.url, "Interval": "1s"}}
    await raw_request(
        target,
        "PUT",
        "/v1/agent/service/register",
        body=json.dumps(body),
        headers={"X-Devcluster-Node": "n5"},
    )

    async def service_check_status():
        _, checks = await aio.health.checks("probed")
        return checks[0]["Status"] if checks else None

    assert "passing" == await eventually(lambda: _is(service_check_status, "passing"), timeout_s=5)
    server.fail_node("n5")
    health_target.status = 500
    # Not a wait: for longer than one check interval (1 s) the failed node's check
    # must keep its last status although its target now answers 500.
    await asyncio.sleep(1.5)
    frozen = await service_check_status()
    server.recover_node("n5")
    assert "critical" == await eventually(
        lambda: _is(service_check_status, "critical"), timeout_s=5
    )
    assert "passing" == frozen


async def _is(probe, wanted: str) -> str | None:
    value = await probe()
    return value if value == wanted else None


def _children(pid: int) -> list[int]:
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            children.append(int(stat.parent.name))
    return children


async def test_python_m_devcluster_prints_exports_and_stops_on_sigterm():
    """`python -m caravan_llm.devcluster` prints the export lines, serves Consul, and exits 0 on
    SIGTERM."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "caravan_llm.devcluster",
        "--consul-port",
        "0",
        "--dns-port",
        "0",
        "--nomad-port",
        "0",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert process.stdout is not None
        first = (await asyncio.wait_for(process.stdout.readline(), 20)).decode()
        second = (await asyncio.wait_for(process.stdout.readline(), 5)).decode()
        address = first.strip().removeprefix("export CONSUL_HTTP_ADDR=")
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://{address}/v1/status/leader") as response:
                leader = await response.json()
        children = _children(process.pid)
        process.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(process.wait(), 10)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert first.startswith("export CONSUL_HTTP_ADDR=127.0.0.1:")
    assert second.startswith("export CARAVAN_DNS_PORT=")
    assert "127.0.0.1:8300" == leader
    assert [] == children
    assert 0 == code


async def test_sync_client_sees_devcluster_nodes(target: Target, sync_client):
    """py-consul's sync client reads simulated nodes like real ones."""
    target.devcluster().register_node("n6", "127.0.0.66")
    _, nodes = await asyncio.to_thread(sync_client.catalog.nodes)
    assert "127.0.0.66" == next(n["Address"] for n in nodes if n["Node"] == "n6")
