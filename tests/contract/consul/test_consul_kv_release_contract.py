"""`PUT /v1/kv/<key>?release=<session>` as Consul's kvsUnlockTxn answers it (issue 16, item 5).

Order of the rules: an empty session is 500 `missing session`; an absent key is
200 `false`; a session that does not hold the key (another one, an unknown one,
a destroyed one) is 200 `false` and writes nothing; the holder writes value
and flags, clears `Session` and keeps `LockIndex` and `CreateIndex`.
"""

from __future__ import annotations

import json
import uuid

from consul_helpers import Target, raw_request


async def _session(target: Target, **body: object) -> str:
    status, text, _ = await raw_request(target, "PUT", "/v1/session/create", body=json.dumps(body))
    assert 200 == status, text
    return str(json.loads(text)["ID"])


async def _locked_key(aio, target: Target, key: str) -> str:
    holder = await _session(target, Name="holder", LockDelay="0s")
    assert await aio.kv.put(key, "held", acquire=holder) is True
    return holder


async def test_release_of_an_absent_key_is_false_and_creates_nothing(aio, target: Target, unique):
    """Releasing a key that does not exist answers false and leaves it absent."""
    key = f"rel/{unique}/absent"
    session = await _session(target, Name="s", LockDelay="0s")
    released = await aio.kv.put(key, "x", release=session)
    _, entry = await aio.kv.get(key)
    assert (False, None) == (released, entry)


async def test_release_by_an_unknown_session_is_false_not_an_error(aio, target: Target, unique):
    """A session id nobody created is simply not the holder: 200 false, the lock stays."""
    key = f"rel/{unique}/unknown"
    holder = await _locked_key(aio, target, key)
    status, text, _ = await raw_request(
        target, "PUT", f"/v1/kv/{key}?release={uuid.uuid4()}", body="stolen"
    )
    _, entry = await aio.kv.get(key)
    assert (200, False) == (status, json.loads(text))
    assert (holder, b"held") == (entry["Session"], entry["Value"])


async def test_release_by_a_destroyed_session_is_false(aio, target: Target, unique):
    """A destroyed session that never held the key is not the holder either."""
    key = f"rel/{unique}/destroyed"
    holder = await _locked_key(aio, target, key)
    gone = await _session(target, Name="gone", LockDelay="0s")
    await aio.session.destroy(gone)
    released = await aio.kv.put(key, "stolen", release=gone)
    _, entry = await aio.kv.get(key)
    assert released is False
    assert (holder, b"held") == (entry["Session"], entry["Value"])


async def test_release_by_another_session_writes_nothing(aio, target: Target, unique):
    """Another live session's release is false and leaves value, flags and indexes alone."""
    key = f"rel/{unique}/other"
    await _locked_key(aio, target, key)
    _, before = await aio.kv.get(key)
    other = await _session(target, Name="other", LockDelay="0s")
    released = await aio.kv.put(key, "stolen", flags=7, release=other)
    _, after = await aio.kv.get(key)
    assert released is False
    assert before == after


async def test_release_by_the_holder_writes_and_keeps_lock_and_create_index(
    aio, target: Target, unique
):
    """The holder's release writes value and flags, clears Session, keeps LockIndex/CreateIndex."""
    key = f"rel/{unique}/holder"
    holder = await _locked_key(aio, target, key)
    _, held = await aio.kv.get(key)
    released = await aio.kv.put(key, "done", flags=42, release=holder)
    _, free = await aio.kv.get(key)
    assert released is True
    assert "Session" not in free
    assert (b"done", 42) == (free["Value"], free["Flags"])
    assert (held["LockIndex"], held["CreateIndex"]) == (free["LockIndex"], free["CreateIndex"])
    assert free["ModifyIndex"] > held["ModifyIndex"]


async def test_release_with_an_empty_session_is_missing_session(target: Target, unique):
    """`?release=` with no session id is 500 `missing session`, before the key is looked at."""
    status, text, _ = await raw_request(target, "PUT", f"/v1/kv/rel/{unique}/x?release=", body="v")
    assert (500, "missing session") == (status, text.strip())


async def test_acquire_with_an_unknown_session_stays_invalid_session(target: Target, unique):
    """Acquire, unlike release, looks the session up: an unknown one is 500 `invalid session`."""
    session = str(uuid.uuid4())
    status, text, _ = await raw_request(
        target, "PUT", f"/v1/kv/rel/{unique}/y?acquire={session}", body="v"
    )
    assert (500, f'invalid session "{session}"') == (status, text.strip())
