"""The vLLM adapter: the official `vllm/vllm-openai` image on the docker driver.

Flags follow vLLM's documented OpenAI server (`--model`, `--served-model-name`,
`--tensor-parallel-size`, `--port`, `--max-num-seqs`, `--max-model-len`);
`/health` answers 200 once the model is loaded; metrics use the `vllm:` names.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from caravan.contract import HTTP_PORT_LABEL
from scheduler.engines.base import VLLM_METRICS, ResolvedMetrics
from scheduler.profiles import Driver, Engine

if TYPE_CHECKING:
    from scheduler.cluster_config import ClusterConfig
    from scheduler.profiles import ModelProfile

# vLLM's own default for --max-num-seqs.
DEFAULT_MAX_NUM_SEQS = 256
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


class VllmAdapter:
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

    def default_metrics(self) -> ResolvedMetrics:
        return VLLM_METRICS

    def capacity(self, profile: ModelProfile) -> int:
        return profile.max_concurrency or DEFAULT_MAX_NUM_SEQS

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

    def container_port(self, profile: ModelProfile, config: ClusterConfig) -> int | None:
        del profile
        return config.vllm.container_port

    def shm_size_bytes(self, profile: ModelProfile) -> int:
        return max(SHM_BYTES_MIN, SHM_BYTES_PER_RANK * profile.tensor_parallel)

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
