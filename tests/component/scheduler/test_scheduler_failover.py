"""The scheduler through failures: a dead node, a Nomad outage, a steady state."""

from __future__ import annotations

import aiohttp
from conftest import eventually, example, store_of, submit

from caravan_llm.cli.local_stack import LocalStack
from caravan_llm.common.contract import model_service_name


async def running_allocs(stack: LocalStack, job_prefix: str) -> dict[str, tuple[str, str]]:
    """Running allocations of matching jobs: job id -> (alloc id, node id)."""
    allocs = (await stack.scheduler.nomad.list_allocations()).value
    return {
        a.job_id: (a.id, a.node_id)
        for a in allocs
        if a.job_id.startswith(job_prefix)
        and a.client_status == "running"
        and a.desired_status == "run"
    }


async def passing(stack: LocalStack, model: str) -> list[str]:
    _, entries = await stack.scheduler.consul.health_service(
        model_service_name(model), passing=True
    )
    return sorted(e.node for e in entries)


async def test_node_kill_restores_replicas_without_touching_healthy_ones(stack: LocalStack):
    """Killing one CPU replica's node restores 3 passing replicas; the other two stay put."""
    await submit(stack, example("tiny-llamacpp-cpu.yaml"))
    await eventually(lambda: _count_is(passing(stack, "tiny-chat"), 3), timeout_s=60)
    before = await running_allocs(stack, "caravan-tiny-chat-")
    victim_job, (_, victim_node) = min(before.items())
    jobs_before = {
        j.id: j.job_modify_index
        for j in (await stack.scheduler.nomad.list_jobs("caravan-tiny-chat-")).value
    }

    victim_name = next(
        n.name for n in (await stack.scheduler.nomad.list_nodes()).value if n.id == victim_node
    )
    await stack.cluster.nomad.kill_node(victim_node)

    async def restored() -> bool:
        # The dead node's entry stays passing until Consul's serf notices (seconds).
        nodes = await passing(stack, "tiny-chat")
        now = await running_allocs(stack, "caravan-tiny-chat-")
        return (
            len(nodes) == 3
            and victim_name not in nodes
            and victim_node not in {n for _, n in now.values()}
            and len(now) == 3
        )

    await eventually(restored, timeout_s=60)
    after = await running_allocs(stack, "caravan-tiny-chat-")
    for job_id, placement in before.items():
        if job_id != victim_job:
            assert after[job_id] == placement, f"{job_id} was disturbed"
    jobs_after = {
        j.id: j.job_modify_index
        for j in (await stack.scheduler.nomad.list_jobs("caravan-tiny-chat-")).value
    }
    assert jobs_before == jobs_after, "the scheduler re-registered jobs Nomad could handle"
    dead_node_names = {
        n.name for n in (await stack.scheduler.nomad.list_nodes()).value if n.id == victim_node
    }
    assert not dead_node_names & set(await passing(stack, "tiny-chat"))


async def _count_is(awaitable, count: int) -> bool:
    return len(await awaitable) == count


def _metric(stack: LocalStack, name: str, labels: dict[str, str] | None = None) -> float:
    value = stack.scheduler.registry.get_sample_value(name, labels or {})
    return value or 0.0


async def test_nomad_outage_deletes_nothing(stack: LocalStack):
    """While Nomad answers 500, the scheduler retries and drains or deletes nothing."""
    await submit(stack, example("qwen-vllm-h100.yaml"))
    await eventually(lambda: _count_is(passing(stack, "qwen2-5-7b"), 2), timeout_s=60)
    before = await running_allocs(stack, "caravan-qwen2-5-7b-")
    outage_url = f"{stack.nomad_addr}/v1/devcluster/outage"
    errors = ("caravan_scheduler_reconcile_passes_total", {"outcome": "error"})
    oks = ("caravan_scheduler_reconcile_passes_total", {"outcome": "ok"})
    async with aiohttp.ClientSession() as session:
        async with session.put(outage_url, json={"Enabled": True}) as response:
            assert response.status == 200
        errors_before = _metric(stack, *errors)
        # Several failed passes, not one: the retries with backoff run through the outage.
        await eventually(
            lambda: _at_least(stack, errors, errors_before + 3), timeout_s=60, interval_s=0.1
        )
        async with session.put(outage_url, json={"Enabled": False}) as response:
            assert response.status == 200
    # Passes succeed again; any action a confused planner would take comes with them.
    oks_after_outage = _metric(stack, *oks)
    await eventually(
        lambda: _at_least(stack, oks, oks_after_outage + 3), timeout_s=60, interval_s=0.1
    )
    assert before == await running_allocs(stack, "caravan-qwen2-5-7b-")
    drains = _metric(
        stack, "caravan_scheduler_actions_total", {"kind": "startdrain", "outcome": "ok"}
    )
    deregisters = _metric(
        stack, "caravan_scheduler_actions_total", {"kind": "deregister", "outcome": "ok"}
    )
    assert (drains, deregisters) == (0.0, 0.0)


