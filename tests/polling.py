"""Waiting in tests: poll a condition until it holds or a deadline passes (never a fixed sleep).

Importable from every test module (pytest puts this folder on `sys.path` for
tests/conftest.py): `from polling import eventually`.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import pytest

T = TypeVar("T")


async def eventually(
    check: Callable[[], Awaitable[T] | T],
    timeout_s: float,
    what: str,
    *,
    interval_s: float = 0.2,
) -> T:
    """`check()`'s first truthy answer (awaited when it is awaitable).

    Fails the test naming `what` and the last answer when none came in time.
    The one deadline loop of the suite: test support modules with their own
    names and defaults delegate here.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value  # type: ignore[return-value]
        if time.monotonic() >= deadline:
            pytest.fail(f"{what} not reached within {timeout_s}s (last: {_short(value)})")
        await asyncio.sleep(interval_s)


def _short(value: object, limit: int = 300) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
