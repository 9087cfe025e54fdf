"""Choose a node for one allocation, by Nomad's rules (`scheduler/feasible`).

`select_node` is pure: the nodes, the allocations already on them (including
those placed earlier in the same plan), the job and group, and a seeded
random source go in; a `Placement` (node, ports, cores, devices, scores) or a
`PlacementFailure` carrying Nomad's `AllocMetric` comes out.

The pipeline is Nomad's generic stack, in its order:

1. shuffle the ready, eligible, non-draining nodes of the job's datacenters and pool;
2. feasibility: job constraints, drivers, group and task constraints, device
   presence, network mode, static host volumes, `distinct_hosts`,
   `distinct_property`;
3. ranking: bin-packing fit (ports, devices, cores, CPU, memory, disk), job
   anti-affinity, rescheduling penalty, node affinities, spread, averaged;
4. the limit iterator (visit about log2(n) fitting nodes, skipping up to 3
   that score <= 0) and the best score wins.

Scope caveat kept from Nomad (facts N14): `distinct_hosts`, `distinct_property`,
spread and job anti-affinity only look at allocations of the same job.
"""

from __future__ import annotations

import fnmatch
import math
import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from caravan_llm.devcluster.nomad.matching import (
    DISTINCT_HOSTS,
    DISTINCT_PROPERTY,
    Attribute,
    check_attribute_constraint,
    check_constraint,
    constraint_text,
    parse_attribute,
)
from caravan_llm.devcluster.nomad.model import (
    AllocatedDevice,
    AllocatedPort,
    AllocatedResources,
    Allocation,
    DeviceGroup,
    Node,
    TaskResources,
)

Json = dict[str, Any]

BINPACK_MAX_FIT_SCORE = 18.0
SKIP_SCORE_THRESHOLD = 0.0
MAX_SKIP = 3
# `SchedulerConfiguration.NodeLimitForFeasibilityChecks` default: with
# affinities or spreads the stack looks at this many fitting nodes.
NODE_LIMIT_WITH_AFFINITIES = 100
IMPLICIT_SPREAD_TARGET = "*"

FILTER_MISSING_DRIVERS = "missing drivers"
FILTER_MISSING_DEVICES = "missing devices"
FILTER_MISSING_NETWORK = "missing network"
FILTER_MISSING_HOST_VOLUMES = "missing compatible host volumes"


@dataclass(slots=True)
class AllocMetric:
    """Nomad's `AllocMetric`: why nodes were filtered or exhausted, and scores."""

    nodes_evaluated: int = 0
    nodes_filtered: int = 0
    nodes_in_pool: int = 0
    nodes_available: dict[str, int] = field(default_factory=dict)
    class_filtered: dict[str, int] = field(default_factory=dict)
    constraint_filtered: dict[str, int] = field(default_factory=dict)
    nodes_exhausted: int = 0
    class_exhausted: dict[str, int] = field(default_factory=dict)
    dimension_exhausted: dict[str, int] = field(default_factory=dict)
    score_meta: list[Json] = field(default_factory=list)
    coalesced_failures: int = 0

    def filter_node(self, node: Node, reason: str) -> None:
        self.nodes_filtered += 1
        if node.node_class:
            self.class_filtered[node.node_class] = self.class_filtered.get(node.node_class, 0) + 1
        if reason:
            self.constraint_filtered[reason] = self.constraint_filtered.get(reason, 0) + 1

    def exhaust_node(self, node: Node, dimension: str) -> None:
        self.nodes_exhausted += 1
        if node.node_class:
            self.class_exhausted[node.node_class] = self.class_exhausted.get(node.node_class, 0) + 1
        if dimension:
            self.dimension_exhausted[dimension] = self.dimension_exhausted.get(dimension, 0) + 1

    def to_api(self) -> Json:
        return {
            "NodesEvaluated": self.nodes_evaluated,
            "NodesFiltered": self.nodes_filtered,
            "NodesInPool": self.nodes_in_pool,
            "NodesAvailable": dict(self.nodes_available),
            "ClassFiltered": dict(self.class_filtered) or None,
            "ConstraintFiltered": dict(self.constraint_filtered) or None,
            "NodesExhausted": self.nodes_exhausted,
            "ClassExhausted": dict(self.class_exhausted) or None,
            "DimensionExhausted": dict(self.dimension_exhausted) or None,
            "QuotaExhausted": None,
            "ResourcesExhausted": None,
            "Scores": None,
            "ScoreMetaData": list(self.score_meta) or None,
            "AllocationTime": 0,
            "CoalescedFailures": self.coalesced_failures,
        }


