"""The settings tables of the docs name exactly the settings the code has.

router/README.md documents `RouterSettings` (one row per field, written as its
`CARAVAN_ROUTER_` suffix); README.md's scheduler table carries every flag of
`caravan scheduler` (its variables are checked against `SchedulerSettings` in
tests/unit/scheduler/test_scheduler_settings.py). A failure lists what is
missing on each side.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

from pydantic import BaseModel

from caravan_llm.cli import scheduler_command
from caravan_llm.router.settings import RouterSettings

ROOT = Path(__file__).resolve().parents[2]
_CODE = re.compile(r"`([^`]+)`")
_FLAG = re.compile(r"--[a-z0-9][a-z0-9-]*")


def table_rows(path: Path, header: str) -> list[list[str]]:
    """The cells of the rows of the markdown table whose header line starts with `header`."""
    lines = path.read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def names_in(cell: str) -> set[str]:
    return set(_CODE.findall(cell))


def setting_names(value: object, prefix: str = "") -> set[str]:
    """Upper-case names of every leaf setting of a dataclass or pydantic object."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    elif isinstance(value, BaseModel):
        fields = {name: getattr(value, name) for name in type(value).model_fields}
    else:
        return {prefix.upper()}
    names: set[str] = set()
    for name, child in fields.items():
        names |= setting_names(child, f"{prefix}{name}__" if _is_group(child) else prefix + name)
    return names


def _is_group(value: object) -> bool:
    nested = dataclasses.is_dataclass(value) and not isinstance(value, type)
    return nested or isinstance(value, BaseModel)


def scheduler_flags() -> set[str]:
    """The options of `caravan scheduler`, read from its usage line."""
    subcommands = argparse.ArgumentParser().add_subparsers()
    scheduler_command.add_commands(subcommands)
    usage = subcommands.choices["scheduler"].format_usage()
    return set(_FLAG.findall(usage)) - {"--help"}


def test_router_settings_table_lists_every_setting():
    """Every `RouterSettings` field has a row in router/README.md, and every row is a field."""
    documented: set[str] = set()
    for row in table_rows(ROOT / "router" / "README.md", "| setting (`CARAVAN_ROUTER_...`)"):
        documented |= names_in(row[0])
    fields = {name.upper() for name in RouterSettings.model_fields}
    assert {"undocumented": [], "not settings": []} == {
        "undocumented": sorted(fields - documented),
        "not settings": sorted(documented - fields),
    }


def test_every_scheduler_flag_is_in_the_readme_table():
    """Each `caravan scheduler` flag appears in the README's scheduler settings table.

    The table's variables are checked against `SchedulerSettings` by
    tests/unit/scheduler/test_scheduler_settings.py.
    """
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    start = text.index("| scheduler setting |")
    table = text[start : text.index("\n\n", start)]
    flags: set[str] = set()
    for row in table.splitlines()[2:]:
        flags |= {name for name in names_in(row.split("|")[1]) if name.startswith("--")}
    assert [] == sorted(scheduler_flags() - flags)


def test_nested_settings_are_joined_with_double_underscores():
    """The naming rule the tables follow, shown on a small nested object."""

    @dataclasses.dataclass
    class Inner:
        b_s: float = 1.0

    @dataclasses.dataclass
    class Outer:
        a: int = 1
        inner: Inner = dataclasses.field(default_factory=Inner)

    assert {"A", "INNER__B_S"} == setting_names(Outer())
