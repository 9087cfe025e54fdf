"""caravan's own async Nomad client against the Nomad under test."""

from __future__ import annotations

import asyncio
import copy

import pytest
from nomad_contract_support import NomadTarget, sleeper_job

from caravan.errors import HashiBadRequest, HashiConflict
from caravan.nomad_api import NomadClient, NomadSettings


def client(target: NomadTarget) -> NomadClient:
    return NomadClient(NomadSettings(address=target.address))


async def test_register_read_and_purge(target: NomadTarget, unique: str) -> None:
    """Create-only register, read back, enforce the index, then purge."""
    job_id = f"cc-{unique}"
    async with client(target) as nomad:
        created = await nomad.register_job(sleeper_job(job_id), enforce_index=0)
        job = await nomad.get_job(job_id)
        assert job is not None
        assert (job_id, 0, created.job_modify_index) == (job.id, job.version, job.job_modify_index)
        with pytest.raises(HashiConflict):
            await nomad.register_job(sleeper_job(job_id), enforce_index=0)
        changed = copy.deepcopy(sleeper_job(job_id))
        changed["Job"]["Meta"] = {"caravan_spec_hash": "2"}
        await nomad.register_job(changed, enforce_index=job.job_modify_index)
        updated = await nomad.get_job(job_id)
        assert updated is not None
        assert 1 == updated.version
        await nomad.deregister_job(job_id, purge=True)
        assert await nomad.get_job(job_id) is None


async def test_blocking_allocations_see_the_job_start(target: NomadTarget, unique: str) -> None:
    """A blocking read from the register's index returns once allocations change."""
    job_id = f"cb-{unique}"
    async with client(target) as nomad:
        first = await nomad.job_allocations(job_id)
        assert [] == first.value
        await nomad.register_job(sleeper_job(job_id))
        index = first.index
        running = []
        for _ in range(50):
            result = await nomad.job_allocations(job_id, index=index, wait_s=5)
            index = result.index
            running = [a for a in result.value if a.client_status == "running"]
            if running:
                break
        assert 1 == len(running)
        full = await nomad.allocation(running[0].id)
        assert full is not None
        assert full.ports == ()
        await nomad.deregister_job(job_id, purge=True)


async def test_event_stream_frames_for_a_job(target: NomadTarget, unique: str) -> None:
    """The async iterator yields the job's allocation frames, heartbeats skipped."""
    job_id = f"ce-{unique}"
    async with client(target) as nomad:
        frames = []

        async def consume() -> None:
            async for frame in nomad.events([f"Allocation:{job_id}"]):
                frames.append(frame)
                if any(
                    event.payload["Allocation"]["ClientStatus"] == "running"
                    for event in frame.events
                ):
                    return

        consumer = asyncio.ensure_future(consume())
        await asyncio.sleep(0.2)
        await nomad.register_job(sleeper_job(job_id))
        await asyncio.wait_for(consumer, 15)
        indexes = [frame.index for frame in frames]
        assert indexes == sorted(indexes)
        assert all(event.topic == "Allocation" for frame in frames for event in frame.events)
        await nomad.deregister_job(job_id, purge=True)


async def test_validation_failure_is_a_bad_request(target: NomadTarget, unique: str) -> None:
    """Nomad's 500 validation text becomes HashiBadRequest, not a retryable outage."""
    body = sleeper_job(f"cv-{unique}")
    body["Job"]["TaskGroups"][0]["Tasks"][0]["Resources"]["Cores"] = 2
    async with client(target) as nomad:
        with pytest.raises(HashiBadRequest) as caught:
            await nomad.register_job(body)
    assert "Task can only ask for 'cpu' or 'cores' resource, not both." in str(caught.value)


async def test_plan_and_nodes(target: NomadTarget, unique: str) -> None:
    """Plan reports placements; nodes list with resources."""
    async with client(target) as nomad:
        plan = await nomad.plan_job(sleeper_job(f"cp-{unique}"))
        nodes = await nomad.list_nodes()
    assert 1 == plan.desired_updates["g"]["Place"]
    assert {} == dict(plan.failed_tg_allocs)
    assert nodes.value
    assert all(node.cpu_mhz for node in nodes.value)
