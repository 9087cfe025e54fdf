"""Settings of the Nomad stand-in: its simulated nodes and its command-line flags.

`add_nomad_arguments` adds the flags to the `python -m caravan_llm.devcluster` parser and
`settings_from_args` turns them into `NomadServerSettings`; tests build
`NomadServerSettings`/`NodeSpec` directly.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic.alias_generators import to_pascal

from caravan_llm.devcluster.nomad.gotext import NS_PER_S, parse_go_duration
from caravan_llm.devcluster.nomad.node_pools import NODE_POOL_ALL, name_problem
from caravan_llm.devcluster.vllm_real import DEFAULT_NICE

DEFAULT_GPU_MODEL = "NVIDIA H100 80GB HBM3"
# MiB NVML reports for common models (what `${device.attr.memory}` compares against).
GPU_MEMORY_MIB = {
    "NVIDIA H100 80GB HBM3": 81559,
    "NVIDIA H200": 143771,
    "NVIDIA A100-SXM4-80GB": 81920,
    "NVIDIA A100-SXM4-40GB": 40960,
    "NVIDIA A100 80GB PCIe": 81920,
    "NVIDIA L40S": 46068,
    "NVIDIA L4": 23034,
    "Tesla T4": 15360,
}
DEFAULT_GPU_MEMORY_MIB = 81559
# Nomad's server defaults (nomad/config.go): heartbeat_grace, min_heartbeat_ttl,
# max_heartbeats_per_second. A dead node is down after TTL (10-20 s) + grace.
DEFAULT_HEARTBEAT_GRACE_S = 10.0
DEFAULT_MIN_HEARTBEAT_TTL_S = 10.0
DEFAULT_MAX_HEARTBEATS_PER_SECOND = 50.0
NOMAD_EVENT_HEARTBEAT_S = 30.0


def gpu_memory_for(model: str) -> int:
    return GPU_MEMORY_MIB.get(model, DEFAULT_GPU_MEMORY_MIB)


class HostVolumeSpec(BaseModel):
    """A static host volume the client declares (`client { host_volume "name" { ... } }`).

    `path` is a folder on this machine: tasks that mount the volume see it at
    their `volume_mount` destination (see `devcluster/nomad/volumes.py`).
    """

    model_config = ConfigDict(
        frozen=True, extra="forbid", alias_generator=to_pascal, populate_by_name=True
    )

    path: str = Field(min_length=1)
    read_only: bool = False

    @field_validator("path")
    @classmethod
    def _path_is_absolute(cls, path: str) -> str:
        if not Path(path).is_absolute():
            raise ValueError(f"host volume path {path!r} must be absolute")
        return path


class NodeSpec(BaseModel):
    """One simulated client node (`POST /v1/devcluster/node` takes this, PascalCase too)."""

    model_config = ConfigDict(
        frozen=True, extra="forbid", alias_generator=to_pascal, populate_by_name=True
    )

    name: str | None = None
    node_class: str = ""
    datacenter: str = "dc1"
    node_pool: str = "default"
    meta: dict[str, str] = Field(default_factory=dict)
    cpu_cores: int = Field(default=4, ge=1, le=1024)
    cpu_mhz_per_core: int = Field(default=2400, ge=1)
    memory_mb: int = Field(default=16384, ge=1)
    disk_mb: int = Field(default=100_000, ge=1)
    gpus: int = Field(default=0, ge=0, le=64)
    gpu_model: str = DEFAULT_GPU_MODEL
    gpu_memory_mib: int | None = Field(default=None, ge=1)
    drivers: tuple[str, ...] = ("raw_exec", "exec", "docker")
    # Static host volumes by name (Nomad's client `host_volume` blocks).
    host_volumes: dict[str, HostVolumeSpec] = Field(default_factory=dict)

    @field_validator("node_pool")
    @classmethod
    def _pool_a_node_may_join(cls, pool: str) -> str:
        # Node.Validate: a valid pool name, and never the built-in `all`.
        problem = name_problem(pool)
        if problem is not None:
            raise ValueError(problem)
        if pool == NODE_POOL_ALL:
            raise ValueError(f'node is not allowed to register in node pool "{NODE_POOL_ALL}"')
        return pool

    @property
    def gpu_memory(self) -> int:
        return (
            self.gpu_memory_mib
            if self.gpu_memory_mib is not None
            else gpu_memory_for(self.gpu_model)
        )


class NomadServerSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(default=0, ge=0, le=65535)
    # Nomad's RPC (4647) and Serf (4648) ports: devcluster holds them (a listener that
    # closes every connection) so the addresses it reports are real and its own.
    rpc_port: int = Field(default=0, ge=0, le=65535)
    serf_port: int = Field(default=0, ge=0, le=65535)
    token: str | None = None
    heartbeat_grace_s: float = Field(default=DEFAULT_HEARTBEAT_GRACE_S, gt=0)
    min_heartbeat_ttl_s: float = Field(default=DEFAULT_MIN_HEARTBEAT_TTL_S, gt=0)
    max_heartbeats_per_second: float = Field(default=DEFAULT_MAX_HEARTBEATS_PER_SECOND, gt=0)
    event_heartbeat_s: float = Field(default=NOMAD_EVENT_HEARTBEAT_S, gt=0)
    nodes: tuple[NodeSpec, ...] = ()
    image_map: Path | None = None
    data_dir: Path | None = None
    seed: int | None = None
    # Which engine vLLM images run: devcluster's simulator or the real vLLM
    # (CPU build, `make vllm`; devcluster/vllm_real.py says what it maps).
    vllm_engine: Literal["simulated", "real"] = "simulated"
    # KV blocks (128 tokens each) of a real vLLM replica whose job sets none.
    vllm_kv_blocks: int = Field(default=64, ge=16)
    # Niceness a real vLLM replica runs at (devcluster/vllm_real.py says why).
    vllm_nice: int = Field(default=DEFAULT_NICE, ge=0, le=19)
    # Files every node has at the same absolute path, kept under this folder
    # (drivers.node_files); None: tasks see only the host's own files.
    node_root: Path | None = None
    # The simulated llama.cpp engine exits 1 with llama-server's own error lines
    # when its -m file does not exist, as on a real node (drivers.DriverSettings).
    check_model_files: bool = False


def default_nodes(
    *,
    cpu_nodes: int = 3,
    gpu_nodes: int = 0,
    gpus_per_node: int = 8,
    gpu_model: str = DEFAULT_GPU_MODEL,
    gpu_memory_mib: int | None = None,
    cores: int = 4,
    cpu_mhz: int = 9600,
    memory_mb: int = 16384,
    gpu_node_memory_mb: int = 262144,
    gpu_node_pool: str = "default",
    host_volumes: dict[str, HostVolumeSpec] | None = None,
) -> tuple[NodeSpec, ...]:
    """`cpu_nodes` plain nodes, then `gpu_nodes` GPU nodes (in `gpu_node_pool`), every
    one declaring `host_volumes`."""
    per_core = max(cpu_mhz // cores, 1)
    plain = [
        NodeSpec(
            cpu_cores=cores,
            cpu_mhz_per_core=per_core,
            memory_mb=memory_mb,
            host_volumes=dict(host_volumes or {}),
        )
        for _ in range(cpu_nodes)
    ]
    gpu = [
        NodeSpec(
            node_class="gpu",
            node_pool=gpu_node_pool,
            cpu_cores=cores,
            cpu_mhz_per_core=per_core,
            memory_mb=gpu_node_memory_mb,
            gpus=gpus_per_node,
            gpu_model=gpu_model,
            gpu_memory_mib=gpu_memory_mib,
            host_volumes=dict(host_volumes or {}),
        )
        for _ in range(gpu_nodes)
    ]
    return (*plain, *gpu)


def _seconds(text: str) -> float:
    """A Go duration (`10s`, `500ms`) or plain seconds, > 0."""
    try:
        seconds = float(text)
    except ValueError:
        try:
            seconds = parse_go_duration(text) / NS_PER_S
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{exc} (use a duration like 10s or 500ms)") from None
    if seconds <= 0:
        raise argparse.ArgumentTypeError(f"duration must be positive, got {text}")
    return seconds


def _host_volume(text: str) -> tuple[str, HostVolumeSpec]:
    """`NAME=PATH[:ro]` for `--host-volume`."""
    name, sep, rest = text.partition("=")
    if not sep or not name or not rest:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH[:ro], got {text!r}")
    path, read_only = (rest[:-3], True) if rest.endswith(":ro") else (rest, False)
    if not Path(path).is_absolute():
        raise argparse.ArgumentTypeError(f"host volume {name}: path {path!r} must be absolute")
    return name, HostVolumeSpec(path=path, read_only=read_only)


def add_nomad_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("nomad", "the Nomad stand-in and its simulated nodes")
    group.add_argument("--nodes", type=int, default=3, help="CPU-only client nodes (default 3)")
    group.add_argument("--gpu-nodes", type=int, default=0, help="client nodes with NVIDIA GPUs")
    group.add_argument("--gpus-per-node", type=int, default=8, help="GPUs on each GPU node")
    group.add_argument("--gpu-model", default=DEFAULT_GPU_MODEL, help="NVML model name of the GPUs")
    group.add_argument(
        "--gpu-memory-mib", type=int, default=None, help="memory of each GPU (default: by model)"
    )
    group.add_argument("--node-cores", type=int, default=4, help="CPU cores of each node")
    group.add_argument(
        "--node-cpu-mhz", type=int, default=9600, help="total CPU MHz of each node (all cores)"
    )
    group.add_argument("--node-memory-mb", type=int, default=16384, help="memory of a CPU node")
    group.add_argument(
        "--gpu-node-memory-mb", type=int, default=262144, help="memory of a GPU node"
    )
    group.add_argument(
        "--gpu-node-pool",
        default="default",
        help="Nomad node pool of the GPU nodes (CPU nodes are in `default`)",
    )
    group.add_argument("--nomad-port", type=int, default=4646, help="HTTP port (0 = any free)")
    group.add_argument(
        "--nomad-rpc-port",
        type=int,
        default=None,
        help="RPC port it reports and holds (default: HTTP port + 1, any free with port 0)",
    )
    group.add_argument(
        "--nomad-serf-port",
        type=int,
        default=None,
        help="Serf port it reports and holds (default: HTTP port + 2, any free with port 0)",
    )
    group.add_argument(
        "--heartbeat-grace",
        type=_seconds,
        default=DEFAULT_HEARTBEAT_GRACE_S,
        help="Nomad's heartbeat_grace: added to the TTL before a silent node is down (10s)",
    )
    group.add_argument(
        "--min-heartbeat-ttl",
        type=_seconds,
        default=DEFAULT_MIN_HEARTBEAT_TTL_S,
        help="Nomad's min_heartbeat_ttl: the smallest TTL handed to clients (10s)",
    )
    group.add_argument(
        "--max-heartbeats-per-second",
        type=float,
        default=DEFAULT_MAX_HEARTBEATS_PER_SECOND,
        help="Nomad's max_heartbeats_per_second: scales the TTL with the node count (50)",
    )
    group.add_argument("--nomad-token", default=None, help="require this X-Nomad-Token")
    group.add_argument(
        "--image-map", type=Path, default=None, help="YAML/JSON docker image -> command table"
    )
    group.add_argument(
        "--nomad-data-dir", type=Path, default=None, help="alloc dirs (default: temp)"
    )
    group.add_argument(
        "--vllm",
        choices=("simulated", "real"),
        default="simulated",
        help="what vLLM images run: the simulated engine, or the real vLLM (`make vllm`)",
    )
    group.add_argument(
        "--host-volume",
        action="append",
        default=[],
        type=_host_volume,
        metavar="NAME=PATH[:ro]",
        help="a host volume every node declares (repeatable; one folder shared by all)",
    )


def settings_from_args(args: argparse.Namespace, *, host: str = "127.0.0.1") -> NomadServerSettings:
    if args.nodes < 0 or args.gpu_nodes < 0:
        raise ValueError("--nodes and --gpu-nodes must be >= 0")

    def companion(given: int | None, offset: int) -> int:
        if given is not None:
            return given
        return args.nomad_port + offset if args.nomad_port else 0

    return NomadServerSettings(
        host=host,
        port=args.nomad_port,
        rpc_port=companion(args.nomad_rpc_port, 1),
        serf_port=companion(args.nomad_serf_port, 2),
        token=args.nomad_token,
        heartbeat_grace_s=args.heartbeat_grace,
        min_heartbeat_ttl_s=args.min_heartbeat_ttl,
        max_heartbeats_per_second=args.max_heartbeats_per_second,
        image_map=args.image_map,
        data_dir=args.nomad_data_dir,
        vllm_engine=args.vllm,
        nodes=default_nodes(
            cpu_nodes=args.nodes,
            gpu_nodes=args.gpu_nodes,
            gpus_per_node=args.gpus_per_node,
            gpu_model=args.gpu_model,
            gpu_memory_mib=args.gpu_memory_mib,
            cores=args.node_cores,
            cpu_mhz=args.node_cpu_mhz,
            memory_mb=args.node_memory_mb,
            gpu_node_memory_mb=args.gpu_node_memory_mb,
            gpu_node_pool=args.gpu_node_pool,
            host_volumes=dict(args.host_volume),
        ),
    )
