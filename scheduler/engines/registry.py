"""Which adapter serves which engine."""

from __future__ import annotations

from scheduler.engines.base import EngineAdapter
from scheduler.engines.llamacpp import LlamaCppAdapter
from scheduler.engines.vllm import VllmAdapter
from scheduler.profiles import Engine

_ADAPTERS: dict[Engine, EngineAdapter] = {
    Engine.VLLM: VllmAdapter(),
    Engine.LLAMACPP: LlamaCppAdapter(),
}


def adapter_for(engine: Engine) -> EngineAdapter:
    return _ADAPTERS[engine]
