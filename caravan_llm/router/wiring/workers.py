"""`caravan router --workers N`: N router processes on one port, one supervisor in front.

The supervisor (this process) never serves a request. It

1. reserves the public port: a socket bound with SO_REUSEPORT and never
   listening, so port 0 resolves to one port every worker then binds, and the
   port stays ours while workers come and go;
2. starts N workers (multiprocessing, spawn start method), each a whole router
   (`caravan_llm.router.wiring.server.run` with a `WorkerRole`): its own event loop, Consul watches,
   engine scrapes, admission queues and rate-limit buckets; the kernel spreads
   new connections over their listeners. Each worker also serves /health and
   /metrics on a private admin listener on 127.0.0.1 and an ephemeral port;
3. serves /health and /metrics for all of them on the admin listener
   (`ADMIN_HOST`:`ADMIN_PORT`, an ephemeral port when `ADMIN_PORT` is unset):
   /health is 200 only while every worker answers 200 (the body lists each),
   /metrics is every worker's exposition with a `worker` label added;
4. registers the one `caravan-router` service in Consul, its check on that
   /health; the workers never register.

Shutdown (SIGTERM or SIGINT to the supervisor): deregister, then SIGTERM every
worker, each of which closes its listener and lets its requests finish for
`SHUTDOWN_TIMEOUT_S`; exit 0 when all of them exited 0. A worker that dies
unexpectedly is not restarted: the supervisor shuts the others down the same
way and exits 1, so the process manager (Nomad, systemd) restarts the whole
router and a crash loop shows as one.

Caps that are configured per host are divided between the workers (rounded
up): `QUEUE_MAX_PER_MODEL`, `MAX_CONNECTIONS` (when set; the default already
follows each process's own descriptor limit) and `CONNECTOR_LIMIT`. Per-key
rate limits are not (router/README.md, "Several workers").
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from caravan_llm.common.consul_api import ConsulClient, ConsulSettings, ServiceRegistration
from caravan_llm.common.errors import HashiError
from caravan_llm.common.log_format import BufferedLineHandler
from caravan_llm.router.edge.http_limits import ConnectionGuard, GuardedAppRunner
from caravan_llm.router.metrics import RouterMetrics
from caravan_llm.router.settings import RouterSettings
from caravan_llm.router.wiring.app import router_registration
from caravan_llm.router.wiring.server import WorkerRole, flush_logs_periodically, run

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess

# Named as before the router's sub-packages: the logger is a field of every log line.
log = logging.getLogger("router.workers")

WORKER_LABEL = "worker"
# How long a worker may take from its start to both listeners up.
_START_TIMEOUT_S = 60.0
# Beyond SHUTDOWN_TIMEOUT_S, how long a stopping worker may take before it is killed.
_STOP_GRACE_S = 10.0
# Under Consul's check timeout (2 s), so a hung worker reads as unhealthy, not as a timeout.
_WORKER_PROBE_TIMEOUT_S = 1.5
_REGISTER_RETRY_S = (1.0, 2.0, 5.0, 10.0)
_WORKER_ADMIN_HOST = "127.0.0.1"
# The supervisor's admin listener serves two routes to a monitoring system.
_ADMIN_MAX_CONNECTIONS = 64


def worker_settings(settings: RouterSettings, port: int) -> RouterSettings:
    """What each worker runs with: the reserved port, no registration, a private admin
    listener, and the per-host caps divided between the workers (rounded up)."""
    n = settings.workers
    return settings.model_copy(
        update={
            "port": port,
            "workers": 1,
            "register_service": False,
            "admin_host": _WORKER_ADMIN_HOST,
            "admin_port": 0,
            "queue_max_per_model": math.ceil(settings.queue_max_per_model / n),
            "connector_limit": math.ceil(settings.connector_limit / n),
            "max_connections": (
                math.ceil(settings.max_connections / n)
                if settings.max_connections is not None
                else None
            ),
        }
    )


# -- merging the workers' answers (pure) ----------------------------------------------------


@dataclass(frozen=True, slots=True)
class WorkerHealth:
    """One worker's /health answer; status None when it did not answer."""

    index: int
    status: int | None
    body: object


