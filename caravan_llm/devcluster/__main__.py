"""`python -m caravan_llm.devcluster`: run the local Consul and Nomad stand-ins until
SIGINT/SIGTERM.

Once ready it prints, each on its own line and flushed:

    export CONSUL_HTTP_ADDR=127.0.0.1:<port>
    export CARAVAN_DNS_PORT=<port>
    export NOMAD_ADDR=http://127.0.0.1:<port>

On SIGTERM every task process the simulated Nomad nodes started is stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Sequence

from caravan_llm.devcluster.cluster import ClusterConfig, DevCluster
from caravan_llm.devcluster.consul.durations import parse_go_duration_s
from caravan_llm.devcluster.consul.server import ConsulConfig
from caravan_llm.devcluster.nomad.settings import add_nomad_arguments, settings_from_args


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port must be 0..65535 (0 = any free port), got {text}")
    return value


def _duration(text: str) -> float:
    try:
        seconds = parse_go_duration_s(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{exc} (use a Go duration such as 10s or 500ms)") from exc
    if seconds <= 0:
        raise argparse.ArgumentTypeError(f"duration must be positive, got {text}")
    return seconds


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m caravan_llm.devcluster",
        description="A local stand-in for `consul agent -dev` and `nomad agent -dev`.",
    )
    parser.add_argument("--consul-port", type=_port, default=8500, help="HTTP port (0 = any free)")
    parser.add_argument("--dns-port", type=_port, default=8600, help="DNS port (0 = any free)")
    parser.add_argument(
        "--consul-token",
        default=None,
        help="enable ACLs (default deny) with this management token",
    )
    parser.add_argument(
        "--session-ttl-min",
        type=_duration,
        default=10.0,
        help="smallest session TTL accepted (Consul: 10s; devcluster-only knob)",
    )
    parser.add_argument(
        "--check-reap-interval",
        type=_duration,
        default=30.0,
        help="how often critical services are reaped (Consul: 30s)",
    )
    parser.add_argument(
        "--deregister-critical-min",
        type=_duration,
        default=60.0,
        help="floor on DeregisterCriticalServiceAfter (Consul: 1m)",
    )
    parser.add_argument("--log-level", default="INFO", help="logging level (stderr)")
    add_nomad_arguments(parser)
    return parser


async def run(config: ClusterConfig) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    async with DevCluster(config) as cluster:
        sys.stdout.write("".join(f"{line}\n" for line in cluster.exports()))
        sys.stdout.flush()
        await stop.wait()
    return 0


class KeyValueFormatter(logging.Formatter):
    """`time level logger event key=value ...`: the `extra=` context stays visible."""

    _standard = frozenset(logging.makeLogRecord({}).__dict__) | {"message", "asctime"}

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        context = " ".join(
            f"{key}={value}" for key, value in record.__dict__.items() if key not in self._standard
        )
        return f"{line} {context}" if context else line


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(KeyValueFormatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    logging.basicConfig(level=args.log_level.upper(), handlers=[handler])
    consul = ConsulConfig(
        http_port=args.consul_port,
        dns_port=args.dns_port,
        management_token=args.consul_token,
        session_ttl_min_s=args.session_ttl_min,
        check_reap_interval_s=args.check_reap_interval,
        deregister_critical_min_s=args.deregister_critical_min,
    )
    try:
        nomad = settings_from_args(args)
    except ValueError as exc:
        sys.stderr.write(f"devcluster: {exc}\n")
        return 2
    try:
        return asyncio.run(run(ClusterConfig(consul=consul, nomad=nomad)))
    except OSError as exc:
        # Typically a port in use: say which, and how to get a free one.
        sys.stderr.write(
            f"devcluster: cannot listen ({exc}); ports {args.consul_port}/{args.dns_port}/"
            f"{args.nomad_port} (use --consul-port 0 --dns-port 0 --nomad-port 0 for free ports)\n"
        )
        return 1


if __name__ == "__main__":
    sys.exit(main())