@dataclass(frozen=True, slots=True)
class Placement:
    node: Node
    resources: AllocatedResources
    score: float
    metric: AllocMetric


@dataclass(frozen=True, slots=True)
class PlacementFailure:
    metric: AllocMetric


@dataclass(frozen=True, slots=True)
class PlacementContext:
    """Everything one placement reads: the cluster as the plan sees it so far."""

    job: Json
    group: Json
    nodes: Sequence[Node]
    # Non-terminal allocations per node id, including this plan's placements.
    proposed: Mapping[str, Sequence[Allocation]]
    penalty_node_ids: frozenset[str] = frozenset()
    # The allocation's name (`job.group[index]`): `per_alloc` volume sources use its suffix.
    alloc_name: str = ""


# -- targets -------------------------------------------------------------


def resolve_node_target(target: str, node: Node) -> tuple[str, bool]:
    """`resolveTarget`: literal, `${node.*}`, `${attr.*}` or `${meta.*}`."""
    if not target.startswith("${"):
        return target, True
    match target:
        case "${node.unique.id}":
            return node.id, True
        case "${node.datacenter}":
            return node.datacenter, True
        case "${node.unique.name}":
            return node.name, True
        case "${node.class}":
            return node.node_class, True
        case "${node.pool}":
            return node.node_pool, True
    if target.startswith("${attr."):
        key = target.removeprefix("${attr.").removesuffix("}")
        return (node.attributes[key], True) if key in node.attributes else ("", False)
    if target.startswith("${meta."):
        key = target.removeprefix("${meta.").removesuffix("}")
        return (node.meta[key], True) if key in node.meta else ("", False)
    return "", False


def resolve_device_target(target: str, device: DeviceGroup) -> Attribute | None:
    """`resolveDeviceTarget`: literal or `${device.ids|model|vendor|type|attr.*}`."""
    if not target.startswith("${"):
        return parse_attribute(target)
    match target:
        case "${device.ids}":
            return Attribute(",".join(instance.id for instance in device.instances))
        case "${device.model}":
            return Attribute(device.name)
        case "${device.vendor}":
            return Attribute(device.vendor)
        case "${device.type}":
            return Attribute(device.type)
    if target.startswith("${device.attr."):
        return device.attributes.get(target.removeprefix("${device.attr.").removesuffix("}"))
    return None


def meets_constraint(constraint: Mapping[str, Any], node: Node) -> bool:
    left, left_found = resolve_node_target(str(constraint.get("LTarget", "")), node)
    right, right_found = resolve_node_target(str(constraint.get("RTarget", "")), node)
    return check_constraint(
        str(constraint.get("Operand", "")), left, right, left_found, right_found
    )


def device_request_id(name: str) -> tuple[str, str, str]:
    """(vendor, type, model) of a request name: `type`, `vendor/type`, `vendor/type/model`."""
    parts = name.split("/", 2)
    if len(parts) == 1:
        return "", parts[0], ""
    if len(parts) == 2:
        return parts[0], parts[1], ""
    return parts[0], parts[1], parts[2]