def combined_health(workers: list[WorkerHealth], *, shutting_down: bool) -> tuple[int, object]:
    """200 only while every worker answers 200: the port spreads connections over all of
    them, so one that is starting, failed or hung fails its share of the clients. A
    worker whose tokens lack a grant makes the whole router `misconfigured`, naming it."""
    listed = [
        {"worker": w.index, "http_status": w.status, "health": w.body}
        for w in sorted(workers, key=lambda w: w.index)
    ]
    if shutting_down:
        return 503, {"status": "shutting_down", "workers": listed}
    # The workers share the router's tokens: a grant one lacks, all lack
    # (router/feeds/preflight.py).
    missing = sorted(
        {
            str(grant)
            for w in workers
            if isinstance(w.body, dict) and w.body.get("status") == "misconfigured"
            for grant in w.body.get("missing") or ()
        }
    )
    if missing:
        return 503, {"status": "misconfigured", "missing": missing, "workers": listed}
    healthy = bool(workers) and all(w.status == 200 for w in workers)
    return (200 if healthy else 503), {"status": "ok" if healthy else "degraded", "workers": listed}


def merge_expositions(texts: dict[int, str | None]) -> list[Metric]:
    """Every worker's metric families with `worker="<index>"` on each sample.

    Families of the same name are merged (help and type from the first worker
    that has it). A worker whose scrape failed (None, or text that does not
    parse) is left out and shows as 0 in `caravan_router_worker_up`.
    """
    families: dict[str, Metric] = {}
    up = Metric("caravan_router_worker_up", "1 if the worker's /metrics answered", "gauge")
    for index in sorted(texts):
        text = texts[index]
        parsed: list[Metric] | None = None
        if text is not None:
            try:
                parsed = list(text_string_to_metric_families(text))
            except (ValueError, IndexError, KeyError, TypeError):
                parsed = None
        up.add_sample("caravan_router_worker_up", {WORKER_LABEL: str(index)}, float(bool(parsed)))
        for family in parsed or ():
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(
                    family.name, family.documentation, family.type, family.unit
                )
            merged.samples.extend(
                Sample(
                    sample.name,
                    {**sample.labels, WORKER_LABEL: str(index)},
                    sample.value,
                    sample.timestamp,
                    sample.exemplar,
                )
                for sample in family.samples
            )
    return [up, *families.values()]


class _Families:
    """A collector that yields given families once (for generate_latest)."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        yield from self._families


def exposition(families: list[Metric]) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families))
    return generate_latest(registry)


# -- the worker process ----------------------------------------------------------------------


def _worker_main(
    settings: RouterSettings, index: int, ready: multiprocessing.connection.Connection
) -> None:
    """Entry point of a spawned worker: the router, serving as worker `index`."""
    # The supervisor orders the shutdown; a terminal's Ctrl-C reaches it alone in effect.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = multiprocessing.parent_process()

    def report(admin_port: int) -> None:
        ready.send(admin_port)
        ready.close()

    role = WorkerRole(
        index=index, ready=report, parent_sentinel=parent.sentinel if parent else None
    )
    sys.exit(run(settings, os.environ, role))


@dataclass
class _Worker:
    index: int
    process: BaseProcess
    admin_port: int | None = None


async def _readable(fd: int) -> None:
    """Wait until `fd` is readable (data, EOF, or a process sentinel at exit)."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def wake() -> None:
        if not done.done():
            done.set_result(None)

    loop.add_reader(fd, wake)
    try:
        await done
    finally:
        loop.remove_reader(fd)


# -- the supervisor ----------------------------------------------------------------------------


