"""The parts of a scheduler process, built from `SchedulerSettings` before anything runs.

`build_scheduler` builds them all (election, watches, controller, autoscaler,
API); `SchedulerProcess.run()` only starts and stops them, in order, so tests
reach every part through the built object. `scheduler/server.py` owns the
process around it (clients, signals, exit codes).

Everything long-lived runs on one event loop, the loops in one TaskGroup and
the election beside it (so it resigns only after the loops have stopped):

- the leader election (Consul session + KV lock on `<prefix>leader`);
- watches that only signal: Consul KV under the prefix, Nomad jobs,
  allocations and nodes (blocking queries); each sets the `wake` event;
- the reconcile loop, which acts only while this process leads;
- the autoscaler loop (when enabled), which only writes desired counts;
- the HTTP API (served by every instance, leader or not). With API tokens
  it binds where asked and requires one on every route but /health; without
  any token it binds loopback only, whatever host was asked for.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from aiohttp.log import server_logger
from prometheus_client import CollectorRegistry

from caravan_llm.common.consul_api import ConsulClient, ConsulSettings
from caravan_llm.common.contract import JOB_PREFIX, KVLayout
from caravan_llm.common.errors import HashiError
from caravan_llm.common.leader import LeaderElection
from caravan_llm.common.nomad_api import NomadClient, NomadSettings
from caravan_llm.common.preflight import Preflight
from caravan_llm.common.process_metrics import register_process_metrics
from caravan_llm.common.watch import BlockingWatch
from caravan_llm.scheduler.api import ApiAuth, ServerLog, create_api
from caravan_llm.scheduler.autoscale.loop import Autoscaler
from caravan_llm.scheduler.cluster_config import ClusterConfig
from caravan_llm.scheduler.controller import Controller
from caravan_llm.scheduler.engine_keys import EngineKeys
from caravan_llm.scheduler.engine_logs import EngineLogReader
from caravan_llm.scheduler.metrics import SchedulerMetrics
from caravan_llm.scheduler.model_service import ModelService
from caravan_llm.scheduler.model_store import ModelStore
from caravan_llm.scheduler.preflight import scheduler_capabilities
from caravan_llm.scheduler.settings import SchedulerSettings
from caravan_llm.scheduler.status import StatusReader

log = logging.getLogger(__name__)


LOOPBACK_HOST = "127.0.0.1"


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def api_bind_host(requested: str, *, tokens_configured: bool) -> str:
    """Where the API may listen: anywhere with tokens, else loopback only."""
    if tokens_configured or _is_loopback(requested):
        return requested
    return LOOPBACK_HOST


async def _signal_on_change(
    name: str,
    fetch: Callable[[int, float], Awaitable[tuple[int, Any]]],
    wake: asyncio.Event,
    wait_s: float,
) -> None:
    async def deliver(_value: Any) -> None:
        wake.set()

    await BlockingWatch(name, fetch, wait_s=wait_s).run(deliver)


@dataclass(slots=True)
class SchedulerWatches:
    """Blocking queries that only signal `wake`: KV under the prefix, Nomad jobs, allocs, nodes."""

    consul: ConsulClient
    nomad: NomadClient
    layout: KVLayout
    wake: asyncio.Event
    wait_s: float = 60.0

    async def run(self) -> None:
        consul, nomad = self.consul, self.nomad

        def kv(prefix: str) -> Callable[[int, float], Awaitable[tuple[int, Any]]]:
            async def fetch(index: int, wait_s: float) -> tuple[int, Any]:
                return await consul.kv_get_recurse(prefix, index=index, wait_s=wait_s)

            return fetch

        async def jobs(index: int, wait_s: float) -> tuple[int, Any]:
            result = await nomad.list_jobs(JOB_PREFIX, index=index, wait_s=wait_s)
            return result.index, None

        async def allocations(index: int, wait_s: float) -> tuple[int, Any]:
            result = await nomad.list_allocations(index=index, wait_s=wait_s)
            return result.index, None

        async def nodes(index: int, wait_s: float) -> tuple[int, Any]:
            result = await nomad.list_nodes(resources=False, index=index, wait_s=wait_s)
            return result.index, None

        layout, wake, wait_s = self.layout, self.wake, self.wait_s
        async with asyncio.TaskGroup() as tasks:
            # Not the whole prefix: the autoscaler's own state/ writes must not
            # wake the reconcile loop.
            for prefix in (layout.models, layout.desired, layout.draining, layout.demand):
                tasks.create_task(_signal_on_change(f"kv {prefix}", kv(prefix), wake, wait_s))
            tasks.create_task(_signal_on_change("nomad jobs", jobs, wake, wait_s))
            tasks.create_task(_signal_on_change("nomad allocations", allocations, wake, wait_s))
            tasks.create_task(_signal_on_change("nomad nodes", nodes, wake, wait_s))


@dataclass(slots=True)
class SchedulerApi:
    """The HTTP API's listener: every instance serves it, leader or not (module docstring)."""

    app: web.Application
    requested_host: str
    port: int
    auth: bool
    runner: web.AppRunner | None = None
    bound_port: int | None = None
    bound_host: str | None = None

    @property
    def host(self) -> str:
        """Where it binds: the requested host with tokens, else loopback only."""
        return api_bind_host(self.requested_host, tokens_configured=self.auth)

    async def start(self) -> None:
        host = self.host
        if not self.auth:
            log.warning(
                "scheduler_api_loopback_only",
                extra={
                    "requested_host": self.requested_host,
                    "host": host,
                    "reason": "no API token configured (CARAVAN_SCHEDULER_API_TOKENS or "
                    "CARAVAN_SCHEDULER_API_TOKENS_FILE); the API is open to this machine only",
                },
            )
        runner = web.AppRunner(self.app, access_log=None, logger=ServerLog(server_logger))
        await runner.setup()
        self.runner = runner
        site = web.TCPSite(runner, host, self.port)
        await site.start()
        sockets = getattr(site._server, "sockets", None) or []  # noqa: SLF001 - aiohttp has no public accessor
        self.bound_port = sockets[0].getsockname()[1] if sockets else self.port
        self.bound_host = sockets[0].getsockname()[0] if sockets else host
        log.info(
            "scheduler_api_listening",
            extra={"host": host, "port": self.bound_port, "auth": self.auth},
        )

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None


