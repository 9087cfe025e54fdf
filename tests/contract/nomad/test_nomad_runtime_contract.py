"""Allocations, nodes, drains, blocking queries and the event stream (facts N11-N17)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp
import nomad.api.exceptions
import pytest
from nomad_contract_support import (
    NS,
    NomadTarget,
    eventually,
    get_json,
    http_job,
    running_allocs,
    sleeper_job,
)


async def test_allocations_run_and_show_their_ports(
    target: NomadTarget, http: aiohttp.ClientSession, unique: str
) -> None:
    """A job's allocations reach `running`; the full allocation carries the host port."""
    job_id = f"alloc-{unique}"
    await http.put(f"{target.address}/v1/jobs", json=http_job(job_id))
    (stub,) = await running_allocs(http, target.address, job_id)
    assert stub.get("AllocatedResources") is None
    assert (f"{job_id}.g[0]", "run", "running") == (
        stub["Name"],
        stub["DesiredStatus"],
        stub["ClientStatus"],
    )
    client = target.python_nomad()
    full = await asyncio.to_thread(client.allocation.get_allocation, stub["ID"])
    (port,) = full["AllocatedResources"]["Shared"]["Ports"]
    assert ("http", 0) == (port["Label"], port["To"])
    assert port["Value"] > 0
    assert port["HostIP"]
    assert "Task started by client" in [
        event["DisplayMessage"] for event in full["TaskStates"]["sleep"]["Events"]
    ]

    async def serving() -> bool:
        try:
            async with http.get(f"http://{port['HostIP']}:{port['Value']}/") as response:
                return response.status == 200
        except aiohttp.ClientError:
            return False

    assert await eventually(serving)
    listed = await asyncio.to_thread(client.allocations.get_allocations)
    assert stub["ID"] in {alloc["ID"] for alloc in listed}
    await http.delete(f"{target.address}/v1/job/{job_id}?purge=true")


async def test_unknown_allocation_is_404(target: NomadTarget) -> None:
    """python-nomad raises URLNotFound for an allocation that does not exist."""
    client = target.python_nomad()
    with pytest.raises(nomad.api.exceptions.URLNotFoundNomadException):
        await asyncio.to_thread(
            client.allocation.get_allocation, "00000000-0000-0000-0000-000000000000"
        )


async def test_nodes_list_with_resources_and_node_detail(target: NomadTarget) -> None:
    """`get_nodes(resources=True)` carries NodeResources; a node has its fingerprint."""
    client = target.python_nomad()
    nodes = await asyncio.to_thread(client.nodes.get_nodes, resources=True)
    assert nodes
    assert all(stub["NodeResources"]["Cpu"]["CpuShares"] > 0 for stub in nodes)
    ready = [stub for stub in nodes if stub["Status"] == "ready"]
    node = await asyncio.to_thread(client.node.get_node, ready[0]["ID"])
    attributes = node["Attributes"]
    assert "linux" == attributes["kernel.name"]
    assert {"cpu.numcores", "memory.totalbytes", "unique.hostname"} <= set(attributes)
    assert node["Drivers"]["raw_exec"]["Healthy"] is True


async def test_gpu_node_fingerprint_is_the_nvidia_plugins(target: NomadTarget) -> None:
    """The GPU node reports NVML names, GPU-<uuid> instances and MiB memory."""
    server = target.devcluster()
    gpu_node = next(node for node in server.state.nodes.values() if node.devices)
    client = target.python_nomad()
    node = await asyncio.to_thread(client.node.get_node, gpu_node.id)
    (device,) = node["NodeResources"]["Devices"]
    assert ("nvidia", "gpu", "NVIDIA H100 80GB HBM3") == (
        device["Vendor"],
        device["Type"],
        device["Name"],
    )
    assert {"Int": 81559, "Unit": "MiB"} == device["Attributes"]["memory"]
    assert all(instance["ID"].startswith("GPU-") for instance in device["Instances"])


