"""The vLLM adapter: the official `vllm/vllm-openai` image on the docker driver.

Flags follow vLLM's documented OpenAI server (`--model`, `--served-model-name`,
`--tensor-parallel-size`, `--port`, `--max-num-seqs`, `--max-model-len`);
`/health` answers 200 once the model is loaded; metrics use the `vllm:` names.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from caravan_llm.common.contract import HTTP_PORT_LABEL, OPENAI_STREAM_TRAITS, EngineRoute
from caravan_llm.common.engine_metrics import MetricNames
from caravan_llm.scheduler.engines.base import (
    HF_HUB_WEIGHTS,
    METRICS_PATH,
    AdapterFacts,
    AdapterLoading,
    EngineFacts,
    GpuContainerSizing,
    KvEventsFacts,
    ResolvedMetrics,
    RuntimeAdapterApi,
    check_gpu_engine,
)
from caravan_llm.scheduler.engines.kv_events import (
    KvEventsSettings,
    kv_events_args,
)

if TYPE_CHECKING:
    from caravan_llm.scheduler.engines.base import EngineProfile

# Pinned so a cluster never silently changes engine versions under a profile.
DEFAULT_VLLM_IMAGE = "vllm/vllm-openai:v0.11.0"


class VllmSettings(BaseModel):
    """The cluster config's `vllm:` section."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    image: str = DEFAULT_VLLM_IMAGE
    # Port the OpenAI server listens on inside the container.
    container_port: int = Field(default=8000, ge=1, le=65535)


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
        # Rendered when the cluster's KV events are on; a profile's own could
        # publish token ids outside the allocation (`tcp://*`).
        "--kv-events-config",
        # LoRA: from the profile's `adapters` and `lora` (LORA_FLAGS).
        "--max-loras",
        "--max-lora-rank",
        "--max-cpu-loras",
        "--lora-modules",
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
    # Where the KV-cache events (token ids) go: caravan's, inside the allocation.
    "--kv-events-config",
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
# vLLM's OpenAI server (vllm/entrypoints/openai/api_server.py and the routers it
# includes): the generative routes for a generate model; embeddings, score and
# rerank only for a pooling model (`register_pooling_api_routers` mounts them by
# the model's tasks; a generate model answers them 404 `{"detail":"Not Found"}`;
# /pooling and /classify likewise). /v1/messages/count_tokens answers for a
# generate model (vllm/entrypoints/anthropic/api_router.py).
VLLM_ROUTES = frozenset(EngineRoute)
# vLLM's own default for --max-num-seqs.
DEFAULT_MAX_NUM_SEQS = 256


# vllm/config/kv_events.py: `enable_kv_cache_events` turns them on, the ZMQ
# publisher binds an `ipc://` endpoint. The block size stays vLLM's own (16 on
# GPU by default, 128 on the CPU build, `--block-size` in engine_args): the
# relay learns it from the events.
VLLM_KV_EVENTS = KvEventsFacts(flag="--kv-events-config", enable_field=True)
# LoRA at run time (vllm/entrypoints/serve/lora/api_router.py): the load and
# unload routes are mounted only with VLLM_ALLOW_RUNTIME_LORA_UPDATING (else
# 404 {"detail": "Not Found"}); under /v1, so behind the API key like the rest.
# A bad path answers 404 NotFoundError ("Loading lora <name> failed: No adapter
# found for <path>"), a second load of a name 400 InvalidUserInput, an unload
# of a name not loaded 404. A loaded adapter is listed in /v1/models with
# `parent` set to the base model and answers requests whose `model` is its name.
VLLM_ADAPTERS = AdapterFacts(
    loading=AdapterLoading.RUNTIME,
    api=RuntimeAdapterApi(
        list_path="/v1/models",
        load_path="/v1/load_lora_adapter",
        unload_path="/v1/unload_lora_adapter",
    ),
    runtime_env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"},
    # `MaxLoRARanks` in vllm/config/lora.py: --max-lora-rank takes only these.
    ranks=frozenset({1, 8, 16, 32, 64, 128, 256, 320, 512}),
)