def device_matches(device: DeviceGroup, request: Mapping[str, Any]) -> bool:
    """`nodeDeviceMatches`: the request's id tuple and its constraints."""
    vendor, kind, model = device_request_id(str(request.get("Name", "")))
    if (vendor and vendor != device.vendor) or (kind and kind != device.type):
        return False
    if model and model != device.name:
        return False
    for constraint in request.get("Constraints") or []:
        left = resolve_device_target(str(constraint.get("LTarget", "")), device)
        right = resolve_device_target(str(constraint.get("RTarget", "")), device)
        if not check_attribute_constraint(str(constraint.get("Operand", "")), left, right):
            return False
    return True


# -- feasibility -----------------------------------------------------------


def _group_tasks(group: Json) -> list[Json]:
    tasks: list[Json] = group.get("Tasks") or []
    return tasks


def _device_requests(group: Json) -> list[Json]:
    return [
        request
        for task in _group_tasks(group)
        for request in (task.get("Resources") or {}).get("Devices") or []
    ]


def _has_devices(node: Node, requests: list[Json]) -> bool:
    """`DeviceChecker.hasDevices`: enough healthy instances for every request."""
    if not requests:
        return True
    available = {
        index: sum(1 for instance in device.instances if instance.healthy)
        for index, device in enumerate(node.devices)
    }
    for request in requests:
        wanted = int(request.get("Count", 1))
        for index, device in enumerate(node.devices):
            if wanted == 0:
                break
            if available[index] == 0 or not device_matches(device, request):
                continue
            taken = min(wanted, available[index])
            available[index] -= taken
            wanted -= taken
        if wanted:
            return False
    return True


def _has_host_volumes(node: Node, group: Json, alloc_name: str) -> bool:
    """Nomad's `HostVolumeChecker` for static host volumes (CSI requests are skipped).

    Every `host` request needs a volume of its `Source` on the node (with
    `PerAlloc`, the source plus the allocation's `[index]` suffix), and a
    read-write request cannot use a volume the client declares read-only.
    Sticky requests need dynamic host volumes, which devcluster does not have.
    """
    for request in (group.get("Volumes") or {}).values():
        if str(request.get("Type", "")) != "host":
            continue
        source = str(request.get("Source", ""))
        if request.get("PerAlloc"):
            source += alloc_name[alloc_name.rfind("[") :] if "[" in alloc_name else ""
        volume = node.host_volumes.get(source)
        if volume is None or request.get("Sticky"):
            return False
        if volume.read_only and not request.get("ReadOnly"):
            return False
    return True


def _wants_distinct_hosts(constraints: Sequence[Mapping[str, Any]]) -> bool:
    for constraint in constraints:
        if constraint.get("Operand") == DISTINCT_HOSTS:
            value = str(constraint.get("RTarget", "")).strip().lower()
            return value in {"", "true", "1", "t"} or value not in {"false", "0", "f"}
    return False


def _collides_distinct_hosts(context: PlacementContext, node: Node) -> bool:
    job_level = _wants_distinct_hosts(context.job.get("Constraints") or [])
    group_level = _wants_distinct_hosts(context.group.get("Constraints") or [])
    if not (job_level or group_level):
        return False
    for alloc in context.proposed.get(node.id, ()):
        same_job = alloc.job_id == context.job["ID"] and alloc.namespace == context.job["Namespace"]
        same_group = alloc.task_group == context.group["Name"]
        if (job_level and same_job) or (same_job and same_group):
            return True
    return False


def _distinct_property_reason(
    context: PlacementContext, node: Node, nodes_by_id: Mapping[str, Node]
) -> str | None:
    scopes = [(c, False) for c in context.job.get("Constraints") or []] + [
        (c, True) for c in context.group.get("Constraints") or []
    ]
    for constraint, group_scope in scopes:
        if constraint.get("Operand") != DISTINCT_PROPERTY:
            continue
        target = str(constraint.get("LTarget", ""))
        allowed = int(constraint.get("RTarget") or 1)
        value, found = resolve_node_target(target, node)
        if not found:
            return f"missing property {target!r}"
        used = 0
        for node_id, allocs in context.proposed.items():
            other = nodes_by_id.get(node_id)
            if other is None or resolve_node_target(target, other) != (value, True):
                continue
            used += sum(
                1
                for alloc in allocs
                if alloc.job_id == context.job["ID"]
                and (not group_scope or alloc.task_group == context.group["Name"])
            )
        if used >= allowed:
            return f"distinct_property: {target}={value} used by {used} allocs"
    return None


