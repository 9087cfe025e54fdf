"""The scheduler against devcluster: submit, place, status, delete."""

from __future__ import annotations

from conftest import eventually, example, store_of, submit

from caravan_llm.cli.local_stack import LocalStack
from caravan_llm.common.contract import model_service_name
from caravan_llm.scheduler.status import StatusReader


async def passing_nodes(stack: LocalStack, model: str) -> list[str]:
    _, entries = await stack.scheduler.consul.health_service(
        model_service_name(model), passing=True
    )
    return sorted(e.node for e in entries)


async def test_examples_become_passing_and_cpu_replicas_spread(stack: LocalStack):
    """The CPU and H100 examples reach passing; the 3 CPU replicas sit on 3 distinct nodes."""
    await submit(stack, example("tiny-llamacpp-cpu.yaml"), example("qwen-vllm-h100.yaml"))

    async def all_passing() -> bool:
        cpu = await passing_nodes(stack, "tiny-chat")
        gpu = await passing_nodes(stack, "qwen2-5-7b")
        return len(cpu) == 3 and len(gpu) == 2

    await eventually(all_passing, timeout_s=90)
    cpu_nodes = await passing_nodes(stack, "tiny-chat")
    assert len(set(cpu_nodes)) == 3
    gpu_nodes = {n.id: n for n in (await stack.scheduler.nomad.list_nodes()).value}
    allocs = (await stack.scheduler.nomad.list_allocations()).value
    for alloc in allocs:
        if alloc.job_id.startswith("caravan-qwen2-5-7b-") and alloc.client_status == "running":
            assert gpu_nodes[alloc.node_id].devices, "a vLLM replica runs on a node without GPUs"


async def test_status_explains_an_unplaceable_replica(stack: LocalStack):
    """A profile asking for L4s on an H100-only cluster is reported in plain words."""
    await submit(stack, example("llama-llamacpp-l4.yaml"))
    reader = StatusReader(
        store=store_of(stack), nomad=stack.scheduler.nomad, health=stack.scheduler.consul
    )

    async def explained() -> str | None:
        status = await reader.model("llama3-8b-q4")
        reasons = [r.pending_reason for r in status.replicas if r.pending_reason]
        return reasons[0] if reasons else None

    reason = await eventually(explained, timeout_s=30)
    assert reason.startswith("no node has 1 free L4")
    assert "have no matching GPU" in reason


async def test_delete_removes_every_job(stack: LocalStack):
    """Deleting a model drains its replicas and removes all of its jobs."""
    await submit(stack, example("qwen-vllm-h100.yaml", drain_s=1))
    await eventually(lambda: passing_nodes(stack, "qwen2-5-7b"), timeout_s=60)
    await store_of(stack).delete("qwen2-5-7b")

    async def no_jobs() -> bool:
        jobs = (await stack.scheduler.nomad.list_jobs("caravan-qwen2-5-7b-")).value
        return not jobs

    await eventually(no_jobs, timeout_s=60)
