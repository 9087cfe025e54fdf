"""Engine load: scrape each routable endpoint's `/metrics` and record it in the live state.

Every `interval_s` all endpoints that may take requests (not critical, not
draining) are scraped at once, each with its own metric names (service
Meta), by `caravan_llm.common.engine_scrape`, the one engine scraper the autoscaler uses
too (short timeout, size cap, the engine's API key). What "failed" means
depends on how:

- the engine answers but not with usable metrics (4xx/5xx, e.g. llama-server
  started without `--metrics`, a page over the size cap, or text that does
  not parse): its load is unknown at once (`forget_load`);
- the scrape times out or the connection fails: the last load stays and ages
  out after `load_max_age_s` (stale = unknown). A busy engine is exactly the
  one whose `/metrics` answers late; marking it unknown on one slow scrape
  would make the balancer treat it as saturated and pile its share onto the
  others.

Unknown load is read by the balancer as saturated while other endpoints
report, and ignored when none does (fail open).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import aiohttp

from caravan_llm.common.engine_metrics import EngineMetricsParseError, parse_engine_load
from caravan_llm.common.engine_scrape import (
    MAX_METRICS_BYTES,
    ScrapeError,
    ScrapeFailure,
    fetch_metrics_text,
    relevant_lines,
)
from caravan_llm.router.core.cost_model import (
    CACHE_FIGURE_NAMES,
    CostConfig,
    parse_cache_figures,
    record_cache_figures,
)
from caravan_llm.router.core.endpoints import CheckStatus, Endpoint
from caravan_llm.router.core.live_state import forget_load, own_counts, record_load
from caravan_llm.router.core.routing_state import RoutingState
from caravan_llm.router.feeds.engine_keys import EngineKeySource
from caravan_llm.router.metrics import RouterMetrics

# Named as before the router's sub-packages: the logger is a field of every log line.
log = logging.getLogger("router.load_scraper")


def _cache_lines(text: str) -> str:
    """The lines that can carry the cost model's cache figures
    (caravan_llm.router.core.cost_model)."""
    return (
        "\n".join(line for line in text.splitlines() if line.startswith(CACHE_FIGURE_NAMES)) + "\n"
    )


class LoadScraper:
    def __init__(
        self,
        session: aiohttp.ClientSession,
        state: RoutingState,
        *,
        interval_s: float,
        timeout_s: float,
        metrics: RouterMetrics,
        clock: Callable[[], float] = time.monotonic,
        engine_keys: EngineKeySource | None = None,
        max_bytes: int = MAX_METRICS_BYTES,
        cost: CostConfig | None = None,
    ) -> None:
        self._max_bytes = max_bytes
        self._engine_keys = engine_keys
        self._session = session
        self._cost = cost or CostConfig()
        self._state = state
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self._metrics = metrics
        self._clock = clock

    async def run(self) -> None:
        while True:
            started = self._clock()
            await self.scrape_once()
            await asyncio.sleep(max(0.0, self._interval_s - (self._clock() - started)))

    async def scrape_once(self) -> None:
        live = self._state.live
        targets = [
            endpoint
            for endpoint in self._state.view.snapshot.by_id.values()
            if endpoint.status is not CheckStatus.CRITICAL
            and not (endpoint.id in live and live[endpoint.id].draining)
        ]
        if targets:
            await asyncio.gather(*(self._scrape(endpoint) for endpoint in targets))

    async def _scrape(self, endpoint: Endpoint) -> None:
        # llama-server guards /metrics with its API key (vLLM does not; the key is harmless there).
        key = None if self._engine_keys is None else self._engine_keys.key_for(endpoint.service)
        own_before = own_counts(self._state.live, endpoint.id)
        try:
            text = await fetch_metrics_text(
                self._session,
                endpoint.base_url + endpoint.metrics_path,
                timeout_s=self._timeout_s,
                max_bytes=self._max_bytes,
                api_key=key,
            )
            # The same page feeds the load and the cost model's cache figures.
            try:
                load = parse_engine_load(
                    relevant_lines(text, endpoint.metric_names), endpoint.metric_names
                )
                figures = parse_cache_figures(_cache_lines(text))
            except EngineMetricsParseError as exc:
                raise ScrapeError(ScrapeFailure.MALFORMED, "not Prometheus text format") from exc
        except ScrapeError as exc:
            if exc.failure.engine_answered:
                forget_load(self._state.live, endpoint.id)
            self._failed(endpoint, exc)
            return
        record_load(self._state.live, endpoint.id, load, self._clock(), own_before=own_before)
        record_cache_figures(self._state.live, endpoint.id, figures, self._cost)

    def _failed(self, endpoint: Endpoint, exc: ScrapeError) -> None:
        self._metrics.scrape_failures.inc()
        log.debug("engine_scrape_failed", extra={"endpoint": endpoint.id, "error": str(exc)})
