"""The engine adapter interface: what caravan knows about an engine, and how it renders it.

One module per engine implements it (`vllm.py`, `llamacpp.py`, `sglang.py`) and owns
everything caravan knows about that engine:

- its facts (`EngineFacts`): constants the profile rules, the profile policy,
  rendering, the weights cache and the router (through service Meta) read,
  such as the health path, metric names, stream traits, default prefill rate
  and the OpenAI routes it serves;
- its settings model (the image, port, binary of the cluster config's section
  named after the engine);
- the rules it adds to a profile, its sizing, and rendering (driver, config, port).

`registry.py` maps each `Engine` to its adapter and its settings; nothing outside
these modules branches on an engine's name. Adapters are pure.

Adapters read a profile through `EngineProfile`, which `caravan_llm.scheduler.profiles.ModelProfile`
satisfies: the profile module imports the registry (for `Engine`), so the adapters
must not import the profile module back.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Protocol

from caravan_llm.common.engine_metrics import MetricNames, resolve_metric_names

if TYPE_CHECKING:
    from caravan_llm.common.contract import EngineRoute, StreamTraits


class Driver(StrEnum):
    """The Nomad task driver a replica runs under."""

    DOCKER = "docker"
    RAW_EXEC = "raw_exec"


class GpuShape(Protocol):
    """What an adapter reads of a profile's `gpu` block."""

    @property
    def count(self) -> int: ...

    @property
    def allow_count_mismatch(self) -> bool: ...


class ResourceShape(Protocol):
    """What an adapter reads of a profile's `resources` block."""

    @property
    def cores(self) -> int | None: ...


class LoraAdapterShape(Protocol):
    """What an engine adapter reads of one LoRA adapter a profile declares (`adapters:`)."""

    @property
    def name(self) -> str: ...

    @property
    def source(self) -> str: ...


class LoraLimitsShape(Protocol):
    """What an engine adapter reads of a profile's LoRA limits (`lora:`)."""

    @property
    def max_loras(self) -> int: ...

    @property
    def max_lora_rank(self) -> int: ...

    @property
    def max_cpu_loras(self) -> int | None: ...


class EngineProfile(Protocol):
    """What an adapter reads of a model profile."""

    @property
    def model(self) -> str: ...

    @property
    def served_name(self) -> str: ...

    @property
    def tensor_parallel(self) -> int: ...

    @property
    def nodes(self) -> int: ...

    @property
    def gpu(self) -> GpuShape | None: ...

    @property
    def uses_gpu(self) -> bool: ...

    @property
    def driver(self) -> Driver | None: ...

    @property
    def image(self) -> str | None: ...

    @property
    def engine_args(self) -> tuple[str, ...]: ...

    @property
    def context_length(self) -> int | None: ...

    @property
    def max_concurrency(self) -> int | None: ...

    @property
    def startup_timeout_s(self) -> int | None: ...

    @property
    def resources(self) -> ResourceShape: ...

    @property
    def weights(self) -> object | None:
        """The profile's weights cache (None: the engine fetches or finds the model itself)."""
        ...

    @property
    def adapters(self) -> Sequence[LoraAdapterShape]: ...

    @property
    def lora_limits(self) -> LoraLimitsShape | None:
        """The LoRA limits when LoRA is on (adapters or a `lora:` block), else None."""
        ...


