"""The wire decoder's events as the relay state takes them, leaving out what it does not track.

Pure. Kept out of `state.py` so that the state knows no wire format.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from caravan_llm.kvrelay.state import ClearedAll, RelayEvent, RemovedBlocks, StoredBlocks
from caravan_llm.kvrelay.wire import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    EventBatch,
)

if TYPE_CHECKING:
    from collections.abc import Sequence

# The KV-cache group the relay follows; vLLM numbers a plain model's one group 0.
TRACKED_GROUP = 0


@dataclass(frozen=True, slots=True)
class Mapped:
    """A batch's events for the relay state, and how many were left out and why."""

    events: tuple[RelayEvent, ...]
    # Events of a type the wire decoder does not know (skipped there).
    unknown_type: int = 0
    # Events of another medium than the engine's own cache (an offload tier).
    medium: int = 0
    # Events of another KV-cache group (hybrid models' sliding-window groups).
    group: int = 0


def relay_events(batch: EventBatch) -> Mapped:
    """The events of `batch` the relay follows: the engine's own cache, group 0.

    A `medium` of None (older engines) or "GPU" (vLLM's name for its own KV
    cache, on CPU too) is the engine's cache; a `group_idx` of None or 0 its
    first group. Block hashes sent as bytes (vLLM's full hashes) become ints.
    """
    events: list[RelayEvent] = []
    medium = group = 0
    for event in batch.events:
        match event:
            case BlockStored():
                if not _own_medium(event.medium):
                    medium += 1
                elif not _own_group(event.group_idx):
                    group += 1
                else:
                    events.append(
                        StoredBlocks(
                            block_hashes=_ints(event.block_hashes),
                            parent_block_hash=(
                                None
                                if event.parent_block_hash is None
                                else _int(event.parent_block_hash)
                            ),
                            token_ids=event.token_ids,
                            block_size=event.block_size,
                            lora_name=event.lora_name,
                            extra_keys=event.extra_keys,
                        )
                    )
            case BlockRemoved():
                if not _own_medium(event.medium):
                    medium += 1
                elif not _own_group(event.group_idx):
                    group += 1
                else:
                    events.append(RemovedBlocks(block_hashes=_ints(event.block_hashes)))
            case AllBlocksCleared():
                events.append(ClearedAll())
    return Mapped(tuple(events), unknown_type=batch.unknown_events, medium=medium, group=group)


def _own_medium(medium: str | None) -> bool:
    return medium is None or medium == MEDIUM_GPU


def _own_group(group_idx: int | None) -> bool:
    return group_idx is None or group_idx == TRACKED_GROUP


def _int(block_hash: BlockHash) -> int:
    return int.from_bytes(block_hash, "big") if isinstance(block_hash, bytes) else block_hash


def _ints(hashes: Sequence[BlockHash]) -> tuple[int, ...]:
    return tuple(_int(block_hash) for block_hash in hashes)
