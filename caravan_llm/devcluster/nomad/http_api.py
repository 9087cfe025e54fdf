"""Nomad's HTTP API on aiohttp: routes, JSON shapes, status codes, headers.

Reads answer with `X-Nomad-Index`, `X-Nomad-KnownLeader` and
`X-Nomad-LastContact` and block with `?index=&wait=` (at most 300 s, plus up
to wait/16 of jitter, woken by any write to the table they read). Errors are
`text/plain`, with Nomad's codes: 400 for decoding and request errors, 403
for ACL, 404 for unknown objects, 500 for validation failures and other
server errors. `/v1/devcluster/*` is the stand-in's own control surface.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from aiohttp import web

from caravan_llm.devcluster.nomad import acl_http, fs_logs, http_ops, namespace_http
from caravan_llm.devcluster.nomad.acl import (
    PERMISSION_DENIED,
    TOKEN_NOT_FOUND,
    Resolved,
    TokenNotFoundError,
    allowed,
    job_volumes_allowed,
    requirement,
)
from caravan_llm.devcluster.nomad.decode import (
    JOB_PLAN_REQUEST,
    JOB_REGISTER_REQUEST,
    JOB_VALIDATE_REQUEST,
    NODE_DRAIN_REQUEST,
    NODE_ELIGIBILITY_REQUEST,
    DecodeError,
    decode_body,
)
from caravan_llm.devcluster.nomad.endpoints import ApiError, request_namespace
from caravan_llm.devcluster.nomad.events import TopicQueryError, event_matches, parse_topics
from caravan_llm.devcluster.nomad.gotext import NS_PER_S, parse_go_duration
from caravan_llm.devcluster.nomad.model import Allocation, Evaluation
from caravan_llm.devcluster.nomad.settings import NodeSpec
from caravan_llm.devcluster.nomad.variables import variable_routes

if TYPE_CHECKING:
    from caravan_llm.devcluster.nomad.server import NomadServer

Json = dict[str, Any]
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

log = logging.getLogger(__name__)

MAX_BLOCKING_S = 300.0
JITTER_FRACTION = 16
OUTAGE_TEXT = "rpc error: No cluster leader"
SERVER_KEY = web.AppKey("nomad_server", object)
RESOLVED_KEY = web.RequestKey("devcluster_nomad_acl", Resolved)
OPEN_PATHS = ("/v1/status/", "/v1/regions", "/v1/agent/health")
# Routes that check the token themselves, after their own parameters (fs_logs.py).
SELF_CHECKED_PATHS = (fs_logs.LOGS_PATH,)


def _json_response(body: Any, *, index: int | None = None, status: int = 200) -> web.Response:
    headers = {"X-Nomad-KnownLeader": "true", "X-Nomad-LastContact": "0"}
    if index is not None:
        headers["X-Nomad-Index"] = str(index)
    return web.Response(
        text=json.dumps(body), status=status, content_type="application/json", headers=headers
    )


def _error(status: int, text: str) -> web.Response:
    return web.Response(text=text, status=status, content_type="text/plain")


def _server(request: web.Request) -> NomadServer:
    server: NomadServer = request.app[SERVER_KEY]  # type: ignore[assignment]
    return server


GO_TRUE = frozenset({"1", "t", "T", "TRUE", "true", "True"})
GO_FALSE = frozenset({"0", "f", "F", "FALSE", "false", "False"})


def parse_go_bool(name: str, raw: str | None) -> bool | None:
    """Nomad's `parseBool`: absent or blank is unset (None), else `strconv.ParseBool`."""
    if raw is None or raw == "":
        return None
    if raw in GO_TRUE:
        return True
    if raw in GO_FALSE:
        return False
    quoted = json.dumps(raw)
    raise ValueError(
        f'Failed to parse value of "{name}" ({raw}) as a bool: strconv.ParseBool: '
        f"parsing {quoted}: invalid syntax"
    )


def _bool_param(request: web.Request, name: str, *, status: int = 500, prefix: str = "") -> bool:
    """A boolean query parameter, false when unset; a bad value is `status` with Nomad's text
    (a plain error, so 500, on most endpoints)."""
    try:
        value = parse_go_bool(name, request.query.get(name))
    except ValueError as exc:
        raise ApiError(status, f"{prefix}{exc}") from None
    return bool(value)


