"""The KV relay process: an engine's KV events in (inside the allocation), digests out (to routers).

Wiring over `hub.RelayHub` (the pure part): a ZeroMQ SUB socket on the
engine's KV-event endpoint, the engine's replay socket for gaps, and an
aiohttp server with

- `GET /v1/kv/stream`: the digest stream (`caravan_llm.common.kv_stream`),
  for callers with `Authorization: Bearer <engine key>` (compared in constant
  time; anything else is a 401 in OpenAI's error shape);
- `GET /health`: 200 while the process serves (and whether the engine's
  publisher is connected);
- `GET /metrics`: Prometheus text (`metrics.RelayMetrics`).

**The engine's frames.** The SUB socket connects to an `ipc://` endpoint (the
engine binds) or binds a loopback `tcp://` one (the engine connects); the
settings refuse anything else. Each frame is decoded (`wire.decode_frame`;
a bad one is counted and skipped: the next batch shows the gap) and applied.
When a batch skips sequence numbers and a replay endpoint is set, the relay
asks it for the missing ones first (`replay_timeout_s`); if it cannot get
them all, the state starts a new epoch (`state.RelayState`).

**The engine going away.** A socket monitor reports the publisher's
disconnect (its process stopped: for ipc the kernel closes the socket at
once); frames already received are applied first, then the hub starts an
empty epoch and sends every router that snapshot (`hub.RelayHub.engine_lost`).
If the disconnect went unseen, the restarted engine's first batch (seq 0,
lower than expected) resets the state just the same.

Nothing here logs a token id, a digest or the key.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import secrets
import signal
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

import zmq
import zmq.asyncio
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from zmq.utils.monitor import parse_monitor_message

from caravan_llm.common.block_digest import DigestKey
from caravan_llm.common.kv_stream import CONTENT_TYPE, STREAM_PATH
from caravan_llm.common.log_format import configure_logging
from caravan_llm.kvrelay.hub import RelayHub, TooManySubscribersError
from caravan_llm.kvrelay.metrics import RelayMetrics
from caravan_llm.kvrelay.settings import relay_binds
from caravan_llm.kvrelay.wire import (
    EventBatch,
    KvWireError,
    decode_frame,
    decode_replay_frame,
    replay_request,
)

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Sequence

    from caravan_llm.kvrelay.settings import RelaySettings

log = logging.getLogger(__name__)

_EPOCH_BITS = 63
# The engine's publisher keeps up to 100000 batches queued (vLLM's `hwm`); so may we.
_RCVHWM = 100_000
_SHUTDOWN_TIMEOUT_S = 5.0
_MONITORED = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_MONITOR_STOPPED


class RelayStartError(Exception):
    """The relay cannot open its engine socket or its listener; not retryable as configured."""

    retryable = False


def _readable(socket: zmq.asyncio.Socket) -> bool:
    events = socket.get(zmq.EVENTS)
    return isinstance(events, int) and bool(events & zmq.POLLIN)


def _random_epoch() -> int:
    return secrets.randbelow(2**_EPOCH_BITS)


def _error(status: int, message: str, error_type: str, code: str) -> web.Response:
    body = {"error": {"message": message, "type": error_type, "param": None, "code": code}}
    return web.json_response(body, status=status)


class KvRelay:
    """One relay: the engine subscription, the routers' streams, the heartbeat."""

    def __init__(
        self,
        settings: RelaySettings,
        *,
        registry: CollectorRegistry,
        new_epoch: Callable[[], int] = _random_epoch,
    ) -> None:
        self.settings = settings
        self.registry = registry
        self.metrics = RelayMetrics(registry)
        secret = settings.engine_api_key.get_secret_value()
        self._expected_auth = f"Bearer {secret}".encode()
        self.hub = RelayHub(
            block_size=settings.block_size,
            key=DigestKey.from_secret(secret),
            max_blocks=settings.max_blocks,
            queue_max=settings.subscriber_queue_max,
            max_subscribers=settings.max_subscribers,
            metrics=self.metrics,
            new_epoch=new_epoch,
        )
        self._topic = settings.topic.encode()
        self.engine_connected = False

    def __repr__(self) -> str:
        return f"KvRelay({self.hub.position}, {self.hub.subscriber_count} subscribers)"

    # -- the engine side ---------------------------------------------------------------

    async def follow_engine(self, context: zmq.asyncio.Context, ready: asyncio.Event) -> None:
        """Read the engine's frames until cancelled; `ready` is set once the socket is open."""
        endpoint = self.settings.events_endpoint
        sub = context.socket(zmq.SUB)
        monitor = sub.get_monitor_socket(_MONITORED)
        try:
            sub.setsockopt(zmq.SUBSCRIBE, self._topic)
            sub.setsockopt(zmq.RCVHWM, _RCVHWM)
            try:
                if relay_binds(endpoint):
                    sub.bind(endpoint)
                else:
                    sub.connect(endpoint)
            except zmq.ZMQError as exc:
                raise RelayStartError(f"events_endpoint: cannot open the socket: {exc}") from None
            ready.set()
            poller = zmq.asyncio.Poller()
            poller.register(sub, zmq.POLLIN)
            poller.register(monitor, zmq.POLLIN)
            while True:
                await poller.poll()
                # Frames first: what arrived before a disconnect belongs to the old engine.
                await self._drain_frames(context, sub)
                while _readable(monitor):
                    self._on_monitor_event(await monitor.recv_multipart())
        finally:
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)

    async def _drain_frames(self, context: zmq.asyncio.Context, sub: zmq.asyncio.Socket) -> None:
        while _readable(sub):
            batch = self.decoded(await sub.recv_multipart())
            if batch is not None:
                await self._apply(context, batch)

    def decoded(self, parts: Sequence[bytes]) -> EventBatch | None:
        """The frame's batch when it is one of our topic; a bad frame is counted and logged."""
        try:
            batch = decode_frame(parts)
        except KvWireError as exc:
            self.metrics.decode_errors.inc()
            log.warning("kv_relay_bad_frame", extra={"error": str(exc)[:200]})
            return None
        if batch.topic != self._topic:
            return None  # a longer topic with ours as its prefix (SUB filters by prefix)
        return batch

    def _on_monitor_event(self, message: list[bytes]) -> None:
        event = parse_monitor_message(message)["event"]
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.engine_connected = True
            self.metrics.engine_connected.set(1)
            log.info("kv_relay_engine_connected")
        elif event == zmq.EVENT_DISCONNECTED:
            self.engine_connected = False
            self.metrics.engine_connected.set(0)
            log.info("kv_relay_engine_disconnected")
            self.hub.engine_lost()

    async def _apply(self, context: zmq.asyncio.Context, batch: EventBatch) -> None:
        expected = self.hub.next_engine_seq
        if (
            expected is not None
            and batch.seq > expected
            and self.settings.replay_endpoint is not None
        ):
            missing = await self._replay(
                context, self.settings.replay_endpoint, expected, batch.seq
            )
            for replayed in missing:
                self.hub.apply(replayed)
            outcome = "filled" if len(missing) == batch.seq - expected else "failed"
            self.metrics.replays.labels(outcome).inc()
            log.info("kv_relay_replay", extra={"outcome": outcome, "batches": len(missing)})
        self.hub.apply(batch)

    async def _replay(
        self, context: zmq.asyncio.Context, endpoint: str, start: int, stop: int
    ) -> list[EventBatch]:
        """The batches `start`, `start + 1`, ... (before `stop`) the replay socket has, in order."""
        dealer = context.socket(zmq.DEALER)
        got: list[EventBatch] = []
        try:
            dealer.connect(endpoint)
            async with asyncio.timeout(self.settings.replay_timeout_s):
                await dealer.send_multipart(replay_request(start))
                while True:
                    replayed = decode_replay_frame(await dealer.recv_multipart(), topic=self._topic)
                    if replayed is None:
                        break
                    if replayed.seq == start + len(got) and replayed.seq < stop:
                        got.append(replayed)
        except (TimeoutError, KvWireError, zmq.ZMQError) as exc:
            log.warning("kv_relay_replay_failed", extra={"error": type(exc).__name__})
        finally:
            dealer.close(linger=0)
        return got

    async def heartbeats(self) -> None:
        """Queue a heartbeat to every router each `heartbeat_interval_s`, until cancelled."""
        while True:
            await asyncio.sleep(self.settings.heartbeat_interval_s)
            self.hub.heartbeat()

    # -- the routers' side -------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get(STREAM_PATH, self._stream)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.on_shutdown.append(self._end_streams)
        return app

    def authorized(self, header: str | None) -> bool:
        """Whether an Authorization header carries the engine key (constant time)."""
        return header is not None and hmac.compare_digest(
            header.encode("utf-8", "surrogateescape"), self._expected_auth
        )

    async def _stream(self, request: web.Request) -> web.StreamResponse:
        if not self.authorized(request.headers.get("Authorization")):
            self.metrics.unauthorized.inc()
            refusal = _error(
                401,
                "the digest stream needs the model's engine key: Authorization: Bearer <key>",
                "authentication_error",
                "invalid_api_key",
            )
            refusal.headers["WWW-Authenticate"] = "Bearer"
            return refusal
        transport = request.transport
        wake = asyncio.Event()

        def drop() -> None:
            # The router fell too far behind: cut the connection, even mid-write.
            if transport is not None:
                transport.abort()

        try:
            subscriber = self.hub.subscribe(wake, drop)
        except TooManySubscribersError:
            return _error(
                503,
                f"the relay serves {self.settings.max_subscribers} streams already",
                "server_error",
                "too_many_streams",
            )
        response = web.StreamResponse(
            headers={"Content-Type": CONTENT_TYPE, "Cache-Control": "no-cache"}
        )
        try:
            await response.prepare(request)
            while (chunk := await subscriber.next()) is not None:
                await response.write(chunk)
        except ConnectionResetError:
            log.debug("kv_relay_stream_reset")
        finally:
            self.hub.unsubscribe(subscriber)
        return response

    async def _end_streams(self, _app: web.Application) -> None:
        self.hub.close_all()

    async def _health(self, _request: web.Request) -> web.Response:
        return web.json_response(
            {
                "status": "ok",
                "engine_connected": self.engine_connected,
                "digests": self.hub.digest_count,
                "subscribers": self.hub.subscriber_count,
            }
        )

    async def _metrics(self, _request: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )


