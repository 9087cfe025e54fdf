"""Nomad's write endpoints for job versions, dispatch, deployments, node evaluation,
job parsing and Serf membership (issue 16 item 2).

The texts and status codes follow Nomad's HTTP agent (`command/agent/*_endpoint.go`):
a body that does not decode or names another object is a 400, a failure of the
RPC behind it is a plain 500 with the RPC's error text.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from aiohttp import web

from caravan_llm.devcluster.nomad import http_api
from caravan_llm.devcluster.nomad.decode import (
    DEPLOYMENT_ALLOC_HEALTH_REQUEST,
    DEPLOYMENT_PAUSE_REQUEST,
    DEPLOYMENT_PROMOTE_REQUEST,
    JOB_DISPATCH_REQUEST,
    JOB_REVERT_REQUEST,
    JOB_STABILITY_REQUEST,
    JOBS_PARSE_REQUEST,
)
from caravan_llm.devcluster.nomad.endpoints import ApiError
from caravan_llm.devcluster.nomad.jobspec import JobspecError, parse_jobspec

if TYPE_CHECKING:
    from aiohttp.web_urldispatcher import UrlDispatcher

Json = dict[str, Any]


def _reply(body: Json) -> web.Response:
    return http_api.json_response(body, index=int(body.get("Index") or 0) or None)


def _require_id(decoded: Json, field: str, path_id: str, label: str) -> str:
    given = str(decoded.get(field) or "")
    if not given:
        raise ApiError(400, f"{field} must be specified")
    if given != path_id:
        raise ApiError(400, f"{label} ID does not match")
    return given


# -- jobs ------------------------------------------------------------------


async def revert_job(request: web.Request) -> web.Response:
    decoded = await http_api.decode_request(request, JOB_REVERT_REQUEST)
    job_id = _require_id(decoded, "JobID", request.match_info["job_id"], "Job")
    enforce = decoded.get("EnforcePriorVersion")
    result = http_api.server_of(request).endpoints.revert_job(
        http_api.namespace_of(request),
        job_id,
        int(decoded.get("JobVersion", 0)),
        None if enforce is None else int(enforce),
    )
    return _reply(result)


async def stable_job(request: web.Request) -> web.Response:
    decoded = await http_api.decode_request(request, JOB_STABILITY_REQUEST)
    job_id = _require_id(decoded, "JobID", request.match_info["job_id"], "Job")
    result = http_api.server_of(request).endpoints.set_job_stability(
        http_api.namespace_of(request),
        job_id,
        int(decoded.get("JobVersion", 0)),
        bool(decoded.get("Stable", False)),
    )
    return _reply(result)


async def dispatch_job(request: web.Request) -> web.Response:
    decoded = await http_api.decode_request(request, JOB_DISPATCH_REQUEST)
    path_id = request.match_info["job_id"]
    if decoded.get("JobID") and decoded["JobID"] != path_id:
        raise ApiError(400, "Job ID does not match")
    result = http_api.server_of(request).endpoints.dispatch_job(
        http_api.namespace_of(request),
        path_id,
        meta=decoded.get("Meta") or {},
        payload=str(decoded.get("Payload") or "").encode("latin-1"),
        id_prefix_template=str(decoded.get("IdPrefixTemplate") or ""),
        priority=int(decoded.get("Priority", 0)),
    )
    return _reply(result)


async def parse_job(request: web.Request) -> web.Response:
    decoded = await http_api.decode_request(request, JOBS_PARSE_REQUEST)
    text = str(decoded.get("JobHCL") or "")
    if not text:
        raise ApiError(400, "Job spec is empty")
    if decoded.get("HCLv1"):
        raise ApiError(400, "Failed to parse job: HCL1 is not supported by devcluster")
    variables = decoded.get("Variables") or {}
    if not isinstance(variables, dict) or not all(
        isinstance(value, str) for value in variables.values()
    ):
        raise ApiError(
            400,
            "json: cannot unmarshal object into Go struct field JobsParseRequest.Variables "
            "of type map[string]string",
        )
    try:
        job = parse_jobspec(
            text, variables=variables, canonicalize=bool(decoded.get("Canonicalize"))
        )
    except JobspecError as exc:
        raise ApiError(400, f"Failed to parse job: {exc}") from None
    return http_api.json_response(job)


# -- deployments -------------------------------------------------------------


async def fail_deployment(request: web.Request) -> web.Response:
    server = http_api.server_of(request)
    return _reply(server.endpoints.fail_deployment(request.match_info["deployment_id"]))


async def pause_deployment(request: web.Request) -> web.Response:
    decoded = await http_api.decode_request(request, DEPLOYMENT_PAUSE_REQUEST)
    deployment_id = _require_id(
        decoded, "DeploymentID", request.match_info["deployment_id"], "Deployment"
    )
    server = http_api.server_of(request)
    return _reply(
        server.endpoints.pause_deployment(deployment_id, pause=bool(decoded.get("Pause")))
    )


async def promote_deployment(request: web.Request) -> web.Response:
    decoded = await http_api.decode_request(request, DEPLOYMENT_PROMOTE_REQUEST)
    deployment_id = _require_id(
        decoded, "DeploymentID", request.match_info["deployment_id"], "Deployment"
    )
    return _reply(http_api.server_of(request).endpoints.promote_deployment(deployment_id))


async def deployment_alloc_health(request: web.Request) -> web.Response:
    decoded = await http_api.decode_request(request, DEPLOYMENT_ALLOC_HEALTH_REQUEST)
    deployment_id = _require_id(
        decoded, "DeploymentID", request.match_info["deployment_id"], "Deployment"
    )
    result = http_api.server_of(request).endpoints.set_alloc_health(
        deployment_id,
        list(decoded.get("HealthyAllocationIDs") or []),
        list(decoded.get("UnhealthyAllocationIDs") or []),
    )
    return _reply(result)


# -- nodes and agent -----------------------------------------------------------


async def evaluate_node(request: web.Request) -> web.Response:
    server = http_api.server_of(request)
    return _reply(server.endpoints.evaluate_node(request.match_info["node_id"]))


async def agent_join(request: web.Request) -> web.Response:
    """One server only: joining itself counts, any other address is refused in `error`."""
    addresses = request.query.getall("address", [])
    if not addresses:
        raise ApiError(400, "missing address to join")
    server = http_api.server_of(request)
    own = {server.host, f"{server.host}:{server.serf_port}"}
    joined = sum(1 for address in addresses if address in own)
    others = [address for address in addresses if address not in own]
    error = ""
    if others:
        lines = "".join(
            f"\t* Failed to join {address}: devcluster runs a single server and joins "
            "no other agent\n"
            for address in others
        )
        count = len(others)
        error = f"{count} error{'s' if count > 1 else ''} occurred:\n{lines}\n"
    return http_api.json_response({"num_joined": joined, "error": error, "warning": ""})


async def agent_force_leave(request: web.Request) -> web.Response:
    """Serf accepts any name (a member it does not know is a no-op): 200, empty body."""
    if not request.query.get("node"):
        raise ApiError(400, "missing node to force leave")
    try:
        http_api.parse_go_bool("prune", request.query.get("prune"))
    except ValueError:
        raise ApiError(400, "invalid prune value") from None
    return web.Response(status=200)


def add_routes(route: UrlDispatcher) -> None:
    for method in ("PUT", "POST"):
        route.add_route(method, "/v1/job/{job_id}/revert", revert_job)
        route.add_route(method, "/v1/job/{job_id}/stable", stable_job)
        route.add_route(method, "/v1/job/{job_id}/dispatch", dispatch_job)
        route.add_route(method, "/v1/jobs/parse", parse_job)
        route.add_route(method, "/v1/deployment/fail/{deployment_id}", fail_deployment)
        route.add_route(method, "/v1/deployment/pause/{deployment_id}", pause_deployment)
        route.add_route(method, "/v1/deployment/promote/{deployment_id}", promote_deployment)
        route.add_route(
            method, "/v1/deployment/allocation-health/{deployment_id}", deployment_alloc_health
        )
        route.add_route(method, "/v1/node/{node_id}/evaluate", evaluate_node)
        route.add_route(method, "/v1/agent/join", agent_join)
        route.add_route(method, "/v1/agent/force-leave", agent_force_leave)
