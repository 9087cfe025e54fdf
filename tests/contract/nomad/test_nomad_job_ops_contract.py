"""Revert, stable, dispatch, parse and deployment actions as Nomad answers them (issue 16, 2)."""

from __future__ import annotations

import asyncio
import base64
import copy
from pathlib import Path
from typing import Any

import aiohttp
import nomad.api.exceptions
import pytest
from nomad_contract_support import NomadTarget, eventually, get_json, sleeper_job

JOBSPECS = Path(__file__).resolve().parents[3] / "jobspecs"
NOMAD_INIT_SHORT = """
job "example" {
  group "cache" {
    network {
      port "db" {
        to = 6379
      }
    }
    task "redis" {
      driver = "docker"
      config {
        image          = "redis:7"
        ports          = ["db"]
        auth_soft_fail = true
      }
      identity {
        env  = true
        file = true
      }
      resources {
        cpu    = 500 # 500 MHz
        memory = 256 # 256MB
      }
    }
  }
}
"""


def _with_meta(body: dict[str, Any], value: str) -> dict[str, Any]:
    changed = copy.deepcopy(body)
    changed["Job"]["Meta"] = {"v": value}
    return changed


async def test_revert_registers_the_old_version_again(target: NomadTarget, unique: str) -> None:
    """Reverting to version 0 makes version 2 with version 0's spec; EnforcePriorVersion checks."""
    client = target.python_nomad()
    job_id = f"revert-{unique}"
    body = sleeper_job(job_id, count=0)
    await asyncio.to_thread(client.jobs.register_job, _with_meta(body, "a"))
    await asyncio.to_thread(client.jobs.register_job, _with_meta(body, "b"))
    with pytest.raises(nomad.api.exceptions.BaseNomadException) as stale:
        await asyncio.to_thread(client.job.revert_job, job_id, 0, 0)
    assert "Current job has version 1; enforcing version 0" in stale.value.nomad_resp.text
    result = await asyncio.to_thread(client.job.revert_job, job_id, 0, 1)
    assert {"EvalID", "EvalCreateIndex", "JobModifyIndex", "Index"} <= set(result)
    job = await asyncio.to_thread(client.job.get_job, job_id)
    assert (2, {"v": "a"}, False) == (job["Version"], job["Meta"], job["Stable"])
    with pytest.raises(nomad.api.exceptions.BaseNomadException) as same:
        await asyncio.to_thread(client.job.revert_job, job_id, 2)
    assert "can't revert to current version" in same.value.nomad_resp.text
    with pytest.raises(nomad.api.exceptions.BaseNomadException) as missing:
        await asyncio.to_thread(client.job.revert_job, job_id, 9)
    assert f'job "{job_id}" in namespace "default" at version 9 not found' in (
        missing.value.nomad_resp.text
    )
    await asyncio.to_thread(client.job.deregister_job, job_id, purge=True)


async def test_stable_flags_a_version(
    target: NomadTarget, http: aiohttp.ClientSession, unique: str
) -> None:
    """`/stable` answers the write index and the version reads back stable."""
    client = target.python_nomad()
    job_id = f"stable-{unique}"
    await asyncio.to_thread(client.jobs.register_job, sleeper_job(job_id, count=0))
    result = await asyncio.to_thread(client.job.stable_job, job_id, 0, True)
    assert result["Index"] > 0
    job = await asyncio.to_thread(client.job.get_job, job_id)
    assert job["Stable"] is True
    async with http.post(
        f"{target.address}/v1/job/{job_id}/stable", json={"JobID": "other", "JobVersion": 0}
    ) as response:
        assert (400, "Job ID does not match") == (response.status, (await response.text()).strip())
    await asyncio.to_thread(client.job.deregister_job, job_id, purge=True)


def _parameterized(job_id: str) -> dict[str, Any]:
    body = sleeper_job(job_id)
    job = body["Job"]
    job["Type"] = "batch"
    job["ParameterizedJob"] = {"Payload": "optional", "MetaRequired": ["model"]}
    task = job["TaskGroups"][0]["Tasks"][0]
    # Succeeds only if the dispatched payload is in local/input.txt.
    check = "import os, sys; p = os.environ['NOMAD_TASK_DIR'] + '/input.txt'; "
    check += "sys.exit(0 if open(p).read() == 'hello' else 3)"
    task["Config"]["args"] = ["-c", check]
    task["DispatchPayload"] = {"File": "input.txt"}
    job["TaskGroups"][0]["RestartPolicy"]["Mode"] = "fail"
    return body


