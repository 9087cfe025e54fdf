"""Discovery's pure conversions: catalog tags, typed health entries, drain markers, profiles."""

from __future__ import annotations

import json
from types import MappingProxyType

from router_builders import service_meta

from caravan_llm.common.consul_api import HealthCheck, HealthEntry, KVEntry
from caravan_llm.common.contract import ModelView
from caravan_llm.router.core.endpoints import CheckStatus, snapshot_from_health
from caravan_llm.router.core.routing_state import KnownModel
from caravan_llm.router.feeds.discovery import (
    draining_endpoint_ids,
    entry_job_id,
    keys_under,
    model_services,
    profiles_from_kv,
)


def entry(service_id: str = "ep-0", status: str = "passing", **meta: str) -> HealthEntry:
    return HealthEntry(
        node="client-1",
        node_address="10.0.0.11",
        service_id=service_id,
        service_name="caravan-qwen2-5-7b",
        service_address="",
        port=23456,
        tags=("caravan",),
        meta=MappingProxyType(service_meta(**meta)),
        checks=(
            HealthCheck("serfHealth", "passing", "Serf Health Status"),
            HealthCheck(f"_nomad-check-{service_id}", status, "engine-health", service_id),
        ),
    )


def kv(key: str, value: object) -> KVEntry:
    raw = value if isinstance(value, bytes) else json.dumps(value).encode()
    return KVEntry(key, raw, 0, None, 0, 1, 1)


def test_model_services_are_the_ones_tagged_caravan() -> None:
    """Only services tagged `caravan` are model replicas; routers and others are not."""
    services = {
        "consul": (),
        "caravan-qwen": ("caravan", "engine-vllm"),
        "caravan-router": ("caravan-control",),
    }

    assert frozenset({"caravan-qwen"}) == model_services(services)


def test_typed_entry_becomes_the_endpoint_the_snapshot_expects() -> None:
    """A typed entry round-trips into an endpoint with the node address and its status."""
    snapshot, skipped = snapshot_from_health({"caravan-qwen2-5-7b": [entry(status="warning")]}, 3)

    endpoint = snapshot.by_id["ep-0"]
    assert () == skipped
    assert ("10.0.0.11", 23456, CheckStatus.WARNING, 64) == (
        endpoint.address,
        endpoint.port,
        endpoint.status,
        endpoint.capacity,
    )


def test_job_id_comes_from_model_and_replica_meta() -> None:
    """The replica's Nomad job id is `caravan-<model>-<replica>`; no Meta, no id."""
    assert "caravan-qwen2-5-7b-2" == entry_job_id(entry(replica="2"))
    assert entry_job_id(entry(replica="x")) is None


def test_drain_markers_select_endpoints_by_job_id() -> None:
    """Endpoints whose job has a drain marker are the ones to drain."""
    entries = [entry("a", replica="0"), entry("b", replica="1")]

    assert frozenset({"b"}) == draining_endpoint_ids(entries, frozenset({"caravan-qwen2-5-7b-1"}))
    assert frozenset() == draining_endpoint_ids(entries, frozenset())


def test_keys_under_a_prefix_ignore_the_prefix_itself_and_deeper_keys() -> None:
    """Only direct children of the prefix count."""
    entries = [
        kv("caravan/draining/", b""),
        kv("caravan/draining/j-1", {}),
        kv("caravan/draining/a/b", {}),
    ]

    assert frozenset({"j-1"}) == keys_under(entries, "caravan/draining/")


def test_profiles_map_served_names_to_profile_names() -> None:
    """A profile is known under its served model name (default: its name); bad ones say why.

    Two profiles serving the same name: the first in key order keeps it."""
    entries = [
        kv("caravan/models/qwen", {"name": "qwen", "served_model_name": "Qwen/Qwen2.5-7B"}),
        kv("caravan/models/tiny", {"name": "tiny"}),
        kv("caravan/models/broken", b"{nope"),
        kv("caravan/models/tiny-copy", {"name": "tiny-copy", "served_model_name": "tiny"}),
    ]

    profiles, problems = profiles_from_kv(entries, "caravan/models/")

    assert {
        "Qwen/Qwen2.5-7B": KnownModel(
            "qwen",
            "Qwen/Qwen2.5-7B",
            ModelView(name="qwen", served_model_name="Qwen/Qwen2.5-7B"),
        ),
        "tiny": KnownModel("tiny", "tiny", ModelView(name="tiny")),
    } == profiles
    assert 2 == len(problems)
    assert problems[0].startswith("caravan/models/broken: not JSON")
    assert "already declared by profile 'tiny'" in problems[1]
