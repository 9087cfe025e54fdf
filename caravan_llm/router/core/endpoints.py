"""Endpoints and the immutable snapshot the router reads, built from Consul health entries.

`snapshot_from_health` is pure: the discovery loop hands it what
`GET /v1/health/service/<name>` returned for every model service, as
`caravan_llm.common.consul_api` decoded it once (`HealthEntry` with its checks; the
aggregate status is `caravan_llm.common.consul_api.aggregate_status`, Consul's rule), and
swaps the result in with one assignment. Everything
a request needs is precomputed here, once per Consul change, not per request:
the endpoints of each served model name sorted by id, split by health, and the
model's hash ring.

An entry that does not carry caravan's service Meta (contract 4) is skipped
with a reason, never crashed on, so one hand-registered service cannot take
routing down for every model.

`verify_entries` runs first, also pure: an entry is an endpoint only if it is
the service Nomad registered for an allocation the scheduler placed for that
model (`caravan/placements/<model>`), at the address and port Nomad allocated
for it, and the names it answers to come from the model's stored profile,
never from the service's own Meta (docs/security.md, "Endpoint verification").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from types import MappingProxyType
from typing import Any

# Re-exported: the balancer, proxy and live state import CheckStatus from here.
from caravan_llm.common.consul_api import CheckStatus as CheckStatus  # noqa: PLC0414
from caravan_llm.common.consul_api import HealthEntry
from caravan_llm.common.contract import (
    DEFAULT_ENGINE_ROUTES,
    OPENAI_STREAM_TRAITS,
    EngineRoute,
    EngineRoutesError,
    PrefillRateError,
    ServiceMetaKey,
    StreamTraits,
    StreamTraitsError,
    decode_engine_routes,
    decode_metric_names,
    decode_prefill_rate,
    decode_stream_traits,
)
from caravan_llm.common.engine_metrics import MetricNames
from caravan_llm.router.core.affinity import DEFAULT_VIRTUAL_NODES, HashRing

DEFAULT_METRICS_PATH = "/metrics"


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One model replica as Consul sees it; immutable, replaced on every Consul change."""

    id: str  # the Consul service ID (Nomad: `_nomad-task-<alloc>-...`)
    service: str  # the Consul service name of the model, `caravan-<name>`
    address: str
    port: int
    served_models: tuple[str, ...]  # the OpenAI `model` values it answers to
    engine: str
    metrics_path: str
    metric_names: MetricNames
    capacity: int | None  # max concurrent sequences; None = not stated
    node: str
    gpu_class: str | None  # None = runs on the CPU
    status: CheckStatus
    spec_hash: str | None
    replica: int
    # How a stream broken elsewhere continues here (from Meta; never from `engine`).
    traits: StreamTraits = OPENAI_STREAM_TRAITS
    # Prefill tokens/s its profile declares (Meta); None = not declared.
    prefill_tokens_per_s: int | None = None
    # The OpenAI routes its engine serves (Meta `routes`; never from `engine`).
    routes: frozenset[EngineRoute] = DEFAULT_ENGINE_ROUTES
    # The host port of its KV relay's digest stream at `address` (the placements'
    # `kv_port`, never its own Meta); None: no stream, the approximate index only.
    kv_port: int | None = None

    def serves(self, route: EngineRoute | None) -> bool:
        """Whether its engine serves `route` (None: any route)."""
        return route is None or route in self.routes

    @property
    def base_url(self) -> str:
        return _url(self.address, self.port)

    @property
    def kv_url(self) -> str | None:
        """Where its KV relay serves the digest stream's host (None: no relay)."""
        return None if self.kv_port is None else _url(self.address, self.kv_port)


def _url(address: str, port: int) -> str:
    host = f"[{address}]" if ":" in address else address
    return f"http://{host}:{port}"


@dataclass(frozen=True, slots=True)
class ModelEndpoints:
    """Everything the balancer needs for one served model name, precomputed."""

    model: str
    endpoints: tuple[Endpoint, ...]  # every status, sorted by id
    ring: HashRing  # over every endpoint, so a health flap does not reshuffle keys


