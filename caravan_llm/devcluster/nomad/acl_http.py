"""/v1/acl/*: the part of Nomad's ACL API caravan's tests need (`command/agent/acl_endpoint.go`).

PUT|POST /v1/acl/policy/:name  {"Name", "Description", "Rules"}; empty 200 with the index
GET      /v1/acl/policy/:name  management, a token holding the policy, or `anonymous`
PUT|POST /v1/acl/token         {"Name", "Type": "client"|"management", "Policies": [...]}
GET      /v1/acl/token/self    the caller's token (the anonymous token without one)

Writes need a management token. With ACLs disabled every route answers 400
`ACL support disabled`, as Nomad does.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from aiohttp import web

from caravan_llm.devcluster.nomad import http_api
from caravan_llm.devcluster.nomad.acl import PERMISSION_DENIED, AclRequestError, Token
from caravan_llm.devcluster.nomad.endpoints import ApiError

TABLES = ("acl_policy", "acl_token")


def _check_enabled(request: web.Request) -> None:
    if not http_api.server_of(request).acl.enabled:
        raise ApiError(400, "ACL support disabled")


def _require_management(request: web.Request) -> None:
    if not http_api.resolved_of(request).acl.management:
        raise ApiError(403, PERMISSION_DENIED)


async def _body(request: web.Request) -> Mapping[str, Any]:
    try:
        body = json.loads(await request.read() or b"null")
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, str(exc)) from None
    if not isinstance(body, Mapping):
        raise ApiError(400, "json: cannot unmarshal into Go value of type structs.ACLPolicy")
    return body


def _index(request: web.Request) -> int:
    state = http_api.server_of(request).state
    for table in TABLES:
        state.table_index.setdefault(table, 1)
    return state.tables_index(TABLES)


async def policy_upsert(request: web.Request) -> web.Response:
    _check_enabled(request)
    body = await _body(request)
    _require_management(request)
    server = http_api.server_of(request)
    try:
        policy = server.acl.prepare_policy(request.match_info["name"], body)
    except AclRequestError as exc:
        raise ApiError(exc.status, exc.text) from None
    _index(request)
    index = server.state.commit(("acl_policy",), lambda i: server.acl.store_policy(policy, i))
    # Nomad's write handlers return no object here: an empty 200 with the index.
    return web.Response(headers={"X-Nomad-Index": str(index)})


async def policy_get(request: web.Request) -> web.Response:
    _check_enabled(request)
    server = http_api.server_of(request)
    name = request.match_info["name"]
    if not server.acl.may_read_policy(http_api.resolved_of(request), name):
        raise ApiError(403, PERMISSION_DENIED)
    policy = server.acl.policy(name)
    if policy is None:
        raise ApiError(404, "ACL policy not found")
    return http_api.json_response(policy.to_api(), index=_index(request))


async def token_create(request: web.Request) -> web.Response:
    _check_enabled(request)
    body = await _body(request)
    _require_management(request)
    server = http_api.server_of(request)
    try:
        token = server.acl.prepare_token(body)
    except AclRequestError as exc:
        raise ApiError(exc.status, exc.text) from None
    _index(request)
    stored: list[Token] = []
    index = server.state.commit(
        ("acl_token",), lambda i: stored.append(server.acl.store_token(token, i))
    )
    return http_api.json_response(stored[0].to_api(), index=index)


async def token_self(request: web.Request) -> web.Response:
    _check_enabled(request)
    token = http_api.resolved_of(request).token
    return http_api.json_response(token.to_api(), index=max(token.create_index, 1))


ROUTES = [
    web.put("/v1/acl/policy/{name}", policy_upsert),
    web.post("/v1/acl/policy/{name}", policy_upsert),
    web.get("/v1/acl/policy/{name}", policy_get),
    web.put("/v1/acl/token", token_create),
    web.post("/v1/acl/token", token_create),
    web.get("/v1/acl/token/self", token_self),
]
