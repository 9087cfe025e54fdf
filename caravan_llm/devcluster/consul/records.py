"""The rows of the emulated Consul catalog, KV store and session table.

Rows are frozen: every write replaces the row, stamped with the raft-like
index of that write, so a reader holding an old row never sees it change.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Literal

Status = Literal["passing", "warning", "critical"]
STATUSES: tuple[Status, ...] = ("passing", "warning", "critical")

SERF_CHECK_ID = "serfHealth"
SERF_CHECK_NAME = "Serf Health Status"
SERF_ALIVE_OUTPUT = "Agent alive and reachable"
SERF_FAILED_OUTPUT = "Agent not live or unreachable"
SERVICE_MAINTENANCE_PREFIX = "_service_maintenance:"
NODE_MAINTENANCE_CHECK_ID = "_node_maintenance"


class SessionBehavior(Enum):
    RELEASE = "release"
    DELETE = "delete"


@dataclass(frozen=True, slots=True)
class NodeRecord:
    name: str
    node_id: str
    address: str
    meta: dict[str, str]
    failed: bool
    create_index: int
    modify_index: int


@dataclass(frozen=True, slots=True)
class ServiceAddress:
    """One value of a service's TaggedAddresses (structs.ServiceAddress)."""

    address: str
    port: int


@dataclass(frozen=True, slots=True)
class Locality:
    """Where a service runs (structs.Locality); both parts optional."""

    region: str = ""
    zone: str = ""


@dataclass(frozen=True, slots=True)
class ServiceRecord:
    """A catalog service instance.

    `local` is False for rows the servers write themselves (the `consul`
    service of a server node): they are in the catalog but in no agent's
    local state, so /v1/agent/* does not see them.
    """

    node: str
    service_id: str
    name: str
    tags: tuple[str, ...]
    address: str
    port: int
    meta: dict[str, str]
    tagged_addresses: dict[str, ServiceAddress]
    weight_passing: int
    weight_warning: int
    enable_tag_override: bool
    kind: str
    create_index: int
    modify_index: int
    locality: Locality | None = None
    local: bool = True

    def same_content(self, other: ServiceRecord) -> bool:
        """True when a re-registration changes nothing a reader could see."""
        return (
            self.name,
            self.tags,
            self.address,
            self.port,
            self.meta,
            self.tagged_addresses,
            self.weight_passing,
            self.weight_warning,
            self.enable_tag_override,
            self.kind,
            self.locality,
            self.local,
        ) == (
            other.name,
            other.tags,
            other.address,
            other.port,
            other.meta,
            other.tagged_addresses,
            other.weight_passing,
            other.weight_warning,
            other.enable_tag_override,
            other.kind,
            other.locality,
            other.local,
        )


@dataclass(frozen=True, slots=True)
class CheckSpec:
    """What a check does, as registered (durations in seconds, 0 = unset)."""

    check_id: str
    name: str
    check_type: str
    notes: str = ""
    initial_status: Status | None = None
    service_id: str = ""
    http: str = ""
    method: str = ""
    header: dict[str, list[str]] = field(default_factory=dict)
    body: str = ""
    disable_redirects: bool = False
    tls_skip_verify: bool = False
    tls_server_name: str = ""
    tcp: str = ""
    udp: str = ""
    grpc: str = ""
    grpc_use_tls: bool = False
    h2ping: str = ""
    script_args: tuple[str, ...] = ()
    interval_s: float = 0.0
    timeout_s: float = 0.0
    ttl_s: float = 0.0
    deregister_critical_after_s: float = 0.0
    success_before_passing: int = 0
    failures_before_warning: int = 0
    failures_before_critical: int = 0
    output_max_size: int = 4096


@dataclass(frozen=True, slots=True)
class CheckRecord:
    """A catalog health check; `local` is False for serf's `serfHealth` (no agent owns it)."""

    node: str
    spec: CheckSpec
    status: Status
    output: str
    notes: str
    service_id: str
    service_name: str
    critical_since: float | None
    create_index: int
    modify_index: int
    local: bool = True

    @property
    def check_id(self) -> str:
        return self.spec.check_id


@dataclass(frozen=True, slots=True)
class KVEntry:
    key: str
    value: bytes
    flags: int
    session: str | None
    lock_index: int
    create_index: int
    modify_index: int


@dataclass(frozen=True, slots=True)
class SessionRecord:
    session_id: str
    name: str
    node: str
    lock_delay_s: float
    behavior: SessionBehavior
    ttl: str
    ttl_s: float
    node_checks: tuple[str, ...]
    service_checks: tuple[str, ...]
    legacy_checks: tuple[str, ...] | None
    create_index: int
    modify_index: int

    @property
    def watched_checks(self) -> frozenset[str]:
        """Every check whose going critical invalidates the session (Consul's CheckIDs())."""
        return (
            frozenset(self.node_checks)
            | frozenset(self.service_checks)
            | frozenset(self.legacy_checks or ())
        )
