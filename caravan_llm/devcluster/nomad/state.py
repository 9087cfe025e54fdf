"""The Nomad stand-in's state store: one index, tables, blocking waiters, events.

Like Nomad's raft-backed store, every write gets the next index, stamps the
objects it changes with it, raises the index of the tables it touched, wakes
blocking queries, and publishes one event frame typed by the kind of write.
Writes are plain synchronous methods on one event loop, so each is atomic.
Values are immutable; a write swaps them.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from caravan_llm.devcluster.nomad.events import Event, EventBroker
from caravan_llm.devcluster.nomad.model import (
    Allocation,
    Deployment,
    Evaluation,
    Node,
    task_groups,
)
from caravan_llm.devcluster.nomad.namespaces import Namespace, built_in_namespaces
from caravan_llm.devcluster.nomad.node_pools import NodePool, built_in_pools

Json = dict[str, Any]

TABLES = (
    "jobs",
    "allocs",
    "evals",
    "deployment",
    "nodes",
    "job_summary",
    "node_pools",
    "namespaces",
)
# Server-set job fields that do not make a new version (`Job.SpecChanged`).
SERVER_JOB_FIELDS = frozenset(
    {
        "Status",
        "StatusDescription",
        "Stable",
        "Version",
        "SubmitTime",
        "CreateIndex",
        "ModifyIndex",
        "JobModifyIndex",
        "NomadTokenID",
    }
)
EVAL_TERMINAL = frozenset({"complete", "failed", "canceled", "cancelled"})
ENFORCE_PREFIX = "Enforcing job modify index"


class EnforceIndexError(Exception):
    """A register with `EnforceIndex` lost against the stored `JobModifyIndex`."""


def job_spec(job: Mapping[str, Any]) -> str:
    """The part of a job that decides whether a register is a new version."""
    return json.dumps(
        {k: v for k, v in job.items() if k not in SERVER_JOB_FIELDS}, sort_keys=True, default=str
    )


def job_status(job: Json, allocs: Iterable[Allocation], evals: Iterable[Evaluation]) -> str:
    """`getJobStatus`: running with a live allocation, pending with a live eval, else dead.

    Periodic and parameterized jobs (not their children) run until stopped."""
    if job.get("Periodic") is not None or (
        job.get("ParameterizedJob") is not None and not job.get("Dispatched")
    ):
        return "dead" if job.get("Stop") else "running"
    has_alloc = False
    for alloc in allocs:
        has_alloc = True
        if not alloc.terminal:
            return "running"
    has_eval = False
    for evaluation in evals:
        if evaluation.status not in EVAL_TERMINAL:
            return "pending"
        has_eval = True
    if job.get("Stop") or has_eval or has_alloc:
        return "dead"
    return "pending"


def _alloc_event(alloc: Allocation, kind: str) -> Event:
    return Event(
        topic="Allocation",
        type=kind,
        key=alloc.id,
        namespace=alloc.namespace,
        filter_keys=(alloc.job_id, alloc.deployment_id),
        payload={"Allocation": alloc.to_api(None, include_job=False)},
    )


def _eval_event(evaluation: Evaluation, kind: str) -> Event:
    return Event(
        topic="Evaluation",
        type=kind,
        key=evaluation.id,
        namespace=evaluation.namespace,
        filter_keys=(evaluation.job_id, evaluation.deployment_id),
        payload={"Evaluation": evaluation.to_api()},
    )


def _job_event(job: Json, kind: str) -> Event:
    return Event(
        topic="Job",
        type=kind,
        key=str(job["ID"]),
        namespace=str(job["Namespace"]),
        filter_keys=(),
        payload={"Job": job},
    )


def _node_event(node: Node, kind: str) -> Event:
    return Event(
        topic="Node",
        type=kind,
        key=node.id,
        namespace="",
        filter_keys=(),
        payload={"Node": node.to_api()},
    )


def _deployment_event(deployment: Deployment, kind: str) -> Event:
    return Event(
        topic="Deployment",
        type=kind,
        key=deployment.id,
        namespace=deployment.namespace,
        filter_keys=(deployment.job_id,),
        payload={"Deployment": deployment.to_api()},
    )


class ClusterState:
    """Jobs, allocations, evaluations, deployments and nodes of one region."""

    def __init__(self, clock_ns: Callable[[], int]) -> None:
        self.clock_ns = clock_ns
        self.index = 1
        self.table_index = dict.fromkeys(TABLES, 1)
        self.jobs: dict[tuple[str, str], Json] = {}
        self.job_versions: dict[tuple[str, str], dict[int, Json]] = {}
        self.allocs: dict[str, Allocation] = {}
        self.evals: dict[str, Evaluation] = {}
        self.deployments: dict[str, Deployment] = {}
        self.nodes: dict[str, Node] = {}
        self.node_pools: dict[str, NodePool] = built_in_pools()
        self.namespaces: dict[str, Namespace] = built_in_namespaces()
        self.broker = EventBroker()
        self._changed = asyncio.Event()

    # -- plumbing ---------------------------------------------------------

    def _next(self) -> int:
        self.index += 1
        return self.index

    def _finish(self, index: int, tables: Iterable[str], events: Sequence[Event]) -> None:
        for table in tables:
            self.table_index[table] = index
        self.broker.publish(index, events)
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def commit(self, tables: Sequence[str], write: Callable[[int], object]) -> int:
        """One write outside the tables above (e.g. Variables): `write(index)`, then wake."""
        index = self._next()
        write(index)
        self._finish(index, tables, ())
        return index

    def tables_index(self, tables: Iterable[str]) -> int:
        return max(self.table_index[table] for table in tables)

    async def wait_for_change(self, tables: Sequence[str], after: int, timeout_s: float) -> None:
        """Block until one of `tables` has an index above `after`, or the timeout."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.tables_index(tables) <= after:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return
            changed = self._changed
            try:
                async with asyncio.timeout(remaining):
                    await changed.wait()
            except TimeoutError:
                return

    def changed_event(self) -> asyncio.Event:
        """An event set by the next write (take it before reading)."""
        return self._changed

    # -- reads --------------------------------------------------------------

    def job(self, namespace: str, job_id: str) -> Json | None:
        return self.jobs.get((namespace, job_id))

    def job_version(self, namespace: str, job_id: str, version: int) -> Json | None:
        return self.job_versions.get((namespace, job_id), {}).get(version)

    def allocs_of_job(self, namespace: str, job_id: str) -> list[Allocation]:
        return [a for a in self.allocs.values() if a.job_id == job_id and a.namespace == namespace]

    def allocs_of_node(self, node_id: str) -> list[Allocation]:
        return [a for a in self.allocs.values() if a.node_id == node_id]

    def evals_of_job(self, namespace: str, job_id: str) -> list[Evaluation]:
        return [e for e in self.evals.values() if e.job_id == job_id and e.namespace == namespace]

    def deployments_of_job(self, namespace: str, job_id: str) -> list[Deployment]:
        return [
            d for d in self.deployments.values() if d.job_id == job_id and d.namespace == namespace
        ]

    def alloc_job(self, alloc: Allocation) -> Json | None:
        return self.job_version(alloc.namespace, alloc.job_id, alloc.job_version) or self.job(
            alloc.namespace, alloc.job_id
        )

    def job_summary(self, namespace: str, job_id: str) -> Json | None:
        job = self.job(namespace, job_id)
        if job is None:
            return None
        summary: dict[str, Json] = {
            str(group["Name"]): {
                "Queued": 0,
                "Complete": 0,
                "Failed": 0,
                "Running": 0,
                "Starting": 0,
                "Lost": 0,
                "Unknown": 0,
            }
            for group in task_groups(job)
        }
        for alloc in self.allocs_of_job(namespace, job_id):
            counts = summary.setdefault(
                alloc.task_group,
                dict.fromkeys(
                    ("Queued", "Complete", "Failed", "Running", "Starting", "Lost", "Unknown"), 0
                ),
            )
            key = {
                "pending": "Starting",
                "running": "Running",
                "complete": "Complete",
                "failed": "Failed",
                "lost": "Lost",
                "unknown": "Unknown",
            }[alloc.client_status]
            counts[key] += 1
        for evaluation in self.evals_of_job(namespace, job_id):
            if evaluation.status == "blocked":
                for group, queued in evaluation.queued_allocations.items():
                    if group in summary:
                        summary[group]["Queued"] += queued
        return {
            "JobID": job_id,
            "Namespace": namespace,
            "Summary": summary,
            "Children": {"Pending": 0, "Running": 0, "Dead": 0},
            "CreateIndex": job.get("CreateIndex", 0),
            "ModifyIndex": max(self.table_index["allocs"], int(job.get("ModifyIndex", 0))),
        }

    # -- job status -------------------------------------------------------

    def _refresh_job_status(
        self, index: int, keys: Iterable[tuple[str, str]], kind: str
    ) -> list[Event]:
        events: list[Event] = []
        for namespace, job_id in set(keys):
            job = self.jobs.get((namespace, job_id))
            if job is None:
                continue
            status = job_status(
                job, self.allocs_of_job(namespace, job_id), self.evals_of_job(namespace, job_id)
            )
            if status == job.get("Status"):
                continue
            updated = {**job, "Status": status, "ModifyIndex": index}
            self.jobs[(namespace, job_id)] = updated
            events.append(_job_event(updated, kind))
        return events

    # -- jobs ---------------------------------------------------------------

    def register_job(
        self,
        job: Json,
        *,
        enforce_index: int | None,
        make_eval: Callable[[Json], Evaluation] | None,
    ) -> tuple[Json, Evaluation | None, int, bool]:
        """Store a job version (or just an eval when the spec is unchanged).

        Returns (stored job, eval, index, spec changed).
        """
        key = (str(job["Namespace"]), str(job["ID"]))
        existing = self.jobs.get(key)
        if enforce_index is not None:
            if enforce_index == 0 and existing is not None:
                raise EnforceIndexError(f"{ENFORCE_PREFIX} 0: job already exists")
            if enforce_index != 0 and existing is None:
                raise EnforceIndexError(f"{ENFORCE_PREFIX} {enforce_index}: job does not exist")
            if existing is not None and enforce_index not in {0, existing["JobModifyIndex"]}:
                raise EnforceIndexError(
                    f"{ENFORCE_PREFIX} {enforce_index}: job exists with conflicting job modify "
                    f"index: {existing['JobModifyIndex']}"
                )
        index = self._next()
        now = self.clock_ns()
        evaluation = None
        events: list[Event] = []
        tables = ["evals"]
        changed = existing is None or job_spec(existing) != job_spec(job)
        if existing is not None and not changed:
            stored = existing
        else:
            stored = copy.deepcopy(job)
            stored["Version"] = 0 if existing is None else int(existing["Version"]) + 1
            stored["CreateIndex"] = index if existing is None else existing["CreateIndex"]
            stored["ModifyIndex"] = index
            stored["JobModifyIndex"] = index
            stored["SubmitTime"] = now
            stored["Stable"] = False
            stored["Status"] = "pending"
            self.jobs[key] = stored
            self.job_versions.setdefault(key, {})[stored["Version"]] = stored
            events.append(_job_event(stored, "JobRegistered"))
            tables += ["jobs", "job_summary"]
        if make_eval is not None:
            evaluation = dataclasses.replace(
                make_eval(stored),
                job_modify_index=int(stored["JobModifyIndex"]),
                create_index=index,
                modify_index=index,
            )
            self.evals[evaluation.id] = evaluation
            events.append(_eval_event(evaluation, "JobRegistered"))
        events += self._refresh_job_status(index, [key], "JobRegistered")
        self._finish(index, tables, events)
        return self.jobs[key], evaluation, index, changed

    def deregister_job(
        self, namespace: str, job_id: str, *, purge: bool, make_eval: Callable[[Json], Evaluation]
    ) -> tuple[Evaluation | None, int, int]:
        """Stop (or purge) a job; (eval, index, job modify index). Unknown job: (None, 0, 0)."""
        key = (namespace, job_id)
        existing = self.jobs.get(key)
        if existing is None:
            return None, 0, 0
        index = self._next()
        events: list[Event] = []
        if purge:
            del self.jobs[key]
            self.job_versions.pop(key, None)
            events.append(_job_event(existing, "JobDeregistered"))
            job_modify_index = index
        else:
            stopped = {**existing, "Stop": True, "ModifyIndex": index, "JobModifyIndex": index}
            self.jobs[key] = stopped
            self.job_versions.setdefault(key, {})[int(stopped["Version"])] = stopped
            events.append(_job_event(stopped, "JobDeregistered"))
            job_modify_index = index
        evaluation = dataclasses.replace(
            make_eval(existing), job_modify_index=index, create_index=index, modify_index=index
        )
        self.evals[evaluation.id] = evaluation
        events.append(_eval_event(evaluation, "JobDeregistered"))
        events += self._refresh_job_status(index, [key], "JobDeregistered")
        self._finish(index, ["jobs", "evals", "job_summary"], events)
        return evaluation, index, job_modify_index

    def mark_job_stable(self, namespace: str, job_id: str, version: int) -> None:
        key = (namespace, job_id)
        job = self.jobs.get(key)
        if job is None or int(job["Version"]) != version or job.get("Stable"):
            return
        index = self._next()
        updated = {**job, "Stable": True, "ModifyIndex": index}
        self.jobs[key] = updated
        self.job_versions.setdefault(key, {})[version] = updated
        self._finish(index, ["jobs"], [_job_event(updated, "DeploymentStatusUpdate")])

    def set_job_stability(self, namespace: str, job_id: str, version: int, stable: bool) -> int:
        """`UpdateJobStability`: flag one stored version (and the job, when current)."""
        key = (namespace, job_id)
        index = self._next()
        stored = self.job_versions.get(key, {}).get(version)
        if stored is None or bool(stored.get("Stable")) == stable:
            self._finish(index, [], [])
            return index
        updated = {**stored, "Stable": stable, "ModifyIndex": index}
        self.job_versions[key][version] = updated
        current = self.jobs.get(key)
        if current is not None and int(current["Version"]) == version:
            self.jobs[key] = {**current, "Stable": stable, "ModifyIndex": index}
        # Nomad publishes no event for a stability change.
        self._finish(index, ["jobs"], [])
        return index

    # -- evaluations --------------------------------------------------------

    def upsert_evals(
        self, evaluations: Sequence[Evaluation], kind: str = "EvaluationUpdated"
    ) -> int:
        index = self._next()
        events: list[Event] = []
        for evaluation in evaluations:
            previous = self.evals.get(evaluation.id)
            stored = dataclasses.replace(
                evaluation,
                create_index=previous.create_index if previous else index,
                modify_index=index,
                modify_time_ns=self.clock_ns(),
            )
            self.evals[stored.id] = stored
            events.append(_eval_event(stored, kind))
        events += self._refresh_job_status(
            index, [(e.namespace, e.job_id) for e in evaluations], kind
        )
        self._finish(index, ["evals", "job_summary"], events)
        return index

    # -- allocations --------------------------------------------------------

    def apply_plan(
        self,
        *,
        stops: Sequence[tuple[str, str, str | None, str]],
        placements: Sequence[Allocation],
        in_place: Sequence[tuple[str, int]],
        followups: Mapping[str, str],
        deployment: Deployment | None,
        cancel_deployments: Sequence[str],
    ) -> int:
        """Commit a plan: stops (id, description, client status, client description),
        new allocations, in-place version bumps, follow-up eval ids, deployments."""
        index = self._next()
        now = self.clock_ns()
        events: list[Event] = []
        touched: list[tuple[str, str]] = []
        tables = ["allocs", "job_summary"]
        for alloc_id, description, client_status, client_description in stops:
            alloc = self.allocs[alloc_id]
            changes: dict[str, Any] = {
                "desired_status": "stop",
                "desired_description": description,
                "modify_index": index,
                "alloc_modify_index": index,
                "modify_time_ns": now,
            }
            if client_status is not None:
                changes["client_status"] = client_status
                changes["client_description"] = client_description
            self.allocs[alloc_id] = dataclasses.replace(alloc, **changes)
        for alloc in placements:
            stored = dataclasses.replace(
                alloc, create_index=index, modify_index=index, alloc_modify_index=index
            )
            self.allocs[stored.id] = stored
            if stored.previous_allocation in self.allocs:
                previous = self.allocs[stored.previous_allocation]
                self.allocs[previous.id] = dataclasses.replace(
                    previous, next_allocation=stored.id, modify_index=index, modify_time_ns=now
                )
        for alloc_id, version in in_place:
            alloc = self.allocs[alloc_id]
            self.allocs[alloc_id] = dataclasses.replace(
                alloc, job_version=version, modify_index=index, alloc_modify_index=index
            )
        for alloc_id, eval_id in followups.items():
            alloc = self.allocs[alloc_id]
            self.allocs[alloc_id] = dataclasses.replace(
                alloc, followup_eval_id=eval_id, modify_index=index
            )
        for alloc in self.allocs.values():
            if alloc.modify_index == index:
                events.append(_alloc_event(alloc, "PlanResult"))
                touched.append((alloc.namespace, alloc.job_id))
        for deployment_id in cancel_deployments:
            current = self.deployments.get(deployment_id)
            if current is None or not current.active:
                continue
            cancelled = dataclasses.replace(
                current,
                status="cancelled",
                status_description="Cancelled due to newer version of job",
                modify_index=index,
                modify_time_ns=now,
            )
            self.deployments[deployment_id] = cancelled
            events.append(_deployment_event(cancelled, "PlanResult"))
            tables.append("deployment")
        if deployment is not None:
            stored_deployment = dataclasses.replace(
                deployment, create_index=index, modify_index=index
            )
            self.deployments[stored_deployment.id] = stored_deployment
            events.append(_deployment_event(stored_deployment, "PlanResult"))
            tables.append("deployment")
        events += self._refresh_job_status(index, touched, "PlanResult")
        if touched:
            tables.append("jobs")
        self._finish(index, tables, events)
        return index

    def client_update(self, allocs: Sequence[Allocation]) -> int:
        """What a client reports: client status, task states, deployment health."""
        index = self._next()
        now = self.clock_ns()
        events: list[Event] = []
        for alloc in allocs:
            stored = dataclasses.replace(alloc, modify_index=index, modify_time_ns=now)
            self.allocs[alloc.id] = stored
            events.append(_alloc_event(stored, "AllocationUpdated"))
        events += self._refresh_job_status(
            index, [(a.namespace, a.job_id) for a in allocs], "AllocationUpdated"
        )
        self._finish(index, ["allocs", "job_summary", "jobs"], events)
        return index

    def set_desired_transition(
        self, alloc_ids: Sequence[str], transition: Mapping[str, bool]
    ) -> int:
        index = self._next()
        events: list[Event] = []
        for alloc_id in alloc_ids:
            alloc = self.allocs[alloc_id]
            stored = dataclasses.replace(
                alloc,
                desired_transition={**alloc.desired_transition, **transition},
                modify_index=index,
                modify_time_ns=self.clock_ns(),
            )
            self.allocs[alloc_id] = stored
            events.append(_alloc_event(stored, "AllocationUpdateDesiredStatus"))
        self._finish(index, ["allocs"], events)
        return index

    # -- nodes --------------------------------------------------------------

    def upsert_node(self, node: Node, kind: str) -> Node:
        index = self._next()
        previous = self.nodes.get(node.id)
        stored = dataclasses.replace(
            node,
            create_index=previous.create_index if previous else index,
            modify_index=index,
        )
        self.nodes[node.id] = stored
        tables = ["nodes"]
        if node.node_pool not in self.node_pools:
            # A node naming a pool that does not exist creates it (fetchOrCreateNodePoolTxn).
            self.node_pools[node.node_pool] = NodePool(
                name=node.node_pool, create_index=index, modify_index=index
            )
            tables.append("node_pools")
        self._finish(index, tables, [_node_event(stored, kind)])
        return stored

    # -- node pools ---------------------------------------------------------

    def upsert_node_pool(self, pool: NodePool) -> int:
        index = self._next()
        previous = self.node_pools.get(pool.name)
        self.node_pools[pool.name] = dataclasses.replace(
            pool,
            create_index=previous.create_index if previous else index,
            modify_index=index,
        )
        self._finish(index, ["node_pools"], [])
        return index

    def delete_node_pool(self, name: str) -> int:
        index = self._next()
        del self.node_pools[name]
        self._finish(index, ["node_pools"], [])
        return index

    # -- namespaces ---------------------------------------------------------

    def upsert_namespace(self, namespace: Namespace) -> int:
        index = self._next()
        previous = self.namespaces.get(namespace.name)
        self.namespaces[namespace.name] = dataclasses.replace(
            namespace,
            create_index=previous.create_index if previous else index,
            modify_index=index,
        )
        self._finish(index, ["namespaces"], [])
        return index

    def delete_namespace(self, name: str) -> int:
        index = self._next()
        del self.namespaces[name]
        self._finish(index, ["namespaces"], [])
        return index

    # -- deployments --------------------------------------------------------

    def upsert_deployment(self, deployment: Deployment, kind: str) -> Deployment:
        index = self._next()
        stored = dataclasses.replace(deployment, modify_index=index, modify_time_ns=self.clock_ns())
        self.deployments[stored.id] = stored
        self._finish(index, ["deployment"], [_deployment_event(stored, kind)])
        return stored
