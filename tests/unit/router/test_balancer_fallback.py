"""Prefix affinity's fallback stays within the load bound when it can."""

from __future__ import annotations

import random

from router_builders import MODEL, endpoint_entry, live_for, loaded, snapshot_of

from caravan_llm.router.core.affinity import stable_hash
from caravan_llm.router.core.balancer import (
    BalancerConfig,
    Picked,
    PickerMemory,
    Policy,
    RequestFeatures,
    pick,
)


def test_fallback_prefers_endpoints_within_the_bound_over_the_one_that_reported() -> None:
    """Only one endpoint reports load and it is over the bound: the others take the request.

    The walk skips endpoints whose load is unknown while another reports, and
    skips the reporting one for being over the bound; load-aware then chooses
    among the endpoints within the bound, not the loaded one.
    """
    snapshot = snapshot_of(*(endpoint_entry(f"e{i}", capacity=None) for i in range(3)))
    key = stable_hash("a conversation")
    model = snapshot.for_model(MODEL)
    assert model is not None
    owner = next(model.ring.walk(key))
    live = live_for(snapshot, {owner: loaded(in_flight=6)})

    chosen = set()
    for seed in range(20):
        result = pick(
            snapshot,
            live,
            RequestFeatures(MODEL, key),
            Policy.PREFIX_AFFINITY,
            100.0,
            config=BalancerConfig(),
            memory=PickerMemory(rng=random.Random(seed)),
        )
        assert isinstance(result, Picked)
        chosen.add(result.endpoint.id)

    assert {f"e{i}" for i in range(3)} - {owner} == chosen
