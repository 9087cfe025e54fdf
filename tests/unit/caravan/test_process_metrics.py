"""A caravan process's own gauges: memory and descriptors from /proc, asyncio tasks at scrape."""

from __future__ import annotations

import asyncio
import sys

import pytest
from prometheus_client import CollectorRegistry

from caravan_llm.common.process_metrics import (
    ASYNCIO_TASKS,
    PYTHON_BLOCKS,
    register_process_metrics,
)


def registry() -> CollectorRegistry:
    built = CollectorRegistry()
    register_process_metrics(built)
    return built


async def test_the_task_gauge_counts_the_loops_live_tasks():
    """Inside a loop the gauge is the number of tasks alive at the scrape, this one included."""
    scraped = registry()
    parked = asyncio.Event()
    extra = [asyncio.create_task(parked.wait()) for _ in range(3)]
    try:
        expected = len(asyncio.all_tasks())
        assert expected == scraped.get_sample_value(ASYNCIO_TASKS)
    finally:
        parked.set()
        await asyncio.gather(*extra)


def test_no_task_sample_outside_a_loop():
    """A scrape outside any event loop has no task sample: unknown, not zero."""
    assert registry().get_sample_value(ASYNCIO_TASKS) is None


def test_the_blocks_gauge_follows_the_objects_alive():
    """The blocks gauge rises with objects kept alive and falls back when they are freed."""
    scraped = registry()
    before = scraped.get_sample_value(PYTHON_BLOCKS)
    kept = [[number] for number in range(20_000)]
    held = scraped.get_sample_value(PYTHON_BLOCKS)
    del kept
    after = scraped.get_sample_value(PYTHON_BLOCKS)
    assert before is not None
    assert held is not None
    assert after is not None
    assert held - before >= 20_000
    assert after - before < 2_000


@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the process collector reads /proc"
)
def test_memory_and_descriptors_come_from_proc():
    """On Linux the standard process gauges carry this process's RSS and open descriptors."""
    scraped = registry()
    rss = scraped.get_sample_value("process_resident_memory_bytes")
    fds = scraped.get_sample_value("process_open_fds")
    assert rss is not None
    assert rss > 0
    assert fds is not None
    assert fds >= 3
