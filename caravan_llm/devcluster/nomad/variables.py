"""Nomad Variables: the store and the HTTP routes (`/v1/vars`, `/v1/var/<path>`).

Facts from Nomad's source (`command/agent/variable_endpoint.go`,
`nomad/structs/variables.go`, `nomad/variables_endpoint.go`,
`nomad/state/state_store_variables.go`, `acl/acl.go`):

* A variable is `Namespace, Path, CreateIndex, CreateTime, ModifyIndex,
  ModifyTime, Items` (a string map; `Lock` is omitted when unset). A list
  answers the metadata only, never `Items`, sorted by path.
* Paths match `^[a-zA-Z0-9-_~/]{1,128}$`; under `nomad/` only `nomad/jobs...`,
  `nomad/sentinel...` and `nomad/job-templates/<name>` are allowed. A write
  needs a non-empty `Items` of at most 64 KiB (keys plus values).
* `?cas=<index>` makes a write or delete conditional on `ModifyIndex`
  (0: only if absent). A lost race is HTTP 409 whose body is the stored
  variable (a zero value with only `Namespace` and `Path` when there is none).
  A delete answers 204 with no body.
* Every write takes the next raft index; reads block on the variables table.
* A workload (a task's template) may read `nomad/jobs`, `nomad/jobs/<job>`,
  `nomad/jobs/<job>/<group>` and `nomad/jobs/<job>/<group>/<task>` of its own
  namespace with no policy; other paths need an ACL policy.

With ACLs on, the HTTP middleware checks a variable's read, write and destroy
capabilities against the caller's policies (`caravan_llm.devcluster.nomad.acl`) and a
list keeps the paths the caller may list; workloads get the implicit paths
only. Locks (`?lock-acquire` and friends) are refused with 400.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from caravan_llm.devcluster.nomad.decode import (
    ANY,
    INT64,
    STRING,
    STRING_MAP,
    UINT64,
    DecodeError,
    Struct,
    decode_body,
)
from caravan_llm.devcluster.nomad.endpoints import ApiError
from caravan_llm.devcluster.nomad.gotext import NS_PER_S, parse_go_duration
from caravan_llm.devcluster.nomad.state import ClusterState

Json = dict[str, Any]

TABLE = "variables"
MAX_ITEMS_BYTES = 65536
MAX_BLOCKING_S = 300.0
JITTER_FRACTION = 16
LOCK_PARAMS = ("lock-acquire", "lock-release", "lock-renew")
_VALID_PATH = re.compile(r"^[a-zA-Z0-9\-_~/]{1,128}$")

VARIABLE_BODY = Struct(
    "VariableDecrypted",
    {
        "Namespace": STRING,
        "Path": STRING,
        "Lock": ANY,
        "CreateIndex": UINT64,
        "CreateTime": INT64,
        "ModifyIndex": UINT64,
        "ModifyTime": INT64,
        "Items": STRING_MAP,
    },
)


def validate_path(path: str) -> str | None:
    """`structs.ValidatePath`: the error text, or None for a valid path."""
    if not path:
        return "variable requires path"
    if not _VALID_PATH.match(path):
        return f"invalid path {json.dumps(path)}"
    parts = path.split("/")
    if parts[0] != "nomad":
        return None
    if len(parts) == 1:
        return (
            '"nomad" is a reserved top-level directory path, but you may write variables '
            'to "nomad/jobs", "nomad/job-templates", "nomad/sentinel", or below'
        )
    if parts[1] in {"jobs", "sentinel"}:
        return None
    if parts[1] == "job-templates" and len(parts) == 3:
        return None
    if parts[1] == "job-templates":
        return (
            '"nomad/job-templates" is a reserved directory path, but you may write variables '
            'at the level below it, for example, "nomad/job-templates/template-name"'
        )
    return (
        'only paths at "nomad/jobs" or "nomad/job-templates" and below are valid paths '
        'under the top-level "nomad" directory'
    )


def workload_may_read(path: str, *, job_id: str, group: str, task: str) -> bool:
    """Nomad's implicit workload access: the job's own `nomad/jobs/...` paths, exactly."""
    return path in {
        "nomad/jobs",
        f"nomad/jobs/{job_id}",
        f"nomad/jobs/{job_id}/{group}",
        f"nomad/jobs/{job_id}/{group}/{task}",
    }


@dataclass(frozen=True, slots=True)
class Variable:
    namespace: str
    path: str
    items: Mapping[str, str]
    create_index: int = 0
    create_time: int = 0
    modify_index: int = 0
    modify_time: int = 0

    def metadata(self) -> Json:
        return {
            "Namespace": self.namespace,
            "Path": self.path,
            "CreateIndex": self.create_index,
            "CreateTime": self.create_time,
            "ModifyIndex": self.modify_index,
            "ModifyTime": self.modify_time,
        }

    def to_api(self) -> Json:
        body = self.metadata()
        if self.items:  # `Items` is omitempty
            body["Items"] = dict(self.items)
        return body


class VariableConflict(Exception):
    """A check-and-set lost: `current` is what is stored (a zero value if nothing)."""

    def __init__(self, current: Variable) -> None:
        super().__init__(f"cas conflict on {current.path}")
        self.current = current


class VariableStore:
    """Variables of every namespace, indexed by the cluster's one raft index."""

    def __init__(self, state: ClusterState) -> None:
        self.state = state
        self._vars: dict[tuple[str, str], Variable] = {}
        state.table_index.setdefault(TABLE, 1)

    def index(self) -> int:
        return self.state.tables_index((TABLE,))

    def get(self, namespace: str, path: str) -> Variable | None:
        return self._vars.get((namespace, path))

    def list(self, namespace: str, prefix: str) -> list[Variable]:
        return [
            var
            for (ns, path), var in sorted(self._vars.items())
            if namespace in {"*", ns} and path.startswith(prefix)
        ]

    def _check_cas(self, namespace: str, path: str, cas: int | None) -> None:
        if cas is None:
            return
        existing = self._vars.get((namespace, path))
        if existing is None:
            if cas != 0:
                raise VariableConflict(Variable(namespace, path, {}))
            return
        if cas != existing.modify_index:
            raise VariableConflict(existing)

    def put(self, namespace: str, path: str, items: Mapping[str, str], cas: int | None) -> Variable:
        """Set (or check-and-set) a variable; validate with Nomad's texts first."""
        if namespace == "*":
            raise ApiError(400, 'can not target wildcard ("*")namespace')
        if sum(len(k) + len(v) for k, v in items.items()) > MAX_ITEMS_BYTES:
            raise ApiError(400, "variables are limited to 64KiB in total size")
        problem = validate_path(path)
        if problem is not None:
            raise ApiError(400, problem)
        self._check_cas(namespace, path, cas)
        existing = self._vars.get((namespace, path))
        now = self.state.clock_ns()

        def write(index: int) -> None:
            self._vars[(namespace, path)] = Variable(
                namespace=namespace,
                path=path,
                items=dict(items),
                create_index=existing.create_index if existing else index,
                create_time=existing.create_time if existing else now,
                modify_index=index,
                modify_time=now,
            )

        self.state.commit((TABLE,), write)
        return self._vars[(namespace, path)]

    def delete(self, namespace: str, path: str, cas: int | None) -> int:
        """Delete (or check-and-delete); returns the write's index."""
        self._check_cas(namespace, path, cas)
        return self.state.commit((TABLE,), lambda _index: self._vars.pop((namespace, path), None))