async def _block(request: web.Request, tables: Sequence[str]) -> int:
    """Honour `?index=&wait=`; return the index to answer with."""
    state = _server(request).state
    raw_index = request.query.get("index")
    if raw_index is not None:
        if not raw_index.isdigit():
            raise ApiError(400, "Invalid index")
        min_index = int(raw_index)
        wait_s = MAX_BLOCKING_S
        raw_wait = request.query.get("wait")
        if raw_wait is not None:
            try:
                wait_s = parse_go_duration(raw_wait) / NS_PER_S
            except ValueError:
                raise ApiError(400, "Invalid wait time") from None
        wait_s = min(max(wait_s, 0.0), MAX_BLOCKING_S)
        if min_index > 0 and wait_s > 0:
            wait_s += random.uniform(0, wait_s / JITTER_FRACTION)
            await state.wait_for_change(tables, min_index, wait_s)
    return max(state.tables_index(tables), 1)


def _namespace(request: web.Request) -> str:
    return request.query.get("namespace") or "default"


def _in_namespace(request: web.Request, namespace: str) -> bool:
    wanted = _namespace(request)
    return wanted in {"*", namespace}


async def _decode(request: web.Request, schema: Any) -> Json:
    body = await request.read()
    try:
        decoded: Json = decode_body(body, schema)
    except DecodeError as exc:
        raise ApiError(400, str(exc)) from None
    return decoded


# Shared with the handler modules (`http_ops`).
json_response = _json_response
block_on = _block
server_of = _server
namespace_of = _namespace
decode_request = _decode


# -- middleware ------------------------------------------------------------


def _secret(request: web.Request) -> str:
    given = request.headers.get("X-Nomad-Token", "")
    bearer = request.headers.get("Authorization", "")
    if not given and bearer.startswith("Bearer "):
        given = bearer.removeprefix("Bearer ")
    return given


def resolved_of(request: web.Request) -> Resolved:
    """The caller the middleware resolved (the management ACL when ACLs are off)."""
    found = request.get(RESOLVED_KEY)
    return found if found is not None else _server(request).acl.resolve("")


def _log_answer(request: web.Request, status: int) -> None:
    if log.isEnabledFor(logging.DEBUG):
        resolved = request.get(RESOLVED_KEY)
        accessor_id = None if resolved is None else resolved.token.accessor_id
        log.debug(
            "nomad_request",
            extra={
                "method": request.method,
                "path": request.path,
                "status": status,
                # Which token was answered (an AccessorID is not a secret).
                "accessor_id": accessor_id,
            },
        )


async def _answer(request: web.Request, handler: Handler) -> web.StreamResponse:
    server = _server(request)
    path = request.path
    if server.acl.enabled and not path.startswith(OPEN_PATHS + SELF_CHECKED_PATHS):
        try:
            resolved = server.acl.resolve(_secret(request))
        except TokenNotFoundError:
            # Agent routes resolve the token themselves (ResolveToken); RPC-backed
            # routes authenticate first and answer an unknown token as a denial.
            text = TOKEN_NOT_FOUND if path.startswith("/v1/agent/") else PERMISSION_DENIED
            return _error(403, text)
        request[RESOLVED_KEY] = resolved
        need = requirement(request.method, path)
        if not _checks_job_namespace(request) and not allowed(
            resolved.acl, need, _namespace(request)
        ):
            return _error(403, PERMISSION_DENIED)
    if server.outage and not path.startswith("/v1/devcluster/"):
        return _error(500, OUTAGE_TEXT)
    try:
        return await handler(request)
    except ApiError as exc:
        return _error(exc.status, exc.text)


def _checks_job_namespace(request: web.Request) -> bool:
    """Job register and plan: the handler checks the namespace the job goes to
    (`namespaceForJob`), which may not be the query's."""
    if request.method not in {"PUT", "POST"}:
        return False
    parts = request.path.removeprefix("/v1/").split("/")
    return parts == ["jobs"] or (
        len(parts) in {2, 3} and parts[0] == "job" and parts[2:] in ([], ["plan"])
    )


def _check_job_write(request: web.Request, decoded: Json, *, volumes: bool) -> None:
    """Nomad's Job.Register / Job.Plan ACL checks, in the job's own namespace
    (only a register checks the volumes it mounts)."""
    job = decoded.get("Job") or {}
    namespace = request_namespace(job, request.query.get("namespace"), decoded.get("Namespace"))
    acl = resolved_of(request).acl
    if not allowed(acl, requirement(request.method, request.path), namespace):
        raise ApiError(403, PERMISSION_DENIED)
    if volumes and not job_volumes_allowed(acl, namespace, job):
        raise ApiError(403, PERMISSION_DENIED)


