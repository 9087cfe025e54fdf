"""Connection-level limits of the router's listeners: header timeout, connection cap, bad HTTP.

aiohttp has no timeout on reading request headers: its keep-alive timer also
runs on a fresh connection, but it is the idle timeout (tens of seconds),
closes silently and cannot be counted, and nothing bounds how many
connections are open. So the listener's protocol is aiohttp's own
`RequestHandler`, subclassed (`GuardedRequestHandler`) through the runner's
documented extension point (`BaseRunner._make_server`, which `AppRunner`
implements), overriding only the asyncio protocol callbacks and
`handle_error`. Each connection is in one `Phase`:

    AWAITING_HEADERS --(middleware sees the request)--> IN_REQUEST
          ^                                                 |
          +--(first byte of the next request)-- IDLE <------+ (response written)

1. A connection waits for its headers at most `header_read_timeout_s` from
   its opening, or from the first byte of a later request on a keep-alive
   connection (Go's ReadHeaderTimeout). Bytes arriving do not extend it, so a
   trickle cannot. On expiry it gets a 408 and a lingering close (as a
   refusal's, rule 3: a client still sending would otherwise read a reset
   instead of the 408), counted as `header_timeout`. The body's own timeout
   is the request middleware's (`caravan_llm.router.edge.request_guard`),
   because only a handler knows a body is expected.
2. An IDLE connection is closed by aiohttp's keep-alive timer
   (`keepalive_timeout_s`).
3. At most `max_connections` are open. A connection over the cap evicts the
   connection that has been idle, or waiting for its headers, the longest: a
   real client sends its headers in milliseconds, so under a flood of
   half-open connections the oldest waiter is an attacker's, and an active
   keep-alive client has been idle for less time than they have waited. A
   connection inside a request (until its response is written) is never
   evicted; only when every connection is inside one is the newcomer refused
   with an immediate 503 (OpenAI JSON, `Retry-After`, `Connection: close`).
   The refusal closes cleanly: the router ends its side (FIN), discards what
   the client sends, and closes once the client has closed its own side or
   `_REFUSED_LINGER_S` has passed (a lingering close, as nginx does), so the
   client reads the 503 rather than a reset caused by its own unread request;
   beyond `_MAX_LINGERING` refusals at once they close at once. The cap sits below the
   process's descriptor limit, so `accept` never fails with EMFILE, which
   would stall every client. Engagement is logged at most every 10 s.
4. Malformed HTTP (aiohttp's parser errors) gets OpenAI JSON: 431 for a line
   or header field over `max_header_field_bytes`, else 400, logged at
   debug without a traceback (it is the client's error, and the raw line
   may hold a key).

5. At start the process raises its soft RLIMIT_NOFILE to its hard limit
   (`raise_descriptor_limit`, called by the wiring before the default cap is
   read): many systems start processes at a soft 1024 while allowing far
   more, and each client connection being proxied holds two descriptors.

`decide_connection` and `nofile_soft_target` are the pure rules; the rest is I/O.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from http import HTTPStatus
from typing import Any, cast

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage, LineTooLong
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from caravan_llm.router.core.errors import (
    HeadersTooLarge,
    InvalidRequest,
    RequestTimeout,
    RouterError,
    TooManyConnections,
    TooManyHeaders,
    error_body,
    retry_after_s,
)
from caravan_llm.router.metrics import RouterMetrics

# Named as before the router's sub-packages: the logger is a field of every log line.
log = logging.getLogger("router.http_limits")

SERVER_HEADER = "caravan"
# Descriptors kept for everything but client connections: the listeners,
# Consul, logs, and the engine connections that mirror client ones.
_RESERVED_FDS = 64
_MAX_AUTO_CONNECTIONS = 65536
# Linux's default ceiling of one process's descriptors (fs.nr_open), the target
# when the hard limit is unlimited.
_NOFILE_CEILING = 1_048_576
_LOG_EVERY_S = 10.0
# A refused connection stays open this long at most, for its client to read the 503.
_REFUSED_LINGER_S = 1.0
_MAX_LINGERING = 256


class Phase(StrEnum):
    AWAITING_HEADERS = "awaiting_headers"
    IN_REQUEST = "in_request"
    IDLE = "idle"


@dataclass(frozen=True, slots=True)
class ConnectionView:
    """What the cap rule needs to know of one open connection."""

    key: int
    phase: Phase
    since: float


@dataclass(frozen=True, slots=True)
class AcceptConnection:
    pass


@dataclass(frozen=True, slots=True)
class EvictConnection:
    key: int


@dataclass(frozen=True, slots=True)
class RefuseConnection:
    pass


ConnectionDecision = AcceptConnection | EvictConnection | RefuseConnection


def decide_connection(open_connections: Sequence[ConnectionView], limit: int) -> ConnectionDecision:
    """Whether a new connection fits (module docstring, rule 3)."""
    if len(open_connections) < limit:
        return AcceptConnection()
    evictable = [view for view in open_connections if view.phase is not Phase.IN_REQUEST]
    if not evictable:
        return RefuseConnection()
    return EvictConnection(min(evictable, key=lambda view: view.since).key)


def connection_limit_for(descriptor_limit: int) -> int:
    """The default cap for a process allowed `descriptor_limit` open files (-1 = unlimited).

    Half of what is left after the reserve: each proxied request also holds
    one connection to an engine.
    """
    if descriptor_limit < 0:
        return _MAX_AUTO_CONNECTIONS
    return max(16, min(_MAX_AUTO_CONNECTIONS, (descriptor_limit - _RESERVED_FDS) // 2))


def nofile_soft_target(soft: int, hard: int, *, unlimited: int) -> int | None:
    """The soft RLIMIT_NOFILE to raise to: the hard limit (the ceiling when that is
    `unlimited`); None when the soft limit is already there or above."""
    if soft == unlimited:
        return None
    target = _NOFILE_CEILING if hard == unlimited else hard
    return target if target > soft else None


def raise_descriptor_limit() -> tuple[int, int]:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit; (before, after).

    Children (the workers of `--workers N`) inherit it. A system that refuses
    (a hard limit above what the kernel allows one process) leaves it as it was.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = nofile_soft_target(soft, hard, unlimited=resource.RLIM_INFINITY)
    if target is None:
        return soft, soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError):
        return soft, soft
    return soft, target


def default_connection_limit() -> int:
    """`connection_limit_for` this process's soft RLIMIT_NOFILE."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return connection_limit_for(-1 if soft == resource.RLIM_INFINITY else soft)


