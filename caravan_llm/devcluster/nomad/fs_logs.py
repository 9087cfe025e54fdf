"""`GET /v1/client/fs/logs/:alloc_id`: a task's stdout or stderr, as Nomad streams it.

Follows Nomad's HTTP agent (`command/agent/fs_endpoint.go` `Logs`) and the
RPCs behind it (`nomad/client_fs_endpoint.go`, `client/fs_endpoint.go`):

- Query parameters are checked first, each a 400 with Nomad's text: `task`
  (`must provide task name`), `follow` and `plain` (`failed to parse follow
  field to boolean: strconv.ParseBool: ...`), `type` stdout|stderr (`must
  provide log type (stdout/stderr)`), `offset` (`error parsing offset:
  strconv.ParseInt: ...`), `origin` start|end (`origin must be start or end`).
- Then the token (unknown: 403 `Permission denied`), the allocation by its
  full ID (404 `Unknown allocation "<id>"`), `read-logs` or `read-fs` in the
  allocation's namespace (403 `Permission denied`), the task (400 `unknown
  task name "<task>"`), whether it started (404 `task "<task>" not started
  yet. No logs available`), and its allocation directory on the node (404
  `state for allocation <id> not found on client`).
- The answer is 200, `application/json`: a stream of `StreamFrame` objects
  one after another (`{"Offset": N, "Data": "<base64>", "File":
  "alloc/logs/<task>.<type>.<index>"}`; `Offset` is where the frame's first
  read ended, as Nomad's framer sets it; empty fields left out), at most
  64 KiB of data each, and a heartbeat frame `{}` each second without data.
  With `plain=true` the bytes themselves, `text/plain`.
- Without `follow` the stream ends at the end of the newest log file; with
  it, it stays open and sends what the task writes until the client leaves.
- `origin=end` with `offset=N` starts N bytes before the end of the newest
  file (Nomad can step back across rotated files; devcluster's tasks write
  one file, `.0`, which it never rotates).
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web

from caravan_llm.devcluster.nomad.acl import PERMISSION_DENIED, Resolved, TokenNotFoundError

if TYPE_CHECKING:
    from caravan_llm.devcluster.nomad.server import NomadServer

LOGS_PATH = "/v1/client/fs/logs/"
FRAME_BYTES = 64 * 1024
HEARTBEAT_S = 1.0
POLL_S = 0.1
_LOG_FILE = re.compile(r"^(?P<task>.+)\.(?P<type>stdout|stderr)\.(?P<index>\d+)$")
GO_TRUE = frozenset({"1", "t", "T", "TRUE", "true", "True"})
GO_FALSE = frozenset({"0", "f", "F", "FALSE", "false", "False"})


class LogsError(Exception):
    def __init__(self, status: int, text: str) -> None:
        self.status = status
        self.text = text
        super().__init__(text)


def _go_bool(field: str, raw: str | None) -> bool:
    if raw is None or raw == "":
        return False
    if raw in GO_TRUE:
        return True
    if raw in GO_FALSE:
        return False
    raise LogsError(
        400,
        f"failed to parse {field} field to boolean: strconv.ParseBool: "
        f"parsing {json.dumps(raw)}: invalid syntax",
    )


def _go_int(raw: str) -> int:
    if re.fullmatch(r"[+-]?\d+", raw) is None:
        raise LogsError(
            400,
            f"error parsing offset: strconv.ParseInt: parsing {json.dumps(raw)}: invalid syntax",
        )
    return int(raw)


def parse_logs_query(query: Any) -> tuple[str, str, bool, bool, int, str]:
    """(task, type, follow, plain, offset, origin) in Nomad's order of checks; LogsError else."""
    task = query.get("task") or ""
    if not task:
        raise LogsError(400, "must provide task name")
    follow = _go_bool("follow", query.get("follow"))
    plain = _go_bool("plain", query.get("plain"))
    log_type = query.get("type") or ""
    if log_type not in {"stdout", "stderr"}:
        raise LogsError(400, "must provide log type (stdout/stderr)")
    raw_offset = query.get("offset") or ""
    offset = _go_int(raw_offset) if raw_offset else 0
    origin = query.get("origin") or "start"
    if origin not in {"start", "end"}:
        raise LogsError(400, "origin must be start or end")
    return task, log_type, follow, plain, offset, origin


def log_files(logs_dir: Path, task: str, log_type: str) -> list[tuple[int, Path]]:
    """The task's log files of that type, oldest first."""
    found: list[tuple[int, Path]] = []
    if not logs_dir.is_dir():
        return found
    for path in logs_dir.iterdir():
        match = _LOG_FILE.match(path.name)
        if match and match["task"] == task and match["type"] == log_type:
            found.append((int(match["index"]), path))
    return sorted(found)