@dataclass(frozen=True, slots=True)
class RunningRelay:
    relay: KvRelay
    # The port the stream listens on (the one asked for, or the one given for 0).
    port: int
    # The engine feed; it ends only with an error (the relay is useless without it).
    feed: asyncio.Task[None]


@contextlib.asynccontextmanager
async def running_relay(
    settings: RelaySettings,
    *,
    registry: CollectorRegistry | None = None,
    new_epoch: Callable[[], int] = _random_epoch,
) -> AsyncIterator[RunningRelay]:
    """Run a relay on this loop while the context is open; on exit end the streams and close.

    Raises RelayStartError when the engine socket or the listener cannot be opened.
    """
    relay = KvRelay(settings, registry=registry or CollectorRegistry(), new_epoch=new_epoch)
    context = zmq.asyncio.Context()
    runner = web.AppRunner(relay.app(), shutdown_timeout=_SHUTDOWN_TIMEOUT_S, access_log=None)
    ready = asyncio.Event()
    feed = asyncio.create_task(relay.follow_engine(context, ready), name="kv-relay-feed")
    ticker = asyncio.create_task(relay.heartbeats(), name="kv-relay-heartbeats")
    try:
        await _first(ready, feed)
        await runner.setup()
        try:
            site = web.TCPSite(runner, settings.host, settings.port)
            await site.start()
        except OSError as exc:
            raise RelayStartError(
                f"cannot listen on {settings.host}:{settings.port}: {exc.strerror}"
            ) from None
        port = int(runner.addresses[0][1])
        log.info("kv_relay_listening", extra={"host": settings.host, "port": port})
        yield RunningRelay(relay, port, feed)
    finally:
        # Streams end first (on_shutdown), then the engine side.
        await runner.cleanup()
        for task in (feed, ticker):
            task.cancel()
        for task in (feed, ticker):
            with contextlib.suppress(asyncio.CancelledError, RelayStartError):
                await task
        context.term()


async def _first(ready: asyncio.Event, feed: asyncio.Task[None]) -> None:
    """Wait until the engine socket is open, or raise what stopped the feed from opening it."""
    waiter = asyncio.ensure_future(ready.wait())
    try:
        await asyncio.wait({waiter, feed}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
    if not ready.is_set():
        await feed  # raises its error


async def serve(settings: RelaySettings) -> None:
    """Serve until SIGTERM or SIGINT (or until the engine feed fails, which raises)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    async with running_relay(settings) as running:
        print(  # noqa: T201 - the one line an operator (and a test) waits for
            f"caravan kv-relay on http://{settings.host}:{running.port}", flush=True
        )
        stopping = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait({stopping, running.feed}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
        if running.feed.done():
            running.feed.result()  # raises the feed's error
    log.info("kv_relay_stopped")


def run(settings: RelaySettings) -> int:
    """Run the relay until stopped; the process exit code."""
    handler = configure_logging(settings.log_level, settings.log_format, batch_lines=1)
    try:
        asyncio.run(serve(settings))
    except RelayStartError as exc:
        print(f"error: {exc}", file=sys.stderr)  # noqa: T201
        return 1
    finally:
        handler.flush()
    return 0
