"""Shared pieces of the Nomad contract tests (fixtures live in conftest.py)."""

from __future__ import annotations

import copy
import json
import os
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import nomad
import polling
import pytest

from caravan_llm.devcluster.nomad.server import NomadServer

T = TypeVar("T")

REAL = os.environ.get("CARAVAN_REAL_NOMAD") == "1"
DEVCLUSTER_ONLY = "devcluster-only (CARAVAN_REAL_NOMAD=1 runs these tests against a real Nomad)"
FIXTURES = Path(__file__).parent / "fixtures"
NS = 1_000_000_000


@dataclass(frozen=True)
class NomadTarget:
    address: str
    server: NomadServer | None

    @property
    def real(self) -> bool:
        return self.server is None

    def devcluster(self) -> NomadServer:
        """The in-process server, or skip when the tests run against a real Nomad."""
        if self.server is None:
            pytest.skip(DEVCLUSTER_ONLY)
        return self.server

    def python_nomad(self) -> nomad.Nomad:
        """python-nomad, unmodified; call it in asyncio.to_thread (the server is on our loop)."""
        return self.python_nomad_with(token=None)

    def python_nomad_with(self, *, token: str | None) -> nomad.Nomad:
        return nomad.Nomad(address=self.address, timeout=10, token=token)


def example(name: str) -> dict[str, Any]:
    document: dict[str, Any] = json.loads((FIXTURES / name).read_text())
    return document


def sleeper_job(job_id: str, *, count: int = 1, **group: Any) -> dict[str, Any]:
    """A raw_exec service job whose task sleeps; small and quick to start and stop."""
    task = {
        "Name": "sleep",
        "Driver": "raw_exec",
        "Config": {"command": sys.executable, "args": ["-c", "import time; time.sleep(600)"]},
        "Resources": {"CPU": 100, "MemoryMB": 32},
        "KillTimeout": NS,
    }
    body: dict[str, Any] = {
        "ID": job_id,
        "Datacenters": ["dc1"],
        "TaskGroups": [
            {
                "Name": "g",
                "Count": count,
                "RestartPolicy": {"Attempts": 2, "Interval": 30 * NS, "Delay": NS, "Mode": "fail"},
                "Tasks": [task],
                **copy.deepcopy(group),
            }
        ],
    }
    return {"Job": body}


def http_job(job_id: str, **group: Any) -> dict[str, Any]:
    """A raw_exec job serving HTTP on its dynamic port, with a Consul service and check."""
    body = sleeper_job(job_id, **group)
    group_body = body["Job"]["TaskGroups"][0]
    group_body["Networks"] = [{"Mode": "host", "DynamicPorts": [{"Label": "http"}]}]
    group_body["Tasks"][0]["Config"]["args"] = [
        "-m",
        "http.server",
        "--bind",
        "${NOMAD_IP_http}",
        "${NOMAD_PORT_http}",
    ]
    group_body.setdefault(
        "Services",
        [
            {
                "Name": job_id,
                "PortLabel": "http",
                "Meta": {"alloc_id": "${NOMAD_ALLOC_ID}"},
                "Checks": [
                    {"Type": "http", "Path": "/", "Interval": NS, "Timeout": NS},
                ],
            }
        ],
    )
    return body


async def eventually(
    probe: Callable[[], Awaitable[T | None]], *, timeout_s: float = 15.0, interval_s: float = 0.05
) -> T:
    """Poll `probe` until it returns something truthy; fail after `timeout_s`."""
    found = await polling.eventually(probe, timeout_s, "the condition", interval_s=interval_s)
    assert found is not None
    return found


async def get_json(session: aiohttp.ClientSession, url: str) -> Any:
    async with session.get(url) as response:
        assert 200 == response.status, await response.text()
        return await response.json()


async def running_allocs(
    session: aiohttp.ClientSession, address: str, job_id: str, count: int = 1
) -> list[dict[str, Any]]:
    """Wait until the job has `count` running allocations; return all of its allocations."""

    async def probe() -> list[dict[str, Any]] | None:
        allocs = await get_json(session, f"{address}/v1/job/{job_id}/allocations")
        running = [a for a in allocs if a["ClientStatus"] == "running"]
        return allocs if len(running) >= count else None

    return await eventually(probe)
