"""The endpoint snapshot built from Consul `/v1/health/service` entries."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from router_builders import MODEL, SERVICE, endpoint_entry, health_entry, service_meta, snapshot_of

from caravan_llm.common.consul_api import HealthCheck, HealthEntry, aggregate_status
from caravan_llm.common.engine_metrics import MetricNames
from caravan_llm.router.core.endpoints import (
    EMPTY_SNAPSHOT,
    CheckStatus,
    Endpoint,
    snapshot_from_health,
)
from caravan_llm.scheduler.engines.llamacpp import LLAMACPP_METRIC_NAMES
from caravan_llm.scheduler.engines.vllm import VLLM_METRIC_NAMES

REALISTIC = Path(__file__).parent / "consul_health_caravan_qwen.json"


def realistic_entries() -> list[HealthEntry]:
    entries: list[dict[str, Any]] = json.loads(REALISTIC.read_text())
    return [HealthEntry.from_api(entry) for entry in entries]


class TestRealisticConsulPayload:
    def test_builds_endpoints_with_status_address_fallback_and_skips_foreign_entry(self) -> None:
        """Three Nomad-registered replicas become endpoints; a hand-registered one is skipped."""
        snapshot, skipped = snapshot_from_health({SERVICE: realistic_entries()}, index=4242)

        model = snapshot.for_model(MODEL)
        assert model is not None
        by_replica = {endpoint.replica: endpoint for endpoint in model.endpoints}
        assert snapshot.index == 4242
        assert {replica: endpoint.status for replica, endpoint in by_replica.items()} == {
            0: CheckStatus.PASSING,
            1: CheckStatus.WARNING,
            2: CheckStatus.CRITICAL,
        }
        # Replica 1 registered no service address: the node's address is used.
        assert by_replica[1].address == "10.0.0.12"
        assert [entry.service_id for entry in skipped] == ["llm-phi3-mini-r1-manual"]
        assert "served_models" in skipped[0].reason

    def test_every_field_of_a_replica_is_read_from_meta(self) -> None:
        """The first replica's endpoint carries every field of the scheduler's Meta."""
        snapshot, _ = snapshot_from_health({SERVICE: realistic_entries()}, index=1)
        service_id = realistic_entries()[0].service_id

        expected = Endpoint(
            id=service_id,
            service=SERVICE,
            address="10.0.0.11",
            port=23456,
            served_models=(MODEL,),
            engine="vllm",
            metrics_path="/metrics",
            metric_names=VLLM_METRIC_NAMES,
            capacity=64,
            node="gpu-client-1",
            gpu_class="h100",
            status=CheckStatus.PASSING,
            spec_hash="535ac0f75981075f",
            replica=0,
        )
        assert expected == snapshot.by_id[service_id]
        assert expected.base_url == "http://10.0.0.11:23456"


class TestAggregateStatus:
    @pytest.mark.parametrize(
        ("statuses", "expected"),
        [
            ([], CheckStatus.PASSING),
            (["passing", "passing"], CheckStatus.PASSING),
            (["passing", "warning"], CheckStatus.WARNING),
            (["warning", "critical", "passing"], CheckStatus.CRITICAL),
            (["passing", "maintenance"], CheckStatus.CRITICAL),
            (["passing", ""], CheckStatus.CRITICAL),
        ],
    )
    def test_worst_check_wins(self, statuses: list[str], expected: CheckStatus) -> None:
        """The entry's status is the worst of its checks; an unknown status counts as critical."""
        checks = [HealthCheck(f"c{i}", status) for i, status in enumerate(statuses)]

        assert expected == aggregate_status(checks)

    def test_node_serf_health_critical_makes_service_critical(self) -> None:
        """A dead node (serfHealth critical) takes its passing service out."""
        snapshot = snapshot_of(health_entry("a", node_status="critical"))

        assert snapshot.by_id["a"].status == CheckStatus.CRITICAL

    @pytest.mark.parametrize("check_id", ["_service_maintenance:a", "_node_maintenance"])
    def test_maintenance_check_makes_service_critical(self, check_id: str) -> None:
        """Service or node maintenance mode is critical even if the check claims otherwise."""
        maintenance = {"CheckID": check_id, "Status": "passing", "Name": "maintenance"}
        snapshot = snapshot_of(health_entry("a", extra_checks=[maintenance]))

        assert snapshot.by_id["a"].status == CheckStatus.CRITICAL


