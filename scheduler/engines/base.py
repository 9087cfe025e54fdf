"""The engine adapter interface: what rendering needs to know about an engine.

One module per engine implements it (`vllm.py`, `llamacpp.py`). Adapters are
pure: they turn a validated profile and the cluster config into the pieces of
a Nomad task (driver, config, port mapping) and the facts the router and
autoscaler need (capacity, health path, metric names).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from scheduler.cluster_config import ClusterConfig
    from scheduler.profiles import Driver, Engine, MetricNames, ModelProfile


@dataclass(frozen=True, slots=True)
class ResolvedMetrics:
    """The metric names a replica's `/metrics` is read with; `None` = not reported."""

    path: str
    running: str | None
    waiting: str | None
    kv_cache_usage: str | None


VLLM_METRICS = ResolvedMetrics(
    path="/metrics",
    running="vllm:num_requests_running",
    waiting="vllm:num_requests_waiting",
    kv_cache_usage="vllm:kv_cache_usage_perc",
)

LLAMACPP_METRICS = ResolvedMetrics(
    path="/metrics",
    running="llamacpp:requests_processing",
    waiting="llamacpp:requests_deferred",
    # llama-server removed its KV-cache usage metric (llama.cpp PR #13660).
    kv_cache_usage=None,
)


def resolve_metrics(
    engine_default: ResolvedMetrics, override: MetricNames | None
) -> ResolvedMetrics:
    """Apply a profile's metric override to its engine's default mapping.

    The seed's rule: no override means the engine's own names; an override
    that names no metric at all means vLLM's names; an override that names
    its own running metric is a complete statement, so what it leaves out
    stays unset; an override without a running metric fills its gaps from
    vLLM's names.
    """
    if override is None:
        return ResolvedMetrics(
            path=engine_default.path,
            running=engine_default.running,
            waiting=engine_default.waiting,
            kv_cache_usage=engine_default.kv_cache_usage,
        )
    if override.running is not None:
        return ResolvedMetrics(
            path=override.path,
            running=override.running,
            waiting=override.waiting,
            kv_cache_usage=override.kv_cache_usage,
        )
    return ResolvedMetrics(
        path=override.path,
        running=VLLM_METRICS.running,
        waiting=override.waiting or VLLM_METRICS.waiting,
        kv_cache_usage=override.kv_cache_usage or VLLM_METRICS.kv_cache_usage,
    )


class EngineAdapter(Protocol):
    """What rendering asks of an engine."""

    @property
    def engine(self) -> Engine: ...

    @property
    def health_path(self) -> str:
        """HTTP path that answers 200 once the model is loaded."""
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
