"""`caravan router`: run the OpenAI router (settings from flags and CARAVAN_ROUTER_* env)."""

from __future__ import annotations

import argparse
import os

from pydantic import ValidationError

from caravan_llm.cli.output import fail
from caravan_llm.common.consul_api import ConsulSettings
from caravan_llm.common.settings_help import print_settings_errors, settings_error_lines
from caravan_llm.router.core.balancer import Policy
from caravan_llm.router.settings import RouterSettings
from caravan_llm.router.wiring.entry import run


def add_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "router",
        help="run the OpenAI-compatible router",
        description=(
            "Route OpenAI requests to the model replicas Consul reports ready. Settings come "
            "from CARAVAN_ROUTER_* variables (see router/README.md); these flags override them. "
            "Consul is found through CONSUL_HTTP_ADDR, CONSUL_HTTP_TOKEN and the other "
            "variables the Consul CLI reads. Open files: the router raises its soft "
            "RLIMIT_NOFILE to the hard limit at start and needs two descriptors per proxied "
            "connection (one per idle keep-alive one) plus 64; its default connection cap is "
            "(limit - 64) / 2, so 10,000 connections need a hard limit of at least 20,064 "
            "(ulimit -Hn, systemd LimitNOFILE)."
        ),
    )
    parser.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port to listen on (default 8080; 0 = any)")
    parser.add_argument("--kv-prefix", help="Consul KV prefix of caravan (default caravan/)")
    parser.add_argument(
        "--policy",
        choices=[policy.value for policy in Policy],
        help="balancing policy (default predicted_ttft)",
    )
    parser.add_argument(
        "--api-keys-file",
        help="YAML/JSON list of named API keys {name, key, max_priority, rps, burst}",
    )
    parser.add_argument("--admin-host", help="address of the /health and /metrics listener")
    parser.add_argument(
        "--admin-port",
        type=int,
        help="serve /health and /metrics on this port instead of the public one (0 = any)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        help="processes serving the one port (SO_REUSEPORT), sharing nothing (default 1)",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="settings errors as one JSON document (log lines are JSON by default)",
    )
    parser.set_defaults(handler=run_router)


def run_router(args: argparse.Namespace) -> int:
    overrides = {
        "host": args.host,
        "port": args.port,
        "kv_prefix": args.kv_prefix,
        "policy": args.policy,
        "api_keys_file": args.api_keys_file,
        "admin_host": args.admin_host,
        "admin_port": args.admin_port,
        "workers": args.workers,
        "log_format": "json" if args.json else None,
    }
    given = {k: v for k, v in overrides.items() if v is not None}
    try:
        settings = RouterSettings(**given)
    except ValidationError as exc:
        if args.json:
            problems = settings_error_lines(RouterSettings, exc, from_flags=given)
            return fail(
                args, "invalid settings", kind="invalid_settings", problems=problems, code=2
            )
        return print_settings_errors(RouterSettings, exc, from_flags=given)
    # A bad CONSUL_* TLS file raises SettingsError here: one line and exit 1 from main.
    ConsulSettings.from_env(os.environ)
    return run(settings, os.environ)
