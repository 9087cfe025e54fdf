"""Pure checks of a request body before anything parses it recursively.

`json.loads` recurses once per nesting level, so a 2 KB body of `[[[[...`
reaches Python's recursion limit (a `RecursionError` deep in the decoder),
and anything that walks the parsed value later (affinity, continuation
building, `json.dumps`) recurses just as deep. `json_depth` measures the
nesting without recursing, and at C speed:

1. when the body has fewer `[` and `{` bytes than the limit, no value in it
   can be nested deeper (the common case: one `bytes.count` each);
2. otherwise the JSON strings are cut out (escaped backslashes and escaped
   quotes removed first, then every other piece between quotes dropped), so
   brackets inside prompts do not count; the remaining brackets are mapped
   to +1 / -1 and the running sum's maximum is the depth. Every step is a C
   loop over the bytes: about as fast as `json.loads` itself.

`validate_body` then parses the body (strict JSON: no NaN or Infinity) and
checks the types of the fields the router itself reads (`model`, `stream`,
`messages`), so a wrong type is a 400 naming the field, never a surprise
further down. Everything raises `InvalidRequest`/`InvalidField`.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

from caravan_llm.router.core.errors import InvalidField, InvalidRequest

_STEP = [0] * 256
_STEP[ord("[")] = _STEP[ord("{")] = 1
_STEP[ord("]")] = _STEP[ord("}")] = -1
# Everything but the four brackets, removed by bytes.translate.
_NOT_BRACKETS = bytes(byte for byte in range(256) if _STEP[byte] == 0)


def json_depth(body: bytes, limit: int) -> int:
    """The nesting depth of the JSON text `body`, or a bound <= `limit` on it.

    Exact whenever the body has more than `limit` brackets; brackets inside
    strings do not count.
    """
    if body.count(b"[") + body.count(b"{") <= limit:
        return min(limit, body.count(b"[") + body.count(b"{"))
    # In valid JSON a backslash only appears inside strings, as an escape: drop
    # escaped backslashes first, so `\\"` ends its string and `\"` does not.
    unescaped = body.replace(b"\\\\", b"").replace(b'\\"', b"")
    outside_strings = b"".join(unescaped.split(b'"')[::2])
    brackets = outside_strings.translate(None, _NOT_BRACKETS)
    return max(itertools.accumulate(map(_STEP.__getitem__, brackets)), default=0)


def _reject_constant(name: str) -> float:
    raise InvalidRequest(f"The request body is not valid JSON: {name} is not a JSON number.")


def parse_json_object(body: bytes, max_depth: int) -> dict[str, Any]:
    """The body as a JSON object, or InvalidRequest saying what is wrong with it."""
    if not body:
        raise InvalidRequest("The request body is empty; send a JSON object.")
    if json_depth(body, max_depth) > max_depth:
        raise InvalidRequest(
            f"The request body is JSON nested deeper than the router's limit of {max_depth} levels."
        )
    try:
        # UTF-8 only (RFC 8259): json.loads would also guess UTF-16 and UTF-32.
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidRequest("The request body is not valid UTF-8.") from None
    try:
        payload = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:  # pragma: no cover - json_depth bounds the depth first
        raise InvalidRequest("The request body is JSON nested too deeply.") from None
    except ValueError as exc:
        # Also digit strings over Python's int limit (4300 digits), as ValueError.
        raise InvalidRequest(f"The request body is not valid JSON: {str(exc)[:200]}") from None
    if not isinstance(payload, dict):
        raise InvalidRequest(
            f"The request body must be a JSON object, not a JSON {_json_type(payload)}."
        )
    return payload


def validate_body(body: bytes, *, max_depth: int) -> dict[str, Any]:
    """Parse an OpenAI request body and check the fields the router reads."""
    payload = parse_json_object(body, max_depth)
    model = payload.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidField("model", "`model` is required and must be a non-empty string.")
    stream = payload.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise InvalidField("stream", f"`stream` must be a boolean, not a {_json_type(stream)}.")
    messages = payload.get("messages")
    if messages is not None:
        if not isinstance(messages, list):
            raise InvalidField(
                "messages", f"`messages` must be an array, not a {_json_type(messages)}."
            )
        for index, message in enumerate(messages):
            if not isinstance(message, dict):
                raise InvalidField(
                    f"messages[{index}]",
                    f"`messages[{index}]` must be an object, not a {_json_type(message)}.",
                )
    return payload


def _json_type(value: object) -> str:
    match value:
        case bool():
            return "boolean"
        case int() | float():
            return "number"
        case str():
            return "string"
        case list():
            return "array"
        case dict():
            return "object"
        case None:
            return "null"
        case _:  # pragma: no cover - json.loads makes nothing else
            return type(value).__name__