@web.middleware
async def _middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    response = await _answer(request, handler)
    _log_answer(request, response.status)
    return response


# -- jobs ----------------------------------------------------------------


def _job_stub(server: NomadServer, job: Json, *, with_meta: bool) -> Json:
    summary = server.state.job_summary(str(job["Namespace"]), str(job["ID"]))
    stub = {
        "ID": job["ID"],
        "ParentID": job.get("ParentID", ""),
        "Name": job.get("Name", job["ID"]),
        "Namespace": job["Namespace"],
        "Datacenters": job.get("Datacenters"),
        "NodePool": job.get("NodePool", "default"),
        "Multiregion": None,
        "Type": job.get("Type"),
        "Priority": job.get("Priority"),
        "Periodic": job.get("Periodic") is not None,
        "ParameterizedJob": job.get("ParameterizedJob") is not None and not job.get("Dispatched"),
        "Stop": job.get("Stop", False),
        "Status": job.get("Status", ""),
        "StatusDescription": job.get("StatusDescription", ""),
        "JobSummary": summary,
        "CreateIndex": job.get("CreateIndex", 0),
        "ModifyIndex": job.get("ModifyIndex", 0),
        "JobModifyIndex": job.get("JobModifyIndex", 0),
        "SubmitTime": job.get("SubmitTime", 0),
        "Version": job.get("Version", 0),
    }
    if with_meta:
        stub["Meta"] = job.get("Meta")
    return stub


async def list_jobs(request: web.Request) -> web.Response:
    with_meta = _bool_param(request, "meta")
    index = await _block(request, ("jobs",))
    server = _server(request)
    prefix = request.query.get("prefix", "")
    jobs = [
        _job_stub(server, job, with_meta=with_meta)
        for (namespace, job_id), job in sorted(server.state.jobs.items())
        if job_id.startswith(prefix) and _in_namespace(request, namespace)
    ]
    return _json_response(jobs, index=index)


async def register_job(request: web.Request) -> web.Response:
    decoded = await _decode(request, JOB_REGISTER_REQUEST)
    path_id = request.match_info.get("job_id")
    _check_job_write(request, decoded, volumes=True)
    result = _server(request).endpoints.register_job(
        decoded, path_id, request.query.get("namespace")
    )
    return _json_response(result, index=result["Index"])


async def get_job(request: web.Request) -> web.Response:
    index = await _block(request, ("jobs",))
    job = _server(request).state.job(_namespace(request), request.match_info["job_id"])
    if job is None:
        raise ApiError(404, "job not found")
    return _json_response(job, index=index)


async def deregister_job(request: web.Request) -> web.Response:
    purge = _bool_param(request, "purge")
    result = _server(request).endpoints.deregister_job(
        _namespace(request), request.match_info["job_id"], purge=purge
    )
    return _json_response(result, index=result["Index"])


async def job_allocations(request: web.Request) -> web.Response:
    index = await _block(request, ("allocs",))
    server = _server(request)
    allocs = server.state.allocs_of_job(_namespace(request), request.match_info["job_id"])
    body = [
        alloc.to_stub(server.state.alloc_job(alloc))
        for alloc in sorted(allocs, key=lambda a: a.create_index)
    ]
    return _json_response(body, index=index)


async def job_evaluations(request: web.Request) -> web.Response:
    index = await _block(request, ("evals",))
    evals = _server(request).state.evals_of_job(_namespace(request), request.match_info["job_id"])
    body = [evaluation.to_api() for evaluation in sorted(evals, key=lambda e: e.create_index)]
    return _json_response(body, index=index)


async def job_deployments(request: web.Request) -> web.Response:
    index = await _block(request, ("deployment",))
    deployments = _server(request).state.deployments_of_job(
        _namespace(request), request.match_info["job_id"]
    )
    ordered = sorted(deployments, key=lambda d: d.create_index, reverse=True)
    return _json_response([d.to_api() for d in ordered], index=index)


async def job_latest_deployment(request: web.Request) -> web.Response:
    index = await _block(request, ("deployment",))
    deployments = _server(request).state.deployments_of_job(
        _namespace(request), request.match_info["job_id"]
    )
    latest = max(deployments, key=lambda d: d.create_index, default=None)
    return _json_response(latest.to_api() if latest else None, index=index)


