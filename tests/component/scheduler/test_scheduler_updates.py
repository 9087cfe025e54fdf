"""Profile changes roll replicas one at a time, and scaling follows `caravan scale`."""

from __future__ import annotations

import asyncio
import time

from conftest import eventually, example, store_of, submit

from caravan_llm.cli.local_stack import LocalStack
from caravan_llm.common.consul_api import HealthEntry
from caravan_llm.common.contract import (
    ENGINE_KEY_ITEM,
    KVLayout,
    engine_key_path,
    model_service_name,
)
from caravan_llm.scheduler.render import spec_hash


async def ready_not_draining(stack: LocalStack, model: str) -> set[str]:
    """Jobs of the model whose replica passes in Consul and is not marked draining."""
    consul = stack.scheduler.consul
    _, entries = await consul.health_service(model_service_name(model), passing=True)
    _, markers = await consul.kv_get_recurse(KVLayout().draining)
    draining = {m.key.rsplit("/", 1)[-1] for m in markers}
    allocs = {a.id: a.job_id for a in (await stack.scheduler.nomad.list_allocations()).value}
    jobs = {allocs.get(e.meta.get("alloc_id", ""), "") for e in entries}
    return {j for j in jobs if j and j not in draining}


async def test_profile_change_rolls_without_losing_ready_capacity(stack: LocalStack):
    """A changed profile replaces both replicas while at least two stay ready throughout."""
    profile = example("qwen-vllm-h100.yaml", drain_s=1)
    await submit(stack, profile)
    await eventually(lambda: _at_least(ready_not_draining(stack, profile.name), 2), timeout_s=60)
    changed = profile.model_copy(update={"engine_args": (*profile.engine_args, "--seed", "7")})
    await submit(stack, changed)

    lowest = 99
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        ready = await ready_not_draining(stack, profile.name)
        lowest = min(lowest, len(ready))
        jobs = (await stack.scheduler.nomad.list_jobs("caravan-qwen2-5-7b-", meta=True)).value
        live = [j for j in jobs if not j.stop]
        current = [
            j
            for j in live
            if j.meta["caravan_spec_hash"]
            == spec_hash(changed, int(j.meta["caravan_replica"]), stack.config)
        ]
        if len(live) == 2 and len(current) == 2 and len(ready) == 2:
            break
        # A sampling interval, not a wait: every sample's ready count is checked.
        await asyncio.sleep(0.3)
    else:
        raise AssertionError(f"the update did not finish: {len(current)} of {len(live)} current")
    assert lowest >= 2, f"ready capacity dropped to {lowest} during the update"


async def _at_least(awaitable, count: int) -> bool:
    return len(await awaitable) >= count


async def test_manual_scale_adds_and_removes_replicas(stack: LocalStack):
    """`caravan scale` to 3 adds a replica; back to 1 drains two."""
    profile = example("qwen-vllm-h100.yaml", drain_s=1)
    await submit(stack, profile)
    await eventually(lambda: _at_least(ready_not_draining(stack, profile.name), 2), timeout_s=60)
    store = store_of(stack)
    await store.scale(profile.name, 3)
    await eventually(lambda: _exactly(ready_not_draining(stack, profile.name), 3), timeout_s=60)
    await store.scale(profile.name, 1)

    async def one_job_left() -> bool:
        jobs = (await stack.scheduler.nomad.list_jobs("caravan-qwen2-5-7b-")).value
        return len(jobs) == 1

    await eventually(one_job_left, timeout_s=60)


async def _exactly(awaitable, count: int) -> bool:
    return len(await awaitable) == count


async def test_scale_down_drains_the_replica_with_fewest_inflight_requests(tmp_path):
    """With two replicas busy and one idle, scaling 3 -> 2 drains the idle one."""
    import aiohttp  # noqa: PLC0415 - only this test drives engines directly

    from caravan_llm.cli.local_stack import StackOptions, local_stack  # noqa: PLC0415

    options = StackOptions(
        prefer_real_llama_server=False,
        cpu_nodes=1,
        gpus_per_node=4,
        autoscale=True,
        autoscale_tick_s=1.0,
        work_dir=tmp_path,
        resync_s=2.0,
    )
    profile = example(
        "qwen-vllm-h100.yaml",
        replicas={"min": 1, "max": 3, "initial": 3},
        autoscaling=None,
        drain_s=1,
        env={"CARAVAN_SIM_STEP_SECONDS": "0.05", "CARAVAN_SIM_OUTPUT_TOKENS": "2000"},
    )
    async with local_stack(options) as stack:
        await submit(stack, profile)
        await eventually(lambda: _exactly(ready_not_draining(stack, profile.name), 3), timeout_s=60)
        _, entries = await stack.scheduler.consul.health_service(
            model_service_name(profile.name), passing=True
        )
        allocs = {a.id: a.job_id for a in (await stack.scheduler.nomad.list_allocations()).value}
        jobs = {allocs[e.meta["alloc_id"]]: e for e in entries}
        idle_job = min(jobs)
        busy = [jobs[j] for j in sorted(jobs) if j != idle_job]
        body = {
            "model": profile.served_name,
            "stream": True,
            "max_tokens": 400,
            "messages": [{"role": "user", "content": "keep talking"}],
        }
        # The engines answer only with their model's key (docs/security.md).
        key = await stack.scheduler.nomad.get_variable(engine_key_path(profile.name))
        assert key is not None
        headers = {"Authorization": f"Bearer {key.items[ENGINE_KEY_ITEM]}"}
        async with aiohttp.ClientSession() as session:
            streams = [
                await session.post(
                    f"http://{e.address}:{e.port}/v1/chat/completions", json=body, headers=headers
                )
                for e in busy
                for _ in range(2)
            ]
            try:
                autoscaler = stack.scheduler.autoscaler
                assert autoscaler is not None

                async def load_seen() -> bool:
                    # What the planner picks by: the autoscaler's last scrape of each replica.
                    def seen(entry: HealthEntry) -> float | None:
                        return autoscaler.inflight.of_alloc(profile.name, entry.meta["alloc_id"])

                    busy_seen = all((seen(e) or 0) >= 2 for e in busy)
                    return busy_seen and seen(jobs[idle_job]) == 0

                await eventually(load_seen, timeout_s=20, interval_s=0.2)
                await store_of(stack).scale(profile.name, 2)

                async def drained() -> list[str]:
                    _, markers = await stack.scheduler.consul.kv_get_recurse(KVLayout().draining)
                    return [m.key.rsplit("/", 1)[-1] for m in markers]

                assert await eventually(drained, timeout_s=20) == [idle_job]
            finally:
                for stream in streams:
                    stream.close()