def _feasibility_reason(
    context: PlacementContext, node: Node, nodes_by_id: Mapping[str, Node]
) -> str | None:
    """None when `node` passes every feasibility check, else Nomad's filter reason."""
    for constraint in context.job.get("Constraints") or []:
        if not meets_constraint(constraint, node):
            return constraint_text(constraint)
    drivers = {str(task.get("Driver", "")) for task in _group_tasks(context.group)}
    if not drivers <= set(node.drivers):
        return FILTER_MISSING_DRIVERS
    group_constraints = list(context.group.get("Constraints") or [])
    for task in _group_tasks(context.group):
        group_constraints.extend(task.get("Constraints") or [])
    for constraint in group_constraints:
        if not meets_constraint(constraint, node):
            return constraint_text(constraint)
    if not _has_devices(node, _device_requests(context.group)):
        return FILTER_MISSING_DEVICES
    networks = context.group.get("Networks") or []
    if networks and networks[0].get("Mode", "host") not in {"", "host"}:
        return FILTER_MISSING_NETWORK
    if not _has_host_volumes(node, context.group, context.alloc_name):
        return FILTER_MISSING_HOST_VOLUMES
    if _collides_distinct_hosts(context, node):
        return DISTINCT_HOSTS
    return _distinct_property_reason(context, node, nodes_by_id)


# -- bin packing -----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Fit:
    resources: AllocatedResources
    scores: tuple[tuple[str, float], ...]


def _used_ports(allocs: Sequence[Allocation]) -> set[int]:
    return {port.value for alloc in allocs for port in alloc.resources.ports}


def _assign_ports(
    group: Json, node: Node, used: set[int], rng: random.Random
) -> tuple[tuple[AllocatedPort, ...], str | None]:
    networks = group.get("Networks") or []
    if not networks:
        return (), None
    network = networks[0]
    taken = set(used)
    ports: list[AllocatedPort] = []
    for port in network.get("ReservedPorts") or []:
        value = int(port.get("Value", 0))
        if value in taken:
            return (), f"network: reserved port collision {port.get('Label', '')}={value}"
        taken.add(value)
        to = int(port.get("To", 0))
        ports.append(
            AllocatedPort(
                str(port.get("Label", "")), value, value if to == -1 else to, node.address
            )
        )
    span = node.max_dynamic_port - node.min_dynamic_port + 1
    for port in network.get("DynamicPorts") or []:
        free = span - sum(1 for p in taken if node.min_dynamic_port <= p <= node.max_dynamic_port)
        if free <= 0:
            return (), "network: dynamic port selection failed"
        value = rng.randint(node.min_dynamic_port, node.max_dynamic_port)
        while value in taken:
            value = rng.randint(node.min_dynamic_port, node.max_dynamic_port)
        taken.add(value)
        to = int(port.get("To", 0))
        ports.append(
            AllocatedPort(
                str(port.get("Label", "")), value, value if to == -1 else to, node.address
            )
        )
    return tuple(ports), None


def _device_affinity_score(device: DeviceGroup, request: Mapping[str, Any]) -> tuple[float, float]:
    """(matched weight sum, total absolute weight) of a request's affinities on `device`."""
    matched = 0.0
    total = 0.0
    for affinity in request.get("Affinities") or []:
        weight = float(affinity.get("Weight", 0))
        total += abs(weight)
        left = resolve_device_target(str(affinity.get("LTarget", "")), device)
        right = resolve_device_target(str(affinity.get("RTarget", "")), device)
        if check_attribute_constraint(str(affinity.get("Operand", "")), left, right):
            matched += weight
    return matched, total