async def test_dispatch_creates_a_child_job(
    target: NomadTarget, http: aiohttp.ClientSession, unique: str
) -> None:
    """Dispatching a parameterized job makes `<id>/dispatch-<time>-<id>` with its own eval."""
    client = target.python_nomad()
    job_id = f"param-{unique}"
    registered = await asyncio.to_thread(client.jobs.register_job, _parameterized(job_id))
    assert "" == registered["EvalID"]
    parent = await asyncio.to_thread(client.job.get_job, job_id)
    assert "running" == parent["Status"]
    with pytest.raises(nomad.api.exceptions.BaseNomadException) as missing_meta:
        await asyncio.to_thread(client.job.dispatch_job, job_id, meta={})
    assert "Dispatch did not provide required meta keys: [model]" in (
        missing_meta.value.nomad_resp.text
    )
    payload = base64.b64encode(b"hello").decode()
    result = await asyncio.to_thread(
        client.job.dispatch_job,
        job_id,
        payload=payload,
        meta={"model": "tiny"},
        id_prefix_template="run",
    )
    assert {"DispatchedJobID", "EvalID", "EvalCreateIndex", "JobCreateIndex", "Index"} <= set(
        result
    )
    child_id = result["DispatchedJobID"]
    assert child_id.startswith(f"{job_id}/dispatch-run-")
    child = await get_json(http, f"{target.address}/v1/job/{child_id}")
    assert (job_id, True, "tiny") == (
        child["ParentID"],
        child["Dispatched"],
        child["Meta"]["model"],
    )
    listed = await get_json(http, f"{target.address}/v1/jobs?prefix={job_id}")
    assert {job_id, child_id} == {j["ID"] for j in listed}

    async def completed() -> list[dict[str, Any]] | None:
        allocs = await get_json(http, f"{target.address}/v1/job/{child_id}/allocations")
        return allocs if any(a["ClientStatus"] == "complete" for a in allocs) else None

    await eventually(completed, timeout_s=20)
    for job in (child_id, job_id):
        async with http.delete(f"{target.address}/v1/job/{job}?purge=true") as response:
            assert 200 == response.status


async def test_payload_destination_may_not_leave_the_allocation(
    target: NomadTarget, http: aiohttp.ClientSession, unique: str
) -> None:
    """`DispatchPayload.File` escaping the allocation directory fails validation."""
    body = _parameterized(f"escape-{unique}")
    body["Job"]["TaskGroups"][0]["Tasks"][0]["DispatchPayload"] = {"File": "../../../x"}
    async with http.put(f"{target.address}/v1/jobs", json=body) as response:
        assert 500 == response.status
        assert "destination escapes allocation directory" in await response.text()


async def test_dispatching_a_plain_job_is_refused(target: NomadTarget, unique: str) -> None:
    """A job without a `parameterized` block cannot be dispatched."""
    client = target.python_nomad()
    job_id = f"plain-{unique}"
    await asyncio.to_thread(client.jobs.register_job, sleeper_job(job_id, count=0))
    with pytest.raises(nomad.api.exceptions.BaseNomadException) as refused:
        await asyncio.to_thread(client.job.dispatch_job, job_id)
    assert f'Specified job "{job_id}" is not a parameterized job' in refused.value.nomad_resp.text
    await asyncio.to_thread(client.job.deregister_job, job_id, purge=True)


async def test_parse_nomad_init_example(target: NomadTarget) -> None:
    """`nomad init -short`'s job parses to the API JSON python-nomad gets back."""
    client = target.python_nomad()
    job = await asyncio.to_thread(client.jobs.parse, NOMAD_INIT_SHORT)
    group = job["TaskGroups"][0]
    task = group["Tasks"][0]
    assert ("example", "cache", "redis", "docker") == (
        job["ID"],
        group["Name"],
        task["Name"],
        task["Driver"],
    )
    assert [{"Label": "db", "To": 6379}] == [
        {k: p[k] for k in ("Label", "To")} for p in group["Networks"][0]["DynamicPorts"]
    ]
    assert (500, 256) == (task["Resources"]["CPU"], task["Resources"]["MemoryMB"])
    assert {"image": "redis:7", "ports": ["db"], "auth_soft_fail": True} == task["Config"]
    canonical = await asyncio.to_thread(client.jobs.parse, NOMAD_INIT_SHORT, True)
    assert ("service", 50, "global") == (
        canonical["Type"],
        canonical["Priority"],
        canonical["Region"],
    )


