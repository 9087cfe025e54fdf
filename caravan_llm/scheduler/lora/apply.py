"""The LoRA step of a reconcile pass: read what replicas hold, plan, load and unload (I/O).

After the pass has applied its job actions, for each model whose engine takes
adapters at run time (`AdapterLoading.RUNTIME`, vLLM):

1. each ready replica's engine is asked what it holds (the engine's model
   list, entries with `parent` set), with the model's engine key; a replica
   that does not answer is left out of this pass (unknown, not empty);
2. `plan_adapters` (pure, scheduler/lora/plan.py) says what each should hold,
   weighted by the demand the `AdapterDemandSource` gives (the routers'
   `adapter-demand/` records, summed), leaving out adapters whose last load
   failed recently. The plan keeps a copy where it is held now whenever its
   counts allow, so an adapter a router loaded on demand (and reports demand
   for) stays where the router put it. When the adapters outnumber the
   slots, the plan has one slot less per replica (`on_demand_slots`), left to
   the routers, and what a router loaded there is kept (`kept_on_demand`).
   An adapter placed now weighs more (`sticky`), so that noise in the
   routers' counts does not move adapters back and forth;
3. the difference is applied through the engine's API: unloads first (they
   free slots), then loads; an adapter loaded from another source than the
   profile's now is unloaded and loaded again. An adapter that appeared on a
   replica since the last pass (a router's on-demand load, made just before
   the request it is for) is not unloaded for `appeared_grace_s`, and a planned
   load waits while no slot is free, so neither side answers the other's
   request with a 404 and no replica goes over `max_loras`;
4. the result is one `ModelAdapters` document per model (what each replica
   holds now, what it should, which adapters failed and why), which the
   publisher writes to `adapters/<model>` on change.

An engine that refuses a load (a bad path: vLLM answers 404) is recorded with
its answer; the adapter is left out of the plan for `retry_failed_after_s`,
so its slot serves the others meanwhile, then tried again. Models whose engine
names its adapters at start (SGLang) get the document too: every ready replica
holds every adapter, as rendered.

Nothing here decides what to hold; it reads, asks the plan and applies.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp

from caravan_llm.common.contract import (
    ALLOC_ID_PATTERN,
    AdapterFailure,
    ModelAdapters,
    ReplicaAdapters,
)
from caravan_llm.common.errors import HashiError
from caravan_llm.scheduler.assess import Assessment
from caravan_llm.scheduler.engines.base import AdapterLoading, RuntimeAdapterApi
from caravan_llm.scheduler.engines.registry import adapter_for
from caravan_llm.scheduler.lora.plan import (
    NO_DEMAND,
    AdapterDemand,
    kept_on_demand,
    on_demand_slots,
    plan_adapters,
    sticky,
)
from caravan_llm.scheduler.world import DesiredModel, Observation

log = logging.getLogger(__name__)

# An engine lists its models from memory: a replica that takes longer is left out.
LIST_TIMEOUT_S = 5.0
# Loading reads the adapter from the volume (or downloads it) into the engine.
LOAD_TIMEOUT_S = 60.0
# Seconds an adapter that appeared on a replica between two passes is kept there
# (`LoraApplier.appeared_grace_s`): a router loads one on demand just before it
# sends the request, and an unload in between would answer that request 404.
ON_DEMAND_GRACE_S = 10.0
# Loads and unloads in flight at once, over all replicas.
APPLY_CONCURRENCY = 4
# How much of an engine's error body a failure keeps.
MAX_REASON_CHARS = 300
# vLLM's answers to a load of a name it holds (400) and an unload of one it does not (404).
ALREADY_LOADED = "has already been loaded"
NOT_LOADED = "cannot be found"


class AdapterApiError(Exception):
    """An engine's adapter route did not do what was asked; `reason` says what it answered.

    Retryable: a refused load is tried again after `retry_failed_after_s`, an
    unreachable engine on the next pass.
    """

    retryable = True

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(reason)


@dataclass(frozen=True, slots=True)
class AdapterTarget:
    """One ready replica's engine: where it listens, and its key (never shown)."""

    model: str
    job_id: str
    alloc_id: str
    base_url: str
    api: RuntimeAdapterApi
    api_key: str | None = field(default=None, repr=False)


