"""The KV relay's digest stream: the one codec of `GET /v1/kv/stream`, relay and routers alike.

A replica's KV relay (`caravan_llm.kvrelay`) serves the caravan block digests
(`caravan_llm.common.block_digest`) of the blocks its engine holds as
Server-Sent Events, one JSON object per event, digests as 16 lowercase hex
digits (the digest's 8 bytes, big-endian)::

    event: snapshot
    data: {"epoch":E,"seq":S,"block_size":B,"digests":["00ab...", ...]}

    event: delta
    data: {"epoch":E,"seq":S,"block_size":B,"added":[...],"removed":[...]}

    event: heartbeat
    data: {"epoch":E,"seq":S}

- The first event of a stream is a `snapshot`: the whole set after delta
  `seq` of `epoch`. A later `snapshot` replaces the set too (the relay sends
  one when it forgets everything it knew, e.g. its engine went away).
- A `delta` is the net change of one engine batch, `seq` one above the
  previous in the same epoch; a new epoch starts from the empty set at seq 0,
  so its first delta (seq 1) is all of it.
- A `heartbeat` says where the stream stands, sent every few seconds, so a
  router can tell a quiet live stream from a dead one
  (`caravan_llm.router.core.kv_index.KvIndex.heartbeat`).

The stream never carries token ids: integers appear only as `epoch`, `seq`
and `block_size`, digests only as hex strings of a keyed hash.

**Bounds.** A snapshot holds at most `MAX_DIGESTS` (2**20) digests: the
relay's cap on the blocks it keeps (`caravan_llm.kvrelay.state`'s
DEFAULT_MAX_BLOCKS, which its settings may lower, never raise past this). A
delta's `added` and `removed` hold at most `MAX_DIGESTS` each, so an event's
`data` is at most `MAX_EVENT_BYTES` (about 40 MiB; a full snapshot is about
20 MiB, 19 bytes per digest). `epoch` and `seq` are in [0, 2**63),
`block_size` in [1, `MAX_BLOCK_SIZE`].

**Decoding** is strict about what it knows and lenient about the future:
every known field must be there with its type and bounds, no key may repeat,
and keys it does not know are ignored (a newer relay may add some). An event
of a name it does not know decodes to None (the SSE rule: skip it). Anything
else malformed raises `KvStreamError`, and nothing else. Messages never echo
the bad value.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, Protocol

from caravan_llm.common.block_digest import DIGEST_BYTES, BlockDigest

if TYPE_CHECKING:
    from collections.abc import Sequence

STREAM_PATH: Final = "/v1/kv/stream"
CONTENT_TYPE: Final = "text/event-stream"

SNAPSHOT: Final = "snapshot"
DELTA: Final = "delta"
HEARTBEAT: Final = "heartbeat"

MAX_DIGESTS: Final = 2**20
MAX_BLOCK_SIZE: Final = 2**16
_MAX_POSITION = 2**63
_HEX_DIGITS = 2 * DIGEST_BYTES
# One digest in a JSON array: the quotes, 16 digits, the comma.
_DIGEST_JSON_BYTES = _HEX_DIGITS + 3
MAX_EVENT_BYTES: Final = 2 * MAX_DIGESTS * _DIGEST_JSON_BYTES + 1024
# An event's name line and anything else that is not data stays short.
_MAX_FIELD_LINE = 256
_HEX = re.compile(r"[0-9a-f]{16}")


class KvStreamError(ValueError):
    """A digest-stream event that does not decode; the message says what was wrong.

    Not retryable as such: the same bytes fail the same way. A router drops the
    connection and reconnects, which starts a fresh stream with a snapshot.
    """

    retryable = False


# -- values ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class KvSnapshot:
    """The relay's whole digest set after delta `seq` of `epoch`."""

    epoch: int
    seq: int
    block_size: int
    digests: frozenset[BlockDigest]


@dataclass(frozen=True, slots=True)
class KvDelta:
    """The net change of the set from `seq - 1` to `seq` in `epoch`."""

    epoch: int
    seq: int
    block_size: int
    added: tuple[BlockDigest, ...]
    removed: tuple[BlockDigest, ...]


@dataclass(frozen=True, slots=True)
class KvHeartbeat:
    """Where the stream stands: its epoch and the seq of its last delta."""

    epoch: int
    seq: int


KvStreamMessage = KvSnapshot | KvDelta | KvHeartbeat


# What the encoder reads (the relay's own values have these shapes).
class PositionLike(Protocol):
    @property
    def epoch(self) -> int: ...
    @property
    def seq(self) -> int: ...


class SnapshotLike(PositionLike, Protocol):
    @property
    def block_size(self) -> int: ...
    @property
    def digests(self) -> Iterable[BlockDigest]: ...


