"""`caravan scheduler`: run the control plane (reconcile loop, autoscaler, HTTP API).

Thin wiring over `python -m caravan_llm.scheduler`: the same `SchedulerSettings`
(`CARAVAN_SCHEDULER_*`), the flags below override their fields, and
`caravan_llm.scheduler.server.run` does the rest (signals, ordered shutdown).
"""

from __future__ import annotations

import argparse
import os

from pydantic import ValidationError

from caravan_llm.cli.output import fail
from caravan_llm.common.settings_help import print_settings_errors, settings_error_lines
from caravan_llm.scheduler.api_auth import TOKENS_ENV, TOKENS_FILE_ENV
from caravan_llm.scheduler.server import run
from caravan_llm.scheduler.settings import SchedulerSettings


def add_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "scheduler",
        help="run the scheduler (reconcile loop, autoscaler, HTTP API)",
        description=(
            "Keep one Nomad job per replica of every model in Consul KV. Several schedulers may "
            "run; one leads (Consul session lock on <prefix>leader). Settings come from "
            "CARAVAN_SCHEDULER_* variables (`python -m caravan_llm.scheduler --help` lists them "
            "all); these "
            "flags override them. Nomad and Consul are found through NOMAD_ADDR, NOMAD_TOKEN, "
            "CONSUL_HTTP_ADDR, CONSUL_HTTP_TOKEN and friends. "
            f"The HTTP API needs a bearer token from {TOKENS_ENV} (comma-separated) or "
            f"{TOKENS_FILE_ENV} (one per line, re-read when it changes); without one it "
            "listens on 127.0.0.1 only, whatever --http-host says."
        ),
    )
    parser.add_argument(
        "--http-host",
        help="API address (default 127.0.0.1; loopback only unless API tokens are set)",
    )
    parser.add_argument("--http-port", type=int, help="API port (default 8090)")
    parser.add_argument("--kv-prefix", help="Consul KV prefix (default caravan/)")
    parser.add_argument(
        "--api-tokens-file",
        metavar="FILE",
        help=f"API bearer tokens, one per line, re-read on change (default ${TOKENS_FILE_ENV})",
    )
    parser.add_argument("--cluster-config", help="cluster config YAML (GPU classes, images)")
    parser.add_argument(
        "--no-autoscale",
        action="store_const",
        const=False,
        dest="autoscale",
        help="keep counts manual (caravan scale)",
    )
    parser.add_argument(
        "--leader-ttl-s",
        type=float,
        help=(
            "session TTL of the leader lock (Consul accepts 10 s to 24 h); a crashed leader "
            "is replaced within 2 x TTL + lock-delay (default 15)"
        ),
    )
    parser.add_argument(
        "--leader-lock-delay-s",
        type=float,
        help="Consul lock-delay after a leader's session is invalidated (default 5)",
    )
    parser.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--log-format", choices=["json", "text"], help="log lines on stderr")
    parser.add_argument(
        "--json",
        action="store_true",
        help="JSON log lines (--log-format json) and settings errors as one JSON document",
    )
    parser.set_defaults(handler=run_scheduler)


def run_scheduler(args: argparse.Namespace) -> int:
    # Tokens only through the environment or a file, never a flag, which `ps` shows.
    overrides = {
        "http_host": args.http_host,
        "http_port": args.http_port,
        "kv_prefix": args.kv_prefix,
        "api_tokens_file": args.api_tokens_file,
        "cluster_config": args.cluster_config,
        "autoscale": args.autoscale,
        "leader_ttl_s": args.leader_ttl_s,
        "leader_lock_delay_s": args.leader_lock_delay_s,
        "log_level": args.log_level,
        "log_format": "json" if args.json else args.log_format,
    }
    given = {k: v for k, v in overrides.items() if v is not None}
    try:
        settings = SchedulerSettings(**given)
    except ValidationError as exc:
        if args.json:
            problems = settings_error_lines(SchedulerSettings, exc, from_flags=given)
            return fail(
                args, "invalid settings", kind="invalid_settings", problems=problems, code=2
            )
        return print_settings_errors(SchedulerSettings, exc, from_flags=given)
    return run(settings, os.environ)
