"""A devcluster (3 CPU nodes, 2 GPU nodes with H100s) and a scheduler, in-process.

These tests are about the scheduler's reactions, not how long failure
detection takes, so Nomad's heartbeat TTL and grace are shortened (1 s + 1 s
instead of 10 s + 10 s: a dead node is down within 3 s). The exit criterion
(tests/component/test_exit_criterion.py) runs through the real delays.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import polling
import pytest

from caravan_llm.cli.local_stack import LocalStack, StackOptions, local_profile, local_stack
from caravan_llm.common.contract import KVLayout
from caravan_llm.scheduler.model_store import ModelStore
from caravan_llm.scheduler.profiles import ModelProfile, load_profile

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = ROOT / "examples" / "profiles"


def example(name: str, **overrides: Any) -> ModelProfile:
    profile = load_profile(EXAMPLES / name)
    if not overrides:
        return profile
    document = profile.model_dump(mode="json", by_alias=True, exclude_none=True)
    document.update(overrides)
    return ModelProfile.model_validate({k: v for k, v in document.items() if v is not None})


@pytest.fixture
async def stack(tmp_path: Path) -> AsyncIterator[LocalStack]:
    options = StackOptions(
        prefer_real_llama_server=False,
        gpus_per_node=4,
        autoscale=False,
        work_dir=tmp_path,
        resync_s=2.0,
        replace_lost_after_s=15.0,
        heartbeat_grace_s=1.0,
        min_heartbeat_ttl_s=1.0,
    )
    async with local_stack(options) as running:
        yield running


@pytest.fixture
async def fast_stack(tmp_path: Path) -> AsyncIterator[LocalStack]:
    """The stack above with a quick periodic resync, for tests that count reconcile passes."""
    options = StackOptions(
        prefer_real_llama_server=False,
        gpus_per_node=4,
        autoscale=False,
        work_dir=tmp_path,
        resync_s=0.2,
        replace_lost_after_s=15.0,
    )
    async with local_stack(options) as running:
        yield running


def store_of(stack: LocalStack) -> ModelStore:
    return ModelStore(stack.scheduler.consul, KVLayout())


async def submit(stack: LocalStack, *profiles: ModelProfile) -> None:
    await store_of(stack).submit([local_profile(p, stack.engine) for p in profiles])


async def eventually(
    check: Callable[[], Any], *, timeout_s: float = 60.0, interval_s: float = 0.5
) -> Any:
    """Poll an async check until it returns a truthy value; fail with its last value."""
    return await polling.eventually(check, timeout_s, "the condition", interval_s=interval_s)
