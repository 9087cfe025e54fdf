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
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Protocol

import aiohttp

from caravan_llm.cli.nomad_flags import add_nomad_flags, nomad_environ
from caravan_llm.cli.output import emit, fail, progress
from caravan_llm.cli.rollout import Outcome, Rollout, engine_stderr_lines, judge_rollout
from caravan_llm.common.contract import KVLayout
from caravan_llm.common.errors import HashiError, HashiPermissionDenied
from caravan_llm.scheduler.app import scheduler_clients
from caravan_llm.scheduler.cluster_config import ClusterConfigError, load_cluster_config
from caravan_llm.scheduler.engine_logs import EngineLogReader
from caravan_llm.scheduler.model_service import (
    ModelService,
    NothingToRevertError,
    SubmissionRejectedError,
    UnknownVersionError,
)
from caravan_llm.scheduler.model_store import (
    DEFAULT_OVERRIDE_S,
    MAX_OVERRIDE_S,
    ModelStore,
    ScaleOutOfBoundsError,
    UnknownModelError,
    WriteConflictError,
    hold_seconds,
)
from caravan_llm.scheduler.profiles import ProfileError
from caravan_llm.scheduler.status import InvalidStoredProfileError, StatusReader


class CommandError(Exception):
    """A failure to report as one line (or one JSON error document), with exit code 1.

    `kind` is the error's `type` in JSON, as the scheduler's API names its errors.
    """

    def __init__(self, message: str, *, kind: str = "error") -> None:
        self.kind = kind
        super().__init__(message)


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
    add_nomad_flags(common)

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

    plan = subparsers.add_parser(
        "plan",
        parents=[common],
        help="show what submitting profiles would change, without writing anything",
        description=(
            "A dry run of `caravan submit`, like `nomad job plan`: validate the profiles as a "
            "submission does, then show each replica job that would be created, updated "
            "(with the fields that change) or stopped. Nothing is written. Exit status: 0 "
            "when no job would change, 1 when some would, 255 on an error (an invalid "
            "profile included)."
        ),
    )
    plan.add_argument("files", nargs="+", metavar="FILE")
    plan.add_argument(
        "--verbose", action="store_true", help="also list the jobs that would not change"
    )
    plan.set_defaults(handler=_runner(_plan, error_code=PLAN_ERROR))

    history = subparsers.add_parser(
        "history",
        parents=[common],
        help="list the kept versions of a model's profile",
        description=(
            "List the kept versions of a model's profile, newest first, like `nomad job "
            "history`. Every caravan submission that changes a profile makes a new version; "
            "the newest 10 are kept. With --version, print that version's profile."
        ),
    )
    history.add_argument("name")
    history.add_argument("--version", type=int, help="print this version's profile")
    history.set_defaults(handler=_runner(_history))

    revert = subparsers.add_parser(
        "revert",
        parents=[common],
        help="submit an earlier version of a model's profile again",
        description=(
            "Submit a kept version of a model's profile again, like `nomad job revert`: it "
            "is validated as any submission (the cluster's current policy included) and "
            "becomes the newest version."
        ),
    )
    revert.add_argument("name")
    revert.add_argument("version", type=int, metavar="VERSION")
    revert.add_argument("--wait", action="store_true", help="wait until the replicas are ready")
    revert.add_argument("--timeout", type=float, default=600.0, help="--wait limit in seconds")
    revert.set_defaults(handler=_runner(_revert))


class Models(Protocol):
    """The model operations, whichever way they are reached."""

    async def submit(self, documents: list[tuple[str, str]]) -> dict[str, int | None]:
        """Submit all or none; returns each model's version (None: the scheduler did not say)."""
        ...

    async def list(self) -> list[dict[str, Any]]: ...
    async def describe(self, name: str) -> dict[str, Any]: ...
    async def delete(self, name: str) -> None: ...
    async def scale(self, name: str, count: int, hold_s: float | None) -> float | None:
        """Set the count; returns how long it is held against the autoscaler (None: not)."""
        ...

    async def release(self, name: str) -> None: ...
    async def history(self, name: str) -> dict[str, Any]: ...
    async def revert(self, name: str, version: int) -> int:
        """Submit a kept version again; returns the new version."""
        ...

    async def plan(self, documents: Sequence[tuple[str, str]]) -> dict[str, Any]: ...


