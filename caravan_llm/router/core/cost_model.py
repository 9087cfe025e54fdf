"""The predicted time to first token of a request on an endpoint (pure, clock passed in).

For one candidate endpoint, the estimate is

    ttft = base_s + (queued + uncached) / rate * (1 + interference * running)

- `queued`: prompt tokens still to prefill ahead of this request there. This
  router's own share: the uncached tokens of every request it sent there
  that has not produced its first token yet, less what the engine has
  prefilled since it started on them (a drain clock at the endpoint's rate,
  moved by every first token that comes early or late). Other routers' requests only
  show in the engine's scraped `waiting` count: the excess over this router's
  own requests at scrape time, times the typical prompt, drained at the
  endpoint's rate for the scrape's age (a one-second-old queue has partly
  gone), is added.
- `uncached`: the request's estimated prompt tokens minus the prefix the
  endpoint holds. Where its KV relay's stream is live and the router has the
  prompt's token ids, the prefix is exact: the blocks the engine's own KV
  events say it holds (`prompt_digests.events_cached`), as a share of the
  prompt's tokens applied to the estimated tokens, so every term stays in
  one unit (`prefix_source` "events"). Otherwise it is what the endpoint's
  `BlockIndex` believes it holds, scaled down by how much of its predicted
  hits the engine's own prefix-cache counters confirmed ("approximate").
- `rate`: prefill tokens per second, learned per endpoint from the streams it
  served (work ahead of the request over its observed time to first token),
  seeded by the rate the endpoint's Meta declares (the profile's, else its
  engine's default, published by the scheduler), else one fallback.
- `running`: requests decoding there (this router's, plus other routers'
  from the scrape); each slows a prefill step a little.

`parse_cache_figures` reads the engine figures the model uses beyond
`EngineLoad` (vLLM's KV capacity and prefix-cache counters); engines that do
not report them (llama.cpp) fall back to the configured capacity and to an
index that is trusted as it is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol

from prometheus_client.parser import text_string_to_metric_families

from caravan_llm.common.engine_metrics import EngineMetricsParseError
from caravan_llm.router.core.prefix_index import BlockIndex, ShapeConfig

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping

    from caravan_llm.common.engine_metrics import EngineLoad
    from caravan_llm.router.core.endpoints import Endpoint, EndpointSnapshot
    from caravan_llm.router.core.kv_index import PrefixSource
    from caravan_llm.router.core.prefix_index import PromptShape
    from caravan_llm.router.core.prompt_digests import EventsCached

VLLM_CACHE_CONFIG = "vllm:cache_config_info"
VLLM_PREFIX_QUERIES = "vllm:prefix_cache_queries_total"
VLLM_PREFIX_HITS = "vllm:prefix_cache_hits_total"
# Histogram of finished requests' prompt tokens: its _sum and _count give the engine's
# mean prompt in real tokens (`CostState.engine_prompt_tokens`).
VLLM_PROMPT_TOKENS = "vllm:request_prompt_tokens"
VLLM_PROMPT_TOKENS_SUM = VLLM_PROMPT_TOKENS + "_sum"
VLLM_PROMPT_TOKENS_COUNT = VLLM_PROMPT_TOKENS + "_count"
# The samples parse_cache_figures sums over engine cores, and every sample it reads
# (the load scraper keeps only these lines: not the histogram's buckets).
_SUMMED = (VLLM_PREFIX_QUERIES, VLLM_PREFIX_HITS, VLLM_PROMPT_TOKENS_SUM, VLLM_PROMPT_TOKENS_COUNT)
CACHE_FIGURE_NAMES = (VLLM_CACHE_CONFIG, *_SUMMED)
# The engine's real tokens per estimated token are believed within these bounds.
TOKEN_RATIO_BOUNDS = (0.25, 4.0)


@dataclass(frozen=True, slots=True)
class CostConfig:
    """The cost model's constants; rates and capacities here are only the defaults."""

    shape: ShapeConfig = field(default_factory=ShapeConfig)
    # Prefill tokens per second before anything is learned, for an endpoint whose
    # Meta declares no rate (the scheduler publishes one for every engine it knows).
    other_prefill_tokens_per_s: float = 5000.0
    # KV capacity (tokens) the index assumes when the engine does not report one.
    default_kv_cache_tokens: int = 65536
    # Fixed part of every time to first token (one engine step).
    base_s: float = 0.02
    # Each running sequence slows prefill by this fraction (decode shares the step).
    interference_per_seq: float = 0.005
    # Learning: weight of a new observation, and the smallest work worth learning from.
    rate_alpha: float = 0.2
    min_learn_tokens: int = 256
    cache_factor_alpha: float = 0.3
    # Prompt size assumed for another router's queued request until this one has seen any.
    default_prompt_tokens: int = 512
    # Estimates this close to the best are a tie, decided by the ring (no herding).
    tie_abs_s: float = 0.005
    tie_rel: float = 0.05
    # A prefix cached nowhere goes to its ring owner among the endpoints with nothing
    # queued whose estimate is within this factor of the best: replicas of one model
    # differ in learned prefill rate by measurement noise (up to 1.5x on a loaded CPU),
    # and following that noise herds every new prefix onto one cache.
    cold_tie_factor: float = 2.0
    # ... unless the ring owner's cache (as believed) is fuller than the emptiest tied
    # one's by more than this share of its capacity: then the next one on the ring
    # (consistent hashing with bounded loads), so a few hot prefixes that hash alike
    # do not overflow one cache while another stays empty.
    cold_fill_slack: float = 0.25
    # A prompt cached somewhere stays with its holders while their estimate is within
    # this factor of the best: a copy in a second cache evicts another prompt there
    # (balancer._predicted_ttft says how that feeds on itself).
    warm_tie_factor: float = 2.0

    def __post_init__(self) -> None:
        for name in (
            "other_prefill_tokens_per_s",
            "default_kv_cache_tokens",
            "default_prompt_tokens",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("base_s", "interference_per_seq", "tie_abs_s", "tie_rel"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.cold_fill_slack <= 1:
            raise ValueError(f"cold_fill_slack must be in [0, 1], got {self.cold_fill_slack}")
        for name in ("cold_tie_factor", "warm_tie_factor"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("rate_alpha", "cache_factor_alpha"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)}")


def default_rate(endpoint: Endpoint, config: CostConfig) -> float:
    """The endpoint's prefill rate before anything is learned: its Meta's, else the fallback.

    The scheduler publishes the profile's `prefill_tokens_per_s`, else its
    engine's default, in every replica's Meta; the router knows no engine.
    """
    if endpoint.prefill_tokens_per_s is not None:
        return float(endpoint.prefill_tokens_per_s)
    return config.other_prefill_tokens_per_s


@dataclass(frozen=True, slots=True)
class CacheFigures:
    """Engine figures beyond `EngineLoad`; None where the engine does not report them."""

    kv_cache_tokens: int | None
    prefix_queries: float | None  # counter, tokens
    prefix_hits: float | None  # counter, tokens
    # The prompt-tokens histogram's sum (tokens) and count (finished requests).
    prompt_tokens: float | None = None
    prompt_requests: float | None = None


@dataclass(frozen=True, slots=True)
class Estimate:
    """One endpoint's predicted time to first token for one request."""

    seconds: float
    cached_tokens: float  # of the request's prompt, believed cached there
    uncached_tokens: float
    # Prefill tokens believed queued ahead of it there (this router's and others').
    queued_tokens: float = 0.0
    # Where `cached_tokens` came from: the engine's KV events, or the approximate index.
    prefix_source: PrefixSource = "approximate"


@dataclass(slots=True)
class CostState:
    """The cost model's bookkeeping for one endpoint, kept in its live state (`.cost`).

    Only this module reads or writes it: the admission gate begins a prefill at
    the lease (`begin_prefill`) and ends it at the first byte or the finish
    (`end_prefill`); the load scraper feeds it the engine's figures.
    """

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
    # The engine's mean prompt in its own tokens: since it started at the first
    # scrape, then over each scrape interval (`record_cache_figures`).
    engine_prompt_tokens: float | None = None
    # Engine-confirmed share of the index's predicted hits, in [0, 1].
    cache_hit_factor: float = 1.0
    # What the index predicted since the last cache figures (tokens hit, queried).
    predicted_hits: float = 0.0
    predicted_queries: float = 0.0
    # This router's own prefilling / decoding requests when the load was scraped.
    prefilling_at_scrape: float = 0.0
    decoding_at_scrape: float = 0.0


class EndpointView(Protocol):
    """What the cost model reads of an endpoint's live state
    (`caravan_llm.router.core.live_state`)."""

    @property
    def in_flight(self) -> int: ...

    @property
    def load(self) -> EngineLoad | None: ...

    @property
    def load_scraped_at(self) -> float | None: ...

    @property
    def cost(self) -> CostState: ...


def parse_cache_figures(text: str) -> CacheFigures:
    """vLLM's KV capacity (cache_config_info's num_gpu_blocks x block_size), prefix
    counters and prompt-tokens histogram (sum and count).

    Label sets (engine cores) are summed. Raises EngineMetricsParseError on bad text.
    """
    kv_tokens = 0
    kv_seen = False
    totals: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == VLLM_CACHE_CONFIG:
                    blocks = _int_label(sample.labels.get("num_gpu_blocks"))
                    size = _int_label(sample.labels.get("block_size"))
                    if blocks is not None and size is not None:
                        kv_tokens += blocks * size
                        kv_seen = True
                elif sample.name in _SUMMED and not math.isnan(sample.value):
                    totals[sample.name] = totals.get(sample.name, 0.0) + float(sample.value)
    except (ValueError, IndexError, KeyError, TypeError) as exc:
        raise EngineMetricsParseError(f"malformed Prometheus exposition text: {exc}") from exc
    return CacheFigures(
        kv_cache_tokens=kv_tokens if kv_seen and kv_tokens > 0 else None,
        prefix_queries=totals.get(VLLM_PREFIX_QUERIES),
        prefix_hits=totals.get(VLLM_PREFIX_HITS),
        prompt_tokens=totals.get(VLLM_PROMPT_TOKENS_SUM),
        prompt_requests=totals.get(VLLM_PROMPT_TOKENS_COUNT),
    )


def _int_label(value: str | None) -> int | None:
    if value is None:
        return None
    try:
        number = int(value)
    except ValueError:
        return None
    return number if number > 0 else None


def prefill_rate(
    endpoint: Endpoint,
    state: EndpointView,
    config: CostConfig,
    peer_rate: float | None = None,
) -> float:
    """Tokens per second: learned if anything was, else its peers', else declared, else default.

    `peer_rate` is what the endpoint's fellow replicas learned (same model):
    a replica that has served nothing yet must not look several times faster
    than the others because the default is optimistic, or a burst piles onto it.
    Before any replica has learned, the rate its Meta declares stands in
    (`default_rate`).
    """
    learned = state.cost.prefill_rate_tps
    if learned is not None:
        return learned
    if peer_rate is not None:
        return peer_rate
    return default_rate(endpoint, config)


def learning_prior(
    endpoint: Endpoint, state: EndpointView, peer_rate: float | None
) -> float | None:
    """Where an endpoint's learned rate starts: its peers' rate, else its declared one.

    The first time to first token a replica reports is often its slowest (an
    engine's first steps after a start or a cache reset; a stall of the host)
    and is one sample: taken alone, one slow first answer made a replica look
    up to 8x slower than it was on two real vLLM engines, so that no new
    prefix went to it and no sample could correct it (its cached prompts teach
    nothing: too little work). It is blended into what the replica's fellows
    learned or what its Meta declares, as any later sample is. None when the
    endpoint has learned (its own rate is the start) or nothing informs a
    start (the fallback default is a guess: the first observation stands).
    """
    if state.cost.prefill_rate_tps is not None:
        return None
    if peer_rate is not None:
        return peer_rate
    declared = endpoint.prefill_tokens_per_s
    return None if declared is None else float(declared)


def peer_rate(states: Iterable[EndpointView]) -> float | None:
    """The mean learned prefill rate of these endpoints; None when none has learned one."""
    learned = [
        state.cost.prefill_rate_tps for state in states if state.cost.prefill_rate_tps is not None
    ]
    return sum(learned) / len(learned) if learned else None


def index_fill(state: EndpointView, config: CostConfig) -> float:
    """The share of the endpoint's KV capacity its index believes in use (0..1)."""
    return len(state.cost.prefix) / max(1, index_capacity_blocks(state, config))


def has_room(state: EndpointView, blocks: int, config: CostConfig) -> bool:
    """Whether the endpoint's cache (as its index believes) takes `blocks` more whole."""
    return len(state.cost.prefix) + blocks <= index_capacity_blocks(state, config)


def index_capacity_blocks(state: EndpointView, config: CostConfig) -> int:
    """How many blocks the index may hold for this endpoint (its engine's KV capacity).

    The engine counts its capacity in its own tokens, the index in estimated
    ones (`ShapeConfig`): the capacity is converted by `token_ratio`.
    """
    figures = state.cost.cache
    tokens = (
        figures.kv_cache_tokens
        if figures is not None and figures.kv_cache_tokens is not None
        else config.default_kv_cache_tokens
    )
    return int(tokens / token_ratio(state) // config.shape.block_tokens)


def token_ratio(state: EndpointView) -> float:
    """The engine's own tokens per token the router estimates; 1 while either is unknown.

    The engine's mean prompt (its prompt-tokens histogram) over the mean prompt
    this router estimated for what it sent there, within `TOKEN_RATIO_BOUNDS`.
    The estimate is characters / 4, which a tokenizer can be far from (the tiny
    test model's takes 2 characters a token; code and many languages differ
    too): an index sized in the wrong unit believes a cache twice its size,
    keeps prefixes the engine evicted and places new ones where they do not fit.
    """
    cost = state.cost
    engine, estimated = cost.engine_prompt_tokens, cost.mean_prompt_tokens
    if engine is None or estimated is None or estimated <= 0:
        return 1.0
    low, high = TOKEN_RATIO_BOUNDS
    return min(max(engine / estimated, low), high)


def cached_tokens(
    state: EndpointView,
    shape: PromptShape,
    config: CostConfig,
    events: EventsCached | None = None,
) -> float:
    """The request's prompt tokens the endpoint is believed to hold (estimated tokens).

    `events`: what the engine's KV events say it holds (`prompt_digests.events_cached`);
    when given, its share of the prompt is exact and the approximate index is not read.
    """
    if events is not None:
        return float(shape.tokens) * events.share
    if not shape.blocks:
        return 0.0
    matched = state.cost.prefix.matched(shape.blocks)
    believed = min(float(shape.tokens), matched * config.shape.block_tokens)
    return believed * state.cost.cache_hit_factor


def foreign_queue(
    endpoint: Endpoint,
    state: EndpointView,
    now: float,
    config: CostConfig,
    max_age_s: float,
    *,
    peer: float | None = None,
) -> tuple[float, float]:
    """Other routers' (queued prefill tokens, running requests) there, from the last scrape."""
    load = state.load
    at = state.load_scraped_at
    if load is None or at is None or now - at > max_age_s:
        return 0.0, 0.0
    waiting = (load.waiting or 0.0) - state.cost.prefilling_at_scrape
    running = (load.running or 0.0) - state.cost.decoding_at_scrape
    # The engine counts this router's prefilling requests as waiting or as
    # running (chunked prefill); whichever way, they are not foreign.
    if waiting < 0:
        running += waiting
        waiting = 0.0
    prompt = state.cost.mean_prompt_tokens or float(config.default_prompt_tokens)
    age = max(0.0, now - at)
    queued = max(0.0, waiting * prompt - prefill_rate(endpoint, state, config, peer) * age)
    return queued, max(0.0, running)


def own_queue(state: EndpointView, now: float, rate: float) -> float:
    """Prefill tokens this router queued there that the engine has not worked through yet.

    The sum of the prefilling requests' uncached tokens, less what the engine
    prefilled since it started on them (its drain clock): a long prompt that
    is nearly done weighs what is left of it.
    """
    queued = state.cost.queued_prefill_tokens
    busy_until = state.cost.prefill_busy_until
    if busy_until is None or now >= busy_until:
        # Past the clock with requests still prefilling: the engine is slower
        # than the rate says (an unlearned default, a stall); count them whole.
        return queued
    return min(queued, (busy_until - now) * rate)


def estimate(
    endpoint: Endpoint,
    state: EndpointView,
    shape: PromptShape | None,
    now: float,
    config: CostConfig,
    *,
    max_age_s: float,
    peer: float | None = None,
    events: EventsCached | None = None,
) -> Estimate:
    """The request's predicted time to first token on this endpoint (module docstring).

    `peer` is the mean rate its fellow replicas learned (`peer_rate`);
    `events` what its KV events say it holds of the prompt (None: not known
    from events, the approximate index answers).
    """
    tokens = float(shape.tokens) if shape is not None else 0.0
    cached = cached_tokens(state, shape, config, events) if shape is not None else 0.0
    uncached = max(0.0, tokens - cached)
    foreign_tokens, foreign_running = foreign_queue(
        endpoint, state, now, config, max_age_s, peer=peer
    )
    rate = prefill_rate(endpoint, state, config, peer)
    queued = own_queue(state, now, rate) + foreign_tokens
    running = state.in_flight - state.cost.prefilling + foreign_running
    seconds = config.base_s + (queued + uncached) / rate * (
        1.0 + config.interference_per_seq * max(0.0, running)
    )
    return Estimate(
        seconds=seconds,
        cached_tokens=cached,
        uncached_tokens=uncached,
        queued_tokens=queued,
        prefix_source="events" if events is not None else "approximate",
    )


def with_adapter_load(item: Estimate, load_s: float | None) -> Estimate:
    """The estimate on a replica that must first load the request's LoRA adapter.

    The load (the engine reads the adapter and adds it, `load_s` as this router
    last timed it) comes before the prefill: its seconds add to the time to
    first token. None: the replica holds it, or the request names no adapter.
    """
    if load_s is None:
        return item
    return replace(item, seconds=item.seconds + load_s)


def load_cost(load_s: float, in_flight: int) -> float:
    """What loading the request's adapter on a replica costs, in seconds of TTFT.

    The engine reads and activates an adapter between two steps, so every
    request in flight there waits for the load too (vLLM's engine core runs
    `add_lora` in its busy loop; devcluster/engine/lora_slots.py). The load is
    counted once for this request and once for each of them, so a replica
    that holds the adapter wins unless it is busier than the load would make
    the other one: loading a copy onto a busy replica to save one request's
    wait delays all of that replica's.
    """
    return load_s * (1 + max(0, in_flight))


def restart_prefill_clock(prefill: Prefill, now: float) -> None:
    """The request reaches the engine only now (its adapter was loaded first).

    Its time to first token is measured from here, so the load does not
    teach the endpoint a slower prefill rate.
    """
    shift = max(0.0, now - prefill.sent_at)
    prefill.sent_at += shift
    prefill.expected_at += shift


def learned_rate(
    previous: float | None,
    *,
    work_tokens: float,
    running: float,
    observed_s: float,
    default: float,
    config: CostConfig,
) -> float | None:
    """The endpoint's prefill rate after one observed time to first token.

    `work_tokens` is what the request had ahead of it plus its own uncached
    tokens, at send time. Observations with too little work say more about
    the fixed step than the rate, and are skipped (None: keep `previous`).
    The new figure is kept within 1/20 and 20 times the default, so one odd
    observation cannot make an endpoint look free or dead.
    """
    if work_tokens < config.min_learn_tokens or observed_s <= 0:
        return None
    prefill_s = max(observed_s - config.base_s, observed_s * 0.1)
    sample = work_tokens * (1.0 + config.interference_per_seq * max(0.0, running)) / prefill_s
    sample = min(max(sample, default / 20.0), default * 20.0)
    if previous is None:
        return sample
    return previous + config.rate_alpha * (sample - previous)


def cache_hit_factor(
    previous: float,
    *,
    predicted_hits: float,
    predicted_queries: float,
    engine_hits: float,
    engine_queries: float,
    config: CostConfig,
) -> float:
    """How far to trust the index: the engine's hit ratio over the index's, in [0, 1].

    Compares ratios, not tokens (the router counts estimated tokens, the engine
    real ones). Nothing predicted, or nothing queried, leaves it unchanged; it
    only ever scales the belief down.
    """
    if predicted_queries <= 0 or engine_queries <= 0 or predicted_hits <= 0:
        return previous
    predicted_ratio = predicted_hits / predicted_queries
    engine_ratio = max(0.0, engine_hits) / engine_queries
    sample = min(1.0, engine_ratio / predicted_ratio)
    return min(1.0, max(0.0, previous + config.cache_factor_alpha * (sample - previous)))


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
    # What the endpoint's first learned rate starts from (`learning_prior`); None: the
    # first observation stands.
    prior_rate: float | None = None
    # Where the endpoint's cached prefix of the prompt was read from (the request log's field).
    prefix_source: PrefixSource = "approximate"
    done: bool = False


def begin_prefill(
    live: Mapping[str, EndpointView],
    endpoint: Endpoint,
    shape: PromptShape,
    now: float,
    config: CostConfig,
    *,
    max_age_s: float,
    peer: float | None = None,
    events: EventsCached | None = None,
) -> Prefill | None:
    """Count the prompt just sent to this endpoint (after `start_request`).

    Queues its uncached tokens, records its blocks in the endpoint's index
    (within the engine's KV capacity) and notes what the index predicted, for
    the engine's prefix-cache counters to confirm. None for an unknown endpoint.
    `events`: what the endpoint's KV events say it holds of the prompt; the
    uncached tokens then follow them, while the approximate index still
    records the prompt and its prediction (it answers when the stream is lost).
    `peer` is the rate its fellow replicas learned (`peer_rate_of`): the drain
    clock must run at the rate the picker assumed, or a replica that learned
    nothing yet looks idle long before its prefill is done.
    """
    state = live.get(endpoint.id)
    if state is None:
        return None
    cost = state.cost
    tokens = float(shape.tokens)
    believed = cached_tokens(state, shape, config, events)
    # What the index alone predicts (before the engine's correction), so that a
    # factor driven to 0 can still recover when the engine's hits come back.
    raw = min(tokens, cost.prefix.matched(shape.blocks) * config.shape.block_tokens)
    uncached = max(0.0, tokens - believed)
    foreign_tokens, foreign_running = foreign_queue(
        endpoint, state, now, config, max_age_s, peer=peer
    )
    # in_flight already counts this request (start_request ran); it is not decoding.
    running = max(0, state.in_flight - 1 - cost.prefilling) + foreign_running
    rate = prefill_rate(endpoint, state, config, peer)
    ahead = own_queue(state, now, rate)
    start = max(now, cost.prefill_busy_until or now)
    cost.prefill_busy_until = start + uncached / rate
    prefill = Prefill(
        endpoint_id=endpoint.id,
        uncached_tokens=uncached,
        work_tokens=ahead + foreign_tokens + uncached,
        running=running,
        sent_at=now,
        default_rate=default_rate(endpoint, config),
        expected_at=cost.prefill_busy_until,
        prior_rate=learning_prior(endpoint, state, peer),
        prefix_source="events" if events is not None else "approximate",
    )
    cost.prefilling += 1
    cost.queued_prefill_tokens += uncached
    cost.predicted_hits += min(raw, tokens)
    cost.predicted_queries += tokens
    cost.mean_prompt_tokens = (
        tokens
        if cost.mean_prompt_tokens is None
        else cost.mean_prompt_tokens + 0.1 * (tokens - cost.mean_prompt_tokens)
    )
    cost.prefix.record(shape.blocks, index_capacity_blocks(state, config))
    return prefill


def peer_rate_of(
    snapshot: EndpointSnapshot, live: Mapping[str, EndpointView], model: str
) -> float | None:
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
    live: Mapping[str, EndpointView],
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
    cost = state.cost
    cost.prefilling = max(0, cost.prefilling - 1)
    cost.queued_prefill_tokens = max(0.0, cost.queued_prefill_tokens - prefill.uncached_tokens)
    if cost.prefilling == 0:
        cost.queued_prefill_tokens = 0.0  # no float dust left behind
        cost.prefill_busy_until = None
    elif first_token and cost.prefill_busy_until is not None:
        # The engine is as early or late on everything behind this request.
        cost.prefill_busy_until = max(now, cost.prefill_busy_until + now - prefill.expected_at)
    if first_token:
        previous = cost.prefill_rate_tps
        rate = learned_rate(
            prefill.prior_rate if previous is None else previous,
            work_tokens=prefill.work_tokens,
            running=prefill.running,
            observed_s=now - prefill.sent_at,
            default=prefill.default_rate,
            config=config,
        )
        if rate is not None:
            cost.prefill_rate_tps = rate


def engine_prompt_mean(
    current: float | None,
    previous: CacheFigures | None,
    figures: CacheFigures,
    config: CostConfig,
) -> float | None:
    """The engine's mean prompt tokens after a scrape: since the engine started when
    nothing is known, then moved toward each interval's mean (requests that finished
    between two scrapes) by `cache_factor_alpha`. A counter gone down (restart) or
    an interval with no finished request leaves it unchanged."""
    total, count = figures.prompt_tokens, figures.prompt_requests
    if total is None or count is None:
        return current
    if current is None:
        return total / count if count > 0 else None
    if previous is None or previous.prompt_tokens is None or previous.prompt_requests is None:
        return current
    finished = count - previous.prompt_requests
    tokens = total - previous.prompt_tokens
    if finished <= 0 or tokens < 0:
        return current
    return current + config.cache_factor_alpha * (tokens / finished - current)


def record_cache_figures(
    live: Mapping[str, EndpointView], endpoint_id: str, figures: CacheFigures, config: CostConfig
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
    cost = state.cost
    previous = cost.cache
    cost.cache = figures
    cost.engine_prompt_tokens = engine_prompt_mean(
        cost.engine_prompt_tokens, previous, figures, config
    )
    cost.prefix.shrink(index_capacity_blocks(state, config))
    if (
        previous is not None
        and previous.prefix_queries is not None
        and previous.prefix_hits is not None
        and figures.prefix_queries is not None
        and figures.prefix_hits is not None
        and figures.prefix_queries >= previous.prefix_queries
        and figures.prefix_hits >= previous.prefix_hits
    ):
        cost.cache_hit_factor = cache_hit_factor(
            cost.cache_hit_factor,
            predicted_hits=cost.predicted_hits,
            predicted_queries=cost.predicted_queries,
            engine_hits=figures.prefix_hits - previous.prefix_hits,
            engine_queries=figures.prefix_queries - previous.prefix_queries,
            config=config,
        )
    cost.predicted_hits = 0.0
    cost.predicted_queries = 0.0
