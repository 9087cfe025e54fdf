"""The OpenAI-compatible routes the router serves, and what each one means to the proxy.

Each route of the router's public port maps to one `EngineRoute` (the contract's
name for it, which a replica's Meta lists when its engine serves it), and says:

- whether `"stream": true` asks for server-sent events, and in which dialect
  the engine streams them: OpenAI chunks ending in `data: [DONE]` (chat,
  completions), the Responses API's typed events ending in
  `response.completed`/`failed`/`incomplete`, or Anthropic's ending in
  `message_stop`;
- whether a stream broken mid-way is continued on another replica (chat and
  completions only, `caravan_llm.router.edge.continuation`); the other streams are relayed
  as the engine writes them and, if the engine dies, end with an error event
  in their own dialect;
- the body fields it needs beyond `model` (a 400 naming the field otherwise).

Several client paths may lead to one engine route (`/rerank`, `/v1/rerank` and
`/v2/rerank` are one handler in vLLM); the engine always gets the route's
`engine_path`. The functions here are pure.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

from caravan_llm.common.contract import EngineRoute
from caravan_llm.router.edge.continuation import StreamKind, engine_json


class SseDialect(StrEnum):
    """How an engine writes a stream on a route, and how the stream ends."""

    # `data: {chunk}` events, then `data: [DONE]`.
    OPENAI_CHUNKS = "openai_chunks"
    # `event: response.*` events; the last is response.completed, failed or incomplete.
    RESPONSES = "responses"
    # `event: message_start` ... `event: message_stop` (Anthropic's Messages API).
    ANTHROPIC = "anthropic"


@dataclass(frozen=True, slots=True)
class RouteSpec:
    """One route of the router: where it goes on the engine and how it is served."""

    route: EngineRoute
    # Whether `"stream": true` asks for SSE on this route.
    streams: bool = False
    dialect: SseDialect = SseDialect.OPENAI_CHUNKS
    # Chat and completions streams are continued elsewhere when their engine dies.
    continuation: StreamKind | None = None
    # Body fields the route cannot do without (besides `model`).
    requires: tuple[str, ...] = ()

    @property
    def engine_path(self) -> str:
        return self.route.engine_path


_CHAT = RouteSpec(EngineRoute.CHAT_COMPLETIONS, streams=True, continuation=StreamKind.CHAT)
_COMPLETIONS = RouteSpec(EngineRoute.COMPLETIONS, streams=True, continuation=StreamKind.COMPLETION)
_RERANK = RouteSpec(EngineRoute.RERANK)
_SCORE = RouteSpec(EngineRoute.SCORE)
_TOKENIZE = RouteSpec(EngineRoute.TOKENIZE)
_DETOKENIZE = RouteSpec(EngineRoute.DETOKENIZE)

# The router's POST routes (client path -> spec).
ROUTES: Mapping[str, RouteSpec] = {
    "/v1/chat/completions": _CHAT,
    "/v1/completions": _COMPLETIONS,
    "/v1/embeddings": RouteSpec(EngineRoute.EMBEDDINGS),
    "/v1/responses": RouteSpec(EngineRoute.RESPONSES, streams=True, dialect=SseDialect.RESPONSES),
    # llama-server answers a body without `messages` with a 500: refused here instead.
    "/v1/messages": RouteSpec(
        EngineRoute.MESSAGES, streams=True, dialect=SseDialect.ANTHROPIC, requires=("messages",)
    ),
    "/v1/rerank": _RERANK,
    "/rerank": _RERANK,
    "/v2/rerank": _RERANK,
    "/v1/score": _SCORE,
    "/score": _SCORE,
    "/tokenize": _TOKENIZE,
    "/v1/tokenize": _TOKENIZE,
    "/detokenize": _DETOKENIZE,
    "/v1/detokenize": _DETOKENIZE,
    "/v1/messages/count_tokens": RouteSpec(
        EngineRoute.MESSAGES_COUNT_TOKENS, requires=("messages",)
    ),
    "/pooling": RouteSpec(EngineRoute.POOLING),
    "/classify": RouteSpec(EngineRoute.CLASSIFY),
}

# Event types that end a stream of each typed dialect (an `error` event ends it too).
_END_EVENTS: Mapping[SseDialect, frozenset[str]] = {
    SseDialect.RESPONSES: frozenset(
        {"response.completed", "response.failed", "response.incomplete", "error"}
    ),
    SseDialect.ANTHROPIC: frozenset({"message_stop", "error"}),
    SseDialect.OPENAI_CHUNKS: frozenset(),
}


def missing_field(spec: RouteSpec, payload: Mapping[str, object]) -> str | None:
    """The first field the route requires that the body lacks; None when it has them all."""
    for name in spec.requires:
        if payload.get(name) is None:
            return name
    return None


def event_type(event: bytes) -> str | None:
    """The type of one SSE event: its `event:` line, else its data's JSON `type`."""
    data_lines: list[bytes] = []
    for line in event.split(b"\n"):
        if line.startswith(b"event:"):
            return line[6:].strip().decode("utf-8", "replace")
        if line.startswith(b"data:"):
            data_lines.append(line[5:].strip())
    if not data_lines:
        return None
    try:
        data = engine_json(b"\n".join(data_lines))
    except (ValueError, UnicodeDecodeError):
        return None
    kind = data.get("type") if isinstance(data, dict) else None
    return kind if isinstance(kind, str) else None


def ends_stream(dialect: SseDialect, block: bytes) -> bool:
    """Whether a block of complete events holds the event that ends a `dialect` stream."""
    ends = _END_EVENTS[dialect]
    if not ends:
        return False
    return any(event_type(event) in ends for event in block.split(b"\n\n") if event)


def broken_stream_event(dialect: SseDialect, message: str) -> bytes:
    """The error event that ends a relayed stream whose engine died, in the route's dialect."""
    if dialect is SseDialect.ANTHROPIC:
        body: dict[str, object] = {
            "type": "error",
            "error": {"type": "api_error", "message": message},
        }
    else:
        body = {
            "type": "error",
            "code": "stream_interrupted",
            "message": message,
            "param": None,
        }
    return b"event: error\ndata: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


def is_openai_error(body: bytes) -> bool:
    """Whether an engine's error body is in OpenAI's shape: `{"error": {"message": ...}}`."""
    try:
        decoded = engine_json(body)
    except (ValueError, UnicodeDecodeError):
        return False
    error = decoded.get("error") if isinstance(decoded, dict) else None
    return isinstance(error, dict) and isinstance(error.get("message"), str)
