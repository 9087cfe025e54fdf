"""The llama.cpp adapter: `llama-server` on raw_exec (a binary on the node) or docker.

Flags follow llama-server (`-m`, `--host`, `--port`, `--metrics`,
`--parallel`, `--ctx-size`, `--alias`, `-t`, `-ngl`, `--cache-ram`);
`/health` is 503 while loading and 200 when ready; metrics use the
`llamacpp:` names, and there is no KV-cache usage metric in current releases.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from caravan_llm.common.contract import HTTP_PORT_LABEL, EngineRoute, StreamTraits
from caravan_llm.common.engine_metrics import MetricNames
from caravan_llm.scheduler.engines.base import (
    METRICS_PATH,
    AdapterFacts,
    Driver,
    EngineFacts,
    ResolvedMetrics,
    WeightsFacts,
)

if TYPE_CHECKING:
    from caravan_llm.scheduler.engines.base import EngineProfile

# llama.cpp publishes `server-b<build>` (CPU) and `server-cuda-b<build>` (CUDA)
# for every release; `server` and `server-cuda` float. Both pins name one
# build, so a model behaves the same on CPU and GPU nodes.
LLAMACPP_BUILD = "b11429"
DEFAULT_LLAMACPP_IMAGE = f"ghcr.io/ggml-org/llama.cpp:server-{LLAMACPP_BUILD}"
DEFAULT_LLAMACPP_CUDA_IMAGE = f"ghcr.io/ggml-org/llama.cpp:server-cuda-{LLAMACPP_BUILD}"


class LlamaCppSettings(BaseModel):
    """The cluster config's `llamacpp:` section."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    driver: Driver = Driver.RAW_EXEC
    # Path of `llama-server` on the client nodes, for the raw_exec driver.
    binary: str = "/usr/local/bin/llama-server"
    image: str = DEFAULT_LLAMACPP_IMAGE
    cuda_image: str = DEFAULT_LLAMACPP_CUDA_IMAGE
    container_port: int = Field(default=8080, ge=1, le=65535)


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
# And it closes the connection after every streamed answer, though its headers
# offer keep-alive (`Keep-Alive: timeout=5, max=100`, no `Connection: close`): a
# client that pools it fails its next request there ("Can not write request
# body"). Seen with the llama-server built from llama-cpp-python 0.3.36's sdist.
STREAM_TRAITS = StreamTraits(
    completion_default_max_tokens=None, echoes_prefill=True, keeps_stream_connections=False
)
# Slots per replica when the profile does not say (llama-server's own default
# is auto; a fixed number keeps capacity known to the router).
DEFAULT_PARALLEL = 4
# Context per sequence when the profile does not say.
DEFAULT_CONTEXT_PER_SLOT = 4096
# Offload every layer when the replica has a GPU.
ALL_LAYERS = "999"
_THREAD_FLAGS = frozenset({"-t", "--threads"})
# llama-server keeps the state of every prompt a slot lets go in a host-memory
# cache (`--cache-ram`, 8192 MiB by default) and scans it on every request:
# on the real server built here, 16,000 short distinct chats took its
# throughput from 165 to 108 requests/s and its RSS from 58 to 399 MiB, where
# `--cache-ram 0` held 163-208 requests/s at 36 MiB (docs/benchmarks.md,
# "Soak"). Prefixes are the router's to place; each slot still reuses its
# own. A profile's engine_args can set it back.
_CACHE_RAM_FLAGS = frozenset({"-cram", "--cache-ram"})
CACHE_RAM_MIB = "0"
_GPU_LAYER_FLAGS = frozenset({"-ngl", "--n-gpu-layers", "--gpu-layers"})


def _has_flag(args: tuple[str, ...], flags: frozenset[str]) -> bool:
    return any(arg.split("=", 1)[0] in flags for arg in args)


# llama-server's routes (tools/server/server.cpp, seen on the built server):
# no /v1/score, /pooling or /classify (404 there). Embeddings answer 501
# without `--embeddings`, rerank 501 without `--reranking` (both
# OpenAI-shaped, passed on as they are); /v1/messages/count_tokens answers.
LLAMACPP_ROUTES = frozenset(EngineRoute) - {
    EngineRoute.SCORE,
    EngineRoute.POOLING,
    EngineRoute.CLASSIFY,
}


