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

from caravan_llm.common.contract import JsonCodec
from caravan_llm.scheduler.engines.llamacpp import LlamaCppSettings
from caravan_llm.scheduler.engines.registry import EngineSettings
from caravan_llm.scheduler.gpu_classes import GpuClass, merge_gpu_classes
from caravan_llm.scheduler.profile_policy import ProfilePolicy
from caravan_llm.scheduler.profiles import check_node_pool_name, describe_validation_error

# `LlamaCppSettings` is re-exported: the local stack builds a cluster config with its
# own llama-server.
__all__ = [
    "CLUSTER_CONFIG_CODEC",
    "NODE_POOL_ALL",
    "NODE_POOL_DEFAULT",
    "RESTART_INTERVAL_S",
    "ClusterConfig",
    "ClusterConfigError",
    "LlamaCppSettings",
    "NodePools",
    "load_cluster_config",
    "with_nomad_namespace",
]

_FROZEN = ConfigDict(frozen=True, extra="forbid")

# Nomad's built-in node pools: `default` holds every node whose client config
# names no pool, `all` is every node of the cluster.
NODE_POOL_DEFAULT = "default"
NODE_POOL_ALL = "all"


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


# The window of Nomad's restart policy: `restart_attempts` restarts within it.
RESTART_INTERVAL_S = 30 * 60


class ClusterConfig(EngineSettings):
    """Settings shared by every replica job of one cluster.

    The engine sections (`vllm`, `llamacpp`, `sglang`) and `engine_api_keys` are
    `EngineSettings`' (scheduler/engines/registry.py): each engine's adapter
    declares its own settings model.
    """

    model_config = _FROZEN

    datacenters: tuple[str, ...] = ("*",)
    namespace: str = "default"
    region: str | None = None
    # Jobs run at this Nomad priority (1..100).
    priority: int = Field(default=50, ge=1, le=100)
    gpu_classes: dict[str, GpuClass] = Field(default_factory=dict)
    # Node pools of replicas whose profile sets no `node_pool`.
    node_pools: NodePools = Field(default_factory=NodePools)
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


def with_nomad_namespace(config: ClusterConfig, nomad_namespace: str | None) -> ClusterConfig:
    """The config with the one Nomad namespace the scheduler works in (pure).

    The scheduler registers the replica jobs in the config's `namespace` and
    reads them, their allocations and logs and its Variables, through its Nomad
    client, which sends NOMAD_NAMESPACE with every request (and Nomad places a
    job in the request's namespace over the job's own). So the two must be one:
    a config that names no namespace takes NOMAD_NAMESPACE; one that names
    another than NOMAD_NAMESPACE is refused (ClusterConfigError).
    """
    if not nomad_namespace:
        return config
    if "namespace" not in config.model_fields_set:
        return config.model_copy(update={"namespace": nomad_namespace})
    if config.namespace != nomad_namespace:
        raise ClusterConfigError(
            f"cluster config namespace {config.namespace!r} differs from NOMAD_NAMESPACE "
            f"{nomad_namespace!r}: the scheduler submits and reads the replica jobs in one "
            "namespace; leave one of them unset or set both alike"
        )
    return config


# The codec of `<prefix>cluster-config` (caravan_llm/common/contract.py lists every document's
# codec):
# the leading scheduler writes it, every scheduler and `caravan` command reads it.
CLUSTER_CONFIG_CODEC = JsonCodec(ClusterConfig)
