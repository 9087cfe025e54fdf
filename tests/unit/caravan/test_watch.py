"""caravan_llm.common.watch: Consul's blocking-client rules as pure functions, and the loop that
uses them."""

from __future__ import annotations

import asyncio
import time

import pytest

from caravan_llm.common.errors import HashiUnavailable
from caravan_llm.common.watch import (
    BlockingWatch,
    TokenBucket,
    WatchStatus,
    backoff_delay_s,
    next_index,
)


@pytest.mark.parametrize(
    ("previous", "returned", "expected"),
    [
        (0, 5, 5),  # first answer
        (5, 5, 5),  # timeout: same index again
        (5, 9, 9),  # moved forward
        (9, 3, 0),  # went backwards: restart with a fresh read
        (0, 0, 1),  # a zero index is never sent back
        (7, 0, 0),  # zero after a real index is "backwards" too
    ],
)
def test_next_index_follows_consul_rules(previous, returned, expected):
    """The next index resets to 0 when it goes backwards and is otherwise at least 1."""
    assert expected == next_index(previous, returned)


def test_backoff_grows_exponentially_and_is_capped():
    """Backoff doubles per failure from base, never exceeds the cap, and jitter scales 50-100%."""
    low = [backoff_delay_s(n, base_s=0.5, cap_s=4.0, jitter=0.0) for n in range(6)]
    high = [backoff_delay_s(n, base_s=0.5, cap_s=4.0, jitter=0.999999) for n in range(6)]
    assert [0.0, 0.25, 0.5, 1.0, 2.0, 2.0] == low
    assert [0.0, 0.5, 1.0, 2.0, 4.0, 4.0] == [round(v, 3) for v in high]


def test_token_bucket_allows_a_burst_then_the_rate():
    """A full bucket of 2 lets two calls through at once, then one per 1/rate seconds."""
    bucket = TokenBucket.full(rate_per_s=2.0, burst=2, now=100.0)
    waits = []
    for now in (100.0, 100.0, 100.0):
        bucket, wait = bucket.take(now)
        waits.append(wait)
    assert [0.0, 0.0, 0.5] == waits


def test_token_bucket_refills_over_time_up_to_the_burst():
    """Idle time refills tokens, but never beyond the burst size."""
    bucket = TokenBucket.full(rate_per_s=1.0, burst=2, now=0.0)
    bucket, _ = bucket.take(0.0)
    bucket, _ = bucket.take(0.0)
    bucket, first = bucket.take(100.0)
    bucket, second = bucket.take(100.0)
    bucket, third = bucket.take(100.0)
    assert (0.0, 0.0, 1.0) == (first, second, third)


def test_token_bucket_rejects_nonsense():
    """A bucket needs a positive rate and room for at least one token."""
    with pytest.raises(ValueError, match="rate_per_s"):
        TokenBucket.full(rate_per_s=0, burst=2, now=0)


def test_watch_status_staleness():
    """A watch is stale before its first success and when the last one is too old."""
    assert WatchStatus().is_stale(now=10.0, max_age_s=5.0)
    assert not WatchStatus(last_success_at=8.0).is_stale(now=10.0, max_age_s=5.0)
    assert WatchStatus(last_success_at=1.0).is_stale(now=10.0, max_age_s=5.0)


class ScriptedFetch:
    """Answers from a script of (index, value) pairs or exceptions; then blocks forever."""

    def __init__(self, script):
        self.script = list(script)
        self.calls: list[tuple[int, float]] = []

    async def __call__(self, index: int, wait_s: float):
        self.calls.append((index, wait_s))
        if not self.script:
            await asyncio.Event().wait()
        step = self.script.pop(0)
        if isinstance(step, BaseException):
            raise step
        return step


async def _collect(watch: BlockingWatch, count: int) -> list:
    seen = []
    async with asyncio.timeout(5):
        async for value in watch:
            seen.append(value)
            if len(seen) == count:
                return seen
    return seen


def _fast(name: str, fetch, **overrides) -> BlockingWatch:
    options = {"rate_per_s": 1000.0, "backoff_base_s": 0.01, "backoff_cap_s": 0.02, "wait_s": 7.0}
    options.update(overrides)
    return BlockingWatch(name, fetch, **options)


async def test_watch_sends_returned_indexes_and_delivers_only_changes():
    """The loop sends each returned index back, and delivers a value only when the index moves."""
    fetch = ScriptedFetch([(5, "a"), (5, "a-again"), (8, "b"), (3, "after-restore"), (4, "c")])
    seen = await _collect(_fast("w", fetch), 4)
    assert ["a", "b", "after-restore", "c"] == seen
    assert [(0, 7.0), (5, 7.0), (5, 7.0), (8, 7.0), (0, 7.0)] == fetch.calls


async def test_watch_treats_a_zero_index_as_one():
    """After an answer with index 0 the next request blocks on index 1, not 0."""
    fetch = ScriptedFetch([(0, "empty"), (2, "x")])
    await _collect(_fast("w", fetch), 2)
    assert [0, 1] == [index for index, _ in fetch.calls]


async def test_watch_backs_off_on_errors_and_reports_them():
    """Errors are retried after a backoff; the status reports the last error until a success."""
    fetch = ScriptedFetch([HashiUnavailable("down"), HashiUnavailable("still down"), (4, "up")])
    watch = _fast("w", fetch)
    statuses = []

    async def observe():
        while True:
            statuses.append(watch.status.consecutive_errors)
            await asyncio.sleep(0.001)

    observer = asyncio.create_task(observe())
    try:
        seen = await _collect(watch, 1)
    finally:
        observer.cancel()
    assert ["up"] == seen
    assert 2 == max(statuses)
    assert 0 == watch.status.consecutive_errors
    assert "HashiUnavailable: still down" == watch.status.last_error
    assert [0, 0, 0] == [index for index, _ in fetch.calls]


async def test_watch_is_rate_limited():
    """With a burst of 2 and 20/s, six immediate answers take at least 0.2 s."""
    fetch = ScriptedFetch([(n, n) for n in range(1, 7)])
    watch = BlockingWatch("w", fetch, rate_per_s=20.0, burst=2)
    started = time.monotonic()
    await _collect(watch, 6)
    assert time.monotonic() - started >= 0.19


async def test_watch_cancels_at_once_while_blocked():
    """Cancelling the consumer ends a watch blocked in its fetch immediately."""
    fetch = ScriptedFetch([])
    task = asyncio.create_task(_collect(_fast("w", fetch), 1))
    # Blocked once the watch has called its fetch (which never answers).
    async with asyncio.timeout(2):
        while not fetch.calls:
            await asyncio.sleep(0.001)
    started = time.monotonic()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert time.monotonic() - started < 0.1


async def test_watch_run_delivers_to_a_callback():
    """run() hands each new result to the callback."""
    fetch = ScriptedFetch([(1, "one"), (2, "two")])
    delivered: list[str] = []

    async def deliver(value: str) -> None:
        delivered.append(value)

    task = asyncio.create_task(_fast("w", fetch).run(deliver))
    async with asyncio.timeout(2):
        while len(delivered) < 2:
            await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert ["one", "two"] == delivered