class AdapterApi(Protocol):
    """The engine calls the LoRA step makes (HttpAdapterApi; a fake in tests)."""

    async def loaded(self, target: AdapterTarget) -> dict[str, str]:
        """The adapters the engine holds, name -> the source it loaded each from."""
        ...

    async def load(self, target: AdapterTarget, name: str, source: str) -> None: ...

    async def unload(self, target: AdapterTarget, name: str) -> None: ...


class AdapterDemandSource(Protocol):
    """Demand per adapter of a model (the routers' `adapter-demand/` records)."""

    def __call__(self, model: str) -> AdapterDemand: ...


def no_demand(model: str) -> AdapterDemand:
    """No figures: every adapter weighs the same."""
    del model
    return NO_DEMAND


def _headers(target: AdapterTarget) -> dict[str, str]:
    return {} if target.api_key is None else {"Authorization": f"Bearer {target.api_key}"}


def _reason(status: int, text: str) -> str:
    """The engine's answer in one line: its OpenAI error message when it sent one."""
    message = text.strip()
    try:
        body = json.loads(text)
    except ValueError:
        body = None
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            message = error["message"]
        elif isinstance(body.get("detail"), str):
            message = body["detail"]
    return f"HTTP {status}: {' '.join(message.split())[:MAX_REASON_CHARS]}"


@dataclass(slots=True)
class HttpAdapterApi:
    """The engine's adapter routes over HTTP (the routes are the engine's facts)."""

    session: aiohttp.ClientSession

    async def loaded(self, target: AdapterTarget) -> dict[str, str]:
        url = target.base_url + target.api.list_path
        try:
            async with self.session.get(
                url,
                headers=_headers(target),
                timeout=aiohttp.ClientTimeout(total=LIST_TIMEOUT_S),
            ) as response:
                text = await response.text()
                if response.status != 200:
                    raise AdapterApiError(_reason(response.status, text))
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise AdapterApiError(f"unreachable: {type(exc).__name__}") from exc
        return _adapters_of(text)

    async def load(self, target: AdapterTarget, name: str, source: str) -> None:
        await self._post(
            target,
            target.api.load_path,
            {"lora_name": name, "lora_path": source},
            done_already=(400, ALREADY_LOADED),
        )

    async def unload(self, target: AdapterTarget, name: str) -> None:
        await self._post(
            target, target.api.unload_path, {"lora_name": name}, done_already=(404, NOT_LOADED)
        )

    async def _post(
        self,
        target: AdapterTarget,
        path: str,
        body: dict[str, str],
        *,
        done_already: tuple[int, str],
    ) -> None:
        """POST to the engine; `done_already`: the status and words of the engine saying the
        change was made already (a router loaded or unloaded it since this pass read)."""
        try:
            async with self.session.post(
                target.base_url + path,
                json=body,
                headers=_headers(target),
                timeout=aiohttp.ClientTimeout(total=LOAD_TIMEOUT_S),
            ) as response:
                text = await response.text()
                status, words = done_already
                if response.status == status and words in text:
                    return
                if response.status != 200:
                    raise AdapterApiError(_reason(response.status, text))
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise AdapterApiError(f"unreachable: {type(exc).__name__}") from exc


def _adapters_of(text: str) -> dict[str, str]:
    """The entries of an OpenAI model list with `parent` set: name -> `root` (its source)."""
    try:
        document: Any = json.loads(text)
    except ValueError as exc:
        raise AdapterApiError("the model list is not JSON") from exc
    data = document.get("data") if isinstance(document, dict) else None
    if not isinstance(data, list):
        raise AdapterApiError("the model list has no `data` list")
    found: dict[str, str] = {}
    for entry in data:
        if not isinstance(entry, dict) or entry.get("parent") is None:
            continue
        name, root = entry.get("id"), entry.get("root")
        if isinstance(name, str):
            found[name] = root if isinstance(root, str) else ""
    return found


@dataclass(frozen=True, slots=True)
class _Failure:
    record: AdapterFailure
    retry_at: float


