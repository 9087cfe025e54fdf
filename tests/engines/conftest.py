"""Fixtures for the engine tests: simulated instances on loopback and an HTTP client."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping

import aiohttp
import pytest
from engine_test_support import StartEngine

from caravan_llm.devcluster.engine.flags import parse_engine_args
from caravan_llm.devcluster.engine.server import RunningEngine, run_engine


@pytest.fixture
async def sim_engine() -> AsyncIterator[StartEngine]:
    """Start simulated engines in this event loop (port 0, no load time unless given)."""
    async with contextlib.AsyncExitStack() as stack:

        async def start(
            flavor: str,
            *args: str,
            env: Mapping[str, str] | None = None,
            wait_ready: bool = True,
        ) -> RunningEngine:
            argv = ["--flavor", flavor, "--host", "127.0.0.1", "--port", "0"]
            if "--sim-load-seconds" not in args and "CARAVAN_SIM_LOAD_SECONDS" not in (env or {}):
                argv += ["--sim-load-seconds", "0"]
            settings = parse_engine_args([*argv, *args], env=env or {})
            running = await stack.enter_async_context(run_engine(settings))
            if wait_ready:
                await asyncio.wait_for(running.engine.ready.wait(), timeout=10)
            return running

        yield start


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        yield session
