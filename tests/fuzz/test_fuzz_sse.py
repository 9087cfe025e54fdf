"""Fuzzing the engine SSE stream the router accounts: cut anywhere, garbage, no `[DONE]`."""

from __future__ import annotations

import itertools
import json

import pytest
from fuzz_strategies import fuzz_settings, sse_events, sse_streams
from hypothesis import example, given
from hypothesis import strategies as st

from caravan_llm.router.edge.continuation import (
    DONE_EVENT,
    ContinuationRewriter,
    StreamAccount,
    StreamKind,
    cut_at_engine_stop,
    iter_event_data,
    split_complete_events,
)
from caravan_llm.router.edge.routes import SseDialect, ends_stream, event_type, is_openai_error

pytestmark = pytest.mark.fuzz

DEEP_EVENT = b"data: " + b"[" * 5000 + b"\n\n"


def relayed_blocks(reads: list[bytes]) -> tuple[list[bytes], bytes]:
    """The blocks of complete events the proxy forwards for these reads, and what is left over."""
    pending = b""
    blocks: list[bytes] = []
    for data in reads:
        pending += data
        block, pending = split_complete_events(pending)
        if block:
            blocks.append(block)
    return blocks, pending


def account_of(kind: StreamKind, blocks: list[bytes]) -> StreamAccount:
    account = StreamAccount(kind)
    for block in blocks:
        account.feed(block)
    return account


def assert_consistent(account: StreamAccount) -> None:
    """What an account says about a stream agrees with itself."""
    assert len(account.text_parts) == account.content_chunks
    assert all(isinstance(part, str) and part for part in account.text_parts)
    assert account.sent_tokens >= account.content_chunks
    assert account.finished == (
        account.done or account.errored or account.finish_reason is not None
    )
    assert account.id is None or isinstance(account.id, str)
    assert account.created is None or isinstance(account.created, int)


def reads_of(stream: bytes, offsets: list[int]) -> list[bytes]:
    """`stream` cut into reads after each of `offsets` (taken modulo its length)."""
    edges = sorted({0, len(stream), *(offset % max(1, len(stream)) for offset in offsets)})
    return [stream[start:end] for start, end in itertools.pairwise(edges)]


@fuzz_settings()
@given(sse_streams(), st.lists(st.integers(min_value=0), max_size=12))
@example(DEEP_EVENT, [3])
@example(b"data: [DONE]\r\n\r\n", [13, 14])
@example(b"data: [DONE]\n\n\n\n\n\r\n", [18])
def test_cut_anywhere_the_forwarded_events_and_the_account_are_the_same(
    stream: bytes, offsets: list[int]
) -> None:
    """However the engine's bytes are cut into reads, the same events go out, accounted alike."""
    whole_blocks, whole_rest = relayed_blocks([stream])
    blocks, rest = relayed_blocks(reads_of(stream, offsets))

    # The same events; a CRLF cut between its CR and LF may move a blank line
    # (no event in SSE) from one block to the rest, never an event.
    assert list(iter_event_data(b"".join(whole_blocks))) == list(iter_event_data(b"".join(blocks)))
    assert whole_rest.strip(b"\r\n") == rest.strip(b"\r\n")
    for kind in StreamKind:
        whole = account_of(kind, whole_blocks)
        piecewise = account_of(kind, blocks)
        assert_consistent(piecewise)
        assert (whole.text, whole.done, whole.finish_reason, whole.errored) == (
            piecewise.text,
            piecewise.done,
            piecewise.finish_reason,
            piecewise.errored,
        )


@fuzz_settings()
@given(st.lists(sse_events(), max_size=6))
@example([DEEP_EVENT])
@example([b'data: {"error": ' + b"[" * 3000 + b"}\n\n"])
@example([b'data: {"error": {"type": [], "message": "error"}}\n\n'])
@example([b"\n\n", b"data: [DONE]\n\n", b'event: error\ndata: {"error": {"code": 500}}\n\n'])
def test_the_engine_stop_cut_keeps_a_prefix_of_the_events(events: list[bytes]) -> None:
    """`cut_at_engine_stop` never raises and keeps the events before the stop, unchanged."""
    block, _ = split_complete_events(b"".join(events))
    kept, reason = cut_at_engine_stop(block)
    # Events, not bytes: blank lines between events (no event in SSE) may go.
    all_events, kept_events = list(iter_event_data(block)), list(iter_event_data(kept))
    assert all_events[: len(kept_events)] == kept_events
    assert reason is None or isinstance(reason, str)
    if reason is None:
        assert kept == block


@fuzz_settings()
@given(st.lists(sse_events(), max_size=6), st.sampled_from(StreamKind), st.text(max_size=5))
@example([DEEP_EVENT], StreamKind.CHAT, "")
def test_a_continuation_is_rewritten_into_complete_json_events(
    events: list[bytes], kind: StreamKind, echo: str
) -> None:
    """The rewriter never raises, writes only whole JSON events or `[DONE]`, and accounts them."""
    block, _ = split_complete_events(b"".join(events))
    account = StreamAccount(kind, text_parts=["so far"], content_chunks=1)
    rewriter = ContinuationRewriter(account, tokens_before=1, echo=echo)

    out = rewriter.rewrite(block)

    assert out == b"" or out.endswith(b"\n\n")
    for data in iter_event_data(out):
        if data != DONE_EVENT[6:-2]:
            assert isinstance(json.loads(data), dict)
    assert_consistent(account)


@fuzz_settings()
@given(sse_streams(), st.sampled_from(SseDialect))
@example(DEEP_EVENT, SseDialect.RESPONSES)
def test_relayed_dialects_read_event_types_without_raising(
    stream: bytes, dialect: SseDialect
) -> None:
    """The end-of-stream check of relayed routes reads any event: a type string or None."""
    block, _ = split_complete_events(stream)
    assert ends_stream(dialect, block) in {True, False}
    for event in block.split(b"\n\n"):
        kind = event_type(event)
        assert kind is None or isinstance(kind, str)


@fuzz_settings()
@given(st.binary(max_size=64) | sse_streams())
@example(b"[" * 5000)
@example(b'{"error": {"message": ' + b"[" * 5000 + b"}}")
def test_an_engine_error_body_is_read_or_not_never_raised(body: bytes) -> None:
    """Whether an engine's error body is OpenAI-shaped is a yes or no for any bytes."""
    assert is_openai_error(body) in {True, False}
