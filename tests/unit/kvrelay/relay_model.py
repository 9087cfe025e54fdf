"""A straightforward model of the KV relay's state, and event sequences to drive both with.

The model recomputes every block's digest one block at a time
(`block_digest`), keeps engine hash -> digest in a plain dict, and clears it
on any batch number but the next; the relay must say it holds exactly the
digests the model does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import strategies as st

from caravan_llm.common.block_digest import BlockDigest, DigestKey, block_digest
from caravan_llm.kvrelay.state import ClearedAll, RelayEvent, RemovedBlocks, StoredBlocks

BLOCK_SIZE = 2
LORA = "tiny-lora"


@dataclass
class RelayModel:
    key: DigestKey
    block_size: int
    max_blocks: int
    blocks: dict[int, BlockDigest | None] = field(default_factory=dict)
    next_seq: int | None = None

    def apply(self, seq: int, events: list[RelayEvent]) -> str | None:
        reset = None
        if self.next_seq is not None and seq != self.next_seq:
            reset = "gap" if seq > self.next_seq else "restart"
            self.blocks = {}
        self.next_seq = seq + 1
        for event in events:
            if isinstance(event, StoredBlocks):
                self.store(event)
            elif isinstance(event, RemovedBlocks):
                for block_hash in event.block_hashes:
                    self.blocks.pop(block_hash, None)
            else:
                self.blocks = {}
        return reset

    def store(self, event: StoredBlocks) -> None:
        size = event.block_size
        count = len(event.block_hashes)
        if size != self.block_size or len(event.token_ids) != count * size:
            return
        if event.extra_keys is not None and len(event.extra_keys) != count:
            return
        parent: BlockDigest | None = None
        opaque = False
        if event.parent_block_hash is not None:
            if event.parent_block_hash not in self.blocks:
                return
            parent = self.blocks[event.parent_block_hash]
            opaque = parent is None
        names: list[BlockDigest | None] = []
        for i in range(count):
            keys = None if event.extra_keys is None else event.extra_keys[i]
            if keys and list(keys) != [event.lora_name]:
                opaque = True
            if opaque:
                names.append(None)
                continue
            block_tokens = event.token_ids[i * size : (i + 1) * size]
            try:
                parent = block_digest(parent, block_tokens, key=self.key, extra=event.lora_name)
            except ValueError:  # a bad token id where a digest is needed: skip the event
                return
            names.append(parent)
        for block_hash, name in zip(event.block_hashes, names, strict=True):
            if block_hash in self.blocks and self.blocks[block_hash] == name:
                continue
            self.blocks.pop(block_hash, None)
            self.blocks[block_hash] = name
        if len(self.blocks) > self.max_blocks:
            excess = len(self.blocks) - self.max_blocks + self.max_blocks // 16
            for block_hash in list(self.blocks)[:excess]:
                del self.blocks[block_hash]

    def held(self) -> set[BlockDigest]:
        return {d for d in self.blocks.values() if d is not None}


@dataclass(frozen=True)
class Batch:
    seq: int
    events: list[RelayEvent]


# Engine hashes are drawn from a small range so that stores, parents and
# removals keep meeting the same blocks; two hashes may carry the same tokens
# (as two KV-cache groups would), so digests are shared.
hashes_st = st.integers(min_value=1, max_value=24)
_POOL = [[0, 0], [0, 1], [1, 0], [5, 5]]
block_tokens_st = st.sampled_from(_POOL) | st.lists(
    st.integers(min_value=0, max_value=50), min_size=BLOCK_SIZE, max_size=BLOCK_SIZE
)


@st.composite
def stored_st(draw: st.DrawFn) -> StoredBlocks:
    count = draw(st.integers(min_value=1, max_value=3))
    size = draw(st.sampled_from([BLOCK_SIZE] * 9 + [BLOCK_SIZE + 1]))
    token_count = count * size + draw(st.sampled_from([0] * 19 + [1]))
    # Blocks mostly from a small pool (so that prompts share blocks), some at random.
    blocks = draw(st.lists(block_tokens_st, min_size=count + 1, max_size=count + 1))
    tokens = [token for block in blocks for token in block][:token_count]
    tokens += [0] * (token_count - len(tokens))
    if draw(st.integers(0, 30)) == 0:
        tokens[0] = -1  # out of range: the whole event is skipped
    lora = draw(st.sampled_from([None, None, LORA]))
    block_keys = st.sampled_from(
        [None, None, None, (LORA,) if lora else None, ("mm-hash", 3), ("salt",)]
    )
    extra_keys = draw(st.none() | st.lists(block_keys, min_size=count, max_size=count))
    return StoredBlocks(
        block_hashes=draw(st.lists(hashes_st, min_size=count, max_size=count, unique=True)),
        parent_block_hash=draw(st.none() | hashes_st),
        token_ids=tokens,
        block_size=size,
        lora_name=lora,
        extra_keys=extra_keys,
    )


removed_st = st.builds(RemovedBlocks, block_hashes=st.lists(hashes_st, max_size=4))
# Mostly stores, some removals, a rare clear (one_of draws its branches evenly).
event_st: st.SearchStrategy[RelayEvent] = st.one_of(
    *[stored_st()] * 6, removed_st, removed_st, st.just(ClearedAll())
)


@st.composite
def batches_st(draw: st.DrawFn) -> list[Batch]:
    """Batches with mostly consecutive numbers, now and then a gap or a restart."""
    batches: list[Batch] = []
    seq = draw(st.integers(min_value=0, max_value=5))
    for _ in range(draw(st.integers(min_value=1, max_value=25))):
        events = draw(st.lists(event_st, max_size=5))
        batches.append(Batch(seq, events))
        jump = draw(st.sampled_from(["next"] * 12 + ["gap", "restart", "back"]))
        if jump == "next":
            seq += 1
        elif jump == "gap":
            seq += draw(st.integers(min_value=2, max_value=5))
        elif jump == "restart":
            seq = 0
        else:
            seq = max(0, seq - draw(st.integers(min_value=1, max_value=3)))
    return batches
