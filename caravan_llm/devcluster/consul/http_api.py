"""The Consul HTTP API of the emulator: routing, errors, ACLs and blocking queries.

Routing follows Consul's Go mux: exact paths, and paths ending in `/` that
match as prefixes (longest wins). An unknown path is 404 `Invalid URL path:
not a recognized HTTP API endpoint`; a known path with the wrong method is
405 `method X not allowed` with an `Allow` header. Errors are text/plain
bodies; results are JSON pretty-printed as a dev agent prints them.

Blocking queries (`?index=&wait=`) wait on the shared raft index: every
write wakes every waiter, which recomputes its own index and answers once
that index passes the one the client sent, or when the wait (default 5m,
at most 10m, plus up to wait/16 jitter) runs out.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from aiohttp import web

from caravan_llm.devcluster.consul.acl import (
    AclNotFoundError,
    AclResolver,
    Authorizer,
    permission_denied,
)
from caravan_llm.devcluster.consul.durations import parse_go_duration_s
from caravan_llm.devcluster.consul.filter import FilterError, Predicate, compile_filter
from caravan_llm.devcluster.consul.records import NodeRecord
from caravan_llm.devcluster.consul.state import ConsulState

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_QUERY_TIME_S = 300.0
MAX_QUERY_TIME_S = 600.0
JITTER_FRACTION = 16
NODE_HEADER = "X-Devcluster-Node"
_RAW_TRAVERSAL = re.compile(
    r"(\.\.[\\/])|(?i:%2e%2e(%2f|%5c|/))|(\.\.%2f)|(\.\.%5c)|(%252e%252e%252f)", re.IGNORECASE
)


class HttpError(Exception):
    """An error answer: status and the text/plain body Consul writes."""

    def __init__(self, status: int, text: str, *, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(text)
        self.status = status
        self.text = text
        self.headers = dict(headers or {})


@dataclass(slots=True)
class Reply:
    """A handler's answer: JSON data (or raw bytes), status, extra headers."""

    data: Any = None
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    raw: bytes | None = None
    content_type: str | None = None
    empty: bool = False


@dataclass(frozen=True, slots=True)
class QueryOptions:
    min_index: int
    wait_s: float
    consistency: str


@dataclass(frozen=True, slots=True)
class ServerIdentity:
    node_name: str
    address: str
    datacenter: str
    version: str
    server_port: int = 8300
    serf_lan_port: int = 8301
    serf_wan_port: int = 8302

    @property
    def rpc_address(self) -> str:
        """The raft leader's (this server's) RPC address: /v1/status/leader, leader_addr."""
        return f"{self.address}:{self.server_port}"


Handler = Callable[["RequestContext"], Awaitable[Reply]]


@dataclass(frozen=True, slots=True)
class Route:
    path: str
    methods: tuple[str, ...]
    handler: Handler

    @property
    def is_prefix(self) -> bool:
        return self.path.endswith("/")


