"""Nomad node pools (1.6+): the built-in `default` and `all`, and pools operators add.

Facts from Nomad's `nomad/structs/node_pool.go`, `nomad/state/state_store_node_pools.go`,
`nomad/node_pool_endpoint.go` and `command/agent/node_pool_endpoint.go`:

- `all` and `default` exist from the start (index 1) and can be neither
  modified nor deleted; a node may not register in `all`;
- a node naming a pool that does not exist creates it when it registers;
- names match `^[a-zA-Z0-9-_]{1,128}$`, descriptions are at most 256 characters;
- a job naming a pool that does not exist is refused at registration;
- a pool with nodes or non-terminal jobs cannot be deleted.

Pure: the records and the checks; `ClusterState` stores them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

NODE_POOL_ALL = "all"
NODE_POOL_DEFAULT = "default"
BUILT_IN = {
    NODE_POOL_ALL: "Node pool with all nodes in the cluster.",
    NODE_POOL_DEFAULT: "Default node pool.",
}
# Nomad's DefaultNodePoolNodeIdentityTTL (24 h), in nanoseconds as the API's Duration.
NODE_IDENTITY_TTL_NS = 24 * 3600 * 1_000_000_000
MAX_DESCRIPTION = 256
_VALID_NAME = re.compile(r"^[a-zA-Z0-9-_]{1,128}$")
_NAME_RULE = "^[a-zA-Z0-9-_]{1,128}$"


@dataclass(frozen=True, slots=True)
class NodePool:
    name: str
    description: str = ""
    meta: Mapping[str, str] | None = None
    scheduler_configuration: Mapping[str, Any] | None = None
    node_identity_ttl_ns: int = NODE_IDENTITY_TTL_NS
    create_index: int = 0
    modify_index: int = 0

    @property
    def built_in(self) -> bool:
        return self.name in BUILT_IN

    def to_api(self) -> dict[str, Any]:
        return {
            "Name": self.name,
            "Description": self.description,
            "Meta": dict(self.meta) if self.meta is not None else None,
            "SchedulerConfiguration": (
                dict(self.scheduler_configuration)
                if self.scheduler_configuration is not None
                else None
            ),
            "NodeIdentityTTL": self.node_identity_ttl_ns,
            "CreateIndex": self.create_index,
            "ModifyIndex": self.modify_index,
        }


def built_in_pools() -> dict[str, NodePool]:
    return {
        name: NodePool(name=name, description=text, create_index=1, modify_index=1)
        for name, text in BUILT_IN.items()
    }


def name_problem(name: str) -> str | None:
    """Nomad's `ValidateNodePoolName` text, or None for a valid name."""
    if _VALID_NAME.fullmatch(name):
        return None
    return f"invalid name {name!r}, must match regex {_NAME_RULE}".replace("'", '"')


def pool_problems(pool: NodePool) -> list[str]:
    """`NodePool.Validate`: every problem with an upserted pool."""
    problems = []
    problem = name_problem(pool.name)
    if problem is not None:
        problems.append(problem)
    if len(pool.description) > MAX_DESCRIPTION:
        problems.append(f"description longer than {MAX_DESCRIPTION}")
    return problems


def pool_from_body(body: Mapping[str, Any]) -> NodePool:
    """A decoded `NodePool` request body (keys as Go matches them: case-insensitive)."""
    folded = {str(key).lower(): value for key, value in body.items()}
    meta = folded.get("meta")
    scheduler = folded.get("schedulerconfiguration")
    ttl = folded.get("nodeidentityttl")
    return NodePool(
        name=str(folded.get("name") or ""),
        description=str(folded.get("description") or ""),
        meta={str(k): str(v) for k, v in meta.items()} if isinstance(meta, dict) else None,
        scheduler_configuration=scheduler if isinstance(scheduler, dict) else None,
        node_identity_ttl_ns=int(ttl) if isinstance(ttl, int) and ttl > 0 else NODE_IDENTITY_TTL_NS,
    )


def nodes_in_pool(pool: str, node_pool_of_each: Mapping[str, str]) -> list[str]:
    """IDs of the nodes of `pool` (every node for `all`)."""
    return [
        node_id
        for node_id, node_pool in node_pool_of_each.items()
        if pool in {NODE_POOL_ALL, node_pool}
    ]