async def job_summary(request: web.Request) -> web.Response:
    index = await _block(request, ("job_summary", "allocs"))
    summary = _server(request).state.job_summary(_namespace(request), request.match_info["job_id"])
    if summary is None:
        raise ApiError(404, "job not found")
    return _json_response(summary, index=index)


async def job_versions(request: web.Request) -> web.Response:
    index = await _block(request, ("jobs",))
    server = _server(request)
    key = (_namespace(request), request.match_info["job_id"])
    versions = server.state.job_versions.get(key)
    if not versions:
        raise ApiError(404, "job versions not found")
    ordered = [versions[v] for v in sorted(versions, reverse=True)]
    return _json_response({"Versions": ordered, "Diffs": None, "Index": index}, index=index)


async def plan_job(request: web.Request) -> web.Response:
    decoded = await _decode(request, JOB_PLAN_REQUEST)
    _check_job_write(request, decoded, volumes=False)
    result = _server(request).endpoints.plan_job(
        decoded, request.match_info["job_id"], request.query.get("namespace")
    )
    return _json_response(result, index=result["Index"])


async def evaluate_job(request: web.Request) -> web.Response:
    server = _server(request)
    job = server.state.job(_namespace(request), request.match_info["job_id"])
    if job is None:
        raise ApiError(404, "job not found")
    if job.get("Periodic") is not None:
        raise ApiError(500, "can't evaluate periodic job")
    if job.get("ParameterizedJob") is not None and not job.get("Dispatched"):
        raise ApiError(500, "can't evaluate parameterized job")
    eval_ids = server.endpoints.create_evals([job], "job-register")
    return _json_response(
        {
            "EvalID": eval_ids[0],
            "EvalCreateIndex": server.state.index,
            "JobModifyIndex": job["JobModifyIndex"],
            "Index": server.state.index,
        },
        index=server.state.index,
    )


async def validate_job(request: web.Request) -> web.Response:
    decoded = await _decode(request, JOB_VALIDATE_REQUEST)
    result = _server(request).endpoints.validate_job_request(
        decoded, request.query.get("namespace")
    )
    return _json_response(result)


# -- allocations -------------------------------------------------------------


def _find_alloc(request: web.Request) -> Allocation:
    state = _server(request).state
    alloc_id = request.match_info["alloc_id"]
    alloc = state.allocs.get(alloc_id)
    if alloc is None:
        matches = [a for a in state.allocs.values() if a.id.startswith(alloc_id)]
        if len(matches) == 1:
            return matches[0]
        raise ApiError(404, "alloc not found")
    return alloc


async def list_allocations(request: web.Request) -> web.Response:
    resources = _bool_param(request, "resources")
    index = await _block(request, ("allocs",))
    server = _server(request)
    prefix = request.query.get("prefix", "")
    body = [
        alloc.to_stub(server.state.alloc_job(alloc), resources=resources)
        for alloc in sorted(server.state.allocs.values(), key=lambda a: a.create_index)
        if alloc.id.startswith(prefix) and _in_namespace(request, alloc.namespace)
    ]
    return _json_response(body, index=index)


async def get_allocation(request: web.Request) -> web.Response:
    index = await _block(request, ("allocs",))
    alloc = _find_alloc(request)
    return _json_response(alloc.to_api(_server(request).state.alloc_job(alloc)), index=index)


async def stop_allocation(request: web.Request) -> web.Response:
    alloc = _find_alloc(request)
    result = _server(request).endpoints.stop_alloc(alloc.id)
    return _json_response(result, index=result["Index"])


async def client_fs_logs(request: web.Request) -> web.StreamResponse:
    return await fs_logs.stream_logs(request, _server(request))


# -- nodes ---------------------------------------------------------------


async def list_nodes(request: web.Request) -> web.Response:
    # A bad field selection is a 400 here (a plain 500 on other endpoints).
    fields_error = "Failed to parse node list fields: "
    resources = _bool_param(request, "resources", status=400, prefix=fields_error)
    with_os = _bool_param(request, "os", status=400, prefix=fields_error)
    index = await _block(request, ("nodes",))
    server = _server(request)
    prefix = request.query.get("prefix", "")
    body = [
        node.to_stub(resources=resources, with_os=with_os)
        for node in sorted(server.state.nodes.values(), key=lambda n: n.create_index)
        if node.id.startswith(prefix)
    ]
    return _json_response(body, index=index)


