"""Decode request bodies the way Nomad's HTTP agent does (facts N1).

Nomad decodes with Go's `encoding/json` into its `api` structs, so:

* keys match field names case-insensitively, and unknown keys are dropped;
* a value of the wrong JSON type is an HTTP 400 carrying Go's message
  (`json: cannot unmarshal string into Go struct field Task.Job.TaskGroups.Tasks.KillTimeout
  of type time.Duration`): every duration is an integer of nanoseconds;
* `null` leaves a field unset.

The result is a plain dict keyed by the canonical Go field names, the shape the
rest of the stand-in (and the read-back API) works with.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass, field
from typing import Any


class DecodeError(ValueError):
    """The body is not what Go's decoder would accept; the text is Go's."""


@dataclass(frozen=True, slots=True)
class Scalar:
    kind: str  # string, bool, int, float, duration, bytes
    go_type: str
    low: int | None = None
    high: int | None = None


@dataclass(frozen=True, slots=True)
class ListOf:
    element: Schema
    pointer: bool = True  # Go's []*T, as most api slices of structs are


@dataclass(frozen=True, slots=True)
class MapOf:
    element: Schema


@dataclass(frozen=True, slots=True)
class AnyJSON:
    go_type: str = "interface {}"


@dataclass(frozen=True, slots=True)
class Struct:
    name: str
    fields: dict[str, Schema] = field(default_factory=dict)
    # The Go package of the type: `api` for most bodies, `structs` where the
    # agent decodes into a server struct (namespaces).
    package: str = "api"

    def lookup(self, key: str) -> str | None:
        if key in self.fields:
            return key
        folded = key.casefold()
        for name in self.fields:
            if name.casefold() == folded:
                return name
        return None


Schema = Scalar | ListOf | MapOf | AnyJSON | Struct

INT64_MAX = 2**63 - 1
STRING = Scalar("string", "string")
BOOL = Scalar("bool", "bool")
INT = Scalar("int", "int", -(2**63), INT64_MAX)
INT64 = Scalar("int", "int64", -(2**63), INT64_MAX)
INT8 = Scalar("int", "int8", -128, 127)
UINT8 = Scalar("int", "uint8", 0, 255)
UINT64 = Scalar("int", "uint64", 0, 2**64 - 1)
FLOAT = Scalar("float", "float64")
DURATION = Scalar("int", "time.Duration", -(2**63), INT64_MAX)
BYTES = Scalar("bytes", "[]uint8")
ANY = AnyJSON()
STRINGS = ListOf(STRING)
STRING_MAP = MapOf(STRING)


def _struct(name: str, **fields: Schema) -> Struct:
    return Struct(name, dict(fields))


CONSTRAINT = _struct("Constraint", LTarget=STRING, RTarget=STRING, Operand=STRING)
AFFINITY = _struct("Affinity", LTarget=STRING, RTarget=STRING, Operand=STRING, Weight=INT8)
SPREAD = _struct(
    "Spread",
    Attribute=STRING,
    Weight=INT8,
    SpreadTarget=ListOf(_struct("SpreadTarget", Value=STRING, Percent=UINT8)),
)
UPDATE = _struct(
    "UpdateStrategy",
    Stagger=DURATION,
    MaxParallel=INT,
    HealthCheck=STRING,
    MinHealthyTime=DURATION,
    HealthyDeadline=DURATION,
    ProgressDeadline=DURATION,
    Canary=INT,
    AutoRevert=BOOL,
    AutoPromote=BOOL,
)
RESCHEDULE = _struct(
    "ReschedulePolicy",
    Attempts=INT,
    Interval=DURATION,
    Delay=DURATION,
    DelayFunction=STRING,
    MaxDelay=DURATION,
    Unlimited=BOOL,
)
MIGRATE = _struct(
    "MigrateStrategy",
    MaxParallel=INT,
    HealthCheck=STRING,
    MinHealthyTime=DURATION,
    HealthyDeadline=DURATION,
)
RESTART = _struct(
    "RestartPolicy",
    Interval=DURATION,
    Attempts=INT,
    Delay=DURATION,
    Mode=STRING,
    RenderTemplates=BOOL,
)
PORT = _struct("Port", Label=STRING, Value=INT, To=INT, HostNetwork=STRING, IgnoreCollision=BOOL)
NETWORK = _struct(
    "NetworkResource",
    Mode=STRING,
    Device=STRING,
    CIDR=STRING,
    IP=STRING,
    DNS=_struct("DNSConfig", Servers=STRINGS, Searches=STRINGS, Options=STRINGS),
    ReservedPorts=ListOf(PORT, pointer=False),
    DynamicPorts=ListOf(PORT, pointer=False),
    Hostname=STRING,
    MBits=INT,
    CNI=_struct("CNIConfig", Args=STRING_MAP),
)
REQUESTED_DEVICE = _struct(
    "RequestedDevice",
    Name=STRING,
    Count=UINT64,
    Constraints=ListOf(CONSTRAINT),
    Affinities=ListOf(AFFINITY),
)
RESOURCES = _struct(
    "Resources",
    CPU=INT,
    Cores=INT,
    MemoryMB=INT,
    MemoryMaxMB=INT,
    DiskMB=INT,
    Networks=ListOf(NETWORK),
    Devices=ListOf(REQUESTED_DEVICE),
    NUMA=_struct("NUMAResource", Affinity=STRING, Devices=STRINGS),
    SecretsMB=INT,
    IOPS=INT,
)
CHECK_RESTART = _struct("CheckRestart", Limit=INT, Grace=DURATION, IgnoreWarnings=BOOL)
SERVICE_CHECK = _struct(
    "ServiceCheck",
    Name=STRING,
    Type=STRING,
    Command=STRING,
    Args=STRINGS,
    Path=STRING,
    Protocol=STRING,
    PortLabel=STRING,
    Expose=BOOL,
    AddressMode=STRING,
    Advertise=STRING,
    Interval=DURATION,
    Timeout=DURATION,
    InitialStatus=STRING,
    Notes=STRING,
    TLSServerName=STRING,
    TLSSkipVerify=BOOL,
    Header=MapOf(STRINGS),
    Method=STRING,
    CheckRestart=CHECK_RESTART,
    GRPCService=STRING,
    GRPCUseTLS=BOOL,
    TaskName=STRING,
    SuccessBeforePassing=INT,
    FailuresBeforeCritical=INT,
    FailuresBeforeWarning=INT,
    Body=STRING,
    OnUpdate=STRING,
)
SERVICE = _struct(
    "Service",
    Name=STRING,
    Tags=STRINGS,
    CanaryTags=STRINGS,
    EnableTagOverride=BOOL,
    PortLabel=STRING,
    AddressMode=STRING,
    Address=STRING,
    Checks=ListOf(SERVICE_CHECK, pointer=False),
    CheckRestart=CHECK_RESTART,
    Connect=ANY,
    Meta=STRING_MAP,
    CanaryMeta=STRING_MAP,
    TaggedAddresses=STRING_MAP,
    TaskName=STRING,
    OnUpdate=STRING,
    Identity=ANY,
    Weights=_struct("ServiceWeights", Passing=INT, Warning=INT),
    Provider=STRING,
    Cluster=STRING,
    Kind=STRING,
)
LOG_CONFIG = _struct("LogConfig", MaxFiles=INT, MaxFileSizeMB=INT, Enabled=BOOL, Disabled=BOOL)
TASK = _struct(
    "Task",
    Name=STRING,
    Driver=STRING,
    User=STRING,
    Lifecycle=_struct("TaskLifecycle", Hook=STRING, Sidecar=BOOL),
    Config=MapOf(ANY),
    Constraints=ListOf(CONSTRAINT),
    Affinities=ListOf(AFFINITY),
    Env=STRING_MAP,
    Services=ListOf(SERVICE),
    Resources=RESOURCES,
    RestartPolicy=RESTART,
    Meta=STRING_MAP,
    KillTimeout=DURATION,
    LogConfig=LOG_CONFIG,
    Artifacts=ListOf(ANY),
    Vault=ANY,
    Consul=ANY,
    Templates=ListOf(ANY),
    DispatchPayload=_struct("DispatchPayloadConfig", File=STRING),
    VolumeMounts=ListOf(ANY),
    CSIPluginConfig=ANY,
    Leader=BOOL,
    ShutdownDelay=DURATION,
    KillSignal=STRING,
    Kind=STRING,
    ScalingPolicies=ListOf(ANY),
    Secrets=ListOf(ANY),
    Identity=ANY,
    Identities=ListOf(ANY),
    Actions=ListOf(ANY),
    Schedule=ANY,
)
SCALING = _struct(
    "ScalingPolicy",
    ID=STRING,
    Namespace=STRING,
    Type=STRING,
    Target=STRING_MAP,
    Min=INT64,
    Max=INT64,
    Policy=MapOf(ANY),
    Enabled=BOOL,
    CreateIndex=UINT64,
    ModifyIndex=UINT64,
)
TASK_GROUP = _struct(
    "TaskGroup",
    Name=STRING,
    Count=INT,
    Constraints=ListOf(CONSTRAINT),
    Affinities=ListOf(AFFINITY),
    Tasks=ListOf(TASK),
    Spreads=ListOf(SPREAD),
    Volumes=MapOf(ANY),
    RestartPolicy=RESTART,
    Disconnect=_struct(
        "DisconnectStrategy",
        LostAfter=DURATION,
        StopOnClientAfter=DURATION,
        Replace=BOOL,
        Reconcile=STRING,
    ),
    ReschedulePolicy=RESCHEDULE,
    EphemeralDisk=_struct("EphemeralDisk", Sticky=BOOL, Migrate=BOOL, SizeMB=INT),
    Update=UPDATE,
    Migrate=MIGRATE,
    Networks=ListOf(NETWORK),
    Meta=STRING_MAP,
    Services=ListOf(SERVICE),
    ShutdownDelay=DURATION,
    MaxRunDuration=DURATION,
    StopAfterClientDisconnect=DURATION,
    MaxClientDisconnect=DURATION,
    Scaling=SCALING,
    Consul=ANY,
    PreventRescheduleOnLost=BOOL,
)
JOB = _struct(
    "Job",
    Region=STRING,
    Namespace=STRING,
    ID=STRING,
    Name=STRING,
    Type=STRING,
    Priority=INT,
    AllAtOnce=BOOL,
    Datacenters=STRINGS,
    NodePool=STRING,
    Constraints=ListOf(CONSTRAINT),
    Affinities=ListOf(AFFINITY),
    TaskGroups=ListOf(TASK_GROUP),
    Update=UPDATE,
    Multiregion=ANY,
    Spreads=ListOf(SPREAD),
    Periodic=ANY,
    ParameterizedJob=ANY,
    Reschedule=RESCHEDULE,
    Migrate=MIGRATE,
    Meta=STRING_MAP,
    UI=ANY,
    Stop=BOOL,
    ParentID=STRING,
    Dispatched=BOOL,
    DispatchIdempotencyToken=STRING,
    Payload=BYTES,
    ConsulNamespace=STRING,
    VaultNamespace=STRING,
    NomadTokenID=STRING,
    Status=STRING,
    StatusDescription=STRING,
    Stable=BOOL,
    Version=UINT64,
    SubmitTime=INT64,
    CreateIndex=UINT64,
    ModifyIndex=UINT64,
    JobModifyIndex=UINT64,
    VersionTag=ANY,
)
_WRITE_REQUEST = {
    "Region": STRING,
    "Namespace": STRING,
    "SecretID": STRING,
    "IdempotencyToken": STRING,
}
JOB_REGISTER_REQUEST = Struct(
    "JobRegisterRequest",
    {
        "Submission": ANY,
        "Job": JOB,
        "EnforceIndex": BOOL,
        "JobModifyIndex": UINT64,
        "PolicyOverride": BOOL,
        "PreserveCounts": BOOL,
        "PreserveResources": BOOL,
        "EvalPriority": INT,
        **_WRITE_REQUEST,
    },
)
JOB_PLAN_REQUEST = Struct(
    "JobPlanRequest", {"Job": JOB, "Diff": BOOL, "PolicyOverride": BOOL, **_WRITE_REQUEST}
)
JOB_VALIDATE_REQUEST = Struct("JobValidateRequest", {"Job": JOB, **_WRITE_REQUEST})
NODE_DRAIN_REQUEST = _struct(
    "NodeUpdateDrainRequest",
    NodeID=STRING,
    DrainSpec=_struct("DrainSpec", Deadline=DURATION, IgnoreSystemJobs=BOOL),
    MarkEligible=BOOL,
    Meta=STRING_MAP,
)
NODE_ELIGIBILITY_REQUEST = _struct(
    "NodeUpdateEligibilityRequest", NodeID=STRING, Eligibility=STRING
)
JOB_REVERT_REQUEST = Struct(
    "JobRevertRequest",
    {"JobID": STRING, "JobVersion": UINT64, "EnforcePriorVersion": UINT64, **_WRITE_REQUEST},
)
JOB_STABILITY_REQUEST = Struct(
    "JobStabilityRequest",
    {"JobID": STRING, "JobVersion": UINT64, "Stable": BOOL, **_WRITE_REQUEST},
)
JOB_DISPATCH_REQUEST = Struct(
    "JobDispatchRequest",
    {
        "JobID": STRING,
        "Payload": BYTES,
        "Meta": STRING_MAP,
        "IdPrefixTemplate": STRING,
        "Priority": INT,
        **_WRITE_REQUEST,
    },
)
DEPLOYMENT_PAUSE_REQUEST = Struct(
    "DeploymentPauseRequest", {"DeploymentID": STRING, "Pause": BOOL, **_WRITE_REQUEST}
)
DEPLOYMENT_PROMOTE_REQUEST = Struct(
    "DeploymentPromoteRequest",
    {"DeploymentID": STRING, "All": BOOL, "Groups": STRINGS, **_WRITE_REQUEST},
)
DEPLOYMENT_ALLOC_HEALTH_REQUEST = Struct(
    "DeploymentAllocHealthRequest",
    {
        "DeploymentID": STRING,
        "HealthyAllocationIDs": STRINGS,
        "UnhealthyAllocationIDs": STRINGS,
        **_WRITE_REQUEST,
    },
)
JOBS_PARSE_REQUEST = _struct(
    "JobsParseRequest", JobHCL=STRING, HCLv1=BOOL, Variables=ANY, Canonicalize=BOOL
)


@dataclass(frozen=True, slots=True)
class _Number:
    """A JSON number kept as its source text, so integer rules can be Go's."""

    text: str

    def as_python(self) -> int | float:
        try:
            return int(self.text)
        except ValueError:
            value = float(self.text)
            return int(value) if value.is_integer() and abs(value) < 2**53 else value


