"""Failure-detection timing of devcluster: Nomad's heartbeat TTL and memberlist's suspicion."""

from __future__ import annotations

import random

import pytest

from caravan_llm.devcluster.consul.serf import (
    SerfTiming,
    detection_delay_s,
    expected_confirmations,
    remaining_timeout_s,
    suspicion_bounds_s,
)
from caravan_llm.devcluster.nomad.heartbeat import (
    HeartbeatSettings,
    heartbeat_ttl_s,
    rate_scaled_interval_s,
)


def test_ttl_is_the_minimum_on_a_small_cluster_and_scales_with_nodes() -> None:
    """RateScaledInterval: max(min_ttl, nodes / rate); 1000 nodes at 50/s need 20 s."""
    assert 10.0 == rate_scaled_interval_s(50.0, 10.0, 3)
    assert 20.0 == rate_scaled_interval_s(50.0, 10.0, 1000)
    assert 10.0 == rate_scaled_interval_s(1.0 / 86400, 10.0, 10**9)


@pytest.mark.parametrize(("stagger", "ttl"), [(0.0, 10.0), (0.5, 15.0), (0.999, 19.99)])
def test_ttl_adds_a_random_stagger_of_up_to_itself(stagger: float, ttl: float) -> None:
    """The TTL a client gets is the scaled interval plus RandomStagger of it."""
    assert ttl == pytest.approx(heartbeat_ttl_s(HeartbeatSettings(), 3, stagger))


def test_suspicion_bounds_follow_memberlist() -> None:
    """min = SuspicionMult * max(1, log10 n) * ProbeInterval; max = 6 * min."""
    timing = SerfTiming()
    assert (4.0, 24.0) == suspicion_bounds_s(timing, 4)
    assert (8.0, 48.0) == suspicion_bounds_s(timing, 100)
    assert 0 == expected_confirmations(timing, 3)
    assert 2 == expected_confirmations(timing, 4)


def test_confirmations_shorten_the_timeout_to_the_minimum() -> None:
    """No confirmation: max; k confirmations: min; in between, memberlist's log curve."""
    assert 24.0 == remaining_timeout_s(0, 2, 4.0, 24.0)
    assert 11.381 == remaining_timeout_s(1, 2, 4.0, 24.0)
    assert 4.0 == remaining_timeout_s(2, 2, 4.0, 24.0)
    assert 4.0 == remaining_timeout_s(0, 0, 4.0, 24.0)


def test_detection_takes_seconds_on_a_small_cluster() -> None:
    """Four agents (one dead): a probe round plus at least the 4 s minimum, under 30 s."""
    rng = random.Random(7)
    delays = [
        detection_delay_s(SerfTiming(), members=4, live_probers=3, rng=rng) for _ in range(500)
    ]
    assert min(delays) >= 1.0 + 4.0
    assert max(delays) <= 4.0 + 24.0
    assert 5.0 < sum(delays) / len(delays) < 12.0


def test_a_lone_prober_waits_for_the_longest_timeout_it_may() -> None:
    """With nobody to confirm (k = 2 expected, one prober), suspicion lasts the maximum."""
    delay = detection_delay_s(SerfTiming(), members=4, live_probers=1, rng=random.Random(1))
    assert delay >= 24.0 + 1.0


def test_bad_timings_are_refused_naming_the_field() -> None:
    """A probe timeout longer than the interval is an error that says which."""
    with pytest.raises(ValueError, match="probe_timeout_s"):
        SerfTiming(probe_timeout_s=2.0)
