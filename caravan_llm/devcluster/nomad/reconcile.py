"""Turn one evaluation into a plan: which allocations stop and which are placed.

This is the pure core of the stand-in's service scheduler, following Nomad's
reconciler (`scheduler/reconciler`) for what caravan exercises:

* a stopped or purged job stops every live allocation;
* an allocation on a `down` node is lost: stopped with client status `lost`
  and replaced at once;
* an allocation marked for migration (drain, `POST /v1/allocation/:id/stop`)
  is stopped and replaced;
* a failed allocation is rescheduled by the group's reschedule policy: now
  (stopped, replaced, its node penalised), later (a follow-up evaluation at
  the next reschedule time), or never (it keeps its slot);
* allocations of an older job version are replaced when the change is
  destructive and updated in place otherwise;
* the group count is met by placing the missing `job.group[i]` names and
  stopping the highest surplus indexes.

Placements go through `placement.select_node` one by one, each seeing the
previous ones, and unplaceable ones are reported as Nomad's `FailedTGAllocs`.
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from caravan_llm.devcluster.nomad.model import (
    Allocation,
    Deployment,
    DeploymentGroup,
    Evaluation,
    Node,
    RescheduleEvent,
    alloc_index,
    find_group,
    task_groups,
)
from caravan_llm.devcluster.nomad.placement import (
    AllocMetric,
    PlacementContext,
    PlacementFailure,
    select_node,
)

Json = dict[str, Any]

# Nomad reschedules failed allocations whose next time falls within this window now.
RESCHEDULE_WINDOW_NS = 1_000_000_000

ALLOC_NOT_NEEDED = "alloc not needed due to job update"
ALLOC_MIGRATING = "alloc is being migrated"
ALLOC_UPDATING = "alloc is being updated due to job update"
ALLOC_LOST = "alloc is lost since its node is down"
ALLOC_RESCHEDULED = "alloc was rescheduled because it failed"
ALLOC_NODE_TAINTED = "alloc not needed as node is tainted"


@dataclass(frozen=True, slots=True)
class StopAlloc:
    alloc_id: str
    description: str
    client_status: str | None = None
    client_description: str = ""


@dataclass(frozen=True, slots=True)
class FollowUp:
    eval_id: str
    wait_until_ns: int
    alloc_ids: tuple[str, ...]


@dataclass(slots=True)
class DesiredUpdates:
    ignore: int = 0
    place: int = 0
    migrate: int = 0
    stop: int = 0
    in_place_update: int = 0
    destructive_update: int = 0
    reschedule_now: int = 0
    reschedule_later: int = 0

    def to_api(self) -> Json:
        return {
            "Ignore": self.ignore,
            "Place": self.place,
            "Migrate": self.migrate,
            "Stop": self.stop,
            "InPlaceUpdate": self.in_place_update,
            "DestructiveUpdate": self.destructive_update,
            "Canary": 0,
            "Preemptions": 0,
            "Reconnect": 0,
            "RescheduleNow": self.reschedule_now,
            "RescheduleLater": self.reschedule_later,
            "Disconnect": 0,
        }


@dataclass(frozen=True, slots=True)
class Plan:
    stops: tuple[StopAlloc, ...]
    placements: tuple[Allocation, ...]
    in_place: tuple[str, ...]
    follow_ups: tuple[FollowUp, ...]
    failures: Mapping[str, AllocMetric]
    queued: Mapping[str, int]
    desired_updates: Mapping[str, DesiredUpdates]
    new_deployment: Deployment | None = None
    cancel_deployments: tuple[str, ...] = ()

    @property
    def changes(self) -> bool:
        return bool(self.stops or self.placements or self.in_place or self.follow_ups)


@dataclass(frozen=True, slots=True)
class PlanInputs:
    """What the scheduler reads to plan one evaluation of one job."""

    evaluation: Evaluation
    job: Json | None  # the latest version; None when purged
    job_versions: Mapping[int, Json]
    job_allocs: Sequence[Allocation]
    nodes: Sequence[Node]
    cluster_allocs: Sequence[Allocation]
    deployments: Sequence[Deployment]
    now_ns: int


# -- reschedule policy ---------------------------------------------------


def next_reschedule(alloc: Allocation, policy: Mapping[str, Any] | None) -> tuple[int, bool]:
    """`Allocation.NextRescheduleTime`: (when, eligible) for a failed allocation."""
    if policy is None:
        return 0, False
    attempts = int(policy.get("Attempts", 0))
    unlimited = bool(policy.get("Unlimited", False))
    if attempts == 0 and not unlimited:
        return 0, False
    delay = _next_delay(alloc, policy)
    fail_time = alloc.last_event_ns()
    when = fail_time + delay
    eligible = unlimited or (attempts > 0 and not alloc.reschedule_events)
    if attempts > 0 and alloc.reschedule_events:
        interval = int(policy.get("Interval", 0))
        recent = [e for e in alloc.reschedule_events if e.reschedule_time_ns > fail_time - interval]
        eligible = len(recent) < attempts and delay < interval
    return when, eligible


def _next_delay(alloc: Allocation, policy: Mapping[str, Any]) -> int:
    """`Allocation.NextDelay`: constant, exponential or fibonacci, capped and reset."""
    delay = int(policy.get("Delay", 0))
    events = alloc.reschedule_events
    if not events:
        return delay
    function = policy.get("DelayFunction")
    max_delay = int(policy.get("MaxDelay", 0))
    if function == "exponential":
        delay = events[-1].delay_ns * 2
    elif function == "fibonacci":
        if len(events) >= 2:
            last, before = events[-1].delay_ns, events[-2].delay_ns
            delay = last if (before == max_delay and last == delay) else last + before
    else:
        return delay
    if max_delay > 0 and delay > max_delay:
        delay = max_delay
        if alloc.last_event_ns() - events[-1].reschedule_time_ns > delay:
            delay = int(policy.get("Delay", 0))
    return delay


# -- what counts as a destructive change ---------------------------------

_IN_PLACE_GROUP_FIELDS = frozenset(
    {"Count", "Services", "Update", "Migrate", "ReschedulePolicy", "Scaling", "ShutdownDelay"}
)
_IN_PLACE_TASK_FIELDS = frozenset({"Services", "ShutdownDelay", "KillTimeout", "RestartPolicy"})


def _group_fingerprint(job: Json, group_name: str) -> str:
    group = find_group(job, group_name) or {}
    shape = {
        "Datacenters": job.get("Datacenters"),
        "Meta": job.get("Meta"),
        "Constraints": job.get("Constraints"),
        "Affinities": job.get("Affinities"),
        "Spreads": job.get("Spreads"),
        "Group": {
            k: v for k, v in group.items() if k not in _IN_PLACE_GROUP_FIELDS and k != "Tasks"
        },
        "Tasks": [
            {k: v for k, v in task.items() if k not in _IN_PLACE_TASK_FIELDS}
            for task in group.get("Tasks") or []
        ],
    }
    return json.dumps(shape, sort_keys=True, default=str)


def is_destructive(old_job: Json | None, new_job: Json, group_name: str) -> bool:
    """Whether moving an allocation from `old_job` to `new_job` needs a new allocation."""
    if old_job is None:
        return True
    return _group_fingerprint(old_job, group_name) != _group_fingerprint(new_job, group_name)


# -- planning ------------------------------------------------------------


@dataclass(slots=True)
class _Builder:
    inputs: PlanInputs
    rng: random.Random
    new_id: Callable[[], str]
    stops: list[StopAlloc] = field(default_factory=list)
    placements: list[Allocation] = field(default_factory=list)
    in_place: list[str] = field(default_factory=list)
    follow_ups: list[FollowUp] = field(default_factory=list)
    failures: dict[str, AllocMetric] = field(default_factory=dict)
    queued: dict[str, int] = field(default_factory=dict)
    desired: dict[str, DesiredUpdates] = field(default_factory=dict)

    def proposed(self) -> dict[str, list[Allocation]]:
        stopped = {stop.alloc_id for stop in self.stops}
        by_node: dict[str, list[Allocation]] = {}
        for alloc in self.inputs.cluster_allocs:
            if alloc.terminal or alloc.id in stopped:
                continue
            by_node.setdefault(alloc.node_id, []).append(alloc)
        for alloc in self.placements:
            by_node.setdefault(alloc.node_id, []).append(alloc)
        return by_node


@dataclass(frozen=True, slots=True)
class _Want:
    name: str
    previous: Allocation | None
    penalty: frozenset[str]
    reschedule: bool


def _alloc_name(job_id: str, group: str, index: int) -> str:
    return f"{job_id}.{group}[{index}]"


def _place(
    builder: _Builder,
    job: Json,
    group: Json,
    want: _Want,
    deployment_id: str,
) -> bool:
    inputs = builder.inputs
    context = PlacementContext(
        job=job,
        group=group,
        nodes=inputs.nodes,
        proposed=builder.proposed(),
        penalty_node_ids=want.penalty,
        alloc_name=want.name,
    )
    result = select_node(context, builder.rng)
    group_name = str(group["Name"])
    if isinstance(result, PlacementFailure):
        existing = builder.failures.get(group_name)
        if existing is None:
            builder.failures[group_name] = result.metric
        else:
            existing.coalesced_failures += 1
        builder.queued[group_name] = builder.queued.get(group_name, 0) + 1
        return False
    events: tuple[RescheduleEvent, ...] = ()
    if want.previous is not None and want.reschedule:
        delay = _next_delay(want.previous, group.get("ReschedulePolicy") or {})
        events = (
            *want.previous.reschedule_events,
            RescheduleEvent(
                reschedule_time_ns=inputs.now_ns,
                prev_alloc_id=want.previous.id,
                prev_node_id=want.previous.node_id,
                delay_ns=delay,
            ),
        )
    builder.placements.append(
        Allocation(
            id=builder.new_id(),
            namespace=str(job["Namespace"]),
            eval_id=inputs.evaluation.id,
            name=want.name,
            node_id=result.node.id,
            node_name=result.node.name,
            job_id=str(job["ID"]),
            job_version=int(job.get("Version", 0)),
            task_group=group_name,
            resources=result.resources,
            metrics=result.metric.to_api(),
            create_time_ns=inputs.now_ns,
            modify_time_ns=inputs.now_ns,
            deployment_id=deployment_id,
            previous_allocation=want.previous.id if want.previous is not None else "",
            reschedule_events=events,
        )
    )
    return True


def _plan_group(
    builder: _Builder,
    job: Json | None,
    group_name: str,
    allocs: list[Allocation],
    deployment_id: str,
) -> None:
    inputs = builder.inputs
    group = find_group(job, group_name) if job is not None and not job.get("Stop") else None
    desired_count = int(group.get("Count", 0)) if group is not None else 0
    updates = builder.desired.setdefault(group_name, DesiredUpdates())
    nodes = {node.id: node for node in inputs.nodes}
    occupied: dict[str, Allocation] = {}  # name -> alloc keeping that slot
    wants: list[_Want] = []
    later: list[Allocation] = []
    later_time = 0
    current_version = int(job.get("Version", 0)) if job is not None else 0
    job_id = str((job or {}).get("ID") or (allocs[0].job_id if allocs else ""))

    batch = str((job or {}).get("Type", "")) == "batch"
    for alloc in sorted(allocs, key=lambda a: (a.index, a.create_index)):
        if (
            batch
            and group is not None
            and alloc.client_status == "complete"
            and alloc.job_version == current_version
        ):
            # Nomad's `shouldFilter`: a batch allocation that ran successfully is
            # done and keeps its slot, even on a node that is down since.
            occupied.setdefault(alloc.name, alloc)
            updates.ignore += 1
            continue
        if alloc.server_terminal or alloc.client_status in {"lost", "complete"}:
            continue
        if group is None:
            if not alloc.client_terminal:
                builder.stops.append(StopAlloc(alloc.id, ALLOC_NOT_NEEDED))
                updates.stop += 1
            continue
        if alloc.client_status == "failed":
            if alloc.next_allocation:
                continue
            when, eligible = next_reschedule(alloc, group.get("ReschedulePolicy"))
            if not eligible:
                occupied.setdefault(alloc.name, alloc)
                updates.ignore += 1
            elif when <= inputs.now_ns + RESCHEDULE_WINDOW_NS:
                builder.stops.append(StopAlloc(alloc.id, ALLOC_RESCHEDULED))
                wants.append(_Want(alloc.name, alloc, frozenset({alloc.node_id}), reschedule=True))
                updates.reschedule_now += 1
            else:
                occupied.setdefault(alloc.name, alloc)
                if not alloc.followup_eval_id:
                    later.append(alloc)
                    later_time = max(later_time, when)
                updates.reschedule_later += 1
            continue
        node = nodes.get(alloc.node_id)
        if node is None or node.status == "down":
            builder.stops.append(StopAlloc(alloc.id, ALLOC_LOST, "lost", ALLOC_LOST))
            wants.append(_Want(alloc.name, alloc, frozenset(), reschedule=False))
            updates.place += 1
            continue
        if alloc.desired_transition.get("Migrate"):
            builder.stops.append(StopAlloc(alloc.id, ALLOC_MIGRATING))
            wants.append(_Want(alloc.name, alloc, frozenset(), reschedule=False))
            updates.migrate += 1
            continue
        if alloc.name in occupied:
            # A duplicate of a name (rare): keep the first.
            builder.stops.append(StopAlloc(alloc.id, ALLOC_NOT_NEEDED))
            updates.stop += 1
            continue
        if alloc.job_version != current_version:
            old = inputs.job_versions.get(alloc.job_version)
            if is_destructive(old, job or {}, group_name):
                builder.stops.append(StopAlloc(alloc.id, ALLOC_UPDATING))
                wants.append(_Want(alloc.name, None, frozenset(), reschedule=False))
                updates.destructive_update += 1
                continue
            builder.in_place.append(alloc.id)
            updates.in_place_update += 1
        else:
            updates.ignore += 1
        occupied[alloc.name] = alloc

    if group is None or job is None:
        return
    if later:
        builder.follow_ups.append(
            FollowUp(builder.new_id(), later_time, tuple(alloc.id for alloc in later))
        )
    wanted_names = {_alloc_name(job_id, group_name, index) for index in range(desired_count)}
    # Surplus: stop the highest indexes that are still live.
    for name in sorted(occupied, key=lambda n: -alloc_index(n)):
        if name in wanted_names:
            continue
        alloc = occupied.pop(name)
        if not alloc.client_terminal:
            builder.stops.append(StopAlloc(alloc.id, ALLOC_NOT_NEEDED))
            updates.stop += 1
            if alloc.id in builder.in_place:
                builder.in_place.remove(alloc.id)
                updates.in_place_update -= 1
            else:
                updates.ignore = max(updates.ignore - 1, 0)
    placed_names = set(occupied)
    for want in wants:
        if want.name not in wanted_names or want.name in placed_names:
            continue
        placed_names.add(want.name)
        _place(builder, job, group, want, deployment_id)
    for index in range(desired_count):
        name = _alloc_name(job_id, group_name, index)
        if name in placed_names:
            continue
        placed_names.add(name)
        updates.place += 1
        _place(builder, job, group, _Want(name, None, frozenset(), reschedule=False), deployment_id)


def _deployment_for(
    inputs: PlanInputs, new_id: Callable[[], str]
) -> tuple[Deployment | None, str, tuple[str, ...]]:
    """(deployment to create, deployment id for placements, deployments to cancel)."""
    job = inputs.job
    if job is None or job.get("Stop") or job.get("Type") != "service":
        active = tuple(d.id for d in inputs.deployments if d.active)
        return None, "", active
    version = int(job.get("Version", 0))
    current = next(
        (
            d
            for d in inputs.deployments
            if d.job_version == version and d.job_create_index == int(job.get("CreateIndex", 0))
        ),
        None,
    )
    stale = tuple(d.id for d in inputs.deployments if d.active and d is not current)
    if current is not None:
        return None, current.id if current.active else "", stale
    groups = {
        str(group["Name"]): DeploymentGroup(
            auto_revert=bool((group.get("Update") or {}).get("AutoRevert", False)),
            progress_deadline_ns=int((group.get("Update") or {}).get("ProgressDeadline", 0)),
            desired_total=int(group.get("Count", 0)),
        )
        for group in task_groups(job)
        if group.get("Update") is not None
    }
    if not groups:
        return None, "", stale
    deployment = Deployment(
        id=new_id(),
        namespace=str(job["Namespace"]),
        job_id=str(job["ID"]),
        job_version=version,
        job_modify_index=int(job.get("JobModifyIndex", 0)),
        job_create_index=int(job.get("CreateIndex", 0)),
        task_groups=groups,
        create_time_ns=inputs.now_ns,
        modify_time_ns=inputs.now_ns,
    )
    return deployment, deployment.id, stale


def plan_evaluation(inputs: PlanInputs, rng: random.Random, new_id: Callable[[], str]) -> Plan:
    """The plan for one evaluation of one job, as Nomad's service scheduler would make it."""
    builder = _Builder(inputs, rng, new_id)
    deployment, deployment_id, cancel = _deployment_for(inputs, new_id)
    by_group: dict[str, list[Allocation]] = {}
    for alloc in inputs.job_allocs:
        by_group.setdefault(alloc.task_group, []).append(alloc)
    group_names = [str(group["Name"]) for group in task_groups(inputs.job or {})]
    group_names += [name for name in by_group if name not in group_names]
    for name in group_names:
        _plan_group(builder, inputs.job, name, by_group.get(name, []), deployment_id)
    placed_for_deployment = any(alloc.deployment_id for alloc in builder.placements)
    if deployment is not None and not (placed_for_deployment or builder.in_place):
        deployment = None
        builder.placements = [
            dataclasses.replace(alloc, deployment_id="") for alloc in builder.placements
        ]
    elif deployment is not None:
        counts: dict[str, int] = {}
        for alloc in builder.placements:
            counts[alloc.task_group] = counts.get(alloc.task_group, 0) + 1
        deployment = _with_placed(deployment, counts)
    return Plan(
        stops=tuple(builder.stops),
        placements=tuple(builder.placements),
        in_place=tuple(builder.in_place),
        follow_ups=tuple(builder.follow_ups),
        failures=builder.failures,
        queued={name: builder.queued.get(name, 0) for name in group_names if inputs.job},
        desired_updates=builder.desired,
        new_deployment=deployment,
        cancel_deployments=cancel,
    )


def _with_placed(deployment: Deployment, counts: Mapping[str, int]) -> Deployment:
    groups = {
        name: dataclasses.replace(group, placed_allocs=group.placed_allocs + counts.get(name, 0))
        for name, group in deployment.task_groups.items()
    }
    return dataclasses.replace(deployment, task_groups=groups)
