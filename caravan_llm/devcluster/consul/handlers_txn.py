"""PUT /v1/txn: several KV operations applied atomically, as Consul's transaction endpoint.

What Consul does (agent/txn_endpoint.go, agent/consul/txn_endpoint.go,
agent/consul/state/txn.go), and so what this does:

1. The body is a JSON list of operations `{"KV": {"Verb", "Key", "Value"
   (base64), "Flags", "Index", "Session"}}`. A body over the size limit or with
   more than 64 operations is 413; a body that does not decode is 400
   `Failed to parse body: ...`; a value over the KV limit is 413.
2. Every operation is checked against the token first (writes need
   `key:write`, `check-index` and friends `key:read`; gets are filtered on
   the way out). A failed check is an entry in `Errors`, answered 409.
3. The operations then run in order, each seeing the ones before it; all
   errors are collected, and if there is any, nothing is applied and the
   answer is 409 `{"Results": null, "Errors": [{"OpIndex", "What"}]}`.
4. Otherwise every write carries the same raft index (one log entry),
   blocking queries wake once, and the answer is 200 with one result per
   operation that has one (writes and checks: the entry without its value;
   gets: with it; deletes: none).

A transaction with no write goes Consul's read path: `?stale`/`?consistent`
are accepted, and the body also carries the query metadata fields.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from caravan_llm.devcluster.consul.decode import DecodeError, Field, Kind, StructSpec, decode_struct
from caravan_llm.devcluster.consul.http_api import HttpError, Reply, RequestContext, Route
from caravan_llm.devcluster.consul.kv import MAX_VALUE_BYTES, KVStore
from caravan_llm.devcluster.consul.records import KVEntry
from caravan_llm.devcluster.consul.render import kv_json

# Consul's maxTxnOps, and its txn_max_req_len default (the suggested raft entry size).
MAX_TXN_OPS = 64
MAX_TXN_BYTES = 512 * 1024

WRITE_VERBS = frozenset({"set", "cas", "delete", "delete-cas", "delete-tree", "lock", "unlock"})
READ_CHECK_VERBS = frozenset({"check-index", "check-session"})
GET_VERBS = frozenset({"get", "get-tree"})

KV_OP = StructSpec(
    "KVTxnOp",
    (
        Field("Verb", Kind.STRING),
        Field("Key", Kind.STRING),
        Field("Value", Kind.STRING),
        Field("Flags", Kind.UINT),
        Field("Index", Kind.UINT),
        Field("Session", Kind.STRING),
        Field("Namespace", Kind.STRING),
        Field("Partition", Kind.STRING),
    ),
)
TXN_OP = StructSpec(
    "TxnOp",
    (
        Field("KV", Kind.STRUCT, struct=KV_OP),
        # Catalog and session operations decode, but devcluster does not emulate them.
        Field("Node", Kind.ANY),
        Field("Service", Kind.ANY),
        Field("Check", Kind.ANY),
        Field("Session", Kind.ANY),
    ),
)


@dataclass(frozen=True, slots=True)
class KVOp:
    verb: str
    key: str
    value: bytes
    flags: int
    index: int
    session: str


@dataclass(frozen=True, slots=True)
class UnsupportedOp:
    """A catalog or session operation: valid for Consul, not emulated here."""

    kind: str


Op = KVOp | UnsupportedOp


@dataclass(frozen=True, slots=True)
class TxnError:
    op_index: int
    what: str


class OpFailedError(Exception):
    """One operation did not apply; `str()` is Consul's `What` text."""


def _too_large() -> HttpError:
    return HttpError(413, f"Request body too large, max size: {MAX_TXN_BYTES} bytes")


