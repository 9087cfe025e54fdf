"""The engine adapter interface: what rendering needs to know about an engine.

One module per engine implements it (`vllm.py`, `llamacpp.py`, `sglang.py`) and owns
everything caravan knows about that engine: the profile rules it adds, the
flags caravan renders itself, the flags and variables the profile policy
refuses, rendering (driver, config, port mapping), and the facts the router
and autoscaler need (capacity, health path, metric names, stream traits).
`registry.py` maps each `Engine` to its adapter; nothing outside these
modules branches on an engine's name. Adapters are pure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from caravan.engine_metrics import MetricNames, resolve_metric_names
from scheduler.engines.kinds import Driver

if TYPE_CHECKING:
    from caravan.contract import StreamTraits
    from scheduler.cluster_config import ClusterConfig
    from scheduler.engines.kinds import Engine
    from scheduler.profiles import MetricNames as ProfileMetricNames
    from scheduler.profiles import ModelProfile


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


def resolve_metrics(
    engine_default: ResolvedMetrics, override: ProfileMetricNames | None
) -> ResolvedMetrics:
    """Apply a profile's metric override to its engine's default mapping.

    No override means the engine's own names; an override follows the rule of
    `caravan.engine_metrics.resolve_metric_names`, with this engine's names for blanks.
    """
    if override is None:
        return engine_default
    names = resolve_metric_names(
        engine_default.names,
        running=override.running,
        waiting=override.waiting,
        kv_cache_usage=override.kv_cache_usage,
    )
    return ResolvedMetrics(path=override.path, names=names)


GIB = 1024**3
# Tensor-parallel workers exchange tensors through /dev/shm (PyTorch, NCCL);
# Docker's 64 MB default makes them fail. vLLM's docker docs allow either
# `--ipc=host` or `--shm-size`; caravan sets the docker driver's `shm_size`
# (bytes): a private /dev/shm sized by the number of ranks, which needs no
# docker plugin setting (`ipc_mode = "host"` can be refused by the plugin's
# `allowed_modes`) and does not share the node's IPC namespace with the
# container.
SHM_BYTES_PER_RANK = 4 * GIB
SHM_BYTES_MIN = 2 * GIB


class GpuContainerSizing:
    """What the GPU server engines (vLLM, SGLang) share: a docker container sized per
    tensor-parallel rank, and the load time of tens of GB of weights."""

    def startup_timeout_s(self, profile: ModelProfile) -> int:
        # Downloading and loading tens of GB of weights and capturing CUDA
        # graphs routinely takes several minutes.
        return profile.startup_timeout_s or 900

    def default_memory_mb(self, profile: ModelProfile) -> int:
        return 16384 * profile.tensor_parallel

    def default_cpu_mhz(self, profile: ModelProfile) -> int:
        return 2000 * profile.tensor_parallel

    def driver(self, profile: ModelProfile, config: ClusterConfig) -> Driver:
        del profile, config
        return Driver.DOCKER

    def shm_size_bytes(self, profile: ModelProfile) -> int:
        return max(SHM_BYTES_MIN, SHM_BYTES_PER_RANK * profile.tensor_parallel)


def check_gpu_engine(profile: ModelProfile, engine: str, shown: str) -> None:
    """The rules of a GPU-only, tensor-parallel engine in a docker image."""
    if profile.gpu is None:
        # A typo in `gpu` must never become a replica placed on a machine with no GPU.
        raise ValueError(
            f"gpu: engine '{engine}' needs a gpu block (for example gpu: {{class: h100, "
            "count: 1}); only llama.cpp can run on the CPU"
        )
    if profile.gpu.count != profile.tensor_parallel and not profile.gpu.allow_count_mismatch:
        raise ValueError(
            f"gpu.count ({profile.gpu.count}) must equal tensor_parallel "
            f"({profile.tensor_parallel}) for {shown} (one GPU per tensor-parallel rank per "
            "node); set gpu.allow_count_mismatch: true if the difference is deliberate"
        )
    if profile.driver is Driver.RAW_EXEC:
        raise ValueError(f"driver: {shown} replicas run with the docker driver only")


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

    @property
    def managed_flags(self) -> frozenset[str]:
        """Flags caravan renders from profile fields; `engine_args` may not set them."""
        ...

    @property
    def denied_flags(self) -> tuple[str, ...]:
        """Flags the default profile policy refuses (code loading, listener, file access)."""
        ...

    @property
    def denied_env(self) -> tuple[str, ...]:
        """Variables (or `PREFIX*`) of this engine the default profile policy refuses."""
        ...

    @property
    def abbreviates_flags(self) -> bool:
        """Whether the engine's parser takes an unambiguous prefix of a long flag."""
        ...

    @property
    def stream_traits(self) -> StreamTraits:
        """How the router continues a stream on this engine (published in service Meta)."""
        ...

    def normalise_flag(self, flag: str) -> str:
        """A flag as the engine's parser reads it (`--a_b` may mean `--a-b`)."""
        ...

    def check_profile(self, profile: ModelProfile) -> None:
        """The engine's own profile rules; raises ValueError naming the field."""
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
