"""The router's load scraper on the shared scraper: what each kind of failure does to load."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry
from router_builders import SERVICE, health_entry, live_for, snapshot_of

from caravan_llm.common.engine_metrics import EngineLoad
from caravan_llm.router.core.routing_state import RoutingState, RoutingView
from caravan_llm.router.feeds.load_scraper import LoadScraper
from caravan_llm.router.metrics import RouterMetrics

KEY = "sk-engine-secret-5678"
NOW = 500.0

VLLM_TEXT = """\
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:cache_config_info{block_size="128",engine="0",num_gpu_blocks="48"} 1.0
# TYPE vllm:request_prompt_tokens histogram
vllm:request_prompt_tokens_bucket{engine="0",le="1000.0",model_name="m"} 3.0
vllm:request_prompt_tokens_bucket{engine="0",le="+Inf",model_name="m"} 4.0
vllm:request_prompt_tokens_count{engine="0",model_name="m"} 4.0
vllm:request_prompt_tokens_sum{engine="0",model_name="m"} 3800.0
"""


@dataclass
class Engine:
    """One engine on loopback whose /metrics answers as `mode` says."""

    mode: str = "ok"
    port: int = 0
    release: asyncio.Event = field(default_factory=asyncio.Event)
    authorizations: list[str | None] = field(default_factory=list)


class Keys:
    def key_for(self, service: str) -> str | None:
        return KEY if service == SERVICE else None


@pytest.fixture
async def engine() -> AsyncIterator[Engine]:
    state = Engine()

    async def handle(request: web.Request) -> web.StreamResponse:
        state.authorizations.append(request.headers.get("Authorization"))
        if state.mode == "slow":
            await state.release.wait()
        if state.mode == "unauthorized":
            return web.Response(status=401, text="Invalid API Key")
        if state.mode == "huge":
            return web.Response(text=VLLM_TEXT + "#" * 10_000 + "\n")
        return web.Response(text=VLLM_TEXT)

    app = web.Application()
    app.router.add_get("/metrics", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    state.port = runner.addresses[0][1]
    try:
        yield state
    finally:
        state.release.set()
        await runner.cleanup()


@dataclass
class Scraping:
    scraper: LoadScraper
    state: RoutingState
    registry: CollectorRegistry

    def load(self) -> EngineLoad | None:
        return self.state.live["ep-0"].load

    def failures(self) -> float | None:
        return self.registry.get_sample_value("caravan_router_engine_scrape_failures_total")


@pytest.fixture
async def scraping(engine: Engine) -> AsyncIterator[Scraping]:
    snapshot = snapshot_of(health_entry("ep-0", address="127.0.0.1", port=engine.port))
    state = RoutingState()
    state.swap(RoutingView(snapshot=snapshot), live_for(snapshot), synced=True)
    registry = CollectorRegistry()
    async with aiohttp.ClientSession() as session:
        scraper = LoadScraper(
            session,
            state,
            interval_s=1.0,
            timeout_s=0.2,
            metrics=RouterMetrics(registry),
            clock=lambda: NOW,
            engine_keys=Keys(),
            max_bytes=4_096,
        )
        yield Scraping(scraper, state, registry)


async def test_load_is_recorded_with_the_engine_key(engine: Engine, scraping: Scraping) -> None:
    await scraping.scraper.scrape_once()

    assert EngineLoad(running=3.0, waiting=2.0, kv_cache_usage=0.25) == scraping.load()
    assert NOW == scraping.state.live["ep-0"].load_scraped_at
    assert [f"Bearer {KEY}"] == engine.authorizations
    assert 0 == scraping.failures()


async def test_the_cache_figures_reach_the_cost_model(scraping: Scraping) -> None:
    """The KV capacity and the engine's mean prompt (its prompt-tokens histogram)."""
    await scraping.scraper.scrape_once()

    cost = scraping.state.live["ep-0"].cost
    assert cost.cache is not None
    assert (cost.cache.kv_cache_tokens, cost.cache.prompt_requests) == (48 * 128, 4.0)
    assert 950.0 == cost.engine_prompt_tokens


async def test_a_timeout_keeps_the_last_load_to_age_out(engine: Engine, scraping: Scraping) -> None:
    """A busy engine answers late; one slow scrape must not make it unknown (saturated)."""
    await scraping.scraper.scrape_once()
    engine.mode = "slow"

    await asyncio.wait_for(scraping.scraper.scrape_once(), timeout=10)

    assert EngineLoad(running=3.0, waiting=2.0, kv_cache_usage=0.25) == scraping.load()
    assert 1 == scraping.failures()


@pytest.mark.parametrize("mode", ["unauthorized", "huge"])
async def test_an_answer_without_usable_metrics_forgets_the_load(
    engine: Engine, scraping: Scraping, mode: str
) -> None:
    """A 401 or a page over the size cap: the engine answered, so its load is unknown now."""
    await scraping.scraper.scrape_once()
    engine.mode = mode

    await scraping.scraper.scrape_once()

    assert scraping.load() is None
    assert scraping.state.live["ep-0"].load_scraped_at is None
    assert 1 == scraping.failures()
