"""The scheduler's HTTP API: models for the CLI and operators, health and metrics.

    GET    /v1/models                 every model with desired / ready and status
    POST   /v1/models                 submit several profiles at once, all or none:
                                      {"documents": [{"source": "a.yaml", "text": "..."}]}
    GET    /v1/models/{name}          one model, replica by replica
    PUT    /v1/models/{name}          submit a profile (JSON or YAML body)
    DELETE /v1/models/{name}          remove a model (its replicas drain and stop)
    POST   /v1/models/{name}/scale    {"replicas": N}: set the desired count; on an
                                      autoscaled model also hold it against the
                                      autoscaler for "hold_s" seconds (default 3600);
                                      {"auto": true}: end the hold
    GET    /v1/models/{name}/history  the kept versions of its profile, newest first
    POST   /v1/models/{name}/revert   {"version": N}: submit version N again (validated)
    POST   /v1/plan                   {"documents": [...]}: what a submission would change,
                                      job by job; nothing is written
    GET    /health                    200 while the process runs; says if it leads;
                                      503 "misconfigured" with the "missing" grants
                                      when its tokens lack one (scheduler/preflight.py)
    GET    /metrics                   Prometheus exposition
    GET    /openapi.json              this API as an OpenAPI 3.1 document
                                      (scheduler/openapi.py)

Errors are JSON `{"error": {"message": ..., "type": ..., "problems": [...]}}`.

Every route but `/health` needs `Authorization: Bearer <token>` when tokens
are configured (`scheduler/api_auth.py`): none or a malformed header gets 401
with `WWW-Authenticate: Bearer`, a token that is not accepted 403; each
refusal is counted in `caravan_scheduler_api_auth_failures_total{reason}`.
Without tokens the API is open, and `scheduler/app.py` binds it to loopback.
A body with a Content-Type the route does not read gets 415 (none: read as
the route's type). A request that matches no route gets its 404 or 405 (with `Allow`) without
being asked for a token: it reaches nothing. A `{name}` that cannot be a
model's name is a 404 before Consul is asked (Consul refuses some
characters in keys, which would otherwise come back as a 502).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest

from caravan_llm.common.contract import MODEL_NAME_MAX_LEN, MODEL_NAME_PATTERN
from caravan_llm.common.errors import HashiError
from caravan_llm.scheduler.api_auth import AuthOutcome, TokenSource, check_authorization
from caravan_llm.scheduler.model_service import (
    ModelService,
    NothingToRevertError,
    SubmissionRejectedError,
    UnknownVersionError,
)
from caravan_llm.scheduler.model_store import (
    ScaleOutOfBoundsError,
    UnknownModelError,
    WriteConflictError,
    hold_seconds,
)
from caravan_llm.scheduler.openapi import api_document
from caravan_llm.scheduler.profiles import ProfileError
from caravan_llm.scheduler.status import InvalidStoredProfileError

SERVICE_KEY = web.AppKey("model_service", ModelService)
REGISTRY_KEY = web.AppKey("registry", CollectorRegistry)
LEADER_KEY: web.AppKey[Callable[[], bool]] = web.AppKey("is_leader")
MISSING_GRANTS_KEY: web.AppKey[Callable[[], tuple[str, ...]]] = web.AppKey("missing_grants")
OPENAPI_KEY: web.AppKey[dict[str, Any]] = web.AppKey("openapi")
MAX_PROFILE_BYTES = 1 << 20
HTTP_SERVER_ERROR = 500
_INVALID_PROFILE = "the profile is invalid; nothing was written"


def _error(status: int, message: str, kind: str, **extra: Any) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, **extra}}, status=status)


class ServerLog(logging.LoggerAdapter[logging.Logger]):
    """aiohttp's server logger for the API's listener (`web.AppRunner(..., logger=...)`).

    A request aiohttp's parser refuses (a NUL in a header, a line too long) is
    answered 400 by aiohttp and is the client's error: logged at debug,
    without the traceback aiohttp would log at error. Everything else, a
    handler's exception above all, is logged as aiohttp logs it.
    """

    def exception(self, msg: object, *args: object, **kwargs: Any) -> None:
        error = kwargs.get("exc_info")
        if isinstance(error, HttpProcessingError) and error.code < HTTP_SERVER_ERROR:
            self.logger.debug("scheduler_api_request_malformed", extra={"status": error.code})
            return
        super().exception(msg, *args, **kwargs)


@dataclass(frozen=True, slots=True)
class ApiAuth:
    """Who may call the API: the accepted tokens and the counter of refusals."""

    tokens: TokenSource
    failures: Counter  # labelled by `reason`: missing, malformed, invalid


AUTH_KEY = web.AppKey("auth", ApiAuth)
_UNAUTHORIZED = {
    AuthOutcome.MISSING: "this API needs an Authorization: Bearer <token> header",
    AuthOutcome.MALFORMED: "the Authorization header must be `Bearer <token>`",
}


@web.middleware
async def _require_token(
    request: web.Request, handler: Callable[[web.Request], Any]
) -> web.StreamResponse:
    auth = request.app[AUTH_KEY]
    # Routing has run: compare the handler, so no spelling of a path slips past.
    # A request that matched no route (404, 405) reaches nothing to protect.
    if request.match_info.handler is health or request.match_info.http_exception is not None:
        outcome = AuthOutcome.OK
    else:
        header = request.headers.get("Authorization")
        outcome = check_authorization(header, auth.tokens.current())
    if outcome is AuthOutcome.OK:
        response: web.StreamResponse = await handler(request)
        return response
    auth.failures.labels(reason=outcome.value).inc()
    if outcome is AuthOutcome.INVALID:
        return _error(403, "the bearer token is not valid for this scheduler", "forbidden")
    refused = _error(401, _UNAUTHORIZED[outcome], "unauthorized")
    refused.headers["WWW-Authenticate"] = 'Bearer realm="caravan-scheduler"'
    return refused


# aiohttp's own refusals (no route, a method the route lacks, a body over
# `client_max_size`), answered in the API's error shape instead of plain text.
_HTTP_ERROR_KINDS = {404: "not_found", 405: "method_not_allowed", 413: "too_large"}


def _http_error(exc: web.HTTPException) -> web.Response:
    refused = _error(exc.status, exc.reason, _HTTP_ERROR_KINDS.get(exc.status, "invalid_request"))
    if "Allow" in exc.headers:
        refused.headers["Allow"] = exc.headers["Allow"]
    return refused


@web.middleware
async def _errors_as_json(
    request: web.Request, handler: Callable[[web.Request], Any]
) -> web.StreamResponse:
    try:
        response: web.StreamResponse = await handler(request)
    except web.HTTPException as exc:
        if not 400 <= exc.status < 500:  # only client errors are reshaped
            raise
        return _http_error(exc)
    except (UnknownModelError, UnknownVersionError) as exc:
        return _error(404, str(exc), "not_found")
    except NothingToRevertError as exc:
        return _error(409, str(exc), "nothing_to_revert")
    except InvalidStoredProfileError as exc:
        return _error(409, str(exc), "invalid_stored_profile")
    except SubmissionRejectedError as exc:
        return _error(
            400,
            _INVALID_PROFILE,
            "invalid_profile",
            problems=[str(p) for p in exc.problems],
        )
    except ScaleOutOfBoundsError as exc:
        return _error(400, str(exc), "out_of_bounds")
    except WriteConflictError as exc:
        return _error(409, str(exc), "conflict")
    except ProfileError as exc:
        # Only a stored profile can fail to parse here (submitted ones are validated first).
        return _error(409, str(exc), "invalid_stored_profile")
    except HashiError as exc:
        status = 503 if exc.retryable else 502
        return _error(status, str(exc), "backend_unavailable" if exc.retryable else "backend_error")
    return response


async def list_models(request: web.Request) -> web.Response:
    models = await request.app[SERVICE_KEY].list()
    return web.json_response({"models": [m.to_json() for m in models]})


def _model_name(request: web.Request) -> str:
    """The path's `{name}`; UnknownModelError (404) when it cannot be a model's name."""
    name = request.match_info["name"]
    if len(name) > MODEL_NAME_MAX_LEN or not MODEL_NAME_PATTERN.fullmatch(name):
        raise UnknownModelError(name)
    return name


# JSON routes read a body typed text/plain as JSON too (what `data=` sends in
# most clients); a form, multipart or binary body is refused.
JSON_MEDIA_TYPES = frozenset({"application/json", "text/plain"})
# A profile is JSON or YAML; text/plain is what `curl --data-binary` and most clients send.
PROFILE_MEDIA_TYPES = frozenset(
    {"application/json", "application/yaml", "application/x-yaml", "text/yaml", "text/plain"}
)


def _unsupported_media(request: web.Request, accepted: frozenset[str]) -> web.Response | None:
    """415 when the body says it is something the route does not read; None without a type."""
    if "Content-Type" not in request.headers or request.content_type in accepted:
        return None
    wanted = " or ".join(sorted(accepted))
    return _error(415, f"send the body as {wanted} (Content-Type)", "unsupported_media_type")


async def _json_body(request: web.Request) -> Any:
    """The request's JSON body; None when it is not JSON (the handler says what it wants)."""
    raw = await request.read()
    try:
        # Bytes: json detects UTF-8/16/32 itself, whatever charset the Content-Type names.
        return json.loads(raw)
    except (ValueError, RecursionError):
        return None


