"""What LoRA adapters cost the simulated vLLM: CPU cache, GPU slots, load and swap time, and
the batch limit of `max_loras` adapters (devcluster/engine/lora_slots.py, as vLLM's manager)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import aiohttp
import pytest
from engine_test_support import StartEngine, post_json
from test_engine_lora import RUNTIME, load, make_adapter

from caravan_llm.devcluster.engine.batch import BatchCore, PerfModel, SequenceSpec
from caravan_llm.devcluster.engine.flags import FlagError, parse_engine_args
from caravan_llm.devcluster.engine.lora_slots import AdapterSlots, LoraCosts

COSTS = LoraCosts(load_seconds=1.0, swap_seconds=0.01)


def slots(max_loras: int = 2, max_cpu_loras: int | None = None) -> AdapterSlots:
    return AdapterSlots(max_loras=max_loras, max_cpu_loras=max_cpu_loras, costs=COSTS)


def test_an_adapter_is_read_once_while_it_stays_in_the_cpu_cache() -> None:
    """The first step with an adapter reads and activates it; the next one costs nothing."""
    cache = slots()
    assert [1.01, 0.0] == [cache.prepare({"a"}), cache.prepare({"a"})]
    assert (1, 1) == (cache.stats().disk_loads, cache.stats().swaps)


def test_the_least_recently_used_adapter_leaves_the_cpu_cache_and_is_read_again() -> None:
    """With `max_cpu_loras` 2 a third adapter pushes out the least recently used one, which
    is read from disk again when used."""
    cache = slots(max_loras=1, max_cpu_loras=2)
    cache.prepare({"a"})
    cache.prepare({"b"})
    cache.prepare({"a"})  # a is now the most recently used
    cache.prepare({"c"})  # pushes b out
    assert ("a", "c") == cache.stats().cpu
    assert [0.01, 1.01] == [cache.prepare({"a"}), cache.prepare({"b"})]


def test_a_cached_adapter_needs_only_a_swap_into_a_slot() -> None:
    """An adapter in the CPU cache but not in a GPU slot costs the swap, not the read."""
    cache = slots(max_loras=1, max_cpu_loras=4)
    cache.prepare({"a"})
    cache.prepare({"b"})
    assert (0.01, ("b", "a"), ("a",)) == (
        cache.prepare({"a"}),
        cache.stats().cpu,
        cache.stats().active,
    )


def test_max_cpu_loras_defaults_to_max_loras_and_is_never_below_it() -> None:
    """vLLM's LoRAConfig: no --max-cpu-loras means max_loras; a smaller one is refused."""
    assert 3 == slots(max_loras=3).max_cpu_loras
    with pytest.raises(ValueError, match=r"max_cpu_loras \(1\) must be >= max_loras \(2\)"):
        slots(max_loras=2, max_cpu_loras=1)


def test_a_runtime_load_reads_and_activates_and_an_unload_drops_it() -> None:
    """`add` is the load route's work (read + slot), `remove` forgets it everywhere."""
    cache = slots()
    assert 1.01 == cache.add("a")
    assert 0.0 == cache.add("a")
    cache.remove("a")
    assert ((), ()) == (cache.stats().cpu, cache.stats().active)


def test_a_batch_takes_a_new_adapter_only_while_it_mixes_fewer_than_max_loras() -> None:
    """Base-model requests and the batch's own adapters always fit; a new one only below the
    limit."""
    cache = slots(max_loras=2)
    assert [True, True, True, False] == [
        cache.fits({"a", "b"}, None),
        cache.fits({"a", "b"}, "a"),
        cache.fits({"a"}, "b"),
        cache.fits({"a", "b"}, "c"),
    ]


def spec(request_id: str, adapter: str | None, output_len: int = 3) -> SequenceSpec:
    return SequenceSpec(
        request_id=request_id,
        prompt_len=4,
        block_hashes=(),
        output_len=output_len,
        adapter=adapter,
    )


