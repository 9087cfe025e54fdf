"""Live state across snapshot swaps, and the request lease that counts in-flight."""

from __future__ import annotations

import pytest
from router_builders import endpoint_entry, snapshot_of

from caravan_llm.common.engine_metrics import EngineLoad
from caravan_llm.router.core.breaker import BreakerPhase, BreakerPolicy
from caravan_llm.router.core.live_state import (
    EndpointLiveState,
    Outcome,
    finish_request,
    reconcile_live_state,
    record_load,
    start_request,
)

POLICY = BreakerPolicy(failure_threshold=2, cool_down_s=5.0)


class TestReconcile:
    def test_surviving_endpoint_keeps_its_state_object(self) -> None:
        """An endpoint in both snapshots keeps the very same state (in-flight, breaker, load)."""
        live = reconcile_live_state({}, snapshot_of(endpoint_entry("a"), endpoint_entry("b")))
        start_request(live, "a", POLICY, 1.0)
        kept = live["a"]

        live = reconcile_live_state(live, snapshot_of(endpoint_entry("a"), endpoint_entry("c")))

        assert kept is live["a"]
        assert live["a"].in_flight == 1

    def test_new_endpoint_gets_fresh_state(self) -> None:
        """An endpoint new to the snapshot starts idle, closed and not draining."""
        live = reconcile_live_state({}, snapshot_of(endpoint_entry("a")))

        assert EndpointLiveState() == live["a"]

    def test_vanished_idle_endpoint_is_dropped(self) -> None:
        """An endpoint gone from Consul with nothing in flight is forgotten at once."""
        live = reconcile_live_state({}, snapshot_of(endpoint_entry("a"), endpoint_entry("b")))

        live = reconcile_live_state(live, snapshot_of(endpoint_entry("a")))

        assert list(live) == ["a"]

    def test_vanished_busy_endpoint_drains_until_its_last_request_ends(self) -> None:
        """A vanished endpoint with requests in flight stays, draining, until they finish."""
        live = reconcile_live_state({}, snapshot_of(endpoint_entry("a"), endpoint_entry("b")))
        first = start_request(live, "b", POLICY, 1.0)
        second = start_request(live, "b", POLICY, 1.0)

        live = reconcile_live_state(live, snapshot_of(endpoint_entry("a")))
        assert (live["b"].draining, live["b"].retired, live["b"].in_flight) == (True, True, 2)

        finish_request(live, first, Outcome.SUCCESS, POLICY, 2.0)
        assert "b" in live
        finish_request(live, second, Outcome.SUCCESS, POLICY, 3.0)
        assert "b" not in live

    def test_critical_endpoint_drains_and_recovers(self) -> None:
        """A critical endpoint is marked draining; passing again, it is not, with state kept."""
        live = reconcile_live_state({}, snapshot_of(endpoint_entry("a")))
        start_request(live, "a", POLICY, 1.0)

        live = reconcile_live_state(live, snapshot_of(endpoint_entry("a", status="critical")))
        assert (live["a"].draining, live["a"].retired) == (True, False)

        live = reconcile_live_state(live, snapshot_of(endpoint_entry("a")))
        assert (live["a"].draining, live["a"].in_flight) == (False, 1)

    def test_returning_endpoint_stops_draining(self) -> None:
        """An endpoint that vanished while busy and came back is routable again."""
        live = reconcile_live_state({}, snapshot_of(endpoint_entry("a")))
        start_request(live, "a", POLICY, 1.0)
        live = reconcile_live_state(live, snapshot_of(endpoint_entry("b")))

        live = reconcile_live_state(live, snapshot_of(endpoint_entry("a"), endpoint_entry("b")))

        assert (live["a"].draining, live["a"].retired, live["a"].in_flight) == (False, False, 1)


class TestLease:
    def test_start_and_finish_pair_up(self) -> None:
        """In-flight rises on start and falls back on finish."""
        live = reconcile_live_state({}, snapshot_of(endpoint_entry("a")))

        lease = start_request(live, "a", POLICY, 1.0)
        assert live["a"].in_flight == 1
        finish_request(live, lease, Outcome.NO_VERDICT, POLICY, 2.0)

        assert live["a"].in_flight == 0

    def test_failures_open_the_breaker_and_a_probe_closes_it(self) -> None:
        """Outcomes flow into the breaker: failures open it, a successful probe closes it."""
        live = reconcile_live_state({}, snapshot_of(endpoint_entry("a")))
        for now in (1.0, 2.0):
            finish_request(
                live, start_request(live, "a", POLICY, now), Outcome.FAILURE, POLICY, now
            )
        phase_after_failures = live["a"].breaker.phase

        probe = start_request(live, "a", POLICY, 7.0)
        finish_request(live, probe, Outcome.SUCCESS, POLICY, 7.5)

        assert (
            phase_after_failures,
            probe.probe,
            live["a"].breaker.phase,
        ) == (BreakerPhase.OPEN, True, BreakerPhase.CLOSED)

    def test_start_on_open_breaker_raises(self) -> None:
        """Starting a request the breaker refuses is a bug in the caller and raises."""
        live = reconcile_live_state({}, snapshot_of(endpoint_entry("a")))
        for now in (1.0, 2.0):
            finish_request(
                live, start_request(live, "a", POLICY, now), Outcome.FAILURE, POLICY, now
            )

        with pytest.raises(ValueError, match="breaker"):
            start_request(live, "a", POLICY, 3.0)
        assert live["a"].in_flight == 0

    def test_record_load_stores_scrape_with_its_time(self) -> None:
        """A scrape is stored with when it was taken; one for a vanished endpoint is dropped."""
        live = reconcile_live_state({}, snapshot_of(endpoint_entry("a")))
        load = EngineLoad(running=1.0, waiting=0.0, kv_cache_usage=0.2)

        record_load(live, "a", load, 42.0)
        record_load(live, "gone", load, 42.0)

        assert (load, 42.0) == (live["a"].load, live["a"].load_scraped_at)
        assert list(live) == ["a"]
