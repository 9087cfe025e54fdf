"""The JSON shapes Consul answers with, built from the emulator's rows."""

from __future__ import annotations

import base64
from typing import Any

from caravan_llm.devcluster.consul.durations import format_go_duration_s
from caravan_llm.devcluster.consul.filter import ANY_KEY
from caravan_llm.devcluster.consul.records import (
    CheckRecord,
    CheckSpec,
    KVEntry,
    Locality,
    NodeRecord,
    ServiceRecord,
    SessionRecord,
)
from caravan_llm.devcluster.consul.state import ConsulState, ServiceInstance

JSON = dict[str, Any]


def tagged_node_addresses(address: str) -> dict[str, str]:
    return {"lan": address, "lan_ipv4": address, "wan": address, "wan_ipv4": address}


def node_json(node: NodeRecord, datacenter: str) -> JSON:
    return {
        "ID": node.node_id,
        "Node": node.name,
        "Address": node.address,
        "Datacenter": datacenter,
        "TaggedAddresses": tagged_node_addresses(node.address),
        "Meta": dict(node.meta),
        "CreateIndex": node.create_index,
        "ModifyIndex": node.modify_index,
    }


def _weights(service: ServiceRecord) -> JSON:
    return {"Passing": service.weight_passing, "Warning": service.weight_warning}


_PROXY = {"Mode": "", "MeshGateway": {}, "Expose": {}}


def tagged_addresses_json(service: ServiceRecord) -> JSON:
    """map[string]ServiceAddress as Consul writes it (both fields always present)."""
    return {
        key: {"Address": value.address, "Port": value.port}
        for key, value in sorted(service.tagged_addresses.items())
    }


def locality_json(locality: Locality) -> JSON:
    """structs.Locality: Region and Zone are each omitted when empty."""
    out: JSON = {}
    if locality.region:
        out["Region"] = locality.region
    if locality.zone:
        out["Zone"] = locality.zone
    return out


def node_service_json(service: ServiceRecord) -> JSON:
    out: JSON = {
        "ID": service.service_id,
        "Service": service.name,
        "Tags": list(service.tags),
        "Address": service.address,
        "Meta": dict(service.meta),
        "Port": service.port,
        "Weights": _weights(service),
        "EnableTagOverride": service.enable_tag_override,
        "Proxy": dict(_PROXY),
        "Connect": {},
        "PeerName": "",
        "CreateIndex": service.create_index,
        "ModifyIndex": service.modify_index,
    }
    if service.kind:
        out["Kind"] = service.kind
    if service.tagged_addresses:
        out["TaggedAddresses"] = tagged_addresses_json(service)
    if service.locality is not None:
        out["Locality"] = locality_json(service.locality)
    return out


def agent_service_json(service: ServiceRecord, datacenter: str) -> JSON:
    out: JSON = {
        "ID": service.service_id,
        "Service": service.name,
        "Tags": list(service.tags),
        "Meta": dict(service.meta),
        "Port": service.port,
        "Address": service.address,
        "Weights": _weights(service),
        "EnableTagOverride": service.enable_tag_override,
        "Datacenter": datacenter,
    }
    if service.kind:
        out["Kind"] = service.kind
    if service.tagged_addresses:
        out["TaggedAddresses"] = tagged_addresses_json(service)
    if service.locality is not None:
        out["Locality"] = locality_json(service.locality)
    return out


def _duration(seconds: float) -> str:
    return format_go_duration_s(seconds)


def check_definition_json(spec: CheckSpec) -> JSON:
    out: JSON = {}
    if spec.http:
        out.update({"HTTP": spec.http, "Method": spec.method, "Header": spec.header or None})
        if spec.body:
            out["Body"] = spec.body
        if spec.tls_skip_verify:
            out["TLSSkipVerify"] = True
    if spec.tcp:
        out["TCP"] = spec.tcp
    if spec.grpc:
        out["GRPC"] = spec.grpc
    if spec.interval_s:
        out["Interval"] = _duration(spec.interval_s)
    if spec.timeout_s:
        out["Timeout"] = _duration(spec.timeout_s)
    if spec.deregister_critical_after_s:
        out["DeregisterCriticalServiceAfter"] = _duration(spec.deregister_critical_after_s)
    return out


def check_json(check: CheckRecord, service_tags: tuple[str, ...], *, indexes: bool = True) -> JSON:
    spec = check.spec
    out: JSON = {
        "Node": check.node,
        "CheckID": check.check_id,
        "Name": spec.name,
        "Status": check.status,
        "Notes": check.notes,
        "Output": check.output,
        "ServiceID": check.service_id,
        "ServiceName": check.service_name,
        "ServiceTags": list(service_tags),
        "Type": spec.check_type,
        "Interval": _duration(spec.interval_s) if spec.interval_s else "",
        "Timeout": _duration(spec.timeout_s) if spec.timeout_s else "",
        "ExposedPort": 0,
        "Definition": check_definition_json(spec),
        "CreateIndex": check.create_index if indexes else 0,
        "ModifyIndex": check.modify_index if indexes else 0,
    }
    return out


