"""The predicted-TTFT cost model, its live accounting, and the `predicted_ttft` picker."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from router_builders import MODEL, endpoint_entry, health_entry, live_for, service_meta, snapshot_of

from caravan_llm.common.engine_metrics import EngineLoad, EngineMetricsParseError
from caravan_llm.router.core.balancer import (
    BalancerConfig,
    NotPicked,
    Picked,
    PickerMemory,
    PickResult,
    Policy,
    RequestFeatures,
    pick,
)
from caravan_llm.router.core.cost_model import (
    TOKEN_RATIO_BOUNDS,
    CacheFigures,
    CostConfig,
    CostState,
    begin_prefill,
    cache_hit_factor,
    default_rate,
    end_prefill,
    engine_prompt_mean,
    estimate,
    foreign_queue,
    index_capacity_blocks,
    index_fill,
    learned_rate,
    parse_cache_figures,
    peer_rate_of,
    record_cache_figures,
    token_ratio,
)
from caravan_llm.router.core.endpoints import EndpointSnapshot
from caravan_llm.router.core.live_state import (
    EndpointLiveState,
    LiveStates,
    Outcome,
    finish_request,
    own_counts,
    record_load,
    start_request,
)
from caravan_llm.router.core.prefix_index import PromptShape, ShapeConfig, prompt_shape

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "metrics"
SHAPE = ShapeConfig(block_chars=32, chars_per_token=4.0)
COST = CostConfig(shape=SHAPE, default_kv_cache_tokens=4096)
CONFIG = BalancerConfig(cost=COST)
NOW = 100.0
SYSTEM_PROMPTS = [f"System prompt number {n}: " + "be helpful and exact. " * 60 for n in range(6)]


def request_for(system: int, user: str) -> RequestFeatures:
    payload = {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": SYSTEM_PROMPTS[system]},
            {"role": "user", "content": user},
        ],
    }
    return RequestFeatures(model=MODEL, prompt=prompt_shape(payload, SHAPE))


def run_pick(
    snapshot: EndpointSnapshot, live: LiveStates, request: RequestFeatures, *, seed: int = 7
) -> PickResult:
    memory = PickerMemory(rng=random.Random(seed))
    return pick(snapshot, live, request, Policy.PREDICTED_TTFT, NOW, config=CONFIG, memory=memory)


def picked_id(result: PickResult) -> str:
    assert isinstance(result, Picked), result
    return result.endpoint.id


def send(
    snapshot: EndpointSnapshot, live: LiveStates, request: RequestFeatures, now: float = NOW
) -> str:
    """Pick, lease and count the request's prefill, as the proxy does."""
    chosen = picked_id(run_pick(snapshot, live, request))
    start_request(live, chosen, CONFIG.breaker, now)
    assert request.prompt is not None
    begin_prefill(live, snapshot.by_id[chosen], request.prompt, now, COST, max_age_s=5.0)
    return chosen


def four() -> EndpointSnapshot:
    return snapshot_of(*(endpoint_entry(f"e{i}") for i in range(4)))


class TestEstimate:
    def test_cached_prefix_and_queued_work_move_the_estimate(self) -> None:
        snapshot = four()
        endpoint = snapshot.by_id["e0"]
        shape = request_for(0, "hello").prompt
        assert shape is not None
        idle = EndpointLiveState()
        cold = estimate(endpoint, idle, shape, NOW, COST, max_age_s=5)
        warm_state = EndpointLiveState()
        warm_state.cost.prefix.record(shape.blocks, 1000)
        warm = estimate(endpoint, warm_state, shape, NOW, COST, max_age_s=5)
        busy_state = EndpointLiveState(cost=CostState(queued_prefill_tokens=4000))
        busy = estimate(endpoint, busy_state, shape, NOW, COST, max_age_s=5)
        assert warm.seconds < cold.seconds < busy.seconds
        assert warm.cached_tokens > 0.9 * shape.tokens
        assert cold.cached_tokens == 0
        rate = COST.other_prefill_tokens_per_s
        assert cold.seconds == pytest.approx(COST.base_s + shape.tokens / rate)
        assert busy.seconds - cold.seconds == pytest.approx(4000 / rate)

    def test_other_routers_queue_shows_through_the_scrape_and_drains_with_age(self) -> None:
        endpoint = four().by_id["e0"]
        shape = PromptShape(blocks=(), tokens=100, ring_key=1)
        state = EndpointLiveState(cost=CostState(mean_prompt_tokens=2000.0))
        record_live = {"e0": state}
        record_load(record_live, "e0", EngineLoad(running=2, waiting=5, kv_cache_usage=0.5), NOW)
        fresh = estimate(endpoint, state, shape, NOW, COST, max_age_s=5)
        later = estimate(endpoint, state, shape, NOW + 0.2, COST, max_age_s=5)
        stale = estimate(endpoint, state, shape, NOW + 10, COST, max_age_s=5)
        alone = estimate(endpoint, EndpointLiveState(), shape, NOW, COST, max_age_s=5)
        assert fresh.seconds > later.seconds > stale.seconds == alone.seconds

    def test_own_requests_in_the_scrape_are_not_counted_twice(self) -> None:
        """What the engine reports waiting is this router's own work: no foreign queue."""
        snapshot = four()
        live = live_for(snapshot)
        shape = request_for(0, "q").prompt
        assert shape is not None
        for _ in range(3):
            start_request(live, "e0", CONFIG.breaker, NOW)
            begin_prefill(live, snapshot.by_id["e0"], shape, NOW, COST, max_age_s=5)
        record_load(live, "e0", EngineLoad(running=0, waiting=3, kv_cache_usage=0.2), NOW)
        with_scrape = estimate(snapshot.by_id["e0"], live["e0"], shape, NOW, COST, max_age_s=5)
        live["e0"].load = None
        without = estimate(snapshot.by_id["e0"], live["e0"], shape, NOW, COST, max_age_s=5)
        assert with_scrape.seconds == pytest.approx(without.seconds)

    def test_the_default_rate_is_the_endpoints_meta_else_one_fallback_for_any_engine(self) -> None:
        """The router names no engine: Meta's rate, else `other_prefill_tokens_per_s`."""
        endpoint = four().by_id["e0"]
        declared = dataclasses.replace(endpoint, prefill_tokens_per_s=12000)
        assert default_rate(declared, COST) == 12000.0
        for engine in ("vllm", "llamacpp", "sglang"):
            undeclared = dataclasses.replace(endpoint, engine=engine, prefill_tokens_per_s=None)
            assert default_rate(undeclared, COST) == COST.other_prefill_tokens_per_s


