"""The processes and the CLI import only the runtime: no devcluster, no demo dependency."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from caravan_llm.cli.main import COMMAND_MODULES, command_module

DEMO_ONLY = ("devcluster", "openai", "gguf", "numpy", "dns", "nomad", "hcl2")


def loaded_after(statement: str) -> set[str]:
    """Top-level modules present in a fresh interpreter after running `statement`."""
    probe = f"import sys; {statement}; import json; print(json.dumps(sorted(sys.modules)))"
    result = subprocess.run(
        [sys.executable, "-c", probe], check=True, capture_output=True, text=True, timeout=120
    )
    return {name.split(".")[0] for name in json.loads(result.stdout)}


@pytest.mark.parametrize(
    "statement",
    [
        "import caravan_llm.router.wiring.app, caravan_llm.scheduler.app",
        "import caravan_llm.cli.main; caravan_llm.cli.main.build_parser()",
    ],
)
def test_runtime_imports_nothing_of_the_demo(statement: str):
    """Neither the processes nor the CLI's parser load devcluster or a demo/test dependency."""
    assert set() == loaded_after(statement) & set(DEMO_ONLY)


def test_command_table_names_what_each_module_registers():
    """Each module adds exactly the subcommands the lazy table lists for it."""
    for name, commands in COMMAND_MODULES.items():
        parser = argparse.ArgumentParser()
        subparsers = parser.add_subparsers()
        command_module(name).add_commands(subparsers)
        assert commands == tuple(subparsers.choices), name


def test_validate_loads_neither_process_nor_demo():
    """`caravan validate`'s parser loads the profile commands only."""
    loaded = loaded_after(
        "import caravan_llm.cli.main; caravan_llm.cli.main.build_parser('validate')"
    )
    assert {"aiohttp", "consul", "router"}.isdisjoint(loaded)
