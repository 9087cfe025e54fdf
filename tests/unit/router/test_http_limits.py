"""The connection cap rule, the default cap and the raw error responses."""

from __future__ import annotations

import json

import pytest

from caravan_llm.router.core.errors import RequestTimeout, TooManyConnections
from caravan_llm.router.edge.http_limits import (
    AcceptConnection,
    ConnectionView,
    EvictConnection,
    Phase,
    RefuseConnection,
    connection_limit_for,
    decide_connection,
    raw_error_response,
)


def view(key: int, phase: Phase, since: float) -> ConnectionView:
    return ConnectionView(key, phase, since)


def test_below_the_cap_every_connection_is_accepted() -> None:
    """Fewer open connections than the cap: accept."""
    assert AcceptConnection() == decide_connection([view(1, Phase.IN_REQUEST, 0.0)], 2)


def test_at_the_cap_the_connection_idle_longest_makes_room() -> None:
    """An idle keep-alive connection older than every half-open one goes first."""
    views = [
        view(1, Phase.AWAITING_HEADERS, 4.0),
        view(2, Phase.IDLE, 5.0),
        view(3, Phase.IDLE, 3.0),
        view(4, Phase.IN_REQUEST, 0.0),
    ]
    assert EvictConnection(3) == decide_connection(views, 4)


def test_under_a_half_open_flood_active_keep_alive_clients_keep_their_connection() -> None:
    """Half-open connections older than a recently served idle one go before it."""
    views = [
        view(1, Phase.IDLE, 9.0),
        view(2, Phase.AWAITING_HEADERS, 1.0),
        view(3, Phase.AWAITING_HEADERS, 2.0),
    ]
    assert EvictConnection(2) == decide_connection(views, 3)


def test_at_the_cap_the_oldest_half_open_connection_makes_room() -> None:
    """Without idle ones, the connection that has waited longest for its headers goes."""
    views = [
        view(1, Phase.IN_REQUEST, 0.0),
        view(2, Phase.AWAITING_HEADERS, 2.0),
        view(3, Phase.AWAITING_HEADERS, 1.0),
    ]
    assert EvictConnection(3) == decide_connection(views, 3)


def test_when_every_connection_is_in_a_request_the_newcomer_is_refused() -> None:
    """Requests in progress are never cut to make room."""
    views = [view(1, Phase.IN_REQUEST, 0.0), view(2, Phase.IN_REQUEST, 1.0)]
    assert RefuseConnection() == decide_connection(views, 2)


@pytest.mark.parametrize(
    ("descriptors", "cap"),
    [(1024, 480), (256, 96), (100, 18), (10, 16), (10**7, 65536), (-1, 65536)],
)
def test_the_default_cap_leaves_room_for_engine_connections(descriptors: int, cap: int) -> None:
    """Half of the descriptors left after a reserve of 64, within [16, 65536]."""
    assert cap == connection_limit_for(descriptors)


def test_raw_error_responses_are_complete_openai_shaped_http() -> None:
    """The 503 of a refused connection has status, JSON body, length, Retry-After, close."""
    raw = raw_error_response(TooManyConnections(96))
    head, body = raw.split(b"\r\n\r\n", 1)
    lines = head.decode().split("\r\n")
    assert "HTTP/1.1 503 Service Unavailable" == lines[0]
    assert {"Connection: close", "Retry-After: 1", f"Content-Length: {len(body)}"} <= set(lines)
    assert "Server: caravan" in lines
    assert {"message", "type", "param", "code"} == set(json.loads(body)["error"])


def test_a_header_timeout_is_a_408() -> None:
    """The header deadline answers 408 with the timeout in the message."""
    raw = raw_error_response(RequestTimeout("headers", 10.0))
    assert raw.startswith(b"HTTP/1.1 408 Request Timeout\r\n")
    assert b"did not arrive within 10 s" in raw
