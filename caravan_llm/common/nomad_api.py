"""caravan's async Nomad adapter, a thin aiohttp client over Nomad's HTTP API.

    settings = NomadSettings.from_env(os.environ)            # wiring only
    async with NomadClient(settings) as nomad:
        jobs = await nomad.list_jobs("caravan-", meta=True)
        jobs = await nomad.list_jobs("caravan-", index=jobs.index, wait_s=60)   # blocks
        stub = next(job for job in jobs.value if job.id == "caravan-qwen-0")
        result = await nomad.register_job(body, enforce_index=stub.job_modify_index)

Why not python-nomad (facts P1): it is synchronous (requests), so every call would
need a thread, and it has no blocking queries (`index`/`wait`) at all,
which the scheduler's watches are built on. The API surface caravan needs
is small, so it lives here with Nomad's field names.

Only what caravan calls is here. Answers are decoded once, here, into frozen
dataclasses with the fields caravan's readers need (`JobStub`, `Allocation`
with its task events, `Node`, `Evaluation`); nothing downstream re-reads
Nomad's JSON. `Allocation.live` and `Node.ready` are the one definition of
a live allocation and of a ready node. Failures are `caravan_llm.common.errors` types: connection
errors,
timeouts and 5xx are `HashiUnavailable`; 403 `HashiPermissionDenied`; 404
`HashiNotFound` (reads of one object return None instead); 400 and Nomad's
validation failures (HTTP 500 whose text says "validation failed" or
"error occurred", facts N2) `HashiBadRequest` with Nomad's message; a lost
`EnforceIndex` race (facts N3) `JobModifyIndexConflict` (a retryable
`HashiConflict`). The token travels in `X-Nomad-Token` only and never
appears in logs or messages.
"""

from __future__ import annotations

import base64
import json
import logging
import ssl
import urllib.parse
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType, TracebackType
from typing import Any, Generic, Self, TypeVar

import aiohttp
from pydantic import Field, SecretStr

from caravan_llm.common.env_bool import parse_env_bool
from caravan_llm.common.errors import (
    HashiBadRequest,
    HashiConflict,
    HashiError,
    HashiMalformedAnswer,
    HashiNotFound,
    HashiPermissionDenied,
    HashiUnavailable,
    JobModifyIndexConflict,
    SettingsError,
    decoded,
    parse_index,
)
from caravan_llm.common.tls_files import TlsClientSettings

log = logging.getLogger(__name__)

Json = dict[str, Any]
T = TypeVar("T")

DEFAULT_ADDRESS = "http://127.0.0.1:4646"
# Nomad caps a blocking query at 5 minutes and adds up to wait/16 of jitter.
MAX_WAIT_S = 300.0
JITTER_FRACTION = 16
MESSAGE_BODY_LIMIT = 2000
_VALIDATION_MARKERS = ("validation failed", "error occurred", "errors occurred")
_ENFORCE_MARKER = "Enforcing job modify index"


