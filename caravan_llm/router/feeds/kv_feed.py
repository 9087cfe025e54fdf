"""The KV feed: each replica's KV relay stream, read into the router's exact prefix index.

    discovery swap --> reconcile: one reader task per endpoint with a `kv_port`
    reader: GET http://<address>:<kv_port>/v1/kv/stream  (Bearer <the model's engine key>)
            SseDecoder -> snapshot / delta / heartbeat -> RoutingState.kv (KvIndex)

A replica's relay (caravan_llm/kvrelay) names the blocks its engine holds by
keyed digests and serves them as a stream: a snapshot, then one delta per
engine batch, and heartbeats (`caravan_llm.common.kv_stream`). Only endpoints
whose placement carries a `kv_port` are read, at the address Nomad allocated
(`core/endpoints.py`); an endpoint that leaves the view is forgotten at once.

**Resync.** The index (`core/kv_index.py`) detects a sequence gap and a new
epoch. The feed acts on them: a gap ends the connection (the relay sends a
snapshot only to a stream that starts, so a fresh connection is the resync);
a new epoch is adopted as the index says. A connection that ends for any
reason drops the replica's set before the next one starts: a router never
believes what a replica held while it could not hear it, and its requests
use the approximate index meanwhile. Nothing heard for `stale_after_s` (the
relay heartbeats every 2 s by default) ends the connection too, and the index
already calls the replica stale by then. Each resync is counted
(`caravan_router_kv_resyncs_total{reason}`), each failed connection
(`caravan_router_kv_stream_failures_total{reason}`), each applied delta
(`caravan_router_kv_events_total{endpoint}`).

**Backoff.** A failed connection is retried after a bounded exponential
backoff with jitter (`backoff_min_s` doubling to `backoff_max_s`), reset
once a connection delivered its snapshot; a gap reconnects after the
smallest step. A model whose engine key the router does not hold (yet) is
not read: the relay would refuse it, and its digests could not be matched.

Never logged: digests, the engine key, headers, URLs' credentials (there are none).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from caravan_llm.common.kv_stream import (
    CONTENT_TYPE,
    STREAM_PATH,
    KvDelta,
    KvHeartbeat,
    KvSnapshot,
    KvStreamError,
    KvStreamMessage,
    SseDecoder,
)
from caravan_llm.router.core.routing_state import RoutingState
from caravan_llm.router.feeds.engine_keys import EngineKeySource
from caravan_llm.router.metrics import KvResyncReason, KvStreamFailure, RouterMetrics

# Named like the other feeds' loggers: the logger is a field of every log line.
log = logging.getLogger("router.kv_feed")

DEFAULT_BACKOFF_MIN_S = 0.5
DEFAULT_BACKOFF_MAX_S = 10.0


def next_backoff(previous: float | None, *, low: float, high: float) -> float:
    """The next reconnect delay before jitter: `low` first, then doubling up to `high`."""
    if previous is None:
        return low
    return min(high, max(low, previous * 2.0))


@dataclass(frozen=True, slots=True)
class StreamTarget:
    """Where one replica's stream is read, and whose key reads it."""

    url: str  # the relay's base URL (placed address, kv port)
    service: str  # the model's service name: the engine key's name


@dataclass(slots=True)
class _Connection:
    """What one connection has done so far (for the resync and failure counts)."""

    # Whether this replica's stream was in sync on an earlier connection.
    was_synced: bool
    responded: bool = False
    snapshots: int = 0
    gap: bool = False


@dataclass(slots=True)
class _Reader:
    target: StreamTarget
    task: asyncio.Task[None]
    # Sync on an earlier connection (a later snapshot is a `reconnect` resync).
    was_synced: bool = False
    # Said once: its model has no engine key here; failing in a row: logged at debug.
    no_key_logged: bool = False
    failing: bool = False


