"""devcluster-only behaviour: fault injection, node control, ACL token, clean shutdown."""

from __future__ import annotations

import asyncio
import copy
import os
from typing import Any

import aiohttp
import nomad.api.exceptions
import pytest
from nomad_contract_support import (
    NomadTarget,
    eventually,
    example,
    get_json,
    running_allocs,
    sleeper_job,
)

from caravan_llm.devcluster.nomad.server import NomadServer
from caravan_llm.devcluster.nomad.settings import NodeSpec


async def test_outage_answers_500_until_lifted(
    target: NomadTarget, http: aiohttp.ClientSession
) -> None:
    """`PUT /v1/devcluster/outage` makes every Nomad endpoint answer 500 `rpc error: ...`."""
    target.devcluster()
    async with http.put(f"{target.address}/v1/devcluster/outage", json={"Enabled": True}):
        pass
    async with http.get(f"{target.address}/v1/jobs") as response:
        assert (500, "rpc error: No cluster leader") == (
            response.status,
            (await response.text()).strip(),
        )
    async with http.put(f"{target.address}/v1/devcluster/outage", json={"Enabled": False}):
        pass
    async with http.get(f"{target.address}/v1/jobs") as response:
        assert 200 == response.status


async def test_crashed_task_restarts_by_its_policy(
    target: NomadTarget, http: aiohttp.ClientSession, unique: str
) -> None:
    """Killing a task's process is a `Terminated` (signal 9) followed by `Restarting`."""
    target.devcluster()
    job_id = f"crash-{unique}"
    await http.put(f"{target.address}/v1/jobs", json=sleeper_job(job_id))
    (alloc,) = await running_allocs(http, target.address, job_id)
    async with http.post(f"{target.address}/v1/devcluster/alloc/{alloc['ID']}/crash") as response:
        assert 1 == len((await response.json())["KilledPIDs"])

    async def restarted() -> dict[str, Any] | None:
        current = await get_json(http, f"{target.address}/v1/allocation/{alloc['ID']}")
        state = current["TaskStates"]["sleep"]
        return state if state["Restarts"] >= 1 and state["State"] == "running" else None

    state = await eventually(restarted)
    types = [event["Type"] for event in state["Events"]]
    terminated = next(e for e in state["Events"] if e["Type"] == "Terminated")
    assert types.index("Terminated") < types.index("Restarting") < len(types) - 1
    assert 9 == terminated["Signal"]
    assert terminated["DisplayMessage"].startswith("Exit Code: -1, Signal: 9")


async def test_task_failing_past_its_attempts_fails_the_allocation(
    target: NomadTarget, http: aiohttp.ClientSession, unique: str
) -> None:
    """A task that always exits 1 ends `Not Restarting` and the allocation `failed`."""
    target.devcluster()
    body = sleeper_job(f"fail-{unique}")
    task = body["Job"]["TaskGroups"][0]["Tasks"][0]
    task["Config"]["args"] = ["-c", "raise SystemExit(1)"]
    await http.put(f"{target.address}/v1/jobs", json=body)

    async def failed() -> dict[str, Any] | None:
        allocs = await get_json(http, f"{target.address}/v1/job/fail-{unique}/allocations")
        return next((a for a in allocs if a["ClientStatus"] == "failed"), None)

    alloc = await eventually(failed, timeout_s=20)
    events = alloc["TaskStates"]["sleep"]["Events"]
    assert "Not Restarting" == events[-1]["Type"]
    assert (
        'Exceeded allowed attempts 2 in interval 30s and mode is "fail"'
        == (events[-1]["DisplayMessage"])
    )


async def test_unmapped_docker_image_is_a_driver_failure(
    target: NomadTarget, http: aiohttp.ClientSession, unique: str
) -> None:
    """A docker image devcluster cannot stand in for fails with a clear Driver Failure."""
    target.devcluster()
    body = sleeper_job(f"img-{unique}")
    task = body["Job"]["TaskGroups"][0]["Tasks"][0]
    task["Driver"] = "docker"
    task["Config"] = {"image": "redis:7"}
    await http.put(f"{target.address}/v1/jobs", json=body)

    async def failure() -> dict[str, Any] | None:
        allocs = await get_json(http, f"{target.address}/v1/job/img-{unique}/allocations")
        for alloc in allocs:
            for event in (alloc["TaskStates"] or {}).get("sleep", {}).get("Events", []):
                if event["Type"] == "Driver Failure":
                    return dict(event)
        return None

    event = await eventually(failure)
    assert "no devcluster image mapping exists for image 'redis:7'" in event["DisplayMessage"]