class NomadSettings(TlsClientSettings):
    """Where Nomad is and how to talk to it; build it with `from_env(os.environ)`.

    The TLS files (`ca_cert`, `ca_path`, `client_cert`, `client_key`) are
    `TlsClientSettings`', read from `NOMAD_CACERT` and its siblings.
    """

    TLS_ENV_PREFIX = "NOMAD"

    address: str = DEFAULT_ADDRESS
    token: SecretStr | None = None
    namespace: str | None = None
    region: str | None = None
    skip_verify: bool = False
    tls_server_name: str | None = None
    request_timeout_s: float = Field(default=10.0, gt=0)

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> NomadSettings:
        """Read the variables the Nomad CLI reads (NOMAD_ADDR, _TOKEN, _NAMESPACE, TLS files)."""
        address = environ.get("NOMAD_ADDR", "").strip() or DEFAULT_ADDRESS
        if "://" not in address:
            address = f"http://{address}"
        parsed = urllib.parse.urlsplit(address)
        if parsed.scheme not in {"http", "https"} or not parsed.hostname:
            raise SettingsError(f"NOMAD_ADDR must be http(s)://host[:port], got {address!r}")
        try:
            _ = parsed.port
        except ValueError as exc:
            raise SettingsError(f"NOMAD_ADDR has an invalid port: {address!r}") from exc
        tls_fields = cls.tls_fields_from_env(environ)
        skip = environ.get("NOMAD_SKIP_VERIFY", "")
        token = environ.get("NOMAD_TOKEN", "").strip()
        settings = cls(
            address=address.rstrip("/"),
            token=SecretStr(token) if token else None,
            namespace=environ.get("NOMAD_NAMESPACE") or None,
            region=environ.get("NOMAD_REGION") or None,
            **tls_fields,
            skip_verify=parse_env_bool("NOMAD_SKIP_VERIFY", skip) if skip else False,
            tls_server_name=environ.get("NOMAD_TLS_SERVER_NAME") or None,
        )
        settings.check_tls_files()
        return settings

    def ssl_context(self) -> ssl.SSLContext | None:
        """The TLS context for https (None for plain http); `SettingsError` names a bad file."""
        if not self.address.startswith("https://"):
            return None
        return self.client_context(verify=not self.skip_verify)


# -- results ---------------------------------------------------------------


def _frozen(mapping: Mapping[str, Any] | None) -> Mapping[str, Any]:
    return MappingProxyType(dict(_object(mapping or {})))


def _object(value: Any) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise TypeError("not an object")
    return value