def _json_kind(value: Any) -> str:
    if isinstance(value, str):
        return "string"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, _Number):
        return f"number {value.text}"
    if isinstance(value, list):
        return "array"
    return "object"


def _type_name(schema: Schema) -> str:
    match schema:
        case Scalar(go_type=go_type):
            return go_type
        case ListOf(element=element, pointer=pointer):
            star = "*" if pointer and isinstance(element, Struct) else ""
            return f"[]{star}{_type_name(element)}"
        case MapOf(element=element):
            star = "*" if isinstance(element, Struct) else ""
            return f"map[string]{star}{_type_name(element)}"
        case AnyJSON(go_type=go_type):
            return go_type
        case Struct(name=name, package=package):
            return f"{package}.{name}"


@dataclass(slots=True)
class _Context:
    struct: str
    path: list[str]


def _type_error(value: Any, schema: Schema, context: _Context) -> DecodeError:
    kind = _json_kind(value)
    if kind.startswith("number ") and not (isinstance(schema, Scalar) and schema.kind == "int"):
        kind = "number"
    where = ".".join(context.path)
    return DecodeError(
        f"json: cannot unmarshal {kind} into Go struct field {context.struct}.{where} "
        f"of type {_type_name(schema)}"
    )


def _decode_scalar(value: Any, schema: Scalar, context: _Context) -> Any:
    match schema.kind:
        case "string":
            if not isinstance(value, str):
                raise _type_error(value, schema, context)
            return value
        case "bool":
            if not isinstance(value, bool):
                raise _type_error(value, schema, context)
            return value
        case "float":
            if not isinstance(value, _Number):
                raise _type_error(value, schema, context)
            return float(value.text)
        case "bytes":
            if not isinstance(value, str):
                raise _type_error(value, schema, context)
            try:
                return base64.b64decode(value, validate=True).decode("latin-1")
            except (binascii.Error, ValueError):
                raise DecodeError("illegal base64 data at input byte 0") from None
        case _:
            if not isinstance(value, _Number):
                raise _type_error(value, schema, context)
            try:
                number = int(value.text)
            except ValueError:
                raise _type_error(value, schema, context) from None
            low = schema.low if schema.low is not None else -(2**63)
            high = schema.high if schema.high is not None else INT64_MAX
            if not low <= number <= high:
                raise _type_error(value, schema, context)
            return number