class TestLearning:
    def test_rate_converges_to_what_the_endpoint_does(self) -> None:
        rate: float | None = None
        for _ in range(40):
            rate = (
                learned_rate(
                    rate,
                    work_tokens=3000,
                    running=0,
                    observed_s=COST.base_s + 3000 / 5000,
                    default=20000,
                    config=COST,
                )
                or rate
            )
        assert rate == pytest.approx(5000, rel=0.01)

    def test_small_work_teaches_nothing_and_outliers_are_clamped(self) -> None:
        kwargs = {"running": 0.0, "default": 20000.0, "config": COST}
        assert learned_rate(None, work_tokens=10, observed_s=1.0, **kwargs) is None  # type: ignore[arg-type]
        assert learned_rate(None, work_tokens=1e6, observed_s=1e-9, **kwargs) == 20000 * 20  # type: ignore[arg-type]
        assert learned_rate(None, work_tokens=300, observed_s=1e6, **kwargs) == 20000 / 20  # type: ignore[arg-type]

    def test_first_token_teaches_the_rate_and_releases_the_queue(self) -> None:
        snapshot = four()
        live = live_for(snapshot)
        shape = PromptShape(blocks=(), tokens=2000, ring_key=1)
        start_request(live, "e1", CONFIG.breaker, NOW)
        prefill = begin_prefill(live, snapshot.by_id["e1"], shape, NOW, COST, max_age_s=5)
        assert prefill is not None
        assert (live["e1"].cost.prefilling, live["e1"].cost.queued_prefill_tokens) == (1, 2000)
        end_prefill(live, prefill, NOW + COST.base_s + 0.5, COST, first_token=True)
        end_prefill(live, prefill, NOW + 9, COST, first_token=True)  # twice: no effect
        assert (live["e1"].cost.prefilling, live["e1"].cost.queued_prefill_tokens) == (0, 0)
        assert live["e1"].cost.prefill_rate_tps == pytest.approx(4000)

    def test_a_first_observation_is_blended_into_the_declared_rate(self) -> None:
        """One slow first answer (8x the declared time) moves a replica's rate by
        `rate_alpha` from what its Meta declares, not all the way."""
        snapshot = declared_pair(40000)
        live = live_for(snapshot)
        shape = PromptShape(blocks=(), tokens=1000, ring_key=1)
        start_request(live, "e0", CONFIG.breaker, NOW)
        prefill = begin_prefill(live, snapshot.by_id["e0"], shape, NOW, COST, max_age_s=5)
        assert prefill is not None
        end_prefill(live, prefill, NOW + COST.base_s + 8 * 1000 / 40000, COST, first_token=True)
        sample = 40000 / 8
        assert live["e0"].cost.prefill_rate_tps == pytest.approx(
            40000 + COST.rate_alpha * (sample - 40000)
        )

    def test_a_first_observation_is_blended_into_what_the_peers_learned(self) -> None:
        snapshot = declared_pair(40000)
        live = live_for(snapshot)
        live["e1"].cost.prefill_rate_tps = 20000.0
        shape = PromptShape(blocks=(), tokens=1000, ring_key=1)
        start_request(live, "e0", CONFIG.breaker, NOW)
        prefill = begin_prefill(
            live, snapshot.by_id["e0"], shape, NOW, COST, max_age_s=5, peer=20000.0
        )
        assert prefill is not None
        end_prefill(live, prefill, NOW + COST.base_s + 1000 / 10000, COST, first_token=True)
        assert live["e0"].cost.prefill_rate_tps == pytest.approx(
            20000 + COST.rate_alpha * (10000 - 20000)
        )

    def test_a_failed_attempt_teaches_nothing(self) -> None:
        snapshot = four()
        live = live_for(snapshot)
        shape = PromptShape(blocks=(), tokens=2000, ring_key=1)
        start_request(live, "e1", CONFIG.breaker, NOW)
        prefill = begin_prefill(live, snapshot.by_id["e1"], shape, NOW, COST, max_age_s=5)
        assert prefill is not None
        end_prefill(live, prefill, NOW + 30, COST, first_token=False)
        assert live["e1"].cost.prefill_rate_tps is None
        assert live["e1"].cost.queued_prefill_tokens == 0


