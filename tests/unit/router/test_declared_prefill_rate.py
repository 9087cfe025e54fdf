"""A profile's declared prefill rate: its Meta codec, the router's decoding, the cost model's seed.

(Rendering it into the service Meta: tests/unit/scheduler/test_render.py.)
"""

from __future__ import annotations

import dataclasses

import pytest
from router_builders import health_entry, live_for, service_meta, snapshot_of

from caravan_llm.common.contract import (
    PrefillRateError,
    ServiceMetaKey,
    decode_prefill_rate,
    encode_prefill_rate,
)
from caravan_llm.router.core.cost_model import CostConfig, prefill_rate
from caravan_llm.router.core.endpoints import MalformedEntryError, endpoint_from_entry

KEY = ServiceMetaKey.PREFILL_TOKENS_PER_S
COST = CostConfig()


def test_the_codec_round_trips_and_leaves_no_key_when_undeclared() -> None:
    assert encode_prefill_rate(None) == {}
    assert decode_prefill_rate(encode_prefill_rate(5000)) == 5000
    assert decode_prefill_rate({}) is None


@pytest.mark.parametrize("raw", ["", "0", "-5", "5k", "1.5", "٣"])
def test_a_bad_value_names_the_key(raw: str) -> None:
    with pytest.raises(PrefillRateError, match=KEY):
        decode_prefill_rate({KEY: raw})


def test_the_router_reads_it_and_refuses_a_malformed_entry() -> None:
    endpoint = endpoint_from_entry(health_entry(meta=service_meta(**{KEY: "6000"})))
    assert endpoint.prefill_tokens_per_s == 6000
    with pytest.raises(MalformedEntryError, match=KEY):
        endpoint_from_entry(health_entry(meta=service_meta(**{KEY: "fast"})))


def test_the_cost_model_starts_from_it_until_something_is_learned() -> None:
    snapshot = snapshot_of(
        health_entry("e0", meta=service_meta(**{KEY: "6000"})), health_entry("e1")
    )
    live = live_for(snapshot)
    declared, undeclared = (snapshot.by_id[i] for i in ("e0", "e1"))
    assert prefill_rate(declared, live["e0"], COST) == 6000.0
    assert prefill_rate(undeclared, live["e1"], COST) == COST.other_prefill_tokens_per_s
    # What replicas measured wins over what was declared.
    assert prefill_rate(declared, live["e0"], COST, peer_rate=4500.0) == 4500.0
    live["e0"].cost.prefill_rate_tps = 5100.0
    assert prefill_rate(declared, live["e0"], COST, peer_rate=4500.0) == 5100.0
    assert dataclasses.replace(declared, prefill_tokens_per_s=None).prefill_tokens_per_s is None