def frame(file: str, data: bytes, offset: int) -> bytes:
    """One StreamFrame as Nomad's JSON codec writes it (empty fields left out)."""
    document: dict[str, Any] = {}
    if offset:
        document["Offset"] = offset
    if data:
        document["Data"] = base64.b64encode(data).decode()
    if file:
        document["File"] = file
    return json.dumps(document, separators=(",", ":")).encode()


def _alloc_dir(server: NomadServer, node_id: str, alloc_id: str) -> Path | None:
    client = server.clients.get(node_id)
    if client is None:
        return None
    directory = client.alloc_root / alloc_id
    return directory if directory.is_dir() else None


def _caller(request: web.Request, server: NomadServer) -> Resolved:
    """The token's ACL; an unknown token is a denial, as the RPC authenticates first."""
    secret = request.headers.get("X-Nomad-Token", "")
    bearer = request.headers.get("Authorization", "")
    if not secret and bearer.startswith("Bearer "):
        secret = bearer.removeprefix("Bearer ")
    try:
        return server.acl.resolve(secret)
    except TokenNotFoundError:
        raise LogsError(403, PERMISSION_DENIED) from None


def _read_chunk(path: Path, position: int) -> bytes:
    try:
        with path.open("rb") as handle:
            handle.seek(position)
            return handle.read(FRAME_BYTES)
    except FileNotFoundError:
        return b""


async def stream_logs(request: web.Request, server: NomadServer) -> web.StreamResponse:
    """The route's handler (`http_api` hands it the server)."""
    try:
        return await _stream(request, server)
    except LogsError as exc:
        return web.Response(text=exc.text, status=exc.status, content_type="text/plain")
    except ConnectionResetError:
        # The client left a followed stream (a heartbeat found out within a second).
        return web.Response(status=200)


async def _stream(request: web.Request, server: NomadServer) -> web.StreamResponse:
    alloc_id = request.path.removeprefix(LOGS_PATH)
    if not alloc_id:
        raise LogsError(400, "must provide a valid alloc id")
    task, log_type, follow, plain, offset, origin = parse_logs_query(request.query)
    caller = _caller(request, server)
    alloc = server.state.allocs.get(alloc_id)
    if alloc is None:
        raise LogsError(404, f"Unknown allocation {json.dumps(alloc_id)}")
    if not caller.acl.allow_namespace_op(alloc.namespace, "read-logs", "read-fs"):
        raise LogsError(403, PERMISSION_DENIED)
    state = alloc.task_states.get(task)
    if state is None:
        raise LogsError(400, f"unknown task name {json.dumps(task)}")
    if state.started_at_ns is None:
        raise LogsError(404, f"task {json.dumps(task)} not started yet. No logs available")
    directory = _alloc_dir(server, alloc.node_id, alloc.id)
    if directory is None:
        raise LogsError(404, f"state for allocation {alloc.id} not found on client")
    logs_dir = directory / "alloc" / "logs"
    files = log_files(logs_dir, task, log_type)
    response = web.StreamResponse(status=200)
    response.content_type = "text/plain" if plain else "application/json"
    await response.prepare(request)
    if not files:
        await response.write_eof()
        return response
    index, path = files[-1] if origin == "end" else files[0]
    size = path.stat().st_size
    position = max(size - abs(offset), 0) if origin == "end" else min(max(offset, 0), size)
    await _send_file(
        response,
        logs_dir,
        task,
        log_type,
        index=index,
        position=position,
        follow=follow,
        plain=plain,
    )
    await response.write_eof()
    return response


async def _send_file(
    response: web.StreamResponse,
    logs_dir: Path,
    task: str,
    log_type: str,
    *,
    index: int,
    position: int,
    follow: bool,
    plain: bool,
) -> None:
    """Send from `position` of file `index` on, moving to newer files as they appear."""
    loop = asyncio.get_running_loop()
    idle_since = loop.time()
    while True:
        path = logs_dir / f"{task}.{log_type}.{index}"
        data = _read_chunk(path, position)
        if data:
            position += len(data)
            name = f"alloc/logs/{path.name}"
            await response.write(data if plain else frame(name, data, position))
            idle_since = loop.time()
            continue
        newer = [i for i, _ in log_files(logs_dir, task, log_type) if i > index]
        if newer:
            index, position = newer[0], 0
            continue
        if not follow:
            return
        if not plain and loop.time() - idle_since >= HEARTBEAT_S:
            await response.write(b"{}")
            idle_since = loop.time()
        await asyncio.sleep(POLL_S)
