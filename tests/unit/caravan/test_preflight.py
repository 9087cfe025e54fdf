"""caravan_llm/common/preflight.py: a probe's answer says whether a grant is held; a fixed token
recovers."""

from __future__ import annotations

import logging

import pytest

from caravan_llm.common.errors import (
    HashiConflict,
    HashiNotFound,
    HashiPermissionDenied,
    HashiUnavailable,
)
from caravan_llm.common.preflight import Capability, Outcome, Preflight, PreflightResult, classify


class Switch:
    """A probe whose answer the test sets: an error to raise, or None to answer."""

    def __init__(self, error: Exception | None) -> None:
        self.error = error

    async def __call__(self) -> None:
        if self.error is not None:
            raise self.error


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (None, Outcome.GRANTED),
        (HashiNotFound("404"), Outcome.GRANTED),
        (HashiConflict("cas"), Outcome.GRANTED),
        (HashiPermissionDenied("403"), Outcome.REFUSED),
        (HashiUnavailable("down"), Outcome.UNKNOWN),
    ],
)
def test_a_refusal_is_missing_a_missing_object_or_lost_cas_is_granted(
    error: Exception | None, expected: str
) -> None:
    """Only a 403 means the grant is missing; an agent that did not answer is unknown."""
    assert expected == classify(error)


async def test_a_refused_grant_is_missing_until_the_token_is_fixed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The result names the refused grant; after a fix the next check passes, logging once each."""
    caplog.set_level(logging.INFO)
    probe = Switch(HashiPermissionDenied("403"))
    preflight = Preflight(
        "router",
        [
            Capability("nomad", "variables read on x/*", probe),
            Capability("consul", "kv", Switch(None)),
        ],
        clock=lambda: 5.0,
    )

    first = await preflight.check()
    again = await preflight.check()
    probe.error = None
    fixed = await preflight.check()

    assert PreflightResult(missing=("nomad: variables read on x/*",), checked_at=5.0) == first
    assert first == again
    assert PreflightResult(checked_at=5.0) == fixed
    assert ["preflight_failed", "preflight_passed"] == [r.getMessage() for r in caplog.records]


async def test_an_unreachable_agent_is_unchecked_not_missing() -> None:
    """A probe that could not reach its agent leaves the grant unchecked, /health unaffected."""
    preflight = Preflight(
        "scheduler", [Capability("nomad", "list-jobs", Switch(HashiUnavailable("x")))]
    )

    result = await preflight.check()

    assert ((), ("nomad: list-jobs",), True) == (result.missing, result.unchecked, result.ok)