def _optional_int(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError("not an integer")
    return value


@dataclass(frozen=True, slots=True)
class QueryResult(Generic[T]):
    """A read with Nomad's `X-Nomad-Index`, to pass back as `index=` to block."""

    index: int
    value: T


@dataclass(frozen=True, slots=True)
class RegisterResult:
    eval_id: str
    eval_create_index: int
    job_modify_index: int
    warnings: str
    index: int


@dataclass(frozen=True, slots=True)
class DeregisterResult:
    eval_id: str
    job_modify_index: int
    index: int


@dataclass(frozen=True, slots=True)
class JobStub:
    """A job as `GET /v1/jobs` lists it; `meta` is empty unless asked with `meta=true`."""

    id: str
    namespace: str = "default"
    version: int = 0
    status: str = ""
    stop: bool = False
    submit_time_ns: int = 0
    meta: Mapping[str, str] = field(default_factory=lambda: _frozen(None))
    job_modify_index: int = 0
    modify_index: int = 0

    @classmethod
    def from_api(cls, data: Mapping[str, Any]) -> JobStub:
        """Raises HashiMalformedAnswer when `data` is not a job of Nomad's API."""
        return decoded("Nomad job", lambda: cls._decode(_object(data)))

    @classmethod
    def _decode(cls, data: Mapping[str, Any]) -> JobStub:
        return cls(
            id=str(data.get("ID", "")),
            namespace=str(data.get("Namespace") or "default"),
            version=int(data.get("Version") or 0),
            status=str(data.get("Status", "")),
            stop=bool(data.get("Stop", False)),
            submit_time_ns=int(data.get("SubmitTime") or 0),
            meta=_frozen({str(k): str(v) for k, v in (data.get("Meta") or {}).items()}),
            job_modify_index=int(data.get("JobModifyIndex") or 0),
            modify_index=int(data.get("ModifyIndex") or 0),
        )


@dataclass(frozen=True, slots=True)
class AllocatedPort:
    label: str
    value: int
    to: int
    host_ip: str


@dataclass(frozen=True, slots=True)
class TaskEvent:
    """One event of one of the allocation's tasks; `message` is Nomad's DisplayMessage
    (else its Message)."""

    type: str
    message: str
    time_ns: int
    # Nomad's FailsTask: this event failed the task (a hook or driver error).
    fails_task: bool = False
    # The task the event is of (the allocation's TaskStates key).
    task: str = ""
    # Nomad's ExitCode: set on `Terminated` events (0 on the others).
    exit_code: int = 0

    @property
    def words(self) -> str:
        return f"{self.type}: {self.message}" if self.message else self.type


# Client statuses of an allocation that runs or is about to.
LIVE_CLIENT_STATUSES = frozenset({"pending", "running"})


@dataclass(frozen=True, slots=True)
class Allocation:
    """An allocation; `ports` is None when the answer carried no resources.

    `task_events` are every task's events, oldest first.
    """

    id: str
    job_id: str = ""
    node_id: str = ""
    desired_status: str = ""
    client_status: str = ""
    deployment_healthy: bool | None = None
    name: str = ""
    namespace: str = "default"
    job_version: int = 0
    task_group: str = ""
    node_name: str = ""
    create_index: int = 0
    modify_index: int = 0
    create_time_ns: int = 0
    modify_time_ns: int = 0
    ports: tuple[AllocatedPort, ...] | None = None
    task_events: tuple[TaskEvent, ...] = ()

    @property
    def live(self) -> bool:
        """The one definition of a live allocation: Nomad wants it to run, and it is
        pending or running (not lost, failed, complete or of unknown state)."""
        return self.desired_status == "run" and self.client_status in LIVE_CLIENT_STATUSES

    @classmethod
    def from_api(cls, data: Mapping[str, Any]) -> Allocation:
        """Raises HashiMalformedAnswer when `data` is not a allocation of Nomad's API."""
        return decoded("Nomad allocation", lambda: cls._decode(_object(data)))

    @classmethod
    def _decode(cls, data: Mapping[str, Any]) -> Allocation:
        resources = data.get("AllocatedResources")
        ports: tuple[AllocatedPort, ...] | None = None
        if isinstance(resources, Mapping):
            shared = resources.get("Shared") or {}
            ports = tuple(
                AllocatedPort(
                    label=str(port.get("Label", "")),
                    value=int(port.get("Value") or 0),
                    to=int(port.get("To") or 0),
                    host_ip=str(port.get("HostIP", "")),
                )
                for port in shared.get("Ports") or []
            )
        health = (data.get("DeploymentStatus") or {}).get("Healthy")
        events = [
            TaskEvent(
                type=str(event.get("Type", "")),
                message=str(event.get("DisplayMessage") or event.get("Message") or ""),
                time_ns=int(event.get("Time") or 0),
                fails_task=bool(event.get("FailsTask", False)),
                task=str(task),
                exit_code=int(event.get("ExitCode") or 0),
            )
            for task, state in (data.get("TaskStates") or {}).items()
            for event in (state or {}).get("Events") or []
        ]
        return cls(
            id=str(data.get("ID", "")),
            name=str(data.get("Name", "")),
            namespace=str(data.get("Namespace") or "default"),
            job_id=str(data.get("JobID", "")),
            job_version=int(data.get("JobVersion") or (data.get("Job") or {}).get("Version") or 0),
            task_group=str(data.get("TaskGroup", "")),
            node_id=str(data.get("NodeID", "")),
            node_name=str(data.get("NodeName", "")),
            desired_status=str(data.get("DesiredStatus", "")),
            client_status=str(data.get("ClientStatus", "")),
            deployment_healthy=health if isinstance(health, bool) else None,
            create_index=int(data.get("CreateIndex") or 0),
            modify_index=int(data.get("ModifyIndex") or 0),
            create_time_ns=int(data.get("CreateTime") or 0),
            modify_time_ns=int(data.get("ModifyTime") or 0),
            ports=ports,
            task_events=tuple(sorted(events, key=lambda event: event.time_ns)),
        )


@dataclass(frozen=True, slots=True)
class NodeDevice:
    vendor: str
    type: str
    name: str
    healthy_instances: int
    memory_mib: int | None


@dataclass(frozen=True, slots=True)
class Node:
    """A client node; resource fields are None when the answer carried no resources."""

    id: str
    name: str = ""
    status: str = ""
    eligibility: str = "eligible"
    drain: bool = False
    address: str = ""
    datacenter: str = ""
    node_class: str = ""
    node_pool: str = "default"
    cpu_mhz: int | None = None
    memory_mb: int | None = None
    devices: tuple[NodeDevice, ...] | None = None

    @property
    def ready(self) -> bool:
        """The one definition of node readiness: Nomad's status is `ready` (its client
        heartbeats). Eligibility and drain are separate: a draining node's
        allocations still run until Nomad migrates them."""
        return self.status == "ready"

    @classmethod
    def from_api(cls, data: Mapping[str, Any]) -> Node:
        """Raises HashiMalformedAnswer when `data` is not a node of Nomad's API."""
        return decoded("Nomad node", lambda: cls._decode(_object(data)))

    @classmethod
    def _decode(cls, data: Mapping[str, Any]) -> Node:
        resources = data.get("NodeResources")
        cpu_mhz = memory_mb = None
        devices: tuple[NodeDevice, ...] | None = None
        if isinstance(resources, Mapping):
            cpu_mhz = int((resources.get("Cpu") or {}).get("CpuShares") or 0)
            memory_mb = int((resources.get("Memory") or {}).get("MemoryMB") or 0)
            devices = tuple(
                NodeDevice(
                    vendor=str(device.get("Vendor", "")),
                    type=str(device.get("Type", "")),
                    name=str(device.get("Name", "")),
                    healthy_instances=sum(
                        1 for instance in device.get("Instances") or [] if instance.get("Healthy")
                    ),
                    memory_mib=_optional_int(
                        ((device.get("Attributes") or {}).get("memory") or {}).get("Int")
                    ),
                )
                for device in resources.get("Devices") or []
            )
        return cls(
            id=str(data.get("ID", "")),
            name=str(data.get("Name", "")),
            address=str(data.get("Address") or data.get("HTTPAddr", "").split(":")[0]),
            datacenter=str(data.get("Datacenter", "")),
            node_class=str(data.get("NodeClass", "")),
            node_pool=str(data.get("NodePool", "default")),
            status=str(data.get("Status", "")),
            eligibility=str(data.get("SchedulingEligibility") or "eligible"),
            drain=bool(data.get("Drain", False)),
            cpu_mhz=cpu_mhz,
            memory_mb=memory_mb,
            devices=devices,
        )


@dataclass(frozen=True, slots=True)
class Evaluation:
    """An evaluation; `failed_tg_allocs` is Nomad's AllocMetric per task group, as sent
    (scheduler/placement_explain.py reads it)."""

    id: str
    job_id: str = ""
    status: str = ""
    status_description: str = ""
    triggered_by: str = ""
    blocked_eval: str = ""
    failed_tg_allocs: Mapping[str, Any] = field(default_factory=lambda: _frozen(None))
    queued_allocations: Mapping[str, int] = field(default_factory=lambda: _frozen(None))
    create_index: int = 0
    modify_index: int = 0

    @classmethod
    def from_api(cls, data: Mapping[str, Any]) -> Evaluation:
        """Raises HashiMalformedAnswer when `data` is not a evaluation of Nomad's API."""
        return decoded("Nomad evaluation", lambda: cls._decode(_object(data)))

    @classmethod
    def _decode(cls, data: Mapping[str, Any]) -> Evaluation:
        return cls(
            id=str(data.get("ID", "")),
            job_id=str(data.get("JobID", "")),
            status=str(data.get("Status", "")),
            status_description=str(data.get("StatusDescription", "")),
            triggered_by=str(data.get("TriggeredBy", "")),
            blocked_eval=str(data.get("BlockedEval", "")),
            failed_tg_allocs=_frozen(data.get("FailedTGAllocs")),
            queued_allocations=_frozen(
                {str(k): int(v) for k, v in (data.get("QueuedAllocations") or {}).items()}
            ),
            create_index=int(data.get("CreateIndex") or 0),
            modify_index=int(data.get("ModifyIndex") or 0),
        )


# -- the client ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class VariableMetadata:
    """A Nomad Variable's metadata (what `GET /v1/vars` lists; no items)."""

    namespace: str
    path: str
    create_index: int
    modify_index: int

    @classmethod
    def from_api(cls, data: Mapping[str, Any]) -> VariableMetadata:
        """Raises HashiMalformedAnswer when `data` is not a variable of Nomad's API."""
        return decoded("Nomad variable", lambda: cls._decode(_object(data)))

    @classmethod
    def _decode(cls, data: Mapping[str, Any]) -> VariableMetadata:
        return cls(
            namespace=str(data.get("Namespace", "default")),
            path=str(data.get("Path", "")),
            create_index=int(data.get("CreateIndex") or 0),
            modify_index=int(data.get("ModifyIndex") or 0),
        )


@dataclass(frozen=True, slots=True)
class Variable:
    """A Nomad Variable with its items; the items never show in `repr`."""

    meta: VariableMetadata
    items: Mapping[str, str] = field(repr=False)

    @classmethod
    def from_api(cls, data: Mapping[str, Any]) -> Variable:
        """Raises HashiMalformedAnswer when `data` is not a variable of Nomad's API."""
        return decoded("Nomad variable", lambda: cls._decode(_object(data)))

    @classmethod
    def _decode(cls, data: Mapping[str, Any]) -> Variable:
        raw_items = data.get("Items") or {}
        return cls(
            meta=VariableMetadata.from_api(data),
            items=_frozen({str(k): str(v) for k, v in raw_items.items()}),
        )


def _list_of(decode: Callable[[Mapping[str, Any]], T], data: Any) -> list[T]:
    """Each item of a JSON array answer (null is empty); HashiMalformedAnswer otherwise."""
    if data is None:
        return []
    if not isinstance(data, list):
        raise HashiMalformedAnswer("Nomad: a list answer is not a JSON array")
    return [decode(item) for item in data]


def _var_path(path: str) -> str:
    return "/v1/var/" + urllib.parse.quote(path.strip("/"), safe="/")


def _job_body(job: Mapping[str, Any]) -> Json:
    """Accept `{"Job": {...}}` (what rendering produces) or a bare job."""
    return dict(job) if "Job" in job else {"Job": dict(job)}


def _wait_param(wait_s: float) -> str:
    return f"{round(min(max(wait_s, 0.0), MAX_WAIT_S) * 1000)}ms"


class NomadClient:
    """Async Nomad HTTP client; use as `async with NomadClient(settings) as nomad:`."""

    def __init__(
        self, settings: NomadSettings, *, session: aiohttp.ClientSession | None = None
    ) -> None:
        self.settings = settings
        self._session = session
        self._owns_session = session is None

    async def __aenter__(self) -> Self:
        if self._session is None:
            connector = aiohttp.TCPConnector(ssl=self.settings.ssl_context() or False)
            self._session = aiohttp.ClientSession(connector=connector)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._owns_session and self._session is not None:
            await self._session.close()
        self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("NomadClient is not open; use `async with NomadClient(...)`")
        return self._session

    def _headers(self) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        if self.settings.token is not None:
            headers["X-Nomad-Token"] = self.settings.token.get_secret_value()
        return headers

    def _params(self, params: Mapping[str, Any] | None) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        for key, value in (params or {}).items():
            if value is None:
                continue
            if isinstance(value, list | tuple):
                out.extend((key, str(item)) for item in value)
            elif isinstance(value, bool):
                out.append((key, "true" if value else "false"))
            else:
                out.append((key, str(value)))
        keys = {key for key, _ in out}
        if self.settings.namespace and "namespace" not in keys:
            out.append(("namespace", self.settings.namespace))
        if self.settings.region and "region" not in keys:
            out.append(("region", self.settings.region))
        return out

    @staticmethod
    def _error(
        method: str, path: str, status: int, text: str, *, redact: bool = False
    ) -> HashiError:
        # A Variables answer (a 409 carries the stored variable) may hold secrets.
        body = "(answer withheld: may hold variable items)" if redact and status == 409 else ""
        body = body or text.strip()[:MESSAGE_BODY_LIMIT]
        message = f"Nomad {method} {path}: HTTP {status}: {body}"
        if status == 403:
            return HashiPermissionDenied(message, status=status)
        if status == 404:
            return HashiNotFound(message, status=status)
        if _ENFORCE_MARKER in body:
            return JobModifyIndexConflict(message, status=status)
        if status == 409:
            return HashiConflict(message, status=status)
        if status == 400 or (
            status == 500 and any(marker in body for marker in _VALIDATION_MARKERS)
        ):
            return HashiBadRequest(message, status=status)
        if 400 < status < 500:
            return HashiBadRequest(message, status=status)
        return HashiUnavailable(message, status=status)

    async def _call(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, Any] | None = None,
        body: Any = None,
        wait_s: float | None = None,
        redact: bool = False,
    ) -> tuple[int, Any]:
        """(X-Nomad-Index or 0, decoded JSON body); errors mapped to `caravan_llm.common.errors`."""
        timeout_s = self.settings.request_timeout_s
        if wait_s is not None:
            timeout_s += wait_s + wait_s / JITTER_FRACTION
        url = f"{self.settings.address}{path}"
        try:
            async with self.session.request(
                method,
                url,
                params=self._params(params),
                json=body,
                headers=self._headers(),
                timeout=aiohttp.ClientTimeout(total=timeout_s),
            ) as response:
                text = await response.text()
                if response.status >= 300:
                    raise self._error(method, path, response.status, text, redact=redact)
                index = parse_index(
                    response.headers.get("X-Nomad-Index") or "0", f"Nomad {method} {path}"
                )
                try:
                    return index, json.loads(text) if text else None
                except (ValueError, RecursionError):
                    raise HashiUnavailable(
                        f"Nomad {method} {path}: answer is not JSON", status=response.status
                    ) from None
        except HashiError:
            raise
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise HashiUnavailable(
                f"Nomad {method} {path} at {self.settings.address} failed: "
                f"{type(exc).__name__}: {exc}"
            ) from exc

    @staticmethod
    def _blocking(index: int | None, wait_s: float | None) -> tuple[dict[str, Any], float | None]:
        if index is None:
            return {}, None
        wait = MAX_WAIT_S if wait_s is None else min(wait_s, MAX_WAIT_S)
        return {"index": max(index, 1), "wait": _wait_param(wait)}, wait

    # -- jobs ---------------------------------------------------------------

    async def register_job(
        self, job: Mapping[str, Any], *, enforce_index: int | None = None
    ) -> RegisterResult:
        """`PUT /v1/jobs`; with `enforce_index`, only if the stored JobModifyIndex matches
        (0: only if the job does not exist), else `HashiConflict`."""
        body = _job_body(job)
        if enforce_index is not None:
            body["EnforceIndex"] = True
            body["JobModifyIndex"] = enforce_index
        index, data = await self._call("PUT", "/v1/jobs", body=body)
        return decoded(
            "Nomad PUT /v1/jobs",
            lambda: RegisterResult(
                eval_id=str(_object(data).get("EvalID", "")),
                eval_create_index=int(data.get("EvalCreateIndex") or 0),
                job_modify_index=int(data.get("JobModifyIndex") or 0),
                warnings=str(data.get("Warnings") or ""),
                index=int(data.get("Index") or index),
            ),
        )

    async def plan_job(self, job: Mapping[str, Any], *, diff: bool = False) -> Json:
        """`POST /v1/job/:job_id/plan`: what registering `job` would do, registering nothing.

        Nomad checks `submit-job` in the namespace (after validating the job).
        """
        body = _job_body(job)
        body["Diff"] = diff
        job_id = str(body["Job"].get("ID", ""))
        path = f"/v1/job/{urllib.parse.quote(job_id, safe='')}/plan"
        _, data = await self._call("POST", path, body=body)
        return decoded(f"Nomad POST {path}", lambda: dict(_object(data or {})))

    async def list_jobs(
        self,
        prefix: str = "",
        *,
        meta: bool = False,
        index: int | None = None,
        wait_s: float | None = None,
    ) -> QueryResult[list[JobStub]]:
        """Job stubs (`GET /v1/jobs`); blocks when `index` is given."""
        params, wait = self._blocking(index, wait_s)
        params.update({"prefix": prefix or None, "meta": True if meta else None})
        got, data = await self._call("GET", "/v1/jobs", params=params, wait_s=wait)
        return QueryResult(got, _list_of(JobStub.from_api, data))

    async def deregister_job(self, job_id: str, *, purge: bool = True) -> DeregisterResult:
        """`DELETE /v1/job/:id`; an unknown job is not an error (Nomad answers 200)."""
        _, data = await self._call(
            "DELETE",
            f"/v1/job/{urllib.parse.quote(job_id, safe='')}",
            params={"purge": purge},
        )
        return decoded(
            "Nomad DELETE job",
            lambda: DeregisterResult(
                eval_id=str(_object(data).get("EvalID", "")),
                job_modify_index=int(data.get("JobModifyIndex") or 0),
                index=int(data.get("Index") or 0),
            ),
        )

    async def job_evaluations(
        self, job_id: str, *, index: int | None = None, wait_s: float | None = None
    ) -> QueryResult[list[Evaluation]]:
        params, wait = self._blocking(index, wait_s)
        got, data = await self._call(
            "GET",
            f"/v1/job/{urllib.parse.quote(job_id, safe='')}/evaluations",
            params=params,
            wait_s=wait,
        )
        return QueryResult(got, _list_of(Evaluation.from_api, data))

    # -- allocations, nodes, evaluations ------------------------------------

    async def list_allocations(
        self,
        prefix: str = "",
        *,
        resources: bool = False,
        index: int | None = None,
        wait_s: float | None = None,
    ) -> QueryResult[list[Allocation]]:
        params, wait = self._blocking(index, wait_s)
        params.update({"prefix": prefix or None, "resources": True if resources else None})
        got, data = await self._call("GET", "/v1/allocations", params=params, wait_s=wait)
        return QueryResult(got, _list_of(Allocation.from_api, data))

    async def list_nodes(
        self, *, resources: bool = True, index: int | None = None, wait_s: float | None = None
    ) -> QueryResult[list[Node]]:
        params, wait = self._blocking(index, wait_s)
        params["resources"] = True if resources else None
        got, data = await self._call("GET", "/v1/nodes", params=params, wait_s=wait)
        return QueryResult(got, _list_of(Node.from_api, data))

    # -- variables -----------------------------------------------------------

    async def list_variables(
        self, prefix: str = "", *, index: int | None = None, wait_s: float | None = None
    ) -> QueryResult[list[VariableMetadata]]:
        """`GET /v1/vars?prefix=`: metadata only; blocks when `index` is given."""
        params, wait = self._blocking(index, wait_s)
        params["prefix"] = prefix or None
        got, data = await self._call("GET", "/v1/vars", params=params, wait_s=wait)
        return QueryResult(got, _list_of(VariableMetadata.from_api, data))

    async def get_variable(self, path: str) -> Variable | None:
        """`GET /v1/var/:path`, or None when there is no such variable."""
        try:
            _, data = await self._call("GET", _var_path(path), redact=True)
        except HashiNotFound:
            return None
        return Variable.from_api(data)

    async def put_variable(
        self, path: str, items: Mapping[str, str], *, cas: int | None = None
    ) -> VariableMetadata:
        """`PUT /v1/var/:path`; with `cas` only if the stored ModifyIndex matches
        (0: only if absent), else `HashiConflict` (its message carries no items)."""
        params = {"cas": cas} if cas is not None else None
        _, data = await self._call(
            "PUT",
            _var_path(path),
            params=params,
            body={"Path": path, "Items": dict(items)},
            redact=True,
        )
        return VariableMetadata.from_api(data)

    async def delete_variable(self, path: str, *, cas: int | None = None) -> None:
        """`DELETE /v1/var/:path` (no error when absent); `cas` as for `put_variable`."""
        params = {"cas": cas} if cas is not None else None
        await self._call("DELETE", _var_path(path), params=params, redact=True)

    # -- allocation logs ------------------------------------------------------

    async def stream_logs(
        self,
        alloc_id: str,
        task: str,
        *,
        log_type: str = "stdout",
        follow: bool = False,
        origin: str = "start",
        offset: int = 0,
    ) -> AsyncIterator[LogFrame]:
        """`GET /v1/client/fs/logs/:alloc_id`: a task's log as Nomad frames it.

        Yields each frame with data (heartbeats are skipped); without `follow`
        it ends at the end of the log. Needs `read-logs` (or `read-fs`) in
        the allocation's namespace.
        """
        path = f"/v1/client/fs/logs/{alloc_id}"
        params = {
            "task": task,
            "type": log_type,
            "follow": follow,
            "origin": origin,
            "offset": offset,
            "plain": False,
        }
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=self.settings.request_timeout_s, sock_read=None
        )
        try:
            async with self.session.get(
                f"{self.settings.address}{path}",
                params=self._params(params),
                headers=self._headers(),
                timeout=timeout,
            ) as response:
                if response.status >= 300:
                    raise self._error("GET", path, response.status, await response.text())
                frames = LogFrameDecoder()
                async for chunk in response.content.iter_any():
                    for found in frames.feed(chunk):
                        if found.data:
                            yield found
                frames.close()
        except HashiError:
            raise
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise HashiUnavailable(
                f"Nomad GET {path} at {self.settings.address} failed: {type(exc).__name__}: {exc}"
            ) from exc


