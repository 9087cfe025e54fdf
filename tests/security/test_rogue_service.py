"""Issue 12, item 4: the router routes only to replicas caravan placed.

Measured on main (c7669df): a service registered by hand under
`caravan-<model>`, or a new service whose Meta claims another model's served
name, received 2 of 12 and 4 of 20 requests, prompts included. Here, on the
local stack (devcluster's Nomad and Consul, a scheduler, a router), three
rogues that an attacker with Consul `service:write` can register each get 0 of
100 requests while the replicas the scheduler placed serve all 100:

- `under-model`: registered by hand under `caravan-<model>`, tag `caravan`,
  the contract's Meta;
- `new-service`: a new service `caravan-<other>` whose Meta claims the
  model's served name;
- `copied-id`: the real replica's Nomad service ID, copied from Consul (anyone
  who can read the catalog sees it), registered on another node at the
  rogue's address.

Each is logged once (after a 10 s grace) and counted. A second router with
`allow_unverified_endpoints` sends them traffic, so the check can fail.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import polling
import pytest
from aiohttp import web

from caravan_llm.cli.local_stack import (
    LocalStack,
    StackOptions,
    local_profile,
    local_stack,
    running_router,
)
from caravan_llm.common.consul_api import ConsulClient, ServiceRegistration
from caravan_llm.common.contract import KVLayout, ServiceMetaKey, model_service_name
from caravan_llm.router.core.balancer import Policy
from caravan_llm.router.settings import RouterSettings
from caravan_llm.scheduler.model_store import ModelStore
from caravan_llm.scheduler.profiles import load_profile

ROOT = Path(__file__).resolve().parents[2]
REQUESTS = 100
ROGUE_TEXT = "intercepted by a rogue"


class RogueEngine:
    """An OpenAI-compatible server that counts every request it receives."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.requests = 0
        self.port = 0
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/health", self._ok)
        app.router.add_get("/metrics", self._ok)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.port = int(self._runner.addresses[0][1])

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _ok(self, _request: web.Request) -> web.Response:
        return web.Response(text="")

    async def _chat(self, request: web.Request) -> web.Response:
        self.requests += 1
        await request.read()
        message = {"role": "assistant", "content": ROGUE_TEXT}
        return web.json_response(
            {
                "id": "chatcmpl-rogue",
                "object": "chat.completion",
                "created": 1,
                "model": "rogue",
                "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
            }
        )


def rogue_meta(served: str) -> dict[str, str]:
    """The contract's Meta, as an attacker copies it from a real replica."""
    return {
        ServiceMetaKey.MODEL: "tiny-chat",
        ServiceMetaKey.SERVED_MODELS: served,
        ServiceMetaKey.ENGINE: "vllm",
        ServiceMetaKey.REPLICA: "0",
        ServiceMetaKey.CAPACITY: "64",
        ServiceMetaKey.METRICS_PATH: "/metrics",
    }


async def eventually(
    condition: Callable[[], Awaitable[bool] | bool], timeout_s: float, what: str
) -> None:
    await polling.eventually(condition, timeout_s, what, interval_s=0.1)


def sample(registry: Any, name: str, **labels: str) -> float:
    return float(registry.get_sample_value(name, labels) or 0.0)


@asynccontextmanager
async def rogues() -> AsyncIterator[dict[str, RogueEngine]]:
    engines = {name: RogueEngine(name) for name in ("under-model", "new-service", "copied-id")}
    try:
        for engine in engines.values():
            await engine.start()
        yield engines
    finally:
        for engine in engines.values():
            await engine.stop()


async def register_rogues(
    consul: ConsulClient, engines: dict[str, RogueEngine], *, service: str, served: str
) -> dict[str, str]:
    """Register the three rogues on the Consul agent the client talks to; their service ids."""
    _, real = await consul.health_service(service, passing=True)
    ids = {
        "under-model": "caravan-tiny-chat-rogue",
        "new-service": "caravan-helper-0",
        "copied-id": real[0].service_id,
    }
    names = {"under-model": service, "new-service": "caravan-helper", "copied-id": service}
    for name, engine in engines.items():
        await consul.agent_service_register(
            ServiceRegistration(
                name=names[name],
                service_id=ids[name],
                address="127.0.0.1",
                port=engine.port,
                tags=("caravan", "engine-vllm"),
                meta=rogue_meta(served),
            )
        )
    return ids


