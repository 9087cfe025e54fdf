"""The autoscaler's memory: history as a step function, bounded, and its JSON in Consul KV."""

from __future__ import annotations

import json

import pytest
from autoscale_builders import T0

from caravan_llm.scheduler.autoscale.memory import (
    MAX_HISTORY,
    DecisionRecord,
    Direction,
    Memory,
    RecommendationSample,
    memory_from_json,
    memory_to_json,
)


def sample(offset: float, count: int) -> RecommendationSample:
    return RecommendationSample(at=T0 + offset, count=count)


class TestHistory:
    def test_only_changes_are_stored(self) -> None:
        """A recommendation equal to the one in force adds no sample."""
        mem = Memory()
        for offset, count in [(0, 2), (5, 2), (10, 3), (15, 3), (20, 2)]:
            mem = mem.with_recommendation(T0 + offset, count, keep_s=300)

        assert (sample(0, 2), sample(10, 3), sample(20, 2)) == mem.history

    def test_pruning_keeps_the_value_in_force_at_the_horizon(self) -> None:
        """Samples older than the window go, except the one still in force when it begins."""
        mem = Memory(history=(sample(0, 5), sample(10, 4), sample(20, 3)))

        pruned = mem.with_recommendation(T0 + 40, 3, keep_s=25)

        assert (sample(10, 4), sample(20, 3)) == pruned.history

    def test_history_is_bounded(self) -> None:
        """A load that flaps at every evaluation never grows the history past its bound."""
        mem = Memory()
        for index in range(MAX_HISTORY + 50):
            mem = mem.with_recommendation(T0 + index, 1 + index % 2, keep_s=10_000)

        assert MAX_HISTORY == len(mem.history)
        assert T0 + MAX_HISTORY + 49 == mem.history[-1].at

    def test_in_force_since_includes_the_anchor(self) -> None:
        """The values seen over a window are the one in force at its start and all later ones."""
        mem = Memory(history=(sample(0, 5), sample(10, 4), sample(20, 3)))

        assert (4, 3) == mem.in_force_since(T0 + 15, before_history=9)
        assert (5, 4, 3) == mem.in_force_since(T0 + 0, before_history=9)

    def test_window_before_the_history_uses_the_count_in_place(self) -> None:
        """A window the history does not cover yet is not read as agreeing with it."""
        mem = Memory(history=(sample(10, 4),))

        assert (9, 4) == mem.in_force_since(T0, before_history=9)


def full_memory() -> Memory:
    record = DecisionRecord(direction=Direction.UP, target=4, reason="in-flight 14 > 8", at=T0)
    return Memory(
        history=(sample(0, 2), sample(7.5, 4)),
        last_decision=record,
        last_scale=record,
        last_busy_at=T0 + 3,
    )


class TestJson:
    def test_round_trip(self) -> None:
        """What is stored reads back equal."""
        mem = full_memory()

        assert mem == memory_from_json(memory_to_json(mem))

    def test_empty_memory_round_trips(self) -> None:
        """A fresh memory reads back fresh."""
        assert Memory() == memory_from_json(memory_to_json(Memory()))

    def test_bytes_are_accepted(self) -> None:
        """Consul KV values arrive as bytes."""
        mem = full_memory()

        assert mem == memory_from_json(memory_to_json(mem).encode())

    def test_load_warning_is_not_stored(self) -> None:
        """The warning is about one load; the next one must not inherit it."""
        stored = memory_to_json(Memory(load_warning="old problem"))

        assert memory_from_json(stored).load_warning is None

    def test_unknown_fields_are_ignored(self) -> None:
        """Fields a newer scheduler added are skipped and the rest is kept."""
        document = json.loads(memory_to_json(full_memory()))
        document["panic_window"] = {"since": 1}
        document["history"][0]["source"] = "inflight"

        assert full_memory() == memory_from_json(json.dumps(document))

    def test_unsorted_history_is_sorted(self) -> None:
        """A hand-edited history out of order is put in time order."""
        text = json.dumps(
            {"version": 1, "history": [{"at": T0 + 5, "count": 3}, {"at": T0, "count": 2}]}
        )

        assert (sample(0, 2), sample(5, 3)) == memory_from_json(text).history

    @pytest.mark.parametrize(
        ("text", "problem"),
        [
            ("{not json", "not JSON"),
            (b"\xff\xfe", "not JSON"),
            ("[1, 2]", "expected a JSON object, got list"),
            ('{"history": []}', "unknown format version None"),
            ('{"version": 2, "history": []}', "unknown format version 2"),
            ('{"version": 1, "history": [{"at": "soon", "count": 1}]}', "history.0.at"),
            ('{"version": 1, "history": [{"at": 1.0, "count": -1}]}', "history.0.count"),
            ('{"version": 1, "last_busy_at": NaN}', "last_busy_at"),
            ('{"version": 1, "last_decision": {"direction": "sideways"}}', "last_decision"),
        ],
    )
    def test_unreadable_memory_starts_fresh_with_a_warning(
        self, text: str | bytes, problem: str
    ) -> None:
        """A corrupt or foreign value never stops the autoscaler; it starts fresh and says why."""
        mem = memory_from_json(text)

        assert Memory() == Memory(
            history=mem.history,
            last_decision=mem.last_decision,
            last_scale=mem.last_scale,
            last_busy_at=mem.last_busy_at,
        )
        assert mem.load_warning is not None
        assert problem in mem.load_warning
