"""caravan's async Consul adapter, over py-consul's `consul.aio` client.

    settings = ConsulSettings.from_env(os.environ)          # wiring only
    async with ConsulClient(settings) as consul:
        index, entries = await consul.health_service("caravan-qwen", passing=True)
        index, entries = await consul.health_service("caravan-qwen", passing=True,
                                                     index=index, wait_s=60)

Consul's behaviour relied on is in `docs/nomad-consul-facts.md`: health
reads (facts C3), KV and check-and-set (C6), transactions (C7), sessions
(C8), ACL tokens (C12); py-consul's async client (facts P2).

Results are frozen dataclasses (`HealthEntry`, `KVEntry`, `SessionInfo`);
failures are `caravan_llm.common.errors` types: connection errors, timeouts and 5xx
are `HashiUnavailable`, 403 `HashiPermissionDenied`, 404 where the object
was needed `HashiNotFound`, 400 `HashiBadRequest`. Tokens travel in the
`X-Consul-Token` header only and never appear in logs or messages.

Why a subclass of `consul.aio.Consul`: its stock HTTP client hands aiohttp
the deprecated `verify_ssl=`/`ssl_context=` arguments and cannot express a
CA directory or a client certificate with verification off. Overriding
`http_connect` keeps py-consul's endpoints and callbacks and gives aiohttp
one `ssl=` context built from the standard CONSUL_* variables.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
import ssl
import urllib.parse
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType, TracebackType
from typing import Any, Literal, Self, TypeVar, assert_never

import aiohttp
import consul.aio
import consul.base
from consul import exceptions as consul_errors
from consul.callback import CB
from pydantic import Field, SecretStr

from caravan_llm.common.env_bool import parse_env_bool
from caravan_llm.common.errors import (
    HashiBadRequest,
    HashiConflict,
    HashiError,
    HashiNotFound,
    HashiPermissionDenied,
    HashiUnavailable,
    SettingsError,
    decoded,
    parse_index,
)
from caravan_llm.common.tls_files import TlsClientSettings

log = logging.getLogger(__name__)

T = TypeVar("T")
HealthStatus = Literal["passing", "warning", "critical"]
SessionBehavior = Literal["release", "delete"]

DEFAULT_PORT = 8500
# Consul adds up to wait/16 of jitter to a blocking query.
JITTER_FRACTION = 16
MAX_WAIT_S = 600.0


class ConsulSettings(TlsClientSettings):
    """Where Consul is and how to talk to it; build it with `from_env(os.environ)`.

    The TLS files (`ca_cert`, `ca_path`, `client_cert`, `client_key`) are
    `TlsClientSettings`', read from `CONSUL_CACERT` and its siblings.
    """

    TLS_ENV_PREFIX = "CONSUL"

    scheme: Literal["http", "https"] = "http"
    host: str = "127.0.0.1"
    port: int = Field(default=DEFAULT_PORT, ge=1, le=65535)
    token: SecretStr | None = None
    verify_tls: bool = True
    request_timeout_s: float = Field(default=10.0, gt=0)

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> ConsulSettings:
        """Read the variables the Consul CLI reads (CONSUL_HTTP_ADDR, _TOKEN, _SSL, TLS files).

        As in Consul's Go client, a scheme inside CONSUL_HTTP_ADDR wins over
        CONSUL_HTTP_SSL, a missing port is the scheme's default, and a token
        file (CONSUL_HTTP_TOKEN_FILE) wins over CONSUL_HTTP_TOKEN.
        """
        scheme: Literal["http", "https"] = "http"
        ssl_flag = environ.get("CONSUL_HTTP_SSL", "")
        if ssl_flag and parse_env_bool("CONSUL_HTTP_SSL", ssl_flag):
            scheme = "https"
        address = environ.get("CONSUL_HTTP_ADDR", "").strip() or f"127.0.0.1:{DEFAULT_PORT}"
        if "://" in address:
            given, _, rest = address.partition("://")
            if given == "http":
                scheme = "http"
            elif given == "https":
                scheme = "https"
            else:
                raise SettingsError(
                    f"CONSUL_HTTP_ADDR has an unsupported scheme {given!r} "
                    "(use host:port, http://host:port or https://host:port)"
                )
            address = rest
        parsed = urllib.parse.urlsplit(f"//{address}")
        try:
            port = parsed.port
        except ValueError as exc:
            raise SettingsError(f"CONSUL_HTTP_ADDR has an invalid port: {address!r}") from exc
        if not parsed.hostname or parsed.path not in ("", "/"):
            raise SettingsError(f"CONSUL_HTTP_ADDR must be [scheme://]host[:port], got {address!r}")
        if port is None:
            port = 443 if scheme == "https" else 80
        verify = True
        verify_flag = environ.get("CONSUL_HTTP_SSL_VERIFY", "")
        if verify_flag:
            verify = parse_env_bool("CONSUL_HTTP_SSL_VERIFY", verify_flag)
        token = environ.get("CONSUL_HTTP_TOKEN", "").strip() or None
        token_file = environ.get("CONSUL_HTTP_TOKEN_FILE", "")
        if token_file:
            try:
                with open(token_file, encoding="utf-8") as handle:  # noqa: PTH123 - wiring-time read
                    token = handle.read().strip() or token
            except OSError as exc:
                raise SettingsError(
                    f"CONSUL_HTTP_TOKEN_FILE: file {token_file} cannot be read: {exc.strerror}"
                ) from exc
        settings = cls(
            **cls.tls_fields_from_env(environ),
            scheme=scheme,
            host=parsed.hostname,
            port=port,
            token=SecretStr(token) if token else None,
            verify_tls=verify,
        )
        settings.check_tls_files()
        return settings

    def ssl_context(self) -> ssl.SSLContext | None:
        """The TLS context for https (None for plain http); `SettingsError` names a bad file."""
        if self.scheme != "https":
            return None
        return self.client_context(verify=self.verify_tls)


# -- results -------------------------------------------------------------------


class CheckStatus(StrEnum):
    """A check's status, and an instance's aggregate (docs/nomad-consul-facts.md, C2)."""

    PASSING = "passing"
    WARNING = "warning"
    CRITICAL = "critical"


# Consul adds these checks when an operator puts a service
# (`_service_maintenance:<service id>`) or a whole node into maintenance mode.
SERVICE_MAINTENANCE_PREFIX = "_service_maintenance:"
NODE_MAINTENANCE_CHECK_ID = "_node_maintenance"
_SEVERITY = {CheckStatus.PASSING: 0, CheckStatus.WARNING: 1, CheckStatus.CRITICAL: 2}


@dataclass(frozen=True, slots=True)
class HealthCheck:
    """One check of a `/v1/health/service` entry: the service's own or its node's."""

    check_id: str
    status: str  # as Consul sent it; `aggregate_status` decides what an unknown one means
    name: str = ""
    service_id: str = ""  # "" for a node check such as `serfHealth`
    output: str = field(default="", repr=False)

    @property
    def is_maintenance(self) -> bool:
        return self.check_id == NODE_MAINTENANCE_CHECK_ID or self.check_id.startswith(
            SERVICE_MAINTENANCE_PREFIX
        )

    @classmethod
    def from_api(cls, raw: Mapping[str, Any]) -> HealthCheck:
        if not isinstance(raw, Mapping):
            raise TypeError("a check is not an object")
        return cls(
            check_id=str(raw.get("CheckID") or ""),
            status=str(raw.get("Status") or ""),
            name=str(raw.get("Name") or ""),
            service_id=str(raw.get("ServiceID") or ""),
            output=str(raw.get("Output") or ""),
        )


def aggregate_status(checks: Iterable[HealthCheck]) -> CheckStatus:
    """The one aggregate of an instance's checks, node checks (`serfHealth`) included.

    Consul's rule (api/health.go `AggregatedStatus`): maintenance > critical >
    warning > passing, and no checks at all is passing. Consul reports a
    maintenance check as `maintenance`, and a status it does not know as "";
    caravan reads both as critical: such an instance is neither routed to nor ready.
    """
    worst = CheckStatus.PASSING
    for check in checks:
        if check.is_maintenance:
            return CheckStatus.CRITICAL
        try:
            status = CheckStatus(check.status)
        except ValueError:
            return CheckStatus.CRITICAL
        if _SEVERITY[status] > _SEVERITY[worst]:
            worst = status
    return worst


@dataclass(frozen=True, slots=True)
class HealthEntry:
    """One instance from /v1/health/service: where it is, its Meta, and its checks."""

    node: str
    node_address: str
    service_id: str
    service_name: str
    service_address: str
    port: int
    tags: tuple[str, ...]
    meta: Mapping[str, str]
    checks: tuple[HealthCheck, ...] = ()

    @property
    def status(self) -> CheckStatus:
        """The aggregate of its checks (`aggregate_status`)."""
        return aggregate_status(self.checks)

    @property
    def address(self) -> str:
        """The service address, or the node's when the service registered none."""
        return self.service_address or self.node_address

    @classmethod
    def from_api(cls, raw: Mapping[str, Any]) -> HealthEntry:
        """Raises HashiMalformedAnswer when `raw` is not an entry of `/v1/health/service`."""

        def decode() -> HealthEntry:
            node, service = _object(raw)["Node"], _object(raw)["Service"]
            return cls(
                node=_text(_object(node)["Node"]),
                node_address=_text(node["Address"]),
                service_id=_text(_object(service)["ID"]),
                service_name=_text(service["Service"]),
                service_address=_text(service.get("Address") or ""),
                port=_count(service.get("Port")),
                tags=tuple(_text(tag) for tag in _array(service.get("Tags"))),
                # Values as sent: the router skips an entry whose Meta it cannot read.
                meta=MappingProxyType(dict(_object(service.get("Meta") or {}))),
                checks=tuple(
                    HealthCheck.from_api(_object(check)) for check in _array(raw.get("Checks"))
                ),
            )

        return decoded("consul health entry", decode)


