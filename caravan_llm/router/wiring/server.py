"""Run the router process: Consul client, app, listener, registration, graceful shutdown.

Shutdown order on SIGTERM/SIGINT (style.md rule 20, "drain before closing"):

1. deregister from Consul, so clients and load balancers stop choosing us;
2. stop accepting connections (`runner.cleanup()` closes the listener);
3. let in-flight requests and streams finish, for up to `shutdown_timeout_s`;
4. stop the background tasks and close the client pool;
5. stop the tokenizers' worker threads (work still queued is dropped).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import importlib
import importlib.util
import logging
import signal
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry

from caravan_llm.common.consul_api import ConsulClient, ConsulSettings
from caravan_llm.common.errors import HashiError
from caravan_llm.common.log_format import BufferedLineHandler, configure_logging
from caravan_llm.common.nomad_api import NomadClient, NomadSettings
from caravan_llm.router.edge.api_keys import ApiKeyError
from caravan_llm.router.edge.http_limits import raise_descriptor_limit
from caravan_llm.router.edge.proxy import RequestLog, log_request
from caravan_llm.router.settings import RouterSettings
from caravan_llm.router.tokens.registry import Tokenizers
from caravan_llm.router.wiring.app import (
    RUNTIME,
    RouterRuntime,
    app_runner,
    create_admin_app,
    create_app,
    key_ring,
)

# Named as before the router's sub-packages: the logger is a field of every log line.
log = logging.getLogger("router.server")

_REGISTER_RETRY_S = (1.0, 2.0, 5.0, 10.0)


@dataclass(frozen=True, slots=True)
class WorkerRole:
    """How a worker of `caravan router --workers N` (router/wiring/workers.py) serves.

    It binds the shared public port with SO_REUSEPORT, prints nothing, never
    registers in Consul, stops on SIGTERM (or when its parent is gone, through
    `parent_sentinel`) but not on SIGINT (the parent orders the shutdown), and
    calls `ready(admin_port)` once both its listeners are up.
    """

    index: int
    ready: Callable[[int], None]
    parent_sentinel: int | None = None


async def serve(
    settings: RouterSettings,
    consul_settings: ConsulSettings,
    log_handler: BufferedLineHandler | None = None,
    nomad_settings: NomadSettings | None = None,
    worker: WorkerRole | None = None,
) -> None:
    """Serve until SIGTERM or SIGINT, then shut down in order (module docstring).

    With `nomad_settings` the engines' API keys are read from Nomad Variables.
    With `worker` it serves as one of several processes on one port (`WorkerRole`).
    """
    flusher = asyncio.create_task(flush_logs_periodically(log_handler)) if log_handler else None
    try:
        await _serve(settings, consul_settings, log_handler, nomad_settings, worker)
    finally:
        if flusher is not None:
            flusher.cancel()
        if log_handler is not None:
            log_handler.flush()


async def flush_logs_periodically(handler: BufferedLineHandler) -> None:
    """Write buffered log lines at least twice a second, even when no new line comes."""
    while True:
        await asyncio.sleep(0.5)
        handler.flush()


def _fast_request_log(
    handler: BufferedLineHandler | None, worker: WorkerRole | None = None
) -> RequestLog | None:
    """The canonical request line written straight to the buffered log handler.

    A worker's lines carry `worker` (its index), so the lines of one port tell
    which process served each request.
    """
    if worker is not None:
        index = worker.index
        base = _fast_request_log(handler) or log_request

        def write_with_worker(fields: dict[str, Any]) -> None:
            fields["worker"] = index
            base(fields)

        return write_with_worker
    if handler is None:
        return None

    def write(fields: dict[str, Any]) -> None:
        handler.write_event("router.proxy", "request", fields)

    return write


async def _serve(
    settings: RouterSettings,
    consul_settings: ConsulSettings,
    log_handler: BufferedLineHandler | None,
    nomad_settings: NomadSettings | None = None,
    worker: WorkerRole | None = None,
) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM,) if worker else (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    if worker is not None and worker.parent_sentinel is not None:
        # The parent died without stopping us (SIGKILL): stop rather than serve unsupervised.
        loop.add_reader(worker.parent_sentinel, stop.set)
    async with ConsulClient(consul_settings) as consul, contextlib.AsyncExitStack() as stack:
        nomad = (
            await stack.enter_async_context(NomadClient(nomad_settings))
            if nomad_settings is not None
            else None
        )
        # Each model's tokenizer, for the exact prefix index; its threads stop last.
        tokenizers = Tokenizers() if settings.kv_events else None
        if tokenizers is not None:
            stack.callback(tokenizers.close)
        app = create_app(
            settings,
            consul=consul,
            registry=CollectorRegistry(),
            request_log=_fast_request_log(log_handler, worker),
            nomad=nomad,
            prompt_tokens=tokenizers,
        )
        runtime = app[RUNTIME]
        if worker is not None:
            # Workers share the router's service id; the demand signals name the process.
            runtime.set_worker(worker.index)
        runner = app_runner(app, settings)
        admin_runner = (
            app_runner(create_admin_app(runtime), settings, listener="admin")
            if settings.admin_port is not None
            else None
        )
        await runner.setup()
        try:
            if admin_runner is not None:
                # /health and /metrics off the public port (before registering, which
                # points Consul's check at it).
                await admin_runner.setup()
                admin_site = web.TCPSite(admin_runner, settings.admin_host, settings.admin_port)
                await admin_site.start()
                runtime.admin_port = int(admin_runner.addresses[0][1])
                admin_host = _shown(settings.admin_host)
                if worker is None:
                    print(  # noqa: T201
                        f"caravan router admin on http://{admin_host}:{runtime.admin_port}",
                        flush=True,
                    )
            site = web.TCPSite(
                runner, settings.host, settings.port, backlog=1024, reuse_port=worker is not None
            )
            await site.start()
            port = int(runner.addresses[0][1])
            # Everything allocated so far lives as long as the process: keep it out
            # of the cyclic collector's generations, so collections stay short.
            gc.freeze()
            registering = asyncio.create_task(_register(runtime, port), name="router-register")
            shown_host = _shown(settings.host)
            if worker is None:
                print(f"caravan router listening on http://{shown_host}:{port}", flush=True)  # noqa: T201
            else:
                worker.ready(runtime.admin_port or 0)
            await stop.wait()
            log.info("router_stopping", extra={"shutdown_timeout_s": settings.shutdown_timeout_s})
            registering.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await registering
            try:
                await runtime.deregister()
            except HashiError as exc:
                log.warning("router_deregister_failed", extra={"error": str(exc)})
        finally:
            await runner.cleanup()
            if admin_runner is not None:
                await admin_runner.cleanup()
    log.info("router_stopped")


def _shown(host: str) -> str:
    return f"[{host}]" if ":" in host else host


async def _register(runtime: RouterRuntime, port: int) -> None:
    """Register in Consul, retrying while Consul is unreachable (serving goes on meanwhile)."""
    attempt = 0
    while True:
        try:
            await runtime.register(port)
        except HashiError as exc:
            delay = _REGISTER_RETRY_S[min(attempt, len(_REGISTER_RETRY_S) - 1)]
            attempt += 1
            log.warning("router_register_failed", extra={"error": str(exc), "retry_in_s": delay})
            await asyncio.sleep(delay)
        else:
            return


def event_loop_factory(choice: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop factory when chosen (or `auto` and installed); None = asyncio's loop.

    Raises ModuleNotFoundError when uvloop is chosen explicitly and missing.
    """
    if choice == "asyncio":
        return None
    if choice == "auto" and importlib.util.find_spec("uvloop") is None:
        return None
    uvloop = importlib.import_module("uvloop")
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