@dataclass(frozen=True, slots=True)
class EndpointSnapshot:
    """What Consul said at one index: endpoints by served model name and by id."""

    index: int
    models: Mapping[str, ModelEndpoints] = field(default_factory=dict)
    by_id: Mapping[str, Endpoint] = field(default_factory=dict)

    def for_model(self, model: str) -> ModelEndpoints | None:
        """The endpoints serving this model name; None when no endpoint serves it."""
        return self.models.get(model)


EMPTY_SNAPSHOT = EndpointSnapshot(index=0)


@dataclass(frozen=True, slots=True)
class SkippedEntry:
    """A health entry left out of the snapshot, with why (for one log line)."""

    service: str
    service_id: str | None
    reason: str


class MalformedEntryError(ValueError):
    """A health entry lacks what the router needs; the message names the field."""


def endpoint_from_entry(entry: HealthEntry) -> Endpoint:
    """One endpoint from one `/v1/health/service` entry.

    Raises MalformedEntryError naming the field when the entry cannot be routed to.
    """
    service_id = _required_str(entry.service_id, "Service.ID")
    address = entry.address
    if not address:
        raise MalformedEntryError("neither Service.Address nor Node.Address is set")
    port = entry.port
    if not 0 < port < 65536:
        raise MalformedEntryError(f"Service.Port is not a TCP port: {port!r}")

    meta = entry.meta
    if not meta:
        raise MalformedEntryError("Service.Meta is missing")
    served_models = _served_models(meta)
    metrics_path = _meta_str(meta, ServiceMetaKey.METRICS_PATH) or DEFAULT_METRICS_PATH
    if not metrics_path.startswith("/"):
        raise MalformedEntryError(
            f"Meta.{ServiceMetaKey.METRICS_PATH} must start with '/': {metrics_path!r}"
        )
    return Endpoint(
        id=service_id,
        service=_required_str(entry.service_name, "Service.Service"),
        address=address,
        port=port,
        served_models=served_models,
        engine=_required_str(meta.get(ServiceMetaKey.ENGINE), f"Meta.{ServiceMetaKey.ENGINE}"),
        metrics_path=metrics_path,
        metric_names=decode_metric_names(meta),
        capacity=_capacity(meta),
        node=entry.node,
        gpu_class=_meta_str(meta, ServiceMetaKey.GPU_CLASS),
        status=entry.status,
        spec_hash=_meta_str(meta, ServiceMetaKey.SPEC_HASH),
        replica=_replica(meta),
        traits=_traits(meta),
        prefill_tokens_per_s=_prefill_rate(meta),
        routes=_routes(meta),
    )


def _routes(meta: Mapping[str, Any]) -> frozenset[EngineRoute]:
    try:
        return decode_engine_routes(meta)
    except EngineRoutesError as exc:
        raise MalformedEntryError(str(exc)) from None


def _prefill_rate(meta: Mapping[str, Any]) -> int | None:
    try:
        return decode_prefill_rate(meta)
    except PrefillRateError as exc:
        raise MalformedEntryError(str(exc)) from None


def _traits(meta: Mapping[str, Any]) -> StreamTraits:
    try:
        return decode_stream_traits(meta)
    except StreamTraitsError as exc:
        raise MalformedEntryError(str(exc)) from None


def snapshot_from_health(
    entries_by_service: Mapping[str, Sequence[HealthEntry]],
    index: int,
    previous: EndpointSnapshot | None = None,
    *,
    virtual_nodes: int = DEFAULT_VIRTUAL_NODES,
    placed: Mapping[str, PlacedAddress] | None = None,
) -> tuple[EndpointSnapshot, tuple[SkippedEntry, ...]]:
    """Build the snapshot from the health entries of every model service.

    `previous` lets a model whose set of endpoint ids did not change keep its
    hash ring, so a health flip costs no rehashing. Entries are skipped, with a
    reason, when malformed or when their service ID repeats one already taken.
    `placed` (service ID -> where Nomad put the allocation) gives an endpoint
    its KV relay's port, only when the endpoint is at the placed address and
    port: a router reads a digest stream only where the scheduler placed one.
    """
    by_id: dict[str, Endpoint] = {}
    skipped: list[SkippedEntry] = []
    for service_name in sorted(entries_by_service):
        for entry in entries_by_service[service_name]:
            try:
                endpoint = endpoint_from_entry(entry)
            except MalformedEntryError as exc:
                skipped.append(SkippedEntry(service_name, entry.service_id or None, str(exc)))
                continue
            kv_port = _placed_kv_port(endpoint, placed)
            if kv_port is not None:
                endpoint = replace(endpoint, kv_port=kv_port)
            if endpoint.id in by_id:
                skipped.append(
                    SkippedEntry(
                        service_name, endpoint.id, "service ID already seen on another node"
                    )
                )
                continue
            by_id[endpoint.id] = endpoint

    grouped: dict[str, list[Endpoint]] = {}
    for endpoint_id in sorted(by_id):
        endpoint = by_id[endpoint_id]
        for model in endpoint.served_models:
            grouped.setdefault(model, []).append(endpoint)

    models: dict[str, ModelEndpoints] = {}
    for model, endpoints in grouped.items():
        ids = tuple(endpoint.id for endpoint in endpoints)
        old = previous.models.get(model) if previous is not None else None
        reusable = (
            old is not None
            and old.ring.endpoint_ids == ids
            and _same_density(old.ring, virtual_nodes)
        )
        ring = old.ring if reusable and old is not None else HashRing.build(ids, virtual_nodes)
        models[model] = ModelEndpoints(model=model, endpoints=tuple(endpoints), ring=ring)
    return EndpointSnapshot(index=index, models=models, by_id=by_id), tuple(skipped)


