"""Wiring: build the router's objects, its aiohttp app, and own its background tasks.

    app = create_app(settings, consul=consul, registry=CollectorRegistry())
    runner = app_runner(app, settings)          # guarded connections (edge/http_limits.py)
    await runner.setup(); await web.TCPSite(runner, host, port).start()
    # optional: app_runner(create_admin_app(app[RUNTIME]), settings, listener="admin")
    await app[RUNTIME].register(bound_port)      # Consul service `caravan-router`
    ...
    await app[RUNTIME].deregister()              # shutdown: leave Consul first,
    await runner.cleanup()                       # then stop accepting, let streams finish

The long-lived tasks (discovery, load scraper, KV feed, admission tick,
demand writer) run in one `asyncio.TaskGroup` inside one supervisor task started
from `cleanup_ctx` and cancelled when the app is cleaned up, after in-flight
requests had their `shutdown_timeout_s`; the shared `aiohttp.ClientSession`
closes last.

Every request passes the request guard (`caravan_llm.router.edge.request_guard`: keys, rate
limits, priority grants, body limits, OpenAI-shaped errors) before its
handler; the guard parses each body once and hands the proxy the result
(`caravan_llm.router.edge.parsed_request`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import AsyncIterator, Callable
from typing import Protocol

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from caravan_llm.common.consul_api import HttpCheck, ServiceRegistration
from caravan_llm.common.contract import ROUTER_SERVICE, RouterMetaKey, router_metrics_addr
from caravan_llm.common.preflight import Preflight
from caravan_llm.common.process_metrics import register_process_metrics
from caravan_llm.router.core.breaker import phase_at
from caravan_llm.router.core.endpoints import CheckStatus
from caravan_llm.router.core.kv_index import KvIndex
from caravan_llm.router.core.routing_state import RoutingState
from caravan_llm.router.edge.adapter_loader import AdapterDemandWriter, AdapterLoader
from caravan_llm.router.edge.admission_gate import AdmissionGate, DemandSignal, DemandStore
from caravan_llm.router.edge.api_keys import KeyRing, build_key_ring, load_key_file
from caravan_llm.router.edge.http_limits import (
    ConnectionGuard,
    GuardedAppRunner,
    default_connection_limit,
)
from caravan_llm.router.edge.prompt_digests import PromptDigester, PromptTokens
from caravan_llm.router.edge.proxy import Proxy, RequestLog, log_request
from caravan_llm.router.edge.request_guard import RequestGuard
from caravan_llm.router.edge.routes import ROUTES
from caravan_llm.router.feeds.discovery import Discovery, DiscoveryConsul
from caravan_llm.router.feeds.engine_keys import EngineKeys, VariableReader
from caravan_llm.router.feeds.kv_feed import KvFeed
from caravan_llm.router.feeds.load_scraper import LoadScraper
from caravan_llm.router.feeds.model_failures import ModelFailures, watch_failures
from caravan_llm.router.feeds.preflight import PreflightConsul, router_capabilities
from caravan_llm.router.metrics import EndpointGauge, RouterMetrics, RouterStateView
from caravan_llm.router.settings import RouterSettings

# Named as before the router's sub-packages: the logger is a field of every log line.
log = logging.getLogger("router.app")

# Routers are control-plane services, not model replicas: never tag them `caravan`.
ROUTER_TAG = "caravan-control"
# Consul removes a router that stayed critical this long (it crashed without deregistering).
_DEREGISTER_CRITICAL_AFTER_S = 60.0
_HEALTH_CHECK_INTERVAL_S = 5.0
_HEALTH_CHECK_TIMEOUT_S = 2.0
_WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::", "[::]"})  # noqa: S104 - compared, never bound
# The admin listener serves two routes to a monitoring system: a few connections suffice.
_ADMIN_MAX_CONNECTIONS = 64


class RouterConsul(DiscoveryConsul, PreflightConsul, DemandStore, Protocol):
    """Everything the router asks of Consul (implemented by
    `caravan_llm.common.consul_api.ConsulClient`)."""

    async def agent_service_register(
        self, registration: ServiceRegistration, *, replace_existing_checks: bool = False
    ) -> None: ...

    async def agent_service_deregister(self, service_id: str) -> bool: ...


def advertise_address(settings: RouterSettings) -> str:
    """The address other machines reach this router at."""
    if settings.advertise_address:
        return settings.advertise_address
    if settings.host in _WILDCARD_HOSTS:
        return socket.gethostname()
    return settings.host


def router_service_id(address: str, port: int) -> str:
    """The same id for the same router address and port, so a restart replaces its entry."""
    return f"{ROUTER_SERVICE}-{address}-{port}"


def router_registration(
    settings: RouterSettings, port: int, admin_port: int | None
) -> ServiceRegistration:
    """The router's service in Consul, its HTTP check on /health (on the admin port if any).

    Shared by a single router process and the supervisor of `--workers N`.
    """
    address = advertise_address(settings)
    check_address, check_port = address, port
    if admin_port is not None:
        check_port = admin_port
        if settings.admin_host not in _WILDCARD_HOSTS:
            check_address = settings.admin_host
    host = f"[{check_address}]" if ":" in check_address else check_address
    return ServiceRegistration(
        name=ROUTER_SERVICE,
        service_id=router_service_id(address, port),
        address=address,
        port=port,
        tags=(ROUTER_TAG,),
        # The autoscaler reads the router's queues from /metrics: say where it
        # is when it is not on the public port.
        meta=(
            {RouterMetaKey.METRICS_ADDR: router_metrics_addr(check_address, check_port)}
            if admin_port is not None
            else {}
        ),
        checks=(
            HttpCheck(
                url=f"http://{host}:{check_port}/health",
                interval_s=_HEALTH_CHECK_INTERVAL_S,
                timeout_s=_HEALTH_CHECK_TIMEOUT_S,
                deregister_critical_after_s=_DEREGISTER_CRITICAL_AFTER_S,
                name="router health",
            ),
        ),
    )


class RouterRuntime:
    """The router's live objects, reachable from the app (`app[RUNTIME]`) and from tests."""

    def __init__(
        self,
        settings: RouterSettings,
        consul: RouterConsul,
        registry: CollectorRegistry,
        *,
        clock: Callable[[], float],
        wall_clock: Callable[[], float],
        request_log: RequestLog | None = None,
        keys: KeyRing | None = None,
        nomad: VariableReader | None = None,
        prompt_tokens: PromptTokens | None = None,
    ) -> None:
        self.settings = settings
        self.consul = consul
        # The engines' keys, when the router has a Nomad to read them from.
        self.engine_keys = (
            EngineKeys(nomad, wait_s=settings.consul_wait_s)
            if nomad is not None and settings.engine_api_keys
            else None
        )
        # Do the tokens hold every grant the router needs? (router/feeds/preflight.py)
        self.preflight = Preflight(
            "router",
            router_capabilities(
                settings.kv_layout, consul, nomad if self.engine_keys is not None else None
            ),
            clock=wall_clock,
        )
        self.clock = clock
        self.state = RoutingState(KvIndex(stale_after_s=settings.kv_events_stale_after_s))
        self.metrics = RouterMetrics(registry)
        self.service_id = router_service_id(advertise_address(settings), settings.port)
        # A worker of `caravan router --workers N` writes its demand signals under its own
        # name (`set_worker`): each counts only the requests it got.
        self.worker_suffix = ""
        self.demand = DemandSignal(
            consul,
            settings.kv_layout,
            router_id=self.service_id,
            interval_s=settings.demand_interval_s,
            metrics=self.metrics,
            clock=clock,
            wall_clock=wall_clock,
        )
        self.failures = ModelFailures()
        self._session: aiohttp.ClientSession | None = None
        # LoRA adapters: loaded on demand where requests go; their demand reported.
        self.adapters = AdapterLoader(
            self.state,
            session=self.session,
            engine_keys=self.engine_keys,
            timeout_s=settings.adapter_load_timeout_s,
            failure_backoff_s=settings.adapter_failure_backoff_s,
            confirm_after_s=settings.adapter_confirm_after_s,
            retry_after_s=settings.retry_after_s,
            demand_window_s=settings.adapter_demand_window_s,
            clock=clock,
        )
        self.adapter_demand = AdapterDemandWriter(
            self.adapters,
            consul,
            settings.kv_layout,
            router_id=self.service_id,
            interval_s=settings.adapter_demand_interval_s,
            clock=clock,
            wall_clock=wall_clock,
        )
        self.gate = AdmissionGate(
            self.state,
            policy=settings.policy,
            balancer=settings.balancer_config(),
            admission=settings.admission_policy(),
            demand=self.demand,
            metrics=self.metrics,
            cold_start_keepalive_s=settings.cold_start_keepalive_s,
            clock=clock,
            failures=self.failures,
            adapters=self.adapters,
        )
        self.discovery = Discovery(
            consul,
            self.state,
            layout=settings.kv_layout,
            metrics=self.metrics,
            wait_s=settings.consul_wait_s,
            clock=clock,
            allow_unverified=settings.allow_unverified_endpoints,
        )
        # Each placed replica's KV relay stream into state.kv (the exact prefix index).
        self.kv_feed = (
            KvFeed(
                self.session,
                self.state,
                engine_keys=self.engine_keys,
                metrics=self.metrics,
                stale_after_s=settings.kv_events_stale_after_s,
                connect_timeout_s=settings.connect_timeout_s,
                backoff_min_s=settings.kv_events_backoff_min_s,
                backoff_max_s=settings.kv_events_backoff_max_s,
                clock=clock,
            )
            if settings.kv_events
            else None
        )
        self.keys = keys if keys is not None else key_ring(settings)
        self.request_guard = RequestGuard(
            keys=self.keys,
            metrics=self.metrics,
            default_priority=settings.default_priority,
            trust_priority_header=settings.trust_priority_header,
            max_body_bytes=settings.max_body_bytes,
            body_read_timeout_s=settings.body_read_timeout_s,
            max_json_depth=settings.max_json_depth,
            clock=clock,
        )
        # The port /health is checked on: the admin listener's when there is one.
        self.admin_port: int | None = None
        self.proxy = Proxy(
            settings,
            state=self.state,
            gate=self.gate,
            session=self.session,
            metrics=self.metrics,
            clock=clock,
            wall_clock=wall_clock,
            request_log=request_log or log_request,
            engine_keys=self.engine_keys,
            adapters=self.adapters,
            digester=(
                PromptDigester(
                    prompt_tokens,
                    self.state,
                    self.engine_keys,
                    budget_s=settings.exact_prefix_budget_ms / 1000,
                    metrics=self.metrics,
                )
                if prompt_tokens is not None and self.kv_feed is not None
                else None
            ),
        )
        self.metrics.add_state_collector(self.state_view)
        self.shutting_down = False
        self.registered_id: str | None = None
        self._supervisor: asyncio.Task[None] | None = None

    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("the router's client session is not open (app not started)")
        return self._session

    # -- lifecycle -----------------------------------------------------------------------

    async def lifecycle(self, _app: web.Application) -> AsyncIterator[None]:
        """cleanup_ctx: open the client pool and start the background tasks; undo both."""
        connector = aiohttp.TCPConnector(
            limit=self.settings.connector_limit,
            limit_per_host=0,
            enable_cleanup_closed=True,
            keepalive_timeout=self.settings.upstream_keepalive_s,
        )
        self._session = aiohttp.ClientSession(connector=connector, raise_for_status=False)
        self._supervisor = asyncio.create_task(self._supervise(), name="router-supervisor")
        try:
            yield
        finally:
            self._supervisor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._supervisor
            with contextlib.suppress(Exception):
                await self.deregister()
            await self._session.close()

    async def _supervise(self) -> None:
        scraper = LoadScraper(
            self.session(),
            self.state,
            interval_s=self.settings.scrape_interval_s,
            timeout_s=self.settings.scrape_timeout_s,
            metrics=self.metrics,
            clock=self.clock,
            engine_keys=self.engine_keys,
            cost=self.settings.balancer_config().cost,
        )
        try:
            async with asyncio.TaskGroup() as group:
                group.create_task(self.preflight.run(), name="router-preflight")
                if self.engine_keys is not None:
                    group.create_task(self.engine_keys.run(), name="router-engine-keys")
                group.create_task(self.discovery.run(), name="router-discovery")
                group.create_task(scraper.run(), name="router-load-scraper")
                if self.kv_feed is not None:
                    group.create_task(self.kv_feed.run(), name="router-kv-feed")
                group.create_task(self.gate.run(), name="router-admission-tick")
                group.create_task(self.demand.run(), name="router-demand-writer")
                group.create_task(self.adapter_demand.run(), name="router-adapter-demand")
                group.create_task(
                    watch_failures(
                        self.consul,
                        self.settings.kv_layout,
                        self.failures,
                        wait_s=self.settings.consul_wait_s,
                        clock=self.clock,
                    ),
                    name="router-model-failures",
                )
        except asyncio.CancelledError:
            raise
        except BaseException:
            log.exception("router_background_tasks_failed")
            raise

    @property
    def background_failed(self) -> bool:
        supervisor = self._supervisor
        return supervisor is not None and supervisor.done() and not supervisor.cancelled()

    def set_worker(self, index: int) -> None:
        """Serve as worker `index` of several on one port: the demand signals (cold-start and
        adapter demand) name the process, since each worker counts only its own requests
        and the scheduler sums the records it reads (one key per worker)."""
        self.worker_suffix = f"-worker-{index}"
        self._name_demand()

    def _name_demand(self) -> None:
        self.demand.router_id = self.service_id + self.worker_suffix
        self.adapter_demand.router_id = self.service_id + self.worker_suffix

    async def register(self, port: int) -> str | None:
        """Register this router in Consul (if enabled) as listening on `port`; the service id."""
        if not self.settings.register_service:
            return None
        registration = router_registration(self.settings, port, self.admin_port)
        service_id = self.service_id = router_service_id(advertise_address(self.settings), port)
        self._name_demand()
        await self.consul.agent_service_register(registration, replace_existing_checks=True)
        self.registered_id = service_id
        log.info("router_registered", extra={"service_id": service_id})
        return service_id

    async def deregister(self) -> None:
        """Leave Consul first on shutdown, so clients stop coming before the listener closes."""
        self.shutting_down = True
        service_id, self.registered_id = self.registered_id, None
        if service_id is not None:
            await self.consul.agent_service_deregister(service_id)
            log.info("router_deregistered", extra={"service_id": service_id})

    # -- operations routes -----------------------------------------------------------------

    async def health(self, _request: web.Request) -> web.Response:
        """200 while serving (with `discovery: fresh|stale`); 503 before the first sync.

        A router that lost Consul keeps routing from its last view, so it stays
        200 and says `stale`; only a router that never synced (it knows no
        endpoint), that is shutting down, or whose tokens lack a grant it needs
        (`misconfigured`, with the `missing` grants: router/feeds/preflight.py)
        answers 503.
        """
        state = self.state
        if self.shutting_down:
            return web.json_response({"status": "shutting_down"}, status=503)
        if self.background_failed:
            return web.json_response({"status": "failed"}, status=503)
        if self.preflight.missing:
            return web.json_response(
                {"status": "misconfigured", "missing": list(self.preflight.missing)}, status=503
            )
        if not state.synced:
            return web.json_response(
                {"status": "starting", "discovery": "never_synced"}, status=503
            )
        staleness = self.discovery.staleness_s(self.clock())
        snapshot = state.view.snapshot
        return web.json_response(
            {
                "status": "ok",
                "discovery": "stale" if staleness > 0 else "fresh",
                "discovery_staleness_s": round(staleness, 3),
                "models": len(snapshot.models),
                "endpoints": len(snapshot.by_id),
                "declared_models": len(state.view.profiles),
            }
        )

    async def prometheus(self, _request: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(self.metrics.registry),
            headers={"Content-Type": CONTENT_TYPE_LATEST},
        )

    def state_view(self) -> RouterStateView:
        state = self.state
        live = state.live
        breaker_policy = self.settings.balancer_config().breaker
        now = self.clock()
        gauges = []
        for endpoint in state.view.snapshot.by_id.values():
            endpoint_state = live.get(endpoint.id)
            gauges.append(
                EndpointGauge(
                    endpoint=endpoint.id,
                    model=endpoint.served_models[0],
                    in_flight=endpoint_state.in_flight if endpoint_state else 0,
                    breaker_phase=(
                        phase_at(endpoint_state.breaker, breaker_policy, now).value
                        if endpoint_state
                        else "closed"
                    ),
                    status=endpoint.status.value,
                    draining=bool(endpoint_state and endpoint_state.draining)
                    and endpoint.status is not CheckStatus.CRITICAL,
                )
            )
        depths = dict.fromkeys(state.view.profiles, 0)
        depths.update(dict.fromkeys(state.view.snapshot.models, 0))
        depths.update(self.gate.queue_depths())
        kv_streams: dict[str, int] = {}
        for endpoint in state.view.snapshot.by_id.values():
            if endpoint.kv_port is not None:
                stream = state.kv.state(endpoint.id, now)
                kv_streams[stream] = kv_streams.get(stream, 0) + 1
        return RouterStateView(
            endpoints=gauges,
            queue_depths=depths,
            discovery_synced=state.synced,
            discovery_staleness_s=self.discovery.staleness_s(self.clock()),
            kv_streams=kv_streams,
        )


