"""The balancer pipeline: filters, scorers in [0,1], pickers, and the reason when nothing fits."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from router_builders import MODEL, endpoint_entry, live_for, loaded, snapshot_of

from caravan_llm.router.core.affinity import load_bound, stable_hash
from caravan_llm.router.core.balancer import (
    BalancerConfig,
    Candidate,
    NoEndpointReason,
    NotPicked,
    Picked,
    PickerMemory,
    PickResult,
    Policy,
    RequestFeatures,
    filter_candidates,
    in_flight_scores,
    kv_cache_scores,
    load_scores,
    pick,
    queue_scores,
)
from caravan_llm.router.core.breaker import BreakerPhase, BreakerState, allows_request
from caravan_llm.router.core.endpoints import CheckStatus, EndpointSnapshot
from caravan_llm.router.core.live_state import EndpointLiveState, LiveStates

CONFIG = BalancerConfig()
NOW = 100.0
REQUEST = RequestFeatures(model=MODEL)


def run_pick(
    snapshot: EndpointSnapshot,
    live: LiveStates,
    policy: Policy = Policy.LOAD_AWARE,
    request: RequestFeatures = REQUEST,
    *,
    memory: PickerMemory | None = None,
    now: float = NOW,
) -> PickResult:
    memory = memory if memory is not None else PickerMemory(rng=random.Random(7))
    return pick(snapshot, live, request, policy, now, config=CONFIG, memory=memory)


def picked_id(result: PickResult) -> str:
    assert isinstance(result, Picked), result
    return result.endpoint.id


def open_breaker(opened_at: float = NOW) -> BreakerState:
    return BreakerState(BreakerPhase.OPEN, consecutive_failures=5, opened_at=opened_at)


class TestFilters:
    @pytest.mark.parametrize("policy", list(Policy))
    def test_unusable_endpoints_are_never_picked(self, policy: Policy) -> None:
        """Critical, draining, excluded, breaker-open and full endpoints are never picked."""
        snapshot = snapshot_of(
            endpoint_entry("critical", status="critical"),
            endpoint_entry("draining"),
            endpoint_entry("excluded"),
            endpoint_entry("broken"),
            endpoint_entry("full", capacity=2),
            endpoint_entry("ok"),
        )
        live = live_for(
            snapshot,
            {
                "draining": EndpointLiveState(draining=True),
                "broken": EndpointLiveState(breaker=open_breaker()),
                "full": EndpointLiveState(in_flight=2),
                "ok": EndpointLiveState(in_flight=40),
            },
        )
        request = RequestFeatures(
            MODEL, affinity_key=stable_hash("k"), exclude=frozenset({"excluded"})
        )

        assert picked_id(run_pick(snapshot, live, policy, request)) == "ok"

    def test_half_open_breaker_admits_its_probe(self) -> None:
        """An endpoint whose breaker cooled down is a candidate again (for its one probe)."""
        snapshot = snapshot_of(endpoint_entry("a"))
        cooled = open_breaker(opened_at=NOW - CONFIG.breaker.cool_down_s)
        live = live_for(snapshot, {"a": EndpointLiveState(breaker=cooled)})

        assert picked_id(run_pick(snapshot, live)) == "a"

    def test_unknown_capacity_is_never_full(self) -> None:
        """An endpoint that states no capacity stays a candidate however busy it is."""
        snapshot = snapshot_of(endpoint_entry("a", capacity=None))
        live = live_for(snapshot, {"a": EndpointLiveState(in_flight=10_000)})

        assert picked_id(run_pick(snapshot, live)) == "a"

    def test_warning_endpoint_is_used_only_when_no_passing_one_has_room(self) -> None:
        """Traffic goes to the passing endpoint until it is full, then to the warning one."""
        snapshot = snapshot_of(
            endpoint_entry("passing", capacity=2), endpoint_entry("warning", status="warning")
        )
        idle = live_for(snapshot, {"passing": EndpointLiveState(in_flight=1)})
        full = live_for(snapshot, {"passing": EndpointLiveState(in_flight=2)})

        for policy in Policy:
            assert picked_id(run_pick(snapshot, idle, policy)) == "passing"
            assert picked_id(run_pick(snapshot, full, policy)) == "warning"

    @pytest.mark.parametrize(
        ("live_overrides", "exclude", "expected"),
        [
            ({}, {"a", "b"}, NoEndpointReason.ALL_EXCLUDED),
            ({"a": EndpointLiveState(draining=True)}, {"b"}, NoEndpointReason.NONE_HEALTHY),
            (
                {"a": EndpointLiveState(breaker=open_breaker())},
                {"b"},
                NoEndpointReason.BREAKERS_OPEN,
            ),
            ({"a": EndpointLiveState(in_flight=1)}, {"b"}, NoEndpointReason.AT_CAPACITY),
            (
                {
                    "a": EndpointLiveState(in_flight=1),
                    "b": EndpointLiveState(breaker=open_breaker()),
                },
                set(),
                NoEndpointReason.AT_CAPACITY,
            ),
        ],
    )
    def test_reason_is_the_furthest_stage_any_endpoint_reached(
        self,
        live_overrides: dict[str, EndpointLiveState],
        exclude: set[str],
        expected: NoEndpointReason,
    ) -> None:
        """When nothing fits, the reason names the last filter that emptied the set."""
        snapshot = snapshot_of(endpoint_entry("a", capacity=1), endpoint_entry("b", capacity=1))
        live = live_for(snapshot, live_overrides)
        request = RequestFeatures(MODEL, exclude=frozenset(exclude))

        assert NotPicked(expected) == run_pick(snapshot, live, request=request)

    def test_all_critical_is_none_healthy(self) -> None:
        """A model whose every replica is critical has no healthy endpoint."""
        snapshot = snapshot_of(endpoint_entry("a", status="critical"))

        assert NotPicked(NoEndpointReason.NONE_HEALTHY) == run_pick(snapshot, live_for(snapshot))

    def test_unknown_model_has_no_endpoints(self) -> None:
        """A model that nothing in Consul serves is told apart from one that is just busy."""
        snapshot = snapshot_of(endpoint_entry("a"))

        result = run_pick(snapshot, live_for(snapshot), request=RequestFeatures("nope"))

        assert NotPicked(NoEndpointReason.NO_ENDPOINTS) == result


class TestScorers:
    def test_stale_load_scores_as_saturated(self) -> None:
        """An idle-looking but stale scrape loses to a fresh, moderately busy one."""
        snapshot = snapshot_of(endpoint_entry("fresh"), endpoint_entry("stale"))
        live = live_for(
            snapshot,
            {
                "fresh": loaded(waiting=3.0, kv_cache_usage=0.5, scraped_at=NOW - 1),
                "stale": loaded(
                    waiting=0.0, kv_cache_usage=0.0, scraped_at=NOW - CONFIG.load_max_age_s - 1
                ),
            },
        )
        candidates = candidates_of(snapshot, live)

        assert [pytest.approx(0.4), 0.0] == queue_scores(candidates, NOW, CONFIG)
        assert [pytest.approx(0.375), 0.0] == kv_cache_scores(candidates, NOW, CONFIG)
        assert picked_id(run_pick(snapshot, live)) == "fresh"

    def test_missing_load_scores_as_saturated_next_to_known(self) -> None:
        """A never-scraped endpoint is not treated as idle while others report load."""
        snapshot = snapshot_of(endpoint_entry("known"), endpoint_entry("unknown"))
        live = live_for(
            snapshot, {"known": loaded(waiting=1.0, kv_cache_usage=0.3, scraped_at=NOW)}
        )

        assert picked_id(run_pick(snapshot, live)) == "known"

    def test_every_load_unknown_fails_open_to_in_flight(self) -> None:
        """With no load known anywhere, engine scorers are neutral and in-flight decides."""
        snapshot = snapshot_of(endpoint_entry("a"), endpoint_entry("b"))
        live = live_for(snapshot, {"a": EndpointLiveState(in_flight=3)})
        candidates = candidates_of(snapshot, live)

        assert queue_scores(candidates, NOW, CONFIG) == [1.0, 1.0]
        assert picked_id(run_pick(snapshot, live)) == "b"

    def test_missing_kv_metric_everywhere_is_neutral(self) -> None:
        """llama.cpp reports no KV usage: that dimension is neutral, the queue decides."""
        snapshot = snapshot_of(endpoint_entry("a"), endpoint_entry("b"))
        live = live_for(
            snapshot,
            {
                "a": loaded(waiting=4.0, kv_cache_usage=None),
                "b": loaded(waiting=1.0, kv_cache_usage=None),
            },
        )

        assert kv_cache_scores(candidates_of(snapshot, live), NOW, CONFIG) == [1.0, 1.0]
        assert picked_id(run_pick(snapshot, live)) == "b"

    def test_in_flight_is_relative_to_capacity(self) -> None:
        """Four in flight of 64 is emptier than two of 8."""
        snapshot = snapshot_of(
            endpoint_entry("big", capacity=64), endpoint_entry("small", capacity=8)
        )
        live = live_for(
            snapshot,
            {"big": EndpointLiveState(in_flight=4), "small": EndpointLiveState(in_flight=2)},
        )

        assert in_flight_scores(candidates_of(snapshot, live)) == [1.0, 0.0]

    def test_unstated_capacity_scores_saturated_unless_none_is_stated(self) -> None:
        """No capacity next to a stated one scores 0; when none is stated, raw counts compare."""
        mixed = snapshot_of(endpoint_entry("a", capacity=None), endpoint_entry("b", capacity=8))
        unstated = snapshot_of(
            endpoint_entry("a", capacity=None), endpoint_entry("b", capacity=None)
        )
        busy_b = {"b": EndpointLiveState(in_flight=6)}

        assert in_flight_scores(candidates_of(mixed, live_for(mixed, busy_b))) == [0.0, 1.0]
        assert in_flight_scores(candidates_of(unstated, live_for(unstated, busy_b))) == [1.0, 0.0]

    @settings(max_examples=60, deadline=None)
    @given(
        st.lists(
            st.tuples(
                st.integers(0, 100),
                st.none() | st.integers(1, 128),
                st.none() | st.floats(0, 1_000, allow_nan=False),
                st.none() | st.floats(0, 5, allow_nan=False),
                st.floats(0, 20, allow_nan=False),
            ),
            min_size=1,
            max_size=6,
        )
    )
    def test_scores_stay_within_zero_and_one(
        self, rows: list[tuple[int, int | None, float | None, float | None, float]]
    ) -> None:
        """Every scorer, and their weighted mean, is clamped to [0, 1]."""
        # The capacity is stated as headroom above in-flight, so every row stays a candidate.
        entries = [
            endpoint_entry(f"e{i}", capacity=None if extra is None else in_flight + extra)
            for i, (in_flight, extra, *_) in enumerate(rows)
        ]
        snapshot = snapshot_of(*entries)
        live = live_for(
            snapshot,
            {
                f"e{i}": loaded(
                    in_flight=in_flight, waiting=w, kv_cache_usage=kv, scraped_at=NOW - age
                )
                for i, (in_flight, _, w, kv, age) in enumerate(rows)
            },
        )
        candidates = candidates_of(snapshot, live)

        for scorer in (
            in_flight_scores(candidates),
            queue_scores(candidates, NOW, CONFIG),
            kv_cache_scores(candidates, NOW, CONFIG),
            load_scores(candidates, NOW, CONFIG),
        ):
            assert len(candidates) == len(scorer)
            assert all(0.0 <= score <= 1.0 for score in scorer)


class TestPickers:
    def test_round_robin_cycles_in_id_order(self) -> None:
        """Round robin takes each candidate in turn, per model."""
        snapshot = snapshot_of(endpoint_entry("b"), endpoint_entry("a"), endpoint_entry("c"))
        memory = PickerMemory(rng=random.Random(1))
        live = live_for(snapshot)

        picks = [
            picked_id(run_pick(snapshot, live, Policy.ROUND_ROBIN, memory=memory)) for _ in range(6)
        ]

        assert picks == ["a", "b", "c", "a", "b", "c"]

    def test_least_inflight_takes_the_emptiest(self) -> None:
        """Least in-flight goes by the router's own counts, ignoring engine load."""
        snapshot = snapshot_of(endpoint_entry("a"), endpoint_entry("b"), endpoint_entry("c"))
        live = live_for(
            snapshot,
            {
                "a": EndpointLiveState(in_flight=3),
                "b": loaded(in_flight=1, waiting=100.0),
                "c": EndpointLiveState(in_flight=2),
            },
        )

        assert picked_id(run_pick(snapshot, live, Policy.LEAST_INFLIGHT)) == "b"

    def test_ties_are_broken_at_random(self) -> None:
        """Equal candidates share the traffic instead of the first id taking all of it."""
        snapshot = snapshot_of(endpoint_entry("a"), endpoint_entry("b"), endpoint_entry("c"))
        memory = PickerMemory(rng=random.Random(3))
        live = live_for(snapshot)

        counts = Counter(
            picked_id(run_pick(snapshot, live, Policy.LOAD_AWARE, memory=memory))
            for _ in range(300)
        )

        assert {"a", "b", "c"} == set(counts)

    def test_power_of_two_takes_the_better_of_its_two_samples(self) -> None:
        """With two candidates both are sampled, so the less loaded one always wins."""
        snapshot = snapshot_of(endpoint_entry("a"), endpoint_entry("b"))
        live = live_for(snapshot, {"a": loaded(waiting=4.0), "b": loaded(waiting=0.0)})
        memory = PickerMemory(rng=random.Random(5))

        picks = {
            picked_id(run_pick(snapshot, live, Policy.POWER_OF_TWO, memory=memory))
            for _ in range(50)
        }

        assert {"b"} == picks

    def test_power_of_two_is_reproducible_with_a_seed(self) -> None:
        """The same seed gives the same sequence of picks."""
        snapshot = snapshot_of(*(endpoint_entry(f"e{i}") for i in range(6)))
        live = live_for(snapshot)

        def sequence(seed: int) -> list[str]:
            memory = PickerMemory(rng=random.Random(seed))
            return [
                picked_id(run_pick(snapshot, live, Policy.POWER_OF_TWO, memory=memory))
                for _ in range(20)
            ]

        assert sequence(11) == sequence(11)

    def test_load_aware_prefers_short_queue_and_free_kv(self) -> None:
        """Load-aware avoids the engine with a deep queue and a full KV cache."""
        snapshot = snapshot_of(endpoint_entry("busy"), endpoint_entry("calm"))
        live = live_for(
            snapshot,
            {
                "busy": loaded(in_flight=1, waiting=5.0, kv_cache_usage=0.9),
                "calm": loaded(in_flight=2, waiting=0.0, kv_cache_usage=0.2),
            },
        )

        assert picked_id(run_pick(snapshot, live, Policy.LOAD_AWARE)) == "calm"


