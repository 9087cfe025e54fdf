"""The vLLM adapter: the official `vllm/vllm-openai` image on the docker driver.

Flags follow vLLM's documented OpenAI server (`--model`, `--served-model-name`,
`--tensor-parallel-size`, `--port`, `--max-num-seqs`, `--max-model-len`);
`/health` answers 200 once the model is loaded; metrics use the `vllm:` names.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from caravan.contract import HTTP_PORT_LABEL, OPENAI_STREAM_TRAITS, StreamTraits
from caravan.engine_metrics import MetricNames
from scheduler.engines.base import (
    METRICS_PATH,
    GpuContainerSizing,
    ResolvedMetrics,
    check_gpu_engine,
)
from scheduler.engines.kinds import Engine

if TYPE_CHECKING:
    from scheduler.cluster_config import ClusterConfig
    from scheduler.profiles import ModelProfile

VLLM_METRIC_NAMES = MetricNames(
    running="vllm:num_requests_running",
    waiting="vllm:num_requests_waiting",
    # Not `vllm:gpu_cache_usage_perc`: deprecated by vLLM PR #18354 and no longer emitted.
    kv_cache_usage="vllm:kv_cache_usage_perc",
)
VLLM_METRICS = ResolvedMetrics(path=METRICS_PATH, names=VLLM_METRIC_NAMES)
MANAGED_FLAGS = frozenset(
    {
        "--model",
        "--served-model-name",
        "--tensor-parallel-size",
        "-tp",
        "--port",
        "--host",
        "--max-num-seqs",
        "--max-model-len",
    }
)
DENIED_FLAGS = (
    "--host",
    "--port",
    "--uds",
    "--api-key",
    "--trust-remote-code",
    "--worker-cls",
    "--worker-extension-cls",
    "--allowed-local-media-path",
    "--middleware",
    "--tool-parser-plugin",
    "--logits-processors",
    "--kv-transfer-config",
    # A YAML file of further arguments, which would bypass this check.
    "--config",
)
# Plugins, logging config (dictConfig instantiates classes), listener, dev
# endpoints, LoRA loading by API clients, the API key.
DENIED_ENV = (
    "VLLM_PLUGINS",
    "VLLM_LOGGING_CONFIG_PATH",
    "VLLM_HOST_IP",
    "VLLM_PORT",
    "VLLM_SERVER_DEV_MODE",
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING",
    "VLLM_API_KEY",
)
# vLLM's own default for --max-num-seqs.
DEFAULT_MAX_NUM_SEQS = 256


class VllmAdapter(GpuContainerSizing):
    @property
    def engine(self) -> Engine:
        return Engine.VLLM

    @property
    def health_path(self) -> str:
        return "/health"

    @property
    def api_key_env(self) -> str:
        # `--api-key` falls back to VLLM_API_KEY (vllm/entrypoints/openai/api_server.py).
        return "VLLM_API_KEY"

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
        # vLLM parses with argparse, which accepts an unambiguous prefix of a long flag.
        return True

    @property
    def stream_traits(self) -> StreamTraits:
        # Completions keep the OpenAI default of 16 tokens; a continued chat
        # message is not repeated (`continue_final_message`).
        return OPENAI_STREAM_TRAITS

    def normalise_flag(self, flag: str) -> str:
        # vLLM's parser reads `--a_b` as `--a-b` and `--x.y=v` as a field of `--x`.
        flag = flag.split(".", 1)[0]
        head, dashes = flag.lstrip("-"), len(flag) - len(flag.lstrip("-"))
        return "-" * dashes + head.replace("_", "-")

    def check_profile(self, profile: ModelProfile) -> None:
        check_gpu_engine(profile, "vllm", "vLLM")

    def default_metrics(self) -> ResolvedMetrics:
        return VLLM_METRICS

    def capacity(self, profile: ModelProfile) -> int:
        return profile.max_concurrency or DEFAULT_MAX_NUM_SEQS

    def container_port(self, profile: ModelProfile, config: ClusterConfig) -> int | None:
        del profile
        return config.vllm.container_port

    def args(self, profile: ModelProfile, config: ClusterConfig) -> list[str]:
        args = [
            "--model",
            profile.model,
            "--served-model-name",
            profile.served_name,
            "--tensor-parallel-size",
            str(profile.tensor_parallel),
            "--port",
            str(config.vllm.container_port),
            "--max-num-seqs",
            str(self.capacity(profile)),
        ]
        if profile.context_length is not None:
            args += ["--max-model-len", str(profile.context_length)]
        args += list(profile.engine_args)
        return args

    def task_config(self, profile: ModelProfile, config: ClusterConfig) -> dict[str, Any]:
        return {
            "image": profile.image or config.vllm.image,
            "args": self.args(profile, config),
            "ports": [HTTP_PORT_LABEL],
            "shm_size": self.shm_size_bytes(profile),
        }