class DeltaLike(PositionLike, Protocol):
    @property
    def block_size(self) -> int: ...
    @property
    def added(self) -> Sequence[BlockDigest]: ...
    @property
    def removed(self) -> Sequence[BlockDigest]: ...


# -- encoding --------------------------------------------------------------------------


def encode_snapshot(snapshot: SnapshotLike) -> bytes:
    """The SSE event of a snapshot. Raises ValueError past the bounds (module docstring)."""
    digests = _hex_list(snapshot.digests, "digests")
    head = _position_fields(snapshot) + f',"block_size":{_block_size(snapshot.block_size)}'
    return _event(SNAPSHOT, f'{{{head},"digests":[{digests}]}}')


def encode_delta(delta: DeltaLike) -> bytes:
    """The SSE event of a delta. Raises ValueError past the bounds."""
    added = _hex_list(delta.added, "added")
    removed = _hex_list(delta.removed, "removed")
    head = _position_fields(delta) + f',"block_size":{_block_size(delta.block_size)}'
    return _event(DELTA, f'{{{head},"added":[{added}],"removed":[{removed}]}}')


def encode_heartbeat(position: PositionLike) -> bytes:
    """The SSE event of a heartbeat at `position`."""
    return _event(HEARTBEAT, f"{{{_position_fields(position)}}}")


def _event(name: str, data: str) -> bytes:
    return f"event: {name}\ndata: {data}\n\n".encode("ascii")


def _position_fields(position: PositionLike) -> str:
    for name, value in (("epoch", position.epoch), ("seq", position.seq)):
        if not 0 <= value < _MAX_POSITION:
            raise ValueError(f"{name} must be in [0, 2**63), got {value}")
    return f'"epoch":{position.epoch},"seq":{position.seq}'


def _block_size(value: int) -> int:
    if not 1 <= value <= MAX_BLOCK_SIZE:
        raise ValueError(f"block_size must be in [1, {MAX_BLOCK_SIZE}], got {value}")
    return value


def _hex_list(digests: Iterable[BlockDigest], name: str) -> str:
    items = [f'"{digest:016x}"' for digest in digests]
    if len(items) > MAX_DIGESTS:
        raise ValueError(f"{name}: at most {MAX_DIGESTS} digests, got {len(items)}")
    if any(len(item) != _HEX_DIGITS + 2 for item in items):
        raise ValueError(f"{name}: a digest is an unsigned {DIGEST_BYTES}-byte integer")
    return ",".join(items)


# -- decoding --------------------------------------------------------------------------


def decode_message(event: str, data: str | bytes) -> KvStreamMessage | None:
    """One event's name and data as a typed value; None for an event name it does not know.

    Raises KvStreamError for malformed data.
    """
    if len(data) > MAX_EVENT_BYTES:
        raise KvStreamError(f"{event} event: data is over {MAX_EVENT_BYTES} bytes")
    if event not in (SNAPSHOT, DELTA, HEARTBEAT):
        return None
    fields = _json_object(data, event)
    epoch = _position(fields, "epoch", event)
    seq = _position(fields, "seq", event)
    if event == HEARTBEAT:
        return KvHeartbeat(epoch=epoch, seq=seq)
    block_size = _bounded_int(fields, "block_size", event, 1, MAX_BLOCK_SIZE + 1)
    if event == SNAPSHOT:
        return KvSnapshot(
            epoch=epoch,
            seq=seq,
            block_size=block_size,
            digests=frozenset(_digests(fields, "digests", event)),
        )
    return KvDelta(
        epoch=epoch,
        seq=seq,
        block_size=block_size,
        added=_digests(fields, "added", event),
        removed=_digests(fields, "removed", event),
    )


class _DuplicateKey(ValueError):
    pass


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
    result: dict[str, object] = {}
    for key, value in pairs:
        if key in result:
            raise _DuplicateKey(key)
        result[key] = value
    return result


def _json_object(data: str | bytes, event: str) -> dict[str, object]:
    try:
        value: object = json.loads(data, object_pairs_hook=_no_duplicates)
    except _DuplicateKey as exc:
        raise KvStreamError(f"{event} event: the key {str(exc)[:40]!r} appears twice") from None
    except RecursionError:
        raise KvStreamError(f"{event} event: data is nested too deeply") from None
    except (ValueError, TypeError):
        # JSONDecodeError, bad UTF-8, an integer too long to convert: never echo the data.
        raise KvStreamError(f"{event} event: data is not one JSON object") from None
    if not isinstance(value, dict):
        raise KvStreamError(f"{event} event: data is a JSON object, got {_kind(value)}")
    return value


