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

from router.breaker import (
    CLOSED,
    BreakerPolicy,
    BreakerState,
    dispatch,
    record_failure,
    record_success,
    release_probe,
)
from router.cost_model import (
    CacheFigures,
    CostConfig,
    cache_hit_factor,
    cached_tokens,
    default_rate,
    foreign_queue,
    index_capacity_blocks,
    learned_rate,
    own_queue,
    peer_rate,
    prefill_rate,
)
from router.endpoints import CheckStatus
from router.prefix_index import BlockIndex

if TYPE_CHECKING:
    from caravan.engine_metrics import EngineLoad
    from router.endpoints import Endpoint, EndpointSnapshot
    from router.prefix_index import PromptShape


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
    # -- token-level accounting for the cost model (router.cost_model) --
    # Requests sent here that have not produced their first token, and their
    # estimated uncached prompt tokens (the prefill work this router queued).
    prefilling: int = 0
    queued_prefill_tokens: float = 0.0
    # When the engine will have prefilled all of them, if it works through them
    # in order at the endpoint's rate (moved by every first token that comes
    # early or late); None when nothing is prefilling.
    prefill_busy_until: float | None = None
    # The prompt blocks this router sent here, within the engine's KV capacity.
    prefix: BlockIndex = field(default_factory=BlockIndex)
    # Prefill tokens per second learned from observed times to first token.
    prefill_rate_tps: float | None = None
    # Typical prompt (estimated tokens) sent here; sizes other routers' queue.
    mean_prompt_tokens: float | None = None
    # The engine's KV capacity and prefix-cache counters at the last scrape.
    cache: CacheFigures | None = None
    # Engine-confirmed share of the index's predicted hits, in [0, 1].
    cache_hit_factor: float = 1.0
    # What the index predicted since the last cache figures (tokens hit, queried).
    predicted_hits: float = 0.0
    predicted_queries: float = 0.0
    # This router's own prefilling / decoding requests when the load was scraped.
    prefilling_at_scrape: float = 0.0
    decoding_at_scrape: float = 0.0


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
        case Outcome.FAILURE:
            state.breaker = record_failure(state.breaker, policy, now, probe=lease.probe)
        case Outcome.NO_VERDICT:
            state.breaker = release_probe(state.breaker, probe=lease.probe)
    if state.retired and state.in_flight == 0:
        del live[lease.endpoint_id]


def own_counts(live: LiveStates, endpoint_id: str) -> tuple[int, int] | None:
    """This router's (prefilling, decoding) requests on the endpoint, for `record_load`."""
    state = live.get(endpoint_id)
    if state is None:
        return None
    return state.prefilling, state.in_flight - state.prefilling


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
        prefilling, decoding = state.prefilling, state.in_flight - state.prefilling
        if own_before is not None:
            prefilling = max(prefilling, own_before[0])
            decoding = max(decoding, own_before[1])
        state.prefilling_at_scrape = float(prefilling)
        state.decoding_at_scrape = float(decoding)


def forget_load(live: LiveStates, endpoint_id: str) -> None:
    """A scrape failed: the engine's load is unknown from now on, not its last value."""
    state = live.get(endpoint_id)
    if state is not None:
        state.load = None
        state.load_scraped_at = None


@dataclass(slots=True)
class Prefill:
    """One request's prefill on one endpoint, from send to first token; see `end_prefill`."""

    endpoint_id: str
    uncached_tokens: float
    # Prefill tokens ahead of it plus its own, and requests decoding, at send time.
    work_tokens: float
    running: float
    sent_at: float
    # The endpoint's declared (Meta) or fallback rate: bounds what one observation teaches.
    default_rate: float
    # When its first token is expected (the endpoint's drain clock at send time).
    expected_at: float
    done: bool = False


