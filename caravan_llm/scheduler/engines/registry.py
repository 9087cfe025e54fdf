"""Which engines caravan renders, and which adapter and settings serve each: the one list.

A new engine is a module in this package (an `EngineAdapter` with its facts and
its settings model), a value of `Engine`, a section of `EngineSettings` and a
case of `adapter_for`; the profile rules, the profile policy, rendering, the
weights cache and the service Meta the router reads all go through the adapter.
"""

from __future__ import annotations

from enum import StrEnum
from typing import TYPE_CHECKING, Self, assert_never

from pydantic import BaseModel, ConfigDict, Field, model_validator

from caravan_llm.scheduler.engines.kv_events import KvEventsSettings
from caravan_llm.scheduler.engines.llamacpp import LlamaCppAdapter, LlamaCppSettings
from caravan_llm.scheduler.engines.sglang import SglangAdapter, SglangSettings
from caravan_llm.scheduler.engines.vllm import VllmAdapter, VllmSettings

if TYPE_CHECKING:
    from caravan_llm.scheduler.engines.base import EngineAdapter


class Engine(StrEnum):
    """A profile's `engine`; each value has one adapter and one settings section here."""

    VLLM = "vllm"
    LLAMACPP = "llamacpp"
    SGLANG = "sglang"


class EngineSettings(BaseModel):
    """The engine sections of the cluster config: each engine's own settings model.

    `caravan_llm.scheduler.cluster_config.ClusterConfig` extends it, so a cluster config file
    names them at its top level (`vllm: {image: ...}`).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    vllm: VllmSettings = Field(default_factory=VllmSettings)
    llamacpp: LlamaCppSettings = Field(default_factory=LlamaCppSettings)
    sglang: SglangSettings = Field(default_factory=SglangSettings)
    # Each replica's engine requires a per-model API key that reaches it through
    # Nomad Variables and a template (docs/security.md "Engine API keys").
    engine_api_keys: bool = True
    # The KV relay in every vLLM/SGLang replica (engines/kv_events.py): the
    # engine publishes its KV-cache events inside the allocation, the relay
    # serves routers their digests behind the engine key.
    kv_events: KvEventsSettings = Field(default_factory=KvEventsSettings)

    @model_validator(mode="after")
    def _kv_events_need_engine_keys(self) -> Self:
        if self.kv_events.enabled and not self.engine_api_keys:
            raise ValueError(
                "kv_events.enabled: the KV relay needs the engine key (it keys the block "
                "digests and guards the digest stream), so it cannot run with "
                "engine_api_keys: false; set engine_api_keys: true or kv_events.enabled: false"
            )
        return self

    @property
    def kv_events_on(self) -> bool:
        """Whether vLLM and SGLang replicas publish KV events to a relay in their group."""
        enabled = self.kv_events.enabled
        return self.engine_api_keys if enabled is None else enabled

    @property
    def engine_images(self) -> frozenset[str]:
        """The images this cluster runs engines from; a profile may always name these."""
        return frozenset().union(*(adapter.images for adapter in all_adapters(self)))


DEFAULT_SETTINGS = EngineSettings()


def adapter_for(engine: Engine, settings: EngineSettings = DEFAULT_SETTINGS) -> EngineAdapter:
    """The engine's adapter under these settings (the defaults when only its facts matter)."""
    kv_events = settings.kv_events if settings.kv_events_on else None
    match engine:
        case Engine.VLLM:
            return VllmAdapter(settings.vllm, kv_events=kv_events)
        case Engine.LLAMACPP:
            return LlamaCppAdapter(settings.llamacpp)
        case Engine.SGLANG:
            return SglangAdapter(
                settings.sglang, api_keys=settings.engine_api_keys, kv_events=kv_events
            )
        case _:
            assert_never(engine)


def all_adapters(settings: EngineSettings = DEFAULT_SETTINGS) -> tuple[EngineAdapter, ...]:
    """Every registered adapter, in `Engine` order."""
    return tuple(adapter_for(engine, settings) for engine in Engine)


def engine_key_env_names() -> frozenset[str]:
    """The variables that carry an engine's API key, over every engine (caravan sets them)."""
    return frozenset(adapter.facts.api_key_env for adapter in all_adapters())