def _offer_devices(
    node: Node, request: Mapping[str, Any], used_ids: set[str]
) -> tuple[AllocatedDevice | None, float, float]:
    """`deviceAllocator.createOffer`: the best-scoring device group with enough free instances."""
    wanted = int(request.get("Count", 1))
    best: AllocatedDevice | None = None
    best_score = 0.0
    best_matched = 0.0
    total_weight = 0.0
    for device in node.devices:
        if not device_matches(device, request):
            continue
        free = [i.id for i in device.instances if i.healthy and i.id not in used_ids][:wanted]
        if len(free) < wanted:
            continue
        matched, total = _device_affinity_score(device, request)
        score = matched / total if total else 0.0
        if best is not None and score < best_score:
            continue
        best = AllocatedDevice(device.vendor, device.type, device.name, tuple(free))
        best_score, best_matched, total_weight = score, matched, total
    return best, best_matched, total_weight


def _bin_pack(context: PlacementContext, node: Node, rng: random.Random) -> tuple[_Fit | None, str]:
    """Assign ports, devices and cores and check the fit; (None, dimension) when it doesn't."""
    existing = list(context.proposed.get(node.id, ()))
    ports, port_error = _assign_ports(context.group, node, _used_ports(existing), rng)
    if port_error is not None:
        return None, port_error
    used_device_ids = {i for alloc in existing for i in alloc.resources.device_ids}
    used_cores = {c for alloc in existing for c in alloc.resources.reserved_cores}
    affinity_matched = 0.0
    affinity_total = 0.0
    tasks: dict[str, TaskResources] = {}
    for task in _group_tasks(context.group):
        resources = task.get("Resources") or {}
        devices: list[AllocatedDevice] = []
        for request in resources.get("Devices") or []:
            offer, matched, total = _offer_devices(node, request, used_device_ids)
            if offer is None:
                return None, "devices: no devices match request"
            used_device_ids.update(offer.device_ids)
            devices.append(offer)
            affinity_matched += matched
            affinity_total += total
        cores_wanted = int(resources.get("Cores", 0))
        reserved: tuple[int, ...] = ()
        cpu_shares = int(resources.get("CPU", 0))
        if cores_wanted:
            free_cores = [c for c in range(node.cpu_cores) if c not in used_cores]
            if len(free_cores) < cores_wanted:
                return None, "cores"
            reserved = tuple(free_cores[:cores_wanted])
            used_cores.update(reserved)
            cpu_shares = cores_wanted * node.cpu_mhz_per_core
        memory = int(resources.get("MemoryMB", 0))
        tasks[str(task.get("Name", ""))] = TaskResources(
            cpu_shares=cpu_shares,
            reserved_cores=reserved,
            memory_mb=memory,
            memory_max_mb=int(resources.get("MemoryMaxMB", 0)),
            devices=tuple(devices),
        )
    disk = int((context.group.get("EphemeralDisk") or {}).get("SizeMB", 0))
    candidate = AllocatedResources(
        tasks=tasks, disk_mb=disk, ports=ports, network_mode="host", ip=node.address
    )
    used_cpu = sum(alloc.resources.cpu_shares for alloc in existing) + candidate.cpu_shares
    used_memory = sum(alloc.resources.memory_mb for alloc in existing) + candidate.memory_mb
    used_disk = sum(alloc.resources.disk_mb for alloc in existing) + disk
    if used_cpu > node.cpu_total_mhz:
        return None, "cpu"
    if used_memory > node.memory_mb:
        return None, "memory"
    if used_disk > node.disk_mb:
        return None, "disk"
    free_cpu = 1 - used_cpu / node.cpu_total_mhz
    free_memory = 1 - used_memory / node.memory_mb
    fitness = min(max(20.0 - (10**free_cpu + 10**free_memory), 0.0), BINPACK_MAX_FIT_SCORE)
    scores: list[tuple[str, float]] = [("binpack", fitness / BINPACK_MAX_FIT_SCORE)]
    if affinity_total:
        scores.append(("devices", affinity_matched / affinity_total))
    return _Fit(candidate, tuple(scores)), ""


# -- scoring ---------------------------------------------------------------