async def test_parse_caravan_jobspecs_with_variables(
    target: NomadTarget, http: aiohttp.ClientSession
) -> None:
    """caravan's router jobspec: variable defaults, overrides, a dynamic constraint, heredocs."""
    text = (JOBSPECS / "caravan-router.nomad.hcl").read_text()
    url = f"{target.address}/v1/jobs/parse"
    async with http.post(url, json={"JobHCL": text}) as response:
        assert 200 == response.status, await response.text()
        job = await response.json()
    task = job["TaskGroups"][0]["Tasks"][0]
    assert ("caravan-router", "system", 70) == (job["ID"], job["Type"], job["Priority"])
    assert not job.get("Constraints")
    assert 120 * 10**9 == task["KillTimeout"]
    assert "${NOMAD_IP_http}" in task["Config"]["args"]
    assert task["Templates"][0]["EmbeddedTmpl"].startswith("{{ if nomadVarExists")
    assert [{"Label": "http", "Value": 8080}] == [
        {k: p[k] for k in ("Label", "Value")}
        for p in job["TaskGroups"][0]["Networks"][0]["ReservedPorts"]
    ]
    body = {"JobHCL": text, "Variables": {"node_class": "gpu"}}
    async with http.post(url, json=body) as response:
        job = await response.json()
    assert [("${node.class}", "gpu", "=")] == [
        (c["LTarget"], c["RTarget"], c["Operand"]) for c in job["Constraints"]
    ]
    scheduler = (JOBSPECS / "caravan-scheduler.nomad.hcl").read_text()
    async with http.post(url, json={"JobHCL": scheduler}) as response:
        assert 200 == response.status, await response.text()
        assert "caravan-scheduler" == (await response.json())["ID"]


@pytest.mark.parametrize(
    ("body", "status", "text"),
    [
        ({"JobHCL": ""}, 400, "Job spec is empty"),
        ({"JobHCL": 'job "x" { a = }'}, 400, "Failed to parse job: input.hcl"),
    ],
)
async def test_parse_errors(
    target: NomadTarget, http: aiohttp.ClientSession, body: dict[str, Any], status: int, text: str
) -> None:
    """An empty or broken jobspec is a 400 that says so."""
    async with http.post(f"{target.address}/v1/jobs/parse", json=body) as response:
        assert status == response.status
        assert (await response.text()).startswith(text)


async def test_parse_refuses_hcl_it_does_not_evaluate(
    target: NomadTarget, http: aiohttp.ClientSession
) -> None:
    """devcluster names what it cannot evaluate instead of guessing (`locals`, other functions)."""
    target.devcluster()
    url = f"{target.address}/v1/jobs/parse"
    hcl = 'locals { a = 1 }\njob "x" { group "g" { task "t" { driver = "raw_exec" } } }'
    async with http.post(url, json={"JobHCL": hcl}) as response:
        assert (400, 'Failed to parse job: input.hcl: Unsupported block type: "locals"') == (
            response.status,
            (await response.text()).split(" is not supported")[0],
        )
    hcl = 'job "x" { priority = max(1, 2) }'
    async with http.post(url, json={"JobHCL": hcl}) as response:
        assert 400 == response.status
        assert 'Call to unknown function: "max"' in await response.text()


async def _running_deployment(
    target: NomadTarget, http: aiohttp.ClientSession, job_id: str
) -> dict[str, Any]:
    body = sleeper_job(job_id)
    # A long MinHealthyTime keeps the deployment running while the test acts on it.
    body["Job"]["TaskGroups"][0]["Update"] = {
        "MinHealthyTime": 600 * 10**9,
        "HealthyDeadline": 900 * 10**9,
        "ProgressDeadline": 1000 * 10**9,
    }
    async with http.put(f"{target.address}/v1/jobs", json=body) as response:
        assert 200 == response.status, await response.text()

    async def probe() -> dict[str, Any] | None:
        found: dict[str, Any] | None = await get_json(
            http, f"{target.address}/v1/job/{job_id}/deployment"
        )
        return found if found and found["Status"] == "running" else None

    return await eventually(probe)


