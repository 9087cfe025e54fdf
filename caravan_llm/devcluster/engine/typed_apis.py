"""The engines' other OpenAI-compatible routes: Responses, Anthropic Messages, tokens, vectors.

Pure functions from request bodies to the chat request the simulation runs,
and from its result to each route's answer, in the shapes the real servers
write (measured on llama-server 0c1e570, `/v1/responses` and `/v1/messages`
unary and streamed; vLLM 0.32 follows the same OpenAI and Anthropic schemas):

- `/v1/responses`: `input` (a string or message items) and `instructions`
  become chat messages, `max_output_tokens` the token limit; the answer is a
  `response` object, or the typed events `response.created` ...
  `response.completed` (no `[DONE]`).
- `/v1/messages`: `system` and `messages` become chat messages; the answer is
  an Anthropic `message`, or `message_start` ... `message_stop`.
- llama-server's `/tokenize` (`content`) and `/detokenize` (`tokens`).
- embeddings and rerank scores: deterministic vectors and scores drawn from
  the text (a simulated embedding model has no meaning, only a shape).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

from caravan_llm.devcluster.engine.openai_requests import ApiError

JSON = dict[str, Any]
EMBEDDING_DIMENSIONS = 64


def _text_of(content: Any, where: str) -> str:
    """The text of a message's content: a string, or text parts of any of the schemas."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            text = part.get("text") if isinstance(part, dict) else None
            if not isinstance(text, str):
                raise ApiError(400, f"{where}: only text content is simulated")
            parts.append(text)
        return "".join(parts)
    raise ApiError(400, f"{where} must be a string or an array of content parts")


def responses_chat_body(body: Any) -> JSON:
    """The chat request a `/v1/responses` body asks for (ApiError 400 for a bad one)."""
    fields: Mapping[str, Any] = body if isinstance(body, dict) else {}
    raw = fields.get("input")
    if raw is None:
        raise ApiError(400, "'input' is required", param="input")
    messages: list[JSON] = []
    instructions = fields.get("instructions")
    if isinstance(instructions, str) and instructions:
        messages.append({"role": "system", "content": instructions})
    if isinstance(raw, str):
        messages.append({"role": "user", "content": raw})
    elif isinstance(raw, list):
        for index, item in enumerate(raw):
            if not isinstance(item, dict) or "role" not in item:
                raise ApiError(400, f"input[{index}] must be a message item", param="input")
            content = _text_of(item.get("content"), f"input[{index}].content")
            messages.append({"role": item["role"], "content": content})
    else:
        raise ApiError(400, "'input' must be a string or an array of items", param="input")
    chat: JSON = {"messages": messages, "stream": fields.get("stream") is True}
    for source, target in (("model", "model"), ("max_output_tokens", "max_tokens")):
        if fields.get(source) is not None:
            chat[target] = fields[source]
    for name in ("temperature", "top_p", "seed"):
        if name in fields:
            chat[name] = fields[name]
    return chat


def messages_chat_body(body: Any) -> JSON:
    """The chat request an Anthropic `/v1/messages` body asks for."""
    fields: Mapping[str, Any] = body if isinstance(body, dict) else {}
    raw = fields.get("messages")
    if not isinstance(raw, list):
        raise ApiError(400, "'messages' is required", param="messages")
    messages: list[JSON] = []
    system = fields.get("system")
    if system is not None:
        messages.append({"role": "system", "content": _text_of(system, "system")})
    for index, item in enumerate(raw):
        if not isinstance(item, dict):
            raise ApiError(400, f"messages[{index}] must be an object", param="messages")
        content = _text_of(item.get("content"), f"messages[{index}].content")
        messages.append({"role": item.get("role"), "content": content})
    chat: JSON = {"messages": messages, "stream": fields.get("stream") is True}
    for source, target in (
        ("model", "model"),
        ("max_tokens", "max_tokens"),
        ("stop_sequences", "stop"),
    ):
        if fields.get(source) is not None:
            chat[target] = fields[source]
    for name in ("temperature", "top_p", "seed"):
        if name in fields:
            chat[name] = fields[name]
    return chat


def sse(event: str, data: Mapping[str, Any]) -> bytes:
    """One typed SSE event, as both engines write them (`event:` line, then `data:`)."""
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


# -- /v1/responses -----------------------------------------------------------------


def _output_message(message_id: str, text: str, status: str) -> JSON:
    return {
        "type": "message",
        "status": status,
        "id": message_id,
        "role": "assistant",
        "content": [{"type": "output_text", "annotations": [], "logprobs": [], "text": text}],
    }


def _responses_usage(prompt: int, completion: int, cached: int) -> JSON:
    return {
        "input_tokens": prompt,
        "output_tokens": completion,
        "total_tokens": prompt + completion,
        "input_tokens_details": {"cached_tokens": cached},
    }


def response_object(
    *,
    response_id: str,
    message_id: str,
    created: int,
    model: str,
    text: str,
    finish_reason: str,
    usage: tuple[int, int, int],
) -> JSON:
    """A finished `response`.

    llama-server reports `completed` even when `max_output_tokens` cut the
    answer (measured); so does the simulator, whatever `finish_reason` was.
    """
    del finish_reason
    body: JSON = {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "completed_at": created,
        "status": "completed",
        "model": model,
        "output": [_output_message(message_id, text, "completed")],
        "usage": _responses_usage(*usage),
    }
    return body