RUNTIME = web.AppKey("caravan_router_runtime", RouterRuntime)


def key_ring(settings: RouterSettings) -> KeyRing:
    """The plain keys and the key file's entries; ApiKeyError naming the file if it is bad."""
    entries = load_key_file(settings.api_keys_file) if settings.api_keys_file else ()
    return build_key_ring(settings.api_keys, entries, default_priority=settings.default_priority)


def create_app(
    settings: RouterSettings,
    *,
    consul: RouterConsul,
    registry: CollectorRegistry,
    clock: Callable[[], float] = time.monotonic,
    wall_clock: Callable[[], float] = time.time,
    request_log: RequestLog | None = None,
    nomad: VariableReader | None = None,
    prompt_tokens: PromptTokens | None = None,
) -> web.Application:
    """The router's aiohttp application; `consul` must be open for the app's lifetime.

    `request_log` writes the canonical line of each request (default: stdlib
    logging on `caravan_llm.router.edge.proxy`). `nomad` (open for the app's lifetime too) is
    where the engines' API keys are read from when `engine_api_keys` is on;
    without it no key is sent upstream (and no KV relay stream can be read).
    `prompt_tokens` gives requests' token ids for the exact prefix index
    (`caravan_llm.router.edge.prompt_digests`; the router process passes its
    `caravan_llm.router.tokens.registry.Tokenizers` and closes them after the
    app); without it every replica uses the approximate index.
    """
    runtime = RouterRuntime(
        settings,
        consul,
        registry,
        clock=clock,
        wall_clock=wall_clock,
        request_log=request_log,
        nomad=nomad,
        prompt_tokens=prompt_tokens,
    )
    register_process_metrics(registry)
    app = _guarded_app(runtime, client_max_size=settings.max_body_bytes)
    app.cleanup_ctx.append(runtime.lifecycle)
    proxy = runtime.proxy
    app.add_routes(
        [
            *(web.post(path, proxy.route(path, spec)) for path, spec in ROUTES.items()),
            web.get("/v1/models", proxy.models),
            # Model names may hold slashes (`Qwen/Qwen2.5-7B-Instruct`).
            web.get("/v1/models/{model:.+}", proxy.model),
        ]
    )
    if settings.admin_port is None:
        app.add_routes(_admin_routes(runtime))
    return app


