"""The agents' check runners, TTL/session expiry and the critical-service reaper.

`CheckRunners` keeps one task per HTTP or TCP check on every live node,
reconciled after each state change: new or changed checks start (after a
random stagger within one interval, as Consul does), removed ones stop, and
a failed node's checks stop until it recovers (its agent is down). Results
pass through Consul's success/failure thresholds before they are written.

`Housekeeping` wakes at the next TTL/session deadline (or on any change)
and runs the DeregisterCriticalServiceAfter reaper every reap interval.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass, replace
from urllib.parse import urlsplit

import aiohttp

from caravan_llm.devcluster.consul.records import CheckSpec, Status
from caravan_llm.devcluster.consul.state import ConsulState

log = logging.getLogger(__name__)

DEFAULT_CHECK_TIMEOUT_S = 10.0
USER_AGENT = "Consul Health Check"
ACCEPT = "text/plain, text/*, */*"


@dataclass(frozen=True, slots=True)
class Thresholds:
    """Consul's StatusHandler: consecutive results needed before a status is written."""

    success_before_passing: int = 0
    failures_before_warning: int = 0
    failures_before_critical: int = 0
    successes: int = 0
    failures: int = 0

    @classmethod
    def for_spec(cls, spec: CheckSpec) -> Thresholds:
        warning = spec.failures_before_warning or spec.failures_before_critical
        return cls(spec.success_before_passing, warning, spec.failures_before_critical)

    def observe(self, status: Status) -> tuple[Thresholds, Status | None]:
        """The next counters and the status to write now (None: keep the current one)."""
        if status in ("passing", "warning"):
            after = replace(self, successes=self.successes + 1, failures=0)
            if after.successes >= self.success_before_passing:
                return after, status
            return after, None
        after = replace(self, failures=self.failures + 1, successes=0)
        if after.failures >= self.failures_before_critical:
            return after, "critical"
        if after.failures >= self.failures_before_warning:
            return after, "warning"
        return after, None


def http_status_verdict(status_code: int) -> Status:
    """2xx is passing, 429 (Too Many Requests) is warning, anything else critical."""
    if 200 <= status_code < 300:
        return "passing"
    if status_code == 429:
        return "warning"
    return "critical"


def _go_method(method: str) -> str:
    return method[:1].upper() + method[1:].lower()


def check_timeout_s(spec: CheckSpec) -> float:
    return spec.timeout_s if spec.timeout_s > 0 else DEFAULT_CHECK_TIMEOUT_S


def _dial_error(address: str, exc: BaseException) -> str:
    if isinstance(exc, ConnectionRefusedError) or "refused" in str(exc).lower():
        return f"dial tcp {address}: connect: connection refused"
    if isinstance(exc, TimeoutError):
        return f"dial tcp {address}: i/o timeout"
    return f"dial tcp {address}: {exc}"


async def probe_http(session: aiohttp.ClientSession, spec: CheckSpec) -> tuple[Status, str]:
    method = (spec.method or "GET").upper()
    headers: list[tuple[str, str]] = [(k, v) for k, values in spec.header.items() for v in values]
    names = {k.lower() for k, _ in headers}
    if "user-agent" not in names:
        headers.append(("User-Agent", USER_AGENT))
    if "accept" not in names:
        headers.append(("Accept", ACCEPT))
    timeout = aiohttp.ClientTimeout(total=check_timeout_s(spec))
    prefix = f'{_go_method(method)} "{spec.http}"'
    try:
        async with session.request(
            method,
            spec.http,
            headers=headers,
            data=spec.body.encode() if spec.body else None,
            timeout=timeout,
            ssl=not spec.tls_skip_verify,
            allow_redirects=not spec.disable_redirects,
        ) as response:
            body = await response.content.read(spec.output_max_size)
            text = body.decode("utf-8", errors="replace")
            output = (
                f"HTTP {method} {spec.http}: {response.status} {response.reason or ''} "
                f"Output: {text}"
            )
            return http_status_verdict(response.status), output
    except TimeoutError:
        return "critical", (
            f"{prefix}: context deadline exceeded (Client.Timeout exceeded while awaiting headers)"
        )
    except aiohttp.ClientConnectorError as exc:
        parts = urlsplit(spec.http)
        address = f"{parts.hostname}:{parts.port or (443 if parts.scheme == 'https' else 80)}"
        return "critical", f"{prefix}: {_dial_error(address, exc.os_error)}"
    except (aiohttp.ClientError, OSError, ValueError) as exc:
        return "critical", f"{prefix}: {exc}"


