"""Turn decoded registration bodies into rows, with Consul's validation and messages."""

from __future__ import annotations

import ipaddress
import re
from typing import Any

from caravan_llm.devcluster.consul.records import (
    STATUSES,
    CheckSpec,
    Locality,
    ServiceAddress,
    ServiceRecord,
    Status,
)

NANOS = 1_000_000_000
MIN_CHECK_INTERVAL_S = 1.0  # the agent raises shorter intervals to 1s (checks.MinInterval)
META_KEY = re.compile(r"^[a-zA-Z0-9_-]+$")
META_MAX_PAIRS = 64
META_KEY_MAX = 128
META_VALUE_MAX = 512
# Service kinds that only make sense with Connect (structs.ServiceKind*).
MESH_KINDS = frozenset(
    {
        "connect-proxy",
        "mesh-gateway",
        "terminating-gateway",
        "ingress-gateway",
        "api-gateway",
        "destination",
    }
)
MESH_REFUSED = (
    "devcluster does not emulate Connect (service mesh), so it refuses {what} instead of "
    "storing a registration it cannot honour; register without it (see devcluster/README.md)"
)
SCRIPTS_DISABLED = (
    "Scripts are disabled on this agent from remote calls; "
    "to enable, configure 'enable_script_checks' to true"
)


