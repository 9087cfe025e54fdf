"""The SGLang adapter: `python -m sglang.launch_server` in the `lmsysorg/sglang` image.

GPU only, tensor parallel on one node, docker driver. Flags follow SGLang's
`ServerArgs` (python/sglang/srt/server_args.py): `--model-path`, `--tp`
(argparse's prefix of `--tp-size`), `--host`, `--port`, `--served-model-name`,
`--max-running-requests`, `--context-length`, `--enable-metrics`, `--api-key`.
SGLang's HTTP server starts listening only after the model is loaded, and its
`/health` then answers 200. Metrics (`--enable-metrics`,
python/sglang/srt/metrics/collector.py) are the gauges `sglang:num_running_reqs`,
`sglang:num_queue_reqs` and `sglang:token_usage` (KV-cache tokens in use, 0..1).

API key: SGLang reads it from `--api-key` only (no environment fallback), so
the nomadVar template puts it in `CARAVAN_ENGINE_API_KEY` and the argument is
`--api-key ${CARAVAN_ENGINE_API_KEY}`, which Nomad interpolates from the task
environment when it starts the container. The job spec carries the variable's
name only; the value is visible in the container's command line on the node
(as with any flag), never in the job, Consul or caravan's logs.

Stream traits: completions default to `max_tokens: 16` (`CompletionRequest`
in python/sglang/srt/entrypoints/openai/protocol.py) and a chat request with
`continue_final_message` continues the last assistant message without
repeating it, as the OpenAI defaults (`OPENAI_STREAM_TRAITS`) say.

Weights: SGLang loads a Hugging Face model id through `huggingface_hub`, so a
weights volume is its cache through HF_HOME (and HF_HUB_OFFLINE once a
prefetch filled it), and a prefetch runs `hf download` in the SGLang image.
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
    check_gpu_engine,
)
from caravan_llm.scheduler.engines.kv_events import (
    KvEventsSettings,
    has_flag,
    kv_events_args,
)

if TYPE_CHECKING:
    from caravan_llm.scheduler.engines.base import EngineProfile

DEFAULT_SGLANG_IMAGE = "lmsysorg/sglang:v0.5.6.post1"


class SglangSettings(BaseModel):
    """The cluster config's `sglang:` section."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    image: str = DEFAULT_SGLANG_IMAGE
    # Port `sglang.launch_server` listens on inside the container (its default).
    container_port: int = Field(default=30000, ge=1, le=65535)


SGLANG_METRIC_NAMES = MetricNames(
    running="sglang:num_running_reqs",
    waiting="sglang:num_queue_reqs",
    kv_cache_usage="sglang:token_usage",
)
SGLANG_METRICS = ResolvedMetrics(path=METRICS_PATH, names=SGLANG_METRIC_NAMES)
# The variable the engine-key template fills; the args read it by interpolation.
API_KEY_ENV = "CARAVAN_ENGINE_API_KEY"
ENTRYPOINT = ("python3", "-m", "sglang.launch_server")
# Sequences per replica when the profile does not say. SGLang sizes its own
# limit from GPU memory when the flag is absent; caravan states one so the
# router and autoscaler know the replica's capacity.
DEFAULT_MAX_RUNNING_REQUESTS = 256
MANAGED_FLAGS = frozenset(
    {
        "--model-path",
        "--model",
        "--tp",
        "--tp-size",
        "--tensor-parallel-size",
        "--host",
        "--port",
        "--served-model-name",
        "--max-running-requests",
        "--context-length",
        "--enable-metrics",
        "--api-key",
        # Rendered when the cluster's KV events are on (see vllm.py).
        "--kv-events-config",
        # LoRA: from the profile's `adapters` and `lora` (`lora_args`).
        "--enable-lora",
        "--lora-paths",
        "--max-loras-per-batch",
        "--max-lora-rank",
        "--max-loaded-loras",
    }
)
DENIED_FLAGS = (
    "--host",
    "--port",
    "--api-key",
    "--admin-api-key",
    "--trust-remote-code",
    # Runs Python sent by API clients (a serialised logits processor).
    "--enable-custom-logit-processor",
    "--file-storage-path",
    # A YAML file of further arguments, which would bypass this check.
    "--config",
    # Where the KV-cache events (token ids) go: caravan's, inside the allocation.
    "--kv-events-config",
)
# Listener and logging config (dictConfig instantiates classes).
DENIED_ENV = ("SGLANG_HOST_IP", "SGLANG_PORT", "SGLANG_LOGGING_CONFIG_PATH", API_KEY_ENV)


# SGLang's http_server.py: every OpenAI route but Anthropic's messages (and so
# their token count) and vLLM's /pooling and /classify; embeddings, score and
# rerank answer only for a model served with `--is-embedding`.
SGLANG_ROUTES = frozenset(EngineRoute) - {
    EngineRoute.MESSAGES,
    EngineRoute.MESSAGES_COUNT_TOKENS,
    EngineRoute.POOLING,
    EngineRoute.CLASSIFY,
}