async def get_model(request: web.Request) -> web.Response:
    name = _model_name(request)
    status = await request.app[SERVICE_KEY].describe(name)
    return web.json_response(status.to_json())


async def put_model(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    if request.content_length is not None and request.content_length > MAX_PROFILE_BYTES:
        return _error(413, "profile larger than 1 MiB", "too_large")
    if (refused := _unsupported_media(request, PROFILE_MEDIA_TYPES)) is not None:
        return refused
    source = f"PUT /v1/models/{name}"
    raw = await request.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        problem = f"{source}: not UTF-8 text (byte {raw[exc.start]:#04x} at offset {exc.start})"
        return _error(400, _INVALID_PROFILE, "invalid_profile", problems=[problem])
    # The name in the path is checked with everything else, before anything is written.
    (submitted,) = await request.app[SERVICE_KEY].submit_versioned(
        [(source, text)], expected_name=name
    )
    return web.json_response({"name": name, "submitted": True, "version": submitted.version})


def _documents(body: Any) -> list[tuple[str, str]] | None:
    """The (source, text) pairs of a POST /v1/models body, or None when it is malformed."""
    if not isinstance(body, dict) or set(body) != {"documents"}:
        return None
    items = body["documents"]
    if not isinstance(items, list) or not items:
        return None
    documents: list[tuple[str, str]] = []
    for item in items:
        if not isinstance(item, dict) or set(item) - {"source", "text"}:
            return None
        source, text = item.get("source", f"document {len(documents) + 1}"), item.get("text")
        if not isinstance(source, str) or not isinstance(text, str):
            return None
        documents.append((source, text))
    return documents


async def _submitted_documents(request: web.Request) -> list[tuple[str, str]] | web.Response:
    """The request's `{"documents": [...]}`, or the error response that refuses it."""
    if request.content_length is not None and request.content_length > MAX_PROFILE_BYTES:
        return _error(413, "submission larger than 1 MiB", "too_large")
    if (refused := _unsupported_media(request, JSON_MEDIA_TYPES)) is not None:
        return refused
    documents = _documents(await _json_body(request))
    if documents is None:
        return _error(
            400,
            'body must be JSON like {"documents": [{"source": "a.yaml", "text": "<profile>"}]}',
            "invalid_request",
        )
    return documents


async def post_models(request: web.Request) -> web.Response:
    documents = await _submitted_documents(request)
    if isinstance(documents, web.Response):
        return documents
    submitted = await request.app[SERVICE_KEY].submit_versioned(documents)
    return web.json_response(
        {
            "submitted": [s.profile.name for s in submitted],
            "versions": {s.profile.name: s.version for s in submitted},
        }
    )


async def plan_models(request: web.Request) -> web.Response:
    documents = await _submitted_documents(request)
    if isinstance(documents, web.Response):
        return documents
    plan = await request.app[SERVICE_KEY].plan(documents)
    return web.json_response(plan.to_json())


async def model_history(request: web.Request) -> web.Response:
    name = _model_name(request)
    history = await request.app[SERVICE_KEY].history(name)
    return web.json_response(history.to_json())


async def revert_model(request: web.Request) -> web.Response:
    name = _model_name(request)
    if (refused := _unsupported_media(request, JSON_MEDIA_TYPES)) is not None:
        return refused
    body = await _json_body(request)
    version = body.get("version") if isinstance(body, dict) and set(body) == {"version"} else None
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        return _error(400, 'body must be JSON like {"version": 3}', "invalid_request")
    submitted = await request.app[SERVICE_KEY].revert(name, version)
    return web.json_response({"name": name, "reverted_to": version, "version": submitted.version})


async def delete_model(request: web.Request) -> web.Response:
    name = _model_name(request)
    await request.app[SERVICE_KEY].delete(name)
    return web.json_response({"name": name, "deleted": True})


_SCALE_SHAPE = (
    'body must be JSON like {"replicas": 2}, {"replicas": 2, "hold_s": 3600} or {"auto": true}'
)


def _scale_request(body: Any) -> tuple[int | None, float | None] | str:
    """(count, hold_s) of a scale body, count None for `auto`; or the problem (pure)."""
    if not isinstance(body, dict) or not body or set(body) - {"replicas", "hold_s", "auto"}:
        return _SCALE_SHAPE
    if "auto" in body:
        if body["auto"] is not True or set(body) != {"auto"}:
            return 'auto: give {"auto": true} alone to hand the count back to the autoscaler'
        return None, None
    count = body.get("replicas")
    if not isinstance(count, int) or isinstance(count, bool):
        return f"replicas must be an integer, got {count!r}"
    hold = body.get("hold_s")
    if hold is not None and (isinstance(hold, bool) or not isinstance(hold, int | float)):
        return f"hold_s must be a number of seconds, got {hold!r}"
    return count, None if hold is None else float(hold)


async def scale_model(request: web.Request) -> web.Response:
    name = _model_name(request)
    if (refused := _unsupported_media(request, JSON_MEDIA_TYPES)) is not None:
        return refused
    parsed = _scale_request(await _json_body(request))
    if isinstance(parsed, str):
        return _error(400, parsed, "invalid_request")
    count, hold_s = parsed
    service = request.app[SERVICE_KEY]
    if count is None:
        await service.release(name)
        return web.json_response({"name": name, "auto": True})
    profile = await service.scale(name, count, hold_s=hold_s)
    held = hold_seconds(profile, hold_s)
    return web.json_response({"name": name, "replicas": count, "hold_s": held})


async def health(request: web.Request) -> web.Response:
    leader = request.app[LEADER_KEY]()
    missing = request.app[MISSING_GRANTS_KEY]()
    if missing:
        return web.json_response(
            {"status": "misconfigured", "leader": leader, "missing": list(missing)}, status=503
        )
    return web.json_response({"status": "ok", "leader": leader})


def _nothing_missing() -> tuple[str, ...]:
    return ()


async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[REGISTRY_KEY])
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def openapi(request: web.Request) -> web.Response:
    return web.json_response(request.app[OPENAPI_KEY])


