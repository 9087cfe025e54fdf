"""Per-endpoint circuit breaker as a pure state machine; time is passed in.

    closed --N consecutive failures--> open --cool-down elapsed--> half-open
    half-open: exactly one probe request is let through
    probe succeeds -> closed          probe fails -> open (cool-down restarts)

"Open until the cool-down ends" is not stored as a separate transition: the
state stays OPEN with its `opened_at`, and `phase_at(now)` reads it as
HALF_OPEN once the cool-down has passed. The probe is claimed by `dispatch`,
and only the result of that probe (the caller passes `probe=True` back) can
close or re-open the breaker; results of requests that started before the
breaker opened are ignored, because they say nothing about the endpoint now.

Which outcomes count as failures (connect errors, 5xx) is the proxy's call.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum


class BreakerPhase(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(frozen=True, slots=True)
class BreakerPolicy:
    """How many consecutive failures open the breaker, and how long it stays open."""

    failure_threshold: int = 5
    cool_down_s: float = 10.0

    def __post_init__(self) -> None:
        if self.failure_threshold < 1:
            raise ValueError(f"failure_threshold must be >= 1, got {self.failure_threshold}")
        if self.cool_down_s < 0:
            raise ValueError(f"cool_down_s must be >= 0, got {self.cool_down_s}")


@dataclass(frozen=True, slots=True)
class BreakerState:
    phase: BreakerPhase = BreakerPhase.CLOSED
    consecutive_failures: int = 0
    # When the breaker last opened; None while closed.
    opened_at: float | None = None
    # True while the single half-open probe is out.
    probe_in_flight: bool = False


CLOSED = BreakerState()


@dataclass(frozen=True, slots=True)
class Dispatch:
    """The breaker after letting one request through, and whether that request is the probe."""

    state: BreakerState
    probe: bool


def phase_at(state: BreakerState, policy: BreakerPolicy, now: float) -> BreakerPhase:
    """The phase as of `now`: an OPEN breaker whose cool-down has passed reads HALF_OPEN."""
    if (
        state.phase is BreakerPhase.OPEN
        and state.opened_at is not None
        and now - state.opened_at >= policy.cool_down_s
    ):
        return BreakerPhase.HALF_OPEN
    return state.phase


def allows_request(state: BreakerState, policy: BreakerPolicy, now: float) -> bool:
    """Whether a request may be sent now: closed, or half-open with the probe slot free."""
    if state.phase is BreakerPhase.CLOSED:
        return True
    return phase_at(state, policy, now) is BreakerPhase.HALF_OPEN and not state.probe_in_flight


def dispatch(state: BreakerState, policy: BreakerPolicy, now: float) -> Dispatch:
    """Let one request through; in half-open it becomes the probe and blocks all others.

    Raises ValueError when the breaker does not allow a request (the balancer's
    filter should have kept this endpoint out).
    """
    if state.phase is BreakerPhase.CLOSED:
        return Dispatch(state, probe=False)
    if not allows_request(state, policy, now):
        raise ValueError(f"breaker is {phase_at(state, policy, now)} and lets no request through")
    return Dispatch(replace(state, phase=BreakerPhase.HALF_OPEN, probe_in_flight=True), probe=True)


def record_success(state: BreakerState, *, probe: bool) -> BreakerState:
    """A request to the endpoint succeeded."""
    if state.phase is BreakerPhase.CLOSED:
        return CLOSED if state.consecutive_failures else state
    if probe and state.probe_in_flight:
        return CLOSED
    return state


def record_failure(
    state: BreakerState, policy: BreakerPolicy, now: float, *, probe: bool
) -> BreakerState:
    """A request to the endpoint failed in a way that blames the endpoint."""
    if state.phase is BreakerPhase.CLOSED:
        failures = state.consecutive_failures + 1
        if failures >= policy.failure_threshold:
            return BreakerState(BreakerPhase.OPEN, failures, opened_at=now)
        return replace(state, consecutive_failures=failures)
    if probe and state.probe_in_flight:
        return BreakerState(BreakerPhase.OPEN, state.consecutive_failures + 1, opened_at=now)
    return state


def release_probe(state: BreakerState, *, probe: bool) -> BreakerState:
    """A request ended with no verdict on the endpoint (client went away, 4xx).

    If it was the probe, the slot frees up so that the next request can probe.
    """
    if probe and state.probe_in_flight:
        return replace(state, probe_in_flight=False)
    return state
