"""The OpenAI proxy: one request in, one endpoint (or a few) out, the answer streamed back.

Per request:

1. check the API key (constant time), read the body once (413 over the
   limit), `json.loads` it once, take `model`, `stream` and the affinity key;
2. `AdmissionGate.admit` gives an endpoint and a lease (or queues, holds for a
   cold start, or raises the 404/429/503 to answer);
3. send the same body bytes to the engine (never re-encoded) over the one
   shared `aiohttp.ClientSession`;
4. non-streaming: read the whole answer, pass it through unchanged;
   streaming: forward complete SSE events as they arrive, no buffering of
   the whole answer.

Failures (style.md rule 20): a connect error, a 500/502/503/504 from the
engine, or no headers within `first_byte_timeout_s` sends the request to
another endpoint (the tried ones excluded), up to `max_attempts`, but only
while nothing from any engine has reached the client. Once a stream has
started, an engine that dies (reset, EOF without `[DONE]`, silent for
`stream_idle_timeout_s`) is replaced by a continuation on another endpoint,
written into the same response (`router.continuation`); when no faithful
continuation is possible the stream ends with an SSE error event and
`[DONE]`. When the replica that died was the last one (every endpoint
tried), the retry or continuation is held for its replacement, like a cold
start (`router.replacement`). Every lease is given back exactly once, with
its verdict for the endpoint's breaker: success, failure (connect error,
5xx, broken stream) or none (4xx, client gone).

One canonical log line per request (`request`: model, endpoint, status,
attempts, failovers, ttfb, duration), never bodies, headers or keys.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import json
import logging
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from caravan.contract import OPENAI_STREAM_TRAITS
from router.admission_gate import (
    CONTINUATION_PRIORITY,
    AdmissionGate,
    Admitted,
    Hold,
    model_label,
)
from router.affinity import affinity_key
from router.balancer import Policy, RequestFeatures
from router.continuation import (
    DONE_EVENT,
    ContinuationRewriter,
    StreamAccount,
    StreamKind,
    Unfaithful,
    build_continuation,
    cut_at_engine_stop,
    error_event,
    split_complete_events,
)
from router.endpoints import CheckStatus, Endpoint
from router.engine_keys import EngineKeySource
from router.errors import (
    AdmissionRejected,
    InvalidRequest,
    ModelNotFound,
    NoHealthyEndpoint,
    ReplacementTimeout,
    RequestTooLarge,
    RouterError,
    StreamInterrupted,
    Unauthorized,
    UpstreamAborted,
    UpstreamConnectError,
    UpstreamError,
    UpstreamFirstByteTimeout,
    UpstreamProtocolError,
    UpstreamStatusError,
    UpstreamTimeout,
    error_body,
    retry_after_s,
)
from router.live_state import Outcome, Prefill, begin_prefill, end_prefill, peer_rate_of
from router.metrics import OTHER_MODEL, FailoverOutcome, RequestOutcome, RouterMetrics
from router.prefix_index import prompt_shape
from router.replacement import replacement_outcome, waits_for_replacement
from router.routing_state import RoutingState
from router.settings import RouterSettings

log = logging.getLogger(__name__)

PRIORITY_HEADER = "x-caravan-priority"
REQUEST_ID_HEADER = "x-request-id"
HOLD_COMMENT = b": waiting for a replica\n\n"
# An SSE event larger than this without a blank line is not SSE.
_MAX_EVENT_BYTES = 8 * 1024 * 1024
_JSON = "application/json"
# An engine's 401 refuses the router's engine key (clients' credentials never reach
# engines): a router-side failure (502), never passed on as the client's 401.
ENGINE_KEY_REFUSED = 401
# Header pairs as aiohttp takes them (it copies them into its own multidict).
Headers = list[tuple[str, str]]
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}

# Hop-by-hop headers (RFC 9110 7.6.1) and the ones the proxy sets itself.
_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
    }
)
# Not sent on to the engine: the host is the engine's, the length is recomputed,
# compression would hide the events the router reads, and the rest are the router's.
_NOT_FORWARDED = _HOP_BY_HOP | {
    # The client's credentials are the router's business; the engine gets its own key.
    "authorization",
    "x-api-key",
    "host",
    "content-length",
    "accept-encoding",
    "expect",
    PRIORITY_HEADER,
    REQUEST_ID_HEADER,
}
_NOT_RETURNED = _HOP_BY_HOP | {"content-length", "content-encoding", "date", "server"}


# Writes the canonical line of one request (its fields); the process wiring may
# inject a faster writer than the stdlib record path (`router.log_format`).
RequestLog = Callable[[dict[str, Any]], None]


def log_request(fields: dict[str, Any]) -> None:
    """The canonical request line through stdlib logging (`request`, fields as extras)."""
    log.info("request", extra=fields)


class ClientGone(Exception):
    """The client closed its connection while the router was writing to it."""


@dataclass(slots=True)
class Exchange:
    """One client request as it goes through the proxy (for the log line and metrics)."""

    request: web.Request
    path: str
    kind: StreamKind | None  # None: embeddings, never streamed
    started: float
    request_id: str
    model: str = "-"
    label: str = "-"
    stream: bool = False
    attempts: int = 0
    failovers: int = 0
    endpoint_id: str | None = None
    status: int = 0
    ttfb_s: float | None = None
    outcome: RequestOutcome = RequestOutcome.OK
    # The client response once its headers went out (streams, cold-start holds).
    response: web.StreamResponse | None = None
    # Some byte of an engine's answer reached the client: no more plain retries.
    forwarded: bool = False
    # Headers of the engine whose stream opens the client response.
    reply_headers: Headers | None = None
    tried: set[str] = field(default_factory=set)
    # Held for the replacement of its dead replica at least once; and whether that hold timed out.
    replacement_held: bool = False
    replacement_timed_out: bool = False
    # The parsed request, set once the body has been read.
    body: bytes = b""
    payload: dict[str, Any] = field(default_factory=dict)
    features: RequestFeatures | None = None
    priority: int = 0
    headers: Headers = field(default_factory=list)
    # The current attempt's prefill, counted until its first token (cost model).
    prefill: Prefill | None = None

    def retry_features(self) -> RequestFeatures:
        """The balancer's view of this request, minus the endpoints it already tried."""
        if self.features is None:  # pragma: no cover - set before any admission
            raise RuntimeError("request not parsed")
        if not self.tried:
            return self.features
        return replace(self.features, exclude=frozenset(self.tried))