@dataclass(frozen=True, slots=True)
class KVEntry:
    key: str
    value: bytes
    flags: int
    session: str | None
    lock_index: int
    create_index: int
    modify_index: int

    @classmethod
    def from_api(cls, raw: Mapping[str, Any]) -> KVEntry:
        """Raises HashiMalformedAnswer when `raw` is not a KV entry."""

        def decode() -> KVEntry:
            value = _object(raw).get("Value")
            if isinstance(value, str):  # py-consul decodes base64 to bytes; be lenient
                value = value.encode("utf-8", "surrogatepass")
            if not isinstance(value, bytes | None):
                raise TypeError("Value")
            session = raw.get("Session") or None
            return cls(
                key=_text(raw["Key"]),
                value=value or b"",
                flags=_count(raw.get("Flags")),
                session=None if session is None else _text(session),
                lock_index=_count(raw.get("LockIndex")),
                create_index=_count(raw.get("CreateIndex")),
                modify_index=_count(raw.get("ModifyIndex")),
            )

        return decoded("consul KV entry", decode)


@dataclass(frozen=True, slots=True)
class SessionInfo:
    session_id: str
    name: str
    node: str
    ttl_s: float | None
    behavior: str
    lock_delay_s: float
    create_index: int
    modify_index: int

    @classmethod
    def from_api(cls, raw: Mapping[str, Any]) -> SessionInfo:
        """Raises HashiMalformedAnswer when `raw` is not a session."""

        def decode() -> SessionInfo:
            ttl = _text(_object(raw).get("TTL") or "")
            return cls(
                session_id=_text(raw["ID"]),
                name=_text(raw.get("Name") or ""),
                node=_text(raw.get("Node") or ""),
                ttl_s=_parse_seconds(ttl) if ttl else None,
                behavior=_text(raw.get("Behavior") or "release"),
                lock_delay_s=_count(raw.get("LockDelay")) / 1e9,
                create_index=_count(raw.get("CreateIndex")),
                modify_index=_count(raw.get("ModifyIndex")),
            )

        return decoded("consul session", decode)


