"""Shared pieces of the Consul contract tests (fixtures live in conftest.py)."""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import polling
import pytest
from aiohttp import web

from caravan_llm.devcluster.consul.server import ConsulConfig, ConsulServer

T = TypeVar("T")

REAL = os.environ.get("CARAVAN_REAL_CONSUL") == "1"
DEVCLUSTER_ONLY = "devcluster-only extension (CARAVAN_REAL_CONSUL=1 runs against a real agent)"


@dataclass(frozen=True)
class Target:
    host: str
    port: int
    dns_port: int
    server: ConsulServer | None
    # The shortest session TTL the agent accepts (10s in Consul; 1s in devcluster tests).
    session_ttl_s: float

    @property
    def http_addr(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def real(self) -> bool:
        return self.server is None

    def devcluster(self) -> ConsulServer:
        """The in-process server, or skip the test when running against a real agent."""
        if self.server is None:
            pytest.skip(DEVCLUSTER_ONLY)
        return self.server


def devcluster_config(**overrides: object) -> ConsulConfig:
    values: dict[str, object] = {
        "session_ttl_min_s": 1.0,
        "check_reap_interval_s": 0.5,
        "deregister_critical_min_s": 1.0,
    }
    values.update(overrides)
    return ConsulConfig(**values)  # type: ignore[arg-type]


class HealthTarget:
    """A tiny HTTP server an HTTP check can probe; `status` is what /health answers."""

    def __init__(self) -> None:
        self.status = 200
        self.body = "ok"
        self._runner: web.AppRunner | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/health"

    async def _health(self, _request: web.Request) -> web.Response:
        return web.Response(status=self.status, text=self.body)

    async def start(self, port: int = 0) -> None:
        app = web.Application()
        app.router.add_get("/health", self._health)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", port)
        await site.start()
        self.port = int(self._runner.addresses[0][1])

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


async def raw_request(
    target: Target,
    method: str,
    path: str,
    *,
    body: bytes | str | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, str, dict[str, str]]:
    """One plain HTTP request: (status, body text, headers) as the agent sent them."""
    import aiohttp  # noqa: PLC0415 - keeps the helper module light for collection

    url = f"http://{target.http_addr}{path}"
    async with aiohttp.ClientSession() as session:
        async with session.request(method, url, data=body, headers=headers) as response:
            return response.status, await response.text(), dict(response.headers)


async def eventually(
    condition: Callable[[], Awaitable[T | None]], *, timeout_s: float = 5.0, every_s: float = 0.05
) -> T:
    """Poll `condition` until it returns something truthy; fail after `timeout_s`."""
    found = await polling.eventually(condition, timeout_s, "the condition", interval_s=every_s)
    assert found is not None
    return found
