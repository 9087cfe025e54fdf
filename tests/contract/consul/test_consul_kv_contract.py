"""KV, sessions, locks and leader election against the Consul target."""

from __future__ import annotations

import asyncio
import base64
import json
import time

import consul
import pytest
from consul_helpers import Target, eventually, raw_request

from caravan_llm.common.consul_api import ConsulClient, ConsulSettings
from caravan_llm.common.leader import ElectionSettings, LeaderElection


async def test_put_and_get_round_trip_with_flags(aio, target: Target, unique):
    """A value written with flags reads back; the raw JSON carries it base64-encoded."""
    key = f"t/{unique}/a"
    written = await aio.kv.put(key, "hello", flags=42)
    _, entry = await aio.kv.get(key)
    _, body, _ = await raw_request(target, "GET", f"/v1/kv/{key}")
    raw = json.loads(body)[0]
    assert written is True
    assert (b"hello", 42) == (entry["Value"], entry["Flags"])
    assert base64.b64encode(b"hello").decode() == raw["Value"]
    assert raw["CreateIndex"] == raw["ModifyIndex"]


async def test_sync_client_kv(sync_client, unique):
    """The sync client writes, reads and deletes keys."""
    key = f"t/{unique}/sync"
    await asyncio.to_thread(sync_client.kv.put, key, "v")
    _, entry = await asyncio.to_thread(sync_client.kv.get, key)
    await asyncio.to_thread(sync_client.kv.delete, key)
    _, gone = await asyncio.to_thread(sync_client.kv.get, key)
    assert b"v" == entry["Value"]
    assert gone is None


async def test_missing_key_is_404_with_an_index(target: Target, unique):
    """Reading a missing key is 404 with an empty body and an X-Consul-Index to block on."""
    status, body, headers = await raw_request(target, "GET", f"/v1/kv/t/{unique}/none")
    assert (404, "") == (status, body)
    assert int(headers["X-Consul-Index"]) >= 1


async def test_recurse_keys_separator_and_raw(aio, target: Target, unique):
    """recurse lists entries, keys+separator lists one level, raw returns the bare value."""
    prefix = f"t/{unique}/"
    for key in ("a", "b/c", "b/d"):
        await aio.kv.put(prefix + key, key)
    _, entries = await aio.kv.get(prefix, recurse=True)
    _, keys = await aio.kv.get(prefix, keys=True, separator="/")
    _, raw, headers = await raw_request(target, "GET", f"/v1/kv/{prefix}b/c?raw")
    assert [prefix + "a", prefix + "b/c", prefix + "b/d"] == [e["Key"] for e in entries]
    assert [prefix + "a", prefix + "b/"] == keys
    assert "b/c" == raw
    assert headers["Content-Type"].startswith("text/plain")


async def test_check_and_set(aio, unique):
    """cas=0 creates only; cas=<ModifyIndex> updates only if nobody wrote since."""
    key = f"t/{unique}/cas"
    created = await aio.kv.put(key, "1", cas=0)
    created_again = await aio.kv.put(key, "2", cas=0)
    _, entry = await aio.kv.get(key)
    updated = await aio.kv.put(key, "3", cas=entry["ModifyIndex"])
    stale = await aio.kv.put(key, "4", cas=entry["ModifyIndex"])
    _, final = await aio.kv.get(key)
    assert [True, False, True, False] == [created, created_again, updated, stale]
    assert b"3" == final["Value"]


async def test_delete_recurse_and_cas(aio, unique):
    """Delete with cas needs the current index; recurse deletes a whole prefix."""
    prefix = f"t/{unique}/del/"
    await aio.kv.put(prefix + "x", "1")
    await aio.kv.put(prefix + "y", "1")
    _, x = await aio.kv.get(prefix + "x")
    stale = await aio.kv.delete(prefix + "x", cas=x["ModifyIndex"] - 1)
    current = await aio.kv.delete(prefix + "x", cas=x["ModifyIndex"])
    # A key that is already gone counts as deleted, whatever the index.
    gone = await aio.kv.delete(prefix + "x", cas=x["ModifyIndex"] + 1000)
    await aio.kv.delete(prefix, recurse=True)
    _, left = await aio.kv.get(prefix, recurse=True)
    assert [False, True, True] == [stale, current, gone]
    assert left is None


