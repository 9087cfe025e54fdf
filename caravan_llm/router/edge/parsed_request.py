"""One client request as the router's edge parsed it: built once, read by every handler.

The request guard (`caravan_llm.router.edge.request_guard`) reads the body, checks and parses
it (`caravan_llm.router.edge.request_body.validate_body`), authenticates the key and grants its
priority, and puts the result on the aiohttp request under `PARSED_REQUEST`.
The proxy takes it from there: nothing downstream reads the body, parses
JSON or looks at the key or the priority header again.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web

PRIORITY_HEADER = "x-caravan-priority"
REQUEST_ID_HEADER = "x-request-id"
# A client's request id is kept for correlation, cut to a sane length.
MAX_REQUEST_ID_CHARS = 128


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    """An OpenAI POST request, read, checked and parsed once."""

    # The bytes as received: engines get exactly these, never re-encoded.
    body: bytes
    # The body as a JSON object, its `model`, `stream` and `messages` checked.
    payload: Mapping[str, Any]
    model: str
    # The body asks for a stream (`"stream": true`).
    stream: bool
    # The name of the API key that authenticated it; None on an open router.
    key_name: str | None
    # The priority it is served at: the header as granted to its key.
    priority: int
    # The client's `x-request-id` (cut to MAX_REQUEST_ID_CHARS) or the router's own.
    request_id: str


PARSED_REQUEST = web.RequestKey("caravan_parsed_request", ParsedRequest)
