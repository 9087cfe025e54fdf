"""The simulated engines' batch core: admission, steps, KV cache, prefix cache, preemption."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from caravan_llm.devcluster.engine.batch import (
    BatchCore,
    BlockPool,
    Finished,
    FirstToken,
    PerfModel,
    RequestTooLargeError,
    SequenceSpec,
    prompt_block_hashes,
)


def make_model(**overrides: object) -> PerfModel:
    values: dict[str, object] = {
        "max_num_seqs": 4,
        "kv_cache_tokens": 4096,
        "block_size": 16,
        "max_batched_tokens": 8192,
        "step_seconds": 0.01,
        "decode_seconds_per_seq": 0.0,
        "prefill_seconds_per_token": 0.0,
        "prefix_caching": True,
    }
    values.update(overrides)
    return PerfModel(**values)  # type: ignore[arg-type]


def make_spec(
    request_id: str, *, prompt: list[str] | None = None, prompt_len: int = 8, output_len: int = 4
) -> SequenceSpec:
    tokens = prompt if prompt is not None else [f"{request_id}-{i}" for i in range(prompt_len)]
    return SequenceSpec(
        request_id=request_id,
        prompt_len=len(tokens),
        block_hashes=prompt_block_hashes(tokens, 16),
        output_len=output_len,
    )


@dataclass
class Run:
    """What driving the core in virtual time produced."""

    emitted: dict[str, int] = field(default_factory=dict)
    first: dict[str, FirstToken] = field(default_factory=dict)
    finished: dict[str, Finished] = field(default_factory=dict)
    max_running: int = 0
    steps: int = 0
    end: float = 0.0


def drive(core: BatchCore, *, now: float = 0.0, max_steps: int = 100_000) -> Run:
    """Step the core with a virtual clock until it has no work."""
    run = Run()
    while core.has_work() and run.steps < max_steps:
        plan = core.schedule(now)
        assert plan is not None, "work remains but nothing could be scheduled"
        now += plan.duration
        outcome = core.complete(plan, now)
        run.steps += 1
        run.max_running = max(run.max_running, core.stats().running)
        for request_id in outcome.emitted:
            run.emitted[request_id] = run.emitted.get(request_id, 0) + 1
        run.first.update({f.request_id: f for f in outcome.first_tokens})
        run.finished.update({f.request_id: f for f in outcome.finished})
    run.end = now
    return run


def test_one_request_prefills_then_decodes_one_token_per_step() -> None:
    """A request gets its first token after the prefill step and one more token per step."""
    core = BatchCore(make_model())
    core.submit(make_spec("a", output_len=5), now=0.0)

    run = drive(core)

    assert {"a": 5} == run.emitted
    assert 5 == run.steps
    assert pytest.approx(0.01) == run.first["a"].ttft_seconds
    assert pytest.approx(0.05) == run.finished["a"].e2e_seconds


def test_step_duration_grows_with_batch_and_prefill_tokens() -> None:
    """A step costs its fixed part, plus per decoding sequence, plus per prefill token."""
    model = make_model(
        step_seconds=0.01, decode_seconds_per_seq=0.002, prefill_seconds_per_token=1e-4
    )

    assert pytest.approx(0.01 + 3 * 0.002 + 100 * 1e-4) == model.step_duration(
        prefill_tokens=100, decode_seqs=3
    )


def test_running_is_capped_and_the_rest_waits_in_fifo_order() -> None:
    """Beyond max_num_seqs requests wait, and they are admitted first come first served."""
    core = BatchCore(make_model(max_num_seqs=2))
    for name in "abcde":
        core.submit(make_spec(name, output_len=3), now=0.0)

    plan = core.schedule(0.0)

    assert plan is not None
    assert ["a", "b"] == [request_id for request_id, _ in plan.chunks]
    assert (2, 3) == (core.stats().running, core.stats().waiting)
    run = drive(core)
    assert 2 == run.max_running
    order = sorted(run.finished, key=lambda r: run.finished[r].e2e_seconds)
    assert ["a", "b", "c", "d", "e"] == order


def tokens_per_second(concurrency: int, max_num_seqs: int) -> float:
    core = BatchCore(make_model(max_num_seqs=max_num_seqs, step_seconds=0.01))
    for i in range(concurrency):
        core.submit(make_spec(f"r{i}", output_len=50), now=0.0)
    run = drive(core)
    return sum(run.emitted.values()) / run.end


def test_throughput_grows_with_concurrency_until_max_num_seqs_then_saturates() -> None:
    """Tokens per second scale with concurrency up to max_num_seqs and no further."""
    below = [tokens_per_second(n, max_num_seqs=8) for n in (1, 2, 4, 8)]
    beyond = [tokens_per_second(n, max_num_seqs=8) for n in (16, 32)]

    assert below == sorted(below)
    assert pytest.approx(8.0, rel=0.05) == below[-1] / below[0]
    for value in beyond:
        assert pytest.approx(below[-1], rel=0.05) == value


def test_decode_slows_down_as_the_batch_grows() -> None:
    """With a per-sequence decode cost, a bigger batch makes each token slower."""
    model = make_model(max_num_seqs=16, decode_seconds_per_seq=0.001)
    single = BatchCore(model)
    single.submit(make_spec("solo", output_len=20), now=0.0)
    crowded = BatchCore(model)
    for i in range(16):
        crowded.submit(make_spec(f"r{i}", output_len=20), now=0.0)

    solo_e2e = drive(single).finished["solo"].e2e_seconds
    crowded_e2e = drive(crowded).finished["r0"].e2e_seconds

    assert crowded_e2e > 1.5 * solo_e2e


def test_a_shared_prefix_is_served_from_the_cache_and_cuts_time_to_first_token() -> None:
    """A second request with the same long prompt prefix skips its prefill."""
    core = BatchCore(make_model(prefill_seconds_per_token=1e-4))
    shared = [f"sys{i}" for i in range(512)]
    core.submit(make_spec("first", prompt=[*shared, "q1"]), now=0.0)
    first_run = drive(core)
    core.submit(make_spec("second", prompt=[*shared, "q2"]), now=first_run.end)
    second_run = drive(core, now=first_run.end)

    assert 0 == first_run.first["first"].cached_tokens
    assert 512 == second_run.first["second"].cached_tokens
    assert second_run.first["second"].ttft_seconds < first_run.first["first"].ttft_seconds / 3
    assert 513 * 2 == core.stats().prefix_queries_tokens
    assert 512 == core.stats().prefix_hits_tokens


def test_without_prefix_caching_nothing_is_reused() -> None:
    """With prefix caching off a repeated prompt is prefilled again."""
    core = BatchCore(make_model(prefix_caching=False))
    prompt = [f"t{i}" for i in range(64)]
    core.submit(make_spec("a", prompt=prompt), now=0.0)
    drive(core)
    core.submit(make_spec("b", prompt=prompt), now=1.0)

    assert 0 == drive(core, now=1.0).first["b"].cached_tokens


def test_a_fully_cached_prompt_still_computes_its_last_block() -> None:
    """At least one prompt token is computed, so a repeated prompt hits all but a block."""
    core = BatchCore(make_model())
    prompt = [f"t{i}" for i in range(64)]
    core.submit(make_spec("a", prompt=prompt), now=0.0)
    drive(core)
    core.submit(make_spec("b", prompt=prompt), now=1.0)

    assert 48 == drive(core, now=1.0).first["b"].cached_tokens


def test_idle_cached_blocks_are_evicted_least_recently_used_first() -> None:
    """When the KV cache fills, the prefix used longest ago is evicted and the newer kept."""
    # 12 blocks. "older" and "newer" leave 4 cached blocks each; "other" needs 9
    # blocks, so 5 idle ones go: all of "older" and the tail block of "newer".
    core = BatchCore(make_model(kv_cache_tokens=12 * 16))
    older = [f"old{i}" for i in range(64)]
    newer = [f"new{i}" for i in range(64)]
    other = [f"other{i}" for i in range(128)]
    for name, prompt in (("older", older), ("newer", newer), ("other", other)):
        core.submit(make_spec(name, prompt=prompt), now=0.0)
        drive(core)

    core.submit(make_spec("newer-again", prompt=newer), now=1.0)
    core.submit(make_spec("older-again", prompt=older), now=1.0)
    run = drive(core, now=1.0)

    assert 48 == run.first["newer-again"].cached_tokens
    assert 0 == run.first["older-again"].cached_tokens


def test_kv_usage_counts_blocks_held_by_running_sequences() -> None:
    """KV usage is the share of blocks running sequences hold; idle cached ones count as free."""
    core = BatchCore(make_model(kv_cache_tokens=100 * 16))
    core.submit(make_spec("a", prompt_len=160, output_len=4), now=0.0)
    plan = core.schedule(0.0)
    assert plan is not None

    assert pytest.approx(0.10) == core.stats().kv_cache_usage
    drive(core)
    assert 0.0 == core.stats().kv_cache_usage


def test_chunked_prefill_spreads_a_long_prompt_over_several_steps() -> None:
    """A prompt longer than the step's token budget takes several steps to its first token."""
    core = BatchCore(make_model(max_batched_tokens=32))
    core.submit(make_spec("a", prompt_len=100, output_len=1), now=0.0)

    run = drive(core)

    assert 4 == run.steps
    assert pytest.approx(0.04) == run.first["a"].ttft_seconds


