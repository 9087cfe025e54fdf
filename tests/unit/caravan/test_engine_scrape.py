"""The one engine scraper: size cap, timeout, the engine's key, and what each failure is."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp
import pytest
from aiohttp import web

from caravan_llm.common.engine_metrics import EngineLoad
from caravan_llm.common.engine_scrape import (
    ScrapeError,
    ScrapeFailure,
    fetch_metrics_text,
    relevant_lines,
    scrape_engine,
)
from caravan_llm.scheduler.engines.llamacpp import LLAMACPP_METRIC_NAMES
from caravan_llm.scheduler.engines.vllm import VLLM_METRIC_NAMES

KEY = "sk-engine-secret-1234"

VLLM_TEXT = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 4.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="m"} 3.0
"""

LLAMACPP_TEXT = """\
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 2
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 0
"""


@dataclass
class Engine:
    """A loopback engine: llama-server's /metrics guarded by its key, and the ways a page fails."""

    base: str = ""
    release: asyncio.Event = field(default_factory=asyncio.Event)
    authorizations: list[str | None] = field(default_factory=list)


async def _handle(engine: Engine, request: web.Request) -> web.StreamResponse:
    engine.authorizations.append(request.headers.get("Authorization"))
    match request.path:
        case "/vllm/metrics":
            return web.Response(text=VLLM_TEXT)
        case "/guarded/metrics":
            if request.headers.get("Authorization") != f"Bearer {KEY}":
                return web.Response(status=401, text="Invalid API Key")
            return web.Response(text=LLAMACPP_TEXT)
        case "/slow/metrics":
            await engine.release.wait()
            return web.Response(text=VLLM_TEXT)
        case "/declared-huge/metrics":
            return web.Response(body=b"#" * 5_000)
        case "/streamed-huge/metrics":
            # No Content-Length: the cap must hold while reading, not only on the header.
            response = web.StreamResponse()
            response.enable_chunked_encoding()
            await response.prepare(request)
            for _ in range(10):
                await response.write(b"#" * 1_000 + b"\n")
            await response.write_eof()
            return response
        case "/garbage/metrics":
            return web.Response(text="vllm:num_requests_running{not prometheus\n")
        case "/latin1/metrics":
            return web.Response(body=b"\xff\xfe", content_type="text/plain", charset="utf-8")
        case "/redirect/metrics":
            raise web.HTTPFound("/guarded/metrics")
    return web.Response(status=503, text="loading model")


