"""Health and catalog reads, blocking queries and the caravan watch loop on top of them."""

from __future__ import annotations

import asyncio
import time

import consul
import pytest
from consul_helpers import HealthTarget, Target, raw_request

from caravan_llm.common.consul_api import ConsulClient, ConsulSettings
from caravan_llm.common.watch import BlockingWatch


async def _three_instances(aio, name: str) -> None:
    """web-1 passing, web-2 warning, web-3 critical (TTL checks)."""
    for number, verb in ((1, "pass"), (2, "warn"), (3, "fail")):
        service_id = f"{name}-{number}"
        await aio.agent.service.register(
            name,
            service_id=service_id,
            port=8000 + number,
            tags=["t", f"n{number}"],
            meta={"number": str(number)},
            check=consul.Check.ttl("60s"),
        )
        await getattr(aio.agent.check, f"ttl_{verb}")(f"service:{service_id}")


def _ids(entries) -> list[str]:
    return sorted(e["Service"]["ID"] for e in entries)


async def test_passing_filter_drops_warning_and_critical_instances(aio, unique):
    """?passing keeps only instances whose every check (node checks too) is passing."""
    name = f"web-{unique}"
    await _three_instances(aio, name)
    _, everything = await aio.health.service(name)
    _, passing = await aio.health.service(name, passing=True)
    assert [f"{name}-1", f"{name}-2", f"{name}-3"] == _ids(everything)
    assert [f"{name}-1"] == _ids(passing)
    assert {"serfHealth", f"service:{name}-1"} == {c["CheckID"] for c in passing[0]["Checks"]}


async def test_failed_node_drops_its_instances_from_passing(target: Target, aio, unique):
    """A node whose serfHealth is critical takes its instances out of ?passing results."""
    server = target.devcluster()
    node = f"node-{unique}"
    server.register_node(node)
    name = f"api-{unique}"
    await raw_request(
        target,
        "PUT",
        "/v1/agent/service/register",
        body=f'{{"Name": "{name}", "Check": {{"TTL": "60s", "Status": "passing"}}}}',
        headers={"X-Devcluster-Node": node},
    )
    _, before = await aio.health.service(name, passing=True)
    server.fail_node(node)
    _, after = await aio.health.service(name, passing=True)
    _, all_entries = await aio.health.service(name)
    serf = next(c for c in all_entries[0]["Checks"] if c["CheckID"] == "serfHealth")
    assert 1 == len(before)
    assert [] == after
    assert ("critical", "Agent not live or unreachable") == (serf["Status"], serf["Output"])


async def test_tag_parameters_must_all_match(aio, unique):
    """Repeated ?tag= parameters select instances carrying every tag."""
    name = f"tags-{unique}"
    await _three_instances(aio, name)
    _, both = await aio.health.service(name, tag=["t", "n2"])
    _, one = await aio.health.service(name, tag="t")
    assert [f"{name}-2"] == _ids(both)
    assert 3 == len(one)


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ('Service.Tags contains "n1"', [1]),
        ('Service.Meta.number == "3"', [3]),
        ('Service.Tags contains "t" and Service.Meta.number != "1"', [2, 3]),
        ('"n2" in Service.Tags or Service.Port == 8003', [2, 3]),
    ],
)
async def test_filter_expressions_select_instances(aio, unique, expression, expected):
    """?filter= evaluates the bexpr subset caravan uses over health entries."""
    name = f"filt-{unique}"
    await _three_instances(aio, name)
    _, entries = await aio.health.service(name, filter_expr=expression)
    assert [f"{name}-{n}" for n in expected] == _ids(entries)


async def test_filter_with_unknown_selector_is_rejected(target: Target, unique):
    """A filter naming a field health entries do not have is an error, even with no results."""
    status, body, _ = await raw_request(
        target, "GET", f"/v1/health/service/none-{unique}?filter=Service.Nope%20%3D%3D%20x"
    )
    assert status >= 400
    assert "Service.Nope" in body


async def test_blocking_health_query_returns_within_100ms_of_a_check_passing(aio, unique):
    """A blocked health.service(passing) call answers within 100 ms of the check turning passing."""
    name = f"block-{unique}"
    await aio.agent.service.register(name, check=consul.Check.ttl("60s"))
    index, entries = await aio.health.service(name, passing=True)
    returned_at: list[float] = []

    async def blocked():
        result = await aio.health.service(name, passing=True, index=index, wait="10s")
        returned_at.append(time.monotonic())
        return result

    task = asyncio.create_task(blocked())
    # Not a wait: with the check still critical for 0.3 s the call must still be blocked.
    await asyncio.sleep(0.3)
    assert not task.done()
    turned_passing_at = time.monotonic()
    await aio.agent.check.ttl_pass(f"service:{name}")
    new_index, new_entries = await task
    assert [] == entries
    assert 1 == len(new_entries)
    assert int(new_index) > int(index)
    assert returned_at[0] - turned_passing_at < 0.1


