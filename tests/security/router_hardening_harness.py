"""Pieces of the router hardening tests: devcluster Consul, a fake engine, a router.

The engine is in-process and counts the order in which requests reach it:
each chat request names itself in its first message's content, and a request
whose name is in `held` waits for `release` before answering, so a test can
keep an endpoint busy while it builds a queue behind it.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import polling
from aiohttp import web
from prometheus_client import CollectorRegistry

from caravan_llm.common.consul_api import ConsulClient, ConsulSettings, ServiceRegistration
from caravan_llm.common.contract import ServiceMetaKey, model_service_name
from caravan_llm.devcluster.consul.server import ConsulConfig, ConsulServer
from caravan_llm.router.edge.proxy import RequestLog
from caravan_llm.router.settings import RouterSettings
from caravan_llm.router.wiring.app import (
    RUNTIME,
    RouterRuntime,
    app_runner,
    create_admin_app,
    create_app,
)

REPO = Path(__file__).resolve().parents[2]
MODEL = "tiny"


@asynccontextmanager
async def running_consul() -> AsyncIterator[tuple[ConsulServer, ConsulClient]]:
    config = ConsulConfig(
        session_ttl_min_s=1.0, check_reap_interval_s=0.5, deregister_critical_min_s=1.0
    )
    async with ConsulServer(config) as server:
        settings = ConsulSettings(host="127.0.0.1", port=server.http_port, request_timeout_s=5.0)
        async with ConsulClient(settings) as client:
            yield server, client


async def wait_until(
    condition: Callable[[], bool | Awaitable[bool]], *, timeout_s: float, what: str
) -> None:
    """Poll until `condition` holds; fail naming `what` if it never does."""
    await polling.eventually(condition, timeout_s, what, interval_s=0.02)


def chat(name: str, **extra: Any) -> dict[str, Any]:
    """A chat request that names itself (the engine records the name)."""
    return {"model": MODEL, "messages": [{"role": "user", "content": name}], **extra}


class OrderEngine:
    """An in-process OpenAI engine recording the order requests reach it."""

    def __init__(self, *, held: frozenset[str] = frozenset()) -> None:
        self.held = held
        self.release = asyncio.Event()
        self.order: list[str] = []
        self.port = 0
        self._runner: web.AppRunner | None = None

    async def __aenter__(self) -> Self:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.port = int(self._runner.addresses[0][1])
        return self

    async def __aexit__(self, *_: object) -> None:
        self.release.set()
        if self._runner is not None:
            await self._runner.cleanup()

    async def _health(self, _request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _metrics(self, _request: web.Request) -> web.Response:
        return web.Response(text="vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n")

    async def _chat(self, request: web.Request) -> web.Response:
        body = await request.json()
        name = str(body["messages"][0]["content"])
        self.order.append(name)
        if name in self.held:
            await self.release.wait()
        message = {"role": "assistant", "content": f"hi {name}"}
        return web.json_response(
            {
                "id": "chatcmpl-order",
                "object": "chat.completion",
                "created": 1,
                "model": MODEL,
                "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
            }
        )


async def register_engine(consul: ConsulClient, port: int, *, capacity: int = 64) -> None:
    """Register the engine as Nomad would register a replica (no check: passing)."""
    service_id = f"_nomad-task-{uuid.uuid4()}-engine-{model_service_name(MODEL)}-http"
    meta = {
        ServiceMetaKey.MODEL: MODEL,
        ServiceMetaKey.SERVED_MODELS: MODEL,
        ServiceMetaKey.ENGINE: "vllm",
        ServiceMetaKey.REPLICA: "0",
        ServiceMetaKey.CAPACITY: str(capacity),
        ServiceMetaKey.METRICS_PATH: "/metrics",
        ServiceMetaKey.METRIC_RUNNING: "vllm:num_requests_running",
        ServiceMetaKey.METRIC_WAITING: "vllm:num_requests_waiting",
        ServiceMetaKey.METRIC_KV_CACHE: "",
        ServiceMetaKey.SPEC_HASH: "0123456789abcdef",
    }
    await consul.agent_service_register(
        ServiceRegistration(
            name=model_service_name(MODEL),
            service_id=service_id,
            address="127.0.0.1",
            port=port,
            tags=("caravan", "engine-vllm"),
            meta=meta,
        )
    )


def hand_registered_endpoints_allowed() -> dict[str, Any]:
    """The setting that lets this router use hand-registered endpoints, where it exists.

    Endpoint verification (issue 12 item 4) ignores services Nomad did not
    place; these tests register their engine by hand, as a static setup would.
    """
    if "allow_unverified_endpoints" in RouterSettings.model_fields:
        return {"allow_unverified_endpoints": True}
    return {}


@dataclass
class RouterUnderTest:
    url: str
    runtime: RouterRuntime
    registry: CollectorRegistry
    admin_url: str | None = None
    logged: list[dict[str, Any]] = field(default_factory=list)

    def metric(self, name: str, **labels: str) -> float:
        """A sample of the router's registry; 0 when it was never incremented."""
        value = self.registry.get_sample_value(name, labels)
        return 0.0 if value is None else float(value)

    def routable(self) -> bool:
        entry = self.runtime.state.view.snapshot.for_model(MODEL)
        return entry is not None and bool(entry.endpoints)


@asynccontextmanager
async def running_router(consul: ConsulClient, **overrides: Any) -> AsyncIterator[RouterUnderTest]:
    """A router on this loop (and its admin listener when `admin_port` is set), synced."""
    values: dict[str, Any] = {
        "port": 0,
        "register_service": False,
        "consul_wait_s": 10.0,
        "scrape_interval_s": 0.5,
        "scrape_timeout_s": 0.5,
        "shutdown_timeout_s": 1.0,
        "log_format": "text",
        **hand_registered_endpoints_allowed(),
    }
    values.update(overrides)
    settings = RouterSettings(**values)
    registry = CollectorRegistry()
    logged: list[dict[str, Any]] = []
    request_log: RequestLog = logged.append
    app = create_app(settings, consul=consul, registry=registry, request_log=request_log)
    runtime = app[RUNTIME]
    runner = app_runner(app, settings)
    admin_runner = (
        app_runner(create_admin_app(runtime), settings, listener="admin")
        if settings.admin_port is not None
        else None
    )
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        port = int(runner.addresses[0][1])
        admin_url = None
        if admin_runner is not None:
            await admin_runner.setup()
            await web.TCPSite(admin_runner, "127.0.0.1", 0).start()
            admin_url = f"http://127.0.0.1:{int(admin_runner.addresses[0][1])}"
        await wait_until(lambda: runtime.state.synced, timeout_s=10.0, what="router synced")
        yield RouterUnderTest(
            f"http://127.0.0.1:{port}", runtime, registry, admin_url=admin_url, logged=logged
        )
    finally:
        await runner.cleanup()
        if admin_runner is not None:
            await admin_runner.cleanup()
