"""LoRA adapters on demand: the router loads a request's adapter where it sends it (I/O).

A request whose `model` is an adapter's name (issue 25) goes to a replica of
its base model (`caravan_llm.router.core.adapters`). When the replica the
balancer picked does not hold the adapter (none does, or a holder was that
much busier), `AdapterLoader.ensure` has the engine load it first, through
the engine's runtime route that the scheduler's `adapters/<model>` document
names (`load_path`), with the model's engine key, from the adapter's source
in the profile. The request is held meanwhile, with its lease, up to
`timeout_s`; requests for the same adapter on the same replica wait for the
same load, and loads on one replica run one at a time (each decides what to
unload from what the one before left). A replica already holding
`max_loras` adapters first unloads one (`eviction_victim`: a copy held
elsewhere too, else the one this router saw least demand for), so no
replica is asked to hold more than the profile allows. When the plan could
not place every adapter it leaves one slot per replica to routers
(scheduler/lora/plan.py): an on-demand load then replaces the adapter held
there beyond the plan, if any (`on_demand_victim`), and never one the plan
placed while the replica has room.

How this agrees with the scheduler's plan (scheduler/lora/apply.py, which
loads and unloads by its own plan every reconcile pass):

- what this router loaded is routed to at once (an overlay on the document)
  until a document of the scheduler's lists it there, and what it unloaded
  is not routed to until one no longer does: a document read before the load
  or unload does not undo it (`_view_changed`). An overlay entry older than
  `confirm_after_s` goes, and the next request loads it again (the engine
  answers "already loaded", which counts as success, or loads it back if the
  plan took it). An engine that answers 404 for an adapter it was thought to
  hold (`not_held`: unloaded since) is not routed to for it either, and the
  request is tried again (the proxy's `AdapterNotHeld`);
- every request for an adapter is counted (`DemandWindow`) and written to
  `adapter-demand/<model>/<router>` (`AdapterDemandWriter`); the scheduler sums
  those into the plan's weights, so an adapter asked for has at least one
  copy, and the plan keeps a copy where it is held now whenever its counts
  allow: the copy the router loaded stays where the router put it.

Failures: an engine that refuses the load (vLLM's 404 for a path with no
adapter) fails the request with `AdapterUnavailable` naming the adapter and
the engine's answer, not retryable, and further requests for that adapter
and source are answered the same at once for `failure_backoff_s`; the
scheduler's own record of a refused load (the document's `failed`) is
answered the same way while no replica holds the adapter. A timeout or an
unreachable engine is retryable. Other models and adapters are untouched.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import aiohttp

from caravan_llm.common.contract import (
    AdapterDemandRecord,
    KVLayout,
    ModelAdapters,
    encode_adapter_demand,
)
from caravan_llm.common.errors import HashiError
from caravan_llm.router.core.adapters import (
    DEFAULT_ADAPTER_LOAD_S,
    AdapterRoute,
    AdapterWant,
    DemandWindow,
    learned_load_s,
    on_demand_victim,
)
from caravan_llm.router.core.endpoints import Endpoint
from caravan_llm.router.core.errors import AdapterUnavailable
from caravan_llm.router.core.routing_state import RoutingState
from caravan_llm.router.edge.engine_answers import engine_message
from caravan_llm.router.feeds.engine_keys import EngineKeySource

log = logging.getLogger("router.adapter_loader")

# How much of an engine's refusal the error keeps.
MAX_REASON_CHARS = 300
# vLLM answers a second load of a loaded name 400 with this in its message.
_ALREADY_LOADED = "has already been loaded"


@dataclass(frozen=True, slots=True)
class _Refusal:
    reason: str
    retryable: bool
    until: float


class _LoadFailed(Exception):
    def __init__(self, reason: str, *, retryable: bool) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retryable = retryable


class AdapterLoader:
    """Loads adapters on demand and tells the balancer where each is held (module docstring)."""

    def __init__(
        self,
        state: RoutingState,
        *,
        session: Callable[[], aiohttp.ClientSession],
        engine_keys: EngineKeySource | None,
        timeout_s: float,
        failure_backoff_s: float,
        confirm_after_s: float,
        retry_after_s: int,
        demand_window_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._state = state
        self._session = session
        self._engine_keys = engine_keys
        self._timeout_s = timeout_s
        self._failure_backoff_s = failure_backoff_s
        self._confirm_after_s = confirm_after_s
        self._retry_after_s = retry_after_s
        self._clock = clock
        self.demand = DemandWindow(window_s=demand_window_s)
        # Endpoint id -> adapter -> when this router loaded it there.
        self._overlay: dict[str, dict[str, float]] = {}
        # Endpoint id -> adapters this router unloaded there (the document may still list them).
        # Endpoint id -> adapter -> when this router unloaded it there (or the engine said
        # it does not hold it); the document may still list it.
        self._evicted: dict[str, dict[str, float]] = {}
        self._documents: Mapping[str, ModelAdapters] = state.view.adapters.documents
        self._inflight: dict[tuple[str, str], asyncio.Task[float]] = {}
        # Endpoint id -> the lock its loads take in turn (`_endpoint_lock`).
        self._endpoint_locks: dict[str, asyncio.Lock] = {}
        self._refusals: dict[tuple[str, str | None], _Refusal] = {}
        # The load time this router last learned, per model.
        self._load_s: dict[str, float] = {}
        state.subscribe(self._view_changed)

    # -- what the proxy and the balancer read ------------------------------------------

    def route(self, model: str) -> AdapterRoute | None:
        """The adapter a request's `model` names; None: a model's served name, or unknown."""
        view = self._state.view
        if model in view.profiles:
            return None
        return view.adapters.route(model)

    def want(self, route: AdapterRoute, now: float) -> AdapterWant:
        """The balancer's view of a request for the adapter; counts the request as demand."""
        self.demand.note(route.model, route.name, now)
        holders = set(self._doc_holders(route))
        for endpoint_id, loaded in self._overlay.items():
            at = loaded.get(route.name)
            if at is not None and now - at < self._confirm_after_s:
                holders.add(endpoint_id)
        return AdapterWant(
            name=route.name,
            holders=frozenset(holders),
            load_s=self._load_s.get(route.model, DEFAULT_ADAPTER_LOAD_S),
        )

    def refusal(self, route: AdapterRoute, now: float) -> AdapterUnavailable | None:
        """The error to answer at once: a recent refused load of this source, held nowhere."""
        if self.want_holders(route):
            return None
        own = self._refusals.get((route.name, route.source))
        if own is not None and now < own.until:
            return self._error(route, own.reason, retryable=own.retryable)
        recorded = self._state.view.adapters.failure(route)
        if recorded is not None:
            return self._error(route, recorded.reason, retryable=False)
        if route.source is None:
            return self._error(route, "the profile names no source for it", retryable=False)
        return None

    def figures(self, model: str, seen: Mapping[str, float]) -> dict[str, float]:
        """The rates to report for a model: every adapter it declares, 0 for those not asked.

        A zero is a figure (this router saw none), unlike an absent adapter,
        which the plan weighs as the mean of the others.
        """
        if not seen:
            return {}
        declared = {route.name: 0.0 for route in self._state.view.adapters.adapters_of(model)}
        return {**declared, **{name: round(rate, 6) for name, rate in seen.items()}}

    def refusal_of(self, want: AdapterWant, now: float) -> AdapterUnavailable | None:
        """`refusal` for the adapter a request's features name."""
        route = self._state.view.adapters.route(want.name)
        return None if route is None else self.refusal(route, now)

    def want_holders(self, route: AdapterRoute) -> bool:
        """Whether any replica holds the adapter (the document's or this router's loads)."""
        if self._doc_holders(route):
            return True
        return any(route.name in loaded for loaded in self._overlay.values())

    def not_held(self, endpoint_id: str, adapter: str) -> None:
        """The endpoint's engine answered that it does not hold the adapter: route as if
        it did not until the scheduler's next document says otherwise."""
        self._overlay.get(endpoint_id, {}).pop(adapter, None)
        self._evicted.setdefault(endpoint_id, {})[adapter] = self._clock()
        log.info("adapter_not_held", extra={"adapter": adapter, "endpoint": endpoint_id})

    # -- loading ---------------------------------------------------------------------------

    async def ensure_want(self, endpoint: Endpoint, want: AdapterWant) -> float | None:
        """`ensure` for the adapter a request's features name (the admission gate's call)."""
        if want.holds(endpoint.id):
            return None
        route = self._state.view.adapters.route(want.name)
        if route is None:
            # Its profile went away while the request waited: the endpoint serves the base.
            return None
        return await self.ensure(endpoint, route)

    async def ensure(self, endpoint: Endpoint, route: AdapterRoute) -> float | None:
        """Make the endpoint's engine hold the adapter; the seconds it took, None if held.

        Raises AdapterUnavailable when it cannot (module docstring).
        """
        now = self._clock()
        loaded_at = self._overlay.get(endpoint.id, {}).get(route.name)
        if endpoint.id in self._doc_holders(route):
            return None
        if loaded_at is not None and now - loaded_at < self._confirm_after_s:
            return None
        key = (endpoint.id, route.name)
        task = self._inflight.get(key)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._load(endpoint, route))
            self._inflight[key] = task
            task.add_done_callback(lambda _: self._inflight.pop(key, None))
        try:
            # Shielded: one waiter leaving (client gone) must not cancel the others' load.
            return await asyncio.shield(task)
        except _LoadFailed as exc:
            raise self._error(route, exc.reason, retryable=exc.retryable) from None

    async def _load(self, endpoint: Endpoint, route: AdapterRoute) -> float:
        document = self._state.view.adapters.documents.get(route.model)
        if document is None:
            raise _LoadFailed(
                "no replica holds it yet (the scheduler has not published its adapters)",
                retryable=True,
            )
        load_path = document.load_path
        if load_path is None or route.source is None:
            raise _LoadFailed(
                "no replica holds it and its engine does not load adapters at run time",
                retryable=True,
            )
        started = self._clock()
        victim: str | None = None
        try:
            async with asyncio.timeout(self._timeout_s), self._endpoint_lock(endpoint.id):
                victim = await self._make_room(endpoint, route, document)
                try:
                    await self._post(
                        endpoint, load_path, {"lora_name": route.name, "lora_path": route.source}
                    )
                except _LoadFailed:
                    await self._restore(endpoint, victim, load_path)
                    raise
                # Counted as held at once, so that the next load here makes room for it.
                self._loaded_here(endpoint.id, route.name)
        except TimeoutError:
            raise self._remember(
                route,
                _LoadFailed(f"the load took longer than {self._timeout_s:g} s", retryable=True),
            ) from None
        except _LoadFailed as exc:
            raise self._remember(route, exc) from None
        took = self._clock() - started
        self._loaded_here(endpoint.id, route.name)
        self._refusals.pop((route.name, route.source), None)
        self._load_s[route.model] = learned_load_s(self._load_s.get(route.model), took)
        log.info(
            "adapter_loaded",
            extra={
                "model": route.model,
                "adapter": route.name,
                "endpoint": endpoint.id,
                "load_s": round(took, 6),
            },
        )
        return took

    def _endpoint_lock(self, endpoint_id: str) -> asyncio.Lock:
        """One load at a time per endpoint: two loads deciding on the same room at once
        would both see a free slot (or the same victim) and ask for one adapter too many."""
        lock = self._endpoint_locks.get(endpoint_id)
        if lock is None:
            lock = self._endpoint_locks[endpoint_id] = asyncio.Lock()
        return lock

    async def _restore(self, endpoint: Endpoint, victim: str | None, load_path: str) -> None:
        """Load back the adapter unloaded for a load that failed (best effort)."""
        route = None if victim is None else self._state.view.adapters.route(victim)
        if route is None or route.source is None:
            return
        try:
            await self._post(
                endpoint, load_path, {"lora_name": route.name, "lora_path": route.source}
            )
            self._loaded_here(endpoint.id, route.name)
        except _LoadFailed as exc:
            log.warning(
                "adapter_restore_failed",
                extra={"adapter": route.name, "endpoint": endpoint.id, "error": exc.reason},
            )

    async def _make_room(
        self, endpoint: Endpoint, route: AdapterRoute, document: ModelAdapters | None
    ) -> str | None:
        """Unload one adapter from a replica that holds `max_loras` already; its name."""
        table = self._state.view.adapters
        held = (
            set(table.held_on(route.model, endpoint.id)) - set(self._evicted.get(endpoint.id, {}))
        ) | set(self._overlay.get(endpoint.id, {}))
        held.discard(route.name)
        copies = table.copies(route.model)
        for gone in self._evicted.values():
            for name in gone:
                copies[name] = copies.get(name, 1) - 1
        for loaded in self._overlay.values():
            for name in loaded:
                copies[name] = copies.get(name, 0) + 1
        victim = on_demand_victim(
            held,
            table.desired_on(route.model, endpoint.id),
            max_loras=route.max_loras,
            reserved=table.on_demand_slots(route),
            copies=copies,
            demand=self.demand.rates(self._clock()).get(route.model, {}),
        )
        unload_path = None if document is None else document.unload_path
        if victim is None or unload_path is None:
            return None
        try:
            await self._post(endpoint, unload_path, {"lora_name": victim})
        except _LoadFailed as exc:
            # Not loaded after all (the document was behind): the room is there.
            if "404" not in exc.reason:
                raise
        self._overlay.get(endpoint.id, {}).pop(victim, None)
        self._evicted.setdefault(endpoint.id, {})[victim] = self._clock()
        log.info(
            "adapter_evicted",
            extra={
                "model": route.model,
                "adapter": victim,
                "for_adapter": route.name,
                "endpoint": endpoint.id,
            },
        )
        return victim

    async def _post(self, endpoint: Endpoint, path: str, body: dict[str, str]) -> None:
        key = None if self._engine_keys is None else self._engine_keys.key_for(endpoint.service)
        headers = {} if key is None else {"Authorization": f"Bearer {key}"}
        try:
            async with self._session().post(
                endpoint.base_url + path, json=body, headers=headers
            ) as response:
                data = await response.read()
                status = response.status
        except (aiohttp.ClientError, OSError) as exc:
            raise _LoadFailed(
                f"the replica did not answer ({type(exc).__name__})", retryable=True
            ) from None
        if status == 200:
            return
        message = _message(data)
        if status == 400 and _ALREADY_LOADED in message:
            return
        # 4xx other than 408/429: the engine refused what it was given (a bad source).
        retryable = status in {408, 429} or status >= 500
        raise _LoadFailed(f"the engine answered HTTP {status}: {message}", retryable=retryable)

    def _remember(self, route: AdapterRoute, failure: _LoadFailed) -> _LoadFailed:
        self._refusals[route.name, route.source] = _Refusal(
            failure.reason,
            failure.retryable,
            self._clock() + (0.0 if failure.retryable else self._failure_backoff_s),
        )
        log.warning(
            "adapter_load_failed",
            extra={
                "model": route.model,
                "adapter": route.name,
                "error": failure.reason,
                "retryable": failure.retryable,
            },
        )
        return failure

    def _error(self, route: AdapterRoute, reason: str, *, retryable: bool) -> AdapterUnavailable:
        return AdapterUnavailable(
            route.name,
            route.served,
            reason,
            retryable=retryable,
            retry_after_s=self._retry_after_s,
        )

    def _doc_holders(self, route: AdapterRoute) -> frozenset[str]:
        """The document's holders, less the endpoints this router unloaded it from since."""
        holders = self._state.view.adapters.holders(route)
        return frozenset(e for e in holders if route.name not in self._evicted.get(e, ()))

    def _loaded_here(self, endpoint_id: str, adapter: str) -> None:
        self._overlay.setdefault(endpoint_id, {})[adapter] = self._clock()
        self._evicted.get(endpoint_id, {}).pop(adapter, None)

    # -- the scheduler's documents -----------------------------------------------------------

    def _view_changed(self) -> None:
        """A new document for a model says what its engines hold: the overlay entries and
        unloads it confirms go, and those older than `confirm_after_s`.

        One it does not confirm stays (until then): the scheduler read the engine
        before this router's load or unload, so the document is behind it, and
        forgetting the load would let the next one here see a free slot that is not.
        """
        table = self._state.view.adapters
        documents = table.documents
        if documents is self._documents:
            return
        changed = {
            model
            for model in set(documents) | set(self._documents)
            if documents.get(model) != self._documents.get(model)
        }
        self._documents = documents
        if not changed:
            return
        now = self._clock()

        def settled(endpoint_id: str, adapter: str, at: float, *, held: bool) -> bool:
            route = table.route(adapter)
            if route is None or route.model not in changed:
                return route is None
            listed = adapter in table.held_on(route.model, endpoint_id)
            return listed == held or now - at >= self._confirm_after_s

        for entries, held in ((self._overlay, True), (self._evicted, False)):
            for endpoint_id in list(entries):
                names = entries[endpoint_id]
                for name, at in list(names.items()):
                    if settled(endpoint_id, name, at, held=held):
                        del names[name]
                if not names:
                    del entries[endpoint_id]


