"""Profile changes roll replicas one at a time, and scaling follows `caravan scale`."""

from __future__ import annotations

import asyncio
import time

from conftest import eventually, example, store_of, submit

from caravan.contract import KVLayout, model_service_name
from caravan_cli.local_stack import LocalStack
from scheduler.render import spec_hash


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
        live = [j for j in jobs if not j.get("Stop")]
        current = [
            j
            for j in live
            if j["Meta"]["caravan_spec_hash"]
            == spec_hash(changed, int(j["Meta"]["caravan_replica"]), stack.config)
        ]
        if len(live) == 2 and len(current) == 2 and len(ready) == 2:
            break
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