class DirectModels:
    """Through Consul and Nomad, with the same ModelService the scheduler API uses."""

    def __init__(self, service: ModelService) -> None:
        self.service = service

    async def submit(self, documents: list[tuple[str, str]]) -> dict[str, int | None]:
        submitted = await self.service.submit_versioned(documents)
        return {s.profile.name: s.version for s in submitted}

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

    async def history(self, name: str) -> dict[str, Any]:
        return (await self.service.history(name)).to_json()

    async def revert(self, name: str, version: int) -> int:
        return (await self.service.revert(name, version)).version

    async def plan(self, documents: Sequence[tuple[str, str]]) -> dict[str, Any]:
        return (await self.service.plan(list(documents))).to_json()


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
            raise CommandError(
                f"scheduler at {self.base_url} unreachable: {exc}", kind="backend_unavailable"
            ) from None
        if response.status == 401:
            if not self.token_set:
                raise CommandError(
                    f"the scheduler at {self.base_url} needs a token: set {API_TOKEN_ENV}",
                    kind="unauthorized",
                )
            raise CommandError(
                f"the scheduler at {self.base_url} refused {API_TOKEN_ENV} as malformed",
                kind="unauthorized",
            )
        if response.status == 403:
            raise CommandError(
                f"the scheduler at {self.base_url} refused {API_TOKEN_ENV}: "
                "it is not one of the scheduler's API tokens",
                kind="forbidden",
            )
        if response.status >= 400:
            error = body.get("error", {}) if isinstance(body, dict) else {}
            problems = [str(p) for p in error.get("problems") or []]
            if problems:
                raise RemoteRejectedError(problems)
            raise CommandError(
                str(error.get("message") or body), kind=str(error.get("type") or "error")
            )
        return body

    async def submit(self, documents: list[tuple[str, str]]) -> dict[str, int | None]:
        # One request for the whole set, so the scheduler validates all of it
        # and writes all of it in one transaction, or none.
        payload = {"documents": [{"source": source, "text": text} for source, text in documents]}
        body = await self._call("POST", "/v1/models", json=payload)
        versions = body.get("versions") or {}
        return {str(name): versions.get(name) for name in body["submitted"]}

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

    async def history(self, name: str) -> dict[str, Any]:
        body: dict[str, Any] = await self._call("GET", f"/v1/models/{name}/history")
        return body

    async def revert(self, name: str, version: int) -> int:
        body = await self._call("POST", f"/v1/models/{name}/revert", json={"version": version})
        return int(body["version"])

    async def plan(self, documents: Sequence[tuple[str, str]]) -> dict[str, Any]:
        payload = {"documents": [{"source": source, "text": text} for source, text in documents]}
        body: dict[str, Any] = await self._call("POST", "/v1/plan", json=payload)
        return body


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
    async with scheduler_clients(nomad_environ(args)) as (consul, nomad):
        store = ModelStore(consul, KVLayout(args.kv_prefix))
        service = ModelService(
            store=store,
            status=StatusReader(
                store=store,
                nomad=nomad,
                health=consul,
                config=config,
                engine_logs=EngineLogReader(nomad, reader="NOMAD_TOKEN"),
            ),
            config=config,
        )
        yield DirectModels(service)


Command = Callable[[argparse.Namespace, Models], Coroutine[Any, Any, int]]


def _runner(command: Command, *, error_code: int = 1) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        async def main() -> int:
            async with _models(args) as models:
                return await command(args, models)

        try:
            return asyncio.run(main())
        except Exception as exc:
            return report_error(args, exc, code=error_code)

    return run


