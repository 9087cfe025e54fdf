"""`caravan scheduler`: run the control plane (reconcile loop, autoscaler, HTTP API)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys

from caravan.consul_api import ConsulSettings
from caravan.contract import KVLayout
from caravan.log_format import configure_logging
from caravan.nomad_api import NomadSettings
from scheduler.api_auth import TOKENS_ENV, TOKENS_FILE_ENV, load_token_source
from scheduler.app import SchedulerOptions, SchedulerProcess, scheduler_clients
from scheduler.cluster_config import ClusterConfig, ClusterConfigError, load_cluster_config


def add_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "scheduler",
        help="run the scheduler (reconcile loop, autoscaler, HTTP API)",
        description=(
            "Keep one Nomad job per replica of every model in Consul KV. Several schedulers may "
            "run; one leads (Consul session lock on <prefix>leader). Nomad and Consul are found "
            "through NOMAD_ADDR, NOMAD_TOKEN, CONSUL_HTTP_ADDR, CONSUL_HTTP_TOKEN and friends. "
            f"The HTTP API needs a bearer token from {TOKENS_ENV} (comma-separated) or "
            f"{TOKENS_FILE_ENV} (one per line, re-read when it changes); without one it "
            "listens on 127.0.0.1 only, whatever --http-host says."
        ),
    )
    parser.add_argument(
        "--http-host",
        default="127.0.0.1",
        help="API address (default 127.0.0.1; loopback only unless API tokens are set)",
    )
    parser.add_argument("--http-port", type=int, default=8090, help="API port (default 8090)")
    parser.add_argument(
        "--kv-prefix",
        default=os.environ.get("CARAVAN_KV_PREFIX", "caravan/"),
        help="Consul KV prefix (default caravan/)",
    )
    parser.add_argument(
        "--api-tokens-file",
        default=os.environ.get(TOKENS_FILE_ENV) or None,
        metavar="FILE",
        help=f"API bearer tokens, one per line, re-read on change (default ${TOKENS_FILE_ENV})",
    )
    parser.add_argument("--cluster-config", help="cluster config YAML (GPU classes, images)")
    parser.add_argument(
        "--no-autoscale", action="store_true", help="keep counts manual (caravan scale)"
    )
    parser.add_argument(
        "--leader-ttl-s",
        type=float,
        default=15.0,
        help=(
            "session TTL of the leader lock (Consul accepts 10 s to 24 h); a crashed leader "
            "is replaced within 2 x TTL + lock-delay (default 15)"
        ),
    )
    parser.add_argument(
        "--leader-lock-delay-s",
        type=float,
        default=5.0,
        help="Consul lock-delay after a leader's session is invalidated (default 5)",
    )
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning"])
    parser.add_argument(
        "--log-format", default="json", choices=["json", "text"], help="log lines on stderr"
    )
    parser.set_defaults(handler=run_scheduler)


def run_scheduler(args: argparse.Namespace) -> int:
    configure_logging(args.log_level, args.log_format)
    try:
        config = load_cluster_config(args.cluster_config)
        KVLayout(args.kv_prefix)
    except (ClusterConfigError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # Tokens only through the environment or a file, never a flag, which `ps` shows.
    # A bad one raises SettingsError: one line and exit 1 from caravan_cli.main.
    api_tokens = load_token_source(os.environ.get(TOKENS_ENV), args.api_tokens_file)
    # Read the Consul and Nomad variables now, so a bad TLS file is reported before anything starts.
    ConsulSettings.from_env(os.environ)
    NomadSettings.from_env(os.environ)
    options = SchedulerOptions(
        http_host=args.http_host,
        http_port=args.http_port,
        kv_prefix=args.kv_prefix,
        autoscale=not args.no_autoscale,
        leader_ttl_s=args.leader_ttl_s,
        leader_lock_delay_s=args.leader_lock_delay_s,
        api_tokens=api_tokens,
    )
    return asyncio.run(_serve(options, config))


async def _serve(options: SchedulerOptions, config: ClusterConfig) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    async with scheduler_clients(os.environ) as (consul, nomad):
        process = SchedulerProcess(options=options, config=config, consul=consul, nomad=nomad)
        task = asyncio.create_task(process.run())
        await process.ready.wait()
        print(
            f"caravan scheduler listening on http://{process.bound_host}:{process.bound_port}",
            flush=True,
        )
        waiter = asyncio.create_task(stop.wait())
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        task.cancel()
        waiter.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    return 0