def raw_error_response(error: RouterError) -> bytes:
    """A complete HTTP/1.1 error response in OpenAI's shape, for a connection that closes."""
    body = json.dumps(error_body(error)).encode()
    lines = [
        f"HTTP/1.1 {error.status} {HTTPStatus(error.status).phrase}",
        "Content-Type: application/json",
        f"Content-Length: {len(body)}",
        "Connection: close",
        f"Server: {SERVER_HEADER}",
    ]
    retry_after = retry_after_s(error)
    if retry_after is not None:
        lines.append(f"Retry-After: {retry_after}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


class ConnectionGuard:
    """The open connections of one listener: the cap, the header deadline, the counts."""

    def __init__(
        self,
        *,
        listener: str,
        limit: int,
        header_timeout_s: float,
        metrics: RouterMetrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.listener = listener
        self.limit = limit
        self.header_timeout_s = header_timeout_s
        self._clock = clock
        self._open: dict[int, GuardedRequestHandler] = {}
        self._closed = {
            reason: metrics.connections_closed.labels(listener, reason)
            for reason in ("header_timeout", "body_timeout", "evicted", "refused", "bad_request")
        }
        metrics.connections_open.labels(listener).set_function(lambda: len(self._open))
        self._last_logged: float | None = None
        self._evicted_since_log = 0
        self._refused_since_log = 0
        # Refused connections still open for their clients to read the 503.
        self.lingering = 0

    def now(self) -> float:
        return self._clock()

    def count_closed(self, reason: str) -> None:
        self._closed[reason].inc()

    def admit(self, connection: GuardedRequestHandler) -> bool:
        """Take a new connection in (evicting another if the cap says so); False = refuse it."""
        if len(self._open) < self.limit:
            # The common case, without looking at every open connection.
            self._open[id(connection)] = connection
            return True
        views = [
            ConnectionView(key, handler.phase, handler.phase_since)
            for key, handler in self._open.items()
        ]
        match decide_connection(views, self.limit):
            case AcceptConnection():
                pass
            case EvictConnection(key=key):
                victim = self._open.pop(key)
                self._evicted_since_log += 1
                self.count_closed("evicted")
                victim.evict()
                self._log_engaged()
            case RefuseConnection():
                self._refused_since_log += 1
                self.count_closed("refused")
                self._log_engaged()
                return False
        self._open[id(connection)] = connection
        return True

    def forget(self, connection: GuardedRequestHandler) -> None:
        self._open.pop(id(connection), None)

    def _log_engaged(self) -> None:
        now = self._clock()
        if self._last_logged is not None and now - self._last_logged < _LOG_EVERY_S:
            return
        self._last_logged = now
        log.warning(
            "connection_limit_reached",
            extra={
                "listener": self.listener,
                "max_connections": self.limit,
                "evicted": self._evicted_since_log,
                "refused": self._refused_since_log,
            },
        )
        self._evicted_since_log = self._refused_since_log = 0


class GuardedRequestHandler(RequestHandler):
    """aiohttp's connection protocol with a header deadline, the cap and JSON parse errors."""

    def __init__(self, manager: web.Server, *, guard: ConnectionGuard, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self.guard = guard
        self.phase = Phase.AWAITING_HEADERS
        self.phase_since = guard.now()
        self._deadline: asyncio.TimerHandle | None = None
        self._refused = False
        self._lingering: asyncio.Transport | None = None

    # -- asyncio protocol callbacks ------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if not self.guard.admit(self):
            self._refused = True
            self._refuse(cast("asyncio.Transport", transport))
            return
        super().connection_made(transport)
        self._arm()

    def _refuse(self, stream: asyncio.Transport) -> None:
        """The 503 over the cap, then a lingering close (module docstring, rule 3)."""
        # A stream transport (uvloop's are not asyncio.Transport subclasses).
        stream.write(raw_error_response(TooManyConnections(self.guard.limit)))
        self._linger(stream)

    def _linger(self, stream: asyncio.Transport) -> None:
        """End the router's side (FIN), discard what arrives, close once the client has
        closed its side or `_REFUSED_LINGER_S` has passed (at once beyond `_MAX_LINGERING`)."""
        if self.guard.lingering >= _MAX_LINGERING or not stream.can_write_eof():
            stream.close()
            return
        stream.write_eof()
        self.guard.lingering += 1
        self._lingering = stream
        loop = asyncio.get_running_loop()
        self._deadline = loop.call_later(_REFUSED_LINGER_S, stream.close)

    def eof_received(self) -> None:
        if self._lingering is not None:
            # The client closed its side after reading the answer: close now.
            self._lingering.close()
            return
        if self._refused:
            return
        super().eof_received()

    def data_received(self, data: bytes) -> None:
        if self._refused or self._lingering is not None:
            # The refused (or timed-out) client's bytes: read and dropped, so that closing
            # sends no reset.
            return
        if self.phase is Phase.IDLE and data:
            # The first byte of the next request starts its header deadline.
            self._enter(Phase.AWAITING_HEADERS)
            self._arm()
        super().data_received(data)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._disarm()
        if self._lingering is not None:
            self._lingering = None
            self.guard.lingering -= 1
        if self._refused:
            return
        self.guard.forget(self)
        super().connection_lost(exc)

    # -- a request's start (told by the request middleware) and end ----------------------

    def request_started(self) -> None:
        self._disarm()
        self._enter(Phase.IN_REQUEST)

    async def finish_response(
        self, request: BaseRequest, resp: web.StreamResponse, start_time: float | None
    ) -> tuple[web.StreamResponse, bool]:
        """aiohttp's last step of every request: once the response is written, it is idle."""
        try:
            return await super().finish_response(request, resp, start_time)
        finally:
            self._enter(Phase.IDLE)

    # -- closing -----------------------------------------------------------------------

    def evict(self) -> None:
        """Closed to make room under the cap (the guard already forgot it)."""
        self._disarm()
        self.force_close()

    def _arm(self) -> None:
        self._disarm()
        loop = asyncio.get_running_loop()
        self._deadline = loop.call_later(self.guard.header_timeout_s, self._header_timeout)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _enter(self, phase: Phase) -> None:
        self.phase = phase
        self.phase_since = self.guard.now()

    def _header_timeout(self) -> None:
        self._deadline = None
        if self.phase is not Phase.AWAITING_HEADERS or self.transport is None:
            return
        self.guard.count_closed("header_timeout")
        error = RequestTimeout("headers", self.guard.header_timeout_s)
        stream = self.transport
        stream.write(raw_error_response(error))
        self._linger(stream)

    # -- aiohttp's answer to requests it could not parse -----------------------------------

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """OpenAI JSON instead of aiohttp's text; no traceback for the client's own errors."""
        del message  # aiohttp's text may quote the client's raw line (a key, a prompt)
        if request.writer.output_size > 0:
            raise ConnectionError("the response had started; cannot send an error instead")
        error: RouterError
        if isinstance(exc, LineTooLong):
            error = HeadersTooLarge(self.max_field_size)
        elif isinstance(exc, BadHttpMessage) and exc.message.startswith("Too many headers"):
            # aiohttp's parsers (C and Python) say only this about max_headers.
            error = TooManyHeaders()
        elif status == HTTPStatus.BAD_REQUEST:
            error = InvalidRequest("The request is not valid HTTP/1.1.")
        else:
            # A handler failed outside the middleware's boundary: a bug, logged in full.
            log.error("request_handler_failed", exc_info=exc)
            error = RouterError("Internal router error.")
            error.status = status if status >= HTTPStatus.INTERNAL_SERVER_ERROR else 500
        if error.status < HTTPStatus.INTERNAL_SERVER_ERROR:
            self.guard.count_closed("bad_request")
            log.debug("http_request_malformed", extra={"status": error.status})
        response = web.json_response(
            error_body(error), status=error.status, headers={"Server": SERVER_HEADER}
        )
        response.force_close()
        return response


class GuardedServer(web.Server):
    """aiohttp's low-level server, making `GuardedRequestHandler`s."""

    def __init__(
        self,
        handler: Any,
        *,
        guard: ConnectionGuard,
        request_factory: Any,
        handler_cancellation: bool,
        handler_kwargs: dict[str, Any],
    ) -> None:
        super().__init__(
            handler,
            request_factory=request_factory,
            handler_cancellation=handler_cancellation,
            **handler_kwargs,
        )
        self.guard = guard
        self._handler_loop = asyncio.get_running_loop()
        self._handler_kwargs = handler_kwargs

    def __call__(self) -> GuardedRequestHandler:
        return GuardedRequestHandler(
            self, guard=self.guard, loop=self._handler_loop, **self._handler_kwargs
        )


class GuardedAppRunner(web.AppRunner):
    """An `AppRunner` whose connections are `GuardedRequestHandler`s of one `ConnectionGuard`."""

    def __init__(
        self,
        app: web.Application,
        *,
        guard: ConnectionGuard,
        handler_cancellation: bool,
        shutdown_timeout: float,
        **handler_kwargs: Any,
    ) -> None:
        super().__init__(
            app,
            handler_cancellation=handler_cancellation,
            shutdown_timeout=shutdown_timeout,
            **handler_kwargs,
        )
        self.guard = guard
        self._guarded_kwargs = handler_kwargs

    async def _make_server(self) -> web.Server:
        # AppRunner starts the app and builds a plain Server; keep its request
        # handler and factory (public attributes) and serve them guarded.
        plain = await super()._make_server()
        return GuardedServer(
            plain.request_handler,
            guard=self.guard,
            request_factory=plain.request_factory,
            handler_cancellation=plain.handler_cancellation,
            handler_kwargs=self._guarded_kwargs,
        )
