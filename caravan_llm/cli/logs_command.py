"""`caravan logs MODEL [--replica N] [-f]`: a replica's engine log, from Nomad.

The log is read through Nomad's API (`GET /v1/client/fs/logs/:alloc`), as
`nomad alloc logs -job caravan-MODEL-N engine` would: the replica's job is
`caravan-<model>-<N>`, its allocation the newest running one (else the
newest), its task `engine`. The token is NOMAD_TOKEN and needs `read-logs`
(or `read-fs`) and `read-job` in caravan's namespace; NOMAD_ADDR,
NOMAD_NAMESPACE, NOMAD_REGION and the TLS variables (or the Nomad CLI's
flags) say where and how.

With `--json` each piece of log is one JSON object per line
(`{"model", "replica", "alloc_id", "type", "file", "offset", "data"}`),
errors one JSON document, as every command's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Sequence

from caravan_llm.cli.nomad_flags import add_nomad_flags, nomad_environ
from caravan_llm.cli.output import fail
from caravan_llm.common.contract import TASK_NAME, replica_job_id
from caravan_llm.common.errors import HashiError, HashiNotFound, HashiPermissionDenied
from caravan_llm.common.nomad_api import Allocation, NomadClient, NomadSettings

# How many bytes before the end `--tail` reads per line asked for, and at most.
TAIL_BYTES_PER_LINE = 1024
MAX_TAIL_BYTES = 1 << 20


def add_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "logs",
        help="print a replica's engine log (stdout, or --stderr), from Nomad",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("model", metavar="MODEL")
    parser.add_argument("--replica", type=int, default=0, help="replica index (default 0)")
    parser.add_argument(
        "-f", "--follow", action="store_true", help="keep printing what the engine writes"
    )
    parser.add_argument("--stderr", action="store_true", help="the engine's stderr, not stdout")
    parser.add_argument(
        "--tail", action="store_true", help="start at the end: the last -n lines (default 10)"
    )
    parser.add_argument("-n", dest="lines", type=int, default=10, help="lines for --tail")
    parser.add_argument("--json", action="store_true", help="one JSON object per piece of log")
    add_nomad_flags(parser)
    parser.set_defaults(handler=run_logs)


def choose_allocation(allocations: Sequence[Allocation], job_id: str) -> Allocation | None:
    """The job's newest running allocation, else its newest one (pure), as `nomad -job` picks."""
    mine = [a for a in allocations if a.job_id == job_id]
    running = [a for a in mine if a.client_status == "running"]
    return max(running or mine, key=lambda a: (a.create_time_ns, a.id), default=None)


def last_lines(data: bytes, count: int) -> bytes:
    """The last `count` lines of `data` (a trailing newline ends the last line)."""
    if count <= 0:
        return b""
    lines = data.splitlines(keepends=True)
    return b"".join(lines[-count:])


def run_logs(args: argparse.Namespace) -> int:
    try:
        return asyncio.run(_logs(args))
    except HashiPermissionDenied as exc:
        return fail(
            args,
            f"{exc} (NOMAD_TOKEN needs read-logs and read-job in the namespace)",
            kind="permission_denied",
        )
    except HashiNotFound as exc:
        return fail(args, str(exc), kind="not_found")
    except HashiError as exc:
        hint = "check NOMAD_ADDR and that Nomad answers" if exc.retryable else None
        return fail(args, str(exc), kind="backend_error", hint=hint)
    except LookupError as exc:
        return fail(args, str(exc.args[0]), kind="not_found")


async def _logs(args: argparse.Namespace) -> int:
    if args.replica < 0:
        raise LookupError(f"--replica must be 0 or more, got {args.replica}")
    settings = NomadSettings.from_env(nomad_environ(args))
    job_id = replica_job_id(args.model, args.replica)
    log_type = "stderr" if args.stderr else "stdout"
    async with NomadClient(settings) as nomad:
        allocations = (await nomad.list_allocations()).value
        chosen = choose_allocation(allocations, job_id)
        if chosen is None:
            raise LookupError(
                f"replica {args.replica} of {args.model} has no allocation (job {job_id}); "
                f"`caravan status {args.model}` says why"
            )
        writer = _Writer(args, chosen.id, log_type)
        if args.tail:
            window = min(max(args.lines, 1) * TAIL_BYTES_PER_LINE, MAX_TAIL_BYTES)
            tail = b""
            end = 0
            async for frame in nomad.stream_logs(
                chosen.id, TASK_NAME, log_type=log_type, origin="end", offset=window
            ):
                tail += frame.data
                end = frame.offset
                writer.file = frame.file
            writer.write(last_lines(tail, args.lines), end)
            if not args.follow:
                return 0
            frames = nomad.stream_logs(
                chosen.id, TASK_NAME, log_type=log_type, follow=True, offset=end
            )
        else:
            frames = nomad.stream_logs(chosen.id, TASK_NAME, log_type=log_type, follow=args.follow)
        async for frame in frames:
            writer.file = frame.file
            writer.write(frame.data, frame.offset)
    return 0


class _Writer:
    """Log bytes to stdout as they are, or as JSON lines with --json."""

    def __init__(self, args: argparse.Namespace, alloc_id: str, log_type: str) -> None:
        self.args = args
        self.alloc_id = alloc_id
        self.log_type = log_type
        self.file = ""

    def write(self, data: bytes, offset: int) -> None:
        if not data:
            return
        if self.args.json:
            document = {
                "model": self.args.model,
                "replica": self.args.replica,
                "alloc_id": self.alloc_id,
                "type": self.log_type,
                "file": self.file,
                "offset": offset,
                "data": data.decode("utf-8", "replace"),
            }
            print(json.dumps(document), flush=True)
            return
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()