@dataclass(slots=True)
class SchedulerProcess:
    """One scheduler instance, its parts built by `build_scheduler`; `run()` until cancelled.

    Startup order: the API listener (so /health answers at once), then the
    watches, the leader election and the loops. Shutdown order (on
    cancellation): the reconcile and autoscaler loops and the watches stop
    (no more writes), then leadership is resigned (lock released, session
    destroyed, so a standby takes over without waiting for the TTL), then the
    API listener closes. The caller closes the Consul and Nomad clients last.
    """

    settings: SchedulerSettings
    config: ClusterConfig
    consul: ConsulClient
    nomad: NomadClient
    registry: CollectorRegistry
    metrics: SchedulerMetrics
    store: ModelStore
    election: LeaderElection
    autoscaler: Autoscaler
    controller: Controller
    api: SchedulerApi
    watches: SchedulerWatches
    wake: asyncio.Event
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    # Do the tokens hold every grant the scheduler needs? (scheduler/preflight.py)
    preflight: Preflight | None = None
    extra_loops: list[Callable[[], Coroutine[Any, Any, None]]] = field(default_factory=list)

    @property
    def bound_port(self) -> int | None:
        return self.api.bound_port

    @property
    def bound_host(self) -> str | None:
        return self.api.bound_host

    async def run(self) -> None:
        await self.api.start()
        try:
            election = asyncio.create_task(self.election.run(), name="scheduler-election")
            try:
                async with asyncio.TaskGroup() as tasks:
                    tasks.create_task(_propagate(election))
                    if self.preflight is not None:
                        tasks.create_task(self.preflight.run())
                    tasks.create_task(self._follow_leadership())
                    tasks.create_task(self.watches.run())
                    tasks.create_task(self.controller.run(self.wake))
                    if self.settings.autoscale:
                        tasks.create_task(self.autoscaler.run())
                    for loop in self.extra_loops:
                        tasks.create_task(loop())
                    self.ready.set()
            finally:
                # The loops have stopped: give up leadership (election.run resigns).
                election.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await election
        finally:
            await self.api.stop()
            log.info("scheduler_stopped")

    async def _follow_leadership(self) -> None:
        election, metrics = self.election, self.metrics
        while True:
            await election.elected.wait()
            metrics.leader.set(1)
            try:
                await self.store.publish_cluster_config(self.config)
            except HashiError as exc:
                log.warning("cluster_config_not_published", extra={"error": str(exc)})
            self.wake.set()
            await election.deposed.wait()
            metrics.leader.set(0)