async def get_node(request: web.Request) -> web.Response:
    index = await _block(request, ("nodes",))
    node = _server(request).endpoints.node(request.match_info["node_id"])
    return _json_response(node.to_api(), index=index)


async def node_allocations(request: web.Request) -> web.Response:
    index = await _block(request, ("allocs",))
    server = _server(request)
    node = server.endpoints.node(request.match_info["node_id"])
    body = [
        alloc.to_api(server.state.alloc_job(alloc))
        for alloc in sorted(server.state.allocs_of_node(node.id), key=lambda a: a.create_index)
    ]
    return _json_response(body, index=index)


async def list_node_pools(request: web.Request) -> web.Response:
    index = await _block(request, ("node_pools",))
    prefix = request.query.get("prefix", "")
    pools = _server(request).state.node_pools
    body = [pools[name].to_api() for name in sorted(pools) if name.startswith(prefix)]
    return _json_response(body, index=index)


async def get_node_pool(request: web.Request) -> web.Response:
    index = await _block(request, ("node_pools",))
    pool = _server(request).endpoints.node_pool(request.match_info["pool"])
    return _json_response(pool.to_api(), index=index)


async def _pool_body(request: web.Request) -> Json:
    try:
        body = json.loads(await request.read() or b"null")
    except ValueError as exc:
        raise ApiError(400, str(exc)) from None
    if not isinstance(body, dict):
        raise ApiError(400, "json: cannot unmarshal into Go value of type structs.NodePool")
    return body


async def upsert_node_pool(request: web.Request) -> web.Response:
    body = await _pool_body(request)
    path_name = request.match_info.get("pool")
    index = _server(request).endpoints.upsert_node_pool(body, path_name)
    # Nomad's write handlers return no object here: an empty 200 with the index.
    return web.Response(headers={"X-Nomad-Index": str(index)})


async def delete_node_pool(request: web.Request) -> web.Response:
    index = _server(request).endpoints.delete_node_pool(request.match_info["pool"])
    # Nomad's write handlers return no object here: an empty 200 with the index.
    return web.Response(headers={"X-Nomad-Index": str(index)})


def _no_prefix(request: web.Request) -> None:
    # `prefix` is ambiguous here (pool name or node/job IDs), so Nomad refuses it.
    if request.query.get("prefix"):
        raise ApiError(400, "prefix argument not allowed")


async def node_pool_nodes(request: web.Request) -> web.Response:
    _no_prefix(request)
    fields_error = "Failed to parse node list fields: "
    resources = _bool_param(request, "resources", status=400, prefix=fields_error)
    with_os = _bool_param(request, "os", status=400, prefix=fields_error)
    index = await _block(request, ("nodes",))
    nodes = _server(request).endpoints.node_pool_nodes(request.match_info["pool"])
    body = [node.to_stub(resources=resources, with_os=with_os) for node in nodes]
    return _json_response(body, index=index)


async def node_pool_jobs(request: web.Request) -> web.Response:
    _no_prefix(request)
    with_meta = _bool_param(request, "meta")
    index = await _block(request, ("jobs",))
    server = _server(request)
    jobs = server.endpoints.node_pool_jobs(request.match_info["pool"])
    body = [_job_stub(server, job, with_meta=with_meta) for job in jobs]
    return _json_response(body, index=index)


async def drain_node(request: web.Request) -> web.Response:
    server = _server(request)
    node_id = server.endpoints.node(request.match_info["node_id"]).id
    body = await request.read()
    if not body.strip() and "enable" in request.query:
        # The pre-0.8 form python-nomad's `drain_node` still sends.
        enable = _bool_param(request, "enable")
        result = server.endpoints.drain_node(
            node_id, {"Deadline": -1} if enable else None, mark_eligible=not enable, meta={}
        )
        return _json_response(result, index=result["Index"])
    try:
        decoded = decode_body(body, NODE_DRAIN_REQUEST)
    except DecodeError as exc:
        raise ApiError(400, str(exc)) from None
    result = server.endpoints.drain_node(
        node_id,
        decoded.get("DrainSpec"),
        mark_eligible=bool(decoded.get("MarkEligible", False)),
        meta=decoded.get("Meta") or {},
    )
    return _json_response(result, index=result["Index"])


