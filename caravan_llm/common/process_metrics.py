"""The health of a caravan process itself, on its `/metrics`: memory, file descriptors, tasks.

Both the scheduler and the router register these on their registry, under the
same names, so one query covers every caravan process:

- `process_resident_memory_bytes`, `process_open_fds`, `process_max_fds`,
  `process_cpu_seconds_total`, `process_virtual_memory_bytes`,
  `process_start_time_seconds`: prometheus_client's standard process
  collector (read from /proc; absent on systems without it);
- `caravan_process_asyncio_tasks`: the tasks alive on the event loop that
  serves `/metrics` (counted at scrape time; absent when a scrape runs outside
  a loop). A number that keeps growing under steady load is a task leak.
- `caravan_process_python_blocks`: the memory blocks the interpreter holds
  allocated (`sys.getallocatedblocks()`: its objects and their buffers),
  counted at each scrape. It leaves out what RSS cannot: memory the
  allocator keeps after a burst is freed (CPython returns a 1 MiB arena
  only when every object in it is gone, so RSS stays at a burst's high
  water), so a number that keeps growing under steady load is a leak of
  objects even while RSS stands still.

A long soak (bench/soak.py) reads them over time: each should level off
after warm-up.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.metrics_core import GaugeMetricFamily, Metric

ASYNCIO_TASKS = "caravan_process_asyncio_tasks"
PYTHON_BLOCKS = "caravan_process_python_blocks"


class AsyncioTaskCollector:
    """`caravan_process_asyncio_tasks`: the running loop's live tasks, counted at each scrape."""

    def collect(self) -> Iterator[Metric]:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            # No loop in this thread: no sample (unknown, not 0).
            return
        yield GaugeMetricFamily(
            ASYNCIO_TASKS,
            "asyncio tasks alive on the event loop serving /metrics",
            value=len(asyncio.all_tasks(loop)),
        )


class PythonBlocksCollector:
    """`caravan_process_python_blocks`: the interpreter's allocated memory blocks at each scrape."""

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            PYTHON_BLOCKS,
            "memory blocks the Python interpreter holds allocated (sys.getallocatedblocks)",
            value=sys.getallocatedblocks(),
        )


def register_process_metrics(registry: CollectorRegistry) -> None:
    """Add the process collector, the asyncio task gauge and the Python blocks gauge."""
    ProcessCollector(registry=registry)
    registry.register(AsyncioTaskCollector())
    registry.register(PythonBlocksCollector())
