"""The balancer's decision core: filters -> scorers in [0,1] -> one picker (after GIE).

`pick` chooses one endpoint of the requested model for one request, or says
why it cannot, so that the caller can answer 404 (no endpoint serves the
model), queue, or answer 429/503. It is pure apart from the picker memory (a
round-robin cursor and an injected `random.Random`): no await, no clock, no
I/O, and it mutates neither the snapshot nor the live state. Everything that
can be computed once per Consul change (candidates per model, sorted; the hash
ring) was computed when the snapshot was built.

Filters, in order (the first one that leaves nothing gives the reason):
1. not in the request's `exclude` set (endpoints this request already tried);
2. healthy: not critical in Consul, not draining;
3. breaker closed, or half-open with its one probe slot free;
4. room: in-flight below capacity (an unstated capacity never counts as full);
5. passing endpoints first; warning ones only when no passing endpoint is left.

A request for a LoRA adapter (`RequestFeatures.adapter`) may go to any replica
of its base model: `predicted_ttft` adds the adapter's load time to the
estimate of a replica that does not hold it (the cost model's
`with_adapter_load`), so a holder wins unless it is that much busier; the
other policies choose among the holders when a candidate holds it, else
among all (the router then loads it where the request goes,
`caravan_llm.router.edge.adapter_loader`).

Scorers (higher is better): in-flight relative to capacity (min-max across the
candidates, because it is the only signal that moves between scrapes), engine
queue and KV-cache usage from the last scrape. A scrape older than
`load_max_age_s`, or none at all, scores as saturated, never idle; when every
candidate is unknown on a dimension, that dimension is neutral (fail open).

`predicted_ttft` scores each candidate by its predicted time to first token
(`caravan_llm.router.core.cost_model.estimate`: queued prefill tokens, the request's uncached
tokens by the endpoint's own KV events where its stream is live, else by the
approximate prefix index, over the learned prefill rate, plus decode
interference) and picks the minimum. Estimates within a small band of
the best are a tie, decided by the hash ring walked from the prompt's prefix
key: a prefix no engine holds yet starts at the same place in every router,
and no random draw makes routers that saw the same traffic disagree.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, assert_never

from caravan_llm.router.core.affinity import DEFAULT_LOAD_FACTOR, load_bound, within_load_bound
from caravan_llm.router.core.breaker import BreakerPhase, BreakerPolicy, allows_request
from caravan_llm.router.core.cost_model import (
    CostConfig,
    Estimate,
    estimate,
    has_room,
    index_fill,
    load_cost,
    peer_rate,
    with_adapter_load,
)
from caravan_llm.router.core.endpoints import CheckStatus, Endpoint
from caravan_llm.router.core.live_state import EndpointLiveState
from caravan_llm.router.core.prompt_digests import events_cached

if TYPE_CHECKING:
    from collections.abc import Sequence

    from caravan_llm.common.contract import EngineRoute
    from caravan_llm.router.core.adapters import AdapterWant
    from caravan_llm.router.core.endpoints import EndpointSnapshot, ModelEndpoints
    from caravan_llm.router.core.live_state import LiveStates
    from caravan_llm.router.core.prefix_index import PromptShape
    from caravan_llm.router.core.prompt_digests import CachedBlocksView, ExactPrompt


class Policy(StrEnum):
    ROUND_ROBIN = "round_robin"
    LEAST_INFLIGHT = "least_inflight"
    POWER_OF_TWO = "power_of_two"
    LOAD_AWARE = "load_aware"
    PREFIX_AFFINITY = "prefix_affinity"  # falls back to LOAD_AWARE
    PREDICTED_TTFT = "predicted_ttft"  # the cost model (caravan_llm.router.core.cost_model)


class NoEndpointReason(StrEnum):
    """Why `pick` found nothing, from the earliest filter stage to the last."""

    NO_ENDPOINTS = "no_endpoints"  # nothing in Consul serves the model: 404 or cold start
    ALL_EXCLUDED = "all_excluded"  # this request already tried every endpoint
    NONE_HEALTHY = "none_healthy"  # every endpoint is critical or draining
    BREAKERS_OPEN = "breakers_open"  # every healthy endpoint's breaker is open
    AT_CAPACITY = "at_capacity"  # every usable endpoint is full: queue, or 429


_REASON_RANK = {reason: rank for rank, reason in enumerate(NoEndpointReason)}


@dataclass(frozen=True, slots=True)
class BalancerConfig:
    """Tuning of the pipeline; built once from the router's settings."""

    breaker: BreakerPolicy = field(default_factory=BreakerPolicy)
    # A scrape older than this is stale: the endpoint scores as saturated.
    load_max_age_s: float = 5.0
    # Saturation levels (GIE's utilization detector uses 5 and 0.8): a queue this
    # deep, or KV usage this high, scores 0 and stops prefix stickiness.
    queue_threshold: float = 5.0
    kv_cache_threshold: float = 0.8
    # CHWBL's c: no endpoint takes more than c times the mean in-flight.
    load_factor: float = DEFAULT_LOAD_FACTOR
    in_flight_weight: float = 1.0
    queue_weight: float = 2.0
    kv_cache_weight: float = 2.0
    cost: CostConfig = field(default_factory=CostConfig)

    def __post_init__(self) -> None:
        for name in ("load_max_age_s", "queue_threshold", "kv_cache_threshold"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.load_factor < 1:
            raise ValueError(f"load_factor must be >= 1, got {self.load_factor}")
        weights = (self.in_flight_weight, self.queue_weight, self.kv_cache_weight)
        if min(weights) < 0 or sum(weights) <= 0:
            raise ValueError(f"scorer weights must be >= 0 and not all 0, got {weights}")


@dataclass(frozen=True, slots=True)
class RequestFeatures:
    """What the balancer reads from a request (derived by the proxy from its ParsedRequest)."""

    model: str
    affinity_key: int | None = None  # core/affinity.py's affinity_key of the body
    exclude: frozenset[str] = frozenset()  # endpoint ids already tried by this request
    prompt: PromptShape | None = None  # core/prefix_index.py's prompt_shape of the body
    # The OpenAI route it is for: only endpoints whose engine serves it are candidates
    # (None: any endpoint of the model).
    route: EngineRoute | None = None
    # core/prompt_digests.py's digests of the prompt's token ids, for the exact index
    # (None: no tokenizer for the model, or no replica of it has a KV stream).
    exact: ExactPrompt | None = None
    # The LoRA adapter it asks for (`model` is then its base model's served name);
    # None: the base model itself.
    adapter: AdapterWant | None = None


@dataclass(slots=True)
class PickerMemory:
    """The only state `pick` changes: round-robin cursors and the random source."""

    rng: random.Random = field(default_factory=random.Random)
    round_robin_next: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Picked:
    endpoint: Endpoint


@dataclass(frozen=True, slots=True)
class NotPicked:
    reason: NoEndpointReason


PickResult = Picked | NotPicked
Candidate = tuple[Endpoint, EndpointLiveState]

# Live state of an endpoint the live dict does not know yet (read, never written).
_UNSEEN = EndpointLiveState()
# Scores closer than this are a tie, broken at random so routers do not herd.
_TIE = 1e-9


def pick(
    snapshot: EndpointSnapshot,
    live: LiveStates,
    request: RequestFeatures,
    policy: Policy,
    now: float,
    *,
    config: BalancerConfig,
    memory: PickerMemory,
    kv: CachedBlocksView | None = None,
) -> PickResult:
    """Choose an endpoint for the request, or say why there is none.

    `kv` is the exact index (the replicas' KV events), read by `predicted_ttft`
    only; None: the approximate index alone.
    """
    model_endpoints = snapshot.for_model(request.model)
    if model_endpoints is None or not model_endpoints.endpoints:
        return NotPicked(NoEndpointReason.NO_ENDPOINTS)
    candidates = filter_candidates(model_endpoints, live, request, now, config)
    if isinstance(candidates, NoEndpointReason):
        return NotPicked(candidates)
    if policy is not Policy.PREDICTED_TTFT:
        candidates = holders_first(candidates, request.adapter)
    if len(candidates) == 1:
        return Picked(candidates[0][0])
    match policy:
        case Policy.ROUND_ROBIN:
            chosen = _round_robin(request.model, candidates, memory)
        case Policy.LEAST_INFLIGHT:
            chosen = _least_in_flight(candidates, memory.rng)
        case Policy.POWER_OF_TWO:
            chosen = _power_of_two(candidates, now, config, memory.rng)
        case Policy.LOAD_AWARE:
            chosen = _max_score(candidates, load_scores(candidates, now, config), memory.rng)
        case Policy.PREFIX_AFFINITY:
            chosen = _prefix_affinity(
                model_endpoints, candidates, request, now=now, config=config, memory=memory
            )
        case Policy.PREDICTED_TTFT:
            chosen = _predicted_ttft(
                model_endpoints, candidates, request, now=now, config=config, kv=kv
            )
        case _:
            assert_never(policy)
    return Picked(chosen)


def filter_candidates(
    model_endpoints: ModelEndpoints,
    live: LiveStates,
    request: RequestFeatures,
    now: float,
    config: BalancerConfig,
) -> list[Candidate] | NoEndpointReason:
    """The endpoints this request may go to, or the reason there are none (module docstring)."""
    passing: list[Candidate] = []
    warning: list[Candidate] = []
    furthest = NoEndpointReason.NO_ENDPOINTS
    for endpoint in model_endpoints.endpoints:
        if not endpoint.serves(request.route):
            # As if it were not there: the proxy refuses a route no endpoint serves first.
            continue
        if endpoint.id in request.exclude:
            stage = NoEndpointReason.ALL_EXCLUDED
        else:
            state = live.get(endpoint.id, _UNSEEN)
            if endpoint.status is CheckStatus.CRITICAL or state.draining:
                stage = NoEndpointReason.NONE_HEALTHY
            elif state.breaker.phase is not BreakerPhase.CLOSED and not allows_request(
                state.breaker, config.breaker, now
            ):
                stage = NoEndpointReason.BREAKERS_OPEN
            elif endpoint.capacity is not None and state.in_flight >= endpoint.capacity:
                stage = NoEndpointReason.AT_CAPACITY
            else:
                if endpoint.status is CheckStatus.PASSING:
                    passing.append((endpoint, state))
                else:
                    warning.append((endpoint, state))
                continue
        if _REASON_RANK[stage] > _REASON_RANK[furthest]:
            furthest = stage
    return passing or warning or furthest


def holders_first(candidates: list[Candidate], adapter: AdapterWant | None) -> list[Candidate]:
    """The candidates that hold the request's adapter, when any does; else all of them."""
    if adapter is None:
        return candidates
    holding = [candidate for candidate in candidates if adapter.holds(candidate[0].id)]
    return holding or candidates


# --- scorers: each returns one score in [0, 1] per candidate, higher is better ---


def in_flight_scores(candidates: Sequence[Candidate]) -> list[float]:
    """In-flight relative to capacity, min-max normalised across the candidates.

    An endpoint with no stated capacity scores as saturated (0) next to ones
    with a capacity; when no candidate states one, raw in-flight counts are
    compared instead.
    """
    utilisation: list[float | None] = [
        state.in_flight / endpoint.capacity if endpoint.capacity else None
        for endpoint, state in candidates
    ]
    if all(value is None for value in utilisation):
        utilisation = [float(state.in_flight) for _, state in candidates]
    known = [value for value in utilisation if value is not None]
    low, high = min(known), max(known)
    if high - low <= _TIE:
        return [1.0 if value is not None else 0.0 for value in utilisation]
    return [0.0 if value is None else (high - value) / (high - low) for value in utilisation]


def queue_scores(
    candidates: Sequence[Candidate], now: float, config: BalancerConfig
) -> list[float]:
    """1 for an empty engine queue, falling to 0 at `queue_threshold` waiting requests."""
    return _pressure_scores([_queue_pressure(state, now, config) for _, state in candidates])


def kv_cache_scores(
    candidates: Sequence[Candidate], now: float, config: BalancerConfig
) -> list[float]:
    """1 for an empty KV cache, falling to 0 at `kv_cache_threshold` usage."""
    return _pressure_scores([_kv_cache_pressure(state, now, config) for _, state in candidates])


def load_scores(candidates: Sequence[Candidate], now: float, config: BalancerConfig) -> list[float]:
    """The weighted mean of the three scorers, in [0, 1]."""
    total_weight = config.in_flight_weight + config.queue_weight + config.kv_cache_weight
    scored = zip(
        in_flight_scores(candidates),
        queue_scores(candidates, now, config),
        kv_cache_scores(candidates, now, config),
        strict=True,
    )
    return [
        (
            config.in_flight_weight * in_flight
            + config.queue_weight * queue
            + config.kv_cache_weight * kv_cache
        )
        / total_weight
        for in_flight, queue, kv_cache in scored
    ]


def _load_is_fresh(state: EndpointLiveState, now: float, config: BalancerConfig) -> bool:
    """Whether the endpoint's last scrape is recent enough to believe."""
    return (
        state.load is not None
        and state.load_scraped_at is not None
        and now - state.load_scraped_at <= config.load_max_age_s
    )


def _queue_pressure(state: EndpointLiveState, now: float, config: BalancerConfig) -> float | None:
    if state.load is None or state.load.waiting is None or not _load_is_fresh(state, now, config):
        return None
    return state.load.waiting / config.queue_threshold


def _kv_cache_pressure(
    state: EndpointLiveState, now: float, config: BalancerConfig
) -> float | None:
    load = state.load
    if load is None or load.kv_cache_usage is None or not _load_is_fresh(state, now, config):
        return None
    return load.kv_cache_usage / config.kv_cache_threshold


def _pressure_scores(pressures: list[float | None]) -> list[float]:
    # Unknown is saturated (0), unless everyone is unknown: then the dimension
    # says nothing and every candidate gets the same score (fail open).
    if all(pressure is None for pressure in pressures):
        return [1.0] * len(pressures)
    return [
        0.0 if pressure is None else 1.0 - min(max(pressure, 0.0), 1.0) for pressure in pressures
    ]


# --- pickers ---


def _max_score(
    candidates: Sequence[Candidate], scores: list[float], rng: random.Random
) -> Endpoint:
    best = max(scores)
    top = [
        candidate
        for candidate, score in zip(candidates, scores, strict=True)
        if score >= best - _TIE
    ]
    return top[0][0] if len(top) == 1 else rng.choice(top)[0]


def _round_robin(model: str, candidates: Sequence[Candidate], memory: PickerMemory) -> Endpoint:
    cursor = memory.round_robin_next.get(model, 0)
    memory.round_robin_next[model] = cursor + 1
    return candidates[cursor % len(candidates)][0]


def _least_in_flight(candidates: Sequence[Candidate], rng: random.Random) -> Endpoint:
    fewest = min(state.in_flight for _, state in candidates)
    top = [endpoint for endpoint, state in candidates if state.in_flight == fewest]
    return top[0] if len(top) == 1 else rng.choice(top)


def _power_of_two(
    candidates: Sequence[Candidate], now: float, config: BalancerConfig, rng: random.Random
) -> Endpoint:
    first, second = rng.sample(range(len(candidates)), 2)
    scores = load_scores([candidates[first], candidates[second]], now, config)
    return candidates[second if scores[1] > scores[0] else first][0]


def _prefix_affinity(
    model_endpoints: ModelEndpoints,
    candidates: Sequence[Candidate],
    request: RequestFeatures,
    *,
    now: float,
    config: BalancerConfig,
    memory: PickerMemory,
) -> Endpoint:
    """CHWBL: the first endpoint on the key's ring walk that is within the load bound.

    An engine that is saturated (queue or KV usage at its threshold) or whose
    load is unknown is passed over too, unless no candidate's load is known; if
    the walk finds nothing, load-aware picks among the endpoints within the
    bound (all of them if none is); a request with no key goes to load-aware.
    """
    if request.affinity_key is None:
        return _max_score(candidates, load_scores(candidates, now, config), memory.rng)
    by_id = {endpoint.id: (endpoint, state) for endpoint, state in candidates}
    bound = load_bound(
        sum(state.in_flight for _, state in candidates), len(candidates), config.load_factor
    )
    pressures = {
        endpoint.id: _engine_pressure(state, now, config) for endpoint, state in candidates
    }
    any_load_known = any(pressure is not None for pressure in pressures.values())
    visited = 0
    for endpoint_id in model_endpoints.ring.walk(request.affinity_key):
        candidate = by_id.get(endpoint_id)
        if candidate is None:
            continue
        endpoint, state = candidate
        pressure = pressures[endpoint_id]
        engine_ok = not any_load_known or (pressure is not None and pressure < 1.0)
        if engine_ok and within_load_bound(state.in_flight, bound):
            return endpoint
        visited += 1
        if visited == len(by_id):
            break
    # No endpoint is both within the bound and known to have room. Load-aware
    # decides, but among the endpoints within the bound when there are any: an
    # endpoint whose scrape is missing must not push the key's whole load onto
    # the one endpoint that reported.
    within = [
        candidate for candidate in candidates if within_load_bound(candidate[1].in_flight, bound)
    ]
    pool = within or candidates
    return _max_score(pool, load_scores(pool, now, config), memory.rng)


def ttft_estimates(
    candidates: Sequence[Candidate],
    request: RequestFeatures,
    now: float,
    config: BalancerConfig,
    kv: CachedBlocksView | None = None,
) -> list[Estimate]:
    """Each candidate's predicted time to first token for the request (`Estimate.seconds`).

    A candidate whose KV stream is live (in `kv`) has its cached prefix from
    its engine's events; the others from the approximate index (`Estimate.prefix_source`).
    """
    peer = peer_rate(state for _, state in candidates)
    adapter = request.adapter
    return [
        with_adapter_load(
            estimate(
                endpoint,
                state,
                request.prompt,
                now,
                config.cost,
                max_age_s=config.load_max_age_s,
                peer=peer,
                events=None if kv is None else events_cached(kv, endpoint, request.exact, now),
            ),
            None
            if adapter is None or adapter.holds(endpoint.id)
            else load_cost(adapter.load_s, state.in_flight),
        )
        for endpoint, state in candidates
    ]


def _predicted_ttft(
    model_endpoints: ModelEndpoints,
    candidates: Sequence[Candidate],
    request: RequestFeatures,
    *,
    now: float,
    config: BalancerConfig,
    kv: CachedBlocksView | None = None,
) -> Endpoint:
    """The smallest predicted time to first token; near-ties go to the prefix's ring order.

    Among near-ties, the endpoints that hold the most of the prompt go first
    (a conversation stays where its history is, rather than being copied
    into a second KV cache for nothing), then those with no prefill queued
    ahead of the request: the band is there so that routers agree on where a
    cold prefix lives, not to put a request behind another's prefill while an
    engine with nothing to prefill is as good by the estimate. A prompt cached
    nowhere widens the band for endpoints with nothing queued to
    `cold_tie_factor` times the best: where a new prefix lives decides every
    later hit on it, and idle replicas of one model differ only by the noise in
    their learned prefill rates, which would otherwise send every new prefix to
    the same one; and a cold prefix skips a ring owner whose cache is fuller
    than the emptiest tied one's by more than `cold_fill_slack` (bounded-load
    consistent hashing), or that has no room left for it while another tied one
    has (`has_room`, in the engine's own tokens): placed where it does not fit,
    it evicts a prefix living there, and the cache it overflows thrashes (on
    two real vLLM replicas, 7 of 12 system prompts on one cache and 5 on the
    other kept 0.87 of the prompts cached, 6 and 6 kept 0.90). A prompt cached
    somewhere stays with the endpoints that hold the most of it among those
    whose estimate is within `warm_tie_factor` times the best (when the
    replica holding a conversation's history is past that, the ones holding
    its system prompt still go before an empty cache): copying it into a
    second cache to save one prefill evicts another prompt there, whose next
    request misses and queues a prefill, which pushes the next warm prompt
    away in turn (on two real vLLM replicas that loop took the fleet's hit
    rate from 0.84 down to round robin's in one run of two). A request with no
    prompt key breaks ties by in-flight relative to capacity, then by
    endpoint id. Deterministic: no random draw.
    """
    estimates = ttft_estimates(candidates, request, now, config, kv)
    best = min(item.seconds for item in estimates)
    band = best + max(config.cost.tie_abs_s, config.cost.tie_rel * best)
    cold = request.prompt is not None and max(item.cached_tokens for item in estimates) <= 0
    cold_band = best * config.cost.cold_tie_factor
    warm_band = best * config.cost.warm_tie_factor
    # The most of the prompt any endpoint within the warm band holds: when the one
    # holding a conversation's history is too busy, the ones holding its system
    # prompt still beat an empty cache.
    held = max((item.cached_tokens for item in estimates if item.seconds <= warm_band), default=0.0)
    near = [
        (endpoint, state, item)
        for (endpoint, state), item in zip(candidates, estimates, strict=True)
        if item.seconds <= band
        or (cold and item.queued_tokens <= 0 and item.seconds <= cold_band)
        or (held > 0 and item.cached_tokens >= held and item.seconds <= warm_band)
    ]
    most = max(item.cached_tokens for _, _, item in near)
    near = [candidate for candidate in near if candidate[2].cached_tokens >= most]
    free = [candidate for candidate in near if candidate[2].queued_tokens <= 0]
    tied = {endpoint.id: (endpoint, state, item.seconds) for endpoint, state, item in free or near}
    if len(tied) == 1:
        return next(iter(tied.values()))[0]
    prompt = request.prompt
    if prompt is not None and prompt.ring_key is not None:
        fill = {eid: index_fill(state, config.cost) for eid, (_, state, _) in tied.items()}
        limit = min(fill.values()) + config.cost.cold_fill_slack if cold else 1.0
        owners = {eid for eid in tied if fill[eid] <= limit}
        if cold:
            # A new prefix goes where it fits whole, if any tied endpoint has room.
            blocks = len(prompt.blocks)
            owners = {
                eid for eid in owners if has_room(tied[eid][1], blocks, config.cost)
            } or owners
        for endpoint_id in model_endpoints.ring.walk(prompt.ring_key):
            if endpoint_id in owners:
                return tied[endpoint_id][0]
    return min(
        tied.values(),
        key=lambda item: (
            item[1].in_flight / item[0].capacity if item[0].capacity else float(item[1].in_flight),
            item[2],
            item[0].id,
        ),
    )[0]


def _engine_pressure(state: EndpointLiveState, now: float, config: BalancerConfig) -> float | None:
    """The roofline saturation of the engine, max(queue, KV) over thresholds; None if unknown."""
    known = [
        pressure
        for pressure in (
            _queue_pressure(state, now, config),
            _kv_cache_pressure(state, now, config),
        )
        if pressure is not None
    ]
    return max(known) if known else None
