"""PUT /v1/txn against the Consul target: atomic KV transactions, their answers and errors."""

from __future__ import annotations

import asyncio
import base64
import json
from typing import Any

import pytest
from consul_helpers import REAL, Target, devcluster_config, raw_request

from caravan_llm.common.consul_api import ConsulClient, ConsulSettings, TxnCheckIndex, TxnSet
from caravan_llm.common.errors import HashiConflict, HashiPermissionDenied
from caravan_llm.devcluster.consul.server import ConsulServer


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def kv(verb: str, key: str, value: str | None = None, **fields: Any) -> dict[str, Any]:
    op: dict[str, Any] = {"Verb": verb, "Key": key, **fields}
    if value is not None:
        op["Value"] = _b64(value)
    return {"KV": op}


async def txn(target: Target, ops: Any, **kwargs: Any) -> tuple[int, Any, dict[str, str]]:
    body = ops if isinstance(ops, str) else json.dumps(ops)
    status, text, headers = await raw_request(target, "PUT", "/v1/txn", body=body, **kwargs)
    try:
        return status, json.loads(text), headers
    except ValueError:
        return status, text, headers


async def test_set_and_get_in_one_transaction(aio, target: Target, unique):
    """Writes are answered without their value, gets with it, all in operation order."""
    a, b = f"t/{unique}/a", f"t/{unique}/b"
    status, body, _ = await txn(target, [kv("set", a, "1"), kv("set", b, "2"), kv("get", a)])
    _, entry = await aio.kv.get(b)
    assert 200 == status
    assert None is body["Errors"]
    assert [a, b, a] == [r["KV"]["Key"] for r in body["Results"]]
    assert [None, None, _b64("1")] == [r["KV"]["Value"] for r in body["Results"]]
    assert b"2" == entry["Value"]


async def test_all_writes_of_a_transaction_share_one_index(target: Target, unique):
    """A transaction is one raft entry: every key it writes gets the same ModifyIndex."""
    keys = [f"t/{unique}/{n}" for n in "abc"]
    status, body, _ = await txn(target, [kv("set", k, k) for k in keys])
    indexes = {r["KV"]["ModifyIndex"] for r in body["Results"]}
    assert 200 == status
    assert 1 == len(indexes)


async def test_a_failed_operation_applies_nothing(aio, target: Target, unique):
    """A stale cas makes the whole transaction 409 with Errors naming the op; no key changed."""
    kept, new = f"t/{unique}/kept", f"t/{unique}/new"
    await aio.kv.put(kept, "old")
    _, before = await aio.kv.get(kept)
    stale = before["ModifyIndex"] - 1
    status, body, headers = await txn(
        target,
        [kv("set", new, "x"), kv("cas", kept, "changed", Index=stale), kv("delete", kept)],
    )
    _, after = await aio.kv.get(kept)
    _, created = await aio.kv.get(new)
    assert 409 == status
    assert headers["Content-Type"].startswith("application/json")
    assert None is body["Results"]
    assert [{"OpIndex": 1, "What": f'failed to set key "{kept}", index is stale'}] == body["Errors"]
    assert (b"old", before["ModifyIndex"]) == (after["Value"], after["ModifyIndex"])
    assert None is created


async def test_cas_zero_creates_only_and_delete_cas_needs_the_index(aio, target: Target, unique):
    """cas with Index 0 fails on an existing key; delete-cas with a stale index fails."""
    key = f"t/{unique}/k"
    await aio.kv.put(key, "v")
    _, entry = await aio.kv.get(key)
    create = await txn(target, [kv("cas", key, "again", Index=0)])
    stale_delete = await txn(target, [kv("delete-cas", key, Index=entry["ModifyIndex"] + 100)])
    delete = await txn(target, [kv("delete-cas", key, Index=entry["ModifyIndex"])])
    _, gone = await aio.kv.get(key)
    assert (409, f'failed to set key "{key}", index is stale') == (
        create[0],
        create[1]["Errors"][0]["What"],
    )
    assert (409, f'failed to delete key "{key}", index is stale') == (
        stale_delete[0],
        stale_delete[1]["Errors"][0]["What"],
    )
    assert 200 == delete[0]
    assert None is gone


async def test_delete_cas_of_a_missing_key_succeeds(target: Target, unique):
    """A key already gone counts as deleted, whatever the index (state store's kvsDeleteCAS)."""
    status, body, _ = await txn(target, [kv("delete-cas", f"t/{unique}/gone", Index=12345)])
    assert 200 == status
    assert None is body["Errors"]


async def test_check_index_guards_keys_not_written(aio, target: Target, unique):
    """check-index passes on the current index and fails, with Consul's text, on another."""
    guard, written = f"t/{unique}/guard", f"t/{unique}/written"
    await aio.kv.put(guard, "g")
    _, entry = await aio.kv.get(guard)
    index = entry["ModifyIndex"]
    ok = await txn(target, [kv("check-index", guard, Index=index), kv("set", written, "1")])
    await aio.kv.put(guard, "moved")
    _, moved = await aio.kv.get(guard)
    stale = await txn(target, [kv("check-index", guard, Index=index), kv("set", written, "2")])
    missing = await txn(target, [kv("check-index", f"t/{unique}/none", Index=1)])
    _, value = await aio.kv.get(written)
    assert 200 == ok[0]
    assert 409 == stale[0]
    assert (
        f'failed index check for key "{guard}", current modify index {moved["ModifyIndex"]} '
        f"!= {index}"
    ) == stale[1]["Errors"][0]["What"]
    assert (
        f'failed to check index, key "t/{unique}/none" doesn\'t exist'
        == (missing[1]["Errors"][0]["What"])
    )
    assert b"1" == value["Value"]


