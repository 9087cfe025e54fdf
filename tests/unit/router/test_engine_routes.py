"""Which replicas a route may go to comes from the routes their Meta publishes, never the engine."""

from __future__ import annotations

import pytest
from router_builders import MODEL, SERVICE, health_entry, service_meta, snapshot_of

from caravan_llm.common.contract import (
    DEFAULT_ENGINE_ROUTES,
    EngineRoute,
    EngineRoutesError,
    ServiceMetaKey,
    decode_engine_routes,
    encode_engine_routes,
)
from caravan_llm.router.core.balancer import (
    BalancerConfig,
    NoEndpointReason,
    NotPicked,
    Picked,
    PickerMemory,
    Policy,
    RequestFeatures,
    pick,
)
from caravan_llm.router.core.endpoints import snapshot_from_health
from caravan_llm.router.core.live_state import reconcile_live_state


def test_routes_round_trip_through_meta() -> None:
    """The routes an adapter declares are the routes the router decodes from Meta."""
    routes = frozenset({EngineRoute.RESPONSES, EngineRoute.TOKENIZE})

    assert routes == decode_engine_routes(encode_engine_routes(routes))


def test_meta_without_routes_serves_what_routers_always_forwarded() -> None:
    """A replica of an older scheduler is sent chat, completions and embeddings, nothing else."""
    assert DEFAULT_ENGINE_ROUTES == decode_engine_routes({})


def test_route_names_this_router_does_not_know_are_skipped() -> None:
    """A newer scheduler's route name does not make the replica unroutable."""
    meta = {ServiceMetaKey.ROUTES: "responses,teleport"}

    assert frozenset({EngineRoute.RESPONSES}) == decode_engine_routes(meta)


@pytest.mark.parametrize("raw", ["responses,,tokenize", ",", "responses, "])
def test_a_malformed_route_list_is_refused_naming_the_key(raw: str) -> None:
    """An empty name in the list is an error that names Meta.routes."""
    with pytest.raises(EngineRoutesError, match=r"Meta\.routes"):
        decode_engine_routes({ServiceMetaKey.ROUTES: raw})


def test_a_malformed_route_list_skips_the_entry() -> None:
    """The router skips, with the key named, a replica whose routes it cannot read."""
    meta = service_meta(**{ServiceMetaKey.ROUTES: "chat_completions,,x"})

    snapshot, skipped = snapshot_from_health({SERVICE: [health_entry("a", meta=meta)]}, 1)

    assert {} == dict(snapshot.by_id)
    assert "Meta.routes" in skipped[0].reason


def test_pick_sends_a_route_only_to_endpoints_that_serve_it() -> None:
    """Of two endpoints, the one whose Meta lacks the route is never picked for it."""
    chat_only = service_meta(engine="x", **encode_engine_routes(DEFAULT_ENGINE_ROUTES))
    everything = service_meta(engine="x", **encode_engine_routes(frozenset(EngineRoute)))
    snapshot = snapshot_of(
        health_entry("a-chat", meta=chat_only), health_entry("b-all", meta=everything)
    )
    live = reconcile_live_state({}, snapshot)
    request = RequestFeatures(model=MODEL, route=EngineRoute.RESPONSES)

    picks = {
        result.endpoint.id
        for _ in range(20)
        if isinstance(
            result := pick(
                snapshot,
                live,
                request,
                Policy.ROUND_ROBIN,
                0.0,
                config=BalancerConfig(),
                memory=PickerMemory(),
            ),
            Picked,
        )
    }

    assert {"b-all"} == picks


def test_no_endpoint_serving_the_route_reads_as_no_endpoints() -> None:
    """When no endpoint serves the route, pick says no_endpoints (the proxy refuses it first)."""
    snapshot = snapshot_of(health_entry("a", meta=service_meta()))
    live = reconcile_live_state({}, snapshot)
    request = RequestFeatures(model=MODEL, route=EngineRoute.MESSAGES)

    result = pick(
        snapshot, live, request, Policy.LEAST_INFLIGHT, 0.0,
        config=BalancerConfig(), memory=PickerMemory(),
    )  # fmt: skip

    assert NotPicked(NoEndpointReason.NO_ENDPOINTS) == result
