"""Fuzzing the router's request-body parse path: any bytes are a 4xx or a checked payload."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fuzz_strategies import (
    fuzz_settings,
    header_values,
    hostile_json,
    json_values,
    outcome,
    request_bodies,
)
from hypothesis import example, given
from hypothesis import strategies as st

from caravan_llm.common.contract import OPENAI_STREAM_TRAITS, EngineRoute
from caravan_llm.router.core.affinity import affinity_key
from caravan_llm.router.core.errors import InvalidRequest
from caravan_llm.router.core.prefix_index import ShapeConfig, prompt_shape
from caravan_llm.router.edge.continuation import (
    StreamAccount,
    StreamKind,
    Unfaithful,
    build_continuation,
    request_blocker,
)
from caravan_llm.router.edge.field_types import field_problem
from caravan_llm.router.edge.request_body import validate_body
from caravan_llm.router.edge.request_guard import parse_priority
from caravan_llm.router.edge.routes import ROUTES, missing_field

pytestmark = pytest.mark.fuzz

MAX_DEPTH = 64


def parsed_or_refused(body: bytes) -> dict[str, Any] | None:
    """The checked payload, or None when validate_body refused it with a 4xx naming why."""
    payload, refused = outcome(lambda: validate_body(body, max_depth=MAX_DEPTH), InvalidRequest)
    if payload is None:
        assert refused is not None
        assert 400 <= refused.status < 500
        assert refused.message
        return None
    assert isinstance(payload["model"], str)
    assert payload["model"]
    assert payload.get("stream") is None or isinstance(payload["stream"], bool)
    return payload


def read_everything(payload: dict[str, Any]) -> None:
    """Every reader of a checked payload, as the proxy calls them: none may raise."""
    for spec in ROUTES.values():
        missing_field(spec, payload)
        problem = field_problem(spec.route, payload)
        assert problem is None or (problem[0] and problem[1].startswith("`"))
        responses = spec.route is EngineRoute.RESPONSES
        key = affinity_key(payload, 256, responses=responses)
        assert key is None or isinstance(key, int)
        prompt_shape(payload, ShapeConfig(), responses=responses)
    for kind in StreamKind:
        request_blocker(payload, kind)
        account = StreamAccount(kind, text_parts=["partial"], content_chunks=1)
        continued = build_continuation(payload, account, OPENAI_STREAM_TRAITS)
        if not isinstance(continued, Unfaithful):
            json.dumps(continued)


@fuzz_settings()
@given(hostile_json())
@example(b'{"model": "m", "n": ' + b"9" * 5000 + b"}")
@example(b'\xef\xbb\xbf{"model": "m"}')
@example(b'{"model": "m", "model": 7}')
@example(b'{"model": "m", "max_tokens": 1e400}')
@example(b'{"model": "m", "messages": [' + b"[" * 3000 + b"]}")
@example(b'{"model": "m", "x": "\\ud800"}')
def test_any_bytes_are_refused_with_a_4xx_or_parse_to_a_checked_payload(body: bytes) -> None:
    """Hostile JSON (huge numbers, NaN, BOMs, bad UTF-8, depth): a 4xx or a checked object."""
    payload = parsed_or_refused(body)
    if payload is not None:
        read_everything(payload)


@fuzz_settings()
@given(request_bodies())
@example({"model": "tiny", "messages": [{"role": []}]})
def test_wrong_types_in_every_field_the_router_reads_never_raise(body: dict[str, Any]) -> None:
    """A body whose every known field may take any JSON type is refused or read without error."""
    # NaN and Infinity, when drawn, are written as Python writes them: refused as not JSON.
    raw = json.dumps(body).encode("utf-8", "surrogatepass")
    payload = parsed_or_refused(raw)
    if payload is not None:
        read_everything(payload)


@fuzz_settings(0.5)
@given(st.dictionaries(st.sampled_from(["model", "stream", "messages"]), json_values, max_size=3))
def test_the_three_fields_the_guard_reads_are_typed_or_refused(body: dict[str, Any]) -> None:
    """`model`, `stream` and `messages` of any type: a 4xx, or the types the guard promises."""
    payload = parsed_or_refused(json.dumps(body).encode("utf-8", "surrogatepass"))
    if payload is not None and "messages" in payload:
        assert isinstance(payload["messages"], list)
        assert all(isinstance(message, dict) for message in payload["messages"])


@fuzz_settings()
@given(header_values)
@example("-99999999999999999999")
@example("\u0661\u0662")
def test_any_priority_header_is_an_integer_or_a_400(raw: str) -> None:
    """`x-caravan-priority` parses to an int or raises InvalidRequest (400)."""
    value, refused = outcome(lambda: parse_priority(raw), InvalidRequest)
    if refused is not None:
        assert 400 == refused.status
    else:
        assert value is None or isinstance(value, int)