class KvFeed:
    """Follows every placed replica's digest stream into `state.kv`; `run()` until cancelled."""

    def __init__(
        self,
        session: Callable[[], aiohttp.ClientSession],
        state: RoutingState,
        *,
        engine_keys: EngineKeySource | None,
        metrics: RouterMetrics,
        stale_after_s: float,
        connect_timeout_s: float = 2.0,
        backoff_min_s: float = DEFAULT_BACKOFF_MIN_S,
        backoff_max_s: float = DEFAULT_BACKOFF_MAX_S,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        if not 0 < backoff_min_s <= backoff_max_s:
            raise ValueError(
                f"backoff must satisfy 0 < min <= max, got {backoff_min_s}, {backoff_max_s}"
            )
        self._session = session
        self._state = state
        self._keys = engine_keys
        self._metrics = metrics
        self._stale_after_s = stale_after_s
        self._connect_timeout_s = connect_timeout_s
        self._backoff_min_s = backoff_min_s
        self._backoff_max_s = backoff_max_s
        self._clock = clock
        self._rng = rng or random.Random()
        self._readers: dict[str, _Reader] = {}
        self._changed = asyncio.Event()
        self._group: asyncio.TaskGroup | None = None
        state.subscribe(self._changed.set)

    @property
    def followed(self) -> frozenset[str]:
        """The endpoint ids whose stream a reader follows now."""
        return frozenset(self._readers)

    async def run(self) -> None:
        async with asyncio.TaskGroup() as group:
            self._group = group
            try:
                while True:
                    self._changed.clear()
                    self.reconcile()
                    await self._changed.wait()
            finally:
                self._group = None
                for endpoint_id in list(self._readers):
                    self._stop(endpoint_id)

    def reconcile(self) -> None:
        """Start a reader for each endpoint with a relay, stop those of endpoints gone."""
        desired = {
            endpoint.id: StreamTarget(url=endpoint.kv_url, service=endpoint.service)
            for endpoint in self._state.view.snapshot.by_id.values()
            if endpoint.kv_url is not None
        }
        for endpoint_id, reader in list(self._readers.items()):
            if desired.get(endpoint_id) != reader.target:
                self._stop(endpoint_id)
        group = self._group
        if group is not None:
            for endpoint_id, target in desired.items():
                if endpoint_id not in self._readers:
                    task = group.create_task(
                        self._follow(endpoint_id), name=f"kv-feed-{endpoint_id}"
                    )
                    self._readers[endpoint_id] = _Reader(target, task)
        self._state.kv.retain(self._readers.keys())

    def _stop(self, endpoint_id: str) -> None:
        reader = self._readers.pop(endpoint_id)
        reader.task.cancel()
        self._state.kv.forget(endpoint_id)
        with contextlib.suppress(KeyError):
            self._metrics.kv_events.remove(endpoint_id)

    # -- one replica ----------------------------------------------------------------------

    async def _follow(self, endpoint_id: str) -> None:
        backoff: float | None = None
        while True:
            reader = self._readers.get(endpoint_id)
            if reader is None:  # pragma: no cover - stopped readers are cancelled first
                return
            key = None if self._keys is None else self._keys.key_for(reader.target.service)
            if key is None:
                if not reader.no_key_logged:
                    log.info("kv_stream_no_engine_key", extra={"endpoint": endpoint_id})
                    reader.no_key_logged = True
            else:
                connection = _Connection(was_synced=reader.was_synced)
                try:
                    failure = await self._read_once(endpoint_id, reader.target, key, connection)
                except asyncio.CancelledError:
                    raise
                except Exception:
                    # The reader's boundary: a bug costs this replica its exact index
                    # until the next connection, never the router.
                    log.exception("kv_stream_failed", extra={"endpoint": endpoint_id})
                    failure = KvStreamFailure.LOST
                # Whatever ended the connection, what the replica holds is unknown now.
                self._state.kv.forget(endpoint_id)
                reader.was_synced = reader.was_synced or connection.snapshots > 0
                self._metrics.kv_stream_failures.labels(failure.value).inc()
                self._log_failure(endpoint_id, failure, reader, synced=connection.snapshots > 0)
                if connection.snapshots > 0:
                    backoff = None
                if failure is KvStreamFailure.GAP:
                    backoff = None
            backoff = next_backoff(backoff, low=self._backoff_min_s, high=self._backoff_max_s)
            await asyncio.sleep(backoff * self._rng.uniform(0.5, 1.0))

    async def _read_once(
        self, endpoint_id: str, target: StreamTarget, key: str, connection: _Connection
    ) -> KvStreamFailure:
        """Read one connection of the stream into the index until it ends; how it ended."""
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=self._connect_timeout_s, sock_read=self._stale_after_s
        )
        headers = {"Authorization": f"Bearer {key}", "Accept": CONTENT_TYPE}
        try:
            async with self._session().get(
                target.url + STREAM_PATH, headers=headers, timeout=timeout, allow_redirects=False
            ) as response:
                connection.responded = True
                if response.status != 200:
                    log.debug(
                        "kv_stream_refused",
                        extra={"endpoint": endpoint_id, "status": response.status},
                    )
                    return KvStreamFailure.REFUSED
                decoder = SseDecoder()
                async for chunk in response.content.iter_any():
                    for message in decoder.feed(chunk):
                        self._apply(endpoint_id, message, connection)
                        if connection.gap:
                            return KvStreamFailure.GAP
                return KvStreamFailure.LOST
        except KvStreamError:
            return KvStreamFailure.MALFORMED
        except (aiohttp.ServerTimeoutError, TimeoutError):
            return KvStreamFailure.SILENT if connection.responded else KvStreamFailure.CONNECT
        except (aiohttp.ClientError, OSError):
            return KvStreamFailure.LOST if connection.responded else KvStreamFailure.CONNECT

    def _apply(self, endpoint_id: str, message: KvStreamMessage, connection: _Connection) -> None:
        """One message of the stream into the index; counts events and resyncs."""
        kv = self._state.kv
        now = self._clock()
        match message:
            case KvSnapshot():
                kv.apply_snapshot(endpoint_id, message, now)
                if connection.snapshots == 0:
                    log.info(
                        "kv_stream_synced",
                        extra={"endpoint": endpoint_id, "blocks": kv.digest_count(endpoint_id)},
                    )
                if connection.snapshots > 0:
                    # A snapshot inside a stream: the relay reset (its engine went away).
                    self._resynced(KvResyncReason.NEW_EPOCH)
                elif connection.was_synced:
                    self._resynced(KvResyncReason.RECONNECT)
                connection.snapshots += 1
            case KvDelta():
                result = kv.apply_delta(endpoint_id, message, now)
                if result in ("applied", "new_epoch"):
                    self._metrics.kv_events.labels(endpoint_id).inc()
                if result == "new_epoch" and connection.snapshots > 0:
                    self._resynced(KvResyncReason.NEW_EPOCH)
                elif result == "gap":
                    self._resynced(KvResyncReason.GAP)
                    connection.gap = True
            case KvHeartbeat():
                if kv.heartbeat(endpoint_id, message, now) == "gap":
                    self._resynced(KvResyncReason.GAP)
                    connection.gap = True

    def _resynced(self, reason: KvResyncReason) -> None:
        self._metrics.kv_resyncs.labels(reason.value).inc()

    @staticmethod
    def _log_failure(
        endpoint_id: str, failure: KvStreamFailure, reader: _Reader, *, synced: bool
    ) -> None:
        # A warning when a stream that worked ends, or on the first failure in a
        # row; a relay that stays away gets debug lines only.
        fields = {"endpoint": endpoint_id, "reason": failure.value}
        if synced or not reader.failing:
            log.warning("kv_stream_ended", extra=fields)
        else:
            log.debug("kv_stream_ended", extra=fields)
        reader.failing = not synced