def owner_of(snapshot: EndpointSnapshot, key: int) -> str | None:
    model = snapshot.for_model(MODEL)
    assert model is not None
    return model.ring.owner(key)


class TestPrefixAffinity:
    def test_same_prefix_sticks_to_its_ring_owner(self) -> None:
        """Every request with one key goes to the key's owner while load stays balanced."""
        snapshot = snapshot_of(*(endpoint_entry(f"e{i}") for i in range(4)))
        key = stable_hash("conversation 1")
        live = live_for(snapshot)

        picks = {
            picked_id(run_pick(snapshot, live, Policy.PREFIX_AFFINITY, RequestFeatures(MODEL, key)))
            for _ in range(10)
        }

        assert {owner_of(snapshot, key)} == picks

    def test_hot_prefix_spills_to_the_next_endpoint_on_the_walk(self) -> None:
        """An owner above c x mean load hands the key to its ring successor."""
        snapshot = snapshot_of(*(endpoint_entry(f"e{i}") for i in range(4)))
        key = stable_hash("hot prompt")
        model = snapshot.for_model(MODEL)
        assert model is not None
        walk = list(model.ring.walk(key))
        live = live_for(snapshot, {walk[0]: EndpointLiveState(in_flight=5)})

        result = run_pick(snapshot, live, Policy.PREFIX_AFFINITY, RequestFeatures(MODEL, key))

        assert walk[1] == picked_id(result)

    def test_saturated_engine_is_passed_over(self) -> None:
        """An owner whose engine queue is at the threshold loses its keys to the next one."""
        snapshot = snapshot_of(*(endpoint_entry(f"e{i}") for i in range(3)))
        key = stable_hash("prompt")
        model = snapshot.for_model(MODEL)
        assert model is not None
        walk = list(model.ring.walk(key))
        live = live_for(
            snapshot,
            {
                walk[0]: loaded(waiting=CONFIG.queue_threshold),
                walk[1]: loaded(waiting=1.0),
                walk[2]: loaded(waiting=0.0),
            },
        )

        result = run_pick(snapshot, live, Policy.PREFIX_AFFINITY, RequestFeatures(MODEL, key))

        assert walk[1] == picked_id(result)

    def test_unscraped_endpoint_is_passed_over_while_others_report(self) -> None:
        """A new endpoint with no scrape yet does not take its keys until its load is known."""
        snapshot = snapshot_of(*(endpoint_entry(f"e{i}") for i in range(3)))
        key = stable_hash("prompt")
        model = snapshot.for_model(MODEL)
        assert model is not None
        walk = list(model.ring.walk(key))
        live = live_for(snapshot, {walk[1]: loaded(), walk[2]: loaded()})

        result = run_pick(snapshot, live, Policy.PREFIX_AFFINITY, RequestFeatures(MODEL, key))

        assert walk[1] == picked_id(result)

    def test_no_key_falls_back_to_load_aware(self) -> None:
        """A request without a prompt to key on goes to the least loaded endpoint."""
        snapshot = snapshot_of(endpoint_entry("a"), endpoint_entry("b"))
        live = live_for(snapshot, {"a": loaded(waiting=4.0), "b": loaded(waiting=0.0)})

        assert picked_id(run_pick(snapshot, live, Policy.PREFIX_AFFINITY)) == "b"

    def test_routers_with_differently_ordered_snapshots_agree(self) -> None:
        """Two routers that built the snapshot from differently ordered entries pick alike."""
        entries = [endpoint_entry(f"e{i}") for i in range(5)]
        first = snapshot_of(*entries)
        second = snapshot_of(*reversed(entries))

        for n in range(200):
            request = RequestFeatures(MODEL, stable_hash(f"prompt {n}"))
            assert picked_id(
                run_pick(first, live_for(first), Policy.PREFIX_AFFINITY, request)
            ) == picked_id(run_pick(second, live_for(second), Policy.PREFIX_AFFINITY, request))

    @settings(max_examples=80, deadline=None)
    @given(
        st.lists(st.integers(0, 30), min_size=2, max_size=8),
        st.integers(0, 2**64 - 1),
    )
    def test_bound_is_respected(self, in_flight: list[int], key: int) -> None:
        """The chosen endpoint is never above c x mean load (an endpoint under it always exists)."""
        snapshot = snapshot_of(
            *(endpoint_entry(f"e{i}", capacity=None) for i in range(len(in_flight)))
        )
        live = live_for(
            snapshot, {f"e{i}": EndpointLiveState(in_flight=n) for i, n in enumerate(in_flight)}
        )
        bound = load_bound(sum(in_flight), len(in_flight), CONFIG.load_factor)

        chosen = picked_id(
            run_pick(snapshot, live, Policy.PREFIX_AFFINITY, RequestFeatures(MODEL, key))
        )

        assert live[chosen].in_flight + 1 <= bound