class DefinitionError(ValueError):
    """The definition is invalid; `status` is what Consul answers (400 unless noted)."""

    def __init__(self, message: str, *, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def is_any_address(address: str) -> bool:
    """0.0.0.0, :: and [::] are refused as a service address (ipaddr.IsAny)."""
    candidate = address.strip("[]")
    try:
        return ipaddress.ip_address(candidate).is_unspecified
    except ValueError:
        return False


def check_type_of(check: dict[str, Any]) -> str:
    """Consul's CheckType.Type(): the first matching kind in Consul's order."""
    interval = check.get("Interval", 0) > 0
    if check.get("GRPC") and interval:
        return "grpc"
    if check.get("HTTP") and interval:
        return "http"
    if check.get("TTL", 0) > 0:
        return "ttl"
    if check.get("TCP") and interval:
        return "tcp"
    if check.get("UDP") and interval:
        return "udp"
    if check.get("AliasNode") or check.get("AliasService"):
        return "alias"
    if check.get("ScriptArgs") and check.get("DockerContainerID") and interval:
        return "docker"
    if check.get("ScriptArgs") and interval:
        return "script"
    if check.get("H2PING") and interval:
        return "h2ping"
    if check.get("OSService") and interval:
        return "os_service"
    return ""


def validate_check_type(check: dict[str, Any]) -> None:
    """CheckType.Validate(), word for word."""
    interval = check.get("Interval", 0)
    ttl = check.get("TTL", 0)
    interval_check = any(
        check.get(k) for k in ("ScriptArgs", "HTTP", "TCP", "UDP", "GRPC", "H2PING", "OSService")
    )
    alias = bool(check.get("AliasNode") or check.get("AliasService"))
    if interval > 0 and ttl > 0:
        raise DefinitionError("Interval and TTL cannot both be specified")
    if interval_check and interval <= 0:
        raise DefinitionError(
            "Interval must be > 0 for Script, HTTP, H2PING, TCP, UDP or OSService checks"
        )
    if interval_check and alias:
        raise DefinitionError("Interval cannot be set for Alias checks")
    if alias and ttl > 0:
        raise DefinitionError("TTL must be not be set for Alias checks")
    if not interval_check and not alias and ttl <= 0:
        raise DefinitionError("TTL must be > 0 for TTL checks")
    if check.get("OutputMaxSize", 0) < 0:
        raise DefinitionError("MaxOutputMaxSize must be positive")
    if check.get("FailuresBeforeWarning", 0) > check.get("FailuresBeforeCritical", 0):
        raise DefinitionError("FailuresBeforeWarning can't be higher than FailuresBeforeCritical")


def _status(value: str) -> Status | None:
    for status in STATUSES:
        if value == status:
            return status
    return None


def check_spec(
    check: dict[str, Any], *, check_id: str, name: str, service_id: str = ""
) -> CheckSpec:
    check_type = check_type_of(check)
    if check_type in ("script", "docker"):
        raise DefinitionError(SCRIPTS_DISABLED, status=500)
    interval_s = check.get("Interval", 0) / NANOS
    if interval_s > 0:
        interval_s = max(interval_s, MIN_CHECK_INTERVAL_S)
    return CheckSpec(
        check_id=check_id,
        name=name,
        check_type=check_type,
        notes=check.get("Notes", ""),
        initial_status=_status(check.get("Status", "")),
        service_id=service_id,
        http=check.get("HTTP", ""),
        method=check.get("Method", ""),
        header=check.get("Header", {}),
        body=check.get("Body", ""),
        disable_redirects=check.get("DisableRedirects", False),
        tls_skip_verify=check.get("TLSSkipVerify", False),
        tls_server_name=check.get("TLSServerName", ""),
        tcp=check.get("TCP", ""),
        udp=check.get("UDP", ""),
        grpc=check.get("GRPC", ""),
        grpc_use_tls=check.get("GRPCUseTLS", False),
        h2ping=check.get("H2PING", ""),
        script_args=tuple(check.get("ScriptArgs", ())),
        interval_s=interval_s,
        timeout_s=check.get("Timeout", 0) / NANOS,
        ttl_s=check.get("TTL", 0) / NANOS,
        deregister_critical_after_s=check.get("DeregisterCriticalServiceAfter", 0) / NANOS,
        success_before_passing=check.get("SuccessBeforePassing", 0),
        failures_before_warning=check.get("FailuresBeforeWarning", 0),
        failures_before_critical=check.get("FailuresBeforeCritical", 0),
        output_max_size=check.get("OutputMaxSize", 0) or 4096,
    )


def parse_go_ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """Go's net.ParseIP: an IPv4 or IPv6 literal, no zone, no brackets; None otherwise."""
    if "%" in text:
        return None
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


def is_go_ipv4(ip: ipaddress.IPv4Address | ipaddress.IPv6Address | None) -> bool:
    """ip.To4() != nil: IPv4, or IPv6 written as an IPv4-mapped address."""
    if isinstance(ip, ipaddress.IPv6Address):
        return ip.ipv4_mapped is not None
    return ip is not None


def _validate_tagged_addresses(tagged: dict[str, ServiceAddress]) -> None:
    """Agent.validateService's tagged address rules (an AddService error, so HTTP 500).

    Consul checks `lan_ipv6` twice and `wan_ipv6` never; so does this.
    """
    rules = (("lan_ipv4", True), ("wan_ipv4", True), ("lan_ipv6", False), ("lan_ipv6", False))
    for key, want_v4 in rules:
        if key not in tagged:
            continue
        ip = parse_go_ip(tagged[key].address)
        if ip is None or is_go_ipv4(ip) is not want_v4:
            family = "ipv4" if want_v4 else "ipv6"
            raise DefinitionError(
                f'Service tagged address "{key}" must be a valid {family} address', status=500
            )


def _with_default_tagged_addresses(
    tagged: dict[str, ServiceAddress], address: str, port: int
) -> dict[str, ServiceAddress]:
    """addServiceInternal: an IP-literal address adds lan/wan entries for its family."""
    ip = parse_go_ip(address)
    if ip is None:
        return tagged
    family = "ipv4" if is_go_ipv4(ip) else "ipv6"
    out = dict(tagged)
    for key in (f"lan_{family}", f"wan_{family}"):
        out.setdefault(key, ServiceAddress(address=address, port=port))
    return out


def _set_keys(value: Any, prefix: str) -> list[str]:
    """The dotted keys of a decoded JSON object that hold something other than a zero value."""
    if isinstance(value, dict):
        keys: list[str] = []
        for key, item in value.items():
            keys.extend(_set_keys(item, f"{prefix}.{key}"))
        return keys
    if value in (None, False, 0, "", []):
        return []
    return [prefix]


_CONNECT_POINTERS = frozenset({"sidecarservice", "sidecar_service", "peermeta"})


def _refuse_mesh(definition: dict[str, Any]) -> None:
    """Connect, Proxy and mesh kinds are refused (400); empty or zero-valued ones are ignored.

    Go decodes `"Connect": {}` or `{"Native": false}` to the zero value, the same as
    leaving it out, so those register as a plain service would. The pointers in
    ServiceConnect are the exception: any non-null value, even `{}`, asks for a sidecar.
    """
    kind = definition.get("Kind", "")
    if kind in MESH_KINDS:
        raise DefinitionError(MESH_REFUSED.format(what=f'Kind "{kind}"'))
    connect = definition.get("Connect") or {}
    keys = {
        *_set_keys(connect, "Connect"),
        *(
            f"Connect.{key}"
            for key, value in connect.items()
            if key.casefold() in _CONNECT_POINTERS and value is not None
        ),
        *_set_keys(definition.get("Proxy"), "Proxy"),
    }
    if keys:
        raise DefinitionError(MESH_REFUSED.format(what=", ".join(sorted(keys))))


def _validate_meta(meta: dict[str, str]) -> None:
    if len(meta) > META_MAX_PAIRS:
        raise DefinitionError(
            f"Invalid Service Meta: Node metadata cannot contain more than {META_MAX_PAIRS} "
            "key/value pairs"
        )
    for key, value in meta.items():
        problem = None
        if not key:
            problem = "Key cannot be blank"
        elif not META_KEY.match(key):
            problem = "Key contains invalid characters"
        elif len(key) > META_KEY_MAX:
            problem = f"Key is too long (limit: {META_KEY_MAX} characters)"
        elif key.startswith("consul-"):
            problem = "Key prefix 'consul-' is reserved for internal use"
        elif len(value) > META_VALUE_MAX:
            problem = f"Value is too long (limit: {META_VALUE_MAX} characters)"
        if problem is not None:
            raise DefinitionError(
                f"Invalid Service Meta: Couldn't load metadata pair ('{key}', '{value}'): {problem}"
            )


def service_definition(
    definition: dict[str, Any], node: str
) -> tuple[ServiceRecord, list[CheckSpec]]:
    """Validate a ServiceDefinition in AgentRegisterService's order and build its rows."""
    name = definition.get("Name", "")
    if not name:
        raise DefinitionError("Missing service name")
    address = definition.get("Address", "")
    if is_any_address(address):
        raise DefinitionError("Invalid service address")
    weights = definition.get("Weights")
    passing, warning = 1, 1
    if weights is not None:
        passing, warning = weights.get("Passing", 0), weights.get("Warning", 0)
        if passing < 1:
            raise DefinitionError("Invalid Weights: Passing must be greater than 0")
        if warning < 0:
            raise DefinitionError("Invalid Weights: Warning must be greater or equal than 0")
    meta = definition.get("Meta", {})
    _validate_meta(meta)
    _refuse_mesh(definition)
    raw_checks = []
    if definition.get("Check"):
        raw_checks.append(definition["Check"])
    raw_checks.extend(c for c in definition.get("Checks", []) if c)
    for check in raw_checks:
        try:
            validate_check_type(check)
        except DefinitionError as exc:
            raise DefinitionError(f"Invalid check: {exc}") from exc
    for check in raw_checks:
        if check.get("Status") and _status(check["Status"]) is None:
            raise DefinitionError("Status for checks must 'passing', 'warning', 'critical'")
    service_id = definition.get("ID") or name
    tagged = {
        key: ServiceAddress(address=value.get("Address", ""), port=value.get("Port", 0))
        for key, value in definition.get("TaggedAddresses", {}).items()
    }
    _validate_tagged_addresses(tagged)
    port = definition.get("Port", 0)
    raw_locality = definition.get("Locality")
    service = ServiceRecord(
        node=node,
        service_id=service_id,
        name=name,
        tags=tuple(definition.get("Tags", ())),
        address=address,
        port=port,
        meta=dict(meta),
        tagged_addresses=_with_default_tagged_addresses(tagged, address, port),
        weight_passing=passing,
        weight_warning=warning,
        enable_tag_override=definition.get("EnableTagOverride", False),
        kind=definition.get("Kind", ""),
        create_index=0,
        modify_index=0,
        locality=(
            Locality(region=raw_locality.get("Region", ""), zone=raw_locality.get("Zone", ""))
            if raw_locality is not None
            else None
        ),
    )
    specs: list[CheckSpec] = []
    for position, check in enumerate(raw_checks, start=1):
        check_id = check.get("CheckID", "")
        if not check_id:
            check_id = f"service:{service_id}"
            if len(raw_checks) > 1:
                check_id += f":{position}"
        check_name = check.get("Name") or f"Service '{name}' check"
        specs.append(check_spec(check, check_id=check_id, name=check_name, service_id=service_id))
    return service, specs


def check_definition(definition: dict[str, Any]) -> CheckSpec:
    """Validate a CheckDefinition (/v1/agent/check/register) in AgentRegisterCheck's order."""
    name = definition.get("Name", "")
    if not name:
        raise DefinitionError("Missing check name")
    status = definition.get("Status", "")
    if status and _status(status) is None:
        raise DefinitionError("Bad check status")
    try:
        validate_check_type(definition)
    except DefinitionError as exc:
        raise DefinitionError(f"Invalid check: {exc}") from exc
    check_id = definition.get("ID") or definition.get("CheckID") or name
    return check_spec(
        definition, check_id=check_id, name=name, service_id=definition.get("ServiceID", "")
    )
