"""`caravan submit | list | status | delete | scale`: manage models.

By default these talk to Consul KV and Nomad directly (found through
`CONSUL_HTTP_ADDR`, `NOMAD_ADDR` and friends); with `--scheduler URL` (or
`CARAVAN_SCHEDULER_ADDR`) they go through a scheduler's HTTP API instead,
sending `CARAVAN_API_TOKEN` as a bearer token when it is set. Both paths run
the same `ModelService` code and print the same output.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Protocol

import aiohttp

from caravan.contract import KVLayout
from caravan.errors import HashiError, HashiPermissionDenied
from scheduler.app import scheduler_clients
from scheduler.cluster_config import ClusterConfigError, load_cluster_config
from scheduler.model_service import ModelService, SubmissionRejectedError
from scheduler.model_store import (
    DEFAULT_OVERRIDE_S,
    MAX_OVERRIDE_S,
    ModelStore,
    ScaleOutOfBoundsError,
    UnknownModelError,
    WriteConflictError,
    hold_seconds,
)
from scheduler.profiles import ProfileError
from scheduler.status import InvalidStoredProfileError, StatusReader


class CommandError(Exception):
    """A failure to report on stderr as one line, with exit code 1."""


class RemoteRejectedError(CommandError):
    """The scheduler refused a submission; `problems` are its `FILE: FIELD: MESSAGE` lines."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("\n".join(problems))


API_TOKEN_ENV = "CARAVAN_API_TOKEN"  # noqa: S105 - a variable name, not a secret
# What an HTTP header value may hold (RFC 9110 field-vchar); anything else is a paste error.
_HEADER_SAFE = re.compile(r"[\x21-\x7e]+")


def api_token_header(token: str | None) -> dict[str, str]:
    """The Authorization header for CARAVAN_API_TOKEN (none when unset or empty)."""
    if token is None or not token.strip():
        return {}
    token = token.strip()
    if not _HEADER_SAFE.fullmatch(token):
        raise CommandError(
            f"{API_TOKEN_ENV} holds spaces or control characters; set it to the token alone"
        )
    return {"Authorization": f"Bearer {token}"}


def add_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--scheduler",
        default=os.environ.get("CARAVAN_SCHEDULER_ADDR"),
        metavar="URL",
        help="go through a scheduler's HTTP API instead of Consul and Nomad directly",
    )
    common.add_argument(
        "--kv-prefix",
        default=os.environ.get("CARAVAN_KV_PREFIX", "caravan/"),
        help="Consul KV prefix (default caravan/)",
    )
    common.add_argument("--config", help="cluster config YAML used to validate profiles")
    common.add_argument("--json", action="store_true", help="print JSON instead of a table")

    submit = subparsers.add_parser(
        "submit", parents=[common], help="validate profiles and submit them"
    )
    submit.add_argument("files", nargs="+", metavar="FILE")
    submit.add_argument("--wait", action="store_true", help="wait until the replicas are ready")
    submit.add_argument("--timeout", type=float, default=600.0, help="--wait limit in seconds")
    submit.set_defaults(handler=_runner(_submit))

    listing = subparsers.add_parser("list", parents=[common], help="list models")
    listing.set_defaults(handler=_runner(_list))

    status = subparsers.add_parser("status", parents=[common], help="show one model in detail")
    status.add_argument("name")
    status.set_defaults(handler=_runner(_status))

    delete = subparsers.add_parser("delete", parents=[common], help="remove a model")
    delete.add_argument("name")
    delete.set_defaults(handler=_runner(_delete))

    scale = subparsers.add_parser(
        "scale",
        parents=[common],
        help="set a model's replica count (held against its autoscaler)",
        description=(
            "Set a model's desired replica count. On an autoscaled model the count is an "
            "override the autoscaler does not change: it holds for --for (default "
            f"{_duration_words(DEFAULT_OVERRIDE_S)}) or until `caravan scale NAME --auto`."
        ),
    )
    scale.add_argument("name")
    scale.add_argument("replicas", type=int, nargs="?", help="the replica count")
    scale.add_argument(
        "--for",
        dest="hold",
        metavar="DURATION",
        help=(
            "autoscaled models: hold the count this long, like 90s, 30m, 2h, 1h30m or 1d "
            f"(default {_duration_words(DEFAULT_OVERRIDE_S)}, at most "
            f"{_duration_words(MAX_OVERRIDE_S)})"
        ),
    )
    scale.add_argument(
        "--auto",
        action="store_true",
        help="end a hold: the autoscaler decides the count again",
    )
    scale.set_defaults(handler=_runner(_scale))