class TestEngineCacheFigures:
    def test_real_vllm_exposition(self) -> None:
        figures = parse_cache_figures((FIXTURES / "vllm.txt").read_text())
        assert figures.kv_cache_tokens == 27532 * 16

    def test_missing_figures_are_none_and_bad_text_raises(self) -> None:
        assert parse_cache_figures("llamacpp:requests_processing 1\n") == CacheFigures(
            None, None, None
        )
        with pytest.raises(EngineMetricsParseError):
            parse_cache_figures('vllm:cache_config_info{block_size="16" 1\n')

    def test_engine_capacity_shrinks_the_index(self) -> None:
        snapshot = four()
        live = live_for(snapshot)
        shape = PromptShape(blocks=tuple(range(100)), tokens=800, ring_key=1)
        start_request(live, "e0", CONFIG.breaker, NOW)
        begin_prefill(live, snapshot.by_id["e0"], shape, NOW, COST, max_age_s=5)
        assert len(live["e0"].cost.prefix) == 100
        record_cache_figures(live, "e0", CacheFigures(32 * 16, None, None), COST)
        assert len(live["e0"].cost.prefix) * SHAPE.block_tokens <= 32 * 16

    def test_the_prompt_tokens_histogram_is_summed_over_engine_cores(self) -> None:
        text = "".join(
            f'vllm:request_prompt_tokens_{part}{{engine="{core}",model_name="m"}} {value}\n'
            for core in (0, 1)
            for part, value in (("sum", 900.0), ("count", 3.0))
        )
        text += 'vllm:request_prompt_tokens_bucket{engine="0",le="+Inf",model_name="m"} 3.0\n'
        figures = parse_cache_figures(text)
        assert (figures.prompt_tokens, figures.prompt_requests) == (1800.0, 6.0)

    def test_the_engines_mean_prompt_starts_from_its_lifetime_then_follows_intervals(
        self,
    ) -> None:
        def at(total: float, count: float) -> CacheFigures:
            return CacheFigures(None, None, None, prompt_tokens=total, prompt_requests=count)

        assert engine_prompt_mean(None, None, at(0, 0), COST) is None
        assert engine_prompt_mean(None, None, at(3000, 10), COST) == 300
        after = engine_prompt_mean(300, at(3000, 10), at(3900, 11), COST)
        assert after == pytest.approx(300 + COST.cache_factor_alpha * (900 - 300))
        assert engine_prompt_mean(300, at(3000, 10), at(3000, 10), COST) == 300  # none finished
        assert engine_prompt_mean(300, at(3000, 10), at(50, 1), COST) == 300  # restarted
        assert engine_prompt_mean(300, at(3000, 10), CacheFigures(None, 0, 0), COST) == 300

    def test_the_index_is_sized_in_the_engines_tokens(self) -> None:
        """An engine whose prompts are 2x the router's estimate holds half the estimated
        tokens its capacity says: the index believes half the blocks (within bounds)."""
        snapshot = four()
        live = live_for(snapshot)
        shape = PromptShape(blocks=tuple(range(100)), tokens=800, ring_key=1)
        start_request(live, "e0", CONFIG.breaker, NOW)
        begin_prefill(live, snapshot.by_id["e0"], shape, NOW, COST, max_age_s=5)
        figures = CacheFigures(4000 * 8, 0, 0, prompt_tokens=1600.0 * 5, prompt_requests=5.0)
        record_cache_figures(live, "e0", figures, COST)
        assert token_ratio(live["e0"]) == pytest.approx(2.0)
        assert index_capacity_blocks(live["e0"], COST) == 2000
        live["e0"].cost.engine_prompt_tokens = 800.0 * 100
        assert token_ratio(live["e0"]) == TOKEN_RATIO_BOUNDS[1]
        assert token_ratio(live["e1"]) == 1.0  # nothing sent there: nothing to compare

    def test_engine_hit_counters_scale_the_belief_down_only(self) -> None:
        assert cache_hit_factor(
            1.0,
            predicted_hits=900,
            predicted_queries=1000,
            engine_hits=450,
            engine_queries=1000,
            config=COST,
        ) == pytest.approx(1 - COST.cache_factor_alpha * 0.5)
        assert (
            cache_hit_factor(
                1.0,
                predicted_hits=100,
                predicted_queries=1000,
                engine_hits=900,
                engine_queries=1000,
                config=COST,
            )
            == 1.0
        )

    def test_counters_feed_the_factor_through_the_live_state(self) -> None:
        snapshot = four()
        live = live_for(snapshot)
        shape = request_for(1, "x").prompt
        assert shape is not None
        record_cache_figures(live, "e2", CacheFigures(None, 0, 0), COST)
        for _ in range(2):  # the second is predicted a full hit
            start_request(live, "e2", CONFIG.breaker, NOW)
            begin_prefill(live, snapshot.by_id["e2"], shape, NOW, COST, max_age_s=5)
        # The engine saw no hit at all: the index is believed less from now on.
        record_cache_figures(live, "e2", CacheFigures(None, 2 * shape.tokens, 0), COST)
        assert live["e2"].cost.cache_hit_factor < 1.0
        assert live["e2"].cost.predicted_queries == 0


