"""The OpenAI proxy: one request in, one endpoint (or a few) out, the answer streamed back.

Per request:

1. take the `ParsedRequest` the request guard built (`caravan_llm.router.edge.parsed_request`:
   the body read and parsed once, the key's name, the granted priority, the
   request id) and derive the balancer's features (affinity key, prompt shape);
2. `AdmissionGate.admit` gives an endpoint and a lease (or queues, holds for a
   cold start, or raises the 404/429/503 to answer); the lease also counts the
   prompt for the cost model, and the proxy only tells the gate when the
   first byte reached the client (`first_byte`) and when the attempt is over
   (`finish`);
3. send the same body bytes to the engine (never re-encoded) over the one
   shared `aiohttp.ClientSession`;
4. non-streaming: read the whole answer, pass it through unchanged (an
   engine's own not-OpenAI-shaped 404/405 for a route it has not mounted
   becomes `RouteNotServed`); streaming: forward complete SSE events as they
   arrive, no buffering of the whole answer.

Which route a request is on (`caravan_llm.router.edge.routes.RouteSpec`) decides the
engine path, whether it may stream, in which SSE dialect, and whether a
broken stream is continued (chat and completions) or ends with an error
event in its dialect (responses, Anthropic messages). A route that no
replica of the model serves (their Meta `routes`) is refused before admission.

Failures (style.md rule 20): a connect error, a 500/502/503/504 from the
engine, or no headers within `first_byte_timeout_s` sends the request to
another endpoint (the tried ones excluded), up to `max_attempts`, but only
while nothing from any engine has reached the client. Once a stream has
started, an engine that dies (reset, EOF without `[DONE]`, silent for
`stream_idle_timeout_s`) is replaced by a continuation on another endpoint,
written into the same response (`caravan_llm.router.edge.continuation`); when no faithful
continuation is possible the stream ends with an SSE error event and
`[DONE]`. When the replica that died was the last one (every endpoint
tried), the retry or continuation is held for its replacement, like a cold
start (`caravan_llm.router.core.replacement`). Every lease is given back exactly once, with
its verdict for the endpoint's breaker: success, failure (connect error,
5xx, broken stream) or none (4xx, client gone).

One canonical log line per request (`request`: model, endpoint, status,
attempts, failovers, ttfb, duration, and `prefix_source`: whether the cost
model read the chosen endpoint's cached prefix from its KV events or the
approximate index, and `adapter_load_s`: the seconds the router spent having
the request's LoRA adapter loaded on its replica, None when none was loaded),
never bodies, headers or keys.

A request whose `model` is a LoRA adapter's name is routed to its base
model's replicas (`caravan_llm.router.edge.adapter_loader`: the holders
first, the adapter loaded on demand by the admission gate) and sent with
`model` as the engine names the adapter (`caravan_llm.router.edge.adapter_requests`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from caravan_llm.common.contract import OPENAI_STREAM_TRAITS, EngineRoute
from caravan_llm.router.core.adapters import AdapterRoute, AdapterWant
from caravan_llm.router.core.affinity import affinity_key
from caravan_llm.router.core.balancer import Policy, RequestFeatures
from caravan_llm.router.core.endpoints import CheckStatus, Endpoint
from caravan_llm.router.core.errors import (
    AdapterNotHeld,
    AdmissionRejected,
    EngineRejectedInput,
    InvalidField,
    ModelNotFound,
    NoHealthyEndpoint,
    ReplacementTimeout,
    RouteNotServed,
    RouterError,
    StreamInterrupted,
    UpstreamAborted,
    UpstreamConnectError,
    UpstreamError,
    UpstreamFirstByteTimeout,
    UpstreamProtocolError,
    UpstreamStatusError,
    UpstreamTimeout,
    error_body,
)
from caravan_llm.router.core.input_fault import (
    AMBIGUOUS_STATUS,
    client_fault_status,
    input_at_fault,
    vouched,
)
from caravan_llm.router.core.live_state import Outcome, blame
from caravan_llm.router.core.prefix_index import prompt_shape
from caravan_llm.router.core.prompt_digests import ExactPrompt
from caravan_llm.router.core.replacement import replacement_outcome, waits_for_replacement
from caravan_llm.router.core.routing_state import RoutingState
from caravan_llm.router.edge.adapter_loader import AdapterLoader
from caravan_llm.router.edge.adapter_requests import adapter_cards, for_engine
from caravan_llm.router.edge.admission_gate import (
    CONTINUATION_PRIORITY,
    AdmissionGate,
    Admitted,
    Hold,
    model_label,
)
from caravan_llm.router.edge.continuation import (
    DONE_EVENT,
    ContinuationRewriter,
    StreamAccount,
    StreamKind,
    Unfaithful,
    build_continuation,
    cut_at_engine_stop,
    engine_json,
    error_event,
    split_complete_events,
)
from caravan_llm.router.edge.engine_answers import engine_message, rejection
from caravan_llm.router.edge.field_types import field_problem
from caravan_llm.router.edge.parsed_request import (
    PARSED_REQUEST,
    PRIORITY_HEADER,
    REQUEST_ID_HEADER,
    ParsedRequest,
)
from caravan_llm.router.edge.prompt_digests import PromptDigester
from caravan_llm.router.edge.request_guard import error_response
from caravan_llm.router.edge.routes import (
    RouteSpec,
    SseDialect,
    broken_stream_event,
    ends_stream,
    is_openai_error,
    missing_field,
)
from caravan_llm.router.feeds.engine_keys import EngineKeySource
from caravan_llm.router.metrics import FailoverOutcome, RequestOutcome, RouterMetrics
from caravan_llm.router.settings import RouterSettings

# Named as before the router's sub-packages: the logger is a field of every log line.
log = logging.getLogger("router.proxy")

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
# An engine's answer for a route it has not mounted.
_ROUTE_MISSING_STATUSES = frozenset({404, 405})

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
class Attempts:
    """What one request's attempts on endpoints came to so far."""

    # Attempts made (retries and continuations included) and continuations among them.
    count: int = 0
    failovers: int = 0
    # Endpoints tried (excluded from later attempts) and the one of the latest attempt.
    tried: set[str] = field(default_factory=set)
    endpoint_id: str | None = None
    # The attempt in progress: its lease (and the prompt the cost model counts on it).
    current: Admitted | None = None
    # Held for the replacement of its dead replica at least once; and whether that hold timed out.
    replacement_held: bool = False
    replacement_timed_out: bool = False
    # Replicas that were serving and answered this request HTTP 500, not counted against
    # them yet: the input's fault or theirs (`caravan_llm.router.core.input_fault`).
    suspects: dict[str, UpstreamStatusError] = field(default_factory=dict)
    # Where the cost model read the latest attempt's endpoint's cached prefix from
    # (`events` or `approximate`); None: no prefix was looked up (no prompt, another policy).
    prefix_source: str | None = None
    # Seconds spent having the request's LoRA adapter loaded on its replica; None: no load.
    adapter_load_s: float | None = None


