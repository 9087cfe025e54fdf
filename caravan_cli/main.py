"""The `caravan` command: one entry point, a subcommand per module.

Each module in `COMMAND_MODULES` adds its subcommands to the parser; the
commands themselves are thin wiring over the packages' pure functions.
A setting that cannot be used (a missing CA file, a bad client certificate,
an invalid API token file: `caravan.errors.SettingsError`) ends any
subcommand with one `error:` line naming the variable and the file, exit 1.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Protocol

from caravan.errors import SettingsError
from caravan_cli import (
    demo,
    model_commands,
    profile_commands,
    router_command,
    scheduler_command,
)

if TYPE_CHECKING:
    from collections.abc import Sequence


class CommandModule(Protocol):
    def add_commands(self, subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
        """Register this module's subcommands; each sets `handler` via set_defaults."""


COMMAND_MODULES: tuple[CommandModule, ...] = (
    profile_commands,
    model_commands,
    scheduler_command,
    router_command,
    demo,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="caravan",
        description="Run LLM inference replicas on Nomad, discover them through Consul.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    for module in COMMAND_MODULES:
        module.add_commands(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = args.handler
    try:
        code: int = handler(args)
    except KeyboardInterrupt:
        return 130
    except SettingsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return code


if __name__ == "__main__":
    sys.exit(main())
