"""`NomadServer`: the in-process stand-in for `nomad agent -dev` with simulated nodes.

    async with NomadServer(consul_addr=consul.address, nodes=3) as nomad:
        nomad.address          # "http://127.0.0.1:PORT"
        await nomad.add_node(NodeSpec(gpus=2))
        await nomad.kill_node(node_id)

It runs the HTTP API, the scheduler worker, the leader's background work and
one simulated client per node, each node on its own loopback address
(127.B.0.2, 127.B.0.3, ..., with B drawn per instance). Leaving the context stops
every process it started.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import random
import shutil
import signal
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import aiohttp
from aiohttp import web

from caravan_llm.devcluster.nomad.acl import AclStore
from caravan_llm.devcluster.nomad.client import ClientNode
from caravan_llm.devcluster.nomad.consul_sync import ConsulAgentClient
from caravan_llm.devcluster.nomad.drivers import DriverSettings, load_image_mappings
from caravan_llm.devcluster.nomad.endpoints import ApiError, Endpoints
from caravan_llm.devcluster.nomad.fingerprint import NOMAD_VERSION, loopback_address, node_from_spec
from caravan_llm.devcluster.nomad.heartbeat import HeartbeatSettings
from caravan_llm.devcluster.nomad.http_api import build_app
from caravan_llm.devcluster.nomad.leader import Leader
from caravan_llm.devcluster.nomad.model import Node
from caravan_llm.devcluster.nomad.settings import NodeSpec, NomadServerSettings, default_nodes
from caravan_llm.devcluster.nomad.state import ClusterState
from caravan_llm.devcluster.nomad.variables import VariableStore
from caravan_llm.devcluster.nomad.worker import Scheduler
from caravan_llm.devcluster.vllm_build import find_vllm, missing_build_message
from caravan_llm.devcluster.vllm_real import RealVllmOptions

SHUTDOWN_TIMEOUT_S = 0.5


def real_vllm_options(settings: NomadServerSettings) -> RealVllmOptions | None:
    """What real vLLM replicas run with, or None for the simulator; absent build: an error."""
    if settings.vllm_engine != "real":
        return None
    build = find_vllm()
    if build is None:
        raise RuntimeError(missing_build_message())
    return RealVllmOptions(build=build, kv_blocks=settings.vllm_kv_blocks, nice=settings.vllm_nice)


def core_cycle() -> Callable[[], int | None]:
    """Each call the next core of this machine, round robin (one OpenMP core per replica)."""
    cores = itertools.cycle(sorted(os.sched_getaffinity(0)))

    def next_core() -> int | None:
        return next(cores)

    return next_core


class NomadServer:
    """A Nomad server with simulated clients, in this process, on loopback."""

    def __init__(
        self,
        settings: NomadServerSettings | None = None,
        *,
        consul_addr: str | None = None,
        consul_token: str | None = None,
        nodes: int | Sequence[NodeSpec] | None = None,
        heartbeat_grace_s: float | None = None,
        min_heartbeat_ttl_s: float | None = None,
        token: str | None = None,
        port: int | None = None,
    ) -> None:
        base = settings or NomadServerSettings()
        changes: dict[str, Any] = {}
        if isinstance(nodes, int):
            changes["nodes"] = default_nodes(cpu_nodes=nodes)
        elif nodes is not None:
            changes["nodes"] = tuple(nodes)
        elif settings is None:
            changes["nodes"] = default_nodes()
        if heartbeat_grace_s is not None:
            changes["heartbeat_grace_s"] = heartbeat_grace_s
        if min_heartbeat_ttl_s is not None:
            changes["min_heartbeat_ttl_s"] = min_heartbeat_ttl_s
        if token is not None:
            changes["token"] = token
        if port is not None:
            changes["port"] = port
        self.settings = base.model_copy(update=changes)
        self.consul_addr = consul_addr
        self.consul_token = consul_token
        self.outage = False
        self.server_id = str(uuid.uuid4())
        self.nomad_version = NOMAD_VERSION
        self.host = self.settings.host
        self.port = 0
        self.rpc_port = 0
        self.serf_port = 0
        self._placeholders: list[asyncio.Server] = []
        self.clients: dict[str, ClientNode] = {}
        self._rng = random.Random(self.settings.seed)
        # This instance's loopback block for its nodes' addresses (fingerprint.loopback_address).
        self.address_block = self._rng.randint(1, 254)
        self._tasks: list[asyncio.Task[Any]] = []
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self._consul: ConsulAgentClient | None = None
        self._owns_data_dir = self.settings.data_dir is None
        self.data_dir = self.settings.data_dir or Path(tempfile.mkdtemp(prefix="devcluster-nomad-"))
        self.state = ClusterState(time.time_ns)
        self.variables = VariableStore(self.state)
        # ACL policies and tokens: enabled by a management token (`--nomad-token`).
        self.acl = AclStore(self.settings.token)
        self.scheduler = Scheduler(self.state, rng=self._rng, new_id=self.new_id)
        self.endpoints = Endpoints(
            self.state,
            self.scheduler,
            new_id=self.new_id,
            monotonic=time.monotonic,
            heartbeat=HeartbeatSettings(
                min_ttl_s=self.settings.min_heartbeat_ttl_s,
                max_per_second=self.settings.max_heartbeats_per_second,
                grace_s=self.settings.heartbeat_grace_s,
            ),
            stagger=self._rng.random,
        )
        self.leader = Leader(self.endpoints, monotonic=time.monotonic)
        self.driver_settings = DriverSettings(
            image_mappings=load_image_mappings(self.settings.image_map),
            real_vllm=real_vllm_options(self.settings),
            next_core=core_cycle(),
            node_root=self.settings.node_root,
            check_model_files=self.settings.check_model_files,
        )

    def new_id(self) -> str:
        return str(uuid.UUID(int=self._rng.getrandbits(128), version=4))

    @property
    def address(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def rpc_address(self) -> str:
        """`host:port` of the server's RPC listener: what `status/leader` and `peers` answer."""
        return f"{self.host}:{self.rpc_port}"

    def member(self) -> dict[str, Any]:
        """The server's Serf member: Serf address and port; its RPC port in the tags."""
        return {
            "Name": "devcluster-server.global",
            "Addr": self.host,
            "Port": self.serf_port,
            "Tags": {
                "role": "nomad",
                "region": "global",
                "dc": "dc1",
                "build": NOMAD_VERSION,
                "revision": "devcluster",
                "vsn": "1",
                "raft_vsn": "3",
                "id": self.server_id,
                "rpc_addr": self.host,
                "port": str(self.rpc_port),
                "bootstrap": "1",
            },
            "Status": "alive",
            "ProtocolMin": 1,
            "ProtocolMax": 5,
            "ProtocolCur": 2,
            "DelegateMin": 2,
            "DelegateMax": 5,
            "DelegateCur": 2,
        }

    async def __aenter__(self) -> Self:
        try:
            await self._start()
        except BaseException:
            await self._stop()
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self._stop()

    async def _start(self) -> None:
        if self.consul_addr:
            self._session = aiohttp.ClientSession()
            self._consul = ConsulAgentClient(self.consul_addr, self.consul_token, self._session)
        self._runner = web.AppRunner(
            build_app(self),
            access_log=None,
            handler_cancellation=True,
            shutdown_timeout=SHUTDOWN_TIMEOUT_S,
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.settings.host, self.settings.port)
        await site.start()
        sockets = self._runner.addresses
        self.port = int(sockets[0][1])
        self.rpc_port = await self._hold_port(self.settings.rpc_port)
        self.serf_port = await self._hold_port(self.settings.serf_port)
        self._tasks.append(asyncio.create_task(self.scheduler.run(), name="nomad-scheduler"))
        self._tasks.append(asyncio.create_task(self.leader.run(), name="nomad-leader"))
        for spec in self.settings.nodes:
            await self.add_node(spec)

    async def _hold_port(self, port: int) -> int:
        """Listen on `port` (0: any free one) and close every connection: devcluster speaks
        only HTTP, but the RPC and Serf addresses it reports must be its own."""

        async def refuse(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.close()

        placeholder = await asyncio.start_server(refuse, self.settings.host, port)
        self._placeholders.append(placeholder)
        return int(placeholder.sockets[0].getsockname()[1])

    async def _stop(self) -> None:
        for placeholder in self._placeholders:
            placeholder.close()
        self._placeholders.clear()
        for client in self.clients.values():
            with contextlib.suppress(Exception):
                await client.shutdown()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        self.scheduler.stop_timers()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._session is not None:
            await self._session.close()
            self._session = None
        if self._owns_data_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    # -- nodes ------------------------------------------------------------

    async def add_node(self, spec: NodeSpec) -> Node:
        """Start one more simulated client node; returns it as registered."""
        number = len(self.clients) + 1
        name = spec.name or f"node-{number}"
        if any(client.node.name == name for client in self.clients.values()):
            raise ApiError(400, f"node name {name!r} is already in use")
        node_id = self.new_id()
        node = node_from_spec(
            spec,
            node_id=node_id,
            name=name,
            address=loopback_address(number, self.address_block),
            registered_at_ns=self.state.clock_ns(),
        )
        client = ClientNode(
            node,
            self.endpoints,
            consul=self._consul,
            data_dir=self.data_dir,
            driver_settings=self.driver_settings,
            clock_ns=self.state.clock_ns,
            rng=self._rng,
            variables=self.variables,
            acl=self.acl,
        )
        self.clients[node_id] = client
        await client.start()
        return self.state.nodes[node_id]

    def _client(self, node_id: str) -> ClientNode:
        client = self.clients.get(node_id)
        if client is None:
            raise ApiError(404, "node not found")
        return client

    async def kill_node(self, node_id: str) -> None:
        """Power off a node: its processes die and its heartbeats stop now; Nomad marks it
        down when its heartbeat timer runs out (TTL + grace) and Consul's serf declares its
        agent failed after the gossip detection delay, as on a real cluster."""
        client = self._client(node_id)
        client.kill()
        await client.wait_stopped()
        if self._consul is not None:
            await self._consul.kill_node(client.node.name)

    async def restart_node(self, node_id: str) -> None:
        """Bring a node back, empty, and ready for new allocations."""
        client = self._client(node_id)
        if not client.killed:
            client.kill()
        if self.state.nodes[node_id].status != "down":
            # Coming back empty means its allocations are lost, as if the timer had run out.
            self.endpoints.heartbeat_expired(node_id)
        await client.restart()

    def crash_alloc(self, alloc_id: str, task: str | None = None) -> list[int]:
        """SIGKILL the processes of one allocation (or one of its tasks); their PIDs."""
        return self.signal_alloc(alloc_id, signal.SIGKILL, task=task)

    def signal_alloc(
        self, alloc_id: str, signum: int, *, task: str | None = None, group: bool = True
    ) -> list[int]:
        """Send `signum` to the running tasks of one allocation; their PIDs.

        `group=False` signals only each task's main process, as `nomad alloc
        signal` and the docker driver's stop do (the container's PID 1).
        """
        for client in self.clients.values():
            runner = client.runners.get(alloc_id)
            if runner is None:
                continue
            pids = []
            for name, task_runner in runner.tasks.items():
                if task is not None and name != task:
                    continue
                process = task_runner.process
                if process is not None and task_runner.state.state == "running":
                    pids.append(process.pid)
                    if group:
                        process.signal_group(signum)
                    else:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(process.pid, signum)
            return pids
        raise ApiError(404, "alloc not found")

    def processes(self) -> list[int]:
        """PIDs of every task process this server started (running or not)."""
        return [
            task_runner.process.pid
            for client in self.clients.values()
            for runner in client.runners.values()
            for task_runner in runner.tasks.values()
            if task_runner.process is not None
        ]