# llama-server takes `--lora FNAME` (GGUF adapters) at start only and applies
# them to every request (or, with `--lora-init-without-apply`, by a `lora`
# field of the request body): it never selects an adapter by the request's
# `model`, which is how caravan serves adapters, so profiles are refused.
LLAMACPP_ADAPTERS = AdapterFacts(
    loading=None,
    refusal=(
        "llama.cpp takes `--lora` adapters at start only and applies them to every "
        "request, never by the request's `model` (how caravan serves an adapter); "
        "serve a merged GGUF as a profile of its own, or use engine vllm or sglang"
    ),
)


LLAMACPP_FACTS = EngineFacts(
    name="llamacpp",
    shown="llama.cpp",
    health_path="/health",
    # llama-server's `--api-key` is also read from LLAMA_API_KEY (common/arg.cpp).
    api_key_env="LLAMA_API_KEY",
    managed_flags=MANAGED_FLAGS,
    denied_flags=DENIED_FLAGS,
    denied_env=DENIED_ENV,
    abbreviates_flags=False,
    stream_traits=STREAM_TRAITS,
    metrics=LLAMACPP_METRICS,
    default_prefill_tokens_per_s=2000,
    # `-m` names a GGUF file: on a cache volume, a file under its path; no
    # default download (a prefetch gives its own command).
    weights=WeightsFacts(hub_cache_env=None, offline_env={}, default_download=None),
    routes=LLAMACPP_ROUTES,
    adapters=LLAMACPP_ADAPTERS,
)


@dataclass(frozen=True, slots=True)
class LlamaCppAdapter:
    settings: LlamaCppSettings = field(default_factory=LlamaCppSettings)

    @property
    def facts(self) -> EngineFacts:
        return LLAMACPP_FACTS

    @property
    def images(self) -> frozenset[str]:
        return frozenset({self.settings.image, self.settings.cuda_image})

    def normalise_flag(self, flag: str) -> str:
        return flag

    def check_profile(self, profile: EngineProfile) -> None:
        if profile.tensor_parallel > 1:
            raise ValueError(
                "tensor_parallel: llama.cpp replicas do not support tensor parallelism "
                f"(got {profile.tensor_parallel}); use vLLM or 1"
            )
        if profile.nodes > 1:
            raise ValueError(
                f"nodes: llama.cpp replicas run on one node (got {profile.nodes}); use vLLM or 1"
            )

    def capacity(self, profile: EngineProfile) -> int:
        return profile.max_concurrency or DEFAULT_PARALLEL

    def startup_timeout_s(self, profile: EngineProfile) -> int:
        return profile.startup_timeout_s or 300

    def default_memory_mb(self, profile: EngineProfile) -> int:
        del profile
        return 2048

    def default_cpu_mhz(self, profile: EngineProfile) -> int:
        del profile
        return 1000

    def driver(self, profile: EngineProfile) -> Driver:
        return profile.driver or self.settings.driver

    @property
    def publishes_kv_events(self) -> bool:
        # llama-server publishes no KV-cache events: routers keep the approximate index.
        return False

    def container_port(self, profile: EngineProfile) -> int | None:
        if self.driver(profile) is Driver.DOCKER:
            return self.settings.container_port
        # raw_exec shares the host network: setting `To` would tell the process
        # a port that was never reserved (facts N18).
        return None

    def threads(self, profile: EngineProfile) -> int:
        # One thread per reserved core; with a MHz reservation, one thread,
        # since several replicas then share the node's cores.
        return profile.resources.cores or 1

    def args(self, profile: EngineProfile) -> list[str]:
        if self.driver(profile) is Driver.DOCKER:
            host, port = "0.0.0.0", str(self.settings.container_port)  # noqa: S104 - inside the container
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
        if not _has_flag(profile.engine_args, _CACHE_RAM_FLAGS):
            args += ["--cache-ram", CACHE_RAM_MIB]
        args += list(profile.engine_args)
        return args

    def task_config(self, profile: EngineProfile) -> dict[str, Any]:
        args = self.args(profile)
        if self.driver(profile) is Driver.RAW_EXEC:
            return {"command": self.settings.binary, "args": args}
        image = profile.image or (
            self.settings.cuda_image if profile.uses_gpu else self.settings.image
        )
        task_config: dict[str, Any] = {"image": image, "args": args, "ports": [HTTP_PORT_LABEL]}
        if profile.model.startswith("/") and profile.weights is None:
            # The model file lives on the node; mount its folder read-only at
            # the same path so `-m` needs no rewriting.
            folder = profile.model.rsplit("/", 1)[0] or "/"
            task_config["volumes"] = [f"{folder}:{folder}:ro"]
        return task_config

    @property
    def prefetch_image(self) -> str:
        # The server image (an Ubuntu base with curl); a llama.cpp prefetch
        # always gives its own command.
        return self.settings.image
