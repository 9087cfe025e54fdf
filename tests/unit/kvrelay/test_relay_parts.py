"""The relay's pure parts: where events may come from, settings, event mapping, router queues."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from caravan_llm.common.block_digest import DigestKey, block_digests
from caravan_llm.common.kv_stream import (
    KvDelta,
    KvHeartbeat,
    KvSnapshot,
    KvStreamMessage,
    SseDecoder,
)
from caravan_llm.kvrelay.events import relay_events
from caravan_llm.kvrelay.hub import RelayHub, Subscriber, TooManySubscribersError
from caravan_llm.kvrelay.metrics import RelayMetrics
from caravan_llm.kvrelay.settings import (
    EndpointNotLocalError,
    RelaySettings,
    check_local_endpoint,
    relay_binds,
)
from caravan_llm.kvrelay.state import ClearedAll, RemovedBlocks, StoredBlocks
from caravan_llm.kvrelay.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
)

KEY = "k" * 20
BLOCK = 4


@pytest.mark.parametrize(
    "endpoint",
    [
        "ipc:///run/kv.ipc",
        "ipc://relative/kv",
        "tcp://127.0.0.1:5599",
        "tcp://127.8.9.10:5599",
        "tcp://localhost:5599",
        "tcp://[::1]:5599",
    ],
)
def test_endpoints_inside_the_allocation_are_accepted(endpoint: str) -> None:
    """ipc:// and loopback tcp:// endpoints keep token ids inside the allocation."""
    assert endpoint == check_local_endpoint(endpoint)


@pytest.mark.parametrize(
    ("endpoint", "problem"),
    [
        ("tcp://*:5557", "loopback"),
        ("tcp://0.0.0.0:5557", "loopback"),
        ("tcp://10.1.2.3:5557", "loopback"),
        ("tcp://[::]:5557", "loopback"),
        ("tcp://engine.internal:5557", "loopback"),
        ("tcp://127.0.0.1", "tcp://<loopback host>:<port>"),
        ("tcp://127.0.0.1:0", "tcp://<loopback host>:<port>"),
        ("tcp://127.0.0.1:99999", "tcp://<loopback host>:<port>"),
        ("ipc://", "socket path"),
        ("ipc://*", "socket path"),
        ("epgm://eth0;239.1.1.1:5555", "transport"),
        ("inproc://kv", "transport"),
        ("127.0.0.1:5557", "transport"),
    ],
)
def test_endpoints_that_could_leave_the_allocation_are_refused(endpoint: str, problem: str) -> None:
    """A wildcard, routable or other-transport endpoint is refused, saying why."""
    with pytest.raises(EndpointNotLocalError, match=problem):
        check_local_endpoint(endpoint)


def test_the_relay_binds_loopback_tcp_and_connects_to_ipc() -> None:
    """The relay does the opposite of vLLM's publisher: vLLM binds ipc, connects to tcp."""
    assert (True, False) == (relay_binds("tcp://127.0.0.1:5599"), relay_binds("ipc:///run/kv"))


def test_settings_come_from_the_allocations_variables_and_the_engines_key_variable() -> None:
    """NOMAD_IP_kv/NOMAD_PORT_kv set the listener; VLLM_API_KEY the key; the key is hidden."""
    env = {
        "CARAVAN_KV_RELAY_EVENTS_ENDPOINT": "ipc:///alloc/kv.ipc",
        "CARAVAN_KV_RELAY_BLOCK_SIZE": "128",
        "NOMAD_IP_kv": "10.0.0.5",
        "NOMAD_PORT_kv": "23456",
        "VLLM_API_KEY": KEY,
    }
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        settings = RelaySettings()
    assert ("10.0.0.5", 23456, 128, KEY) == (
        settings.host,
        settings.port,
        settings.block_size,
        settings.engine_api_key.get_secret_value(),
    )
    assert KEY not in repr(settings)


def test_an_ipc_path_longer_than_zeromq_takes_is_refused() -> None:
    """A socket path past ZeroMQ's 107 bytes is refused with its length, not at connect."""
    longest = "ipc:///" + "a" * 106
    assert longest == check_local_endpoint(longest)
    with pytest.raises(EndpointNotLocalError, match="108 bytes"):
        check_local_endpoint(longest + "a")


def test_settings_leave_the_block_size_to_the_events_when_unset() -> None:
    """Without CARAVAN_KV_RELAY_BLOCK_SIZE the relay learns the size from the events."""
    settings = RelaySettings.model_validate({"events_endpoint": "ipc:///x", "engine_api_key": KEY})
    assert settings.block_size is None


def test_settings_refuse_a_wildcard_events_endpoint_naming_the_setting() -> None:
    """tcp://* is refused at start, the error naming events_endpoint and never the key."""
    with pytest.raises(ValidationError) as caught:
        RelaySettings.model_validate(
            {"events_endpoint": "tcp://*:5557", "block_size": 16, "engine_api_key": KEY}
        )
    assert ["events_endpoint"] == [error["loc"][0] for error in caught.value.errors()]
    assert KEY not in str(caught.value)


