"""The KV relay's state: the engine's cached blocks as caravan digests, and the stream routers read.

**Input.** The engine's KV-event batches, decoded, in the order they arrived:
`RelayState.apply(engine_seq, events)` with each event one of `StoredBlocks`,
`RemovedBlocks`, `ClearedAll` (plain values; the wiring maps the wire
decoder's events onto them and leaves out those it does not track, such as
another KV-cache group or an offload medium).

**What it keeps.** For every engine block hash the relay has seen stored and
not removed, the block's caravan digest (`caravan_llm.common.block_digest`),
computed here from the event's token ids, the digest of its parent (looked up
by `parent_block_hash`), the block size and the LoRA name. The token ids are
dropped at once; only digests leave this module.

**Output.** A versioned digest stream. The relay's *epoch* names one lineage
of its state; within an epoch, `seq` counts the `DigestDelta`s emitted, each
the net change of one engine batch (`added`, `removed`), and a
`DigestSnapshot` is the whole set at one `(epoch, seq)`. Invariant: every
epoch starts from the empty set at seq 0, so a router may adopt a new epoch
from its first delta (seq 1) without a snapshot. Epochs are opaque: compare
them for equality, never for order. Batches that change no digest emit no
delta; `position` is what a heartbeat carries.

**Resets.** The engine numbers its batches 0, 1, 2, ... A batch whose number
is not the next one means the relay cannot know what the engine holds: a
higher number is a gap (batches lost while nobody listened, or dropped by
ZMQ's high-water mark: a missed removal would leave a block believed cached),
a lower one is a restarted engine (or a replayed old batch). Either way the
relay forgets everything, starts a new epoch (epoch + 1), applies the batch
to the empty state and always emits that epoch's first delta, so routers drop
this replica's old set at once. The first batch after construction may carry
any number (the relay may start after the engine). After a reset the relay
knows only what it sees from then on: blocks stored before are unknown, which
only makes routers under-count cached prefixes, never over-count.

**Blocks it cannot name.** Each is counted and never guessed:
- a `StoredBlocks` whose parent hash is unknown (stored before a reset, or
  forgotten at the cap) cannot be chained: its blocks are counted in
  `unchained_blocks` and not recorded, so their children are unchained too;
- a block whose `extra_keys` carry more than the LoRA name (multimodal
  hashes, a cache salt) is one a router cannot name from the prompt's tokens:
  it is recorded as *opaque* (kept so that its children are known to be
  opaque too, and its removal is not "unknown"), counted in `opaque_blocks`,
  and has no digest; every later block of its chain is opaque too;
- an event with another block size than the relay's (`foreign_blocks`), or
  with inconsistent lengths or a token id out of range (`malformed_events`),
  is skipped whole.

**Memory.** At most `max_blocks` engine blocks are kept (default 2**20, above
the KV capacity of any one replica caravan runs: set it to at least the
engine's `num_gpu_blocks`; then it is never reached while events flow). When a
store would pass it, the oldest stored blocks (a sixteenth of the cap, so that
eviction is amortised) are forgotten *and reported removed*: routers then
under-count them, never keep a block the relay can no longer see removed.
Measured with tracemalloc over a million kept blocks (random 64-bit engine
hashes): about 160 bytes per block (the hash -> digest map and the digests'
reference counts), so about 170 MB at the default cap.

Pure: no clock, no I/O. Not thread-safe (one event loop).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Literal

from caravan_llm.common.block_digest import BlockDigest, DigestKey, block_digests
from caravan_llm.common.kv_stream import MAX_BLOCK_SIZE

if TYPE_CHECKING:
    from collections.abc import Sequence

DEFAULT_MAX_BLOCKS = 2**20
# The block size a relay that learns it from the events announces before the
# first store (vLLM's default on GPU); its set is empty until then, so routers
# find no block at it, and the first delta carries the engine's own size.
UNLEARNED_BLOCK_SIZE = 16
# Epochs stay in a signed 64-bit range so that any JSON reader keeps them exact.
_EPOCH_MODULUS = 2**63

ResetReason = Literal["gap", "restart"]


@dataclass(frozen=True, slots=True)
class StoredBlocks:
    """The engine cached consecutive full blocks of one sequence (vLLM's `BlockStored`)."""

    block_hashes: Sequence[int]
    # The engine hash of the block before the first one; None: these start the sequence.
    parent_block_hash: int | None
    # block_size ids per block, all blocks in order.
    token_ids: Sequence[int]
    block_size: int
    lora_name: str | None = None
    # One entry per block (None or the block's extra hash keys); None: none given.
    extra_keys: Sequence[Sequence[object] | None] | None = None


@dataclass(frozen=True, slots=True)
class RemovedBlocks:
    """The engine evicted these blocks (vLLM's `BlockRemoved`)."""

    block_hashes: Sequence[int]


@dataclass(frozen=True, slots=True)
class ClearedAll:
    """The engine dropped its whole prefix cache (vLLM's `AllBlocksCleared`)."""


RelayEvent = StoredBlocks | RemovedBlocks | ClearedAll


@dataclass(frozen=True, slots=True)
class StreamPosition:
    """Where a digest stream stands: its epoch and the seq of its last delta (0: none yet)."""

    epoch: int
    seq: int


@dataclass(frozen=True, slots=True)
class DigestDelta:
    """The net change of the relay's digest set from seq - 1 to seq in one epoch."""

    epoch: int
    seq: int
    block_size: int
    added: tuple[BlockDigest, ...]
    removed: tuple[BlockDigest, ...]


@dataclass(frozen=True, slots=True)
class DigestSnapshot:
    """The relay's whole digest set after delta `seq` of `epoch`."""

    epoch: int
    seq: int
    block_size: int
    digests: frozenset[BlockDigest]


@dataclass(frozen=True, slots=True)
class Applied:
    """What one engine batch did: the delta to send routers (None: no change), and any reset."""

    delta: DigestDelta | None
    reset: ResetReason | None


@dataclass(frozen=True, slots=True)
class RelayCounters:
    """Totals since the relay started (across resets), for its metrics."""

    batches: int = 0
    events: int = 0
    resets_gap: int = 0
    resets_restart: int = 0
    # Blocks stored after a parent the relay does not know: not recorded.
    unchained_blocks: int = 0
    # Blocks recorded without a digest (extra keys beyond the LoRA name, or an opaque parent).
    opaque_blocks: int = 0
    # Blocks of another block size than the relay's: skipped.
    foreign_blocks: int = 0
    # Events whose lengths disagree (token ids, extra keys): skipped whole.
    malformed_events: int = 0
    # Removals of hashes the relay does not hold (stored before it started, or unchained).
    unknown_removals: int = 0
    # Blocks forgotten at the max_blocks cap (reported removed).
    evicted_blocks: int = 0


@dataclass(slots=True)
class _Counts:
    batches: int = 0
    events: int = 0
    resets_gap: int = 0
    resets_restart: int = 0
    unchained_blocks: int = 0
    opaque_blocks: int = 0
    foreign_blocks: int = 0
    malformed_events: int = 0
    unknown_removals: int = 0
    evicted_blocks: int = 0


class RelayState:
    """One engine's cached blocks as digests, and the delta stream routers follow.

    `epoch` is the first epoch's identifier: the wiring draws it at random per
    relay process (63 bits), so that a restarted relay never continues an old
    lineage by accident. `block_size` is the engine's (events of another size
    are skipped); None: learned from the events, as the first size stored
    while the state holds no block (vLLM's default is 16 on GPU, 128 on its
    CPU build, and `--block-size` changes it), so every digest held at once
    has one size; until then snapshots say `UNLEARNED_BLOCK_SIZE`. `key`
    names blocks as the routers of this model do.
    """

    __slots__ = (
        "_block_size",
        "_blocks",
        "_counts",
        "_epoch",
        "_key",
        "_learns_block_size",
        "_max_blocks",
        "_next_engine_seq",
        "_refs",
        "_seq",
        "_touched",
    )

    def __init__(
        self,
        *,
        epoch: int,
        block_size: int | None,
        key: DigestKey,
        max_blocks: int = DEFAULT_MAX_BLOCKS,
    ) -> None:
        if not 0 <= epoch < _EPOCH_MODULUS:
            raise ValueError(f"epoch must be in [0, 2**63), got {epoch}")
        if block_size is not None and not 1 <= block_size <= MAX_BLOCK_SIZE:
            raise ValueError(f"block_size must be in [1, {MAX_BLOCK_SIZE}], got {block_size}")
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
        self._epoch = epoch
        self._learns_block_size = block_size is None
        self._block_size = UNLEARNED_BLOCK_SIZE if block_size is None else block_size
        self._key = key
        self._max_blocks = max_blocks
        self._seq = 0
        self._next_engine_seq: int | None = None
        # Engine block hash -> its digest (None: opaque), oldest stored first.
        self._blocks: dict[int, BlockDigest | None] = {}
        # Digest -> how many kept engine blocks carry it (two engine hashes may
        # name the same tokens, e.g. one per KV-cache group).
        self._refs: dict[BlockDigest, int] = {}
        # During one batch: digest -> whether it was held before the batch.
        self._touched: dict[BlockDigest, bool] = {}
        self._counts = _Counts()

    def __len__(self) -> int:
        """Engine blocks kept (opaque ones included)."""
        return len(self._blocks)

    def __repr__(self) -> str:
        return (
            f"RelayState(epoch={self._epoch}, seq={self._seq},"
            f" {len(self._blocks)} blocks, {len(self._refs)} digests)"
        )

    @property
    def position(self) -> StreamPosition:
        """The stream's current epoch and seq: what a heartbeat carries."""
        return StreamPosition(self._epoch, self._seq)

    @property
    def next_engine_seq(self) -> int | None:
        """The engine batch number expected next (None: none seen yet, any is accepted).

        The wiring may replay the missing batches from the engine's replay
        socket before calling `apply` with a later one, and so avoid a reset.
        """
        return self._next_engine_seq

    @property
    def counters(self) -> RelayCounters:
        counts = self._counts
        return RelayCounters(**{f.name: getattr(counts, f.name) for f in fields(counts)})

    def digests(self) -> frozenset[BlockDigest]:
        """The digests of every block the engine is known to hold."""
        return frozenset(self._refs)

    def snapshot(self) -> DigestSnapshot:
        """The whole set at the current position, for a router that (re)connects."""
        return DigestSnapshot(self._epoch, self._seq, self._block_size, frozenset(self._refs))

    def apply(self, engine_seq: int, events: Sequence[RelayEvent]) -> Applied:
        """Apply one engine batch; the delta routers need, and whether it reset the state.

        Raises ValueError for a negative `engine_seq` (vLLM's replay socket ends
        its backlog with -1: that marker is not a batch), before changing anything.
        """
        if engine_seq < 0:
            raise ValueError(f"engine_seq must be >= 0, got {engine_seq}")
        reset: ResetReason | None = None
        expected = self._next_engine_seq
        if expected is not None and engine_seq != expected:
            reset = "gap" if engine_seq > expected else "restart"
            self._reset(reset)
        self._next_engine_seq = engine_seq + 1
        self._counts.batches += 1
        self._touched = {}
        for event in events:
            self._counts.events += 1
            match event:
                case StoredBlocks():
                    self._store(event)
                case RemovedBlocks():
                    self._remove(event.block_hashes)
                case ClearedAll():
                    self._clear()
        delta = self._close_batch(force=reset is not None)
        return Applied(delta=delta, reset=reset)

    def _reset(self, reason: ResetReason) -> None:
        if reason == "gap":
            self._counts.resets_gap += 1
        else:
            self._counts.resets_restart += 1
        self._blocks = {}
        self._refs = {}
        self._epoch = (self._epoch + 1) % _EPOCH_MODULUS
        self._seq = 0

    def _close_batch(self, *, force: bool) -> DigestDelta | None:
        refs = self._refs
        added = tuple(d for d, held in self._touched.items() if not held and d in refs)
        removed = tuple(d for d, held in self._touched.items() if held and d not in refs)
        self._touched = {}
        if not (added or removed or force):
            return None
        self._seq += 1
        return DigestDelta(self._epoch, self._seq, self._block_size, added, removed)

    def _store(self, event: StoredBlocks) -> None:
        hashes = event.block_hashes
        count = len(hashes)
        block_size = event.block_size
        if block_size != self._block_size:
            if not (self._learns_block_size and not self._blocks and block_size <= MAX_BLOCK_SIZE):
                self._counts.foreign_blocks += count
                return
            # Nothing is held: the engine's size is this one from now on.
            self._block_size = block_size
        extra_keys = event.extra_keys
        if len(event.token_ids) != count * block_size or (
            extra_keys is not None and len(extra_keys) != count
        ):
            self._counts.malformed_events += 1
            return
        parent = event.parent_block_hash
        nameable = count
        parent_digest: BlockDigest | None = None
        if parent is not None:
            if parent not in self._blocks:
                self._counts.unchained_blocks += count
                return
            parent_digest = self._blocks[parent]
            if parent_digest is None:
                nameable = 0
        if extra_keys is not None:
            nameable = next(
                (
                    i
                    for i, keys in enumerate(extra_keys[:nameable])
                    if not _only_lora(keys, event.lora_name)
                ),
                nameable,
            )
        try:
            names: Sequence[BlockDigest | None] = block_digests(
                event.token_ids[: nameable * block_size],
                block_size=block_size,
                key=self._key,
                extra=event.lora_name,
                parent=parent_digest,
            )
        except ValueError:  # a token id out of range: nothing of the event is recorded
            self._counts.malformed_events += 1
            return
        if nameable < count:
            self._counts.opaque_blocks += count - nameable
            names = [*names, *itertools.repeat(None, count - nameable)]
        for block_hash, digest in zip(hashes, names, strict=True):
            self._record(block_hash, digest)
        if len(self._blocks) > self._max_blocks:
            self._evict()

    def _record(self, block_hash: int, digest: BlockDigest | None) -> None:
        blocks = self._blocks
        if block_hash in blocks:
            old = blocks[block_hash]
            if old == digest:
                return
            del blocks[block_hash]
            if old is not None:
                self._unref(old)
        blocks[block_hash] = digest
        if digest is not None:
            refs = self._refs
            count = refs.get(digest, 0)
            if count == 0:
                self._touched.setdefault(digest, False)
            refs[digest] = count + 1

    def _unref(self, digest: BlockDigest) -> None:
        refs = self._refs
        count = refs[digest]
        if count == 1:
            del refs[digest]
            self._touched.setdefault(digest, True)
        else:
            refs[digest] = count - 1

    def _remove(self, hashes: Sequence[int]) -> None:
        blocks = self._blocks
        for block_hash in hashes:
            if block_hash not in blocks:
                self._counts.unknown_removals += 1
                continue
            digest = blocks.pop(block_hash)
            if digest is not None:
                self._unref(digest)

    def _clear(self) -> None:
        touched = self._touched
        for digest in self._refs:
            touched.setdefault(digest, True)
        self._blocks = {}
        self._refs = {}

    def _evict(self) -> None:
        blocks = self._blocks
        excess = len(blocks) - self._max_blocks + self._max_blocks // 16
        victims = list(itertools.islice(blocks, excess))
        self._counts.evicted_blocks += len(victims)
        for block_hash in victims:
            digest = blocks.pop(block_hash)
            if digest is not None:
                self._unref(digest)


def _only_lora(keys: Sequence[object] | None, lora_name: str | None) -> bool:
    """Whether a block's extra keys say no more than its LoRA adapter (which the digest has)."""
    if keys is None or len(keys) == 0:
        return True
    return lora_name is not None and len(keys) == 1 and keys[0] == lora_name
