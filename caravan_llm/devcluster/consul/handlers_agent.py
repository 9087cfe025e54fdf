"""/v1/agent/*: the local agent of a node (the server's own, or X-Devcluster-Node's)."""

from __future__ import annotations

import hashlib
import json

from caravan_llm.devcluster.consul.decode import (
    CHECK_DEFINITION,
    CHECK_UPDATE,
    SERVICE_DEFINITION,
    DecodeError,
    decode_body,
)
from caravan_llm.devcluster.consul.definitions import (
    DefinitionError,
    check_definition,
    service_definition,
)
from caravan_llm.devcluster.consul.http_api import HttpError, Reply, RequestContext, Route
from caravan_llm.devcluster.consul.records import STATUSES, NodeRecord, ServiceRecord, Status
from caravan_llm.devcluster.consul.render import (
    TEMPLATE_AGENT_SERVICE,
    TEMPLATE_CHECK,
    agent_service_json,
    check_json,
)
from caravan_llm.devcluster.consul.state import StateError

PUT = ("PUT",)
GET = ("GET",)


async def _body(context: RequestContext) -> bytes:
    return await context.request.read()


def _decode_failed(exc: DecodeError) -> HttpError:
    return HttpError(400, f"Request decode failed: {exc}")


def _parse_bool(value: str) -> bool | None:
    """Go's strconv.ParseBool."""
    if value in ("1", "t", "T", "TRUE", "true", "True"):
        return True
    if value in ("0", "f", "F", "FALSE", "false", "False"):
        return False
    return None


def member_json(
    context: RequestContext, node: NodeRecord, *, wan: bool = False
) -> dict[str, object]:
    """A serf member; in the WAN pool (servers only) it is `<node>.<dc>` on the WAN port."""
    identity = context.api.identity
    is_server = node.name == identity.node_name
    tags = {
        "dc": context.state.datacenter,
        "role": "consul" if is_server else "node",
        "segment": "",
        "build": f"{identity.version}:devcluster",
        "vsn": "2",
        "vsn_max": "3",
        "vsn_min": "2",
        "id": node.node_id,
    }
    if is_server:
        tags.update({"port": str(identity.server_port), "bootstrap": "1", "expect": "1"})
    if wan:
        # Network segments are a LAN notion; the WAN pool's tags have none.
        del tags["segment"]
    return {
        "Name": f"{node.name}.{context.state.datacenter}" if wan else node.name,
        "Addr": node.address,
        "Port": identity.serf_wan_port if wan else identity.serf_lan_port,
        "Tags": tags,
        "Status": 4 if node.failed else 1,
        "ProtocolMin": 1,
        "ProtocolMax": 5,
        "ProtocolCur": 2,
        "DelegateMin": 2,
        "DelegateMax": 5,
        "DelegateCur": 4,
    }


async def agent_self(context: RequestContext) -> Reply:
    node = context.agent_node()
    context.require("agent:read", node.name)
    identity = context.api.identity
    config = {
        "Datacenter": context.state.datacenter,
        "PrimaryDatacenter": context.state.datacenter,
        "NodeName": node.name,
        "NodeID": node.node_id,
        "Revision": "devcluster",
        "Server": node.name == identity.node_name,
        "Version": identity.version,
        "BuildDate": "2025-01-01T00:00:00Z",
    }
    debug = {
        "Datacenter": context.state.datacenter,
        "NodeName": node.name,
        "NodeID": node.node_id,
        "AdvertiseAddrLAN": node.address,
        "ClientAddrs": ["127.0.0.1"],
        "DevMode": True,
        "ServerMode": node.name == identity.node_name,
        "ACLsEnabled": context.api.acl.enabled,
    }
    return Reply(
        data={
            "Config": config,
            "DebugConfig": debug,
            "Coord": None,
            "Member": member_json(context, node),
            "Stats": agent_stats(context, node),
            "Meta": dict(node.meta),
        }
    )


