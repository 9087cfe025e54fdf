"""Batch jobs as Nomad reconciles them: a successful allocation is done, not replaced
(`shouldFilter` in scheduler/reconciler/filters.go), which is what lets caravan's weights
prefetch run once."""

from __future__ import annotations

import sys
from typing import Any

import aiohttp
from nomad_contract_support import NS, NomadTarget, eventually, get_json, sleeper_job


def _quick_batch(job_id: str) -> dict[str, Any]:
    body = sleeper_job(job_id)
    body["Job"]["Type"] = "batch"
    group = body["Job"]["TaskGroups"][0]
    group["RestartPolicy"] = {"Attempts": 0, "Interval": 30 * NS, "Delay": NS, "Mode": "fail"}
    group["Tasks"][0]["Config"] = {"command": sys.executable, "args": ["-c", "pass"]}
    return body


async def _complete(http: aiohttp.ClientSession, address: str, job_id: str) -> list[Any]:
    async def done() -> list[Any] | None:
        allocs = await get_json(http, f"{address}/v1/job/{job_id}/allocations")
        return allocs if [a["ClientStatus"] for a in allocs] == ["complete"] else None

    result: list[Any] = await eventually(done, timeout_s=30)
    return result


async def _evaluated(http: aiohttp.ClientSession, address: str, job_id: str) -> None:
    async with http.put(f"{address}/v1/job/{job_id}/evaluate", json={}) as response:
        assert 200 == response.status, await response.text()
        eval_id = (await response.json())["EvalID"]

    async def finished() -> bool:
        evaluation = await get_json(http, f"{address}/v1/evaluation/{eval_id}")
        return evaluation["Status"] == "complete"

    await eventually(finished)


async def test_a_completed_batch_job_is_not_run_again_by_an_evaluation(
    target: NomadTarget, http: aiohttp.ClientSession, unique: str
) -> None:
    job_id = f"once-{unique}"
    async with http.put(f"{target.address}/v1/jobs", json=_quick_batch(job_id)) as response:
        assert 200 == response.status, await response.text()
    (alloc,) = await _complete(http, target.address, job_id)
    await _evaluated(http, target.address, job_id)
    assert [alloc["ID"]] == [a["ID"] for a in await _complete(http, target.address, job_id)]


async def test_a_completed_batch_alloc_on_a_dead_node_is_not_replaced(
    target: NomadTarget, http: aiohttp.ClientSession, unique: str
) -> None:
    server = target.devcluster()
    job_id = f"once-dead-{unique}"
    async with http.put(f"{target.address}/v1/jobs", json=_quick_batch(job_id)) as response:
        assert 200 == response.status, await response.text()
    (alloc,) = await _complete(http, target.address, job_id)
    await server.kill_node(alloc["NodeID"])

    async def down() -> bool:
        node = await get_json(http, f"{target.address}/v1/node/{alloc['NodeID']}")
        return node["Status"] == "down"

    await eventually(down)
    await _evaluated(http, target.address, job_id)
    assert [alloc["ID"]] == [a["ID"] for a in await _complete(http, target.address, job_id)]


async def test_a_new_version_of_a_completed_batch_job_runs_again(
    target: NomadTarget, http: aiohttp.ClientSession, unique: str
) -> None:
    """Terminal allocations of an older version are ignored (`filterOldTerminalAllocs`)."""
    job_id = f"again-{unique}"
    body = _quick_batch(job_id)
    async with http.put(f"{target.address}/v1/jobs", json=body) as response:
        assert 200 == response.status, await response.text()
    (first,) = await _complete(http, target.address, job_id)
    body["Job"]["TaskGroups"][0]["Tasks"][0]["Config"]["args"] = ["-c", "pass  # v2"]
    async with http.put(f"{target.address}/v1/jobs", json=body) as response:
        assert 200 == response.status, await response.text()

    async def rerun() -> list[Any] | None:
        allocs = await get_json(http, f"{target.address}/v1/job/{job_id}/allocations")
        done = [a for a in allocs if a["ClientStatus"] == "complete"]
        return done if len(done) == 2 else None

    allocs = await eventually(rerun, timeout_s=30)
    assert first["ID"] in {a["ID"] for a in allocs}
    assert {0, 1} == {a["JobVersion"] for a in allocs}