async def test_blocking_query_without_change_returns_after_wait_with_same_index(aio, unique):
    """With nothing changing, a blocking call returns after `wait` (+ jitter), same index."""
    name = f"idle-{unique}"
    await aio.agent.service.register(name)
    index, _ = await aio.health.service(name)
    started = time.monotonic()
    new_index, _ = await aio.health.service(name, index=index, wait="1s")
    elapsed = time.monotonic() - started
    assert new_index == index
    assert 0.9 <= elapsed < 1.0 + 1.0 / 16 + 0.5


async def test_unrelated_writes_do_not_move_a_service_index(aio, unique):
    """A KV write leaves a service's X-Consul-Index alone; registering it moves it."""
    name = f"quiet-{unique}"
    missing_index, _ = await aio.health.service(name)
    await aio.kv.put(f"unrelated/{unique}", "x")
    after_kv, _ = await aio.health.service(name)
    await aio.agent.service.register(name)
    registered, entries = await aio.health.service(name)
    assert missing_index == after_kv
    assert int(registered) > int(after_kv)
    assert 1 == len(entries)


@pytest.mark.parametrize(
    "path",
    [
        "/v1/health/service/consul",
        "/v1/health/state/any",
        "/v1/health/checks/consul",
        "/v1/catalog/services",
        "/v1/catalog/service/consul",
        "/v1/catalog/nodes",
        "/v1/session/list",
    ],
)
async def test_blocking_endpoints_send_consul_query_headers(target: Target, path):
    """Every blocking endpoint answers with X-Consul-Index >= 1, KnownLeader and LastContact."""
    status, _, headers = await raw_request(target, "GET", path)
    assert 200 == status
    assert int(headers["X-Consul-Index"]) >= 1
    assert "true" == headers["X-Consul-KnownLeader"]
    assert headers["X-Consul-LastContact"].isdigit()


async def test_health_state_and_checks_and_node(aio, unique):
    """health/state filters checks by status; health/checks and health/node list checks."""
    name = f"st-{unique}"
    await _three_instances(aio, name)
    _, warning = await aio.health.state("warning")
    _, any_state = await aio.health.state("any")
    _, service_checks = await aio.health.checks(name)
    me = await aio.agent.self()
    _, node_checks = await aio.health.node(me["Config"]["NodeName"])
    assert [f"service:{name}-2"] == [c["CheckID"] for c in warning if name in c["ServiceName"]]
    assert {f"service:{name}-{n}" for n in (1, 2, 3)} <= {c["CheckID"] for c in any_state}
    assert 3 == len(service_checks)
    assert "serfHealth" in {c["CheckID"] for c in node_checks}


async def test_catalog_service_nodes_and_node(aio, unique):
    """catalog/service lists instances; catalog/nodes and catalog/node describe nodes."""
    name = f"cat-{unique}"
    await aio.agent.service.register(name, service_id=f"{name}-a", port=1234, tags=["x"])
    _, instances = await aio.catalog.service(name)
    _, nodes = await aio.catalog.nodes()
    node_name = instances[0]["Node"]
    _, node = await aio.catalog.node(node_name)
    assert [(f"{name}-a", 1234, ["x"])] == [
        (i["ServiceID"], i["ServicePort"], i["ServiceTags"]) for i in instances
    ]
    assert node_name in {n["Node"] for n in nodes}
    assert f"{name}-a" in node["Services"]


async def test_catalog_services_blocks_until_a_service_registers(aio, unique):
    """A blocking catalog/services call wakes when a new service registers."""
    index, services = await aio.catalog.services()
    name = f"new-{unique}"

    reader = asyncio.create_task(aio.catalog.services(index=index, wait="5s"))
    # Not a wait: with nothing written for 0.2 s the read must still be blocked.
    await asyncio.sleep(0.2)
    blocked = not reader.done()
    await aio.agent.service.register(name, tags=["fresh"])
    new_index, new_services = await reader
    assert blocked
    assert name not in services
    assert ["fresh"] == new_services[name]
    assert int(new_index) > int(index)


async def test_watch_sees_an_instance_leave_passing_when_its_target_stops(
    target: Target, aio, health_target: HealthTarget, unique
):
    """caravan's watch over health.service(passing) drops an instance whose HTTP check fails."""
    name = f"watched-{unique}"
    await aio.agent.service.register(
        name, port=health_target.port, check=consul.Check.http(health_target.url, "1s")
    )
    settings = ConsulSettings(host=target.host, port=target.port)
    seen: list[int] = []
    async with ConsulClient(settings) as client:

        async def fetch(index: int, wait_s: float):
            return await client.health_service(name, passing=True, index=index, wait_s=wait_s)

        watch = BlockingWatch(f"health {name}", fetch, wait_s=30.0)

        async def follow() -> None:
            async for entries in watch:
                seen.append(len(entries))
                if seen[-1] == 1:
                    await health_target.stop()
                if seen[-1] == 0 and 1 in seen:
                    return

        await asyncio.wait_for(follow(), timeout=15)
    assert 1 in seen
    assert 0 == seen[-1]
    assert watch.status.last_error is None
