"""Job registration enforces the JobModifyIndex the plan was made from, and a lost race re-plans.

The fake Nomad applies Nomad's EnforceIndex rule (docs/nomad-consul-facts.md, N3) to
the jobs it holds; a test hook lets another writer register behind the controller's back.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from profile_builders import make_llamacpp
from prometheus_client import CollectorRegistry

from caravan_llm.common.consul_api import HealthEntry, KVEntry
from caravan_llm.common.contract import KVLayout
from caravan_llm.common.errors import HashiUnavailable, JobModifyIndexConflict
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
from caravan_llm.scheduler.controller import CONFLICT_REPLANS, Controller
from caravan_llm.scheduler.metrics import SchedulerMetrics
from caravan_llm.scheduler.model_store import DesiredState, ModelStore

PROFILE = make_llamacpp(name="tiny", replicas={"min": 1, "max": 1})


class DictKV:
    """Consul KV in a dict (what publishing placements and failures needs)."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    async def kv_get_recurse(
        self, prefix: str, *, index: int = 0, wait_s: float | None = None
    ) -> tuple[int, tuple[KVEntry, ...]]:
        return 1, tuple(
            KVEntry(k, v, 0, None, 0, 1, 1) for k, v in self.data.items() if k.startswith(prefix)
        )

    async def kv_put(self, key: str, value: bytes | str, **_: object) -> bool:
        self.data[key] = value.encode() if isinstance(value, str) else value
        return True

    async def kv_delete(self, key: str, **_: object) -> bool:
        self.data.pop(key, None)
        return True


class FixedStore(ModelStore):
    """The desired state is one CPU profile at one replica."""

    async def read(self, *, index: int = 0, wait_s: float | None = None) -> DesiredState:
        return DesiredState(
            profiles={PROFILE.name: PROFILE}, invalid={}, stored_counts={}, draining={}, demand={}
        )


class EnforcingNomad:
    """Jobs in a dict with Nomad's EnforceIndex rule; `before_register` runs first."""

    def __init__(self) -> None:
        self.jobs: dict[str, dict[str, Any]] = {}
        self.index = 10
        self.reads = 0
        self.registers: list[tuple[str, int | None]] = []
        self.before_register: Callable[[Mapping[str, Any]], None] = lambda _job: None

    def put(self, job: Mapping[str, Any]) -> None:
        self.index += 1
        self.jobs[str(job["ID"])] = {**job, "JobModifyIndex": self.index, "Status": "pending"}

    async def list_jobs(
        self,
        prefix: str = "",
        *,
        meta: bool = False,
        index: int | None = None,
        wait_s: float | None = None,
    ) -> QueryResult[list[JobStub]]:
        self.reads += 1
        stubs = [
            JobStub.from_api(job) for job in self.jobs.values() if job["ID"].startswith(prefix)
        ]
        return QueryResult(self.index, stubs)

    async def list_allocations(
        self,
        prefix: str = "",
        *,
        resources: bool = False,
        index: int | None = None,
        wait_s: float | None = None,
    ) -> QueryResult[list[Allocation]]:
        return QueryResult(self.index, [])

    async def list_nodes(
        self, *, resources: bool = True, index: int | None = None, wait_s: float | None = None
    ) -> QueryResult[list[Node]]:
        return QueryResult(self.index, [])

    async def job_evaluations(
        self, job_id: str, *, index: int | None = None, wait_s: float | None = None
    ) -> QueryResult[list[Evaluation]]:
        return QueryResult(self.index, [])

    async def register_job(
        self, job: Mapping[str, Any], *, enforce_index: int | None = None
    ) -> RegisterResult:
        body = job.get("Job", job)
        self.registers.append((str(body["ID"]), enforce_index))
        self.before_register(body)
        stored = self.jobs.get(str(body["ID"]))
        if enforce_index is not None:
            have = 0 if stored is None else int(stored["JobModifyIndex"])
            if have != enforce_index:
                raise_enforce(enforce_index, have)
        self.put(body)
        return RegisterResult("eval", self.index, self.index, "", self.index)

    async def deregister_job(self, job_id: str, *, purge: bool = True) -> DeregisterResult:
        self.jobs.pop(job_id, None)
        return DeregisterResult("eval", self.index, self.index)


def raise_enforce(wanted: int, have: int) -> None:
    # What caravan_llm.common.nomad_api makes of Nomad's 500 (its mapping is tested in
    # test_nomad_api.py).
    raise JobModifyIndexConflict(
        f"Nomad PUT /v1/jobs: HTTP 500: Enforcing job modify index {wanted}: "
        f"job exists with conflicting job modify index: {have}",
        status=500,
    )


class NoHealth:
    async def health_service(self, name: str, **_: object) -> tuple[int, tuple[HealthEntry, ...]]:
        return 1, ()


def controller(nomad: EnforcingNomad) -> Controller:
    return Controller(
        store=FixedStore(DictKV(), KVLayout()),  # type: ignore[arg-type]  # no txn needed
        nomad=nomad,
        health=NoHealth(),
        config=ClusterConfig(),
        metrics=SchedulerMetrics.create(CollectorRegistry()),
        clock=lambda: 1_000_000.0,
    )


async def test_a_new_job_is_registered_only_if_it_still_does_not_exist() -> None:
    """The plan saw no job: registration enforces index 0 and succeeds."""
    nomad = EnforcingNomad()

    result = await controller(nomad).reconcile_once()

    assert [("caravan-tiny-0", 0)] == nomad.registers
    assert (1, 0, 0) == (result.applied, result.failed, result.conflicts)


async def test_a_lost_race_replans_from_a_fresh_read_instead_of_failing() -> None:
    """Another writer registers the job between our read and our write: we re-read and
    see it there, so we do not overwrite it and the pass does not fail."""
    nomad = EnforcingNomad()

    def behind_our_back(job: Mapping[str, Any]) -> None:
        nomad.before_register = lambda _job: None
        nomad.put(job)  # the same spec, written by someone else first

    nomad.before_register = behind_our_back

    result = await controller(nomad).reconcile_once()
    theirs = nomad.jobs["caravan-tiny-0"]["JobModifyIndex"]

    assert [("caravan-tiny-0", 0)] == nomad.registers  # the re-plan had nothing left to do
    assert 2 == nomad.reads
    assert 11 == theirs  # their registration stands: not overwritten
    assert (0, 0, 1) == (result.failed, result.applied, result.conflicts)


async def test_a_writer_that_always_wins_backs_off_after_a_few_replans() -> None:
    """Each re-plan loses again: the call stops after CONFLICT_REPLANS and comes back later."""
    nomad = EnforcingNomad()
    nomad.before_register = lambda _job: raise_enforce(0, 99)

    c = controller(nomad)
    result = await c.reconcile_once()

    assert CONFLICT_REPLANS + 1 == len(nomad.registers) == result.conflicts
    assert 0 == result.failed
    assert c.settings.backoff_initial_s == result.requeue_after_s
    assert not nomad.jobs


async def test_an_outage_while_registering_is_still_a_failure() -> None:
    """Only the EnforceIndex race re-plans; an unreachable Nomad fails the action as before."""
    nomad = EnforcingNomad()

    def down(_job: Mapping[str, Any]) -> None:
        raise HashiUnavailable("nomad down")

    nomad.before_register = down
    result = await controller(nomad).reconcile_once()

    assert (0, 1, 0) == (result.applied, result.failed, result.conflicts)
    assert 1 == nomad.reads