@dataclass(frozen=True, slots=True)
class _Done:
    """The answer went to the client in full (or as far as the engine's own error)."""

    response: web.StreamResponse


@dataclass(frozen=True, slots=True)
class _Failed:
    """The attempt failed before anything reached the client: another endpoint may retry."""

    error: UpstreamError


@dataclass(frozen=True, slots=True)
class _Broken:
    """The engine died after part of the stream reached the client."""

    error: UpstreamError


class Proxy:
    """The request handlers of the OpenAI routes."""

    def __init__(
        self,
        settings: RouterSettings,
        *,
        state: RoutingState,
        gate: AdmissionGate,
        session: Callable[[], aiohttp.ClientSession],
        metrics: RouterMetrics,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        request_log: RequestLog | None = None,
        engine_keys: EngineKeySource | None = None,
    ) -> None:
        self._engine_keys = engine_keys
        self._settings = settings
        self._request_log = request_log or log_request
        self._state = state
        self._gate = gate
        self._session = session
        self._metrics = metrics
        self._clock = clock
        self._wall_clock = wall_clock
        # Request ids: a random prefix per process and a counter, unique across
        # routers and cheaper than a uuid4 per request.
        self._id_prefix = secrets.token_hex(6)
        self._id_counter = itertools.count()
        self._api_keys = tuple(key.get_secret_value().encode() for key in settings.api_keys)
        self._use_affinity = settings.policy is Policy.PREFIX_AFFINITY
        self._use_cost = settings.policy is Policy.PREDICTED_TTFT
        self._cost = settings.balancer_config().cost
        self._load_max_age_s = settings.load_max_age_s
        self._unary_timeout = aiohttp.ClientTimeout(
            total=None,
            sock_connect=settings.connect_timeout_s,
            sock_read=settings.first_byte_timeout_s,
        )
        # Streams get no socket read timeout: the first-event and idle deadlines
        # are the proxy's own (`asyncio.timeout`, rescheduled per event).
        self._stream_timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=settings.connect_timeout_s
        )
        self._not_forwarded = _NOT_FORWARDED

    def _new_request_id(self) -> str:
        return f"{self._id_prefix}-{next(self._id_counter):x}"

    # -- routes ------------------------------------------------------------------------

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "/v1/chat/completions", StreamKind.CHAT)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "/v1/completions", StreamKind.COMPLETION)

    async def embeddings(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "/v1/embeddings", None)

    async def models(self, request: web.Request) -> web.StreamResponse:
        """`GET /v1/models`: served models with a routable endpoint, and declared ones."""
        try:
            self._check_key(request)
        except RouterError as exc:
            return _error_response(exc)
        view = self._state.view
        live = self._state.live
        names: set[str] = set(view.profiles)
        for model, endpoints in view.snapshot.models.items():
            if any(
                endpoint.status is not CheckStatus.CRITICAL
                and not (endpoint.id in live and live[endpoint.id].draining)
                for endpoint in endpoints.endpoints
            ):
                names.add(model)
        created = int(self._wall_clock())
        data = [
            {"id": name, "object": "model", "created": created, "owned_by": "caravan"}
            for name in sorted(names)
        ]
        return web.json_response({"object": "list", "data": data})

    # -- one request ---------------------------------------------------------------------

    async def _handle(
        self, request: web.Request, path: str, kind: StreamKind | None
    ) -> web.StreamResponse:
        exchange = Exchange(
            request=request,
            path=path,
            kind=kind,
            started=self._clock(),
            # A client's id is kept for correlation, cut to a sane length.
            request_id=(request.headers.get(REQUEST_ID_HEADER) or self._new_request_id())[:128],
        )
        try:
            response = await self._serve(exchange)
        except RouterError as exc:
            response = await self._answer_error(exchange, exc)
        except ClientGone:
            exchange.status, exchange.outcome = 499, RequestOutcome.CLIENT_CLOSED
            response = exchange.response or web.Response(status=499)
        except asyncio.CancelledError:
            # aiohttp cancels the handler when the client disconnects.
            exchange.status, exchange.outcome = 499, RequestOutcome.CLIENT_CLOSED
            self._record(exchange)
            raise
        except Exception:
            # The request's boundary: a bug must cost one request, answered in
            # OpenAI's shape, never the router (leases were given back in finally).
            log.exception("request_failed", extra={"request_id": exchange.request_id})
            response = await self._answer_error(exchange, RouterError("Internal router error."))
        self._record(exchange)
        return response

    async def _serve(self, exchange: Exchange) -> web.StreamResponse:
        request = exchange.request
        self._check_key(request)
        exchange.body = await self._read_body(request)
        payload = exchange.payload = _parse_payload(exchange.body)
        model = payload.get("model")
        if not isinstance(model, str) or not model:
            raise InvalidRequest("`model` is required and must be a non-empty string.")
        exchange.model = model
        exchange.label = model_label(self._state, model)
        exchange.stream = exchange.kind is not None and payload.get("stream") is True
        exchange.features = RequestFeatures(
            model=model,
            affinity_key=(
                affinity_key(payload, self._settings.affinity_prefix_chars)
                if self._use_affinity
                else None
            ),
            prompt=prompt_shape(payload, self._cost.shape) if self._use_cost else None,
        )
        exchange.priority = self._priority(request)
        exchange.headers = self._upstream_headers(request, exchange.request_id)
        if exchange.stream and exchange.kind is not None:
            return await self._serve_stream(exchange, exchange.kind)
        return await self._serve_unary(exchange)

    # -- non-streaming -------------------------------------------------------------------

    async def _serve_unary(self, exchange: Exchange) -> web.StreamResponse:
        replacement = False
        while True:
            admitted = await self._admit(exchange, replacement=replacement)
            result = await self._unary_once(exchange, admitted)
            if isinstance(result, _Done):
                return result.response
            self._retry_or_raise(exchange, admitted, result.error)
            replacement = self._waits_for_replacement(result.error, mid_stream=False)

    async def _unary_once(self, exchange: Exchange, admitted: Admitted) -> _Done | _Failed:
        endpoint = admitted.endpoint
        outcome = Outcome.FAILURE
        try:
            try:
                async with self._session().post(
                    endpoint.base_url + exchange.path,
                    data=exchange.body,
                    headers=self._engine_headers(exchange.headers, endpoint),
                    timeout=self._unary_timeout,
                ) as upstream:
                    data = await upstream.read()
                    status = upstream.status
                    upstream_headers = upstream.headers
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                # Nothing reached the client yet (the body is read whole), so even
                # a connection lost halfway through the body can go elsewhere.
                return _Failed(_upstream_failure(endpoint.id, exc))
            if status in UpstreamStatusError.RETRYABLE_STATUSES or status == ENGINE_KEY_REFUSED:
                return _Failed(UpstreamStatusError(endpoint.id, status))
            outcome = _verdict(status)
            exchange.status = status
            exchange.ttfb_s = self._clock() - exchange.started
            exchange.outcome = _outcome_of(status)
            response_headers = _response_headers(upstream_headers, exchange.request_id)
            return _Done(web.Response(status=status, body=data, headers=response_headers))
        except asyncio.CancelledError:
            outcome = Outcome.NO_VERDICT
            raise
        finally:
            self._end_prefill(exchange, first_token=False)
            self._gate.finish(admitted, outcome)

    # -- streaming ---------------------------------------------------------------------

    async def _serve_stream(self, exchange: Exchange, kind: StreamKind) -> web.StreamResponse:
        account = StreamAccount(kind)

        async def hold() -> None:
            await self._write(exchange, HOLD_COMMENT, forwarded=False)

        # Plain attempts, while nothing of any engine's answer reached the client.
        replacement = False
        while True:
            admitted = await self._admit(exchange, hold=hold, replacement=replacement)
            result = await self._stream_once(exchange, admitted, exchange.body, account, None)
            if isinstance(result, _Done):
                return result.response
            if isinstance(result, _Failed):
                self._retry_or_raise(exchange, admitted, result.error)
                replacement = self._waits_for_replacement(result.error, mid_stream=False)
                continue
            exchange.tried.add(admitted.endpoint.id)
            return await self._fail_over(exchange, account, hold, result.error)

    async def _fail_over(
        self, exchange: Exchange, account: StreamAccount, hold: Hold, broken: UpstreamError
    ) -> web.StreamResponse:
        """The stream has started and its engine died: continue it, in the same response."""
        while True:
            log.warning(
                "stream_broken",
                extra={
                    "model": exchange.model,
                    "endpoint": exchange.endpoint_id,
                    "error": str(broken),
                    "tokens_sent": account.sent_tokens,
                },
            )
            if account.finished:
                # The engine died after its last token: only the end was lost.
                if not account.done:
                    await self._write(exchange, DONE_EVENT, forwarded=True)
                return await self._end_stream(exchange)
            if exchange.failovers >= self._settings.max_failovers:
                error = StreamInterrupted(
                    exchange.endpoint_id or "-", f"the stream broke and failover gave up: {broken}"
                )
                return await self._end_stream_with_error(exchange, error, FailoverOutcome.FAILED)
            step = await self._continue(exchange, account, hold, broken)
            if isinstance(step, _Done):
                return step.response
            broken = step

    async def _continue(
        self, exchange: Exchange, account: StreamAccount, hold: Hold, broken: UpstreamError
    ) -> _Done | UpstreamError:
        """One continuation on another endpoint: `_Done` once the stream is over, else the error.

        Ends the client's stream itself (with an error event) when no faithful
        continuation is possible or no endpoint can take it. When the endpoint
        that broke was the last one, waits for its replacement (SSE comments
        through `hold` meanwhile), up to the cold-start deadline.
        """
        children = self._metrics.for_model(exchange.label)
        payload = exchange.payload
        # Whether any engine could continue; the strictest traits (the OpenAI defaults).
        probe = build_continuation(payload, account, OPENAI_STREAM_TRAITS)
        if isinstance(probe, Unfaithful):
            error = StreamInterrupted(
                exchange.endpoint_id or "-",
                f"the stream broke and cannot be continued faithfully: {probe.reason}",
            )
            return _Done(
                await self._end_stream_with_error(exchange, error, FailoverOutcome.IMPOSSIBLE)
            )
        exchange.failovers += 1
        try:
            admitted = await self._admit(
                exchange,
                hold,
                replacement=self._waits_for_replacement(broken, mid_stream=True),
                priority=CONTINUATION_PRIORITY,
            )
        except RouterError as exc:
            return _Done(await self._end_stream_with_error(exchange, exc, FailoverOutcome.FAILED))
        continuation = build_continuation(payload, account, admitted.endpoint.traits)
        if isinstance(continuation, Unfaithful):  # pragma: no cover - the probe said yes
            self._gate.finish(admitted, Outcome.NO_VERDICT)
            error = StreamInterrupted(admitted.endpoint.id, continuation.reason)
            return _Done(
                await self._end_stream_with_error(exchange, error, FailoverOutcome.IMPOSSIBLE)
            )
        body = json.dumps(continuation, separators=(",", ":")).encode()
        rewriter = ContinuationRewriter(
            account,
            tokens_before=account.sent_tokens,
            echo=account.text if admitted.endpoint.traits.echoes_prefill else "",
        )
        result = await self._stream_once(exchange, admitted, body, account, rewriter)
        if isinstance(result, _Done):
            if exchange.outcome is RequestOutcome.OK:
                children.failovers[FailoverOutcome.RESUMED].inc()
                log.info(
                    "stream_resumed",
                    extra={"model": exchange.model, "endpoint": admitted.endpoint.id},
                )
            return result
        exchange.tried.add(admitted.endpoint.id)
        return result.error

    async def _stream_once(
        self,
        exchange: Exchange,
        admitted: Admitted,
        body: bytes,
        account: StreamAccount,
        rewriter: ContinuationRewriter | None,
    ) -> _Done | _Failed | _Broken:
        endpoint = admitted.endpoint
        exchange.endpoint_id = endpoint.id
        outcome = Outcome.FAILURE
        upstream: aiohttp.ClientResponse | None = None
        clean = False
        try:
            try:
                async with asyncio.timeout(self._settings.first_byte_timeout_s):
                    upstream = await self._session().post(
                        endpoint.base_url + exchange.path,
                        data=body,
                        headers=self._engine_headers(exchange.headers, endpoint),
                        timeout=self._stream_timeout,
                    )
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                return self._failed_or_broken(exchange, _upstream_failure(endpoint.id, exc))
            content_type = upstream.headers.get("Content-Type", "")
            if upstream.status != 200 or not content_type.startswith("text/event-stream"):
                result = await self._stream_refused(exchange, upstream, rewriter is not None)
                if not isinstance(result, _Failed):
                    outcome = _verdict(upstream.status)
                    clean = True
                return result
            if exchange.response is None:
                exchange.reply_headers = _response_headers(upstream.headers, exchange.request_id)
            relayed = await self._relay(exchange, upstream, account, rewriter)
            if relayed is None:
                outcome, clean = Outcome.SUCCESS, True
                return _Done(await self._end_stream(exchange))
            return self._failed_or_broken(exchange, relayed)
        except ClientGone:
            outcome = Outcome.NO_VERDICT
            raise
        except asyncio.CancelledError:
            outcome = Outcome.NO_VERDICT
            raise
        finally:
            if upstream is not None:
                if clean:
                    upstream.release()
                else:
                    # Closing the connection tells the engine to stop generating.
                    upstream.close()
            self._end_prefill(exchange, first_token=False)
            self._gate.finish(admitted, outcome)

    async def _stream_refused(
        self, exchange: Exchange, upstream: aiohttp.ClientResponse, continuing: bool
    ) -> _Done | _Failed | _Broken:
        """The engine answered a stream request with an error (or not with SSE)."""
        endpoint_id = exchange.endpoint_id or "-"
        try:
            data = await asyncio.wait_for(upstream.read(), self._settings.first_byte_timeout_s)
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            return self._failed_or_broken(exchange, _upstream_failure(endpoint_id, exc))
        status = upstream.status
        if status in UpstreamStatusError.RETRYABLE_STATUSES or status == ENGINE_KEY_REFUSED:
            return self._failed_or_broken(exchange, UpstreamStatusError(endpoint_id, status))
        if exchange.response is None and not continuing:
            # Nothing sent yet: the engine's answer goes through as it is.
            exchange.status = status
            exchange.ttfb_s = self._clock() - exchange.started
            exchange.outcome = _outcome_of(status)
            headers = _response_headers(upstream.headers, exchange.request_id)
            return _Done(web.Response(status=status, body=data, headers=headers))
        # Headers already went out: the engine's refusal becomes the stream's error event.
        detail = f"answered HTTP {status}"
        error = StreamInterrupted(endpoint_id, detail)
        return _Done(await self._end_stream_with_error(exchange, error, None, engine_body=data))

    async def _relay(
        self,
        exchange: Exchange,
        upstream: aiohttp.ClientResponse,
        account: StreamAccount,
        rewriter: ContinuationRewriter | None,
    ) -> UpstreamError | None:
        """Forward complete events until `[DONE]`; the error if the engine failed first."""
        endpoint_id = exchange.endpoint_id or "-"
        loop = asyncio.get_running_loop()
        idle_s = self._settings.stream_idle_timeout_s
        content = upstream.content
        pending = b""
        got_event = False
        try:
            async with asyncio.timeout(self._settings.first_byte_timeout_s) as deadline:
                while True:
                    data = await content.readany()
                    if not data:
                        break
                    pending += data
                    block, pending = split_complete_events(pending)
                    if not block:
                        if len(pending) > _MAX_EVENT_BYTES:
                            return UpstreamProtocolError(endpoint_id, "SSE event too large")
                        deadline.reschedule(loop.time() + idle_s)
                        continue
                    # A slow client is not a silent engine: no deadline while writing.
                    deadline.reschedule(None)
                    got_event = True
                    block, stopped = cut_at_engine_stop(block)
                    if stopped is not None:
                        if block:
                            await self._forward(exchange, block, account, rewriter)
                        return UpstreamAborted(endpoint_id, stopped)
                    await self._forward(exchange, block, account, rewriter)
                    if account.done:
                        return None
                    deadline.reschedule(loop.time() + idle_s)
        except TimeoutError:
            if not got_event:
                return UpstreamFirstByteTimeout(
                    endpoint_id, "no event within the first-byte timeout"
                )
            return UpstreamTimeout(endpoint_id, "the stream went silent")
        except (aiohttp.ClientError, OSError) as exc:
            return _upstream_failure(endpoint_id, exc)
        if account.finished:
            if not account.done:
                await self._write(exchange, DONE_EVENT, forwarded=True)
            return None
        if not got_event:
            return UpstreamConnectError(endpoint_id, "the stream ended before its first event")
        return UpstreamProtocolError(endpoint_id, "the stream ended without [DONE]")

    async def _forward(
        self,
        exchange: Exchange,
        block: bytes,
        account: StreamAccount,
        rewriter: ContinuationRewriter | None,
    ) -> None:
        """Send a block of complete events to the client and account for it."""
        if rewriter is None:
            await self._write(exchange, block, forwarded=True)
            account.feed(block)
            return
        out = rewriter.rewrite(block)
        if out:
            await self._write(exchange, out, forwarded=True)

    def _failed_or_broken(self, exchange: Exchange, error: UpstreamError) -> _Failed | _Broken:
        if exchange.forwarded:
            return _Broken(error)
        return _Failed(error)

    # -- writing to the client -------------------------------------------------------------

    async def _prepare(self, exchange: Exchange) -> web.StreamResponse:
        response = exchange.response
        if response is None:
            headers = CIMultiDict(exchange.reply_headers or ())
            headers.update(_SSE_HEADERS)
            headers.setdefault(REQUEST_ID_HEADER, exchange.request_id)
            response = web.StreamResponse(status=200, headers=headers)
            exchange.response = response
            exchange.status = 200
            try:
                await response.prepare(exchange.request)
            except (ConnectionError, aiohttp.ClientConnectionError) as exc:
                raise ClientGone from exc
        return response

    async def _write(self, exchange: Exchange, data: bytes, *, forwarded: bool) -> None:
        response = exchange.response or await self._prepare(exchange)
        if forwarded and not exchange.forwarded:
            exchange.forwarded = True
            exchange.ttfb_s = self._clock() - exchange.started
            self._end_prefill(exchange, first_token=True)
        try:
            await response.write(data)
        except (ConnectionError, aiohttp.ClientConnectionError) as exc:
            raise ClientGone from exc

    async def _end_stream(self, exchange: Exchange) -> web.StreamResponse:
        response = exchange.response or await self._prepare(exchange)
        try:
            await response.write_eof()
        except (ConnectionError, aiohttp.ClientConnectionError) as exc:
            raise ClientGone from exc
        return response

    async def _end_stream_with_error(
        self,
        exchange: Exchange,
        error: RouterError,
        failover: FailoverOutcome | None,
        *,
        engine_body: bytes | None = None,
    ) -> web.StreamResponse:
        """End a started stream with an OpenAI error event and `[DONE]`, then close it cleanly."""
        if failover is not None:
            self._metrics.for_model(exchange.label).failovers[failover].inc()
        body: Mapping[str, Any] = error_body(error)
        if engine_body is not None:
            try:
                decoded = json.loads(engine_body)
            except ValueError:
                decoded = None
            if isinstance(decoded, dict) and "error" in decoded:
                body = decoded
        exchange.outcome = RequestOutcome.STREAM_ERROR
        log.warning(
            "stream_ended_with_error",
            extra={"model": exchange.model, "endpoint": exchange.endpoint_id, "error": str(error)},
        )
        await self._write(exchange, error_event(body), forwarded=True)
        return await self._end_stream(exchange)

    async def _answer_error(self, exchange: Exchange, error: RouterError) -> web.StreamResponse:
        exchange.outcome = _error_outcome(error)
        if exchange.response is not None:
            # A held stream already has its headers: the error goes as an event.
            try:
                return await self._end_stream_with_error(exchange, error, None)
            except ClientGone:
                exchange.status, exchange.outcome = 499, RequestOutcome.CLIENT_CLOSED
                return exchange.response
        exchange.status = error.status
        return _error_response(error)

    # -- helpers -------------------------------------------------------------------------

    async def _admit(
        self,
        exchange: Exchange,
        hold: Hold | None = None,
        *,
        replacement: bool = False,
        priority: int | None = None,
    ) -> Admitted:
        """An endpoint for the next attempt; `replacement`: it may wait for a rebuilt replica."""
        if replacement:
            hold = _marking_hold(exchange, hold)
        try:
            admitted = await self._gate.admit(
                exchange.retry_features(),
                priority=exchange.priority if priority is None else priority,
                hold=hold,
                replacement=replacement,
            )
        except ReplacementTimeout:
            exchange.replacement_timed_out = True
            raise
        exchange.attempts += 1
        exchange.endpoint_id = admitted.endpoint.id
        features = exchange.features
        if features is not None and features.prompt is not None:
            exchange.prefill = begin_prefill(
                self._state.live,
                admitted.endpoint,
                features.prompt,
                self._clock(),
                self._cost,
                max_age_s=self._load_max_age_s,
                peer=peer_rate_of(self._state.view.snapshot, self._state.live, features.model),
            )
        return admitted

    def _waits_for_replacement(self, error: UpstreamError, *, mid_stream: bool) -> bool:
        return self._settings.hold_for_replacement and waits_for_replacement(
            error, mid_stream=mid_stream
        )

    def _end_prefill(self, exchange: Exchange, *, first_token: bool) -> None:
        """The attempt's first token came (it teaches the endpoint's rate) or it ended."""
        if exchange.prefill is not None:
            end_prefill(
                self._state.live,
                exchange.prefill,
                self._clock(),
                self._cost,
                first_token=first_token,
            )
            exchange.prefill = None

    def _retry_or_raise(self, exchange: Exchange, admitted: Admitted, error: UpstreamError) -> None:
        exchange.tried.add(admitted.endpoint.id)
        if not error.retryable or exchange.attempts >= self._settings.max_attempts:
            raise error
        self._metrics.for_model(exchange.label).retries.inc()
        log.info(
            "request_retried",
            extra={"model": exchange.model, "endpoint": admitted.endpoint.id, "error": str(error)},
        )

    def _check_key(self, request: web.Request) -> None:
        if not self._api_keys:
            return
        header = request.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        presented = token.strip().encode()
        # Compare with every key, always, so the time says nothing about which matched.
        matched = False
        for key in self._api_keys:
            matched |= hmac.compare_digest(presented, key)
        if scheme.lower() != "bearer" or not presented or not matched:
            raise Unauthorized

    async def _read_body(self, request: web.Request) -> bytes:
        limit = self._settings.max_body_bytes
        length = request.content_length
        if length is not None and length > limit:
            raise RequestTooLarge(limit)
        try:
            return await request.read()
        except web.HTTPRequestEntityTooLarge as exc:
            raise RequestTooLarge(limit) from exc

    def _priority(self, request: web.Request) -> int:
        raw = request.headers.get(PRIORITY_HEADER)
        if raw is None:
            return self._settings.default_priority
        try:
            return int(raw.strip())
        except ValueError:
            raise InvalidRequest(
                f"Header {PRIORITY_HEADER} must be an integer, got {raw[:40]!r}."
            ) from None

    def _engine_headers(self, headers: Headers, endpoint: Endpoint) -> Headers:
        """The request's headers plus the engine key of the endpoint's model, if known."""
        key = None if self._engine_keys is None else self._engine_keys.key_for(endpoint.service)
        if key is None:
            return headers
        return [*headers, ("Authorization", f"Bearer {key}")]

    def _upstream_headers(self, request: web.Request, request_id: str) -> Headers:
        dropped = self._not_forwarded
        connection = request.headers.get("Connection")
        if connection:
            # Headers the client named in Connection are hop-by-hop too.
            dropped = dropped | {name.strip().lower() for name in connection.split(",")}
        # A list of pairs: aiohttp copies headers into its own multidict anyway.
        headers = [
            (name, value) for name, value in request.headers.items() if name.lower() not in dropped
        ]
        headers.append((REQUEST_ID_HEADER, request_id))
        if "Content-Type" not in request.headers:
            headers.append(("Content-Type", _JSON))
        return headers

    def _record(self, exchange: Exchange) -> None:
        duration = self._clock() - exchange.started
        label = exchange.label if exchange.model != "-" else OTHER_MODEL
        children = self._metrics.for_model(label)
        children.requests[exchange.outcome].inc()
        children.duration[exchange.outcome].observe(duration)
        if exchange.ttfb_s is not None:
            children.ttfb.observe(exchange.ttfb_s)
        if exchange.replacement_held:
            outcome = replacement_outcome(
                ok=exchange.outcome is RequestOutcome.OK,
                timed_out=exchange.replacement_timed_out,
                client_closed=exchange.outcome is RequestOutcome.CLIENT_CLOSED,
            )
            kind = "stream" if exchange.stream else "unary"
            self._metrics.replacement_holds.labels(label, kind, outcome.value).inc()
        if log.isEnabledFor(logging.INFO):
            self._request_log(
                {
                    "request_id": exchange.request_id,
                    "path": exchange.path,
                    "model": exchange.model,
                    "endpoint": exchange.endpoint_id,
                    "status": exchange.status,
                    "outcome": exchange.outcome.value,
                    "stream": exchange.stream,
                    "attempts": exchange.attempts,
                    "failovers": exchange.failovers,
                    "ttfb_s": None if exchange.ttfb_s is None else round(exchange.ttfb_s, 6),
                    "duration_s": round(duration, 6),
                }
            )


