"""Errors the router answers clients with, each knowing its HTTP status and OpenAI shape.

    RouterError                   base; `retryable` says if sending the request again may help
    ├── InvalidRequest            400  the body is not JSON, has no `model`, ...
    │   ├── InvalidField          400  a body field has the wrong type (`param` names it)
    │   ├── EngineRejectedInput   4xx  an engine refused the request's input (its own 4xx,
    │   │                              or a 500 judged the input's fault: core/input_fault.py)
    │   ├── RequestTooLarge       413  the body is over the router's limit
    │   ├── HeadersTooLarge       431  a request line or header field over the limit
    │   └── TooManyHeaders        431  more header fields than the limit
    ├── Unauthorized              401  no API key, or not one of the configured keys
    ├── RouteNotFound             404  no such path
    ├── MethodNotAllowed          405  the path exists, not with this method
    ├── RequestTimeout            408  headers or body not received in time (connection closed)
    ├── RateLimited               429  over the key's requests per second, Retry-After (retryable)
    ├── TooManyConnections        503  the router is at its connection cap (retryable)
    ├── ModelNotFound             404  no endpoint serves the model and none is declared
    ├── RouteNotServed            404  the model's replicas do not serve this route
    ├── NoHealthyEndpoint         503  endpoints exist, none can take the request   (retryable)
    │   └── ModelUnavailable      503  every replica failed for good (the scheduler's record)
    ├── AdapterUnavailable        503  a LoRA adapter could not be loaded (bad source, timeout)
    ├── AdmissionRejected         429/503 with Retry-After                          (retryable)
    │   ├── QueueFull             429  the model's queue is at its bound
    │   └── QueueTimeout          503  queued past its deadline (capacity or cold start)
    │       ├── ReplacementTimeout 503 no replacement of a dead last replica passed in time
    │       └── RebuildTimeout    503  every replica out; none rebuilt within the rebuild bound
    └── UpstreamError             502  the engine failed the request
        ├── UpstreamConnectError  502  no connection, or reset before any response  (retryable)
        ├── UpstreamStatusError   502/503/504 as the engine said (retryable for 5xx gateway codes)
        ├── UpstreamProtocolError 502  the response broke HTTP/SSE framing
        ├── UpstreamAborted       502  the engine aborted the answer (vLLM stopping) (retryable)
        ├── UpstreamTimeout       504  no response within the read timeout
        │   └── UpstreamFirstByteTimeout  504  no headers at all: a hung replica  (retryable)
        └── StreamInterrupted     502  the engine died mid-stream and no faithful
                                       continuation was possible (sent as an SSE error event)

The proxy retries only a retryable error, only on another endpoint, and only
before the first byte has gone to the client. Messages name the model or the
endpoint id, never request bodies, headers or keys.
"""

from __future__ import annotations

from typing import Any


class RouterError(Exception):
    """Base of every error the router turns into an HTTP answer."""

    retryable: bool = False
    status: int = 500
    error_type: str = "server_error"
    code: str = "internal_error"
    # The request field the error is about (OpenAI's `param`), when there is one.
    param: str | None = None

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidRequest(RouterError):
    status = 400
    error_type = "invalid_request_error"
    code = "invalid_request"