# -- HTTP -------------------------------------------------------------------


def _json(body: Any, *, index: int, status: int = 200) -> web.Response:
    headers = {
        # A conflict answers the stored variable's ModifyIndex: 0 when there is none.
        "X-Nomad-Index": str(index),
        "X-Nomad-KnownLeader": "true",
        "X-Nomad-LastContact": "0",
    }
    return web.Response(
        text=json.dumps(body), status=status, content_type="application/json", headers=headers
    )


def _namespace(request: web.Request) -> str:
    return request.query.get("namespace") or "default"


def _cas(request: web.Request) -> int | None:
    raw = request.query.get("cas")
    if not raw:
        return None
    if not raw.isdigit():
        raise ApiError(
            400, f'can not parse cas: strconv.ParseUint: parsing "{raw}": invalid syntax'
        )
    return int(raw)


async def _block(request: web.Request, store: VariableStore) -> int:
    raw_index = request.query.get("index")
    if raw_index is not None:
        if not raw_index.isdigit():
            raise ApiError(400, "Invalid index")
        wait_s = MAX_BLOCKING_S
        raw_wait = request.query.get("wait")
        if raw_wait is not None:
            try:
                wait_s = parse_go_duration(raw_wait) / NS_PER_S
            except ValueError:
                raise ApiError(400, "Invalid wait time") from None
        wait_s = min(max(wait_s, 0.0), MAX_BLOCKING_S)
        if int(raw_index) > 0 and wait_s > 0:
            wait_s += random.uniform(0, wait_s / JITTER_FRACTION)
            await store.state.wait_for_change((TABLE,), int(raw_index), wait_s)
    return max(store.index(), 1)


