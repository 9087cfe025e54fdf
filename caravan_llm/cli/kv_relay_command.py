"""`caravan kv-relay`: run a replica's KV relay (settings from flags and CARAVAN_KV_RELAY_* env).

Thin wiring over `python -m caravan_llm.kvrelay`: the same `RelaySettings`,
the flags below override their fields. The engine key is never a flag: it
comes from the engine task's variable (kvrelay/README.md).
"""

from __future__ import annotations

import argparse

from pydantic import ValidationError

from caravan_llm.cli.output import fail
from caravan_llm.common.settings_help import print_settings_errors, settings_error_lines
from caravan_llm.kvrelay.relay import run
from caravan_llm.kvrelay.settings import RelaySettings


def add_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "kv-relay",
        help="run a replica's KV relay (engine KV events in, block digests out)",
        description=(
            "Read a vLLM/SGLang engine's KV-cache events inside its allocation (ipc:// or "
            "loopback tcp:// only) and serve routers the blocks' keyed digests, never token "
            "ids, on GET /v1/kv/stream behind the engine key. Settings come from "
            "CARAVAN_KV_RELAY_* variables (`python -m caravan_llm.kvrelay --help` lists them "
            "all); these flags override them. The engine key is read from VLLM_API_KEY, "
            "CARAVAN_ENGINE_API_KEY or CARAVAN_KV_RELAY_ENGINE_API_KEY, never from a flag."
        ),
    )
    parser.add_argument(
        "--events-endpoint", help="the engine's KV-event endpoint (ipc://... or tcp://127.0.0.1:N)"
    )
    parser.add_argument("--replay-endpoint", help="the engine's replay endpoint (same rule)")
    parser.add_argument("--topic", help="the engine's KV-event topic (default kv-events)")
    parser.add_argument("--block-size", type=int, help="the engine's KV block size in tokens")
    parser.add_argument("--host", help="address of the digest stream (default $NOMAD_IP_kv)")
    parser.add_argument(
        "--port", type=int, help="port of the digest stream (default $NOMAD_PORT_kv)"
    )
    parser.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--log-format", choices=["json", "text"], help="log lines on stderr")
    parser.add_argument(
        "--json",
        action="store_true",
        help="JSON log lines (--log-format json) and settings errors as one JSON document",
    )
    parser.set_defaults(handler=run_kv_relay)


def run_kv_relay(args: argparse.Namespace) -> int:
    overrides = {
        "events_endpoint": args.events_endpoint,
        "replay_endpoint": args.replay_endpoint,
        "topic": args.topic,
        "block_size": args.block_size,
        "host": args.host,
        "port": args.port,
        "log_level": args.log_level,
        "log_format": "json" if args.json else args.log_format,
    }
    given = {k: v for k, v in overrides.items() if v is not None}
    try:
        settings = RelaySettings(**given)
    except ValidationError as exc:
        if args.json:
            problems = settings_error_lines(RelaySettings, exc, from_flags=given)
            return fail(
                args, "invalid settings", kind="invalid_settings", problems=problems, code=2
            )
        return print_settings_errors(RelaySettings, exc, from_flags=given)
    return run(settings)
