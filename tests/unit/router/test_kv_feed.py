"""The router's KV feed against a scripted relay on loopback: decoding, resyncs, backoff, forget."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp
import pytest
from aiohttp import web
from polling import eventually
from prometheus_client import CollectorRegistry
from router_builders import SERVICE, endpoint_entry, live_for, snapshot_of

from caravan_llm.common.block_digest import BlockDigest
from caravan_llm.common.kv_stream import (
    STREAM_PATH,
    KvDelta,
    KvHeartbeat,
    KvSnapshot,
    encode_delta,
    encode_heartbeat,
    encode_snapshot,
)
from caravan_llm.router.core.endpoints import EndpointSnapshot
from caravan_llm.router.core.kv_index import KvIndex
from caravan_llm.router.core.routing_state import RoutingState, RoutingView
from caravan_llm.router.feeds.kv_feed import KvFeed, next_backoff
from caravan_llm.router.metrics import RouterMetrics

KEY = "sk-engine-key-of-the-model"
BLOCK = 16
WAIT_S = 10.0
A, B, C = BlockDigest(0xA), BlockDigest(0xB), BlockDigest(0xC)


@dataclass
class Connection:
    """One stream a router opened; the test writes its chunks (None ends it)."""

    authorization: str | None
    chunks: asyncio.Queue[bytes | None] = field(default_factory=asyncio.Queue)

    def send(self, *chunks: bytes) -> None:
        for chunk in chunks:
            self.chunks.put_nowait(chunk)

    def close(self) -> None:
        self.chunks.put_nowait(None)


@dataclass
class FakeRelay:
    """A relay on loopback: answers `status`, and streams what the test sends per connection."""

    port: int = 0
    status: int = 200
    connections: list[Connection] = field(default_factory=list)


@pytest.fixture
async def relay() -> AsyncIterator[FakeRelay]:
    fake = FakeRelay()

    async def stream(request: web.Request) -> web.StreamResponse:
        connection = Connection(request.headers.get("Authorization"))
        fake.connections.append(connection)
        if fake.status != 200:
            return web.json_response({"error": {"type": "authentication_error"}}, status=401)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        while (chunk := await connection.chunks.get()) is not None:
            await response.write(chunk)
        return response

    app = web.Application()
    app.router.add_get(STREAM_PATH, stream)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    fake.port = int(runner.addresses[0][1])
    try:
        yield fake
    finally:
        for connection in fake.connections:
            connection.close()
        await runner.cleanup()


class Keys:
    def __init__(self, key: str | None = KEY) -> None:
        self.key = key

    def key_for(self, service: str) -> str | None:
        return self.key if service == SERVICE else None


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def placed(port: int, *ids: str) -> EndpointSnapshot:
    """A snapshot of these endpoints, each with its KV relay on loopback `port`."""
    snapshot = snapshot_of(*(endpoint_entry(i) for i in ids))
    by_id = {
        eid: dataclasses.replace(e, address="127.0.0.1", kv_port=port)
        for eid, e in snapshot.by_id.items()
    }
    return dataclasses.replace(snapshot, by_id=by_id)


@dataclass
class Feed:
    state: RoutingState
    feed: KvFeed
    registry: CollectorRegistry
    clock: Clock

    def swap(self, snapshot: EndpointSnapshot) -> None:
        self.state.swap(RoutingView(snapshot=snapshot), live_for(snapshot), synced=True)

    def metric(self, name: str, **labels: str) -> float | None:
        return self.registry.get_sample_value(name, labels)

    def held(self, replica: str) -> int | None:
        """How many of A, B, C the index says the replica holds in chain order (None: not live)."""
        return self.state.kv.cached_blocks(replica, [A, B, C], block_size=BLOCK, now=self.clock())


@contextlib.asynccontextmanager
async def running_feed(keys: Keys | None = None, **options: float) -> AsyncIterator[Feed]:
    clock = Clock()
    registry = CollectorRegistry()
    state = RoutingState(KvIndex(stale_after_s=options.pop("stale_after_s", 5.0)))
    async with aiohttp.ClientSession() as session:
        feed = KvFeed(
            lambda: session,
            state,
            engine_keys=keys if keys is not None else Keys(),
            metrics=RouterMetrics(registry),
            stale_after_s=5.0,
            backoff_min_s=options.pop("backoff_min_s", 0.01),
            backoff_max_s=options.pop("backoff_max_s", 0.05),
            clock=clock,
            rng=random.Random(3),
        )
        task = asyncio.create_task(feed.run())
        try:
            yield Feed(state, feed, registry, clock)
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def snapshot_event(epoch: int, seq: int, *digests: BlockDigest) -> bytes:
    return encode_snapshot(
        KvSnapshot(epoch=epoch, seq=seq, block_size=BLOCK, digests=frozenset(digests))
    )


def delta_event(
    epoch: int, seq: int, added: tuple[BlockDigest, ...], removed: tuple[BlockDigest, ...] = ()
) -> bytes:
    return encode_delta(
        KvDelta(epoch=epoch, seq=seq, block_size=BLOCK, added=added, removed=removed)
    )


async def connection(relay: FakeRelay, count: int) -> Connection:
    """The relay's `count`-th connection, once the router opened it."""
    await eventually(lambda: len(relay.connections) >= count, WAIT_S, f"connection {count}")
    return relay.connections[count - 1]


