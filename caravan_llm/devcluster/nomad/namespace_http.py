"""Nomad's namespace endpoints: `GET /v1/namespaces`, `GET|PUT|POST|DELETE /v1/namespace/:name`
and `PUT|POST /v1/namespace` (`command/agent/namespace_endpoint.go`, `nomad/namespace_endpoint.go`).

The handlers check the token themselves, in Nomad's order: a write decodes the
body and compares the name with the path (400s) before the RPC refuses a token
that is not management (403); reads need some capability in the namespace
(`AllowNamespace`), and the list keeps only such namespaces.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from aiohttp import web

from caravan_llm.devcluster.nomad import http_api
from caravan_llm.devcluster.nomad.acl import PERMISSION_DENIED
from caravan_llm.devcluster.nomad.decode import DecodeError, decode_body
from caravan_llm.devcluster.nomad.endpoints import ApiError
from caravan_llm.devcluster.nomad.gotext import go_quote, multierror
from caravan_llm.devcluster.nomad.namespaces import (
    DEFAULT_NAMESPACE,
    NAMESPACE_BODY,
    delete_problems,
    namespace_from_body,
    problems,
    quota_problem,
)

if TYPE_CHECKING:
    from aiohttp.web_urldispatcher import UrlDispatcher

TABLES = ("namespaces",)


def _written(index: int) -> web.Response:
    # Nomad's write handlers return no object: an empty 200 with the index.
    return web.Response(headers={"X-Nomad-Index": str(index)})


def _require_management(request: web.Request) -> None:
    if not http_api.resolved_of(request).acl.management:
        raise ApiError(403, PERMISSION_DENIED)


async def list_namespaces(request: web.Request) -> web.Response:
    index = await http_api.block_on(request, TABLES)
    acl = http_api.resolved_of(request).acl
    prefix = request.query.get("prefix", "")
    stored = http_api.server_of(request).state.namespaces
    body = [
        stored[name].to_api()
        for name in sorted(stored)
        if name.startswith(prefix) and acl.allow_namespace(name)
    ]
    return http_api.json_response(body, index=index)


async def get_namespace(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    if not http_api.resolved_of(request).acl.allow_namespace(name):
        raise ApiError(403, PERMISSION_DENIED)
    index = await http_api.block_on(request, TABLES)
    found = http_api.server_of(request).state.namespaces.get(name)
    if found is None:
        raise ApiError(404, "Namespace not found")
    return http_api.json_response(found.to_api(), index=found.modify_index or index)


async def upsert_namespace(request: web.Request) -> web.Response:
    path_name = request.match_info.get("name", "")
    body = await request.read()
    try:
        decoded: dict[str, Any] = decode_body(body, NAMESPACE_BODY)
    except DecodeError as exc:
        raise ApiError(400, str(exc)) from None
    namespace = namespace_from_body(decoded)
    if path_name and namespace.name != path_name:
        raise ApiError(400, "Namespace name does not match request path")
    _require_management(request)
    found = problems(namespace)
    if found:
        raise ApiError(500, f"Invalid namespace {go_quote(namespace.name)}: {multierror(found)}")
    quota = quota_problem(namespace)
    if quota is not None:
        raise ApiError(500, quota)
    return _written(http_api.server_of(request).state.upsert_namespace(namespace))


async def delete_namespace(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    _require_management(request)
    if name == DEFAULT_NAMESPACE:
        raise ApiError(500, "can not delete default namespace")
    server = http_api.server_of(request)
    state = server.state
    if name not in state.namespaces:
        raise ApiError(500, "namespace not found")
    found = delete_problems(
        name,
        live_jobs=any(
            job.get("Status") != "dead" for (ns, _), job in state.jobs.items() if ns == name
        ),
        live_allocations=any(
            not alloc.client_terminal for alloc in state.allocs.values() if alloc.namespace == name
        ),
        variables=bool(server.variables.list(name, "")),
    )
    if found:
        raise ApiError(500, multierror(found))
    return _written(state.delete_namespace(name))


async def missing_name(_request: web.Request) -> web.Response:
    raise ApiError(400, "Missing Namespace Name")


async def _bad_method(_request: web.Request) -> web.Response:
    raise ApiError(405, "Invalid method")


def add_routes(route: UrlDispatcher) -> None:
    route.add_get("/v1/namespaces", list_namespaces)
    route.add_get("/v1/namespace/{name}", get_namespace)
    route.add_delete("/v1/namespace/{name}", delete_namespace)
    for method in ("PUT", "POST"):
        route.add_route(method, "/v1/namespace/{name}", upsert_namespace)
        route.add_route(method, "/v1/namespace", upsert_namespace)
    route.add_route("*", "/v1/namespace/", missing_name)
    route.add_get("/v1/namespace", _bad_method)
