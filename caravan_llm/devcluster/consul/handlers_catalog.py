"""/v1/catalog/*, /v1/health/* and /v1/status/*: cluster-wide reads, all blocking-capable."""

from __future__ import annotations

from typing import Any

from caravan_llm.devcluster.consul.http_api import HttpError, Reply, RequestContext, Route
from caravan_llm.devcluster.consul.records import STATUSES, CheckRecord, NodeRecord
from caravan_llm.devcluster.consul.render import (
    TEMPLATE_CATALOG_SERVICE,
    TEMPLATE_CHECK,
    TEMPLATE_HEALTH_ENTRY,
    TEMPLATE_NODE,
    TEMPLATE_NODE_SERVICE,
    catalog_service_json,
    check_json,
    health_entry_json,
    node_json,
    node_service_json,
)
from caravan_llm.devcluster.consul.state import ServiceInstance

GET = ("GET",)


def _visible_instance(context: RequestContext, instance: ServiceInstance) -> bool:
    """aclFilter on service nodes: node:read on the node and service:read on the service."""
    return context.may("node:read", instance.node.name) and context.may(
        "service:read", instance.service.name
    )


def _visible_check(context: RequestContext, check: CheckRecord) -> bool:
    """aclFilter on health checks: node:read, and service:read for a service's check."""
    if not context.may("node:read", check.node):
        return False
    return not check.service_name or context.may("service:read", check.service_name)


def _parse_bool(value: str) -> bool | None:
    if value in ("1", "t", "T", "TRUE", "true", "True"):
        return True
    if value in ("0", "f", "F", "FALSE", "false", "False"):
        return False
    return None


def _node_meta_filter(context: RequestContext) -> list[tuple[str, str]]:
    pairs = []
    for raw in context.getall("node-meta"):
        key, _, value = raw.partition(":")
        pairs.append((key, value))
    return pairs


def _node_matches(node: NodeRecord, pairs: list[tuple[str, str]]) -> bool:
    return all(node.meta.get(k) == v for k, v in pairs)


def _has_tags(instance: ServiceInstance, tags: list[str]) -> bool:
    # Consul compares tags case-insensitively (serviceTagFilter).
    lowered = {t.lower() for t in instance.service.tags}
    return all(tag.lower() in lowered for tag in tags)


def _all_passing(instance: ServiceInstance) -> bool:
    return all(check.status == "passing" for check in instance.checks)


async def health_service(context: RequestContext) -> Reply:
    name = context.tail
    if not name:
        raise HttpError(400, "Missing service name")
    options = context.query_options()
    passing = False
    if context.has("passing"):
        raw = context.get("passing")
        parsed = True if raw == "" else _parse_bool(raw)
        if parsed is None:
            raise HttpError(400, "Invalid value for ?passing")
        passing = parsed
    tags = context.getall("tag")
    meta_pairs = _node_meta_filter(context)
    predicate = context.filter(TEMPLATE_HEALTH_ENTRY)
    state = context.state

    def compute() -> tuple[int, list[dict[str, Any]]]:
        entries: list[dict[str, Any]] = []
        for instance in state.instances(name):
            if not _visible_instance(context, instance):
                continue
            if not _has_tags(instance, tags) or not _node_matches(instance.node, meta_pairs):
                continue
            if passing and not _all_passing(instance):
                continue
            rendered = health_entry_json(instance, state)
            if predicate is None or predicate(rendered):
                entries.append(rendered)
        return state.service_index(name), entries

    return await context.block(options, compute)


async def health_state(context: RequestContext) -> Reply:
    wanted = context.tail
    if not wanted:
        raise HttpError(400, "Missing check state")
    options = context.query_options()
    predicate = context.filter(TEMPLATE_CHECK)
    meta_pairs = _node_meta_filter(context)
    state = context.state

    def compute() -> tuple[int, list[dict[str, Any]]]:
        out = []
        for check in state.all_checks():
            if not _visible_check(context, check):
                continue
            if wanted not in ("any", check.status):
                continue
            node = state.node(check.node)
            if node is None or not _node_matches(node, meta_pairs):
                continue
            rendered = check_json(check, state.service_tags(check))
            if predicate is None or predicate(rendered):
                out.append(rendered)
        return state.checks_index(), out

    return await context.block(options, compute)


def _render_checks(
    context: RequestContext, checks: list[CheckRecord], template: dict[str, Any]
) -> list[dict[str, Any]]:
    predicate = context.filter(template)
    visible = [c for c in checks if _visible_check(context, c)]
    rendered = [check_json(c, context.state.service_tags(c)) for c in visible]
    return [r for r in rendered if predicate is None or predicate(r)]


async def health_checks(context: RequestContext) -> Reply:
    name = context.tail
    if not name:
        raise HttpError(400, "Missing service name")
    options = context.query_options()
    context.filter(TEMPLATE_CHECK)
    state = context.state

    def compute() -> tuple[int, list[dict[str, Any]]]:
        checks = [c for c in state.all_checks() if c.service_name == name and c.service_id]
        return state.service_index(name), _render_checks(context, checks, TEMPLATE_CHECK)

    return await context.block(options, compute)