# -- pure helpers ----------------------------------------------------------------------------


def _parse_payload(body: bytes) -> dict[str, Any]:
    if not body:
        raise InvalidRequest("The request body is empty; send a JSON object.")
    try:
        payload = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"The request body is not valid JSON: {exc}") from None
    if not isinstance(payload, dict):
        raise InvalidRequest("The request body must be a JSON object.")
    return payload


def _marking_hold(exchange: Exchange, hold: Hold | None) -> Hold:
    """`hold`, noting on the exchange that it was held (the gate calls it when a hold begins)."""

    async def marked() -> None:
        exchange.replacement_held = True
        if hold is not None:
            await hold()

    return marked


def _upstream_failure(endpoint_id: str, exc: BaseException) -> UpstreamError:
    """The typed error for an aiohttp failure talking to an engine."""
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return UpstreamConnectError(endpoint_id, "connect timed out")
    if isinstance(exc, TimeoutError):
        return UpstreamFirstByteTimeout(endpoint_id, "no answer within the first-byte timeout")
    if isinstance(exc, aiohttp.ClientResponseError):
        return UpstreamProtocolError(endpoint_id, f"bad HTTP response: {exc.message}")
    return UpstreamConnectError(endpoint_id, f"{type(exc).__name__}: {exc}")


