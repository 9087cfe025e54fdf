"""The relay's core between the engine and the routers: its state, and one queue per router.

`RelayHub` applies engine batches to the relay state (`state.RelayState`),
encodes each resulting delta once (`caravan_llm.common.kv_stream`) and queues
the bytes for every subscribed router. A router that subscribes gets the
snapshot first, queued in the same step as its registration, so it misses
no delta. Heartbeats go through the same queues, so a heartbeat never
overtakes a delta it would contradict.

Queues are bounded (`queue_max` messages): a router that falls that far
behind is dropped (`on_overflow`, which closes its connection) instead of
growing the relay's memory; it reconnects and starts from a fresh snapshot.

When the engine goes away (its publisher disconnects: it stopped or
restarted, and its cache with it) the hub replaces its state by an empty one
of a new epoch and queues that snapshot to every router at once: they drop
the replica's blocks within one event-loop turn of ZeroMQ reporting it.

No I/O and no clock; asyncio only for waking the writers. One event loop.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import TYPE_CHECKING

from caravan_llm.common.kv_stream import encode_delta, encode_heartbeat, encode_snapshot
from caravan_llm.kvrelay.events import relay_events
from caravan_llm.kvrelay.state import Applied, RelayState

if TYPE_CHECKING:
    import asyncio
    from collections.abc import Callable

    from caravan_llm.common.block_digest import DigestKey
    from caravan_llm.kvrelay.metrics import RelayMetrics
    from caravan_llm.kvrelay.state import StreamPosition
    from caravan_llm.kvrelay.wire import EventBatch

log = logging.getLogger(__name__)


class TooManySubscribersError(Exception):
    """The relay serves `max_subscribers` streams already; retryable (try again later)."""

    retryable = True


class Subscriber:
    """One router's stream: the encoded events queued for it, in order."""

    __slots__ = ("_max", "_on_overflow", "_queue", "_wake", "closed", "overflowed")

    def __init__(
        self, queue_max: int, wake: asyncio.Event, on_overflow: Callable[[], None]
    ) -> None:
        self._queue: deque[bytes] = deque()
        self._max = queue_max
        self._wake = wake
        self._on_overflow = on_overflow
        self.closed = False
        self.overflowed = False

    def push(self, message: bytes) -> None:
        if self.closed:
            return
        if len(self._queue) >= self._max:
            self.overflowed = True
            self.closed = True
            self._queue.clear()
            self._wake.set()
            self._on_overflow()
            return
        self._queue.append(message)
        self._wake.set()

    def close(self) -> None:
        """End the stream after what is queued (the relay is shutting down)."""
        self.closed = True
        self._wake.set()

    def take(self) -> bytes | None:
        """Everything queued, joined; None once the stream is over (closed and drained)."""
        self._wake.clear()
        if self.overflowed:
            return None
        if self._queue:
            chunk = b"".join(self._queue)
            self._queue.clear()
            return chunk
        return None if self.closed else b""

    async def next(self) -> bytes | None:
        """The next bytes to write (waits for some); None once the stream is over."""
        while True:
            chunk = self.take()
            if chunk is None or chunk:
                return chunk
            await self._wake.wait()


class RelayHub:
    """The relay state and the routers following it."""

    def __init__(
        self,
        *,
        block_size: int | None,
        key: DigestKey,
        max_blocks: int,
        queue_max: int,
        max_subscribers: int,
        metrics: RelayMetrics,
        new_epoch: Callable[[], int],
    ) -> None:
        self._block_size = block_size
        self._key = key
        self._max_blocks = max_blocks
        self._queue_max = queue_max
        self._max_subscribers = max_subscribers
        self._metrics = metrics
        self._new_epoch = new_epoch
        self._state = self._fresh_state()
        self._digest_count = 0
        self._subscribers: set[Subscriber] = set()
        # The encoded snapshot of the current position, shared by routers joining there.
        self._snapshot: tuple[StreamPosition, bytes] | None = None

    def _fresh_state(self) -> RelayState:
        return RelayState(
            epoch=self._new_epoch(),
            block_size=self._block_size,
            key=self._key,
            max_blocks=self._max_blocks,
        )

    @property
    def position(self) -> StreamPosition:
        return self._state.position

    @property
    def next_engine_seq(self) -> int | None:
        return self._state.next_engine_seq

    @property
    def digest_count(self) -> int:
        return self._digest_count

    @property
    def subscriber_count(self) -> int:
        return len(self._subscribers)

    def apply(self, batch: EventBatch) -> Applied:
        """Apply one engine batch and queue its delta (if any) to every router."""
        mapped = relay_events(batch)
        metrics = self._metrics
        for reason, count in (
            ("unknown_type", mapped.unknown_type),
            ("medium", mapped.medium),
            ("group", mapped.group),
        ):
            if count:
                metrics.skipped_events.labels(reason).inc(count)
        before = self._state.counters
        applied = self._state.apply(batch.seq, mapped.events)
        metrics.count_state(before, self._state.counters)
        if applied.reset is not None:
            metrics.resyncs.labels(applied.reset).inc()
            log.warning("kv_relay_resync", extra={"reason": applied.reset})
            self._digest_count = 0
        delta = applied.delta
        if delta is not None:
            self._digest_count += len(delta.added) - len(delta.removed)
            metrics.digests.set(self._digest_count)
            self._broadcast(encode_delta(delta))
        return applied

    def engine_lost(self) -> bool:
        """The engine's publisher went away: start an empty epoch and tell every router.

        False (nothing done) when the state knows nothing yet.
        """
        if self._state.next_engine_seq is None and self._digest_count == 0:
            return False
        self._state = self._fresh_state()
        self._digest_count = 0
        self._metrics.resyncs.labels("engine_lost").inc()
        self._metrics.digests.set(0)
        log.warning("kv_relay_resync", extra={"reason": "engine_lost"})
        self._broadcast(self._encoded_snapshot())
        return True

    def heartbeat(self) -> None:
        """Queue a heartbeat at the current position to every router."""
        if self._subscribers:
            self._broadcast(encode_heartbeat(self._state.position))

    def subscribe(self, wake: asyncio.Event, on_overflow: Callable[[], None]) -> Subscriber:
        """A new router's stream, the snapshot queued first.

        Raises TooManySubscribersError at `max_subscribers`.
        """
        if len(self._subscribers) >= self._max_subscribers:
            raise TooManySubscribersError
        subscriber = Subscriber(self._queue_max, wake, on_overflow)
        subscriber.push(self._encoded_snapshot())
        self._subscribers.add(subscriber)
        self._metrics.subscribers.set(len(self._subscribers))
        return subscriber

    def unsubscribe(self, subscriber: Subscriber) -> None:
        self._subscribers.discard(subscriber)
        self._metrics.subscribers.set(len(self._subscribers))

    def close_all(self) -> None:
        """End every stream after what is queued (shutdown)."""
        for subscriber in self._subscribers:
            subscriber.close()

    def _encoded_snapshot(self) -> bytes:
        position = self._state.position
        cached = self._snapshot
        if cached is not None and cached[0] == position:
            return cached[1]
        encoded = encode_snapshot(self._state.snapshot())
        self._snapshot = (position, encoded)
        return encoded

    def _broadcast(self, message: bytes) -> None:
        overflowed = []
        for subscriber in self._subscribers:
            subscriber.push(message)
            if subscriber.overflowed:
                overflowed.append(subscriber)
        for subscriber in overflowed:
            self._metrics.subscriber_overflows.inc()
            log.warning("kv_relay_subscriber_overflow", extra={"queued": self._queue_max})
            self.unsubscribe(subscriber)
