"""`caravan router`: run the OpenAI router (settings from flags and CARAVAN_ROUTER_* env)."""

from __future__ import annotations

import argparse
import os
import sys

from pydantic import ValidationError

from router.balancer import Policy
from router.server import run
from router.settings import RouterSettings


def add_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "router",
        help="run the OpenAI-compatible router",
        description=(
            "Route OpenAI requests to the model replicas Consul reports ready. Settings come "
            "from CARAVAN_ROUTER_* variables (see router/README.md); these flags override them. "
            "Consul is found through CONSUL_HTTP_ADDR, CONSUL_HTTP_TOKEN and the other "
            "variables the Consul CLI reads."
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
    parser.set_defaults(handler=run_router)


def run_router(args: argparse.Namespace) -> int:
    overrides = {
        "host": args.host,
        "port": args.port,
        "kv_prefix": args.kv_prefix,
        "policy": args.policy,
    }
    try:
        settings = RouterSettings(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as exc:
        for error in exc.errors():
            field = ".".join(str(part) for part in error["loc"]) or "settings"
            print(f"error: {field}: {error['msg']}", file=sys.stderr)
        return 2
    return run(settings, os.environ)
