"""Fuzzing the engine's KV events as the relay reads them: both encodings, any damage, counted.

The decoder's own properties (round trips, truncation, garbage, random
msgpack values) are in tests/unit/kvrelay/test_wire.py; here frames go
through the relay's frame handling (`KvRelay.decoded`, what its engine feed
runs per frame): a stream of valid frames in either encoding mixed with
damaged ones (truncated payloads, a sequence number of the wrong length, a
wrong number of parts, garbage) never raises, every valid frame of the
relay's topic decodes, and each bad frame is counted once in
`caravan_kv_relay_decode_errors_total`.
"""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from fuzz_strategies import fuzz_settings
from hypothesis import example, given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from caravan_llm.kvrelay.relay import KvRelay
from caravan_llm.kvrelay.settings import RelaySettings
from caravan_llm.kvrelay.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvWireError,
    decode_frame,
    encode_batch,
)

pytestmark = pytest.mark.fuzz

TOPIC = "kv-events"
BLOCK = 4

block_hashes = st.integers(0, 2**64 - 1) | st.binary(min_size=1, max_size=32)
stored = st.builds(
    lambda hashes, parent, tokens: BlockStored(
        block_hashes=tuple(hashes),
        parent_block_hash=parent,
        token_ids=tuple(tokens[: len(hashes) * BLOCK]),
        block_size=BLOCK,
    ),
    st.lists(block_hashes, min_size=1, max_size=3),
    st.none() | block_hashes,
    st.lists(st.integers(0, 2**32 - 1), min_size=12, max_size=12),
)
events = st.one_of(
    stored,
    st.builds(BlockRemoved, block_hashes=st.lists(block_hashes, max_size=3).map(tuple)),
    st.just(AllBlocksCleared()),
)


@st.composite
def valid_frames(draw: st.DrawFn) -> list[bytes]:
    return encode_batch(
        draw(st.integers(0, 2**63)),
        draw(st.lists(events, max_size=4)),
        encoding=draw(st.sampled_from(["map", "array"])),
        topic=TOPIC.encode(),
    )


@st.composite
def damaged_frames(draw: st.DrawFn) -> list[bytes]:
    """A valid frame broken one way: the payload cut or garbled, the seq resized, parts changed."""
    topic, seq, payload = draw(valid_frames())
    damage = draw(st.sampled_from(["truncate", "seq", "parts", "garbage", "byte"]))
    if damage == "truncate":
        return [topic, seq, payload[: draw(st.integers(0, len(payload) - 1))]]
    if damage == "seq":
        size = draw(st.integers(0, 16).filter(lambda n: n != len(seq)))
        return [topic, draw(st.binary(min_size=size, max_size=size)), payload]
    if damage == "parts":
        parts = [topic, seq, payload]
        extra = draw(st.lists(st.binary(max_size=8), max_size=3))
        return draw(st.sampled_from([parts[:1], parts[:2], [*parts, b"", *extra], []]))
    if damage == "garbage":
        return [topic, seq, draw(st.binary(max_size=64))]
    index = draw(st.integers(0, len(payload) - 1))
    return [topic, seq, payload[:index] + bytes([draw(st.integers(0, 255))]) + payload[index + 1 :]]


def relay() -> KvRelay:
    settings = RelaySettings(
        events_endpoint="ipc:///tmp/caravan-fuzz-kv.ipc",
        topic=TOPIC,
        block_size=BLOCK,
        engine_api_key="fuzz-key",
        host="127.0.0.1",
        port=0,
    )
    return KvRelay(settings, registry=CollectorRegistry())


def refused(parts: list[bytes]) -> bool:
    try:
        decode_frame(parts)
    except KvWireError:
        return True
    return False


@fuzz_settings(2)
@given(frames=st.lists(st.one_of(valid_frames(), damaged_frames()), min_size=1, max_size=8))
@example(frames=[[TOPIC.encode(), b"\x00" * 7, msgpack.packb([0.0, []])]])  # a 7-byte seq
@example(frames=[[TOPIC.encode(), b"\x00" * 8, msgpack.packb([0.0, [["BlockStored"]]])]])
@example(frames=[[TOPIC.encode(), b"\x00" * 8, b"\x92\x00\x91" + b"\x91" * 50_000]])
def test_each_bad_frame_is_counted_once_and_none_breaks_the_relay(
    frames: list[list[bytes]],
) -> None:
    """Valid frames of either encoding decode; each one the decoder refuses is counted once."""
    under_test = relay()
    expected_bad = sum(refused(parts) for parts in frames)

    batches = [under_test.decoded(parts) for parts in frames]

    counted = under_test.registry.get_sample_value("caravan_kv_relay_decode_errors_total")
    assert expected_bad == counted
    assert len(frames) - expected_bad == sum(batch is not None for batch in batches)


@fuzz_settings(1)
@given(frame=valid_frames())
def test_valid_frames_of_another_topic_are_left_out_uncounted(frame: list[bytes]) -> None:
    """A longer topic with ours as its prefix (ZeroMQ filters by prefix): skipped, not an error."""
    under_test = relay()
    frame[0] += b"-other"

    batch: Any = under_test.decoded(frame)

    assert batch is None
    assert 0 == under_test.registry.get_sample_value("caravan_kv_relay_decode_errors_total")
