"""The scheduler's preflight probes submit-job with a plan, which registers nothing."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from caravan_llm.common.contract import KVLayout
from caravan_llm.common.errors import HashiPermissionDenied
from caravan_llm.common.nomad_api import QueryResult, VariableMetadata
from caravan_llm.common.preflight import PROBE_NAME, Preflight
from caravan_llm.scheduler.preflight import scheduler_capabilities


class NoSubmitNomad:
    """Every read answers; a plan is refused as for a token without submit-job."""

    def __init__(self) -> None:
        self.planned: list[Mapping[str, Any]] = []

    async def list_jobs(self, prefix: str = "") -> QueryResult[list[Any]]:
        return QueryResult(1, [])

    async def job_evaluations(self, job_id: str) -> QueryResult[list[Any]]:
        return QueryResult(1, [])

    async def list_nodes(self, *, resources: bool = True) -> QueryResult[list[Any]]:
        return QueryResult(1, [])

    async def plan_job(self, job: Mapping[str, Any], *, diff: bool = False) -> dict[str, Any]:
        self.planned.append(job)
        raise HashiPermissionDenied("Nomad POST .../plan: HTTP 403: Permission denied", status=403)

    async def get_variable(self, path: str) -> None:
        return None

    async def put_variable(
        self, path: str, items: Mapping[str, str], *, cas: int | None = None
    ) -> VariableMetadata:
        raise AssertionError("not probed without engine keys")


class Consul:
    async def kv_put(self, key: str, value: bytes | str, *, cas: int | None = None) -> bool:
        return False


async def test_a_token_without_submit_job_is_named_by_the_plan_probe() -> None:
    """The probe plans a count-0 job named after the probe; a 403 makes submit-job missing."""
    nomad = NoSubmitNomad()
    preflight = Preflight(
        "scheduler",
        scheduler_capabilities(KVLayout(), Consul(), nomad, engine_api_keys=False),
        clock=lambda: 1.0,
    )

    result = await preflight.check()

    assert ("nomad: submit-job",) == result.missing
    (job,) = nomad.planned
    assert (PROBE_NAME, [0]) == (job["ID"], [group["Count"] for group in job["TaskGroups"]])