def report_error(args: argparse.Namespace, exc: Exception, *, code: int = 1) -> int:
    """Say why a model command failed, as text or JSON; returns `code`. Unknown errors re-raise."""
    if isinstance(exc, SubmissionRejectedError | RemoteRejectedError):
        problems = [str(p) for p in exc.problems]
        return fail(
            args, "nothing was submitted", kind="invalid_profile", problems=problems, code=code
        )
    if isinstance(exc, UnknownModelError | UnknownVersionError):
        return fail(args, str(exc), kind="not_found", code=code)
    if isinstance(exc, InvalidStoredProfileError | ProfileError):
        return fail(args, str(exc), kind="invalid_stored_profile", code=code)
    if isinstance(exc, ScaleOutOfBoundsError):
        return fail(args, str(exc), kind="out_of_bounds", code=code)
    if isinstance(exc, WriteConflictError):
        return fail(args, str(exc), kind="conflict", code=code)
    if isinstance(exc, NothingToRevertError):
        return fail(args, str(exc), kind="nothing_to_revert", code=code)
    if isinstance(exc, ClusterConfigError):
        return fail(args, str(exc), kind="invalid_config", code=code)
    if isinstance(exc, CommandError):
        return fail(args, str(exc), kind=exc.kind, code=code)
    if isinstance(exc, HashiPermissionDenied):
        return fail(
            args,
            f"{exc} (check CONSUL_HTTP_TOKEN and NOMAD_TOKEN)",
            kind="permission_denied",
            code=code,
        )
    if isinstance(exc, HashiError):
        hint = "check NOMAD_ADDR / CONSUL_HTTP_ADDR and that both answer" if exc.retryable else None
        kind = "backend_unavailable" if exc.retryable else "backend_error"
        return fail(args, str(exc), kind=kind, hint=hint, code=code)
    raise exc


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
            # The profile codec's own words (caravan_llm.common.contract.decode_profile_document).
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


def _names(names: list[str] | None) -> str:
    return ", ".join(names) if names else "none"


def adapter_lines(model: dict[str, Any], now: float) -> list[str]:
    """The LoRA adapters of `caravan status`: declared, per replica desired and loaded,
    and each adapter that failed to load with the engine's answer."""
    adapters = model.get("adapters")
    if adapters is None:
        return []
    lines = [f"adapters: {_names(adapters.get('declared'))}"]
    for r in model.get("replicas") or []:
        if r.get("adapters_desired") is None and r.get("adapters_loaded") is None:
            continue
        lines.append(
            f"  replica {r['replica']}: loaded {_names(r.get('adapters_loaded'))}; "
            f"desired {_names(r.get('adapters_desired'))}"
        )
    unplaced = adapters.get("unplaced") or []
    if unplaced:
        lines.append(f"  unplaced (lora.max_loras slots full): {_names(unplaced)}")
    lines.extend(
        f"  adapter {f['adapter']} failed to load on {f['job_id']} "
        f"({_age(now - float(f['since']))} ago): {f['reason']} (source {f['source']})"
        for f in adapters.get("failed") or []
    )
    return lines


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
        lines.extend(
            f"  replica {r['replica']} shares its node with {r['shares_node_with']}: "
            "the scheduler places a replica apart, then drains this one"
            for r in replicas
            if r.get("shares_node_with")
        )
        for r in replicas:
            said = engine_stderr_lines(r)
            if said:
                lines.append(f"  replica {r['replica']} {said[0]}")
                lines.extend(f"  {line}" for line in said[1:])
    else:
        lines.append("no replicas")
    lines.extend(adapter_lines(model, now))
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


async def _submit(args: argparse.Namespace, models: Models) -> int:
    documents = _read_documents(args.files)
    versions = await models.submit(documents)
    for name in versions:
        # The versions are in the --json document and `caravan history`.
        progress(args, f"submitted {name}")
    document: dict[str, Any] = {"submitted": list(versions), "versions": versions}
    if not args.wait:
        emit(args, document, "")
        return 0
    code, rollouts = await wait_for_rollouts(models, versions, args.timeout, args=args)
    document["wait"] = {
        "outcome": "ready" if code == 0 else "failed",
        "models": [r.to_json() for r in rollouts],
    }
    emit(args, document, "")
    return code


