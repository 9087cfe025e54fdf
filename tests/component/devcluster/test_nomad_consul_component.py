"""devcluster Nomad + Consul together: jobs run, register, pass checks and survive failures.

Each test starts the devcluster Consul and a Nomad with two CPU nodes and
one GPU node (1 s check intervals). These tests are about what happens after
a failure, not how long detection takes, so Nomad's heartbeat TTL and grace
are shortened (0.5 s + 1 s instead of 10 s + 10 s: a dead node is down within
2 s); Consul's serf keeps its real timing. tests/component/test_exit_criterion.py
and the heartbeat contract tests measure the real delays. The engines are
devcluster's simulated ones (0.2 s load).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import polling
import pytest

from caravan_llm.devcluster.consul.server import ConsulConfig, ConsulServer
from caravan_llm.devcluster.nomad.server import NomadServer
from caravan_llm.devcluster.nomad.settings import NodeSpec

T = TypeVar("T")
NS = 1_000_000_000
FIXTURES = Path(__file__).parents[2] / "contract" / "nomad" / "fixtures"
HEARTBEAT_GRACE_S = 1.0
MIN_HEARTBEAT_TTL_S = 0.5
# TTL (min + up to min of stagger) + grace.
DETECTION_MAX_S = 2 * MIN_HEARTBEAT_TTL_S + HEARTBEAT_GRACE_S

pytestmark = pytest.mark.slow


@dataclass(frozen=True)
class Cluster:
    consul: ConsulServer
    nomad: NomadServer
    http: aiohttp.ClientSession

    @property
    def consul_url(self) -> str:
        return f"http://{self.consul.http_addr}"

    async def get(self, url: str) -> Any:
        async with self.http.get(url) as response:
            assert 200 == response.status, await response.text()
            return await response.json()

    async def nomad_get(self, path: str) -> Any:
        return await self.get(f"{self.nomad.address}{path}")

    async def register(self, body: dict[str, Any]) -> dict[str, Any]:
        async with self.http.put(f"{self.nomad.address}/v1/jobs", json=body) as response:
            result: dict[str, Any] = await response.json()
            assert 200 == response.status, result
            return result

    async def health(self, service: str, *, passing: bool = False) -> list[dict[str, Any]]:
        query = "?passing=true" if passing else ""
        entries: list[dict[str, Any]] = await self.get(
            f"{self.consul_url}/v1/health/service/{service}{query}"
        )
        return entries


@pytest.fixture
async def cluster() -> AsyncIterator[Cluster]:
    nodes = [NodeSpec(), NodeSpec(), NodeSpec(gpus=2, node_class="gpu", memory_mb=262144)]
    async with ConsulServer(ConsulConfig()) as consul:
        async with NomadServer(
            consul_addr=consul.http_addr,
            nodes=nodes,
            heartbeat_grace_s=HEARTBEAT_GRACE_S,
            min_heartbeat_ttl_s=MIN_HEARTBEAT_TTL_S,
        ) as nomad:
            async with aiohttp.ClientSession() as http:
                yield Cluster(consul, nomad, http)


async def eventually(probe: Callable[[], Awaitable[T | None]], *, timeout_s: float = 20.0) -> T:
    found = await polling.eventually(probe, timeout_s, "the condition", interval_s=0.1)
    assert found is not None
    return found


def fast_checks(group: dict[str, Any]) -> None:
    for service in group.get("Services", []):
        for check in service.get("Checks", []):
            check["Interval"] = NS
            check["Timeout"] = NS


def vllm_job(job_id: str = "vllm-0") -> dict[str, Any]:
    """The vLLM example (docker, one H100) with quick checks and a quick simulated load."""
    body: dict[str, Any] = json.loads((FIXTURES / "vllm_gpu_job.json").read_text())
    job = body["Job"]
    job["ID"] = job["Name"] = job_id
    group = job["TaskGroups"][0]
    fast_checks(group)
    task = group["Tasks"][0]
    task["Env"]["CARAVAN_SIM_LOAD_SECONDS"] = "0.2"
    task["ShutdownDelay"] = 0
    task["KillTimeout"] = 2 * NS
    return body


def llama_job(job_id: str, *, constraints: list[dict[str, str]] | None = None) -> dict[str, Any]:
    """The llama.cpp example (raw_exec) running the simulated engine in place of llama-server."""
    body: dict[str, Any] = json.loads((FIXTURES / "llamacpp_cpu_job.json").read_text())
    job = body["Job"]
    job["ID"] = job["Name"] = job_id
    job["Constraints"] = constraints or []
    group = job["TaskGroups"][0]
    fast_checks(group)
    task = group["Tasks"][0]
    task["Config"] = {
        "command": sys.executable,
        "args": [
            "-m",
            "caravan_llm.devcluster.engine",
            "--flavor",
            "llamacpp",
            *task["Config"]["args"],
        ],
    }
    task["Env"] = {"CARAVAN_SIM_LOAD_SECONDS": "0.2"}
    task["Resources"] = {"Cores": 1, "MemoryMB": 1024}
    task["KillTimeout"] = 2 * NS
    return body


async def running(cluster: Cluster, job_id: str) -> dict[str, Any]:
    async def probe() -> dict[str, Any] | None:
        allocs = await cluster.nomad_get(f"/v1/job/{job_id}/allocations")
        return next(
            (a for a in allocs if a["ClientStatus"] == "running" and a["DesiredStatus"] == "run"),
            None,
        )

    return await eventually(probe)


async def passing(cluster: Cluster, service: str, count: int = 1) -> list[dict[str, Any]]:
    async def probe() -> list[dict[str, Any]] | None:
        entries = await cluster.health(service, passing=True)
        return entries if len(entries) >= count else None

    return await eventually(probe)


async def test_example_jobs_run_and_pass_their_consul_checks(cluster: Cluster) -> None:
    """Both worked examples place (GPU on the GPU node), run, and turn passing in Consul."""
    await cluster.register(vllm_job())
    await cluster.register(llama_job("llama-0"))
    vllm_alloc = await running(cluster, "vllm-0")
    llama_alloc = await running(cluster, "llama-0")
    gpu_node = await cluster.nomad_get(f"/v1/node/{vllm_alloc['NodeID']}")
    assert gpu_node["NodeResources"]["Devices"]
    (vllm_entry,) = await passing(cluster, "llm-qwen2-5-7b-instruct")
    (llama_entry,) = await passing(cluster, "llm-phi3-mini")
    service = vllm_entry["Service"]
    assert vllm_alloc["ID"] == service["Meta"]["alloc_id"]
    assert "nomad" == service["Meta"]["external-source"]
    assert service["ID"] == (
        f"_nomad-task-{vllm_alloc['ID']}-group-server-llm-qwen2-5-7b-instruct-http"
    )
    assert gpu_node["Name"] == vllm_entry["Node"]["Node"]
    full = await cluster.nomad_get(f"/v1/allocation/{vllm_alloc['ID']}")
    (port,) = full["AllocatedResources"]["Shared"]["Ports"]
    assert (port["HostIP"], port["Value"], 8000) == (
        service["Address"],
        service["Port"],
        port["To"],
    )
    assert llama_entry["Node"]["Node"] == llama_alloc["NodeName"]


async def test_cpu_replicas_with_node_constraints_land_on_distinct_nodes(cluster: Cluster) -> None:
    """Replica k excludes the nodes of replicas 0..k-1 (`${node.unique.id} !=`): all apart."""
    nodes: list[str] = []
    for replica in range(3):
        constraints = [
            {"LTarget": "${node.unique.id}", "Operand": "!=", "RTarget": node_id}
            for node_id in nodes
        ]
        await cluster.register(llama_job(f"llama-{replica}", constraints=constraints))
        nodes.append((await running(cluster, f"llama-{replica}"))["NodeID"])
    assert 3 == len(set(nodes))
    entries = await passing(cluster, "llm-phi3-mini", 3)
    assert 3 == len({entry["Node"]["Node"] for entry in entries})


async def test_cpu_replicas_with_negative_affinity_land_on_distinct_nodes(
    cluster: Cluster,
) -> None:
    """caravan's sibling anti-affinity (weight -100) spreads replicas across the nodes."""
    nodes: list[str] = []
    for replica in range(3):
        body = llama_job(f"llama-{replica}")
        if nodes:
            body["Job"]["Affinities"] = [
                {
                    "LTarget": "${node.unique.id}",
                    "RTarget": ",".join(nodes),
                    "Operand": "set_contains_any",
                    "Weight": -100,
                }
            ]
        await cluster.register(body)
        nodes.append((await running(cluster, f"llama-{replica}"))["NodeID"])
    assert 3 == len(set(nodes))


