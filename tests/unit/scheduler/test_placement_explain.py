"""Plain-words explanations of Nomad's failed placements."""

from __future__ import annotations

from profile_builders import make_llamacpp, make_vllm

from caravan_llm.scheduler.placement_explain import (
    ReplicaAsk,
    explain_failed_groups,
    explain_failed_placement,
)
from caravan_llm.scheduler.render import render


def test_missing_gpus_say_how_many_of_which_class():
    """A device shortage reads 'no node has 2 free H100'."""
    job = render(make_vllm(tensor_parallel=2, gpu={"class": "h100", "count": 2}), 0)["Job"]
    ask = ReplicaAsk.from_job(job, gpu_class="h100")
    metric = {
        "NodesEvaluated": 5,
        "ConstraintFiltered": {"missing devices": 3},
        "DimensionExhausted": {"devices: no devices match request": 2},
    }
    expected = (
        "no node has 2 free H100 (3 nodes have no matching GPU; "
        "2 nodes have too few free GPUs; 5 nodes evaluated)"
    )
    assert expected == explain_failed_placement(metric, ask)


def test_exhausted_memory_names_the_request():
    """A memory shortage names the memory the replica asked for."""
    job = render(make_llamacpp(resources={"memory_mb": 4096}), 0)["Job"]
    metric = {"NodesEvaluated": 3, "DimensionExhausted": {"memory": 3}}
    assert explain_failed_placement(metric, ReplicaAsk.from_job(job)) == (
        'every matching node in node pool "default" is full '
        "(3 nodes have less than 4096 MB memory free; 3 nodes evaluated)"
    )


def test_missing_driver_and_constraint():
    """Missing drivers and failed constraints are named."""
    ask = ReplicaAsk(driver="raw_exec")
    metric = {
        "NodesEvaluated": 2,
        "ConstraintFiltered": {"missing drivers": 1, "${attr.kernel.name} = linux": 1},
    }
    assert explain_failed_placement(metric, ask) == (
        "no node satisfies the replica's requirements (1 node fails the constraint "
        "${attr.kernel.name} = linux; 1 node lacks the raw_exec driver; 2 nodes evaluated)"
    )


def test_no_nodes_at_all():
    """With no node evaluated, the explanation says no client is available."""
    assert explain_failed_placement({"NodesEvaluated": 0}, ReplicaAsk()).startswith(
        "no client node is available"
    )


def test_groups_none_when_nothing_failed():
    """No failed groups means no explanation."""
    assert explain_failed_groups(None, ReplicaAsk()) is None
    assert explain_failed_groups({}, ReplicaAsk()) is None


def test_cpu_replica_with_full_cpu_pool_names_the_pool():
    """A CPU replica whose pool is full says which pool it is kept to."""
    job = render(make_llamacpp(resources={"cpu_mhz": 4000}), 0)["Job"]
    metric = {"NodesEvaluated": 2, "NodesInPool": 2, "DimensionExhausted": {"cpu": 2}}
    assert explain_failed_placement(metric, ReplicaAsk.from_job(job)) == (
        'every matching node in node pool "default" is full '
        "(2 nodes have less than 4000 MHz CPU free; 2 nodes evaluated)"
    )


def test_empty_pool_names_the_pool_and_the_setting():
    """A pool with no ready node is named, with the settings that chose it."""
    job = render(make_vllm(node_pool="h100-team"), 0)["Job"]
    metric = {"NodesEvaluated": 0, "NodesInPool": 0, "NodesAvailable": {}}
    explained = explain_failed_placement(metric, ReplicaAsk.from_job(job, gpu_class="h100"))
    assert explained.startswith('no client node is ready in node pool "h100-team"')
    assert "node_pool" in explained


def test_gpu_replica_in_pool_all_names_no_pool():
    """Pool `all` restricts nothing, so a GPU shortage reads as before."""
    job = render(make_vllm(), 0)["Job"]
    assert job["NodePool"] == "all"
    metric = {"NodesEvaluated": 1, "ConstraintFiltered": {"missing devices": 1}}
    explained = explain_failed_placement(metric, ReplicaAsk.from_job(job, gpu_class="h100"))
    assert explained.startswith("no node has 1 free H100")
