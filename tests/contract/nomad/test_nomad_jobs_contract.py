"""Jobs API contract: register, read, list, plan, validate, deregister (facts N1-N10, N15)."""

from __future__ import annotations

import asyncio
import copy
import json

import aiohttp
import nomad.api.exceptions
import pytest
from nomad_contract_support import NS, NomadTarget, example, sleeper_job


async def test_register_returns_nomads_envelope(target: NomadTarget, unique: str) -> None:
    """python-nomad's `register_job` gets EvalID, indexes and Warnings back."""
    client = target.python_nomad()
    result = await asyncio.to_thread(client.jobs.register_job, sleeper_job(f"reg-{unique}"))
    assert {"EvalID", "EvalCreateIndex", "JobModifyIndex", "Warnings", "Index"} <= set(result)
    assert result["EvalID"]
    assert result["JobModifyIndex"] > 0
    await asyncio.to_thread(client.job.deregister_job, f"reg-{unique}", purge=True)


async def test_read_back_shows_defaults_and_implied_constraints(
    target: NomadTarget, unique: str
) -> None:
    """The stored job has Nomad's defaults and the Consul/signal constraints it implied."""
    body = copy.deepcopy(example("llamacpp_cpu_job.json"))
    body["Job"]["ID"] = body["Job"]["Name"] = f"llama-{unique}"
    body["Job"]["TaskGroups"][0]["Tasks"][0]["KillSignal"] = "SIGTERM"
    client = target.python_nomad()
    await asyncio.to_thread(client.jobs.register_job, body)
    job = await asyncio.to_thread(client.job.get_job, f"llama-{unique}")
    group = job["TaskGroups"][0]
    assert ("service", 50, "global", "default", 0) == (
        job["Type"],
        job["Priority"],
        job["Region"],
        job["Namespace"],
        job["Version"],
    )
    assert {"Delay": 15 * NS, "Attempts": 2, "Interval": 1800 * NS, "Mode": "fail"}.items() <= (
        group["RestartPolicy"].items()
    )
    assert {"LTarget": "${attr.consul.version}", "RTarget": ">= 1.8.0", "Operand": "semver"} in (
        group["Constraints"]
    )
    assert {"LTarget": "${attr.os.signals}", "RTarget": "SIGTERM", "Operand": "set_contains"} in (
        group["Constraints"]
    )
    check = group["Services"][0]["Checks"][0]
    assert f'service: "{group["Services"][0]["Name"]}" check' == check["Name"]
    await asyncio.to_thread(client.job.deregister_job, f"llama-{unique}", purge=True)


async def test_unknown_job_is_404_text(
    target: NomadTarget, http: aiohttp.ClientSession, unique: str
) -> None:
    """`GET /v1/job/<unknown>` is 404 `job not found` in text/plain; python-nomad raises."""
    async with http.get(f"{target.address}/v1/job/none-{unique}") as response:
        assert (404, "text/plain", "job not found") == (
            response.status,
            response.content_type,
            (await response.text()).strip(),
        )
    client = target.python_nomad()
    with pytest.raises(nomad.api.exceptions.URLNotFoundNomadException):
        await asyncio.to_thread(client.job.get_job, f"none-{unique}")


async def test_same_spec_keeps_the_version_and_a_change_bumps_it(
    target: NomadTarget, unique: str
) -> None:
    """Re-registering an unchanged job keeps Version 0; a changed Meta makes Version 1."""
    client = target.python_nomad()
    body = sleeper_job(f"ver-{unique}")
    first = await asyncio.to_thread(client.jobs.register_job, body)
    again = await asyncio.to_thread(client.jobs.register_job, body)
    stored = await asyncio.to_thread(client.job.get_job, f"ver-{unique}")
    assert (0, first["JobModifyIndex"]) == (stored["Version"], stored["JobModifyIndex"])
    assert again["EvalID"] != first["EvalID"]
    changed = copy.deepcopy(body)
    changed["Job"]["Meta"] = {"caravan_spec_hash": "b"}
    await asyncio.to_thread(client.jobs.register_job, changed)
    job = await asyncio.to_thread(client.job.get_job, f"ver-{unique}")
    assert (1, {"caravan_spec_hash": "b"}) == (job["Version"], job["Meta"])
    await asyncio.to_thread(client.job.deregister_job, f"ver-{unique}", purge=True)


