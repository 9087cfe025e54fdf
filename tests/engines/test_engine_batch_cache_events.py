"""The batch core's prefix-cache events (the simulated vLLM's KV events), driven in virtual time."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from caravan_llm.devcluster.engine.batch import (
    BatchCore,
    BlockEvicted,
    BlocksStored,
    CacheCleared,
    CacheEvent,
    PerfModel,
    SequenceSpec,
    prompt_block_hashes,
)

BS = 4


def make_core(*, blocks: int = 64, record: bool = True, max_num_seqs: int = 4) -> BatchCore:
    model = PerfModel(
        max_num_seqs=max_num_seqs,
        kv_cache_tokens=blocks * BS,
        block_size=BS,
        step_seconds=0.01,
        decode_seconds_per_seq=0.0,
        prefill_seconds_per_token=0.0,
    )
    return BatchCore(model, record_cache_events=record)


def make_spec(request_id: str, tokens: list[int], output_len: int = 1) -> SequenceSpec:
    return SequenceSpec(
        request_id=request_id,
        prompt_len=len(tokens),
        block_hashes=prompt_block_hashes([str(t) for t in tokens], BS),
        output_len=output_len,
        prompt_token_ids=tuple(tokens),
    )


def run(core: BatchCore, *specs: SequenceSpec) -> list[CacheEvent]:
    """Submit the requests together and step until all finish; the events in order."""
    now = 0.0
    for spec in specs:
        core.submit(spec, now)
    events: list[CacheEvent] = []
    while (plan := core.schedule(now)) is not None:
        now += plan.duration
        events += core.complete(plan, now).cache_events
    return events


def test_full_prompt_blocks_are_stored_once_with_their_tokens() -> None:
    """A 10-token prompt stores its 2 full blocks; the same prompt again stores nothing."""
    core = make_core()
    tokens = list(range(100, 110))
    spec = make_spec("a", tokens)
    assert [BlocksStored(spec.block_hashes, None, tuple(tokens[:8]))] == run(core, spec)
    assert [] == run(core, make_spec("b", tokens))


def test_an_extension_stores_only_its_new_blocks_under_its_parent() -> None:
    """A prompt extending a cached one stores the blocks past it, with the last cached as parent."""
    core = make_core()
    first = make_spec("a", list(range(8)))
    run(core, first)
    longer = make_spec("b", list(range(13)))
    expected = BlocksStored(longer.block_hashes[2:], first.block_hashes[1], tuple(range(8, 12)))
    assert [expected] == run(core, longer)


def test_two_sequences_computing_the_same_block_store_it_once() -> None:
    """Concurrent identical prompts: the second shares the block, and no second store appears."""
    core = make_core()
    tokens = list(range(9))
    events = run(core, make_spec("a", tokens), make_spec("b", tokens))
    stored = [block for e in events if isinstance(e, BlocksStored) for block in e.block_hashes]
    assert 2 == len(stored) == len(set(stored))


def test_a_full_cache_evicts_the_least_recently_used_blocks() -> None:
    """With 4 blocks, a second 2-block prompt and a third evict the first prompt's blocks."""
    core = make_core(blocks=4, max_num_seqs=1)
    a, b, c = (make_spec(n, [i + 10 * k for i in range(8)]) for k, n in enumerate("abc"))
    run(core, a)
    run(core, b)
    events = run(core, c)
    # Tail first, as vLLM frees a finished request's blocks.
    evicted = [e.block_hash for e in events if isinstance(e, BlockEvicted)]
    assert [a.block_hashes[1], a.block_hashes[0]] == evicted
    assert isinstance(events[-1], BlocksStored)


def test_reset_prefix_cache_clears_when_idle_and_refuses_while_blocks_are_held() -> None:
    """A reset with a running request fails; when idle it empties the cache and says so."""
    core = make_core()
    spec = make_spec("a", list(range(8)), output_len=3)
    core.submit(spec, 0.0)
    plan = core.schedule(0.0)
    assert plan is not None
    assert not core.reset_prefix_cache()
    run(core)
    assert core.reset_prefix_cache()
    events = run(core, make_spec("b", list(range(8))))
    assert [CacheCleared, BlocksStored] == [type(e) for e in events]


def test_nothing_is_recorded_unless_asked() -> None:
    """Without record_cache_events the outcomes carry no cache events."""
    core = make_core(blocks=3, record=False)
    events = run(core, make_spec("a", list(range(8)))) + run(core, make_spec("b", [9] * 8))
    assert [] == events


@settings(max_examples=40, deadline=None)
@given(
    prompts=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=20), min_size=1, max_size=12),
    blocks=st.integers(6, 12),
)
def test_the_events_replay_to_what_the_cache_holds(prompts: list[list[int]], blocks: int) -> None:
    """Applying the events gives a set of blocks never larger than the cache, each stored once."""
    core = make_core(blocks=blocks, max_num_seqs=2)
    held: set[int] = set()
    for n, tokens in enumerate(prompts):
        for event in run(core, make_spec(str(n), tokens)):
            match event:
                case BlocksStored():
                    assert not held & set(event.block_hashes)
                    held |= set(event.block_hashes)
                case BlockEvicted():
                    held.remove(event.block_hash)
                case CacheCleared():
                    held.clear()
        assert len(held) <= blocks
