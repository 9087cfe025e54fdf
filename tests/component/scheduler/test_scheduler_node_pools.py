"""CPU replicas stay off GPU nodes through node failures (issue 14 item 4), on devcluster.

The stack has 3 CPU nodes in Nomad's `default` pool and 2 GPU nodes in pool
`gpu` (as docs/deploy.md asks of a real cluster). Each CPU replica here
reserves 3 of a node's 4 cores, so one fits per node: the GPU nodes always
have room, and only the node pool keeps CPU replicas off them.
"""

from __future__ import annotations

from conftest import eventually, example, store_of, submit

from caravan_llm.cli.local_stack import LocalStack
from caravan_llm.scheduler.status import StatusReader

MODEL = "tiny-chat"
PREFIX = f"caravan-{MODEL}-"


async def running(stack: LocalStack) -> dict[str, str]:
    """Running allocations of the model's replicas: job id -> node id."""
    allocs = (await stack.scheduler.nomad.list_allocations()).value
    return {
        a.job_id: a.node_id
        for a in allocs
        if a.job_id.startswith(PREFIX)
        and a.client_status == "running"
        and a.desired_status == "run"
    }


async def test_rebuilt_cpu_replica_avoids_gpu_nodes_and_waits_naming_the_pool(stack: LocalStack):
    """A CPU replica rebuilt after its node dies lands on a free CPU node, never a GPU node;
    with no CPU node free it waits and `caravan status` names the node pool."""
    profile = example(
        "tiny-llamacpp-cpu.yaml",
        replicas={"min": 1, "max": 5, "initial": 2},
        resources={"cores": 3, "memory_mb": 512},
    )
    await submit(stack, profile)
    nodes = (await stack.scheduler.nomad.list_nodes()).value
    gpu_nodes = {n.id for n in nodes if n.devices}
    cpu_nodes = {n.id for n in nodes if not n.devices}
    assert (len(gpu_nodes), len(cpu_nodes)) == (2, 3)

    async def two_running() -> dict[str, str] | None:
        now = await running(stack)
        return now if len(now) == 2 else None

    before = await eventually(two_running, timeout_s=60)
    assert set(before.values()) <= cpu_nodes
    spare = (cpu_nodes - set(before.values())).pop()
    victim_job, victim_node = min(before.items())

    await stack.cluster.nomad.kill_node(victim_node)

    async def rebuilt() -> dict[str, str] | None:
        now = await running(stack)
        if len(now) == 2 and victim_node not in now.values():
            return now
        # Never, not even for a moment, on a GPU node.
        assert not set(now.values()) & gpu_nodes, f"a CPU replica runs on a GPU node: {now}"
        return None

    after = await eventually(rebuilt, timeout_s=60)
    assert after[victim_job] == spare
    assert not set(after.values()) & gpu_nodes

    # Now no CPU node has room for a second rebuild: it must wait, not take a GPU node.
    second_job, second_node = min((j, n) for j, n in after.items() if j != victim_job)
    await stack.cluster.nomad.kill_node(second_node)
    reader = StatusReader(
        store=store_of(stack), nomad=stack.scheduler.nomad, health=stack.scheduler.consul
    )

    async def explained() -> str | None:
        now = await running(stack)
        assert not set(now.values()) & gpu_nodes, f"a CPU replica runs on a GPU node: {now}"
        status = await reader.model(MODEL)
        reasons = [r.pending_reason for r in status.replicas if r.pending_reason]
        return reasons[0] if reasons else None

    reason = await eventually(explained, timeout_s=60)
    assert 'in node pool "default"' in reason, reason
    # The one CPU node left is full; the GPU nodes, with room, were never candidates.
    assert "1 node has fewer than 3 free cores; 1 node evaluated" in reason, reason
    now = await running(stack)
    assert second_job not in now
    assert set(now.values()) <= cpu_nodes - {victim_node, second_node}
