"""/v1/kv/* and /v1/session/*: the KV store, locks and sessions."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlencode

from caravan_llm.devcluster.consul.decode import SESSION, DecodeError, decode_body
from caravan_llm.devcluster.consul.durations import format_go_duration_s, parse_go_duration_ns
from caravan_llm.devcluster.consul.http_api import HttpError, Reply, RequestContext, Route
from caravan_llm.devcluster.consul.kv import MAX_VALUE_BYTES, key_problem
from caravan_llm.devcluster.consul.records import SERF_CHECK_ID, KVEntry, SessionBehavior
from caravan_llm.devcluster.consul.render import kv_json, session_json
from caravan_llm.devcluster.consul.sessions import DEFAULT_LOCK_DELAY_S, SESSION_TTL_MAX_S
from caravan_llm.devcluster.consul.state import StateError

NANOS = 1_000_000_000
LOCK_DELAY_MIN_THRESHOLD_NS = 1000


def _conflicting(context: RequestContext, *flags: str) -> HttpError | None:
    present = [flag for flag in flags if context.has(flag)]
    if len(present) < 2:
        return None
    encoded = urlencode(sorted(context.request.query.items()))
    return HttpError(400, f"Conflicting flags: {encoded}\n")


def _parse_uint(raw: str) -> int:
    if not raw.isdigit():
        raise HttpError(500, f'strconv.ParseUint: parsing "{raw}": invalid syntax')
    return int(raw)


def _key(context: RequestContext) -> str:
    key = context.tail
    if key:
        problem = key_problem(key)
        if problem is not None:
            raise HttpError(400, problem)
    return key


async def kv_endpoint(context: RequestContext) -> Reply:
    key = _key(context)
    method = context.request.method
    if method == "GET":
        if context.has("keys"):
            return await _kv_keys(context, key)
        return await _kv_get(context, key)
    if method == "PUT":
        return await _kv_put(context, key)
    return await _kv_delete(context, key)


async def _kv_get(context: RequestContext, key: str) -> Reply:
    recurse = context.has("recurse")
    if not recurse and not key:
        raise HttpError(400, "Missing key name")
    options = context.query_options()
    if not recurse:
        context.require("key:read", key)
    kv = context.state.kv

    def compute() -> tuple[int, list[KVEntry]]:
        if recurse:
            # KVS.List without enable_key_list_policy: filtered by key:read per entry.
            index, entries = kv.list_prefix(key)
            return index, [e for e in entries if context.may("key:read", e.key)]
        index, entry = kv.get(key)
        return index, [entry] if entry is not None else []

    index, entries = await context.wait_for_index(options, compute)
    headers = context.api.meta_headers(index, options)
    if not entries:
        return Reply(status=404, empty=True, headers=headers)
    if context.has("raw") and not recurse:
        headers.update({"X-Content-Type-Options": "nosniff", "Content-Security-Policy": "sandbox"})
        return Reply(raw=entries[0].value, content_type="text/plain", headers=headers)
    return Reply(data=[kv_json(e) for e in entries], headers=headers)


async def _kv_keys(context: RequestContext, prefix: str) -> Reply:
    separator = context.get("separator") if context.has("separator") else context.get("seperator")
    options = context.query_options()
    kv = context.state.kv

    def compute() -> tuple[int, list[str]]:
        index, entries = kv.list_prefix(prefix)
        keys: list[str] = []
        for entry in entries:
            if not separator:
                keys.append(entry.key)
                continue
            after = entry.key[len(prefix) :]
            position = after.find(separator)
            cut = (
                entry.key if position < 0 else entry.key[: len(prefix) + position + len(separator)]
            )
            if cut not in keys:
                keys.append(cut)
        # KVS.ListKeys: the answer's keys (or separator-cut prefixes) filtered by key:read.
        return index, [k for k in keys if context.may("key:read", k)]

    index, keys = await context.wait_for_index(options, compute)
    headers = context.api.meta_headers(index, options)
    if not keys and prefix:
        return Reply(status=404, empty=True, headers=headers)
    return Reply(data=keys, headers=headers)


async def _kv_put(context: RequestContext, key: str) -> Reply:
    context.check_datacenter()
    if not key:
        raise HttpError(400, "Missing key name")
    conflict = _conflicting(context, "cas", "acquire", "release")
    if conflict is not None:
        raise conflict
    flags = _parse_uint(context.get("flags")) if context.has("flags") else 0
    cas = _parse_uint(context.get("cas")) if context.has("cas") else None
    length = context.request.content_length or 0
    if length > MAX_VALUE_BYTES:
        raise HttpError(
            413,
            f"Request body({length} bytes) too large, max size: {MAX_VALUE_BYTES} bytes. "
            "See https://developer.hashicorp.com/docs/agent/config/config-files#kv_max_value_size.",
        )
    value = await context.request.read()
    context.require("key:write", key)
    state = context.state
    try:
        if context.has("acquire"):
            applied = state.kv_lock(key, value, flags, context.get("acquire"))
        elif context.has("release"):
            applied = state.kv_unlock(key, value, flags, context.get("release"))
        elif cas is not None:
            applied = state.kv.cas(key, value, flags, cas)
            state.raft.notify()
        else:
            applied = state.kv.set(key, value, flags)
            state.raft.notify()
    except StateError as exc:
        raise HttpError(exc.status, str(exc)) from exc
    return Reply(data=applied)


async def _kv_delete(context: RequestContext, key: str) -> Reply:
    context.check_datacenter()
    conflict = _conflicting(context, "recurse", "cas")
    if conflict is not None:
        raise conflict
    recurse = context.has("recurse")
    if not recurse and not key:
        raise HttpError(400, "Missing key name")
    cas = _parse_uint(context.get("cas")) if context.has("cas") else None
    if recurse:
        context.require_write_prefix(key)
    else:
        context.require("key:write", key)
    kv = context.state.kv
    if recurse:
        applied = kv.delete_tree(key)
    elif cas is not None:
        applied = kv.delete_cas(key, cas)
    else:
        applied = kv.delete(key)
    context.state.raft.notify()
    return Reply(data=applied)


def _lock_delay_s(raw: Any) -> float:
    """Session.LockDelay: a Go duration or nanoseconds; values under 1000ns mean seconds."""
    if isinstance(raw, str):
        try:
            nanos = parse_go_duration_ns(raw)
        except ValueError as exc:
            raise HttpError(400, f"Request decode failed: {exc}") from exc
    elif isinstance(raw, (int, float)) and not isinstance(raw, bool):
        nanos = int(raw)
    else:
        raise HttpError(
            400,
            "Request decode failed: json: cannot unmarshal into Go struct field "
            "Session.LockDelay of type time.Duration",
        )
    if nanos < LOCK_DELAY_MIN_THRESHOLD_NS:
        nanos *= NANOS
    return nanos / NANOS


async def session_create(context: RequestContext) -> Reply:
    context.check_datacenter()
    agent = context.agent_node()
    body = await context.request.read()
    session: dict[str, Any] = {}
    if body:
        try:
            session = decode_body(body, SESSION, "structs.Session")
        except DecodeError as exc:
            raise HttpError(400, f"Request decode failed: {exc}") from exc
    lock_delay_s = _lock_delay_s(session["LockDelay"]) if "LockDelay" in session else None
    node = session.get("Node") or agent.name
    node_checks: list[str] = session.get("NodeChecks", [SERF_CHECK_ID])
    legacy: list[str] | None = session.get("Checks", [SERF_CHECK_ID])
    # fixupEmptySessionChecks: an explicit empty Checks means "no checks at all".
    if legacy is not None and len(legacy) == 0:
        node_checks, legacy = [], None
    elif legacy == [SERF_CHECK_ID] or not node_checks:
        legacy = None
    context.require("session:write", node)
    behavior_raw = session.get("Behavior", "") or SessionBehavior.RELEASE.value
    behavior = next((b for b in SessionBehavior if b.value == behavior_raw), None)
    if behavior is None:
        raise HttpError(500, f"Invalid Behavior setting '{behavior_raw}'")
    ttl = session.get("TTL", "")
    ttl_s = 0.0
    if ttl:
        try:
            ttl_ns = parse_go_duration_ns(ttl)
        except ValueError as exc:
            raise HttpError(500, f"Session TTL '{ttl}' invalid: {exc}") from exc
        ttl_s = ttl_ns / NANOS
        minimum = context.api.session_ttl_min_s
        if ttl_ns != 0 and (ttl_s < minimum or ttl_s > SESSION_TTL_MAX_S):
            raise HttpError(
                500,
                f"Invalid Session TTL '{ttl_ns}', must be between "
                f"[{format_go_duration_s(minimum)}={format_go_duration_s(SESSION_TTL_MAX_S)}]",
            )
    service_checks = tuple(c["ID"] for c in session.get("ServiceChecks", []) if c.get("ID"))
    try:
        record = context.state.create_session(
            name=session.get("Name", ""),
            node=node,
            lock_delay_s=DEFAULT_LOCK_DELAY_S if lock_delay_s is None else lock_delay_s,
            behavior=behavior,
            ttl=ttl,
            ttl_s=ttl_s,
            node_checks=tuple(node_checks),
            service_checks=service_checks,
            legacy_checks=tuple(legacy) if legacy else None,
        )
    except StateError as exc:
        raise HttpError(exc.status, str(exc)) from exc
    return Reply(data={"ID": record.session_id})


async def session_destroy(context: RequestContext) -> Reply:
    context.check_datacenter()
    session_id = context.tail
    if not session_id:
        raise HttpError(400, "Missing session")
    session = context.state.sessions.get(session_id)
    context.require("session:write", session.node if session else None)
    context.state.destroy_session(session_id)
    return Reply(data=True)


async def session_renew(context: RequestContext) -> Reply:
    context.query_options()
    session_id = context.tail
    if not session_id:
        raise HttpError(400, "Missing session")
    existing = context.state.sessions.get(session_id)
    context.require("session:write", existing.node if existing else None)
    renewed = context.state.sessions.renew(session_id, context.state.clock())
    if renewed is None:
        raise HttpError(404, f"Session id '{session_id}' not found")
    return Reply(data=[session_json(renewed)])


async def session_info(context: RequestContext) -> Reply:
    options = context.query_options()
    session_id = context.tail
    if not session_id:
        raise HttpError(400, "Missing session")
    sessions = context.state.sessions

    def compute() -> tuple[int, list[dict[str, Any]]]:
        record = sessions.get(session_id)
        if record is not None and not context.may("session:read", record.node):
            record = None
        return sessions.table_index(), [session_json(record)] if record else []

    return await context.block(options, compute)


async def session_list(context: RequestContext) -> Reply:
    options = context.query_options()
    sessions = context.state.sessions

    def compute() -> tuple[int, list[dict[str, Any]]]:
        records = [s for s in sessions.all() if context.may("session:read", s.node)]
        return sessions.table_index(), [session_json(r) for r in records]

    return await context.block(options, compute)


async def session_node(context: RequestContext) -> Reply:
    options = context.query_options()
    node = context.tail
    if not node:
        raise HttpError(400, "Missing node name")
    sessions = context.state.sessions

    def compute() -> tuple[int, list[dict[str, Any]]]:
        on_node = [s for s in sessions.all() if s.node == node]
        records = [s for s in on_node if context.may("session:read", s.node)]
        return sessions.table_index(), [session_json(r) for r in records]

    return await context.block(options, compute)


ROUTES = [
    Route("/v1/kv/", ("GET", "PUT", "DELETE"), kv_endpoint),
    Route("/v1/session/create", ("PUT",), session_create),
    Route("/v1/session/destroy/", ("PUT",), session_destroy),
    Route("/v1/session/renew/", ("PUT",), session_renew),
    Route("/v1/session/info/", ("GET",), session_info),
    Route("/v1/session/list", ("GET",), session_list),
    Route("/v1/session/node/", ("GET",), session_node),
]