class TestPredictedTtftPicker:
    def test_a_cold_prefix_goes_where_the_ring_says_in_every_router(self) -> None:
        """No engine holds it: every router places it the same way, whatever its seed."""
        snapshot = four()
        request = request_for(2, "hello")
        picks = {
            picked_id(run_pick(snapshot, live_for(snapshot), request, seed=s)) for s in range(5)
        }
        assert len(picks) == 1

    def test_later_requests_of_a_prefix_follow_it(self) -> None:
        snapshot = four()
        live = live_for(snapshot)
        home = send(snapshot, live, request_for(3, "first conversation"))
        # Its prefill finished; the prefix is cached there.
        live[home].cost.queued_prefill_tokens = 0
        live[home].cost.prefilling = 0
        for n in range(5):
            assert picked_id(run_pick(snapshot, live, request_for(3, f"other user {n}"))) == home

    def test_prefixes_spread_over_the_fleet(self) -> None:
        """Different system prompts do not all land on one engine."""
        snapshot = four()
        live = live_for(snapshot)
        homes = {send(snapshot, live, request_for(n, "hi")) for n in range(6)}
        assert len(homes) >= 3

    def test_a_busy_home_spills_to_an_idle_engine(self) -> None:
        snapshot = four()
        live = live_for(snapshot)
        request = request_for(4, "q")
        home = send(snapshot, live, request)
        assert request.prompt is not None
        live[home].cost.queued_prefill_tokens = 20 * request.prompt.tokens
        live[home].cost.prefill_busy_until = NOW + 20 * request.prompt.tokens / 1000
        assert picked_id(run_pick(snapshot, live, request)) != home

    def test_unique_prompts_spread_like_rotation(self) -> None:
        """With nothing shared, queued work spreads requests over every endpoint."""
        snapshot = four()
        live = live_for(snapshot)
        chosen = [
            send(snapshot, live, RequestFeatures(MODEL, prompt=PromptShape((), 1500, n)))
            for n in range(8)
        ]
        assert sorted(chosen) == sorted([f"e{i}" for i in range(4)] * 2)

    def test_request_without_prompt_goes_to_the_least_loaded(self) -> None:
        snapshot = four()
        live = live_for(snapshot, {f"e{i}": EndpointLiveState(in_flight=5 - i) for i in range(4)})
        assert picked_id(run_pick(snapshot, live, RequestFeatures(MODEL))) == "e3"


# --- properties ---

TRAFFIC = st.lists(
    st.tuples(st.integers(0, 5), st.integers(0, 3), st.booleans()), min_size=1, max_size=25
)


def replay(traffic: list[tuple[int, int, bool]], seed: int) -> list[str]:
    """One router's picks for a sequence of (system prompt, user, first token now?)."""
    snapshot = four()
    live = live_for(snapshot)
    rng = random.Random(seed)
    chosen: list[str] = []
    pending = []
    for step, (system, user, done) in enumerate(traffic):
        request = request_for(system, f"user {user}")
        result = pick(
            snapshot,
            live,
            request,
            Policy.PREDICTED_TTFT,
            NOW + step,
            config=CONFIG,
            memory=PickerMemory(rng=rng),
        )
        endpoint_id = picked_id(result)
        chosen.append(endpoint_id)
        start_request(live, endpoint_id, CONFIG.breaker, NOW + step)
        assert request.prompt is not None
        prefill = begin_prefill(
            live, snapshot.by_id[endpoint_id], request.prompt, NOW + step, COST, max_age_s=5
        )
        pending.append(prefill)
        if done:
            for item in pending:
                assert item is not None
                end_prefill(live, item, NOW + step + 0.5, COST, first_token=True)
            pending.clear()
    return chosen


@settings(max_examples=60, deadline=None)
@given(TRAFFIC, st.integers(0, 1000), st.integers(0, 1000))
def test_routers_that_saw_the_same_traffic_pick_the_same(
    traffic: list[tuple[int, int, bool]], seed_a: int, seed_b: int
) -> None:
    """The picker is a function of what the router saw: no random draw, no hidden state."""
    assert replay(traffic, seed_a) == replay(traffic, seed_b)


@settings(max_examples=60, deadline=None)
@given(TRAFFIC)
def test_index_belief_never_exceeds_engine_capacity(traffic: list[tuple[int, int, bool]]) -> None:
    """However much is sent, no endpoint's index believes more than its KV capacity."""
    snapshot = four()
    live = live_for(snapshot)
    for step, (system, user, _) in enumerate(traffic):
        send(snapshot, live, request_for(system, f"user {user} " * 30), NOW + step)
        for state in live.values():
            assert len(state.cost.prefix) * SHAPE.block_tokens <= COST.default_kv_cache_tokens


@settings(max_examples=80, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["passing", "warning", "critical"]),
            st.booleans(),  # draining
            st.booleans(),  # excluded
            st.integers(0, 4),  # in flight (capacity 3)
            st.integers(0, 5000),  # queued prefill tokens
            st.booleans(),  # holds the prefix
        ),
        min_size=1,
        max_size=6,
    ),
    st.integers(0, 5),
)
def test_never_picks_a_filtered_endpoint(
    specs: list[tuple[str, bool, bool, int, int, bool]], system: int
) -> None:
    """Not even one that holds the whole prompt and has nothing queued."""
    ids = [f"e{i}" for i in range(len(specs))]
    snapshot = snapshot_of(
        *(endpoint_entry(i, status=s[0], capacity=3) for i, s in zip(ids, specs, strict=True))
    )
    request = request_for(system, "u")
    assert request.prompt is not None
    states = {}
    for i, (_, draining, _, in_flight, queued, holds) in zip(ids, specs, strict=True):
        state = EndpointLiveState(
            in_flight=in_flight,
            draining=draining,
            cost=CostState(queued_prefill_tokens=float(queued)),
        )
        if holds:
            state.cost.prefix.record(request.prompt.blocks, 10_000)
        states[i] = state
    live = live_for(snapshot, states)
    for i, (_, draining, *_rest) in zip(ids, specs, strict=True):
        live[i].draining = draining
    exclude = frozenset(i for i, s in zip(ids, specs, strict=True) if s[2])
    usable = {
        i
        for i, (status, draining, excluded, in_flight, _, _) in zip(ids, specs, strict=True)
        if status != "critical" and not draining and not excluded and in_flight < 3
    }
    passing = {i for i in usable if specs[ids.index(i)][0] == "passing"}
    result = run_pick(
        snapshot, live, RequestFeatures(MODEL, prompt=request.prompt, exclude=exclude)
    )
    if usable:
        assert picked_id(result) in (passing or usable)
    else:
        assert isinstance(result, NotPicked)


