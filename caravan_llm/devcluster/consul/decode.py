"""Request bodies decoded the way Consul's Go handlers decode them.

Consul decodes bodies with `encoding/json` and `DisallowUnknownFields`:
keys match field names case-insensitively, a few snake_case aliases are
accepted, unknown keys and wrong JSON types are 400 `Request decode failed:
<Go error text>`. Durations inside checks accept Go duration strings or
nanosecond numbers. This module holds the field tables and one decoder
over them; handlers get plain dicts keyed by the Go field name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import Enum
from typing import Any

from caravan_llm.devcluster.consul.durations import parse_go_duration_ns


class Kind(Enum):
    STRING = "string"
    INT = "int"
    UINT = "uint64"
    BOOL = "bool"
    DURATION = "duration"  # string (Go duration) or number (ns)
    STRING_LIST = "[]string"
    STRING_MAP = "map[string]string"
    STRING_LIST_MAP = "map[string][]string"
    ANY = "interface {}"
    OBJECT = "object"  # any JSON object (or null), kept as decoded; Field.go_type names it
    STRUCT = "struct"
    STRUCT_LIST = "[]struct"
    STRUCT_MAP = "map[string]struct"


@dataclass(frozen=True, slots=True)
class Field:
    name: str
    kind: Kind
    struct: StructSpec | None = None
    aliases: tuple[str, ...] = ()
    # The Go type printed in type errors, where the kind alone does not say it.
    go_type: str = ""


@dataclass(frozen=True, slots=True)
class StructSpec:
    go_name: str
    fields: tuple[Field, ...]

    def lookup(self, key: str) -> Field | None:
        """The field a JSON key lands in: exact name or alias first, then case-insensitively."""
        for field in self.fields:
            if key == field.name or key in field.aliases:
                return field
        folded = key.casefold()
        for field in self.fields:
            if folded == field.name.casefold() or folded in (a.casefold() for a in field.aliases):
                return field
        return None


class DecodeError(ValueError):
    """The body is not what the Go struct accepts; the text is Go's error text."""


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return "null"


def _mismatch(
    value: Any, spec: StructSpec, field: Field, *, go_type: str = "", path: str = ""
) -> DecodeError:
    """Go's UnmarshalTypeError text: innermost struct, then the field path from the top."""
    if not go_type:
        go_type = field.go_type
    if not go_type:
        go_type = field.struct.go_name if field.struct is not None else field.kind.value
        if field.kind is Kind.STRUCT_LIST:
            go_type = f"[]{go_type}"
    return DecodeError(
        f"json: cannot unmarshal {_json_type(value)} into Go struct field "
        f"{spec.go_name}.{path}{field.name} of type {go_type}"
    )


def _decode_struct_map(value: Any, spec: StructSpec, field: Field) -> dict[str, dict[str, Any]]:
    """map[string]<struct>: any keys; each value decoded into the struct (null = zero value).

    Go's error context does not name map keys: a bad `Port` under
    `TaggedAddresses.lan` is `<Struct>.TaggedAddresses.Port`.
    """
    struct = field.struct
    if struct is None:  # pragma: no cover - table error
        raise AssertionError(f"field {field.name} needs a struct spec")
    if not isinstance(value, dict):
        raise _mismatch(value, spec, field)
    out: dict[str, dict[str, Any]] = {}
    for key, item in value.items():
        if item is None:
            out[key] = {}
            continue
        if not isinstance(item, dict):
            raise _mismatch(item, spec, field, go_type=f"structs.{struct.go_name}")
        out[key] = decode_struct(item, struct, path=f"{field.name}.")
    return out


