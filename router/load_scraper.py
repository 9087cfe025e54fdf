"""Engine load: scrape each routable endpoint's `/metrics` and record it in the live state.

Every `interval_s` all endpoints that may take requests (not critical, not
draining) are scraped at once, each with its own metric names (service
Meta) and a short timeout. What "failed" means depends on how:

- the engine answers but not with usable metrics (4xx/5xx, e.g. llama-server
  started without `--metrics`, or text that does not parse): its load is
  unknown at once (`forget_load`);
- the scrape times out or the connection fails: the last load stays and ages
  out after `load_max_age_s` (stale = unknown). A busy engine is exactly the
  one whose `/metrics` answers late; marking it unknown on one slow scrape
  would make the balancer treat it as saturated and pile its share onto the
  others.

Unknown load is read by the balancer as saturated while other endpoints
report, and ignored when none does (fail open).

Parsing runs on the event loop, so only the lines that carry the three
wanted metrics reach the Prometheus parser: a vLLM exposition is hundreds of
lines of histograms, of which three matter here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import aiohttp

from caravan.engine_metrics import EngineMetricsParseError, MetricNames, parse_engine_load
from router.cost_model import CACHE_FIGURE_NAMES, CostConfig, parse_cache_figures
from router.endpoints import CheckStatus, Endpoint
from router.live_state import forget_load, own_counts, record_cache_figures, record_load
from router.metrics import RouterMetrics
from router.routing_state import RoutingState

log = logging.getLogger(__name__)


def relevant_lines(text: str, names: MetricNames) -> str:
    """The exposition lines that can carry one of the wanted samples (other lines dropped)."""
    wanted = tuple(name for name in (names.running, names.waiting, names.kv_cache_usage) if name)
    if not wanted:
        return ""
    return "\n".join(line for line in text.splitlines() if line.startswith(wanted)) + "\n"


def _cache_lines(text: str) -> str:
    """The lines that can carry the cost model's cache figures (router.cost_model)."""
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
        cost: CostConfig | None = None,
    ) -> None:
        self._session = session
        self._cost = cost or CostConfig()
        self._state = state
        self._interval_s = interval_s
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
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
        url = endpoint.base_url + endpoint.metrics_path
        own_before = own_counts(self._state.live, endpoint.id)
        try:
            async with self._session.get(
                url, timeout=self._timeout, raise_for_status=True
            ) as response:
                text = await response.text(errors="replace")
            load = parse_engine_load(
                relevant_lines(text, endpoint.metric_names), endpoint.metric_names
            )
            figures = parse_cache_figures(_cache_lines(text))
        except asyncio.CancelledError:
            raise
        except (aiohttp.ClientResponseError, EngineMetricsParseError) as exc:
            forget_load(self._state.live, endpoint.id)
            self._failed(endpoint, exc)
            return
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            self._failed(endpoint, exc)
            return
        record_load(self._state.live, endpoint.id, load, self._clock(), own_before=own_before)
        record_cache_figures(self._state.live, endpoint.id, figures, self._cost)

    def _failed(self, endpoint: Endpoint, exc: BaseException) -> None:
        self._metrics.scrape_failures.inc()
        log.debug(
            "engine_scrape_failed",
            extra={"endpoint": endpoint.id, "error": f"{type(exc).__name__}: {exc}"},
        )
