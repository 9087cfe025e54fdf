"""Scraping engines and routers over HTTP: real readings, and unknown (never zero) on failure."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest

from caravan_llm.common.engine_metrics import MetricNames
from caravan_llm.common.engine_scrape import ScrapeFailure
from caravan_llm.scheduler.autoscale.scrape import (
    ReplicaTarget,
    RouterTarget,
    scrape_replicas,
    scrape_routers,
)
from caravan_llm.scheduler.autoscale.signals import ReplicaLoad, RouterQueue, router_queue
from caravan_llm.scheduler.engines.llamacpp import LLAMACPP_METRIC_NAMES
from caravan_llm.scheduler.engines.vllm import VLLM_METRIC_NAMES

SCRAPED_AT = 1_700_000_123.5

VLLM_TEXT = """\
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 8231.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="Qwen/Qwen3-8B"} 12.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="Qwen/Qwen3-8B"} 5.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="Qwen/Qwen3-8B"} 0.83
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="Qwen/Qwen3-8B"} 140.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="Qwen/Qwen3-8B"} 152.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="Qwen/Qwen3-8B"} 152.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="Qwen/Qwen3-8B"} 11.2
"""

LLAMACPP_TEXT = """\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 10421
# HELP llamacpp:tokens_predicted_total Number of generation tokens processed.
# TYPE llamacpp:tokens_predicted_total counter
llamacpp:tokens_predicted_total 30977
# HELP llamacpp:predicted_tokens_seconds Average generation throughput in tokens/s.
# TYPE llamacpp:predicted_tokens_seconds gauge
llamacpp:predicted_tokens_seconds 41.7
# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 0
# HELP llamacpp:requests_deferred Number of requests deferred.
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 0
"""


def router_text(depth: dict[str, float], waits: dict[str, list[float]]) -> str:
    """A router's page as prometheus_client itself writes it."""
    registry = CollectorRegistry()
    queue = Gauge(
        "caravan_router_queue_depth",
        "Requests waiting for a replica.",
        ["model"],
        registry=registry,
    )
    wait = Histogram(
        "caravan_router_queue_wait_seconds",
        "Time requests waited for a replica.",
        ["model"],
        registry=registry,
    )
    for model, value in depth.items():
        queue.labels(model=model).set(value)
    for model, observations in waits.items():
        for seconds in observations:
            wait.labels(model=model).observe(seconds)
    return generate_latest(registry).decode()


class MetricsServer:
    """Serves fixed exposition text on loopback, plus the ways a scrape can go wrong."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.in_flight = 0
        self.peak_in_flight = 0
        self.pages: dict[str, str] = {
            "/vllm/metrics": VLLM_TEXT,
            "/llama/metrics": LLAMACPP_TEXT,
            "/router-a/metrics": router_text({"llama-8b": 3, "qwen": 0}, {"llama-8b": [0.5, 1.5]}),
            "/router-b/metrics": router_text({"llama-8b": 2}, {"llama-8b": [4.0]}),
            "/router-old/metrics": "# TYPE process_cpu_seconds_total counter\n"
            "process_cpu_seconds_total 1.0\n",
            # Only the lines of the wanted names are parsed (caravan_llm.common.engine_scrape).
            "/garbage/metrics": "vllm:num_requests_running{not prometheus\n",
        }

    async def handle(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        if path in self.pages:
            return web.Response(text=self.pages[path], content_type="text/plain")
        if path == "/counted/metrics":
            self.in_flight += 1
            self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
            try:
                await asyncio.sleep(0.02)
            finally:
                self.in_flight -= 1
            return web.Response(text=VLLM_TEXT)
        if path == "/slow/metrics":
            await self.release.wait()
            return web.Response(text=VLLM_TEXT)
        if path == "/huge/metrics":
            return web.Response(body=b"# " + b"x" * 200_000 + b"\n")
        return web.Response(status=503, text="loading model")


@pytest.fixture
async def server() -> AsyncIterator[tuple[str, MetricsServer]]:
    metrics = MetricsServer()
    app = web.Application()
    app.router.add_get("/{tail:.*}", metrics.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}", metrics
    finally:
        metrics.release.set()
        await runner.cleanup()


@pytest.fixture
async def dead_url() -> str:
    """A loopback address where nothing listens any more."""
    runner = web.AppRunner(web.Application())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    await runner.cleanup()
    return f"http://127.0.0.1:{port}"


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as client:
        yield client


def replica(replica_id: str, base_url: str, path: str, names: MetricNames) -> ReplicaTarget:
    return ReplicaTarget(
        replica_id=replica_id, base_url=base_url, metrics_path=path, metric_names=names
    )


def unknown(replica_id: str) -> ReplicaLoad:
    return ReplicaLoad(replica_id, running=None, waiting=None, kv_cache_usage=None, scraped_at=None)


async def test_vllm_and_llamacpp_replicas_are_read(
    server: tuple[str, MetricsServer], session: aiohttp.ClientSession
) -> None:
    """Each engine's page is read with its own names; an idle llama.cpp reads 0, not None."""
    base, _ = server
    targets = [
        replica("vllm-0", base, "/vllm/metrics", VLLM_METRIC_NAMES),
        replica("llama-0", base, "/llama/metrics", LLAMACPP_METRIC_NAMES),
    ]

    results = await scrape_replicas(session, targets, clock=lambda: SCRAPED_AT)

    assert [
        ReplicaLoad(
            "vllm-0", running=12.0, waiting=5.0, kv_cache_usage=0.83, scraped_at=SCRAPED_AT
        ),
        ReplicaLoad(
            "llama-0", running=0.0, waiting=0.0, kv_cache_usage=None, scraped_at=SCRAPED_AT
        ),
    ] == [result.load for result in results]
    assert [None, None] == [result.failure for result in results]