@dataclass(frozen=True, slots=True)
class LogFrame:
    """One `StreamFrame` of a log stream: bytes of `file`, ending at `offset`."""

    data: bytes
    file: str = ""
    offset: int = 0
    file_event: str = ""


class LogFrameDecoder:
    """Nomad's log stream is JSON frames one after another; this splits and decodes them."""

    def __init__(self) -> None:
        self._buffer = ""
        self._decoder = json.JSONDecoder()
        self._bytes = b""

    def feed(self, chunk: bytes) -> list[LogFrame]:
        self._bytes += chunk
        try:
            text = self._bytes.decode("utf-8")
        except UnicodeDecodeError as exc:
            # A multi-byte character split across chunks: keep its start for the next one.
            text = self._bytes[: exc.start].decode("utf-8")
            self._bytes = self._bytes[exc.start :]
        else:
            self._bytes = b""
        self._buffer += text
        frames: list[LogFrame] = []
        while True:
            stripped = self._buffer.lstrip()
            if not stripped:
                self._buffer = ""
                return frames
            try:
                document, end = self._decoder.raw_decode(stripped)
            except RecursionError:
                raise HashiMalformedAnswer(
                    "Nomad log stream: a frame is nested too deeply"
                ) from None
            except ValueError:
                self._buffer = stripped
                return frames
            self._buffer = stripped[end:]
            frames.append(_log_frame(document))

    def close(self) -> None:
        if self._buffer.strip() or self._bytes:
            raise HashiUnavailable("Nomad log stream: it ended inside a frame")


def _log_frame(document: Any) -> LogFrame:
    if not isinstance(document, dict):
        raise HashiUnavailable("Nomad log stream: a frame is not a JSON object")
    raw = document.get("Data") or ""
    try:
        data = base64.b64decode(raw, validate=True) if raw else b""
    except (ValueError, TypeError):
        raise HashiUnavailable("Nomad log stream: a frame's Data is not base64") from None
    return decoded(
        "Nomad log stream",
        lambda: LogFrame(
            data=data,
            file=str(document.get("File") or ""),
            offset=int(document.get("Offset") or 0),
            file_event=str(document.get("FileEvent") or ""),
        ),
    )