async def _propagate(task: asyncio.Task[None]) -> None:
    """Wait on a task run beside a TaskGroup, so its failure stops the group."""
    await asyncio.shield(task)


def build_scheduler(
    settings: SchedulerSettings,
    *,
    config: ClusterConfig,
    consul: ConsulClient,
    nomad: NomadClient,
    registry: CollectorRegistry | None = None,
) -> SchedulerProcess:
    """Build every part of a scheduler from its settings; nothing runs until `run()`.

    Raises ApiTokenError (a SettingsError) when the API tokens are unusable.
    """
    registry = registry if registry is not None else CollectorRegistry()
    register_process_metrics(registry)
    layout = settings.kv_layout
    metrics = SchedulerMetrics.create(registry)
    store = ModelStore(consul, layout)
    election = LeaderElection(consul, settings.election_settings())

    def is_leader() -> bool:
        return election.is_leader

    # Each model's engine API key (docs/security.md "Engine API keys").
    engine_keys = EngineKeys(nomad) if config.engine_api_keys else None
    autoscaler = Autoscaler(
        store=store,
        health=consul,
        metrics=metrics,
        is_leader=is_leader,
        settings=settings.autoscaler_settings(),
        engine_key=engine_keys.cached_model_key if engine_keys is not None else None,
    )
    controller = Controller(
        store=store,
        nomad=nomad,
        health=consul,
        config=config,
        metrics=metrics,
        settings=settings.controller_settings(),
        is_leader=is_leader,
        inflight=autoscaler.inflight.of,
        engine_keys=engine_keys,
    )
    preflight = Preflight(
        "scheduler",
        scheduler_capabilities(layout, consul, nomad, engine_api_keys=config.engine_api_keys),
    )

    def missing_grants() -> tuple[str, ...]:
        return preflight.missing

    service = ModelService(
        store=store,
        status=StatusReader(
            store=store,
            nomad=nomad,
            health=consul,
            config=config,
            scheduler_missing=missing_grants,
            engine_logs=EngineLogReader(nomad),
        ),
        config=config,
    )
    tokens = settings.token_source()
    auth = None if tokens is None else ApiAuth(tokens, metrics.api_auth_failures)
    api = SchedulerApi(
        app=create_api(service, registry, is_leader, auth=auth, missing_grants=missing_grants),
        requested_host=settings.http_host,
        port=settings.http_port,
        auth=tokens is not None,
    )
    wake = asyncio.Event()
    return SchedulerProcess(
        settings=settings,
        config=config,
        consul=consul,
        nomad=nomad,
        registry=registry,
        metrics=metrics,
        store=store,
        election=election,
        autoscaler=autoscaler,
        controller=controller,
        api=api,
        watches=SchedulerWatches(
            consul=consul, nomad=nomad, layout=layout, wake=wake, wait_s=settings.watch_wait_s
        ),
        wake=wake,
        preflight=preflight,
    )


@contextlib.asynccontextmanager
async def scheduler_clients(
    environ: Mapping[str, str], *, namespace: str | None = None
) -> AsyncIterator[tuple[ConsulClient, NomadClient]]:
    """Consul and Nomad clients configured from the standard environment variables; the
    Nomad client works in `namespace` (the cluster config's) when given."""
    nomad_settings = NomadSettings.from_env(environ)
    if namespace:
        nomad_settings = nomad_settings.model_copy(update={"namespace": namespace})
    async with (
        ConsulClient(ConsulSettings.from_env(environ)) as consul,
        NomadClient(nomad_settings) as nomad,
    ):
        yield consul, nomad
