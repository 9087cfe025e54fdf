"""The llama.cpp adapter: `llama-server` on raw_exec (a binary on the node) or docker.

Flags follow llama-server (`-m`, `--host`, `--port`, `--metrics`,
`--parallel`, `--ctx-size`, `--alias`, `-t`, `-ngl`); `/health` is 503 while
loading and 200 when ready; metrics use the `llamacpp:` names, and there is no
KV-cache usage metric in current releases.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from caravan.contract import HTTP_PORT_LABEL, StreamTraits
from caravan.engine_metrics import MetricNames
from scheduler.engines.base import METRICS_PATH, ResolvedMetrics
from scheduler.engines.kinds import Driver, Engine

if TYPE_CHECKING:
    from scheduler.cluster_config import ClusterConfig
    from scheduler.profiles import ModelProfile

LLAMACPP_METRIC_NAMES = MetricNames(
    running="llamacpp:requests_processing",
    waiting="llamacpp:requests_deferred",
    # llama.cpp removed its KV-cache gauges (PR #13660); a mapping must not rely on them.
    kv_cache_usage=None,
)
LLAMACPP_METRICS = ResolvedMetrics(path=METRICS_PATH, names=LLAMACPP_METRIC_NAMES)
MANAGED_FLAGS = frozenset(
    {
        "-m",
        "--model",
        "--host",
        "--port",
        "--metrics",
        "-np",
        "--parallel",
        "-c",
        "--ctx-size",
        "-a",
        "--alias",
    }
)
DENIED_FLAGS = (
    "--host",
    "--port",
    "--api-key",
    "--api-key-file",
    "--path",
    "--slot-save-path",
    "--log-file",
    # Offloads the model and its computation to other hosts.
    "--rpc",
    # Lets the engine's clients change its global settings.
    "--props",
    # Built-in agent tools (read files, run commands) and where they run.
    "--tools",
    "--tools-runtime",
    "--media-path",
    # Router mode: loads (and spawns servers for) any model of a directory.
    "--models-dir",
    "--models-preset",
)
# llama-server reads every command-line flag from LLAMA_ARG_* as well.
DENIED_ENV = ("LLAMA_ARG_*", "LLAMA_API_KEY")
# llama-server has no default completion length, and a server without
# `continue_final_message` support repeats a continued message (prefill).
STREAM_TRAITS = StreamTraits(completion_default_max_tokens=None, echoes_prefill=True)
# Slots per replica when the profile does not say (llama-server's own default
# is auto; a fixed number keeps capacity known to the router).
DEFAULT_PARALLEL = 4
# Context per sequence when the profile does not say.
DEFAULT_CONTEXT_PER_SLOT = 4096
# Offload every layer when the replica has a GPU.
ALL_LAYERS = "999"
_THREAD_FLAGS = frozenset({"-t", "--threads"})
_GPU_LAYER_FLAGS = frozenset({"-ngl", "--n-gpu-layers", "--gpu-layers"})


def _has_flag(args: tuple[str, ...], flags: frozenset[str]) -> bool:
    return any(arg.split("=", 1)[0] in flags for arg in args)


class LlamaCppAdapter:
    @property
    def engine(self) -> Engine:
        return Engine.LLAMACPP

    @property
    def health_path(self) -> str:
        return "/health"

    @property
    def api_key_env(self) -> str:
        # llama-server's `--api-key` is also read from LLAMA_API_KEY (common/arg.cpp).
        return "LLAMA_API_KEY"

    @property
    def managed_flags(self) -> frozenset[str]:
        return MANAGED_FLAGS

    @property
    def denied_flags(self) -> tuple[str, ...]:
        return DENIED_FLAGS

    @property
    def denied_env(self) -> tuple[str, ...]:
        return DENIED_ENV

    @property
    def abbreviates_flags(self) -> bool:
        return False

    @property
    def stream_traits(self) -> StreamTraits:
        return STREAM_TRAITS

    def normalise_flag(self, flag: str) -> str:
        return flag

    def check_profile(self, profile: ModelProfile) -> None:
        if profile.tensor_parallel > 1:
            raise ValueError(
                "tensor_parallel: llama.cpp replicas do not support tensor parallelism "
                f"(got {profile.tensor_parallel}); use vLLM or 1"
            )
        if profile.nodes > 1:
            raise ValueError(
                f"nodes: llama.cpp replicas run on one node (got {profile.nodes}); use vLLM or 1"
            )

    def default_metrics(self) -> ResolvedMetrics:
        return LLAMACPP_METRICS

    def capacity(self, profile: ModelProfile) -> int:
        return profile.max_concurrency or DEFAULT_PARALLEL

    def startup_timeout_s(self, profile: ModelProfile) -> int:
        return profile.startup_timeout_s or 300

    def default_memory_mb(self, profile: ModelProfile) -> int:
        del profile
        return 2048

    def default_cpu_mhz(self, profile: ModelProfile) -> int:
        del profile
        return 1000

    def driver(self, profile: ModelProfile, config: ClusterConfig) -> Driver:
        return profile.driver or config.llamacpp.driver

    def container_port(self, profile: ModelProfile, config: ClusterConfig) -> int | None:
        if self.driver(profile, config) is Driver.DOCKER:
            return config.llamacpp.container_port
        # raw_exec shares the host network: setting `To` would tell the process
        # a port that was never reserved (facts N18).
        return None

    def threads(self, profile: ModelProfile) -> int:
        # One thread per reserved core; with a MHz reservation, one thread,
        # since several replicas then share the node's cores.
        return profile.resources.cores or 1

    def args(self, profile: ModelProfile, config: ClusterConfig) -> list[str]:
        if self.driver(profile, config) is Driver.DOCKER:
            host, port = "0.0.0.0", str(config.llamacpp.container_port)  # noqa: S104 - inside the container
        else:
            host, port = f"${{NOMAD_IP_{HTTP_PORT_LABEL}}}", f"${{NOMAD_PORT_{HTTP_PORT_LABEL}}}"
        args = [
            "-m",
            profile.model,
            "--host",
            host,
            "--port",
            port,
            "--metrics",
            "--parallel",
            str(self.capacity(profile)),
            # llama-server splits --ctx-size across its slots, while a
            # profile's context_length is per request (as vLLM's
            # --max-model-len): give every slot the whole window.
            "--ctx-size",
            str((profile.context_length or DEFAULT_CONTEXT_PER_SLOT) * self.capacity(profile)),
            "--alias",
            profile.served_name,
        ]
        if not _has_flag(profile.engine_args, _THREAD_FLAGS):
            args += ["-t", str(self.threads(profile))]
        if profile.uses_gpu and not _has_flag(profile.engine_args, _GPU_LAYER_FLAGS):
            args += ["-ngl", ALL_LAYERS]
        args += list(profile.engine_args)
        return args

    def task_config(self, profile: ModelProfile, config: ClusterConfig) -> dict[str, Any]:
        args = self.args(profile, config)
        if self.driver(profile, config) is Driver.RAW_EXEC:
            return {"command": config.llamacpp.binary, "args": args}
        image = profile.image or (
            config.llamacpp.cuda_image if profile.uses_gpu else config.llamacpp.image
        )
        task_config: dict[str, Any] = {"image": image, "args": args, "ports": [HTTP_PORT_LABEL]}
        if profile.model.startswith("/") and profile.weights is None:
            # The model file lives on the node; mount its folder read-only at
            # the same path so `-m` needs no rewriting.
            folder = profile.model.rsplit("/", 1)[0] or "/"
            task_config["volumes"] = [f"{folder}:{folder}:ro"]
        return task_config