def agent_stats(context: RequestContext, node: NodeRecord) -> dict[str, dict[str, str]]:
    """Agent.Stats(): Server.Stats() or Client.Stats(), plus the agent's and build's sections.

    A dev server bootstraps itself and leads; `leader_addr` is the address
    /v1/status/leader answers (the RPC address), one datacenter is known.
    """
    identity = context.api.identity
    acl = "enabled" if context.api.acl.enabled else "disabled"
    consul: dict[str, str]
    if node.name == identity.node_name:
        consul = {
            "server": "true",
            "leader": "true",
            "leader_addr": identity.rpc_address,
            "bootstrap": "true",
            "known_datacenters": "1",
            "acl": acl,
        }
    else:
        consul = {"server": "false", "known_servers": "1", "acl": acl}
    state = context.state
    return {
        "consul": consul,
        "agent": {
            "check_monitors": "0",
            "check_ttls": str(sum(1 for c in state.agent_checks(node.name) if c.spec.ttl_s > 0)),
            "checks": str(len(state.agent_checks(node.name))),
            "services": str(len(state.agent_services(node.name))),
        },
        "build": {"prerelease": "", "revision": "devcluster", "version": identity.version},
    }


async def agent_members(context: RequestContext) -> Reply:
    """LAN members (every node), or with `?wan=<anything>` the WAN pool: the servers only."""
    node = context.agent_node()
    wan = bool(context.get("wan"))
    segment = context.get("segment")
    if wan and segment not in ("", "_all"):
        raise HttpError(400, "Cannot provide a segment with wan=true")
    context.authz()
    if wan:
        if node.name != context.api.identity.node_name:
            # Agent.WANMembers: a client agent is in no WAN pool (a JSON null).
            return Reply(data=None)
        # filterMembers: node:read on each member's name (the WAN name is `<node>.<dc>`).
        wan_member = member_json(context, node, wan=True)
        visible = context.may("node:read", str(wan_member["Name"]))
        return Reply(data=[wan_member] if visible else [])
    return Reply(
        data=[
            member_json(context, n)
            for n in context.state.nodes()
            if context.may("node:read", n.name)
        ]
    )


async def agent_services(context: RequestContext) -> Reply:
    node = context.agent_node()
    predicate = context.filter(TEMPLATE_AGENT_SERVICE)
    context.authz()
    out = {}
    for service in context.state.agent_services(node.name):
        if not context.may("service:read", service.name):
            continue
        rendered = agent_service_json(service, context.state.datacenter)
        if predicate is None or predicate(rendered):
            out[service.service_id] = rendered
    return Reply(data=out)


def _content_hash(data: object) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


async def agent_service(context: RequestContext) -> Reply:
    node = context.agent_node()
    service_id = context.tail
    options = context.query_options()
    context.authz()
    wanted_hash = context.get("hash")

    def current() -> tuple[str, dict[str, object] | None]:
        service = context.state.agent_service(node.name, service_id)
        if service is None:
            return "", None
        rendered = agent_service_json(service, context.state.datacenter)
        digest = _content_hash(rendered)
        rendered["ContentHash"] = digest
        return digest, rendered

    digest, rendered = current()
    if wanted_hash and rendered is not None and digest == wanted_hash:
        # Hash-based blocking (agent endpoints have no raft index of their own).
        await context.api.wait_until(lambda: current()[0] != wanted_hash, options.wait_s)
        digest, rendered = current()
    if rendered is None:
        raise HttpError(404, f"unknown service ID: {service_id}")
    context.require("service:read", str(rendered["Service"]))
    return Reply(data=rendered, headers={"X-Consul-ContentHash": digest})


async def agent_checks(context: RequestContext) -> Reply:
    node = context.agent_node()
    predicate = context.filter(TEMPLATE_CHECK)
    context.authz()
    out = {}
    for check in context.state.agent_checks(node.name):
        if check.service_name:
            if not context.may("service:read", check.service_name):
                continue
        elif not context.may("node:read", node.name):
            continue
        rendered = check_json(check, context.state.service_tags(check), indexes=False)
        if predicate is None or predicate(rendered):
            out[check.check_id] = rendered
    return Reply(data=out)


async def register_service(context: RequestContext) -> Reply:
    node = context.agent_node()
    try:
        definition = decode_body(
            await _body(context), SERVICE_DEFINITION, "structs.ServiceDefinition"
        )
    except DecodeError as exc:
        raise _decode_failed(exc) from exc
    try:
        service, checks = service_definition(definition, node.name)
    except DefinitionError as exc:
        if exc.status != 400:
            context.require("service:write", str(definition.get("Name", "")))
        raise HttpError(exc.status, str(exc)) from exc
    context.require("service:write", service.name)
    values = context.getall("replace-existing-checks")
    replace_existing = bool(values) and values[0] in ("", "true")
    context.state.register_service(
        node.name, service, checks, replace_existing_checks=replace_existing
    )
    return Reply(empty=True)


