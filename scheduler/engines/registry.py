"""Which adapter serves which engine: the one place that lists the engines.

A new engine is a module in this package (an `EngineAdapter`), a value of
`Engine` (`kinds.py`) and a line here; the profile rules, the profile policy,
rendering and the service Meta the router reads all go through the adapter.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import TYPE_CHECKING

from scheduler.engines.kinds import Engine
from scheduler.engines.llamacpp import LlamaCppAdapter
from scheduler.engines.sglang import SglangAdapter
from scheduler.engines.vllm import VllmAdapter

if TYPE_CHECKING:
    from collections.abc import Mapping

    from scheduler.engines.base import EngineAdapter

_ADAPTERS: Mapping[Engine, EngineAdapter] = MappingProxyType(
    {
        Engine.VLLM: VllmAdapter(),
        Engine.LLAMACPP: LlamaCppAdapter(),
        Engine.SGLANG: SglangAdapter(),
    }
)


def adapter_for(engine: Engine) -> EngineAdapter:
    return _ADAPTERS[engine]


def all_adapters() -> tuple[EngineAdapter, ...]:
    """Every registered adapter, in `Engine` order."""
    return tuple(_ADAPTERS[engine] for engine in Engine)


def engine_key_env_names() -> frozenset[str]:
    """The variables that carry an engine's API key, over every engine (caravan sets them)."""
    return frozenset(adapter.api_key_env for adapter in all_adapters())