def candidates_of(snapshot: EndpointSnapshot, live: LiveStates) -> list[Candidate]:
    model = snapshot.for_model(MODEL)
    assert model is not None
    candidates = filter_candidates(model, live, REQUEST, NOW, CONFIG)
    assert isinstance(candidates, list)
    return candidates


# --- property: no policy ever returns an endpoint a filter removes ---


@dataclass(frozen=True)
class Spec:
    status: str
    capacity: int | None
    in_flight: int
    draining: bool
    breaker: str  # closed | open | cooled | probing
    excluded: bool
    scraped_age: float | None


SPECS = st.builds(
    Spec,
    status=st.sampled_from(["passing", "passing", "warning", "critical"]),
    capacity=st.none() | st.integers(1, 4),
    in_flight=st.integers(0, 5),
    draining=st.booleans(),
    breaker=st.sampled_from(["closed", "closed", "open", "cooled", "probing"]),
    excluded=st.booleans(),
    scraped_age=st.none() | st.floats(0, 20),
)


def breaker_of(kind: str) -> BreakerState:
    cool_down = CONFIG.breaker.cool_down_s
    return {
        "closed": BreakerState(),
        "open": open_breaker(opened_at=NOW - 1),
        "cooled": open_breaker(opened_at=NOW - cool_down),
        "probing": BreakerState(BreakerPhase.HALF_OPEN, 5, NOW - cool_down, probe_in_flight=True),
    }[kind]