def test_a_distrusted_index_recovers_when_the_engine_hits_again() -> None:
    """Predictions are counted from the index itself, so a factor at 0 can climb back."""
    snapshot = four()
    live = live_for(snapshot)
    shape = request_for(5, "x").prompt
    assert shape is not None
    live["e3"].cost.cache_hit_factor = 0.0
    record_cache_figures(live, "e3", CacheFigures(None, 0, 0), COST)
    for _ in range(2):
        start_request(live, "e3", CONFIG.breaker, NOW)
        begin_prefill(live, snapshot.by_id["e3"], shape, NOW, COST, max_age_s=5)
    hits = live["e3"].cost.predicted_hits
    assert hits > 0
    queries = live["e3"].cost.predicted_queries
    record_cache_figures(live, "e3", CacheFigures(None, queries, hits), COST)
    assert live["e3"].cost.cache_hit_factor == pytest.approx(COST.cache_factor_alpha)


class TestDrainClock:
    def test_a_prompt_nearly_prefilled_weighs_what_is_left_of_it(self) -> None:
        snapshot = four()
        live = live_for(snapshot)
        endpoint = snapshot.by_id["e0"]
        big = PromptShape(blocks=(), tokens=4000, ring_key=1)
        start_request(live, "e0", CONFIG.breaker, NOW)
        begin_prefill(live, endpoint, big, NOW, COST, max_age_s=5)
        rate = COST.other_prefill_tokens_per_s
        small = PromptShape(blocks=(), tokens=100, ring_key=2)
        at_send = estimate(endpoint, live["e0"], small, NOW, COST, max_age_s=5)
        later = estimate(endpoint, live["e0"], small, NOW + 3000 / rate, COST, max_age_s=5)
        assert at_send.seconds - later.seconds == pytest.approx(3000 / rate)

    def test_a_late_first_token_delays_everything_behind_it(self) -> None:
        snapshot = four()
        live = live_for(snapshot)
        endpoint = snapshot.by_id["e0"]
        shape = PromptShape(blocks=(), tokens=2000, ring_key=1)
        prefills = []
        for _ in range(2):
            start_request(live, "e0", CONFIG.breaker, NOW)
            prefills.append(begin_prefill(live, endpoint, shape, NOW, COST, max_age_s=5))
        first = prefills[0]
        assert first is not None
        expected = live["e0"].cost.prefill_busy_until
        assert expected is not None
        end_prefill(live, first, first.expected_at + 1.0, COST, first_token=False)
        assert live["e0"].cost.prefill_busy_until == expected  # an end without a token says nothing
        second = prefills[1]
        assert second is not None
        start_request(live, "e0", CONFIG.breaker, NOW)
        third = begin_prefill(live, endpoint, shape, NOW, COST, max_age_s=5)
        assert third is not None
        end_prefill(live, second, second.expected_at + 0.5, COST, first_token=True)
        assert live["e0"].cost.prefill_busy_until == pytest.approx(third.expected_at + 0.5)
        end_prefill(live, third, NOW + 9, COST, first_token=True)
        assert live["e0"].cost.prefill_busy_until is None


def test_an_engine_behind_its_clock_counts_its_queue_whole() -> None:
    """A default rate far above the engine's must not make a busy engine look free."""
    snapshot = four()
    live = live_for(snapshot)
    endpoint = snapshot.by_id["e0"]
    big = PromptShape(blocks=(), tokens=4000, ring_key=1)
    start_request(live, "e0", CONFIG.breaker, NOW)
    begin_prefill(live, endpoint, big, NOW, COST, max_age_s=5)
    busy_until = live["e0"].cost.prefill_busy_until
    assert busy_until is not None
    small = PromptShape(blocks=(), tokens=100, ring_key=2)
    idle = estimate(endpoint, EndpointLiveState(), small, NOW, COST, max_age_s=5)
    late = estimate(endpoint, live["e0"], small, busy_until + 0.5, COST, max_age_s=5)
    assert late.seconds - idle.seconds == pytest.approx(4000 / COST.other_prefill_tokens_per_s)


