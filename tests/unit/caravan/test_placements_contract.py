"""The placements document: one codec for the scheduler (writer) and the router (reader)."""

from __future__ import annotations

import json
import uuid

import pytest

from caravan_llm.common.contract import (
    GROUP_NAME,
    KVLayout,
    PlacedAllocation,
    Placements,
    PlacementsError,
    decode_placements,
    encode_placements,
    model_service_name,
    nomad_service_id,
)
from caravan_llm.devcluster.nomad.consul_sync import service_id as devcluster_service_id

A = "00000000-0000-4000-8000-00000000000a"
B = "00000000-0000-4000-8000-00000000000b"


def alloc(alloc_id: str = A, **overrides: object) -> PlacedAllocation:
    fields: dict[str, object] = {
        "alloc_id": alloc_id,
        "job_id": "caravan-tiny-0",
        "address": "10.0.0.5",
        "port": 23000,
    }
    fields.update(overrides)
    return PlacedAllocation.model_validate(fields)


def test_round_trip_and_order_does_not_matter() -> None:
    """Decode(encode(p)) == p, and the same set in any order encodes to the same text."""
    one = Placements(model="tiny", allocations=(alloc(A), alloc(B, port=23001)))
    other = Placements(model="tiny", allocations=(alloc(B, port=23001), alloc(A)))

    assert encode_placements(one) == encode_placements(other)
    assert one == decode_placements(encode_placements(one), key="k", model="tiny")


@pytest.mark.parametrize(
    ("document", "names"),
    [
        ({"model": "tiny", "allocations": [{"alloc_id": "nope"}]}, "allocations.0.alloc_id"),
        ({"model": "tiny", "allocations": [{**alloc().model_dump(), "port": 0}]}, "port"),
        ({"model": "tiny", "allocations": [{**alloc().model_dump(), "extra": 1}]}, "extra"),
        ({"model": "Tiny!", "allocations": []}, "model"),
        ({"model": "other", "allocations": []}, "does not match its key"),
    ],
)
def test_a_bad_document_is_refused_naming_the_key_and_field(
    document: dict[str, object], names: str
) -> None:
    """Every problem names the KV key and the field in error."""
    with pytest.raises(PlacementsError) as caught:
        decode_placements(json.dumps(document), key="caravan/placements/tiny", model="tiny")

    assert str(caught.value).startswith("caravan/placements/tiny: ")
    assert names in str(caught.value)


def test_not_json_is_a_placements_error() -> None:
    with pytest.raises(PlacementsError):
        decode_placements(b"{", key="k", model="tiny")


def test_nomad_service_id_is_the_one_nomad_registers_for_the_group_service() -> None:
    """Same as devcluster's Nomad (MakeAllocServiceID with task `group-<group>`)."""
    alloc_id = str(uuid.uuid4())
    service = {"Name": model_service_name("tiny"), "PortLabel": "http"}

    assert devcluster_service_id(alloc_id, f"group-{GROUP_NAME}", service) == nomad_service_id(
        alloc_id, "tiny"
    )
    assert f"_nomad-task-{alloc_id}-group-engine-caravan-tiny-http" == nomad_service_id(
        alloc_id, "tiny"
    )


def test_layout_places_the_documents_under_the_prefix() -> None:
    assert "ns/placements/tiny" == KVLayout("ns/").placements_key("tiny")
