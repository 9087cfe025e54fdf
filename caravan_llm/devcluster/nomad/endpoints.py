"""The Nomad server's RPC semantics, shared by the HTTP API and the simulated clients.

Register, plan, validate and deregister jobs; stop allocations; drain nodes
and change their eligibility; take client reports (allocation status,
heartbeats, registrations). Errors carry the HTTP status and body Nomad
answers with (`ApiError`).
"""

from __future__ import annotations

import base64
import copy
import dataclasses
import json
import random
from collections.abc import Callable, Mapping
from typing import Any

from caravan_llm.devcluster.nomad.canonicalize import DEFAULT_REGION as REGION
from caravan_llm.devcluster.nomad.canonicalize import add_implied_constraints, canonicalize_job
from caravan_llm.devcluster.nomad.gotext import go_time, multierror
from caravan_llm.devcluster.nomad.heartbeat import HeartbeatSettings, heartbeat_ttl_s
from caravan_llm.devcluster.nomad.model import (
    Allocation,
    Deployment,
    DrainStrategy,
    Evaluation,
    Node,
    task_groups,
)
from caravan_llm.devcluster.nomad.namespaces import DEFAULT_NAMESPACE, driver_problem
from caravan_llm.devcluster.nomad.node_pools import (
    NODE_POOL_ALL,
    NODE_POOL_DEFAULT,
    NodePool,
    nodes_in_pool,
    pool_from_body,
    pool_problems,
)
from caravan_llm.devcluster.nomad.state import (
    SERVER_JOB_FIELDS,
    ClusterState,
    EnforceIndexError,
    job_spec,
)
from caravan_llm.devcluster.nomad.validate import (
    is_parameterized,
    job_warnings,
    validate_job,
    validation_failure_text,
    warnings_text,
)
from caravan_llm.devcluster.nomad.worker import Scheduler, new_evaluation

Json = dict[str, Any]


