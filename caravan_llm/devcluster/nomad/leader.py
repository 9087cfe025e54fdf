"""What Nomad's leader does in the background: heartbeats, drains, deployments.

* Heartbeat monitor: a node whose heartbeat timer (its TTL plus the grace,
  see `heartbeat.py`) ran out turns `down` ("Node heartbeat missed"); its
  allocations are then lost and replaced by the evaluation that follows.
* Drainer: marks allocations of a draining node for migration, `MaxParallel`
  of a group at a time (all at once past the deadline), and ends the drain
  when nothing is left.
* Deployment watcher: counts healthy and unhealthy allocations of running
  deployments, marks them successful (and the job version stable) or failed.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import Any

from caravan_llm.devcluster.nomad.endpoints import Endpoints
from caravan_llm.devcluster.nomad.gotext import go_time
from caravan_llm.devcluster.nomad.model import Allocation, Deployment, find_group

Json = dict[str, Any]

TICK_S = 0.25


class Leader:
    def __init__(self, endpoints: Endpoints, *, monotonic: Callable[[], float]) -> None:
        self.endpoints = endpoints
        self.state = endpoints.state
        self.monotonic = monotonic

    async def run(self) -> None:
        while True:
            changed = self.state.changed_event()
            self.check_heartbeats()
            self.advance_drains()
            self.watch_deployments()
            try:
                async with asyncio.timeout(TICK_S):
                    await changed.wait()
            except TimeoutError:
                pass
            # Let a burst of writes settle before looking again.
            await asyncio.sleep(0.02)

    def check_heartbeats(self) -> None:
        now = self.monotonic()
        for node in list(self.state.nodes.values()):
            if node.status not in {"ready", "initializing"}:
                continue
            deadline = self.endpoints.heartbeat_deadline.get(node.id)
            if deadline is not None and now > deadline:
                self.endpoints.heartbeat_expired(node.id)

    # -- drains -------------------------------------------------------------

    def _migrating_unhealthy(self, alloc: Allocation) -> bool:
        """An allocation counted against a group's migrate `MaxParallel`."""
        if alloc.terminal:
            return False
        if alloc.desired_transition.get("Migrate"):
            return True
        previous = self.state.allocs.get(alloc.previous_allocation)
        replaced_migration = previous is not None and previous.desired_transition.get("Migrate")
        healthy = (alloc.deployment_status or {}).get("Healthy") is True
        return bool(replaced_migration) and not healthy

    def advance_drains(self) -> None:
        now = self.state.clock_ns()
        for node in list(self.state.nodes.values()):
            drain = node.drain
            if drain is None:
                continue
            remaining = [
                alloc
                for alloc in self.state.allocs_of_node(node.id)
                if not alloc.terminal and not alloc.desired_transition.get("Migrate")
            ]
            stopping = [
                alloc
                for alloc in self.state.allocs_of_node(node.id)
                if not alloc.terminal and alloc.desired_transition.get("Migrate")
            ]
            if not remaining and not stopping:
                self._finish_drain(node.id, drain.started_at_ns, now)
                continue
            forced = drain.force_deadline_ns is not None and now >= drain.force_deadline_ns
            to_mark: list[str] = []
            by_group: dict[tuple[str, str, str], list[Allocation]] = {}
            for alloc in remaining:
                by_group.setdefault((alloc.namespace, alloc.job_id, alloc.task_group), []).append(
                    alloc
                )
            for (namespace, job_id, group_name), allocs in by_group.items():
                if forced:
                    to_mark += [alloc.id for alloc in allocs]
                    continue
                job = self.state.job(namespace, job_id)
                group = find_group(job, group_name) if job is not None else None
                max_parallel = int(((group or {}).get("Migrate") or {}).get("MaxParallel", 1))
                in_flight = sum(
                    1
                    for alloc in self.state.allocs_of_job(namespace, job_id)
                    if alloc.task_group == group_name and self._migrating_unhealthy(alloc)
                )
                room = max(max_parallel - in_flight, 0)
                to_mark += [alloc.id for alloc in sorted(allocs, key=lambda a: a.index)[:room]]
            if to_mark:
                self.state.set_desired_transition(to_mark, {"Migrate": True})
                jobs = {
                    (self.state.allocs[a].namespace, self.state.allocs[a].job_id) for a in to_mark
                }
                self.endpoints.create_evals(
                    [job for key in jobs if (job := self.state.job(*key)) is not None],
                    "node-drain",
                    node_id=node.id,
                )

    def _finish_drain(self, node_id: str, started_at_ns: int, now: int) -> None:
        node = self.state.nodes[node_id]
        self.state.upsert_node(
            dataclasses.replace(
                node,
                drain=None,
                last_drain={
                    "StartedAt": go_time(started_at_ns),
                    "UpdatedAt": go_time(now),
                    "Status": "complete",
                    "AccessorID": "",
                    "Meta": (node.last_drain or {}).get("Meta"),
                },
            ),
            "NodeDrain",
        )

    # -- deployments --------------------------------------------------------

    def watch_deployments(self) -> None:
        now = self.state.clock_ns()
        for deployment in list(self.state.deployments.values()):
            if deployment.status != "running":
                continue
            updated = self._counted(deployment)
            status, description = self._verdict(updated, now)
            if status != updated.status:
                updated = dataclasses.replace(
                    updated, status=status, status_description=description
                )
            if updated == deployment:
                continue
            kind = "DeploymentStatusUpdate" if status != "running" else "DeploymentAllocHealth"
            self.state.upsert_deployment(updated, kind)
            if status == "successful":
                self.state.mark_job_stable(
                    deployment.namespace, deployment.job_id, deployment.job_version
                )

    def _counted(self, deployment: Deployment) -> Deployment:
        groups = {}
        allocs = [a for a in self.state.allocs.values() if a.deployment_id == deployment.id]
        for name, group in deployment.task_groups.items():
            mine = [a for a in allocs if a.task_group == name]
            healthy = sum(1 for a in mine if (a.deployment_status or {}).get("Healthy") is True)
            unhealthy = sum(1 for a in mine if (a.deployment_status or {}).get("Healthy") is False)
            groups[name] = dataclasses.replace(
                group, healthy_allocs=healthy, unhealthy_allocs=unhealthy, placed_allocs=len(mine)
            )
        return dataclasses.replace(deployment, task_groups=groups)

    def _verdict(self, deployment: Deployment, now: int) -> tuple[str, str]:
        if any(group.unhealthy_allocs for group in deployment.task_groups.values()):
            return "failed", "Failed due to unhealthy allocations"
        if all(
            group.healthy_allocs >= group.desired_total for group in deployment.task_groups.values()
        ):
            return "successful", "Deployment completed successfully"
        for group in deployment.task_groups.values():
            if (
                group.progress_deadline_ns
                and now > deployment.create_time_ns + group.progress_deadline_ns
            ):
                return "failed", "Failed due to progress deadline"
        return "running", "Deployment is running"