def test_a_first_token_during_the_scrape_is_not_another_routers_queue() -> None:
    """The engine counted the request as waiting; by the answer it had its first token."""
    snapshot = four()
    live = live_for(snapshot)
    endpoint = snapshot.by_id["e0"]
    shape = PromptShape(blocks=(), tokens=1500, ring_key=1)
    start_request(live, "e0", CONFIG.breaker, NOW)
    prefill = begin_prefill(live, endpoint, shape, NOW, COST, max_age_s=5)
    assert prefill is not None
    before = own_counts(live, "e0")
    end_prefill(live, prefill, NOW + 0.3, COST, first_token=True)
    load = EngineLoad(running=0, waiting=1, kv_cache_usage=0.1)
    record_load(live, "e0", load, NOW + 0.31, own_before=before)
    probe = PromptShape(blocks=(), tokens=100, ring_key=2)
    assert foreign_queue(endpoint, live["e0"], NOW + 0.31, COST, 5.0) == (0.0, 0.0)
    naive = live_for(snapshot)
    naive["e0"].cost.mean_prompt_tokens = 1500.0
    record_load(naive, "e0", load, NOW + 0.31)
    assert foreign_queue(endpoint, naive["e0"], NOW + 0.31, COST, 5.0)[0] > 0
    assert estimate(endpoint, live["e0"], probe, NOW + 0.31, COST, max_age_s=5).seconds < (
        estimate(endpoint, naive["e0"], probe, NOW + 0.31, COST, max_age_s=5).seconds
    )


def test_a_replica_that_learned_nothing_borrows_its_peers_rate() -> None:
    """A burst does not pile onto the one replica still on the optimistic default rate."""
    snapshot = four()
    live = live_for(snapshot)
    for endpoint_id in ("e0", "e1", "e2"):
        live[endpoint_id].cost.prefill_rate_tps = 5000.0
    chosen = [
        send(snapshot, live, RequestFeatures(MODEL, prompt=PromptShape((), 2000, n)))
        for n in range(4)
    ]
    assert sorted(chosen) == ["e0", "e1", "e2", "e3"]


def test_the_drain_clock_of_a_replica_that_learned_nothing_runs_at_its_peers_rate() -> None:
    """Sent at the borrowed rate, its queue must drain at that rate, not the default's."""
    snapshot = four()
    live = live_for(snapshot)
    for endpoint_id in ("e0", "e1", "e2"):
        live[endpoint_id].cost.prefill_rate_tps = 5000.0
    peer = peer_rate_of(snapshot, live, MODEL)
    assert peer == pytest.approx(5000.0)
    endpoint = snapshot.by_id["e3"]
    start_request(live, "e3", CONFIG.breaker, NOW)
    begin_prefill(live, endpoint, PromptShape((), 2000, 1), NOW, COST, max_age_s=5.0, peer=peer)
    # Just before the default rate (20k tokens/s) would have drained it: most is left.
    later = NOW + 0.09
    probe = PromptShape((), 100, 2)
    ahead = estimate(endpoint, live["e3"], probe, later, COST, max_age_s=5.0, peer=peer)
    assert ahead.queued_tokens == pytest.approx(2000 - 0.09 * 5000)


def fleet_at_5k_with_a_key_ringed_to_e1() -> tuple[Any, Any, int]:
    """Four endpoints that learned 5k tokens/s, and a ring key whose first endpoint is e1."""
    snapshot = four()
    ring = snapshot.models[MODEL].ring
    key = next(k for k in range(0, 2**64, 2**50) if next(ring.walk(k)) == "e1")
    live = live_for(snapshot)
    for state in live.values():
        state.cost.prefill_rate_tps = 5000.0
    return snapshot, live, key


def test_near_ties_prefer_an_engine_with_nothing_to_prefill() -> None:
    """Within the tie band, the ring must not put a request behind another's prefill."""
    snapshot, live, key = fleet_at_5k_with_a_key_ringed_to_e1()
    start_request(live, "e1", CONFIG.breaker, NOW)
    begin_prefill(live, snapshot.by_id["e1"], PromptShape((), 50, 7), NOW, COST, max_age_s=5.0)
    request = RequestFeatures(MODEL, prompt=PromptShape((), 2000, key))
    estimates = {
        endpoint_id: estimate(
            snapshot.by_id[endpoint_id], state, request.prompt, NOW, COST, max_age_s=5.0
        )
        for endpoint_id, state in live.items()
    }
    best = min(item.seconds for item in estimates.values())
    assert estimates["e1"].seconds <= best * (1 + COST.tie_rel)  # a near-tie, first on the ring
    assert estimates["e1"].queued_tokens > 0
    assert picked_id(run_pick(snapshot, live, request)) != "e1"


def test_near_ties_keep_a_conversation_where_its_history_is() -> None:
    """As fast by the estimate, the endpoint holding the prompt wins over an idle one."""
    snapshot, live, key = fleet_at_5k_with_a_key_ringed_to_e1()
    blocks = tuple(range(1, 11))
    cached = len(blocks) * SHAPE.block_tokens
    # e2 holds the history, and has as much queued ahead as the history saves.
    live["e2"].cost.prefix.record(blocks, 1000)
    start_request(live, "e2", CONFIG.breaker, NOW)
    begin_prefill(
        live, snapshot.by_id["e2"], PromptShape((), int(cached), 9), NOW, COST, max_age_s=5.0
    )
    request = RequestFeatures(MODEL, prompt=PromptShape(blocks, 2000, key))
    home = estimate(snapshot.by_id["e2"], live["e2"], request.prompt, NOW, COST, max_age_s=5.0)
    idle = estimate(snapshot.by_id["e1"], live["e1"], request.prompt, NOW, COST, max_age_s=5.0)
    assert home.cached_tokens == cached
    assert home.seconds == pytest.approx(idle.seconds)
    assert picked_id(run_pick(snapshot, live, request)) == "e2"