def _decode_value(value: Any, spec: StructSpec, field: Field, path: str = "") -> Any:
    kind = field.kind
    if value is None and kind is not Kind.DURATION:
        return None
    if kind is Kind.STRING:
        if not isinstance(value, str):
            raise _mismatch(value, spec, field, path=path)
        return value
    if kind in (Kind.INT, Kind.UINT):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _mismatch(value, spec, field, path=path)
        if isinstance(value, float) and not value.is_integer():
            raise DecodeError(
                f"json: cannot unmarshal number {value} into Go struct field "
                f"{spec.go_name}.{path}{field.name} of type {kind.value}"
            )
        if kind is Kind.UINT and value < 0:
            raise DecodeError(
                f"json: cannot unmarshal number {value} into Go struct field "
                f"{spec.go_name}.{path}{field.name} of type uint64"
            )
        return int(value)
    if kind is Kind.BOOL:
        if not isinstance(value, bool):
            raise _mismatch(value, spec, field, path=path)
        return value
    if kind is Kind.DURATION:
        # Consul's CheckType.UnmarshalJSON switches on the JSON type: strings are
        # Go durations, numbers are nanoseconds, anything else is ignored.
        if isinstance(value, str):
            try:
                return parse_go_duration_ns(value)
            except ValueError as exc:
                raise DecodeError(str(exc)) from exc
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return int(value)
        return None
    if kind is Kind.STRING_LIST:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise _mismatch(value, spec, field, path=path)
        return list(value)
    if kind is Kind.STRING_MAP:
        if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
            raise _mismatch(value, spec, field, path=path)
        return dict(value)
    if kind is Kind.STRING_LIST_MAP:
        if not isinstance(value, dict) or not all(
            isinstance(v, list) and all(isinstance(s, str) for s in v) for v in value.values()
        ):
            raise _mismatch(value, spec, field, path=path)
        return {k: list(v) for k, v in value.items()}
    if kind is Kind.ANY:
        return value
    if kind is Kind.OBJECT:
        if not isinstance(value, dict):
            raise _mismatch(value, spec, field, path=path)
        return value
    if kind is Kind.STRUCT_MAP:
        return _decode_struct_map(value, spec, field)
    if field.struct is None:  # pragma: no cover - table error
        raise AssertionError(f"field {field.name} of kind {kind} needs a struct spec")
    if kind is Kind.STRUCT:
        if not isinstance(value, dict):
            raise _mismatch(value, spec, field, path=path)
        return decode_struct(value, field.struct)
    if not isinstance(value, list):
        raise _mismatch(value, spec, field, path=path)
    items: list[dict[str, Any]] = []
    for item in value:
        if item is None:
            continue
        if not isinstance(item, dict):
            raise _mismatch(item, spec, field, path=path)
        items.append(decode_struct(item, field.struct))
    return items


def decode_struct(data: dict[str, Any], spec: StructSpec, *, path: str = "") -> dict[str, Any]:
    """Decode one JSON object into {Go field name: value}; later duplicate keys win, as in Go.

    `path` is the field path above this struct, for Go's error texts.
    """
    out: dict[str, Any] = {}
    for key, value in data.items():
        field = spec.lookup(key)
        if field is None:
            raise DecodeError(f'json: unknown field "{key}"')
        decoded = _decode_value(value, spec, field, path)
        if decoded is not None:
            out[field.name] = decoded
    return out


def _syntax_error(body: str, exc: json.JSONDecodeError) -> DecodeError:
    if exc.pos >= len(body.rstrip()):
        return DecodeError("unexpected EOF")
    return DecodeError(f"invalid character {body[exc.pos]!r} looking for beginning of value")


def decode_body(raw: bytes, spec: StructSpec, go_type: str) -> dict[str, Any]:
    """Decode a request body like `lib.DecodeJSON(body, &out)` does for `go_type`."""
    body = raw.decode("utf-8", errors="replace")
    if not body.strip():
        raise DecodeError("EOF")
    try:
        data = json.loads(body)
    except json.JSONDecodeError as exc:
        raise _syntax_error(body, exc) from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise DecodeError(
            f"json: cannot unmarshal {_json_type(data)} into Go value of type {go_type}"
        )
    return decode_struct(data, spec)


def _fields(*fields: Field) -> tuple[Field, ...]:
    return fields


CHECK_TYPE = StructSpec(
    "CheckType",
    _fields(
        Field("CheckID", Kind.STRING),
        Field("Name", Kind.STRING),
        Field("Status", Kind.STRING),
        Field("Notes", Kind.STRING),
        Field("ScriptArgs", Kind.STRING_LIST, aliases=("args", "script_args")),
        Field("HTTP", Kind.STRING),
        Field("H2PING", Kind.STRING),
        Field("H2PingUseTLS", Kind.BOOL, aliases=("h2ping_use_tls",)),
        Field("Header", Kind.STRING_LIST_MAP),
        Field("Method", Kind.STRING),
        Field("Body", Kind.STRING),
        Field("DisableRedirects", Kind.BOOL),
        Field("TCP", Kind.STRING),
        Field("TCPUseTLS", Kind.BOOL),
        Field("UDP", Kind.STRING),
        Field("Interval", Kind.DURATION),
        Field("AliasNode", Kind.STRING),
        Field("AliasService", Kind.STRING),
        Field("DockerContainerID", Kind.STRING, aliases=("docker_container_id",)),
        Field("Shell", Kind.STRING),
        Field("GRPC", Kind.STRING),
        Field("GRPCUseTLS", Kind.BOOL, aliases=("grpc_use_tls",)),
        Field("OSService", Kind.STRING),
        Field("TLSServerName", Kind.STRING, aliases=("tls_server_name",)),
        Field("TLSSkipVerify", Kind.BOOL, aliases=("tls_skip_verify",)),
        Field("Timeout", Kind.DURATION),
        Field("TTL", Kind.DURATION),
        Field("SuccessBeforePassing", Kind.INT),
        Field("FailuresBeforeWarning", Kind.INT),
        Field("FailuresBeforeCritical", Kind.INT),
        Field("ProxyHTTP", Kind.STRING),
        Field("ProxyGRPC", Kind.STRING),
        Field(
            "DeregisterCriticalServiceAfter",
            Kind.DURATION,
            aliases=("deregister_critical_service_after",),
        ),
        Field("OutputMaxSize", Kind.INT),
        # Accepted and ignored by Consul's CheckType decoder.
        Field("ServiceID", Kind.STRING, aliases=("service_id",)),
    ),
)

