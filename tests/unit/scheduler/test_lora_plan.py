"""The LoRA placement plan: capacity, coverage, demand order, stability."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from caravan_llm.common.contract import AdapterDemandRecord
from caravan_llm.scheduler.lora.plan import (
    NO_DEMAND,
    AdapterDemand,
    AdapterPlacement,
    demand_from_records,
    kept_on_demand,
    on_demand_slots,
    plan_adapters,
    sticky,
)

ADAPTER_NAMES = [f"a{i}" for i in range(12)]


@st.composite
def situations(
    draw: st.DrawFn,
) -> tuple[dict[str, frozenset[str]], list[str], AdapterDemand, int]:
    """Replicas holding anything (even removed adapters, even over the limit), adapters, demand."""
    adapters = draw(st.lists(st.sampled_from(ADAPTER_NAMES), unique=True, max_size=10))
    ids = draw(st.lists(st.sampled_from([f"r{i}" for i in range(6)]), unique=True, max_size=6))
    held = st.frozensets(st.sampled_from([*ADAPTER_NAMES, "gone"]), max_size=6)
    replicas = {replica: draw(held) for replica in ids}
    known = draw(st.lists(st.sampled_from(adapters), unique=True)) if adapters else []
    demand = AdapterDemand(
        {name: draw(st.floats(min_value=0, max_value=100, allow_nan=False)) for name in known}
    )
    return replicas, adapters, demand, draw(st.integers(min_value=1, max_value=4))


Situation = tuple[dict[str, frozenset[str]], list[str], AdapterDemand, int]


def run(situation: Situation) -> AdapterPlacement:
    replicas, adapters, demand, max_loras = situation
    return plan_adapters(replicas, adapters, demand, max_loras)


@settings(max_examples=300)
@given(situations())
def test_no_replica_is_asked_for_more_than_max_loras(situation: Situation):
    """Every replica's planned set has at most max_loras adapters, all of the profile."""
    placement = run(situation)
    replicas, adapters, _, max_loras = situation
    assert set(replicas) == set(placement.holds)
    for held in placement.holds.values():
        assert len(held) <= max_loras
        assert held <= set(adapters)


@settings(max_examples=300)
@given(situations())
def test_every_adapter_is_placed_when_the_capacity_allows(situation: Situation):
    """With as many slots as adapters, each adapter is on at least one replica."""
    placement = run(situation)
    replicas, adapters, _, max_loras = situation
    if replicas and len(adapters) <= len(replicas) * max_loras:
        assert all(placement.copies(name) >= 1 for name in adapters)
        assert () == placement.unplaced


@settings(max_examples=300)
@given(situations())
def test_a_hotter_adapter_is_never_on_fewer_replicas(situation: Situation):
    """An adapter with more demand has at least as many copies as any colder one."""
    placement = run(situation)
    _, adapters, demand, _ = situation
    weights = demand.weights(adapters)
    for hot in adapters:
        for cold in adapters:
            if weights[hot] > weights[cold]:
                assert placement.copies(hot) >= placement.copies(cold)


@settings(max_examples=300)
@given(situations())
def test_planning_its_own_output_changes_nothing(situation: Situation):
    """The plan is a fixed point: replicas holding what it asked keep exactly that."""
    first = run(situation)
    _, adapters, demand, max_loras = situation
    again = plan_adapters(first.holds, adapters, demand, max_loras)
    assert dict(first.holds) == dict(again.holds)


def test_a_hot_adapter_spreads_and_cold_ones_stay_on_one():
    """With four replicas of two slots, the hot adapter is everywhere and the cold ones once."""
    replicas = {f"r{i}": frozenset() for i in range(4)}
    demand = AdapterDemand({"hot": 50.0, "c1": 1.0, "c2": 1.0, "c3": 1.0, "c4": 1.0})
    placement = plan_adapters(replicas, ["hot", "c1", "c2", "c3", "c4"], demand, 2)
    assert 4 == placement.copies("hot")
    assert [1, 1, 1, 1] == [placement.copies(f"c{i}") for i in range(1, 5)]


def test_without_demand_every_adapter_weighs_the_same():
    """No figures: three adapters on two replicas of two slots: one copy each, one twice."""
    replicas = {"r0": frozenset(), "r1": frozenset()}
    placement = plan_adapters(replicas, ["a", "b", "c"], NO_DEMAND, 2)
    assert [2, 1, 1] == [placement.copies(name) for name in ("a", "b", "c")]


def test_when_slots_run_out_the_coldest_are_unplaced():
    """Five adapters, one replica of two slots: the two hottest are placed."""
    demand = AdapterDemand({"a": 1, "b": 5, "c": 3, "d": 0.5, "e": 2})
    placement = plan_adapters({"r0": frozenset()}, "abcde", demand, 2)
    assert frozenset({"b", "c"}) == placement.holds["r0"]
    assert ("e", "a", "d") == placement.unplaced