class Models(Protocol):
    """The model operations, whichever way they are reached."""

    async def submit(self, documents: list[tuple[str, str]]) -> list[str]: ...
    async def list(self) -> list[dict[str, Any]]: ...
    async def describe(self, name: str) -> dict[str, Any]: ...
    async def delete(self, name: str) -> None: ...
    async def scale(self, name: str, count: int, hold_s: float | None) -> float | None:
        """Set the count; returns how long it is held against the autoscaler (None: not)."""
        ...

    async def release(self, name: str) -> None: ...


class DirectModels:
    """Through Consul and Nomad, with the same ModelService the scheduler API uses."""

    def __init__(self, service: ModelService) -> None:
        self.service = service

    async def submit(self, documents: list[tuple[str, str]]) -> list[str]:
        return [p.name for p in await self.service.submit(documents)]

    async def list(self) -> list[dict[str, Any]]:
        return [m.to_json() for m in await self.service.list()]

    async def describe(self, name: str) -> dict[str, Any]:
        return (await self.service.describe(name)).to_json()

    async def delete(self, name: str) -> None:
        await self.service.delete(name)

    async def scale(self, name: str, count: int, hold_s: float | None) -> float | None:
        profile = await self.service.scale(name, count, hold_s=hold_s)
        return hold_seconds(profile, hold_s)

    async def release(self, name: str) -> None:
        await self.service.release(name)


class RemoteModels:
    """Through a scheduler's HTTP API."""

    def __init__(
        self, session: aiohttp.ClientSession, base_url: str, *, token_set: bool = False
    ) -> None:
        self.session = session
        self.base_url = base_url.rstrip("/")
        self.token_set = token_set

    async def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            async with self.session.request(method, self.base_url + path, **kwargs) as response:
                # A refusal may come from a proxy in front, with a body that is not JSON.
                refused = response.status in {401, 403}
                body = None if refused else await response.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise CommandError(f"scheduler at {self.base_url} unreachable: {exc}") from None
        if response.status == 401:
            if not self.token_set:
                raise CommandError(
                    f"the scheduler at {self.base_url} needs a token: set {API_TOKEN_ENV}"
                )
            raise CommandError(
                f"the scheduler at {self.base_url} refused {API_TOKEN_ENV} as malformed"
            )
        if response.status == 403:
            raise CommandError(
                f"the scheduler at {self.base_url} refused {API_TOKEN_ENV}: "
                "it is not one of the scheduler's API tokens"
            )
        if response.status >= 400:
            error = body.get("error", {}) if isinstance(body, dict) else {}
            problems = [str(p) for p in error.get("problems") or []]
            if problems:
                raise RemoteRejectedError(problems)
            raise CommandError(str(error.get("message") or body))
        return body

    async def submit(self, documents: list[tuple[str, str]]) -> list[str]:
        # One request for the whole set, so the scheduler validates all of it
        # and writes all of it in one transaction, or none.
        payload = {"documents": [{"source": source, "text": text} for source, text in documents]}
        body = await self._call("POST", "/v1/models", json=payload)
        return [str(name) for name in body["submitted"]]

    async def list(self) -> list[dict[str, Any]]:
        body = await self._call("GET", "/v1/models")
        return list(body["models"])

    async def describe(self, name: str) -> dict[str, Any]:
        body: dict[str, Any] = await self._call("GET", f"/v1/models/{name}")
        return body

    async def delete(self, name: str) -> None:
        await self._call("DELETE", f"/v1/models/{name}")

    async def scale(self, name: str, count: int, hold_s: float | None) -> float | None:
        payload: dict[str, Any] = {"replicas": count}
        if hold_s is not None:
            payload["hold_s"] = hold_s
        body = await self._call("POST", f"/v1/models/{name}/scale", json=payload)
        held = body.get("hold_s") if isinstance(body, dict) else None
        return float(held) if isinstance(held, int | float) else None

    async def release(self, name: str) -> None:
        await self._call("POST", f"/v1/models/{name}/scale", json={"auto": True})


@asynccontextmanager
async def _models(args: argparse.Namespace) -> AsyncIterator[Models]:
    config = load_cluster_config(args.config)
    if args.scheduler:
        headers = api_token_header(os.environ.get(API_TOKEN_ENV))
        base_url = args.scheduler if "://" in args.scheduler else f"http://{args.scheduler}"
        async with aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=30), headers=headers
        ) as session:
            yield RemoteModels(session, base_url, token_set=bool(headers))
        return
    async with scheduler_clients(os.environ) as (consul, nomad):
        store = ModelStore(consul, KVLayout(args.kv_prefix))
        service = ModelService(
            store=store,
            status=StatusReader(store=store, nomad=nomad, health=consul, config=config),
            config=config,
        )
        yield DirectModels(service)


Command = Callable[[argparse.Namespace, Models], Coroutine[Any, Any, int]]