async def test_blocking_get_wakes_on_create_and_on_delete(aio, unique):
    """A blocking read of a missing key wakes when it is created; a recurse read on delete."""
    key = f"t/{unique}/wake"
    index, missing = await aio.kv.get(key)

    reader = asyncio.create_task(aio.kv.get(key, index=index, wait="5s"))
    # Not a wait: with nothing written for 0.2 s the read must still be blocked.
    await asyncio.sleep(0.2)
    blocked = not reader.done()
    await aio.kv.put(key, "now")
    created_index, created = await reader
    assert blocked
    list_index, _ = await aio.kv.get(f"t/{unique}/", recurse=True)
    deleter = asyncio.create_task(aio.kv.delete(key))
    deleted_index, after = await aio.kv.get(
        f"t/{unique}/", recurse=True, index=list_index, wait="5s"
    )
    await deleter
    assert missing is None
    assert b"now" == created["Value"]
    assert int(created_index) > int(index)
    assert after is None
    assert int(deleted_index) > int(list_index)


async def test_session_lifecycle(aio, target: Target, unique):
    """Sessions can be created, read, listed per node, renewed and destroyed."""
    me = await aio.agent.self()
    node = me["Config"]["NodeName"]
    session_id = await aio.session.create(
        name=f"s-{unique}", ttl=int(max(10, target.session_ttl_s))
    )
    _, info = await aio.session.info(session_id)
    _, listed = await aio.session.list()
    _, on_node = await aio.session.node(node)
    renewed = await aio.session.renew(session_id)
    await aio.session.destroy(session_id)
    _, gone = await aio.session.info(session_id)
    with pytest.raises(consul.NotFound):
        await aio.session.renew(session_id)
    assert (f"s-{unique}", node, "release", 15_000_000_000) == (
        info["Name"],
        info["Node"],
        info["Behavior"],
        info["LockDelay"],
    )
    assert ["serfHealth"] == info["NodeChecks"]
    assert session_id in {s["ID"] for s in listed}
    assert session_id in {s["ID"] for s in on_node}
    assert session_id == renewed["ID"]
    assert gone is None


async def _session(target: Target, **body) -> str:
    status, text, _ = await raw_request(target, "PUT", "/v1/session/create", body=json.dumps(body))
    assert 200 == status, text
    return json.loads(text)["ID"]


async def test_acquire_and_release(aio, target: Target, unique):
    """acquire takes a free lock (LockIndex+1); others are refused; release frees it."""
    key = f"t/{unique}/lock"
    first = await _session(target, Name="a", LockDelay="0s")
    second = await _session(target, Name="b", LockDelay="0s")
    got = await aio.kv.put(key, "a", acquire=first)
    refused = await aio.kv.put(key, "b", acquire=second)
    _, held = await aio.kv.get(key)
    wrong_release = await aio.kv.put(key, "b", release=second)
    released = await aio.kv.put(key, "a", release=first)
    _, free = await aio.kv.get(key)
    taken = await aio.kv.put(key, "b", acquire=second)
    _, retaken = await aio.kv.get(key)
    assert [True, False, False, True, True] == [got, refused, wrong_release, released, taken]
    assert (first, 1) == (held["Session"], held["LockIndex"])
    assert "Session" not in free
    assert (second, 2) == (retaken["Session"], retaken["LockIndex"])