def test_a_removed_adapter_is_dropped_everywhere():
    """An adapter the profile no longer names is in no replica's planned set."""
    replicas = {"r0": frozenset({"a", "gone"}), "r1": frozenset({"gone"})}
    placement = plan_adapters(replicas, ["a"], NO_DEMAND, 2)
    assert {"r0": frozenset({"a"}), "r1": frozenset({"a"})} == dict(placement.holds)


def test_a_new_replica_takes_new_copies_and_old_ones_stay():
    """A replica that joins gets copies; what the others hold stays where it is."""
    before = plan_adapters({"r0": frozenset(), "r1": frozenset()}, "abcd", NO_DEMAND, 2)
    after = plan_adapters({**before.holds, "r2": frozenset()}, "abcd", NO_DEMAND, 2)
    assert before.holds["r0"] <= after.holds["r0"]
    assert before.holds["r1"] <= after.holds["r1"]
    assert 2 == len(after.holds["r2"])


def test_unknown_demand_counts_as_the_mean_of_the_known():
    """An adapter without a figure weighs the mean of those with one."""
    weights = AdapterDemand({"a": 2.0, "b": 4.0}).weights(["a", "b", "c"])
    assert {"a": 2.0, "b": 4.0, "c": 3.0} == weights


def test_the_routers_figures_are_summed_and_stale_ones_left_out() -> None:
    """Two fresh routers' rates add up; a record older than the window is not counted."""
    records = [
        AdapterDemandRecord(at=100.0, router="r1", requests_per_s={"sql": 1.0, "chat": 0.0}),
        AdapterDemandRecord(at=95.0, router="r2", requests_per_s={"sql": 0.5}),
        AdapterDemandRecord(at=10.0, router="r3", requests_per_s={"chat": 9.0}),
    ]
    assert {"sql": 1.5, "chat": 0.0} == dict(
        demand_from_records(records, now=100.0, max_age_s=60.0).requests_per_s
    )
    assert NO_DEMAND == demand_from_records(records[2:], now=100.0, max_age_s=60.0)


def test_a_copy_a_router_loaded_on_demand_stays_where_it_is_once_its_demand_is_reported() -> None:
    """A router evicted `b` for `c` on r1: with c's demand reported, the plan keeps c on r1."""
    current = {"r1": frozenset({"c"}), "r2": frozenset({"a"})}
    demand = AdapterDemand({"a": 0.0, "b": 0.0, "c": 0.5})
    placement = plan_adapters(current, ["a", "b", "c"], demand, max_loras=1)
    assert {"r1": frozenset({"c"}), "r2": frozenset({"a"})} == dict(placement.holds)
    assert ("b",) == placement.unplaced


def test_one_slot_per_replica_is_left_to_routers_only_when_the_adapters_do_not_fit() -> None:
    """20 adapters on 4 replicas of 4 slots: one slot each for routers; 16 or a single slot:
    none."""
    assert [1, 0, 0] == [
        on_demand_slots(max_loras=4, adapters=20, replicas=4),
        on_demand_slots(max_loras=4, adapters=16, replicas=4),
        on_demand_slots(max_loras=1, adapters=20, replicas=4),
    ]


def test_what_a_router_loaded_beyond_the_plan_is_kept_the_most_asked_for_first() -> None:
    """Adapters held that the plan never placed there stay, up to the slots left to routers;
    one the plan placed there before and now moved away does not."""
    demand = AdapterDemand({"x": 1.0, "y": 3.0, "moved": 9.0})
    kept = kept_on_demand(
        held={"a", "x", "y", "moved"},
        planned={"a"},
        planned_before={"a", "moved"},
        slots=1,
        demand=demand,
    )
    assert frozenset({"y"}) == kept
    assert frozenset() == kept_on_demand({"a", "x"}, {"a"}, set(), 0, demand)


def test_an_adapter_placed_now_keeps_its_slot_against_a_slightly_hotter_one() -> None:
    """With one slot, the placed adapter stays until the other is asked for 1.5 times as much."""
    replicas = {"r0": frozenset({"a"})}
    close = AdapterDemand({"a": 1.0, "b": 1.2})
    far = AdapterDemand({"a": 1.0, "b": 1.6})
    assert [frozenset({"a"}), frozenset({"b"})] == [
        plan_adapters(replicas, ["a", "b"], sticky(d, {"a"}), 1).holds["r0"] for d in (close, far)
    ]
    assert NO_DEMAND == sticky(NO_DEMAND, {"a"})
