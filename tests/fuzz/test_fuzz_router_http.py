"""Fuzzing a running router over HTTP: hostile bodies are OpenAI 4xx, engine garbage is no crash."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from fuzz_strategies import (
    fuzz_settings,
    header_values,
    hostile_json,
    request_bodies,
    sse_streams,
)
from hypothesis import HealthCheck, example, given
from hypothesis import strategies as st
from live_router import MODEL, Answer, LiveRouter, live_router

pytestmark = [pytest.mark.fuzz, pytest.mark.slow]

PATHS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/responses",
    "/v1/messages",
    "/tokenize",
)
# A shared router across examples is the point: it must survive all of them.
SHARED = HealthCheck.function_scoped_fixture


# The two policies that read the prompt out of the body: the cost model's prompt
# shape (the default) and prefix affinity's key.
@pytest.fixture(scope="module", params=["predicted_ttft", "prefix_affinity"])
def router(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveRouter]:
    with live_router(tmp_path_factory.mktemp("live-router"), request.param) as running:
        yield running


def assert_openai_error(answer: Answer) -> None:
    """A refusal in OpenAI's shape: {"error": {"message": str, "type": str, ...}}."""
    error = answer.json()["error"]
    assert isinstance(error["message"], str)
    assert error["message"]
    assert isinstance(error["type"], str)


def assert_clean(router: LiveRouter) -> None:
    assert [] == router.new_log_problems()


@fuzz_settings(0.3, suppress_health_check=[SHARED])
@given(body=hostile_json(), path=st.sampled_from(PATHS))
@example(body=b'{"model": "tiny", "n": ' + b"9" * 5000 + b"}", path=PATHS[0])
@example(body=b'\xef\xbb\xbf{"model": "tiny", "messages": []}', path=PATHS[0])
@example(body=b'{"model": "tiny", "messages": [], "messages": 7}', path=PATHS[0])
@example(body=b'{"model": "tiny", "max_tokens": 1e400, "messages": []}', path=PATHS[0])
@example(body=b"[" * 100_000, path=PATHS[1])
def test_hostile_json_is_an_openai_4xx_never_a_5xx(
    router: LiveRouter, body: bytes, path: str
) -> None:
    """Hostile JSON text at any route: 2xx from the engine or an OpenAI-shaped 4xx, no traceback."""
    answer = router.send(path, body)

    assert answer.status < 500, answer.body[:300]
    if answer.status >= 400:
        assert_openai_error(answer)
    assert_clean(router)


def _body_for(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode("utf-8", "surrogatepass")


@fuzz_settings(0.3, suppress_health_check=[SHARED])
@given(body=request_bodies(), path=st.sampled_from(PATHS), priority=st.none() | header_values)
@example(body={"model": MODEL, "messages": [], "tools": True}, path=PATHS[0], priority=None)
@example(body={"model": MODEL, "messages": [{"role": []}]}, path=PATHS[0], priority=None)
@example(body={"model": MODEL, "prompt": "x", "stream": True, "n": 2}, path=PATHS[1], priority="1")
def test_wrong_types_in_every_field_are_an_openai_4xx_never_a_5xx(
    router: LiveRouter, body: dict[str, Any], path: str, priority: str | None
) -> None:
    """Any type in any field the router reads, and any priority header: never a 5xx or traceback."""
    headers = {} if priority is None else {"x-caravan-priority": priority}
    answer = router.send(path, _body_for(body), headers)

    assert answer.status < 500, answer.body[:300]
    if answer.status >= 400:
        assert_openai_error(answer)
    assert_clean(router)


@fuzz_settings(0.3, suppress_health_check=[SHARED])
@given(stream=sse_streams(), cuts=st.lists(st.integers(min_value=0), max_size=8))
@example(stream=b"data: " + b"[" * 5000 + b"\n\n", cuts=[])
@example(stream=b'data: {"choices": [{"index": 0, "delta": {"content": "a"}}]}\n\n', cuts=[])
def test_whatever_the_engine_streams_the_relay_ends_cleanly(
    router: LiveRouter, stream: bytes, cuts: list[int]
) -> None:
    """Any engine stream, cut anywhere: a well-formed answer, no traceback, nothing in flight."""
    router.set_stream(stream, tuple(cuts))
    body = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    answer = router.send(PATHS[0], _body_for(body))

    if answer.status == 200:
        # Only whole events reach the client, and the stream ends: `[DONE]`, or an error event.
        assert answer.body.endswith(b"\n\n") or not answer.body
    else:
        assert_openai_error(answer)
    assert_clean(router)
    router.settle()