def health_entry_json(instance: ServiceInstance, state: ConsulState) -> JSON:
    return {
        "Node": node_json(instance.node, state.datacenter),
        "Service": node_service_json(instance.service),
        "Checks": [check_json(c, state.service_tags(c)) for c in instance.checks],
    }


def catalog_service_json(instance: ServiceInstance, datacenter: str) -> JSON:
    node, service = instance.node, instance.service
    out: JSON = {
        "ID": node.node_id,
        "Node": node.name,
        "Address": node.address,
        "Datacenter": datacenter,
        "TaggedAddresses": tagged_node_addresses(node.address),
        "NodeMeta": dict(node.meta),
        "ServiceKind": service.kind,
        "ServiceID": service.service_id,
        "ServiceName": service.name,
        "ServiceTags": list(service.tags),
        "ServiceAddress": service.address,
        "ServiceWeights": _weights(service),
        "ServiceMeta": dict(service.meta),
        "ServicePort": service.port,
        "ServiceSocketPath": "",
        "ServiceEnableTagOverride": service.enable_tag_override,
        "ServiceProxy": dict(_PROXY),
        "ServiceConnect": {},
        "ServicePeerName": "",
        "CreateIndex": service.create_index,
        "ModifyIndex": service.modify_index,
    }
    # ServiceNode's omitempty fields.
    if service.tagged_addresses:
        out["ServiceTaggedAddresses"] = tagged_addresses_json(service)
    if service.locality is not None:
        out["ServiceLocality"] = locality_json(service.locality)
    return out


def session_json(session: SessionRecord) -> JSON:
    out: JSON = {
        "ID": session.session_id,
        "Name": session.name,
        "Node": session.node,
        "LockDelay": round(session.lock_delay_s * 1_000_000_000),
        "Behavior": session.behavior.value,
        "TTL": session.ttl,
        "NodeChecks": list(session.node_checks),
        "ServiceChecks": (
            [{"ID": c, "Namespace": ""} for c in session.service_checks]
            if session.service_checks
            else None
        ),
        "CreateIndex": session.create_index,
        "ModifyIndex": session.modify_index,
    }
    if session.legacy_checks:
        out["Checks"] = list(session.legacy_checks)
    return out


def kv_json(entry: KVEntry) -> JSON:
    out: JSON = {
        "LockIndex": entry.lock_index,
        "Key": entry.key,
        "Flags": entry.flags,
        "Value": base64.b64encode(entry.value).decode("ascii") if entry.value else None,
        "CreateIndex": entry.create_index,
        "ModifyIndex": entry.modify_index,
    }
    if entry.session:
        out["Session"] = entry.session
    return out


# Template records for `?filter=` selector validation (shapes, not data).
_TEMPLATE_NODE = NodeRecord(
    "n", "id", "127.0.0.1", {}, failed=False, create_index=0, modify_index=0
)
_TEMPLATE_SERVICE = ServiceRecord(
    node="n",
    service_id="s",
    name="s",
    tags=(),
    address="",
    port=0,
    meta={},
    tagged_addresses={},
    weight_passing=1,
    weight_warning=1,
    enable_tag_override=False,
    kind="",
    create_index=0,
    modify_index=0,
)
_TEMPLATE_CHECK = CheckRecord(
    node="n",
    spec=CheckSpec(check_id="c", name="c", check_type="ttl"),
    status="passing",
    output="",
    notes="",
    service_id="",
    service_name="",
    critical_since=None,
    create_index=0,
    modify_index=0,
)


# A service's TaggedAddresses map to {Address, Port} structs: any key, then those fields.
_TEMPLATE_SERVICE_ADDRESSES: JSON = {ANY_KEY: {"Address": "", "Port": 0}}


def _with_maps(record: JSON) -> JSON:
    record.setdefault("TaggedAddresses", _TEMPLATE_SERVICE_ADDRESSES)
    return record


TEMPLATE_HEALTH_ENTRY: JSON = {
    "Node": node_json(_TEMPLATE_NODE, "dc1"),
    "Service": _with_maps(node_service_json(_TEMPLATE_SERVICE)) | {"Kind": ""},
    "Checks": [],
}
TEMPLATE_CATALOG_SERVICE: JSON = catalog_service_json(
    ServiceInstance(_TEMPLATE_NODE, _TEMPLATE_SERVICE, ()), "dc1"
) | {"ServiceTaggedAddresses": _TEMPLATE_SERVICE_ADDRESSES}
TEMPLATE_CHECK: JSON = check_json(_TEMPLATE_CHECK, ())
TEMPLATE_NODE: JSON = node_json(_TEMPLATE_NODE, "dc1")
# api.AgentService's Locality has no `bexpr:"-"` (NodeService's does), so it filters here.
TEMPLATE_AGENT_SERVICE: JSON = _with_maps(agent_service_json(_TEMPLATE_SERVICE, "dc1")) | {
    "Kind": "",
    "Locality": {"Region": "", "Zone": ""},
}
# /v1/catalog/node/<node> filters its Services map by NodeService fields.
TEMPLATE_NODE_SERVICE: JSON = _with_maps(node_service_json(_TEMPLATE_SERVICE)) | {"Kind": ""}