# /v1/agent/check/register: a CheckDefinition (ID, ServiceID, Token + the check type).
CHECK_DEFINITION = StructSpec(
    "CheckDefinition",
    (
        Field("ID", Kind.STRING),
        Field("ServiceID", Kind.STRING, aliases=("service_id",)),
        Field("Token", Kind.STRING),
        Field("Namespace", Kind.STRING),
        Field("Partition", Kind.STRING),
        *(f for f in CHECK_TYPE.fields if f.name != "ServiceID"),
    ),
)

WEIGHTS = StructSpec("Weights", _fields(Field("Passing", Kind.INT), Field("Warning", Kind.INT)))

SERVICE_ADDRESS = StructSpec(
    "ServiceAddress", _fields(Field("Address", Kind.STRING), Field("Port", Kind.INT))
)

LOCALITY = StructSpec("Locality", _fields(Field("Region", Kind.STRING), Field("Zone", Kind.STRING)))

SERVICE_DEFINITION = StructSpec(
    "ServiceDefinition",
    _fields(
        Field("Kind", Kind.STRING),
        Field("ID", Kind.STRING),
        Field("Name", Kind.STRING),
        Field("Tags", Kind.STRING_LIST),
        Field("Address", Kind.STRING),
        Field(
            "TaggedAddresses",
            Kind.STRUCT_MAP,
            struct=SERVICE_ADDRESS,
            aliases=("tagged_addresses",),
            go_type="map[string]structs.ServiceAddress",
        ),
        Field("Meta", Kind.STRING_MAP),
        Field("Port", Kind.INT),
        Field("SocketPath", Kind.STRING, aliases=("socket_path",)),
        Field("Check", Kind.STRUCT, struct=CHECK_TYPE),
        Field("Checks", Kind.STRUCT_LIST, struct=CHECK_TYPE),
        Field("Weights", Kind.STRUCT, struct=WEIGHTS),
        Field("Token", Kind.STRING),
        Field("EnableTagOverride", Kind.BOOL, aliases=("enable_tag_override",)),
        # Decoded for their JSON type only; definitions.py refuses any content.
        Field("Proxy", Kind.OBJECT, go_type="structs.ConnectProxyConfig"),
        Field("Connect", Kind.OBJECT, go_type="structs.ServiceConnect"),
        Field("Locality", Kind.STRUCT, struct=LOCALITY, go_type="structs.Locality"),
        Field("Namespace", Kind.STRING),
        Field("Partition", Kind.STRING),
    ),
)

CHECK_UPDATE = StructSpec(
    "checkUpdate", _fields(Field("Status", Kind.STRING), Field("Output", Kind.STRING))
)

SERVICE_CHECK_REF = StructSpec(
    "ServiceCheck", _fields(Field("ID", Kind.STRING), Field("Namespace", Kind.STRING))
)

SESSION = StructSpec(
    "Session",
    _fields(
        Field("ID", Kind.STRING),
        Field("Name", Kind.STRING),
        Field("Node", Kind.STRING),
        # LockDelay has its own decoding rule (numbers below 1000 mean seconds).
        Field("LockDelay", Kind.ANY),
        Field("Behavior", Kind.STRING),
        Field("TTL", Kind.STRING),
        Field("NodeChecks", Kind.STRING_LIST),
        Field("ServiceChecks", Kind.STRUCT_LIST, struct=SERVICE_CHECK_REF),
        Field("Checks", Kind.STRING_LIST),
        Field("Namespace", Kind.STRING),
        Field("Partition", Kind.STRING),
        Field("CreateIndex", Kind.UINT),
        Field("ModifyIndex", Kind.UINT),
    ),
)

DEVCLUSTER_NODE = StructSpec(
    "devclusterNode",
    _fields(
        Field("Node", Kind.STRING),
        Field("Address", Kind.STRING),
        Field("Meta", Kind.STRING_MAP),
    ),
)
