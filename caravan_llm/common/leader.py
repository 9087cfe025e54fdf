"""Leader election on a Consul session and a KV lock (`KVLayout.leader`).

    election = LeaderElection(consul, ElectionSettings(key=layout.leader, value=b"sched-1"))
    async with asyncio.TaskGroup() as tasks:
        tasks.create_task(election.run())
        await election.elected.wait()            # now the only writer

How it works: a session with a TTL (behavior `release`, a lock-delay) is
renewed every TTL/2; the contender `acquire`s the key with it. A follower
blocks on the key and tries again when the key has no holder (a refused
acquire while the key is free means the lock-delay is running: it retries
every `retry_interval_s`; facts C10). A leader blocks on the key as well and steps down
at once when the key shows another holder or no holder, when a renew says
the session is gone, or when no renew has succeeded for a whole TTL (the
session may be gone without us hearing). On cancellation it releases the
key and destroys the session, so a successor does not wait out the TTL.

Takeover time (facts C8-C10): after a clean shutdown the key is released
before the session is destroyed, so no lock-delay applies and a follower
takes the lock as soon as its blocking read returns. After a crash Consul
invalidates the session twice the TTL after its last renew (1.5 to 2 TTLs
after the crash, as renews come every TTL/2), and the key then stays
locked for the lock-delay: a follower leads within 2 x TTL + lock-delay
(+ one `retry_interval_s`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

from caravan_llm.common.consul_api import KVEntry, SessionInfo
from caravan_llm.common.errors import HashiError, HashiNotFound
from caravan_llm.common.watch import next_index

log = logging.getLogger(__name__)


class LeaderConsul(Protocol):
    """What the election needs from Consul (implemented by
    `caravan_llm.common.consul_api.ConsulClient`)."""

    async def session_create(
        self,
        *,
        name: str,
        ttl_s: float,
        behavior: Literal["release", "delete"] = "release",
        lock_delay_s: float = 15.0,
        node: str | None = None,
        node_checks: tuple[str, ...] | None = None,
    ) -> str: ...

    async def session_renew(self, session_id: str) -> SessionInfo: ...

    async def session_destroy(self, session_id: str) -> None: ...

    async def kv_get(
        self, key: str, *, index: int = 0, wait_s: float | None = None
    ) -> tuple[int, KVEntry | None]: ...

    async def kv_put(
        self,
        key: str,
        value: bytes | str,
        *,
        cas: int | None = None,
        flags: int | None = None,
        acquire: str | None = None,
        release: str | None = None,
    ) -> bool: ...


@dataclass(frozen=True, slots=True)
class ElectionSettings:
    key: str
    value: bytes = b""
    session_name: str = "caravan-leader"
    ttl_s: float = 15.0
    lock_delay_s: float = 15.0
    retry_interval_s: float = 1.0
    shutdown_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if self.ttl_s <= 0 or self.retry_interval_s <= 0 or self.lock_delay_s < 0:
            raise ValueError(
                "ElectionSettings needs ttl_s > 0, retry_interval_s > 0 and lock_delay_s >= 0"
            )


class LeaderElection:
    def __init__(
        self,
        consul: LeaderConsul,
        settings: ElectionSettings,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._consul = consul
        self.settings = settings
        self._clock = clock
        self.elected = asyncio.Event()  # set while leader
        self.deposed = asyncio.Event()  # set while not leader
        self.deposed.set()
        self._session_id: str | None = None
        self._last_renew_ok = 0.0
        self._renew_due = 0.0
        self._index = 0
        self._key_free_but_refused = False

    @property
    def is_leader(self) -> bool:
        return self.elected.is_set()

    @property
    def session_id(self) -> str | None:
        return self._session_id

    def _become_leader(self) -> None:
        if not self.is_leader:
            self.deposed.clear()
            self.elected.set()
            log.info("leadership_acquired", extra={"key": self.settings.key})

    def _step_down(self, reason: str, *, deliberate: bool = False) -> None:
        if self.is_leader:
            self.elected.clear()
            self.deposed.set()
            # Resigning on shutdown is routine; losing the lock is not.
            log.log(
                logging.INFO if deliberate else logging.WARNING,
                "leadership_released" if deliberate else "leadership_lost",
                extra={"key": self.settings.key, "reason": reason},
            )

    async def run(self) -> None:
        """Campaign (and hold leadership) until cancelled; then resign."""
        try:
            while True:
                try:
                    await self._step()
                except HashiError as exc:
                    log.warning(
                        "election_step_failed",
                        extra={"key": self.settings.key, "error": str(exc)},
                    )
                    self._check_renew_deadline()
                    await asyncio.sleep(self.settings.retry_interval_s)
        finally:
            await self._resign()

    def _check_renew_deadline(self) -> None:
        if (
            self._session_id is not None
            and self._clock() - self._last_renew_ok >= self.settings.ttl_s
        ):
            self._step_down("no successful renew for a whole TTL")

    async def _ensure_session(self) -> str:
        if self._session_id is None:
            self._session_id = await self._consul.session_create(
                name=self.settings.session_name,
                ttl_s=self.settings.ttl_s,
                behavior="release",
                lock_delay_s=self.settings.lock_delay_s,
            )
            self._last_renew_ok = self._clock()
            self._renew_due = self._last_renew_ok + self.settings.ttl_s / 2
            self._index = 0
        elif self._clock() >= self._renew_due:
            try:
                await self._consul.session_renew(self._session_id)
            except HashiNotFound:
                self._session_id = None
                self._step_down("session expired or destroyed")
                raise
            self._last_renew_ok = self._clock()
            self._renew_due = self._last_renew_ok + self.settings.ttl_s / 2
        return self._session_id

    async def _step(self) -> None:
        try:
            session_id = await self._ensure_session()
        except HashiNotFound:
            return
        wait_s = max(0.001, self._renew_due - self._clock())
        if self._key_free_but_refused:
            wait_s = min(wait_s, self.settings.retry_interval_s)
        returned, entry = await self._consul.kv_get(
            self.settings.key, index=self._index, wait_s=wait_s
        )
        self._index = next_index(self._index, returned)
        holder = entry.session if entry is not None else None
        if self.is_leader:
            if holder != session_id:
                self._step_down(
                    "the lock shows another holder" if holder else "the lock was released"
                )
            return
        if holder is None or holder == session_id:
            acquired = await self._consul.kv_put(
                self.settings.key, self.settings.value, acquire=session_id
            )
            self._key_free_but_refused = not acquired
            if acquired:
                self._become_leader()
        else:
            self._key_free_but_refused = False

    async def _resign(self) -> None:
        session_id, self._session_id = self._session_id, None
        was_leader = self.is_leader
        self._step_down("shutting down", deliberate=True)
        if session_id is None:
            return
        with contextlib.suppress(HashiError, TimeoutError):
            async with asyncio.timeout(self.settings.shutdown_timeout_s):
                if was_leader:
                    await self._consul.kv_put(
                        self.settings.key, self.settings.value, release=session_id
                    )
                await self._consul.session_destroy(session_id)
