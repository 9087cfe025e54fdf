"""Per-endpoint live state that outlives snapshot swaps: in-flight, breaker, draining, load.

Endpoints are immutable and replaced on every Consul change; what the router
learns about them while serving lives here instead, in a dict keyed by
endpoint id. `reconcile_live_state` carries it across a swap (after KubeAI's
`reconcileEndpoints`): a replica that survives keeps its counters and breaker,
so it never restarts cold because another replica moved.

Everything runs on the router's one event loop, and no function here awaits,
so the state needs no lock: a pick and the `start_request` that follows it
happen in the same loop step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING

from caravan_llm.router.core.breaker import (
    CLOSED,
    BreakerPolicy,
    BreakerState,
    dispatch,
    record_failure,
    record_success,
    release_probe,
)
from caravan_llm.router.core.cost_model import CostState
from caravan_llm.router.core.endpoints import CheckStatus

if TYPE_CHECKING:
    from caravan_llm.common.engine_metrics import EngineLoad
    from caravan_llm.router.core.endpoints import EndpointSnapshot


@dataclass(slots=True)
class EndpointLiveState:
    """What the router knows about one endpoint beyond what Consul says."""

    in_flight: int = 0
    breaker: BreakerState = CLOSED
    # No new requests: the endpoint is critical in Consul or gone from it.
    draining: bool = False
    # Gone from the snapshot; the state is dropped once its in-flight reaches 0.
    retired: bool = False
    # The last successful scrape of the engine, and when it was taken (router clock).
    load: EngineLoad | None = None
    load_scraped_at: float | None = None
    # The cost model's bookkeeping of its prefills there (caravan_llm.router.core.cost_model).
    cost: CostState = field(default_factory=CostState)
    # When a request there last ended in success (router clock); None: never.
    # An engine 500 is blamed on the input only from a replica serving lately
    # (caravan_llm.router.core.input_fault).
    last_success_at: float | None = None


LiveStates = dict[str, EndpointLiveState]


class Outcome(StrEnum):
    """What a finished request says about the endpoint's health."""

    SUCCESS = "success"
    FAILURE = "failure"  # connect error, 5xx, broken stream: the endpoint's fault
    NO_VERDICT = "no_verdict"  # client went away, 4xx: says nothing about the endpoint


@dataclass(frozen=True, slots=True)
class Lease:
    """One request in flight on one endpoint; hand it back to `finish_request`."""

    endpoint_id: str
    # This request is the breaker's single half-open probe.
    probe: bool


def reconcile_live_state(
    old_states: LiveStates,
    snapshot: EndpointSnapshot,
    draining: frozenset[str] = frozenset(),
) -> LiveStates:
    """The live state for a new snapshot, built from the old one.

    `draining` holds the ids of endpoints the scheduler marked for draining
    (KV markers): they take no new requests, while their streams finish.

    1. An endpoint still in the snapshot keeps its state object (the same object,
       so requests in flight on it still count), draining if critical or marked.
    2. A new endpoint gets fresh state.
    3. An endpoint gone from the snapshot with requests still in flight is kept,
       draining and retired, until `finish_request` brings it to zero; one with
       none in flight is dropped now.
    """
    states: LiveStates = {}
    for endpoint_id, endpoint in snapshot.by_id.items():
        state = old_states.get(endpoint_id)
        if state is None:
            state = EndpointLiveState()
        state.draining = endpoint.status is CheckStatus.CRITICAL or endpoint_id in draining
        state.retired = False
        states[endpoint_id] = state
    for endpoint_id, state in old_states.items():
        if endpoint_id not in states and state.in_flight > 0:
            state.draining = True
            state.retired = True
            states[endpoint_id] = state
    return states


def start_request(live: LiveStates, endpoint_id: str, policy: BreakerPolicy, now: float) -> Lease:
    """Count a request the balancer just sent to this endpoint.

    Raises ValueError when the breaker lets nothing through (the pick should
    have excluded it).
    """
    state = live.get(endpoint_id)
    if state is None:
        # Picked from a snapshot whose live state was not reconciled yet.
        state = live[endpoint_id] = EndpointLiveState()
    outcome = dispatch(state.breaker, policy, now)
    state.breaker = outcome.state
    state.in_flight += 1
    return Lease(endpoint_id=endpoint_id, probe=outcome.probe)


def finish_request(
    live: LiveStates, lease: Lease, outcome: Outcome, policy: BreakerPolicy, now: float
) -> None:
    """Uncount a finished request and feed its outcome to the endpoint's breaker."""
    state = live.get(lease.endpoint_id)
    if state is None:
        # Only reachable if the lease was finished twice; nothing left to count.
        return
    state.in_flight = max(0, state.in_flight - 1)
    match outcome:
        case Outcome.SUCCESS:
            state.breaker = record_success(state.breaker, probe=lease.probe)
            state.last_success_at = now
        case Outcome.FAILURE:
            state.breaker = record_failure(state.breaker, policy, now, probe=lease.probe)
        case Outcome.NO_VERDICT:
            state.breaker = release_probe(state.breaker, probe=lease.probe)
    if state.retired and state.in_flight == 0:
        del live[lease.endpoint_id]


def blame(live: LiveStates, endpoint_id: str, policy: BreakerPolicy, now: float) -> None:
    """Count a failure against an endpoint after its request was finished without a verdict.

    An engine 500 from a replica that was serving lately is held as a suspicion
    (`caravan_llm.router.core.input_fault`); when another replica then answers the same
    request, the 500 was the replica's after all and counts here. Its lease was no
    half-open probe (a replica in half-open is never vouched for).
    """
    state = live.get(endpoint_id)
    if state is not None:
        state.breaker = record_failure(state.breaker, policy, now, probe=False)


def own_counts(live: LiveStates, endpoint_id: str) -> tuple[int, int] | None:
    """This router's (prefilling, decoding) requests on the endpoint, for `record_load`."""
    state = live.get(endpoint_id)
    if state is None:
        return None
    prefilling = state.cost.prefilling
    return prefilling, state.in_flight - prefilling


def record_load(
    live: LiveStates,
    endpoint_id: str,
    load: EngineLoad,
    now: float,
    *,
    own_before: tuple[int, int] | None = None,
) -> None:
    """Store a scrape of the endpoint's engine; a scrape of a vanished endpoint is dropped.

    `own_before` is `own_counts` when the scrape was sent: the engine counted
    somewhere in between, so the larger of then and now is taken as this
    router's share, and a request that got its first token meanwhile is never
    mistaken for another router's queued one.
    """
    state = live.get(endpoint_id)
    if state is not None:
        state.load = load
        state.load_scraped_at = now
        cost = state.cost
        prefilling, decoding = cost.prefilling, state.in_flight - cost.prefilling
        if own_before is not None:
            prefilling = max(prefilling, own_before[0])
            decoding = max(decoding, own_before[1])
        cost.prefilling_at_scrape = float(prefilling)
        cost.decoding_at_scrape = float(decoding)


def forget_load(live: LiveStates, endpoint_id: str) -> None:
    """A scrape failed: the engine's load is unknown from now on, not its last value."""
    state = live.get(endpoint_id)
    if state is not None:
        state.load = None
        state.load_scraped_at = None