class TestMetaRules:
    def test_meta_naming_no_metrics_reads_as_no_metrics(self) -> None:
        """A Meta with every metric name blank is read as written: no engine's names fill it."""
        meta = service_meta(metric_running="", metric_waiting="", metric_kv_cache="")

        snapshot = snapshot_of(health_entry("a", meta=meta))

        assert MetricNames(None, None, None) == snapshot.by_id["a"].metric_names

    def test_meta_naming_its_running_metric_is_complete(self) -> None:
        """llama.cpp's Meta names running and waiting; its blank KV name stays None."""
        meta = service_meta(
            engine="llamacpp",
            gpu_class="",
            metric_running="llamacpp:requests_processing",
            metric_waiting="llamacpp:requests_deferred",
            metric_kv_cache="",
        )

        endpoint = snapshot_of(health_entry("a", meta=meta)).by_id["a"]

        assert endpoint.metric_names == LLAMACPP_METRIC_NAMES
        assert endpoint.gpu_class is None

    def test_served_models_are_split_trimmed_and_deduplicated(self) -> None:
        """A comma-separated list becomes a tuple, and the endpoint serves each name."""
        meta = service_meta(served_models=" qwen , qwen-chat,qwen,")

        snapshot = snapshot_of(health_entry("a", meta=meta))

        assert snapshot.by_id["a"].served_models == ("qwen", "qwen-chat")
        assert sorted(snapshot.models) == ["qwen", "qwen-chat"]

    def test_blank_capacity_is_unknown_and_blank_metrics_path_defaults(self) -> None:
        """Empty strings mean absent: no capacity, and the default `/metrics` path."""
        meta = service_meta(capacity="", metrics_path="", spec_hash="")

        endpoint = snapshot_of(health_entry("a", meta=meta)).by_id["a"]

        assert (
            endpoint.capacity,
            endpoint.metrics_path,
            endpoint.spec_hash,
        ) == (None, "/metrics", None)

    def test_ipv6_address_is_bracketed_in_base_url(self) -> None:
        """An IPv6 service address makes a valid URL."""
        endpoint = snapshot_of(health_entry("a", address="fd00::5", port=8080)).by_id["a"]

        assert endpoint.base_url == "http://[fd00::5]:8080"


class TestMalformedEntries:
    @pytest.mark.parametrize(
        ("entry", "reason_mentions"),
        [
            (health_entry("a", meta={}), "Meta is missing"),
            (health_entry("a", meta=service_meta(served_models=" , ")), "served_models"),
            (health_entry("a", meta=service_meta(capacity="lots")), "capacity"),
            (health_entry("a", meta=service_meta(capacity="0")), "capacity"),
            (health_entry("a", meta=service_meta(replica="-1")), "replica"),
            (health_entry("a", meta=service_meta(engine="")), "engine"),
            (health_entry("a", meta=service_meta(metrics_path="metrics")), "metrics_path"),
            (health_entry("a", port=0), "Port"),
            (health_entry("a", address="", node_address=""), "Address"),
            (replace(health_entry("a"), service_id=""), "Service.ID"),
            (replace(health_entry("a"), service_name=""), "Service.Service"),
        ],
    )
    def test_malformed_entry_is_skipped_with_reason(
        self, entry: HealthEntry, reason_mentions: str
    ) -> None:
        """A bad entry is left out with a reason naming the field, and its neighbours stay."""
        snapshot, skipped = snapshot_from_health({SERVICE: [entry, endpoint_entry("good")]}, 7)

        assert list(snapshot.by_id) == ["good"]
        assert len(skipped) == 1
        assert reason_mentions in skipped[0].reason

    def test_meta_value_of_wrong_type_is_skipped(self) -> None:
        """A non-string Meta value (not what Consul sends, but possible from a fake) is skipped."""
        entry = health_entry("a", meta={**service_meta(), "capacity": 64})  # type: ignore[dict-item]

        snapshot, skipped = snapshot_from_health({SERVICE: [entry]}, 1)

        assert EMPTY_SNAPSHOT.models == snapshot.models
        assert "capacity" in skipped[0].reason

    def test_duplicate_service_id_keeps_first_and_reports_second(self) -> None:
        """Two entries with one service ID (two nodes) keep one endpoint, and say so."""
        first = health_entry("dup", node="n1", address="10.0.0.1")
        second = health_entry("dup", node="n2", address="10.0.0.2")

        snapshot, skipped = snapshot_from_health({SERVICE: [first, second]}, 1)

        assert snapshot.by_id["dup"].address == "10.0.0.1"
        assert [(entry.service_id, entry.reason) for entry in skipped] == [
            ("dup", "service ID already seen on another node")
        ]


class TestPrecomputation:
    def test_model_endpoints_are_sorted_by_id_whatever_the_entry_order(self) -> None:
        """Endpoints of a model come out sorted by id, so every router sees one order."""
        entries = [endpoint_entry(name) for name in ("c", "a", "b")]

        snapshot = snapshot_of(*entries)

        model = snapshot.for_model(MODEL)
        assert model is not None
        assert [endpoint.id for endpoint in model.endpoints] == ["a", "b", "c"]
        assert model.ring.endpoint_ids == ("a", "b", "c")

    def test_ring_is_reused_when_endpoint_ids_are_unchanged(self) -> None:
        """A health flip rebuilds no ring; a new endpoint does."""
        first = snapshot_of(endpoint_entry("a"), endpoint_entry("b"))
        flipped = snapshot_of(
            endpoint_entry("a", status="critical"), endpoint_entry("b"), previous=first
        )
        grown = snapshot_of(
            endpoint_entry("a"), endpoint_entry("b"), endpoint_entry("c"), previous=flipped
        )

        first_ring = first.models[MODEL].ring
        assert first_ring is flipped.models[MODEL].ring
        assert first_ring is not grown.models[MODEL].ring

    def test_unknown_model_has_no_entry(self) -> None:
        """A model nothing serves reads as None."""
        assert snapshot_of(endpoint_entry("a")).for_model("other") is None
