"""The KV relay's state machine: engine batches in, digest snapshots and deltas out."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from relay_model import BLOCK_SIZE, Batch, RelayModel, batches_st

from caravan_llm.common.block_digest import BlockDigest, DigestKey, block_digests
from caravan_llm.kvrelay.state import (
    UNLEARNED_BLOCK_SIZE,
    ClearedAll,
    DigestDelta,
    RelayState,
    RemovedBlocks,
    StoredBlocks,
    StreamPosition,
)

KEY = DigestKey.from_secret("engine-key")
B = 4


def relay(**overrides: object) -> RelayState:
    options: dict[str, object] = {"epoch": 7, "block_size": B, "key": KEY} | overrides
    return RelayState(**options)  # type: ignore[arg-type]


def stored(
    hashes: list[int], tokens: list[int], parent: int | None = None, **overrides: object
) -> StoredBlocks:
    options: dict[str, object] = {
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": B,
    } | overrides
    return StoredBlocks(**options)  # type: ignore[arg-type]


def digests(tokens: list[int], extra: str | None = None) -> tuple[BlockDigest, ...]:
    return block_digests(tokens, block_size=B, key=KEY, extra=extra)


PROMPT = list(range(100, 112))  # three blocks of four


class TestStores:
    def test_a_store_adds_the_prompts_digests(self) -> None:
        """The first store's delta adds exactly the digests a router computes for the prompt."""
        state = relay()
        applied = state.apply(0, [stored([11, 12, 13], PROMPT)])
        assert DigestDelta(7, 1, B, digests(PROMPT), ()) == applied.delta
        assert applied.reset is None
        assert set(digests(PROMPT)) == state.digests()

    def test_a_continuation_chains_from_its_parent(self) -> None:
        """Blocks stored after a known parent get the digests of the whole prompt's chain."""
        state = relay()
        state.apply(0, [stored([11], PROMPT[:4])])
        applied = state.apply(1, [stored([12, 13], PROMPT[4:], parent=11)])
        assert applied.delta is not None
        assert digests(PROMPT)[1:] == applied.delta.added
        assert set(digests(PROMPT)) == state.digests()

    def test_a_lora_chain_is_named_with_its_adapter(self) -> None:
        """A LoRA request's blocks match a router's digests with the adapter as extra key."""
        state = relay()
        state.apply(
            0,
            [
                stored(
                    [1, 2, 3],
                    PROMPT,
                    lora_name="tiny-lora",
                    extra_keys=[("tiny-lora",), ["tiny-lora"], None],
                )
            ],
        )
        assert set(digests(PROMPT, extra="tiny-lora")) == state.digests()

    def test_a_repeated_store_changes_nothing(self) -> None:
        """Storing blocks the relay already holds emits no delta."""
        state = relay()
        state.apply(0, [stored([11, 12, 13], PROMPT)])
        applied = state.apply(1, [stored([11, 12, 13], PROMPT)])
        assert applied.delta is None
        assert StreamPosition(7, 1) == state.position

    def test_two_hashes_of_one_digest_keep_it_until_both_go(self) -> None:
        """Two engine blocks with the same tokens share a digest: removing one keeps it."""
        state = relay()
        state.apply(0, [stored([1], PROMPT[:4]), stored([2], PROMPT[:4])])
        assert state.apply(1, [RemovedBlocks([1])]).delta is None
        assert {digests(PROMPT)[0]} == state.digests()
        applied = state.apply(2, [RemovedBlocks([2])])
        assert applied.delta is not None
        assert (digests(PROMPT)[0],) == applied.delta.removed


class TestRemovals:
    def test_removed_blocks_leave_the_set(self) -> None:
        """A removal's delta names the digests that went."""
        state = relay()
        state.apply(0, [stored([11, 12, 13], PROMPT)])
        applied = state.apply(1, [RemovedBlocks([13, 12])])
        assert DigestDelta(7, 2, B, (), (digests(PROMPT)[2], digests(PROMPT)[1])) == (applied.delta)
        assert {digests(PROMPT)[0]} == state.digests()

    def test_a_clear_removes_everything(self) -> None:
        """AllBlocksCleared removes every digest in one delta."""
        state = relay()
        state.apply(0, [stored([11, 12, 13], PROMPT)])
        applied = state.apply(1, [ClearedAll()])
        assert applied.delta is not None
        assert set(digests(PROMPT)) == set(applied.delta.removed)
        assert frozenset() == state.digests()
        assert 0 == len(state)

    def test_a_store_and_removal_in_one_batch_cancel_out(self) -> None:
        """The delta is the batch's net change: stored then removed is no change."""
        state = relay()
        applied = state.apply(0, [stored([11], PROMPT[:4]), RemovedBlocks([11])])
        assert applied.delta is None
        assert StreamPosition(7, 0) == state.position

    def test_removing_an_unknown_block_is_counted(self) -> None:
        """A removal of a hash the relay never saw changes nothing and is counted."""
        state = relay()
        assert state.apply(0, [RemovedBlocks([99])]).delta is None
        assert 1 == state.counters.unknown_removals


