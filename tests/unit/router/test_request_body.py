"""The request body checks: nesting depth without recursion, strict JSON, field types."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fuzz_strategies import fuzz_settings
from hypothesis import given
from hypothesis import strategies as st

from caravan_llm.router.core.errors import InvalidField, InvalidRequest
from caravan_llm.router.edge.request_body import json_depth, parse_json_object, validate_body

_text = st.text(alphabet=st.sampled_from('ab[]{}"\\\n\u00e9'), max_size=6)
_json = st.recursive(
    st.none() | st.booleans() | st.integers() | _text,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(_text, children, max_size=3),
    max_leaves=30,
)


def _depth(value: Any) -> int:
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    return 0


@pytest.mark.fuzz
@fuzz_settings(2.5)
@given(_json)
def test_depth_matches_the_parsed_value_and_ignores_brackets_in_strings(value: Any) -> None:
    """With a limit below the bracket count, json_depth is the parsed value's exact depth."""
    body = json.dumps(value).encode()
    assert _depth(value) == json_depth(body, 0)


@pytest.mark.fuzz
@fuzz_settings(2.5)
@given(_json, st.integers(min_value=0, max_value=40))
def test_depth_is_never_reported_within_the_limit_when_it_exceeds_it(
    value: Any, limit: int
) -> None:
    """Whatever the limit, a body deeper than it is reported deeper than it."""
    body = json.dumps(value, ensure_ascii=False).encode()
    assert (_depth(value) > limit) == (json_depth(body, limit) > limit)


def test_depth_1000_is_refused_before_parsing_with_a_message_naming_the_limit() -> None:
    """A 2 KB body nested 1000 deep is an InvalidRequest naming the limit, not a RecursionError."""
    body = b'{"model":"m","messages":' + b"[" * 1000 + b"]" * 1000 + b"}"
    with pytest.raises(InvalidRequest) as caught:
        parse_json_object(body, 64)
    assert "nested deeper than the router's limit of 64 levels" in caught.value.message


def test_depth_far_beyond_the_recursion_limit_is_refused() -> None:
    """Depth 100000 (unbalanced, as an attacker sends it) is refused the same way."""
    with pytest.raises(InvalidRequest, match="nested deeper"):
        parse_json_object(b"[" * 100_000, 64)


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        (b"", "empty"),
        (b"\xff\xfe{}", "UTF-8"),
        (b'{"model": "m", "x": "\xc3\x28"}', "UTF-8"),
        (b'{"model": "m", "n": NaN}', "NaN"),
        (b'{"model": "m", "n": -Infinity}', "Infinity"),
        (b'{"model": "m", "n": ' + b"9" * 5000 + b"}", "not valid JSON"),
        (b"[1, 2]", "not a JSON array"),
        (b'"text"', "not a JSON string"),
        (b"null", "not a JSON null"),
        (b"{not json", "not valid JSON"),
    ],
)
def test_bodies_that_are_not_a_json_object_are_invalid_requests(body: bytes, fragment: str) -> None:
    """Empty, invalid UTF-8, NaN, huge integers and non-objects are 400s that say why."""
    with pytest.raises(InvalidRequest) as caught:
        parse_json_object(body, 64)
    assert fragment in caught.value.message
    assert 400 == caught.value.status


@pytest.mark.parametrize(
    ("payload", "param"),
    [
        ({"messages": []}, "model"),
        ({"model": 7}, "model"),
        ({"model": ""}, "model"),
        ({"model": ["m"]}, "model"),
        ({"model": "m", "stream": "yes"}, "stream"),
        ({"model": "m", "stream": 1}, "stream"),
        ({"model": "m", "messages": "hi"}, "messages"),
        ({"model": "m", "messages": {"role": "user"}}, "messages"),
        ({"model": "m", "messages": [{"role": "user"}, "hi"]}, "messages[1]"),
    ],
)
def test_wrong_types_of_the_fields_the_router_reads_name_the_field(
    payload: dict[str, Any], param: str
) -> None:
    """`model`, `stream` and `messages` of the wrong type are 400s whose `param` names them."""
    with pytest.raises(InvalidField) as caught:
        validate_body(json.dumps(payload).encode(), max_depth=64)
    assert (400, param) == (caught.value.status, caught.value.param)


def test_a_valid_chat_body_is_returned_parsed() -> None:
    """A well-formed request comes back as its parsed object."""
    payload = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "[{"}]}
    assert payload == validate_body(json.dumps(payload).encode(), max_depth=4)
