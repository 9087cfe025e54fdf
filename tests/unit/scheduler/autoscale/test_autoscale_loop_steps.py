"""The autoscale loop's pure steps: cold-start timing and the tick cadence."""

from __future__ import annotations

from caravan_llm.scheduler.autoscale.loop import cold_start_step, next_tick_in
from caravan_llm.scheduler.autoscale.memory import Direction


def test_a_scale_up_from_zero_begins_it_whatever_asked_for_it() -> None:
    # The router's queue report can reach the autoscaler before its demand
    # record: the decision is UP at zero either way, and the clock starts.
    assert cold_start_step(None, current=0, direction=Direction.UP, ready=0, now=10.0) == (
        10.0,
        None,
    )


def test_it_ends_at_the_first_ready_replica_with_its_duration() -> None:
    began, took = cold_start_step(None, current=0, direction=Direction.UP, ready=0, now=10.0)
    began, took = cold_start_step(began, current=1, direction=Direction.NONE, ready=0, now=12.0)
    assert (began, took) == (10.0, None)
    assert cold_start_step(began, current=1, direction=Direction.NONE, ready=1, now=17.5) == (
        None,
        7.5,
    )


def test_no_scale_up_from_zero_is_no_cold_start() -> None:
    assert cold_start_step(None, current=0, direction=Direction.NONE, ready=0, now=1.0) == (
        None,
        None,
    )
    assert cold_start_step(None, current=2, direction=Direction.UP, ready=2, now=1.0) == (
        None,
        None,
    )


def test_a_second_up_decision_keeps_the_first_start() -> None:
    assert cold_start_step(4.0, current=0, direction=Direction.UP, ready=0, now=9.0) == (
        4.0,
        None,
    )


def test_a_tick_keeps_its_cadence_and_an_overrun_does_not_burst() -> None:
    assert next_tick_in(2.0, 0.5) == 1.5
    assert next_tick_in(2.0, 0.0) == 2.0
    assert next_tick_in(2.0, 5.0) == 0.2