class TestSequence:
    def test_a_gap_resets_to_a_new_epoch(self) -> None:
        """A skipped batch number drops everything and starts epoch + 1 from the batch."""
        state = relay()
        state.apply(0, [stored([11, 12], PROMPT[:8])])
        applied = state.apply(2, [stored([21], [9, 9, 9, 9])])
        assert "gap" == applied.reset
        assert DigestDelta(8, 1, B, digests([9, 9, 9, 9]), ()) == applied.delta
        assert set(digests([9, 9, 9, 9])) == state.digests()
        assert 1 == state.counters.resets_gap

    def test_a_restart_resets_and_always_says_so(self) -> None:
        """A batch number going back resets, and emits the new epoch's delta even if empty."""
        state = relay()
        state.apply(5, [stored([11], PROMPT[:4])])
        applied = state.apply(0, [])
        assert "restart" == applied.reset
        assert DigestDelta(8, 1, B, (), ()) == applied.delta
        assert frozenset() == state.digests()
        assert 1 == state.next_engine_seq
        assert 1 == state.counters.resets_restart

    def test_the_first_batch_may_have_any_number(self) -> None:
        """A relay that starts after its engine accepts the batch it sees first."""
        state = relay()
        assert state.apply(500, [stored([1], PROMPT[:4])]).reset is None
        assert 501 == state.next_engine_seq

    def test_the_replay_end_marker_is_refused_before_any_change(self) -> None:
        """A negative batch number (vLLM's end of replay) is an error and changes nothing."""
        state = relay()
        state.apply(0, [stored([1], PROMPT[:4])])
        with pytest.raises(ValueError, match="engine_seq must be >= 0, got -1"):
            state.apply(-1, [ClearedAll()])
        assert {digests(PROMPT)[0]} == state.digests()
        assert 1 == state.next_engine_seq

    def test_the_epoch_wraps_within_63_bits(self) -> None:
        """A reset of the last epoch id starts again at 0 (epochs are compared, not ordered)."""
        state = relay(epoch=2**63 - 1)
        state.apply(0, [])
        applied = state.apply(3, [])
        assert applied.delta is not None
        assert 0 == applied.delta.epoch
        assert StreamPosition(0, 1) == state.position


class TestBlocksItCannotName:
    def test_an_unknown_parent_cannot_be_chained(self) -> None:
        """Blocks after a parent the relay does not know are counted and not recorded."""
        state = relay()
        applied = state.apply(0, [stored([12, 13], PROMPT[4:], parent=11)])
        assert applied.delta is None
        assert 2 == state.counters.unchained_blocks
        assert 0 == len(state)
        state.apply(1, [stored([14], [1, 1, 1, 1], parent=13)])
        assert 3 == state.counters.unchained_blocks

    def test_multimodal_or_salted_blocks_are_opaque_with_their_children(self) -> None:
        """A block with extra keys beyond the LoRA name has no digest, nor has any after it."""
        state = relay()
        state.apply(0, [stored([11, 12, 13], PROMPT, extra_keys=[None, ("mm-hash", 0), None])])
        assert {digests(PROMPT)[0]} == state.digests()
        assert 3 == len(state)
        assert 2 == state.counters.opaque_blocks
        assert state.apply(1, [stored([14], [5, 5, 5, 5], parent=13)]).delta is None
        assert 3 == state.counters.opaque_blocks
        state.apply(2, [RemovedBlocks([12, 14])])
        assert 0 == state.counters.unknown_removals

    def test_another_block_size_is_skipped(self) -> None:
        """Events of a block size other than the relay's are counted and skipped."""
        state = relay()
        assert state.apply(0, [stored([1], list(range(8)), block_size=8)]).delta is None
        assert 1 == state.counters.foreign_blocks

    def test_an_unset_block_size_is_learned_from_the_first_store(self) -> None:
        """With no block size given, the first store names blocks at its own size."""
        state = relay(block_size=None)
        assert UNLEARNED_BLOCK_SIZE == state.snapshot().block_size
        eight = list(range(200, 216))
        applied = state.apply(0, [stored([1, 2], eight, block_size=8)])
        expected = block_digests(eight, block_size=8, key=KEY)
        assert DigestDelta(7, 1, 8, expected, ()) == applied.delta
        assert 8 == state.snapshot().block_size

    def test_a_learned_block_size_holds_while_blocks_are_held(self) -> None:
        """Once blocks are held, another size is foreign; emptied, the next store decides."""
        state = relay(block_size=None)
        state.apply(0, [stored([11, 12, 13], PROMPT)])
        assert state.apply(1, [stored([1], list(range(8)), block_size=8)]).delta is None
        assert 1 == state.counters.foreign_blocks
        state.apply(2, [ClearedAll()])
        state.apply(3, [stored([1], list(range(8)), block_size=8)])
        assert 8 == state.snapshot().block_size

    def test_a_malformed_event_is_skipped_whole_and_the_batch_goes_on(self) -> None:
        """Lengths that disagree or a bad token id skip that event; the others apply."""
        state = relay()
        applied = state.apply(
            0,
            [
                stored([1, 2], PROMPT[:7]),
                stored([3], PROMPT[:4], extra_keys=[None, None]),
                stored([4, 5], [*PROMPT[:4], -3, 0, 0, 0]),
                stored([6], PROMPT[:4]),
            ],
        )
        assert applied.delta is not None
        assert (digests(PROMPT)[0],) == applied.delta.added
        assert 3 == state.counters.malformed_events
        assert 1 == len(state)


