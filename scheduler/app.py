"""Wiring of the `caravan scheduler` process: clients, election, watches, loops, API.

Everything long-lived runs in one TaskGroup on one event loop:

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
import os
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry

from caravan.consul_api import ConsulClient, ConsulSettings
from caravan.contract import JOB_PREFIX, KVLayout
from caravan.errors import HashiError
from caravan.leader import ElectionSettings, LeaderElection
from caravan.nomad_api import NomadClient, NomadSettings
from caravan.watch import BlockingWatch
from scheduler.api import ApiAuth, create_api
from scheduler.api_auth import TokenSource
from scheduler.autoscale.loop import Autoscaler, AutoscalerSettings
from scheduler.cluster_config import ClusterConfig
from scheduler.controller import Controller, ControllerSettings
from scheduler.engine_keys import EngineKeys
from scheduler.metrics import SchedulerMetrics
from scheduler.model_service import ModelService
from scheduler.model_store import ModelStore
from scheduler.status import StatusReader

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SchedulerOptions:
    http_host: str = "127.0.0.1"
    http_port: int = 8090
    kv_prefix: str = "caravan/"
    leader_ttl_s: float = 15.0
    leader_lock_delay_s: float = 5.0
    controller: ControllerSettings = field(default_factory=ControllerSettings)
    autoscale: bool = True
    autoscaler: AutoscalerSettings = field(default_factory=AutoscalerSettings)
    instance_id: str = field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")
    # Bearer tokens of the HTTP API (scheduler/api_auth.py); None: no token, loopback only.
    api_tokens: TokenSource | None = field(default=None, repr=False)


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
) -> None:
    async def deliver(_value: Any) -> None:
        wake.set()

    await BlockingWatch(name, fetch, wait_s=60.0).run(deliver)


@dataclass(slots=True)
class SchedulerProcess:
    """One scheduler instance; `run()` until cancelled."""

    options: SchedulerOptions
    config: ClusterConfig
    consul: ConsulClient
    nomad: NomadClient
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    bound_port: int | None = None
    bound_host: str | None = None
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    controller: Controller | None = None
    election: LeaderElection | None = None
    autoscaler: Autoscaler | None = None
    extra_loops: list[Callable[[], Coroutine[Any, Any, None]]] = field(default_factory=list)

    async def run(self) -> None:
        layout = KVLayout(self.options.kv_prefix)
        metrics = SchedulerMetrics.create(self.registry)
        store = ModelStore(self.consul, layout)
        election = LeaderElection(
            self.consul,
            ElectionSettings(
                key=layout.leader,
                value=self.options.instance_id.encode(),
                session_name="caravan-scheduler",
                ttl_s=self.options.leader_ttl_s,
                lock_delay_s=self.options.leader_lock_delay_s,
            ),
        )
        self.election = election
        engine_keys = EngineKeys(self.nomad) if self.config.engine_api_keys else None
        autoscaler = Autoscaler(
            store=store,
            health=self.consul,
            metrics=metrics,
            is_leader=lambda: election.is_leader,
            settings=self.options.autoscaler,
            engine_key=engine_keys.cached_model_key if engine_keys is not None else None,
        )
        self.autoscaler = autoscaler
        controller = Controller(
            store=store,
            nomad=self.nomad,
            health=self.consul,
            config=self.config,
            metrics=metrics,
            settings=self.options.controller,
            is_leader=lambda: election.is_leader,
            inflight=autoscaler.inflight_of,
            engine_keys=engine_keys,
        )
        self.controller = controller
        service = ModelService(
            store=store,
            status=StatusReader(
                store=store, nomad=self.nomad, health=self.consul, config=self.config
            ),
            config=self.config,
        )
        wake = asyncio.Event()
        async with (
            self._serve_api(service, lambda: election.is_leader, metrics),
            asyncio.TaskGroup() as tasks,
        ):
            tasks.create_task(election.run())
            tasks.create_task(self._follow_leadership(election, metrics, wake, store))
            tasks.create_task(self._watches(layout, wake))
            tasks.create_task(controller.run(wake))
            if self.options.autoscale:
                tasks.create_task(autoscaler.run())
            for loop in self.extra_loops:
                tasks.create_task(loop())
            self.ready.set()

    async def _follow_leadership(
        self,
        election: LeaderElection,
        metrics: SchedulerMetrics,
        wake: asyncio.Event,
        store: ModelStore,
    ) -> None:
        while True:
            await election.elected.wait()
            metrics.leader.set(1)
            try:
                await store.publish_cluster_config(self.config)
            except HashiError as exc:
                log.warning("cluster_config_not_published", extra={"error": str(exc)})
            wake.set()
            await election.deposed.wait()
            metrics.leader.set(0)

    async def _watches(self, layout: KVLayout, wake: asyncio.Event) -> None:
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

        async with asyncio.TaskGroup() as tasks:
            # Not the whole prefix: the autoscaler's own state/ writes must not
            # wake the reconcile loop.
            for prefix in (layout.models, layout.desired, layout.draining, layout.demand):
                tasks.create_task(_signal_on_change(f"kv {prefix}", kv(prefix), wake))
            tasks.create_task(_signal_on_change("nomad jobs", jobs, wake))
            tasks.create_task(_signal_on_change("nomad allocations", allocations, wake))
            tasks.create_task(_signal_on_change("nomad nodes", nodes, wake))

    @contextlib.asynccontextmanager
    async def _serve_api(
        self, service: ModelService, is_leader: Callable[[], bool], metrics: SchedulerMetrics
    ) -> AsyncIterator[None]:
        tokens = self.options.api_tokens
        auth = None if tokens is None else ApiAuth(tokens, metrics.api_auth_failures)
        app = create_api(service, self.registry, is_leader, auth=auth)
        host = api_bind_host(self.options.http_host, tokens_configured=tokens is not None)
        if tokens is None:
            log.warning(
                "scheduler_api_loopback_only",
                extra={
                    "requested_host": self.options.http_host,
                    "host": host,
                    "reason": "no API token configured (CARAVAN_SCHEDULER_API_TOKENS or "
                    "CARAVAN_SCHEDULER_API_TOKENS_FILE); the API is open to this machine only",
                },
            )
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, host, self.options.http_port)
        await site.start()
        sockets = getattr(site._server, "sockets", None) or []  # noqa: SLF001 - aiohttp has no public accessor
        self.bound_port = sockets[0].getsockname()[1] if sockets else self.options.http_port
        self.bound_host = sockets[0].getsockname()[0] if sockets else host
        log.info(
            "scheduler_api_listening",
            extra={"host": host, "port": self.bound_port, "auth": tokens is not None},
        )
        try:
            yield
        finally:
            await runner.cleanup()


@contextlib.asynccontextmanager
async def scheduler_clients(
    environ: Mapping[str, str],
) -> AsyncIterator[tuple[ConsulClient, NomadClient]]:
    """Consul and Nomad clients configured from the standard environment variables."""
    async with (
        ConsulClient(ConsulSettings.from_env(environ)) as consul,
        NomadClient(NomadSettings.from_env(environ)) as nomad,
    ):
        yield consul, nomad