@dataclass(slots=True)
class ClientReply:
    """What went, or goes, back to the client."""

    status: int = 0
    outcome: RequestOutcome = RequestOutcome.OK
    ttfb_s: float | None = None
    # The client response once its headers went out (streams, cold-start holds).
    response: web.StreamResponse | None = None
    # Some byte of an engine's answer reached the client: no more plain retries.
    forwarded: bool = False
    # Headers of the engine whose stream opens the client response.
    headers: Headers | None = None


@dataclass(frozen=True, slots=True)
class Exchange:
    """One client request as it goes through the proxy: what it is, its attempts, its reply."""

    request: web.Request
    parsed: ParsedRequest
    # The client's path (for the log line) and what it means (`caravan_llm.router.edge.routes`).
    path: str
    spec: RouteSpec
    started: float
    # The `model` label of its metrics (`model_label`).
    label: str
    stream: bool
    features: RequestFeatures
    # The headers sent to engines (the client's, less hop-by-hop and the router's own).
    headers: Headers
    attempts: Attempts = field(default_factory=Attempts)
    reply: ClientReply = field(default_factory=ClientReply)
    # Routed on its leading ids' digests: the whole prompt's, once tokenized (`prompt_digests`).
    whole_prompt: asyncio.Future[ExactPrompt | None] | None = None

    @property
    def kind(self) -> StreamKind | None:
        """How a broken stream of this request is continued; None: it is not."""
        return self.spec.continuation

    def retry_features(self) -> RequestFeatures:
        """The balancer's view of this request, minus the endpoints it already tried."""
        tried = self.attempts.tried
        if not tried:
            return self.features
        return replace(self.features, exclude=frozenset(tried))


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
        digester: PromptDigester | None = None,
        adapters: AdapterLoader | None = None,
    ) -> None:
        self._adapters = adapters
        self._engine_keys = engine_keys
        self._digester = digester
        self._settings = settings
        self._request_log = request_log or log_request
        self._state = state
        self._gate = gate
        self._session = session
        self._metrics = metrics
        self._clock = clock
        self._wall_clock = wall_clock
        self._use_affinity = settings.policy is Policy.PREFIX_AFFINITY
        self._use_cost = settings.policy is Policy.PREDICTED_TTFT
        self._shape = settings.balancer_config().cost.shape
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
        self._breaker = settings.balancer_config().breaker

    # -- routes ------------------------------------------------------------------------

    def route(
        self, path: str, spec: RouteSpec
    ) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        """The handler of one POST route (`caravan_llm.router.edge.routes.ROUTES`)."""

        async def handle(request: web.Request) -> web.StreamResponse:
            return await self._handle(request, path, spec)

        return handle

    def _model_names(self) -> list[str]:
        """Served models with a routable endpoint, and every declared one, sorted."""
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
        return sorted(names)

    def _model_card(self, name: str) -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "created": int(self._wall_clock()),
            "owned_by": "caravan",
        }

    def _model_cards(self) -> list[dict[str, Any]]:
        """The served and declared models, then their LoRA adapters (`parent` the base)."""
        names = self._model_names()
        cards = [self._model_card(name) for name in names]
        created = int(self._wall_clock())
        return cards + adapter_cards(self._state.view.adapters, names, created)

    async def models(self, _request: web.Request) -> web.StreamResponse:
        """`GET /v1/models`: served models with a routable endpoint, declared ones, adapters."""
        return web.json_response({"object": "list", "data": self._model_cards()})

    async def model(self, request: web.Request) -> web.StreamResponse:
        """`GET /v1/models/{model}` (models.retrieve): one model of the list, else 404."""
        name = request.match_info["model"]
        card = next((c for c in self._model_cards() if c["id"] == name), None)
        if card is None:
            return error_response(ModelNotFound(name[:200]))
        return web.json_response(card)

    # -- one request ---------------------------------------------------------------------

    async def _handle(self, request: web.Request, path: str, spec: RouteSpec) -> web.StreamResponse:
        parsed = request.get(PARSED_REQUEST)
        if parsed is None:  # pragma: no cover - the request guard parses every POST
            log.error("request_not_parsed", extra={"path": path})
            return error_response(RouterError("Internal router error."))
        exchange = self._exchange(request, parsed, path, spec)
        reply = exchange.reply
        try:
            self._check_request(exchange)
            exchange = await self._with_exact_prompt(exchange)
            response = await self._serve(exchange)
        except RouterError as exc:
            response = await self._answer_error(exchange, exc)
        except ClientGone:
            reply.status, reply.outcome = 499, RequestOutcome.CLIENT_CLOSED
            response = reply.response or web.Response(status=499)
        except asyncio.CancelledError:
            # aiohttp cancels the handler when the client disconnects.
            reply.status, reply.outcome = 499, RequestOutcome.CLIENT_CLOSED
            self._record(exchange)
            raise
        except Exception:
            # The request's boundary: a bug must cost one request, answered in
            # OpenAI's shape, never the router (leases were given back in finally).
            log.exception("request_failed", extra={"request_id": parsed.request_id})
            response = await self._answer_error(exchange, RouterError("Internal router error."))
        self._record(exchange)
        return response

    def _exchange(
        self, request: web.Request, parsed: ParsedRequest, path: str, spec: RouteSpec
    ) -> Exchange:
        payload = parsed.payload
        route = None if self._adapters is None else self._adapters.route(parsed.model)
        model = parsed.model if route is None else route.served
        adapter = None if route is None else self._adapters_want(route)
        if route is not None:
            parsed = for_engine(parsed, route, self._state.view.adapters.request_model(route))
        responses = spec.route is EngineRoute.RESPONSES
        shape = prompt_shape(payload, self._shape, responses=responses) if self._use_cost else None
        return Exchange(
            request=request,
            parsed=parsed,
            path=path,
            spec=spec,
            started=self._clock(),
            label=model_label(self._state, model),
            stream=spec.streams and parsed.stream,
            features=RequestFeatures(
                model=model,
                adapter=adapter,
                route=spec.route,
                affinity_key=(
                    affinity_key(payload, self._settings.affinity_prefix_chars, responses=responses)
                    if self._use_affinity
                    else None
                ),
                prompt=shape,
            ),
            headers=self._upstream_headers(request, parsed.request_id),
        )

    async def _with_exact_prompt(self, exchange: Exchange) -> Exchange:
        """The exchange with its prompt's block digests for the exact index, when there are any.

        Waits at most the digester's budget (`caravan_llm.router.edge.prompt_digests`).
        """
        features = exchange.features
        # An adapter's blocks are keyed by the adapter too: its requests keep the
        # approximate index.
        if features.prompt is None or features.adapter is not None or self._digester is None:
            return exchange
        digested = await self._digester.digest(
            exchange.parsed.model,
            exchange.parsed.payload,
            route=exchange.spec.route,
        )
        if digested.prompt is None and digested.whole is None:
            return exchange
        return replace(
            exchange,
            features=replace(features, exact=digested.prompt),
            whole_prompt=digested.whole,
        )

    def _adapters_want(self, route: AdapterRoute) -> AdapterWant | None:
        """The balancer's view of a request for the adapter (the loader counts it as demand)."""
        return None if self._adapters is None else self._adapters.want(route, self._clock())

    def _check_request(self, exchange: Exchange) -> None:
        """Refuse a body the route cannot take, or a route no replica serves, before admission."""
        missing = missing_field(exchange.spec, exchange.parsed.payload)
        if missing is not None:
            raise InvalidField(missing, f"`{missing}` is required on {exchange.path}.")
        wrong = field_problem(exchange.spec.route, exchange.parsed.payload)
        if wrong is not None:
            raise InvalidField(*wrong)
        adapter = exchange.features.adapter
        if adapter is not None and self._adapters is not None:
            refused = self._adapters.refusal_of(adapter, self._clock())
            if refused is not None:
                raise refused
        model = exchange.features.model
        endpoints = self._state.view.snapshot.for_model(model)
        route = exchange.spec.route
        if (
            endpoints is not None
            and endpoints.endpoints
            and not any(endpoint.serves(route) for endpoint in endpoints.endpoints)
        ):
            raise RouteNotServed(model, exchange.path, "its engine does not serve this route")

    async def _serve(self, exchange: Exchange) -> web.StreamResponse:
        if exchange.stream:
            return await self._serve_stream(exchange)
        return await self._serve_unary(exchange)

    # -- non-streaming -------------------------------------------------------------------

    async def _serve_unary(self, exchange: Exchange) -> web.StreamResponse:
        replacement = False
        while True:
            admitted = await self._admit_attempt(exchange, replacement=replacement)
            result = await self._unary_once(exchange, admitted)
            if isinstance(result, _Done):
                if exchange.reply.status < 400:
                    self._blame_suspects(exchange)
                return result.response
            self._retry_or_raise(exchange, admitted, result.error)
            replacement = self._waits_for_replacement(result.error, mid_stream=False)

    async def _unary_once(self, exchange: Exchange, admitted: Admitted) -> _Done | _Failed:
        endpoint = admitted.endpoint
        outcome = Outcome.FAILURE
        try:
            try:
                async with self._session().post(
                    endpoint.base_url + exchange.spec.engine_path,
                    data=exchange.parsed.body,
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
            gone = self._adapter_gone(exchange, endpoint.id, status, data)
            if gone is not None:
                outcome = Outcome.NO_VERDICT
                return _Failed(gone)
            if status in UpstreamStatusError.RETRYABLE_STATUSES or status == ENGINE_KEY_REFUSED:
                error = _status_error(endpoint.id, status, data)
                outcome = self._failure_verdict(exchange, error)
                return _Failed(error)
            outcome = _verdict(status)
            exchange.reply.status = status
            exchange.reply.ttfb_s = self._clock() - exchange.started
            exchange.reply.outcome = _outcome_of(status)
            refused = self._engine_refusal(exchange, status, data)
            if refused is not None:
                return _Done(refused)
            response_headers = _response_headers(upstream_headers, exchange.parsed.request_id)
            return _Done(web.Response(status=status, body=data, headers=response_headers))
        except asyncio.CancelledError:
            outcome = Outcome.NO_VERDICT
            raise
        finally:
            self._finish(exchange, admitted, outcome)

    # -- streaming ---------------------------------------------------------------------

    async def _serve_stream(self, exchange: Exchange) -> web.StreamResponse:
        # Chat and completions streams are accounted for (to continue them); others are relayed.
        kind = exchange.kind
        account = StreamAccount(kind) if kind is not None else None

        async def hold() -> None:
            await self._write(exchange, HOLD_COMMENT, forwarded=False)

        # Plain attempts, while nothing of any engine's answer reached the client.
        replacement = False
        while True:
            admitted = await self._admit_attempt(exchange, hold=hold, replacement=replacement)
            result = await self._stream_once(
                exchange, admitted, exchange.parsed.body, account, None
            )
            if exchange.reply.forwarded:
                # Another replica answered (its stream started): the suspicions were right.
                self._blame_suspects(exchange)
            if isinstance(result, _Done):
                return result.response
            if isinstance(result, _Failed):
                self._retry_or_raise(exchange, admitted, result.error)
                replacement = self._waits_for_replacement(result.error, mid_stream=False)
                continue
            exchange.attempts.tried.add(admitted.endpoint.id)
            if account is None:
                error = StreamInterrupted(
                    admitted.endpoint.id,
                    f"the stream broke and {exchange.path} streams are not continued: "
                    f"{result.error}",
                )
                return await self._end_stream_with_error(
                    exchange, error, FailoverOutcome.IMPOSSIBLE
                )
            return await self._fail_over(exchange, account, hold, result.error)

    async def _fail_over(
        self, exchange: Exchange, account: StreamAccount, hold: Hold, broken: UpstreamError
    ) -> web.StreamResponse:
        """The stream has started and its engine died: continue it, in the same response."""
        while True:
            log.warning(
                "stream_broken",
                extra={
                    "model": exchange.parsed.model,
                    "endpoint": exchange.attempts.endpoint_id,
                    "error": str(broken),
                    "tokens_sent": account.sent_tokens,
                },
            )
            if account.finished:
                # The engine died after its last token: only the end was lost.
                if not account.done:
                    await self._write(exchange, DONE_EVENT, forwarded=True)
                return await self._end_stream(exchange)
            if exchange.attempts.failovers >= self._settings.max_failovers:
                error = StreamInterrupted(
                    exchange.attempts.endpoint_id or "-",
                    f"the stream broke and failover gave up: {broken}",
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
        payload = exchange.parsed.payload
        # Whether any engine could continue; the strictest traits (the OpenAI defaults).
        probe = build_continuation(payload, account, OPENAI_STREAM_TRAITS)
        if isinstance(probe, Unfaithful):
            error = StreamInterrupted(
                exchange.attempts.endpoint_id or "-",
                f"the stream broke and cannot be continued faithfully: {probe.reason}",
            )
            return _Done(
                await self._end_stream_with_error(exchange, error, FailoverOutcome.IMPOSSIBLE)
            )
        exchange.attempts.failovers += 1
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
            self._finish(exchange, admitted, Outcome.NO_VERDICT)
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
            if exchange.reply.outcome is RequestOutcome.OK:
                children.failovers[FailoverOutcome.RESUMED].inc()
                log.info(
                    "stream_resumed",
                    extra={"model": exchange.parsed.model, "endpoint": admitted.endpoint.id},
                )
            return result
        exchange.attempts.tried.add(admitted.endpoint.id)
        return result.error

    async def _stream_once(
        self,
        exchange: Exchange,
        admitted: Admitted,
        body: bytes,
        account: StreamAccount | None,
        rewriter: ContinuationRewriter | None,
    ) -> _Done | _Failed | _Broken:
        endpoint = admitted.endpoint
        exchange.attempts.endpoint_id = endpoint.id
        outcome = Outcome.FAILURE
        upstream: aiohttp.ClientResponse | None = None
        clean = False
        try:
            try:
                async with asyncio.timeout(self._settings.first_byte_timeout_s):
                    upstream = await self._session().post(
                        endpoint.base_url + exchange.spec.engine_path,
                        data=body,
                        headers=self._stream_headers(exchange.headers, endpoint),
                        timeout=self._stream_timeout,
                    )
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                return self._failed_or_broken(exchange, _upstream_failure(endpoint.id, exc))
            content_type = upstream.headers.get("Content-Type", "")
            if upstream.status != 200 or not content_type.startswith("text/event-stream"):
                result = await self._stream_refused(exchange, upstream, rewriter is not None)
                if isinstance(result, _Failed):
                    outcome = self._failure_verdict(exchange, result.error)
                else:
                    outcome = _verdict(upstream.status)
                    clean = True
                return result
            if exchange.reply.response is None:
                exchange.reply.headers = _response_headers(
                    upstream.headers, exchange.parsed.request_id
                )
            relayed = (
                await self._relay(exchange, upstream, account, rewriter)
                if account is not None
                else await self._relay_plain(exchange, upstream)
            )
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
            self._finish(exchange, admitted, outcome)

    async def _stream_refused(
        self, exchange: Exchange, upstream: aiohttp.ClientResponse, continuing: bool
    ) -> _Done | _Failed | _Broken:
        """The engine answered a stream request with an error (or not with SSE)."""
        endpoint_id = exchange.attempts.endpoint_id or "-"
        try:
            data = await asyncio.wait_for(upstream.read(), self._settings.first_byte_timeout_s)
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            return self._failed_or_broken(exchange, _upstream_failure(endpoint_id, exc))
        status = upstream.status
        gone = self._adapter_gone(exchange, endpoint_id, status, data)
        if gone is not None:
            return self._failed_or_broken(exchange, gone)
        if status in UpstreamStatusError.RETRYABLE_STATUSES or status == ENGINE_KEY_REFUSED:
            return self._failed_or_broken(exchange, _status_error(endpoint_id, status, data))
        if exchange.reply.response is None and not continuing:
            # Nothing sent yet: the engine's answer goes through as it is.
            exchange.reply.status = status
            exchange.reply.ttfb_s = self._clock() - exchange.started
            exchange.reply.outcome = _outcome_of(status)
            refused = self._engine_refusal(exchange, status, data)
            if refused is not None:
                return _Done(refused)
            headers = _response_headers(upstream.headers, exchange.parsed.request_id)
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
        endpoint_id = exchange.attempts.endpoint_id or "-"
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

    async def _relay_plain(
        self, exchange: Exchange, upstream: aiohttp.ClientResponse
    ) -> UpstreamError | None:
        """Forward complete events as the engine writes them (no continuation on these routes).

        The stream is whole once its dialect's last event came (`response.completed`,
        `message_stop`, ...); whatever follows up to the engine's EOF is forwarded too.
        """
        endpoint_id = exchange.attempts.endpoint_id or "-"
        dialect = exchange.spec.dialect
        loop = asyncio.get_running_loop()
        idle_s = self._settings.stream_idle_timeout_s
        content = upstream.content
        pending = b""
        got_event = ended = False
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
                    deadline.reschedule(None)
                    got_event = True
                    ended = ended or ends_stream(dialect, block)
                    await self._write(exchange, block, forwarded=True)
                    deadline.reschedule(loop.time() + idle_s)
        except TimeoutError:
            if ended:
                return None
            if not got_event:
                return UpstreamFirstByteTimeout(
                    endpoint_id, "no event within the first-byte timeout"
                )
            return UpstreamTimeout(endpoint_id, "the stream went silent")
        except (aiohttp.ClientError, OSError) as exc:
            return None if ended else _upstream_failure(endpoint_id, exc)
        if pending.strip():
            # The engine's last event, without the blank line that ends it.
            last = pending.rstrip(b"\n") + b"\n\n"
            ended = ended or ends_stream(dialect, last)
            got_event = True
            await self._write(exchange, last, forwarded=True)
        if ended:
            return None
        if not got_event:
            return UpstreamConnectError(endpoint_id, "the stream ended before its first event")
        return UpstreamProtocolError(endpoint_id, "the stream ended before its last event")

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
        if exchange.reply.forwarded:
            return _Broken(error)
        return _Failed(error)

    # -- writing to the client -------------------------------------------------------------

    async def _prepare(self, exchange: Exchange) -> web.StreamResponse:
        response = exchange.reply.response
        if response is None:
            headers = CIMultiDict(exchange.reply.headers or ())
            headers.update(_SSE_HEADERS)
            headers.setdefault(REQUEST_ID_HEADER, exchange.parsed.request_id)
            response = web.StreamResponse(status=200, headers=headers)
            exchange.reply.response = response
            exchange.reply.status = 200
            try:
                await response.prepare(exchange.request)
            except (ConnectionError, aiohttp.ClientConnectionError) as exc:
                raise ClientGone from exc
        return response

    async def _write(self, exchange: Exchange, data: bytes, *, forwarded: bool) -> None:
        response = exchange.reply.response or await self._prepare(exchange)
        if forwarded and not exchange.reply.forwarded:
            exchange.reply.forwarded = True
            exchange.reply.ttfb_s = self._clock() - exchange.started
            current = exchange.attempts.current
            if current is not None:
                self._gate.first_byte(current)
        try:
            await response.write(data)
        except (ConnectionError, aiohttp.ClientConnectionError) as exc:
            raise ClientGone from exc

    async def _end_stream(self, exchange: Exchange) -> web.StreamResponse:
        response = exchange.reply.response or await self._prepare(exchange)
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
        dialect = exchange.spec.dialect
        if dialect is not SseDialect.OPENAI_CHUNKS:
            # A relayed stream ends in its own dialect, without `[DONE]`.
            exchange.reply.outcome = RequestOutcome.STREAM_ERROR
            log.warning(
                "stream_ended_with_error",
                extra={
                    "model": exchange.parsed.model,
                    "endpoint": exchange.attempts.endpoint_id,
                    "error": str(error),
                },
            )
            await self._write(exchange, broken_stream_event(dialect, error.message), forwarded=True)
            return await self._end_stream(exchange)
        body: Mapping[str, Any] = error_body(error)
        if engine_body is not None:
            try:
                decoded = engine_json(engine_body)
            except ValueError:
                decoded = None
            if isinstance(decoded, dict) and "error" in decoded:
                body = decoded
        exchange.reply.outcome = RequestOutcome.STREAM_ERROR
        log.warning(
            "stream_ended_with_error",
            extra={
                "model": exchange.parsed.model,
                "endpoint": exchange.attempts.endpoint_id,
                "error": str(error),
            },
        )
        await self._write(exchange, error_event(body), forwarded=True)
        return await self._end_stream(exchange)

    async def _answer_error(self, exchange: Exchange, error: RouterError) -> web.StreamResponse:
        exchange.reply.outcome = _error_outcome(error)
        if exchange.reply.response is not None:
            # A held stream already has its headers: the error goes as an event.
            try:
                return await self._end_stream_with_error(exchange, error, None)
            except ClientGone:
                exchange.reply.status, exchange.reply.outcome = 499, RequestOutcome.CLIENT_CLOSED
                return exchange.reply.response
        exchange.reply.status = error.status
        return error_response(error)

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
                priority=exchange.parsed.priority if priority is None else priority,
                hold=hold,
                replacement=replacement,
            )
        except ReplacementTimeout:
            exchange.attempts.replacement_timed_out = True
            raise
        if exchange.whole_prompt is not None:
            self._gate.hold_whole(admitted, exchange.whole_prompt)
        exchange.attempts.count += 1
        exchange.attempts.endpoint_id = admitted.endpoint.id
        exchange.attempts.current = admitted
        if admitted.prefill is not None:
            exchange.attempts.prefix_source = admitted.prefill.prefix_source
        if admitted.adapter_load_s is not None:
            exchange.attempts.adapter_load_s = (
                exchange.attempts.adapter_load_s or 0.0
            ) + admitted.adapter_load_s
        return admitted

    async def _admit_attempt(
        self, exchange: Exchange, hold: Hold | None = None, *, replacement: bool
    ) -> Admitted:
        """`_admit` for a plain attempt: no endpoint left for suspicions blames the input."""
        try:
            return await self._admit(exchange, hold, replacement=replacement)
        except RouterError as exc:
            if exchange.attempts.suspects:
                raise self._input_fault(exchange) from exc
            raise

    def _adapter_gone(
        self, exchange: Exchange, endpoint_id: str, status: int, data: bytes
    ) -> AdapterNotHeld | None:
        """The engine's 404 for the request's adapter: it no longer holds it (`AdapterNotHeld`).

        The loader forgets the adapter there until the scheduler's next document,
        so that the retry goes to a holder or loads it on demand.
        """
        adapter = exchange.features.adapter
        if adapter is None or self._adapters is None or status != 404:
            return None
        if not is_openai_error(data):
            return None  # a route the engine lacks (`_route_not_served`)
        self._adapters.not_held(endpoint_id, adapter.name)
        return AdapterNotHeld(endpoint_id, f"it does not hold the adapter '{adapter.name}'")

    def _failure_verdict(self, exchange: Exchange, error: UpstreamError) -> Outcome:
        """The breaker verdict of a failed attempt: a suspicion when the input may be at fault."""
        if isinstance(error, AdapterNotHeld):
            return Outcome.NO_VERDICT
        if (
            not isinstance(error, UpstreamStatusError)
            or error.upstream_status != AMBIGUOUS_STATUS
            or exchange.reply.forwarded
        ):
            return Outcome.FAILURE
        now = self._clock()
        state = self._state.live.get(error.endpoint_id)
        if not vouched(state, now, self._settings.input_fault_window_s):
            return Outcome.FAILURE
        exchange.attempts.suspects[error.endpoint_id] = error
        return Outcome.NO_VERDICT

    def _blame_suspects(self, exchange: Exchange) -> None:
        """Another replica answered: each suspected 500 was its replica's failure."""
        suspects = exchange.attempts.suspects
        if not suspects:
            return
        now = self._clock()
        for endpoint_id in suspects:
            blame(self._state.live, endpoint_id, self._breaker, now)
        suspects.clear()

    def _input_fault(self, exchange: Exchange) -> EngineRejectedInput:
        """The answer for a request whose 500s are blamed on its input (nothing counted)."""
        suspects = exchange.attempts.suspects
        message = next(
            (error.engine_message for error in suspects.values() if error.engine_message),
            None,
        )
        log.info(
            "engine_input_fault",
            extra={
                "model": exchange.parsed.model,
                "endpoints": sorted(suspects),
                "request_id": exchange.parsed.request_id,
            },
        )
        self._metrics.engine_rejections.labels(exchange.label, str(AMBIGUOUS_STATUS)).inc()
        count = len(suspects)
        suspects.clear()
        return EngineRejectedInput(
            400,
            message
            or f"The model's engine could not process this request (HTTP 500 from {count} "
            "replica(s) that serve other requests): the request is taken to be malformed.",
        )

    def _engine_refusal(
        self, exchange: Exchange, status: int, data: bytes
    ) -> web.StreamResponse | None:
        """The router's own answer instead of an engine's refusal, or None to pass it on.

        An engine's not-OpenAI-shaped 404/405 means a route it lacks
        (`route_not_supported`); another refusal of the client's input goes back
        as it is when OpenAI-shaped, else rewritten in OpenAI's shape.
        """
        not_served = _route_not_served(exchange, status, data)
        if not_served is not None:
            return error_response(not_served)
        if not client_fault_status(status):
            return None
        self._metrics.engine_rejections.labels(exchange.label, str(status)).inc()
        if is_openai_error(data):
            return None
        return error_response(rejection(status, data))

    def _finish(self, exchange: Exchange, admitted: Admitted, outcome: Outcome) -> None:
        """The attempt is over: its lease goes back with the endpoint's verdict."""
        exchange.attempts.current = None
        self._gate.finish(admitted, outcome)

    def _waits_for_replacement(self, error: UpstreamError, *, mid_stream: bool) -> bool:
        return self._settings.hold_for_replacement and waits_for_replacement(
            error, mid_stream=mid_stream
        )

    def _retry_or_raise(self, exchange: Exchange, admitted: Admitted, error: UpstreamError) -> None:
        exchange.attempts.tried.add(admitted.endpoint.id)
        can_retry = error.retryable and exchange.attempts.count < self._settings.max_attempts
        if input_at_fault(exchange.attempts.suspects, can_retry=can_retry):
            raise self._input_fault(exchange)
        if not can_retry:
            raise error
        self._metrics.for_model(exchange.label).retries.inc()
        log.info(
            "request_retried",
            extra={
                "model": exchange.parsed.model,
                "endpoint": admitted.endpoint.id,
                "error": str(error),
                "request_id": exchange.parsed.request_id,
            },
        )

    def _engine_headers(self, headers: Headers, endpoint: Endpoint) -> Headers:
        """The request's headers plus the engine key of the endpoint's model, if known."""
        key = None if self._engine_keys is None else self._engine_keys.key_for(endpoint.service)
        if key is None:
            return headers
        return [*headers, ("Authorization", f"Bearer {key}")]

    def _stream_headers(self, headers: Headers, endpoint: Endpoint) -> Headers:
        """`_engine_headers`, and `Connection: close` to an engine that drops its
        connections after a stream anyway (its traits): aiohttp then never pools the
        connection, so no later request goes out on one the engine is closing."""
        headers = self._engine_headers(headers, endpoint)
        if endpoint.traits.keeps_stream_connections:
            return headers
        return [*headers, ("Connection", "close")]

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
        label, parsed, attempts, reply = (
            exchange.label,
            exchange.parsed,
            exchange.attempts,
            exchange.reply,
        )
        children = self._metrics.for_model(label)
        children.requests[reply.outcome].inc()
        children.duration[reply.outcome].observe(duration)
        if reply.ttfb_s is not None:
            children.ttfb.observe(reply.ttfb_s)
        if attempts.replacement_held:
            outcome = replacement_outcome(
                ok=reply.outcome is RequestOutcome.OK,
                timed_out=attempts.replacement_timed_out,
                client_closed=reply.outcome is RequestOutcome.CLIENT_CLOSED,
            )
            kind = "stream" if exchange.stream else "unary"
            self._metrics.replacement_holds.labels(label, kind, outcome.value).inc()
        if log.isEnabledFor(logging.INFO):
            fields: dict[str, Any] = {
                "request_id": parsed.request_id,
                "path": exchange.path,
                "model": parsed.model,
                "endpoint": attempts.endpoint_id,
                "status": reply.status,
                "outcome": reply.outcome.value,
                "stream": exchange.stream,
                "attempts": attempts.count,
                "failovers": attempts.failovers,
                "ttfb_s": None if reply.ttfb_s is None else round(reply.ttfb_s, 6),
                "duration_s": round(duration, 6),
                "prefix_source": attempts.prefix_source,
                "adapter_load_s": None
                if attempts.adapter_load_s is None
                else round(attempts.adapter_load_s, 6),
            }
            if parsed.key_name is not None:
                fields["key"] = parsed.key_name
            self._request_log(fields)


# -- pure helpers ----------------------------------------------------------------------------


def _marking_hold(exchange: Exchange, hold: Hold | None) -> Hold:
    """`hold`, noting on the exchange that it was held (the gate calls it when a hold begins)."""

    async def marked() -> None:
        exchange.attempts.replacement_held = True
        if hold is not None:
            await hold()

    return marked


def _route_not_served(exchange: Exchange, status: int, data: bytes) -> RouteNotServed | None:
    """The error to answer instead of an engine's own not-found (not OpenAI's shape).

    An engine without the route, or whose model is not of the kind the route
    needs (vLLM mounts embeddings, score and rerank for pooling models only),
    answers 404/405 in its web framework's shape (`{"detail": "Not Found"}`).
    """
    if status not in _ROUTE_MISSING_STATUSES or is_openai_error(data):
        return None
    return RouteNotServed(
        exchange.parsed.model,
        exchange.path,
        f"its engine answered HTTP {status} for {exchange.spec.engine_path} "
        "(the engine lacks the route, or the model is not of the kind it needs, "
        "such as an embedding or reranking model)",
    )


def _upstream_failure(endpoint_id: str, exc: BaseException) -> UpstreamError:
    """The typed error for an aiohttp failure talking to an engine."""
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return UpstreamConnectError(endpoint_id, "connect timed out")
    if isinstance(exc, TimeoutError):
        return UpstreamFirstByteTimeout(endpoint_id, "no answer within the first-byte timeout")
    if isinstance(exc, aiohttp.ClientResponseError):
        return UpstreamProtocolError(endpoint_id, f"bad HTTP response: {exc.message}")
    return UpstreamConnectError(endpoint_id, f"{type(exc).__name__}: {exc}")


# "Not implemented": the engine lacks a feature (llama-server's embeddings without
# `--embeddings`), which says nothing about the replica's health.
_NOT_IMPLEMENTED = 501


def _verdict(status: int) -> Outcome:
    if status < 400:
        return Outcome.SUCCESS
    if status < 500 or status == _NOT_IMPLEMENTED:
        return Outcome.NO_VERDICT
    return Outcome.FAILURE


def _status_error(endpoint_id: str, status: int, data: bytes) -> UpstreamStatusError:
    """The failure of an engine's 5xx (or 401) answer, with its own message when it has one."""
    return UpstreamStatusError(endpoint_id, status, engine_message=engine_message(data)[0])


def _outcome_of(status: int) -> RequestOutcome:
    if status < 400:
        return RequestOutcome.OK
    if status < 500:
        return RequestOutcome.ENGINE_CLIENT_ERROR
    return RequestOutcome.UPSTREAM_ERROR


def _error_outcome(error: RouterError) -> RequestOutcome:
    if isinstance(error, EngineRejectedInput):
        return RequestOutcome.ENGINE_CLIENT_ERROR
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