@pytest.fixture
async def engine() -> AsyncIterator[Engine]:
    state = Engine()

    async def handle(request: web.Request) -> web.StreamResponse:
        return await _handle(state, request)

    app = web.Application()
    app.router.add_get("/{tail:.*}", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    state.base = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        yield state
    finally:
        state.release.set()
        await runner.cleanup()


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as client:
        yield client


async def test_reads_the_engine_load(engine: Engine, session: aiohttp.ClientSession) -> None:
    load = await scrape_engine(
        session, engine.base + "/vllm/metrics", VLLM_METRIC_NAMES, timeout_s=2
    )

    assert EngineLoad(running=4.0, waiting=1.0, kv_cache_usage=0.5) == load
    assert [None] == engine.authorizations


async def test_sends_the_engine_key_as_a_bearer_token(
    engine: Engine, session: aiohttp.ClientSession
) -> None:
    """llama-server guards /metrics with its key: with it the page reads, without it 401."""
    url = engine.base + "/guarded/metrics"

    load = await scrape_engine(session, url, LLAMACPP_METRIC_NAMES, timeout_s=2, api_key=KEY)
    with pytest.raises(ScrapeError) as refused:
        await scrape_engine(session, url, LLAMACPP_METRIC_NAMES, timeout_s=2)

    assert EngineLoad(running=2.0, waiting=0.0, kv_cache_usage=None) == load
    assert [f"Bearer {KEY}", None] == engine.authorizations
    assert (ScrapeFailure.HTTP_STATUS, "HTTP 401") == (refused.value.failure, refused.value.detail)
    assert KEY not in str(refused.value)


async def test_a_redirect_is_not_followed_with_the_key(
    engine: Engine, session: aiohttp.ClientSession
) -> None:
    with pytest.raises(ScrapeError) as raised:
        await scrape_engine(
            session, engine.base + "/redirect/metrics", VLLM_METRIC_NAMES, timeout_s=2, api_key=KEY
        )

    assert (ScrapeFailure.HTTP_STATUS, "HTTP 302") == (raised.value.failure, raised.value.detail)
    assert 1 == len(engine.authorizations)


@pytest.mark.parametrize("path", ["/declared-huge/metrics", "/streamed-huge/metrics"])
async def test_the_size_cap_is_enforced(
    engine: Engine, session: aiohttp.ClientSession, path: str
) -> None:
    """A page over max_bytes fails as too large, whether it says its length up front or not."""
    with pytest.raises(ScrapeError) as raised:
        await fetch_metrics_text(session, engine.base + path, timeout_s=2, max_bytes=4_096)

    assert ScrapeFailure.TOO_LARGE == raised.value.failure
    assert raised.value.failure.engine_answered


async def test_a_page_at_the_cap_is_read(engine: Engine, session: aiohttp.ClientSession) -> None:
    text = await fetch_metrics_text(
        session, engine.base + "/declared-huge/metrics", timeout_s=2, max_bytes=5_000
    )

    assert 5_000 == len(text)


async def test_a_slow_engine_times_out(engine: Engine, session: aiohttp.ClientSession) -> None:
    """The timeout is the caller's: the scrape gives up even though the engine never answers."""
    with pytest.raises(ScrapeError) as raised:
        await asyncio.wait_for(
            scrape_engine(session, engine.base + "/slow/metrics", VLLM_METRIC_NAMES, timeout_s=0.2),
            timeout=10,
        )

    assert (ScrapeFailure.TIMEOUT, "no answer within 0.2s") == (
        raised.value.failure,
        raised.value.detail,
    )
    assert not raised.value.failure.engine_answered
    assert raised.value.retryable


async def test_a_refused_connection_is_a_connection_failure(
    session: aiohttp.ClientSession,
) -> None:
    runner = web.AppRunner(web.Application())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    await runner.cleanup()

    with pytest.raises(ScrapeError) as raised:
        await scrape_engine(
            session, f"http://127.0.0.1:{port}/metrics", VLLM_METRIC_NAMES, timeout_s=2
        )

    assert ScrapeFailure.CONNECTION == raised.value.failure
    assert not raised.value.failure.engine_answered


@pytest.mark.parametrize(
    ("path", "failure"),
    [
        ("/loading/metrics", ScrapeFailure.HTTP_STATUS),
        ("/garbage/metrics", ScrapeFailure.MALFORMED),
        ("/latin1/metrics", ScrapeFailure.MALFORMED),
    ],
)
async def test_an_answer_without_usable_metrics_says_the_engine_answered(
    engine: Engine, session: aiohttp.ClientSession, path: str, failure: ScrapeFailure
) -> None:
    with pytest.raises(ScrapeError) as raised:
        await scrape_engine(session, engine.base + path, VLLM_METRIC_NAMES, timeout_s=2)

    assert failure == raised.value.failure
    assert raised.value.failure.engine_answered


async def test_limits_are_checked(session: aiohttp.ClientSession) -> None:
    with pytest.raises(ValueError, match="timeout_s must be > 0, got 0"):
        await fetch_metrics_text(session, "http://127.0.0.1:1/metrics", timeout_s=0)
    with pytest.raises(ValueError, match="max_bytes must be >= 1, got 0"):
        await fetch_metrics_text(session, "http://127.0.0.1:1/metrics", timeout_s=1, max_bytes=0)


def test_only_lines_of_the_wanted_names_reach_the_parser() -> None:
    kept = relevant_lines(VLLM_TEXT, VLLM_METRIC_NAMES)

    assert [
        'vllm:num_requests_running{engine="0",model_name="m"} 4.0',
        'vllm:num_requests_waiting{engine="0",model_name="m"} 1.0',
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5',
    ] == kept.splitlines()
    assert "" == relevant_lines(VLLM_TEXT, LLAMACPP_METRIC_NAMES).strip()