def _known_service(context: RequestContext, node: NodeRecord, service_id: str) -> ServiceRecord:
    service = context.state.agent_service(node.name, service_id)
    context.authz()
    if service is None:
        raise HttpError(
            404,
            f'Unknown service ID "{service_id}". '
            "Ensure that the service ID is passed, not the service name.",
        )
    context.require("service:write", service.name)
    return service


async def deregister_service(context: RequestContext) -> Reply:
    node = context.agent_node()
    service = _known_service(context, node, context.tail)
    context.state.deregister_service(node.name, service.service_id)
    return Reply(empty=True)


async def service_maintenance(context: RequestContext) -> Reply:
    node = context.agent_node()
    service_id = context.tail
    if not service_id:
        raise HttpError(400, "Missing service ID")
    if not context.has("enable"):
        raise HttpError(400, "Missing value for enable")
    raw = context.get("enable")
    enable = _parse_bool(raw)
    if enable is None:
        raise HttpError(400, f'Invalid value for enable: "{raw}"')
    _known_service(context, node, service_id)
    try:
        context.state.set_service_maintenance(
            node.name, service_id, enable=enable, reason=context.get("reason")
        )
    except StateError as exc:
        raise HttpError(exc.status, str(exc)) from exc
    return Reply(empty=True)


async def node_maintenance(context: RequestContext) -> Reply:
    node = context.agent_node()
    if not context.has("enable"):
        raise HttpError(400, "Missing value for enable")
    raw = context.get("enable")
    enable = _parse_bool(raw)
    if enable is None:
        raise HttpError(400, f'Invalid value for enable: "{raw}"')
    context.require("node:write", node.name)
    context.state.set_node_maintenance(node.name, enable=enable, reason=context.get("reason"))
    return Reply(empty=True)


async def register_check(context: RequestContext) -> Reply:
    node = context.agent_node()
    try:
        definition = decode_body(await _body(context), CHECK_DEFINITION, "structs.CheckDefinition")
    except DecodeError as exc:
        raise _decode_failed(exc) from exc
    try:
        spec = check_definition(definition)
    except DefinitionError as exc:
        raise HttpError(exc.status, str(exc)) from exc
    if spec.service_id:
        # A service's check needs service:write on that service (vetCheckRegister).
        service = context.state.agent_service(node.name, spec.service_id)
        context.require("service:write", service.name if service else spec.service_id)
    else:
        context.require("node:write", node.name)
    try:
        context.state.register_check(node.name, spec)
    except StateError as exc:
        raise HttpError(exc.status, str(exc)) from exc
    return Reply(empty=True)


def _known_check(context: RequestContext, node: NodeRecord, check_id: str) -> None:
    check = context.state.agent_check(node.name, check_id)
    context.authz()
    if check is None:
        raise HttpError(
            404,
            f'Unknown check ID "{check_id}". Ensure that the check ID is passed, '
            "not the check name.",
        )
    if check.service_name:
        context.require("service:write", check.service_name)
    else:
        context.require("node:write", node.name)


async def deregister_check(context: RequestContext) -> Reply:
    node = context.agent_node()
    _known_check(context, node, context.tail)
    context.state.deregister_check(node.name, context.tail)
    return Reply(empty=True)


async def _ttl_update(context: RequestContext, status: Status, output: str) -> Reply:
    node = context.agent_node()
    check_id = context.tail
    _known_check(context, node, check_id)
    try:
        context.state.update_ttl_check(node.name, check_id, status, output)
    except StateError as exc:
        raise HttpError(exc.status, str(exc)) from exc
    return Reply(empty=True)


async def check_pass(context: RequestContext) -> Reply:
    return await _ttl_update(context, "passing", context.get("note"))


async def check_warn(context: RequestContext) -> Reply:
    return await _ttl_update(context, "warning", context.get("note"))


async def check_fail(context: RequestContext) -> Reply:
    return await _ttl_update(context, "critical", context.get("note"))


