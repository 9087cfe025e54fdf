"""A relay's digest stream, delivered with losses, keeps a router's exact index right.

The relay (kvrelay.state) and the router's index (router.core.kv_index) meet
only through the stream's values here, as they will over HTTP.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from relay_model import BLOCK_SIZE, Batch, batches_st

from caravan_llm.common.block_digest import BlockDigest, DigestKey, block_digests
from caravan_llm.kvrelay.state import RelayState, StoredBlocks
from caravan_llm.router.core.kv_index import KvIndex

KEY = DigestKey.from_secret("engine-key")
REPLICA = "vllm-a"


@settings(max_examples=100, derandomize=True)
@given(batches=batches_st(), deliveries=st.lists(st.booleans(), min_size=30, max_size=30))
def test_the_router_never_holds_a_set_the_relay_did_not_have(
    batches: list[Batch], deliveries: list[bool]
) -> None:
    """Whatever deltas are lost, an in-sync router holds the relay's set at its position.

    And after a heartbeat and the snapshot it then asks for, it holds the relay's current set.
    """
    relay = RelayState(epoch=1, block_size=BLOCK_SIZE, key=KEY)
    index = KvIndex(stale_after_s=60.0)
    history: dict[tuple[int, int], frozenset[BlockDigest]] = {(1, 0): frozenset()}
    index.apply_snapshot(REPLICA, relay.snapshot(), 0.0)
    for step, batch in enumerate(batches):
        delta = relay.apply(batch.seq, batch.events).delta
        position = relay.position
        history[position.epoch, position.seq] = relay.digests()
        if delta is not None and deliveries[step % len(deliveries)]:
            index.apply_delta(REPLICA, delta, float(step))
        in_sync_at = index.position(REPLICA)
        if in_sync_at is not None:
            assert history[in_sync_at] == _router_set(index, history[in_sync_at])
    index.heartbeat(REPLICA, relay.position, 100.0)
    if index.needs_snapshot(REPLICA):
        index.apply_snapshot(REPLICA, relay.snapshot(), 100.0)
    assert "live" == index.state(REPLICA, 100.0)
    assert relay.digests() == _router_set(index, relay.digests())


def _router_set(index: KvIndex, candidates: frozenset[BlockDigest]) -> frozenset[BlockDigest]:
    """The candidates the index says the replica holds (each as a one-block chain)."""
    assert index.digest_count(REPLICA) == len(candidates)
    return frozenset(
        digest
        for digest in candidates
        if index.cached_blocks(REPLICA, (digest,), block_size=BLOCK_SIZE, now=0.0) == 1
    )


def test_a_prompt_cached_on_the_engine_is_found_by_the_router() -> None:
    """The engine stores a prompt's blocks; the router finds the prompt's cached prefix."""
    relay = RelayState(epoch=1, block_size=4, key=KEY)
    index = KvIndex()
    index.apply_snapshot(REPLICA, relay.snapshot(), 0.0)
    system = list(range(1000, 1010))  # two full blocks and a partial one
    engine_prompt = [*system, 7, 7, 8, 8, 9, 9]  # four full blocks
    delta = relay.apply(
        0,
        [
            StoredBlocks(
                block_hashes=[41, 42, 43, 44],
                parent_block_hash=None,
                token_ids=engine_prompt,
                block_size=4,
            )
        ],
    ).delta
    assert delta is not None
    assert "applied" == index.apply_delta(REPLICA, delta, 1.0)
    request = block_digests([*system, 7, 7, 1, 1, 1, 1, 1, 1], block_size=4, key=KEY)
    assert 3 == index.cached_blocks(REPLICA, request, block_size=4, now=1.0)
    assert 0 == index.cached_blocks(
        REPLICA,
        block_digests(engine_prompt, block_size=4, key=DigestKey.from_secret("other")),
        block_size=4,
        now=1.0,
    )