def _placed_kv_port(endpoint: Endpoint, placed: Mapping[str, PlacedAddress] | None) -> int | None:
    where = None if placed is None else placed.get(endpoint.id)
    if where is None or (where.address, where.port) != (endpoint.address, endpoint.port):
        return None
    return where.kv_port


class UnverifiedReason(StrEnum):
    """Why an entry is not an endpoint caravan placed (a bounded metric label)."""

    # No stored profile declares the model of this service name.
    NO_PROFILE = "no_profile"
    # The service ID is not Nomad's for any live allocation the scheduler placed.
    NOT_PLACED = "not_placed"
    # The ID matches, but not the address and port Nomad allocated for it.
    ADDRESS_MISMATCH = "address_mismatch"
    # Another instance with the same ID, address and port was kept: the one on
    # the allocation's node when there is one, else the first.
    DUPLICATE = "duplicate"


@dataclass(frozen=True, slots=True)
class PlacedAddress:
    """Where Nomad put one allocation's engine: the host IP and port of its `http` label."""

    address: str
    port: int
    node: str = ""  # the Nomad node's name; "" = unknown
    # The host port of its `kv` label (the KV relay's digest stream); None: no relay.
    kv_port: int | None = None


@dataclass(frozen=True, slots=True)
class TrustedService:
    """What caravan vouches for under one model service name (`caravan-<model>`)."""

    # The OpenAI `model` values the model's stored profile declares.
    served_models: tuple[str, ...]
    # Nomad's service ID of each placed allocation -> where Nomad put it.
    placed: Mapping[str, PlacedAddress]


@dataclass(frozen=True, slots=True)
class UnverifiedEntry:
    """A health entry that is not an endpoint caravan placed (for one log line and a metric)."""

    service: str
    service_id: str | None
    reason: UnverifiedReason


def verify_entries(
    entries_by_service: Mapping[str, Sequence[HealthEntry]],
    trusted: Mapping[str, TrustedService],
    *,
    allow_unverified: bool = False,
) -> tuple[dict[str, list[HealthEntry]], tuple[UnverifiedEntry, ...]]:
    """Keep the entries caravan placed; report every other one with its reason.

    A kept entry comes back as a copy whose `Meta.served_models` is the
    profile's served names that its Meta also names, so a registration never
    gets traffic for a name its model's profile does not declare, and a
    replica still running an older profile under another name gets none for
    the new name (it is being replaced); a placed entry left with no name is
    dropped. `trusted` is keyed by service name; a service missing from it
    has no profile. With `allow_unverified` (setups
    without Nomad) unverified entries are kept unchanged, Meta and all, and
    still reported.
    """
    kept: dict[str, list[HealthEntry]] = {}
    unverified: list[UnverifiedEntry] = []
    for service_name in sorted(entries_by_service):
        trust = trusted.get(service_name)
        entries = entries_by_service[service_name]
        reasons = [_unverified_reason(entry, trust) for entry in entries]
        if trust is not None:
            _mark_duplicates(entries, reasons, trust)
        for entry, reason in zip(entries, reasons, strict=True):
            if reason is None and trust is not None:
                served = _served_by_both(entry, trust.served_models)
                if served:
                    kept.setdefault(service_name, []).append(_with_served(entry, served))
                continue
            if reason is not None:
                unverified.append(UnverifiedEntry(service_name, entry.service_id or None, reason))
            if allow_unverified:
                kept.setdefault(service_name, []).append(entry)
    return kept, tuple(unverified)


