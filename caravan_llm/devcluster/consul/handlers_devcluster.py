"""/v1/devcluster/*: devcluster-only endpoints to add, fail and recover simulated nodes.

PUT    /v1/devcluster/node/register   {"Node": "n1", "Address": "127.0.0.2", "Meta": {}}
DELETE /v1/devcluster/node/<name>
PUT    /v1/devcluster/node/<name>/fail
PUT    /v1/devcluster/node/<name>/kill      (agent dies; serf notices after its delay)
PUT    /v1/devcluster/node/<name>/recover
GET    /v1/devcluster/nodes
"""

from __future__ import annotations

import ipaddress

from caravan_llm.devcluster.consul.decode import DEVCLUSTER_NODE, DecodeError, decode_body
from caravan_llm.devcluster.consul.http_api import HttpError, Reply, RequestContext, Route
from caravan_llm.devcluster.consul.render import node_json
from caravan_llm.devcluster.consul.state import ConsulState

NODE_ADDRESS_NETWORK = ipaddress.ip_network("127.0.0.0/8")


def next_free_address(state: ConsulState) -> str:
    """The lowest 127.0.0.N (N >= 2) no node uses yet."""
    used = {node.address for node in state.nodes()}
    for candidate in NODE_ADDRESS_NETWORK.hosts():
        text = str(candidate)
        if candidate.packed[-1] >= 2 and text not in used:
            return text
    raise HttpError(500, "devcluster: no free loopback address left")


def validate_node_address(address: str) -> str | None:
    try:
        parsed = ipaddress.ip_address(address)
    except ValueError:
        return f"devcluster: Address {address!r} is not an IP address"
    if parsed not in NODE_ADDRESS_NETWORK:
        return f"devcluster: Address {address!r} must be a loopback address (127.0.0.0/8)"
    return None


async def register_node(context: RequestContext) -> Reply:
    try:
        body = decode_body(await context.request.read(), DEVCLUSTER_NODE, "devcluster.Node")
    except DecodeError as exc:
        raise HttpError(400, f"Request decode failed: {exc}") from exc
    name = body.get("Node", "")
    if not name:
        raise HttpError(400, "devcluster: Missing node name (field Node)")
    context.require("operator:write")
    existing = context.state.node(name)
    address = body.get("Address") or (existing.address if existing else None)
    if address is None:
        address = next_free_address(context.state)
    problem = validate_node_address(address)
    if problem is not None:
        raise HttpError(400, problem)
    node = context.state.register_node(name, address, body.get("Meta", {}))
    return Reply(data=node_json(node, context.state.datacenter))


async def node_action(context: RequestContext) -> Reply:
    name, _, action = context.tail.partition("/")
    method = context.request.method
    if (
        not name
        or (method == "DELETE" and action)
        or (
            method == "PUT"
            and action
            not in (
                "fail",
                "recover",
                "kill",
            )
        )
    ):
        raise HttpError(404, "Invalid URL path: not a recognized HTTP API endpoint\n")
    context.require("operator:write")
    state = context.state
    if state.node(name) is None:
        raise HttpError(404, f'devcluster: unknown node "{name}"')
    if name == context.api.identity.node_name:
        raise HttpError(400, "devcluster: the server's own node cannot be changed")
    if method == "DELETE":
        state.deregister_node(name)
        return Reply(data=True)
    if action == "kill":
        delay = state.kill_node(name)
        node = state.node(name)
        body = node_json(node, state.datacenter) if node else {}
        return Reply(data=body | {"Failed": False, "FailureDetectedInSeconds": delay})
    state.set_node_failed(name, failed=action == "fail")
    node = state.node(name)
    return Reply(data=node_json(node, state.datacenter) if node else None)


async def list_nodes(context: RequestContext) -> Reply:
    state = context.state
    return Reply(
        data=[node_json(n, state.datacenter) | {"Failed": n.failed} for n in state.nodes()]
    )


ROUTES = [
    Route("/v1/devcluster/node/register", ("PUT",), register_node),
    Route("/v1/devcluster/node/", ("PUT", "DELETE"), node_action),
    Route("/v1/devcluster/nodes", ("GET",), list_nodes),
]
