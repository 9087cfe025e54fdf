"""/v1/acl/*: the subset of Consul's ACL API caravan's tests need.

PUT /v1/acl/policy      {"Name": "...", "Description": "...", "Rules": "<HCL or JSON>"}
PUT /v1/acl/token       {"Description": "...", "Policies": [{"Name": "..."}], "SecretID": "<uuid>"}
GET /v1/acl/token/self  the calling token (needs no permission)

Both writes need acl:write. With ACLs disabled every endpoint answers 401
`ACL support disabled`, as Consul does.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from caravan_llm.devcluster.consul.acl import AclRequestError
from caravan_llm.devcluster.consul.http_api import HttpError, Reply, RequestContext, Route


def _check_enabled(context: RequestContext) -> None:
    if not context.api.acl.enabled:
        raise HttpError(401, "ACL support disabled")


async def _body(context: RequestContext, what: str) -> Mapping[str, Any]:
    raw = await context.request.read()
    try:
        body = json.loads(raw or b"{}")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise HttpError(400, f"{what} decoding failed: {exc}") from exc
    if not isinstance(body, Mapping):
        raise HttpError(400, f"{what} decoding failed: expected a JSON object")
    return body


async def policy_create(context: RequestContext) -> Reply:
    _check_enabled(context)
    body = await _body(context, "Policy")
    context.require("acl:write")
    try:
        data = context.api.acl.create_policy(body, context.state.raft.next_index())
    except AclRequestError as exc:
        raise HttpError(exc.status, exc.text) from exc
    return Reply(data=data)


async def token_create(context: RequestContext) -> Reply:
    _check_enabled(context)
    body = await _body(context, "Token")
    context.require("acl:write")
    try:
        data = context.api.acl.create_token(body, context.state.raft.next_index())
    except AclRequestError as exc:
        raise HttpError(exc.status, exc.text) from exc
    return Reply(data=data)


async def token_self(context: RequestContext) -> Reply:
    _check_enabled(context)
    context.check_datacenter()
    authz = context.authz()
    data = context.api.acl.token_json_for(authz.accessor_id)
    if data is None:
        raise HttpError(404, "Supplied token does not exist")
    return Reply(data=data)


ROUTES = [
    Route("/v1/acl/policy", ("PUT",), policy_create),
    Route("/v1/acl/token", ("PUT",), token_create),
    Route("/v1/acl/token/self", ("GET",), token_self),
]
