"""Waiting in tests: poll a condition until it holds or a deadline passes (never a fixed sleep).

Importable from every test module (pytest puts this folder on `sys.path` for
tests/conftest.py): `from polling import eventually`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import pytest

T = TypeVar("T")


async def eventually(
    check: Callable[[], Awaitable[T]], timeout_s: float, what: str, *, interval_s: float = 0.2
) -> T:
    """`check()`'s first truthy answer; fails the test naming `what` when none came in time."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = await check()
        if value:
            return value
        if time.monotonic() >= deadline:
            pytest.fail(f"{what} not reached within {timeout_s}s")
        await asyncio.sleep(interval_s)