async def node_eligibility(request: web.Request) -> web.Response:
    server = _server(request)
    node_id = server.endpoints.node(request.match_info["node_id"]).id
    decoded = await _decode(request, NODE_ELIGIBILITY_REQUEST)
    result = server.endpoints.set_eligibility(node_id, str(decoded.get("Eligibility", "")))
    return _json_response(result, index=result["Index"])


# -- evaluations and deployments -----------------------------------------------


def _find_eval(request: web.Request) -> Evaluation:
    state = _server(request).state
    eval_id = request.match_info["eval_id"]
    evaluation = state.evals.get(eval_id)
    if evaluation is None:
        matches = [e for e in state.evals.values() if e.id.startswith(eval_id)]
        if len(matches) != 1:
            raise ApiError(404, "eval not found")
        evaluation = matches[0]
    return evaluation


async def list_evaluations(request: web.Request) -> web.Response:
    index = await _block(request, ("evals",))
    server = _server(request)
    prefix = request.query.get("prefix", "")
    job_id = request.query.get("job")
    status = request.query.get("status")
    body = [
        evaluation.to_api()
        for evaluation in sorted(server.state.evals.values(), key=lambda e: e.create_index)
        if evaluation.id.startswith(prefix)
        and (job_id is None or evaluation.job_id == job_id)
        and (status is None or evaluation.status == status)
        and _in_namespace(request, evaluation.namespace)
    ]
    return _json_response(body, index=index)


async def get_evaluation(request: web.Request) -> web.Response:
    index = await _block(request, ("evals",))
    return _json_response(_find_eval(request).to_api(), index=index)


async def evaluation_allocations(request: web.Request) -> web.Response:
    index = await _block(request, ("allocs",))
    server = _server(request)
    evaluation = _find_eval(request)
    body = [
        alloc.to_stub(server.state.alloc_job(alloc))
        for alloc in server.state.allocs.values()
        if alloc.eval_id == evaluation.id
    ]
    return _json_response(body, index=index)


async def list_deployments(request: web.Request) -> web.Response:
    index = await _block(request, ("deployment",))
    deployments = sorted(_server(request).state.deployments.values(), key=lambda d: d.create_index)
    return _json_response([d.to_api() for d in deployments], index=index)


async def get_deployment(request: web.Request) -> web.Response:
    index = await _block(request, ("deployment",))
    deployment = _server(request).state.deployments.get(request.match_info["deployment_id"])
    if deployment is None:
        raise ApiError(404, "deployment not found")
    return _json_response(deployment.to_api(), index=index)


async def deployment_allocations(request: web.Request) -> web.Response:
    index = await _block(request, ("allocs",))
    server = _server(request)
    deployment_id = request.match_info["deployment_id"]
    body = [
        alloc.to_stub(server.state.alloc_job(alloc))
        for alloc in server.state.allocs.values()
        if alloc.deployment_id == deployment_id
    ]
    return _json_response(body, index=index)


# -- event stream ------------------------------------------------------------


async def event_stream(request: web.Request) -> web.StreamResponse:
    server = _server(request)
    try:
        start = int(request.query.get("index", "0") or "0")
    except ValueError as exc:
        raise ApiError(400, f"Unable to parse index: {exc}") from None
    try:
        topics = parse_topics(request.query.getall("topic", []))
    except TopicQueryError as exc:
        raise ApiError(400, f"Invalid topic query: {exc}") from None
    namespace = _namespace(request)
    response = web.StreamResponse(headers={"Content-Type": "application/json"})
    await response.prepare(request)
    broker = server.state.broker
    last = start - 1 if start > 0 else 0
    heartbeat_s = server.settings.event_heartbeat_s
    # Runs until the client hangs up (the handler is cancelled then).
    await response.write(b"{}\n")
    while True:
        published = broker.next_publication()
        for frame in broker.frames_after(last):
            last = frame.index
            events = [
                e.to_api(frame.index) for e in frame.events if event_matches(e, topics, namespace)
            ]
            if events:
                line = json.dumps({"Index": frame.index, "Events": events}) + "\n"
                await response.write(line.encode())
        try:
            async with asyncio.timeout(heartbeat_s):
                await published.wait()
        except TimeoutError:
            await response.write(b"{}\n")


# -- agent and status --------------------------------------------------------