class MetricsOverrideShape(Protocol):
    """A profile's override of its engine's metric names (`metrics:`)."""

    @property
    def path(self) -> str: ...

    @property
    def running(self) -> str | None: ...

    @property
    def waiting(self) -> str | None: ...

    @property
    def kv_cache_usage(self) -> str | None: ...


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
    engine_default: ResolvedMetrics, override: MetricsOverrideShape | None
) -> ResolvedMetrics:
    """Apply a profile's metric override to its engine's default mapping.

    No override means the engine's own names; an override follows the rule of
    `caravan_llm.common.engine_metrics.resolve_metric_names`, with this engine's names for blanks.
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


@dataclass(frozen=True, slots=True)
class WeightsFacts:
    """How an engine finds its weights on a cache volume (a profile's `weights`)."""

    # The variable that points the engine's Hugging Face cache at the volume;
    # None: the engine has no hub cache and `model` is a file on the volume.
    hub_cache_env: str | None
    # Set on replicas whose cache a prefetch filled: never reach out, never
    # write the read-only mount.
    offline_env: Mapping[str, str]
    # The prefetch's argv when the profile gives none, the model id appended;
    # None: the engine has no default download.
    default_download: tuple[str, ...] | None


# The Hugging Face hub cache, as vLLM and SGLang read it (`huggingface_hub`).
HF_HUB_WEIGHTS = WeightsFacts(
    hub_cache_env="HF_HOME",
    offline_env={"HF_HUB_OFFLINE": "1"},
    default_download=("hf", "download"),
)


class AdapterLoading(StrEnum):
    """How an engine takes LoRA adapters."""

    # Loaded and unloaded through its HTTP API while it serves: the scheduler
    # places each adapter on some replicas (scheduler/lora/plan.py) and changing
    # the profile's adapters restarts nothing.
    RUNTIME = "runtime"
    # Named on its command line: every replica holds every adapter, and a change
    # of the adapters is a new spec (the replicas are replaced).
    START = "start"


@dataclass(frozen=True, slots=True)
class RuntimeAdapterApi:
    """The engine's routes for adapters at run time (all behind its API key)."""

    # GET: the OpenAI model list, in which an adapter's entry has `parent` set.
    list_path: str
    # POST {"lora_name", "lora_path"}: 200 once loaded; an error status otherwise.
    load_path: str
    # POST {"lora_name"}: 200 once unloaded; 404 when it is not loaded.
    unload_path: str


@dataclass(frozen=True, slots=True)
class AdapterFacts:
    """What an engine does with LoRA adapters (a profile's `adapters:` and `lora:`)."""

    # None: the engine takes no adapters; `refusal` says why, for the profile's error.
    loading: AdapterLoading | None
    refusal: str = ""
    # The runtime routes (RUNTIME only).
    api: RuntimeAdapterApi | None = None
    # Variables the engine needs to take adapters at run time, rendered by caravan
    # (a profile's `env` may not set them: the profile policy refuses them).
    runtime_env: Mapping[str, str] = field(default_factory=dict)
    # The values its `max_lora_rank` flag accepts; None: any positive rank.
    ranks: frozenset[int] | None = None
    # How a request names an adapter in `model`: `{adapter}` the adapter's name,
    # `{served}` the base model's served name (SGLang: `{served}:{adapter}`).
    request_model: str = "{adapter}"


NO_ADAPTERS = AdapterFacts(loading=None, refusal="this engine takes no LoRA adapters")


@dataclass(frozen=True, slots=True)
class KvEventsFacts:
    """How an engine is told to publish its KV-cache events (engines/kv_events.py)."""

    # The flag that takes the JSON config.
    flag: str
    # Whether the config carries vLLM's `enable_kv_cache_events: true`
    # (SGLang's config has no such field: a publisher alone turns them on).
    enable_field: bool


@dataclass(frozen=True, slots=True)
class EngineFacts:
    """What caravan knows about an engine that no profile or setting changes."""

    # The engine's name in profiles (`engine:`) and in service Meta.
    name: str
    # How messages name it ("vLLM").
    shown: str
    # HTTP path that answers 200 once the model is loaded.
    health_path: str
    # The environment variable caravan puts the engine's API key in.
    api_key_env: str
    # Flags caravan renders from profile fields; `engine_args` may not set them.
    managed_flags: frozenset[str]
    # Flags the default profile policy refuses (code loading, listener, file access).
    denied_flags: tuple[str, ...]
    # Variables (or `PREFIX*`) of this engine the default profile policy refuses.
    denied_env: tuple[str, ...]
    # Whether the engine's parser takes an unambiguous prefix of a long flag.
    abbreviates_flags: bool
    # How the router continues a stream on this engine (published in service Meta).
    stream_traits: StreamTraits
    # The engine's own metrics path and names of running, waiting and KV use.
    metrics: ResolvedMetrics
    # Prompt tokens per second one replica prefills when its profile declares no
    # `prefill_tokens_per_s` (published in service Meta for the router's cost model).
    default_prefill_tokens_per_s: int
    # How it finds weights on a cache volume.
    weights: WeightsFacts
    # The OpenAI routes the engine serves (published in service Meta, so the router
    # sends a route only where it is served). Some need a model of the right kind
    # (an embedding or reranking model) or a flag; the engine then answers a
    # model without it with its own error, which the router passes on as OpenAI's.
    routes: frozenset[EngineRoute]
    # How the engine publishes its KV-cache events (engines/kv_events.py);
    # None: it publishes none, and routers keep the approximate prefix index.
    kv_events: KvEventsFacts | None = None
    # What it does with LoRA adapters (how it loads them, its limits' flags).
    adapters: AdapterFacts = NO_ADAPTERS


class EngineAdapter(Protocol):
    """What the profile rules and rendering ask of an engine under one cluster's settings."""

    @property
    def facts(self) -> EngineFacts: ...

    @property
    def images(self) -> frozenset[str]:
        """The images this engine's settings name; a profile may always use these."""
        ...

    def normalise_flag(self, flag: str) -> str:
        """A flag as the engine's parser reads it (`--a_b` may mean `--a-b`)."""
        ...

    def check_profile(self, profile: EngineProfile) -> None:
        """The engine's own profile rules; raises ValueError naming the field."""
        ...

    def capacity(self, profile: EngineProfile) -> int:
        """Concurrent sequences one replica serves before requests queue."""
        ...

    def startup_timeout_s(self, profile: EngineProfile) -> int:
        """How long model load may take before the replica counts as failed."""
        ...

    def default_memory_mb(self, profile: EngineProfile) -> int: ...

    def default_cpu_mhz(self, profile: EngineProfile) -> int: ...

    def driver(self, profile: EngineProfile) -> Driver: ...

    def container_port(self, profile: EngineProfile) -> int | None:
        """The port inside the container (docker `To`); `None` for host-mode raw_exec."""
        ...

    def task_config(self, profile: EngineProfile) -> dict[str, Any]:
        """The task's driver `Config` block (image or command, args)."""
        ...

    @property
    def publishes_kv_events(self) -> bool:
        """Whether replicas publish KV events to a KV relay in their group (issue 24)."""
        ...

    @property
    def prefetch_image(self) -> str:
        """The docker image a weights prefetch runs in when the profile names none."""
        ...


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

    __slots__ = ()

    def startup_timeout_s(self, profile: EngineProfile) -> int:
        # Downloading and loading tens of GB of weights and capturing CUDA
        # graphs routinely takes several minutes.
        return profile.startup_timeout_s or 900

    def default_memory_mb(self, profile: EngineProfile) -> int:
        return 16384 * profile.tensor_parallel

    def default_cpu_mhz(self, profile: EngineProfile) -> int:
        return 2000 * profile.tensor_parallel

    def driver(self, profile: EngineProfile) -> Driver:
        del profile
        return Driver.DOCKER

    def shm_size_bytes(self, profile: EngineProfile) -> int:
        return max(SHM_BYTES_MIN, SHM_BYTES_PER_RANK * profile.tensor_parallel)


def check_gpu_engine(profile: EngineProfile, facts: EngineFacts) -> None:
    """The rules of a GPU-only, tensor-parallel engine in a docker image."""
    if profile.gpu is None:
        # A typo in `gpu` must never become a replica placed on a machine with no GPU.
        raise ValueError(
            f"gpu: engine '{facts.name}' needs a gpu block (for example gpu: {{class: h100, "
            "count: 1}); only llama.cpp can run on the CPU"
        )
    if profile.gpu.count != profile.tensor_parallel and not profile.gpu.allow_count_mismatch:
        raise ValueError(
            f"gpu.count ({profile.gpu.count}) must equal tensor_parallel "
            f"({profile.tensor_parallel}) for {facts.shown} (one GPU per tensor-parallel rank "
            "per node); set gpu.allow_count_mismatch: true if the difference is deliberate"
        )
    if profile.driver is Driver.RAW_EXEC:
        raise ValueError(f"driver: {facts.shown} replicas run with the docker driver only")