def _mark_duplicates(
    entries: Sequence[HealthEntry],
    reasons: list[UnverifiedReason | None],
    trust: TrustedService,
) -> None:
    """Of verified entries sharing one service ID, keep one: on the allocation's node, else first.

    Consul service IDs are unique per node only, so a copy of a replica's
    registration (ID, address and port) can sit on another node; it points at
    the real engine, but its checks and Meta are the copier's.
    """
    by_id: dict[str, list[int]] = {}
    for position, (entry, reason) in enumerate(zip(entries, reasons, strict=True)):
        if reason is None and entry.service_id:
            by_id.setdefault(entry.service_id, []).append(position)
    for service_id, positions in by_id.items():
        if len(positions) < 2:
            continue
        node = trust.placed[service_id].node
        on_node = [p for p in positions if node and entries[p].node == node]
        keep = on_node[0] if on_node else positions[0]
        for position in positions:
            if position != keep:
                reasons[position] = UnverifiedReason.DUPLICATE


def _unverified_reason(entry: HealthEntry, trust: TrustedService | None) -> UnverifiedReason | None:
    if trust is None:
        return UnverifiedReason.NO_PROFILE
    placed = trust.placed.get(entry.service_id)
    if placed is None:
        return UnverifiedReason.NOT_PLACED
    if entry.address != placed.address or entry.port != placed.port:
        return UnverifiedReason.ADDRESS_MISMATCH
    return None


def _served_by_both(entry: HealthEntry, declared: tuple[str, ...]) -> tuple[str, ...]:
    """The profile's served names that the entry's own Meta names too."""
    raw = entry.meta.get(ServiceMetaKey.SERVED_MODELS)
    claimed = {name.strip() for name in raw.split(",")} if isinstance(raw, str) else set()
    return tuple(name for name in declared if name in claimed)


def _with_served(entry: HealthEntry, served_models: tuple[str, ...]) -> HealthEntry:
    meta = {**entry.meta, ServiceMetaKey.SERVED_MODELS: ",".join(served_models)}
    return replace(entry, meta=MappingProxyType(meta))


def _same_density(ring: HashRing, virtual_nodes: int) -> bool:
    return len(ring.points) == virtual_nodes * len(ring.endpoint_ids)


def _required_str(value: Any, name: str) -> str:
    if not isinstance(value, str) or not value:
        raise MalformedEntryError(f"{name} is missing or empty")
    return value


def _meta_str(meta: Mapping[str, Any], key: str) -> str | None:
    """A Meta value; an absent key and an empty string both mean absent."""
    value = meta.get(key)
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise MalformedEntryError(f"Meta.{key} is not a string: {value!r}")
    return value


def _served_models(meta: Mapping[str, Any]) -> tuple[str, ...]:
    raw = _meta_str(meta, ServiceMetaKey.SERVED_MODELS)
    names = dict.fromkeys(name.strip() for name in (raw or "").split(","))
    names.pop("", None)
    if not names:
        raise MalformedEntryError(f"Meta.{ServiceMetaKey.SERVED_MODELS} names no model")
    return tuple(names)


def _capacity(meta: Mapping[str, Any]) -> int | None:
    raw = _meta_str(meta, ServiceMetaKey.CAPACITY)
    if raw is None:
        return None
    if not (raw.isascii() and raw.isdigit()) or int(raw) < 1:
        raise MalformedEntryError(
            f"Meta.{ServiceMetaKey.CAPACITY} is not a positive integer: {raw!r}"
        )
    return int(raw)


def _replica(meta: Mapping[str, Any]) -> int:
    raw = _meta_str(meta, ServiceMetaKey.REPLICA)
    if raw is None or not (raw.isascii() and raw.isdigit()):
        raise MalformedEntryError(
            f"Meta.{ServiceMetaKey.REPLICA} is not a non-negative integer: {raw!r}"
        )
    return int(raw)