async def agent_self(request: web.Request) -> web.Response:
    server = _server(request)
    host, port = server.host, server.port
    member = server.member()
    return _json_response(
        {
            "config": {
                "Region": "global",
                "Datacenter": "dc1",
                "NodeName": "devcluster-server",
                "Version": {
                    "Version": server.nomad_version,
                    "VersionPrerelease": "",
                    "Revision": "devcluster",
                },
                "ACL": {"Enabled": server.acl.enabled},
                "Addresses": {"HTTP": host, "RPC": host, "Serf": host},
                "Ports": {"HTTP": port, "RPC": server.rpc_port, "Serf": server.serf_port},
                "Server": {"Enabled": True, "BootstrapExpect": 1},
                "Client": {"Enabled": True},
            },
            "member": member,
            "stats": {
                "nomad": {
                    "server": "true",
                    "leader": "true",
                    "leader_addr": server.rpc_address,
                    "bootstrap": "true",
                    "known_regions": "1",
                }
            },
        }
    )


async def agent_members(request: web.Request) -> web.Response:
    server = _server(request)
    return _json_response(
        {
            "ServerName": "devcluster-server",
            "ServerRegion": "global",
            "ServerDC": "dc1",
            "Members": [server.member()],
        }
    )


async def agent_servers(request: web.Request) -> web.Response:
    # The client's known servers: their RPC addresses.
    return _json_response([_server(request).rpc_address])


async def agent_health(_request: web.Request) -> web.Response:
    return _json_response(
        {"client": {"ok": True, "message": "ok"}, "server": {"ok": True, "message": "ok"}}
    )


async def status_leader(request: web.Request) -> web.Response:
    # Raft's leader address is the server's RPC address, not the HTTP one.
    return _json_response(_server(request).rpc_address)


async def status_peers(request: web.Request) -> web.Response:
    return _json_response([_server(request).rpc_address])


async def regions(_request: web.Request) -> web.Response:
    return _json_response(["global"])


# -- devcluster control --------------------------------------------------------


async def devcluster_add_node(request: web.Request) -> web.Response:
    body = await request.read()
    try:
        spec = NodeSpec.model_validate_json(body or b"{}")
    except ValueError as exc:
        raise ApiError(400, f"invalid node spec: {exc}") from None
    node = await _server(request).add_node(spec)
    return _json_response(node.to_api(), index=node.modify_index)


async def devcluster_kill_node(request: web.Request) -> web.Response:
    server = _server(request)
    node = server.endpoints.node(request.match_info["node_id"])
    await server.kill_node(node.id)
    return _json_response({"NodeID": node.id, "Killed": True})


async def devcluster_restart_node(request: web.Request) -> web.Response:
    server = _server(request)
    node = server.endpoints.node(request.match_info["node_id"])
    await server.restart_node(node.id)
    return _json_response({"NodeID": node.id, "Restarted": True})


async def devcluster_crash_alloc(request: web.Request) -> web.Response:
    server = _server(request)
    alloc = _find_alloc(request)
    task = request.query.get("task")
    pids = server.crash_alloc(alloc.id, task)
    return _json_response({"AllocID": alloc.id, "KilledPIDs": pids})


async def devcluster_outage(request: web.Request) -> web.Response:
    server = _server(request)
    try:
        body = json.loads(await request.read() or b"{}")
    except ValueError:
        raise ApiError(400, 'outage body must be JSON like {"Enabled": true}') from None
    enabled = body.get("Enabled") if isinstance(body, dict) else None
    if not isinstance(enabled, bool):
        raise ApiError(400, 'outage body needs a boolean "Enabled"')
    server.outage = enabled
    return _json_response({"Enabled": enabled})


def _may_list_variable(request: web.Request, namespace: str, path: str) -> bool:
    """Variables.List keeps the variables the caller may `list`."""
    return resolved_of(request).acl.allow_variable_op(namespace, path, "list")