# -- reading Consul's JSON: each raises TypeError/ValueError, which `decoded` reports --


def _object(value: Any) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise TypeError("not an object")
    return value


def _array(value: Any) -> list[Any]:
    """A JSON array; null or absent is empty."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise TypeError("not an array")
    return value


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError("not a string")
    return value


def _count(value: Any) -> int:
    """A non-negative integer (Consul's indexes, ports, flags); null or absent is 0."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError("not a non-negative integer")
    return value


def decode_health(raw_index: object, raw: Any) -> tuple[int, tuple[HealthEntry, ...]]:
    """The index and entries of a `/v1/health/service` answer; HashiMalformedAnswer otherwise."""
    index = parse_index(raw_index, "consul health.service")
    return index, decoded(
        "consul health.service", lambda: tuple(HealthEntry.from_api(e) for e in _array(raw))
    )


def decode_services(raw_index: object, raw: Any) -> tuple[int, dict[str, tuple[str, ...]]]:
    """The index and services (name -> tags) of a `/v1/catalog/services` answer."""
    index = parse_index(raw_index, "consul catalog.services")
    return index, decoded(
        "consul catalog.services",
        lambda: {
            _text(name): tuple(_text(tag) for tag in _array(tags))
            for name, tags in _object(raw or {}).items()
        },
    )


def decode_kv(raw_index: object, raw: Any) -> tuple[int, KVEntry | None]:
    """The index and entry of a `/v1/kv/<key>` answer (py-consul: the entry, or None)."""
    return parse_index(raw_index, "consul kv.get"), KVEntry.from_api(raw) if raw else None


def decode_kv_recurse(raw_index: object, raw: Any) -> tuple[int, tuple[KVEntry, ...]]:
    """The index and entries of a `/v1/kv/<prefix>?recurse` answer."""
    index = parse_index(raw_index, "consul kv.get recurse")
    return index, decoded(
        "consul kv.get recurse", lambda: tuple(KVEntry.from_api(item) for item in _array(raw))
    )


def decode_keys(raw_index: object, raw: Any) -> tuple[int, tuple[str, ...]]:
    """The index and keys of a `/v1/kv/<prefix>?keys` answer."""
    index = parse_index(raw_index, "consul kv.keys")
    return index, decoded("consul kv.keys", lambda: tuple(_text(key) for key in _array(raw)))


def decode_session(raw_index: object, raw: Any) -> tuple[int, SessionInfo | None]:
    """The index and session of a `/v1/session/info` answer (py-consul: the session, or None)."""
    return parse_index(raw_index, "consul session.info"), SessionInfo.from_api(raw) if raw else None


def _parse_seconds(text: str) -> float | None:
    """Seconds of the simple Go durations Consul echoes back ("15s", "1m0s", "500ms")."""
    total, number = 0.0, ""
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
    position = 0
    while position < len(text):
        char = text[position]
        if char.isdigit() or char == ".":
            number += char
            position += 1
            continue
        unit = text[position : position + 2] if text[position : position + 2] in units else char
        if unit not in units or not number:
            return None
        total += float(number) * units[unit]
        number, position = "", position + len(unit)
    return total if not number else None


# -- transactions ----------------------------------------------------------------

# Consul refuses a transaction of more operations than this (413).
MAX_TXN_OPS = 64


@dataclass(frozen=True, slots=True)
class TxnSet:
    """Write a key unconditionally."""

    key: str
    value: bytes
    flags: int = 0


@dataclass(frozen=True, slots=True)
class TxnCas:
    """Write a key only if its ModifyIndex is `index` (0: only if it does not exist)."""

    key: str
    value: bytes
    index: int
    flags: int = 0


@dataclass(frozen=True, slots=True)
class TxnGet:
    """Read a key (the transaction fails if it does not exist)."""

    key: str


@dataclass(frozen=True, slots=True)
class TxnDelete:
    """Delete a key (nothing to do if it does not exist)."""

    key: str


@dataclass(frozen=True, slots=True)
class TxnDeleteCas:
    """Delete a key only if its ModifyIndex is `index` (a key already gone counts as deleted)."""

    key: str
    index: int


@dataclass(frozen=True, slots=True)
class TxnCheckIndex:
    """Fail the transaction unless the key exists with ModifyIndex `index`."""

    key: str
    index: int


TxnOp = TxnSet | TxnCas | TxnGet | TxnDelete | TxnDeleteCas | TxnCheckIndex


@dataclass(frozen=True, slots=True)
class TxnOpError:
    """Why one operation of a transaction failed (Consul's `OpIndex` and `What`)."""

    op_index: int
    what: str

    def __str__(self) -> str:
        return f"op {self.op_index}: {self.what}"


class TxnConflictError(HashiConflict):
    """A transaction did not apply because an operation failed (a lost CAS, a moved index).

    Nothing was written; re-read and try again.
    """

    def __init__(self, errors: tuple[TxnOpError, ...]) -> None:
        super().__init__(
            "consul txn: nothing applied: " + "; ".join(str(e) for e in errors), status=409
        )
        self.errors = errors


def txn_op_payload(op: TxnOp) -> dict[str, Any]:
    """One operation in /v1/txn's body."""
    kv: dict[str, Any]
    match op:
        case TxnSet(key=key, value=value, flags=flags):
            kv = {"Verb": "set", "Key": key, "Value": _b64(value), "Flags": flags}
        case TxnCas(key=key, value=value, index=index, flags=flags):
            kv = {"Verb": "cas", "Key": key, "Value": _b64(value), "Flags": flags, "Index": index}
        case TxnGet(key=key):
            kv = {"Verb": "get", "Key": key}
        case TxnDelete(key=key):
            kv = {"Verb": "delete", "Key": key}
        case TxnDeleteCas(key=key, index=index):
            kv = {"Verb": "delete-cas", "Key": key, "Index": index}
        case TxnCheckIndex(key=key, index=index):
            kv = {"Verb": "check-index", "Key": key, "Index": index}
        case _:  # pragma: no cover - exhaustive over TxnOp
            assert_never(op)
    return {"KV": kv}


def _b64(value: bytes) -> str:
    return base64.b64encode(value).decode("ascii")


def parse_txn_answer(status: int, body: Any) -> tuple[KVEntry, ...]:
    """The KV results of a 200 answer, or the typed error of a 409 one (pure)."""
    if not isinstance(body, Mapping):
        raise HashiUnavailable(f"consul txn: unexpected answer {str(body)[:200]!r}", status=status)
    return decoded("consul txn", lambda: _txn_entries(status, body))


def _txn_entries(status: int, body: Mapping[str, Any]) -> tuple[KVEntry, ...]:
    if status == 409:
        errors = tuple(
            TxnOpError(_count(_object(e).get("OpIndex")), str(e.get("What") or ""))
            for e in _array(body.get("Errors"))
        )
        denied = [e for e in errors if e.what.startswith(("Permission denied", "ACL not found"))]
        if denied:
            raise HashiPermissionDenied(f"consul txn: {denied[0].what}", status=403)
        raise TxnConflictError(errors)
    entries: list[KVEntry] = []
    for result in _array(body.get("Results")):
        raw = dict(_object(_object(result).get("KV") or {}))
        if not raw:
            continue
        value = raw.get("Value")
        try:
            raw["Value"] = base64.b64decode(value) if isinstance(value, str) else b""
        except (binascii.Error, ValueError):
            raise HashiUnavailable("consul txn: a result value is not base64") from None
        entries.append(KVEntry.from_api(raw))
    return tuple(entries)


def _txn_callback(response: consul.base.Response) -> tuple[int, Any]:
    # 409 carries the per-operation errors in JSON; other failures raise as usual.
    if response.code != 409:
        CB._status(response)  # noqa: SLF001 - py-consul's own status mapping
    try:
        return response.code, json.loads(response.body)
    except (ValueError, TypeError):
        return response.code, response.body


# -- registrations ---------------------------------------------------------------


def go_duration(seconds: float) -> str:
    """A Go duration string Consul accepts ("10s", or "1500ms" for fractions)."""
    if seconds <= 0:
        raise ValueError(f"duration must be positive, got {seconds}")
    if float(seconds).is_integer():
        return f"{int(seconds)}s"
    return f"{round(seconds * 1000)}ms"


@dataclass(frozen=True, slots=True)
class HttpCheck:
    url: str
    interval_s: float
    timeout_s: float | None = None
    deregister_critical_after_s: float | None = None
    name: str | None = None
    check_id: str | None = None
    initial_status: HealthStatus | None = None
    method: str | None = None
    tls_skip_verify: bool = False


@dataclass(frozen=True, slots=True)
class TtlCheck:
    ttl_s: float
    deregister_critical_after_s: float | None = None
    name: str | None = None
    check_id: str | None = None
    initial_status: HealthStatus | None = None


Check = HttpCheck | TtlCheck


@dataclass(frozen=True, slots=True)
class ServiceRegistration:
    name: str
    service_id: str | None = None
    address: str | None = None
    port: int | None = None
    tags: tuple[str, ...] = ()
    meta: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    checks: tuple[Check, ...] = ()


def check_payload(check: Check) -> dict[str, Any]:
    payload: dict[str, Any] = {}
    if isinstance(check, HttpCheck):
        payload["HTTP"] = check.url
        payload["Interval"] = go_duration(check.interval_s)
        if check.timeout_s is not None:
            payload["Timeout"] = go_duration(check.timeout_s)
        if check.method:
            payload["Method"] = check.method
        if check.tls_skip_verify:
            payload["TLSSkipVerify"] = True
    else:
        payload["TTL"] = go_duration(check.ttl_s)
    if check.deregister_critical_after_s is not None:
        payload["DeregisterCriticalServiceAfter"] = go_duration(check.deregister_critical_after_s)
    if check.name:
        payload["Name"] = check.name
    if check.check_id:
        payload["CheckID"] = check.check_id
    if check.initial_status:
        payload["Status"] = check.initial_status
    return payload


def service_payload(registration: ServiceRegistration) -> dict[str, Any]:
    """The /v1/agent/service/register body for a registration."""
    payload: dict[str, Any] = {"Name": registration.name}
    if registration.service_id:
        payload["ID"] = registration.service_id
    if registration.address:
        payload["Address"] = registration.address
    if registration.port is not None:
        payload["Port"] = registration.port
    if registration.tags:
        payload["Tags"] = list(registration.tags)
    if registration.meta:
        payload["Meta"] = dict(registration.meta)
    if registration.checks:
        payload["Checks"] = [check_payload(c) for c in registration.checks]
    return payload


# -- the client --------------------------------------------------------------------


class _HttpClient(consul.aio.HTTPClient):  # type: ignore[misc]
    """py-consul's aiohttp client with one proper `ssl=` argument and no total timeout."""

    def __init__(
        self,
        host: str,
        port: int,
        scheme: str,
        *,
        ssl_context: ssl.SSLContext | None,
        connect_timeout_s: float,
    ) -> None:
        consul.base.HTTPClient.__init__(self, host, port, scheme, verify=True, cert=None)
        connector = aiohttp.TCPConnector(ssl=ssl_context if ssl_context is not None else True)
        # Blocking queries run long: each call sets its own deadline instead.
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s)
        self._session = aiohttp.ClientSession(connector=connector, timeout=timeout)


