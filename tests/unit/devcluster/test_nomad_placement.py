"""Nomad's feasibility and ranking rules in the stand-in's pure placement function."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from typing import Any

import pytest
from nomad_builders import admitted, cpu_job, example_job, make_alloc, make_node

from caravan_llm.devcluster.nomad.model import AllocatedDevice, Allocation, Node
from caravan_llm.devcluster.nomad.placement import (
    Placement,
    PlacementContext,
    PlacementFailure,
    select_node,
)

SEEDS = range(12)
GPU_RAM = 262144


def place(
    job: dict[str, Any],
    nodes: Sequence[Node],
    allocs: Sequence[Allocation] = (),
    *,
    seed: int = 0,
    penalty: frozenset[str] = frozenset(),
) -> Placement | PlacementFailure:
    proposed: dict[str, list[Allocation]] = {}
    for alloc in allocs:
        proposed.setdefault(alloc.node_id, []).append(alloc)
    context = PlacementContext(
        job=job,
        group=job["TaskGroups"][0],
        nodes=nodes,
        proposed=proposed,
        penalty_node_ids=penalty,
    )
    return select_node(context, random.Random(seed))


def placed(result: Placement | PlacementFailure) -> Placement:
    assert isinstance(result, Placement), getattr(result, "metric", None)
    return result


def failed(result: Placement | PlacementFailure) -> dict[str, Any]:
    assert isinstance(result, PlacementFailure)
    return result.metric.to_api()


def cluster() -> list[Node]:
    return [make_node(1), make_node(2), make_node(3, gpus=2, node_class="gpu", memory_mb=GPU_RAM)]


def vllm_job(**changes: Any) -> dict[str, Any]:
    job = example_job("vllm_gpu_job.json")
    job.update(changes)
    return admitted(job)


@pytest.mark.parametrize("seed", SEEDS)
def test_gpu_job_lands_only_on_the_gpu_node(seed: int) -> None:
    """The vLLM example needs one H100: only node-3 has one."""
    result = placed(place(vllm_job(), cluster(), seed=seed))
    devices = result.resources.tasks["vllm"].devices
    assert "node-3" == result.node.name
    assert 1 == len(devices)
    assert ("nvidia", "gpu", "NVIDIA H100 80GB HBM3") == (
        devices[0].vendor,
        devices[0].type,
        devices[0].name,
    )
    assert devices[0].device_ids[0].startswith("GPU-")


def test_unknown_gpu_model_is_filtered_as_missing_devices() -> None:
    """A model no node has: every node is filtered with `missing devices`."""
    job = example_job("vllm_gpu_job.json")
    job["TaskGroups"][0]["Tasks"][0]["Resources"]["Devices"][0]["Name"] = "nvidia/gpu/NVIDIA B200"
    metric = failed(place(admitted(job), cluster()))
    assert {"missing devices": 3} == metric["ConstraintFiltered"]
    assert (3, 3, {"dc1": 3}) == (
        metric["NodesEvaluated"],
        metric["NodesFiltered"],
        metric["NodesAvailable"],
    )
    assert {"gpu": 1} == metric["ClassFiltered"]


def test_device_memory_constraint_uses_units() -> None:
    """A 24 GiB GPU fails `${device.attr.memory} >= 40 GiB`; an 80 GB one passes."""
    small = make_node(4, gpus=1, gpu_model="NVIDIA L4", memory_mb=GPU_RAM)
    assert isinstance(place(vllm_job(), [small]), PlacementFailure)
    assert "node-3" == placed(place(vllm_job(), [small, cluster()[2]])).node.name


def test_missing_driver_is_filtered() -> None:
    """A driver no node has is `missing drivers`."""
    job = cpu_job()
    job["TaskGroups"][0]["Tasks"][0]["Driver"] = "qemu"
    assert {"missing drivers": 3} == failed(place(job, cluster()))["ConstraintFiltered"]


def test_unmet_constraint_is_reported_by_its_text() -> None:
    """The reason key is the constraint's `LTarget Operand RTarget`."""
    job = cpu_job(
        Constraints=[{"LTarget": "${attr.kernel.name}", "RTarget": "darwin", "Operand": "="}]
    )
    assert {"${attr.kernel.name} = darwin": 3} == failed(place(job, cluster()))[
        "ConstraintFiltered"
    ]


