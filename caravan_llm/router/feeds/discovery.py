"""Consul discovery: blocking watches that feed one immutable routing view.

    catalog (blocking)        which services carry the `caravan` tag
      -> health/<service>     one blocking watch per model service, every status
    KV <prefix>models/        declared profiles (models that exist at zero replicas)
    KV <prefix>draining/      replicas the scheduler is draining (no new requests)
    KV <prefix>placements/    the live allocations the scheduler placed, per model

Watchers only store what they read and signal (`asyncio.Event.set`, which
coalesces); one rebuild task re-reads everything stored, builds the snapshot
(`snapshot_from_health`, pure, passing the previous one so unchanged rings are
reused), reconciles the live state (survivors keep in-flight, breaker and
drain) and swaps both in with one assignment (`RoutingState.swap`).

When Consul cannot be reached the watches back off and the router keeps
serving from the last view; `staleness_s` says for how long it has been
blind, for `/health` and the metrics. The view counts as synced once the
catalog, the three KV prefixes and the health of every model service have
each been read once.

Endpoint verification: a health entry becomes an endpoint only if it is the
service Nomad registered for an allocation in the model's placements document
(written by the scheduler, the one writer of the prefix), at the address Nomad
allocated for it; it answers to the served name of the model's stored profile.
Every other entry is ignored (`verify_entries`, pure) unless `allow_unverified`
is set (setups without Nomad); one still unverified after
`UNVERIFIED_LOG_AFTER_S` is logged once and counted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, Protocol

from caravan_llm.common.consul_api import HealthEntry, KVEntry
from caravan_llm.common.contract import (
    SERVICE_TAG,
    ContractError,
    KVLayout,
    ModelView,
    Placements,
    PlacementsError,
    ServiceMetaKey,
    decode_model_view,
    decode_placements,
    model_service_name,
    nomad_service_id,
    replica_job_id,
    served_name_owners,
)
from caravan_llm.common.watch import BlockingWatch, Fetch
from caravan_llm.router.core.endpoints import (
    PlacedAddress,
    SkippedEntry,
    TrustedService,
    UnverifiedEntry,
    UnverifiedReason,
    snapshot_from_health,
    verify_entries,
)
from caravan_llm.router.core.live_state import reconcile_live_state
from caravan_llm.router.core.routing_state import KnownModel, RoutingState, RoutingView
from caravan_llm.router.metrics import RouterMetrics

# Named as before the router's sub-packages: the logger is a field of every log line.
log = logging.getLogger("router.discovery")

# An instance is logged and counted as unverified once it has been so for this
# long: the scheduler publishes a new replica's allocation on the reconcile
# pass that Nomad's allocation change wakes, which may end a moment after the
# replica registered in Consul.
UNVERIFIED_LOG_AFTER_S = 10.0


class DiscoveryConsul(Protocol):
    """The Consul reads discovery needs (implemented by
    `caravan_llm.common.consul_api.ConsulClient`)."""

    async def catalog_services(
        self, *, index: int = 0, wait_s: float | None = None
    ) -> tuple[int, dict[str, tuple[str, ...]]]: ...

    async def health_service(
        self,
        name: str,
        *,
        passing: bool = False,
        tags: tuple[str, ...] = (),
        filter_expr: str | None = None,
        index: int = 0,
        wait_s: float | None = None,
    ) -> tuple[int, tuple[HealthEntry, ...]]: ...

    async def kv_get_recurse(
        self, prefix: str, *, index: int = 0, wait_s: float | None = None
    ) -> tuple[int, tuple[KVEntry, ...]]: ...


# -- pure conversions ---------------------------------------------------------------


def model_services(services: Mapping[str, Sequence[str]]) -> frozenset[str]:
    """The services of the catalog that carry the `caravan` tag (model replicas)."""
    return frozenset(name for name, tags in services.items() if SERVICE_TAG in tags)


def entry_job_id(entry: HealthEntry) -> str | None:
    """The Nomad job id of the replica behind an entry, from its Meta; None when it has none."""
    model = entry.meta.get(ServiceMetaKey.MODEL)
    replica = entry.meta.get(ServiceMetaKey.REPLICA)
    if not model or replica is None or not (replica.isascii() and replica.isdigit()):
        return None
    return replica_job_id(model, int(replica))


def draining_endpoint_ids(
    entries: Iterable[HealthEntry], draining_jobs: frozenset[str]
) -> frozenset[str]:
    """The endpoint ids whose replica job carries a drain marker."""
    if not draining_jobs:
        return frozenset()
    return frozenset(entry.service_id for entry in entries if entry_job_id(entry) in draining_jobs)


def keys_under(entries: Iterable[KVEntry], prefix: str) -> frozenset[str]:
    """The key names directly under a KV prefix (`<prefix>draining/<job>` -> `<job>`)."""
    names = (entry.key[len(prefix) :] for entry in entries if entry.key.startswith(prefix))
    return frozenset(name for name in names if name and "/" not in name)


def profiles_from_kv(
    entries: Iterable[KVEntry], prefix: str
) -> tuple[dict[str, KnownModel], list[str]]:
    """Declared models by served model name, and one problem line per profile left out.

    The profile name is the key under `<prefix>models/`; the served model name
    is the contract's (`caravan_llm.common.contract.ModelView.served_name`).
    """
    views: dict[str, tuple[str, int]] = {}
    decoded: dict[str, ModelView] = {}
    keys: dict[str, str] = {}
    problems: list[str] = []
    for entry in sorted(entries, key=lambda item: item.key):
        name = entry.key[len(prefix) :] if entry.key.startswith(prefix) else ""
        if not name or "/" in name:
            continue
        try:
            view = decode_model_view(entry.value, key=entry.key, model=name)
        except ContractError as exc:
            problems.append(str(exc))
            continue
        views[name] = (view.served_name, entry.create_index)
        decoded[name] = view
        keys[name] = entry.key
    owners = served_name_owners(views)
    models: dict[str, KnownModel] = {}
    for name, (served, _) in sorted(views.items()):
        owner = owners[served]
        if owner != name:
            problems.append(
                f"{keys[name]}: served_model_name {served!r} is already declared by "
                f"profile {owner!r}"
            )
            continue
        models[served] = KnownModel(name=name, served_model_name=served, view=decoded[name])
    return models, problems


def placements_from_kv(
    entries: Iterable[KVEntry], prefix: str
) -> tuple[dict[str, Placements], list[str]]:
    """The placements document of each model, and one problem line per document left out.

    The model is the key under `prefix`. A model whose document is left out
    has no placed allocation, so its entries verify against nothing (fail closed).
    """
    placements: dict[str, Placements] = {}
    problems: list[str] = []
    for entry in sorted(entries, key=lambda item: item.key):
        name = entry.key[len(prefix) :] if entry.key.startswith(prefix) else ""
        if not name or "/" in name:
            continue
        try:
            placements[name] = decode_placements(entry.value, key=entry.key, model=name)
        except PlacementsError as exc:
            problems.append(str(exc))
    return placements, problems


def trusted_services(
    profiles: Mapping[str, KnownModel], placements: Mapping[str, Placements]
) -> dict[str, TrustedService]:
    """What caravan vouches for, by model service name.

    For each declared model: its profile's served name, and Nomad's service ID
    of each allocation the scheduler placed for it, with where Nomad put it.
    """
    trusted: dict[str, TrustedService] = {}
    for known in profiles.values():
        placed = placements.get(known.name)
        allocations = placed.allocations if placed is not None else ()
        trusted[model_service_name(known.name)] = TrustedService(
            served_models=(known.served_model_name,),
            placed={
                nomad_service_id(alloc.alloc_id, known.name): PlacedAddress(
                    alloc.address, alloc.port, alloc.node, alloc.kv_port
                )
                for alloc in allocations
            },
        )
    return trusted


# -- the watch loops --------------------------------------------------------------------


class Discovery:
    """Runs the watches and the rebuild; `run()` until cancelled."""

    def __init__(
        self,
        consul: DiscoveryConsul,
        state: RoutingState,
        *,
        layout: KVLayout,
        metrics: RouterMetrics,
        wait_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        allow_unverified: bool = False,
        unverified_log_after_s: float = UNVERIFIED_LOG_AFTER_S,
    ) -> None:
        self._consul = consul
        self._allow_unverified = allow_unverified
        self._state = state
        self._layout = layout
        self._metrics = metrics
        self._wait_s = wait_s
        self._clock = clock
        self._changed = asyncio.Event()
        self._started_at = clock()

        self._services: frozenset[str] | None = None
        self._health: dict[str, tuple[HealthEntry, ...]] = {}
        self._health_index: dict[str, int] = {}
        self._health_tasks: dict[str, asyncio.Task[None]] = {}
        self._profiles: dict[str, KnownModel] | None = None
        self._draining_jobs: frozenset[str] | None = None
        self._placements: dict[str, Placements] | None = None
        self._last_placement_problems: tuple[str, ...] = ()
        self._unverified_log_after_s = unverified_log_after_s
        self._last_unverified: tuple[UnverifiedEntry, ...] = ()
        self._unverified_since: dict[tuple[str | None, UnverifiedReason], float] = {}
        self._unverified_reported: set[tuple[str | None, UnverifiedReason]] = set()
        self._recheck_at: float | None = None
        self._last_skipped: frozenset[tuple[str | None, str]] = frozenset()
        self._last_problems: tuple[str, ...] = ()

        self._catalog_watch = BlockingWatch("catalog services", self._fetch_catalog, **self._w())
        self._models_watch = BlockingWatch(
            f"kv {layout.models}", self._kv_fetch(layout.models), **self._w()
        )
        self._draining_watch = BlockingWatch(
            f"kv {layout.draining}", self._kv_fetch(layout.draining), **self._w()
        )
        self._placements_watch = BlockingWatch(
            f"kv {layout.placements}", self._kv_fetch(layout.placements), **self._w()
        )
        self._health_watches: dict[str, BlockingWatch[tuple[HealthEntry, ...]]] = {}
        self._task_group: asyncio.TaskGroup | None = None

    def _w(self) -> dict[str, Any]:
        return {"wait_s": self._wait_s, "clock": self._clock}

    async def run(self) -> None:
        async with asyncio.TaskGroup() as group:
            self._task_group = group
            group.create_task(self._catalog_watch.run(self._on_catalog), name="discovery-catalog")
            group.create_task(self._models_watch.run(self._on_models), name="discovery-models")
            group.create_task(
                self._draining_watch.run(self._on_draining), name="discovery-draining"
            )
            group.create_task(
                self._placements_watch.run(self._on_placements), name="discovery-placements"
            )
            group.create_task(self._rebuild_loop(), name="discovery-rebuild")

    def staleness_s(self, now: float) -> float:
        """Seconds since the failing watches last heard from Consul; 0 while all are fine."""
        oldest: float | None = None
        for watch in self._all_watches():
            status = watch.status
            if status.consecutive_errors == 0:
                continue
            heard = status.last_success_at if status.last_success_at is not None else None
            since = heard if heard is not None else self._started_at
            oldest = since if oldest is None else min(oldest, since)
        return 0.0 if oldest is None else max(0.0, now - oldest)

    def _all_watches(self) -> list[BlockingWatch[Any]]:
        return [
            self._catalog_watch,
            self._models_watch,
            self._draining_watch,
            self._placements_watch,
            *self._health_watches.values(),
        ]

    # -- fetches and deliveries ------------------------------------------------------

    async def _fetch_catalog(
        self, index: int, wait_s: float
    ) -> tuple[int, dict[str, tuple[str, ...]]]:
        return await self._consul.catalog_services(index=index, wait_s=wait_s)

    def _kv_fetch(self, prefix: str) -> Fetch[tuple[KVEntry, ...]]:
        async def fetch(index: int, wait_s: float) -> tuple[int, tuple[KVEntry, ...]]:
            return await self._consul.kv_get_recurse(prefix, index=index, wait_s=wait_s)

        return fetch

    async def _on_catalog(self, services: dict[str, tuple[str, ...]]) -> None:
        wanted = model_services(services)
        for name in sorted(wanted - self._health_tasks.keys()):
            self._start_health_watch(name)
        for name in sorted(self._health_tasks.keys() - wanted):
            self._health_tasks.pop(name).cancel()
            self._health_watches.pop(name, None)
            self._health.pop(name, None)
            self._health_index.pop(name, None)
            log.info("model_service_gone", extra={"service": name})
        self._services = wanted
        self._changed.set()

    def _start_health_watch(self, name: str) -> None:
        consul = self._consul

        async def fetch(index: int, wait_s: float) -> tuple[int, tuple[HealthEntry, ...]]:
            # passing=False: warning (saturated) and critical instances matter too.
            return await consul.health_service(name, passing=False, index=index, wait_s=wait_s)

        async def deliver(entries: tuple[HealthEntry, ...]) -> None:
            self._health[name] = entries
            self._health_index[name] = watch.status.index
            self._changed.set()

        watch: BlockingWatch[tuple[HealthEntry, ...]] = BlockingWatch(
            f"health {name}", fetch, **self._w()
        )
        self._health_watches[name] = watch
        if self._task_group is None:  # pragma: no cover - only reachable before run()
            raise RuntimeError("discovery is not running")
        self._health_tasks[name] = self._task_group.create_task(
            watch.run(deliver), name=f"discovery-health-{name}"
        )
        log.info("model_service_found", extra={"service": name})

    async def _on_models(self, entries: tuple[KVEntry, ...]) -> None:
        profiles, problems = profiles_from_kv(entries, self._layout.models)
        if tuple(problems) != self._last_problems:
            for problem in problems:
                log.warning("profile_ignored", extra={"problem": problem})
            self._last_problems = tuple(problems)
        self._profiles = profiles
        self._changed.set()

    async def _on_draining(self, entries: tuple[KVEntry, ...]) -> None:
        self._draining_jobs = keys_under(entries, self._layout.draining)
        self._changed.set()

    async def _on_placements(self, entries: tuple[KVEntry, ...]) -> None:
        placements, problems = placements_from_kv(entries, self._layout.placements)
        if tuple(problems) != self._last_placement_problems:
            for problem in problems:
                log.warning("placements_ignored", extra={"problem": problem})
            self._last_placement_problems = tuple(problems)
        self._placements = placements
        self._changed.set()

    # -- the rebuild -----------------------------------------------------------------

    async def _rebuild_loop(self) -> None:
        while True:
            wait_s = (
                None if self._recheck_at is None else max(0.0, self._recheck_at - self._clock())
            )
            try:
                async with asyncio.timeout(wait_s):
                    await self._changed.wait()
            except TimeoutError:
                # Nothing changed, but an unverified instance's grace period ran out.
                self._report_unverified(self._last_unverified)
                continue
            self._changed.clear()
            self.rebuild()

    def rebuild(self) -> None:
        """Build the view from everything the watches hold and swap it in."""
        previous = self._state.view
        entries_by_service = {name: list(entries) for name, entries in self._health.items()}
        profiles = self._profiles if self._profiles is not None else {}
        trusted = trusted_services(profiles, self._placements or {})
        verified, unverified = verify_entries(
            entries_by_service, trusted, allow_unverified=self._allow_unverified
        )
        self._report_unverified(unverified)
        index = max(self._health_index.values(), default=0)
        placed = {sid: where for trust in trusted.values() for sid, where in trust.placed.items()}
        snapshot, skipped = snapshot_from_health(
            verified, index, previous=previous.snapshot, placed=placed
        )
        self._log_skipped(skipped)
        draining = draining_endpoint_ids(
            (entry for entries in self._health.values() for entry in entries),
            self._draining_jobs or frozenset(),
        )
        live = reconcile_live_state(self._state.live, snapshot, draining)
        view = RoutingView(snapshot=snapshot, profiles=MappingProxyType(dict(profiles)))
        synced = self._state.synced or self._is_synced()
        self._metrics.discovery_rebuilds.inc()
        self._state.swap(view, live, synced=synced)

    def _is_synced(self) -> bool:
        return (
            self._services is not None
            and self._profiles is not None
            and self._draining_jobs is not None
            and self._placements is not None
            and all(name in self._health for name in self._services)
        )

    def _report_unverified(self, unverified: tuple[UnverifiedEntry, ...]) -> None:
        """Set the current gauge; log and count each instance unverified for the grace period once.

        The grace period keeps a replica that registered a moment before the
        scheduler published its allocation out of the warnings. When some are
        still within it, `_recheck_at` makes the rebuild loop look again then.
        """
        self._last_unverified = unverified
        now = self._clock()
        action = "accepted" if self._allow_unverified else "ignored"
        current = {(item.service_id, item.reason): item for item in unverified}
        # Only what is still registered is remembered, so both stay bounded.
        self._unverified_since = {key: self._unverified_since.get(key, now) for key in current}
        self._unverified_reported &= current.keys()
        due: float | None = None
        for key, item in current.items():
            if key in self._unverified_reported:
                continue
            at = self._unverified_since[key] + self._unverified_log_after_s
            if at > now:
                due = at if due is None else min(due, at)
                continue
            self._unverified_reported.add(key)
            self._metrics.unverified_endpoints.labels(item.reason.value, action).inc()
            log.warning(
                "endpoint_unverified",
                extra={
                    "service": item.service,
                    "service_id": item.service_id,
                    "reason": item.reason.value,
                    "action": action,
                },
            )
        self._recheck_at = due
        for reason in UnverifiedReason:
            count = sum(1 for item in unverified if item.reason is reason)
            self._metrics.unverified_endpoints_current.labels(reason.value).set(count)

    def _log_skipped(self, skipped: tuple[SkippedEntry, ...]) -> None:
        # Once per change, not on every rebuild: a bad registration stays bad.
        current = frozenset((item.service_id, item.reason) for item in skipped)
        if current != self._last_skipped:
            for item in skipped:
                log.warning(
                    "health_entry_skipped",
                    extra={
                        "service": item.service,
                        "service_id": item.service_id,
                        "reason": item.reason,
                    },
                )
            self._last_skipped = current
