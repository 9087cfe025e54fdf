"""The `caravan` command: one entry point, a subcommand per module.

Each module in `COMMAND_MODULES` adds its subcommands to the parser; the
commands themselves are thin wiring over the packages' pure functions.
Only the module of the subcommand being run is imported (`caravan validate`
never loads the router, the scheduler's process or the demo); `--help` and
an unknown command load them all.
A setting that cannot be used (a missing CA file, a bad client certificate,
an invalid API token file: `caravan.errors.SettingsError`) ends any
subcommand with one `error:` line naming the variable and the file, exit 1.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
from typing import TYPE_CHECKING, Protocol, cast

from caravan.errors import SettingsError

if TYPE_CHECKING:
    from collections.abc import Sequence


class CommandModule(Protocol):
    def add_commands(self, subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
        """Register this module's subcommands; each sets `handler` via set_defaults."""


# Module -> the subcommands it adds, in `--help` order. A test keeps the
# names equal to what each module registers.
COMMAND_MODULES: dict[str, tuple[str, ...]] = {
    "caravan_cli.profile_commands": ("validate", "render"),
    "caravan_cli.model_commands": (
        "submit",
        "list",
        "status",
        "delete",
        "scale",
        "plan",
        "history",
        "revert",
    ),
    "caravan_cli.scheduler_command": ("scheduler",),
    "caravan_cli.router_command": ("router",),
    "caravan_cli.demo": ("demo",),
}


def command_module(name: str) -> CommandModule:
    return cast("CommandModule", importlib.import_module(name))


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; with `command`, only that command's module is loaded (if it names one)."""
    parser = argparse.ArgumentParser(
        prog="caravan",
        description="Run LLM inference replicas on Nomad, discover them through Consul.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    wanted = [name for name, commands in COMMAND_MODULES.items() if command in commands]
    for name in wanted or COMMAND_MODULES:
        command_module(name).add_commands(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    first = next((word for word in arguments if not word.startswith("-")), None)
    parser = build_parser(first if arguments and arguments[0] == first else None)
    args = parser.parse_args(arguments)
    handler = args.handler
    try:
        code: int = handler(args)
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader went away (`caravan list --json | head`): stop quietly with
        # the status of a process ended by SIGPIPE. stdout goes to /dev/null so
        # the interpreter's own flush at exit cannot fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except KeyboardInterrupt:
        return 130
    except SettingsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return code


if __name__ == "__main__":
    sys.exit(main())