def create_api(
    service: ModelService,
    registry: CollectorRegistry,
    is_leader: Callable[[], bool],
    *,
    auth: ApiAuth | None = None,
    missing_grants: Callable[[], tuple[str, ...]] = _nothing_missing,
) -> web.Application:
    """The API app; `auth=None` serves it open (the caller binds it to loopback then).

    `missing_grants` names the grants the scheduler's tokens lack (its preflight).
    """
    middlewares = [_errors_as_json] if auth is None else [_require_token, _errors_as_json]
    app = web.Application(middlewares=middlewares, client_max_size=MAX_PROFILE_BYTES)
    if auth is not None:
        app[AUTH_KEY] = auth
    app[SERVICE_KEY] = service
    app[REGISTRY_KEY] = registry
    app[LEADER_KEY] = is_leader
    app[MISSING_GRANTS_KEY] = missing_grants
    app[OPENAPI_KEY] = api_document()
    # No implicit HEAD routes: the routes are exactly the document's operations.
    app.router.add_get("/v1/models", list_models, allow_head=False)
    app.router.add_post("/v1/models", post_models)
    app.router.add_get("/v1/models/{name}", get_model, allow_head=False)
    app.router.add_put("/v1/models/{name}", put_model)
    app.router.add_delete("/v1/models/{name}", delete_model)
    app.router.add_post("/v1/models/{name}/scale", scale_model)
    app.router.add_post("/v1/plan", plan_models)
    app.router.add_get("/v1/models/{name}/history", model_history, allow_head=False)
    app.router.add_post("/v1/models/{name}/revert", revert_model)
    app.router.add_get("/health", health, allow_head=False)
    app.router.add_get("/metrics", metrics, allow_head=False)
    app.router.add_get("/openapi.json", openapi, allow_head=False)
    return app


def dumps(document: Any) -> str:
    return json.dumps(document, indent=2)