async def probe_tcp(spec: CheckSpec) -> tuple[Status, str]:
    host, _, port = spec.tcp.rpartition(":")
    host = host.strip("[]")
    try:
        async with asyncio.timeout(check_timeout_s(spec)):
            _, writer = await asyncio.open_connection(host, int(port))
    except (OSError, TimeoutError, ValueError) as exc:
        return "critical", _dial_error(spec.tcp, exc)
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return "passing", f"TCP connect {spec.tcp}: Success"


class CheckRunners:
    """One probing task per HTTP/TCP check of each live node, kept in step with the state."""

    def __init__(self, state: ConsulState, *, rand: Callable[[], float] = random.random) -> None:
        self._state = state
        self._rand = rand
        self._tasks: dict[tuple[str, str], tuple[CheckSpec, asyncio.Task[None]]] = {}
        self._session: aiohttp.ClientSession | None = None

    def _desired(self) -> dict[tuple[str, str], CheckSpec]:
        desired: dict[tuple[str, str], CheckSpec] = {}
        for check in self._state.all_checks():
            if self._state.agent_down(check.node):
                continue
            if check.spec.check_type in ("http", "tcp") and check.spec.interval_s > 0:
                desired[(check.node, check.check_id)] = check.spec
        return desired

    def _sync(self) -> None:
        desired = self._desired()
        for key, (spec, task) in list(self._tasks.items()):
            if desired.get(key) != spec:
                task.cancel()
                del self._tasks[key]
        for key, spec in desired.items():
            if key not in self._tasks:
                task = asyncio.create_task(self._run(key[0], spec), name=f"check:{key[1]}")
                self._tasks[key] = (spec, task)

    async def run(self) -> None:
        # Consul's HTTP checks never reuse connections (DisableKeepAlives).
        connector = aiohttp.TCPConnector(force_close=True)
        async with aiohttp.ClientSession(connector=connector) as session:
            self._session = session
            try:
                while True:
                    changed = self._state.raft.changed
                    self._sync()
                    await changed.wait()
            finally:
                tasks = [task for _, task in self._tasks.values()]
                self._tasks.clear()
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

    async def _run(self, node: str, spec: CheckSpec) -> None:
        thresholds = Thresholds.for_spec(spec)
        await asyncio.sleep(self._rand() * spec.interval_s)
        while True:
            status, output = await self._probe(spec)
            thresholds, verdict = thresholds.observe(status)
            if verdict is not None:
                self._state.record_check_result(node, spec.check_id, verdict, output)
            await asyncio.sleep(spec.interval_s)

    async def _probe(self, spec: CheckSpec) -> tuple[Status, str]:
        if spec.check_type == "tcp":
            return await probe_tcp(spec)
        if self._session is None:  # pragma: no cover - run() sets it before any task starts
            raise RuntimeError("check runners are not running")
        return await probe_http(self._session, spec)


class Housekeeping:
    """TTL checks and sessions expire on time; critical services are reaped periodically."""

    def __init__(
        self,
        state: ConsulState,
        *,
        reap_interval_s: float,
        clock: Callable[[], float],
    ) -> None:
        self._state = state
        self._reap_interval_s = reap_interval_s
        self._clock = clock

    async def run(self) -> None:
        next_reap = self._clock() + self._reap_interval_s
        while True:
            changed = self._state.raft.changed
            now = self._clock()
            self._state.expire(now)
            if now >= next_reap:
                for node, service_id in self._state.reap_critical_services(now):
                    log.info("critical_service_reaped", extra={"node": node, "service": service_id})
                next_reap = now + self._reap_interval_s
            deadline = self._state.next_deadline()
            wake_at = next_reap if deadline is None else min(deadline, next_reap)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, wake_at - self._clock())):
                    await changed.wait()
