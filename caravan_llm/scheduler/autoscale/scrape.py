"""Reading the load of replicas and routers from their `/metrics` (the autoscaler's I/O).

Replicas: each target names its engine's metrics path and metric names (from
its Consul service Meta, contract 4); each is read by `caravan_llm.common.engine_scrape`,
the one engine scraper the router uses too (timeout, size cap, API key).

Routers: every router exports, per model,

    caravan_router_queue_depth{model="..."}            gauge
    caravan_router_queue_wait_seconds{model="..."}     histogram

and `signals.router_queue` combines the reports of all routers.

Every scrape has a short timeout and the scrapes of one call run concurrently
under a bound. A failed scrape is never an exception to the caller: it comes
back as an all-None load (unknown, never zero) with the kind of failure, for
a log line and a metric.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TypeVar

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from caravan_llm.common.contract import (
    ROUTER_MODEL_LABEL,
    ROUTER_QUEUE_DEPTH_METRIC,
    ROUTER_QUEUE_WAIT_METRIC,
)
from caravan_llm.common.engine_metrics import MetricNames
from caravan_llm.common.engine_scrape import (
    MAX_METRICS_BYTES,
    ScrapeError,
    ScrapeFailure,
    fetch_metrics_text,
    scrape_engine,
)
from caravan_llm.scheduler.autoscale.signals import ReplicaLoad, RouterQueueReport

# An engine answers /metrics from memory in milliseconds; a replica that takes
# seconds is overloaded or gone, and waiting longer would delay every model's
# evaluation behind it.
DEFAULT_TIMEOUT_S = 2.0
DEFAULT_MAX_CONCURRENCY = 16

Item = TypeVar("Item")
Result = TypeVar("Result")


@dataclass(frozen=True, slots=True)
class ReplicaTarget:
    """Where one replica's engine metrics are, and which samples to read."""

    replica_id: str
    # For example http://10.0.0.5:21000 (from the Consul service address and port).
    base_url: str
    metrics_path: str
    metric_names: MetricNames
    # The engine's API key (llama-server guards /metrics with it); never shown.
    api_key: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        _check_endpoint(self.base_url, self.metrics_path)

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + self.metrics_path


@dataclass(frozen=True, slots=True)
class ReplicaScrape:
    """The load read from one replica, or the reason there is none."""

    load: ReplicaLoad
    failure: ScrapeFailure | None
    # A short description of the failure for a log line; empty on success.
    detail: str


@dataclass(frozen=True, slots=True)
class RouterTarget:
    """Where one router's metrics are."""

    router_id: str
    base_url: str
    metrics_path: str = "/metrics"

    def __post_init__(self) -> None:
        _check_endpoint(self.base_url, self.metrics_path)

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + self.metrics_path


@dataclass(frozen=True, slots=True)
class RouterScrape:
    """One router's queues, or the reason they are unknown."""

    report: RouterQueueReport
    failure: ScrapeFailure | None
    detail: str


def _check_endpoint(base_url: str, metrics_path: str) -> None:
    if not base_url.startswith(("http://", "https://")):
        raise ValueError(f"base_url must start with http:// or https://, got {base_url!r}")
    if not metrics_path.startswith("/"):
        raise ValueError(f"metrics_path must start with '/', got {metrics_path!r}")


def _check_limits(timeout_s: float, max_concurrency: int) -> None:
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    if max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")


async def _run_bounded(
    items: Sequence[Item], run: Callable[[Item], Awaitable[Result]], max_concurrency: int
) -> tuple[Result, ...]:
    semaphore = asyncio.Semaphore(max_concurrency)

    async def one(item: Item) -> Result:
        async with semaphore:
            return await run(item)

    async with asyncio.TaskGroup() as group:
        tasks = [group.create_task(one(item)) for item in items]
    return tuple(task.result() for task in tasks)


def _unknown_load(replica_id: str) -> ReplicaLoad:
    return ReplicaLoad(
        replica_id=replica_id, running=None, waiting=None, kv_cache_usage=None, scraped_at=None
    )