def _runner(command: Command) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        async def main() -> int:
            async with _models(args) as models:
                return await command(args, models)

        try:
            return asyncio.run(main())
        except (SubmissionRejectedError, RemoteRejectedError) as exc:
            for problem in exc.problems:
                print(problem, file=sys.stderr)
            print("nothing was submitted", file=sys.stderr)
        except (
            CommandError,
            UnknownModelError,
            InvalidStoredProfileError,
            ScaleOutOfBoundsError,
            ClusterConfigError,
            WriteConflictError,
            ProfileError,
        ) as exc:
            print(f"error: {exc}", file=sys.stderr)
        except HashiPermissionDenied as exc:
            print(f"error: {exc} (check CONSUL_HTTP_TOKEN and NOMAD_TOKEN)", file=sys.stderr)
        except HashiError as exc:
            print(f"error: {exc}", file=sys.stderr)
            if exc.retryable:
                print(
                    "hint: check NOMAD_ADDR / CONSUL_HTTP_ADDR and that both answer",
                    file=sys.stderr,
                )
        return 1

    return run


def _read_documents(files: list[str]) -> list[tuple[str, str]]:
    documents = []
    for path in files:
        try:
            raw = Path(path).read_bytes()
        except OSError as exc:
            raise CommandError(f"{path}: cannot read file: {exc.strerror or exc}") from None
        try:
            documents.append((path, raw.decode("utf-8")))
        except UnicodeDecodeError as exc:
            # The profile codec's own words (caravan.contract.decode_profile_document).
            problem = f"not UTF-8 text (byte {raw[exc.start]:#04x} at offset {exc.start})"
            raise CommandError(f"{path}: {problem}") from None
    return documents


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )


def _hold_and_failure(model: dict[str, Any]) -> str:
    """What `caravan list` adds to the status: the hold and its expiry, the failure."""
    words = ""
    override = model.get("override")
    if override:
        words += f"; held at {override['count']} until {_when(float(override['until']))}"
    failure = model.get("failure")
    if failure and model.get("status") != "failed":
        words += "; failed"
    if failure:
        words += f": {failure['reason']}"
    return words


def format_list(models: list[dict[str, Any]]) -> str:
    if not models:
        return "no models (submit one with `caravan submit PROFILE.yaml`)"
    rows = [["NAME", "ENGINE", "GPU", "READY/DESIRED", "STATUS"]]
    for m in models:
        status = m["status"] if not m.get("problem") else f"{m['status']}: {m['problem']}"
        status += _hold_and_failure(m)
        rows.append([m["name"], m["engine"], m["gpu"], f"{m['ready']}/{m['desired']}", status])
    return _table(rows)


def format_status(model: dict[str, Any], now: float) -> str:
    header = (
        f"{model['name']} ({model['engine']}, served as {model['served_model_name']}, "
        f"{model['gpu']}): {model['ready']}/{model['desired']} ready, {model['status']}; "
        f"replicas {model['min']}..{model['max']}"
    )
    lines = [header]
    lines.extend(control_plane_lines(model))
    override = model.get("override")
    if override:
        lines.append(
            f"held at {override['count']} by `caravan scale` until "
            f"{_when(float(override['until']))} ({_age(float(override['until']) - now)} left); "
            f"`caravan scale {model['name']} --auto` hands it back to the autoscaler"
        )
    failure = model.get("failure")
    if failure:
        lines.append(
            f"failed {_age(now - float(failure['since']))} ago: {failure['reason']}; "
            "requests get 503 until a change (new profile, `caravan scale`, a passing replica)"
        )
    replicas = model.get("replicas") or []
    if replicas:
        rows = [["REPLICA", "JOB", "ALLOC", "NODE", "STATE", "HEALTH", "SINCE", "LAST EVENT"]]
        rows.extend(
            [
                str(r["replica"]),
                r["job_id"] + ("" if r["current"] else " (outdated)"),
                r.get("alloc_id") or "-",
                r.get("node") or "-",
                r["state"],
                r.get("health") or "-",
                _age(r.get("since_s")),
                r.get("last_event") or "-",
            ]
            for r in replicas
        )
        lines.append(_table(rows))
        lines.extend(
            f"  replica {r['replica']} pending: {r['pending_reason']}"
            for r in replicas
            if r.get("pending_reason")
        )
    else:
        lines.append("no replicas")
    if model.get("prefetch"):
        lines.append(f"prefetch: {model['prefetch']}")
    autoscaler = model.get("autoscaler") or {}
    signals = autoscaler.get("last_signals") or {}
    if signals:
        shown = ", ".join(
            f"{key}={'unknown' if value is None else round(value, 2)}"
            for key, value in sorted(signals.items())
        )
        lines.append(f"autoscaler signals: {shown}")
    if autoscaler.get("last_cold_start_s") is not None:
        lines.append(f"last cold start: {autoscaler['last_cold_start_s']}s from demand to ready")
    for key, label in (("last_decision", "last decision"), ("last_scale", "last scaling")):
        record = autoscaler.get(key)
        if record:
            lines.append(
                f"autoscaler {label} {_age(now - float(record['at']))} ago: "
                f"{record['direction']} to {record['target']}: {record['reason']}"
            )
    return "\n".join(lines)