ListFilter = Callable[[web.Request, str, str], bool]


def variable_routes(
    store: VariableStore, *, may_list: ListFilter = lambda _r, _ns, _path: True
) -> list[web.RouteDef]:
    """The routes, for `app.router.add_routes`; a list keeps what `may_list` allows
    (the caller's ACL: Nomad filters lists, it does not refuse them)."""

    async def list_variables(request: web.Request) -> web.Response:
        if request.method != "GET":
            raise ApiError(405, "Invalid method")
        index = await _block(request, store)
        prefix = request.query.get("prefix", "")
        body = [
            var.metadata()
            for var in store.list(_namespace(request), prefix)
            if may_list(request, var.namespace, var.path)
        ]
        return _json(body, index=index)

    async def variable(request: web.Request) -> web.Response:
        path = request.match_info.get("path", "")
        if not path:
            raise ApiError(400, "missing variable path")
        namespace = _namespace(request)
        if request.method == "GET":
            index = await _block(request, store)
            found = store.get(namespace, path)
            if found is None:
                raise ApiError(404, "variable not found")
            return _json(found.to_api(), index=index)
        if request.method in {"PUT", "POST"}:
            return await _upsert(request, namespace, path)
        if request.method == "DELETE":
            try:
                index = store.delete(namespace, path, _cas(request))
            except VariableConflict as conflict:
                current = conflict.current
                return _json(current.to_api(), index=current.modify_index, status=409)
            return web.Response(status=204, headers={"X-Nomad-Index": str(index)})
        raise ApiError(400, "Invalid method")

    async def _upsert(request: web.Request, namespace: str, path: str) -> web.Response:
        if any(param in request.query for param in LOCK_PARAMS):
            raise ApiError(400, "variable locks are not supported by devcluster")
        try:
            decoded = decode_body(await request.read(), VARIABLE_BODY)
        except DecodeError as exc:
            raise ApiError(400, str(exc)) from None
        items: Mapping[str, str] = decoded.get("Items") or {}
        if not items:
            raise ApiError(400, "variable missing required Items object")
        target_namespace = str(decoded.get("Namespace") or namespace)
        try:
            written = store.put(target_namespace, path, items, _cas(request))
        except VariableConflict as conflict:
            current = conflict.current
            return _json(current.to_api(), index=current.modify_index, status=409)
        return _json(written.to_api(), index=written.modify_index)

    return [
        web.route("*", "/v1/vars", list_variables),
        web.route("*", "/v1/var/{path:.*}", variable),
    ]


VariableReader = Callable[[str, str], Variable | None]