async def _wait_ready(models: Models, names: Sequence[str], timeout_s: float) -> int:
    code, _ = await wait_for_rollouts(models, names, timeout_s)
    return code


async def wait_for_rollouts(
    models: Models,
    names: Sequence[str] | Mapping[str, int | None],
    timeout_s: float,
    *,
    args: object = None,
    interval_s: float = 1.0,
) -> tuple[int, list[Rollout]]:
    """Wait until the submitted revision of every model is ready (0) or has failed (1).

    Judged by `caravan_llm.cli.rollout.judge_rollout`: the state of the previous
    revision never decides. On a timeout every model says what it waits for.
    """
    versions = dict(names) if isinstance(names, Mapping) else dict.fromkeys(names)
    deadline = time.monotonic() + timeout_s
    last: dict[str, str] = {}
    while True:
        rollouts: list[Rollout] = []
        described: dict[str, dict[str, Any]] = {}
        for name, version in versions.items():
            model = await models.describe(name)
            described[name] = model
            rollout = judge_rollout(model, version)
            rollouts.append(rollout)
            line = rollout.progress_line(model.get("replicas") or [])
            if last.get(name) != line:
                progress(args, line)
                last[name] = line
        failed = [r for r in rollouts if r.outcome is Outcome.FAILED]
        if failed:
            # Waiting on longer cannot help: it takes a change (caravan status says which).
            for rollout in failed:
                for reason in rollout.reasons:
                    print(f"{rollout.name} failed: {reason}", file=sys.stderr)
            return 1, rollouts
        if all(r.outcome is Outcome.READY for r in rollouts):
            progress(args, "all replicas ready")
            return 0, rollouts
        if time.monotonic() > deadline:
            print(f"timed out after {timeout_s:.0f}s waiting for replicas:", file=sys.stderr)
            for rollout in rollouts:
                for line in control_plane_lines(described[rollout.name]):
                    print(f"  {rollout.name}: {line}", file=sys.stderr)
                if rollout.outcome is Outcome.WAITING:
                    for reason in rollout.reasons or ("not ready",):
                        print(f"  {rollout.name}: {reason}", file=sys.stderr)
            return 1, rollouts
        await asyncio.sleep(interval_s)


async def _list(args: argparse.Namespace, models: Models) -> int:
    found = await models.list()
    emit(args, found, format_list(found))
    return 0


async def _status(args: argparse.Namespace, models: Models) -> int:
    model = await models.describe(args.name)
    emit(args, model, format_status(model, time.time()))
    return 0


async def _delete(args: argparse.Namespace, models: Models) -> int:
    await models.delete(args.name)
    emit(
        args,
        {"name": args.name, "deleted": True},
        f"deleted {args.name}: its replicas drain and stop",
    )
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
            raise CommandError("--auto takes no replica count and no --for", kind="invalid_request")
        await models.release(args.name)
        emit(
            args,
            {"name": args.name, "auto": True},
            f"{args.name}: the autoscaler decides the count again",
        )
        return 0
    if args.replicas is None:
        raise CommandError(
            "give a replica count (caravan scale NAME N) or --auto", kind="invalid_request"
        )
    hold_s = parse_duration(args.hold) if args.hold is not None else None
    held = await models.scale(args.name, args.replicas, hold_s)
    lines = [f"scaled {args.name} to {args.replicas} replicas"]
    if held is not None:
        lines.append(
            f"held against the autoscaler for {_duration_words(held)} "
            f"(until about {_when(time.time() + held)}); "
            f"`caravan scale {args.name} --auto` ends it sooner"
        )
    emit(args, {"name": args.name, "replicas": args.replicas, "hold_s": held}, "\n".join(lines))
    return 0


PLAN_ERROR = 255


async def _plan(args: argparse.Namespace, models: Models) -> int:
    document = await models.plan(_read_documents(args.files))
    emit(args, document, format_plan(document, verbose=args.verbose))
    return 1 if document["changes"] else 0


