"""Reading one engine's `/metrics` over HTTP: the one scraper the router and the autoscaler share.

`scrape_engine` GETs one engine's metrics page and turns it into an
`EngineLoad` with `caravan_llm.common.engine_metrics`. Every scrape:

- has a total timeout (an engine answers `/metrics` from memory in
  milliseconds; one that takes seconds is overloaded or gone);
- reads at most `max_bytes` of body (vLLM's page with all its histograms is a
  few hundred KiB; far more is not a metrics page, and reading it whole would
  let one replica fill the caller's memory);
- sends the engine's API key as a bearer token when it has one (llama-server
  guards `/metrics` with `--api-key`; vLLM does not, and the header is harmless
  there), never follows a redirect (which could carry the key elsewhere), and
  never puts the key in an error;
- parses only the exposition lines that can carry one of the wanted samples:
  the parser runs on the caller's event loop, and of a vLLM page's hundreds of
  histogram lines three matter. A page that carries none of the wanted names
  therefore reads as all None (unknown), whatever else it holds.

A failed scrape raises `ScrapeError` with a bounded `ScrapeFailure` kind, for
a metric label and for the caller's choice of what the failure means: an
engine that answered without usable metrics (`engine_answered`) is unknown at
once, while a timeout or a refused connection may be a busy engine whose last
reading can still stand for a while.
"""

from __future__ import annotations

from enum import StrEnum
from typing import TYPE_CHECKING

import aiohttp

from caravan_llm.common.engine_metrics import EngineMetricsParseError, parse_engine_load

if TYPE_CHECKING:
    from caravan_llm.common.engine_metrics import EngineLoad, MetricNames

# vLLM's page with all its histograms is a few hundred KiB; far more is not a
# metrics page.
MAX_METRICS_BYTES = 8 * 1024 * 1024
_CHUNK_BYTES = 64 * 1024


class ScrapeFailure(StrEnum):
    """Why a scrape produced no reading (a bounded label value for metrics)."""

    TIMEOUT = "timeout"
    CONNECTION = "connection"
    HTTP_STATUS = "http_status"
    TOO_LARGE = "too_large"
    MALFORMED = "malformed"

    @property
    def engine_answered(self) -> bool:
        """True when the engine answered, but not with usable metrics (its load is unknown now)."""
        return self not in {ScrapeFailure.TIMEOUT, ScrapeFailure.CONNECTION}


class ScrapeError(Exception):
    """One scrape failed; the next scrape tries again."""

    retryable = True

    def __init__(self, failure: ScrapeFailure, detail: str) -> None:
        super().__init__(f"{failure.value}: {detail}")
        self.failure = failure
        self.detail = detail


def _check_limits(timeout_s: float, max_bytes: int) -> None:
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    if max_bytes < 1:
        raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")


async def _read_bounded(response: aiohttp.ClientResponse, max_bytes: int) -> bytes:
    if response.content_length is not None and response.content_length > max_bytes:
        raise ScrapeError(ScrapeFailure.TOO_LARGE, f"{response.content_length} bytes")
    chunks: list[bytes] = []
    size = 0
    async for chunk in response.content.iter_chunked(_CHUNK_BYTES):
        size += len(chunk)
        if size > max_bytes:
            raise ScrapeError(ScrapeFailure.TOO_LARGE, f"more than {max_bytes} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def fetch_metrics_text(
    session: aiohttp.ClientSession,
    url: str,
    *,
    timeout_s: float,
    max_bytes: int = MAX_METRICS_BYTES,
    api_key: str | None = None,
) -> str:
    """GET one metrics page as text (with the bearer key, if any); raises ScrapeError."""
    _check_limits(timeout_s, max_bytes)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    try:
        async with session.get(
            url,
            timeout=aiohttp.ClientTimeout(total=timeout_s),
            allow_redirects=False,
            raise_for_status=False,
            headers=headers,
        ) as response:
            if response.status != 200:
                raise ScrapeError(ScrapeFailure.HTTP_STATUS, f"HTTP {response.status}")
            body = await _read_bounded(response, max_bytes)
            charset = response.charset or "utf-8"
    # aiohttp's read timeouts are both TimeoutError and ClientError; they are timeouts.
    except TimeoutError as exc:
        raise ScrapeError(ScrapeFailure.TIMEOUT, f"no answer within {timeout_s:g}s") from exc
    except aiohttp.ClientError as exc:
        raise ScrapeError(ScrapeFailure.CONNECTION, type(exc).__name__) from exc
    try:
        return body.decode(charset)
    except (UnicodeDecodeError, LookupError) as exc:
        raise ScrapeError(ScrapeFailure.MALFORMED, f"body is not {charset} text") from exc


def relevant_lines(text: str, names: MetricNames) -> str:
    """The exposition lines that can carry one of the wanted samples (other lines dropped)."""
    wanted = tuple(name for name in (names.running, names.waiting, names.kv_cache_usage) if name)
    if not wanted:
        return ""
    return "\n".join(line for line in text.splitlines() if line.startswith(wanted)) + "\n"


async def scrape_engine(
    session: aiohttp.ClientSession,
    url: str,
    names: MetricNames,
    *,
    timeout_s: float,
    max_bytes: int = MAX_METRICS_BYTES,
    api_key: str | None = None,
) -> EngineLoad:
    """Read one engine's load from its metrics page at `url`; raises ScrapeError."""
    text = await fetch_metrics_text(
        session, url, timeout_s=timeout_s, max_bytes=max_bytes, api_key=api_key
    )
    try:
        return parse_engine_load(relevant_lines(text, names), names)
    except EngineMetricsParseError as exc:
        raise ScrapeError(ScrapeFailure.MALFORMED, "not Prometheus text format") from exc
