"""The `caravan` command: one entry point, a subcommand per module.

Each module in `COMMAND_MODULES` adds its subcommands to the parser; the
commands themselves are thin wiring over the packages' pure functions.
Only the module of the subcommand being run is imported (`caravan validate`
never loads the router, the scheduler's process or the demo); `--help` and
an unknown command load them all.
A setting that cannot be used (a missing CA file, a bad client certificate,
an invalid API token file: `caravan_llm.common.errors.SettingsError`) ends any
subcommand with one `error:` line naming the variable and the file, exit 1.

Every subcommand takes `--json`: its result, and any error (a usage error
included, exit 2), is then one JSON document on stdout
(`caravan_llm/cli/output.py`). `caravan --version` prints the package's version.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import signal
import sys
from typing import TYPE_CHECKING, NoReturn, Protocol, cast

from caravan_llm.cli.output import fail, print_json
from caravan_llm.common.errors import SettingsError

if TYPE_CHECKING:
    from collections.abc import Sequence


class CommandModule(Protocol):
    def add_commands(self, subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
        """Register this module's subcommands; each sets `handler` via set_defaults."""


# Module -> the subcommands it adds, in `--help` order. A test keeps the
# names equal to what each module registers.
COMMAND_MODULES: dict[str, tuple[str, ...]] = {
    "caravan_llm.cli.profile_commands": ("validate", "render"),
    "caravan_llm.cli.model_commands": (
        "submit",
        "list",
        "status",
        "delete",
        "scale",
        "plan",
        "history",
        "revert",
    ),
    "caravan_llm.cli.logs_command": ("logs",),
    "caravan_llm.cli.scheduler_command": ("scheduler",),
    "caravan_llm.cli.router_command": ("router",),
    "caravan_llm.cli.kv_relay_command": ("kv-relay",),
    "caravan_llm.cli.demo": ("demo",),
}


# argparse's exit status for a command line it refuses.
USAGE_EXIT = 2


class UsageError(SystemExit):
    """A command line argparse refuses; raised instead of printing, still a SystemExit(2)."""

    def __init__(self, parser: argparse.ArgumentParser, message: str) -> None:
        self.parser = parser
        self.message = message
        super().__init__(USAGE_EXIT)


class CaravanParser(argparse.ArgumentParser):
    """argparse, with usage errors raised so that `--json` can report them as JSON.

    Subcommand parsers are made of the same class (argparse uses the parent's).
    """

    def error(self, message: str) -> NoReturn:
        raise UsageError(self, message)


# The PyPI distribution (pyproject's `name`); `caravan` on PyPI is another project.
DISTRIBUTION = "caravan-llm"


def package_version() -> str:
    """The installed distribution's version."""
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


def command_module(name: str) -> CommandModule:
    return cast("CommandModule", importlib.import_module(name))


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; with `command`, only that command's module is loaded (if it names one)."""
    parser = CaravanParser(
        prog="caravan",
        description="Run LLM inference replicas on Nomad, discover them through Consul.",
    )
    parser.add_argument(
        "--version", action="store_true", help="print the version of caravan and exit"
    )
    # The subcommands' parsers are CaravanParsers too (argparse makes them of the parent's class).
    subparsers = cast(
        "argparse._SubParsersAction[argparse.ArgumentParser]",  # noqa: SLF001 - argparse types it so
        parser.add_subparsers(dest="command", metavar="COMMAND"),
    )
    subparsers.required = True
    wanted = [name for name, commands in COMMAND_MODULES.items() if command in commands]
    for name in wanted or COMMAND_MODULES:
        command_module(name).add_commands(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    first = next((word for word in arguments if not word.startswith("-")), None)
    wants_json = "--json" in arguments
    if first is None and ("--version" in arguments or "-version" in arguments):
        version = package_version()
        if wants_json:
            print_json({"name": "caravan", "version": version})
        else:
            print(f"caravan {version}")
        return 0
    as_json = argparse.Namespace(json=wants_json)
    try:
        parser = build_parser(first if arguments and arguments[0] == first else None)
        args = parser.parse_args(arguments)
    except UsageError as exc:
        if wants_json:
            return fail(as_json, f"{exc.parser.prog}: {exc.message}", kind="usage", code=USAGE_EXIT)
        exc.parser.print_usage(sys.stderr)
        print(f"{exc.parser.prog}: error: {exc.message}", file=sys.stderr)
        return USAGE_EXIT
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
        return fail(as_json, str(exc), kind="invalid_settings")
    return code


if __name__ == "__main__":
    sys.exit(main())
