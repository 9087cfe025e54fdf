"""A ZeroMQ SUB socket on an engine's KV-event endpoint, for the tests of both vLLMs.

    with KvSubscriber.connect("ipc:///tmp/x/kv.ipc", b"kv-events") as sub:
        ...send requests...
        batches = await sub.batches_until(lambda bs: ..., 10, "what")

`connect` returns once the ZMTP handshake with the publisher is done, so a
batch the engine publishes afterwards is not lost to ZeroMQ's late joining:
the subscription travels right behind the handshake, long before the engine's
next step can publish. The socket is a plain (non-asyncio) one read without
blocking: ZeroMQ's own threads do the I/O, so the test's event loop stays free
for an engine running in it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import zmq
from polling import eventually

from caravan_llm.kvrelay.wire import EventBatch, decode_frame

HANDSHAKE_TIMEOUT_MS = 10_000


@dataclass(slots=True)
class KvSubscriber:
    socket: zmq.Socket[bytes]
    batches: list[EventBatch] = field(default_factory=list)
    # The frames as received, beside their decoded batches (same order).
    frames: list[list[bytes]] = field(default_factory=list)

    @classmethod
    @contextlib.contextmanager
    def connect(cls, endpoint: str, topic: bytes) -> Iterator[KvSubscriber]:
        """A SUB socket connected to a publisher that binds (ipc://, tcp://*)."""
        with cls._socket(topic) as (sock, monitor):
            sock.connect(endpoint)
            if not monitor.poll(HANDSHAKE_TIMEOUT_MS):
                raise TimeoutError(f"no ZMTP handshake with the publisher at {endpoint}")
            yield cls(socket=sock)

    @classmethod
    @contextlib.contextmanager
    def bind(cls, endpoint: str, topic: bytes) -> Iterator[KvSubscriber]:
        """A SUB socket bound where a publisher with a concrete tcp:// endpoint connects."""
        with cls._socket(topic) as (sock, _):
            sock.bind(endpoint)
            yield cls(socket=sock)

    @staticmethod
    @contextlib.contextmanager
    def _socket(topic: bytes) -> Iterator[tuple[zmq.Socket[bytes], zmq.Socket[bytes]]]:
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        sock = context.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, topic)
        monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        try:
            yield sock, monitor
        finally:
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close(linger=0)
            context.term()

    def drain(self) -> list[EventBatch]:
        """Every frame that has arrived, decoded and appended; all batches so far."""
        while True:
            try:
                parts = self.socket.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return self.batches
            self.frames.append(parts)
            self.batches.append(decode_frame(parts))

    async def batches_until(
        self, done: Callable[[list[EventBatch]], bool], timeout_s: float, what: str
    ) -> list[EventBatch]:
        """All batches so far, once `done(batches)` holds (fails the test at the deadline)."""

        def check() -> tuple[list[EventBatch]] | None:
            batches = self.drain()
            # In a tuple: an empty list of batches may be the awaited answer.
            return (list(batches),) if done(batches) else None

        (batches,) = await eventually(check, timeout_s, what, interval_s=0.05)
        return batches
