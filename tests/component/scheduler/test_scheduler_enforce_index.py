"""A registration that loses an EnforceIndex race on devcluster re-plans instead of failing.

Between the controller's read and its write, the same job is registered behind its
back; devcluster's Nomad refuses the controller's write (facts N3) and the controller
reads again, finds the job there and leaves it as the other writer made it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from conftest import eventually, example, submit

from caravan_llm.cli.local_stack import LocalStack
from caravan_llm.common.nomad_api import NomadClient, RegisterResult


class RacedNomad:
    """The controller's Nomad client; before its first registration, someone else registers
    the same job (through a client of their own) and wins."""

    def __init__(self, nomad: NomadClient) -> None:
        self._nomad = nomad
        self.raced: list[tuple[str, int]] = []
        self.enforced: list[int | None] = []
        self._first = True

    def __getattr__(self, name: str) -> Any:
        return getattr(self._nomad, name)

    async def register_job(
        self, job: Mapping[str, Any], *, enforce_index: int | None = None
    ) -> RegisterResult:
        self.enforced.append(enforce_index)
        if self._first:  # registrations run concurrently: claim the race before awaiting
            self._first = False
            theirs = await self._nomad.register_job(job)
            self.raced.append((str(job["Job"]["ID"]), theirs.job_modify_index))
        return await self._nomad.register_job(job, enforce_index=enforce_index)


def counter(stack: LocalStack, kind: str, outcome: str) -> float:
    metric = stack.scheduler.controller.metrics.actions.labels(kind=kind, outcome=outcome)
    return float(metric._value.get())


async def test_lost_register_race_replans_and_keeps_the_winners_job(stack: LocalStack):
    controller = stack.scheduler.controller
    raced = RacedNomad(controller.nomad)  # type: ignore[arg-type]
    controller.nomad = raced  # type: ignore[assignment]
    profile = example("qwen-vllm-h100.yaml")
    await submit(stack, profile)

    async def both_registered() -> bool:
        jobs = (await stack.scheduler.nomad.list_jobs("caravan-qwen2-5-7b-")).value
        return len(jobs) == profile.replicas.start if raced.raced else False

    await eventually(both_registered, timeout_s=60, interval_s=0.2)
    [(job_id, their_index)] = raced.raced
    jobs = (await stack.scheduler.nomad.list_jobs(job_id)).value
    [job] = [j for j in jobs if j.id == job_id]
    assert their_index == job.job_modify_index, "the controller overwrote the winner's job"
    assert 0 == raced.enforced[0], "a new job must be registered with EnforceIndex 0"
    assert 1 == counter(stack, "register", "conflict")
    assert 0 == counter(stack, "register", "error")
