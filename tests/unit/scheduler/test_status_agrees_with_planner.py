"""`caravan status` and a reconcile pass, reading the same Nomad and Consul, agree on each replica.

Both run their whole code path here (the StatusReader's observe and assess, the
controller's observe, assess and plan) against one generated world served by
in-memory Nomad and Consul reads; what each says per replica is compared.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from hypothesis import given, settings
from observation_strategies import NOW, worlds
from prometheus_client import CollectorRegistry
from test_enforce_index import DictKV

from caravan_llm.common.consul_api import HealthCheck, HealthEntry
from caravan_llm.common.contract import (
    MANAGED_BY_VALUE,
    JobMetaKey,
    KVLayout,
    ServiceMetaKey,
    model_service_name,
)
from caravan_llm.common.nomad_api import (
    Allocation,
    DeregisterResult,
    Evaluation,
    JobStub,
    Node,
    QueryResult,
    RegisterResult,
)
from caravan_llm.scheduler.cluster_config import ClusterConfig
from caravan_llm.scheduler.controller import Controller
from caravan_llm.scheduler.metrics import SchedulerMetrics
from caravan_llm.scheduler.model_store import DesiredState, ModelStore
from caravan_llm.scheduler.status import ModelStatus, StatusReader
from caravan_llm.scheduler.weights import PREFETCH_KIND, PREFETCH_KIND_KEY, PrefetchState
from caravan_llm.scheduler.world import DesiredModel, Observation

CONFIG = ClusterConfig()
# What a prefetch job's only allocation does in each observed state (none: pending).
PREFETCH_ALLOC = {
    PrefetchState.COMPLETE: "complete",
    PrefetchState.RUNNING: "running",
    PrefetchState.FAILED: "failed",
}


class WorldNomad:
    """Nomad's reads answered from one observation; the controller's writes are dropped."""

    def __init__(self, seen: Observation) -> None:
        self.stubs = [
            JobStub(
                id=r.job_id,
                version=r.version,
                status=r.job_status,
                stop=r.stopped,
                submit_time_ns=r.submit_time_ns,
                meta={
                    JobMetaKey.MANAGED_BY: MANAGED_BY_VALUE,
                    JobMetaKey.MODEL: r.model,
                    JobMetaKey.REPLICA: str(r.replica),
                    JobMetaKey.SPEC_HASH: r.spec_hash,
                },
            )
            for r in seen.replicas.values()
        ]
        self.allocs = [a for r in seen.replicas.values() for a in r.allocs]
        for model, prefetch in seen.prefetch.items():
            self.stubs.append(
                JobStub(
                    id=prefetch.job_id,
                    submit_time_ns=prefetch.submit_time_ns,
                    meta={
                        JobMetaKey.MANAGED_BY: MANAGED_BY_VALUE,
                        JobMetaKey.MODEL: model,
                        JobMetaKey.SPEC_HASH: prefetch.spec_hash,
                        PREFETCH_KIND_KEY: PREFETCH_KIND,
                    },
                )
            )
            if prefetch.state in PREFETCH_ALLOC:
                self.allocs.append(
                    Allocation(
                        id=f"{prefetch.job_id}-alloc",
                        job_id=prefetch.job_id,
                        client_status=PREFETCH_ALLOC[prefetch.state],
                        desired_status="run",
                    )
                )
        self.nodes = list(seen.nodes.values())
        self.evaluations = seen.evaluations

    async def list_jobs(
        self,
        prefix: str = "",
        *,
        meta: bool = False,
        index: int | None = None,
        wait_s: float | None = None,
    ) -> QueryResult[list[JobStub]]:
        return QueryResult(1, [s for s in self.stubs if s.id.startswith(prefix)])

    async def list_allocations(
        self,
        prefix: str = "",
        *,
        resources: bool = False,
        index: int | None = None,
        wait_s: float | None = None,
    ) -> QueryResult[list[Allocation]]:
        return QueryResult(1, list(self.allocs))

    async def list_nodes(
        self, *, resources: bool = True, index: int | None = None, wait_s: float | None = None
    ) -> QueryResult[list[Node]]:
        return QueryResult(1, list(self.nodes))

    async def job_evaluations(
        self, job_id: str, *, index: int | None = None, wait_s: float | None = None
    ) -> QueryResult[list[Evaluation]]:
        return QueryResult(1, list(self.evaluations.get(job_id, ())))

    async def register_job(
        self, job: Mapping[str, Any], *, enforce_index: int | None = None
    ) -> RegisterResult:
        return RegisterResult("eval", 1, 1, "", 1)

    async def deregister_job(self, job_id: str, *, purge: bool = True) -> DeregisterResult:
        return DeregisterResult("eval", 1, 1)


class WorldHealth:
    """Consul's instances of each model's service, one per allocation with a check status."""

    def __init__(self, seen: Observation) -> None:
        self.entries: dict[str, list[HealthEntry]] = {}
        for replica in seen.replicas.values():
            for alloc in replica.allocs:
                status = seen.health.get(alloc.id)
                if status is None:
                    continue
                service = model_service_name(replica.model)
                self.entries.setdefault(service, []).append(
                    HealthEntry(
                        node=alloc.node_id,
                        node_address="10.0.0.1",
                        service_id=f"_nomad-task-{alloc.id}",
                        service_name=service,
                        service_address="10.0.0.1",
                        port=8000,
                        tags=(),
                        meta={ServiceMetaKey.ALLOC_ID: alloc.id},
                        checks=(HealthCheck(check_id="http", status=status),),
                    )
                )

    async def health_service(
        self,
        name: str,
        *,
        passing: bool = False,
        tags: tuple[str, ...] = (),
        filter_expr: str | None = None,
        index: int = 0,
        wait_s: float | None = None,
    ) -> tuple[int, tuple[HealthEntry, ...]]:
        return 1, tuple(self.entries.get(name, ()))


class WorldStore(ModelStore):
    """KV's desired state: the generated profiles, counts and drain markers."""

    def __init__(self, desired: dict[str, DesiredModel], seen: Observation) -> None:
        super().__init__(DictKV(), KVLayout())
        self.state = DesiredState(
            profiles={name: d.profile for name, d in desired.items()},
            invalid={},
            stored_counts={name: d.count for name, d in desired.items()},
            draining=seen.draining,
            demand={},
        )

    async def read(self, *, index: int = 0, wait_s: float | None = None) -> DesiredState:
        return self.state