def reserve_port(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port) with SO_REUSEPORT and not listening: it holds the
    port (resolving 0) while the workers bind it too; it never accepts a connection.

    A given port is first bound without SO_REUSEPORT, so that a port another
    process holds with SO_REUSEPORT (another router with workers, same user)
    is refused instead of silently shared. OSError when the port is taken.
    """
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    if port != 0:
        with socket.socket(family, kind, proto) as probe:
            probe.bind(address)
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


def supervise(
    settings: RouterSettings,
    consul_settings: ConsulSettings,
    log_handler: BufferedLineHandler,
    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None,
) -> int:
    """Run `settings.workers` workers on one port until SIGTERM/SIGINT; the exit code."""
    if not hasattr(socket, "SO_REUSEPORT"):
        print("error: workers: this platform has no SO_REUSEPORT", file=sys.stderr)  # noqa: T201
        return 2
    try:
        reserved = reserve_port(settings.host, settings.port)
    except OSError as exc:
        print(f"error: cannot listen on {settings.host}:{settings.port}: {exc}", file=sys.stderr)  # noqa: T201
        return 1
    with reserved:
        port = int(reserved.getsockname()[1])
        supervisor = _Supervisor(settings, consul_settings, port, log_handler)
        try:
            with asyncio.Runner(loop_factory=loop_factory) as runner:
                return runner.run(supervisor.run())
        except OSError as exc:
            print(f"error: cannot listen on the admin port: {exc}", file=sys.stderr)  # noqa: T201
            return 1
        finally:
            supervisor.kill_stragglers()
            log_handler.flush()


class _Supervisor:
    def __init__(
        self,
        settings: RouterSettings,
        consul_settings: ConsulSettings,
        port: int,
        log_handler: BufferedLineHandler,
    ) -> None:
        self.log_handler = log_handler
        self.settings = settings
        self.consul_settings = consul_settings
        self.port = port
        self.workers: list[_Worker] = []
        self.shutting_down = False
        self._session: aiohttp.ClientSession | None = None

    async def run(self) -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        flusher = asyncio.create_task(flush_logs_periodically(self.log_handler))
        try:
            return await self._run(stop)
        finally:
            flusher.cancel()

    async def _run(self, stop: asyncio.Event) -> int:
        async with (
            ConsulClient(self.consul_settings) as consul,
            aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=_WORKER_PROBE_TIMEOUT_S)
            ) as session,
        ):
            self._session = session
            admin = self._admin_runner()
            await admin.setup()
            try:
                return await self._serve(consul, admin, stop)
            finally:
                await admin.cleanup()

    async def _serve(self, consul: ConsulClient, admin: web.AppRunner, stop: asyncio.Event) -> int:
        settings = self.settings
        admin_site = web.TCPSite(admin, settings.admin_host, settings.admin_port or 0)
        await admin_site.start()
        admin_port = int(admin.addresses[0][1])
        started = await self._start_workers(stop)
        if not started:
            return await self._stop_workers(failed=not stop.is_set())
        host = f"[{settings.host}]" if ":" in settings.host else settings.host
        admin_host = (
            f"[{settings.admin_host}]" if ":" in settings.admin_host else settings.admin_host
        )
        print(f"caravan router admin on http://{admin_host}:{admin_port}", flush=True)  # noqa: T201
        print(f"caravan router listening on http://{host}:{self.port}", flush=True)  # noqa: T201
        log.info("router_workers_started", extra={"workers": len(self.workers), "port": self.port})
        registration = router_registration(settings, self.port, admin_port)
        registering = asyncio.create_task(self._register(consul, registration))
        died = asyncio.create_task(self._first_death())
        stopping = asyncio.create_task(stop.wait())
        await asyncio.wait({died, stopping}, return_when=asyncio.FIRST_COMPLETED)
        failed = died.done()
        if failed:
            worker = died.result()
            log.error(
                "router_worker_died",
                extra={"worker": worker.index, "exit_code": worker.process.exitcode},
            )
        for task in (registering, died, stopping):
            task.cancel()
        await asyncio.gather(registering, died, stopping, return_exceptions=True)
        self.shutting_down = True
        log.info("router_stopping", extra={"shutdown_timeout_s": settings.shutdown_timeout_s})
        if settings.register_service:
            try:
                await consul.agent_service_deregister(str(registration.service_id))
                log.info("router_deregistered", extra={"service_id": registration.service_id})
            except HashiError as exc:
                log.warning("router_deregister_failed", extra={"error": str(exc)})
        return await self._stop_workers(failed=failed)

    async def _start_workers(self, stop: asyncio.Event) -> bool:
        """Start every worker and wait for each to report its admin port; False if one
        failed to start or a stop signal came first."""
        context = multiprocessing.get_context("spawn")
        child_settings = worker_settings(self.settings, self.port)
        waits = []
        for index in range(self.settings.workers):
            receive, send = context.Pipe(duplex=False)
            process = context.Process(
                target=_worker_main,
                args=(child_settings, index, send),
                name=f"caravan-router-worker-{index}",
            )
            process.start()
            send.close()
            worker = _Worker(index, process)
            self.workers.append(worker)
            waits.append(self._await_ready(worker, receive))
        gathered: asyncio.Future[list[bool]] = asyncio.gather(*waits)
        stopping = asyncio.create_task(stop.wait())
        try:
            async with asyncio.timeout(_START_TIMEOUT_S):
                either: list[asyncio.Future[object]] = [gathered, stopping]  # type: ignore[list-item]
                await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        except TimeoutError:
            log.warning("router_workers_start_timeout", extra={"timeout_s": _START_TIMEOUT_S})
        stopping.cancel()
        if not gathered.done():
            gathered.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await gathered
            return False
        return all(gathered.result()) and not stop.is_set()

    async def _await_ready(
        self, worker: _Worker, receive: multiprocessing.connection.Connection
    ) -> bool:
        with receive:
            await _readable(receive.fileno())
            try:
                worker.admin_port = int(receive.recv())
            except EOFError:
                log.warning(
                    "router_worker_start_failed",
                    extra={"worker": worker.index, "exit_code": worker.process.exitcode},
                )
                return False
        return True

    async def _first_death(self) -> _Worker:
        async def watch(worker: _Worker) -> _Worker:
            await _readable(worker.process.sentinel)
            return worker

        tasks = [asyncio.create_task(watch(w)) for w in self.workers]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            return done.pop().result()
        finally:
            for task in tasks:
                task.cancel()
            # Each removes its reader before anyone else watches the same sentinel.
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _register(self, consul: ConsulClient, registration: ServiceRegistration) -> None:
        if not self.settings.register_service:
            return
        attempt = 0
        while True:
            try:
                await consul.agent_service_register(registration, replace_existing_checks=True)
            except HashiError as exc:
                delay = _REGISTER_RETRY_S[min(attempt, len(_REGISTER_RETRY_S) - 1)]
                attempt += 1
                log.warning(
                    "router_register_failed", extra={"error": str(exc), "retry_in_s": delay}
                )
                await asyncio.sleep(delay)
            else:
                log.info("router_registered", extra={"service_id": registration.service_id})
                return

    async def _stop_workers(self, *, failed: bool) -> int:
        """SIGTERM every live worker and wait for it (killed after the grace); the exit code."""
        for worker in self.workers:
            if worker.process.exitcode is None:
                worker.process.terminate()
        deadline = self.settings.shutdown_timeout_s + _STOP_GRACE_S
        clean = not failed
        for worker in self.workers:
            if worker.process.exitcode is None:
                try:
                    async with asyncio.timeout(deadline):
                        await _readable(worker.process.sentinel)
                except TimeoutError:
                    log.warning("router_worker_stop_timeout", extra={"worker": worker.index})
                    worker.process.kill()
                    clean = False
            worker.process.join(timeout=_STOP_GRACE_S)
            # -SIGTERM: it was stopped before its own handler was in place (still starting).
            clean = clean and worker.process.exitcode in {0, -signal.SIGTERM}
        log.info(
            "router_stopped",
            extra={"exit_codes": [w.process.exitcode for w in self.workers]},
        )
        return 0 if clean else 1

    def kill_stragglers(self) -> None:
        """Last resort on the way out (an exception in the supervisor): no orphan keeps serving."""
        for worker in self.workers:
            if worker.process.exitcode is None:
                worker.process.kill()
                worker.process.join(timeout=_STOP_GRACE_S)

    # -- the supervisor's admin listener -------------------------------------------------------

    def _admin_runner(self) -> web.AppRunner:
        """The admin listener, hardened as a single router's is
        (caravan_llm.router.edge.http_limits: header
        deadline, connection cap); its own connection counts are not exported."""
        settings = self.settings
        guard = ConnectionGuard(
            listener="admin",
            limit=min(settings.max_connections or _ADMIN_MAX_CONNECTIONS, _ADMIN_MAX_CONNECTIONS),
            header_timeout_s=settings.header_read_timeout_s,
            metrics=RouterMetrics(CollectorRegistry()),
        )
        return GuardedAppRunner(
            self._admin_app(),
            guard=guard,
            handler_cancellation=True,
            shutdown_timeout=1.0,
            access_log=None,
            keepalive_timeout=settings.keepalive_timeout_s,
            max_line_size=settings.max_header_field_bytes,
            max_field_size=settings.max_header_field_bytes,
        )

    def _admin_app(self) -> web.Application:
        app = web.Application(client_max_size=1024, middlewares=[_json_errors])
        app.add_routes([web.get("/health", self._health), web.get("/metrics", self._metrics)])
        return app

    async def _fetch(self, worker: _Worker, path: str) -> tuple[int | None, str | None]:
        if (
            worker.admin_port is None
            or self._session is None
            or worker.process.exitcode is not None
        ):
            return None, None
        try:
            async with self._session.get(
                f"http://{_WORKER_ADMIN_HOST}:{worker.admin_port}{path}"
            ) as response:
                return response.status, await response.text()
        except (aiohttp.ClientError, TimeoutError):
            return None, None

    async def _health(self, _request: web.Request) -> web.Response:
        answers = await asyncio.gather(*(self._fetch(w, "/health") for w in self.workers))
        states = []
        for worker, (status, text) in zip(self.workers, answers, strict=True):
            body: object = None
            if text is not None:
                with contextlib.suppress(ValueError):
                    body = json.loads(text)
            states.append(WorkerHealth(worker.index, status, body))
        status, body = combined_health(states, shutting_down=self.shutting_down)
        return web.json_response(body, status=status)

    async def _metrics(self, _request: web.Request) -> web.Response:
        answers = await asyncio.gather(*(self._fetch(w, "/metrics") for w in self.workers))
        texts = {
            worker.index: text if status == 200 else None
            for worker, (status, text) in zip(self.workers, answers, strict=True)
        }
        return web.Response(
            body=exposition(merge_expositions(texts)), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )


@web.middleware
async def _json_errors(
    request: web.Request, handler: Callable[[web.Request], object]
) -> web.StreamResponse:
    """aiohttp's own 404/405 as OpenAI-shaped JSON, like every other router answer."""
    try:
        response = await handler(request)  # type: ignore[misc]
    except web.HTTPException as exc:
        body = {
            "error": {
                "message": exc.reason,
                "type": "invalid_request_error",
                "param": None,
                "code": "not_found" if exc.status == 404 else "method_not_allowed",
            }
        }
        return web.json_response(body, status=exc.status)
    assert isinstance(response, web.StreamResponse)  # noqa: S101
    return response
