"""Static host volumes as Nomad has them (issue 14 item 1).

A client's `host_volume` blocks appear as `HostVolumes` in `/v1/node/:id`
(`ClientHostVolumeConfig`: Name, Path, ReadOnly, ID); a group `volume` of type
`host` is placed only on nodes that declare its source, others are filtered as
`missing compatible host volumes`; a read-write request skips a volume the
client declares read-only; the task sees the folder at its `volume_mount`
destination; raw_exec refuses mounts.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import aiohttp
from nomad_contract_support import NS, NomadTarget, eventually, get_json, sleeper_job

FILTER = "missing compatible host volumes"


def _with_volume(
    body: dict[str, Any], source: str, *, read_only: bool = True, destination: str = "/models"
) -> dict[str, Any]:
    group = body["Job"]["TaskGroups"][0]
    group["Volumes"] = {
        "weights": {"Name": "weights", "Type": "host", "Source": source, "ReadOnly": read_only}
    }
    group["Tasks"][0]["VolumeMounts"] = [
        {"Volume": "weights", "Destination": destination, "ReadOnly": read_only}
    ]
    return body


def _reader_job(job_id: str, source: str, *, driver: str = "exec") -> dict[str, Any]:
    """A batch job that exits 0 only if it reads `weights` from /models/hello.txt."""
    body = sleeper_job(job_id)
    body["Job"]["Type"] = "batch"
    group = body["Job"]["TaskGroups"][0]
    group["RestartPolicy"] = {"Attempts": 0, "Interval": 30 * NS, "Delay": NS, "Mode": "fail"}
    group["ReschedulePolicy"] = {"Attempts": 0, "Unlimited": False}
    task = group["Tasks"][0]
    task["Driver"] = driver
    task["Config"] = {
        "command": sys.executable,
        "args": [
            "-c",
            "import sys; sys.exit(0 if open(sys.argv[1]).read() == 'weights' else 3)",
            "/models/hello.txt",
        ],
    }
    return _with_volume(body, source)


async def _add_node(http: aiohttp.ClientSession, target: NomadTarget, spec: Any) -> dict[str, Any]:
    async with http.post(f"{target.address}/v1/devcluster/node", json=spec) as response:
        added: dict[str, Any] = await response.json()
        assert 200 == response.status, added
    return added


async def _final_alloc(
    http: aiohttp.ClientSession, target: NomadTarget, job_id: str
) -> dict[str, Any]:
    async def done() -> dict[str, Any] | None:
        allocs = await get_json(http, f"{target.address}/v1/job/{job_id}/allocations")
        finished = [a for a in allocs if a["ClientStatus"] in {"complete", "failed"}]
        return finished[0] if finished else None

    return await eventually(done, timeout_s=30)


async def test_node_reports_its_host_volumes(
    target: NomadTarget, http: aiohttp.ClientSession, tmp_path: Path, unique: str
) -> None:
    """`HostVolumes` is `ClientHostVolumeConfig` by name; null for a node with none."""
    target.devcluster()
    spec = {
        "HostVolumes": {
            f"models-{unique}": {"Path": str(tmp_path)},
            f"ro-{unique}": {"Path": str(tmp_path), "ReadOnly": True},
        }
    }
    added = await _add_node(http, target, spec)
    node = await get_json(http, f"{target.address}/v1/node/{added['ID']}")
    assert {
        f"models-{unique}": {
            "Name": f"models-{unique}",
            "Path": str(tmp_path),
            "ReadOnly": False,
            "ID": "",
        },
        f"ro-{unique}": {"Name": f"ro-{unique}", "Path": str(tmp_path), "ReadOnly": True, "ID": ""},
    } == node["HostVolumes"]
    stubs = await get_json(http, f"{target.address}/v1/nodes")
    by_id = {stub["ID"]: stub for stub in stubs}
    assert node["HostVolumes"] == by_id[added["ID"]]["HostVolumes"]
    assert all(stub["HostVolumes"] is None for id_, stub in by_id.items() if id_ != added["ID"])


async def test_host_volume_path_must_be_absolute(
    target: NomadTarget, http: aiohttp.ClientSession
) -> None:
    target.devcluster()
    spec = {"HostVolumes": {"models": {"Path": "relative/dir"}}}
    async with http.post(f"{target.address}/v1/devcluster/node", json=spec) as response:
        text = await response.text()
        assert 400 == response.status
    assert "relative/dir" in text


async def test_plan_without_the_volume_anywhere_names_the_filter(
    target: NomadTarget, unique: str
) -> None:
    """No node has the source: every node is filtered as `missing compatible host volumes`."""
    job_id = f"novol-{unique}"
    body = _with_volume(sleeper_job(job_id), f"caravan-absent-{unique}")
    client = target.python_nomad()
    result = await asyncio.to_thread(client.job.plan_job, job_id, body)
    failed = result["FailedTGAllocs"]["g"]
    assert failed["ConstraintFiltered"][FILTER] >= 1
    assert set(failed["ConstraintFiltered"]) == {FILTER}


async def test_placed_only_where_the_volume_is_and_the_task_reads_it(
    target: NomadTarget, http: aiohttp.ClientSession, tmp_path: Path, unique: str
) -> None:
    """The one node with the volume gets the alloc; the exec task reads the file at /models."""
    target.devcluster()
    (tmp_path / "hello.txt").write_text("weights")
    source = f"models-{unique}"
    added = await _add_node(http, target, {"HostVolumes": {source: {"Path": str(tmp_path)}}})
    job_id = f"reader-{unique}"
    async with http.put(f"{target.address}/v1/jobs", json=_reader_job(job_id, source)) as resp:
        assert 200 == resp.status, await resp.text()
    alloc = await _final_alloc(http, target, job_id)
    assert (added["ID"], "complete") == (alloc["NodeID"], alloc["ClientStatus"])
    evaluation = await get_json(http, f"{target.address}/v1/evaluation/{alloc['EvalID']}")
    assert evaluation["FailedTGAllocs"] is None


async def test_read_write_request_skips_a_read_only_volume(
    target: NomadTarget, http: aiohttp.ClientSession, tmp_path: Path, unique: str
) -> None:
    """A client `read_only` volume cannot serve a read-write request: it is filtered."""
    target.devcluster()
    source = f"ro-{unique}"
    await _add_node(
        http, target, {"HostVolumes": {source: {"Path": str(tmp_path), "ReadOnly": True}}}
    )
    job_id = f"rw-{unique}"
    body = _with_volume(sleeper_job(job_id), source, read_only=False)
    async with http.put(f"{target.address}/v1/jobs", json=body) as response:
        eval_id = (await response.json())["EvalID"]

    async def blocked() -> dict[str, Any] | None:
        evaluation = await get_json(http, f"{target.address}/v1/evaluation/{eval_id}")
        return evaluation if evaluation["BlockedEval"] else None

    evaluation = await eventually(blocked)
    assert {FILTER: 4} == evaluation["FailedTGAllocs"]["g"]["ConstraintFiltered"]


async def test_raw_exec_cannot_mount_a_host_volume(
    target: NomadTarget, http: aiohttp.ClientSession, tmp_path: Path, unique: str
) -> None:
    """raw_exec has no mount support: the volumes hook fails the task, as in Nomad."""
    target.devcluster()
    source = f"models-{unique}"
    await _add_node(http, target, {"HostVolumes": {source: {"Path": str(tmp_path)}}})
    job_id = f"rawvol-{unique}"
    body = _reader_job(job_id, source, driver="raw_exec")
    async with http.put(f"{target.address}/v1/jobs", json=body) as response:
        assert 200 == response.status
    alloc = await _final_alloc(http, target, job_id)
    assert "failed" == alloc["ClientStatus"]
    alloc = await get_json(http, f"{target.address}/v1/allocation/{alloc['ID']}")
    events = alloc["TaskStates"]["sleep"]["Events"]
    hook = next(event for event in events if event["Type"] == "Task hook failed")
    assert hook["DisplayMessage"] == (
        'prestart hook "volumes" failed: task driver "raw_exec" for "sleep" '
        "does not support host volumes"
    )


async def test_volume_and_mount_validation_use_nomads_words(
    target: NomadTarget, http: aiohttp.ClientSession, unique: str
) -> None:
    """A mount of an undeclared volume, a read-write multi-node-reader-only CSI request and a
    host request with an empty source: HTTP 500 with Nomad's messages."""
    job_id = f"badvol-{unique}"
    body = sleeper_job(job_id)
    group = body["Job"]["TaskGroups"][0]
    group["Volumes"] = {
        "a": {"Name": "a", "Type": "host", "Source": ""},
        "b": {
            "Name": "b",
            "Type": "csi",
            "Source": "vol",
            "AccessMode": "multi-node-reader-only",
            "AttachmentMode": "file-system",
        },
    }
    group["Tasks"][0]["VolumeMounts"] = [{"Volume": "nope", "Destination": "/x"}]
    async with http.put(f"{target.address}/v1/jobs", json=body) as response:
        text = await response.text()
        assert 500 == response.status, text
    assert (
        "Task group volume validation for a failed: 1 error occurred:\n"
        "\t* volume has an empty source" in text
    )
    assert (
        "Task group volume validation for b failed: 1 error occurred:\n"
        "\t* multi-node-reader-only volumes must be read-only" in text
    )
    assert "Volume Mount (0) references undefined volume nope" in text