async def test_killed_node_is_replaced_and_nothing_of_it_stays_passing(cluster: Cluster) -> None:
    """Kill a node: its allocation is lost once it is down, the replacement passes elsewhere."""
    await cluster.register(llama_job("llama-0"))
    await cluster.register(
        llama_job("llama-1", constraints=[]),
    )
    first = await running(cluster, "llama-0")
    await passing(cluster, "llm-phi3-mini", 2)
    dead_node = first["NodeID"]
    dead_name = first["NodeName"]
    killed_at = time.monotonic()
    async with cluster.http.post(f"{cluster.nomad.address}/v1/devcluster/node/{dead_node}/kill"):
        pass

    async def lost() -> bool:
        allocs = await cluster.nomad_get("/v1/job/llama-0/allocations")
        return any(a["ID"] == first["ID"] and a["ClientStatus"] == "lost" for a in allocs)

    await eventually(lost, timeout_s=DETECTION_MAX_S + 3)
    assert time.monotonic() - killed_at < DETECTION_MAX_S + 3
    replacement = await running(cluster, "llama-0")
    assert replacement["NodeID"] != dead_node
    assert (
        first["ID"]
        == (await cluster.nomad_get(f"/v1/allocation/{replacement['ID']}"))["PreviousAllocation"]
    )

    async def settled() -> list[dict[str, Any]] | None:
        entries = await cluster.health("llm-phi3-mini", passing=True)
        nodes = {entry["Node"]["Node"] for entry in entries}
        return entries if len(entries) == 2 and dead_name not in nodes else None

    await eventually(settled)
    everything = await cluster.health("llm-phi3-mini")
    on_dead = [entry for entry in everything if entry["Node"]["Node"] == dead_name]
    for entry in on_dead:
        assert any(check["Status"] != "passing" for check in entry["Checks"])


