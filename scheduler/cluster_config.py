"""Cluster-wide settings that shape every rendered job.

Read from an optional YAML file (`caravan render --config`, the scheduler's
`--cluster-config`): where jobs may run, which images and binaries the engines
use, extra GPU classes. Everything has a default that works on a stock Nomad
cluster with Docker and the NVIDIA device plugin.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Self

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from caravan.contract import JsonCodec
from scheduler.gpu_classes import GpuClass, merge_gpu_classes
from scheduler.profile_policy import ProfilePolicy
from scheduler.profiles import Driver, check_node_pool_name, describe_validation_error

_FROZEN = ConfigDict(frozen=True, extra="forbid")

# Pinned so a cluster never silently changes engine versions under a profile.
DEFAULT_VLLM_IMAGE = "vllm/vllm-openai:v0.11.0"
# llama.cpp publishes `server-b<build>` (CPU) and `server-cuda-b<build>` (CUDA)
# for every release; `server` and `server-cuda` float. Both pins name one
# build, so a model behaves the same on CPU and GPU nodes.
LLAMACPP_BUILD = "b11429"
DEFAULT_LLAMACPP_IMAGE = f"ghcr.io/ggml-org/llama.cpp:server-{LLAMACPP_BUILD}"
DEFAULT_LLAMACPP_CUDA_IMAGE = f"ghcr.io/ggml-org/llama.cpp:server-cuda-{LLAMACPP_BUILD}"
# Nomad's built-in node pools: `default` holds every node whose client config
# names no pool, `all` is every node of the cluster.
NODE_POOL_DEFAULT = "default"
NODE_POOL_ALL = "all"
DEFAULT_SGLANG_IMAGE = "lmsysorg/sglang:v0.5.6.post1"


class VllmSettings(BaseModel):
    model_config = _FROZEN

    image: str = DEFAULT_VLLM_IMAGE
    # Port the OpenAI server listens on inside the container.
    container_port: int = Field(default=8000, ge=1, le=65535)


class LlamaCppSettings(BaseModel):
    model_config = _FROZEN

    driver: Driver = Driver.RAW_EXEC
    # Path of `llama-server` on the client nodes, for the raw_exec driver.
    binary: str = "/usr/local/bin/llama-server"
    image: str = DEFAULT_LLAMACPP_IMAGE
    cuda_image: str = DEFAULT_LLAMACPP_CUDA_IMAGE
    container_port: int = Field(default=8080, ge=1, le=65535)


class NodePools(BaseModel):
    """The Nomad node pool replica jobs run in when their profile names none.

    Nomad cannot tell from a job constraint whether a node has GPUs (the
    device plugin adds no node attributes, and `${device.*}` is only read
    inside a `device` block), so the separation is by pool: put GPU nodes in
    their own pool (`client { node_pool = "gpu" }`) and CPU replicas, which
    run in `cpu`, never land there. GPU replicas find their GPUs through their
    device request, so `gpu` defaults to every pool.
    """

    model_config = _FROZEN

    cpu: str = NODE_POOL_DEFAULT
    gpu: str = NODE_POOL_ALL

    @field_validator("cpu", "gpu")
    @classmethod
    def _is_a_pool_name(cls, name: str) -> str:
        return check_node_pool_name(name)


class SglangSettings(BaseModel):
    model_config = _FROZEN

    image: str = DEFAULT_SGLANG_IMAGE
    # Port `sglang.launch_server` listens on inside the container (its default).
    container_port: int = Field(default=30000, ge=1, le=65535)


# The window of Nomad's restart policy: `restart_attempts` restarts within it.
RESTART_INTERVAL_S = 30 * 60


class ClusterConfig(BaseModel):
    """Settings shared by every replica job of one cluster."""

    model_config = _FROZEN

    datacenters: tuple[str, ...] = ("*",)
    namespace: str = "default"
    region: str | None = None
    # Jobs run at this Nomad priority (1..100).
    priority: int = Field(default=50, ge=1, le=100)
    vllm: VllmSettings = Field(default_factory=VllmSettings)
    llamacpp: LlamaCppSettings = Field(default_factory=LlamaCppSettings)
    gpu_classes: dict[str, GpuClass] = Field(default_factory=dict)
    # Node pools of replicas whose profile sets no `node_pool`.
    node_pools: NodePools = Field(default_factory=NodePools)
    sglang: SglangSettings = Field(default_factory=SglangSettings)
    # First delay before Nomad reschedules a failed replica (Nomad's minimum is 5 s).
    reschedule_delay_s: int = Field(default=30, ge=5)
    # Nomad's restart policy for a crashed engine, in place on its node: this
    # many restarts within 30 minutes, this far apart; one more crash fails the
    # allocation (reschedule) and, once none is left, the model (fail fast).
    restart_attempts: int = Field(default=2, ge=0, le=10)
    restart_delay_s: int = Field(default=15, ge=1, le=3600)
    check_interval_s: int = Field(default=5, ge=1)
    check_timeout_s: int = Field(default=2, ge=1)
    # What profiles may put in env, engine_args and image (scheduler/profile_policy.py).
    profile_policy: ProfilePolicy = Field(default_factory=ProfilePolicy)

    @model_validator(mode="after")
    def _restarts_fit_their_interval(self) -> Self:
        # Nomad refuses a restart policy whose attempts x delay exceed its interval (facts N21).
        if self.restart_attempts * self.restart_delay_s > RESTART_INTERVAL_S:
            raise ValueError(
                f"restart_attempts ({self.restart_attempts}) x restart_delay_s "
                f"({self.restart_delay_s}) must fit in Nomad's restart interval "
                f"({RESTART_INTERVAL_S} s)"
            )
        return self

    @property
    def engine_images(self) -> frozenset[str]:
        """The images this cluster runs engines from; a profile may always name these."""
        return frozenset(
            {self.vllm.image, self.llamacpp.image, self.llamacpp.cuda_image, self.sglang.image}
        )

    # Each replica's engine requires a per-model API key that reaches it through
    # Nomad Variables and a template (docs/security.md "Engine API keys").
    engine_api_keys: bool = True

    @property
    def gpu_catalog(self) -> Mapping[str, GpuClass]:
        """Built-in GPU classes with this cluster's additions and overrides."""
        return merge_gpu_classes(self.gpu_classes)


class ClusterConfigError(ValueError):
    """The cluster config file could not be read or is invalid."""


def load_cluster_config(path: Path | str | None) -> ClusterConfig:
    """Read a cluster config file; `None` gives the defaults."""
    if path is None:
        return ClusterConfig()
    try:
        document: Any = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ClusterConfigError(f"{path}: cannot read cluster config: {exc}") from None
    if not isinstance(document, dict):
        raise ClusterConfigError(f"{path}: a cluster config must be a mapping")
    try:
        return ClusterConfig.model_validate(document)
    except ValidationError as exc:
        lines = "; ".join(describe_validation_error(exc))
        raise ClusterConfigError(f"{path}: {lines}") from None


# The codec of `<prefix>cluster-config` (caravan/contract.py lists every document's codec):
# the leading scheduler writes it, every scheduler and `caravan` command reads it.
CLUSTER_CONFIG_CODEC = JsonCodec(ClusterConfig)
