"""The request middleware: every answer in OpenAI's shape, keys, priority grants, body limits.

For every request, before any handler:

1. tell the connection (`caravan_llm.router.edge.http_limits`) its headers are in (it stops
   the header deadline; the connection notes the end of the response itself);
2. on API routes (every route but `/health` and `/metrics`): authenticate the
   key (`caravan_llm.router.edge.api_keys`, 401), apply its rate limit (429 +
   Retry-After), and grant `x-caravan-priority` as far as
   the key may go (`grant_priority`);
3. on POST: read the body within `body_read_timeout_s` (408 and close on
   expiry: a trickling body cannot hold a connection), within
   `max_body_bytes` (413), and check and parse it, once
   (`caravan_llm.router.edge.request_body.validate_body`: nesting depth, strict JSON, an
   object, the types of `model`, `stream`, `messages`; 400 naming the
   problem). The handler gets the result as a `ParsedRequest` (body, payload,
   key name, granted priority, request id) under `PARSED_REQUEST`, and never
   reads or parses the body again;
4. turn aiohttp's own HTTP errors (404, 405, 413...) into OpenAI JSON.

Refusals are counted by reason, never logged one by one (a client could fill
the log), and never with a key, header or body.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from types import MappingProxyType

from aiohttp import web

from caravan_llm.router.core.errors import (
    InvalidRequest,
    MethodNotAllowed,
    RateLimited,
    RequestTimeout,
    RequestTooLarge,
    RouteNotFound,
    RouterError,
    Unauthorized,
    error_body,
    retry_after_s,
)
from caravan_llm.router.edge.api_keys import ApiKey, KeyRing, RateLimits, grant_priority
from caravan_llm.router.edge.http_limits import SERVER_HEADER, GuardedRequestHandler
from caravan_llm.router.edge.parsed_request import (
    MAX_REQUEST_ID_CHARS,
    PARSED_REQUEST,
    PRIORITY_HEADER,
    REQUEST_ID_HEADER,
    ParsedRequest,
)
from caravan_llm.router.edge.request_body import validate_body
from caravan_llm.router.metrics import RouterMetrics

# Named as before the router's sub-packages: the logger is a field of every log line.
log = logging.getLogger("router.request_guard")

_MAX_PRIORITY_CHARS = 20
# Routes for monitoring (no key, no body): every other route is an API route
# (`/v1/...`, and `/tokenize`, `/rerank`, ... as the engines name them).
OPERATIONS_PATHS = frozenset({"/health", "/metrics"})

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def error_response(error: RouterError, *, close: bool = False) -> web.Response:
    """The OpenAI JSON answer for an error (with Retry-After when it has one)."""
    headers: dict[str, str] = {}
    retry_after = retry_after_s(error)
    if retry_after is not None:
        headers["Retry-After"] = str(retry_after)
    if isinstance(error, MethodNotAllowed):
        headers["Allow"] = error.allowed
    response = web.json_response(error_body(error), status=error.status, headers=headers)
    if close:
        response.force_close()
    return response


def parse_priority(raw: str | None) -> int | None:
    """The header's integer, None when absent; InvalidRequest when it is not an integer."""
    if raw is None:
        return None
    text = raw.strip()
    # Bounded before int(): more digits than any 64-bit integer is not a priority.
    if len(text) > _MAX_PRIORITY_CHARS:
        raise InvalidRequest(f"Header {PRIORITY_HEADER} must be an integer, got {raw[:40]!r}.")
    try:
        return int(text)
    except ValueError:
        raise InvalidRequest(
            f"Header {PRIORITY_HEADER} must be an integer, got {raw[:40]!r}."
        ) from None


def _http_error(exc: web.HTTPException, request: web.Request, max_body_bytes: int) -> RouterError:
    """The RouterError for one of aiohttp's own HTTP exceptions."""
    if isinstance(exc, web.HTTPNotFound):
        return RouteNotFound(request.path)
    if isinstance(exc, web.HTTPMethodNotAllowed):
        return MethodNotAllowed(request.method, ", ".join(sorted(exc.allowed_methods)))
    if isinstance(exc, web.HTTPRequestEntityTooLarge):
        return RequestTooLarge(max_body_bytes)
    error = InvalidRequest(exc.reason or HTTPStatus(exc.status).phrase)
    error.status = exc.status
    return error


