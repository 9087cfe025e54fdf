"""The scheduler's Prometheus metrics, defined once against an injected registry."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


@dataclass(frozen=True, slots=True)
class SchedulerMetrics:
    reconcile_passes: Counter
    reconcile_duration: Histogram
    actions: Counter
    errors: Counter
    replicas_desired: Gauge
    replicas_live: Gauge
    replicas_ready: Gauge
    replicas_unplaced: Gauge
    leader: Gauge
    backend_up: Gauge
    autoscale_decisions: Counter
    autoscale_desired: Gauge
    autoscale_current: Gauge
    signal_age: Gauge
    cold_start: Histogram
    api_auth_failures: Counter
    autoscale_overridden: Gauge
    model_failed: Gauge
    prefetch_failed: Gauge

    @classmethod
    def create(cls, registry: CollectorRegistry) -> SchedulerMetrics:
        return cls(
            reconcile_passes=Counter(
                "caravan_scheduler_reconcile_passes_total",
                "Reconcile passes, by outcome (ok, error, skipped).",
                ["outcome"],
                registry=registry,
            ),
            reconcile_duration=Histogram(
                "caravan_scheduler_reconcile_duration_seconds",
                "Time one reconcile pass took (observe, plan, apply).",
                registry=registry,
            ),
            actions=Counter(
                "caravan_scheduler_actions_total",
                "Actions applied to Nomad and Consul, by kind and outcome.",
                ["kind", "outcome"],
                registry=registry,
            ),
            errors=Counter(
                "caravan_scheduler_errors_total",
                "Errors, by kind: invalid_profile, render, or the error class name.",
                ["kind"],
                registry=registry,
            ),
            replicas_desired=Gauge(
                "caravan_scheduler_replicas_desired",
                "Desired replica count per model.",
                ["model"],
                registry=registry,
            ),
            replicas_live=Gauge(
                "caravan_scheduler_replicas_live",
                "Replica jobs per model that are not draining.",
                ["model"],
                registry=registry,
            ),
            replicas_ready=Gauge(
                "caravan_scheduler_replicas_ready",
                "Replicas per model running on a live node and passing their check.",
                ["model"],
                registry=registry,
            ),
            replicas_unplaced=Gauge(
                "caravan_scheduler_replicas_unplaced",
                "Replicas per model that Nomad could not place.",
                ["model"],
                registry=registry,
            ),
            leader=Gauge(
                "caravan_scheduler_leader",
                "1 while this scheduler holds the leader lock, else 0.",
                registry=registry,
            ),
            backend_up=Gauge(
                "caravan_scheduler_backend_up",
                "1 when the last call to the backend (nomad, consul) succeeded.",
                ["backend"],
                registry=registry,
            ),
            autoscale_decisions=Counter(
                "caravan_scheduler_autoscale_decisions_total",
                "Autoscaler decisions per model, by direction (up, down, none).",
                ["model", "direction"],
                registry=registry,
            ),
            autoscale_desired=Gauge(
                "caravan_scheduler_autoscale_desired_replicas",
                "Replica count the autoscaler last asked for, per model.",
                ["model"],
                registry=registry,
            ),
            autoscale_current=Gauge(
                "caravan_scheduler_autoscale_current_replicas",
                "Ready replicas the autoscaler last saw, per model.",
                ["model"],
                registry=registry,
            ),
            signal_age=Gauge(
                "caravan_scheduler_autoscale_signal_age_seconds",
                "Age of the oldest engine metric the autoscaler used, per model (NaN: none).",
                ["model"],
                registry=registry,
            ),
            cold_start=Histogram(
                "caravan_scheduler_cold_start_seconds",
                "Time from a router's demand signal to the model's first ready replica.",
                ["model"],
                buckets=(1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1200),
                registry=registry,
            ),
            api_auth_failures=Counter(
                "caravan_scheduler_api_auth_failures_total",
                "API requests refused for their credentials, by reason "
                "(missing, malformed: 401; invalid: 403).",
                ["reason"],
                registry=registry,
            ),
            autoscale_overridden=Gauge(
                "caravan_scheduler_autoscale_overridden",
                "1 while a manual `caravan scale` override holds the model's count, else 0.",
                ["model"],
                registry=registry,
            ),
            model_failed=Gauge(
                "caravan_scheduler_model_failed",
                "1 while every replica of the model has failed for good (KV failed/<name>).",
                ["model"],
                registry=registry,
            ),
            prefetch_failed=Gauge(
                "caravan_scheduler_prefetch_failed",
                "1 when the model's weights prefetch failed for its current version, else 0.",
                ["model"],
                registry=registry,
            ),
        )
