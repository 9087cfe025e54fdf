"""The router's exact prefix index, fed by each replica's KV-relay digest stream."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from caravan_llm.common.block_digest import BlockDigest
from caravan_llm.router.core.kv_index import KvIndex, prefix_source

B = 16
STALE_S = 10.0


@dataclass(frozen=True)
class Snap:
    epoch: int
    seq: int
    digests: frozenset[BlockDigest]
    block_size: int = B


@dataclass(frozen=True)
class Delta:
    epoch: int
    seq: int
    added: tuple[BlockDigest, ...] = ()
    removed: tuple[BlockDigest, ...] = ()
    block_size: int = B


@dataclass(frozen=True)
class Beat:
    epoch: int
    seq: int


def d(*values: int) -> tuple[BlockDigest, ...]:
    return tuple(BlockDigest(v) for v in values)


def snap(epoch: int, seq: int, *values: int) -> Snap:
    return Snap(epoch, seq, frozenset(d(*values)))


CHAIN = d(1, 2, 3, 4)


def index_with(*values: int, epoch: int = 5, seq: int = 3, now: float = 0.0) -> KvIndex:
    index = KvIndex(stale_after_s=STALE_S)
    assert "applied" == index.apply_snapshot("r1", snap(epoch, seq, *values), now)
    return index


class TestLookup:
    def test_an_unknown_replica_is_not_known_from_events(self) -> None:
        """A replica with no stream answers None: the caller uses the approximate index."""
        index = KvIndex()
        assert index.cached_blocks("r1", CHAIN, block_size=B, now=0.0) is None
        assert "absent" == index.state("r1", 0.0)
        assert index.needs_snapshot("r1")
        assert "approximate" == prefix_source(None)

    def test_the_leading_held_blocks_are_counted(self) -> None:
        """The count stops at the first block the replica does not hold."""
        index = index_with(1, 2, 4)
        assert 2 == index.cached_blocks("r1", CHAIN, block_size=B, now=1.0)
        assert 0 == index.cached_blocks("r1", d(9, 1, 2), block_size=B, now=1.0)
        assert 0 == index.cached_blocks("r1", (), block_size=B, now=1.0)
        assert "events" == prefix_source(0)

    def test_another_block_size_is_not_an_answer(self) -> None:
        """Digests computed for another block size than the replica's give None, not 0."""
        index = index_with(1, 2)
        assert index.cached_blocks("r1", CHAIN, block_size=128, now=1.0) is None

    def test_every_replica_is_answered(self) -> None:
        """cached_prefixes answers each replica asked: a count, or None when not in sync."""
        index = index_with(1, 2, 3)
        index.apply_snapshot("r2", snap(9, 0, 1), 0.0)
        expected = {"r1": 3, "r2": 1, "r3": None}
        assert expected == index.cached_prefixes(
            CHAIN, block_size=B, replicas=["r1", "r2", "r3"], now=1.0
        )