def _message(data: bytes) -> str:
    """The engine's error message (its own when it sent one), bounded and on one line."""
    found, _ = engine_message(data)
    text = found or data.decode("utf-8", "replace")
    return " ".join(text.split())[:MAX_REASON_CHARS]


class DemandStore(Protocol):
    async def kv_put(self, key: str, value: bytes | str) -> bool: ...


class AdapterDemandWriter:
    """Writes this router's adapter demand to `adapter-demand/<model>/<router>` every interval."""

    def __init__(
        self,
        loader: AdapterLoader,
        store: DemandStore,
        layout: KVLayout,
        *,
        router_id: str,
        interval_s: float,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._loader = loader
        self._store = store
        self._layout = layout
        self.router_id = router_id
        self._interval_s = interval_s
        self._clock = clock
        self._wall_clock = wall_clock
        self._last: dict[str, dict[str, float]] = {}

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            await self.write_once()

    async def write_once(self) -> None:
        """Write each model's rates (rewritten every time, so the record stays fresh);
        a model whose adapters were asked for no more is written once with none."""
        rates = self._loader.demand.rates(self._clock())
        for model in sorted(set(rates) | set(self._last)):
            current = self._loader.figures(model, rates.get(model, {}))
            record = AdapterDemandRecord(
                at=round(self._wall_clock(), 3), router=self.router_id, requests_per_s=current
            )
            try:
                await self._store.kv_put(
                    self._layout.adapter_demand_key(model, self.router_id),
                    encode_adapter_demand(record),
                )
            except HashiError as exc:
                log.warning("adapter_demand_failed", extra={"model": model, "error": str(exc)})
                continue
            if current:
                self._last[model] = current
            else:
                self._last.pop(model, None)
