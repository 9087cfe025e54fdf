"""Nomad namespaces (Community Edition): the built-in `default` and the ones operators add.

Facts from Nomad 1.10.5's `nomad/structs/structs.go` (`Namespace`, `Validate`,
`SetHash`), `nomad/structs/structs_ce.go`, `nomad/state/state_store.go`
(`namespaceInit`, `upsertNamespaceImpl`, `DeleteNamespaces`),
`nomad/namespace_endpoint.go` and `command/agent/namespace_endpoint.go`:

- `default` ("Default shared namespace") exists from index 1 and cannot be deleted;
- names match `^[a-zA-Z0-9-]{1,128}$`, descriptions are at most 256 characters;
- node pool, Vault and Consul configurations are Enterprise features: CE refuses
  any of them ("... is unlicensed."), and a quota, which CE cannot create, is a
  "non-existent quota";
- a write keeps `CreateIndex` and recomputes `Hash` (BLAKE2b-256 of the fields);
- a namespace with non-terminal jobs or allocations, or with variables, is not
  deleted (each reason is one error of a multierror).

Pure: the record, its JSON and its checks; `ClusterState` stores them.
"""

from __future__ import annotations

import base64
import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from caravan_llm.devcluster.nomad.decode import (
    STRING,
    STRING_MAP,
    UINT64,
    ListOf,
    Scalar,
    Schema,
    Struct,
)
from caravan_llm.devcluster.nomad.gotext import go_quote

DEFAULT_NAMESPACE = "default"
DEFAULT_DESCRIPTION = "Default shared namespace"
MAX_DESCRIPTION = 256
NAME_RULE = "^[a-zA-Z0-9-]{1,128}$"
_VALID_NAME = re.compile(NAME_RULE)
REGION = "global"

_STRINGS = ListOf(STRING, pointer=False)
_ALLOW_DENY: dict[str, Schema] = {"Default": STRING, "Allowed": _STRINGS, "Denied": _STRINGS}
# `structs.Namespace`, as the HTTP agent decodes a namespace write.
NAMESPACE_BODY = Struct(
    "Namespace",
    {
        "Name": STRING,
        "Description": STRING,
        "Quota": STRING,
        "Capabilities": Struct(
            "NamespaceCapabilities",
            {
                "EnabledTaskDrivers": _STRINGS,
                "DisabledTaskDrivers": _STRINGS,
                "EnabledNetworkModes": _STRINGS,
                "DisabledNetworkModes": _STRINGS,
            },
            package="structs",
        ),
        "NodePoolConfiguration": Struct(
            "NamespaceNodePoolConfiguration", dict(_ALLOW_DENY), package="structs"
        ),
        "VaultConfiguration": Struct(
            "NamespaceVaultConfiguration", dict(_ALLOW_DENY), package="structs"
        ),
        "ConsulConfiguration": Struct(
            "NamespaceConsulConfiguration", dict(_ALLOW_DENY), package="structs"
        ),
        "Meta": STRING_MAP,
        "Hash": Scalar("bytes", "[]uint8"),
        "CreateIndex": UINT64,
        "ModifyIndex": UINT64,
    },
    package="structs",
)
_CAPABILITY_LISTS = (
    "EnabledTaskDrivers",
    "DisabledTaskDrivers",
    "EnabledNetworkModes",
    "DisabledNetworkModes",
)
_ENTERPRISE = (
    ("NodePoolConfiguration", "node pool", "Node Pools Governance is unlicensed."),
    ("VaultConfiguration", "vault", "Multi-Cluster Vault is unlicensed."),
    ("ConsulConfiguration", "consul", "Multi-Cluster Consul is unlicensed."),
)