_REFUSAL_REASON: dict[type[RouterError], str] = {
    Unauthorized: "unauthorized",
    RateLimited: "rate_limited",
    RequestTooLarge: "too_large",
    RequestTimeout: "body_timeout",
    RouteNotFound: "not_found",
    MethodNotAllowed: "method_not_allowed",
}


class RequestGuard:
    """The middleware (`middleware`) and `on_response_prepare` hook of the router's apps."""

    def __init__(
        self,
        *,
        keys: KeyRing,
        metrics: RouterMetrics,
        default_priority: int,
        trust_priority_header: bool,
        max_body_bytes: int,
        body_read_timeout_s: float,
        max_json_depth: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._keys = keys
        self._metrics = metrics
        self._default_priority = default_priority
        self._trust_priority_header = trust_priority_header
        self._max_body_bytes = max_body_bytes
        self._body_read_timeout_s = body_read_timeout_s
        self._max_json_depth = max_json_depth
        self._clock = clock
        self._rate_limits = RateLimits()
        # Request ids: a random prefix per process and a counter, unique across
        # routers and cheaper than a uuid4 per request.
        self._id_prefix = secrets.token_hex(6)
        self._id_counter = itertools.count()

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        protocol = request.protocol
        if isinstance(protocol, GuardedRequestHandler):
            protocol.request_started()
        try:
            return await self._guarded(request, handler)
        except web.HTTPException as exc:
            # aiohttp's own 404/405/413...; never a 2xx/3xx here (the router raises none).
            return self._refuse(_http_error(exc, request, self._max_body_bytes))
        except RequestTimeout as exc:
            # The body did not come: answer and close now. A plain forced close
            # would first spend aiohttp's lingering time reading the rest of it.
            response = self._refuse(exc, close=True)
            await response.prepare(request)
            await response.write_eof()
            protocol.force_close()
            return response
        except RouterError as exc:
            return self._refuse(exc)

    async def on_response_prepare(
        self, _request: web.Request, response: web.StreamResponse
    ) -> None:
        # aiohttp would send `Python/3.x aiohttp/3.x`: no versions to fingerprint.
        response.headers["Server"] = SERVER_HEADER

    def _refuse(self, error: RouterError, *, close: bool = False) -> web.Response:
        reason = _REFUSAL_REASON.get(type(error), "invalid_request")
        self._metrics.requests_refused.labels(reason).inc()
        return error_response(error, close=close)

    async def _guarded(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in OPERATIONS_PATHS or request.match_info.http_exception is not None:
            return await handler(request)
        key = self._authenticate(request)
        requested = parse_priority(request.headers.get(PRIORITY_HEADER))
        granted = grant_priority(
            requested,
            key,
            default=self._default_priority,
            trust_header=self._trust_priority_header,
        )
        if request.method == "POST":
            body = await self._read_body(request)
            payload = validate_body(body, max_depth=self._max_json_depth)
            request[PARSED_REQUEST] = ParsedRequest(
                body=body,
                payload=MappingProxyType(payload),
                model=payload["model"],
                stream=payload.get("stream") is True,
                key_name=None if key is None else key.name,
                priority=granted,
                request_id=self._request_id(request),
            )
        return await handler(request)

    def _request_id(self, request: web.Request) -> str:
        given = request.headers.get(REQUEST_ID_HEADER)
        if given:
            return given[:MAX_REQUEST_ID_CHARS]
        return f"{self._id_prefix}-{next(self._id_counter):x}"

    def _authenticate(self, request: web.Request) -> ApiKey | None:
        if not self._keys.enabled:
            return None
        key = self._keys.authenticate(request.headers.get("Authorization"))
        if key is None:
            raise Unauthorized
        wait_s = self._rate_limits.check(key, self._clock())
        if wait_s is not None and key.rps is not None:
            self._metrics.key_requests.labels(key.name, "rate_limited").inc()
            raise RateLimited(key.name, key.rps, max(1, int(-(-wait_s // 1))))
        self._metrics.key_requests.labels(key.name, "admitted").inc()
        return key

    async def _read_body(self, request: web.Request) -> bytes:
        length = request.content_length
        if length is not None and length > self._max_body_bytes:
            raise RequestTooLarge(self._max_body_bytes)
        try:
            async with asyncio.timeout(self._body_read_timeout_s):
                return await request.read()
        except TimeoutError:
            protocol = request.protocol
            if isinstance(protocol, GuardedRequestHandler):
                protocol.guard.count_closed("body_timeout")
            raise RequestTimeout("body", self._body_read_timeout_s) from None