def _verdict(status: int) -> Outcome:
    if status < 400:
        return Outcome.SUCCESS
    if status < 500:
        return Outcome.NO_VERDICT
    return Outcome.FAILURE


def _outcome_of(status: int) -> RequestOutcome:
    if status < 400:
        return RequestOutcome.OK
    if status < 500:
        return RequestOutcome.ENGINE_CLIENT_ERROR
    return RequestOutcome.UPSTREAM_ERROR


def _error_outcome(error: RouterError) -> RequestOutcome:
    if isinstance(error, UpstreamError):
        return RequestOutcome.UPSTREAM_ERROR
    if isinstance(error, ModelNotFound):
        return RequestOutcome.UNKNOWN_MODEL
    if isinstance(error, AdmissionRejected | NoHealthyEndpoint):
        return RequestOutcome.REJECTED
    return RequestOutcome.INVALID


def _response_headers(upstream: Mapping[str, str], request_id: str) -> Headers:
    headers = [
        (name, value) for name, value in upstream.items() if name.lower() not in _NOT_RETURNED
    ]
    if REQUEST_ID_HEADER not in upstream:
        headers.append((REQUEST_ID_HEADER, request_id))
    return headers


def _error_response(error: RouterError) -> web.Response:
    headers = {}
    retry_after = retry_after_s(error)
    if retry_after is not None:
        headers["Retry-After"] = str(retry_after)
    return web.json_response(error_body(error), status=error.status, headers=headers)