@dataclass(frozen=True, slots=True)
class Namespace:
    name: str
    description: str = ""
    quota: str = ""
    # `NamespaceCapabilities` as decoded (lists of names), or None.
    capabilities: Mapping[str, Sequence[str]] | None = None
    # The Enterprise blocks, kept only to be refused (`problems`).
    enterprise: Mapping[str, Any] | None = None
    meta: Mapping[str, str] | None = None
    create_index: int = 0
    modify_index: int = 0

    def hash(self) -> bytes:
        """`SetHash`: BLAKE2b-256 over the user-set fields, Meta by sorted key."""
        digest = hashlib.blake2b(digest_size=32)
        for part in (self.name, self.description, self.quota):
            digest.update(part.encode())
        if self.capabilities is not None:
            for key in _CAPABILITY_LISTS:
                for value in self.capabilities.get(key) or ():
                    digest.update(value.encode())
        for key in sorted(self.meta or {}):
            digest.update(key.encode())
            digest.update((self.meta or {})[key].encode())
        return digest.digest()

    def to_api(self) -> dict[str, Any]:
        capabilities = None
        if self.capabilities is not None:
            capabilities = {
                key: list(self.capabilities[key]) if self.capabilities.get(key) else None
                for key in _CAPABILITY_LISTS
            }
        return {
            "Name": self.name,
            "Description": self.description,
            "Quota": self.quota,
            "Capabilities": capabilities,
            "NodePoolConfiguration": None,
            "VaultConfiguration": None,
            "ConsulConfiguration": None,
            "Meta": dict(self.meta) if self.meta is not None else None,
            "Hash": base64.b64encode(self.hash()).decode(),
            "CreateIndex": self.create_index,
            "ModifyIndex": self.modify_index,
        }


def built_in_namespaces() -> dict[str, Namespace]:
    default = Namespace(
        name=DEFAULT_NAMESPACE, description=DEFAULT_DESCRIPTION, create_index=1, modify_index=1
    )
    return {DEFAULT_NAMESPACE: default}


def namespace_from_body(decoded: Mapping[str, Any]) -> Namespace:
    """A `NAMESPACE_BODY`-decoded write (indexes and hash are the server's to set)."""
    capabilities = decoded.get("Capabilities")
    meta = decoded.get("Meta")
    enterprise = {key: decoded[key] for key, _, _ in _ENTERPRISE if key in decoded}
    return Namespace(
        name=str(decoded.get("Name") or ""),
        description=str(decoded.get("Description") or ""),
        quota=str(decoded.get("Quota") or ""),
        capabilities=(
            {key: tuple(capabilities.get(key) or ()) for key in _CAPABILITY_LISTS}
            if isinstance(capabilities, dict)
            else None
        ),
        enterprise=enterprise or None,
        meta=dict(meta) if isinstance(meta, dict) else None,
    )


def problems(namespace: Namespace) -> list[str]:
    """`Namespace.Validate` (CE): every problem, in Nomad's order."""
    found = []
    if not _VALID_NAME.fullmatch(namespace.name):
        found.append(f"invalid name {go_quote(namespace.name)}. Must match regex {NAME_RULE}")
    if len(namespace.description) > MAX_DESCRIPTION:
        found.append(f"description longer than {MAX_DESCRIPTION}")
    for key, label, text in _ENTERPRISE:
        if namespace.enterprise and key in namespace.enterprise:
            found.append(f"invalid {label} configuration: {text}")
    return found


def quota_problem(namespace: Namespace) -> str | None:
    """CE has no quota specifications, so any quota names one that does not exist."""
    if not namespace.quota:
        return None
    return (
        f"namespace {go_quote(namespace.name)} using non-existent quota {go_quote(namespace.quota)}"
    )


def delete_problems(
    name: str, *, live_jobs: bool, live_allocations: bool, variables: bool
) -> list[str]:
    """`DeleteNamespaces`' checks of an existing namespace, one error each."""
    found = []
    quoted = go_quote(name)
    if live_jobs:
        found.append(f"namespace {quoted} has non-terminal jobs in regions: [{REGION}]")
    if live_allocations:
        found.append(f"namespace {quoted} has non-terminal allocations in regions: [{REGION}]")
    if variables:
        found.append(f"namespace {quoted} has variables associated with it in regions: [{REGION}]")
    return found


def driver_problem(namespace: Namespace, drivers: Sequence[str]) -> str | None:
    """`jobNamespaceConstraintCheckHook`'s driver rule: the drivers the namespace refuses."""
    if namespace.capabilities is None:
        return None
    enabled = namespace.capabilities.get("EnabledTaskDrivers") or ()
    disabled = namespace.capabilities.get("DisabledTaskDrivers") or ()
    refused = [d for d in drivers if (enabled and d not in enabled) or d in disabled]
    if not refused:
        return None
    quoted = go_quote(namespace.name)
    if len(refused) == 1:
        return f"used task driver {go_quote(refused[0])} is not allowed in namespace {quoted}"
    listed = "[" + " ".join(go_quote(d) for d in refused) + "]"
    return f"used task drivers {listed} are not allowed in namespace {quoted}"
