"""Router errors: status, retryability and the OpenAI-style body they render to."""

from __future__ import annotations

import json

import pytest

from caravan_llm.router.core.errors import (
    HeadersTooLarge,
    InvalidField,
    InvalidRequest,
    MethodNotAllowed,
    ModelNotFound,
    NoHealthyEndpoint,
    QueueFull,
    QueueTimeout,
    RateLimited,
    RequestTimeout,
    RouteNotFound,
    RouterError,
    TooManyConnections,
    TooManyHeaders,
    UpstreamConnectError,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamStatusError,
    UpstreamTimeout,
    error_body,
    retry_after_s,
)


def test_model_not_found_renders_openai_body() -> None:
    """An unknown model renders OpenAI's own shape and code, with param null."""
    body = error_body(ModelNotFound("gpt-9"))

    assert body == {
        "error": {
            "message": "The model 'gpt-9' does not exist or has no replicas declared.",
            "type": "invalid_request_error",
            "param": None,
            "code": "model_not_found",
        }
    }
    assert json.loads(json.dumps(body)) == body


@pytest.mark.parametrize(
    ("error", "status", "retryable", "retry_after"),
    [
        (InvalidRequest("body is not JSON"), 400, False, None),
        (ModelNotFound("m"), 404, False, None),
        (NoHealthyEndpoint("m", "none_healthy", 2), 503, True, 2),
        (QueueFull("m", 1), 429, True, 1),
        (QueueTimeout("m", 10, cold_start=True), 503, True, 10),
        (UpstreamConnectError("ep-1", "connection refused"), 502, True, None),
        (UpstreamProtocolError("ep-1", "bad chunk"), 502, False, None),
        (UpstreamTimeout("ep-1", "no response in 60s"), 504, False, None),
        (UpstreamStatusError("ep-1", 503), 503, True, None),
        (UpstreamStatusError("ep-1", 500), 502, True, None),
        (UpstreamStatusError("ep-1", 404), 502, False, None),
        (InvalidField("stream", "`stream` must be a boolean"), 400, False, None),
        (RouteNotFound("/nope"), 404, False, None),
        (MethodNotAllowed("GET", "POST"), 405, False, None),
        (RequestTimeout("body", 30.0), 408, False, None),
        (RateLimited("batch", 2.0, 3), 429, True, 3),
        (HeadersTooLarge(8190), 431, False, None),
        (TooManyHeaders(), 431, False, None),
        (TooManyConnections(480), 503, True, 1),
    ],
)
def test_each_error_knows_status_retryability_and_retry_after(
    error: RouterError, status: int, retryable: bool, retry_after: int | None
) -> None:
    """Every error carries the HTTP status, whether a retry may help, and any Retry-After."""
    assert (status, retryable, retry_after) == (error.status, error.retryable, retry_after_s(error))


def test_upstream_errors_share_a_base_and_name_the_endpoint() -> None:
    """The proxy can catch every engine failure at once, and the message names the replica."""
    error = UpstreamStatusError("ep-7", 500)

    assert isinstance(error, UpstreamError)
    assert "ep-7" in error_body(error)["error"]["message"]
    assert error_body(error)["error"]["code"] == "upstream_status_error"


def test_a_field_error_names_the_field_in_param() -> None:
    """InvalidField renders OpenAI's `param` with the field's name."""
    body = error_body(InvalidField("messages[1]", "`messages[1]` must be an object"))
    assert ("messages[1]", "invalid_request") == (body["error"]["param"], body["error"]["code"])


def test_a_client_path_is_cut_in_the_404_message() -> None:
    """A 10 KB path does not come back whole in the error."""
    assert len(RouteNotFound("/" + "a" * 10_000).message) < 300