async def send(session: aiohttp.ClientSession, url: str, served: str) -> list[tuple[int, str]]:
    """REQUESTS chat completions, ten at a time; (status, answer text) of each."""
    results: list[tuple[int, str]] = []
    limit = asyncio.Semaphore(10)

    async def one(number: int) -> None:
        body = {
            "model": served,
            "max_tokens": 4,
            "messages": [{"role": "user", "content": f"secret prompt {number}"}],
        }
        async with limit, session.post(url, json=body) as response:
            answer = await response.json()
            text = answer["choices"][0]["message"]["content"] if response.status == 200 else ""
            results.append((response.status, text))

    await asyncio.gather(*(one(number) for number in range(REQUESTS)))
    return results


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_rogue_services_get_none_of_100_requests(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Rogues get 0 of 100, the placed replicas serve 100; each rogue logged once and counted."""
    caplog.set_level(logging.WARNING, logger="router.discovery")
    options = StackOptions(
        prefer_real_llama_server=False,
        gpu_nodes=0,
        autoscale=False,
        work_dir=tmp_path,
        resync_s=2.0,
        router=RouterSettings(port=0, scrape_interval_s=0.5, log_level="warning"),
    )
    async with local_stack(options) as stack, rogues() as engines:
        await run_scenario(stack, engines, caplog)


async def run_scenario(
    stack: LocalStack, engines: dict[str, RogueEngine], caplog: pytest.LogCaptureFixture
) -> None:
    assert stack.router is not None
    consul = stack.scheduler.consul
    registry = stack.router.registry
    base = load_profile(ROOT / "examples/profiles/tiny-llamacpp-cpu.yaml")
    profile = base.model_copy(
        update={
            "replicas": base.replicas.model_copy(update={"initial": 2}),
            "env": {"CARAVAN_SIM_STEP_SECONDS": "0.002", "CARAVAN_SIM_OUTPUT_TOKENS": "4"},
        }
    )
    await ModelStore(consul, KVLayout()).submit([local_profile(profile, stack.engine)])
    service, served = model_service_name(profile.name), profile.served_name

    async def replicas_routable() -> bool:
        _, entries = await consul.health_service(service, passing=True)
        ok = sample(registry, "caravan_router_endpoints", model=served, state="passing")
        return len(entries) == 2 and ok == 2

    await eventually(replicas_routable, 90, "2 placed replicas routable")
    ids = await register_rogues(consul, engines, service=service, served=served)

    def all_seen() -> bool:
        return (
            sample(registry, "caravan_router_endpoints_unverified", reason="not_placed") == 1
            and sample(registry, "caravan_router_endpoints_unverified", reason="no_profile") == 1
            and sample(registry, "caravan_router_endpoints_unverified", reason="address_mismatch")
            == 1
        )

    await eventually(all_seen, 20, "the router to see the three rogues")
    expected_logs = sorted(
        [
            (ids["under-model"], "not_placed"),
            (ids["new-service"], "no_profile"),
            (ids["copied-id"], "address_mismatch"),
        ]
    )

    def rogue_logs() -> list[tuple[str, str]]:
        """endpoint_unverified lines of the rogues (a real replica may appear for a moment)."""
        rogue_ids = set(ids.values())
        return sorted(
            (record.__dict__["service_id"], record.__dict__["reason"])
            for record in caplog.records
            if record.getMessage() == "endpoint_unverified"
            and record.__dict__["action"] == "ignored"
            and record.__dict__["service_id"] in rogue_ids
            and record.__dict__["reason"] != "duplicate"
        )

    # Logged once they have been unverified for the grace period (10 s).
    await eventually(lambda: rogue_logs() == expected_logs, 30, "the three rogues logged")
    # One more Consul change: the rogues are still there, and must not be logged again.
    rebuilds = sample(registry, "caravan_router_discovery_rebuilds_total")
    await consul.agent_service_register(
        ServiceRegistration(
            name=service,
            service_id=ids["under-model"],
            address="127.0.0.1",
            port=engines["under-model"].port,
            tags=("caravan", "engine-vllm", "again"),
            meta=rogue_meta(served),
        )
    )
    await eventually(
        lambda: sample(registry, "caravan_router_discovery_rebuilds_total") > rebuilds,
        20,
        "a rebuild after the rogue changed",
    )

    allow = RouterSettings(
        port=0, register_service=False, allow_unverified_endpoints=True, policy=Policy.ROUND_ROBIN
    )
    # The stack's router needs its API key; the unsafe one has none and ignores it.
    async with aiohttp.ClientSession(headers=stack.router.headers) as session:
        verified = await send(session, f"{stack.router.base_url}/v1/chat/completions", served)
        counts_verified = {name: engine.requests for name, engine in engines.items()}
        async with running_router(allow, consul) as unsafe:

            async def unsafe_sees_rogues() -> bool:
                async with session.get(f"{unsafe.base_url}/health") as response:
                    if response.status != 200:
                        return False
                return (
                    sample(
                        unsafe.registry, "caravan_router_endpoints", model=served, state="passing"
                    )
                    >= 4
                )

            await eventually(unsafe_sees_rogues, 20, "the unsafe router to accept the rogues")
            unsafe_results = await send(session, f"{unsafe.base_url}/v1/chat/completions", served)

    assert {"under-model": 0, "new-service": 0, "copied-id": 0} == counts_verified
    assert [(200, False)] * REQUESTS == [(status, ROGUE_TEXT in text) for status, text in verified]
    assert REQUESTS == sample(registry, "caravan_router_requests_total", model=served, outcome="ok")

    assert expected_logs == rogue_logs()
    for reason in ("not_placed", "no_profile", "address_mismatch"):
        assert 1 <= sample(
            registry, "caravan_router_unverified_endpoints_total", reason=reason, action="ignored"
        )

    # The same rogues, with the unsafe setting: they get traffic, so the check above can fail.
    rogue_answers = sum(1 for _, text in unsafe_results if ROGUE_TEXT in text)
    assert engines["under-model"].requests > 0
    assert engines["new-service"].requests > 0
    assert rogue_answers == sum(engine.requests for engine in engines.values())
