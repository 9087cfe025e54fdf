"""caravan_llm.common.leader against devcluster's Consul, and against a fake for an unreachable
Consul."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from caravan_llm.common.consul_api import ConsulClient, ConsulSettings, KVEntry, SessionInfo
from caravan_llm.common.contract import KVLayout
from caravan_llm.common.errors import HashiUnavailable
from caravan_llm.common.leader import ElectionSettings, LeaderElection
from caravan_llm.devcluster.consul.server import ConsulConfig, ConsulServer

KEY = KVLayout().leader


@pytest.fixture
async def consul_client() -> AsyncIterator[ConsulClient]:
    async with ConsulServer(ConsulConfig(session_ttl_min_s=1.0)) as server:
        settings = ConsulSettings(host=server.config.host, port=server.http_port)
        async with ConsulClient(settings) as client:
            yield client


def _settings(value: bytes, **overrides: float) -> ElectionSettings:
    options = {"ttl_s": 2.0, "lock_delay_s": 1.0, "retry_interval_s": 0.1}
    options.update(overrides)
    return ElectionSettings(key=KEY, value=value, **options)


async def _stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


class WatchingConsul:
    """The real client, noting when a contender blocks on the key (it has read it and lost)."""

    def __init__(self, consul: ConsulClient) -> None:
        self._consul = consul
        self.blocked_on_key = asyncio.Event()

    def __getattr__(self, name: str) -> object:
        return getattr(self._consul, name)

    async def kv_get(self, key: str, **options: object) -> tuple[int, KVEntry | None]:
        if options.get("index"):
            self.blocked_on_key.set()
        return await self._consul.kv_get(key, **options)


async def test_exactly_one_leader_and_handover_on_shutdown(consul_client: ConsulClient):
    """Of two contenders one leads; when it shuts down the other takes over without waiting."""
    first = LeaderElection(consul_client, _settings(b"first", lock_delay_s=15.0))
    watching = WatchingConsul(consul_client)
    second = LeaderElection(watching, _settings(b"second", lock_delay_s=15.0))
    first_task = asyncio.create_task(first.run())
    await asyncio.wait_for(first.elected.wait(), 2)
    second_task = asyncio.create_task(second.run())
    # A blocking read (index > 0) comes after the second's first look at the held key.
    await asyncio.wait_for(watching.blocked_on_key.wait(), 3)
    both_before = (first.is_leader, second.is_leader)
    stopped_at = time.monotonic()
    await _stop(first_task)
    await asyncio.wait_for(second.elected.wait(), 3)
    handover_s = time.monotonic() - stopped_at
    _, entry = await consul_client.kv_get(KEY)
    second_session = second.session_id
    await _stop(second_task)
    _, after_all = await consul_client.kv_get(KEY)
    assert (True, False) == both_before
    assert handover_s < 1.5  # released on shutdown, so no TTL or lock-delay wait
    assert entry is not None
    assert (b"second", second_session) == (entry.value, entry.session)
    assert after_all is not None
    assert after_all.session is None


async def test_leader_steps_down_at_once_when_its_session_is_destroyed(
    consul_client: ConsulClient,
):
    """Invalidating the leader's session ends leadership immediately, then it campaigns again."""
    election = LeaderElection(consul_client, _settings(b"me", lock_delay_s=0.5))
    task = asyncio.create_task(election.run())
    try:
        await asyncio.wait_for(election.elected.wait(), 2)
        old_session = election.session_id
        assert old_session is not None
        await consul_client.session_destroy(old_session)
        started = time.monotonic()
        await asyncio.wait_for(election.deposed.wait(), 1)
        lost_after_s = time.monotonic() - started
        await asyncio.wait_for(election.elected.wait(), 5)
        new_session = election.session_id
    finally:
        await _stop(task)
    assert lost_after_s < 0.3
    assert new_session not in (None, old_session)


async def test_leader_steps_down_when_the_key_shows_another_holder(consul_client: ConsulClient):
    """If the key is released behind the leader's back, it stops leading at once."""
    election = LeaderElection(consul_client, _settings(b"me"))
    task = asyncio.create_task(election.run())
    try:
        await asyncio.wait_for(election.elected.wait(), 2)
        await consul_client.kv_delete(KEY)
        await asyncio.wait_for(election.deposed.wait(), 1)
    finally:
        await _stop(task)


class UnreachableAfterElection:
    """A Consul that grants the lock, then stops answering renews and reads."""

    def __init__(self) -> None:
        self.reachable = True

    async def session_create(self, **_: object) -> str:
        return "session-1"

    async def session_renew(self, session_id: str) -> SessionInfo:
        if not self.reachable:
            raise HashiUnavailable("consul session.renew: connection refused")
        return SessionInfo(session_id, "", "n", 1.0, "release", 0.0, 1, 1)

    async def session_destroy(self, session_id: str) -> None:
        return None

    async def kv_get(
        self, key: str, *, index: int = 0, wait_s: float | None = None
    ) -> tuple[int, KVEntry | None]:
        if index and self.reachable:
            await asyncio.sleep(min(wait_s or 0.0, 0.05))
        if not self.reachable:
            raise HashiUnavailable("consul kv.get: connection refused")
        return 5, KVEntry(key, b"me", 0, "session-1", 1, 5, 5)

    async def kv_put(self, key: str, value: bytes | str, **_: object) -> bool:
        return True


async def test_leader_steps_down_after_a_ttl_without_renewals():
    """When Consul cannot be reached, the leader gives up once a whole TTL passed without renew."""
    consul = UnreachableAfterElection()
    election = LeaderElection(consul, _settings(b"me", ttl_s=1.0, lock_delay_s=0.0))
    task = asyncio.create_task(election.run())
    try:
        await asyncio.wait_for(election.elected.wait(), 1)
        consul.reachable = False
        cut_at = time.monotonic()
        await asyncio.wait_for(election.deposed.wait(), 3)
        lost_after_s = time.monotonic() - cut_at
    finally:
        await _stop(task)
    assert 0.4 <= lost_after_s < 1.6