def _plain(value: Any) -> Any:
    """A decoded free-form value (task Config): numbers become int or float."""
    if isinstance(value, _Number):
        return value.as_python()
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    return value


def _decode(value: Any, schema: Schema, context: _Context) -> Any:
    if value is None:
        return None
    match schema:
        case AnyJSON():
            return _plain(value)
        case Scalar():
            return _decode_scalar(value, schema, context)
        case ListOf(element=element):
            if not isinstance(value, list):
                raise _type_error(value, schema, context)
            return [_decode(item, element, context) for item in value]
        case MapOf(element=element):
            if not isinstance(value, dict):
                raise _type_error(value, schema, context)
            return {key: _decode(item, element, context) for key, item in value.items()}
        case Struct():
            if not isinstance(value, dict):
                raise _type_error(value, schema, context)
            return _decode_struct(value, schema, context)


def _decode_struct(value: dict[str, Any], schema: Struct, context: _Context) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, item in value.items():
        name = schema.lookup(key)
        if name is None:
            continue  # Go's decoder drops keys it has no field for
        inner = _Context(schema.name, [*context.path, name])
        decoded = _decode(item, schema.fields[name], inner)
        if decoded is not None:
            out[name] = decoded
    return out


def _pairs_hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # Later duplicates win, as in Go.
    return dict(pairs)


