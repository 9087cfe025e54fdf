"""The engines' API keys, read from Nomad Variables with the router's own Nomad token.

The scheduler keeps one key per model at
`nomad/jobs/caravan-engine-keys/models/<model>/key` (item `api_key`;
docs/security.md "Engine API keys"). This module follows
that prefix with a blocking list (`GET /v1/vars?prefix=`), reads a variable
again only when its `ModifyIndex` moved, and swaps an immutable snapshot
that the proxy and the load scraper read without locks. A key is looked up
by the endpoint's Consul service name (`caravan-<model>`).

Nomad unreachable: the last snapshot stays in use and the loop retries with
jittered backoff. Keys are `SecretStr` and never logged; a failure is
logged with the error's class and Nomad's status only.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Protocol

from pydantic import SecretStr

from caravan_llm.common.contract import (
    ENGINE_KEY_ITEM,
    ENGINE_KEY_PREFIX,
    engine_key_model,
    model_service_name,
)
from caravan_llm.common.errors import HashiError
from caravan_llm.common.nomad_api import QueryResult, Variable, VariableMetadata

# Named as before the router's sub-packages: the logger is a field of every log line.
log = logging.getLogger("router.engine_keys")

BACKOFF_MIN_S = 0.5
BACKOFF_MAX_S = 30.0


class VariableReader(Protocol):
    """The Nomad Variables reads the router makes (caravan_llm.common.nomad_api.NomadClient)."""

    async def list_variables(
        self, prefix: str = "", *, index: int | None = None, wait_s: float | None = None
    ) -> QueryResult[list[VariableMetadata]]: ...

    async def get_variable(self, path: str) -> Variable | None: ...


class EngineKeySource(Protocol):
    """What the proxy and the scraper ask: the key to send to a model's engines."""

    def key_for(self, service: str) -> str | None: ...


@dataclass(frozen=True, slots=True)
class _Entry:
    modify_index: int
    key: SecretStr = field(repr=False)


class EngineKeys:
    """Model service name -> engine key, kept fresh from Nomad Variables."""

    def __init__(self, nomad: VariableReader, *, wait_s: float = 60.0) -> None:
        self._nomad = nomad
        self._wait_s = wait_s
        self._entries: Mapping[str, _Entry] = MappingProxyType({})
        self.loaded = asyncio.Event()

    def key_for(self, service: str) -> str | None:
        entry = self._entries.get(service)
        return None if entry is None else entry.key.get_secret_value()

    @property
    def models(self) -> frozenset[str]:
        """The service names a key is known for (no key values)."""
        return frozenset(self._entries)

    async def refresh(self, index: int | None = None) -> int:
        """One (blocking when `index` is given) read; returns the index to block on next."""
        listed = await self._nomad.list_variables(
            ENGINE_KEY_PREFIX, index=index, wait_s=self._wait_s
        )
        current = self._entries
        entries: dict[str, _Entry] = {}
        for meta in listed.value:
            model = engine_key_model(meta.path)
            if model is None:
                continue
            service = model_service_name(model)
            known = current.get(service)
            if known is not None and known.modify_index == meta.modify_index:
                entries[service] = known
                continue
            variable = await self._nomad.get_variable(meta.path)
            if variable is None:
                continue  # deleted between the list and the read
            key = variable.items.get(ENGINE_KEY_ITEM)
            if key:
                entries[service] = _Entry(variable.meta.modify_index, SecretStr(key))
        if set(entries) != set(current):
            log.info("engine_keys_loaded", extra={"models": len(entries)})
        self._entries = MappingProxyType(entries)
        self.loaded.set()
        return listed.index

    async def run(self) -> None:
        """Follow the keys until cancelled; Nomad errors keep the last keys and back off."""
        index: int | None = None
        backoff = BACKOFF_MIN_S
        while True:
            try:
                next_index = await self.refresh(index)
            except HashiError as exc:
                log.warning(
                    "engine_keys_read_failed",
                    extra={"error": type(exc).__name__, "status": exc.status},
                )
                await asyncio.sleep(backoff * random.uniform(0.5, 1.0))
                backoff = min(backoff * 2, BACKOFF_MAX_S)
                index = None
                continue
            backoff = BACKOFF_MIN_S
            # A backwards index (a Nomad restore) starts over, as Consul's rules say.
            index = next_index if index is None or next_index >= index else None
