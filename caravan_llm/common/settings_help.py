"""`python -m caravan_llm.router --help` / `python -m caravan_llm.scheduler --help`: the settings a
process reads.

Both processes take their settings from the environment only; their command
line accepts `--help` (which lists every setting: variable, default, and the
field's description where it has one) and nothing else. Settings that cannot
be used are reported by `print_settings_errors`, one line per problem naming
the variable, the same from `python -m ...` and from `caravan router|scheduler`.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from pydantic import AliasChoices, ValidationError
from pydantic_core import PydanticUndefined
from pydantic_settings import BaseSettings


@dataclass(frozen=True, slots=True)
class SettingDoc:
    """One setting as a person reads it."""

    field: str
    env: tuple[str, ...]  # the variables that set it, the preferred one first
    default: str
    description: str | None


def env_names(settings_cls: type[BaseSettings], field: str) -> tuple[str, ...]:
    """The environment variables that set `field`, the preferred one first."""
    alias = settings_cls.model_fields[field].validation_alias
    if isinstance(alias, AliasChoices):
        return tuple(str(choice) for choice in alias.choices)
    if isinstance(alias, str):
        return (alias,)
    prefix = str(settings_cls.model_config.get("env_prefix", ""))
    return (f"{prefix}{field}".upper(),)


def _shown_default(value: object) -> str:
    if value is PydanticUndefined:
        return "required"
    if value is None or value == ():
        return "unset"
    shown = getattr(value, "value", value)  # enum members by value
    return str(shown).lower() if isinstance(shown, bool) else str(shown)


def setting_docs(settings_cls: type[BaseSettings]) -> tuple[SettingDoc, ...]:
    """Every field of a settings class, in declaration order."""
    return tuple(
        SettingDoc(
            field=name,
            env=env_names(settings_cls, name),
            default=_shown_default(info.get_default(call_default_factory=True)),
            description=info.description,
        )
        for name, info in settings_cls.model_fields.items()
    )


def settings_help(settings_cls: type[BaseSettings]) -> str:
    """The settings list printed under `--help`."""
    lines = ["settings (environment variables):"]
    for doc in setting_docs(settings_cls):
        names = " or ".join(doc.env)
        lines.append(f"  {names}  (default: {doc.default})")
        if doc.description:
            lines.extend(
                textwrap.wrap(
                    doc.description, width=88, initial_indent=" " * 6, subsequent_indent=" " * 6
                )
            )
    return "\n".join(lines)


def parse_process_args(
    argv: Sequence[str], *, prog: str, description: str, settings_cls: type[BaseSettings]
) -> None:
    """Handle the process's command line: `--help` prints the settings and exits 0;
    anything else is refused (exit 2), since settings come from the environment."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description=description,
        epilog=settings_help(settings_cls),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.parse_args(list(argv))


# The exit status of a process whose settings cannot be used (argparse's for a bad flag).
SETTINGS_EXIT_CODE = 2


def settings_error_lines(
    settings_cls: type[BaseSettings], exc: ValidationError, from_flags: Collection[str] = ()
) -> list[str]:
    """One line per problem, naming what to fix (never echoing its value).

    A field in `from_flags` was set on the command line and is named as its flag's
    destination (`workers`); any other by the variables that set it.
    """
    by_alias = {
        alias.upper(): name
        for name in settings_cls.model_fields
        for alias in env_names(settings_cls, name)
    }
    lines = []
    for error in exc.errors():
        field = str(error["loc"][0]) if error["loc"] else ""
        field = by_alias.get(field.upper(), field)
        if field in from_flags:
            where = field
        elif field in settings_cls.model_fields:
            where = " or ".join(env_names(settings_cls, field))
        else:
            where = field or "settings"
        lines.append(f"{where}: {error['msg']}")
    return lines


def print_settings_errors(
    settings_cls: type[BaseSettings], exc: ValidationError, from_flags: Collection[str] = ()
) -> int:
    """Print `error: <variable or flag>: <problem>` lines on stderr; the exit status."""
    for line in settings_error_lines(settings_cls, exc, from_flags):
        print(f"error: {line}", file=sys.stderr)  # noqa: T201 - the process's own error output
    return SETTINGS_EXIT_CODE