def build_app(server: NomadServer) -> web.Application:
    app = web.Application(middlewares=[_middleware])
    app[SERVER_KEY] = server
    route = app.router
    # Before `/v1/node/{node_id}`: aiohttp tries resources in the order they are added.
    route.add_get("/v1/node/pools", list_node_pools)
    route.add_get("/v1/node/pool/{pool}/nodes", node_pool_nodes)
    route.add_get("/v1/node/pool/{pool}/jobs", node_pool_jobs)
    route.add_get("/v1/node/pool/{pool}", get_node_pool)
    route.add_delete("/v1/node/pool/{pool}", delete_node_pool)
    for method in ("PUT", "POST"):
        route.add_route(method, "/v1/node/pools", upsert_node_pool)
        route.add_route(method, "/v1/node/pool/{pool}", upsert_node_pool)
    for method in ("PUT", "POST"):
        route.add_route(method, "/v1/jobs", register_job)
        route.add_route(method, "/v1/job/{job_id}", register_job)
        route.add_route(method, "/v1/job/{job_id}/plan", plan_job)
        route.add_route(method, "/v1/job/{job_id}/evaluate", evaluate_job)
        route.add_route(method, "/v1/validate/job", validate_job)
        route.add_route(method, "/v1/allocation/{alloc_id}/stop", stop_allocation)
        route.add_route(method, "/v1/node/{node_id}/drain", drain_node)
        route.add_route(method, "/v1/node/{node_id}/eligibility", node_eligibility)
    route.add_get("/v1/jobs", list_jobs)
    route.add_get("/v1/job/{job_id}", get_job)
    route.add_delete("/v1/job/{job_id}", deregister_job)
    route.add_get("/v1/job/{job_id}/allocations", job_allocations)
    route.add_get("/v1/job/{job_id}/evaluations", job_evaluations)
    route.add_get("/v1/job/{job_id}/deployments", job_deployments)
    route.add_get("/v1/job/{job_id}/deployment", job_latest_deployment)
    route.add_get("/v1/job/{job_id}/summary", job_summary)
    route.add_get("/v1/job/{job_id}/versions", job_versions)
    route.add_get("/v1/allocations", list_allocations)
    route.add_get("/v1/allocation/{alloc_id}", get_allocation)
    route.add_get("/v1/nodes", list_nodes)
    route.add_get("/v1/node/{node_id}", get_node)
    route.add_get("/v1/node/{node_id}/allocations", node_allocations)
    route.add_get("/v1/evaluations", list_evaluations)
    route.add_get("/v1/evaluation/{eval_id}", get_evaluation)
    route.add_get("/v1/evaluation/{eval_id}/allocations", evaluation_allocations)
    route.add_get("/v1/deployments", list_deployments)
    route.add_get("/v1/deployment/{deployment_id}", get_deployment)
    route.add_get("/v1/deployment/allocations/{deployment_id}", deployment_allocations)
    route.add_get("/v1/event/stream", event_stream)
    route.add_get("/v1/agent/self", agent_self)
    route.add_get("/v1/agent/members", agent_members)
    route.add_get("/v1/agent/servers", agent_servers)
    route.add_get("/v1/agent/health", agent_health)
    route.add_get("/v1/status/leader", status_leader)
    route.add_get("/v1/status/peers", status_peers)
    route.add_get("/v1/regions", regions)
    route.add_get(fs_logs.LOGS_PATH + "{alloc_id:.*}", client_fs_logs)
    route.add_post("/v1/devcluster/node", devcluster_add_node)
    route.add_put("/v1/devcluster/node", devcluster_add_node)
    route.add_post("/v1/devcluster/node/{node_id}/kill", devcluster_kill_node)
    route.add_post("/v1/devcluster/node/{node_id}/restart", devcluster_restart_node)
    route.add_post("/v1/devcluster/alloc/{alloc_id}/crash", devcluster_crash_alloc)
    route.add_put("/v1/devcluster/outage", devcluster_outage)
    route.add_post("/v1/devcluster/outage", devcluster_outage)
    http_ops.add_routes(route)
    namespace_http.add_routes(route)
    # Dispatched children have a `/` in their ID (`<parent>/dispatch-<time>-<id>`).
    child = "{job_id:[^{}]+/dispatch-[^{}/]+}"
    route.add_get(f"/v1/job/{child}", get_job)
    route.add_delete(f"/v1/job/{child}", deregister_job)
    route.add_get(f"/v1/job/{child}/allocations", job_allocations)
    route.add_get(f"/v1/job/{child}/evaluations", job_evaluations)
    route.add_get(f"/v1/job/{child}/deployments", job_deployments)
    route.add_get(f"/v1/job/{child}/deployment", job_latest_deployment)
    route.add_get(f"/v1/job/{child}/summary", job_summary)
    route.add_get(f"/v1/job/{child}/versions", job_versions)
    route.add_routes(variable_routes(server.variables, may_list=_may_list_variable))
    route.add_routes(acl_http.ROUTES)
    return app
