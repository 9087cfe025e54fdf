"""LoRA adapters in the router's pure core: names resolved, holders first, load cost, eviction."""

from __future__ import annotations

import json
import random

import pytest
from router_builders import MODEL, endpoint_entry, live_for, loaded, snapshot_of

from caravan_llm.common.consul_api import KVEntry
from caravan_llm.common.contract import ModelAdapters, ReplicaAdapters, nomad_service_id
from caravan_llm.router.core.adapters import (
    AdapterRoute,
    AdapterTable,
    AdapterWant,
    DemandWindow,
    engine_model_name,
    eviction_victim,
)
from caravan_llm.router.core.balancer import (
    BalancerConfig,
    Picked,
    PickerMemory,
    Policy,
    RequestFeatures,
    pick,
)
from caravan_llm.router.core.prefix_index import ShapeConfig, prompt_shape
from caravan_llm.router.edge.adapter_requests import adapter_cards, for_engine
from caravan_llm.router.edge.parsed_request import ParsedRequest
from caravan_llm.router.feeds.discovery import adapters_from_kv, declared_from_kv

PREFIX = "caravan/models/"
ALLOC_A = "5d3c2a4e-8b1f-4c0d-9e6a-7f8b9c0d1e2f"
ALLOC_B = "6e4d3b5f-9c2a-4d1e-8f7b-8a9c0d1e2f3a"


def profile(name: str, served: str, adapters: list[str], index: int) -> KVEntry:
    document = {
        "name": name,
        "served_model_name": served,
        "adapters": [{"name": a, "source": f"/models/loras/{a}"} for a in adapters],
        "lora": {"max_loras": 2},
    }
    return kv_entry(f"{PREFIX}{name}", json.dumps(document).encode(), index)


def kv_entry(key: str, value: bytes, index: int) -> KVEntry:
    return KVEntry(
        key=key,
        value=value,
        create_index=index,
        modify_index=index,
        flags=0,
        session=None,
        lock_index=0,
    )


def route(name: str = "sql") -> AdapterRoute:
    return AdapterRoute(name, "qwen", "qwen-chat", f"/models/loras/{name}", max_loras=2)


def test_adapter_names_resolve_to_their_base_model_and_a_clash_leaves_the_later_profile_out() -> (
    None
):
    """An adapter name maps to its profile; a later profile declaring a taken name loses all."""
    entries = [
        profile("qwen", "qwen-chat", ["sql", "chat"], 1),
        profile("llama", "llama-chat", ["sql"], 2),
    ]
    models, routes, problems = declared_from_kv(entries, PREFIX)
    assert ["qwen-chat"] == sorted(models)
    assert {"sql": ("qwen", "qwen-chat", "/models/loras/sql", 2)} == {
        n: (r.model, r.served, r.source, r.max_loras) for n, r in routes.items() if n == "sql"
    }
    assert ["chat", "sql"] == sorted(routes)
    assert ["caravan/models/llama: adapter name 'sql' is already declared by profile 'qwen'"] == (
        problems
    )


def test_the_holders_are_the_endpoints_of_the_allocations_that_loaded_the_adapter() -> None:
    """The document's allocations are Nomad's service ids; a failure is of the same source."""
    document = ModelAdapters(
        model="qwen",
        replicas=(
            ReplicaAdapters(alloc_id=ALLOC_A, job_id="j-0", loaded=("sql",)),
            ReplicaAdapters(alloc_id=ALLOC_B, job_id="j-1", loaded=("chat",)),
        ),
    )
    table = AdapterTable(routes={"sql": route()}, documents={"qwen": document})
    assert frozenset({nomad_service_id(ALLOC_A, "qwen")}) == table.holders(route())
    assert {"sql": 1, "chat": 1} == table.copies("qwen")
    assert table.failure(route()) is None


def test_an_unreadable_adapters_document_is_reported_and_left_out() -> None:
    """A document that does not decode is a problem line, not an exception."""
    documents, problems = adapters_from_kv(
        [kv_entry("caravan/adapters/qwen", b"{not json", 1)],
        "caravan/adapters/",
    )
    assert ({}, 1) == (documents, len(problems))


def features(adapter: AdapterWant | None) -> RequestFeatures:
    shape = prompt_shape({"prompt": "hello " * 50}, ShapeConfig())
    return RequestFeatures(model=MODEL, prompt=shape, adapter=adapter)