def test_a_request_for_one_adapter_too_many_waits_while_the_queue_behind_it_goes_on() -> None:
    """With one slot, a waiting request for a second adapter is skipped; a base-model request
    behind it is admitted, and the skipped one runs once the first adapter's request is done."""
    model = PerfModel(
        max_num_seqs=8,
        kv_cache_tokens=1024,
        step_seconds=0.01,
        decode_seconds_per_seq=0.0,
        prefill_seconds_per_token=0.0,
    )
    core = BatchCore(model, adapters=AdapterSlots(max_loras=1, max_cpu_loras=2, costs=COSTS))
    for request in (spec("a1", "a"), spec("b1", "b"), spec("base", None)):
        core.submit(request, 0.0)
    first = core.schedule(0.0)
    assert first is not None
    assert (["a1", "base"], 1.01) == (
        [rid for rid, _ in first.chunks],
        pytest.approx(first.adapter_seconds),
    )
    assert pytest.approx(0.01 + 1.01) == first.duration
    now = first.duration
    core.complete(first, now)
    admitted: list[str] = []
    while core.has_work():
        plan = core.schedule(now)
        assert plan is not None
        admitted += [rid for rid, _ in plan.chunks if rid not in admitted]
        now += plan.duration
        core.complete(plan, now)
    assert ["a1", "base", "b1"] == admitted


def test_a_core_without_adapter_slots_admits_strictly_in_order() -> None:
    """No --enable-lora: the queue is first in, first out, as before."""
    core = BatchCore(PerfModel(max_num_seqs=2, kv_cache_tokens=1024))
    for request in (spec("x", None), spec("y", None), spec("z", None)):
        core.submit(request, 0.0)
    plan = core.schedule(0.0)
    assert plan is not None
    assert ["x", "y"] == [rid for rid, _ in plan.chunks]


def test_the_lora_cost_knobs_default_to_their_stated_values_and_take_flags_and_env() -> None:
    """0.5 s to read, 0.002 s to swap (lora_slots.py says why); the flag wins over the env."""
    base = ["--flavor", "vllm", "--model", "m", "--enable-lora"]
    defaults = parse_engine_args(base, env={})
    env = {"CARAVAN_SIM_LORA_LOAD_SECONDS": "2", "CARAVAN_SIM_LORA_SWAP_SECONDS": "0.1"}
    from_env = parse_engine_args(base, env=env)
    from_flag = parse_engine_args([*base, "--sim-lora-load-seconds", "3"], env=env)
    assert [(0.5, 0.002), (2.0, 0.1), (3.0, 0.1)] == [
        (s.lora_costs.load_seconds, s.lora_costs.swap_seconds)
        for s in (defaults, from_env, from_flag)
    ]
    with pytest.raises(FlagError, match="--sim-lora-load-seconds"):
        parse_engine_args([*base, "--sim-lora-load-seconds", "-1"], env={})
    with pytest.raises(FlagError, match="--sim-lora-state-dir"):
        parse_engine_args([*base, "--sim-lora-state-dir", "/nowhere/at/all"], env={})


async def completion_s(http: aiohttp.ClientSession, base: str, model: str) -> float:
    started = time.monotonic()
    body = {"model": model, "prompt": "hello there", "max_tokens": 2}
    status, _ = await post_json(http, f"{base}/v1/completions", body)
    assert 200 == status
    return time.monotonic() - started


async def test_a_load_takes_the_read_time_and_an_adapter_pushed_out_is_read_again(
    sim_engine: StartEngine, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    """The load route answers after the read time; with one CPU slot, a request for the
    adapter loaded first waits for it to be read again; the state file counts the reads."""
    state = tmp_path / "state"
    state.mkdir()
    engine = await sim_engine(
        "vllm",
        "--model",
        "base",
        "--enable-lora",
        "--max-loras",
        "1",
        "--max-lora-rank",
        "8",
        "--sim-lora-load-seconds",
        "0.3",
        "--sim-lora-state-dir",
        str(state),
        env=RUNTIME,
    )
    started = time.monotonic()
    assert 200 == (await load(http, engine.base_url, "a", make_adapter(tmp_path / "a")))[0]
    assert time.monotonic() - started >= 0.3
    assert 200 == (await load(http, engine.base_url, "b", make_adapter(tmp_path / "b")))[0]
    assert await completion_s(http, engine.base_url, "a") >= 0.3
    document = json.loads(next(state.glob("*.json")).read_text())
    assert (3, 2, 1, 1) == (
        document["disk_loads"],
        document["max_registered"],
        document["max_active"],
        document["max_loras"],
    )