@pytest.mark.parametrize("seed", SEEDS)
def test_node_id_not_equal_constraint_keeps_a_replica_off_a_node(seed: int) -> None:
    """`${node.unique.id} != <id>` (the llama.cpp example's shape) avoids that node."""
    job = cpu_job(
        Constraints=[{"LTarget": "${node.unique.id}", "RTarget": "node-id-1", "Operand": "!="}]
    )
    assert "node-id-1" != placed(place(job, cluster()[:2], seed=seed)).node.id


@pytest.mark.parametrize("seed", SEEDS)
def test_negative_affinity_keeps_cpu_replicas_apart(seed: int) -> None:
    """caravan's sibling anti-affinity sends replica 2 to the node no sibling uses."""
    siblings = [make_alloc(cpu_job("m-0"), cluster()[0]), make_alloc(cpu_job("m-1"), cluster()[1])]
    job = cpu_job(
        "m-2",
        Affinities=[
            {
                "LTarget": "${node.unique.id}",
                "RTarget": "node-id-1,node-id-2",
                "Operand": "set_contains_any",
                "Weight": -100,
            }
        ],
    )
    assert "node-3" == placed(place(job, cluster(), siblings, seed=seed)).node.name


def test_negative_affinity_stays_soft_when_only_sibling_nodes_remain() -> None:
    """With every node hosting a sibling, the replica is still placed."""
    job = cpu_job(
        Affinities=[
            {"LTarget": "${node.unique.id}", "RTarget": "node-id-1", "Operand": "=", "Weight": -100}
        ]
    )
    assert "node-1" == placed(place(job, cluster()[:1])).node.name


def test_distinct_hosts_fills_each_node_once_per_job() -> None:
    """A fourth allocation of a distinct_hosts group has no node left."""
    job = cpu_job(count=4, Constraints=[{"Operand": "distinct_hosts"}])
    nodes = cluster()
    allocs = [make_alloc(job, node, index) for index, node in enumerate(nodes)]
    metric = failed(place(job, nodes, allocs))
    assert {"distinct_hosts": 3} == metric["ConstraintFiltered"]


def test_distinct_hosts_is_scoped_to_the_job() -> None:
    """Another job's allocations do not count (facts N14)."""
    other = make_alloc(cpu_job("other"), cluster()[0])
    job = cpu_job(Constraints=[{"Operand": "distinct_hosts"}])
    assert "node-1" == placed(place(job, cluster()[:1], [other])).node.name


def test_memory_exhaustion_is_a_dimension() -> None:
    """Asking for more memory than any node has exhausts `memory` on each."""
    metric = failed(place(cpu_job(memory=GPU_RAM + 1), cluster()))
    assert (3, {"memory": 3}) == (metric["NodesExhausted"], metric["DimensionExhausted"])


def test_cpu_exhaustion_counts_existing_allocations() -> None:
    """A node whose CPU is taken by others is exhausted on `cpu`."""
    node = make_node(1)
    busy = make_alloc(cpu_job("busy"), node, cpu=node.cpu_total_mhz - 50)
    assert {"cpu": 1} == failed(place(cpu_job(cpu=100), [node], [busy]))["DimensionExhausted"]


def test_allocated_gpus_are_not_handed_out_twice() -> None:
    """With the only GPU taken, the device request exhausts the node."""
    node = make_node(3, gpus=1, memory_mb=GPU_RAM)
    taken = make_alloc(vllm_job(ID="other"), node)
    device = node.devices[0]
    gpu = AllocatedDevice("nvidia", "gpu", device.name, (device.instances[0].id,))
    task = dataclasses.replace(taken.resources.tasks["t"], devices=(gpu,))
    taken = dataclasses.replace(
        taken, resources=dataclasses.replace(taken.resources, tasks={"t": task})
    )
    metric = failed(place(vllm_job(), [node], [taken]))
    assert {"devices: no devices match request": 1} == metric["DimensionExhausted"]


def test_second_gpu_alloc_gets_the_other_instance() -> None:
    """Two single-GPU allocations on a two-GPU node get different instances."""
    node = cluster()[2]
    first = placed(place(vllm_job(), [node]))
    alloc = make_alloc(vllm_job(), node)
    alloc = dataclasses.replace(alloc, resources=first.resources)
    second = placed(place(vllm_job(ID="second"), [node], [alloc]))
    assert first.resources.device_ids.isdisjoint(second.resources.device_ids)


