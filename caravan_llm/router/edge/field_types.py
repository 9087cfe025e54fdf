"""The JSON types of the request fields each route's public schema defines, checked at the edge.

A body whose `tools` is `true` made llama-server answer 500, which the router
took for the replica's failure (a 502, a breaker count): any client could take
replicas out of rotation with malformed bodies. So the fields of OpenAI's
schema for each route (Anthropic's for `/v1/messages`) are type-checked here,
before any engine sees the request: a wrong type is a 400 whose `param` names
the field (`tools[0].function.name`). Only the types are checked, not the
values an engine judges (a temperature of 7 is the engine's to refuse), and a
field the schema does not define (an engine's own sampling options such as
`top_k`, `min_p`, `ignore_eos`) passes through untouched.

The tables follow the OpenAI API reference (chat, completions, embeddings,
responses) and Anthropic's Messages API reference. `integer` accepts a JSON
number with no fraction (`2.0`), as the engines' validators do. Pure.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from enum import Flag, auto
from typing import Any

from caravan_llm.common.contract import EngineRoute


class J(Flag):
    """The JSON types a field may take."""

    STRING = auto()
    INTEGER = auto()
    NUMBER = auto()
    BOOLEAN = auto()
    ARRAY = auto()
    OBJECT = auto()
    NULL = auto()


_NAMES = {
    J.STRING: "a string",
    J.INTEGER: "an integer",
    J.NUMBER: "a number",
    J.BOOLEAN: "a boolean",
    J.ARRAY: "an array",
    J.OBJECT: "an object",
    J.NULL: "null",
}


def json_type(value: object) -> J:
    """The JSON type of a decoded value (an integral number is both INTEGER and NUMBER)."""
    match value:
        case bool():
            return J.BOOLEAN
        case int():
            return J.INTEGER | J.NUMBER
        case float():
            return J.INTEGER | J.NUMBER if value.is_integer() else J.NUMBER
        case str():
            return J.STRING
        case list():
            return J.ARRAY
        case dict():
            return J.OBJECT
        case _:
            return J.NULL


def _shown(value: object) -> str:
    # Integral numbers are INTEGER | NUMBER, which is not one name: "a number".
    return _NAMES.get(json_type(value), "a number")


def _expected(allowed: J) -> str:
    names = [name for flag, name in _NAMES.items() if flag in allowed]
    if J.INTEGER in allowed and J.NUMBER in allowed:
        names.remove("an integer")
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


# A nested check: (path of the field, its value) -> the problem, or None.
Nested = Callable[[str, Any], "tuple[str, str] | None"]


def _type_problem(path: str, value: object, allowed: J) -> tuple[str, str] | None:
    if json_type(value) & allowed:
        return None
    return path, f"`{path}` must be {_expected(allowed)}, not {_shown(value)}."


def _items(allowed: J, each: Nested | None = None) -> Nested:
    """An array whose items are of `allowed` types (and pass `each`)."""

    def check(path: str, value: Any) -> tuple[str, str] | None:
        if not isinstance(value, list):
            return None
        for index, item in enumerate(value):
            where = f"{path}[{index}]"
            problem = _type_problem(where, item, allowed)
            if problem is None and each is not None:
                problem = each(where, item)
            if problem is not None:
                return problem
        return None

    return check


def _fields(table: Mapping[str, tuple[J, Nested | None]]) -> Nested:
    """An object whose named fields (where present) have these types."""

    def check(path: str, value: Any) -> tuple[str, str] | None:
        if not isinstance(value, dict):
            return None
        for name, (allowed, nested) in table.items():
            if name not in value:
                continue
            where = f"{path}.{name}" if path else name
            problem = _type_problem(where, value[name], allowed)
            if problem is None and nested is not None:
                problem = nested(where, value[name])
            if problem is not None:
                return problem
        return None

    return check


_S = J.STRING
_I = J.INTEGER
_N = J.NUMBER | J.INTEGER
_B = J.BOOLEAN
_A = J.ARRAY
_O = J.OBJECT
_NULL = J.NULL

_CONTENT = _S | _A | _NULL
_STOP = (_S | _A | _NULL, _items(_S))

_CHAT_MESSAGE = _fields(
    {
        "role": (_S, None),
        "content": (_CONTENT, _items(_O | _S)),
        "name": (_S, None),
        "tool_calls": (_A | _NULL, _items(_O)),
        "tool_call_id": (_S, None),
    }
)
_FUNCTION = _fields({"name": (_S, None), "description": (_S, None), "parameters": (_O, None)})
_CHAT_TOOL = _fields({"type": (_S, None), "function": (_O, _FUNCTION)})

_SAMPLING: dict[str, tuple[J, Nested | None]] = {
    "frequency_penalty": (_N | _NULL, None),
    "presence_penalty": (_N | _NULL, None),
    "logit_bias": (_O | _NULL, None),
    "max_tokens": (_I | _NULL, None),
    "n": (_I | _NULL, None),
    "seed": (_I | _NULL, None),
    "stop": _STOP,
    "stream_options": (_O | _NULL, None),
    "temperature": (_N | _NULL, None),
    "top_p": (_N | _NULL, None),
    "user": (_S, None),
}

_CHAT = _fields(
    {
        **_SAMPLING,
        "messages": (_A, _items(_O, _CHAT_MESSAGE)),
        "logprobs": (_B | _NULL, None),
        "top_logprobs": (_I | _NULL, None),
        "max_completion_tokens": (_I | _NULL, None),
        "response_format": (_O, None),
        "tools": (_A, _items(_O, _CHAT_TOOL)),
        "tool_choice": (_S | _O, None),
        "parallel_tool_calls": (_B, None),
        "functions": (_A, _items(_O, _FUNCTION)),
        "function_call": (_S | _O, None),
        "metadata": (_O | _NULL, None),
        "store": (_B | _NULL, None),
        "modalities": (_A | _NULL, _items(_S)),
        "reasoning_effort": (_S | _NULL, None),
        "service_tier": (_S | _NULL, None),
    }
)

_COMPLETIONS = _fields(
    {
        **_SAMPLING,
        "prompt": (_S | _A, _items(_S | _I | _A)),
        "best_of": (_I | _NULL, None),
        "echo": (_B | _NULL, None),
        "logprobs": (_I | _NULL, None),
        "suffix": (_S | _NULL, None),
    }
)

_EMBEDDINGS = _fields(
    {
        "input": (_S | _A, _items(_S | _I | _A)),
        "encoding_format": (_S, None),
        "dimensions": (_I, None),
        "user": (_S, None),
    }
)

_RESPONSES = _fields(
    {
        "input": (_S | _A, _items(_O | _S)),
        "instructions": (_S | _NULL, None),
        "max_output_tokens": (_I | _NULL, None),
        "temperature": (_N | _NULL, None),
        "top_p": (_N | _NULL, None),
        "tools": (_A, _items(_O, _fields({"type": (_S, None)}))),
        "tool_choice": (_S | _O, None),
        "parallel_tool_calls": (_B | _NULL, None),
        "previous_response_id": (_S | _NULL, None),
        "store": (_B | _NULL, None),
        "background": (_B | _NULL, None),
        "metadata": (_O | _NULL, None),
        "text": (_O, None),
        "reasoning": (_O | _NULL, None),
        "include": (_A | _NULL, _items(_S)),
        "truncation": (_S | _NULL, None),
        "user": (_S, None),
    }
)

_ANTHROPIC_MESSAGE = _fields({"role": (_S, None), "content": (_S | _A, _items(_O))})
_ANTHROPIC_TOOL = _fields(
    {"name": (_S, None), "description": (_S, None), "input_schema": (_O, None)}
)
_ANTHROPIC: dict[str, tuple[J, Nested | None]] = {
    "messages": (_A, _items(_O, _ANTHROPIC_MESSAGE)),
    "system": (_S | _A, _items(_O)),
    "tools": (_A, _items(_O, _ANTHROPIC_TOOL)),
    "tool_choice": (_O, None),
    "metadata": (_O, None),
}
_MESSAGES = _fields(
    {
        **_ANTHROPIC,
        "max_tokens": (_I, None),
        "stop_sequences": (_A, _items(_S)),
        "temperature": (_N, None),
        "top_p": (_N, None),
        "top_k": (_I, None),
    }
)

_BY_ROUTE: Mapping[EngineRoute, Nested] = {
    EngineRoute.CHAT_COMPLETIONS: _CHAT,
    EngineRoute.COMPLETIONS: _COMPLETIONS,
    EngineRoute.EMBEDDINGS: _EMBEDDINGS,
    EngineRoute.RESPONSES: _RESPONSES,
    EngineRoute.MESSAGES: _MESSAGES,
    EngineRoute.MESSAGES_COUNT_TOKENS: _fields(_ANTHROPIC),
}


def field_problem(route: EngineRoute, payload: Mapping[str, Any]) -> tuple[str, str] | None:
    """The first field of `payload` whose JSON type the route's schema does not allow.

    Returns (param, message) for a 400, or None. Routes without a table here
    (tokenize, rerank, score, ...: engine-specific schemas) are not checked.
    """
    check = _BY_ROUTE.get(route)
    if check is None:
        return None
    return check("", dict(payload))