async def test_enforce_index_conflict_is_a_500_with_nomads_text(
    target: NomadTarget, http: aiohttp.ClientSession, unique: str
) -> None:
    """A stale `JobModifyIndex` with `EnforceIndex` is refused; the right one passes."""
    body = sleeper_job(f"cas-{unique}")
    async with http.put(f"{target.address}/v1/jobs", json=body) as response:
        current = (await response.json())["JobModifyIndex"]
    stale = {**body, "EnforceIndex": True, "JobModifyIndex": current + 1000}
    stale["Job"] = {**body["Job"], "Meta": {"x": "1"}}
    async with http.put(f"{target.address}/v1/jobs", json=stale) as response:
        text = await response.text()
        assert 500 == response.status
        assert (
            f"Enforcing job modify index {current + 1000}: job exists with conflicting job "
            f"modify index: {current}"
        ) in text
    fresh = {**stale, "JobModifyIndex": current}
    async with http.put(f"{target.address}/v1/jobs", json=fresh) as response:
        assert 200 == response.status
    create_only = {**body, "EnforceIndex": True, "JobModifyIndex": 0}
    async with http.put(f"{target.address}/v1/jobs", json=create_only) as response:
        assert "Enforcing job modify index 0: job already exists" in await response.text()
    async with http.delete(f"{target.address}/v1/job/cas-{unique}?purge=true"):
        pass


async def test_list_jobs_by_prefix_with_meta(
    target: NomadTarget, http: aiohttp.ClientSession, unique: str
) -> None:
    """`GET /v1/jobs?prefix=&meta=true` lists stubs with their Meta and X-Nomad-Index."""
    for name in ("a", "b"):
        body = sleeper_job(f"list-{unique}-{name}")
        body["Job"]["Meta"] = {"caravan_model": name}
        async with http.put(f"{target.address}/v1/jobs", json=body) as response:
            assert 200 == response.status
    async with http.get(
        f"{target.address}/v1/jobs", params={"prefix": f"list-{unique}", "meta": "true"}
    ) as response:
        stubs = await response.json()
        assert int(response.headers["X-Nomad-Index"]) > 0
        assert "true" == response.headers["X-Nomad-KnownLeader"]
    assert [
        (f"list-{unique}-a", {"caravan_model": "a"}),
        (f"list-{unique}-b", {"caravan_model": "b"}),
    ] == sorted((stub["ID"], stub["Meta"]) for stub in stubs)
    for name in ("a", "b"):
        async with http.delete(f"{target.address}/v1/job/list-{unique}-{name}?purge=true"):
            pass


async def test_validation_failure_is_500_text_plain(
    target: NomadTarget, http: aiohttp.ClientSession, unique: str
) -> None:
    """A dotted service name and a 500 ms check interval: HTTP 500, Nomad's multierror text."""
    body = copy.deepcopy(example("llamacpp_cpu_job.json"))
    body["Job"]["ID"] = body["Job"]["Name"] = f"bad-{unique}"
    service = body["Job"]["TaskGroups"][0]["Services"][0]
    service["Name"] = "qwen2.5"
    service["Checks"][0]["Interval"] = NS // 2
    async with http.put(f"{target.address}/v1/jobs", json=body) as response:
        text = await response.text()
        assert (500, "text/plain") == (response.status, response.content_type)
    assert text.startswith("1 error occurred:\n\t* Task group server validation failed:")
    assert 'must be no longer than 63 characters: "qwen2.5"' in text
    assert "interval (500ms) cannot be lower than 1s" in text
    client = target.python_nomad()
    with pytest.raises(nomad.api.exceptions.BaseNomadException) as caught:
        await asyncio.to_thread(client.jobs.register_job, body)
    assert 500 == caught.value.nomad_resp.status_code


async def test_decode_errors_are_400(
    target: NomadTarget, http: aiohttp.ClientSession, unique: str
) -> None:
    """A string duration is a 400 with Go's unmarshal text; python-nomad raises BadRequest."""
    body = sleeper_job(f"dec-{unique}")
    body["Job"]["TaskGroups"][0]["Tasks"][0]["KillTimeout"] = "10s"
    async with http.put(f"{target.address}/v1/jobs", data=json.dumps(body)) as response:
        text = await response.text()
        assert 400 == response.status
    assert "json: cannot unmarshal string into Go struct field" in text
    assert "of type time.Duration" in text
    client = target.python_nomad()
    with pytest.raises(nomad.api.exceptions.BadRequestNomadException):
        await asyncio.to_thread(client.jobs.register_job, body)