def _bounded_int(fields: dict[str, object], name: str, event: str, low: int, high: int) -> int:
    if name not in fields:
        raise KvStreamError(f"{event} event: missing {name}")
    value = fields[name]
    if isinstance(value, bool) or not isinstance(value, int):
        raise KvStreamError(f"{event} event: {name}: expected an integer, got {_kind(value)}")
    if not low <= value < high:
        raise KvStreamError(f"{event} event: {name}: out of range [{low}, {high})")
    return value


def _position(fields: dict[str, object], name: str, event: str) -> int:
    return _bounded_int(fields, name, event, 0, _MAX_POSITION)


def _digests(fields: dict[str, object], name: str, event: str) -> tuple[BlockDigest, ...]:
    if name not in fields:
        raise KvStreamError(f"{event} event: missing {name}")
    value = fields[name]
    if not isinstance(value, list):
        raise KvStreamError(f"{event} event: {name}: expected an array, got {_kind(value)}")
    if len(value) > MAX_DIGESTS:
        raise KvStreamError(f"{event} event: {name}: more than {MAX_DIGESTS} digests")
    digests: list[BlockDigest] = []
    for index, item in enumerate(value):
        if not isinstance(item, str) or _HEX.fullmatch(item) is None:
            raise KvStreamError(
                f"{event} event: {name}[{index}]: expected {_HEX_DIGITS} lowercase hex digits"
            )
        digests.append(BlockDigest(int(item, 16)))
    return tuple(digests)


def _kind(value: object) -> str:
    names = {
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "an array",
        dict: "an object",
    }
    return "null" if value is None else names.get(type(value), type(value).__name__)


# -- the SSE framing -------------------------------------------------------------------


class SseDecoder:
    """Bytes of a digest stream in, typed messages out; incremental, with bounded buffers.

    `feed` takes any chunking of the body (lines may be split anywhere) and
    returns the messages completed by it. Lines end in LF, CRLF or CR; `:`
    comment lines and fields other than `event` and `data` are ignored (the
    SSE rules); several `data` lines join with LF. An event of an unknown
    name is skipped and counted in `skipped`. Raises KvStreamError when a
    line or an event's data passes its bound or an event does not decode;
    after that the decoder is spent (the caller drops the connection).
    """

    __slots__ = ("_buffer", "_data", "_data_bytes", "_event", "_pending_cr", "skipped")

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._data: list[bytes] = []
        self._data_bytes = 0
        self._event: str | None = None
        self._pending_cr = False
        self.skipped = 0

    def feed(self, chunk: bytes) -> list[KvStreamMessage]:
        messages: list[KvStreamMessage] = []
        buffer = self._buffer
        if self._pending_cr and chunk[:1] == b"\n":
            chunk = chunk[1:]
        self._pending_cr = False
        buffer += chunk
        start = 0
        while True:
            end = _line_end(buffer, start)
            if end < 0:
                break
            line = bytes(buffer[start:end])
            if buffer[end] == ord("\r"):
                if end + 1 < len(buffer):
                    start = end + 2 if buffer[end + 1] == ord("\n") else end + 1
                else:
                    start = end + 1
                    self._pending_cr = True
            else:
                start = end + 1
            message = self._line(line)
            if message is not None:
                messages.append(message)
        del buffer[:start]
        if len(buffer) > MAX_EVENT_BYTES + _MAX_FIELD_LINE:
            raise KvStreamError(f"a line of the stream is over {MAX_EVENT_BYTES} bytes")
        return messages

    def _line(self, line: bytes) -> KvStreamMessage | None:
        if not line:
            return self._dispatch()
        if line.startswith(b":"):
            return None
        name, _, value = line.partition(b":")
        value = value.removeprefix(b" ")
        if name == b"data":
            self._data_bytes += len(value) + 1
            if self._data_bytes > MAX_EVENT_BYTES:
                raise KvStreamError(f"an event's data is over {MAX_EVENT_BYTES} bytes")
            self._data.append(value)
        elif name == b"event":
            if len(value) > _MAX_FIELD_LINE:
                raise KvStreamError(f"an event name is over {_MAX_FIELD_LINE} bytes")
            try:
                self._event = value.decode("utf-8")
            except UnicodeDecodeError:
                raise KvStreamError("an event name is not UTF-8") from None
        return None

    def _dispatch(self) -> KvStreamMessage | None:
        event, data = self._event, self._data
        self._event, self._data, self._data_bytes = None, [], 0
        if not data:
            return None  # no data: the SSE rule is to dispatch nothing
        # An event without a name is a "message": not one of ours.
        message = decode_message(event or "message", b"\n".join(data))
        if message is None:
            self.skipped += 1
        return message


def _line_end(buffer: bytearray, start: int) -> int:
    lf = buffer.find(b"\n", start)
    cr = buffer.find(b"\r", start, lf if lf >= 0 else len(buffer))
    return cr if cr >= 0 else lf
