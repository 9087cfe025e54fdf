"""The exact prefix index in the decision core: prompt digests, events_cached, the cost model."""

from __future__ import annotations

import dataclasses
import random

from router_builders import MODEL, SERVICE, endpoint_entry, health_entry, live_for, snapshot_of

from caravan_llm.common.block_digest import BlockDigest, DigestKey, block_digests
from caravan_llm.common.kv_stream import KvSnapshot
from caravan_llm.router.core.balancer import (
    BalancerConfig,
    Picked,
    PickerMemory,
    Policy,
    RequestFeatures,
    pick,
)
from caravan_llm.router.core.cost_model import CostConfig, begin_prefill, end_prefill, estimate
from caravan_llm.router.core.endpoints import (
    EndpointSnapshot,
    PlacedAddress,
    snapshot_from_health,
)
from caravan_llm.router.core.kv_index import KvIndex
from caravan_llm.router.core.live_state import Outcome, finish_request, start_request
from caravan_llm.router.core.prefix_index import ShapeConfig, prompt_shape
from caravan_llm.router.core.prompt_digests import (
    MAX_EXACT_TOKENS,
    EventsCached,
    ExactPrompt,
    events_cached,
    exact_prompt,
)

KEY = DigestKey.from_secret("engine-key")
BLOCK = 16
NOW = 100.0
SHAPE = ShapeConfig(block_chars=32, chars_per_token=4.0)
COST = CostConfig(shape=SHAPE, default_kv_cache_tokens=4096)
CONFIG = BalancerConfig(cost=COST)
SYSTEM = "You are a careful assistant. " * 40
# The prompt's token ids as the engine computes them (any ids do for the core).
TOKENS = list(range(1000, 1000 + 320))


def with_kv_ports(snapshot: EndpointSnapshot, port: int = 9000) -> EndpointSnapshot:
    """The snapshot with every endpoint placed with a KV relay."""
    by_id = {eid: dataclasses.replace(e, kv_port=port) for eid, e in snapshot.by_id.items()}
    models = {
        name: dataclasses.replace(entry, endpoints=tuple(by_id[e.id] for e in entry.endpoints))
        for name, entry in snapshot.models.items()
    }
    return dataclasses.replace(snapshot, by_id=by_id, models=models)


def relay_snapshot(digests: tuple[BlockDigest, ...]) -> KvSnapshot:
    return KvSnapshot(epoch=1, seq=1, block_size=BLOCK, digests=frozenset(digests))


def request() -> RequestFeatures:
    payload = {
        "model": MODEL,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}],
    }
    return RequestFeatures(
        model=MODEL,
        prompt=prompt_shape(payload, SHAPE),
        exact=exact_prompt(TOKENS, keys={SERVICE: KEY}, kinds=[(SERVICE, BLOCK)]),
    )


def test_exact_prompt_names_the_blocks_once_per_service_and_block_size() -> None:
    """Digests are computed per (service, block size) whose service has a key, as the relay does."""
    prompt = exact_prompt(
        TOKENS,
        keys={SERVICE: KEY},
        kinds=[(SERVICE, 16), (SERVICE, 16), (SERVICE, 128), ("caravan-other", 16)],
    )
    expected = {
        (SERVICE, 16): block_digests(TOKENS, block_size=16, key=KEY),
        (SERVICE, 128): block_digests(TOKENS, block_size=128, key=KEY),
    }
    assert (len(TOKENS), expected) == (prompt.tokens, dict(prompt.digests))


def test_a_prompt_past_the_cap_is_named_only_up_to_it() -> None:
    """Tokens past MAX_EXACT_TOKENS get no digest (they count as never cached)."""
    tokens = [7] * (MAX_EXACT_TOKENS + 3 * BLOCK)
    prompt = exact_prompt(tokens, keys={SERVICE: KEY}, kinds=[(SERVICE, BLOCK)])
    assert MAX_EXACT_TOKENS // BLOCK == len(prompt.digests[SERVICE, BLOCK])


def test_events_cached_reads_the_live_stream_in_its_block_size_only() -> None:
    """Cached tokens are held blocks x block size while live; None without a live stream."""
    snapshot = with_kv_ports(snapshot_of(endpoint_entry("e0"), endpoint_entry("e1")))
    digests = block_digests(TOKENS, block_size=BLOCK, key=KEY)
    kv = KvIndex(stale_after_s=5.0)
    kv.apply_snapshot("e0", relay_snapshot(digests[:7]), NOW)
    exact = request().exact
    assert exact is not None
    e0, e1 = snapshot.by_id["e0"], snapshot.by_id["e1"]
    other_size = ExactPrompt(tokens=len(TOKENS), digests={(SERVICE, 32): digests})
    no_relay = dataclasses.replace(e0, kv_port=None)

    assert EventsCached(tokens=7 * BLOCK, of=len(TOKENS)) == events_cached(kv, e0, exact, NOW)
    assert events_cached(kv, e1, exact, NOW) is None  # no stream
    assert events_cached(kv, e0, exact, NOW + 6.0) is None  # stale
    assert events_cached(kv, e0, other_size, NOW) is None
    assert events_cached(kv, no_relay, exact, NOW) is None
    assert events_cached(kv, e0, None, NOW) is None


