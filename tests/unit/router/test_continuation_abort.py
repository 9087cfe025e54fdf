"""vLLM's `finish_reason: "abort"` ends a stream that must be continued, not delivered."""

from __future__ import annotations

import json

from router.continuation import cut_at_abort


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

    assert (chunk(" a") + chunk(" b"), True) == cut_at_abort(block)


def test_a_stream_without_an_abort_is_untouched() -> None:
    """Other finish reasons, and the word "abort" in the text, are the answer itself."""
    block = chunk(' "abort"') + chunk(None, "length") + b"data: [DONE]\n\n"

    assert (block, False) == cut_at_abort(block)


def test_an_abort_in_the_first_event_keeps_nothing() -> None:
    """A block that starts with the abort sends nothing on to the client."""
    assert (b"", True) == cut_at_abort(chunk(None, "abort"))