async def test_killed_node_goes_down_and_its_allocation_is_replaced(
    target: NomadTarget, http: aiohttp.ClientSession, unique: str
) -> None:
    """After the heartbeat grace the node is down, the allocation lost, a replacement runs."""
    server = target.devcluster()
    job_id = f"kill-{unique}"
    await http.put(f"{target.address}/v1/jobs", json=sleeper_job(job_id))
    (alloc,) = await running_allocs(http, target.address, job_id)
    pid = next(iter(server.processes()))
    async with http.post(f"{target.address}/v1/devcluster/node/{alloc['NodeID']}/kill"):
        pass
    await eventually(lambda: _gone(pid))

    async def replaced() -> list[dict[str, Any]] | None:
        allocs = await get_json(http, f"{target.address}/v1/job/{job_id}/allocations")
        lost = [a for a in allocs if a["ClientStatus"] == "lost"]
        running = [a for a in allocs if a["ClientStatus"] == "running"]
        return allocs if lost and running else None

    allocs = await eventually(replaced, timeout_s=10)
    lost = next(a for a in allocs if a["ClientStatus"] == "lost")
    running = next(a for a in allocs if a["ClientStatus"] == "running")
    assert (alloc["ID"], "stop", "alloc is lost since its node is down") == (
        lost["ID"],
        lost["DesiredStatus"],
        lost["DesiredDescription"],
    )
    assert running["NodeID"] != alloc["NodeID"]
    node = await get_json(http, f"{target.address}/v1/node/{alloc['NodeID']}")
    assert "down" == node["Status"]
    async with http.post(f"{target.address}/v1/devcluster/node/{alloc['NodeID']}/restart"):
        pass

    async def back() -> bool:
        restarted = await get_json(http, f"{target.address}/v1/node/{alloc['NodeID']}")
        return restarted["Status"] == "ready"

    assert await eventually(back)


async def _gone(pid: int) -> bool:
    """Whether the process has exited and been reaped."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


async def test_added_gpu_node_unblocks_a_waiting_job(
    target: NomadTarget, http: aiohttp.ClientSession, unique: str
) -> None:
    """A job for a GPU model no node has blocks; adding such a node places it."""
    target.devcluster()
    body = copy.deepcopy(example("vllm_gpu_job.json"))
    job = body["Job"]
    job["ID"] = job["Name"] = f"b200-{unique}"
    task = job["TaskGroups"][0]["Tasks"][0]
    task["Resources"]["Devices"][0]["Name"] = "nvidia/gpu/NVIDIA B200"
    task["Env"]["CARAVAN_SIM_LOAD_SECONDS"] = "0.1"
    async with http.put(f"{target.address}/v1/jobs", json=body) as response:
        eval_id = (await response.json())["EvalID"]

    async def blocked() -> dict[str, Any] | None:
        evaluation = await get_json(http, f"{target.address}/v1/evaluation/{eval_id}")
        return evaluation if evaluation["BlockedEval"] else None

    evaluation = await eventually(blocked)
    assert {"missing devices": 3} == evaluation["FailedTGAllocs"]["server"]["ConstraintFiltered"]
    blocked_eval = await get_json(
        http, f"{target.address}/v1/evaluation/{evaluation['BlockedEval']}"
    )
    assert "blocked" == blocked_eval["Status"]
    spec = {"Gpus": 1, "GpuModel": "NVIDIA B200", "GpuMemoryMib": 183359, "MemoryMb": 262144}
    async with http.post(f"{target.address}/v1/devcluster/node", json=spec) as response:
        added = await response.json()
        assert 200 == response.status, added
    (alloc,) = await running_allocs(http, target.address, job["ID"])
    assert added["ID"] == alloc["NodeID"]


async def test_node_spec_is_checked(target: NomadTarget, http: aiohttp.ClientSession) -> None:
    """An unknown field in a devcluster node spec is a 400 naming it."""
    target.devcluster()
    async with http.post(f"{target.address}/v1/devcluster/node", json={"Gpuz": 1}) as response:
        text = await response.text()
        assert 400 == response.status
    assert "Gpuz" in text


async def test_acl_token_is_required_when_configured() -> None:
    """With a token set, calls without it get 403 `Permission denied`; python-nomad's pass."""
    async with NomadServer(nodes=1, token="management-secret") as server:
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{server.address}/v1/jobs") as response:
                assert (403, "Permission denied") == (
                    response.status,
                    (await response.text()).strip(),
                )
            headers = {"X-Nomad-Token": "wrong"}
            async with http.get(f"{server.address}/v1/jobs", headers=headers) as response:
                assert 403 == response.status
        target = NomadTarget(address=server.address, server=server)
        with pytest.raises(nomad.api.exceptions.URLNotAuthorizedNomadException):
            await asyncio.to_thread(target.python_nomad_with(token="wrong").jobs.get_jobs)
        authorized = target.python_nomad_with(token="management-secret")
        assert [] == await asyncio.to_thread(authorized.jobs.get_jobs)


async def test_leaving_the_context_leaves_no_process_behind(unique: str) -> None:
    """Every task process is gone once the server context exits."""
    async with NomadServer(nodes=[NodeSpec(), NodeSpec()]) as server:
        async with aiohttp.ClientSession() as http:
            await http.put(
                f"{server.address}/v1/jobs", json=sleeper_job(f"orphan-{unique}", count=3)
            )
            await running_allocs(http, server.address, f"orphan-{unique}", 3)
        pids = server.processes()
        assert 3 == len(pids)
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
