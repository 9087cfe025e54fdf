"""`ConsulServer`: the whole emulated Consul (HTTP API, DNS, checks, timers) in-process.

    async with ConsulServer(ConsulConfig(session_ttl_min_s=1)) as consul:
        consul.register_node("n1")            # 127.0.0.2, serfHealth passing
        os.environ["CONSUL_HTTP_ADDR"] = consul.http_addr
        ...
        consul.fail_node("n1")                # serfHealth critical, its checks stop

Everything runs on the caller's event loop; leaving the context stops the
listeners, answers pending blocking queries and cancels every task.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Self

from aiohttp import web

from caravan_llm.devcluster.consul import (
    handlers_acl,
    handlers_agent,
    handlers_catalog,
    handlers_devcluster,
    handlers_kv,
    handlers_txn,
)
from caravan_llm.devcluster.consul.acl import AclResolver
from caravan_llm.devcluster.consul.checks import CheckRunners, Housekeeping
from caravan_llm.devcluster.consul.dns import ConsulDns, DnsListener
from caravan_llm.devcluster.consul.http_api import ConsulHttpApi, ServerIdentity
from caravan_llm.devcluster.consul.records import NodeRecord, ServiceRecord
from caravan_llm.devcluster.consul.serf import SerfTiming
from caravan_llm.devcluster.consul.state import CONSUL_VERSION, ConsulState

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ConsulConfig:
    """How to run the emulated agent; the defaults are those of `consul agent -dev`."""

    host: str = "127.0.0.1"
    http_port: int = 0
    dns_port: int = 0
    management_token: str | None = None
    node_name: str = "devcluster"
    datacenter: str = "dc1"
    # Consul's session_ttl_min; tests may lower it (devcluster-only).
    session_ttl_min_s: float = 10.0
    # Consul's check_reap_interval and the floor on DeregisterCriticalServiceAfter.
    check_reap_interval_s: float = 30.0
    deregister_critical_min_s: float = 60.0
    # memberlist's LAN failure detection (how long a killed node's serfHealth stays passing).
    serf: SerfTiming = field(default_factory=SerfTiming)

    def __repr__(self) -> str:
        # Never show the token.
        token = "<set>" if self.management_token else None
        return (
            f"ConsulConfig(host={self.host!r}, http_port={self.http_port}, "
            f"dns_port={self.dns_port}, management_token={token}, node_name={self.node_name!r})"
        )


class ConsulServer:
    def __init__(
        self, config: ConsulConfig | None = None, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config or ConsulConfig()
        self._clock = clock
        self.state = ConsulState(
            datacenter=self.config.datacenter,
            clock=clock,
            deregister_critical_min_s=self.config.deregister_critical_min_s,
            serf=self.config.serf,
        )
        identity = ServerIdentity(
            node_name=self.config.node_name,
            address=self.config.host,
            datacenter=self.config.datacenter,
            version=CONSUL_VERSION,
        )
        self._api = ConsulHttpApi(
            self.state,
            AclResolver(self.config.management_token),
            identity,
            session_ttl_min_s=self.config.session_ttl_min_s,
        )
        for module in (handlers_agent, handlers_catalog, handlers_kv, handlers_devcluster):
            self._api.add_routes(module.ROUTES)
        self._api.add_routes(handlers_txn.ROUTES)
        self._api.add_routes(handlers_acl.ROUTES)
        self._dns = DnsListener(ConsulDns(self.state))
        self._runner: web.AppRunner | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._http_port = 0

    @property
    def http_addr(self) -> str:
        """`127.0.0.1:PORT`, the value for CONSUL_HTTP_ADDR."""
        return f"{self.config.host}:{self._http_port}"

    @property
    def http_port(self) -> int:
        return self._http_port

    @property
    def dns_port(self) -> int:
        return self._dns.port

    def _register_self(self) -> None:
        node = self.config.node_name
        self.state.register_node(node, self.config.host, {})
        self.state.register_service(
            node,
            ServiceRecord(
                node=node,
                service_id="consul",
                name="consul",
                tags=(),
                address="",
                port=8300,
                meta={
                    "non_voter": "false",
                    "raft_version": "3",
                    "read_replica": "false",
                    "serf_protocol_current": "2",
                    "serf_protocol_max": "5",
                    "serf_protocol_min": "1",
                    "version": CONSUL_VERSION,
                },
                tagged_addresses={},
                weight_passing=1,
                weight_warning=1,
                enable_tag_override=False,
                kind="",
                create_index=0,
                modify_index=0,
                # The leader writes this row (reconcileMember), not the agent:
                # it is in the catalog, not in /v1/agent/services.
                local=False,
            ),
            [],
            replace_existing_checks=False,
        )

    def _spawn(self, name: str, coroutine: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coroutine, name=name)

        def report(done: asyncio.Task[None]) -> None:
            if not done.cancelled() and done.exception() is not None:
                log.error("consul_task_crashed", extra={"task": name}, exc_info=done.exception())

        task.add_done_callback(report)
        self._tasks.append(task)

    async def _serve_http(self, port: int) -> web.AppRunner:
        """The HTTP API's runner, listening on `port` (0: any free port)."""
        # handler_cancellation: a client that hangs up ends its blocking query.
        runner = web.AppRunner(
            self._api.build_app(),
            handler_cancellation=True,
            access_log=None,
            shutdown_timeout=1.0,
        )
        await runner.setup()
        try:
            site = web.TCPSite(runner, self.config.host, port)
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        return runner

    async def __aenter__(self) -> Self:
        self._register_self()
        self._runner = await self._serve_http(self.config.http_port)
        try:
            address = self._runner.addresses[0]
            self._http_port = int(address[1])
            await self._dns.start(self.config.host, self.config.dns_port)
        except BaseException:
            await self._runner.cleanup()
            raise
        self._spawn("consul-checks", CheckRunners(self.state).run())
        self._spawn(
            "consul-housekeeping",
            Housekeeping(
                self.state, reap_interval_s=self.config.check_reap_interval_s, clock=self._clock
            ).run(),
        )
        log.info("consul_started", extra={"http_addr": self.http_addr, "dns_port": self.dns_port})
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._api.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        await self._dns.stop()
        if self._runner is not None:
            await self._runner.cleanup()
        log.info("consul_stopped")

    # -- outages -----------------------------------------------------------------

    @property
    def http_up(self) -> bool:
        return self._runner is not None

    async def stop_http(self) -> None:
        """Consul goes down for its clients: the HTTP listener closes (connection refused)
        and open blocking queries end. The catalog, KV and sessions stay, and session TTLs
        and checks keep running, so a leader that cannot renew loses its lock as it would."""
        runner, self._runner = self._runner, None
        if runner is None:
            return
        self._api.close()
        await runner.cleanup()
        log.info("consul_http_stopped")

    async def start_http(self) -> None:
        """Consul is back, on the same address."""
        if self._runner is not None:
            return
        self._api.reopen()
        self._runner = await self._serve_http(self._http_port)
        log.info("consul_http_started", extra={"http_addr": self.http_addr})

    # -- simulated nodes (the same operations as /v1/devcluster/*) -------------

    def register_node(
        self, name: str, address: str | None = None, meta: dict[str, str] | None = None
    ) -> NodeRecord:
        """Add (or update) a simulated node; without an address it gets the next free 127.0.0.N."""
        existing = self.state.node(name)
        if address is None:
            address = (
                existing.address if existing else handlers_devcluster.next_free_address(self.state)
            )
        problem = handlers_devcluster.validate_node_address(address)
        if problem is not None:
            raise ValueError(problem)
        return self.state.register_node(name, address, meta or {})

    def deregister_node(self, name: str) -> bool:
        return self.state.deregister_node(name)

    def fail_node(self, name: str) -> None:
        """The node's agent stops answering: serfHealth critical, its checks stop running."""
        if not self.state.set_node_failed(name, failed=True):
            raise KeyError(name)

    def kill_node(self, name: str) -> float:
        """The node's agent dies now; serfHealth goes critical after serf's detection delay
        (returned, in seconds). `fail_node` is the same with no delay."""
        delay = self.state.kill_node(name)
        if delay is None:
            raise KeyError(name)
        return delay

    def recover_node(self, name: str) -> None:
        if not self.state.set_node_failed(name, failed=False):
            raise KeyError(name)