async def health_node(context: RequestContext) -> Reply:
    name = context.tail
    if not name:
        raise HttpError(400, "Missing node name")
    options = context.query_options()
    context.filter(TEMPLATE_CHECK)
    state = context.state

    def compute() -> tuple[int, list[dict[str, Any]]]:
        checks = state.checks_on(name)
        return state.checks_index(), _render_checks(context, checks, TEMPLATE_CHECK)

    return await context.block(options, compute)


async def catalog_services(context: RequestContext) -> Reply:
    """Catalog.ListServices: `?filter=` runs per instance over /v1/catalog/service's fields.

    The answer is servicesTagsByName of the surviving instances: the union of
    their tags, and a name none of whose instances survived is left out.
    """
    options = context.query_options()
    meta_pairs = _node_meta_filter(context)
    predicate = context.filter(TEMPLATE_CATALOG_SERVICE)
    state = context.state

    def compute() -> tuple[int, dict[str, list[str]]]:
        services: dict[str, list[str]] = {}
        for service in state.all_services():
            # Catalog.ListServices: the names the token may read (nodes are not checked).
            if not context.may("service:read", service.name):
                continue
            node = state.node(service.node)
            if node is None or not _node_matches(node, meta_pairs):
                continue
            if predicate is not None and not predicate(
                catalog_service_json(ServiceInstance(node, service, ()), state.datacenter)
            ):
                continue
            tags = services.setdefault(service.name, [])
            tags.extend(t for t in service.tags if t not in tags)
        return state.catalog_index(), {name: services[name] for name in sorted(services)}

    return await context.block(options, compute)


async def catalog_service(context: RequestContext) -> Reply:
    name = context.tail
    if not name:
        raise HttpError(400, "Missing service name")
    options = context.query_options()
    tags = context.getall("tag")
    meta_pairs = _node_meta_filter(context)
    predicate = context.filter(TEMPLATE_CATALOG_SERVICE)
    state = context.state

    def compute() -> tuple[int, list[dict[str, Any]]]:
        out = []
        for instance in state.instances(name):
            if not _visible_instance(context, instance):
                continue
            if not _has_tags(instance, tags) or not _node_matches(instance.node, meta_pairs):
                continue
            rendered = catalog_service_json(instance, state.datacenter)
            if predicate is None or predicate(rendered):
                out.append(rendered)
        return state.service_index(name), out

    return await context.block(options, compute)


async def catalog_nodes(context: RequestContext) -> Reply:
    options = context.query_options()
    meta_pairs = _node_meta_filter(context)
    predicate = context.filter(TEMPLATE_NODE)
    state = context.state

    def compute() -> tuple[int, list[dict[str, Any]]]:
        out = []
        for node in state.nodes():
            if not context.may("node:read", node.name):
                continue
            if not _node_matches(node, meta_pairs):
                continue
            rendered = node_json(node, state.datacenter)
            if predicate is None or predicate(rendered):
                out.append(rendered)
        return state.nodes_index(), out

    return await context.block(options, compute)


async def catalog_node(context: RequestContext) -> Reply:
    name = context.tail
    if not name:
        raise HttpError(400, "Missing node name")
    options = context.query_options()
    # Catalog.NodeServices filters the Services map by NodeService fields; the
    # expression is checked even when the node does not exist.
    predicate = context.filter(TEMPLATE_NODE_SERVICE)
    state = context.state

    def compute() -> tuple[int, dict[str, Any] | None]:
        node = state.node(name)
        index = max(state.nodes_index(), state.catalog_index())
        if node is None or not context.may("node:read", node.name):
            return index, None
        rendered = {
            s.service_id: node_service_json(s)
            for s in state.services_on(name)
            if context.may("service:read", s.name)
        }
        services = {
            sid: svc for sid, svc in rendered.items() if predicate is None or predicate(svc)
        }
        return index, {"Node": node_json(node, state.datacenter), "Services": services}

    return await context.block(options, compute)


async def catalog_datacenters(context: RequestContext) -> Reply:
    return Reply(data=[context.state.datacenter])


async def status_leader(context: RequestContext) -> Reply:
    return Reply(data=context.api.identity.rpc_address)


async def status_peers(context: RequestContext) -> Reply:
    return Reply(data=[context.api.identity.rpc_address])


# Health states Consul knows; others simply match no check.
KNOWN_STATES = (*STATUSES, "any")

ROUTES = [
    Route("/v1/health/service/", GET, health_service),
    Route("/v1/health/state/", GET, health_state),
    Route("/v1/health/checks/", GET, health_checks),
    Route("/v1/health/node/", GET, health_node),
    Route("/v1/catalog/services", GET, catalog_services),
    Route("/v1/catalog/service/", GET, catalog_service),
    Route("/v1/catalog/nodes", GET, catalog_nodes),
    Route("/v1/catalog/node/", GET, catalog_node),
    Route("/v1/catalog/datacenters", GET, catalog_datacenters),
    Route("/v1/status/leader", GET, status_leader),
    Route("/v1/status/peers", GET, status_peers),
]