def test_exact_counts_beat_an_approximate_index_that_missed_an_eviction() -> None:
    """The router sent the prompt to e0, whose engine evicted it since, while another router's
    traffic cached it on e1: the approximate index picks e0, the events pick e1."""
    snapshot = with_kv_ports(snapshot_of(endpoint_entry("e0"), endpoint_entry("e1")))
    live = live_for(snapshot)
    features = request()
    assert features.prompt is not None
    # This router sent the prompt to e0 once: its approximate index believes e0 holds it.
    lease = start_request(live, "e0", CONFIG.breaker, NOW - 10)
    sent = begin_prefill(live, snapshot.by_id["e0"], features.prompt, NOW - 10, COST, max_age_s=5)
    assert sent is not None
    end_prefill(live, sent, NOW - 9, COST, first_token=True)
    finish_request(live, lease, Outcome.SUCCESS, CONFIG.breaker, NOW - 9)
    # The engines' own events: e0 evicted it (nothing left), e1 holds all of it.
    digests = block_digests(TOKENS, block_size=BLOCK, key=KEY)
    kv = KvIndex(stale_after_s=5.0)
    kv.apply_snapshot("e0", relay_snapshot(()), NOW)
    kv.apply_snapshot("e1", relay_snapshot(digests), NOW)

    def chosen(kv_index: KvIndex | None) -> str:
        result = pick(
            snapshot,
            live,
            features,
            Policy.PREDICTED_TTFT,
            NOW,
            config=CONFIG,
            memory=PickerMemory(rng=random.Random(1)),
            kv=kv_index,
        )
        assert isinstance(result, Picked)
        return result.endpoint.id

    assert ("e0", "e1") == (chosen(None), chosen(kv))


def test_the_estimate_says_where_its_cached_prefix_came_from() -> None:
    """With events the cached share is exact (in the model's token unit); without, approximate."""
    snapshot = with_kv_ports(snapshot_of(endpoint_entry("e0")))
    endpoint = snapshot.by_id["e0"]
    live = live_for(snapshot)
    features = request()
    assert features.prompt is not None
    half = EventsCached(tokens=len(TOKENS) // 2, of=len(TOKENS))

    exact = estimate(endpoint, live["e0"], features.prompt, NOW, COST, max_age_s=5, events=half)
    approximate = estimate(endpoint, live["e0"], features.prompt, NOW, COST, max_age_s=5)

    assert ("events", features.prompt.tokens / 2) == (exact.prefix_source, exact.cached_tokens)
    assert ("approximate", 0.0) == (approximate.prefix_source, approximate.cached_tokens)


def test_a_prefill_with_events_queues_only_what_the_engine_lacks_and_still_feeds_the_index() -> (
    None
):
    """begin_prefill follows the events for the uncached work, and records the prompt in the
    approximate index for when the stream is lost."""
    snapshot = with_kv_ports(snapshot_of(endpoint_entry("e0")))
    live = live_for(snapshot)
    features = request()
    assert features.prompt is not None
    start_request(live, "e0", CONFIG.breaker, NOW)
    everything = EventsCached(tokens=len(TOKENS), of=len(TOKENS))

    prefill = begin_prefill(
        live, snapshot.by_id["e0"], features.prompt, NOW, COST, max_age_s=5, events=everything
    )

    assert prefill is not None
    assert ("events", 0.0) == (prefill.prefix_source, prefill.uncached_tokens)
    assert len(features.prompt.blocks) == len(live["e0"].cost.prefix)


def test_a_placed_kv_port_reaches_only_the_endpoint_at_the_placed_address() -> None:
    """The snapshot takes the relay's port from the placement, and only for the placed address."""
    entries = {
        SERVICE: [
            health_entry("placed", address="10.0.0.11", port=23456),
            health_entry("moved", address="10.0.0.12", port=23456),
            health_entry("no-relay", address="10.0.0.13", port=23456),
        ]
    }
    placed = {
        "placed": PlacedAddress("10.0.0.11", 23456, kv_port=24000),
        "moved": PlacedAddress("10.0.0.99", 23456, kv_port=24001),
        "no-relay": PlacedAddress("10.0.0.13", 23456),
    }
    snapshot, _ = snapshot_from_health(entries, 1, placed=placed)
    ports = {eid: (e.kv_port, e.kv_url) for eid, e in snapshot.by_id.items()}
    assert {
        "placed": (24000, "http://10.0.0.11:24000"),
        "moved": (None, None),
        "no-relay": (None, None),
    } == ports