def test_backoff_doubles_from_the_minimum_up_to_the_maximum() -> None:
    """None starts at the minimum; each failure doubles it, never past the maximum."""
    delays: list[float] = []
    delay = None
    for _ in range(6):
        delay = next_backoff(delay, low=0.5, high=3.0)
        delays.append(delay)
    assert [0.5, 1.0, 2.0, 3.0, 3.0, 3.0] == delays


async def test_snapshot_then_deltas_build_the_set_and_each_delta_is_one_event(
    relay: FakeRelay,
) -> None:
    """The index follows the stream, read with the engine key; deltas count, heartbeats don't."""
    async with running_feed() as feed:
        feed.swap(placed(relay.port, "e0"))
        first = await connection(relay, 1)
        # Split mid-line: the decoder takes any chunking.
        data = snapshot_event(7, 3, A) + delta_event(7, 4, (B,)) + delta_event(7, 5, (C,))
        first.send(data[:10], data[10:])
        first.send(encode_heartbeat(KvHeartbeat(epoch=7, seq=5)))
        await eventually(lambda: feed.held("e0") == 3, WAIT_S, "three blocks held")
        events = feed.metric("caravan_router_kv_events_total", endpoint="e0")
        resyncs = feed.metric("caravan_router_kv_resyncs_total", reason="reconnect")

    assert f"Bearer {KEY}" == first.authorization
    assert (2.0, None) == (events, resyncs)


async def test_a_gap_drops_the_set_and_a_new_connection_resyncs(relay: FakeRelay) -> None:
    """A skipped seq: counted as a gap, the set is dropped, the feed reconnects for a snapshot."""
    async with running_feed() as feed:
        feed.swap(placed(relay.port, "e0"))
        first = await connection(relay, 1)
        first.send(snapshot_event(7, 3, A, B))
        await eventually(lambda: feed.held("e0") == 2, WAIT_S, "synced")
        first.send(delta_event(7, 5, (C,)))  # seq 4 never came
        second = await connection(relay, 2)
        held_between = feed.held("e0")
        second.send(snapshot_event(7, 5, A, B, C))
        await eventually(lambda: feed.held("e0") == 3, WAIT_S, "resynced")
        gaps = feed.metric("caravan_router_kv_resyncs_total", reason="gap")
        reconnects = feed.metric("caravan_router_kv_resyncs_total", reason="reconnect")
        failures = feed.metric("caravan_router_kv_stream_failures_total", reason="gap")

    assert held_between is None
    assert (1.0, 1.0, 1.0) == (gaps, reconnects, failures)


async def test_a_lost_stream_is_forgotten_at_once_and_reconnected(relay: FakeRelay) -> None:
    """The relay closing the stream drops the replica to the approximate index at once."""
    async with running_feed(backoff_min_s=0.3, backoff_max_s=0.3) as feed:
        feed.swap(placed(relay.port, "e0"))
        first = await connection(relay, 1)
        first.send(snapshot_event(7, 3, A))
        await eventually(lambda: feed.held("e0") == 1, WAIT_S, "synced")
        first.close()
        await eventually(
            lambda: feed.state.kv.state("e0", feed.clock()) == "absent", WAIT_S, "forgotten"
        )
        lost = feed.metric("caravan_router_kv_stream_failures_total", reason="lost")
        second = await connection(relay, 2)
        second.send(snapshot_event(8, 0))
        await eventually(lambda: feed.held("e0") == 0, WAIT_S, "synced again, empty")

    assert 1.0 == lost


