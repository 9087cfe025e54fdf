"""vLLM's `finish_reason: "abort"` ends a stream that must be continued, not delivered."""

from __future__ import annotations

import json

from caravan_llm.router.edge.continuation import cut_at_engine_stop


def event(payload: object) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def chunk(content: str | None, finish: str | None = None) -> bytes:
    delta = {} if content is None else {"content": content}
    return event({"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})


def test_events_before_the_abort_are_kept_and_the_rest_is_dropped() -> None:
    """The abort chunk, the usage chunk after it and `[DONE]` never reach the client."""
    block = (
        chunk(" a") + chunk(" b") + chunk(None, "abort")
        + event({"choices": [], "usage": {"completion_tokens": 2}}) + b"data: [DONE]\n\n"
    )  # fmt: skip

    assert (chunk(" a") + chunk(" b"), "the engine aborted the stream") == cut_at_engine_stop(block)


def test_a_stream_without_an_abort_is_untouched() -> None:
    """Other finish reasons, and the word "abort" in the text, are the answer itself."""
    block = chunk(' "abort"') + chunk(None, "length") + b"data: [DONE]\n\n"

    assert (block, None) == cut_at_engine_stop(block)


def test_an_abort_in_the_first_event_keeps_nothing() -> None:
    """A block that starts with the abort sends nothing on to the client."""
    assert (b"", "the engine aborted the stream") == cut_at_engine_stop(chunk(None, "abort"))


def test_a_server_side_error_event_stops_the_stream_and_a_client_one_does_not() -> None:
    """vLLM's "EngineCore encountered an issue" (500) is the engine failing: continued
    elsewhere; a 400 error event is the request's own answer: passed on."""
    engine = event({"error": {"message": "EngineCore encountered an issue", "code": 500}})
    client = event({"error": {"message": "bad", "type": "BadRequestError", "code": 400}})

    assert (chunk(" a"), "the engine failed mid-stream") == cut_at_engine_stop(
        chunk(" a") + engine + b"data: [DONE]\n\n"
    )
    assert (chunk(" a") + client, None) == cut_at_engine_stop(chunk(" a") + client)