def create_admin_app(runtime: RouterRuntime) -> web.Application:
    """`/health` and `/metrics` alone, for the admin listener (no lifecycle of its own)."""
    app = _guarded_app(runtime, client_max_size=1024)
    app.add_routes(_admin_routes(runtime))
    return app


def _guarded_app(runtime: RouterRuntime, *, client_max_size: int) -> web.Application:
    guard = runtime.request_guard
    app = web.Application(client_max_size=client_max_size, middlewares=[guard.middleware])
    app[RUNTIME] = runtime
    app.on_response_prepare.append(guard.on_response_prepare)
    return app


def _admin_routes(runtime: RouterRuntime) -> list[web.RouteDef]:
    return [web.get("/health", runtime.health), web.get("/metrics", runtime.prometheus)]


def app_runner(
    app: web.Application, settings: RouterSettings, *, listener: str = "public"
) -> web.AppRunner:
    """The runner to serve the app with (`caravan_llm.router.edge.http_limits`: header timeout,
    connection cap).

    Client disconnects cancel handlers (logged as 499).
    """
    limit = settings.max_connections or default_connection_limit()
    if listener == "admin":
        limit = min(limit, _ADMIN_MAX_CONNECTIONS)
    guard = ConnectionGuard(
        listener=listener,
        limit=limit,
        header_timeout_s=settings.header_read_timeout_s,
        metrics=app[RUNTIME].metrics,
        clock=app[RUNTIME].clock,
    )
    return GuardedAppRunner(
        app,
        guard=guard,
        handler_cancellation=True,
        shutdown_timeout=settings.shutdown_timeout_s,
        access_log=None,
        keepalive_timeout=settings.keepalive_timeout_s,
        max_line_size=settings.max_header_field_bytes,
        max_field_size=settings.max_header_field_bytes,
    )
