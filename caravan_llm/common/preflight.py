"""Preflight: does this process's token hold every capability it needs? Asked of the agents.

A scheduler or router with a token that lacks a grant used to look healthy
and fail later, one request at a time (a router answering every request
with 502 from the engines' 401; a scheduler logging 403 once a second).
A preflight asks at start, with one cheap probe per capability, and keeps
the answer where people look: the log (`preflight_failed` naming the
capability), `/health` (503, `"status": "misconfigured"`, `"missing": [...]`)
and, through the health check's output, `caravan status`.

A probe exercises the capability itself rather than reading the token's
policies (`GET /v1/acl/token/self`, `/v1/acl/policy/<name>`): a token may
lack the right to read its policies' rules, roles and workload identities
grant capabilities no single policy shows, and Nomad's and Consul's own
evaluation of globs and `deny` is the only authority. Probes touch nothing:

* a read of a path that does not exist: Nomad's `Variables.Read` and
  `Job.*` reads and Consul's `KVS.Get` check the ACL first, so a refusal is
  403 and a permitted read of a missing object is 404 or empty;
* a write with a check-and-set index no object has (`?cas=<huge>`): the ACL
  check comes first (403), then the CAS fails (Nomad 409, Consul `false`),
  so nothing is written.

With ACLs off every probe passes. An agent that cannot be reached leaves the
capability `unchecked` (not missing); the preflight is asked again every
`retry_s` until it passes, so a fixed token recovers without a restart, and
every `recheck_s` after that.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from caravan_llm.common.errors import (
    HashiConflict,
    HashiError,
    HashiNotFound,
    HashiPermissionDenied,
)

log = logging.getLogger(__name__)

# A check-and-set index no object will have: the write is refused by the CAS, never made.
IMPOSSIBLE_CAS_INDEX = 2**62
# The object name probes read or write; it never exists.
PROBE_NAME = "caravan-preflight-probe"
RETRY_S = 15.0
RECHECK_S = 600.0

Probe = Callable[[], Awaitable[object]]


@dataclass(frozen=True, slots=True)
class Capability:
    """One grant a component needs, named as an operator would write it in a policy."""

    system: str  # "nomad" or "consul"
    grant: str  # e.g. `variables read on nomad/jobs/caravan-engine-keys/models/*`
    probe: Probe = field(repr=False, compare=False)

    @property
    def name(self) -> str:
        return f"{self.system}: {self.grant}"


@dataclass(frozen=True, slots=True)
class PreflightResult:
    """What the last preflight found; `missing` and `unchecked` hold capability names."""

    missing: tuple[str, ...] = ()
    unchecked: tuple[str, ...] = ()
    checked_at: float | None = None

    @property
    def ok(self) -> bool:
        return not self.missing


class Outcome:
    """What one probe's answer means (pure: `classify`)."""

    GRANTED = "granted"
    REFUSED = "refused"
    UNKNOWN = "unknown"


def classify(error: BaseException | None) -> str:
    """A probe's outcome from the error it raised (None: it answered)."""
    match error:
        case None | HashiNotFound() | HashiConflict():
            return Outcome.GRANTED
        case HashiPermissionDenied():
            return Outcome.REFUSED
        case _:
            return Outcome.UNKNOWN


def summarise(outcomes: Sequence[tuple[str, str]], checked_at: float) -> PreflightResult:
    """The result of one round: (capability name, outcome) pairs in the order checked."""
    return PreflightResult(
        missing=tuple(name for name, outcome in outcomes if outcome == Outcome.REFUSED),
        unchecked=tuple(name for name, outcome in outcomes if outcome == Outcome.UNKNOWN),
        checked_at=checked_at,
    )


async def probe_once(capability: Capability) -> str:
    try:
        await capability.probe()
    except HashiError as exc:
        return classify(exc)
    return Outcome.GRANTED


class Preflight:
    """The capabilities of one component, checked at start and again until they pass."""

    def __init__(
        self,
        component: str,
        capabilities: Sequence[Capability],
        *,
        retry_s: float = RETRY_S,
        recheck_s: float = RECHECK_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.component = component
        self.capabilities = tuple(capabilities)
        self._retry_s = retry_s
        self._recheck_s = recheck_s
        self._clock = clock
        self.result = PreflightResult()
        self.checked = asyncio.Event()

    @property
    def missing(self) -> tuple[str, ...]:
        return self.result.missing

    async def check(self) -> PreflightResult:
        """One round of probes; logs what changed since the last round."""
        outcomes = [(c.name, await probe_once(c)) for c in self.capabilities]
        previous, self.result = self.result, summarise(outcomes, self._clock())
        self._log_change(previous, self.result)
        self.checked.set()
        return self.result

    def _log_change(self, previous: PreflightResult, current: PreflightResult) -> None:
        for name in current.missing:
            if name not in previous.missing:
                log.error(
                    "preflight_failed",
                    extra={
                        "component": self.component,
                        "capability": name,
                        "reason": "the token lacks this grant (HTTP 403 Permission denied); "
                        "fix the policy or the token, no restart needed",
                    },
                )
        for name in current.unchecked:
            if name not in previous.unchecked:
                log.warning(
                    "preflight_unchecked",
                    extra={
                        "component": self.component,
                        "capability": name,
                        "reason": "the agent did not answer; asked again shortly",
                    },
                )
        if previous.missing and not current.missing:
            log.info("preflight_passed", extra={"component": self.component})

    async def run(self) -> None:
        """Check until cancelled: every `retry_s` while anything is missing or unchecked."""
        while True:
            result = await self.check()
            settled = result.ok and not result.unchecked
            await asyncio.sleep(self._recheck_s if settled else self._retry_s)