def holder_with_queued_prefill(queued_tokens: int) -> tuple[Any, Any, RequestFeatures]:
    """e2 holds the whole prompt's blocks and has `queued_tokens` of another prefill ahead."""
    snapshot, live, key = fleet_at_5k_with_a_key_ringed_to_e1()
    blocks = tuple(range(1, 11))
    live["e2"].cost.prefix.record(blocks, 1000)
    start_request(live, "e2", CONFIG.breaker, NOW)
    begin_prefill(
        live, snapshot.by_id["e2"], PromptShape((), queued_tokens, 9), NOW, COST, max_age_s=5.0
    )
    prompt_tokens = int(len(blocks) * SHAPE.block_tokens) + 40
    return snapshot, live, RequestFeatures(MODEL, prompt=PromptShape(blocks, prompt_tokens, key))


def ratio_to_best(snapshot: Any, live: Any, request: RequestFeatures, endpoint_id: str) -> float:
    estimates = {
        eid: estimate(snapshot.by_id[eid], state, request.prompt, NOW, COST, max_age_s=5.0)
        for eid, state in live.items()
    }
    return estimates[endpoint_id].seconds / min(item.seconds for item in estimates.values())


def test_a_warm_prompt_stays_with_its_holder_behind_a_prefill_within_the_warm_band() -> None:
    """Slower than an idle replica by more than the tie band, within `warm_tie_factor`:
    the holder keeps it, rather than a copy in a second cache evicting another prompt."""
    snapshot, live, request = holder_with_queued_prefill(150)
    ratio = ratio_to_best(snapshot, live, request, "e2")

    assert 1 + COST.tie_rel < ratio <= COST.warm_tie_factor
    assert "e2" == picked_id(run_pick(snapshot, live, request))


def test_a_warm_prompt_leaves_a_holder_slower_than_the_warm_band() -> None:
    """A holder whose queue makes it slower than `warm_tie_factor` times the best loses it."""
    snapshot, live, request = holder_with_queued_prefill(4000)

    assert ratio_to_best(snapshot, live, request, "e2") > COST.warm_tie_factor
    assert "e2" != picked_id(run_pick(snapshot, live, request))


def test_past_the_warm_band_a_conversation_goes_to_the_holder_of_its_system_prompt() -> None:
    """The holder of the whole history (e2) is past the warm band; e3, holding its
    leading blocks (the system prompt) behind a short prefill, is within it: e3 gets the
    turn, where an idle replica would have copied the whole prompt into a third cache."""
    snapshot, live, request = holder_with_queued_prefill(4000)
    live["e3"].cost.prefix.record(tuple(range(1, 7)), 1000)
    start_request(live, "e3", CONFIG.breaker, NOW)
    begin_prefill(live, snapshot.by_id["e3"], PromptShape((), 150, 8), NOW, COST, max_age_s=5.0)

    assert ratio_to_best(snapshot, live, request, "e2") > COST.warm_tie_factor
    assert 1 + COST.tie_rel < ratio_to_best(snapshot, live, request, "e3") <= COST.warm_tie_factor
    assert "e3" == picked_id(run_pick(snapshot, live, request))


def cold_picks(snapshot: EndpointSnapshot, live: LiveStates) -> dict[int, str]:
    """Where a 1000-token prompt cached nowhere goes, for ring keys spread over the ring."""
    return {
        key: picked_id(
            run_pick(snapshot, live, RequestFeatures(MODEL, prompt=PromptShape((), 1000, key)))
        )
        for key in range(1, 2**64, 2**58)
    }


def test_a_cold_prefix_goes_to_its_ring_owner_whatever_the_idle_replicas_learned_rates() -> None:
    """Idle replicas of one model whose learned rates differ by noise (18k vs 27k tokens/s):
    new prefixes follow the ring across all of them, not all to the fastest-looking one."""
    snapshot = four()
    ring = snapshot.models[MODEL].ring
    live = live_for(snapshot)
    for index, state in enumerate(live.values()):
        state.cost.prefill_rate_tps = 27000.0 if index == 0 else 18000.0
    picks = cold_picks(snapshot, live)

    assert all(picks[key] == next(ring.walk(key)) for key in picks)
    assert {"e0", "e1", "e2", "e3"} == set(picks.values())


def declared_pair(rate: int) -> EndpointSnapshot:
    """Two replicas whose Meta declares `rate` prefill tokens/s, as the scheduler renders."""
    return snapshot_of(
        *(
            health_entry(
                f"e{i}",
                meta=service_meta(served_models=MODEL, prefill_tokens_per_s=str(rate)),
                port=23456,
            )
            for i in range(2)
        )
    )


def test_one_slow_first_answer_does_not_keep_new_prefixes_off_a_replica() -> None:
    """Two idle replicas declaring 40k tokens/s; e0's first answer takes 8x the declared
    time (seen on two real vLLM engines after a cache reset). New prefixes still follow
    the ring across both: with the first sample taken alone e0 looked 5x slower, past
    the cold band, every new prefix went to e1 and its cache overflowed."""
    snapshot = declared_pair(40000)
    ring = snapshot.models[MODEL].ring
    live = live_for(snapshot)
    first = PromptShape((), 1000, 1)
    for endpoint_id, slowdown in (("e1", 1), ("e0", 8)):  # e1 answers as declared
        lease = start_request(live, endpoint_id, CONFIG.breaker, NOW)
        prefill = begin_prefill(live, snapshot.by_id[endpoint_id], first, NOW, COST, max_age_s=5)
        assert prefill is not None
        took = COST.base_s + slowdown * 1000 / 40000
        end_prefill(live, prefill, NOW + took, COST, first_token=True)
        finish_request(live, lease, Outcome.SUCCESS, CONFIG.breaker, NOW + 0.3)
    picks = cold_picks(snapshot, live)

    assert all(picks[key] == next(ring.walk(key)) for key in picks)
    assert {"e0", "e1"} == set(picks.values())


