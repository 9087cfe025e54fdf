"""The blocking-query watch loop shared by the router and the scheduler.

    async def fetch(index: int, wait_s: float) -> tuple[int, Entries]:
        return await consul.health_service(name, passing=True, index=index, wait_s=wait_s)

    watch = BlockingWatch("health caravan-qwen", fetch)
    async for entries in watch:          # each new result (coalesced: the latest only)
        snapshot = build(entries)        # consumers re-read full state

It follows Consul's rules for blocking clients (facts C4; Nomad's blocking
queries work the same way, facts N16):
a return is no proof of change (results are delivered when the index
moves); an index that goes backwards resets the loop to 0 (a fresh read);
an index of 0 after a read is treated as 1 so the server blocks; the loop
is rate-limited by a token bucket (burst 2) rather than fixed sleeps; errors
back off exponentially with jitter, capped. `status` reports the index, the
last success and the last error so callers can tell a stale view.
Cancellation is honoured at once: every wait is an await on the loop.

The decisions (`next_index`, `backoff_delay_s`, `TokenBucket`) are pure
functions of their inputs and tested as such.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Generic, NoReturn, TypeVar

from caravan_llm.common.errors import HashiError

log = logging.getLogger(__name__)

T = TypeVar("T")
Fetch = Callable[[int, float], Awaitable[tuple[int, T]]]


def next_index(previous: int, returned: int) -> int:
    """The index to send next: 0 (fresh read) if it went backwards, else at least 1."""
    if returned < previous:
        return 0
    return max(returned, 1)


def backoff_delay_s(failures: int, *, base_s: float, cap_s: float, jitter: float) -> float:
    """Delay after `failures` consecutive errors: base*2^(n-1), capped, scaled into [50%, 100%].

    `jitter` is a number in [0, 1) (random in the loop, fixed in tests).
    """
    if failures <= 0:
        return 0.0
    ceiling = min(cap_s, base_s * 2.0 ** min(failures - 1, 32))
    return ceiling * (0.5 + 0.5 * jitter)


@dataclass(frozen=True, slots=True)
class TokenBucket:
    """A token bucket over an injected clock: `take` says how long to wait for the next token."""

    rate_per_s: float
    burst: float
    tokens: float
    updated_at: float

    @classmethod
    def full(cls, rate_per_s: float, burst: float, now: float) -> TokenBucket:
        if rate_per_s <= 0 or burst < 1:
            raise ValueError(f"need rate_per_s > 0 and burst >= 1, got {rate_per_s}, {burst}")
        return cls(rate_per_s=rate_per_s, burst=burst, tokens=burst, updated_at=now)

    def take(self, now: float) -> tuple[TokenBucket, float]:
        """Spend one token at `now`; returns the new bucket and the wait before it is ours."""
        elapsed = max(0.0, now - self.updated_at)
        tokens = min(self.burst, self.tokens + elapsed * self.rate_per_s) - 1.0
        wait = 0.0 if tokens >= 0 else -tokens / self.rate_per_s
        return replace(self, tokens=tokens, updated_at=now), wait


@dataclass(frozen=True, slots=True)
class WatchStatus:
    """What a watch knows about its own freshness (`None` = never happened)."""

    index: int = 0
    delivered: int = 0
    last_success_at: float | None = None
    last_error: str | None = None
    last_error_at: float | None = None
    consecutive_errors: int = 0

    def is_stale(self, now: float, max_age_s: float) -> bool:
        """True when no fetch has succeeded within `max_age_s` (or ever)."""
        return self.last_success_at is None or now - self.last_success_at > max_age_s


class BlockingWatch(Generic[T]):
    def __init__(
        self,
        name: str,
        fetch: Fetch[T],
        *,
        wait_s: float = 300.0,
        rate_per_s: float = 4.0,
        burst: float = 2.0,
        backoff_base_s: float = 0.5,
        backoff_cap_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        rand: Callable[[], float] = random.random,
    ) -> None:
        self.name = name
        self._fetch = fetch
        self._wait_s = wait_s
        self._bucket = TokenBucket.full(rate_per_s, burst, clock())
        self._backoff_base_s = backoff_base_s
        self._backoff_cap_s = backoff_cap_s
        self._clock = clock
        self._rand = rand
        self._status = WatchStatus()

    @property
    def status(self) -> WatchStatus:
        return self._status

    def __aiter__(self) -> AsyncIterator[T]:
        return self._results()

    async def _results(self) -> AsyncGenerator[T, None]:
        index = 0
        delivered_index: int | None = None
        while True:
            self._bucket, delay = self._bucket.take(self._clock())
            if delay > 0:
                await asyncio.sleep(delay)
            try:
                returned, value = await self._fetch(index, self._wait_s)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                await self._failed(exc)
                continue
            following = next_index(index, returned)
            if returned < index:
                log.info(
                    "watch_index_reset",
                    extra={"watch": self.name, "previous": index, "returned": returned},
                )
            index = following
            self._status = replace(
                self._status,
                index=returned,
                last_success_at=self._clock(),
                consecutive_errors=0,
            )
            if delivered_index is not None and returned == delivered_index:
                continue
            delivered_index = returned
            self._status = replace(self._status, delivered=self._status.delivered + 1)
            yield value

    async def _failed(self, exc: Exception) -> None:
        failures = self._status.consecutive_errors + 1
        self._status = replace(
            self._status,
            last_error=f"{type(exc).__name__}: {exc}",
            last_error_at=self._clock(),
            consecutive_errors=failures,
        )
        delay = backoff_delay_s(
            failures, base_s=self._backoff_base_s, cap_s=self._backoff_cap_s, jitter=self._rand()
        )
        retryable = isinstance(exc, HashiError) and exc.retryable
        log.log(
            logging.WARNING if retryable else logging.ERROR,
            "watch_fetch_failed",
            extra={"watch": self.name, "failures": failures, "retry_in_s": round(delay, 3)},
            exc_info=not isinstance(exc, HashiError),
        )
        await asyncio.sleep(delay)

    async def run(self, deliver: Callable[[T], Awaitable[None]]) -> NoReturn:
        """Call `deliver` with each new result until cancelled."""
        async with contextlib.aclosing(self._results()) as results:
            async for value in results:
                await deliver(value)
        raise AssertionError("a watch never ends")  # pragma: no cover