def test_dynamic_ports_come_from_the_node_range_and_do_not_collide() -> None:
    """Ports are in [20000, 32000] and differ from those already used on the node."""
    node = make_node(1)
    first = placed(place(cpu_job(), [node], seed=1))
    alloc = dataclasses.replace(make_alloc(cpu_job("a"), node), resources=first.resources)
    second = placed(place(cpu_job("b"), [node], [alloc], seed=1))
    port_a, port_b = first.resources.ports[0], second.resources.ports[0]
    assert 20000 <= port_a.value <= 32000
    assert port_a.value != port_b.value
    assert (node.address, 0) == (port_a.host_ip, port_a.to)


def test_reserved_cores_are_exclusive() -> None:
    """`Cores` reserves distinct core ids and runs out as `cores`."""
    node = make_node(1, cpu_cores=4)
    job = cpu_job()
    job["TaskGroups"][0]["Tasks"][0]["Resources"] = {"Cores": 3, "CPU": 0, "MemoryMB": 64}
    first = placed(place(job, [node]))
    assert (0, 1, 2) == first.resources.tasks["t"].reserved_cores
    assert 3 * node.cpu_mhz_per_core == first.resources.tasks["t"].cpu_shares
    alloc = dataclasses.replace(make_alloc(job, node), resources=first.resources)
    assert {"cores": 1} == failed(place(job, [node], [alloc]))["DimensionExhausted"]


def test_datacenter_globs_select_nodes() -> None:
    """`dc*` matches dc1; `eu-*` matches nothing and evaluates no node."""
    assert placed(place(cpu_job(Datacenters=["dc*"]), cluster()))
    metric = failed(place(cpu_job(Datacenters=["eu-*"]), cluster()))
    assert (0, {}) == (metric["NodesEvaluated"], metric["NodesAvailable"])


@pytest.mark.parametrize(
    "change",
    [{"status": "down"}, {"eligibility": "ineligible"}, {"status": "initializing"}],
)
def test_unready_nodes_are_not_candidates(change: dict[str, str]) -> None:
    """Down, ineligible or initializing nodes are never picked."""
    nodes = [dataclasses.replace(make_node(1), **change), make_node(2)]
    for seed in SEEDS:
        assert "node-2" == placed(place(cpu_job(), nodes, seed=seed)).node.name


@pytest.mark.parametrize("seed", SEEDS)
def test_rescheduling_penalises_the_previous_node(seed: int) -> None:
    """Between two equal nodes, the one a failed allocation ran on loses."""
    nodes = cluster()[:2]
    result = placed(place(cpu_job(), nodes, seed=seed, penalty=frozenset({"node-id-1"})))
    assert "node-2" == result.node.name


@pytest.mark.parametrize("seed", SEEDS)
def test_bin_packing_prefers_the_fuller_node(seed: int) -> None:
    """Nomad's default bin-packing puts the allocation beside existing load."""
    nodes = cluster()[:2]
    load = make_alloc(cpu_job("load"), nodes[0], cpu=4000, memory=8000)
    assert "node-1" == placed(place(cpu_job(), nodes, [load], seed=seed)).node.name


@pytest.mark.parametrize("seed", SEEDS)
def test_device_affinity_prefers_the_matching_model(seed: int) -> None:
    """The vLLM example's H100 affinity wins over an A100 node."""
    nodes = [
        make_node(1, gpus=1, gpu_model="NVIDIA A100-SXM4-80GB", memory_mb=GPU_RAM),
        make_node(2, gpus=1, gpu_model="NVIDIA H100 80GB HBM3", memory_mb=GPU_RAM),
    ]
    assert "node-2" == placed(place(vllm_job(), nodes, seed=seed)).node.name


def test_score_metadata_lists_the_ranked_nodes() -> None:
    """`ScoreMetaData` carries the binpack score of the nodes considered."""
    metric = placed(place(cpu_job(), cluster())).metric.to_api()
    assert metric["ScoreMetaData"]
    assert all("binpack" in entry["Scores"] for entry in metric["ScoreMetaData"])