def format_plan(plan: Mapping[str, Any], *, verbose: bool = False) -> str:
    """The plan in `nomad job plan`'s words: markers, jobs, then the fields that change."""
    marks = {"create": "+", "update": "+/-", "stop": "-", "none": " "}
    lines: list[str] = []
    for model in plan["models"]:
        lines.append(
            f"{marks[model['change']]} Model: {model['name']!r} "
            f"({model['change']}, {model['desired']} replica(s) desired)"
        )
        for job in model["jobs"]:
            if job["change"] == "none" and not verbose:
                continue
            words = {
                "create": "create",
                "update": f"update: spec {job['old_spec_hash']} => {job['new_spec_hash']}",
                "stop": "stop: drained, then deregistered",
                "none": "no change",
            }[job["change"]]
            lines.append(f"  {marks[job['change']]} Job: {job['job_id']!r} ({words})")
            for field in job["fields"]:
                old, new = json.dumps(field["old"]), json.dumps(field["new"])
                text = {"+": new, "-": old}.get(field["mark"], f"{old} => {new}")
                lines.append(f"      {field['mark']} {field['path']}: {text}")
    lines.append("")
    lines.append(
        "applying this submission would change the jobs above (exit 1)"
        if plan["changes"]
        else "no job would change (exit 0)"
    )
    return "\n".join(lines)


def format_history(history: Mapping[str, Any], now: float) -> str:
    """`caravan history NAME`: one line per kept version, newest first, like `nomad job history`."""
    name = history["name"]
    lines: list[str] = []
    if not history.get("exists", True):
        lines.append(f"{name} is deleted; `caravan revert {name} VERSION` brings a version back")
    elif history.get("current") is None:
        lines.append(
            f"{name}'s current profile was written around caravan (consul kv put, Terraform): "
            "it is none of these versions"
        )
    rows = [["VERSION", "SUBMITTED", "AGE", "NOTE"]]
    for version in history.get("versions") or []:
        notes = []
        if version["version"] == history.get("current"):
            notes.append("current")
        if version.get("reverted_from") is not None:
            notes.append(f"revert to {version['reverted_from']}")
        rows.append(
            [
                str(version["version"]),
                _when(float(version["submitted_at"])),
                _age(max(now - float(version["submitted_at"]), 0.0)),
                ", ".join(notes) or "-",
            ]
        )
    if len(rows) == 1:
        lines.append(f"{name} has no kept versions")
    else:
        lines.append(_table(rows))
    lines.extend(f"unreadable: {problem}" for problem in history.get("unreadable") or [])
    return "\n".join(lines)


def _history_version(history: Mapping[str, Any], number: int) -> Mapping[str, Any] | None:
    return next((v for v in history.get("versions") or [] if v["version"] == number), None)


async def _history(args: argparse.Namespace, models: Models) -> int:
    history = await models.history(args.name)
    if args.version is not None:
        chosen = _history_version(history, args.version)
        if chosen is None:
            kept = ", ".join(str(v["version"]) for v in history.get("versions") or []) or "none"
            raise CommandError(
                f"{args.name}: no version {args.version} is kept (kept: {kept})", kind="not_found"
            )
        emit(args, chosen, json.dumps(chosen["profile"], indent=2))
        return 0
    emit(args, history, format_history(history, time.time()))
    return 0


async def _revert(args: argparse.Namespace, models: Models) -> int:
    version = await models.revert(args.name, args.version)
    progress(args, f"reverted {args.name} to version {args.version}: it is now version {version}")
    document: dict[str, Any] = {"name": args.name, "reverted_to": args.version, "version": version}
    if not args.wait:
        emit(args, document, "")
        return 0
    code, rollouts = await wait_for_rollouts(models, {args.name: version}, args.timeout, args=args)
    document["wait"] = {
        "outcome": "ready" if code == 0 else "failed",
        "models": [r.to_json() for r in rollouts],
    }
    emit(args, document, "")
    return code
