"""`python -m caravan_llm.devcluster` with Nomad: it serves both APIs and leaves no process
behind."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import uuid
from pathlib import Path

import aiohttp
import pytest

NS = 1_000_000_000
pytestmark = pytest.mark.slow


def processes_with(marker: str) -> list[int]:
    """PIDs whose command line contains `marker` (Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if marker.encode() in command:
            found.append(int(entry.name))
    return found


async def read_exports(stream: asyncio.StreamReader) -> dict[str, str]:
    exports: dict[str, str] = {}
    while "NOMAD_ADDR" not in exports:
        line = (await stream.readline()).decode().strip()
        if not line:
            raise AssertionError("devcluster exited before printing NOMAD_ADDR")
        name, _, value = line.removeprefix("export ").partition("=")
        exports[name] = value
    return exports


async def test_sigterm_stops_every_task_process() -> None:
    """After SIGTERM the devcluster exits 0 and none of its task processes is left."""
    if not Path("/proc/self/cmdline").exists():
        pytest.skip("needs Linux /proc to find processes by command line")
    marker = f"devcluster-orphan-check-{uuid.uuid4().hex}"
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "caravan_llm.devcluster",
        "--consul-port",
        "0",
        "--dns-port",
        "0",
        "--nomad-port",
        "0",
        "--nodes",
        "2",
        "--heartbeat-grace",
        "2s",
        "--log-level",
        "WARNING",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        assert process.stdout is not None
        exports = await asyncio.wait_for(read_exports(process.stdout), 30)
        job = {
            "Job": {
                "ID": "orphan-check",
                "TaskGroups": [
                    {
                        "Name": "g",
                        "Count": 2,
                        "Tasks": [
                            {
                                "Name": "t",
                                "Driver": "raw_exec",
                                "Config": {
                                    "command": sys.executable,
                                    "args": ["-c", "import time; time.sleep(600)", marker],
                                },
                                "Resources": {"CPU": 100, "MemoryMB": 32},
                                "KillTimeout": NS,
                            }
                        ],
                    }
                ],
            }
        }
        address = exports["NOMAD_ADDR"]
        async with aiohttp.ClientSession() as http:
            async with http.put(f"{address}/v1/jobs", json=job) as response:
                assert 200 == response.status
            for _ in range(200):
                if len(processes_with(marker)) == 2:
                    break
                await asyncio.sleep(0.05)
        assert 2 == len(processes_with(marker))
        process.send_signal(signal.SIGTERM)
        assert 0 == await asyncio.wait_for(process.wait(), 30)
        assert [] == processes_with(marker)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
        for pid in processes_with(marker):
            os.kill(pid, signal.SIGKILL)