async def status_and_pass(
    desired: dict[str, DesiredModel], seen: Observation
) -> tuple[list[ModelStatus], list[ModelStatus], Any]:
    nomad, health, store = WorldNomad(seen), WorldHealth(seen), WorldStore(desired, seen)
    reader = StatusReader(store=store, nomad=nomad, health=health, clock=lambda: NOW, config=CONFIG)
    listed = await reader.models()
    one_by_one = [await reader.model(name) for name in sorted(desired)]
    controller = Controller(
        store=store,
        nomad=nomad,
        health=health,
        config=CONFIG,
        metrics=SchedulerMetrics.create(CollectorRegistry()),
        clock=lambda: NOW,
    )
    result = await controller.reconcile_once()
    return listed, one_by_one, result.plan


@settings(max_examples=100, deadline=None)
@given(worlds())
def test_status_and_a_reconcile_pass_say_the_same_of_every_replica(world: Any) -> None:
    """`caravan list`, `caravan status <model>` and the planner agree, replica by replica, on
    ready, unplaceable and failed, and on each model's ready count."""
    desired, seen = world
    listed, one_by_one, planned = asyncio.run(status_and_pass(desired, seen))

    assert planned is not None
    reports = {report.model: report for report in planned.reports}
    assert [m.name for m in listed] == [m.name for m in one_by_one] == sorted(desired)
    for shown in [*listed, *one_by_one]:
        assert reports[shown.name].ready == shown.ready
        judged = planned.assessment.models[shown.name]
        assert [r.job_id for r in judged.replicas] == [r.job_id for r in shown.replicas]
        for replica in shown.replicas:
            decided = planned.assessment.replicas[replica.job_id]
            said = (replica.state == "ready", replica.pending_reason, replica.failed)
            assert (decided.ready and decided.live, decided.unplaceable, decided.failed) == said
