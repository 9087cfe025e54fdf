"""The scheduler worker: takes evaluations off a queue, plans them, commits plans.

One evaluation is planned and committed in one synchronous step on the event
loop, so nothing changes between reading the state and writing the plan (as
Nomad's plan applier guarantees with its optimistic concurrency). Evaluations
that could not place everything leave a `blocked` evaluation, which is
re-run whenever capacity appears (`capacity_changed`). Evaluations with a
`WaitUntil` (reschedule follow-ups) run at that time.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
from collections.abc import Callable
from typing import Any

from caravan_llm.devcluster.nomad.model import Evaluation
from caravan_llm.devcluster.nomad.reconcile import Plan, PlanInputs, plan_evaluation
from caravan_llm.devcluster.nomad.state import ClusterState

Json = dict[str, Any]

log = logging.getLogger(__name__)

BLOCKED_DESCRIPTION = "created to place remaining allocations"
CANCELED_DESCRIPTION = "canceled after more recent eval was processed"


def new_evaluation(
    job: Json,
    triggered_by: str,
    *,
    eval_id: str,
    now_ns: int,
    node_id: str = "",
    status: str = "pending",
    wait_until_ns: int | None = None,
    previous_eval: str = "",
) -> Evaluation:
    return Evaluation(
        id=eval_id,
        namespace=str(job.get("Namespace", "default")),
        priority=int(job.get("Priority", 50)),
        type=str(job.get("Type", "service")),
        triggered_by=triggered_by,
        job_id=str(job["ID"]),
        job_modify_index=int(job.get("JobModifyIndex", 0)),
        node_id=node_id,
        status=status,
        wait_until_ns=wait_until_ns,
        previous_eval=previous_eval,
        create_time_ns=now_ns,
        modify_time_ns=now_ns,
    )


class Scheduler:
    """Nomad's eval broker, scheduler worker and blocked-evals tracker in one."""

    def __init__(
        self,
        state: ClusterState,
        *,
        rng: random.Random,
        new_id: Callable[[], str],
    ) -> None:
        self.state = state
        self.rng = rng
        self.new_id = new_id
        self._queue: asyncio.Queue[str] = asyncio.Queue()
        self._queued: set[str] = set()
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self.idle = asyncio.Event()
        self.idle.set()

    # -- queueing ---------------------------------------------------------

    def enqueue(self, evaluation: Evaluation) -> None:
        now = self.state.clock_ns()
        if evaluation.wait_until_ns is not None and evaluation.wait_until_ns > now:
            delay_s = (evaluation.wait_until_ns - now) / 1e9
            loop = asyncio.get_running_loop()
            self._timers[evaluation.id] = loop.call_later(delay_s, self._put, evaluation.id)
            return
        self._put(evaluation.id)

    def _put(self, eval_id: str) -> None:
        self._timers.pop(eval_id, None)
        if eval_id in self._queued:
            return
        self._queued.add(eval_id)
        self.idle.clear()
        self._queue.put_nowait(eval_id)

    def capacity_changed(self) -> None:
        """Re-run blocked evaluations: a node appeared or resources were freed."""
        for evaluation in list(self.state.evals.values()):
            if evaluation.status == "blocked":
                self._put(evaluation.id)

    def stop_timers(self) -> None:
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()

    async def run(self) -> None:
        while True:
            eval_id = await self._queue.get()
            self._queued.discard(eval_id)
            try:
                self.process(eval_id)
            except Exception:
                log.exception("evaluation_failed", extra={"eval_id": eval_id})
            if self._queue.empty():
                self.idle.set()

    # -- planning ---------------------------------------------------------

    def inputs_for(self, evaluation: Evaluation, job: Json | None) -> PlanInputs:
        state = self.state
        return PlanInputs(
            evaluation=evaluation,
            job=job,
            job_versions=state.job_versions.get((evaluation.namespace, evaluation.job_id), {}),
            job_allocs=state.allocs_of_job(evaluation.namespace, evaluation.job_id),
            nodes=list(state.nodes.values()),
            cluster_allocs=list(state.allocs.values()),
            deployments=state.deployments_of_job(evaluation.namespace, evaluation.job_id),
            now_ns=state.clock_ns(),
        )

    def dry_run(self, evaluation: Evaluation, job: Json) -> Plan:
        """The plan for `job` as it would be made now, committing nothing."""
        rng = random.Random(self.rng.random())
        return plan_evaluation(self.inputs_for(evaluation, job), rng, self.new_id)

    def process(self, eval_id: str) -> None:
        state = self.state
        evaluation = state.evals.get(eval_id)
        if evaluation is None or evaluation.status in {"complete", "canceled", "failed"}:
            return
        job = state.job(evaluation.namespace, evaluation.job_id)
        plan = plan_evaluation(self.inputs_for(evaluation, job), self.rng, self.new_id)
        followups = {
            alloc_id: follow_up.eval_id
            for follow_up in plan.follow_ups
            for alloc_id in follow_up.alloc_ids
        }
        if plan.changes or plan.new_deployment is not None or plan.cancel_deployments:
            state.apply_plan(
                stops=[
                    (stop.alloc_id, stop.description, stop.client_status, stop.client_description)
                    for stop in plan.stops
                ],
                placements=plan.placements,
                in_place=[
                    (alloc_id, int((job or {}).get("Version", 0))) for alloc_id in plan.in_place
                ],
                followups=followups,
                deployment=plan.new_deployment,
                cancel_deployments=plan.cancel_deployments,
            )
        now = state.clock_ns()
        updates: list[Evaluation] = [
            new_evaluation(
                job or {"ID": evaluation.job_id, "Namespace": evaluation.namespace},
                "failed-follow-up",
                eval_id=follow_up.eval_id,
                now_ns=now,
                wait_until_ns=follow_up.wait_until_ns,
                previous_eval=evaluation.id,
            )
            for follow_up in plan.follow_ups
        ]
        failed = {name: metric.to_api() for name, metric in plan.failures.items()}
        stale_blocked = [
            other
            for other in state.evals_of_job(evaluation.namespace, evaluation.job_id)
            if other.status == "blocked" and other.id != evaluation.id
        ]
        updates.extend(
            dataclasses.replace(other, status="canceled", status_description=CANCELED_DESCRIPTION)
            for other in stale_blocked
        )
        if failed and evaluation.status == "blocked":
            updates.append(
                dataclasses.replace(
                    evaluation,
                    failed_tg_allocs=failed,
                    queued_allocations=dict(plan.queued),
                    snapshot_index=state.index,
                )
            )
        elif failed:
            blocked = dataclasses.replace(
                new_evaluation(
                    job or {"ID": evaluation.job_id, "Namespace": evaluation.namespace},
                    "queued-allocs",
                    eval_id=self.new_id(),
                    now_ns=now,
                    status="blocked",
                    previous_eval=evaluation.id,
                ),
                status_description=BLOCKED_DESCRIPTION,
                failed_tg_allocs=failed,
                queued_allocations=dict(plan.queued),
                snapshot_index=state.index,
            )
            updates.append(blocked)
            updates.append(
                dataclasses.replace(
                    evaluation,
                    status="complete",
                    blocked_eval=blocked.id,
                    failed_tg_allocs=failed,
                    queued_allocations=dict(plan.queued),
                    snapshot_index=state.index,
                )
            )
        else:
            updates.append(
                dataclasses.replace(
                    evaluation,
                    status="complete",
                    queued_allocations=dict(plan.queued),
                    snapshot_index=state.index,
                )
            )
        state.upsert_evals(updates)
        for follow_up in plan.follow_ups:
            stored = state.evals.get(follow_up.eval_id)
            if stored is not None:
                self.enqueue(stored)