def begin_prefill(
    live: LiveStates,
    endpoint: Endpoint,
    shape: PromptShape,
    now: float,
    config: CostConfig,
    *,
    max_age_s: float,
    peer: float | None = None,
) -> Prefill | None:
    """Count the prompt just sent to this endpoint (after `start_request`).

    Queues its uncached tokens, records its blocks in the endpoint's index
    (within the engine's KV capacity) and notes what the index predicted, for
    the engine's prefix-cache counters to confirm. None for an unknown endpoint.
    `peer` is the rate its fellow replicas learned (`peer_rate_of`): the drain
    clock must run at the rate the picker assumed, or a replica that learned
    nothing yet looks idle long before its prefill is done.
    """
    state = live.get(endpoint.id)
    if state is None:
        return None
    tokens = float(shape.tokens)
    believed = cached_tokens(state, shape, config)
    # What the index alone predicts (before the engine's correction), so that a
    # factor driven to 0 can still recover when the engine's hits come back.
    raw = min(tokens, state.prefix.matched(shape.blocks) * config.shape.block_tokens)
    uncached = max(0.0, tokens - believed)
    foreign_tokens, foreign_running = foreign_queue(
        endpoint, state, now, config, max_age_s, peer=peer
    )
    # in_flight already counts this request (start_request ran); it is not decoding.
    running = max(0, state.in_flight - 1 - state.prefilling) + foreign_running
    rate = prefill_rate(endpoint, state, config, peer)
    ahead = own_queue(state, now, rate)
    start = max(now, state.prefill_busy_until or now)
    state.prefill_busy_until = start + uncached / rate
    prefill = Prefill(
        endpoint_id=endpoint.id,
        uncached_tokens=uncached,
        work_tokens=ahead + foreign_tokens + uncached,
        running=running,
        sent_at=now,
        default_rate=default_rate(endpoint, config),
        expected_at=state.prefill_busy_until,
    )
    state.prefilling += 1
    state.queued_prefill_tokens += uncached
    state.predicted_hits += min(raw, tokens)
    state.predicted_queries += tokens
    state.mean_prompt_tokens = (
        tokens
        if state.mean_prompt_tokens is None
        else state.mean_prompt_tokens + 0.1 * (tokens - state.mean_prompt_tokens)
    )
    state.prefix.record(shape.blocks, index_capacity_blocks(state, config))
    return prefill


def peer_rate_of(snapshot: EndpointSnapshot, live: LiveStates, model: str) -> float | None:
    """The mean prefill rate the model's replicas learned (`cost_model.peer_rate`)."""
    model_endpoints = snapshot.for_model(model)
    if model_endpoints is None:
        return None
    return peer_rate(
        state
        for state in (live.get(endpoint.id) for endpoint in model_endpoints.endpoints)
        if state is not None
    )


def end_prefill(
    live: LiveStates,
    prefill: Prefill,
    now: float,
    config: CostConfig,
    *,
    first_token: bool,
) -> None:
    """The request's prefill is over: its first token came (`first_token`), or it ended.

    Only a first token teaches the endpoint's rate; calling it twice is harmless.
    """
    if prefill.done:
        return
    prefill.done = True
    state = live.get(prefill.endpoint_id)
    if state is None:
        return
    state.prefilling = max(0, state.prefilling - 1)
    state.queued_prefill_tokens = max(0.0, state.queued_prefill_tokens - prefill.uncached_tokens)
    if state.prefilling == 0:
        state.queued_prefill_tokens = 0.0  # no float dust left behind
        state.prefill_busy_until = None
    elif first_token and state.prefill_busy_until is not None:
        # The engine is as early or late on everything behind this request.
        state.prefill_busy_until = max(now, state.prefill_busy_until + now - prefill.expected_at)
    if first_token:
        rate = learned_rate(
            state.prefill_rate_tps,
            work_tokens=prefill.work_tokens,
            running=prefill.running,
            observed_s=now - prefill.sent_at,
            default=prefill.default_rate,
            config=config,
        )
        if rate is not None:
            state.prefill_rate_tps = rate


def record_cache_figures(
    live: LiveStates, endpoint_id: str, figures: CacheFigures, config: CostConfig
) -> None:
    """Store the engine's KV capacity and prefix counters; correct the index by them.

    The index shrinks at once to a smaller reported capacity. The counters'
    growth since the last scrape, against what the index predicted meanwhile,
    updates how far the index is trusted. A counter that went down (engine
    restart) only resets the comparison.
    """
    state = live.get(endpoint_id)
    if state is None:
        return
    previous = state.cache
    state.cache = figures
    state.prefix.shrink(index_capacity_blocks(state, config))
    if (
        previous is not None
        and previous.prefix_queries is not None
        and previous.prefix_hits is not None
        and figures.prefix_queries is not None
        and figures.prefix_hits is not None
        and figures.prefix_queries >= previous.prefix_queries
        and figures.prefix_hits >= previous.prefix_hits
    ):
        state.cache_hit_factor = cache_hit_factor(
            state.cache_hit_factor,
            predicted_hits=state.predicted_hits,
            predicted_queries=state.predicted_queries,
            engine_hits=figures.prefix_hits - previous.prefix_hits,
            engine_queries=figures.prefix_queries - previous.prefix_queries,
            config=config,
        )
    state.predicted_hits = 0.0
    state.predicted_queries = 0.0