async def test_drain_moves_allocations_off_the_node(
    target: NomadTarget, http: aiohttp.ClientSession, unique: str
) -> None:
    """Draining a node marks it ineligible, migrates its allocations, then completes."""
    job_id = f"drain-{unique}"
    await http.put(f"{target.address}/v1/jobs", json=sleeper_job(job_id, count=2))
    allocs = await running_allocs(http, target.address, job_id, 2)
    node_id = allocs[0]["NodeID"]
    client = target.python_nomad()
    result = await asyncio.to_thread(
        client.node.drain_node_with_spec, node_id, {"Deadline": 60 * NS}
    )
    assert {"EvalCreateIndex", "Index", "NodeModifyIndex"} <= set(result)

    async def drained() -> bool:
        node = await get_json(http, f"{target.address}/v1/node/{node_id}")
        current = await get_json(http, f"{target.address}/v1/job/{job_id}/allocations")
        live = [
            a for a in current if a["DesiredStatus"] == "run" and a["ClientStatus"] == "running"
        ]
        on_node = [a for a in live if a["NodeID"] == node_id]
        return (
            node["SchedulingEligibility"] == "ineligible"
            and node["DrainStrategy"] is None
            and not on_node
            and len(live) == 2
        )

    assert await eventually(drained, timeout_s=30)
    await asyncio.to_thread(client.node.eligible_node, node_id, eligible=True)
    node = await asyncio.to_thread(client.node.get_node, node_id)
    assert "eligible" == node["SchedulingEligibility"]
    await http.delete(f"{target.address}/v1/job/{job_id}?purge=true")


async def test_blocking_query_wakes_promptly_on_a_change(
    target: NomadTarget, http: aiohttp.ClientSession, unique: str
) -> None:
    """A blocked `allocations?index=` returns within 100 ms of the allocation changing."""
    job_id = f"block-{unique}"
    await http.put(f"{target.address}/v1/jobs", json=sleeper_job(job_id))
    (alloc,) = await running_allocs(http, target.address, job_id)
    async with http.get(f"{target.address}/v1/job/{job_id}/allocations") as response:
        index = int(response.headers["X-Nomad-Index"])
    url = f"{target.address}/v1/job/{job_id}/allocations?index={index}&wait=20s"
    blocked = asyncio.ensure_future(http.get(url))
    await asyncio.sleep(0.3)
    assert not blocked.done()
    started = time.monotonic()
    async with http.post(f"{target.address}/v1/allocation/{alloc['ID']}/stop") as response:
        assert 200 == response.status
    async with await blocked as response:
        woke = time.monotonic() - started
        assert int(response.headers["X-Nomad-Index"]) > index
    assert woke < 0.1, f"woke after {woke:.3f} s"
    await http.delete(f"{target.address}/v1/job/{job_id}?purge=true")


async def test_blocking_query_times_out_with_the_same_index(
    target: NomadTarget, http: aiohttp.ClientSession, unique: str
) -> None:
    """Without a change the query waits about `wait` (plus jitter up to wait/16)."""
    async with http.get(f"{target.address}/v1/nodes") as response:
        index = int(response.headers["X-Nomad-Index"])
    started = time.monotonic()
    async with http.get(f"{target.address}/v1/nodes?index={index}&wait=1s") as response:
        elapsed = time.monotonic() - started
        assert index == int(response.headers["X-Nomad-Index"])
    assert 0.9 <= elapsed <= 1.0 + 1 / 16 + 0.5


@pytest.mark.parametrize(
    ("query", "message"),
    [("index=x", "Invalid index"), ("index=1&wait=forever", "Invalid wait time")],
)
async def test_bad_blocking_parameters_are_400(
    target: NomadTarget, http: aiohttp.ClientSession, query: str, message: str
) -> None:
    """`index` and `wait` must parse."""
    async with http.get(f"{target.address}/v1/jobs?{query}") as response:
        assert (400, message) == (response.status, (await response.text()).strip())


async def read_frames(
    http: aiohttp.ClientSession, url: str, wanted: int, timeout_s: float = 15.0
) -> list[dict[str, Any]]:
    """The first `wanted` lines of an event stream (heartbeats included)."""
    frames: list[dict[str, Any]] = []
    async with asyncio.timeout(timeout_s), http.get(url) as response:
        assert 200 == response.status
        async for line in response.content:
            frames.append(json.loads(line))
            if len(frames) >= wanted:
                break
    return frames


async def test_event_stream_starts_with_a_heartbeat(
    target: NomadTarget, http: aiohttp.ClientSession
) -> None:
    """The first line of a stream is `{}`."""
    frames = await read_frames(http, f"{target.address}/v1/event/stream?topic=Node", 1)
    assert [{}] == frames