async def test_deployment_pause_resume_promote_and_fail(
    target: NomadTarget, http: aiohttp.ClientSession, unique: str
) -> None:
    """A running deployment can be paused, resumed, promoted and failed; then it is terminal."""
    client = target.python_nomad()
    job_id = f"deploy-{unique}"
    deployment = await _running_deployment(target, http, job_id)
    deployment_id = deployment["ID"]
    paused = await asyncio.to_thread(client.deployment.pause_deployment, deployment_id, True)
    assert ("", paused["Index"]) == (paused["EvalID"], paused["DeploymentModifyIndex"])
    state = await asyncio.to_thread(client.deployment.get_deployment, deployment_id)
    assert ("paused", "Deployment is paused") == (state["Status"], state["StatusDescription"])
    resumed = await asyncio.to_thread(client.deployment.pause_deployment, deployment_id, False)
    assert resumed["EvalID"]
    promoted = await asyncio.to_thread(client.deployment.promote_deployment_all, deployment_id)
    assert {"EvalID", "EvalCreateIndex", "DeploymentModifyIndex", "Index"} <= set(promoted)
    failed = await asyncio.to_thread(client.deployment.fail_deployment, deployment_id)
    assert failed["EvalID"]
    state = await asyncio.to_thread(client.deployment.get_deployment, deployment_id)
    assert ("failed", "Deployment marked as failed") == (
        state["Status"],
        state["StatusDescription"],
    )
    base = f"{target.address}/v1/deployment"
    attempts = [
        ("fail", {}, "can't fail terminal deployment"),
        ("pause", {"Pause": True}, "can't pause terminal deployment"),
        ("pause", {"Pause": False}, "can't resume terminal deployment"),
        ("promote", {"All": True}, "can't promote terminal deployment"),
        (
            "allocation-health",
            {"HealthyAllocationIDs": ["x"]},
            "can't set health of allocations for a terminal deployment",
        ),
    ]
    for action, extra, text in attempts:
        request = {"DeploymentID": deployment_id, **extra}
        async with http.post(f"{base}/{action}/{deployment_id}", json=request) as response:
            assert (500, text) == (response.status, (await response.text()).strip())
    await asyncio.to_thread(client.job.deregister_job, job_id, purge=True)


async def test_allocation_health_marks_allocations(
    target: NomadTarget, http: aiohttp.ClientSession, unique: str
) -> None:
    """Marking an allocation unhealthy fails the deployment with Nomad's description."""
    client = target.python_nomad()
    job_id = f"health-{unique}"
    deployment = await _running_deployment(target, http, job_id)
    allocs = await get_json(http, f"{target.address}/v1/deployment/allocations/{deployment['ID']}")
    result = await asyncio.to_thread(
        client.deployment.deployment_allocation_health,
        deployment["ID"],
        unhealthy_allocations=[allocs[0]["ID"]],
    )
    assert result["EvalID"]
    alloc = await get_json(http, f"{target.address}/v1/allocation/{allocs[0]['ID']}")
    assert alloc["DeploymentStatus"]["Healthy"] is False
    state = await get_json(http, f"{target.address}/v1/deployment/{deployment['ID']}")
    assert ("failed", "Failed due to unhealthy allocations") == (
        state["Status"],
        state["StatusDescription"],
    )
    await asyncio.to_thread(client.job.deregister_job, job_id, purge=True)


async def test_parse_caravan_router_sidecar_jobspec(
    target: NomadTarget, http: aiohttp.ClientSession
) -> None:
    """The sidecar example parses: a prestart sidecar router on the bridge group's loopback."""
    text = (JOBSPECS / "caravan-router-sidecar.nomad.hcl").read_text()
    async with http.post(f"{target.address}/v1/jobs/parse", json={"JobHCL": text}) as response:
        assert 200 == response.status, await response.text()
        job = await response.json()
    group = job["TaskGroups"][0]
    tasks = {task["Name"]: task for task in group["Tasks"]}
    router = tasks["caravan-router"]
    assert ("chat-app", "bridge") == (job["ID"], group["Networks"][0]["Mode"])
    assert {"Hook": "prestart", "Sidecar": True} == {
        k: router["Lifecycle"][k] for k in ("Hook", "Sidecar")
    }
    args = router["Config"]["args"]
    assert ["127.0.0.1", "8080"] == [args[args.index("--host") + 1], args[args.index("--port") + 1]]
    assert "http://${attr.unique.network.ip-address}:8500" == router["Env"]["CONSUL_HTTP_ADDR"]
    assert "false" == router["Env"]["CARAVAN_ROUTER_REGISTER_SERVICE"]
    assert "http://127.0.0.1:8080/v1" == tasks["app"]["Env"]["OPENAI_BASE_URL"]
