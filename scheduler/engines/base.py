"""The engine adapter interface: what rendering needs to know about an engine.

One module per engine implements it (`vllm.py`, `llamacpp.py`). Adapters are
pure: they turn a validated profile and the cluster config into the pieces of
a Nomad task (driver, config, port mapping) and the facts the router and
autoscaler need (capacity, health path, metric names).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from caravan.engine_metrics import (
    LLAMACPP_METRIC_NAMES,
    VLLM_METRIC_NAMES,
    MetricNames,
    resolve_metric_names,
)

if TYPE_CHECKING:
    from scheduler.cluster_config import ClusterConfig
    from scheduler.profiles import Driver, Engine, ModelProfile
    from scheduler.profiles import MetricNames as ProfileMetricNames


@dataclass(frozen=True, slots=True)
class ResolvedMetrics:
    """Where a replica's metrics are and which names say running, waiting, KV use."""

    path: str
    names: MetricNames

    @property
    def running(self) -> str | None:
        return self.names.running

    @property
    def waiting(self) -> str | None:
        return self.names.waiting

    @property
    def kv_cache_usage(self) -> str | None:
        return self.names.kv_cache_usage


METRICS_PATH = "/metrics"
VLLM_METRICS = ResolvedMetrics(path=METRICS_PATH, names=VLLM_METRIC_NAMES)
LLAMACPP_METRICS = ResolvedMetrics(path=METRICS_PATH, names=LLAMACPP_METRIC_NAMES)


def resolve_metrics(
    engine_default: ResolvedMetrics, override: ProfileMetricNames | None
) -> ResolvedMetrics:
    """Apply a profile's metric override to its engine's default mapping.

    No override means the engine's own names; an override follows the seed's
    rule (`caravan.engine_metrics.resolve_metric_names`).
    """
    if override is None:
        return engine_default
    names = resolve_metric_names(
        running=override.running, waiting=override.waiting, kv_cache_usage=override.kv_cache_usage
    )
    return ResolvedMetrics(path=override.path, names=names)


class EngineAdapter(Protocol):
    """What rendering asks of an engine."""

    @property
    def engine(self) -> Engine: ...

    @property
    def health_path(self) -> str:
        """HTTP path that answers 200 once the model is loaded."""
        ...

    @property
    def api_key_env(self) -> str:
        """The environment variable the engine reads its API key from."""
        ...

    def default_metrics(self) -> ResolvedMetrics: ...

    def capacity(self, profile: ModelProfile) -> int:
        """Concurrent sequences one replica serves before requests queue."""
        ...

    def startup_timeout_s(self, profile: ModelProfile) -> int:
        """How long model load may take before the replica counts as failed."""
        ...

    def default_memory_mb(self, profile: ModelProfile) -> int: ...

    def default_cpu_mhz(self, profile: ModelProfile) -> int: ...

    def driver(self, profile: ModelProfile, config: ClusterConfig) -> Driver: ...

    def container_port(self, profile: ModelProfile, config: ClusterConfig) -> int | None:
        """The port inside the container (docker `To`); `None` for host-mode raw_exec."""
        ...

    def task_config(self, profile: ModelProfile, config: ClusterConfig) -> dict[str, Any]:
        """The task's driver `Config` block (image or command, args)."""
        ...