async def check_update(context: RequestContext) -> Reply:
    try:
        update = decode_body(await _body(context), CHECK_UPDATE, "agent.checkUpdate")
    except DecodeError as exc:
        raise _decode_failed(exc) from exc
    status = update.get("Status", "")
    for known in STATUSES:
        if status == known:
            return await _ttl_update(context, known, update.get("Output", ""))
    raise HttpError(400, f"Invalid check status: '{status}'")


_HEALTH_CODES = {"passing": 200, "warning": 429, "critical": 503}


def _aggregate(statuses: list[str]) -> str:
    for status in ("critical", "warning"):
        if status in statuses:
            return status
    return "passing"


def _service_health(
    context: RequestContext, node: NodeRecord, service: ServiceRecord
) -> tuple[int, str, dict[str, object]]:
    # State.ChecksForService(id, includeNodeChecks=true): the service's checks
    # and the agent's own node-level checks (serfHealth is not one of them).
    checks = [
        c for c in context.state.agent_checks(node.name) if c.service_id in ("", service.service_id)
    ]
    status = _aggregate([c.status for c in checks])
    body: dict[str, object] = {
        "AggregatedStatus": status,
        "Service": agent_service_json(service, context.state.datacenter),
        "Checks": [
            {
                k: v
                for k, v in check_json(c, service.tags, indexes=False).items()
                if k != "Definition"
            }
            for c in checks
        ],
    }
    return _HEALTH_CODES[status], status, body


def _text_wanted(context: RequestContext) -> bool:
    if context.request.headers.get("Accept", "").startswith("text/plain"):
        return True
    return context.get("format") == "text"


async def health_by_name(context: RequestContext) -> Reply:
    node = context.agent_node()
    name = context.tail
    if not name:
        raise HttpError(400, "Missing service Name")
    context.require("service:read", name)
    code, status, results = 404, f"ServiceName {name} Not Found", []
    for service in context.state.agent_services(node.name):
        if service.name != name:
            continue
        service_code, service_status, body = _service_health(context, node, service)
        results.append(body)
        if code == 404 or code < service_code:
            code, status = service_code, service_status
    headers = {"X-Consul-Reason": status}
    if _text_wanted(context):
        return Reply(raw=status.encode(), status=code, content_type="text/plain", headers=headers)
    return Reply(data=results, status=code, headers=headers)


async def health_by_id(context: RequestContext) -> Reply:
    node = context.agent_node()
    service_id = context.tail
    if not service_id:
        raise HttpError(400, "Missing serviceID")
    service = context.state.agent_service(node.name, service_id)
    if service is None:
        reason = f"ServiceId {service_id} not found"
        if _text_wanted(context):
            return Reply(raw=reason.encode(), status=404, content_type="text/plain")
        body: dict[str, object] = {"AggregatedStatus": "critical", "Checks": None, "Service": None}
        return Reply(data=body, status=404, headers={"X-Consul-Reason": reason})
    context.require("service:read", service.name)
    code, status, body = _service_health(context, node, service)
    if _text_wanted(context):
        return Reply(raw=status.encode(), status=code, content_type="text/plain")
    return Reply(data=body, status=code, headers={"X-Consul-Reason": status})


ROUTES = [
    Route("/v1/agent/self", GET, agent_self),
    Route("/v1/agent/members", GET, agent_members),
    Route("/v1/agent/services", GET, agent_services),
    Route("/v1/agent/service/", GET, agent_service),
    Route("/v1/agent/checks", GET, agent_checks),
    Route("/v1/agent/service/register", PUT, register_service),
    Route("/v1/agent/service/deregister/", PUT, deregister_service),
    Route("/v1/agent/service/maintenance/", PUT, service_maintenance),
    Route("/v1/agent/maintenance", PUT, node_maintenance),
    Route("/v1/agent/check/register", PUT, register_check),
    Route("/v1/agent/check/deregister/", PUT, deregister_check),
    Route("/v1/agent/check/pass/", PUT, check_pass),
    Route("/v1/agent/check/warn/", PUT, check_warn),
    Route("/v1/agent/check/fail/", PUT, check_fail),
    Route("/v1/agent/check/update/", PUT, check_update),
    Route("/v1/agent/health/service/name/", GET, health_by_name),
    Route("/v1/agent/health/service/id/", GET, health_by_id),
]