class RequestContext:
    """One request, with the helpers every handler needs."""

    def __init__(self, api: ConsulHttpApi, request: web.Request, route: Route) -> None:
        self.api = api
        self.request = request
        self.route = route
        self._authz: Authorizer | None = None
        # Whether the last computed answer left out something the token may not read.
        self.filtered = False

    @property
    def state(self) -> ConsulState:
        return self.api.state

    @property
    def query(self) -> Mapping[str, str]:
        return self.request.query

    def has(self, name: str) -> bool:
        return name in self.request.query

    def get(self, name: str, default: str = "") -> str:
        return self.request.query.get(name, default)

    def getall(self, name: str) -> list[str]:
        return list(self.request.query.getall(name, []))

    @property
    def tail(self) -> str:
        """The path after the route prefix (the service id, key, session id...)."""
        return self.request.path[len(self.route.path) :]

    def token(self) -> str:
        query_token = self.request.query.get("token")
        if query_token:
            return query_token
        header = self.request.headers.get("X-Consul-Token", "")
        if header:
            return header
        authorization = self.request.headers.get("Authorization", "")
        scheme, _, value = authorization.partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
        return ""

    def authz(self) -> Authorizer:
        if self._authz is None:
            try:
                self._authz = self.api.acl.resolve(self.token())
            except AclNotFoundError as exc:
                raise HttpError(403, str(exc)) from exc
        return self._authz

    @property
    def accessor_id(self) -> str | None:
        """The AccessorID of the request's token, once resolved (None before or if unknown)."""
        return None if self._authz is None else self._authz.accessor_id

    def require(self, permission: str, obj: str | None = None) -> None:
        """403 `Permission denied: ...` unless the token may do `permission` on `obj`."""
        authz = self.authz()
        if not authz.allows(permission, obj or ""):
            raise HttpError(403, permission_denied(permission, obj, authz.accessor_id))

    def require_write_prefix(self, prefix: str) -> None:
        """403 unless the token may write every key under `prefix` (recursive deletes)."""
        authz = self.authz()
        if not authz.allows_write_prefix(prefix):
            raise HttpError(403, permission_denied("key:write", prefix, authz.accessor_id))

    def may(self, permission: str, obj: str = "") -> bool:
        """Whether the token may; a refusal marks the answer as filtered by ACLs."""
        allowed = self.authz().allows(permission, obj)
        if not allowed:
            self.filtered = True
        return allowed

    def can_read(self) -> bool:
        """Whether the token may read everything (the management token, or no ACLs)."""
        return self.authz().allows_everything

    def filtered_header(self) -> dict[str, str]:
        """X-Consul-Results-Filtered-By-ACLs, which Consul never sets for anonymous requests."""
        if self.filtered and self.token():
            return {"X-Consul-Results-Filtered-By-ACLs": "true"}
        return {}

    def check_datacenter(self) -> None:
        dc = self.get("dc")
        if dc and dc != self.state.datacenter:
            raise HttpError(500, "No path to datacenter")

    def query_options(self) -> QueryOptions:
        """Parse `?wait`, `?index` and the consistency flags like Consul's parse()."""
        self.check_datacenter()
        consistency = "leader"
        if self.has("stale"):
            consistency = "stale"
        if self.has("consistent"):
            consistency = "consistent"
        max_stale = self.get("max_stale")
        if max_stale:
            try:
                parse_go_duration_s(max_stale)
            except ValueError as exc:
                raise HttpError(400, f'Invalid max_stale value "{max_stale}"') from exc
        wait_s = 0.0
        wait = self.get("wait")
        if wait:
            try:
                wait_s = parse_go_duration_s(wait)
            except ValueError as exc:
                raise HttpError(400, "Invalid wait time") from exc
        min_index = 0
        index = self.get("index")
        if index:
            if not index.isdigit() or int(index) >= 1 << 64:
                raise HttpError(400, "Invalid index")
            min_index = int(index)
        return QueryOptions(min_index=min_index, wait_s=wait_s, consistency=consistency)

    def filter(self, template: Mapping[str, Any]) -> Predicate | None:
        expression = self.get("filter")
        if not expression:
            return None
        try:
            return compile_filter(expression, template)
        except FilterError as exc:
            raise HttpError(500, str(exc)) from exc

    def agent_node(self) -> NodeRecord:
        """The node whose local agent this request talks to (devcluster's X-Devcluster-Node)."""
        name = self.request.headers.get(NODE_HEADER, "") or self.api.identity.node_name
        node = self.state.node(name)
        if node is None:
            raise HttpError(
                404,
                f'devcluster: unknown node "{name}" in {NODE_HEADER}; '
                "register it with PUT /v1/devcluster/node/register",
            )
        if self.state.agent_down(name):
            raise HttpError(
                503, f'devcluster: the agent of node "{name}" is not reachable (node failed)'
            )
        return node

    async def block(self, options: QueryOptions, compute: Callable[[], tuple[int, T]]) -> Reply:
        """Answer `compute()` now, or once its index passes `options.min_index`."""
        index, result = await self.wait_for_index(options, compute)
        return Reply(data=result, headers=self.api.meta_headers(index, options))

    async def wait_for_index(
        self, options: QueryOptions, compute: Callable[[], tuple[int, T]]
    ) -> tuple[int, T]:
        """The API's wait_for_index, with `filtered` describing the answer it returns."""
        # Resolve the token first: an unknown one is 403 even when nothing would be filtered.
        self.authz()

        def fresh() -> tuple[int, T]:
            self.filtered = False
            return compute()

        return await self.api.wait_for_index(options, fresh)


def _json_body(data: Any) -> bytes:
    # A dev agent pretty-prints every JSON answer (4 spaces, trailing newline).
    return (json.dumps(data, indent=4) + "\n").encode()


def _text(status: int, text: str, headers: Mapping[str, str] | None = None) -> web.Response:
    return web.Response(
        status=status,
        body=text.encode(),
        headers={"Content-Type": "text/plain; charset=utf-8", **(headers or {})},
    )