def test_a_full_kv_cache_preempts_the_newest_sequence_which_still_completes() -> None:
    """Decoding that needs a missing block preempts the newest sequence, which is redone."""
    # 10 blocks; two sequences of 64 + 64 tokens need 8 blocks each at the end.
    core = BatchCore(make_model(kv_cache_tokens=10 * 16, prefix_caching=False))
    core.submit(make_spec("older", prompt_len=64, output_len=64), now=0.0)
    core.submit(make_spec("newer", prompt_len=64, output_len=64), now=0.0)

    run = drive(core)

    assert {"older": 64, "newer": 64} == run.emitted
    assert core.stats().preemptions >= 1
    assert run.finished["older"].e2e_seconds < run.finished["newer"].e2e_seconds


def test_abort_frees_the_slot_and_the_blocks() -> None:
    """An aborted request leaves the batch at once and gives back its KV blocks."""
    core = BatchCore(make_model(max_num_seqs=1))
    core.submit(make_spec("gone", prompt_len=64, output_len=100), now=0.0)
    core.submit(make_spec("next", output_len=2), now=0.0)
    plan = core.schedule(0.0)
    assert plan is not None
    core.complete(plan, 0.01)

    assert core.abort("gone")
    assert (0, 1, 0.0) == (core.stats().running, core.stats().waiting, core.stats().kv_cache_usage)
    assert {"next": 2} == drive(core, now=0.01).emitted
    assert not core.abort("gone")


