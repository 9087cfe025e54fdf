"""Endpoint verification: only Nomad's registration of a placed allocation is an endpoint."""

from __future__ import annotations

import json
from types import MappingProxyType

import pytest
from router_builders import health_entry, service_meta

from caravan_llm.common.consul_api import KVEntry
from caravan_llm.common.contract import (
    PlacedAllocation,
    Placements,
    encode_placements,
    nomad_service_id,
)
from caravan_llm.router.core.endpoints import (
    PlacedAddress,
    TrustedService,
    UnverifiedEntry,
    UnverifiedReason,
    snapshot_from_health,
    verify_entries,
)
from caravan_llm.router.core.routing_state import KnownModel
from caravan_llm.router.feeds.discovery import placements_from_kv, trusted_services
from caravan_llm.router.settings import RouterSettings

NAME = "qwen2-5-7b"
SERVICE = "caravan-qwen2-5-7b"
SERVED = "qwen2.5-7b-instruct"
ALLOC = "5d3c2a4e-8b1f-4c0d-9e6a-7f8b9c0d1e2f"
PLACED_ID = nomad_service_id(ALLOC, NAME)


def trust(**placed: PlacedAddress) -> dict[str, TrustedService]:
    where = placed or {PLACED_ID: PlacedAddress("10.0.0.11", 23456)}
    return {SERVICE: TrustedService(served_models=(SERVED,), placed=MappingProxyType(where))}


def kv(key: str, value: object) -> KVEntry:
    raw = value if isinstance(value, bytes) else json.dumps(value).encode()
    return KVEntry(key, raw, 0, None, 0, 1, 1)


def test_the_service_nomad_registered_for_a_placed_allocation_is_kept() -> None:
    """An entry with Nomad's ID of a placed allocation, at its address, is an endpoint."""
    kept, unverified = verify_entries({SERVICE: [health_entry(PLACED_ID)]}, trust())

    assert () == unverified
    assert [PLACED_ID] == [entry.service_id for entry in kept[SERVICE]]


def test_a_hand_registered_service_under_the_model_name_is_ignored() -> None:
    """An ID no placed allocation has (the rogue's own) is not an endpoint."""
    rogue = health_entry("rogue-1", address="10.9.9.9")
    kept, unverified = verify_entries({SERVICE: [health_entry(PLACED_ID), rogue]}, trust())

    assert [PLACED_ID] == [entry.service_id for entry in kept[SERVICE]]
    assert (UnverifiedEntry(SERVICE, "rogue-1", UnverifiedReason.NOT_PLACED),) == unverified


def test_a_copy_of_a_placed_id_at_another_address_is_ignored() -> None:
    """Service IDs are visible to anyone who reads Consul: the address and port must be Nomad's."""
    forged = health_entry(PLACED_ID, node="attacker", address="10.9.9.9")
    moved_port = health_entry(PLACED_ID, port=40000)
    _, unverified = verify_entries({SERVICE: [forged, moved_port]}, trust())

    assert [UnverifiedReason.ADDRESS_MISMATCH] * 2 == [item.reason for item in unverified]


def test_the_node_address_counts_when_the_service_has_none() -> None:
    """Consul's rule: an empty Service.Address means the node's address."""
    entry = health_entry(PLACED_ID, address="", node_address="10.0.0.11")
    kept, unverified = verify_entries({SERVICE: [entry]}, trust())

    assert () == unverified
    assert 1 == len(kept[SERVICE])


def test_of_two_copies_of_a_placed_registration_the_one_on_the_allocations_node_wins() -> None:
    """A copy (same ID, address and port) on another node is dropped, whatever the order."""
    where = PlacedAddress("10.0.0.11", 23456, node="client-1")
    real = health_entry(PLACED_ID, node="client-1")
    copy = health_entry(PLACED_ID, node="attacker", status="passing")
    results = [
        verify_entries({SERVICE: entries}, trust(**{PLACED_ID: where}))
        for entries in ([copy, real], [real, copy])
    ]

    for kept, unverified in results:
        assert ["client-1"] == [entry.node for entry in kept[SERVICE]]
        assert (UnverifiedEntry(SERVICE, PLACED_ID, UnverifiedReason.DUPLICATE),) == unverified


def test_without_a_node_match_the_first_copy_is_kept_and_the_rest_reported() -> None:
    """Consul and Nomad node names may differ: never fail closed on the node, keep one."""
    where = PlacedAddress("10.0.0.11", 23456, node="nomad-name")
    first, second = health_entry(PLACED_ID, node="a"), health_entry(PLACED_ID, node="b")
    kept, unverified = verify_entries({SERVICE: [first, second]}, trust(**{PLACED_ID: where}))

    assert ["a"] == [entry.node for entry in kept[SERVICE]]
    assert [UnverifiedReason.DUPLICATE] == [item.reason for item in unverified]