def usable(spec: Spec, state: EndpointLiveState) -> bool:
    """The filters, restated independently of the balancer's code."""
    return (
        not spec.excluded
        and spec.status != "critical"
        and not spec.draining
        and allows_request(state.breaker, CONFIG.breaker, NOW)
        and (spec.capacity is None or spec.in_flight < spec.capacity)
    )


@settings(max_examples=120, deadline=None)
@given(
    st.lists(SPECS, min_size=1, max_size=6),
    st.sampled_from(list(Policy)),
    st.integers(0, 2**64 - 1),
)
def test_pick_never_returns_a_filtered_endpoint(
    specs: list[Spec], policy: Policy, key: int
) -> None:
    """The pick is always usable (passing when it can be), and absent only when nothing is."""
    ids = [f"e{i}" for i in range(len(specs))]
    snapshot = snapshot_of(
        *(
            endpoint_entry(i, status=s.status, capacity=s.capacity)
            for i, s in zip(ids, specs, strict=True)
        )
    )
    live = live_for(
        snapshot,
        {
            i: (
                loaded(in_flight=s.in_flight, scraped_at=NOW - s.scraped_age)
                if s.scraped_age is not None
                else EndpointLiveState(in_flight=s.in_flight)
            )
            for i, s in zip(ids, specs, strict=True)
        },
    )
    for i, s in zip(ids, specs, strict=True):
        live[i].draining = s.draining
        live[i].breaker = breaker_of(s.breaker)
    exclude = frozenset(i for i, s in zip(ids, specs, strict=True) if s.excluded)
    usable_ids = {i for i, s in zip(ids, specs, strict=True) if usable(s, live[i])}
    usable_passing = {i for i in usable_ids if snapshot.by_id[i].status is CheckStatus.PASSING}

    result = run_pick(snapshot, live, policy, RequestFeatures(MODEL, key, exclude))

    if usable_ids:
        chosen = picked_id(result)
        assert chosen in (usable_passing or usable_ids)
    else:
        assert isinstance(result, NotPicked)
