"""Request fields of each route's public schema are type-checked before any engine sees them."""

from __future__ import annotations

from typing import Any

import pytest
from fuzz_strategies import fuzz_settings
from hypothesis import given
from hypothesis import strategies as st

from caravan_llm.common.contract import EngineRoute
from caravan_llm.router.edge.field_types import field_problem

CHAT = EngineRoute.CHAT_COMPLETIONS
MESSAGES = [{"role": "user", "content": "hi"}]


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": MESSAGES, **fields}


@pytest.mark.parametrize("tools", [True, 0, {"a": [None]}, "get_weather"])
def test_tools_that_are_not_an_array_are_the_clients_fault(tools: object) -> None:
    """The bodies that made llama-server answer 500 are a 400 naming `tools`."""
    problem = field_problem(CHAT, chat(tools=tools))

    assert problem is not None
    assert "tools" == problem[0]
    assert problem[1].startswith("`tools` must be an array, not ")


def test_a_nested_field_is_named_by_its_path() -> None:
    """A tool whose function name is a number names tools[1].function.name."""
    tools = [
        {"type": "function", "function": {"name": "ok"}},
        {"type": "function", "function": {"name": 7}},
    ]

    assert (
        "tools[1].function.name",
        "`tools[1].function.name` must be a string, not a number.",
    ) == field_problem(CHAT, chat(tools=tools))


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"temperature": "hot"}, "temperature"),
        ({"stop": 3}, "stop"),
        ({"stop": ["a", 1]}, "stop[1]"),
        ({"messages": [{"role": 1, "content": "x"}]}, "messages[0].role"),
        ({"logprobs": "yes"}, "logprobs"),
        ({"response_format": "json"}, "response_format"),
    ],
)
def test_wrong_types_in_chat_fields(fields: dict[str, Any], param: str) -> None:
    """Each wrong type is refused with the field's path."""
    problem = field_problem(CHAT, chat(**fields))

    assert problem is not None
    assert param == problem[0]


def test_right_types_unknown_fields_and_nulls_pass() -> None:
    """Integral floats, nulls where the schema allows them and engine-only fields pass."""
    body = chat(
        max_tokens=16.0,
        temperature=0,
        seed=None,
        stop=None,
        top_k=40,
        min_p="engine decides",
        ignore_eos=True,
        tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
        tool_choice="auto",
    )

    assert field_problem(CHAT, body) is None


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        (EngineRoute.COMPLETIONS, {"model": "m", "prompt": 5}, "prompt"),
        (EngineRoute.COMPLETIONS, {"model": "m", "prompt": "x", "echo": 1}, "echo"),
        (EngineRoute.EMBEDDINGS, {"model": "m", "input": {"a": 1}}, "input"),
        (EngineRoute.RESPONSES, {"model": "m", "input": 3}, "input"),
        (
            EngineRoute.RESPONSES,
            {"model": "m", "input": "x", "tools": [{"type": 1}]},
            "tools[0].type",
        ),
        (EngineRoute.MESSAGES, {"model": "m", "messages": MESSAGES, "system": 1}, "system"),
        (
            EngineRoute.MESSAGES,
            {"model": "m", "messages": MESSAGES, "max_tokens": "9"},
            "max_tokens",
        ),
        (
            EngineRoute.MESSAGES_COUNT_TOKENS,
            {"model": "m", "messages": [{"role": []}]},
            "messages[0].role",
        ),
    ],
)
def test_every_schema_route_checks_its_fields(
    route: EngineRoute, body: dict[str, Any], param: str
) -> None:
    """Completions, embeddings, responses and Anthropic's routes check their own fields."""
    problem = field_problem(route, body)

    assert problem is not None
    assert param == problem[0]


def test_routes_without_a_public_schema_are_not_checked() -> None:
    """Tokenize, rerank and score take engine-specific bodies: nothing is refused here."""
    assert field_problem(EngineRoute.TOKENIZE, {"model": "m", "tools": True}) is None


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=20,
)
FIELDS = st.sampled_from(
    ["messages", "tools", "stop", "input", "prompt", "system", "max_tokens", "tool_choice", "x"]
)


@pytest.mark.fuzz
@fuzz_settings(7.5)
@given(route=st.sampled_from(list(EngineRoute)), body=st.dictionaries(FIELDS, JSON, max_size=5))
def test_any_json_body_gets_an_answer_never_an_exception(
    route: EngineRoute, body: dict[str, Any]
) -> None:
    """Whatever JSON a client sends, the check returns None or a (param, message) pair."""
    problem = field_problem(route, body)

    assert problem is None or (isinstance(problem[0], str) and problem[1].startswith("`"))
