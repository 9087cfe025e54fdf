"""Per-model engine API keys, kept in Nomad Variables (docs/security.md "Engine API keys").

Each model has one random key at `nomad/jobs/caravan-engine-keys/models/<model>/key`
(item `api_key`), created once with check-and-set so two schedulers never
mint two keys. Before a replica job is registered its key is copied to the job's own
path `nomad/jobs/<job_id>`, the one path a task may read with no ACL policy
(Nomad's implicit workload access), where the job's `template` block reads
it into the engine's environment. Routers read the per-model copies.

Keys never appear in a job, a log line, a metric or an error message.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Mapping
from typing import Protocol

from caravan_llm.common.contract import ENGINE_KEY_ITEM, engine_key_path, replica_key_path
from caravan_llm.common.errors import HashiConflict
from caravan_llm.common.nomad_api import Variable, VariableMetadata

log = logging.getLogger(__name__)

KEY_BYTES = 32
CAS_ATTEMPTS = 3
# How long the autoscaler's scrapes reuse a key they read.
CACHE_S = 30.0


class VariableStore(Protocol):
    """The Nomad Variables calls the scheduler makes (caravan_llm.common.nomad_api.NomadClient)."""

    async def get_variable(self, path: str) -> Variable | None: ...

    async def put_variable(
        self, path: str, items: Mapping[str, str], *, cas: int | None = None
    ) -> VariableMetadata: ...

    async def delete_variable(self, path: str, *, cas: int | None = None) -> None: ...


def new_key() -> str:
    return secrets.token_urlsafe(KEY_BYTES)


class EngineKeys:
    """Creates a model's key once and hands it to each replica job's own variable."""

    def __init__(
        self,
        store: VariableStore,
        *,
        generate: Callable[[], str] = new_key,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.generate = generate
        self.clock = clock
        # For the autoscaler's scrapes: model -> (key, when read).
        self._cached: dict[str, tuple[str, float]] = {}

    async def cached_model_key(self, model: str) -> str:
        """The model's key, read again at most every CACHE_S (scrapes run every tick)."""
        cached = self._cached.get(model)
        if cached is not None and self.clock() - cached[1] < CACHE_S:
            return cached[0]
        return await self.model_key(model)

    async def model_key(self, model: str) -> str:
        """The model's key as stored now, created (create-only CAS) when it has none."""
        path = engine_key_path(model)
        for _ in range(CAS_ATTEMPTS):
            found = await self.store.get_variable(path)
            key = None if found is None else found.items.get(ENGINE_KEY_ITEM)
            if key:
                self._cached[model] = (key, self.clock())
                return key
            try:
                cas = 0 if found is None else found.meta.modify_index
                await self.store.put_variable(path, {ENGINE_KEY_ITEM: self.generate()}, cas=cas)
                log.info("engine_key_created", extra={"model": model, "path": path})
            except HashiConflict:
                log.debug("engine_key_race", extra={"model": model})
        raise HashiConflict(f"engine key of {model}: lost {CAS_ATTEMPTS} races at {path}")

    async def ensure_replica_key(self, model: str, job_id: str) -> None:
        """Make `nomad/jobs/<job_id>` hold the model's key (written only when it differs)."""
        key = await self.model_key(model)
        path = replica_key_path(job_id)
        found = await self.store.get_variable(path)
        if found is not None and found.items.get(ENGINE_KEY_ITEM) == key:
            return
        await self.store.put_variable(path, {ENGINE_KEY_ITEM: key})
        log.info("engine_key_handed_to_replica", extra={"model": model, "job_id": job_id})

    async def remove_replica_key(self, job_id: str) -> None:
        """Delete the replica job's copy once the job is gone."""
        await self.store.delete_variable(replica_key_path(job_id))