class TestMemory:
    def test_the_cap_forgets_the_oldest_and_reports_them_removed(self) -> None:
        """Past max_blocks the oldest blocks go (a sixteenth of the cap) and leave the set."""
        state = relay(max_blocks=16)
        tokens = [[i, i, i, i] for i in range(17)]
        for i in range(16):
            state.apply(i, [stored([100 + i], tokens[i])])
        applied = state.apply(16, [stored([116], tokens[16])])
        assert applied.delta is not None
        assert digests(tokens[16]) == applied.delta.added
        assert digests(tokens[0]) == applied.delta.removed[:1]
        assert 2 == len(applied.delta.removed)
        assert 15 == len(state)
        assert 2 == state.counters.evicted_blocks


def test_a_snapshot_is_the_whole_set_at_the_position() -> None:
    """The snapshot carries the current epoch, seq, block size and every digest."""
    state = relay()
    state.apply(0, [stored([11, 12, 13], PROMPT)])
    state.apply(1, [RemovedBlocks([13])])
    snapshot = state.snapshot()
    assert (7, 2, B) == (snapshot.epoch, snapshot.seq, snapshot.block_size)
    assert set(digests(PROMPT)[:2]) == snapshot.digests


def test_bad_construction_is_refused() -> None:
    """Epoch, block size and cap are checked at construction."""
    for overrides, message in [
        ({"epoch": -1}, "epoch"),
        ({"epoch": 2**63}, "epoch"),
        ({"block_size": 0}, "block_size"),
        ({"max_blocks": 0}, "max_blocks"),
    ]:
        with pytest.raises(ValueError, match=message):
            relay(**overrides)


@settings(max_examples=150, derandomize=True)
@given(batches=batches_st(), max_blocks=st.sampled_from([3, 16, 1000]))
def test_the_relay_holds_what_the_model_holds(batches: list[Batch], max_blocks: int) -> None:
    """Under any stores, removals, clears, gaps and restarts the relay's digests are the model's.

    And its deltas, applied in order from each epoch's empty start, rebuild its set.
    """
    key = DigestKey.from_secret("model-key")
    state = RelayState(epoch=1, block_size=BLOCK_SIZE, key=key, max_blocks=max_blocks)
    model = RelayModel(key=key, block_size=BLOCK_SIZE, max_blocks=max_blocks)
    follower: set[BlockDigest] = set()
    epoch, seq = 1, 0
    for batch in batches:
        applied = state.apply(batch.seq, batch.events)
        assert model.apply(batch.seq, batch.events) == applied.reset
        assert model.held() == state.digests()
        assert len(state) <= max_blocks
        delta = applied.delta
        if delta is not None:
            if delta.epoch != epoch:
                epoch, seq, follower = delta.epoch, 0, set()
            assert seq + 1 == delta.seq
            assert set() == set(delta.added) & follower
            assert set(delta.removed) <= follower
            follower = (follower - set(delta.removed)) | set(delta.added)
            seq = delta.seq
        assert (epoch, seq) == (state.position.epoch, state.position.seq)
        assert follower == state.snapshot().digests
    assert len(batches) == state.counters.batches