async def scrape_replicas(
    session: aiohttp.ClientSession,
    targets: Sequence[ReplicaTarget],
    *,
    clock: Callable[[], float] = time.time,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    max_concurrency: int = DEFAULT_MAX_CONCURRENCY,
    max_bytes: int = MAX_METRICS_BYTES,
) -> tuple[ReplicaScrape, ...]:
    """Scrape every replica concurrently; one result per target, in the same order.

    `clock` stamps `scraped_at` when a scrape succeeds. It must be the clock
    the policy's `now` comes from, wall-clock seconds by default.
    """
    _check_limits(timeout_s, max_concurrency)

    async def scrape_one(target: ReplicaTarget) -> ReplicaScrape:
        try:
            engine_load = await scrape_engine(
                session,
                target.url,
                target.metric_names,
                timeout_s=timeout_s,
                max_bytes=max_bytes,
                api_key=target.api_key,
            )
        except ScrapeError as exc:
            return ReplicaScrape(_unknown_load(target.replica_id), exc.failure, exc.detail)
        load = ReplicaLoad(
            replica_id=target.replica_id,
            running=engine_load.running,
            waiting=engine_load.waiting,
            kv_cache_usage=engine_load.kv_cache_usage,
            scraped_at=clock(),
        )
        return ReplicaScrape(load, None, "")

    return await _run_bounded(targets, scrape_one, max_concurrency)


def parse_router_queues(router_id: str, text: str) -> RouterQueueReport:
    """Read one router's per-model queue depth and mean queue wait from its exposition text.

    Depth series of one model are summed (a router may add labels). The wait is
    the histogram's sum / count, a mean since the router started. A metric
    family the text does not contain at all gives None (the router does not
    export it); a family with no series for a model means an empty queue for
    it. Raises ScrapeError (malformed) when the text is not exposition format.
    """
    depth: dict[str, float] | None = None
    wait_sum: dict[str, float] = {}
    wait_count: dict[str, float] = {}
    wait_exported = False
    sum_name = f"{ROUTER_QUEUE_WAIT_METRIC}_sum"
    count_name = f"{ROUTER_QUEUE_WAIT_METRIC}_count"
    try:
        for family in text_string_to_metric_families(text):
            if family.name == ROUTER_QUEUE_DEPTH_METRIC and depth is None:
                depth = {}
            if family.name == ROUTER_QUEUE_WAIT_METRIC:
                wait_exported = True
            for sample in family.samples:
                model = sample.labels.get(ROUTER_MODEL_LABEL)
                if model is None or math.isnan(sample.value):
                    continue
                if sample.name == ROUTER_QUEUE_DEPTH_METRIC:
                    depth = {} if depth is None else depth
                    depth[model] = depth.get(model, 0.0) + sample.value
                elif sample.name == sum_name:
                    wait_exported = True
                    wait_sum[model] = wait_sum.get(model, 0.0) + sample.value
                elif sample.name == count_name:
                    wait_exported = True
                    wait_count[model] = wait_count.get(model, 0.0) + sample.value
    # The parser signals bad input with ValueError mostly, but a truncated line
    # can surface as an IndexError or KeyError from inside it.
    except (ValueError, IndexError, KeyError, TypeError) as exc:
        raise ScrapeError(ScrapeFailure.MALFORMED, "not Prometheus text format") from exc
    means = {
        model: wait_sum[model] / count
        for model, count in wait_count.items()
        if count > 0 and model in wait_sum
    }
    return RouterQueueReport(
        router_id=router_id,
        depth_by_model=None if depth is None else MappingProxyType(depth),
        mean_wait_s_by_model=MappingProxyType(means) if wait_exported else None,
    )


async def scrape_routers(
    session: aiohttp.ClientSession,
    targets: Sequence[RouterTarget],
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    max_concurrency: int = DEFAULT_MAX_CONCURRENCY,
    max_bytes: int = MAX_METRICS_BYTES,
) -> tuple[RouterScrape, ...]:
    """Scrape every router concurrently; one result per target, in the same order.

    Pass the reports to `signals.router_queue` once per model. An empty
    `targets` (no router registered) is a legitimate "nothing queued".
    """
    _check_limits(timeout_s, max_concurrency)

    async def scrape_one(target: RouterTarget) -> RouterScrape:
        try:
            text = await fetch_metrics_text(
                session, target.url, timeout_s=timeout_s, max_bytes=max_bytes
            )
            report = parse_router_queues(target.router_id, text)
        except ScrapeError as exc:
            unknown = RouterQueueReport(
                router_id=target.router_id, depth_by_model=None, mean_wait_s_by_model=None
            )
            return RouterScrape(unknown, exc.failure, exc.detail)
        return RouterScrape(report, None, "")

    return await _run_bounded(targets, scrape_one, max_concurrency)