VLLM_FACTS = EngineFacts(
    name="vllm",
    shown="vLLM",
    health_path="/health",
    # `--api-key` falls back to VLLM_API_KEY (vllm/entrypoints/openai/api_server.py).
    api_key_env="VLLM_API_KEY",
    managed_flags=MANAGED_FLAGS,
    denied_flags=DENIED_FLAGS,
    denied_env=DENIED_ENV,
    # vLLM parses with argparse, which accepts an unambiguous prefix of a long flag.
    abbreviates_flags=True,
    # Completions keep the OpenAI default of 16 tokens; a continued chat
    # message is not repeated (`continue_final_message`).
    stream_traits=OPENAI_STREAM_TRAITS,
    metrics=VLLM_METRICS,
    default_prefill_tokens_per_s=20000,
    # vLLM loads `model` through its Hugging Face cache (HF_HOME).
    weights=HF_HUB_WEIGHTS,
    routes=VLLM_ROUTES,
    kv_events=VLLM_KV_EVENTS,
    adapters=VLLM_ADAPTERS,
)


@dataclass(frozen=True, slots=True)
class VllmAdapter(GpuContainerSizing):
    settings: VllmSettings = field(default_factory=VllmSettings)
    # The cluster config's `kv_events` when replicas publish KV events to
    # their group's KV relay; None: off.
    kv_events: KvEventsSettings | None = None

    @property
    def facts(self) -> EngineFacts:
        return VLLM_FACTS

    @property
    def images(self) -> frozenset[str]:
        return frozenset({self.settings.image})

    def normalise_flag(self, flag: str) -> str:
        # vLLM's parser reads `--a_b` as `--a-b` and `--x.y=v` as a field of `--x`.
        flag = flag.split(".", 1)[0]
        head, dashes = flag.lstrip("-"), len(flag) - len(flag.lstrip("-"))
        return "-" * dashes + head.replace("_", "-")

    def check_profile(self, profile: EngineProfile) -> None:
        check_gpu_engine(profile, VLLM_FACTS)

    def capacity(self, profile: EngineProfile) -> int:
        return profile.max_concurrency or DEFAULT_MAX_NUM_SEQS

    @property
    def publishes_kv_events(self) -> bool:
        return self.kv_events is not None

    def container_port(self, profile: EngineProfile) -> int | None:
        del profile
        return self.settings.container_port

    def args(self, profile: EngineProfile) -> list[str]:
        args = [
            "--model",
            profile.model,
            "--served-model-name",
            profile.served_name,
            "--tensor-parallel-size",
            str(profile.tensor_parallel),
            "--port",
            str(self.settings.container_port),
            "--max-num-seqs",
            str(self.capacity(profile)),
        ]
        if profile.context_length is not None:
            args += ["--max-model-len", str(profile.context_length)]
        if self.kv_events is not None:
            args += kv_events_args(VLLM_KV_EVENTS)
        args += self.lora_args(profile)
        args += list(profile.engine_args)
        return args

    def lora_args(self, profile: EngineProfile) -> list[str]:
        """LoRA on, with the profile's limits; the adapters themselves are loaded at run
        time by the scheduler, so a change of `adapters` changes no job."""
        limits = profile.lora_limits
        if limits is None:
            return []
        args = [
            "--enable-lora",
            "--max-loras",
            str(limits.max_loras),
            "--max-lora-rank",
            str(limits.max_lora_rank),
        ]
        if limits.max_cpu_loras is not None:
            args += ["--max-cpu-loras", str(limits.max_cpu_loras)]
        return args

    def task_config(self, profile: EngineProfile) -> dict[str, Any]:
        return {
            "image": profile.image or self.settings.image,
            "args": self.args(profile),
            "ports": [HTTP_PORT_LABEL],
            "shm_size": self.shm_size_bytes(profile),
        }

    @property
    def prefetch_image(self) -> str:
        # The vLLM image has `hf` (huggingface_hub), the default download.
        return self.settings.image