async def test_get_of_a_missing_key_is_an_error(target: Target, unique):
    """A get of a key that does not exist fails the transaction (409), as in Consul."""
    status, body, _ = await txn(target, [kv("get", f"t/{unique}/missing")])
    assert 409 == status
    assert [{"OpIndex": 0, "What": f'key "t/{unique}/missing" doesn\'t exist'}] == body["Errors"]


async def test_every_failed_operation_is_reported(target: Target, unique):
    """All failing operations are listed, each with its OpIndex."""
    ops = [kv("get", f"t/{unique}/x"), kv("set", f"t/{unique}/ok", "1"), kv("get", f"t/{unique}/y")]
    status, body, _ = await txn(target, ops)
    assert 409 == status
    assert [0, 2] == [e["OpIndex"] for e in body["Errors"]]


async def test_a_write_wakes_blocking_queries(aio, target: Target, unique):
    """A blocking read of a prefix returns once a transaction writes under it."""
    prefix = f"t/{unique}/watch/"
    await aio.kv.put(prefix + "seed", "0")
    index, _ = await aio.kv.get(prefix, recurse=True)
    waiter = asyncio.create_task(aio.kv.get(prefix, recurse=True, index=index, wait="30s"))
    await asyncio.sleep(0)
    status, _, _ = await txn(target, [kv("set", prefix + "a", "1"), kv("set", prefix + "b", "2")])
    new_index, entries = await asyncio.wait_for(waiter, timeout=10)
    assert 200 == status
    assert int(new_index) > int(index)
    assert [prefix + "a", prefix + "b", prefix + "seed"] == [e["Key"] for e in entries]


@pytest.mark.parametrize(
    ("body", "status", "text"),
    [
        ("{not json", 400, "Failed to parse body: "),
        ('{"KV": {}}', 400, "Failed to parse body: "),
        ('[{"KV": {"Verb": "set", "Key": "k", "Value": "%%%"}}]', 400, "Failed to parse body: "),
        ('[{"KV": {"Verb": "set", "Key": "k", "Bogus": 1}}]', 400, "Failed to parse body: "),
    ],
    ids=["syntax", "object-not-list", "bad-base64", "unknown-field"],
)
async def test_malformed_bodies_are_400(target: Target, body, status, text):
    """A body that does not decode into a list of operations is 400 `Failed to parse body`."""
    got_status, got_body, _ = await txn(target, body)
    assert status == got_status
    assert str(got_body).startswith(text)


async def test_more_than_64_operations_is_413(target: Target, unique):
    """Consul caps a transaction at 64 operations."""
    ops = [kv("set", f"t/{unique}/{n}", "v") for n in range(65)]
    status, body, _ = await txn(target, ops)
    assert 413 == status
    assert "Transaction contains too many operations (65 > 64)" == body


async def test_only_put_is_allowed(target: Target):
    """/v1/txn answers PUT only."""
    status, _, headers = await raw_request(target, "GET", "/v1/txn")
    assert 405 == status
    assert "PUT" in headers["Allow"]


async def test_caravan_client_txn_typed_ops_and_conflict(target: Target, unique):
    """caravan's ConsulClient.txn returns typed results, and a lost check is HashiConflict."""
    settings = ConsulSettings(host=target.host, port=target.port)
    key, guard = f"t/{unique}/typed", f"t/{unique}/guard"
    async with ConsulClient(settings) as consul:
        await consul.kv_put(guard, "g")
        _, entry = await consul.kv_get(guard)
        assert entry is not None
        results = await consul.txn([TxnSet(key, b"v"), TxnCheckIndex(guard, entry.modify_index)])
        with pytest.raises(HashiConflict) as conflict:
            await consul.txn([TxnSet(key, b"w"), TxnCheckIndex(guard, entry.modify_index + 7)])
        _, after = await consul.kv_get(key)
    assert [key, guard] == [r.key for r in results]
    assert conflict.value.retryable
    assert 1 == conflict.value.errors[0].op_index
    assert after is not None
    assert b"v" == after.value


TOKEN = "devcluster-test-management-token"


async def test_acl_is_checked_per_operation(unique):
    """Without a token every write op is refused in Errors (409) and nothing applies."""
    if REAL:
        pytest.skip("needs an agent with ACLs enabled; the ACL tests run against devcluster only")
    async with ConsulServer(devcluster_config(management_token=TOKEN)) as server:
        target = Target(server.config.host, server.http_port, server.dns_port, server, 1.0)
        key = f"t/{unique}/acl"
        anonymous = await txn(target, [kv("set", key, "v")])
        unknown = await txn(target, [kv("set", key, "v")], headers={"X-Consul-Token": "nope"})
        allowed = await txn(target, [kv("set", key, "v")], headers={"X-Consul-Token": TOKEN})
        settings = ConsulSettings(host=target.host, port=target.port)
        async with ConsulClient(settings) as consul:
            with pytest.raises(HashiPermissionDenied):
                await consul.txn([TxnSet(key, b"x")])
    assert 409 == anonymous[0]
    assert anonymous[1]["Errors"][0]["What"].startswith("Permission denied")
    assert "key:write" in anonymous[1]["Errors"][0]["What"]
    assert (403, "ACL not found") == (unknown[0], unknown[1])
    assert 200 == allowed[0]