async def test_missing_job_and_id_mismatch_are_400(
    target: NomadTarget, http: aiohttp.ClientSession, unique: str
) -> None:
    """No `Job`, and a path id that is not the body's, are request errors."""
    async with http.put(f"{target.address}/v1/jobs", json={"Foo": 1}) as response:
        assert (400, "Job must be specified") == (response.status, (await response.text()).strip())
    async with http.put(
        f"{target.address}/v1/job/other-{unique}", json=sleeper_job(unique)
    ) as response:
        assert (400, "Job ID does not match name") == (
            response.status,
            (await response.text()).strip(),
        )


async def test_validate_endpoint_answers_200_with_errors(target: NomadTarget) -> None:
    """`/v1/validate/job` reports errors in the body instead of a status."""
    body = copy.deepcopy(example("llamacpp_cpu_job.json"))
    body["Job"]["TaskGroups"][0]["Tasks"][0]["Driver"] = ""
    client = target.python_nomad()
    response = await asyncio.to_thread(client.validate.validate_job, body)
    result = response.json()
    assert 200 == response.status_code
    assert any("Missing task driver" in error for error in result["ValidationErrors"])
    assert "Missing task driver" in result["Error"]


async def test_plan_annotates_without_applying(target: NomadTarget, unique: str) -> None:
    """`plan_job` says it would place one allocation and registers nothing."""
    client = target.python_nomad()
    body = sleeper_job(f"plan-{unique}")
    result = await asyncio.to_thread(client.job.plan_job, f"plan-{unique}", body, diff=True)
    updates = result["Annotations"]["DesiredTGUpdates"]["g"]
    assert (1, 0) == (updates["Place"], updates["Stop"])
    assert "Added" == result["Diff"]["Type"]
    assert result["FailedTGAllocs"] is None
    with pytest.raises(nomad.api.exceptions.URLNotFoundNomadException):
        await asyncio.to_thread(client.job.get_job, f"plan-{unique}")


async def test_plan_of_unplaceable_gpu_job_says_why(target: NomadTarget, unique: str) -> None:
    """A GPU model no node has: FailedTGAllocs with `missing devices` and a blocked eval."""
    body = copy.deepcopy(example("vllm_gpu_job.json"))
    body["Job"]["ID"] = body["Job"]["Name"] = f"gpu-{unique}"
    body["Job"]["Constraints"] = []
    device = body["Job"]["TaskGroups"][0]["Tasks"][0]["Resources"]["Devices"][0]
    device["Name"] = "nvidia/gpu/NVIDIA B200"
    client = target.python_nomad()
    result = await asyncio.to_thread(client.job.plan_job, f"gpu-{unique}", body)
    failed = result["FailedTGAllocs"]["server"]
    assert failed["ConstraintFiltered"]["missing devices"] >= 1
    assert "blocked" == result["CreatedEvals"][0]["Status"]


async def test_deregister_unknown_job_is_200_with_zero_fields(
    target: NomadTarget, unique: str
) -> None:
    """Stopping a job that does not exist is not an error (facts N15)."""
    client = target.python_nomad()
    result = await asyncio.to_thread(client.job.deregister_job, f"ghost-{unique}", purge=True)
    assert ("", 0) == (result["EvalID"], result["JobModifyIndex"])


async def test_deregister_without_purge_keeps_a_stopped_job(
    target: NomadTarget, unique: str
) -> None:
    """Without purge the job stays readable with `Stop: true`; with purge it is gone."""
    client = target.python_nomad()
    await asyncio.to_thread(client.jobs.register_job, sleeper_job(f"stop-{unique}"))
    await asyncio.to_thread(client.job.deregister_job, f"stop-{unique}")
    job = await asyncio.to_thread(client.job.get_job, f"stop-{unique}")
    assert job["Stop"] is True
    await asyncio.to_thread(client.job.deregister_job, f"stop-{unique}", purge=True)
    with pytest.raises(nomad.api.exceptions.URLNotFoundNomadException):
        await asyncio.to_thread(client.job.get_job, f"stop-{unique}")


async def test_agent_and_status_probes(target: NomadTarget) -> None:
    """python-nomad's agent, status and regions calls answer."""
    client = target.python_nomad()
    agent = await asyncio.to_thread(client.agent.get_agent)
    leader = await asyncio.to_thread(client.status.leader.get_leader)
    regions = await asyncio.to_thread(client.regions.get_regions)
    assert "config" in agent
    assert ":" in leader
    assert "global" in regions
