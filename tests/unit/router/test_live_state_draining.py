"""Live-state extensions the I/O layer needs: drain markers and forgetting a failed scrape."""

from __future__ import annotations

from router_builders import endpoint_entry, snapshot_of

from caravan_llm.common.engine_metrics import EngineLoad
from caravan_llm.router.core.live_state import forget_load, reconcile_live_state, record_load


def test_marked_endpoint_drains_and_unmarked_one_recovers() -> None:
    """An endpoint in the drain set drains; dropping the marker makes it routable again."""
    snapshot = snapshot_of(endpoint_entry("a"), endpoint_entry("b"))

    drained = reconcile_live_state({}, snapshot, frozenset({"a"}))
    while_marked = (drained["a"].draining, drained["b"].draining)
    recovered = reconcile_live_state(drained, snapshot)

    assert (True, False) == while_marked
    assert (False, False) == (recovered["a"].draining, recovered["b"].draining)
    assert drained["a"] is recovered["a"]


def test_forget_load_makes_the_engine_unknown() -> None:
    """After a scrape that failed for good, the endpoint's load is unknown, not its last value."""
    snapshot = snapshot_of(endpoint_entry("a"))
    live = reconcile_live_state({}, snapshot)
    record_load(live, "a", EngineLoad(running=1.0, waiting=0.0, kv_cache_usage=0.2), 5.0)

    forget_load(live, "a")
    forget_load(live, "gone")

    assert (None, None) == (live["a"].load, live["a"].load_scraped_at)
    assert ["a"] == list(live)