class TestDeltas:
    def test_deltas_in_order_move_the_set(self) -> None:
        """The next delta is applied; the set follows its additions and removals."""
        index = index_with(1, 2)
        assert "applied" == index.apply_delta("r1", Delta(5, 4, added=d(3, 4)), 1.0)
        assert "applied" == index.apply_delta("r1", Delta(5, 5, removed=d(2)), 1.0)
        assert 1 == index.cached_blocks("r1", CHAIN, block_size=B, now=1.0)
        assert 3 == index.digest_count("r1")
        assert (5, 5) == index.position("r1")

    def test_an_old_delta_changes_nothing(self) -> None:
        """A delta the set already includes is a duplicate."""
        index = index_with(1, 2)
        assert "duplicate" == index.apply_delta("r1", Delta(5, 3, removed=d(1)), 1.0)
        assert 2 == index.cached_blocks("r1", CHAIN, block_size=B, now=1.0)

    def test_a_gap_drops_the_set_until_a_snapshot(self) -> None:
        """A skipped seq drops the replica's set and says so; a snapshot brings it back."""
        index = index_with(1, 2)
        assert "gap" == index.apply_delta("r1", Delta(5, 5, added=d(3)), 1.0)
        assert "resyncing" == index.state("r1", 1.0)
        assert index.needs_snapshot("r1")
        assert index.position("r1") is None
        assert 0 == index.digest_count("r1")
        assert index.cached_blocks("r1", CHAIN, block_size=B, now=1.0) is None
        assert "applied" == index.apply_snapshot("r1", snap(5, 5, 1, 2, 3), 2.0)
        assert 3 == index.cached_blocks("r1", CHAIN, block_size=B, now=2.0)

    def test_deltas_while_resyncing_are_applied_after_the_snapshot(self) -> None:
        """Deltas newer than the snapshot that comes are applied on top of it, in order."""
        index = index_with(1)
        assert "gap" == index.apply_delta("r1", Delta(5, 6, added=d(3)), 1.0)
        assert "buffered" == index.apply_delta("r1", Delta(5, 8, added=d(9)), 1.0)
        assert "buffered" == index.apply_delta("r1", Delta(5, 7, added=d(4)), 1.0)
        index.apply_snapshot("r1", snap(5, 5, 1, 2), 2.0)
        assert (5, 8) == index.position("r1")
        assert 4 == index.cached_blocks("r1", CHAIN, block_size=B, now=2.0)

    def test_only_the_newest_pending_deltas_are_kept(self) -> None:
        """Past max_pending the oldest waiting deltas are dropped, not the newest."""
        index = KvIndex(stale_after_s=STALE_S, max_pending=2)
        for seq in (4, 5, 6):
            index.apply_delta("r1", Delta(5, seq, added=d(seq)), 0.0)
        index.apply_snapshot("r1", snap(5, 4, 4), 1.0)
        assert (5, 6) == index.position("r1")
        assert 3 == index.digest_count("r1")

    def test_a_new_epoch_is_adopted_from_its_first_delta(self) -> None:
        """Seq 1 of another epoch replaces the set: every epoch starts empty."""
        index = index_with(1, 2)
        assert "new_epoch" == index.apply_delta("r1", Delta(6, 1, added=d(7)), 1.0)
        assert (6, 1) == index.position("r1")
        assert 0 == index.cached_blocks("r1", CHAIN, block_size=B, now=1.0)
        assert 1 == index.digest_count("r1")

    def test_a_new_epoch_joined_late_is_a_gap(self) -> None:
        """A later delta of another epoch cannot be applied: resync."""
        index = index_with(1, 2)
        assert "gap" == index.apply_delta("r1", Delta(6, 2, added=d(7)), 1.0)
        assert "resyncing" == index.state("r1", 1.0)

    def test_a_replica_first_heard_from_its_epochs_start_is_live(self) -> None:
        """A replica the index never saw is adopted from seq 1 without a snapshot."""
        index = KvIndex(stale_after_s=STALE_S)
        assert "new_epoch" == index.apply_delta("r1", Delta(3, 1, added=d(1)), 0.0)
        assert 1 == index.cached_blocks("r1", CHAIN, block_size=B, now=0.0)

    def test_an_old_epochs_first_delta_is_not_adopted_while_resyncing(self) -> None:
        """After a gap, seq 1 of the epoch already known is old news and waits for a snapshot."""
        index = index_with(1, 2)
        index.apply_delta("r1", Delta(5, 9), 1.0)
        assert "buffered" == index.apply_delta("r1", Delta(5, 1, added=d(1)), 1.0)
        assert "resyncing" == index.state("r1", 1.0)

    def test_an_older_snapshot_does_not_roll_the_set_back(self) -> None:
        """A snapshot behind the set's position is a duplicate."""
        index = index_with(1, 2)
        index.apply_delta("r1", Delta(5, 4, added=d(3)), 1.0)
        assert "duplicate" == index.apply_snapshot("r1", snap(5, 2, 1), 1.0)
        assert 3 == index.cached_blocks("r1", CHAIN, block_size=B, now=1.0)


