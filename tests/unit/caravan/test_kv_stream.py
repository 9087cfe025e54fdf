"""The digest stream's codec: what the relay encodes, a router decodes to the same values."""

from __future__ import annotations

import contextlib
import json

import pytest
from fuzz_strategies import fuzz_settings
from hypothesis import given
from hypothesis import strategies as st

from caravan_llm.common.block_digest import BlockDigest
from caravan_llm.common.kv_stream import (
    MAX_BLOCK_SIZE,
    MAX_DIGESTS,
    MAX_EVENT_BYTES,
    KvDelta,
    KvHeartbeat,
    KvSnapshot,
    KvStreamError,
    KvStreamMessage,
    SseDecoder,
    decode_message,
    encode_delta,
    encode_heartbeat,
    encode_snapshot,
)

digests = st.integers(min_value=0, max_value=2**64 - 1).map(BlockDigest)
positions = st.integers(min_value=0, max_value=2**63 - 1)
block_sizes = st.integers(min_value=1, max_value=MAX_BLOCK_SIZE)
snapshots = st.builds(
    KvSnapshot,
    epoch=positions,
    seq=positions,
    block_size=block_sizes,
    digests=st.frozensets(digests, max_size=20),
)
deltas = st.builds(
    KvDelta,
    epoch=positions,
    seq=positions,
    block_size=block_sizes,
    added=st.lists(digests, max_size=20).map(tuple),
    removed=st.lists(digests, max_size=20).map(tuple),
)
heartbeats = st.builds(KvHeartbeat, epoch=positions, seq=positions)
messages = st.one_of(snapshots, deltas, heartbeats)


def encode(message: KvStreamMessage) -> bytes:
    match message:
        case KvSnapshot():
            return encode_snapshot(message)
        case KvDelta():
            return encode_delta(message)
        case KvHeartbeat():
            return encode_heartbeat(message)


def decode_all(body: bytes, cuts: list[int] | None = None) -> list[KvStreamMessage]:
    decoder = SseDecoder()
    out: list[KvStreamMessage] = []
    start = 0
    for cut in sorted(cuts or []):
        out += decoder.feed(body[start:cut])
        start = cut
    out += decoder.feed(body[start:])
    return out


@given(st.lists(messages, max_size=8), st.lists(st.integers(0, 4000), max_size=6))
def test_any_stream_cut_anywhere_decodes_to_the_messages_encoded(
    sent: list[KvStreamMessage], cuts: list[int]
) -> None:
    """Encoded messages, fed in any chunking, decode to equal values in order."""
    body = b"".join(encode(message) for message in sent)
    assert sent == decode_all(body, [cut for cut in cuts if cut <= len(body)])


def test_the_wire_format_is_named_events_with_one_json_line_and_hex_digests() -> None:
    """A delta is `event: delta` and one `data:` JSON line; digests are 16 lowercase hex digits."""
    delta = KvDelta(7, 3, 16, (BlockDigest(0xAB),), (BlockDigest(2**64 - 1),))
    expected = (
        b'event: delta\ndata: {"epoch":7,"seq":3,"block_size":16,'
        b'"added":["00000000000000ab"],"removed":["ffffffffffffffff"]}\n\n'
    )
    assert expected == encode_delta(delta)


def test_crlf_and_cr_line_ends_comments_and_unknown_events_are_handled_as_sse_says() -> None:
    """CRLF/CR end lines, `:` comments and unknown events are skipped (counted), data joins."""
    body = (
        b": keepalive\r\n\r\n"
        b"event: news\r\ndata: {}\r\n\r\n"
        b'event: heartbeat\rdata: {"epoch":1,\rdata: "seq":2}\r\r'
        b'data: {"epoch":1,"seq":2}\n\n'
    )
    decoder = SseDecoder()
    got = decoder.feed(body[:5]) + decoder.feed(body[5:-1]) + decoder.feed(body[-1:])
    assert ([KvHeartbeat(1, 2)], 2) == (got, decoder.skipped)


def test_a_cr_at_the_end_of_a_chunk_and_lf_at_the_start_of_the_next_is_one_line_end() -> None:
    """A CRLF split across two chunks ends one line, not two (which would dispatch early)."""
    body = b'event: heartbeat\r\ndata: {"epoch":1,"seq":2}\r\n\r\n'
    cut = body.index(b"\n")
    assert [KvHeartbeat(1, 2)] == decode_all(body, [cut])