async def test_event_stream_delivers_allocation_updates_in_order(
    target: NomadTarget, http: aiohttp.ClientSession, unique: str
) -> None:
    """Allocation events of a job arrive in index order, pending to running, without the Job."""
    job_id = f"events-{unique}"
    events: list[dict[str, Any]] = []

    async def consume() -> None:
        url = f"{target.address}/v1/event/stream?topic=Allocation:{job_id}"
        async with http.get(url) as response:
            async for line in response.content:
                frame = json.loads(line)
                for event in frame.get("Events", []):
                    events.append(event)
                    if event["Payload"]["Allocation"]["ClientStatus"] == "running":
                        return

    consumer = asyncio.ensure_future(consume())
    await asyncio.sleep(0.2)
    await http.put(f"{target.address}/v1/jobs", json=sleeper_job(job_id))
    await asyncio.wait_for(consumer, 15)
    indexes = [event["Index"] for event in events]
    assert indexes == sorted(indexes)
    assert "PlanResult" == events[0]["Type"]
    assert "AllocationUpdated" == events[-1]["Type"]
    assert all(event["Topic"] == "Allocation" for event in events)
    assert all(job_id in event["FilterKeys"] for event in events)
    assert all(event["Payload"]["Allocation"].get("Job") is None for event in events)
    await http.delete(f"{target.address}/v1/job/{job_id}?purge=true")


async def test_event_stream_replays_from_an_index(
    target: NomadTarget, http: aiohttp.ClientSession, unique: str
) -> None:
    """Asking from an index replays the buffered JobRegistered event."""
    job_id = f"replay-{unique}"
    async with http.put(f"{target.address}/v1/jobs", json=sleeper_job(job_id)) as response:
        index = (await response.json())["JobModifyIndex"]
    url = f"{target.address}/v1/event/stream?topic=Job:{job_id}&index={index}"
    frames = await read_frames(http, url, 2)
    event = frames[1]["Events"][0]
    assert ("Job", "JobRegistered", job_id, index) == (
        event["Topic"],
        event["Type"],
        event["Key"],
        frames[1]["Index"],
    )
    await http.delete(f"{target.address}/v1/job/{job_id}?purge=true")


async def test_malformed_topic_is_400(target: NomadTarget, http: aiohttp.ClientSession) -> None:
    """A topic with two colons is refused."""
    async with http.get(f"{target.address}/v1/event/stream?topic=Job:a:b") as response:
        text = await response.text()
        assert 400 == response.status
    assert text.startswith("Invalid topic query:")


async def test_evaluations_of_a_job(
    target: NomadTarget, http: aiohttp.ClientSession, unique: str
) -> None:
    """The register's evaluation completes and can be read by id."""
    job_id = f"eval-{unique}"
    async with http.put(f"{target.address}/v1/jobs", json=sleeper_job(job_id)) as response:
        eval_id = (await response.json())["EvalID"]
    client = target.python_nomad()

    async def complete() -> dict[str, Any] | None:
        evaluation = await asyncio.to_thread(client.evaluation.get_evaluation, eval_id)
        return evaluation if evaluation["Status"] == "complete" else None

    evaluation = await eventually(complete)
    assert ("job-register", job_id) == (evaluation["TriggeredBy"], evaluation["JobID"])
    listed = await asyncio.to_thread(client.job.get_evaluations, job_id)
    assert eval_id in {item["ID"] for item in listed}
    await http.delete(f"{target.address}/v1/job/{job_id}?purge=true")


async def test_python_nomad_event_stream_reads_frames(
    target: NomadTarget, http: aiohttp.ClientSession, unique: str
) -> None:
    """python-nomad's threaded `get_stream` receives the JobRegistered frame of a new job."""
    client = target.python_nomad()
    stream, stop, frames = client.event.stream.get_stream(topic=["Job"], timeout=30)
    stream.start()
    job_id = f"pystream-{unique}"
    await http.put(f"{target.address}/v1/jobs", json=sleeper_job(job_id))

    def wait_for_job() -> dict[str, Any]:
        while True:
            frame = frames.get(timeout=10)
            for event in frame["Events"]:
                if event["Key"] == job_id:
                    return dict(event)

    event = await asyncio.to_thread(wait_for_job)
    stop.set()
    # The reader thread looks at `stop` after its next line: give it one.
    await http.delete(f"{target.address}/v1/job/{job_id}?purge=true")
    await asyncio.to_thread(stream.join, 10)
    assert ("Job", "JobRegistered") == (event["Topic"], event["Type"])
    assert not stream.is_alive()