class TestLiveness:
    def test_a_silent_stream_goes_stale_and_a_heartbeat_revives_it(self) -> None:
        """Past stale_after_s without a message the set is not used; a matching heartbeat helps."""
        index = index_with(1, 2, now=100.0)
        assert "live" == index.state("r1", 100.0 + STALE_S)
        assert "stale" == index.state("r1", 100.0 + STALE_S + 0.1)
        assert index.cached_blocks("r1", CHAIN, block_size=B, now=111.0) is None
        assert "applied" == index.heartbeat("r1", Beat(5, 3), 111.0)
        assert 2 == index.cached_blocks("r1", CHAIN, block_size=B, now=111.0)

    def test_an_applied_delta_counts_as_heard(self) -> None:
        """A delta moves the staleness clock; a duplicate does not."""
        index = index_with(1, now=0.0)
        index.apply_delta("r1", Delta(5, 4, added=d(2)), 8.0)
        index.apply_delta("r1", Delta(5, 4), 15.0)
        assert "live" == index.state("r1", 18.0)
        assert "stale" == index.state("r1", 18.1)

    def test_a_heartbeat_ahead_of_the_set_is_a_gap(self) -> None:
        """A heartbeat at a later seq or another epoch means deltas were missed."""
        index = index_with(1, 2)
        assert "gap" == index.heartbeat("r1", Beat(5, 4), 1.0)
        assert "resyncing" == index.state("r1", 1.0)
        index = index_with(1, 2)
        assert "gap" == index.heartbeat("r1", Beat(6, 0), 1.0)
        assert "resyncing" == index.state("r1", 1.0)

    def test_an_old_or_early_heartbeat_changes_nothing(self) -> None:
        """A heartbeat behind the set, or for a replica not in sync, is not an answer."""
        index = index_with(1, 2, now=0.0)
        assert "duplicate" == index.heartbeat("r1", Beat(5, 2), 5.0)
        assert "stale" == index.state("r1", 10.5)
        assert "ignored" == index.heartbeat("r2", Beat(5, 2), 5.0)
        assert "absent" == index.state("r2", 5.0)


class TestReplicas:
    def test_a_lost_replica_is_forgotten(self) -> None:
        """forget and retain drop replicas that left discovery."""
        index = index_with(1)
        index.apply_snapshot("r2", snap(1, 0, 1), 0.0)
        index.apply_snapshot("r3", snap(1, 0, 1), 0.0)
        index.forget("r1")
        index.forget("unknown")
        assert frozenset({"r2", "r3"}) == index.replicas()
        index.retain({"r3", "r4"})
        assert frozenset({"r3"}) == index.replicas()
        assert "absent" == index.state("r2", 0.0)

    def test_each_replica_has_its_block_size(self) -> None:
        """The block size comes with the stream; None before any message."""
        index = index_with(1)
        index.apply_snapshot("r2", Snap(1, 0, frozenset(), block_size=128), 0.0)
        assert (B, 128, None) == (
            index.block_size("r1"),
            index.block_size("r2"),
            index.block_size("r3"),
        )


def test_bad_settings_are_refused() -> None:
    """A staleness bound must be positive, the pending bound not negative."""
    with pytest.raises(ValueError, match="stale_after_s must be > 0, got 0"):
        KvIndex(stale_after_s=0)
    with pytest.raises(ValueError, match="max_pending must be >= 0, got -1"):
        KvIndex(max_pending=-1)


class TestInFlight:
    def test_blocks_of_a_request_in_flight_count_until_it_is_released(self) -> None:
        """Held blocks extend the events' chain on that replica only, until released."""
        index = index_with(1)
        index.apply_snapshot("r2", snap(9, 0), 0.0)
        index.hold("r1", d(1, 2, 3))
        held = index.cached_blocks("r1", CHAIN, block_size=B, now=1.0)
        elsewhere = index.cached_blocks("r2", CHAIN, block_size=B, now=1.0)
        index.release("r1", d(1, 2, 3))
        released = index.cached_blocks("r1", CHAIN, block_size=B, now=1.0)
        assert (3, 0, 1) == (held, elsewhere, released)
        assert 0 == index.in_flight_count("r1")

    def test_two_requests_holding_a_block_keep_it_until_both_end(self) -> None:
        """A block held twice stays held after the first release."""
        index = index_with()
        index.hold("r1", d(1, 2))
        index.hold("r1", d(1))
        index.release("r1", d(1, 2))
        assert 1 == index.cached_blocks("r1", CHAIN, block_size=B, now=1.0)

    def test_in_flight_blocks_say_nothing_without_a_live_stream(self) -> None:
        """A replica whose stream is not live answers None even while it holds requests."""
        index = KvIndex(stale_after_s=STALE_S)
        index.hold("r1", d(1, 2))
        assert index.cached_blocks("r1", CHAIN, block_size=B, now=1.0) is None

    def test_a_replica_that_left_discovery_holds_nothing(self) -> None:
        """retain drops the in-flight blocks of replicas no longer routable."""
        index = index_with()
        index.hold("r1", d(1, 2))
        index.retain(["r2"])
        assert 0 == index.in_flight_count("r1")