def _affinities(context: PlacementContext) -> list[Json]:
    affinities = list(context.job.get("Affinities") or [])
    affinities.extend(context.group.get("Affinities") or [])
    for task in _group_tasks(context.group):
        affinities.extend(task.get("Affinities") or [])
    return affinities


def _spreads(context: PlacementContext) -> list[Json]:
    return list(context.group.get("Spreads") or []) + list(context.job.get("Spreads") or [])


def _job_anti_affinity(context: PlacementContext, node: Node) -> float | None:
    collisions = sum(
        1
        for alloc in context.proposed.get(node.id, ())
        if alloc.job_id == context.job["ID"] and alloc.task_group == context.group["Name"]
    )
    if not collisions:
        return None
    return -1 * (collisions + 1) / max(int(context.group.get("Count", 1)), 1)


def _node_affinity(affinities: list[Json], node: Node) -> float | None:
    """Nomad appends the normalised affinity score only where an affinity matched."""
    if not affinities:
        return None
    total_weight = sum(abs(float(a.get("Weight", 0))) for a in affinities)
    matched = sum(float(a.get("Weight", 0)) for a in affinities if meets_constraint(a, node))
    if matched == 0.0 or total_weight == 0.0:
        return None
    return matched / total_weight


def _spread_use(
    context: PlacementContext, attribute: str, nodes_by_id: Mapping[str, Node]
) -> dict[str, int]:
    use: dict[str, int] = {}
    for node_id, allocs in context.proposed.items():
        node = nodes_by_id.get(node_id)
        if node is None:
            continue
        value, found = resolve_node_target(attribute, node)
        if not found:
            continue
        count = sum(
            1
            for alloc in allocs
            if alloc.job_id == context.job["ID"] and alloc.task_group == context.group["Name"]
        )
        if count:
            use[value] = use.get(value, 0) + count
    return use


def _even_spread_boost(use: Mapping[str, int], value: str, found: bool) -> float:
    if not use:
        return 0.0
    if not found:
        return -1.0
    current = use.get(value, 0)
    lowest = min(use.values())
    highest = max(use.values())
    if current != lowest:
        return (lowest - current) / lowest if lowest else -1.0
    if lowest == highest:
        return -1.0
    if lowest == 0:
        return 1.0
    return (highest - lowest) / lowest


def _spread_score(
    context: PlacementContext, spreads: list[Json], node: Node, nodes_by_id: Mapping[str, Node]
) -> float | None:
    if not spreads:
        return None
    total_count = int(context.group.get("Count", 1))
    sum_weights = sum(int(spread.get("Weight", 0)) for spread in spreads) or 1
    total = 0.0
    for spread in spreads:
        attribute = str(spread.get("Attribute", ""))
        value, found = resolve_node_target(attribute, node)
        use = _spread_use(context, attribute, nodes_by_id)
        targets = spread.get("SpreadTarget") or []
        if not targets:
            total += _even_spread_boost(use, value, found)
            continue
        if not found:
            total -= 1.0
            continue
        desired = {
            str(t.get("Value", "")): int(t.get("Percent", 0)) / 100 * total_count for t in targets
        }
        assigned = sum(desired.values())
        if 0 < assigned < total_count:
            desired[IMPLICIT_SPREAD_TARGET] = total_count - assigned
        wanted = desired.get(value, desired.get(IMPLICIT_SPREAD_TARGET))
        if wanted is None:
            total -= 1.0
            continue
        if wanted == 0:
            continue
        weight = int(spread.get("Weight", 0)) / sum_weights
        total += ((wanted - (use.get(value, 0) + 1)) / wanted) * weight
    return total if total != 0.0 else None


@dataclass(frozen=True, slots=True)
class _Ranked:
    node: Node
    fit: _Fit
    scores: tuple[tuple[str, float], ...]

    @property
    def final(self) -> float:
        return sum(score for _, score in self.scores) / len(self.scores)