class ApiError(Exception):
    """An error Nomad answers with this HTTP status and plain-text body."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(text)
        self.status = status
        self.text = text


def _namespace_for(job: Json, query_namespace: str | None) -> str:
    return str(job.get("Namespace") or query_namespace or DEFAULT_NAMESPACE)


def request_namespace(job: Json, query_namespace: str | None, body_namespace: Any = None) -> str:
    """The namespace a job write goes to (`namespaceForJob`): the `namespace` query
    parameter (the CLI's -namespace / NOMAD_NAMESPACE) first, then the request
    body's `Namespace`, then the job's own."""
    return str(query_namespace or body_namespace or job.get("Namespace") or DEFAULT_NAMESPACE)


def _field_diffs(
    old: Mapping[str, Any], new: Mapping[str, Any], skip: frozenset[str]
) -> list[Json]:
    fields: list[Json] = []
    for name in sorted(set(old) | set(new)):
        if name in skip:
            continue
        before, after = old.get(name), new.get(name)
        if isinstance(before, dict | list) or isinstance(after, dict | list) or before == after:
            continue
        kind = "Added" if before is None else "Deleted" if after is None else "Edited"
        fields.append(
            {
                "Type": kind,
                "Name": name,
                "Old": "" if before is None else _diff_text(before),
                "New": "" if after is None else _diff_text(after),
                "Annotations": None,
            }
        )
    return fields


def _diff_text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def job_diff(old: Json | None, new: Json, updates: Mapping[str, Json]) -> Json:
    """A `JobDiff` with top-level field changes and per-group update counts."""
    if old is None:
        kind = "Added"
    elif job_spec(old) == job_spec(new):
        kind = "None"
    else:
        kind = "Edited"
    groups = []
    old_groups = {str(g["Name"]): g for g in task_groups(old or {})}
    for group in task_groups(new):
        name = str(group["Name"])
        before = old_groups.get(name)
        group_kind = (
            "Added"
            if before is None
            else (
                "None"
                if json.dumps(before, sort_keys=True) == json.dumps(group, sort_keys=True)
                else "Edited"
            )
        )
        counts = updates.get(name, {})
        update_names = {
            "Place": "create",
            "Stop": "destroy",
            "InPlaceUpdate": "in-place update",
            "DestructiveUpdate": "create/destroy update",
            "Migrate": "migrate",
            "Ignore": "ignore",
        }
        groups.append(
            {
                "Type": group_kind,
                "Name": name,
                "Fields": _field_diffs(before or {}, group, frozenset()) or None,
                "Objects": None,
                "Tasks": [
                    {
                        "Type": group_kind,
                        "Name": str(task.get("Name", "")),
                        "Fields": None,
                        "Objects": None,
                        "Annotations": None,
                    }
                    for task in group.get("Tasks") or []
                ],
                "Updates": {
                    label: int(counts.get(key, 0))
                    for key, label in update_names.items()
                    if counts.get(key)
                }
                or None,
            }
        )
    return {
        "Type": kind,
        "ID": str(new["ID"]),
        "Fields": _field_diffs(old or {}, new, SERVER_JOB_FIELDS) or None,
        "Objects": None,
        "TaskGroups": groups,
    }


class Endpoints:
    """What the Nomad server does for each request."""

    def __init__(
        self,
        state: ClusterState,
        scheduler: Scheduler,
        *,
        new_id: Callable[[], str],
        monotonic: Callable[[], float],
        heartbeat: HeartbeatSettings | None = None,
        stagger: Callable[[], float] = random.random,
    ) -> None:
        self.state = state
        self.scheduler = scheduler
        self.new_id = new_id
        self.monotonic = monotonic
        self.heartbeat_settings = heartbeat or HeartbeatSettings()
        self.stagger = stagger
        # When each live node's heartbeat timer runs out (TTL + grace after its last one).
        self.heartbeat_deadline: dict[str, float] = {}

    # -- admission ----------------------------------------------------------

    def admit(self, decoded_job: Json, namespace: str) -> tuple[Json, list[str]]:
        """Canonicalize, add implied constraints, validate: Nomad's admission controllers."""
        job = dict(decoded_job)
        job["Namespace"] = namespace
        job = add_implied_constraints(canonicalize_job(job))
        # Nomad's namespace and node pool hooks run before jobValidate; their
        # errors are one multierror.
        errors = [
            *self._namespace_problems(job),
            *self._node_pool_problems(job),
            *validate_job(job),
        ]
        if errors:
            raise ApiError(500, validation_failure_text(errors))
        return job, job_warnings(job)

    def _namespace_problems(self, job: Json) -> list[str]:
        """`jobNamespaceConstraintCheckHook`: the namespace exists and allows the drivers."""
        namespace = self.state.namespaces.get(str(job["Namespace"]))
        if namespace is None:
            return [f'job "{job["ID"]}" is in nonexistent namespace "{job["Namespace"]}"']
        drivers = [
            str(task.get("Driver") or "")
            for group in task_groups(job)
            for task in group.get("Tasks") or []
        ]
        problem = driver_problem(namespace, drivers)
        return [] if problem is None else [problem]

    def _node_pool_problems(self, job: Json) -> list[str]:
        pool = str(job.get("NodePool") or NODE_POOL_DEFAULT)
        if pool in self.state.node_pools:
            return []
        return [f'job "{job["ID"]}" is in nonexistent node pool "{pool}"']

    # -- node pools -----------------------------------------------------------

    def node_pool(self, name: str) -> NodePool:
        pool = self.state.node_pools.get(name)
        if pool is None:
            raise ApiError(404, "node pool not found")
        return pool

    def upsert_node_pool(self, body: Json, path_name: str | None) -> int:
        pool = pool_from_body(body)
        if path_name is not None and pool.name != path_name:
            raise ApiError(400, "Node pool name does not match request path")
        problems = pool_problems(pool)
        if problems:
            raise ApiError(400, f'invalid node pool "{pool.name}": {multierror(problems)}')
        if pool.built_in:
            raise ApiError(400, f'modifying node pool "{pool.name}" is not allowed')
        return self.state.upsert_node_pool(pool)

    def delete_node_pool(self, name: str) -> int:
        if not name:
            raise ApiError(400, "node pool name is empty")
        in_use = []
        jobs = [
            job
            for job in self.state.jobs.values()
            if str(job.get("NodePool") or NODE_POOL_DEFAULT) == name and job.get("Status") != "dead"
        ]
        if jobs:
            in_use.append(f'node pool "{name}" has non-terminal jobs in regions: [{REGION}]')
        if name != NODE_POOL_ALL and any(n.node_pool == name for n in self.state.nodes.values()):
            in_use.append(f'node pool "{name}" has nodes in regions: [{REGION}]')
        if in_use:
            raise ApiError(500, multierror(in_use))
        pool = self.state.node_pools.get(name)
        if pool is None:
            raise ApiError(500, f"node pool {name} not found")
        if pool.built_in:
            raise ApiError(500, f'deleting node pool "{name}" is not allowed')
        return self.state.delete_node_pool(name)

    def node_pool_nodes(self, name: str) -> list[Node]:
        """The pool's nodes by ID (Nomad's memdb order); none for an unknown pool."""
        if name not in self.state.node_pools:
            return []
        pools = {node.id: node.node_pool for node in self.state.nodes.values()}
        return [self.state.nodes[i] for i in sorted(nodes_in_pool(name, pools))]

    def node_pool_jobs(self, name: str) -> list[Json]:
        if name not in self.state.node_pools:
            return []
        return [
            job
            for _, job in sorted(self.state.jobs.items())
            if name == NODE_POOL_ALL or str(job.get("NodePool") or NODE_POOL_DEFAULT) == name
        ]

    @staticmethod
    def _require_job(request: Json, path_job_id: str | None, *, plan: bool = False) -> Json:
        job = request.get("Job")
        if job is None:
            raise ApiError(400, "Job must be specified")
        if "ID" not in job:
            raise ApiError(
                400, "Job must have a valid ID" if plan else "Job ID hasn't been provided"
            )
        if path_job_id is not None and job["ID"] != path_job_id:
            raise ApiError(400, "Job ID does not match" if plan else "Job ID does not match name")
        return dict(job)

    def _new_eval(self, job: Json, triggered_by: str, *, node_id: str = "") -> Evaluation:
        return new_evaluation(
            job, triggered_by, eval_id=self.new_id(), now_ns=self.state.clock_ns(), node_id=node_id
        )

    def create_evals(self, jobs: list[Json], triggered_by: str, *, node_id: str = "") -> list[str]:
        evaluations = [self._new_eval(job, triggered_by, node_id=node_id) for job in jobs]
        if not evaluations:
            return []
        self.state.upsert_evals(evaluations)
        for evaluation in evaluations:
            self.scheduler.enqueue(self.state.evals[evaluation.id])
        return [evaluation.id for evaluation in evaluations]

    # -- jobs -----------------------------------------------------------------

    def register_job(
        self, request: Json, path_job_id: str | None, query_namespace: str | None
    ) -> Json:
        decoded = self._require_job(request, path_job_id)
        priority = int(request.get("EvalPriority", 0))
        if priority != 0 and not 1 <= priority <= 100:
            raise ApiError(400, "Eval priority must be between 1 and 100 inclusively")
        job, warnings = self.admit(
            decoded, request_namespace(decoded, query_namespace, request.get("Namespace"))
        )
        enforce = int(request.get("JobModifyIndex", 0)) if request.get("EnforceIndex") else None
        existing = self.state.job(job["Namespace"], job["ID"])
        try:
            stored, evaluation, index, changed = self.state.register_job(
                job,
                enforce_index=enforce,
                # Periodic and parameterized jobs get no evaluation: their children do.
                make_eval=None
                if job.get("Periodic") is not None or is_parameterized(job)
                else lambda stored: self._new_eval(stored, "job-register"),
            )
        except EnforceIndexError as exc:
            raise ApiError(500, str(exc)) from None
        if evaluation is not None:
            self.scheduler.enqueue(evaluation)
        job_modify_index = (
            int(stored["JobModifyIndex"])
            if changed or existing is None
            else int(existing["ModifyIndex"])
        )
        return {
            "EvalID": evaluation.id if evaluation is not None else "",
            "EvalCreateIndex": index if evaluation is not None else 0,
            "JobModifyIndex": job_modify_index,
            "Warnings": warnings_text(warnings),
            "Index": index,
            "LastContact": 0,
            "KnownLeader": False,
            "NextToken": "",
        }

    def validate_job_request(self, request: Json, query_namespace: str | None) -> Json:
        decoded = request.get("Job")
        if decoded is None:
            raise ApiError(400, "Job must be specified")
        job = dict(decoded)
        job["Namespace"] = _namespace_for(job, query_namespace)
        job = add_implied_constraints(canonicalize_job(job))
        errors = validate_job(job)
        return {
            "DriverConfigValidated": True,
            "ValidationErrors": errors or None,
            "Error": validation_failure_text(errors) if errors else "",
            "Warnings": warnings_text(job_warnings(job)),
        }

    def plan_job(self, request: Json, path_job_id: str | None, query_namespace: str | None) -> Json:
        decoded = self._require_job(request, path_job_id, plan=True)
        job, warnings = self.admit(
            decoded, request_namespace(decoded, query_namespace, request.get("Namespace"))
        )
        existing = self.state.job(job["Namespace"], job["ID"])
        candidate = dict(job)
        if existing is None:
            candidate.update({"Version": 0, "CreateIndex": 0, "JobModifyIndex": 0})
        else:
            changed = job_spec(existing) != job_spec(job)
            candidate.update(
                {
                    "Version": int(existing["Version"]) + (1 if changed else 0),
                    "CreateIndex": existing["CreateIndex"],
                    "JobModifyIndex": existing["JobModifyIndex"],
                }
            )
        evaluation = self._new_eval(candidate, "job-register")
        plan = self.scheduler.dry_run(evaluation, candidate)
        desired = {name: updates.to_api() for name, updates in plan.desired_updates.items()}
        failed = {name: metric.to_api() for name, metric in plan.failures.items()}
        created: list[Json] | None = None
        if failed:
            blocked = dataclasses.replace(
                new_evaluation(
                    candidate,
                    "queued-allocs",
                    eval_id=self.new_id(),
                    now_ns=self.state.clock_ns(),
                    status="blocked",
                    previous_eval=evaluation.id,
                ),
                status_description="created to place remaining allocations",
                failed_tg_allocs=failed,
                queued_allocations=dict(plan.queued),
            )
            created = [blocked.to_api()]
        response: Json = {
            "Annotations": {"DesiredTGUpdates": desired, "PreemptedAllocs": None},
            "FailedTGAllocs": failed or None,
            "JobModifyIndex": int(existing["JobModifyIndex"]) if existing else 0,
            "CreatedEvals": created,
            "Diff": job_diff(existing, candidate, desired) if request.get("Diff") else None,
            "NextPeriodicLaunch": go_time(None),
            "Warnings": warnings_text(warnings),
            "Index": self.state.index,
        }
        return response

    def deregister_job(self, namespace: str, job_id: str, *, purge: bool) -> Json:
        evaluation, index, job_modify_index = self.state.deregister_job(
            namespace,
            job_id,
            purge=purge,
            make_eval=lambda job: self._new_eval(job, "job-deregister"),
        )
        if evaluation is not None:
            self.scheduler.enqueue(evaluation)
        return {
            "EvalID": evaluation.id if evaluation is not None else "",
            "EvalCreateIndex": index,
            "JobModifyIndex": job_modify_index,
            "VolumeEvalID": "",
            "VolumeEvalIndex": 0,
            "Index": index,
            "LastContact": 0,
            "KnownLeader": False,
            "NextToken": "",
        }

    # -- allocations --------------------------------------------------------

    def stop_alloc(self, alloc_id: str) -> Json:
        alloc = self.state.allocs.get(alloc_id)
        if alloc is None:
            raise ApiError(404, "alloc not found")
        self.state.set_desired_transition([alloc_id], {"Migrate": True})
        job = self.state.job(alloc.namespace, alloc.job_id) or {
            "ID": alloc.job_id,
            "Namespace": alloc.namespace,
        }
        eval_ids = self.create_evals([job], "alloc-stop")
        return {"EvalID": eval_ids[0], "Index": self.state.index}

    def client_update(self, allocs: list[Allocation]) -> None:
        """A client reports allocation status; failures and freed capacity trigger evals."""
        before = {alloc.id: self.state.allocs.get(alloc.id) for alloc in allocs}
        self.state.client_update(allocs)
        failed_jobs: dict[tuple[str, str], Json] = {}
        freed = False
        for alloc in allocs:
            previous = before[alloc.id]
            became_terminal = alloc.client_terminal and not (previous and previous.client_terminal)
            freed = freed or became_terminal
            if (
                alloc.client_status == "failed"
                and (previous is None or previous.client_status != "failed")
                and alloc.desired_status == "run"
            ):
                job = self.state.job(alloc.namespace, alloc.job_id)
                if job is not None and not job.get("Stop"):
                    failed_jobs[(alloc.namespace, alloc.job_id)] = job
        if failed_jobs:
            self.create_evals(list(failed_jobs.values()), "alloc-failure")
        if freed:
            self.scheduler.capacity_changed()

    # -- nodes --------------------------------------------------------------

    def node(self, node_id_or_prefix: str) -> Node:
        node = self.state.nodes.get(node_id_or_prefix)
        if node is not None:
            return node
        matches = [n for n in self.state.nodes.values() if n.id.startswith(node_id_or_prefix)]
        if len(matches) == 1:
            return matches[0]
        if len(matches) > 1:
            raise ApiError(400, f"Ambiguous identifier: {node_id_or_prefix}")
        raise ApiError(404, "node not found")

    def _node_event(self, message: str, subsystem: str = "Cluster") -> Json:
        return {
            "Message": message,
            "Subsystem": subsystem,
            "Details": None,
            "Timestamp": go_time(self.state.clock_ns()),
            "CreateIndex": self.state.index + 1,
        }

    def register_node(self, node: Node) -> Node:
        """A client (re)registers: `initializing`, then `ready` once fingerprinted."""
        self.reset_heartbeat_timer(node.id)
        previous = self.state.nodes.get(node.id)
        message = "Node registered" if previous is None else "Node re-registered"
        events = (*(previous.events if previous else ()), self._node_event(message))[-10:]
        stored = self.state.upsert_node(
            dataclasses.replace(
                node,
                status="initializing",
                events=events,
                eligibility=previous.eligibility if previous else node.eligibility,
                drain=previous.drain if previous else None,
                status_updated_at_s=self.state.clock_ns() // 1_000_000_000,
            ),
            "NodeRegistration",
        )
        return self.set_node_status(stored.id, "ready")

    def set_node_status(self, node_id: str, status: str, message: str | None = None) -> Node:
        node = self.state.nodes[node_id]
        events = node.events
        if message:
            events = (*events, self._node_event(message))[-10:]
        stored = self.state.upsert_node(
            dataclasses.replace(
                node,
                status=status,
                events=events,
                status_updated_at_s=self.state.clock_ns() // 1_000_000_000,
            ),
            "NodeStreamEvent",
        )
        if status == "ready":
            self.scheduler.capacity_changed()
        else:
            self.create_node_evals(node_id, "node-update")
        return stored

    def reset_heartbeat_timer(self, node_id: str) -> float:
        """`resetHeartbeatTimer`: a new TTL for the client; the timer runs TTL + grace."""
        timers = len(self.heartbeat_deadline.keys() - {node_id}) + 1
        ttl = heartbeat_ttl_s(self.heartbeat_settings, timers, self.stagger())
        self.heartbeat_deadline[node_id] = self.monotonic() + ttl + self.heartbeat_settings.grace_s
        return ttl

    def heartbeat(self, node_id: str) -> float:
        """A client heartbeats; returns the TTL after which it should heartbeat again."""
        ttl = self.reset_heartbeat_timer(node_id)
        node = self.state.nodes.get(node_id)
        if node is not None and node.status == "down":
            self.set_node_status(node_id, "ready", "Node reregistered by heartbeat")
        return ttl

    def heartbeat_expired(self, node_id: str) -> None:
        """`invalidateHeartbeat`: the timer ran out; the node is down."""
        self.heartbeat_deadline.pop(node_id, None)
        self.set_node_status(node_id, "down", "Node heartbeat missed")

    def create_node_evals(self, node_id: str, triggered_by: str) -> list[str]:
        jobs: dict[tuple[str, str], Json] = {}
        for alloc in self.state.allocs_of_node(node_id):
            if alloc.terminal:
                continue
            job = self.state.job(alloc.namespace, alloc.job_id)
            if job is not None:
                jobs[(alloc.namespace, alloc.job_id)] = job
        return self.create_evals(list(jobs.values()), triggered_by, node_id=node_id)

    def drain_node(
        self, node_id: str, drain_spec: Json | None, *, mark_eligible: bool, meta: Mapping[str, str]
    ) -> Json:
        node = self.node(node_id)
        now = self.state.clock_ns()
        if drain_spec is None:
            last = node.last_drain
            if node.drain is not None:
                last = {
                    "StartedAt": go_time(node.drain.started_at_ns),
                    "UpdatedAt": go_time(now),
                    "Status": "canceled",
                    "AccessorID": "",
                    "Meta": dict(meta) or None,
                }
            stored = self.state.upsert_node(
                dataclasses.replace(
                    node,
                    drain=None,
                    last_drain=last,
                    eligibility="eligible" if mark_eligible else node.eligibility,
                ),
                "NodeDrain",
            )
            if mark_eligible:
                self.scheduler.capacity_changed()
            return {
                "EvalCreateIndex": 0,
                "EvalIDs": None,
                "Index": stored.modify_index,
                "NodeModifyIndex": stored.modify_index,
            }
        deadline = int(drain_spec.get("Deadline", 0))
        force_at = None
        if deadline < 0:
            force_at = now
        elif deadline > 0:
            force_at = now + deadline
        strategy = DrainStrategy(
            deadline_ns=deadline,
            ignore_system_jobs=bool(drain_spec.get("IgnoreSystemJobs", False)),
            force_deadline_ns=force_at,
            started_at_ns=now,
        )
        stored = self.state.upsert_node(
            dataclasses.replace(
                node,
                drain=strategy,
                eligibility="ineligible",
                last_drain={
                    "StartedAt": go_time(now),
                    "UpdatedAt": go_time(now),
                    "Status": "draining",
                    "AccessorID": "",
                    "Meta": dict(meta) or None,
                },
            ),
            "NodeDrain",
        )
        return {
            "EvalCreateIndex": 0,
            "EvalIDs": None,
            "Index": stored.modify_index,
            "NodeModifyIndex": stored.modify_index,
        }

    def set_eligibility(self, node_id: str, eligibility: str) -> Json:
        node = self.node(node_id)
        if eligibility not in {"eligible", "ineligible"}:
            raise ApiError(400, f'invalid scheduling eligibility "{eligibility}"')
        if node.drain is not None and eligibility == "eligible":
            raise ApiError(
                500, "can not set node's scheduling eligibility to eligible while it is draining"
            )
        stored = self.state.upsert_node(
            dataclasses.replace(node, eligibility=eligibility), "NodeEligibility"
        )
        if eligibility == "eligible":
            self.scheduler.capacity_changed()
        return {
            "EvalCreateIndex": 0,
            "EvalIDs": None,
            "Index": stored.modify_index,
            "NodeModifyIndex": stored.modify_index,
        }

    # -- job versions, dispatch, deployments (issue 16 item 2) ------------------

    def _versioned(self, namespace: str, job_id: str, version: int) -> Json:
        stored = self.state.job_versions.get((namespace, job_id), {}).get(version)
        if stored is None:
            raise ApiError(
                500,
                f'job "{job_id}" in namespace "{namespace}" at version {version} not found',
            )
        return stored

    def revert_job(
        self, namespace: str, job_id: str, version: int, enforce_prior_version: int | None
    ) -> Json:
        """`Job.Revert`: register an older version again (a new version, not stable)."""
        current = self.state.job(namespace, job_id)
        if current is None:
            raise ApiError(500, f'job "{job_id}" not found')
        if version == int(current["Version"]):
            raise ApiError(500, "can't revert to current version")
        older = self._versioned(namespace, job_id, version)
        request: Json = {"Job": _spec_only(older)}
        if enforce_prior_version is not None:
            if int(current["Version"]) != enforce_prior_version:
                raise ApiError(
                    500,
                    f"Current job has version {current['Version']}; enforcing version "
                    f"{enforce_prior_version}",
                )
            request.update(EnforceIndex=True, JobModifyIndex=int(current["JobModifyIndex"]))
        return self.register_job(request, job_id, namespace)

    def set_job_stability(self, namespace: str, job_id: str, version: int, stable: bool) -> Json:
        """`Job.Stable`: the answer is only the write index (`JobStabilityResponse`)."""
        self._versioned(namespace, job_id, version)
        index = self.state.set_job_stability(namespace, job_id, version, stable)
        return {"Index": index}

    def dispatch_job(
        self,
        namespace: str,
        job_id: str,
        *,
        meta: Mapping[str, str],
        payload: bytes,
        id_prefix_template: str,
        priority: int,
    ) -> Json:
        """`Job.Dispatch`: a child job `<parent>/dispatch-<unix>-<id>` with its own eval."""
        parent = self.state.job(namespace, job_id)
        if parent is None:
            raise ApiError(500, "parameterized job not found")
        if not is_parameterized(parent):
            raise ApiError(500, f'Specified job "{job_id}" is not a parameterized job')
        if parent.get("Stop"):
            raise ApiError(500, f'Specified job "{job_id}" is stopped')
        problem = dispatch_problem(
            parent["ParameterizedJob"], meta, payload, priority or int(parent["Priority"])
        )
        if problem is not None:
            raise ApiError(500, problem)
        now_ns = self.state.clock_ns()
        suffix = f"{now_ns // 1_000_000_000}-{self.new_id()[:8]}"
        child_id = (
            f"{job_id}/dispatch-{id_prefix_template}-{suffix}"
            if id_prefix_template
            else f"{job_id}/dispatch-{suffix}"
        )
        child = _spec_only(parent)
        child.update(
            ID=child_id,
            Name=child_id,
            ParentID=job_id,
            Dispatched=True,
            Priority=priority or int(parent["Priority"]),
            Meta={**(parent.get("Meta") or {}), **meta} or None,
            Payload=base64.b64encode(payload).decode() if payload else None,
        )
        stored, evaluation, index, _ = self.state.register_job(
            child,
            enforce_index=None,
            make_eval=lambda job: self._new_eval(job, "job-register"),
        )
        if evaluation is not None:
            self.scheduler.enqueue(evaluation)
        return {
            "DispatchedJobID": child_id,
            "EvalID": evaluation.id if evaluation is not None else "",
            "EvalCreateIndex": index,
            "JobCreateIndex": int(stored["CreateIndex"]),
            "Index": index,
        }

    def evaluate_node(self, node_id: str) -> Json:
        """`Node.Evaluate`: an evaluation per job with allocations on the node (exact ID)."""
        node = self.state.nodes.get(node_id)
        if node is None:
            raise ApiError(500, "node not found")
        eval_ids = self.create_node_evals(node_id, "node-update")
        index = self.state.index if eval_ids else 0
        return {
            "HeartbeatTTL": 0,
            "EvalIDs": eval_ids or None,
            "EvalCreateIndex": index,
            "NodeModifyIndex": 0,
            "Features": 0,
            "LeaderRPCAddr": "",
            "NumNodes": 0,
            "Servers": None,
            "SchedulingEligibility": "",
            "SignedIdentity": None,
            "Index": index,
            "LastContact": 0,
            "KnownLeader": False,
            "NextToken": "",
        }

    def _active_deployment(self, deployment_id: str, terminal_text: str) -> Deployment:
        deployment = self.state.deployments.get(deployment_id)
        if deployment is None:
            raise ApiError(500, "deployment not found")
        if not deployment.active:
            raise ApiError(500, terminal_text)
        return deployment

    def _deployment_eval(self, deployment: Deployment) -> Evaluation:
        job = self.state.job(deployment.namespace, deployment.job_id) or {
            "ID": deployment.job_id,
            "Namespace": deployment.namespace,
        }
        evaluation = dataclasses.replace(
            self._new_eval(job, "deployment-watcher"), deployment_id=deployment.id
        )
        self.state.upsert_evals([evaluation])
        self.scheduler.enqueue(self.state.evals[evaluation.id])
        return evaluation

    def _rollback_target(self, deployment: Deployment, description: str) -> tuple[Json | None, str]:
        """The latest stable version to revert to when a group auto-reverts, and the text."""
        if not any(group.auto_revert for group in deployment.task_groups.values()):
            return None, description
        key = (deployment.namespace, deployment.job_id)
        versions = self.state.job_versions.get(key, {})
        stable = [versions[v] for v in sorted(versions, reverse=True) if versions[v].get("Stable")]
        if not stable:
            return None, f"{description} - no stable job version to auto revert to"
        target = stable[0]
        current = self.state.jobs.get(key)
        if current is not None and job_spec(current) == job_spec(target):
            return None, (
                f"{description} - not rolling back to stable job version {target['Version']} "
                "as current job has same specification"
            )
        return target, f"{description} - rolling back to job version {target['Version']}"

    def _fail(self, deployment: Deployment, description: str) -> Json:
        target, description = self._rollback_target(deployment, description)
        stored = self.state.upsert_deployment(
            dataclasses.replace(deployment, status="failed", status_description=description),
            "DeploymentStatusUpdate",
        )
        evaluation = self._deployment_eval(stored)
        reverted = None
        if target is not None:
            reverted = int(target["Version"])
            self.register_job({"Job": _spec_only(target)}, None, deployment.namespace)
        return {
            "EvalID": evaluation.id,
            "EvalCreateIndex": self.state.evals[evaluation.id].create_index,
            "DeploymentModifyIndex": stored.modify_index,
            "RevertedJobVersion": reverted,
            "Index": self.state.index,
        }

    def fail_deployment(self, deployment_id: str) -> Json:
        deployment = self._active_deployment(deployment_id, "can't fail terminal deployment")
        return self._fail(deployment, "Deployment marked as failed")

    def pause_deployment(self, deployment_id: str, *, pause: bool) -> Json:
        terminal = (
            "can't pause terminal deployment" if pause else "can't resume terminal deployment"
        )
        deployment = self._active_deployment(deployment_id, terminal)
        status, description = ("paused", "Deployment is paused")
        if not pause:
            status, description = ("running", "Deployment is running")
        stored = self.state.upsert_deployment(
            dataclasses.replace(deployment, status=status, status_description=description),
            "DeploymentStatusUpdate",
        )
        response: Json = {
            "EvalID": "",
            "EvalCreateIndex": 0,
            "DeploymentModifyIndex": stored.modify_index,
            "RevertedJobVersion": None,
            "Index": stored.modify_index,
        }
        if not pause:
            evaluation = self._deployment_eval(stored)
            index = self.state.evals[evaluation.id].create_index
            response.update(EvalID=evaluation.id, EvalCreateIndex=index, Index=index)
        return response

    def promote_deployment(self, deployment_id: str) -> Json:
        """devcluster places no canaries, so there is nothing to promote but the eval."""
        deployment = self._active_deployment(deployment_id, "can't promote terminal deployment")
        stored = self.state.upsert_deployment(deployment, "DeploymentPromotion")
        evaluation = self._deployment_eval(stored)
        index = self.state.evals[evaluation.id].create_index
        return {
            "EvalID": evaluation.id,
            "EvalCreateIndex": index,
            "DeploymentModifyIndex": index,
            "RevertedJobVersion": None,
            "Index": index,
        }

    def set_alloc_health(
        self, deployment_id: str, healthy: list[str], unhealthy: list[str]
    ) -> Json:
        """`Deployment.SetAllocHealth`: mark allocations; any unhealthy one fails it."""
        if not healthy and not unhealthy:
            raise ApiError(500, "must specify at least one healthy/unhealthy allocation ID")
        deployment = self._active_deployment(
            deployment_id, "can't set health of allocations for a terminal deployment"
        )
        marked: list[Allocation] = []
        now = go_time(self.state.clock_ns())
        for alloc_id, is_healthy in [(a, True) for a in healthy] + [(a, False) for a in unhealthy]:
            alloc = self.state.allocs.get(alloc_id)
            if alloc is None:
                raise ApiError(500, f'unknown alloc "{alloc_id}"')
            if alloc.deployment_id != deployment_id:
                raise ApiError(
                    500, f'alloc "{alloc_id}" is not part of deployment "{deployment_id}"'
                )
            status = {**(alloc.deployment_status or {}), "Healthy": is_healthy, "Timestamp": now}
            marked.append(dataclasses.replace(alloc, deployment_status=status))
        self.state.client_update(marked)
        if unhealthy:
            return self._fail(deployment, "Failed due to unhealthy allocations")
        evaluation = self._deployment_eval(deployment)
        index = self.state.evals[evaluation.id].create_index
        return {
            "EvalID": evaluation.id,
            "EvalCreateIndex": index,
            "DeploymentModifyIndex": index,
            "RevertedJobVersion": None,
            "Index": index,
        }


DISPATCH_PAYLOAD_LIMIT = 16 * 1024
MAX_PRIORITY = 100


def _spec_only(job: Json) -> Json:
    """A stored job without the fields the server sets, ready to register again."""
    spec = {k: copy.deepcopy(v) for k, v in job.items() if k not in SERVER_JOB_FIELDS}
    spec["Stable"] = False
    return spec


def _go_list(keys: list[str]) -> str:
    return "[" + " ".join(keys) + "]"


def dispatch_problem(
    config: Json, meta: Mapping[str, str], payload: bytes, priority: int
) -> str | None:
    """`validateDispatchRequest`: Nomad's text for the first problem, or None."""
    mode = str(config.get("Payload") or "optional")
    if mode == "required" and not payload:
        return "Payload is not provided but required by parameterized job"
    if mode == "forbidden" and payload:
        return "Payload provided but forbidden by parameterized job"
    if len(payload) > DISPATCH_PAYLOAD_LIMIT:
        return f"Payload exceeds maximum size; {len(payload)} > {DISPATCH_PAYLOAD_LIMIT}"
    required = list(config.get("MetaRequired") or [])
    allowed = set(required) | set(config.get("MetaOptional") or [])
    unpermitted = sorted(key for key in meta if key not in allowed)
    if unpermitted:
        return f"Dispatch request included unpermitted metadata keys: {_go_list(unpermitted)}"
    missing = [key for key in required if key not in meta]
    if missing:
        return f"Dispatch did not provide required meta keys: {_go_list(missing)}"
    if not 1 <= priority <= MAX_PRIORITY:
        return f"dispatch job priority must be between [1, {MAX_PRIORITY}]"
    return None
