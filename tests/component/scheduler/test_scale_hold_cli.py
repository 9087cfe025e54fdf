"""`caravan scale --for/--auto` through the scheduler's API and directly: the hold in KV."""

from __future__ import annotations

import time

from conftest import example
from test_scheduler_cli_and_api import caravan

from caravan_llm.cli.local_stack import LocalStack
from caravan_llm.common.contract import KVLayout, ScaleOverride
from caravan_llm.scheduler.model_store import ModelStore

AUTOSCALED = {"target_inflight": 4}


async def hold_of(stack: LocalStack, name: str) -> ScaleOverride | None:
    _, entry = await stack.scheduler.consul.kv_get(KVLayout().override_key(name))
    return None if entry is None else ScaleOverride.decode(entry.value)


async def test_scale_holds_through_the_api_and_auto_ends_it(stack: LocalStack):
    """--for 30m writes a 30-minute hold with the count; --auto removes it; bad asks write none."""
    await ModelStore(stack.scheduler.consul, KVLayout()).submit(
        [example("qwen-vllm-h100.yaml", autoscaling=AUTOSCALED)]
    )
    base = f"http://127.0.0.1:{stack.scheduler.bound_port}"

    before = time.time()
    code, out, err = await caravan(
        stack, "scale", "qwen2-5-7b", "3", "--for", "30m", "--scheduler", base
    )
    assert (code, err) == (0, "")
    assert "held against the autoscaler for 30m" in out
    held = await hold_of(stack, "qwen2-5-7b")
    assert held is not None
    assert 3 == held.count
    assert before + 1800 <= held.until <= time.time() + 1800

    code, out, _ = await caravan(stack, "list", "--scheduler", base)
    assert "held at 3 until" in out

    code, _, err = await caravan(stack, "scale", "qwen2-5-7b", "2", "--for", "soon")
    assert code == 1
    assert "--for: 'soon' is not a duration" in err
    assert held == await hold_of(stack, "qwen2-5-7b")

    code, out, err = await caravan(stack, "scale", "qwen2-5-7b", "--auto", "--scheduler", base)
    assert (code, err) == (0, "")
    assert await hold_of(stack, "qwen2-5-7b") is None


async def test_a_model_without_autoscaling_refuses_a_duration(stack: LocalStack):
    """A manual model's count holds anyway: --for and --auto are refused with the reason."""
    manual = example("qwen-vllm-h100.yaml", autoscaling={"enabled": False, **AUTOSCALED})
    await ModelStore(stack.scheduler.consul, KVLayout()).submit([manual])

    code, _, err = await caravan(stack, "scale", "qwen2-5-7b", "2", "--for", "1h")
    auto_code, _, auto_err = await caravan(stack, "scale", "qwen2-5-7b", "--auto")

    assert code == 1
    assert "no autoscaling, so its count holds until changed" in err
    assert auto_code == 1
    assert "no enabled autoscaling" in auto_err
    assert await hold_of(stack, "qwen2-5-7b") is None