async def test_failures_are_unknown_never_zero(
    server: tuple[str, MetricsServer], dead_url: str, session: aiohttp.ClientSession
) -> None:
    """Refused, erroring, slow, oversized and malformed pages all read as unknown, with a kind."""
    base, _ = server
    targets = [
        replica("dead", dead_url, "/metrics", VLLM_METRIC_NAMES),
        replica("loading", base, "/loading/metrics", VLLM_METRIC_NAMES),
        replica("slow", base, "/slow/metrics", VLLM_METRIC_NAMES),
        replica("huge", base, "/huge/metrics", VLLM_METRIC_NAMES),
        replica("garbage", base, "/garbage/metrics", VLLM_METRIC_NAMES),
        replica("ok", base, "/vllm/metrics", VLLM_METRIC_NAMES),
    ]

    results = await scrape_replicas(
        # The slow page never answers; 2 s lets the others answer on a loaded machine
        # (at 0.3 s, CI once saw four of them time out).
        session,
        targets,
        clock=lambda: SCRAPED_AT,
        timeout_s=2.0,
        max_bytes=100_000,
    )

    assert [
        ScrapeFailure.CONNECTION,
        ScrapeFailure.HTTP_STATUS,
        ScrapeFailure.TIMEOUT,
        ScrapeFailure.TOO_LARGE,
        ScrapeFailure.MALFORMED,
        None,
    ] == [result.failure for result in results]
    assert [unknown(t.replica_id) for t in targets[:5]] == [r.load for r in results[:5]]
    assert "HTTP 503" == results[1].detail
    assert SCRAPED_AT == results[5].load.scraped_at


async def test_concurrency_is_bounded_and_every_target_answered(
    server: tuple[str, MetricsServer], session: aiohttp.ClientSession
) -> None:
    """At most max_concurrency scrapes run at once, and each target gets its result, in order."""
    base, metrics = server
    targets = [
        replica(str(index), base, "/counted/metrics", VLLM_METRIC_NAMES) for index in range(6)
    ]

    results = await scrape_replicas(session, targets, max_concurrency=2)

    assert 2 == metrics.peak_in_flight
    assert [str(index) for index in range(6)] == [result.load.replica_id for result in results]
    assert all(result.load.running == 12.0 for result in results)


async def test_router_queues_are_summed_across_routers(
    server: tuple[str, MetricsServer], session: aiohttp.ClientSession
) -> None:
    """Two routers' depths add up; the wait is the worst of their means."""
    base, _ = server
    targets = [
        RouterTarget("a", base, "/router-a/metrics"),
        RouterTarget("b", base, "/router-b/metrics"),
    ]

    results = await scrape_routers(session, targets)

    reports = [result.report for result in results]
    assert RouterQueue(depth=5.0, wait_s=4.0) == router_queue(reports, "llama-8b")
    assert RouterQueue(depth=0.0, wait_s=None) == router_queue(reports, "qwen")


async def test_dead_router_makes_an_empty_queue_unknown(
    server: tuple[str, MetricsServer], dead_url: str, session: aiohttp.ClientSession
) -> None:
    """A router that cannot be read hides whether anything is queued, unless another has a queue."""
    base, _ = server
    targets = [
        RouterTarget("a", base, "/router-a/metrics"),
        RouterTarget("dead", dead_url),
    ]

    results = await scrape_routers(session, targets, timeout_s=0.5)

    reports = [result.report for result in results]
    assert ScrapeFailure.CONNECTION == results[1].failure
    assert router_queue(reports, "qwen").depth is None
    assert 3.0 == router_queue(reports, "llama-8b").depth


async def test_router_without_queue_metrics_is_unknown(
    server: tuple[str, MetricsServer], session: aiohttp.ClientSession
) -> None:
    """A router that exports no queue family at all says nothing about queues."""
    base, _ = server

    results = await scrape_routers(session, [RouterTarget("old", base, "/router-old/metrics")])

    assert results[0].failure is None
    assert router_queue([results[0].report], "llama-8b").depth is None