async def test_restarted_node_comes_back_empty_and_clean(cluster: Cluster) -> None:
    """A restarted node is ready again and its old service registrations are gone."""
    await cluster.register(llama_job("llama-0"))
    first = await running(cluster, "llama-0")
    await passing(cluster, "llm-phi3-mini")
    node_id = first["NodeID"]
    async with cluster.http.post(f"{cluster.nomad.address}/v1/devcluster/node/{node_id}/kill"):
        pass
    async with cluster.http.post(f"{cluster.nomad.address}/v1/devcluster/node/{node_id}/restart"):
        pass

    async def clean() -> bool:
        node = await cluster.nomad_get(f"/v1/node/{node_id}")
        entries = await cluster.health("llm-phi3-mini")
        stale = [e for e in entries if first["ID"] in e["Service"]["ID"]]
        return node["Status"] == "ready" and not stale

    assert await eventually(clean)


async def test_stop_deregisters_before_the_shutdown_delay(cluster: Cluster) -> None:
    """On stop the service leaves Consul first; the task is signalled after ShutdownDelay."""
    body = llama_job("llama-0")
    body["Job"]["TaskGroups"][0]["ShutdownDelay"] = NS
    await cluster.register(body)
    alloc = await running(cluster, "llama-0")
    await passing(cluster, "llm-phi3-mini")
    pids = cluster.nomad.processes()
    async with cluster.http.delete(f"{cluster.nomad.address}/v1/job/llama-0"):
        pass

    async def deregistered() -> bool:
        return not await cluster.health("llm-phi3-mini")

    await eventually(deregistered, timeout_s=5)
    for pid in pids:
        os.kill(pid, 0)  # still alive: the shutdown delay has not passed

    async def killed() -> dict[str, Any] | None:
        current = await cluster.nomad_get(f"/v1/allocation/{alloc['ID']}")
        return current if current["ClientStatus"] == "complete" else None

    done = await eventually(killed, timeout_s=10)
    types = [event["Type"] for event in done["TaskStates"]["llama-server"]["Events"]]
    assert types[-3:] == ["Killing", "Terminated", "Killed"]


