"""LoRA adapters as the router sees them: which model serves each, where each is held (pure).

An adapter is a model of its own (issue 25): a request whose `model` is an
adapter's name goes to a replica of its base model, and best to one whose
engine holds the adapter already. This module answers, with no I/O and no
clock of its own:

- `adapter_routes`: each declared adapter's base model (profile name and
  served name), its source and the model's `lora.max_loras`, from the
  profiles (`ModelView`) whose names `declared_name_owners` gave them;
- `AdapterTable`: those routes with the scheduler's `adapters/<model>`
  documents (`ModelAdapters`): which endpoints hold an adapter, what an
  endpoint holds, and the scheduler's record of a load the engine refused;
- `AdapterWant`: what the balancer reads for one request (the endpoints that
  hold it, and the load time a replica that does not would add);
- `eviction_victim`: which adapter a full replica gives up for an on-demand
  load, so that no replica is asked to hold more than `max_loras`;
  `on_demand_victim` keeps on-demand loads in the slot the plan leaves to
  routers when it could not place every adapter;
- `engine_model_name`: the `model` value the engine expects for an adapter
  (`ModelAdapters.request_model`: vLLM takes the adapter's name, SGLang
  `<served>:<adapter>`);
- `DemandWindow`: requests per second per adapter over a sliding window, what
  the router reports to the scheduler (`adapter-demand/<model>/<router>`).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from caravan_llm.common.contract import (
    AdapterFailure,
    LoraView,
    ModelAdapters,
    ModelView,
    nomad_service_id,
)

# What a router assumes an adapter load costs before it has timed one (seconds).
DEFAULT_ADAPTER_LOAD_S = 1.0
# Weight of a new observation in the learned load time.
LOAD_TIME_ALPHA = 0.3


@dataclass(frozen=True, slots=True)
class AdapterRoute:
    """One declared adapter: the model that serves it and how to load it."""

    name: str  # the OpenAI `model` value clients send
    model: str  # the base model's profile name (its KV key)
    served: str  # the base model's served name (where its endpoints are)
    source: str | None  # folder on the nodes or Hugging Face id; None: not said
    max_loras: int


@dataclass(frozen=True, slots=True)
class AdapterWant:
    """What the balancer reads of a request for an adapter."""

    name: str
    # Endpoint ids whose engine holds the adapter now (the scheduler's document,
    # plus what this router loaded since).
    holders: frozenset[str]
    # Seconds a replica that does not hold it adds to the time to first token.
    load_s: float

    def holds(self, endpoint_id: str) -> bool:
        return endpoint_id in self.holders


def adapter_routes(
    views: Mapping[str, ModelView], owners: Mapping[str, str]
) -> dict[str, AdapterRoute]:
    """Each adapter a model owns (`declared_name_owners`), by adapter name."""
    routes: dict[str, AdapterRoute] = {}
    for model, view in sorted(views.items()):
        if not view.adapters or any(owners.get(name) != model for name in view.declared_names):
            continue
        limits = view.lora or LoraView()
        for adapter in view.adapters:
            routes[adapter.name] = AdapterRoute(
                name=adapter.name,
                model=model,
                served=view.served_name,
                source=adapter.source,
                max_loras=limits.max_loras,
            )
    return routes


@dataclass(frozen=True, slots=True)
class AdapterTable:
    """Declared adapters and where the scheduler's documents say each is held."""

    routes: Mapping[str, AdapterRoute] = field(default_factory=lambda: MappingProxyType({}))
    # The scheduler's `adapters/<model>` documents, by profile name.
    documents: Mapping[str, ModelAdapters] = field(default_factory=lambda: MappingProxyType({}))

    def route(self, name: str) -> AdapterRoute | None:
        return self.routes.get(name)

    def adapters_of(self, model: str) -> tuple[AdapterRoute, ...]:
        """The adapters of one model (profile name), by name."""
        return tuple(r for _, r in sorted(self.routes.items()) if r.model == model)

    def holders(self, route: AdapterRoute) -> frozenset[str]:
        """The endpoint ids (Nomad's service ids) whose engine holds the adapter."""
        document = self.documents.get(route.model)
        if document is None:
            return frozenset()
        return frozenset(
            nomad_service_id(alloc_id, route.model) for alloc_id in document.holders(route.name)
        )

    def held_on(self, model: str, endpoint_id: str) -> frozenset[str]:
        """The adapters the document says one endpoint of the model holds."""
        document = self.documents.get(model)
        if document is None:
            return frozenset()
        for replica in document.replicas:
            if nomad_service_id(replica.alloc_id, model) == endpoint_id:
                return frozenset(replica.loaded)
        return frozenset()

    def desired_on(self, model: str, endpoint_id: str) -> frozenset[str]:
        """The adapters the scheduler's plan wants one endpoint of the model to hold."""
        document = self.documents.get(model)
        if document is None:
            return frozenset()
        for replica in document.replicas:
            if nomad_service_id(replica.alloc_id, model) == endpoint_id:
                return frozenset(replica.desired)
        return frozenset()

    def on_demand_slots(self, route: AdapterRoute) -> int:
        """Slots per replica the plan leaves to routers (scheduler/lora/plan.py's
        `on_demand_slots`): one when the plan could not place every adapter."""
        document = self.documents.get(route.model)
        if document is None or not document.unplaced or route.max_loras < 2:
            return 0
        return 1

    def copies(self, model: str) -> dict[str, int]:
        """On how many replicas each adapter of the model is held."""
        counts: dict[str, int] = {}
        document = self.documents.get(model)
        for replica in () if document is None else document.replicas:
            for name in replica.loaded:
                counts[name] = counts.get(name, 0) + 1
        return counts

    def failure(self, route: AdapterRoute) -> AdapterFailure | None:
        """The scheduler's record of an engine refusing this adapter's source, if any."""
        document = self.documents.get(route.model)
        if document is None:
            return None
        for failed in document.failed:
            if failed.adapter == route.name and failed.source == route.source:
                return failed
        return None

    def request_model(self, route: AdapterRoute) -> str:
        """The model's `request_model` template (the scheduler's document; vLLM's by default)."""
        document = self.documents.get(route.model)
        return "{adapter}" if document is None else document.request_model