def _pool_nodes(job: Json, nodes: Sequence[Node]) -> list[Node]:
    pool = str(job.get("NodePool") or "default")
    return [node for node in nodes if pool in {"all", node.node_pool}]


def _in_datacenters(job: Json, node: Node) -> bool:
    patterns = job.get("Datacenters") or ["*"]
    return any(fnmatch.fnmatchcase(node.datacenter, str(p)) for p in patterns)


def _ranked_options(
    context: PlacementContext,
    candidates: list[Node],
    metric: AllocMetric,
    rng: random.Random,
) -> Iterator[_Ranked]:
    nodes_by_id = {node.id: node for node in context.nodes}
    affinities = _affinities(context)
    spreads = _spreads(context)
    for node in candidates:
        metric.nodes_evaluated += 1
        reason = _feasibility_reason(context, node, nodes_by_id)
        if reason is not None:
            metric.filter_node(node, reason)
            continue
        fit, dimension = _bin_pack(context, node, rng)
        if fit is None:
            metric.exhaust_node(node, dimension)
            continue
        scores = list(fit.scores)
        anti = _job_anti_affinity(context, node)
        if anti is not None:
            scores.append(("job-anti-affinity", anti))
        if node.id in context.penalty_node_ids:
            scores.append(("node-reschedule-penalty", -1.0))
        affinity = _node_affinity(affinities, node)
        if affinity is not None:
            scores.append(("node-affinity", affinity))
        spread = _spread_score(context, spreads, node, nodes_by_id)
        if spread is not None:
            scores.append(("allocation-spread", spread))
        yield _Ranked(node, fit, tuple(scores))


def _visit_limit(context: PlacementContext, node_count: int) -> int:
    limit = 2
    if node_count > 0:
        limit = max(limit, math.ceil(math.log2(node_count)))
    if _affinities(context) or _spreads(context):
        count = int(context.group.get("Count", 1))
        limit = max(count, NODE_LIMIT_WITH_AFFINITIES)
    return limit


def _limited(options: Iterator[_Ranked], limit: int) -> Iterator[_Ranked]:
    """Nomad's `LimitIterator`: stop after `limit`, skipping up to 3 options scoring <= 0."""
    skipped: list[_Ranked] = []
    used_skipped = 0
    seen = 0

    def next_option() -> _Ranked | None:
        nonlocal used_skipped
        option = next(options, None)
        if option is None and used_skipped < len(skipped):
            option = skipped[used_skipped]
            used_skipped += 1
        return option

    while seen < limit:
        option = next_option()
        if option is None:
            return
        while (
            option is not None and option.final <= SKIP_SCORE_THRESHOLD and len(skipped) < MAX_SKIP
        ):
            skipped.append(option)
            option = next(options, None)
        seen += 1
        if option is None:
            option = next_option()
            if option is None:
                return
        yield option


def select_node(context: PlacementContext, rng: random.Random) -> Placement | PlacementFailure:
    """The node Nomad would pick for one allocation of `context.group`, or why none fits."""
    metric = AllocMetric()
    pool = _pool_nodes(context.job, context.nodes)
    ready = [node for node in pool if node.schedulable]
    metric.nodes_in_pool = len(ready)
    candidates = [node for node in ready if _in_datacenters(context.job, node)]
    for node in candidates:
        metric.nodes_available[node.datacenter] = metric.nodes_available.get(node.datacenter, 0) + 1
    rng.shuffle(candidates)
    best: _Ranked | None = None
    visited: list[_Ranked] = []
    limit = _visit_limit(context, len(candidates))
    for option in _limited(_ranked_options(context, candidates, metric, rng), limit):
        visited.append(option)
        if best is None or option.final > best.final:
            best = option
    visited.sort(key=lambda option: option.final, reverse=True)
    metric.score_meta = [
        {
            "NodeID": option.node.id,
            "Scores": dict(option.scores),
            "NormScore": option.final,
        }
        for option in visited[:5]
    ]
    if best is None:
        return PlacementFailure(metric)
    return Placement(best.node, best.fit.resources, best.final, metric)