async def _at_least(stack: LocalStack, metric: tuple[str, dict[str, str]], value: float) -> bool:
    return _metric(stack, *metric) >= value


async def test_steady_state_makes_no_nomad_writes_over_many_passes(fast_stack: LocalStack):
    """Once every replica passes, twenty more reconcile passes write nothing to Nomad.

    The periodic resync is shortened so the passes come quickly; each pass reads
    the whole world as a pass on a slow cadence would.
    """
    stack = fast_stack
    await submit(stack, example("tiny-llamacpp-cpu.yaml"), example("qwen-vllm-h100.yaml"))
    await eventually(lambda: _count_is(passing(stack, "tiny-chat"), 3), timeout_s=90)
    await eventually(lambda: _count_is(passing(stack, "qwen2-5-7b"), 2), timeout_s=60)
    writes = ("register", "replace", "deregister")
    ok_passes = ("caravan_scheduler_reconcile_passes_total", {"outcome": "ok"})

    def write_counts() -> dict[str, float]:
        return {
            k: _metric(stack, "caravan_scheduler_actions_total", {"kind": k, "outcome": "ok"})
            for k in writes
        }

    # Settled: a few passes in a row with no write, so the rollout's last
    # registrations are behind us before the measured window starts.
    async def settled() -> bool:
        counts, passes = write_counts(), _metric(stack, *ok_passes)
        await eventually(
            lambda: _at_least(stack, ok_passes, passes + 3), timeout_s=30, interval_s=0.05
        )
        return counts == write_counts()

    await eventually(settled, timeout_s=60, interval_s=0.05)
    nomad = stack.scheduler.nomad
    jobs_before = {
        j.id: (j.job_modify_index, j.version) for j in (await nomad.list_jobs("caravan-")).value
    }
    actions_before = write_counts()
    passes_before = _metric(stack, *ok_passes)

    await eventually(
        lambda: _at_least(stack, ok_passes, passes_before + 20), timeout_s=60, interval_s=0.1
    )

    jobs_after = {
        j.id: (j.job_modify_index, j.version) for j in (await nomad.list_jobs("caravan-")).value
    }
    assert actions_before == write_counts()
    assert jobs_before == jobs_after


async def test_replicas_crowded_onto_one_node_are_moved_apart(stack: LocalStack):
    """Two CPU replicas on A and B, the third CPU node C down: killing B makes Nomad
    reschedule its replica onto A, the only node left (the job's anti-affinity is soft and
    was rendered for B's old sibling). Once C is back, the scheduler places a new replica
    there and drains the crowded one, never going below 2 passing on the way."""
    replicas = {"min": 2, "max": 2, "initial": 2}
    await submit(stack, example("tiny-llamacpp-cpu.yaml", replicas=replicas, autoscaling=None))
    await eventually(lambda: _count_is(passing(stack, "tiny-chat"), 2), timeout_s=60)
    placed = await running_allocs(stack, "caravan-tiny-chat-")
    nodes = (await stack.scheduler.nomad.list_nodes()).value
    cpu_nodes = {n.id for n in nodes if n.node_pool == "default"}
    used = {node for _, node in placed.values()}
    [spare] = cpu_nodes - used
    victim = max(used)
    [survivor] = used - {victim}

    await stack.cluster.nomad.kill_node(spare)
    await stack.cluster.nomad.kill_node(victim)

    async def crowded() -> bool:
        now = await running_allocs(stack, "caravan-tiny-chat-")
        on = {node for _, node in now.values()}
        return len(now) == 2 and on == {survivor} and len(await passing(stack, "tiny-chat")) == 2

    await eventually(crowded, timeout_s=90)
    await stack.cluster.nomad.restart_node(spare)
    fewest = 2

    async def apart() -> bool:
        nonlocal fewest
        fewest = min(fewest, len(await passing(stack, "tiny-chat")))
        draining = set((await store_of(stack).read()).draining)
        now = await running_allocs(stack, "caravan-tiny-chat-")
        live = {job: node for job, (_, node) in now.items() if job not in draining}
        return len(live) == 2 and set(live.values()) == {survivor, spare}

    await eventually(apart, timeout_s=120)
    assert fewest == 2, "the move took a replica out before its replacement passed"