@dataclass(frozen=True, slots=True)
class Startup:
    """What a router process reads from its environment before it serves."""

    consul_settings: ConsulSettings
    # The engines' keys are read with the router's own Nomad token (NOMAD_* variables).
    nomad_settings: NomadSettings | None
    log_handler: BufferedLineHandler
    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None


def start_up(settings: RouterSettings, environ: Mapping[str, str]) -> Startup | int:
    """Logging, Consul and Nomad settings, the key file, the event loop; or the exit code.

    A bad setting is one line on stderr and exit code 2, never a traceback.
    """
    handler = configure_logging(settings.log_level, settings.log_format)
    try:
        consul_settings = ConsulSettings.from_env(environ)
        nomad_settings = NomadSettings.from_env(environ) if settings.engine_api_keys else None
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)  # noqa: T201
        return 2
    try:
        # Read once here too, so a bad key file is one line at startup, not a traceback.
        key_ring(settings)
    except ApiKeyError as exc:
        print(f"error: CARAVAN_ROUTER_API_KEYS_FILE: {exc}", file=sys.stderr)  # noqa: T201
        return 2
    try:
        loop_factory = event_loop_factory(settings.event_loop)
    except ModuleNotFoundError:
        print("error: event_loop is uvloop but uvloop is not installed", file=sys.stderr)  # noqa: T201
        return 2
    # Before anything reads it (the default connection cap): soft up to hard.
    before, after = raise_descriptor_limit()
    if after != before:
        log.info("descriptor_limit_raised", extra={"soft_before": before, "soft": after})
    return Startup(consul_settings, nomad_settings, handler, loop_factory)


def run(
    settings: RouterSettings, environ: Mapping[str, str], worker: WorkerRole | None = None
) -> int:
    """Serve as one router (or as `worker`, one of a supervisor's) until stopped; the exit code.

    `caravan_llm.router.wiring.entry.run` is the process entry point: it comes here unless
    `settings.workers` asks for a supervisor (router/wiring/workers.py).
    """
    startup = start_up(settings, environ)
    if isinstance(startup, int):
        return startup
    return serve_started(settings, startup, worker)


def serve_started(settings: RouterSettings, startup: Startup, worker: WorkerRole | None) -> int:
    """Serve with what `start_up` read, until stopped; the exit code."""
    loop_factory = startup.loop_factory
    log.info("event_loop_chosen", extra={"event_loop": "uvloop" if loop_factory else "asyncio"})
    try:
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            runner.run(
                serve(
                    settings,
                    startup.consul_settings,
                    startup.log_handler,
                    startup.nomad_settings,
                    worker,
                )
            )
    except OSError as exc:
        # A taken port or an address that is not ours.
        print(f"error: cannot listen on {settings.host}:{settings.port}: {exc}", file=sys.stderr)  # noqa: T201
        return 1
    return 0