@pytest.mark.parametrize("policy", list(Policy))
def test_a_holder_is_chosen_over_an_equally_idle_replica_that_would_load(policy: Policy) -> None:
    """Every policy sends an adapter request to the replica holding it when load is equal."""
    snapshot = snapshot_of(endpoint_entry("a"), endpoint_entry("b", port=2))
    live = live_for(snapshot, {"a": loaded(), "b": loaded()})
    for holder in ("a", "b"):
        want = AdapterWant("sql", frozenset({holder}), load_s=2.0)
        result = pick(
            snapshot,
            live,
            features(want),
            policy,
            100.0,
            config=BalancerConfig(),
            memory=PickerMemory(rng=random.Random(7)),
        )
        assert isinstance(result, Picked)
        assert holder == result.endpoint.id


def test_the_cost_model_loads_elsewhere_when_the_holder_is_busier_than_a_load() -> None:
    """With a cheap load and a deeply queued holder, predicted TTFT picks the idle replica."""
    snapshot = snapshot_of(endpoint_entry("a"), endpoint_entry("b", port=2))
    busy = loaded(in_flight=40, waiting=30.0)
    live = live_for(snapshot, {"a": busy, "b": loaded()})
    want = AdapterWant("sql", frozenset({"a"}), load_s=0.01)
    result = pick(
        snapshot,
        live,
        features(want),
        Policy.PREDICTED_TTFT,
        100.0,
        config=BalancerConfig(),
        memory=PickerMemory(),
    )
    assert isinstance(result, Picked)
    assert "b" == result.endpoint.id


def test_a_full_replica_gives_up_a_copy_held_elsewhere_before_a_sole_copy() -> None:
    """Eviction: the adapter with another copy goes, then the least asked for; room: none."""
    assert eviction_victim(["a"], max_loras=2, copies={}, demand={}) is None
    assert "b" == eviction_victim(
        ["a", "b"], max_loras=2, copies={"a": 1, "b": 2}, demand={"b": 9.0}
    )
    assert "a" == eviction_victim(
        ["a", "b"], max_loras=2, copies={"a": 1, "b": 1}, demand={"a": 0.1, "b": 2.0}
    )


def test_the_engine_model_name_follows_the_engines_template() -> None:
    """vLLM takes the adapter's name; SGLang `<served>:<adapter>`."""
    assert ("sql", "qwen-chat:sql") == (
        engine_model_name("{adapter}", route()),
        engine_model_name("{served}:{adapter}", route()),
    )


def test_a_request_is_rewritten_only_when_the_engine_names_the_adapter_otherwise() -> None:
    """The same bytes go to vLLM; SGLang gets `model` rewritten and the rest unchanged."""
    body = b'{"model": "sql", "prompt": "x"}'
    parsed = ParsedRequest(body, {"model": "sql", "prompt": "x"}, "sql", False, None, 0, "r")
    assert for_engine(parsed, route(), "{adapter}") is parsed
    rewritten = for_engine(parsed, route(), "{served}:{adapter}")
    assert {"model": "qwen-chat:sql", "prompt": "x"} == json.loads(rewritten.body)
    assert "sql" == rewritten.model


def test_the_model_list_names_each_adapters_parent_and_root() -> None:
    """Adapters of listed models appear with `parent` and `root`, as vLLM lists them."""
    table = AdapterTable(routes={"sql": route()})
    assert [
        {
            "id": "sql",
            "object": "model",
            "created": 5,
            "owned_by": "caravan",
            "root": "/models/loras/sql",
            "parent": "qwen-chat",
        }
    ] == adapter_cards(table, ["qwen-chat"], 5)
    assert [] == adapter_cards(table, ["other"], 5)


def test_demand_is_requests_per_second_over_the_window_and_forgets_old_ones() -> None:
    """Requests inside the window count; an adapter with none left is dropped."""
    window = DemandWindow(window_s=10.0)
    for at in (0.0, 5.0, 9.0):
        window.note("qwen", "sql", at)
    assert {"qwen": {"sql": 0.3}} == window.rates(9.5)
    assert {"qwen": {"sql": 0.1}} == window.rates(18.0)
    assert {} == window.rates(30.0)
