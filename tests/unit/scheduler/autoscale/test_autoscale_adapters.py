"""A hot LoRA adapter spreads to replicas with room before its model scales out (pure)."""

from __future__ import annotations

from caravan_llm.common.contract import ModelAdapters, ReplicaAdapters, nomad_service_id
from caravan_llm.scheduler.autoscale.adapters import (
    adapter_to_spread,
    holders_by_adapter,
    spread_first,
)
from caravan_llm.scheduler.autoscale.memory import Direction
from caravan_llm.scheduler.autoscale.policy import ScaleDecision
from caravan_llm.scheduler.lora.plan import AdapterDemand

UP = ScaleDecision(Direction.UP, 6, "in-flight 16.5 over 10", {})
HOT = AdapterDemand({"sql": 5.0, "chat": 0.1})


def test_a_scale_up_is_held_while_the_hot_adapters_holders_are_full_and_others_have_room() -> None:
    """Two saturated holders of `sql` and two idle replicas: the model does not scale out."""
    inflight = {"r1": 30.0, "r2": 30.0, "r3": 3.0, "r4": 3.0}
    decision = spread_first(
        UP,
        4,
        inflight=inflight,
        holders={"sql": {"r1", "r2"}, "chat": {"r3"}},
        demand=HOT,
        target_inflight=10.0,
    )
    assert (Direction.NONE, 4) == (decision.direction, decision.target)
    assert "adapter 'sql'" in decision.reason


def test_the_scale_up_goes_ahead_once_the_adapter_is_on_every_replica_with_room() -> None:
    """Once `sql` spread to all four replicas and they are all busy, the model scales out."""
    inflight = {"r1": 30.0, "r2": 30.0, "r3": 25.0, "r4": 25.0}
    holders = {"sql": {"r1", "r2", "r3", "r4"}}
    assert UP == spread_first(
        UP, 4, inflight=inflight, holders=holders, demand=HOT, target_inflight=10.0
    )


def test_unknown_load_and_adapters_without_demand_hold_nothing() -> None:
    """A holder of unknown load is not saturated; an adapter nobody asks for never holds."""
    assert (
        adapter_to_spread({"r1": None, "r2": 3.0}, {"sql": {"r1"}}, HOT, target_inflight=10.0)
        is None
    )
    assert (
        adapter_to_spread(
            {"r1": 30.0, "r2": 3.0}, {"sql": {"r1"}}, AdapterDemand({"sql": 0.0}), 10.0
        )
        is None
    )


def test_a_scale_down_or_a_model_without_an_inflight_target_is_left_alone() -> None:
    """Only a scale-up is held, and only against `target_inflight`."""
    down = ScaleDecision(Direction.DOWN, 2, "idle", {})
    inflight = {"r1": 30.0, "r2": 3.0}
    holders = {"sql": {"r1"}}
    assert down == spread_first(
        down, 3, inflight=inflight, holders=holders, demand=HOT, target_inflight=10.0
    )
    assert UP == spread_first(
        UP, 3, inflight=inflight, holders=holders, demand=HOT, target_inflight=None
    )


def test_holders_are_named_by_the_replicas_consul_service_ids() -> None:
    """The adapters document's allocations map to the ids the scrapes carry."""
    alloc = "5d3c2a4e-8b1f-4c0d-9e6a-7f8b9c0d1e2f"
    document = ModelAdapters(
        model="qwen", replicas=(ReplicaAdapters(alloc_id=alloc, job_id="j", loaded=("sql",)),)
    )
    assert {"sql": {nomad_service_id(alloc, "qwen")}} == holders_by_adapter(document, "qwen")
    assert {} == holders_by_adapter(None, "qwen")