# python/sglang/srt/disaggregation/kv_events.py: `--kv-events-config` takes
# vLLM's fields less `enable_kv_cache_events` (a `zmq` publisher turns them
# on); its PUB socket binds an `ipc://` endpoint as vLLM's does. Events are one
# block per `--page-size` tokens, 1 by default: caravan renders
# `kv_events.sglang_page_size` (16) when the profile sets no page size.
SGLANG_KV_EVENTS = KvEventsFacts(flag="--kv-events-config", enable_field=False)
PAGE_SIZE_FLAG = "--page-size"
# LoRA (docs.sglang.io, "LoRA Serving"): `--enable-lora`, `--lora-paths
# <NAME>=<PATH>` (a path or a Hugging Face id), `--max-loras-per-batch`,
# `--max-lora-rank`, `--max-loaded-loras` (adapters in CPU memory, at least
# max-loras-per-batch). SGLang also has /load_lora_adapter and
# /unload_lora_adapter; caravan names the adapters at start (every replica
# holds every one; a change replaces the replicas) until its run-time contract
# is checked against a real server. A request names an adapter as
# `<base>:<adapter>` in `model` (SGLang's OpenAI-compatible form).
SGLANG_ADAPTERS = AdapterFacts(
    loading=AdapterLoading.START,
    request_model="{served}:{adapter}",
)


SGLANG_FACTS = EngineFacts(
    name="sglang",
    shown="SGLang",
    health_path="/health",
    api_key_env=API_KEY_ENV,
    managed_flags=MANAGED_FLAGS,
    denied_flags=DENIED_FLAGS,
    denied_env=DENIED_ENV,
    # `ServerArgs.add_cli_args` fills a plain argparse parser (prefixes allowed).
    abbreviates_flags=True,
    stream_traits=OPENAI_STREAM_TRAITS,
    metrics=SGLANG_METRICS,
    default_prefill_tokens_per_s=5000,
    # SGLang loads `model` through its Hugging Face cache (HF_HOME), as vLLM does.
    weights=HF_HUB_WEIGHTS,
    routes=SGLANG_ROUTES,
    kv_events=SGLANG_KV_EVENTS,
    adapters=SGLANG_ADAPTERS,
)


@dataclass(frozen=True, slots=True)
class SglangAdapter(GpuContainerSizing):
    settings: SglangSettings = field(default_factory=SglangSettings)
    # Whether replicas get an API key (the cluster config's `engine_api_keys`).
    api_keys: bool = True
    # The cluster config's `kv_events` when replicas publish KV events; None: off.
    kv_events: KvEventsSettings | None = None

    @property
    def facts(self) -> EngineFacts:
        return SGLANG_FACTS

    @property
    def images(self) -> frozenset[str]:
        return frozenset({self.settings.image})

    def normalise_flag(self, flag: str) -> str:
        return flag

    def check_profile(self, profile: EngineProfile) -> None:
        check_gpu_engine(profile, SGLANG_FACTS)
        if profile.nodes > 1:
            raise ValueError(
                f"nodes: SGLang replicas run on one node (got {profile.nodes}); "
                "caravan does not render SGLang's multi-node flags"
            )

    def capacity(self, profile: EngineProfile) -> int:
        return profile.max_concurrency or DEFAULT_MAX_RUNNING_REQUESTS

    @property
    def publishes_kv_events(self) -> bool:
        return self.kv_events is not None

    def container_port(self, profile: EngineProfile) -> int | None:
        del profile
        return self.settings.container_port

    def args(self, profile: EngineProfile) -> list[str]:
        args = [
            "--model-path",
            profile.model,
            "--served-model-name",
            profile.served_name,
            "--tp",
            str(profile.tensor_parallel),
            # SGLang binds 127.0.0.1 by default; the port mapping needs all interfaces.
            "--host",
            "0.0.0.0",  # noqa: S104 - inside the container
            "--port",
            str(self.settings.container_port),
            "--max-running-requests",
            str(self.capacity(profile)),
            "--enable-metrics",
        ]
        if profile.context_length is not None:
            args += ["--context-length", str(profile.context_length)]
        if self.api_keys:
            args += ["--api-key", f"${{{API_KEY_ENV}}}"]
        if self.kv_events is not None:
            args += kv_events_args(SGLANG_KV_EVENTS)
            if not has_flag(profile.engine_args, PAGE_SIZE_FLAG):
                args += [PAGE_SIZE_FLAG, str(self.kv_events.sglang_page_size)]
        args += self.lora_args(profile)
        args += list(profile.engine_args)
        return args

    def lora_args(self, profile: EngineProfile) -> list[str]:
        """LoRA on with the profile's limits, and every adapter named at start."""
        limits = profile.lora_limits
        if limits is None:
            return []
        args = [
            "--enable-lora",
            "--max-loras-per-batch",
            str(limits.max_loras),
            "--max-lora-rank",
            str(limits.max_lora_rank),
        ]
        if limits.max_cpu_loras is not None:
            args += ["--max-loaded-loras", str(limits.max_cpu_loras)]
        if profile.adapters:
            args += ["--lora-paths", *(f"{a.name}={a.source}" for a in profile.adapters)]
        return args

    def task_config(self, profile: EngineProfile) -> dict[str, Any]:
        return {
            "image": profile.image or self.settings.image,
            "entrypoint": list(ENTRYPOINT),
            "args": self.args(profile),
            "ports": [HTTP_PORT_LABEL],
            # Tensor-parallel ranks exchange tensors through /dev/shm (NCCL).
            "shm_size": self.shm_size_bytes(profile),
        }

    @property
    def prefetch_image(self) -> str:
        # The SGLang image has `hf` (huggingface_hub), the default download.
        return self.settings.image