def test_a_request_that_cannot_fit_the_whole_cache_is_refused() -> None:
    """A request needing more KV blocks than exist is refused at submit."""
    core = BatchCore(make_model(kv_cache_tokens=64))

    with pytest.raises(RequestTooLargeError, match="KV blocks"):
        core.submit(make_spec("big", prompt_len=60, output_len=10), now=0.0)


def test_zero_output_tokens_finish_right_after_prefill() -> None:
    """A request planned to produce nothing (a stop string at once) finishes after its prefill."""
    core = BatchCore(make_model())
    core.submit(make_spec("empty", output_len=0), now=0.0)

    run = drive(core)

    assert ({}, 1) == (run.emitted, run.steps)
    assert 0 == run.finished["empty"].generated


def test_slots_are_reused_lowest_first() -> None:
    """Running requests hold distinct slot ids, and a freed slot is reused first."""
    core = BatchCore(make_model(max_num_seqs=3))
    for name in ("a", "b", "c"):
        core.submit(make_spec(name), now=0.0)
    core.schedule(0.0)
    slots = {name: core.slot_of(name) for name in ("a", "b", "c")}
    core.abort("b")
    core.submit(make_spec("d"), now=0.0)
    core.schedule(0.0)

    assert {"a": 0, "b": 1, "c": 2} == slots
    assert 1 == core.slot_of("d")


def test_block_pool_allocate_evict_and_usage() -> None:
    """The pool hands out free blocks first, then evicts idle cached ones, oldest first."""
    pool = BlockPool(4)
    assert pool.allocate(2)
    assert pool.register(11)
    assert pool.register(22)
    pool.release(11)
    pool.release(22)

    assert (4, 0.0) == (pool.available, pool.usage)
    assert pool.allocate(3)
    assert (0, 1) == (pool.cached_prefix([11]), pool.cached_prefix([22]))
    assert not pool.allocate(2)


def test_invalid_perf_model_values_name_the_field() -> None:
    """A perf model with an impossible value is rejected with the field's name."""
    with pytest.raises(ValueError, match="max_num_seqs"):
        make_model(max_num_seqs=0)
    with pytest.raises(ValueError, match="kv_cache_tokens"):
        make_model(kv_cache_tokens=8)


@settings(max_examples=60, deadline=None)
@given(
    max_num_seqs=st.integers(1, 6),
    kv_blocks=st.integers(12, 40),
    requests=st.lists(
        st.tuples(st.integers(1, 60), st.integers(0, 30), st.integers(0, 3), st.booleans()),
        min_size=1,
        max_size=25,
    ),
)
def test_invariants_hold_under_random_load(
    max_num_seqs: int, kv_blocks: int, requests: list[tuple[int, int, int, bool]]
) -> None:
    """Whatever the load: running never exceeds the cap, usage stays in [0, 1], and every
    request that is not aborted ends with exactly its planned tokens."""
    core = BatchCore(
        make_model(max_num_seqs=max_num_seqs, kv_cache_tokens=kv_blocks * 16, max_batched_tokens=48)
    )
    aborted: set[str] = set()
    expected: dict[str, int] = {}
    generated: dict[str, int] = {}
    now = 0.0
    for index, (prompt_len, output_len, prefix_group, abort) in enumerate(requests):
        prompt = [f"shared{prefix_group}-{i}" for i in range(prompt_len)]
        name = f"r{index}"
        try:
            core.submit(make_spec(name, prompt=prompt, output_len=output_len), now=now)
        except RequestTooLargeError:
            continue
        expected[name] = output_len
        plan = core.schedule(now)
        if plan is not None:
            now += plan.duration
            outcome = core.complete(plan, now)
            generated.update({f.request_id: f.generated for f in outcome.finished})
        if abort and core.abort(name):
            aborted.add(name)
        stats = core.stats()
        assert stats.running <= max_num_seqs
        assert 0.0 <= stats.kv_cache_usage <= 1.0

    run = drive(core, now=now)
    generated.update({name: f.generated for name, f in run.finished.items()})

    assert run.max_running <= max_num_seqs
    assert {n: c for n, c in expected.items() if n not in aborted} == generated
    assert 0.0 == core.stats().kv_cache_usage
    assert not core.has_work()