def test_a_cold_prefix_goes_where_it_fits_whole() -> None:
    """Two idle replicas; the ring owner's cache is within `cold_fill_slack` of the
    other's but has no room for the new prompt's blocks: it goes to the one with room
    (6 and 6 system prompts on two real vLLM caches of 48 blocks, not 7 and 5). A prompt
    that fits stays with the ring owner."""
    snapshot = declared_pair(40000)
    ring = snapshot.models[MODEL].ring
    key = next(k for k in range(0, 2**64, 2**50) if next(ring.walk(k)) == "e1")
    live = live_for(snapshot)
    capacity = int(COST.default_kv_cache_tokens // SHAPE.block_tokens)
    other = capacity - 3 - int(0.2 * capacity)
    live["e1"].cost.prefix.record(tuple(range(1, capacity - 3 + 1)), capacity)
    live["e0"].cost.prefix.record(tuple(range(10**6, 10**6 + other)), capacity)
    assert index_fill(live["e1"], COST) - index_fill(live["e0"], COST) < COST.cold_fill_slack

    def cold(blocks: int) -> RequestFeatures:
        ids = tuple(range(10**7, 10**7 + blocks))
        return RequestFeatures(MODEL, prompt=PromptShape(ids, blocks * 128, key))

    assert "e0" == picked_id(run_pick(snapshot, live, cold(5)))
    assert "e1" == picked_id(run_pick(snapshot, live, cold(3)))


def test_twelve_prompts_that_fit_two_caches_are_split_six_and_six() -> None:
    """Two idle replicas of 48 blocks of 128 tokens, an engine tokenizer that takes
    2 characters a token (the router estimates 4), twelve system prompts of 7 engine
    blocks, all of whose ring keys name e0: bounded loads alone gave 7 and 5 (49 blocks
    on a cache of 48); sized in the engine's tokens, the twelfth goes where it fits."""
    snapshot = declared_pair(40000)
    ring = snapshot.models[MODEL].ring
    live = live_for(snapshot)
    real, estimated = 7 * 128, 7 * 64  # one prompt, in the engine's tokens and estimated
    for endpoint_id in ("e0", "e1"):
        figures = CacheFigures(48 * 128, 0, 0, prompt_tokens=10.0 * real, prompt_requests=10.0)
        record_cache_figures(live, endpoint_id, figures, COST)
        live[endpoint_id].cost.mean_prompt_tokens = float(estimated)
    keys = [k for k in range(1, 2**64, 2**52) if next(ring.walk(k)) == "e0"][:12]
    placed: dict[str, int] = {"e0": 0, "e1": 0}
    for number, key in enumerate(keys):
        blocks = tuple(range(1000 * number, 1000 * number + estimated // int(SHAPE.block_tokens)))
        request = RequestFeatures(MODEL, prompt=PromptShape(blocks, estimated, key))
        chosen = picked_id(run_pick(snapshot, live, request))
        lease = start_request(live, chosen, CONFIG.breaker, NOW)
        assert request.prompt is not None
        prefill = begin_prefill(
            live, snapshot.by_id[chosen], request.prompt, NOW, COST, max_age_s=5
        )
        assert prefill is not None
        end_prefill(live, prefill, NOW + 0.05, COST, first_token=True)
        finish_request(live, lease, Outcome.SUCCESS, CONFIG.breaker, NOW + 0.06)
        placed[chosen] += 1

    assert placed == {"e0": 6, "e1": 6}


def test_a_cold_prefix_still_avoids_a_replica_with_prefill_queued() -> None:
    """The wider band for cold prefixes is for idle replicas only: queued work still counts."""
    snapshot, live, key = fleet_at_5k_with_a_key_ringed_to_e1()
    start_request(live, "e1", CONFIG.breaker, NOW)
    begin_prefill(live, snapshot.by_id["e1"], PromptShape((), 200, 7), NOW, COST, max_age_s=5.0)

    assert (
        picked_id(
            run_pick(snapshot, live, RequestFeatures(MODEL, prompt=PromptShape((), 1000, key)))
        )
        != "e1"
    )


def test_a_cold_prefix_skips_a_ring_owner_whose_cache_is_much_fuller() -> None:
    """Bounded loads: a new prefix whose ring owner already holds far more than the
    emptiest idle replica goes on along the ring, so hot prefixes spread over the caches."""
    snapshot, live, key = fleet_at_5k_with_a_key_ringed_to_e1()
    capacity = int(COST.default_kv_cache_tokens // SHAPE.block_tokens)
    live["e1"].cost.prefix.record(tuple(range(1, capacity // 2 + 1)), capacity)
    request = RequestFeatures(MODEL, prompt=PromptShape((), 1000, key))
    half_full = picked_id(run_pick(snapshot, live, request))
    live["e1"].cost.prefix = type(live["e1"].cost.prefix)()
    live["e1"].cost.prefix.record(tuple(range(1, capacity // 10 + 1)), capacity)
    a_little = picked_id(run_pick(snapshot, live, request))

    assert "e1" != half_full
    assert "e1" == a_little  # within the slack, the ring owner keeps it
