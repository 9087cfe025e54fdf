"""Signal aggregation: fresh replicas only, unknown never zero, router queues combined."""

from __future__ import annotations

import math
from types import MappingProxyType

import pytest
from autoscale_builders import T0, failed, load, make_signals

from caravan_llm.scheduler.autoscale.signals import (
    RouterQueue,
    RouterQueueReport,
    aggregate,
    router_queue,
)

MAX_AGE_S = 15.0


class TestAggregate:
    def test_fresh_replicas_give_mean_inflight_and_kv(self) -> None:
        """In-flight is running + waiting, and both figures are means over the replicas."""
        signals = make_signals(
            load("a", running=6, waiting=2, kv=0.5),
            load("b", running=10, waiting=0, kv=0.7),
        )

        agg = aggregate(signals, T0, MAX_AGE_S, need_kv_cache=True)

        assert 9.0 == agg.inflight_per_replica
        assert 18.0 == agg.inflight_total
        assert pytest.approx(0.6) == agg.kv_cache_per_replica
        assert agg.complete
        assert 0 == agg.unknown_replicas

    def test_failed_scrape_is_unknown_not_zero(self) -> None:
        """A failed replica adds nothing to the mean and makes the data incomplete."""
        signals = make_signals(load("a", running=8, waiting=0), failed("b"))

        agg = aggregate(signals, T0, MAX_AGE_S)

        assert 8.0 == agg.inflight_per_replica
        assert 1 == agg.inflight_known_replicas
        assert 1 == agg.unknown_replicas
        assert not agg.complete
        assert not agg.inflight_complete

    def test_stale_scrape_is_unknown(self) -> None:
        """A reading older than max_age_s counts as unknown, whatever it says."""
        signals = make_signals(
            load("a", running=4, waiting=0),
            load("b", running=0, waiting=0, at=T0 - MAX_AGE_S - 1),
        )

        agg = aggregate(signals, T0, MAX_AGE_S)

        assert 4.0 == agg.inflight_per_replica
        assert 1 == agg.unknown_replicas
        assert not agg.complete

    def test_reading_at_exactly_max_age_is_fresh(self) -> None:
        """The age limit is inclusive."""
        signals = make_signals(load("a", running=3, waiting=0, at=T0 - MAX_AGE_S))

        assert aggregate(signals, T0, MAX_AGE_S).complete

    def test_ready_replica_missing_from_the_list_is_unknown(self) -> None:
        """Consul says three are ready but only two were scraped: one is unknown."""
        signals = make_signals(load("a", running=1), load("b", running=1), ready=3)

        agg = aggregate(signals, T0, MAX_AGE_S)

        assert 1 == agg.unknown_replicas
        assert not agg.complete

    def test_no_ready_replica_is_incomplete(self) -> None:
        """With nothing ready there is nothing known, and no figure."""
        agg = aggregate(make_signals(ready=0), T0, MAX_AGE_S)

        assert agg.inflight_per_replica is None
        assert agg.inflight_total is None
        assert not agg.complete
        assert not agg.inflight_complete

    def test_router_queue_is_spread_over_measured_replicas(self) -> None:
        """Queued requests add to the demand each measured replica would have to absorb."""
        signals = make_signals(
            load("a", running=4, waiting=0), load("b", running=4, waiting=0), queue=6
        )

        agg = aggregate(signals, T0, MAX_AGE_S)

        assert 7.0 == agg.inflight_per_replica
        assert 8.0 == agg.inflight_total

    def test_unknown_router_queue_adds_nothing(self) -> None:
        """An unknown queue is not guessed at."""
        signals = make_signals(load("a", running=5, waiting=1), queue=None)

        assert 6.0 == aggregate(signals, T0, MAX_AGE_S).inflight_per_replica

    def test_engine_without_waiting_gauge_still_has_inflight(self) -> None:
        """A mapping that names no waiting metric leaves running as the in-flight count."""
        signals = make_signals(load("a", running=5, waiting=None))

        agg = aggregate(signals, T0, MAX_AGE_S)

        assert 5.0 == agg.inflight_per_replica
        assert agg.complete

    def test_replica_without_running_is_unknown(self) -> None:
        """Without a running count the in-flight count of a replica is unknown."""
        signals = make_signals(load("a", running=None, waiting=3))

        agg = aggregate(signals, T0, MAX_AGE_S)

        assert agg.inflight_per_replica is None
        assert 1 == agg.unknown_replicas

    def test_kv_cache_counts_only_when_needed(self) -> None:
        """llama.cpp reports no KV use; that makes data incomplete only for a KV target."""
        signals = make_signals(load("a", running=2, kv=None))

        assert aggregate(signals, T0, MAX_AGE_S, need_kv_cache=False).complete
        assert not aggregate(signals, T0, MAX_AGE_S, need_kv_cache=True).complete

    @pytest.mark.parametrize("bad", [math.nan, math.inf, -1.0])
    def test_implausible_reading_is_unknown(self, bad: float) -> None:
        """NaN, infinite or negative gauges are not readings."""
        signals = make_signals(load("a", running=bad, waiting=0))

        assert aggregate(signals, T0, MAX_AGE_S).inflight_per_replica is None

    def test_negative_ready_count_is_rejected(self) -> None:
        """A negative ready count is a caller bug, reported by name."""
        with pytest.raises(ValueError, match="ready_replicas"):
            aggregate(make_signals(ready=-1), T0, MAX_AGE_S)


def report(
    router_id: str, depth: dict[str, float] | None, wait: dict[str, float] | None = None
) -> RouterQueueReport:
    return RouterQueueReport(
        router_id=router_id,
        depth_by_model=None if depth is None else MappingProxyType(depth),
        mean_wait_s_by_model=None if wait is None else MappingProxyType(wait),
    )


class TestRouterQueue:
    def test_no_routers_means_nothing_queued(self) -> None:
        """With no router registered there is no queue at all."""
        assert RouterQueue(depth=0.0, wait_s=None) == router_queue([], "qwen")

    def test_depths_are_summed_and_wait_is_the_worst_mean(self) -> None:
        """Every router known: the depths add up and the longest mean wait is kept."""
        reports = [
            report("r1", {"qwen": 3.0, "other": 9.0}, {"qwen": 0.5}),
            report("r2", {"qwen": 2.0}, {"qwen": 1.5}),
        ]

        assert RouterQueue(depth=5.0, wait_s=1.5) == router_queue(reports, "qwen")

    def test_model_without_series_has_an_empty_queue(self) -> None:
        """A router that exports the family but no series for the model queues none of it."""
        reports = [report("r1", {"other": 4.0}, {})]

        assert RouterQueue(depth=0.0, wait_s=None) == router_queue(reports, "qwen")

    def test_unknown_router_with_zero_elsewhere_is_unknown(self) -> None:
        """Zero from some routers says nothing when another router is unknown."""
        reports = [report("r1", {"qwen": 0.0}), report("r2", None)]

        assert router_queue(reports, "qwen").depth is None

    def test_unknown_router_with_a_queue_elsewhere_gives_the_lower_bound(self) -> None:
        """A queue at a known router is reported even while another is unknown."""
        reports = [report("r1", {"qwen": 4.0}), report("r2", None)]

        assert 4.0 == router_queue(reports, "qwen").depth