async def test_destroyed_session_releases_its_lock_and_lock_delay_applies(
    aio, target: Target, unique
):
    """Destroying a holder releases its keys; acquire is refused until the lock-delay ends."""
    key = f"t/{unique}/delay"
    holder = await _session(target, Name="holder", LockDelay="1s")
    other = await _session(target, Name="other", LockDelay="0s")
    await aio.kv.put(key, "h", acquire=holder)
    await aio.session.destroy(holder)
    destroyed_at = time.monotonic()
    _, released = await aio.kv.get(key)
    during_delay = await aio.kv.put(key, "o", acquire=other)
    after_delay = await eventually(lambda: aio.kv.put(key, "o", acquire=other), timeout_s=5)
    waited = time.monotonic() - destroyed_at
    assert "Session" not in released
    assert (False, True) == (during_delay, after_delay)
    # The 1 s lock-delay, counted from just after the destroy (margin for a loaded machine).
    assert waited >= 0.7


async def test_session_ttl_expiry_releases_or_deletes(aio, target: Target, unique):
    """An unrenewed TTL session is invalidated: `release` frees keys, `delete` removes them."""
    ttl = f"{int(target.session_ttl_s)}s"
    releasing = await _session(target, TTL=ttl, LockDelay="0s")
    deleting = await _session(target, TTL=ttl, LockDelay="0s", Behavior="delete")
    await aio.kv.put(f"t/{unique}/r", "x", acquire=releasing)
    await aio.kv.put(f"t/{unique}/d", "x", acquire=deleting)

    async def both_expired():
        _, one = await aio.session.info(releasing)
        _, two = await aio.session.info(deleting)
        return one is None and two is None

    await eventually(both_expired, timeout_s=2 * target.session_ttl_s + 2, every_s=0.1)
    _, kept = await aio.kv.get(f"t/{unique}/r")
    _, removed = await aio.kv.get(f"t/{unique}/d")
    assert "Session" not in kept
    assert removed is None


async def test_critical_check_invalidates_sessions_watching_it(aio, target: Target, unique):
    """A session tied to a service check is invalidated when that check goes critical."""
    name = f"sess-{unique}"
    await aio.agent.service.register(name, check={"TTL": "60s", "Status": "passing"})
    session_id = await _session(
        target, LockDelay="0s", NodeChecks=["serfHealth"], ServiceChecks=[{"ID": f"service:{name}"}]
    )
    _, alive = await aio.session.info(session_id)
    await aio.agent.check.ttl_fail(f"service:{name}")

    async def invalidated():
        _, info = await aio.session.info(session_id)
        return info is None

    assert alive is not None
    assert await eventually(invalidated, timeout_s=3)


async def test_leader_election_takes_over_when_the_holder_stops_renewing(
    aio, target: Target, unique
):
    """A contender becomes leader once the holder's session expires (it stopped renewing)."""
    key = f"t/{unique}/leader"
    ttl = target.session_ttl_s
    holder = await _session(target, TTL=f"{int(ttl)}s", LockDelay="500ms")
    assert await aio.kv.put(key, "old", acquire=holder)
    settings = ConsulSettings(host=target.host, port=target.port)
    async with ConsulClient(settings) as client:
        election = LeaderElection(
            client,
            ElectionSettings(
                key=key,
                value=b"new",
                ttl_s=max(ttl, 1.0),
                lock_delay_s=0.5,
                retry_interval_s=0.2,
            ),
        )
        started = time.monotonic()
        runner = asyncio.create_task(election.run())
        try:
            # Not a wait: while the old holder's session lives, nobody else may lead.
            await asyncio.sleep(0.3)
            was_leader_early = election.is_leader
            await asyncio.wait_for(election.elected.wait(), timeout=2 * ttl + 5)
            took = time.monotonic() - started
            _, entry = await aio.kv.get(key)
        finally:
            runner.cancel()
            await asyncio.gather(runner, return_exceptions=True)
    assert was_leader_early is False
    assert (b"new", election.session_id or entry["Session"]) == (entry["Value"], entry["Session"])
    assert took >= ttl * 0.9