class _Consul(consul.aio.Consul):  # type: ignore[misc]
    def __init__(self, settings: ConsulSettings) -> None:
        self._settings = settings
        super().__init__(
            host=settings.host, port=settings.port, scheme=settings.scheme, verify=True
        )
        # py-consul prefers $CONSUL_HTTP_TOKEN over its argument; settings decide here.
        self.token = settings.token.get_secret_value() if settings.token else None

    def http_connect(
        self,
        host: str,
        port: int,
        scheme: str,
        verify: bool | str = True,  # noqa: ARG002 - TLS comes from the settings instead
        cert: Any = None,  # noqa: ARG002 - same
    ) -> _HttpClient:
        return _HttpClient(
            host,
            port,
            scheme,
            ssl_context=self._settings.ssl_context(),
            connect_timeout_s=self._settings.request_timeout_s,
        )


def _status_of(message: str) -> int | None:
    head = message[:3]
    return int(head) if head.isdigit() else None


def _body_of(message: str) -> str:
    text = message[4:] if _status_of(message) is not None else message
    return text.strip()[:300]


_BAD_REQUEST_500 = ("Invalid Session TTL", "Session TTL", "Invalid Behavior", "missing session")


def map_error(operation: str, exc: BaseException) -> HashiError:
    """The caravan error for a py-consul/aiohttp failure (messages carry no token)."""
    if isinstance(exc, HashiError):
        return exc
    if isinstance(exc, consul_errors.ACLPermissionDenied):
        return HashiPermissionDenied(
            f"consul {operation}: permission denied: {_body_of(str(exc))}", status=403
        )
    if isinstance(exc, consul_errors.ACLDisabled):
        return HashiPermissionDenied(f"consul {operation}: {_body_of(str(exc))}", status=401)
    if isinstance(exc, consul_errors.NotFound):
        return HashiNotFound(f"consul {operation}: not found: {_body_of(str(exc))}", status=404)
    if isinstance(exc, consul_errors.BadRequest):
        return HashiBadRequest(f"consul {operation}: {_body_of(str(exc))}", status=400)
    if isinstance(exc, consul_errors.Timeout):
        return HashiUnavailable(f"consul {operation}: timed out")
    if isinstance(exc, consul_errors.ConsulException):
        status = _status_of(str(exc))
        body = _body_of(str(exc))
        if status == 429:
            return HashiUnavailable(f"consul {operation}: rate limited: {body}", status=status)
        if status == 409:
            return HashiConflict(f"consul {operation}: {body}", status=status)
        if status is not None and 400 <= status < 500:
            return HashiBadRequest(f"consul {operation}: {body}", status=status)
        if "invalid session" in body:
            return HashiNotFound(f"consul {operation}: {body}", status=status)
        if any(marker in body for marker in _BAD_REQUEST_500):
            return HashiBadRequest(f"consul {operation}: {body}", status=status)
        return HashiUnavailable(f"consul {operation}: {body}", status=status)
    if isinstance(exc, TimeoutError):
        return HashiUnavailable(f"consul {operation}: timed out")
    if isinstance(exc, (aiohttp.ClientError, OSError)):
        return HashiUnavailable(f"consul {operation}: {type(exc).__name__}: {exc}")
    return HashiUnavailable(f"consul {operation}: unexpected {type(exc).__name__}")


