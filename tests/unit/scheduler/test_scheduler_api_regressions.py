"""Inputs Schemathesis found answered with a 5xx, a traceback or an undocumented answer (issue 26).

Each is refused before the model service is reached, so the app here has
none; tests/security/test_scheduler_api_schemathesis.py finds such inputs.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any, cast

import aiohttp
import pytest
from aiohttp.http_exceptions import BadHttpMessage
from aiohttp.test_utils import TestServer
from prometheus_client import CollectorRegistry

from caravan_llm.scheduler.api import ApiAuth, ServerLog, create_api
from caravan_llm.scheduler.api_auth import StaticTokens, TokenSet
from caravan_llm.scheduler.metrics import SchedulerMetrics
from caravan_llm.scheduler.model_service import ModelService
from caravan_llm.scheduler.profile_policy import ProfilePolicy, document_policy_problems

TOKEN = "t" * 24 + "-regression-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
async def base() -> AsyncIterator[str]:
    registry = CollectorRegistry()
    auth = ApiAuth(
        StaticTokens(TokenSet.of([TOKEN])), SchedulerMetrics.create(registry).api_auth_failures
    )
    app = create_api(cast("ModelService", object()), registry, lambda: True, auth=auth)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        yield str(server.make_url("")).rstrip("/")
    finally:
        await server.close()


async def call(method: str, url: str, **kwargs: Any) -> tuple[int, dict[str, Any], Any]:
    async with (
        aiohttp.ClientSession() as session,
        session.request(method, url, **kwargs) as response,
    ):
        return response.status, dict(response.headers), await response.json()


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("GET", "/v1/models/%C2%84", None),
        ("DELETE", "/v1/models/%C2%84", None),
        ("GET", "/v1/models/%C2%84/history", None),
        ("POST", "/v1/models/%C2%84/scale", {"replicas": 2}),
        ("POST", "/v1/models/%C2%84/revert", {"version": 0}),
        ("GET", "/v1/models/Upper", None),
        ("GET", "/v1/models/" + "a" * 41, None),
    ],
)
async def test_a_name_that_cannot_be_a_model_is_404_not_a_consul_502(
    base: str, method: str, path: str, body: Any
):
    """A {name} Consul would refuse as a key (it answered 502) is no model: 404, Consul unasked."""
    status, _, answer = await call(method, base + path, json=body, headers=AUTH)
    assert (404, "not_found") == (status, answer["error"]["type"])


async def test_a_profile_that_is_not_utf8_is_a_400_naming_the_byte(base: str):
    """A PUT body that is not UTF-8 (it answered 500, a traceback) is refused naming the byte."""
    status, _, answer = await call(
        "PUT",
        f"{base}/v1/models/tiny-chat",
        data=b"M\xe9q",
        headers={"Content-Type": "application/json", **AUTH},
    )
    assert (400, "invalid_profile") == (status, answer["error"]["type"])
    assert ["PUT /v1/models/tiny-chat: not UTF-8 text (byte 0xe9 at offset 1)"] == answer["error"][
        "problems"
    ]


@pytest.mark.parametrize("path", ["/v1/models", "/v1/plan", "/v1/models/tiny-chat/scale"])
async def test_a_body_type_the_route_does_not_read_is_415(base: str, path: str):
    """A JSON route given form data is told to send JSON (it read the body as JSON anyway)."""
    form = {"Content-Type": "application/x-www-form-urlencoded", **AUTH}
    status, _, answer = await call("POST", base + path, data="documents=x", headers=form)
    assert (415, "unsupported_media_type") == (status, answer["error"]["type"])


@pytest.mark.parametrize("headers", [{}, AUTH])
async def test_a_method_no_route_has_is_405_json_with_allow(base: str, headers: dict[str, str]):
    """TRACE /health was 401 without a token and plain text with one; it is a JSON 405."""
    status, response_headers, answer = await call("TRACE", f"{base}/health", headers=headers)
    assert (405, "method_not_allowed") == (status, answer["error"]["type"])
    assert "GET" == response_headers["Allow"]


async def test_an_unknown_path_is_a_json_404(base: str):
    """A path no route has is a 404 in the API's error shape, not aiohttp's text."""
    status, _, answer = await call("GET", f"{base}/v2/nothing", headers=AUTH)
    assert (404, "not_found") == (status, answer["error"]["type"])


def test_an_engine_that_is_not_a_string_is_the_schemas_problem_not_a_500():
    """`engine: {}` made the policy check raise TypeError (unhashable), a 500; it is skipped."""
    document = {"name": "x", "engine": {"a": [None]}, "engine_args": ["--x"]}
    assert [] == document_policy_problems(document, ProfilePolicy())


def test_a_request_aiohttp_cannot_parse_is_logged_at_debug_without_a_traceback(
    caplog: pytest.LogCaptureFixture,
):
    """A NUL in a header is the client's error: no error record and no traceback in the log."""
    log = ServerLog(logging.getLogger("test.server"))
    with caplog.at_level(logging.DEBUG, logger="test.server"):
        # As aiohttp calls it: .exception() with the error, outside an except block.
        malformed = BadHttpMessage("Invalid header value char")
        log.exception("Error handling request", exc_info=malformed)  # noqa: LOG004
        log.exception("Error handling request", exc_info=RuntimeError("a bug"))  # noqa: LOG004
    levels = [(r.levelno, r.getMessage(), r.exc_info is not None) for r in caplog.records]
    assert [
        (logging.DEBUG, "scheduler_api_request_malformed", False),
        (logging.ERROR, "Error handling request", True),
    ] == levels