class EngineRejectedInput(InvalidRequest):
    """An engine refused what the client sent: the client's fault, never the replica's.

    `status` is the engine's 4xx (400 for a 500 that `caravan_llm.router.core.input_fault`
    blames on the input); the message is the engine's own when it has one
    (`engine_message`: bounded, printable), else a plain one naming the status.
    """

    code = "rejected_by_engine"

    def __init__(self, status: int, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param


class RequestTooLarge(InvalidRequest):
    status = 413
    code = "request_too_large"

    def __init__(self, limit_bytes: int) -> None:
        super().__init__(
            f"The request body is larger than the router's limit of {limit_bytes} bytes."
        )
        self.limit_bytes = limit_bytes


class InvalidField(InvalidRequest):
    """A field of the request body has the wrong type or value; `param` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class HeadersTooLarge(InvalidRequest):
    status = 431
    code = "request_header_fields_too_large"

    def __init__(self, limit_bytes: int) -> None:
        super().__init__(
            f"A request line or header field is longer than the router's limit of "
            f"{limit_bytes} bytes."
        )
        self.limit_bytes = limit_bytes


class TooManyHeaders(InvalidRequest):
    status = 431
    code = "request_header_fields_too_large"

    def __init__(self) -> None:
        super().__init__("The request has more header fields than the router accepts.")


class Unauthorized(RouterError):
    status = 401
    error_type = "invalid_request_error"
    # What OpenAI's own API answers a missing or wrong key with.
    code = "invalid_api_key"

    def __init__(self) -> None:
        super().__init__("Missing or invalid API key (send `Authorization: Bearer <key>`).")


class ModelNotFound(RouterError):
    status = 404
    error_type = "invalid_request_error"
    # The code OpenAI's own API answers an unknown model with.
    code = "model_not_found"

    def __init__(self, model: str) -> None:
        super().__init__(f"The model '{model}' does not exist or has no replicas declared.")
        self.model = model


class RouteNotServed(RouterError):
    """No replica of the model serves the route: its engine has no such route, or
    (an engine's own non-OpenAI 404) the model is not of the kind the route needs."""

    status = 404
    error_type = "invalid_request_error"
    code = "route_not_supported"
    param = "model"

    def __init__(self, model: str, path: str, why: str) -> None:
        super().__init__(f"No replica of model '{model}' serves {path}: {why}.")
        self.model = model


class RouteNotFound(RouterError):
    status = 404
    error_type = "invalid_request_error"
    code = "not_found"

    def __init__(self, path: str) -> None:
        # The path is the client's own input: cut it, so the answer stays small.
        super().__init__(f"No route {path[:200]!r} on this router.")


class MethodNotAllowed(RouterError):
    status = 405
    error_type = "invalid_request_error"
    code = "method_not_allowed"

    def __init__(self, method: str, allowed: str) -> None:
        super().__init__(f"Method {method[:20]!r} is not allowed here; use {allowed}.")
        self.allowed = allowed


class RequestTimeout(RouterError):
    status = 408
    error_type = "invalid_request_error"
    code = "request_timeout"

    def __init__(self, what: str, timeout_s: float) -> None:
        super().__init__(f"The request's {what} did not arrive within {timeout_s:g} s.")


class RateLimited(RouterError):
    retryable = True
    status = 429
    error_type = "rate_limit_error"
    # What OpenAI's own API answers a rate-limited key with.
    code = "rate_limit_exceeded"

    def __init__(self, key_name: str, rps: float, retry_after_s: int) -> None:
        super().__init__(
            f"API key '{key_name}' is over its limit of {rps:g} requests per second; retry later."
        )
        self.retry_after_s = retry_after_s


class TooManyConnections(RouterError):
    retryable = True
    status = 503
    error_type = "unavailable_error"
    code = "too_many_connections"

    def __init__(self, limit: int, retry_after_s: int = 1) -> None:
        super().__init__(f"The router is at its limit of {limit} connections; retry later.")
        self.retry_after_s = retry_after_s


class NoHealthyEndpoint(RouterError):
    retryable = True
    status = 503
    # llama.cpp's server uses this type for its own 503s.
    error_type = "unavailable_error"
    code = "no_healthy_endpoint"

    def __init__(self, model: str, reason: str, retry_after_s: int) -> None:
        super().__init__(f"No replica of model '{model}' can take the request ({reason}).")
        self.model = model
        self.reason = reason
        self.retry_after_s = retry_after_s


class ModelUnavailable(NoHealthyEndpoint):
    """Every replica of the model failed in a way that needs a change; answered at once.

    Not retryable on another endpoint (there is none), but `Retry-After` is
    sent: the scheduler clears the record as soon as a change fixes it.
    """

    retryable = False
    code = "model_unavailable"

    def __init__(self, model: str, reason: str, since_utc: str, retry_after_s: int) -> None:
        super().__init__(model, reason, retry_after_s)
        self.message = (
            f"Model '{model}' is unavailable: {reason} (since {since_utc}). "
            "Requests fail at once until the model is changed (new profile, `caravan scale`) "
            "or a replica passes; `caravan status` shows the same."
        )
        self.args = (self.message,)


class AdapterUnavailable(RouterError):
    """A request's LoRA adapter is held nowhere and could not be loaded; `reason` says why.

    `retryable` when another try may load it (a timeout, an unreachable engine);
    not for what the engine refused (a source with no adapter: vLLM's 404),
    which only a change of the profile fixes. Other models and adapters serve on.
    """

    status = 503
    error_type = "unavailable_error"
    code = "adapter_unavailable"
    param = "model"

    def __init__(
        self, adapter: str, model: str, reason: str, *, retryable: bool, retry_after_s: int
    ) -> None:
        super().__init__(
            f"The LoRA adapter '{adapter}' of model '{model}' could not be loaded: {reason}."
        )
        self.adapter = adapter
        self.reason = reason
        self.retryable = retryable
        self.retry_after_s = retry_after_s


class AdmissionRejected(RouterError):
    retryable = True

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class QueueFull(AdmissionRejected):
    status = 429
    error_type = "rate_limit_error"
    code = "queue_full"

    def __init__(self, model: str, retry_after_s: int) -> None:
        super().__init__(
            f"Model '{model}' is at capacity and its queue is full; retry later.", retry_after_s
        )
        self.model = model


class QueueTimeout(AdmissionRejected):
    status = 503
    error_type = "unavailable_error"
    code = "queue_timeout"

    def __init__(self, model: str, retry_after_s: int, *, cold_start: bool) -> None:
        waited_for = "a first replica to start" if cold_start else "free capacity"
        super().__init__(
            f"Timed out waiting for {waited_for} of model '{model}'; retry later.", retry_after_s
        )
        self.model = model
        self.cold_start = cold_start


class ReplacementTimeout(QueueTimeout):
    """A retry or continuation held for the replacement of a dead replica waited too long."""

    code = "replacement_timeout"

    def __init__(self, model: str, retry_after_s: int) -> None:
        AdmissionRejected.__init__(
            self,
            f"The last replica of model '{model}' failed and no replacement passed its health "
            "check in time; retry later.",
            retry_after_s,
        )
        self.model = model
        self.cold_start = True


class RebuildTimeout(QueueTimeout):
    """A request held while every replica of its model was out (breaker open, critical, dead)
    waited the whole rebuild bound and no replica came back."""

    code = "rebuild_timeout"

    def __init__(self, model: str, retry_after_s: int, *, waited_s: float) -> None:
        AdmissionRejected.__init__(
            self,
            f"Every replica of model '{model}' was out of rotation (dead, failing or critical) "
            f"and none was rebuilt within {waited_s:.0f} s, the time a rebuild is expected to "
            "take; retry later.",
            retry_after_s,
        )
        self.model = model
        self.cold_start = True


class UpstreamError(RouterError):
    status = 502
    error_type = "server_error"
    code = "upstream_error"

    def __init__(self, endpoint_id: str, detail: str) -> None:
        super().__init__(f"Replica {endpoint_id} failed the request: {detail}")
        self.endpoint_id = endpoint_id


class UpstreamConnectError(UpstreamError):
    # Nothing reached the engine, so another endpoint can safely take the request.
    retryable = True
    code = "upstream_connect_error"


class UpstreamStatusError(UpstreamError):
    code = "upstream_status_error"
    # Statuses that mean "this replica cannot serve now", not "the request is bad".
    RETRYABLE_STATUSES = frozenset({500, 502, 503, 504})

    def __init__(
        self, endpoint_id: str, upstream_status: int, *, engine_message: str | None = None
    ) -> None:
        super().__init__(endpoint_id, f"answered HTTP {upstream_status}")
        self.upstream_status = upstream_status
        # The engine's own error message (bounded, printable), when its body had one:
        # what the client is told if the answer turns out to be about its input.
        self.engine_message = engine_message
        self.retryable = upstream_status in self.RETRYABLE_STATUSES
        self.status = upstream_status if upstream_status in {503, 504} else 502


class AdapterNotHeld(UpstreamError):
    """The replica answered 404 for the request's LoRA adapter: it no longer holds it.

    What the router read said it did (the scheduler's document, or its own
    load), but the adapter was unloaded since (a scheduler pass, another
    router). Nothing reached the client and the replica is healthy: another
    attempt goes to a holder, or has the adapter loaded on demand.
    """

    retryable = True
    status = 503
    code = "adapter_not_held"


class UpstreamProtocolError(UpstreamError):
    code = "upstream_protocol_error"


class UpstreamAborted(UpstreamError):
    # vLLM ends its streams with finish_reason "abort" when it stops: it has stopped
    # working on the request, so another endpoint may take it, or continue it.
    retryable = True
    code = "upstream_aborted"


class UpstreamTimeout(UpstreamError):
    # Not retryable: the engine may still be working on it, and a retry doubles the load.
    status = 504
    code = "upstream_timeout"


class UpstreamFirstByteTimeout(UpstreamTimeout):
    # The engine sent no headers at all: it is hung, and nothing reached the client,
    # so another endpoint may take the request (the hung one is counted by its breaker).
    retryable = True
    code = "upstream_first_byte_timeout"


class StreamInterrupted(UpstreamError):
    code = "stream_interrupted"


def error_body(error: RouterError) -> dict[str, Any]:
    """The OpenAI-style JSON error body for an error."""
    return {
        "error": {
            "message": error.message,
            "type": error.error_type,
            "param": error.param,
            "code": error.code,
        }
    }


def retry_after_s(error: RouterError) -> int | None:
    """The Retry-After value to send with the error, if it has one."""
    value = getattr(error, "retry_after_s", None)
    return value if isinstance(value, int) else None
