"""Read the world once per pass into an `Observation` (I/O, no decisions).

One reading serves the reconcile pass and `caravan status` alike: caravan's
jobs (stubs with Meta), every allocation with its ports, the nodes, Consul's
health of each model's replicas, and the evaluations of the replica jobs that
have no live allocation (why Nomad does not place them). What any of it means
is `scheduler/assess.py`'s to say.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, replace
from typing import Protocol

from caravan_llm.common.consul_api import HealthEntry
from caravan_llm.common.contract import (
    HTTP_PORT_LABEL,
    JOB_PREFIX,
    KV_PORT_LABEL,
    DrainRecord,
    ServiceMetaKey,
    model_service_name,
)
from caravan_llm.common.errors import HashiError
from caravan_llm.common.nomad_api import Allocation, Evaluation, JobStub, Node, QueryResult
from caravan_llm.scheduler.engine_logs import crashed_alloc
from caravan_llm.scheduler.weights import ObservedPrefetch, observe_prefetch
from caravan_llm.scheduler.world import (
    AllocEngine,
    EngineLogTail,
    Observation,
    ObservedReplica,
    replica_from_job_stub,
)

log = logging.getLogger(__name__)


class NomadReads(Protocol):
    """The Nomad reads an observation needs (implemented by
    caravan_llm.common.nomad_api.NomadClient)."""

    async def list_jobs(
        self,
        prefix: str = "",
        *,
        meta: bool = False,
        index: int | None = None,
        wait_s: float | None = None,
    ) -> QueryResult[list[JobStub]]: ...

    async def list_allocations(
        self,
        prefix: str = "",
        *,
        resources: bool = False,
        index: int | None = None,
        wait_s: float | None = None,
    ) -> QueryResult[list[Allocation]]: ...

    async def list_nodes(
        self, *, resources: bool = True, index: int | None = None, wait_s: float | None = None
    ) -> QueryResult[list[Node]]: ...

    async def job_evaluations(
        self, job_id: str, *, index: int | None = None, wait_s: float | None = None
    ) -> QueryResult[list[Evaluation]]: ...


class EngineLogs(Protocol):
    """Crashed engines' stderr tails (implemented by
    caravan_llm.scheduler.engine_logs.EngineLogReader)."""

    async def tail(self, alloc: Allocation) -> EngineLogTail: ...


class HealthSource(Protocol):
    """Consul health of a service (implemented by caravan_llm.common.consul_api.ConsulClient)."""

    async def health_service(
        self,
        name: str,
        *,
        passing: bool = False,
        tags: tuple[str, ...] = (),
        filter_expr: str | None = None,
        index: int = 0,
        wait_s: float | None = None,
    ) -> tuple[int, tuple[HealthEntry, ...]]: ...


@dataclass(frozen=True, slots=True)
class NomadReadout:
    """caravan's jobs (stubs with Meta), their allocations grouped by job, and the nodes,
    as `caravan_llm.common.nomad_api` decoded them."""

    job_stubs: list[JobStub]
    allocs_by_job: dict[str, list[Allocation]]
    nodes: list[Node]
    # Where each allocation's engine listens (its `http` port) and on which node.
    engines: dict[str, AllocEngine]


async def read_nomad(nomad: NomadReads) -> NomadReadout:
    """The three Nomad list reads every observation starts from."""
    job_stubs = (await nomad.list_jobs(JOB_PREFIX, meta=True)).value
    allocations = (await nomad.list_allocations(resources=True)).value
    nodes = (await nomad.list_nodes(resources=False)).value
    allocs_by_job: dict[str, list[Allocation]] = {}
    engines: dict[str, AllocEngine] = {}
    for allocation in allocations:
        allocs_by_job.setdefault(allocation.job_id, []).append(allocation)
        engine = alloc_engine(allocation)
        if engine is not None:
            engines[allocation.id] = engine
    return NomadReadout(job_stubs, allocs_by_job, nodes, engines)


# The highest TCP port: a `kv` port Nomad reports beyond it is not believed.
MAX_PORT = 65535


def alloc_engine(allocation: Allocation) -> AllocEngine | None:
    """Where an allocation's engine listens, and its KV relay (pure); None: no `http` port yet.

    The relay's port counts only at the engine's own address: routers trust a
    relay exactly where they trust the engine (the endpoint proof).
    """
    ports = allocation.ports or ()
    http = next(
        (p for p in ports if p.label == HTTP_PORT_LABEL and p.host_ip and p.value > 0), None
    )
    if http is None:
        return None
    kv = next(
        (
            p.value
            for p in ports
            if p.label == KV_PORT_LABEL and p.host_ip == http.host_ip and 0 < p.value <= MAX_PORT
        ),
        None,
    )
    return AllocEngine(http, allocation.node_name, kv)


def _health_by_alloc(entries: tuple[HealthEntry, ...]) -> dict[str, str]:
    result: dict[str, str] = {}
    for entry in entries:
        alloc_id = entry.meta.get(ServiceMetaKey.ALLOC_ID)
        if alloc_id:
            result[alloc_id] = entry.status
    return result


def _passing(replica: ObservedReplica, health: Mapping[str, str]) -> bool | None:
    """True when a live allocation passes its check, None when Consul knows none of them."""
    states = [health[a.id] == "passing" for a in replica.live_allocs() if a.id in health]
    return any(states) if states else None


async def observe(
    nomad: NomadReads,
    health: HealthSource,
    readout: NomadReadout,
    *,
    draining: Mapping[str, DrainRecord],
    models: Collection[str],
    now: float,
    inflight: Callable[[ObservedReplica], float | None] = lambda _replica: None,
    scope: Collection[str] | None = None,
    engine_logs: EngineLogs | None = None,
) -> Observation:
    """Complete a Nomad readout with Consul health and placement evaluations.

    Health is read for `models` and every model with replica jobs; `scope`,
    when given, keeps the replicas (and so the reads) to those models, for a
    `caravan status` of one model. An evaluation read that fails leaves that
    job's evaluations out (not known this pass): only what is said about why
    it waits is delayed, never the pass. With `engine_logs`, the stderr tail
    of each replica's newest crashed allocation is read too (`caravan status`).
    """
    replicas: dict[str, ObservedReplica] = {}
    for job_stub in readout.job_stubs:
        replica = replica_from_job_stub(job_stub)
        if replica is None or (scope is not None and replica.model not in scope):
            continue
        allocs = tuple(readout.allocs_by_job.get(replica.job_id, ()))
        with_allocs = replace(replica, allocs=allocs)
        replicas[replica.job_id] = replace(with_allocs, inflight=inflight(with_allocs))
    prefetch: dict[str, ObservedPrefetch] = {}
    for job_stub in readout.job_stubs:
        found = observe_prefetch(job_stub, readout.allocs_by_job.get(job_stub.id, []))
        if found is not None and (scope is None or found.model in scope):
            prefetch[found.model] = found
    wanted = set(models) if scope is None else set(models) & set(scope)
    by_alloc: dict[str, str] = {}
    for model in sorted({r.model for r in replicas.values()} | wanted):
        _, entries = await health.health_service(model_service_name(model))
        by_alloc.update(_health_by_alloc(entries))
    replicas = {job_id: replace(r, passing=_passing(r, by_alloc)) for job_id, r in replicas.items()}
    evaluations: dict[str, tuple[Evaluation, ...]] = {}
    for job_id, replica in sorted(replicas.items()):
        if replica.stopped or replica.live_allocs():
            continue
        try:
            evaluations[job_id] = tuple((await nomad.job_evaluations(job_id)).value)
        except HashiError as exc:
            log.debug("evaluations_not_read", extra={"job_id": job_id, "error": str(exc)})
    tails: dict[str, EngineLogTail] = {}
    if engine_logs is not None:
        for job_id, replica in sorted(replicas.items()):
            crashed = None if replica.stopped else crashed_alloc(replica)
            if crashed is not None:
                tails[job_id] = await engine_logs.tail(crashed)
    return Observation(
        replicas=replicas,
        nodes={node.id: node for node in readout.nodes},
        draining=draining,
        taken_at=now,
        prefetch=prefetch,
        engines=readout.engines,
        health=by_alloc,
        evaluations=evaluations,
        engine_logs=tails,
    )
