"""Waiting for a replacement replica, the pure part: when to hold, what to exclude, outcomes.

When the only replica of a model dies, a retry or a stream's continuation
finds no other endpoint: the balancer answers `all_excluded` (the request
already tried everything Consul lists). The scheduler and Nomad rebuild the
replica elsewhere (failure detection + reschedule + model load), so instead
of failing, the router holds the request like a cold start, up to the
cold-start deadline, and sends it to the replacement as soon as one passes.

1. `waits_for_replacement(error, mid_stream=)`: hold only when the failure
   says the replica is gone (connection refused or reset, a stream cut or
   gone silent). A live engine that answered (5xx) or is hung (no first
   byte within the timeout) fails as before: no replacement is coming.
2. `still_excluded(endpoints, exclude, live, since=)`: the endpoints the
   held request still avoids. One that Consul reports critical, or that
   left the catalog, is forgotten, so the same service (a task restarted in
   place keeps its Consul service id) is taken again once it passes. So is
   one that showed it is alive since the hold began (a request there
   succeeded, or the router scraped its metrics): its failure was passing
   (a connection the engine closed as the request went out), and no
   replacement is coming for a live replica. Found by the soak: a request
   that met such failures on both replicas of a model was held until the
   rebuild deadline (300 s) while both served everyone else.
3. `replacement_outcome(...)`: how a held request ended, for the metric.
"""

from __future__ import annotations

from enum import StrEnum
from typing import TYPE_CHECKING

from caravan_llm.router.core.endpoints import CheckStatus
from caravan_llm.router.core.errors import (
    UpstreamConnectError,
    UpstreamError,
    UpstreamFirstByteTimeout,
    UpstreamStatusError,
)

if TYPE_CHECKING:
    from collections.abc import Mapping

    from caravan_llm.router.core.endpoints import ModelEndpoints
    from caravan_llm.router.core.live_state import EndpointLiveState


class ReplacementOutcome(StrEnum):
    """How a request held for a replacement replica ended."""

    RESUMED = "resumed"  # the replacement took it and the whole answer reached the client
    TIMED_OUT = "timed_out"  # no replacement passed before the cold-start deadline
    FAILED = "failed"  # a replacement took it and failed too, or the request failed otherwise
    CLIENT_CLOSED = "client_closed"  # the client left while it was held or served


def waits_for_replacement(error: UpstreamError, *, mid_stream: bool) -> bool:
    """Whether this failure may wait for a replacement when no other endpoint is left.

    `mid_stream`: the failure cut a stream that had already reached the
    client (a continuation follows); otherwise it came before the first byte.
    """
    if isinstance(error, UpstreamStatusError | UpstreamFirstByteTimeout):
        # The engine answered, or is alive but hung: its replacement is not coming.
        return False
    if mid_stream:
        # Reset, EOF without [DONE], or silence past the idle timeout.
        return True
    return isinstance(error, UpstreamConnectError)


def still_excluded(
    endpoints: ModelEndpoints | None,
    exclude: frozenset[str],
    live: Mapping[str, EndpointLiveState] | None = None,
    *,
    since: float | None = None,
) -> frozenset[str]:
    """The tried endpoints a held request keeps avoiding.

    Those still listed, not critical, and (with `live` and `since`, when the
    hold began) not seen alive since: no request there succeeded and no
    scrape of its metrics came back after `since`.
    """
    if not exclude:
        return exclude
    if endpoints is None:
        return frozenset()
    kept = {
        endpoint.id
        for endpoint in endpoints.endpoints
        if endpoint.id in exclude
        and endpoint.status is not CheckStatus.CRITICAL
        and not _alive_since(None if live is None else live.get(endpoint.id), since)
    }
    return exclude if len(kept) == len(exclude) else frozenset(kept)


def _alive_since(state: EndpointLiveState | None, since: float | None) -> bool:
    if state is None or since is None:
        return False
    return any(
        at is not None and at > since for at in (state.last_success_at, state.load_scraped_at)
    )


def replacement_outcome(*, ok: bool, timed_out: bool, client_closed: bool) -> ReplacementOutcome:
    """The metric outcome of a held request from how the request ended."""
    if client_closed:
        return ReplacementOutcome.CLIENT_CLOSED
    if timed_out:
        return ReplacementOutcome.TIMED_OUT
    return ReplacementOutcome.RESUMED if ok else ReplacementOutcome.FAILED