def _ready_targets(
    name: str, observed: Observation, assessment: Assessment
) -> list[tuple[str, str, str]]:
    """(job id, alloc id, base URL) of each ready, not draining replica of the model."""
    model = assessment.models.get(name)
    if model is None:
        return []
    found: list[tuple[str, str, str]] = []
    for judged in model.replicas:
        if not judged.ready or judged.draining:
            continue
        replica = observed.replicas.get(judged.job_id)
        if replica is None:
            continue
        passing = [
            a
            for a in replica.live_allocs()
            if a.client_status == "running" and observed.health.get(a.id) == "passing"
        ]
        for alloc in sorted(passing, key=lambda a: -a.create_time_ns)[:1]:
            engine = observed.engines.get(alloc.id)
            # As for placements: only Nomad's own allocations, at the address Nomad gave.
            if engine is None or not re.match(ALLOC_ID_PATTERN, alloc.id):
                continue
            host = engine.port.host_ip
            host = f"[{host}]" if ":" in host else host
            found.append((judged.job_id, alloc.id, f"http://{host}:{engine.port.value}"))
    return found


@dataclass(slots=True)
class LoraApplier:
    """Keeps each runtime-LoRA model's replicas holding what the plan says (module docstring).

    What it keeps between passes is the failures it saw (when each may be tried
    again), returned in every document it builds, and its last documents.
    """

    # The model's engine API key (EngineKeys.cached_model_key); None: engines run without keys.
    engine_key: Callable[[str], Awaitable[str]] | None = None
    demand: AdapterDemandSource = no_demand
    # Builds the engine client for one pass (tests pass a fake).
    api_factory: Callable[[aiohttp.ClientSession], AdapterApi] = HttpAdapterApi
    retry_failed_after_s: float = 60.0
    # An adapter that appeared on a replica since the last pass (a router loaded it on
    # demand for a request it is about to send there) is not unloaded for this long.
    appeared_grace_s: float = ON_DEMAND_GRACE_S
    clock: Callable[[], float] = time.time
    _failures: dict[tuple[str, str], _Failure] = field(default_factory=dict)
    # (model, alloc id) -> adapter -> when this applier first saw the replica hold it;
    # what a replica held when first read counts as old (-inf).
    _appeared: dict[tuple[str, str], dict[str, float]] = field(default_factory=dict)
    # The documents of the last pass, said again for a model whose key could not be read.
    _last: dict[str, ModelAdapters] = field(default_factory=dict)

    async def reconcile(
        self,
        models: Mapping[str, DesiredModel],
        observed: Observation,
        assessment: Assessment,
        demand: AdapterDemandSource | None = None,
    ) -> dict[str, ModelAdapters]:
        """Apply the plan of every model with LoRA on; one document per such model.

        `demand`: this pass's figures (the controller's, from KV); None: `self.demand`.
        """
        lora_models = {
            name: desired
            for name, desired in sorted(models.items())
            if desired.profile.lora_limits is not None
            and adapter_for(desired.profile.engine).facts.adapters.loading is not None
        }
        self._forget_failures(lora_models)
        if not lora_models:
            return {}
        documents: dict[str, ModelAdapters] = {}
        async with aiohttp.ClientSession() as session:
            api = self.api_factory(session)
            for name, desired in lora_models.items():
                documents[name] = await self._model(
                    name, desired, observed, assessment, api, demand=demand or self.demand
                )
        self._last = dict(documents)
        return documents

    def _forget_failures(self, lora_models: Mapping[str, DesiredModel]) -> None:
        """Drop failures of adapters gone from their profile, or whose source changed."""
        for key in list(self._failures):
            model, adapter = key
            desired = lora_models.get(model)
            sources = (
                {} if desired is None else {a.name: a.source for a in desired.profile.adapters}
            )
            if sources.get(adapter) != self._failures[key].record.source:
                del self._failures[key]

    async def _model(
        self,
        name: str,
        desired: DesiredModel,
        observed: Observation,
        assessment: Assessment,
        api: AdapterApi,
        *,
        demand: AdapterDemandSource,
    ) -> ModelAdapters:
        profile = desired.profile
        facts = adapter_for(profile.engine).facts.adapters
        sources = {adapter.name: adapter.source for adapter in profile.adapters}
        if facts.loading is AdapterLoading.START or facts.api is None:
            return _at_start(
                name, observed, assessment, tuple(sorted(sources)), facts.request_model
            )
        try:
            key = None if self.engine_key is None else await self.engine_key(name)
        except HashiError as exc:
            # Nomad Variables unreachable: keep saying what was last known (the
            # publisher would otherwise delete the document), and try next pass.
            log.warning("lora_engine_key_unavailable", extra={"model": name, "error": str(exc)})
            return self._last.get(name, ModelAdapters(model=name))
        targets = [
            AdapterTarget(name, job_id, alloc_id, url, facts.api, key)
            for job_id, alloc_id, url in _ready_targets(name, observed, assessment)
        ]
        held = await self._read_held(api, targets)
        now = self.clock()
        placeable = [
            adapter
            for adapter in sources
            if (failure := self._failures.get((name, adapter))) is None or now >= failure.retry_at
        ]
        limits = profile.lora_limits
        assert limits is not None  # noqa: S101 - reconcile keeps LoRA models only
        by_id = {t.alloc_id: t for t in targets if t.alloc_id in held}
        # A replica holds an adapter only if it loaded it from the profile's source now.
        current = {
            alloc_id: frozenset(n for n, root in held[alloc_id].items() if sources.get(n) == root)
            for alloc_id in by_id
        }
        # With more adapters than slots, one slot per replica is left to routers' loads.
        reserved = on_demand_slots(limits.max_loras, len(placeable), len(by_id))
        wanted = demand(name)
        previous = self._last.get(name)
        planned_before = {
            r.alloc_id: frozenset(r.desired) for r in (previous.replicas if previous else ())
        }
        # What the plan keeps in place: with a slot left to routers, only what it placed
        # itself (a router's copy stays in the routers' slot, `kept_on_demand`, instead of
        # taking a planned slot and pushing the planned copy elsewhere).
        basis = (
            {a: held_now & planned_before.get(a, frozenset()) for a, held_now in current.items()}
            if reserved and previous is not None
            else current
        )
        # With a slot left to routers, an adapter placed now weighs more (`sticky`); without,
        # the router's copies are in the plan's slots and demand alone decides, as before.
        placed_now = frozenset().union(*basis.values()) if reserved and basis else frozenset()
        placement = plan_adapters(
            basis, placeable, sticky(wanted, placed_now), limits.max_loras - reserved
        )
        loaded = {alloc_id: set(held[alloc_id]) for alloc_id in by_id}
        recent = self._recently_appeared(name, held, now)
        semaphore = asyncio.Semaphore(APPLY_CONCURRENCY)

        async def apply_replica(target: AdapterTarget) -> None:
            want = placement.holds[target.alloc_id]
            have = held[target.alloc_id]
            keep = kept_on_demand(
                current[target.alloc_id],
                want,
                planned_before.get(target.alloc_id, frozenset()),
                reserved,
                wanted,
            )
            mine = loaded[target.alloc_id]
            stale = [
                n
                for n in sorted(have)
                if sources.get(n) != have[n]
                or (n not in want and n not in keep and n not in recent[target.alloc_id])
            ]
            for adapter in stale:
                async with semaphore:
                    await self._unload(api, target, adapter, loaded)
            for adapter in sorted(want - current[target.alloc_id]):
                if len(mine) >= limits.max_loras:
                    # A slot is still held by a recent on-demand load: the next pass.
                    break
                async with semaphore:
                    await self._load(api, target, adapter, sources[adapter], loaded)

        async with asyncio.TaskGroup() as group:
            for target in by_id.values():
                group.create_task(apply_replica(target))
        return ModelAdapters(
            model=name,
            replicas=tuple(
                ReplicaAdapters(
                    alloc_id=alloc_id,
                    job_id=by_id[alloc_id].job_id,
                    loaded=tuple(sorted(loaded[alloc_id])),
                    desired=tuple(sorted(placement.holds[alloc_id])),
                )
                for alloc_id in sorted(by_id)
            ),
            failed=tuple(
                failure.record
                for (model, _), failure in sorted(self._failures.items())
                if model == name
            ),
            unplaced=placement.unplaced,
            request_model=facts.request_model,
            load_path=facts.api.load_path,
            unload_path=facts.api.unload_path,
        )

    def _recently_appeared(
        self, model: str, held: Mapping[str, Mapping[str, str]], now: float
    ) -> dict[str, frozenset[str]]:
        """Per replica read this pass, the adapters that appeared on it less than
        `appeared_grace_s` ago (since an earlier pass); remembers what each holds."""
        recent: dict[str, frozenset[str]] = {}
        for alloc_id, names in held.items():
            before = self._appeared.get((model, alloc_id))
            since = {n: (before.get(n, now) if before is not None else -math.inf) for n in names}
            self._appeared[(model, alloc_id)] = since
            recent[alloc_id] = frozenset(
                n for n, at in since.items() if now - at < self.appeared_grace_s
            )
        for key in [k for k in self._appeared if k[0] == model and k[1] not in held]:
            # A replica not read this pass (gone, or its list failed) starts again.
            del self._appeared[key]
        return recent

    async def _read_held(
        self, api: AdapterApi, targets: list[AdapterTarget]
    ) -> dict[str, dict[str, str]]:
        """What each replica holds; one that does not answer is left out (unknown)."""
        held: dict[str, dict[str, str]] = {}
        for target in targets:
            try:
                held[target.alloc_id] = await api.loaded(target)
            except AdapterApiError as exc:
                log.warning(
                    "lora_list_failed",
                    extra={"model": target.model, "job_id": target.job_id, "error": exc.reason},
                )
        return held

    async def _unload(
        self,
        api: AdapterApi,
        target: AdapterTarget,
        adapter: str,
        loaded: dict[str, set[str]],
    ) -> None:
        try:
            await api.unload(target, adapter)
        except AdapterApiError as exc:
            log.warning(
                "lora_unload_failed",
                extra={
                    "model": target.model,
                    "job_id": target.job_id,
                    "adapter": adapter,
                    "error": exc.reason,
                },
            )
            return
        loaded[target.alloc_id].discard(adapter)
        log.info(
            "lora_unloaded",
            extra={"model": target.model, "job_id": target.job_id, "adapter": adapter},
        )

    async def _load(
        self,
        api: AdapterApi,
        target: AdapterTarget,
        adapter: str,
        source: str,
        loaded: dict[str, set[str]],
    ) -> None:
        key = (target.model, adapter)
        try:
            await api.load(target, adapter, source)
        except AdapterApiError as exc:
            now = self.clock()
            earlier = self._failures.get(key)
            since = earlier.record.since if earlier is not None else now
            self._failures[key] = _Failure(
                AdapterFailure(
                    adapter=adapter,
                    source=source,
                    job_id=target.job_id,
                    reason=exc.reason,
                    since=since,
                ),
                retry_at=now + self.retry_failed_after_s,
            )
            log.warning(
                "lora_load_failed",
                extra={
                    "model": target.model,
                    "job_id": target.job_id,
                    "adapter": adapter,
                    "error": exc.reason,
                    "retry_in_s": self.retry_failed_after_s,
                },
            )
            return
        self._failures.pop(key, None)
        loaded[target.alloc_id].add(adapter)
        log.info(
            "lora_loaded",
            extra={"model": target.model, "job_id": target.job_id, "adapter": adapter},
        )


def _at_start(
    name: str,
    observed: Observation,
    assessment: Assessment,
    adapters: tuple[str, ...],
    request_model: str,
) -> ModelAdapters:
    """An engine that takes its adapters at start holds all of them once ready."""
    return ModelAdapters(
        model=name,
        replicas=tuple(
            ReplicaAdapters(alloc_id=alloc_id, job_id=job_id, loaded=adapters, desired=adapters)
            for job_id, alloc_id, _ in _ready_targets(name, observed, assessment)
        ),
        request_model=request_model,
    )