async def test_failing_check_restarts_the_task(cluster: Cluster) -> None:
    """A check critical past `check_restart` limits sends a `Restart Signal`."""
    body = llama_job("llama-0")
    service = body["Job"]["TaskGroups"][0]["Services"][0]
    service["Checks"][0]["Path"] = "/no-such-path"
    service["Checks"][0]["CheckRestart"] = {"Limit": 2, "Grace": 0}
    await cluster.register(body)
    alloc = await running(cluster, "llama-0")

    async def restarted() -> dict[str, Any] | None:
        current = await cluster.nomad_get(f"/v1/allocation/{alloc['ID']}")
        events = current["TaskStates"]["llama-server"]["Events"]
        return next((e for e in events if e["Type"] == "Restart Signal"), None)

    event = await eventually(restarted, timeout_s=15)
    expected = 'healthcheck: check "service: "llm-phi3-mini" check" unhealthy'
    assert expected == event["DisplayMessage"]


async def test_deployment_turns_healthy_after_min_healthy_time(cluster: Cluster) -> None:
    """With passing checks for MinHealthyTime the allocation and deployment are healthy."""
    body = llama_job("llama-0")
    body["Job"]["Update"] = {
        "MinHealthyTime": NS,
        "HealthyDeadline": 20 * NS,
        "ProgressDeadline": 30 * NS,
        "HealthCheck": "checks",
    }
    await cluster.register(body)

    async def successful() -> dict[str, Any] | None:
        deployment = await cluster.nomad_get("/v1/job/llama-0/deployment")
        return deployment if deployment and deployment["Status"] == "successful" else None

    deployment = await eventually(successful)
    assert 1 == deployment["TaskGroups"]["server"]["HealthyAllocs"]
    allocs = await cluster.nomad_get("/v1/job/llama-0/allocations")
    assert allocs[0]["DeploymentStatus"]["Healthy"] is True
    assert (await cluster.nomad_get("/v1/job/llama-0"))["Stable"] is True


def two_task_job(job_id: str, leader_command: str) -> dict[str, Any]:
    """A batch group of a leader running `leader_command` and a sibling that would run a minute."""

    def task(name: str, script: str, *, leader: bool) -> dict[str, Any]:
        return {
            "Name": name,
            "Driver": "raw_exec",
            "Config": {"command": "/bin/sh", "args": ["-c", script]},
            "Leader": leader,
            "KillTimeout": 2 * NS,
            "Resources": {"CPU": 100, "MemoryMB": 64},
        }

    return {
        "Job": {
            "ID": job_id,
            "Name": job_id,
            "Type": "batch",
            "Datacenters": ["*"],
            "TaskGroups": [
                {
                    "Name": "g",
                    "Count": 1,
                    "RestartPolicy": {"Attempts": 0, "Mode": "fail"},
                    "ReschedulePolicy": {"Attempts": 0, "Unlimited": False},
                    "Tasks": [
                        task("leader", leader_command, leader=True),
                        task("sibling", "sleep 60", leader=False),
                    ],
                }
            ],
        }
    }


@pytest.mark.parametrize(
    ("leader_command", "event", "status"),
    [
        ("sleep 0.5", "Leader Task Dead", "complete"),
        ("sleep 0.5; exit 3", "Sibling Task Failed", "failed"),
    ],
)
async def test_a_dead_leader_or_a_failed_task_takes_its_siblings_with_it(
    cluster: Cluster, leader_command: str, event: str, status: str
) -> None:
    """The sibling is killed when the leader completes or fails, as Nomad's alloc runner does."""
    await cluster.register(two_task_job("two-tasks", leader_command))

    async def finished() -> dict[str, Any] | None:
        allocs = await cluster.nomad_get("/v1/job/two-tasks/allocations")
        done = [a for a in allocs if a["ClientStatus"] in {"complete", "failed"}]
        return done[0] if done else None

    alloc = await eventually(finished, timeout_s=20.0)
    sibling = alloc["TaskStates"]["sibling"]
    assert status == alloc["ClientStatus"]
    assert event in [e["Type"] for e in sibling["Events"]]
    assert ("dead", "Killed") == (sibling["State"], sibling["Events"][-1]["Type"])


async def test_a_replica_placed_while_consul_is_down_registers_once_consul_is_back(
    cluster: Cluster,
) -> None:
    """The client retries a service registration its Consul agent refused, as Nomad does."""
    await cluster.consul.stop_http()
    try:
        await cluster.register(llama_job("llama-0"))
        alloc = await running(cluster, "llama-0")
    finally:
        await cluster.consul.start_http()
    (entry,) = await passing(cluster, "llm-phi3-mini")
    assert entry["Service"]["ID"].startswith(f"_nomad-task-{alloc['ID']}-")
