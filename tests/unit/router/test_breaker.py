"""The circuit breaker state machine: closed -> open -> half-open (one probe) -> closed/open."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from caravan_llm.router.core.breaker import (
    CLOSED,
    BreakerPhase,
    BreakerPolicy,
    BreakerState,
    allows_request,
    dispatch,
    phase_at,
    record_failure,
    record_success,
    release_probe,
)

POLICY = BreakerPolicy(failure_threshold=3, cool_down_s=10.0)


def opened_at(now: float) -> BreakerState:
    """A breaker that tripped at `now`."""
    state = CLOSED
    for _ in range(POLICY.failure_threshold):
        state = record_failure(state, POLICY, now, probe=False)
    return state


class TestClosed:
    def test_opens_after_threshold_consecutive_failures(self) -> None:
        """N consecutive failures open the breaker; N-1 do not."""
        state = CLOSED
        state = record_failure(state, POLICY, 1.0, probe=False)
        state = record_failure(state, POLICY, 2.0, probe=False)
        assert state.phase == BreakerPhase.CLOSED

        state = record_failure(state, POLICY, 3.0, probe=False)

        assert BreakerState(BreakerPhase.OPEN, 3, opened_at=3.0) == state

    def test_success_resets_the_failure_count(self) -> None:
        """Failures must be consecutive: a success in between starts the count again."""
        state = record_failure(CLOSED, POLICY, 1.0, probe=False)
        state = record_failure(state, POLICY, 2.0, probe=False)
        state = record_success(state, probe=False)
        state = record_failure(state, POLICY, 3.0, probe=False)

        assert BreakerState(BreakerPhase.CLOSED, 1) == state

    def test_closed_dispatch_is_not_a_probe(self) -> None:
        """A closed breaker lets every request through, none of them a probe."""
        outcome = dispatch(CLOSED, POLICY, 0.0)

        assert (outcome.state, outcome.probe) == (CLOSED, False)


class TestOpenAndHalfOpen:
    def test_open_refuses_until_the_cool_down_ends(self) -> None:
        """An open breaker reads OPEN and refuses during its cool-down, HALF_OPEN after."""
        state = opened_at(100.0)

        assert (
            phase_at(state, POLICY, 109.9),
            allows_request(state, POLICY, 109.9),
        ) == (BreakerPhase.OPEN, False)
        assert (
            phase_at(state, POLICY, 110.0),
            allows_request(state, POLICY, 110.0),
        ) == (BreakerPhase.HALF_OPEN, True)

    def test_half_open_lets_exactly_one_probe_through(self) -> None:
        """After the cool-down one request becomes the probe and the next is refused."""
        probe = dispatch(opened_at(0.0), POLICY, 10.0)

        assert probe.probe
        assert not allows_request(probe.state, POLICY, 10.0)
        assert not allows_request(probe.state, POLICY, 1_000.0)
        with pytest.raises(ValueError, match="lets no request through"):
            dispatch(probe.state, POLICY, 10.0)

    def test_dispatch_while_open_is_refused(self) -> None:
        """Sending to an open breaker before the cool-down is a caller bug and raises."""
        with pytest.raises(ValueError, match="open"):
            dispatch(opened_at(0.0), POLICY, 1.0)

    def test_probe_success_closes(self) -> None:
        """A successful probe closes the breaker and clears the failure count."""
        probe = dispatch(opened_at(0.0), POLICY, 10.0)

        assert record_success(probe.state, probe=True) == CLOSED

    def test_probe_failure_reopens_with_a_new_cool_down(self) -> None:
        """A failed probe opens the breaker again, counting the cool-down from the failure."""
        probe = dispatch(opened_at(0.0), POLICY, 10.0)

        state = record_failure(probe.state, POLICY, 12.0, probe=True)

        assert (state.phase, state.opened_at) == (BreakerPhase.OPEN, 12.0)
        assert not allows_request(state, POLICY, 21.0)
        assert allows_request(state, POLICY, 22.0)

    def test_results_of_requests_sent_before_opening_are_ignored(self) -> None:
        """A late success or failure that was not the probe changes nothing once open."""
        state = opened_at(0.0)

        assert state == record_success(state, probe=False)
        assert state == record_failure(state, POLICY, 5.0, probe=False)
        probe = dispatch(state, POLICY, 10.0)
        assert probe.state == record_success(probe.state, probe=False)

    def test_probe_without_verdict_frees_the_slot(self) -> None:
        """A probe whose client went away lets the next request probe."""
        probe = dispatch(opened_at(0.0), POLICY, 10.0)

        state = release_probe(probe.state, probe=True)

        assert allows_request(state, POLICY, 10.0)
        assert dispatch(state, POLICY, 10.0).probe


def test_policy_rejects_nonsense() -> None:
    """A threshold below 1 or a negative cool-down is refused, naming the field."""
    with pytest.raises(ValueError, match="failure_threshold"):
        BreakerPolicy(failure_threshold=0)
    with pytest.raises(ValueError, match="cool_down_s"):
        BreakerPolicy(cool_down_s=-1)


EVENTS = st.lists(
    st.tuples(
        st.sampled_from(["dispatch", "dispatch", "failure", "failure", "success", "no_verdict"]),
        st.sampled_from([0.0, 0.0, 0.4, 1.0, 3.0]),
    ),
    max_size=60,
)


# A short cool-down and low threshold, so that generated runs reach half-open often.
QUICK = BreakerPolicy(failure_threshold=2, cool_down_s=1.0)


@settings(max_examples=300)
@given(EVENTS)
def test_at_most_one_probe_is_ever_in_flight(events: list[tuple[str, float]]) -> None:
    """Whatever the interleaving, a non-closed breaker never has two probes out at once."""
    state = CLOSED
    now = 0.0
    outstanding: list[bool] = []  # probe flag of each request in flight
    for event, step in events:
        now += step
        if event == "dispatch":
            if allows_request(state, QUICK, now):
                outcome = dispatch(state, QUICK, now)
                state = outcome.state
                outstanding.append(outcome.probe)
        elif outstanding:
            probe = outstanding.pop(0)
            if event == "success":
                state = record_success(state, probe=probe)
            elif event == "failure":
                state = record_failure(state, QUICK, now, probe=probe)
            else:
                state = release_probe(state, probe=probe)
        probes_out = sum(outstanding)
        assert probes_out <= 1
        assert int(state.probe_in_flight) == probes_out