def responses_stream_start(response_id: str, message_id: str) -> bytes:
    head = {"id": response_id, "object": "response", "status": "in_progress"}
    return b"".join(
        [
            sse("response.created", {"type": "response.created", "response": head}),
            sse("response.in_progress", {"type": "response.in_progress", "response": head}),
            sse(
                "response.output_item.added",
                {
                    "type": "response.output_item.added",
                    "item": {
                        "content": [],
                        "id": message_id,
                        "role": "assistant",
                        "status": "in_progress",
                        "type": "message",
                    },
                },
            ),
            sse(
                "response.content_part.added",
                {
                    "type": "response.content_part.added",
                    "item_id": message_id,
                    "part": {"type": "output_text", "text": ""},
                },
            ),
        ]
    )


def responses_stream_delta(message_id: str, text: str) -> bytes:
    return sse(
        "response.output_text.delta",
        {"type": "response.output_text.delta", "item_id": message_id, "delta": text},
    )


def responses_stream_end(final: JSON, timings: JSON | None = None) -> bytes:
    """The closing events of a streamed response, `final` being its `response_object`.

    The last event's response has no `completed_at`; llama-server adds its
    `timings` beside it (`timings`, None for the other engines).
    """
    final = {key: value for key, value in final.items() if key != "completed_at"}
    message = final["output"][0]
    text = message["content"][0]["text"]
    last = "response.completed"
    return b"".join(
        [
            sse(
                "response.output_text.done",
                {"type": "response.output_text.done", "item_id": message["id"], "text": text},
            ),
            sse(
                "response.content_part.done",
                {
                    "type": "response.content_part.done",
                    "item_id": message["id"],
                    "part": message["content"][0],
                },
            ),
            sse(
                "response.output_item.done", {"type": "response.output_item.done", "item": message}
            ),
            sse(
                last,
                {"type": last, "response": final}
                | ({"timings": timings} if timings is not None else {}),
            ),
        ]
    )


# -- /v1/messages (Anthropic) ---------------------------------------------------------

_STOP_REASONS = {"length": "max_tokens", "stop": "end_turn"}


def anthropic_message(
    *,
    message_id: str,
    model: str,
    text: str,
    finish_reason: str,
    usage: tuple[int, int, int],
) -> JSON:
    prompt, completion, cached = usage
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "content": [{"type": "text", "text": text}],
        "model": model,
        "stop_reason": _STOP_REASONS.get(finish_reason, "end_turn"),
        "stop_sequence": None,
        "usage": {
            "cache_read_input_tokens": cached,
            "input_tokens": prompt - cached,
            "output_tokens": completion,
        },
    }


def messages_stream_start(message_id: str, model: str, usage: tuple[int, int]) -> bytes:
    prompt, cached = usage
    head: JSON = {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "content": [],
        "model": model,
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {
            "cache_read_input_tokens": cached,
            "input_tokens": prompt - cached,
            "output_tokens": 0,
        },
    }
    return sse("message_start", {"type": "message_start", "message": head}) + sse(
        "content_block_start",
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
    )


def messages_stream_delta(text: str) -> bytes:
    return sse(
        "content_block_delta",
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}},
    )


def messages_stream_end(finish_reason: str, completion_tokens: int) -> bytes:
    return b"".join(
        [
            sse("content_block_stop", {"type": "content_block_stop", "index": 0}),
            sse(
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {
                        "stop_reason": _STOP_REASONS.get(finish_reason, "end_turn"),
                        "stop_sequence": None,
                    },
                    "usage": {"output_tokens": completion_tokens},
                },
            ),
            sse("message_stop", {"type": "message_stop"}),
        ]
    )


# -- vectors and scores ------------------------------------------------------------------


def embedding(text: str, dimensions: int = EMBEDDING_DIMENSIONS) -> list[float]:
    """A deterministic unit vector for `text` (the same text always gets the same one)."""
    digest = b""
    counter = 0
    while len(digest) < dimensions:
        digest += hashlib.blake2b(f"{counter}:{text}".encode(), digest_size=64).digest()
        counter += 1
    raw = [byte / 127.5 - 1.0 for byte in digest[:dimensions]]
    norm = math.sqrt(sum(value * value for value in raw)) or 1.0
    return [round(value / norm, 6) for value in raw]


def relevance(query: str, document: str) -> float:
    """A deterministic relevance of `document` to `query`: the cosine of their vectors."""
    return round(sum(a * b for a, b in zip(embedding(query), embedding(document), strict=True)), 6)


def embedding_inputs(body: Any) -> list[str]:
    """The texts of an embeddings request (`input`: a string or an array of strings)."""
    raw = body.get("input") if isinstance(body, dict) else None
    if isinstance(raw, str):
        return [raw]
    if isinstance(raw, list) and raw and all(isinstance(item, str) for item in raw):
        return list(raw)
    raise ApiError(400, "'input' must be a string or an array of strings", param="input")


def rerank_inputs(body: Any) -> tuple[str, Sequence[str], int | None]:
    """(query, documents, top_n) of a rerank request."""
    fields: Mapping[str, Any] = body if isinstance(body, dict) else {}
    query, documents = fields.get("query"), fields.get("documents")
    if not isinstance(query, str):
        raise ApiError(400, "'query' must be a string", param="query")
    if not isinstance(documents, list) or not all(isinstance(d, str) for d in documents):
        raise ApiError(400, "'documents' must be an array of strings", param="documents")
    top_n = fields.get("top_n")
    return query, documents, top_n if isinstance(top_n, int) and top_n > 0 else None
