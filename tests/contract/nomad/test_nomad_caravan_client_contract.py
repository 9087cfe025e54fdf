"""caravan's own async Nomad client against the Nomad under test (only what caravan calls)."""

from __future__ import annotations

import copy

import pytest
from nomad_contract_support import NomadTarget, sleeper_job

from caravan_llm.common.errors import HashiBadRequest, JobModifyIndexConflict
from caravan_llm.common.nomad_api import JobStub, NomadClient, NomadSettings


def client(target: NomadTarget) -> NomadClient:
    return NomadClient(NomadSettings(address=target.address))


async def stub_of(nomad: NomadClient, job_id: str) -> JobStub | None:
    jobs = (await nomad.list_jobs(job_id, meta=True)).value
    return next((job for job in jobs if job.id == job_id), None)


async def test_register_read_and_purge(target: NomadTarget, unique: str) -> None:
    """Create-only register, read back, enforce the index, then purge."""
    job_id = f"cc-{unique}"
    async with client(target) as nomad:
        created = await nomad.register_job(sleeper_job(job_id), enforce_index=0)
        job = await stub_of(nomad, job_id)
        assert job is not None
        assert (job_id, 0, created.job_modify_index) == (job.id, job.version, job.job_modify_index)
        with pytest.raises(JobModifyIndexConflict) as lost:
            await nomad.register_job(sleeper_job(job_id), enforce_index=0)
        assert lost.value.retryable
        changed = copy.deepcopy(sleeper_job(job_id))
        changed["Job"]["Meta"] = {"caravan_spec_hash": "2"}
        with pytest.raises(JobModifyIndexConflict):
            await nomad.register_job(changed, enforce_index=job.job_modify_index + 1)
        await nomad.register_job(changed, enforce_index=job.job_modify_index)
        updated = await stub_of(nomad, job_id)
        assert updated is not None
        assert (1, {"caravan_spec_hash": "2"}) == (updated.version, dict(updated.meta))
        await nomad.deregister_job(job_id, purge=True)
        assert await stub_of(nomad, job_id) is None


async def test_blocking_allocations_see_the_job_start(target: NomadTarget, unique: str) -> None:
    """A blocking read from the last index returns once allocations change; the
    allocation with resources carries its (empty) ports and is live."""
    job_id = f"cb-{unique}"
    async with client(target) as nomad:
        first = await nomad.list_allocations(resources=True)
        await nomad.register_job(sleeper_job(job_id))
        index = first.index
        running = []
        for _ in range(50):
            result = await nomad.list_allocations(resources=True, index=index, wait_s=5)
            index = result.index
            running = [a for a in result.value if a.job_id == job_id and a.live]
            if any(a.client_status == "running" for a in running):
                break
        assert 1 == len(running)
        assert () == running[0].ports
        await nomad.deregister_job(job_id, purge=True)


async def test_validation_failure_is_a_bad_request(target: NomadTarget, unique: str) -> None:
    """Nomad's 500 validation text becomes HashiBadRequest, not a retryable outage."""
    body = sleeper_job(f"cv-{unique}")
    body["Job"]["TaskGroups"][0]["Tasks"][0]["Resources"]["Cores"] = 2
    async with client(target) as nomad:
        with pytest.raises(HashiBadRequest) as caught:
            await nomad.register_job(body)
    assert "Task can only ask for 'cpu' or 'cores' resource, not both." in str(caught.value)


async def test_nodes(target: NomadTarget) -> None:
    """Nodes list with resources, ready by Nomad's status."""
    async with client(target) as nomad:
        nodes = await nomad.list_nodes()
    assert nodes.value
    assert all(node.cpu_mhz for node in nodes.value)
    assert any(node.ready for node in nodes.value)