def _wait_param(wait_s: float | None) -> str | None:
    if wait_s is None:
        return None
    return go_duration(min(max(wait_s, 0.001), MAX_WAIT_S))


class ConsulClient:
    """The Consul API subset caravan uses; one aiohttp session, opened by `async with`."""

    def __init__(self, settings: ConsulSettings) -> None:
        self.settings = settings
        self._consul: _Consul | None = None

    async def __aenter__(self) -> Self:
        self._consul = _Consul(self.settings)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        client, self._consul = self._consul, None
        if client is not None:
            await client.close()

    @property
    def _client(self) -> _Consul:
        if self._consul is None:
            raise RuntimeError("ConsulClient is not open; use `async with ConsulClient(...)`")
        return self._consul

    def _timeout(self, index: int, wait_s: float | None) -> float:
        timeout = self.settings.request_timeout_s
        if index and wait_s is not None:
            wait = min(wait_s, MAX_WAIT_S)
            timeout += wait + wait / JITTER_FRACTION
        elif index:
            timeout += 300.0 + 300.0 / JITTER_FRACTION
        return timeout

    async def _call(
        self, operation: str, call: Callable[[], Awaitable[T]], *, timeout_s: float | None = None
    ) -> T:
        try:
            async with asyncio.timeout(timeout_s or self.settings.request_timeout_s):
                return await call()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            raise map_error(operation, exc) from exc

    # -- health and catalog --------------------------------------------------

    async def health_service(
        self,
        name: str,
        *,
        passing: bool = False,
        tags: tuple[str, ...] = (),
        filter_expr: str | None = None,
        index: int = 0,
        wait_s: float | None = None,
    ) -> tuple[int, tuple[HealthEntry, ...]]:
        client = self._client
        raw_index, raw = await self._call(
            f"health.service {name}",
            lambda: client.health.service(
                name,
                index=str(index) if index else None,
                wait=_wait_param(wait_s),
                passing=passing,
                tag=list(tags) or None,
                filter_expr=filter_expr,
            ),
            timeout_s=self._timeout(index, wait_s),
        )
        return decode_health(raw_index, raw)

    async def catalog_services(
        self, *, index: int = 0, wait_s: float | None = None
    ) -> tuple[int, dict[str, tuple[str, ...]]]:
        client = self._client
        raw_index, raw = await self._call(
            "catalog.services",
            lambda: client.catalog.services(
                index=str(index) if index else None, wait=_wait_param(wait_s)
            ),
            timeout_s=self._timeout(index, wait_s),
        )
        return decode_services(raw_index, raw)

    # -- KV --------------------------------------------------------------------

    async def kv_get(
        self, key: str, *, index: int = 0, wait_s: float | None = None
    ) -> tuple[int, KVEntry | None]:
        client = self._client
        raw_index, raw = await self._call(
            f"kv.get {key}",
            lambda: client.kv.get(
                key, index=str(index) if index else None, wait=_wait_param(wait_s)
            ),
            timeout_s=self._timeout(index, wait_s),
        )
        return decode_kv(raw_index, raw)

    async def kv_get_recurse(
        self, prefix: str, *, index: int = 0, wait_s: float | None = None
    ) -> tuple[int, tuple[KVEntry, ...]]:
        client = self._client
        raw_index, raw = await self._call(
            f"kv.get {prefix} recurse",
            lambda: client.kv.get(
                prefix, recurse=True, index=str(index) if index else None, wait=_wait_param(wait_s)
            ),
            timeout_s=self._timeout(index, wait_s),
        )
        return decode_kv_recurse(raw_index, raw)

    async def kv_keys(
        self,
        prefix: str,
        *,
        separator: str | None = None,
        index: int = 0,
        wait_s: float | None = None,
    ) -> tuple[int, tuple[str, ...]]:
        client = self._client
        raw_index, raw = await self._call(
            f"kv.keys {prefix}",
            lambda: client.kv.get(
                prefix,
                keys=True,
                separator=separator,
                index=str(index) if index else None,
                wait=_wait_param(wait_s),
            ),
            timeout_s=self._timeout(index, wait_s),
        )
        return decode_keys(raw_index, raw)

    async def kv_put(
        self,
        key: str,
        value: bytes | str,
        *,
        cas: int | None = None,
        flags: int | None = None,
        acquire: str | None = None,
        release: str | None = None,
    ) -> bool:
        """Write a key; False when a `cas`/`acquire`/`release` condition did not hold."""
        client = self._client
        result = await self._call(
            f"kv.put {key}",
            lambda: client.kv.put(
                key, value, cas=cas, flags=flags, acquire=acquire, release=release
            ),
        )
        return bool(result)

    async def kv_delete(self, key: str, *, recurse: bool = False, cas: int | None = None) -> bool:
        client = self._client
        result = await self._call(
            f"kv.delete {key}", lambda: client.kv.delete(key, recurse=recurse or None, cas=cas)
        )
        return bool(result)

    async def txn(self, ops: list[TxnOp] | tuple[TxnOp, ...]) -> tuple[KVEntry, ...]:
        """Apply `ops` atomically (PUT /v1/txn): all of them, or none.

        Returns the KV results in operation order (writes and checks without
        their value, gets with it). A failed operation (a lost `cas`, a moved
        `check-index`) raises `TxnConflictError` (retryable: re-read first);
        a refused token raises `HashiPermissionDenied`.

        Posted directly: py-consul's `Txn.put` sends no ACL token.
        """
        if not ops:
            return ()
        if len(ops) > MAX_TXN_OPS:
            raise HashiBadRequest(
                f"consul txn: {len(ops)} operations is more than Consul's limit of {MAX_TXN_OPS}"
            )
        client = self._client
        payload = json.dumps([txn_op_payload(op) for op in ops])
        status, body = await self._call(
            "txn",
            lambda: client.http.put(
                _txn_callback, "/v1/txn", headers=client.prepare_headers(), data=payload
            ),
        )
        return parse_txn_answer(int(status), body)

    # -- sessions ----------------------------------------------------------------

    async def session_create(
        self,
        *,
        name: str,
        ttl_s: float,
        behavior: SessionBehavior = "release",
        lock_delay_s: float = 15.0,
        node: str | None = None,
        node_checks: tuple[str, ...] | None = None,
    ) -> str:
        """Create a TTL session and return its id.

        Posted directly: py-consul's helper only accepts whole-second TTLs of 10s or more.
        """
        body: dict[str, Any] = {
            "Name": name,
            "TTL": go_duration(ttl_s),
            "Behavior": behavior,
            "LockDelay": f"{round(lock_delay_s * 1000)}ms",
        }
        if node:
            body["Node"] = node
        if node_checks is not None:
            body["NodeChecks"] = list(node_checks)
        client = self._client
        session_id = await self._call(
            "session.create",
            lambda: client.http.put(
                CB.json(is_id=True),
                "/v1/session/create",
                headers=client.prepare_headers(),
                data=json.dumps(body),
            ),
        )
        return str(session_id)

    async def session_renew(self, session_id: str) -> SessionInfo:
        """Renew; HashiNotFound when the session is gone (expired or destroyed)."""
        client = self._client
        raw = await self._call("session.renew", lambda: client.session.renew(session_id))
        if not raw:
            raise HashiNotFound("consul session.renew: session not found", status=404)
        return SessionInfo.from_api(raw)

    async def session_destroy(self, session_id: str) -> None:
        client = self._client
        await self._call("session.destroy", lambda: client.session.destroy(session_id))

    async def session_info(
        self, session_id: str, *, index: int = 0, wait_s: float | None = None
    ) -> tuple[int, SessionInfo | None]:
        client = self._client
        raw_index, raw = await self._call(
            "session.info",
            lambda: client.session.info(
                session_id, index=str(index) if index else None, wait=_wait_param(wait_s)
            ),
            timeout_s=self._timeout(index, wait_s),
        )
        return decode_session(raw_index, raw)

    # -- agent -------------------------------------------------------------------

    async def agent_service_register(
        self, registration: ServiceRegistration, *, replace_existing_checks: bool = False
    ) -> None:
        params = [("replace-existing-checks", "true")] if replace_existing_checks else []
        client = self._client
        await self._call(
            f"agent.service.register {registration.name}",
            lambda: client.http.put(
                CB.boolean(),
                "/v1/agent/service/register",
                params=params,
                headers=client.prepare_headers(),
                data=json.dumps(service_payload(registration)),
            ),
        )

    async def agent_service_deregister(self, service_id: str) -> bool:
        """Remove a service from the local agent; False if it was not registered."""
        client = self._client
        result = await self._call(
            "agent.service.deregister", lambda: client.agent.service.deregister(service_id)
        )
        return bool(result)

    async def agent_service_maintenance(
        self, service_id: str, *, enable: bool, reason: str | None = None
    ) -> None:
        client = self._client
        found = await self._call(
            "agent.service.maintenance",
            lambda: client.agent.service.maintenance(
                service_id, "true" if enable else "false", reason=reason
            ),
        )
        if not found:
            raise HashiNotFound(
                f"consul agent.service.maintenance: no service {service_id!r}", status=404
            )

    async def _ttl(self, verb: str, check_id: str, note: str | None) -> None:
        client = self._client
        method = {
            "pass": client.agent.check.ttl_pass,
            "warn": client.agent.check.ttl_warn,
            "fail": client.agent.check.ttl_fail,
        }[verb]
        found = await self._call(f"agent.check.{verb}", lambda: method(check_id, notes=note))
        if not found:
            raise HashiNotFound(f"consul agent.check.{verb}: no check {check_id!r}", status=404)

    async def agent_check_pass(self, check_id: str, note: str | None = None) -> None:
        await self._ttl("pass", check_id, note)

    async def agent_check_warn(self, check_id: str, note: str | None = None) -> None:
        await self._ttl("warn", check_id, note)

    async def agent_check_fail(self, check_id: str, note: str | None = None) -> None:
        await self._ttl("fail", check_id, note)