class ConsulHttpApi:
    def __init__(
        self,
        state: ConsulState,
        acl: AclResolver,
        identity: ServerIdentity,
        *,
        session_ttl_min_s: float = 10.0,
        rand: Callable[[], float] = random.random,
    ) -> None:
        self.state = state
        self.session_ttl_min_s = session_ttl_min_s
        self.acl = acl
        self.identity = identity
        self._rand = rand
        self._routes: list[Route] = []
        self._closing = False

    def add_routes(self, routes: list[Route]) -> None:
        self._routes.extend(routes)

    def close(self) -> None:
        """Answer every blocking query now, so shutdown does not wait for them."""
        self._closing = True
        self.state.raft.notify()

    def reopen(self) -> None:
        """Serve blocking queries again after `close` (the listener is back)."""
        self._closing = False

    def meta_headers(self, index: int, options: QueryOptions | None = None) -> dict[str, str]:
        return {
            # Never answer index 0: clients would busy-loop (Consul's setIndex does the same).
            "X-Consul-Index": str(max(index, 1)),
            "X-Consul-KnownLeader": "true",
            "X-Consul-LastContact": "0",
            "X-Consul-Effective-Consistency": options.consistency if options else "leader",
        }

    async def wait_until(self, done: Callable[[], bool], wait_s: float) -> None:
        """Wait for `done()` (re-evaluated after every write) or the blocking timeout."""
        if wait_s <= 0:
            wait_s = DEFAULT_QUERY_TIME_S
        wait_s = min(wait_s, MAX_QUERY_TIME_S)
        wait_s += self._rand() * wait_s / JITTER_FRACTION
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while not self._closing:
            changed = self.state.raft.changed
            if done():
                return
            remaining = deadline - loop.time()
            if remaining <= 0:
                return
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(remaining):
                    await changed.wait()

    async def wait_for_index(
        self, options: QueryOptions, compute: Callable[[], tuple[int, T]]
    ) -> tuple[int, T]:
        latest = compute()
        if options.min_index == 0:
            return latest

        def passed() -> bool:
            nonlocal latest
            latest = compute()
            return latest[0] > options.min_index

        await self.wait_until(passed, options.wait_s)
        return compute()

    def _match(self, path: str) -> Route | None:
        best: Route | None = None
        for route in self._routes:
            if route.path == path:
                return route
            longer = best is None or len(route.path) > len(best.path)
            if route.is_prefix and path.startswith(route.path) and longer:
                best = route
        return best

    async def handle(self, request: web.Request) -> web.StreamResponse:
        route = self._match(request.path)
        if route is None:
            return _text(404, "Invalid URL path: not a recognized HTTP API endpoint\n")
        headers: dict[str, str] = {}
        if self.acl.enabled:
            headers["X-Consul-Default-ACL-Policy"] = "deny"
        if request.method == "OPTIONS":
            return web.Response(
                status=200, headers={**headers, "Allow": ",".join(("OPTIONS", *route.methods))}
            )
        if request.method not in route.methods:
            allow = ",".join(("OPTIONS", *route.methods))
            return _text(405, f"method {request.method} not allowed", {**headers, "Allow": allow})
        if _RAW_TRAVERSAL.search(request.raw_path.split("?", 1)[0]):
            return _text(400, "URL path contains invalid or encoded traversal sequence", headers)
        context = RequestContext(self, request, route)
        try:
            reply = await route.handler(context)
        except HttpError as exc:
            log.debug(
                "consul_request_failed",
                extra={
                    "method": request.method,
                    "path": request.path,
                    "status": exc.status,
                    # Which token was refused (an AccessorID is not a secret).
                    "accessor_id": context.accessor_id,
                },
            )
            return _text(exc.status, exc.text, {**headers, **exc.headers})
        except Exception as exc:
            # Consul answers unexpected errors with 500 and the error text.
            log.exception(
                "consul_request_crashed", extra={"method": request.method, "path": request.path}
            )
            return _text(500, str(exc) or type(exc).__name__, headers)
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "consul_request",
                extra={
                    "method": request.method,
                    "path": request.path,
                    "status": reply.status,
                    "accessor_id": context.accessor_id,
                },
            )
        headers.update(reply.headers)
        headers.update(context.filtered_header())
        if reply.raw is not None:
            if reply.content_type:
                headers["Content-Type"] = reply.content_type
            return web.Response(status=reply.status, body=reply.raw, headers=headers)
        if reply.empty:
            return web.Response(status=reply.status, headers=headers)
        headers["Content-Type"] = "application/json"
        return web.Response(status=reply.status, body=_json_body(reply.data), headers=headers)

    def build_app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self.handle)
        return app