def control_plane_lines(model: dict[str, Any]) -> list[str]:
    """The grants the schedulers' and routers' tokens lack (their preflights), one a line."""
    return [f"control plane: {problem}" for problem in model.get("control_plane") or ()]


def _emit(args: argparse.Namespace, document: Any, text: str) -> None:
    print(json.dumps(document, indent=2) if args.json else text)


async def _submit(args: argparse.Namespace, models: Models) -> int:
    documents = _read_documents(args.files)
    names = await models.submit(documents)
    for name in names:
        print(f"submitted {name}")
    if not args.wait:
        return 0
    return await _wait_ready(models, names, args.timeout)


async def _wait_ready(models: Models, names: list[str], timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    last: dict[str, str] = {}
    while True:
        done = True
        latest: dict[str, dict[str, Any]] = {}
        for name in names:
            model = await models.describe(name)
            latest[name] = model
            states = ", ".join(f"r{r['replica']} {r['state']}" for r in model["replicas"])
            line = f"{name}: {model['ready']}/{model['desired']} ready ({states or 'no replicas'})"
            if last.get(name) != line:
                print(line, flush=True)
                last[name] = line
            if model["status"] != "ready" or model["ready"] < model["desired"]:
                done = False
            failure = model.get("failure")
            if failure:
                # Waiting on longer cannot help: it takes a change (caravan status says which).
                print(f"{name} failed: {failure['reason']}", file=sys.stderr)
                return 1
        if done:
            print("all replicas ready")
            return 0
        if time.monotonic() > deadline:
            print(f"timed out after {timeout_s:.0f}s waiting for replicas:", file=sys.stderr)
            for name, model in latest.items():
                for line in control_plane_lines(model):
                    print(f"  {name}: {line}", file=sys.stderr)
                reasons = [r for r in model["replicas"] if r.get("pending_reason")]
                for replica in reasons:
                    print(
                        f"  {name} replica {replica['replica']}: {replica['pending_reason']}",
                        file=sys.stderr,
                    )
                if not model["replicas"]:
                    print(
                        f"  {name}: no replica job exists yet; is `caravan scheduler` running?",
                        file=sys.stderr,
                    )
            return 1
        await asyncio.sleep(1.0)


async def _list(args: argparse.Namespace, models: Models) -> int:
    found = await models.list()
    _emit(args, found, format_list(found))
    return 0


async def _status(args: argparse.Namespace, models: Models) -> int:
    model = await models.describe(args.name)
    _emit(args, model, format_status(model, time.time()))
    return 0


async def _delete(args: argparse.Namespace, models: Models) -> int:
    await models.delete(args.name)
    print(f"deleted {args.name}: its replicas drain and stop")
    return 0


_DURATION = re.compile(r"(?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?")
_UNIT_S = (86400, 3600, 60, 1)


def parse_duration(text: str) -> float:
    """`90s`, `30m`, `2h`, `1h30m`, `1d` in seconds; CommandError names the bad value."""
    match = _DURATION.fullmatch(text.strip())
    if not text.strip() or match is None or not any(match.groups()):
        raise CommandError(
            f"--for: {text!r} is not a duration (use a number with s, m, h or d: 90s, 30m, 1h30m)"
        )
    seconds = sum(int(part or 0) * unit for part, unit in zip(match.groups(), _UNIT_S, strict=True))
    if seconds <= 0:
        raise CommandError(f"--for: {text!r} must be longer than 0s")
    return float(seconds)


def _duration_words(seconds: float) -> str:
    whole = int(seconds)
    parts = []
    for unit, suffix in zip(_UNIT_S, "dhms", strict=True):
        if whole >= unit:
            parts.append(f"{whole // unit}{suffix}")
            whole %= unit
    return "".join(parts) or "0s"


def _when(at: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(at))


async def _scale(args: argparse.Namespace, models: Models) -> int:
    if args.auto:
        if args.replicas is not None or args.hold is not None:
            raise CommandError("--auto takes no replica count and no --for")
        await models.release(args.name)
        print(f"{args.name}: the autoscaler decides the count again")
        return 0
    if args.replicas is None:
        raise CommandError("give a replica count (caravan scale NAME N) or --auto")
    hold_s = parse_duration(args.hold) if args.hold is not None else None
    held = await models.scale(args.name, args.replicas, hold_s)
    print(f"scaled {args.name} to {args.replicas} replicas")
    if held is not None:
        print(
            f"held against the autoscaler for {_duration_words(held)} "
            f"(until about {_when(time.time() + held)}); "
            f"`caravan scale {args.name} --auto` ends it sooner"
        )
    return 0