async def test_a_new_epoch_inside_the_stream_is_adopted_and_counted(relay: FakeRelay) -> None:
    """The relay's engine restarted: its empty snapshot of a new epoch replaces the set."""
    async with running_feed() as feed:
        feed.swap(placed(relay.port, "e0"))
        first = await connection(relay, 1)
        first.send(snapshot_event(7, 3, A, B))
        await eventually(lambda: feed.held("e0") == 2, WAIT_S, "synced")
        first.send(snapshot_event(9, 0), delta_event(9, 1, (A,)))
        await eventually(lambda: feed.held("e0") == 1, WAIT_S, "the new epoch's set")
        resyncs = feed.metric("caravan_router_kv_resyncs_total", reason="new_epoch")

        position = feed.state.kv.position("e0")

    assert ((9, 1), 1.0) == (position, resyncs)


async def test_a_silent_stream_goes_stale_by_the_injected_clock(relay: FakeRelay) -> None:
    """No message for the stale bound: the replica falls back to the approximate index."""
    async with running_feed() as feed:
        feed.swap(placed(relay.port, "e0"))
        first = await connection(relay, 1)
        first.send(snapshot_event(7, 3, A))
        await eventually(lambda: feed.held("e0") == 1, WAIT_S, "synced")
        feed.clock.now += 5.5
        stale = feed.held("e0")
        first.send(encode_heartbeat(KvHeartbeat(epoch=7, seq=3)))
        await eventually(lambda: feed.held("e0") == 1, WAIT_S, "live again after a heartbeat")

    assert stale is None


async def test_a_refused_stream_is_retried_with_backoff_and_never_applied(
    relay: FakeRelay,
) -> None:
    """A 401 is counted as refused and retried; nothing is believed meanwhile."""
    relay.status = 401
    async with running_feed() as feed:
        feed.swap(placed(relay.port, "e0"))
        await connection(relay, 3)
        refused = feed.metric("caravan_router_kv_stream_failures_total", reason="refused")
        state = feed.state.kv.state("e0", feed.clock())

    assert refused is not None
    assert refused >= 2
    assert "absent" == state


async def test_without_the_models_engine_key_the_stream_is_not_read(
    relay: FakeRelay, caplog: pytest.LogCaptureFixture
) -> None:
    """No key: no connection (the relay would refuse it, and digests could not match)."""
    keys = Keys(key=None)
    caplog.set_level(logging.INFO, logger="router.kv_feed")
    async with running_feed(keys) as feed:
        feed.swap(placed(relay.port, "e0"))
        await eventually(
            lambda: any(r.msg == "kv_stream_no_engine_key" for r in caplog.records),
            WAIT_S,
            "the reader found no key",
        )
        before = len(relay.connections)
        keys.key = KEY
        first = await connection(relay, 1)

    assert 0 == before
    assert f"Bearer {KEY}" == first.authorization


async def test_a_replica_leaving_the_view_is_forgotten_and_its_reader_stopped(
    relay: FakeRelay,
) -> None:
    """Discovery drops the endpoint: its set, its reader and its events series go."""
    async with running_feed() as feed:
        feed.swap(placed(relay.port, "e0", "e1"))
        first = await connection(relay, 1)
        second = await connection(relay, 2)
        for conn in (first, second):
            conn.send(snapshot_event(7, 3, A), delta_event(7, 4, (B,)))
        await eventually(
            lambda: feed.held("e0") == 2 and feed.held("e1") == 2, WAIT_S, "both synced"
        )
        feed.swap(placed(relay.port, "e1"))
        await eventually(lambda: feed.feed.followed == {"e1"}, WAIT_S, "e0's reader stopped")
        replicas = feed.state.kv.replicas()
        events = (
            feed.metric("caravan_router_kv_events_total", endpoint="e0"),
            feed.metric("caravan_router_kv_events_total", endpoint="e1"),
        )

    assert frozenset({"e1"}) == replicas
    assert (None, 1.0) == events


async def test_a_malformed_stream_is_dropped_and_counted(relay: FakeRelay) -> None:
    """Data the codec refuses ends the connection (counted malformed); nothing half-applied."""
    async with running_feed() as feed:
        feed.swap(placed(relay.port, "e0"))
        first = await connection(relay, 1)
        first.send(snapshot_event(7, 3, A), b"event: delta\ndata: {not json}\n\n")
        await connection(relay, 2)
        malformed = feed.metric("caravan_router_kv_stream_failures_total", reason="malformed")

    assert 1.0 == malformed
