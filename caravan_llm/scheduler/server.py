"""Run the scheduler process: settings checked, clients, parts, ordered startup and shutdown.

Startup order:

1. logging, then every setting that can be refused before anything starts
   (cluster config file, Consul and Nomad variables and TLS files, API tokens);
2. the Consul and Nomad clients;
3. every part, built before it runs (`caravan_llm.scheduler.app.build_scheduler`);
4. the API listener, then the watches, the leader election and the loops.

Shutdown order on SIGTERM/SIGINT:

1. the reconcile and autoscaler loops and the watches stop (no more writes);
2. leadership is resigned: lock released, session destroyed, so a standby
   takes over without waiting for the session TTL;
3. the API listener closes;
4. the Consul and Nomad clients close.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Mapping

from caravan_llm.common.consul_api import ConsulSettings
from caravan_llm.common.errors import SettingsError
from caravan_llm.common.log_format import configure_logging
from caravan_llm.common.nomad_api import NomadSettings
from caravan_llm.scheduler.app import SchedulerProcess, build_scheduler, scheduler_clients
from caravan_llm.scheduler.cluster_config import (
    ClusterConfig,
    ClusterConfigError,
    load_cluster_config,
    with_nomad_namespace,
)
from caravan_llm.scheduler.settings import DEPRECATED_KV_PREFIX_ENV, ENV_PREFIX, SchedulerSettings

log = logging.getLogger(__name__)


async def serve(
    settings: SchedulerSettings,
    config: ClusterConfig,
    environ: Mapping[str, str],
    *,
    stop: asyncio.Event | None = None,
) -> None:
    """Serve until SIGTERM or SIGINT (or `stop` is set), then shut down in order."""
    if stop is None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
    async with scheduler_clients(environ, namespace=config.namespace) as (consul, nomad):
        process = build_scheduler(settings, config=config, consul=consul, nomad=nomad)
        await _run_until(process, stop)
    log.info("scheduler_clients_closed")


async def _run_until(process: SchedulerProcess, stop: asyncio.Event) -> None:
    running = asyncio.create_task(process.run(), name="scheduler")
    ready = asyncio.create_task(process.ready.wait())
    stopping = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({running, ready, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if process.ready.is_set() and not running.done():
            print(  # noqa: T201
                f"caravan scheduler listening on http://{process.bound_host}:{process.bound_port}",
                flush=True,
            )
            await asyncio.wait({running, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if not running.done():
            log.info("scheduler_stopping")
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await running  # raises what made it stop on its own (a taken port, ...)
    finally:
        ready.cancel()
        stopping.cancel()
        running.cancel()


def deprecated_alias_used(environ: Mapping[str, str]) -> bool:
    """Whether the KV prefix comes from the deprecated `CARAVAN_KV_PREFIX`."""
    return bool(environ.get(DEPRECATED_KV_PREFIX_ENV)) and not environ.get(f"{ENV_PREFIX}KV_PREFIX")


def run(settings: SchedulerSettings, environ: Mapping[str, str]) -> int:
    """The process entry point shared by `python -m caravan_llm.scheduler` and `caravan scheduler`.

    Exit codes: 0 after a signal; 1 for an unusable client setting or token
    (SettingsError, one line naming the variable and file) or a port that cannot
    be bound; 2 for an invalid cluster config (or one whose namespace is not NOMAD_NAMESPACE).
    """
    # Every line at once: the scheduler logs little, and an operator watching
    # its start must see each line when it happens.
    configure_logging(settings.log_level, settings.log_format, batch_lines=1)
    if deprecated_alias_used(environ):
        log.warning(
            "deprecated_setting",
            extra={"variable": DEPRECATED_KV_PREFIX_ENV, "use": f"{ENV_PREFIX}KV_PREFIX"},
        )
    try:
        config = load_cluster_config(settings.cluster_config)
    except ClusterConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)  # noqa: T201
        return 2
    try:
        # Read now, so a bad TLS file or token is one line before anything starts.
        ConsulSettings.from_env(environ)
        nomad_settings = NomadSettings.from_env(environ)
        settings.token_source()
    except SettingsError as exc:
        print(f"error: {exc}", file=sys.stderr)  # noqa: T201
        return 1
    try:
        config = with_nomad_namespace(config, nomad_settings.namespace)
    except ClusterConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)  # noqa: T201
        return 2
    try:
        asyncio.run(serve(settings, config, environ))
    except OSError as exc:
        # A taken port or an address that is not ours.
        print(  # noqa: T201
            f"error: cannot listen on {settings.http_host}:{settings.http_port}: {exc}",
            file=sys.stderr,
        )
        return 1
    return 0