def _decode_value(raw: str | None) -> bytes:
    if raw is None:
        return b""
    try:
        return base64.b64decode(raw, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise DecodeError(f"illegal base64 data at input byte {len(raw)}") from exc


def decode_ops(body: bytes) -> list[Op]:
    """The operations of a /v1/txn body, decoded like Consul's `api.TxnOps` (pure)."""
    text = body.decode("utf-8", errors="replace")
    if not text.strip():
        raise DecodeError("EOF")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DecodeError(f"invalid character looking for beginning of value: {exc.msg}") from exc
    if data is None:
        return []
    if not isinstance(data, list):
        kind = "object" if isinstance(data, dict) else type(data).__name__
        raise DecodeError(f"json: cannot unmarshal {kind} into Go value of type api.TxnOps")
    ops: list[Op] = []
    for item in data:
        if item is None:
            continue
        if not isinstance(item, dict):
            raise DecodeError("json: cannot unmarshal into Go value of type api.TxnOp")
        decoded = decode_struct(item, TXN_OP)
        kv = decoded.get("KV")
        if kv is not None:
            ops.append(
                KVOp(
                    verb=kv.get("Verb", ""),
                    key=kv.get("Key", ""),
                    value=_decode_value(kv.get("Value")),
                    flags=kv.get("Flags", 0),
                    index=kv.get("Index", 0),
                    session=kv.get("Session", ""),
                )
            )
            continue
        kind = next((k for k in ("Node", "Service", "Check", "Session") if k in decoded), "")
        ops.append(UnsupportedOp(kind))
    return ops


def _permission(op: KVOp) -> str | None:
    if op.verb in GET_VERBS:
        return None  # filtered on the way out
    if op.verb in READ_CHECK_VERBS:
        return "key:read"
    return "key:write"


def pre_check(ops: list[Op], may: Callable[[str, str, bool], str | None]) -> list[TxnError]:
    """Consul's preCheck: a key for every op but delete-tree, and the token's permission.

    `may(permission, key, whole_prefix)` answers None or the refusal's text;
    `whole_prefix` is set for delete-tree, which needs write on the whole tree.
    """
    errors: list[TxnError] = []
    for position, op in enumerate(ops):
        if not isinstance(op, KVOp):
            continue
        if not op.key and op.verb != "delete-tree":
            errors.append(TxnError(position, "Must provide key"))
            continue
        permission = _permission(op)
        denied = may(permission, op.key, op.verb == "delete-tree") if permission else None
        if denied is not None:
            errors.append(TxnError(position, denied))
    return errors


def _without_value(entry: KVEntry) -> dict[str, Any]:
    out = kv_json(entry)
    out["Value"] = None
    return out


def _existing(kv: KVStore, key: str) -> KVEntry | None:
    return kv.get(key)[1]


def _apply_write(kv: KVStore, op: KVOp) -> list[dict[str, Any]]:
    existing = _existing(kv, op.key)
    if op.verb == "set":
        kv.set(op.key, op.value, op.flags)
    elif op.verb == "cas":
        if not kv.cas(op.key, op.value, op.flags, op.index):
            raise OpFailedError(f'failed to set key "{op.key}", index is stale')
    elif op.verb == "delete":
        kv.delete(op.key)
        return []
    elif op.verb == "delete-cas":
        # Consul: a key that is already gone counts as deleted, whatever the index.
        if existing is not None:
            if existing.modify_index != op.index:
                raise OpFailedError(f'failed to delete key "{op.key}", index is stale')
            kv.delete(op.key)
        return []
    elif op.verb == "delete-tree":
        kv.delete_tree(op.key)
        return []
    else:
        raise OpFailedError(f'devcluster: KV verb "{op.verb}" is not emulated in /v1/txn')
    written = _existing(kv, op.key)
    return [_without_value(written)] if written is not None else []


def _apply_read(kv: KVStore, op: KVOp) -> list[dict[str, Any]]:
    entry = _existing(kv, op.key)
    if op.verb == "get":
        if entry is None:
            raise OpFailedError(f'key "{op.key}" doesn\'t exist')
        return [kv_json(entry)]
    if op.verb == "get-or-empty":
        if entry is None:
            return [{"LockIndex": 0, "Key": op.key, "Flags": op.flags, "Value": None,
                     "CreateIndex": 0, "ModifyIndex": 0}]  # fmt: skip
        return [kv_json(entry)]
    if op.verb == "get-tree":
        return [kv_json(e) for e in kv.list_prefix(op.key)[1]]
    if op.verb == "check-index":
        if entry is None:
            raise OpFailedError(f'failed to check index, key "{op.key}" doesn\'t exist')
        if entry.modify_index != op.index:
            raise OpFailedError(
                f'failed index check for key "{op.key}", current modify index '
                f"{entry.modify_index} != {op.index}"
            )
        return [_without_value(entry)]
    if op.verb == "check-session":
        if entry is None:
            raise OpFailedError(f'failed to check session, key "{op.key}" doesn\'t exist')
        if (entry.session or "") != op.session:
            raise OpFailedError(
                f'failed session check for key "{op.key}", current session '
                f'"{entry.session or ""}" != "{op.session}"'
            )
        return [_without_value(entry)]
    if op.verb == "check-not-exists":
        if entry is not None:
            raise OpFailedError(f'key "{op.key}" exists')
        return []
    raise OpFailedError(f'unknown KV verb "{op.verb}"')


def _apply(kv: KVStore, op: Op) -> list[dict[str, Any]]:
    if isinstance(op, UnsupportedOp):
        raise OpFailedError(
            f"devcluster: {op.kind or 'non-KV'} operations are not emulated in /v1/txn"
        )
    return _apply_write(kv, op) if op.verb in WRITE_VERBS else _apply_read(kv, op)


def apply_ops(kv: KVStore, ops: list[Op]) -> tuple[list[dict[str, Any]], list[TxnError]]:
    """Run the ops in order on `kv`; on any error the caller rolls the store back."""
    results: list[dict[str, Any]] = []
    errors: list[TxnError] = []
    for position, op in enumerate(ops):
        try:
            results.extend(_apply(kv, op))
        except OpFailedError as exc:
            errors.append(TxnError(position, str(exc)))
    return results, errors


def _is_write(op: Op) -> bool:
    return isinstance(op, UnsupportedOp) or op.verb in WRITE_VERBS


def _errors_reply(errors: list[TxnError], extra: dict[str, Any]) -> Reply:
    return Reply(
        status=409,
        data={
            "Results": None,
            "Errors": [{"OpIndex": e.op_index, "What": e.what} for e in errors],
            **extra,
        },
    )


async def txn(context: RequestContext) -> Reply:
    length = context.request.content_length
    if length is not None and length > MAX_TXN_BYTES:
        raise _too_large()
    body = await context.request.read()
    if len(body) > MAX_TXN_BYTES:
        raise _too_large()
    try:
        ops = decode_ops(body)
    except DecodeError as exc:
        raise HttpError(400, f"Failed to parse body: {exc}") from exc
    if len(ops) > MAX_TXN_OPS:
        raise HttpError(
            413, f"Transaction contains too many operations ({len(ops)} > {MAX_TXN_OPS})"
        )
    for op in ops:
        if isinstance(op, KVOp) and len(op.value) > MAX_VALUE_BYTES:
            size = len(op.value)
            raise HttpError(
                413, f'Value for key "{op.key}" is too large ({size} > {MAX_VALUE_BYTES} bytes)'
            )
    writes = any(_is_write(op) for op in ops)
    extra: dict[str, Any] = {}
    if writes:
        context.check_datacenter()
    else:
        options = context.query_options()
        extra = {
            "Index": 0,
            "LastContact": 0,
            "KnownLeader": True,
            "ConsistencyLevel": options.consistency,
            "NotModified": False,
            "Backend": 0,
            "ResultsFilteredByACLs": False,
        }
    authz = context.authz()  # an unknown token is 403 `ACL not found` for the whole request

    def may(permission: str, key: str, whole_prefix: bool) -> str | None:
        try:
            if whole_prefix:
                context.require_write_prefix(key)
            else:
                context.require(permission, key)
        except HttpError as exc:
            return exc.text
        return None

    errors = pre_check(ops, may)
    if errors:
        return _errors_reply(errors, extra)
    state = context.state
    kv_checkpoint, raft_checkpoint = state.kv.checkpoint(), state.raft.checkpoint()
    with state.raft.one_entry():
        results, errors = apply_ops(state.kv, ops)
    if errors:
        state.kv.restore(kv_checkpoint)
        state.raft.restore(raft_checkpoint)
        return _errors_reply(errors, extra)
    if writes:
        state.raft.notify()
    # FilterTxnResults: gets are filtered by key:read, not refused.
    total = len(results)
    results = [r for r in results if authz.allows("key:read", str(r.get("Key", "")))]
    if not writes and context.token():
        # Consul resets the flag for anonymous requests.
        extra["ResultsFilteredByACLs"] = total != len(results)
    return Reply(data={"Results": [{"KV": r} for r in results], "Errors": None, **extra})


ROUTES = [Route("/v1/txn", ("PUT",), txn)]