def parse_json(body: bytes) -> Any:
    """JSON text to Python, numbers kept as text; Go-like syntax errors."""
    text = body.decode("utf-8", errors="replace")
    if not text.strip():
        raise DecodeError("Request body is empty")
    try:
        return json.loads(
            text,
            parse_int=_Number,
            parse_float=_Number,
            parse_constant=lambda name: _raise_invalid(name[0]),
            object_pairs_hook=_pairs_hook,
        )
    except json.JSONDecodeError as exc:
        if exc.pos >= len(text.rstrip()):
            raise DecodeError("unexpected EOF") from None
        char = text[exc.pos]
        if exc.msg.startswith("Extra data"):
            raise DecodeError(f"invalid character {char!r} after top-level value") from None
        raise DecodeError(f"invalid character {char!r} looking for beginning of value") from None


def _raise_invalid(char: str) -> Any:
    raise DecodeError(f"invalid character {char!r} looking for beginning of value")


def decode_body(body: bytes, schema: Struct) -> dict[str, Any]:
    """Decode a request body into `schema`, as Go's `json.Decoder.Decode` would."""
    document = parse_json(body)
    if document is None:
        return {}
    if not isinstance(document, dict):
        raise DecodeError(
            f"json: cannot unmarshal {_json_kind(document).split(' ')[0]} "
            f"into Go value of type {schema.package}.{schema.name}"
        )
    return _decode_struct(document, schema, _Context(schema.name, []))


def decode_value(document: Any, schema: Struct) -> dict[str, Any]:
    """Decode an already-parsed JSON object (plain Python values) into `schema`."""
    text = json.dumps(document).encode()
    return decode_body(text, schema)