def test_settings_refuse_to_start_without_the_engine_key() -> None:
    """No engine key, no relay: the stream could not be guarded nor the digests keyed."""
    with pytest.raises(ValidationError) as caught:
        RelaySettings.model_validate({"events_endpoint": "ipc:///x", "block_size": 16})
    assert ["CARAVAN_KV_RELAY_ENGINE_API_KEY"] == [e["loc"][0] for e in caught.value.errors()]


def batch(seq: int, *events: object, unknown: int = 0) -> EventBatch:
    return EventBatch(b"t", seq, 0.0, tuple(events), 0, unknown)  # type: ignore[arg-type]


def stored(
    hashes: tuple[int, ...], parent: int | None, tokens: range, **fields: object
) -> BlockStored:
    return BlockStored(hashes, parent, tuple(tokens), BLOCK, **fields)  # type: ignore[arg-type]


def test_events_of_an_offload_medium_or_another_group_are_left_out_and_counted() -> None:
    """The engine's own cache (medium GPU or unset, group 0 or unset) is followed; bytes hashes
    become ints."""
    mapped = relay_events(
        batch(
            0,
            stored((1,), None, range(4), medium="GPU", group_idx=0),
            stored((2,), None, range(4), medium="CPU"),
            stored((3,), None, range(4), group_idx=1),
            BlockRemoved((b"\x00\x05",)),
            BlockRemoved((6,), medium="CPU"),
            AllBlocksCleared(),
            unknown=2,
        )
    )
    assert (
        StoredBlocks((1,), None, tuple(range(4)), BLOCK, None, None),
        RemovedBlocks((5,)),
        ClearedAll(),
    ) == mapped.events
    assert (2, 2, 1) == (mapped.unknown_type, mapped.medium, mapped.group)


def make_hub(*, queue_max: int = 8, max_subscribers: int = 4) -> RelayHub:
    epochs = iter(range(100, 200))
    return RelayHub(
        block_size=BLOCK,
        key=DigestKey.from_secret(KEY),
        max_blocks=1000,
        queue_max=queue_max,
        max_subscribers=max_subscribers,
        metrics=RelayMetrics(CollectorRegistry()),
        new_epoch=lambda: next(epochs),
    )


def read(subscriber: Subscriber) -> list[KvStreamMessage]:
    chunk = subscriber.take()
    return SseDecoder().feed(chunk or b"")


def test_a_router_gets_the_snapshot_then_every_delta_and_heartbeat_in_order() -> None:
    """Subscribing queues the snapshot at once; deltas and heartbeats follow in order."""
    hub = make_hub()
    hub.apply(batch(0, stored((1,), None, range(4))))
    subscriber = hub.subscribe(asyncio.Event(), lambda: None)
    hub.apply(batch(1, stored((2,), 1, range(4, 8))))
    hub.heartbeat()
    key = DigestKey.from_secret(KEY)
    first, second = block_digests(range(8), block_size=BLOCK, key=key)
    assert [
        KvSnapshot(100, 1, BLOCK, frozenset({first})),
        KvDelta(100, 2, BLOCK, (second,), ()),
        KvHeartbeat(100, 2),
    ] == read(subscriber)


def test_a_router_that_falls_behind_is_dropped_not_buffered() -> None:
    """Past queue_max messages the router is cut off (its connection aborted) and forgotten."""
    hub = make_hub(queue_max=3)
    dropped: list[bool] = []
    subscriber = hub.subscribe(asyncio.Event(), lambda: dropped.append(True))
    for _ in range(3):
        hub.heartbeat()
    assert ([True], True, 0, None) == (
        dropped,
        subscriber.overflowed,
        hub.subscriber_count,
        subscriber.take(),
    )


def test_subscribers_past_the_limit_are_refused() -> None:
    """max_subscribers streams at once; the next one is refused (a 503 at the edge)."""
    hub = make_hub(max_subscribers=1)
    hub.subscribe(asyncio.Event(), lambda: None)
    with pytest.raises(TooManySubscribersError):
        hub.subscribe(asyncio.Event(), lambda: None)


def test_losing_the_engine_sends_every_router_an_empty_snapshot_of_a_new_epoch() -> None:
    """engine_lost replaces the state by an empty one of a new epoch and tells the routers."""
    hub = make_hub()
    hub.apply(batch(0, stored((1,), None, range(4))))
    subscriber = hub.subscribe(asyncio.Event(), lambda: None)
    read(subscriber)
    assert hub.engine_lost()
    assert ([KvSnapshot(101, 0, BLOCK, frozenset())], 0) == (read(subscriber), hub.digest_count)
    assert not hub.engine_lost()  # nothing known: nothing to tell


def test_closing_ends_a_stream_after_what_is_queued() -> None:
    """Shutdown: a router gets what was queued, then the end of the stream."""
    hub = make_hub()
    subscriber = hub.subscribe(asyncio.Event(), lambda: None)
    hub.close_all()
    assert [KvSnapshot(100, 0, BLOCK, frozenset())] == read(subscriber)
    assert subscriber.take() is None
