"""Builders for router tests: Consul health entries, snapshots and live state with overrides."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from caravan_llm.common.consul_api import HealthEntry
from caravan_llm.common.engine_metrics import EngineLoad
from caravan_llm.router.core.endpoints import EndpointSnapshot, snapshot_from_health
from caravan_llm.router.core.live_state import EndpointLiveState, LiveStates, reconcile_live_state

MODEL = "qwen2.5-7b-instruct"
SERVICE = "caravan-qwen2-5-7b"


def service_meta(**overrides: str) -> dict[str, str]:
    """Service Meta as the scheduler renders it for a vLLM replica."""
    meta = {
        "alloc_id": "5d3c2a4e-8b1f-4c0d-9e6a-7f8b9c0d1e2f",
        "capacity": "64",
        "caravan_model": "qwen2-5-7b",
        "engine": "vllm",
        "gpu_class": "h100",
        "metric_kv_cache": "vllm:kv_cache_usage_perc",
        "metric_running": "vllm:num_requests_running",
        "metric_waiting": "vllm:num_requests_waiting",
        "metrics_path": "/metrics",
        "replica": "0",
        "served_models": MODEL,
        "spec_hash": "535ac0f75981075f",
        "external-source": "nomad",
    }
    meta.update(overrides)
    return meta


def health_entry(
    service_id: str = "ep-0",
    *,
    status: str = "passing",
    node_status: str = "passing",
    service: str = SERVICE,
    node: str = "client-1",
    node_address: str = "10.0.0.11",
    address: str = "10.0.0.11",
    port: int = 23456,
    meta: dict[str, str] | None = None,
    extra_checks: Iterable[dict[str, Any]] = (),
) -> HealthEntry:
    """One `/v1/health/service` entry (a node with serfHealth and an HTTP service check),
    decoded as `caravan_llm.common.consul_api` decodes Consul's JSON."""
    return HealthEntry.from_api({
        "Node": {"ID": f"id-{node}", "Node": node, "Address": node_address, "Datacenter": "dc1"},
        "Service": {
            "ID": service_id,
            "Service": service,
            "Tags": ["caravan", "engine-vllm"],
            "Address": address,
            "Meta": meta if meta is not None else service_meta(),
            "Port": port,
            "Weights": {"Passing": 1, "Warning": 1},
            "EnableTagOverride": False,
        },
        "Checks": [
            {"Node": node, "CheckID": "serfHealth", "Name": "Serf Health Status",
             "Status": node_status, "ServiceID": "", "ServiceName": ""},
            {"Node": node, "CheckID": f"_nomad-check-{service_id}", "Name": "engine-health",
             "Status": status, "ServiceID": service_id, "ServiceName": service, "Type": "http"},
            *extra_checks,
        ],
    })  # fmt: skip


def endpoint_entry(
    endpoint_id: str,
    *,
    status: str = "passing",
    capacity: int | None = 64,
    model: str = MODEL,
    port: int = 23456,
) -> HealthEntry:
    """A health entry for one replica of `model`, trimmed to what balancer tests vary."""
    meta = service_meta(served_models=model, capacity="" if capacity is None else str(capacity))
    return health_entry(endpoint_id, status=status, meta=meta, port=port)


def snapshot_of(
    *entries: HealthEntry, index: int = 1, previous: EndpointSnapshot | None = None
) -> EndpointSnapshot:
    """A snapshot of these entries, grouped by their service name; fails on a skipped entry."""
    by_service: dict[str, list[HealthEntry]] = {}
    for entry in entries:
        by_service.setdefault(entry.service_name, []).append(entry)
    snapshot, skipped = snapshot_from_health(by_service, index, previous)
    assert skipped == ()
    return snapshot


def live_for(
    snapshot: EndpointSnapshot, states: dict[str, EndpointLiveState] | None = None
) -> LiveStates:
    """Reconciled live state for the snapshot, with chosen endpoints' state replaced."""
    live = reconcile_live_state({}, snapshot)
    live.update(states or {})
    return live


def loaded(
    *,
    in_flight: int = 0,
    waiting: float | None = 0.0,
    kv_cache_usage: float | None = 0.1,
    scraped_at: float | None = 100.0,
) -> EndpointLiveState:
    """Live state with a scrape taken at `scraped_at` (None = never scraped)."""
    if scraped_at is None:
        return EndpointLiveState(in_flight=in_flight)
    load = EngineLoad(running=float(in_flight), waiting=waiting, kv_cache_usage=kv_cache_usage)
    return EndpointLiveState(in_flight=in_flight, load=load, load_scraped_at=scraped_at)