def engine_model_name(template: str, route: AdapterRoute) -> str:
    """The `model` value the engine takes for the adapter (`ModelAdapters.request_model`)."""
    return template.replace("{served}", route.served).replace("{adapter}", route.name)


def eviction_victim(
    held: Iterable[str],
    *,
    max_loras: int,
    copies: Mapping[str, int],
    demand: Mapping[str, float],
) -> str | None:
    """The adapter a replica holding `held` unloads to make room for one more; None: room.

    An adapter held on other replicas too goes first (nothing becomes
    unavailable), the one with the most copies; then the least asked for by
    this router's window, then by name (deterministic).
    """
    names = sorted(set(held))
    if len(names) < max_loras:
        return None
    return min(names, key=lambda n: (-copies.get(n, 1), demand.get(n, 0.0), n))


def on_demand_victim(
    held: Iterable[str],
    desired: Iterable[str],
    *,
    max_loras: int,
    reserved: int,
    copies: Mapping[str, int],
    demand: Mapping[str, float],
) -> str | None:
    """The adapter to unload before an on-demand load on a replica; None: there is room.

    When the plan leaves `reserved` slots to routers, a router's loads stay in
    them: an adapter held beyond the plan's (a router's earlier on-demand
    load) makes way, the least asked for first, even while the replica has a
    free slot, so that the plan's slots and the routers' never overlap. With
    no such adapter and a free slot, nothing goes. Otherwise (nothing
    reserved, or the documents behind): `eviction_victim`.
    """
    names = set(held)
    extras = sorted(names - set(desired))
    if reserved > 0 and len(extras) >= reserved:
        return min(extras, key=lambda n: (demand.get(n, 0.0), n))
    if reserved > 0 and len(names) < max_loras:
        return None
    return eviction_victim(names, max_loras=max_loras, copies=copies, demand=demand)


def learned_load_s(previous: float | None, observed_s: float) -> float:
    """The load time a router assumes next, after timing one load."""
    if previous is None:
        return observed_s
    return previous + LOAD_TIME_ALPHA * (observed_s - previous)


@dataclass(slots=True)
class DemandWindow:
    """Requests for each adapter over the last `window_s` seconds; `rates` per second.

    Bounded: counts are kept per whole second, at most `window_s` of them per
    adapter; adapters with none left in the window are forgotten.
    """

    window_s: float = 60.0
    # (model, adapter) -> [second, requests in it], oldest first.
    _seen: dict[tuple[str, str], deque[list[int]]] = field(default_factory=dict)

    def note(self, model: str, adapter: str, now: float) -> None:
        second = math.floor(now)
        buckets = self._seen.setdefault((model, adapter), deque())
        if buckets and buckets[-1][0] == second:
            buckets[-1][1] += 1
        else:
            buckets.append([second, 1])

    def rates(self, now: float) -> dict[str, dict[str, float]]:
        """Model -> adapter -> requests per second in the window (only adapters seen)."""
        horizon = now - self.window_s
        out: dict[str, dict[str, float]] = {}
        for key in list(self._seen):
            buckets = self._seen[key]
            while buckets and buckets[0][0] < horizon:
                buckets.popleft()
            if not buckets:
                del self._seen[key]
                continue
            model, adapter = key
            out.setdefault(model, {})[adapter] = sum(c for _, c in buckets) / self.window_s
        return out