@pytest.mark.parametrize(
    ("event", "data", "problem"),
    [
        ("heartbeat", "[1, 2]", "data is a JSON object, got an array"),
        ("heartbeat", "{", "data is not one JSON object"),
        ("heartbeat", '{"epoch": 1}', "missing seq"),
        ("heartbeat", '{"epoch": 1, "seq": true}', "seq: expected an integer, got a boolean"),
        ("heartbeat", '{"epoch": 1, "seq": 1.0}', "seq: expected an integer, got a number"),
        ("heartbeat", '{"epoch": -1, "seq": 1}', "epoch: out of range"),
        ("heartbeat", '{"epoch": 9223372036854775808, "seq": 1}', "epoch: out of range"),
        ("heartbeat", '{"epoch": 1, "epoch": 2, "seq": 1}', "appears twice"),
        ("heartbeat", '{"epoch": 1' + "0" * 5000 + ', "seq": 1}', "not one JSON object"),
        ("snapshot", '{"epoch": 1, "seq": 1, "digests": []}', "missing block_size"),
        ("snapshot", '{"epoch": 1, "seq": 1, "block_size": 0, "digests": []}', "block_size"),
        ("snapshot", '{"epoch": 1, "seq": 1, "block_size": 16}', "missing digests"),
        ("snapshot", '{"epoch":1,"seq":1,"block_size":16,"digests":{}}', "expected an array"),
        ("snapshot", '{"epoch":1,"seq":1,"block_size":16,"digests":[1]}', "digests[0]"),
        ("delta", '{"epoch":1,"seq":1,"block_size":16,"added":["ab"],"removed":[]}', "added[0]"),
        (
            "delta",
            '{"epoch":1,"seq":1,"block_size":16,"added":[],"removed":["00000000000000AB"]}',
            "removed[0]",
        ),
        (
            "delta",
            '{"epoch":1,"seq":1,"block_size":16,"added":["0x000000000000ab"],"removed":[]}',
            "added[0]",
        ),
        ("delta", '{"epoch":1,"seq":1,"block_size":16,"added":[]}', "missing removed"),
    ],
)
def test_malformed_events_raise_one_typed_error_naming_the_field(
    event: str, data: str, problem: str
) -> None:
    """Each malformed event raises KvStreamError saying what was wrong, and nothing is returned."""
    with pytest.raises(KvStreamError) as caught:
        decode_message(event, data)
    assert problem in str(caught.value)


def test_keys_a_newer_relay_adds_are_ignored() -> None:
    """Unknown keys in a known event do not fail it (a newer relay may add fields)."""
    assert KvHeartbeat(1, 2) == decode_message("heartbeat", '{"epoch":1,"seq":2,"lag_s":0.5}')


def test_an_overlong_line_fails_before_it_is_buffered_past_the_cap() -> None:
    """A line longer than the event cap raises KvStreamError instead of growing without bound."""
    decoder = SseDecoder()
    with pytest.raises(KvStreamError):
        decoder.feed(b"data: " + b"x" * (MAX_EVENT_BYTES + 1024))


def test_too_many_digests_are_refused_by_the_encoder() -> None:
    """A snapshot past MAX_DIGESTS is refused where it is made, not sent."""
    too_many = KvSnapshot(1, 1, 16, frozenset(BlockDigest(i) for i in range(MAX_DIGESTS + 1)))
    with pytest.raises(ValueError, match="at most"):
        encode_snapshot(too_many)


def test_a_full_snapshot_fits_the_decoders_bound() -> None:
    """A snapshot of MAX_DIGESTS of the widest digests decodes (the bound is not too tight)."""
    full = KvSnapshot(
        2**63 - 1,
        2**63 - 1,
        MAX_BLOCK_SIZE,
        frozenset(BlockDigest(2**64 - 1 - i) for i in range(MAX_DIGESTS)),
    )
    (decoded,) = decode_all(encode_snapshot(full))
    assert full == decoded


@pytest.mark.fuzz
@fuzz_settings(2.5)
@given(st.binary(max_size=400), st.lists(st.integers(0, 400), max_size=4))
def test_garbage_bytes_raise_only_the_typed_error(body: bytes, cuts: list[int]) -> None:
    """Any bytes at all either decode or raise KvStreamError, never another exception."""
    with contextlib.suppress(KvStreamError):
        decode_all(body, [cut for cut in cuts if cut <= len(body)])


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=5)
    ),
    max_leaves=20,
)
field_names = st.sampled_from(["epoch", "seq", "block_size", "digests", "added", "removed", "x"])


@pytest.mark.fuzz
@fuzz_settings(2.5)
@given(
    st.sampled_from(["snapshot", "delta", "heartbeat"]),
    st.dictionaries(field_names, json_values | st.lists(st.text(max_size=17), max_size=3)),
)
def test_wrong_shaped_json_raises_only_the_typed_error(
    event: str, fields: dict[str, object]
) -> None:
    """JSON objects of any shape under the known names decode or raise KvStreamError only."""
    with contextlib.suppress(KvStreamError):
        decode_message(event, json.dumps(fields))


@pytest.mark.fuzz
@fuzz_settings(2.5)
@given(messages, st.integers(min_value=0), st.binary(min_size=1, max_size=3))
def test_a_damaged_event_raises_only_the_typed_error(
    message: KvStreamMessage, at: int, junk: bytes
) -> None:
    """An encoded event with bytes overwritten decodes or raises KvStreamError only."""
    body = bytearray(encode(message))
    position = at % len(body)
    body[position : position + len(junk)] = junk
    with contextlib.suppress(KvStreamError):
        decode_all(bytes(body))
