"""Nothing outside the engine adapters and their registry names an engine (issue 22's rule)."""

from __future__ import annotations

import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "caravan_llm"
ENGINE_NAME = re.compile(r'"(vllm|llamacpp|sglang)"')
# The engines package holds each adapter and the registry that lists them.
OWNERS = (PACKAGE / "scheduler" / "engines",)
CHECKED = ("scheduler", "router", "common")


def _named_outside_the_adapters() -> list[str]:
    found: list[str] = []
    for folder in CHECKED:
        for path in sorted((PACKAGE / folder).rglob("*.py")):
            if any(path.is_relative_to(owner) for owner in OWNERS):
                continue
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if ENGINE_NAME.search(line):
                    found.append(f"{path.relative_to(PACKAGE)}:{number}: {line.strip()}")
    return found


def test_no_module_outside_the_adapters_names_an_engine() -> None:
    """Scheduler, router and common code ask the adapter or the Meta, never an engine's name."""
    assert [] == _named_outside_the_adapters()


def test_the_check_finds_an_engine_name_where_there_is_one() -> None:
    """The pattern matches a quoted engine name as the acceptance's git grep does."""
    assert ENGINE_NAME.search('engine = "sglang"') is not None
    assert ENGINE_NAME.search("vLLM's own metrics") is None