def test_a_service_of_a_model_without_profile_is_ignored() -> None:
    """A new service (no stored profile) claiming another model's served name gets nothing."""
    claim = health_entry("evil-1", service="caravan-evil", meta=service_meta(served_models=SERVED))
    kept, unverified = verify_entries({"caravan-evil": [claim]}, trust())

    assert {} == kept
    assert (UnverifiedEntry("caravan-evil", "evil-1", UnverifiedReason.NO_PROFILE),) == unverified


def test_served_names_come_from_the_profile_not_from_meta() -> None:
    """A placed replica whose Meta claims other names answers only to its profile's name."""
    greedy = health_entry(PLACED_ID, meta=service_meta(served_models=f"other-model,{SERVED},x"))
    kept, _ = verify_entries({SERVICE: [greedy]}, trust())
    snapshot, skipped = snapshot_from_health(kept, index=1)

    assert () == skipped
    assert [SERVED] == sorted(snapshot.models)


def test_a_replica_of_an_older_profile_gets_no_requests_for_the_new_name() -> None:
    """Meta naming only an old served name: placed, but routable for no name (being replaced)."""
    old = health_entry(PLACED_ID, meta=service_meta(served_models="old-name"))
    kept, unverified = verify_entries({SERVICE: [old]}, trust())

    assert ({}, ()) == (kept, unverified)


def test_allow_unverified_keeps_them_as_they_are_and_still_reports_them() -> None:
    """The unsafe setting routes to unverified entries by their own Meta, and says so."""
    rogue = health_entry("rogue-1", service="caravan-evil", meta=service_meta(served_models="m"))
    kept, unverified = verify_entries({"caravan-evil": [rogue]}, trust(), allow_unverified=True)
    snapshot, _ = snapshot_from_health(kept, index=1)

    assert ["m"] == sorted(snapshot.models)
    assert [UnverifiedReason.NO_PROFILE] == [item.reason for item in unverified]


def test_a_rogue_next_to_real_replicas_is_not_in_the_snapshot() -> None:
    """End of the pure pipeline: the snapshot holds the placed replica only."""
    entries = {
        SERVICE: [health_entry(PLACED_ID), health_entry("rogue", address="10.9.9.9")],
        "caravan-evil": [health_entry("evil", service="caravan-evil")],
    }
    kept, unverified = verify_entries(entries, trust())
    snapshot, _ = snapshot_from_health(kept, index=1)

    assert [PLACED_ID] == sorted(snapshot.by_id)
    assert 2 == len(unverified)


def test_trusted_services_pair_profiles_with_placements() -> None:
    """Nomad's service ID of each placed allocation, under the model's service name."""
    placements = {
        NAME: Placements(
            model=NAME,
            allocations=(
                PlacedAllocation(
                    alloc_id=ALLOC,
                    job_id="caravan-qwen2-5-7b-0",
                    address="10.0.0.11",
                    port=23456,
                    node="client-1",
                ),
            ),
        )
    }
    profiles = {SERVED: KnownModel(name=NAME, served_model_name=SERVED)}
    unplaced = {"x": KnownModel(name="idle", served_model_name="x")}

    assert {
        SERVICE: TrustedService(
            (SERVED,), {PLACED_ID: PlacedAddress("10.0.0.11", 23456, "client-1")}
        ),
        "caravan-idle": TrustedService(("x",), {}),
    } == trusted_services({**profiles, **unplaced}, placements)


def test_placements_from_kv_reads_each_model_and_names_bad_documents() -> None:
    """A readable document per model; a bad one is left out with a problem naming the key."""
    good = Placements(model="a", allocations=())
    entries = [
        kv("caravan/placements/a", encode_placements(good).encode()),
        kv("caravan/placements/b", {"model": "a", "allocations": []}),
        kv("caravan/placements/c", b"{not json"),
    ]
    placements, problems = placements_from_kv(entries, "caravan/placements/")

    assert {"a": good} == placements
    assert 2 == len(problems)
    assert problems[0].startswith("caravan/placements/b: model 'a'")
    assert problems[1].startswith("caravan/placements/c: ")


def test_verification_is_on_unless_the_environment_turns_it_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Off by default; `CARAVAN_ROUTER_ALLOW_UNVERIFIED_ENDPOINTS=true` allows unverified ones."""
    monkeypatch.delenv("CARAVAN_ROUTER_ALLOW_UNVERIFIED_ENDPOINTS", raising=False)
    default = RouterSettings().allow_unverified_endpoints
    monkeypatch.setenv("CARAVAN_ROUTER_ALLOW_UNVERIFIED_ENDPOINTS", "true")

    assert (False, True) == (default, RouterSettings().allow_unverified_endpoints)
