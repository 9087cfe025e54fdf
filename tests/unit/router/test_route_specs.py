"""The router's routes: where each goes on the engine, how its streams end, what it requires."""

from __future__ import annotations

import json

import pytest

from caravan_llm.common.contract import EngineRoute
from caravan_llm.router.edge.routes import (
    ROUTES,
    SseDialect,
    broken_stream_event,
    ends_stream,
    event_type,
    is_openai_error,
    missing_field,
)


@pytest.mark.parametrize(
    ("path", "engine_path"),
    [
        ("/v1/responses", "/v1/responses"),
        ("/v1/messages", "/v1/messages"),
        ("/rerank", "/v1/rerank"),
        ("/v2/rerank", "/v1/rerank"),
        ("/score", "/v1/score"),
        ("/v1/tokenize", "/tokenize"),
        ("/detokenize", "/detokenize"),
    ],
)
def test_client_paths_reach_the_engine_path_of_their_route(path: str, engine_path: str) -> None:
    """Every client spelling of a route goes to the one path engines serve it at."""
    assert engine_path == ROUTES[path].engine_path


def test_every_engine_route_has_a_client_path() -> None:
    """No route an engine can publish is left without a way in."""
    assert set(EngineRoute) == {spec.route for spec in ROUTES.values()}


def test_only_chat_and_completions_streams_are_continued() -> None:
    """Continuation is declared for the two chunk routes and no other."""
    continued = {path for path, spec in ROUTES.items() if spec.continuation is not None}

    assert {"/v1/chat/completions", "/v1/completions"} == continued


def test_event_type_reads_the_event_line_or_the_data_type() -> None:
    """An event's type is its `event:` line, else the `type` in its data."""
    assert "message_stop" == event_type(b'event: message_stop\ndata: {"type":"x"}')
    assert "response.completed" == event_type(b'data: {"type":"response.completed"}')
    assert event_type(b"data: [DONE]") is None


@pytest.mark.parametrize(
    ("dialect", "block", "ended"),
    [
        (SseDialect.RESPONSES, b"event: response.output_text.delta\ndata: {}\n\n", False),
        (
            SseDialect.RESPONSES,
            b"event: a\ndata: {}\n\nevent: response.completed\ndata: {}\n\n",
            True,
        ),
        (SseDialect.RESPONSES, b"event: response.incomplete\ndata: {}\n\n", True),
        (SseDialect.ANTHROPIC, b"event: message_delta\ndata: {}\n\n", False),
        (SseDialect.ANTHROPIC, b"event: message_stop\ndata: {}\n\n", True),
        (SseDialect.ANTHROPIC, b"event: error\ndata: {}\n\n", True),
    ],
)
def test_a_relayed_stream_ends_with_its_dialects_last_event(
    dialect: SseDialect, block: bytes, ended: bool
) -> None:
    """response.completed/incomplete and message_stop (or an error event) end a relayed stream."""
    assert ended == ends_stream(dialect, block)


def test_broken_stream_events_speak_the_routes_dialect() -> None:
    """The closing error event is Anthropic's for messages and the Responses API's otherwise."""
    anthropic = broken_stream_event(SseDialect.ANTHROPIC, "engine died")
    responses = broken_stream_event(SseDialect.RESPONSES, "engine died")

    def data(event: bytes) -> dict[str, object]:
        return dict(json.loads(event.split(b"data: ", 1)[1]))

    assert {"type": "api_error", "message": "engine died"} == data(anthropic)["error"]
    assert ("error", "engine died") == (data(responses)["type"], data(responses)["message"])
    assert anthropic.startswith(b"event: error\n")
    assert anthropic.endswith(b"\n\n")


@pytest.mark.parametrize(
    ("body", "shaped"),
    [
        (b'{"error":{"message":"The model `x` does not exist.","code":404}}', True),
        (b'{"detail":"Not Found"}', False),
        (b'{"error":"Unauthorized"}', False),
        (b"File Not Found", False),
    ],
)
def test_openai_shaped_errors_are_told_from_framework_ones(body: bytes, shaped: bool) -> None:
    """Only `{"error": {"message": ...}}` is OpenAI's shape."""
    assert shaped == is_openai_error(body)


def test_messages_route_requires_messages() -> None:
    """/v1/messages names `messages` when the body lacks it; chat names nothing."""
    assert "messages" == missing_field(ROUTES["/v1/messages"], {"model": "m"})
    assert missing_field(ROUTES["/v1/chat/completions"], {"model": "m"}) is None
