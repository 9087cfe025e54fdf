"""`?filter=` on /v1/catalog/services and /v1/catalog/node/<node> (issue 16, item 6).

/v1/catalog/services filters instances with the fields of /v1/catalog/service/
<name> and answers the union of the tags of the instances that survive; a
name with no survivor is left out. /v1/catalog/node/<node> filters its
`Services` map by NodeService fields. An invalid expression is a 500 with the
same bexpr text every filtering endpoint gives.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import quote

import pytest
from consul_helpers import Target, raw_request


async def _get(target: Target, path: str, expression: str) -> tuple[int, Any]:
    status, text, _ = await raw_request(target, "GET", f"{path}?filter={quote(expression)}")
    return status, (json.loads(text) if status == 200 else text.strip())


async def _register_fleet(aio, unique: str) -> tuple[str, str]:
    """alpha: two instances (v=1 tags blue/x, v=2 tag y); beta: one (v=2 tag z)."""
    alpha, beta = f"alpha-{unique}", f"beta-{unique}"
    await aio.agent.service.register(
        alpha, service_id=f"{alpha}-1", tags=["x", "blue"], meta={"v": "1"}
    )
    await aio.agent.service.register(alpha, service_id=f"{alpha}-2", tags=["y"], meta={"v": "2"})
    await aio.agent.service.register(beta, service_id=f"{beta}-1", tags=["z"], meta={"v": "2"})
    return alpha, beta


async def _cleanup(aio, alpha: str, beta: str) -> None:
    for service_id in (f"{alpha}-1", f"{alpha}-2", f"{beta}-1"):
        await aio.agent.service.deregister(service_id)


async def test_catalog_services_filter_keeps_the_tags_of_surviving_instances(
    aio, target: Target, unique
):
    """Only surviving instances contribute tags; a name without survivors is dropped."""
    alpha, beta = await _register_fleet(aio, unique)
    try:
        two = await _get(target, "/v1/catalog/services", 'ServiceMeta.v == "2"')
        one = await _get(target, "/v1/catalog/services", 'ServiceMeta.v == "1"')
        tagged = await _get(target, "/v1/catalog/services", '"blue" in ServiceTags')
    finally:
        await _cleanup(aio, alpha, beta)
    mine = (alpha, beta)
    assert (200, {alpha: ["y"], beta: ["z"]}) == (
        two[0],
        {name: sorted(tags) for name, tags in two[1].items() if name in mine},
    )
    assert "consul" not in two[1]
    assert {alpha: ["blue", "x"]} == {n: sorted(t) for n, t in one[1].items() if n in mine}
    assert {alpha: ["blue", "x"]} == {n: sorted(t) for n, t in tagged[1].items() if n in mine}


async def test_catalog_services_filter_sees_catalog_service_fields(aio, target: Target, unique):
    """Selectors are those of /v1/catalog/service: ServiceName, ServiceID, Node..."""
    alpha, beta = await _register_fleet(aio, unique)
    try:
        by_id = await _get(target, "/v1/catalog/services", f'ServiceID == "{alpha}-2"')
        by_name = await _get(target, "/v1/catalog/services", f'ServiceName == "{beta}"')
    finally:
        await _cleanup(aio, alpha, beta)
    assert (200, {alpha: ["y"]}) == by_id
    assert (200, {beta: ["z"]}) == by_name


async def test_catalog_node_filter_filters_the_services_map(aio, target: Target, unique):
    """The node view keeps the services that match, by NodeService fields."""
    alpha, beta = await _register_fleet(aio, unique)
    me = await aio.agent.self()
    node = me["Config"]["NodeName"]
    try:
        by_meta = await _get(target, f"/v1/catalog/node/{node}", 'Meta.v == "2"')
        by_name = await _get(target, f"/v1/catalog/node/{node}", f'Service == "{alpha}"')
    finally:
        await _cleanup(aio, alpha, beta)
    assert 200 == by_meta[0]
    assert {f"{alpha}-2", f"{beta}-1"} == set(by_meta[1]["Services"])
    assert {f"{alpha}-1", f"{alpha}-2"} == set(by_name[1]["Services"])
    assert node == by_name[1]["Node"]["Node"]


@pytest.mark.parametrize("expression", ["NoSuchField == x", "((", "ServiceMeta.v =="])
async def test_invalid_filter_is_500_with_the_same_text_everywhere(aio, target: Target, expression):
    """catalog/services and catalog/node refuse a bad expression as catalog/service does.

    The node view checks the expression even for a node that does not exist. A
    syntax error is reported before any selector is judged, so `ServiceMeta.v ==`
    (no NodeService field of that name) fails the same way on the node view.
    """
    me = await aio.agent.self()
    node = me["Config"]["NodeName"]
    reference = await _get(target, "/v1/catalog/service/consul", expression)
    answers = [
        await _get(target, path, expression)
        for path in (
            "/v1/catalog/services",
            f"/v1/catalog/node/{node}",
            "/v1/catalog/node/no-such-node-here",
        )
    ]
    assert 500 == reference[0]
    assert [reference] * 3 == answers
